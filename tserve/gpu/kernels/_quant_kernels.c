/* Linear layers over GGUF weights (tserve/gpu/forward/_quant.py).
 *
 * y[M, N] = x[M, K] W^T, W one row per output feature in one of GGML's
 * formats (codes are GGML's type ids). Every weight byte is read once per
 * call whatever M is: a few hundred bytes of W stay in L1 while tiles of up
 * to TILE_ROWS rows of x (INT8_TILE_ROWS for the AVX2 Q4/Q5 panels, which
 * take a block in halves; panel_tile's for the AVX-512 VNNI panels, which have
 * 32 registers) run over them in turn, CHUNK_ROWS rows of x at a time.
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
 * int8 panels an AVX-512 VNNI one too (from PAIR_MIN_ROWS rows of x two
 * adjacent panels at a time in 512-bit registers, else and for a last odd
 * panel one in 256-bit ones: bitwise the same outputs) and the block formats'
 * fp32 products an AVX-512 one; the caller
 * picks by `isa`
 * (tserve_quant_isa() says the best this CPU runs; a kernel without a variant
 * for it runs the next one down).
 * Output rows are split among OpenMP threads: torch's own runtime (the same
 * libgomp), so torch.set_num_threads sets the count and its threads are
 * the ones used; products too small to share run on the caller alone.
 */
#include "_kernels.h"
#include "_quant_common.h"
#include "_panel_common.h"
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

/* One block of 32: q = round(x / d) with d = max|x| / 127, s = d sum q, and sum q
 * itself at `isum` unless NULL. */
static void quantize_block_portable(const float *xb, int8_t *qb, float *d, float *s,
                                    int32_t *isum) {
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
    if (isum) *isum = sum;
}

#if defined(__x86_64__)

/* The same numbers as quantize_block_portable (one multiply, round half to even). */
AVX2 static void quantize_block_avx2(const float *xb, int8_t *qb, float *d, float *s,
                                     int32_t *isum) {
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
    if (isum) *isum = _mm_cvtsi128_si32(t);
}
#endif

/* x [m, k] (k a multiple of 32) -> q [m, k] int8, d and s [m, k / 32], and the
 * blocks' integer sums [m, k / 32] at `isum` unless NULL. */
void tserve_quantize_q8(int isa, const float *x, int64_t m, int64_t k, int8_t *q, float *d,
                        float *s, int32_t *isum) {
    int64_t blocks = m * (k / BLOCK);
    for (int64_t i = 0; i < blocks; i++) {
        int32_t *sum = isum ? isum + i : 0;
#if defined(__x86_64__)
        if (isa >= ISA_AVX2) {
            quantize_block_avx2(x + i * BLOCK, q + i * BLOCK, d + i, s + i, sum);
            continue;
        }
#endif
        quantize_block_portable(x + i * BLOCK, q + i * BLOCK, d + i, s + i, sum);
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
 *   Q8_0: 8 fp16 scales, then the quants;
 *   Q4_0: 8 fp16 scales, then the quants;
 *   Q4_1: 8 fp16 scales, 8 fp16 offsets, then the quants;
 *   Q5_0, Q5_1: as Q4_0, Q4_1, then the fifth bits, 4 bytes a row.
 * Scales and offsets are in row order. The quants (each row's 16
 * nibble bytes, or Q8_0's 32 int8) lie in groups of 4 bytes: group g is bytes
 * 4g..4g+3 of rows 0..7, one after another, so that one 32-byte load holds a
 * group of every row, a row per 32-bit lane. Against 4 bytes of x broadcast
 * to every lane, an integer multiply-add leaves each row's sum in its own
 * lane: no reduction across lanes per block, and the sums come out in row
 * order. A Q5 row's 32 fifth bits lie where its nibbles do: byte j of the
 * row (of 4) holds in bits 2g and 2g + 1 the fifth bits of the bytes that
 * group g's lane j meets, elements 4g + j (low nibble) and 16 + 4g + j (high),
 * so that one shift and mask puts a group's bits over its nibbles. The same
 * bits as the file's rows, rearranged. */

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

/* Where a packed block's quants start (after the scales, and the offsets if any). */
static int64_t panel_quants_at(int fmt) { return has_min(fmt) ? 32 : 16; }

/* A row's 32 fifth bits (the file's `qh`, bit e for element e) as its 4 packed bytes. */
static void pack_fifth_bits(uint32_t qh, uint8_t *out) {
    memset(out, 0, GROUP);
    for (int e = 0; e < BLOCK; e++)
        out[fifth_byte(e)] |= (uint8_t)(((qh >> e) & 1) << fifth_shift(e));
}

/* The file's `qh` of a row from its 4 packed bytes. */
static uint32_t unpack_fifth_bits(const uint8_t *in) {
    uint32_t qh = 0;
    for (int e = 0; e < BLOCK; e++) qh |= (uint32_t)((in[fifth_byte(e)] >> fifth_shift(e)) & 1) << e;
    return qh;
}

/* Bytes of W [n, k] in the packed layout (0: no packed layout for fmt). */
int64_t tserve_packed_bytes(int fmt, int64_t n, int64_t k) {
    if (TSERVE_IS_KQUANT(fmt)) return tserve_kpacked_bytes(fmt, n, k);
    return (n + PANEL - 1) / PANEL * (k / BLOCK) * panel_block_bytes(fmt);
}

/* W [n, k] (the file's rows) -> out [tserve_packed_bytes]. */
void tserve_pack(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (TSERVE_IS_KQUANT(fmt)) {
        tserve_kpack(fmt, w, n, k, out);
        return;
    }
    int64_t nb = k / BLOCK, unit = unit_bytes(fmt), stride = row_bytes(fmt, k);
    int64_t pb = panel_block_bytes(fmt), panels = (n + PANEL - 1) / PANEL;
    int64_t quants = panel_quants_at(fmt), width = fmt == Q8_0 ? 32 : 16;
    memset(out, 0, (size_t)(panels * nb * pb));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (p * nb + b) * pb;
            for (int i = 0; i < PANEL && p * PANEL + i < n; i++) {
                const uint8_t *blk = w + (p * PANEL + i) * stride + b * unit;
                memcpy(dst + 2 * i, blk, 2);
                if (has_min(fmt)) memcpy(dst + 16 + 2 * i, blk + 2, 2);
                for (int j = 0; j < width; j += GROUP)
                    memcpy(dst + quants + panel_quant_at(i, j), blk + unit - width + j, GROUP);
                if (is_q5(fmt)) {
                    uint32_t qh;
                    memcpy(&qh, blk + unit - 20, sizeof qh);
                    pack_fifth_bits(qh, dst + quants + PANEL * 16 + GROUP * i);
                }
            }
        }
}

/* One block of packed row `i` of its panel back in the file's block layout. */
static void file_block(int fmt, const uint8_t *src, int i, uint8_t *blk) {
    int64_t unit = unit_bytes(fmt), width = fmt == Q8_0 ? 32 : 16, quants = panel_quants_at(fmt);
    memcpy(blk, src + 2 * i, 2);
    if (has_min(fmt)) memcpy(blk + 2, src + 16 + 2 * i, 2);
    for (int j = 0; j < width; j += GROUP)
        memcpy(blk + unit - width + j, src + quants + panel_quant_at(i, j), GROUP);
    if (is_q5(fmt)) {
        uint32_t qh = unpack_fifth_bits(src + quants + PANEL * 16 + GROUP * i);
        memcpy(blk + unit - 20, &qh, sizeof qh);
    }
}

/* Rows `rows` (or 0..n_rows-1 when NULL) of a packed W [*, k] as fp32 into out [n_rows, k]
 * (`isa`: the K-quants' decoder; the block formats' rows are gguf's either way). */
void tserve_unpack(int isa, int fmt, const uint8_t *packed, int64_t k, const int64_t *rows,
                   int64_t n_rows, float *out) {
    if (TSERVE_IS_KQUANT(fmt)) {
        tserve_kunpack(isa, fmt, packed, k, rows, n_rows, out);
        return;
    }
    (void)isa;
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
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *src = panel + b * pb, *qs = src + quants;
                const int8_t *xb = x + r * k + b * BLOCK;
                float dw = half_to_float(load_u16(src + 2 * c)), dx = xd[r * nb + b];
                int32_t dot = 0;
                if (fmt == Q8_0) {
                    for (int j = 0; j < BLOCK; j++) dot += (int8_t)qs[panel_quant_at(c, j)] * xb[j];
                    total += dw * dx * (float)dot;
                    continue;
                }
                uint32_t qh = 0;
                if (is_q5(fmt)) qh = unpack_fifth_bits(qs + PANEL * 16 + GROUP * c);
                for (int j = 0; j < BLOCK / 2; j++) {
                    uint8_t byte = qs[panel_quant_at(c, j)];
                    dot += ((byte & 0x0f) | fifth_bit(qh, j)) * xb[j] +
                           ((byte >> 4) | fifth_bit(qh, j + BLOCK / 2)) * xb[j + BLOCK / 2];
                }
                float mw = has_min(fmt) ? half_to_float(load_u16(src + 16 + 2 * c))
                                        : -zero_point(fmt) * dw;
                total += dw * dx * (float)dot + mw * xs[r * nb + b];
            }
            y[r * y_stride + c] = total;
        }
}

typedef void (*row_fn)(const uint8_t *, int64_t, int, const float *, float *, int64_t);
/* An int8 panel kernel: (panel, twin, next, k, rows, x, xd, xs, y, y_stride, cols).
 * A 512-bit one takes a pair of panels, the second `twin` bytes after the first,
 * and `cols` of 16 outputs; the others one panel (twin unused), `cols` of 8.
 * `next`: what its pass asks memory for (prefetch_panels). `xs`: per block of x,
 * what the kernel needs of its sums (x_sums_of): the scaled sums (float) for
 * Q4_1's and Q5_1's offsets, the integer sums times minus a zero point (int32)
 * for Q4_0 (8), Q5_0 (16) and VNNI's Q8_0 (128, q8_vnni_256), nothing for AVX2's
 * Q8_0. */
typedef void (*panel_fn)(const uint8_t *, int64_t, int64_t, int64_t, int, const int8_t *,
                         const float *, const void *, float *, int64_t, int);

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

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel block's scales and offsets (Q4_1's and Q5_1's m,
 * Q4_0's -8 d, Q5_0's -16 d), in row order, at W bits a vector. */
#define Q4_SCALES(W, TARGET)                                                                  \
    TARGET INLINE __m##W q4_scales_##W(int fmt, const uint8_t *src, int64_t twin,            \
                                        __m##W *offsets) {                                    \
        __m##W dw = halves_##W(src, twin);                                                    \
        *offsets = has_min(fmt) ? halves_##W(src + 16, twin)                                  \
                                : _mm##W##_mul_ps(dw, _mm##W##_set1_ps(-zero_point(fmt)));    \
        return dw;                                                                            \
    }

/* Half h of a Q4/Q5 panel block's quants as 32 bytes per group and panel, a row per
 * 32-bit lane: q[g] elements 16h + 4g..16h + 4g + 3 of each row (h = 0 the low
 * nibbles, 1 the high ones); Q5: each with its fifth bit (the packed fifth bits
 * after the quants, a row per lane as loaded, merged by OR_MASKED_<ISA>).
 * q4_groups_<ISA>: both halves, lo and hi. */
#define Q4_GROUPS(W, TARGET, ISA)                                                             \
    TARGET INLINE void q4_half_##ISA(int fmt, const uint8_t *quants, int64_t twin, int h,     \
                                     __m##W##i q[4]) {                                        \
        const __m##W##i low = _mm##W##_set1_epi8(0x0f);                                       \
        for (int g = 0; g < 4; g++) {                                                         \
            __m##W##i v = bytes_##W(quants + GROUP_BYTES * g, twin);                          \
            q[g] = _mm##W##_and_si##W(h ? _mm##W##_srli_epi16(v, 4) : v, low);                \
        }                                                                                     \
        if (!is_q5(fmt)) return;                                                              \
        __m##W##i bits = bytes_##W(quants + PANEL * 16, twin);                                \
        const __m##W##i fifth = _mm##W##_set1_epi8(0x10);                                     \
        for (int g = 0; g < 4; g++)                                                           \
            q[g] = OR_MASKED_##ISA(q[g], FIFTH_TO_4(W, bits, 2 * g + h), fifth);              \
    }                                                                                         \
    TARGET INLINE void q4_groups_##ISA(int fmt, const uint8_t *quants, int64_t twin,         \
                                       __m##W##i lo[4], __m##W##i hi[4]) {                    \
        q4_half_##ISA(fmt, quants, twin, 0, lo);                                              \
        q4_half_##ISA(fmt, quants, twin, 1, hi);                                              \
    }

Q4_SCALES(256, AVX2)
Q4_GROUPS(256, AVX2, avx2_256)

/* The offsets' term of x row r's block b (Q4_1's and Q5_1's m times the
 * block's sum of x), at W bits a vector: up to two rows into an accumulator of
 * its own, so that a row's two multiply-adds per block do not wait on each
 * other; from three rows on into the products' (the tile has enough chains,
 * and its accumulators stay in registers). Q4_0's and Q5_0's offsets are in
 * the integer sums (x_bias): nothing here. */
#define OFFSET_TERM(W, r)                                                                     \
    do {                                                                                      \
        if (!has_min(fmt)) break;                                                             \
        __m##W x_sum = _mm##W##_set1_ps(x_sums[(r) * nb + b]);                                \
        if (rows <= 2)                                                                        \
            acc_m[r] = _mm##W##_fmadd_ps(mw, x_sum, acc_m[r]);                                \
        else                                                                                  \
            acc[r] = _mm##W##_fmadd_ps(mw, x_sum, acc[r]);                                    \
    } while (0)

/* sum += v (int32 lanes), as written: GCC otherwise regroups a row's eight additions
 * into a tree and keeps every product on the stack. */
#define ADD_EPI32_IN_PLACE(sum, v) __asm__("vpaddd %1, %0, %0" : "+x"(sum) : "x"(v))

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel against `rows` int8 rows of x, each block in two
 * halves of 16 elements, so that AVX2's 16 registers hold a half's four groups and
 * a tile of INT8_TILE_ROWS rows' block sums (a whole block's eight groups left room
 * for tiles of 4, each unpacking the quants again). Per half: four 32-byte loads
 * hold the eight W rows' nibbles (q4_half_avx2_256); each group meets its 4 bytes of x
 * broadcast to every lane (maddubs), and the four int16 sums add up (each at most
 * 2 * 31 * 127). A madd with ones widens a row's sums into its block sum: Q4's
 * eight once (they fit 16 bits), Q5's each half. The same integer sums and float
 * steps as tiles of 4 (OFFSET_TERM aside, which depends on the tile's rows). On
 * Zen 4, Q5_0 4,096 x 640 at 16 / 64 rows: 0.589-0.607 / 2.36-2.38 ms in tiles of
 * 4, 0.562-0.565 / 2.19-2.21 ms here; Q4_0 and Q4_1 within 3 %. */
AVX2 INLINE void panel_q4_avx2(int fmt, const uint8_t *panel, int64_t next, int64_t k,
                               int rows, const int8_t *x, const float *xd, const void *xs,
                               float *y, int64_t y_stride, int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt), quants = panel_quants_at(fmt);
    const float *x_sums = xs;   /* Q4_1, Q5_1 */
    const int32_t *x_bias = xs; /* Q4_0, Q5_0 */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[INT8_TILE_ROWS], acc_m[INT8_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_panels(src, b * pb, pb, 0, next);
        __m256i sums[INT8_TILE_ROWS];
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q4_half_avx2_256(fmt, src + quants, 0, h, q);
            for (int r = 0; r < rows; r++) {
                const int8_t *xh = x + r * k + b * BLOCK + 16 * h;
                __m256i part = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], broadcast4(xh)),
                                                _mm256_maddubs_epi16(q[1], broadcast4(xh + 4)));
                part = _mm256_add_epi16(part, _mm256_maddubs_epi16(q[2], broadcast4(xh + 8)));
                part = _mm256_add_epi16(part, _mm256_maddubs_epi16(q[3], broadcast4(xh + 12)));
                if (!is_q5(fmt)) /* eight Q4 sums fit 16 bits: one madd a block */
                    sums[r] = h ? _mm256_madd_epi16(_mm256_add_epi16(sums[r], part), ones) : part;
                else if (h == 0)
                    sums[r] = _mm256_madd_epi16(part, ones);
                else
                    ADD_EPI32_IN_PLACE(sums[r], _mm256_madd_epi16(part, ones));
                if (h && !has_min(fmt))
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_set1_epi32(x_bias[r * nb + b]));
            }
        }
        __m256 mw, dw = q4_scales_256(fmt, src, 0, &mw);
        for (int r = 0; r < rows; r++) {
            __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
            OFFSET_TERM(256, r);
        }
    }
    for (int r = 0; r < rows; r++)
        store_panel(_mm256_add_ps(acc[r], acc_m[r]), y + r * y_stride, cols);
}

/* Rows of x in a tile of panel_q8_avx2: its two sums a row for 6 rows, a group's two
 * widened W halves and x's broadcast take 15 of AVX2's 16 registers (the float sums
 * meet memory once a block). Each group's W widens once per tile, so more rows a
 * tile mean fewer widenings a product; 8 rows spill the sums. On Zen 4 capped at
 * AVX2, a Q8_0 weight 65,536 x 640 at 6 / 12 / 16 / 64 rows took 3.70-3.79 /
 * 7.41-7.42 / 9.95-10.0 / 39.8-40.1 ms in tiles of 6 against 4.39-4.42 / 7.88-7.91
 * / 10.4-10.4 / 40.9-41.1 in tiles of 4 (8: 10.4 ms at 16 rows); the Gemma head
 * 262,144 x 640 at 16 rows 39.7-39.8 against 41.7-42.1 ms. */
#define Q8_AVX2_TILE_ROWS 6
_Static_assert(Q8_AVX2_TILE_ROWS == 6, "BY_SIX_ROWS dispatches tiles of 1..6 rows");

/* A Q8_0 panel against `rows` rows of x widened to int16 (the caller's copy,
 * tserve_qlinear_int8), in 16-bit multiply-adds. AVX2's byte multiply-add takes
 * one unsigned operand, so signed w would meet x in three operations a group of 4
 * bytes, all on the multiplying ports (the sign moved onto x, maddubs, a madd with
 * ones to widen each pair sum at once); here a group of each W row widens once per
 * tile (two vpmovsxbw: rows 0-3 and 4-7, a row per two lanes) and meets each x
 * row's 4 values in two madds. Per block, a row's two lanes add up in one hadd,
 * leaving rows in lane order 0 1 4 5 2 3 6 7: the scales are permuted alike once
 * per tile, the sums back at the store (two blends, a shuffle and an add in its
 * place measured the same). The integer sums and float steps are the
 * sign trick's: every output is bitwise the same. On Zen 4 (whose byte and word
 * multiply-adds share two ports with the sign) the Gemma head, 262,144 x 640, at
 * 16 rows took 43.7-45.6 ms against 46.6-51.2. A block's first group's products
 * start its sums: 14 additions a block and row, not 16 (each addition takes a slot
 * of the multiplying ports now and then; 65,536 x 640 at 16 / 64 rows 60 /
 * 58-61 GMAC/s before, 60-64 / 62-63 after). */
AVX2 INLINE void panel_q8_avx2(const uint8_t *panel, int64_t next, int64_t k, int rows,
                               const int8_t *x, const float *xd, float *y, int64_t y_stride,
                               int cols) {
    const int64_t nb = k / BLOCK, pb = panel_block_bytes(Q8_0);
    const int16_t *x16 = (const int16_t *)x;
    __m256 acc[Q8_AVX2_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = panel + b * pb;
        prefetch_panels(src, b * pb, pb, 0, next);
        __m256i low[Q8_AVX2_TILE_ROWS], high[Q8_AVX2_TILE_ROWS];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m128i *w = (const __m128i *)(src + 16 + GROUP_BYTES * g);
            __m256i w_low = _mm256_cvtepi8_epi16(_mm_loadu_si128(w));
            __m256i w_high = _mm256_cvtepi8_epi16(_mm_loadu_si128(w + 1));
            for (int r = 0; r < rows; r++) {
                int64_t four;
                memcpy(&four, x16 + r * k + b * BLOCK + GROUP * g, sizeof four);
                __m256i xg = _mm256_set1_epi64x(four);
                if (g == 0) { /* the first group's products start the sums */
                    low[r] = _mm256_madd_epi16(w_low, xg);
                    high[r] = _mm256_madd_epi16(w_high, xg);
                    continue;
                }
                ADD_EPI32_IN_PLACE(low[r], _mm256_madd_epi16(w_low, xg));
                ADD_EPI32_IN_PLACE(high[r], _mm256_madd_epi16(w_high, xg));
            }
        }
        __m256 dw = _mm256_castpd_ps(_mm256_permute4x64_pd(
            _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src))), 0xD8));
        for (int r = 0; r < rows; r++) {
            __m256i sums = _mm256_hadd_epi32(low[r], high[r]);
            __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        store_panel(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(acc[r]), 0xD8)),
                    y + r * y_stride, cols);
}

/* panel_<SUFFIX>_<FMT>: the int8 panel kernel of one format and instruction set
 * (panel_q8_<SUFFIX> or panel_q4_<SUFFIX>), the format and the tile's row count
 * constants in each instance. */
#define PANEL_TILE(SUFFIX, R)                                                                 \
    (FORMAT == Q8_0 ? panel_q8_##SUFFIX(panel, next, k, R, x, xd, y, y_stride, cols)          \
                    : panel_q4_##SUFFIX(FORMAT, panel, next, k, R, x, xd, xs, y, y_stride, cols))

#define PANEL_KERNEL(TARGET, SUFFIX, FMT, BY_ROWS)                                            \
    TARGET static void panel_##SUFFIX##_##FMT(const uint8_t *panel, int64_t twin,             \
                                              int64_t next, int64_t k, int rows,              \
                                              const int8_t *x, const float *xd,               \
                                              const void *xs, float *y, int64_t y_stride,     \
                                              int cols) {                                     \
        enum { FORMAT = FMT };                                                                \
        (void)xs, (void)twin;                                                                 \
        BY_ROWS(rows, SUFFIX##_PANEL_TILE)                                                    \
    }

#define avx2_PANEL_TILE(R) PANEL_TILE(avx2, R)
PANEL_KERNEL(AVX2, avx2, Q4_0, BY_INT8_TILE_ROWS)
PANEL_KERNEL(AVX2, avx2, Q4_1, BY_INT8_TILE_ROWS)
PANEL_KERNEL(AVX2, avx2, Q5_0, BY_INT8_TILE_ROWS)
PANEL_KERNEL(AVX2, avx2, Q5_1, BY_INT8_TILE_ROWS)
PANEL_KERNEL(AVX2, avx2, Q8_0, BY_SIX_ROWS)

/* ------------------------------------------------------------------ AVX-512 VNNI
 *
 * The packed panels of the block formats with vpdpbusd (u8 x s8, four
 * products summed into each int32): the AVX2 kernels' loop, each maddubs and
 * madd pair one instruction, the sums in four independent chains, and tiles
 * of panel_tile's rows of x (the quants unpacked once per tile). The same
 * products as the AVX2 kernels', exact in integers. Each kernel is written
 * once and built at two widths: 256-bit registers take one panel, 512-bit
 * ones a pair (two adjacent panels, 16 rows of W), so that every unpacking,
 * vpdpbusd and float step serves 16 outputs. Each lane sees the same integer
 * sums and float operations in the same order at either width: every output
 * is bitwise the same. */

Q4_SCALES(512, AVX512)
Q4_GROUPS(256, AVX512, vnni_256)
Q4_GROUPS(512, AVX512, vnni_512)

/* A Q4_0/Q4_1/Q5_0/Q5_1 panel (or pair) against `rows` int8 rows of x
 * (panel_q4_avx2's layout and scales). */
#define Q4_VNNI(W)                                                                            \
    AVX512 INLINE void q4_vnni_##W(int fmt, const uint8_t *panel, int64_t twin, int64_t next, \
                                   int64_t k, int rows, const int8_t *x, const float *xd,     \
                                   const void *xs, float *y, int64_t y_stride, int cols) {    \
        const int64_t nb = k / BLOCK, pb = panel_block_bytes(fmt);                            \
        const float *x_sums = xs;   /* Q4_1, Q5_1 */                                          \
        const int32_t *x_bias = xs; /* Q4_0, Q5_0: starts the first chain */                  \
        const int64_t quants = panel_quants_at(fmt);                                          \
        __m##W acc[PANEL_TILE_ROWS], acc_m[PANEL_TILE_ROWS];                                  \
        for (int r = 0; r < rows; r++) acc[r] = acc_m[r] = _mm##W##_setzero_ps();             \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const uint8_t *src = panel + b * pb;                                              \
            prefetch_panels(src, b * pb, pb, twin, next);                                     \
            __m##W mw, dw = q4_scales_##W(fmt, src, twin, &mw);                               \
            __m##W##i lo[4], hi[4];                                                           \
            q4_groups_vnni_##W(fmt, src + quants, twin, lo, hi);                              \
            for (int r = 0; r < rows; r++) {                                                  \
                const int8_t *xb = x + r * k + b * BLOCK;                                     \
                __m##W##i d[4];                                                               \
                for (int g = 0; g < 2; g++) {                                                 \
                    __m##W##i start = g || has_min(fmt)                                       \
                                          ? _mm##W##_setzero_si##W()                          \
                                          : _mm##W##_set1_epi32(x_bias[r * nb + b]);          \
                    d[g] = dpbusd_x4_##W(start, lo[g], xb + 4 * g);                           \
                    d[2 + g] = dpbusd_x4_##W(_mm##W##_setzero_si##W(), hi[g], xb + 16 + 4 * g); \
                }                                                                             \
                for (int g = 2; g < 4; g++) {                                                 \
                    d[g - 2] = dpbusd_x4_##W(d[g - 2], lo[g], xb + 4 * g);                    \
                    d[g] = dpbusd_x4_##W(d[g], hi[g], xb + 16 + 4 * g);                       \
                }                                                                             \
                __m##W##i sums = _mm##W##_add_epi32(_mm##W##_add_epi32(d[0], d[1]),           \
                                                    _mm##W##_add_epi32(d[2], d[3]));          \
                __m##W scale = _mm##W##_mul_ps(dw, _mm##W##_set1_ps(xd[r * nb + b]));         \
                acc[r] = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(sums), scale, acc[r]);        \
                OFFSET_TERM(W, r);                                                            \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < rows; r++)                                                        \
            store_##W(_mm##W##_add_ps(acc[r], acc_m[r]), y + r * y_stride, cols);             \
    }

/* A Q8_0 panel (or pair) against `rows` rows of x as quantized, signed. vpdpbusd
 * takes one operand unsigned: w + 128 (w with its sign bit flipped, once per block
 * and tile), so that x, the signed one, is read straight from memory broadcast to
 * every lane in the multiply-add itself. sum (w + 128) x - 128 sum x = sum w x,
 * exact in int32; the caller gives -128 sum x per block (`x_bias`), which starts
 * the first chain. Per x row and block: 8 vpdpbusd and 6 other vector operations. */
#define Q8_VNNI(W)                                                                            \
    AVX512 INLINE void q8_vnni_##W(const uint8_t *panel, int64_t twin, int64_t next,          \
                                   int64_t k, int rows, const int8_t *x, const float *xd,     \
                                   const int32_t *x_bias, float *y, int64_t y_stride,         \
                                   int cols) {                                                \
        const int64_t nb = k / BLOCK, pb = panel_block_bytes(Q8_0);                           \
        const __m##W##i sign = _mm##W##_set1_epi8((char)0x80);                                \
        __m##W acc[PANEL_TILE_ROWS];                                                          \
        for (int r = 0; r < rows; r++) acc[r] = _mm##W##_setzero_ps();                        \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const uint8_t *src = panel + b * pb;                                              \
            prefetch_panels(src, b * pb, pb, twin, next);                                     \
            __m##W dw = halves_##W(src, twin);                                                \
            __m##W##i w[8];                                                                   \
            for (int g = 0; g < 8; g++)                                                       \
                w[g] = _mm##W##_xor_si##W(bytes_##W(src + 16 + 32 * g, twin), sign);          \
            for (int r = 0; r < rows; r++) {                                                  \
                const int8_t *xb = x + r * k + b * BLOCK;                                     \
                __m##W##i d[4];                                                               \
                d[0] = _mm##W##_set1_epi32(x_bias[r * nb + b]);                               \
                for (int g = 1; g < 4; g++) d[g] = _mm##W##_setzero_si##W();                  \
                for (int g = 0; g < 8; g++) d[g % 4] = dpbusd_x4_##W(d[g % 4], w[g], xb + 4 * g); \
                __m##W##i sums = _mm##W##_add_epi32(_mm##W##_add_epi32(d[0], d[1]),           \
                                                    _mm##W##_add_epi32(d[2], d[3]));          \
                __m##W scale = _mm##W##_mul_ps(dw, _mm##W##_set1_ps(xd[r * nb + b]));         \
                acc[r] = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(sums), scale, acc[r]);        \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < rows; r++) store_##W(acc[r], y + r * y_stride, cols);             \
    }

Q4_VNNI(256)
Q4_VNNI(512)
Q8_VNNI(256)
Q8_VNNI(512)

/* vnni<W>_<FMT>: the kernel of one format and width (a panel_fn), the tile's row
 * count a constant in each instance. */
#define VNNI_TILE(W, R)                                                                       \
    (FORMAT == Q8_0 ? q8_vnni_##W(panel, twin, next, k, R, x, xd, xs, y, y_stride, cols)      \
                    : q4_vnni_##W(FORMAT, panel, twin, next, k, R, x, xd, xs, y, y_stride, cols))
#define VNNI_TILE_256(R) VNNI_TILE(256, R)
#define VNNI_TILE_512(R) VNNI_TILE(512, R)

#define VNNI_KERNEL(W, FMT, BY_ROWS)                                                          \
    AVX512 static void vnni##W##_##FMT(const uint8_t *panel, int64_t twin, int64_t next,      \
                                       int64_t k, int rows, const int8_t *x, const float *xd, \
                                       const void *xs, float *y, int64_t y_stride,            \
                                       int cols) {                                            \
        enum { FORMAT = FMT };                                                                \
        (void)xs;                                                                             \
        BY_ROWS(rows, VNNI_TILE_##W)                                                          \
    }

VNNI_KERNEL(256, Q4_0, BY_PANEL_TILE_ROWS)
VNNI_KERNEL(256, Q4_1, BY_PANEL_TILE_ROWS)
VNNI_KERNEL(256, Q5_0, BY_PANEL_TILE_ROWS)
VNNI_KERNEL(256, Q5_1, BY_PANEL_TILE_ROWS)
VNNI_KERNEL(256, Q8_0, BY_PANEL_TILE_ROWS)
VNNI_KERNEL(512, Q4_0, BY_INT8_TILE_ROWS)
VNNI_KERNEL(512, Q4_1, BY_INT8_TILE_ROWS)
VNNI_KERNEL(512, Q5_0, BY_INT8_TILE_ROWS)
VNNI_KERNEL(512, Q5_1, BY_INT8_TILE_ROWS)
VNNI_KERNEL(512, Q8_0, BY_INT8_TILE_ROWS)

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
        case Q4_0: return vnni256_Q4_0;
        case Q4_1: return vnni256_Q4_1;
        case Q5_0: return vnni256_Q5_0;
        case Q5_1: return vnni256_Q5_1;
        case Q8_0: return vnni256_Q8_0;
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

/* The pair kernel `isa` runs for `fmt` (NULL: none; panels go one at a time). */
static panel_fn fast_pair(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512_VNNI) switch (fmt) {
        case Q4_0: return vnni512_Q4_0;
        case Q4_1: return vnni512_Q4_1;
        case Q5_0: return vnni512_Q5_0;
        case Q5_1: return vnni512_Q5_1;
        case Q8_0: return vnni512_Q8_0;
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

/* What the fast int8 kernels of `fmt` take of x's sums besides xs: x_bias, each
 * block's integer sum times this (0: nothing). A zero point's offset, -zp d sum x
 * for Q4_0 and Q5_0, is exact in the integer sums; VNNI's Q8_0 takes w + 128
 * against x and subtracts 128 sum x likewise. Q4_1's and Q5_1's m is a float:
 * their offsets stay in xs. */
static int32_t x_sums_of(int fmt, int wide) {
    if (fmt == Q4_0 || fmt == Q5_0) return -(int32_t)zero_point(fmt);
    return fmt == Q8_0 && wide ? -128 : 0;
}

/* A product's kernels and activations, for block_tile. */
typedef struct {
    int fmt;
    int64_t n, k, nb;
    panel_fn fast, pair;      /* one panel, two (NULL: portable; none) */
    const int8_t *xq, *xin;   /* x rounded; as the fast kernels take it */
    int64_t x_stride;         /* bytes per row of xin */
    const float *xd, *xs;     /* per block: scales, scaled sums */
    const int32_t *x_bias;    /* per block: x_sums_of's integer sums (else NULL) */
} block_sweep;

/* A tile_fn: a panel (or pair) against rows r.. of x. */
static void block_tile(const void *sweep, const uint8_t *panel, int64_t twin, int64_t next,
                       int64_t r, int rows, float *y, int cols) {
    const block_sweep *s = sweep;
    panel_fn run = twin ? s->pair : s->fast;
    const float *dr = s->xd + r * s->nb, *sr = s->xs + r * s->nb;
    const void *sums = s->x_bias ? (const void *)(s->x_bias + r * s->nb) : (const void *)sr;
    if (run)
        run(panel, twin, next, s->k, rows, s->xin + r * s->x_stride, dr, sums, y, s->n, cols);
    else
        panel_portable(s->fmt, panel, s->k, rows, s->xq + r * s->k, dr, sr, y, s->n, cols);
}

/* y[M, n] = x W^T for W [n, k] packed by tserve_pack and fp32 x [M, k], quantized here
 * per block of 32 (tserve_quantize_q8) into a scratch copy. Returns 0, or -1 when the
 * scratch cannot be allocated (y untouched). */
int tserve_qlinear_int8(int isa, int fmt, const uint8_t *packed, int64_t n, int64_t k,
                        const float *x, int64_t m, float *y) {
    if (TSERVE_IS_KQUANT(fmt)) return tserve_kqlinear_int8(isa, fmt, packed, n, k, x, m, y);
    int64_t nb = k / BLOCK;
    panel_fn fast = fast_panel(isa, fmt);
    int wide = fast && isa == ISA_AVX512_VNNI; /* 32 registers: tiles of INT8_TILE_ROWS */
    int32_t bias_scale = fast ? x_sums_of(fmt, wide) : 0; /* the kernels' x_bias, if any */
    int int16_x = fast && !wide && fmt == Q8_0; /* panel_q8_avx2 takes x widened */
    /* 512-bit registers: two panels at a time, from PAIR_MIN_ROWS rows of x */
    panel_fn pair = m >= PAIR_MIN_ROWS ? fast_pair(isa, fmt) : 0;
    int64_t x_bytes = int16_x ? 2 : 0; /* per value of the kernels' copy */
    /* xd, xs and x_bias per block, 4 bytes each; xq; the copy */
    int64_t per_block = bias_scale ? 3 : 2;
    float *scales = malloc((size_t)(per_block * m * nb) * sizeof(float) +
                           (size_t)(m * k) * (1 + x_bytes));
    if (!scales) return -1;
    float *xd = scales, *xs = scales + m * nb;
    int32_t *x_bias = bias_scale ? (int32_t *)(scales + 2 * m * nb) : 0;
    int8_t *xq = (int8_t *)(scales + per_block * m * nb), *xin = x_bytes ? xq + m * k : xq;
    int64_t x_stride = k * (x_bytes ? x_bytes : 1);
    block_sweep sweep = {fmt, n, k, nb, fast, pair, xq, xin, x_stride, xd, xs, x_bias};
    /* rows of x a tile: VNNI's panel_tile; AVX2's Q8_0 6 (two sums a row), Q4/Q5 8 (half
     * blocks); the portable panel any */
    int64_t tile = wide ? panel_tile(m) : int16_x ? Q8_AVX2_TILE_ROWS : INT8_TILE_ROWS;
    int threads = threads_for(n * nb * m);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            int32_t *bias = x_bias ? x_bias + r * nb : 0; /* the sums, then scaled */
            tserve_quantize_q8(isa, x + r * k, 1, k, xq + r * k, xd + r * nb, xs + r * nb, bias);
            for (int64_t b = 0; bias && b < nb; b++) bias[b] *= bias_scale;
            if (int16_x)
                for (int64_t j = 0; j < k; j++) {
                    int16_t wide_value = xq[r * k + j];
                    memcpy(xin + 2 * (r * k + j), &wide_value, sizeof wide_value);
                }
        }
        sweep_panels(packed, n, m, nb * panel_block_bytes(fmt), pair ? 2 : 1, tile, y,
                     block_tile, &sweep);
    }
    free(scales);
    return 0;
}
