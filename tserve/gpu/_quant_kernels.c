/* Linear layers over GGUF weights (tserve/gpu/_quant.py).
 *
 * y[M, N] = x[M, K] W^T, W one row per output feature in one of GGML's
 * formats (codes are GGML's type ids). Every weight byte is read once per
 * call whatever M is: a few hundred bytes of W stay in L1 while tiles of up
 * to TILE_ROWS rows of x run over them in turn, CHUNK_ROWS rows of x at a
 * time.
 *
 * Two activation paths:
 *
 * - fp32 (tserve_qlinear): W as the file lays it out, each block of 32
 *   weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) widened to fp32 in registers once
 *   per tile, F16/BF16/F32 as loaded; the products are fp32 ones, equal to
 *   dequantize-then-matmul up to summation order.
 * - int8 (tserve_qlinear_int8), llama.cpp's scheme: x quantized per
 *   block of 32 (tserve_quantize_q8: d = max|x| / 127, q = round(x / d),
 *   s = d * sum(q)), then per block sum(wq * xq) exact in integers, scaled
 *   by dw * dx, plus for Q4_0/Q4_1/Q5_0/Q5_1 the block's offset times s
 *   (Q4_0's -8 dw, Q5_0's -16 dw, Q4_1's and Q5_1's m). W is first
 *   repacked (tserve_pack) into panels of PANEL rows, block by block, so
 *   that one pass of 256-bit integer products serves PANEL outputs and their
 *   scales are one vector load (layout at panel_block_bytes).
 *
 * Each kernel has a portable C version and an AVX2 + FMA + F16C one, the
 * int8 panels an AVX-512 VNNI one too and the block formats' fp32 products
 * an AVX-512 one; the caller picks by `isa`
 * (tserve_quant_isa() says the best this CPU runs; a kernel without a variant
 * for it runs the next one down).
 * Output rows are split among OpenMP threads: torch's own runtime (the same
 * libgomp), so torch.set_num_threads sets the count and its threads are
 * the ones used; products too small to share run on the caller alone.
 */
#include "_kernels.h"
#include "_quant_common.h"
#include <math.h>
#include <stdlib.h>

#define F32 0
#define F16 1
#define Q4_0 2
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define BF16 30
#define BLOCK 32
#define PANEL 8       /* rows of W per panel of the packed layout */

int tserve_quant_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512_VNNI;
    if (avx2) return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

static int is_block_format(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == Q8_0;
}

/* The 4-bit block formats and their 5-bit kin: quants unsigned, w = d * q + offset. */
static int is_q5(int fmt) { return fmt == Q5_0 || fmt == Q5_1; }
static int has_min(int fmt) { return fmt == Q4_1 || fmt == Q5_1; } /* offset: a stored m */
static float zero_point(int fmt) { return is_q5(fmt) ? 16.0f : 8.0f; } /* no m: -zp * d */

/* Where a block's 16 nibble bytes start (Q5's 4 bytes of fifth bits lie just before). */
static int64_t nibbles_at(int fmt) {
    switch (fmt) {
    case Q4_1: return 4;
    case Q5_0: return 6;
    case Q5_1: return 8;
    default: return 2;
    }
}

/* Bytes of one block (block formats) or one element (float formats). */
static int64_t unit_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case F16: case BF16: return 2;
    default: return 4;
    }
}

static int64_t row_bytes(int fmt, int64_t k) {
    return is_block_format(fmt) ? k / BLOCK * unit_bytes(fmt) : k * unit_bytes(fmt);
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Element j of a row of a float format (F16, BF16, F32). */
static float float_at(int fmt, const uint8_t *row, int64_t j) {
    if (fmt == F32) {
        float v;
        memcpy(&v, row + 4 * j, sizeof v);
        return v;
    }
    uint16_t h = load_u16(row + 2 * j);
    return fmt == F16 ? half_to_float(h) : bf16_to_float(h);
}

/* ------------------------------------------------------------------ activations to int8 */

static void quantize_block_portable(const float *xb, int8_t *qb, float *d, float *s) {
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < BLOCK; j++) {
        int v = (int)nearbyintf(xb[j] * inverse);
        qb[j] = (int8_t)v;
        sum += v;
    }
    *d = amax / 127.0f;
    *s = *d * (float)sum;
}

#if defined(__x86_64__)

/* The same numbers as quantize_block_portable (one multiply, round half to even). */
AVX2 static void quantize_block_avx2(const float *xb, int8_t *qb, float *d, float *s) {
    __m256 v[4], sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float top = _mm_cvtss_f32(m), inverse = top > 0.0f ? 127.0f / top : 0.0f;
    __m256 scale = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], scale),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(r);
    }
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    /* packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order */
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                        _mm256_packs_epi32(q[2], q[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qb, packed);
    *d = top / 127.0f;
    *s = *d * (float)_mm_cvtsi128_si32(t);
}
#endif

/* x [m, k] (k a multiple of 32) -> q [m, k] int8, d and s [m, k / 32]. */
void tserve_quantize_q8(int isa, const float *x, int64_t m, int64_t k, int8_t *q, float *d,
                        float *s) {
    int64_t blocks = m * (k / BLOCK);
    for (int64_t i = 0; i < blocks; i++) {
#if defined(__x86_64__)
        if (isa >= ISA_AVX2) {
            quantize_block_avx2(x + i * BLOCK, q + i * BLOCK, d + i, s + i);
            continue;
        }
#endif
        quantize_block_portable(x + i * BLOCK, q + i * BLOCK, d + i, s + i);
    }
}

/* ------------------------------------------------------------------ dequantizing */

/* Q5_0/Q5_1: the fifth bit of element j (of 32) of a block whose bits are `qh`. */
static int fifth_bit(uint32_t qh, int j) { return (int)((qh >> j) & 1) << 4; }

/* One block as 32 fp32 weights, with gguf's (and ggml's) arithmetic: d * q for
 * the symmetric formats (q less its zero point, exact), d * q + m for Q4_1/Q5_1,
 * each a multiply then an add (never fused), so the values are gguf's to the bit. */
static void dequantize_block(int fmt, const uint8_t *blk, float *ob) {
    float dw = half_to_float(load_u16(blk));
    if (fmt == Q8_0) {
        for (int j = 0; j < BLOCK; j++) ob[j] = dw * (float)(int8_t)blk[2 + j];
        return;
    }
    const uint8_t *qs = blk + nibbles_at(fmt);
    uint32_t qh = 0;
    if (is_q5(fmt)) memcpy(&qh, qs - 4, sizeof qh);
    int q[BLOCK];
    for (int j = 0; j < BLOCK / 2; j++) {
        q[j] = (qs[j] & 0x0f) | fifth_bit(qh, j);
        q[j + BLOCK / 2] = (qs[j] >> 4) | fifth_bit(qh, j + BLOCK / 2);
    }
    if (has_min(fmt)) {
        float mw = half_to_float(load_u16(blk + 2));
        for (int j = 0; j < BLOCK; j++) {
            volatile float scaled = dw * (float)q[j]; /* rounded before the add, as gguf's */
            ob[j] = scaled + mw;
        }
        return;
    }
    float zp = zero_point(fmt);
    for (int j = 0; j < BLOCK; j++) ob[j] = dw * ((float)q[j] - zp);
}

/* Rows `rows` (or 0..n_rows-1 when NULL) of W [*, k] as fp32 into out [n_rows, k]. */
void tserve_dequantize(int fmt, const uint8_t *w, int64_t k, const int64_t *rows, int64_t n_rows,
                       float *out) {
    int64_t stride = row_bytes(fmt, k), nb = k / BLOCK;
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * stride;
        float *o = out + i * k;
        if (fmt == F16 || fmt == BF16) {
            for (int64_t j = 0; j < k; j++) {
                uint16_t h = load_u16(row + 2 * j);
                o[j] = fmt == F16 ? half_to_float(h) : bf16_to_float(h);
            }
            continue;
        }
        if (fmt == F32) {
            memcpy(o, row, (size_t)k * sizeof(float));
            continue;
        }
        for (int64_t b = 0; b < nb; b++) dequantize_block(fmt, row + b * unit_bytes(fmt), o + b * BLOCK);
    }
}

/* ------------------------------------------------------------------ the packed layout
 *
 * Panel p holds W rows [PANEL p, PANEL p + PANEL) (rows past N are zeros),
 * block after block along K; one block of a panel is:
 *   Q8_0: 8 fp16 scales (row order), then each row's 32 int8 (row order);
 *   Q4_0: 8 fp16 scales (slot order), then each row's 16 nibble bytes (row order);
 *   Q4_1: 8 fp16 scales, 8 fp16 offsets (slot order), then the 16-byte rows;
 *   Q5_0, Q5_1: as Q4_0, Q4_1, then each row's 4 bytes of fifth bits (row order).
 * Slot order is the order in which the AVX2 kernel's reductions leave the
 * rows' sums (rows 0, 2, 4, 6, 1, 3, 5, 7), so the scales multiply them
 * as they come. The same bytes as the file's rows, rearranged. */

static const int Q4_SLOT[PANEL] = {0, 4, 1, 5, 2, 6, 3, 7}; /* slot of row i */
static const int ROW_ORDER[PANEL] = {0, 1, 2, 3, 4, 5, 6, 7};  /* Q8_0's: slot i is row i */

static int64_t panel_block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 16 + PANEL * 16;
    case Q4_1: return 32 + PANEL * 16;
    case Q5_0: return 16 + PANEL * 20;
    case Q5_1: return 32 + PANEL * 20;
    case Q8_0: return 16 + PANEL * 32;
    default: return 0;
    }
}

static int scale_slot(int fmt, int i) { return fmt == Q8_0 ? i : Q4_SLOT[i]; }

/* Where a packed block's quants start (after the scales, and the offsets if any). */
static int64_t panel_quants_at(int fmt) { return has_min(fmt) ? 32 : 16; }

/* Bytes of W [n, k] in the packed layout (0: no packed layout for fmt). */
int64_t tserve_packed_bytes(int fmt, int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * (k / BLOCK) * panel_block_bytes(fmt);
}

/* W [n, k] (the file's rows) -> out [tserve_packed_bytes]. */
void tserve_pack(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    int64_t nb = k / BLOCK, unit = unit_bytes(fmt), stride = row_bytes(fmt, k);
    int64_t pb = panel_block_bytes(fmt), panels = (n + PANEL - 1) / PANEL;
    int64_t quants = panel_quants_at(fmt), width = fmt == Q8_0 ? 32 : 16;
    memset(out, 0, (size_t)(panels * nb * pb));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * pb;
            for (int i = 0; i < PANEL && p * PANEL + i < n; i++) {
                const uint8_t *blk = w + (p * PANEL + i) * stride + b * unit;
                int slot = scale_slot(fmt, i);
                memcpy(dst + 2 * slot, blk, 2);
                if (has_min(fmt)) memcpy(dst + 16 + 2 * slot, blk + 2, 2);
                memcpy(dst + quants + width * i, blk + unit - width, (size_t)width);
                if (is_q5(fmt)) memcpy(dst + quants + PANEL * 16 + 4 * i, blk + unit - 20, 4);
            }
        }
}

/* One block of packed row `i` of its panel back in the file's block layout. */
static void file_block(int fmt, const uint8_t *src, int i, uint8_t *blk) {
    int64_t unit = unit_bytes(fmt), width = fmt == Q8_0 ? 32 : 16, quants = panel_quants_at(fmt);
    int slot = scale_slot(fmt, i);
    memcpy(blk, src + 2 * slot, 2);
    if (has_min(fmt)) memcpy(blk + 2, src + 16 + 2 * slot, 2);
    memcpy(blk + unit - width, src + quants + width * i, (size_t)width);
    if (is_q5(fmt)) memcpy(blk + unit - 20, src + quants + PANEL * 16 + 4 * i, 4);
}

/* Rows `rows` (or 0..n_rows-1 when NULL) of a packed W [*, k] as fp32 into out [n_rows, k]. */
void tserve_unpack(int fmt, const uint8_t *packed, int64_t k, const int64_t *rows,
                   int64_t n_rows, float *out) {
    int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt);
    uint8_t blk[64];
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t row = rows ? rows[r] : r;
        const uint8_t *panel = packed + row / PANEL * nb * pb;
        for (int64_t b = 0; b < nb; b++) {
            file_block(fmt, panel + b * pb, (int)(row % PANEL), blk);
            dequantize_block(fmt, blk, out + r * k + b * BLOCK);
        }
    }
}

/* ------------------------------------------------------------------ portable kernels */

/* One W row (block format) against `rows` fp32 rows of x: each block dequantized once. */
static void row_portable_f32(int fmt, const uint8_t *wrow, int64_t k, int rows, const float *x,
                             float *y, int64_t y_stride) {
    int64_t nb = k / BLOCK;
    float w[BLOCK], total[TILE_ROWS] = {0};
    for (int64_t b = 0; b < nb; b++) {
        dequantize_block(fmt, wrow + b * unit_bytes(fmt), w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            float sum = 0.0f;
            for (int j = 0; j < BLOCK; j++) sum += w[j] * xb[j];
            total[r] += sum;
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = total[r];
}

/* One F16/BF16/F32 W row against `rows` fp32 rows of x. */
static void row_portable_floats(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                const float *x, float *y, int64_t y_stride) {
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += float_at(fmt, wrow, j) * x[r * k + j];
        y[r * y_stride] = total;
    }
}

/* One packed panel (`cols` real rows of W) against `rows` int8 rows of x. */
static void panel_portable(int fmt, const uint8_t *panel, int64_t k, int rows, const int8_t *x,
                           const float *xd, const float *xs, float *y, int64_t y_stride,
                           int cols) {
    int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt), quants = panel_quants_at(fmt);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float total = 0.0f;
            int slot = scale_slot(fmt, c);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *src = panel + b * pb;
                const int8_t *xb = x + r * k + b * BLOCK;
                float dw = half_to_float(load_u16(src + 2 * slot)), dx = xd[r * nb + b];
                int32_t dot = 0;
                if (fmt == Q8_0) {
                    const int8_t *qs = (const int8_t *)(src + 16 + 32 * c);
                    for (int j = 0; j < BLOCK; j++) dot += qs[j] * xb[j];
                    total += dw * dx * (float)dot;
                    continue;
                }
                const uint8_t *qs = src + quants + 16 * c;
                uint32_t qh = 0;
                if (is_q5(fmt)) memcpy(&qh, src + quants + PANEL * 16 + 4 * c, sizeof qh);
                for (int j = 0; j < BLOCK / 2; j++)
                    dot += ((qs[j] & 0x0f) | fifth_bit(qh, j)) * xb[j] +
                           ((qs[j] >> 4) | fifth_bit(qh, j + BLOCK / 2)) * xb[j + BLOCK / 2];
                float mw = has_min(fmt) ? half_to_float(load_u16(src + 16 + 2 * slot))
                                        : -zero_point(fmt) * dw;
                total += dw * dx * (float)dot + mw * xs[r * nb + b];
            }
            y[r * y_stride + c] = total;
        }
}

typedef void (*row_fn)(const uint8_t *, int64_t, int, const float *, float *, int64_t);
typedef void (*panel_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *,
                         const float *, float *, int64_t, int);

/* ------------------------------------------------------------------ AVX2 */
#if defined(__x86_64__)

/* 8 bytes (u8 or s8) -> 8 floats. */
AVX2 INLINE __m256 bytes_to_floats(__m128i v, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* Bytes whose bit `select` byte holds is set in `spread`'s same byte: 0x10, else 0. */
AVX2 INLINE __m256i bits_to_fifth(__m256i spread) {
    const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Q5's fifth bits of elements 16 h .. 16 h + 15 of a block (bits of `qh`) as
 * 16 bytes, 0x10 where set: byte j of the result is bit 16 h + j. */
AVX2 INLINE __m128i fifth_bits_avx2(uint32_t qh, int h) {
    const int8_t a = (int8_t)(2 * h), b = (int8_t)(2 * h + 1);
    __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)qh),
                                      _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b));
    return _mm256_castsi256_si128(bits_to_fifth(_mm256_castsi128_si256(spread)));
}

/* A block's 32 weights as 4 x 8 floats (dequantized in registers). */
AVX2 INLINE void block_floats_avx2(int fmt, const uint8_t *blk, __m256 w[4]) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
    if (fmt == Q8_0) {
        __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        w[0] = _mm256_mul_ps(bytes_to_floats(q0, 1), d);
        w[1] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(q0, 8), 1), d);
        w[2] = _mm256_mul_ps(bytes_to_floats(q1, 1), d);
        w[3] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(q1, 8), 1), d);
        return;
    }
    float dw = _cvtsh_ss(load_u16(blk));
    __m256 m = _mm256_set1_ps(has_min(fmt) ? _cvtsh_ss(load_u16(blk + 2)) : -zero_point(fmt) * dw);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + nibbles_at(fmt)));
    __m128i low = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    if (is_q5(fmt)) {
        uint32_t qh;
        memcpy(&qh, blk + nibbles_at(fmt) - 4, sizeof qh);
        lo = _mm_or_si128(lo, fifth_bits_avx2(qh, 0));
        hi = _mm_or_si128(hi, fifth_bits_avx2(qh, 1));
    }
    w[0] = _mm256_fmadd_ps(bytes_to_floats(lo, 0), d, m);
    w[1] = _mm256_fmadd_ps(bytes_to_floats(_mm_srli_si128(lo, 8), 0), d, m);
    w[2] = _mm256_fmadd_ps(bytes_to_floats(hi, 0), d, m);
    w[3] = _mm256_fmadd_ps(bytes_to_floats(_mm_srli_si128(hi, 8), 0), d, m);
}

/* One W row (block format) against `rows` fp32 rows: ACC accumulators per row
 * (4 for one row, so the FMAs of a block do not wait on each other). */
AVX2 INLINE void tile_blocks_f32_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                      const float *x, float *y, int64_t y_stride) {
    enum { ACC = 4 };
    int64_t nb = k / BLOCK, unit = unit_bytes(fmt);
    int acc_n = rows == 1 ? 4 : 2;
    __m256 acc[TILE_ROWS][ACC];
    for (int r = 0; r < rows; r++)
        for (int a = 0; a < ACC; a++) acc[r][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        prefetch_ahead(wrow + b * unit, unit);
        block_floats_avx2(fmt, wrow + b * unit, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            for (int i = 0; i < 4; i++)
                acc[r][i % acc_n] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i),
                                                    acc[r][i % acc_n]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 sum = acc[r][0];
        for (int a = 1; a < acc_n; a++) sum = _mm256_add_ps(sum, acc[r][a]);
        y[r * y_stride] = hsum(sum);
    }
}

AVX2 INLINE __m256 widen_avx2(int fmt, const uint8_t *p) {
    if (fmt == F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (fmt == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 INLINE void tile_floats_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                  const float *x, float *y, int64_t y_stride) {
    const int64_t size = fmt == F32 ? 4 : 2;
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        if (j % 32 == 0) prefetch_ahead(wrow + size * j, 32 * size); /* 32 weights' lines */
        __m256 w = widen_avx2(fmt, wrow + size * j);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * k + j), acc[r]);
    }
    for (int r = 0; r < rows; r++) {
        float total = hsum(acc[r]);
        for (int64_t t = j; t < k; t++) total += float_at(fmt, wrow, t) * x[r * k + t];
        y[r * y_stride] = total;
    }
}

#define AVX2_TILE(R)                                                                          \
    (!is_block_format(FORMAT) ? tile_floats_avx2(FORMAT, wrow, k, R, x, y, y_stride)          \
                              : tile_blocks_f32_avx2(FORMAT, wrow, k, R, x, y, y_stride))

/* The format and the tile's row count as constants in each instance, so each inner loop is
 * specialised. */
#define AVX2_ROW(FMT)                                                                         \
    AVX2 static void row_avx2_##FMT(const uint8_t *wrow, int64_t k, int rows, const float *x, \
                                    float *y, int64_t y_stride) {                             \
        enum { FORMAT = FMT };                                                                \
        BY_TILE_ROWS(rows, AVX2_TILE)                                                         \
    }

AVX2_ROW(Q4_0)
AVX2_ROW(Q4_1)
AVX2_ROW(Q5_0)
AVX2_ROW(Q5_1)
AVX2_ROW(Q8_0)
AVX2_ROW(F16)
AVX2_ROW(BF16)
AVX2_ROW(F32)

/* A panel's sums as the scales' slots want them: lanes in slot order. */
AVX2 INLINE void store_panel(__m256 sums, const int *slot, float *y, int cols) {
    float lanes[PANEL];
    _mm256_storeu_ps(lanes, sums);
    for (int c = 0; c < cols; c++) y[c] = lanes[slot[c]];
}

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel block's scales and offsets (Q4_1's and Q5_1's m,
 * Q4_0's -8 d, Q5_0's -16 d), in slot order. */
AVX2 INLINE __m256 q4_scales(int fmt, const uint8_t *src, __m256 *offsets) {
    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    *offsets = has_min(fmt) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 16)))
                            : _mm256_mul_ps(dw, _mm256_set1_ps(-zero_point(fmt)));
    return dw;
}

/* The fifth bits of a Q5 panel block's rows 2p and 2p + 1 (their 8 bytes at
 * `qh`), as panel_q4_avx2 lays out their nibbles: row 2p in the low lane, 2p + 1
 * in the high; *lo for elements 0..15, *hi for 16..31; bytes 0x10 where set. */
AVX2 INLINE void fifth_bits_pair(const uint8_t *qh, __m256i *lo, __m256i *hi) {
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i *)qh));
    *lo = bits_to_fifth(_mm256_shuffle_epi8(
        both, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4,
                               4, 4, 5, 5, 5, 5, 5, 5, 5, 5)));
    *hi = bits_to_fifth(_mm256_shuffle_epi8(
        both, _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6, 6, 6, 6, 6,
                               6, 6, 7, 7, 7, 7, 7, 7, 7, 7)));
}

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel against `rows` int8 rows of x. Per block and pair
 * of W rows: one 32-byte load holds both rows' nibbles; masked, they are
 * elements 0..15 of each (the x block's first half broadcast to both lanes),
 * shifted, elements 16..31 (Q5: each with its fifth bit, 0..31); maddubs, then
 * madd with ones, leave 4 int32 per row; three hadds leave one sum per row, in
 * slot order. */
AVX2 INLINE void panel_q4_avx2(int fmt, const uint8_t *panel, int64_t k, int rows,
                               const int8_t *x, const float *xd, const float *xs, float *y,
                               int64_t y_stride, int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt), quants = panel_quants_at(fmt);
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_ROWS], acc_m[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_ahead(src, pb);
        __m256 mw, dw = q4_scales(fmt, src, &mw);
        __m256i lo[4], hi[4];
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(src + quants + 32 * p));
            lo[p] = _mm256_and_si256(v, low);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (is_q5(fmt)) {
                __m256i high_lo, high_hi;
                fifth_bits_pair(src + quants + PANEL * 16 + 8 * p, &high_lo, &high_hi);
                lo[p] = _mm256_or_si256(lo[p], high_lo);
                hi[p] = _mm256_or_si256(hi[p], high_hi);
            }
        }
        for (int r = 0; r < rows; r++) {
            const int8_t *xb = x + r * k + b * BLOCK;
            __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
            __m256i xz = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
            __m256i s[4];
            for (int p = 0; p < 4; p++) {
                __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xa),
                                                 _mm256_maddubs_epi16(hi[p], xz));
                s[p] = _mm256_madd_epi16(pairs, ones);
            }
            __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                             _mm256_hadd_epi32(s[2], s[3]));
            __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
            acc_m[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), acc_m[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        store_panel(_mm256_add_ps(acc[r], acc_m[r]), Q4_SLOT, y + r * y_stride, cols);
}

/* A Q8_0 panel against `rows` int8 rows of x: per W row, |w| times x with w's sign
 * (maddubs takes one unsigned operand), madd with ones; six hadds and a swap of
 * lanes leave one sum per row, in row order. */
AVX2 INLINE void panel_q8_avx2(const uint8_t *panel, int64_t k, int rows, const int8_t *x,
                               const float *xd, float *y, int64_t y_stride, int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(Q8_0);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_ahead(src, pb);
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
        for (int r = 0; r < rows; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + b * BLOCK));
            __m256i s[PANEL];
            for (int c = 0; c < PANEL; c++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(src + 16 + 32 * c));
                __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                     _mm256_sign_epi8(xv, w));
                s[c] = _mm256_madd_epi16(pairs, ones);
            }
            __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                           _mm256_hadd_epi32(s[2], s[3]));
            __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]),
                                           _mm256_hadd_epi32(s[6], s[7]));
            __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                            _mm256_permute2x128_si256(h0, h1, 0x31));
            __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_panel(acc[r], ROW_ORDER, y + r * y_stride, cols);
}

/* panel_<SUFFIX>_<FMT>: the int8 panel kernel of one format and instruction set
 * (panel_q8_<SUFFIX> or panel_q4_<SUFFIX>), the format and the tile's row count
 * constants in each instance. */
#define PANEL_TILE(SUFFIX, R)                                                                 \
    (FORMAT == Q8_0 ? panel_q8_##SUFFIX(panel, k, R, x, xd, y, y_stride, cols)                \
                    : panel_q4_##SUFFIX(FORMAT, panel, k, R, x, xd, xs, y, y_stride, cols))

#define PANEL_KERNEL(TARGET, SUFFIX, FMT)                                                     \
    TARGET static void panel_##SUFFIX##_##FMT(const uint8_t *panel, int64_t k, int rows,      \
                                              const int8_t *x, const float *xd,               \
                                              const float *xs, float *y, int64_t y_stride,    \
                                              int cols) {                                     \
        enum { FORMAT = FMT };                                                                \
        (void)xs;                                                                             \
        BY_TILE_ROWS(rows, SUFFIX##_PANEL_TILE)                                               \
    }

#define avx2_PANEL_TILE(R) PANEL_TILE(avx2, R)
PANEL_KERNEL(AVX2, avx2, Q4_0)
PANEL_KERNEL(AVX2, avx2, Q4_1)
PANEL_KERNEL(AVX2, avx2, Q5_0)
PANEL_KERNEL(AVX2, avx2, Q5_1)
PANEL_KERNEL(AVX2, avx2, Q8_0)

/* ------------------------------------------------------------------ AVX-512 VNNI
 *
 * The packed panels of the block formats with 512-bit registers: one register
 * holds four W rows' quants of a block, one per 128-bit lane, and vpdpbusd
 * (u8 x s8, four products summed into each int32) leaves four partial sums per
 * row and lane. Those are scaled and summed in fp32 lane by lane, and each
 * lane's four only meet at the end of K: the same products as the AVX2
 * kernels', the sums in another order. */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Eight fp32 values (`index` picks which for each row) spread over the two
 * registers' lanes: rows 0..3 in the first, 4..7 in the second, each value
 * in all four places of its row's lane. */
AVX512 INLINE void spread_rows(__m256 values, const int index[PANEL], __m512 out[2]) {
    __m512 wide = _mm512_castps256_ps512(values);
    for (int p = 0; p < 2; p++) {
        const int *i = index + 4 * p;
        __m512i lanes = _mm512_setr_epi32(i[0], i[0], i[0], i[0], i[1], i[1], i[1], i[1], i[2],
                                          i[2], i[2], i[2], i[3], i[3], i[3], i[3]);
        out[p] = _mm512_permutexvar_ps(lanes, wide);
    }
}

/* The per-row totals of two registers laid out as spread_rows leaves them. */
AVX512 INLINE void row_totals(__m512 first, __m512 second, float out[PANEL]) {
    __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(first, second, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(first, second, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
    float lanes[16];
    _mm512_storeu_ps(lanes, sums); /* lane j: row j, row 4 + j, row j, row 4 + j */
    for (int j = 0; j < 4; j++) {
        out[j] = lanes[4 * j];
        out[4 + j] = lanes[4 * j + 1];
    }
}

/* Bytes whose bit `select` byte holds is set in `all` shuffled by `index`: 0x10, else 0. */
AVX512 INLINE __m512i fifth_bits_of(__m512i all, const int32_t *index) {
    const __m512i select = _mm512_set1_epi64(0x8040201008040201LL);
    __m512i spread = _mm512_shuffle_epi8(all, _mm512_loadu_si512((const void *)index));
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, select), _mm512_set1_epi8(0x10));
}

/* Byte v four times: a 32-bit word of a shuffle's index. */
#define BYTE4(v) ((int32_t)((v) * 0x01010101u))
/* Lane L's index for half h: bytes 0..7 from qh byte 4 L + 2 h, 8..15 from the next. */
#define QUAD_LANE(L, h)                                                                       \
    BYTE4(4 * (L) + 2 * (h)), BYTE4(4 * (L) + 2 * (h)), BYTE4(4 * (L) + 2 * (h) + 1),         \
        BYTE4(4 * (L) + 2 * (h) + 1)
static const int32_t QUAD_INDEX[2][16] = {
    {QUAD_LANE(0, 0), QUAD_LANE(1, 0), QUAD_LANE(2, 0), QUAD_LANE(3, 0)},
    {QUAD_LANE(0, 1), QUAD_LANE(1, 1), QUAD_LANE(2, 1), QUAD_LANE(3, 1)},
};

/* Q5's fifth bits of a panel block's rows 4p .. 4p + 3 (their 16 bytes at `qh`),
 * one row per 128-bit lane as panel_q4_vnni lays out their nibbles: *lo for
 * elements 0..15, *hi for 16..31; bytes 0x10 where set. */
AVX512 INLINE void fifth_bits_quad(const uint8_t *qh, __m512i *lo, __m512i *hi) {
    __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qh));
    *lo = fifth_bits_of(all, QUAD_INDEX[0]);
    *hi = fifth_bits_of(all, QUAD_INDEX[1]);
}

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel against `rows` int8 rows of x: per block, two
 * 64-byte loads hold the eight rows' nibbles; masked, they meet the x block's
 * first half (broadcast to every lane), shifted, its second half (Q5: each
 * with its fifth bit). The offsets' term (Q4_1's and Q5_1's m, Q4_0's -8 d,
 * Q5_0's -16 d) is one fp32 product per row and block, as in AVX2. */
AVX512 INLINE void panel_q4_vnni(int fmt, const uint8_t *panel, int64_t k, int rows,
                                 const int8_t *x, const float *xd, const float *xs, float *y,
                                 int64_t y_stride, int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt), quants = panel_quants_at(fmt);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[TILE_ROWS][2];
    __m256 acc_m[TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        acc_m[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_ahead(src, pb);
        __m256 mw;
        __m512 dw[2];
        spread_rows(q4_scales(fmt, src, &mw), Q4_SLOT, dw);
        __m512i lo[2], hi[2];
        for (int p = 0; p < 2; p++) {
            __m512i v = _mm512_loadu_si512((const void *)(src + quants + 64 * p));
            lo[p] = _mm512_and_si512(v, low);
            hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (is_q5(fmt)) {
                __m512i high_lo, high_hi;
                fifth_bits_quad(src + quants + PANEL * 16 + 16 * p, &high_lo, &high_hi);
                lo[p] = _mm512_or_si512(lo[p], high_lo);
                hi[p] = _mm512_or_si512(hi[p], high_hi);
            }
        }
        for (int r = 0; r < rows; r++) {
            const int8_t *xb = x + r * k + b * BLOCK;
            __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xb));
            __m512i xz = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xb + 16)));
            __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
            for (int p = 0; p < 2; p++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[p], xa);
                dot = _mm512_dpbusd_epi32(dot, hi[p], xz);
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[p], dx),
                                            acc[r][p]);
            }
            acc_m[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), acc_m[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float totals[PANEL], offsets[PANEL];
        row_totals(acc[r][0], acc[r][1], totals);
        _mm256_storeu_ps(offsets, acc_m[r]);
        for (int c = 0; c < cols; c++) y[r * y_stride + c] = totals[c] + offsets[Q4_SLOT[c]];
    }
}

/* A Q8_0 panel against `rows` int8 rows of x. vpdpbusd wants one unsigned
 * operand: x + 128 (its sign bit flipped), each int32 starting from -128 times
 * its four weights' sum (one vpdpbusd per block), so the sums are x . w exactly.
 * A register holds two rows (two lanes each); pairs of registers fold into
 * spread_rows' layout before their scales. */
AVX512 INLINE void panel_q8_vnni(const uint8_t *panel, int64_t k, int rows, const int8_t *x,
                                 const float *xd, float *y, int64_t y_stride, int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(Q8_0);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_ahead(src, pb);
        __m512 dw[2];
        spread_rows(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)), ROW_ORDER, dw);
        __m512i w[4], start[4];
        for (int q = 0; q < 4; q++) {
            w[q] = _mm512_loadu_si512((const void *)(src + 16 + 64 * q));
            __m512i offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, w[q]);
            start[q] = _mm512_sub_epi32(_mm512_setzero_si512(), offset);
        }
        for (int r = 0; r < rows; r++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(x + r * k + b * BLOCK));
            __m512i xv = _mm512_xor_si512(_mm512_broadcast_i64x4(xq), flip);
            __m512i dot[4];
            for (int q = 0; q < 4; q++) dot[q] = _mm512_dpbusd_epi32(start[q], xv, w[q]);
            __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
            for (int p = 0; p < 2; p++) { /* rows 4p..4p+3, one per lane */
                __m512i a = dot[2 * p], c = dot[2 * p + 1];
                __m512i rowwise =
                    _mm512_add_epi32(_mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1)));
                acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rowwise),
                                            _mm512_mul_ps(dw[p], dx), acc[r][p]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float totals[PANEL];
        row_totals(acc[r][0], acc[r][1], totals);
        if (cols == PANEL) /* a whole panel: one store, not a call of memcpy per panel */
            _mm256_storeu_ps(y + r * y_stride, _mm256_loadu_ps(totals));
        else
            for (int c = 0; c < cols; c++) y[r * y_stride + c] = totals[c];
    }
}

#define vnni_PANEL_TILE(R) PANEL_TILE(vnni, R)
PANEL_KERNEL(AVX512, vnni, Q4_0)
PANEL_KERNEL(AVX512, vnni, Q4_1)
PANEL_KERNEL(AVX512, vnni, Q5_0)
PANEL_KERNEL(AVX512, vnni, Q5_1)
PANEL_KERNEL(AVX512, vnni, Q8_0)

/* ------------------------------------------------------------------ AVX-512, fp32 activations
 *
 * The block formats' fp32 products with 512-bit registers: a block's 32
 * weights widen to two registers of 16 floats (bytes straight to int32), and
 * each x row meets them in two FMAs; the same products as the AVX2 kernels',
 * summed in another order. */

/* A block's 32 weights as 2 x 16 floats (dequantized in registers). */
AVX512 INLINE void block_floats_avx512(int fmt, const uint8_t *blk, __m512 w[2]) {
    float dw = _cvtsh_ss(load_u16(blk));
    __m512 d = _mm512_set1_ps(dw);
    if (fmt == Q8_0) {
        for (int h = 0; h < 2; h++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h));
            w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
        return;
    }
    __m512 m = _mm512_set1_ps(has_min(fmt) ? _cvtsh_ss(load_u16(blk + 2)) : -zero_point(fmt) * dw);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + nibbles_at(fmt)));
    __m128i low = _mm_set1_epi8(0x0f);
    __m128i q[2] = {_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low)};
    if (is_q5(fmt)) {
        uint32_t qh;
        memcpy(&qh, blk + nibbles_at(fmt) - 4, sizeof qh);
        q[0] = _mm_or_si128(q[0], fifth_bits_avx2(qh, 0));
        q[1] = _mm_or_si128(q[1], fifth_bits_avx2(qh, 1));
    }
    for (int h = 0; h < 2; h++)
        w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[h])), d, m);
}

/* One W row (block format) against `rows` fp32 rows: two accumulators per row. */
AVX512 INLINE void tile_blocks_f32_avx512(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                          const float *x, float *y, int64_t y_stride) {
    int64_t nb = k / BLOCK, unit = unit_bytes(fmt);
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 w[2];
        prefetch_ahead(wrow + b * unit, unit);
        block_floats_avx512(fmt, wrow + b * unit, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++)
        y[r * y_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

#define AVX512_TILE(R) tile_blocks_f32_avx512(FORMAT, wrow, k, R, x, y, y_stride)

#define AVX512_ROW(FMT)                                                                       \
    AVX512 static void row_avx512_##FMT(const uint8_t *wrow, int64_t k, int rows,             \
                                        const float *x, float *y, int64_t y_stride) {         \
        enum { FORMAT = FMT };                                                                \
        BY_TILE_ROWS(rows, AVX512_TILE)                                                       \
    }

AVX512_ROW(Q4_0)
AVX512_ROW(Q4_1)
AVX512_ROW(Q5_0)
AVX512_ROW(Q5_1)
AVX512_ROW(Q8_0)

#endif

/* The fp32 kernel `isa` runs for `fmt` (NULL: the portable one): AVX-512 for
 * the block formats, AVX2 for the float formats (and below AVX-512). */
static row_fn fast_row(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512_VNNI) switch (fmt) {
        case Q4_0: return row_avx512_Q4_0;
        case Q4_1: return row_avx512_Q4_1;
        case Q5_0: return row_avx512_Q5_0;
        case Q5_1: return row_avx512_Q5_1;
        case Q8_0: return row_avx512_Q8_0;
        }
    if (isa >= ISA_AVX2) switch (fmt) {
        case Q4_0: return row_avx2_Q4_0;
        case Q4_1: return row_avx2_Q4_1;
        case Q5_0: return row_avx2_Q5_0;
        case Q5_1: return row_avx2_Q5_1;
        case Q8_0: return row_avx2_Q8_0;
        case F16: return row_avx2_F16;
        case BF16: return row_avx2_BF16;
        case F32: return row_avx2_F32;
        }
#endif
    (void)isa;
    (void)fmt;
    return 0;
}

/* The int8 panel kernel `isa` runs for `fmt` (NULL: the portable one). */
static panel_fn fast_panel(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512_VNNI) switch (fmt) {
        case Q4_0: return panel_vnni_Q4_0;
        case Q4_1: return panel_vnni_Q4_1;
        case Q5_0: return panel_vnni_Q5_0;
        case Q5_1: return panel_vnni_Q5_1;
        case Q8_0: return panel_vnni_Q8_0;
        }
    if (isa >= ISA_AVX2) switch (fmt) {
        case Q4_0: return panel_avx2_Q4_0;
        case Q4_1: return panel_avx2_Q4_1;
        case Q5_0: return panel_avx2_Q5_0;
        case Q5_1: return panel_avx2_Q5_1;
        case Q8_0: return panel_avx2_Q8_0;
        }
#endif
    (void)isa;
    (void)fmt;
    return 0;
}

/* ------------------------------------------------------------------ entry points */

/* y[M, n] = x W^T for fp32 x [M, k] and W [n, k] in `fmt` (the file's layout). */
void tserve_qlinear(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x,
                    int64_t m, float *y) {
    int64_t stride = row_bytes(fmt, k);
    row_fn fast = fast_row(isa, fmt);
    int threads = threads_for(n * (k / BLOCK) * m);
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
#pragma omp for schedule(dynamic, SHARE_ROWS) nowait /* chunks write apart: no barrier */
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *wrow = w + j * stride;
            for (int64_t r = m0; r < m1; r += TILE_ROWS) {
                int rows = m1 - r < TILE_ROWS ? (int)(m1 - r) : TILE_ROWS;
                const float *xr = x + r * k;
                float *yr = y + r * n + j;
                if (fast)
                    fast(wrow, k, rows, xr, yr, n);
                else if (!is_block_format(fmt))
                    row_portable_floats(fmt, wrow, k, rows, xr, yr, n);
                else
                    row_portable_f32(fmt, wrow, k, rows, xr, yr, n);
            }
        }
    }
}

/* y[M, n] = x W^T for W [n, k] packed by tserve_pack and fp32 x [M, k], quantized here
 * per block of 32 (tserve_quantize_q8) into a scratch copy. Returns 0, or -1 when the
 * scratch cannot be allocated (y untouched). */
int tserve_qlinear_int8(int isa, int fmt, const uint8_t *packed, int64_t n, int64_t k,
                        const float *x, int64_t m, float *y) {
    int64_t nb = k / BLOCK, panels = (n + PANEL - 1) / PANEL;
    int64_t panel_bytes = nb * panel_block_bytes(fmt);
    float *scales = malloc((size_t)(2 * m * nb) * sizeof(float) + (size_t)(m * k));
    if (!scales) return -1;
    float *xd = scales, *xs = scales + m * nb;
    int8_t *xq = (int8_t *)(scales + 2 * m * nb);
    panel_fn fast = fast_panel(isa, fmt);
    int threads = threads_for(n * nb * m);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            tserve_quantize_q8(isa, x + r * k, 1, k, xq + r * k, xd + r * nb, xs + r * nb);
        for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
            int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
#pragma omp for schedule(dynamic, SHARE_ROWS / PANEL) nowait /* chunks write apart */
            for (int64_t p = 0; p < panels; p++) {
                const uint8_t *panel = packed + p * panel_bytes;
                int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
                for (int64_t r = m0; r < m1; r += TILE_ROWS) {
                    int rows = m1 - r < TILE_ROWS ? (int)(m1 - r) : TILE_ROWS;
                    const int8_t *xr = xq + r * k;
                    const float *dr = xd + r * nb, *sr = xs + r * nb;
                    float *yr = y + r * n + p * PANEL;
                    if (fast)
                        fast(panel, k, rows, xr, dr, sr, yr, n, cols);
                    else
                        panel_portable(fmt, panel, k, rows, xr, dr, sr, yr, n, cols);
                }
            }
        }
    }
    free(scales);
    return 0;
}
