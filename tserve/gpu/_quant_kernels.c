/* Linear layers over GGUF weights as they lie in the file (tserve/gpu/_quant.py).
 *
 * y[M, N] = x[M, K] W^T with W stored row by row (one output feature per
 * row) in one of GGML's formats. Every row of W is read once per call
 * whatever M is: a W row (a few hundred bytes) stays in L1 while tiles of up
 * to TILE_ROWS rows of x run over it in turn.
 *
 * Activations are fp32 against weights dequantized in registers (block
 * formats Q8_0, Q4_0, Q4_1: blocks of 32 along K, each widened once per tile of
 * x rows; F16, BF16: widened as loaded): the products are fp32 ones, equal to
 * dequantize-then-matmul up to summation order. Block formats can instead
 * take activations quantized to 8 bits per block of 32 (tserve_quantize_q8:
 * scale d = max|x| / 127, q = round(x / d), s = d * sum(q)), as llama.cpp
 * does, and multiply 8-bit integers: per block sum(wq * xq) is exact, then
 * scaled by dw * dx (plus the block's offset times s for Q4_0 and Q4_1).
 *
 * Each kernel has a portable C version and an AVX2 + FMA + F16C one; the
 * caller picks by `isa` (tserve_quant_isa() says what this CPU runs).
 * Single-threaded; columns [n0, n1) only, so callers may split N.
 * Format codes are GGML's type ids.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define F32 0
#define F16 1
#define Q4_0 2
#define Q4_1 3
#define Q8_0 8
#define BF16 30
#define BLOCK 32
#define TILE_ROWS 4
#define CHUNK_ROWS 64 /* rows of x kept hot (int8: CHUNK_ROWS * K bytes) per pass over W */

#define ISA_PORTABLE 0
#define ISA_AVX2 1

int tserve_quant_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

/* Bytes of one block (block formats) or one element (float formats). */
static int64_t unit_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case F16: case BF16: return 2;
    default: return 4;
    }
}

static int64_t row_bytes(int fmt, int64_t k) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 ? k / BLOCK * unit_bytes(fmt)
                                                      : k * unit_bytes(fmt);
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f); /* subnormal (or zero): mant * 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* x [m, k] (k a multiple of 32) -> q [m, k] int8, d and s [m, k / 32]. */
void tserve_quantize_q8(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *s) {
    int64_t nb = k / BLOCK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * BLOCK;
            int8_t *qb = q + r * k + b * BLOCK;
            float amax = 0.0f;
            for (int j = 0; j < BLOCK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int j = 0; j < BLOCK; j++) {
                int v = (int)nearbyintf(xb[j] * inverse);
                qb[j] = (int8_t)v;
                sum += v;
            }
            d[r * nb + b] = scale;
            s[r * nb + b] = scale * (float)sum;
        }
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
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * unit_bytes(fmt);
            float *ob = o + b * BLOCK, dw = half_to_float(load_u16(blk));
            if (fmt == Q8_0) {
                for (int j = 0; j < BLOCK; j++) ob[j] = dw * (float)(int8_t)blk[2 + j];
                continue;
            }
            float mw = fmt == Q4_1 ? half_to_float(load_u16(blk + 2)) : -8.0f * dw;
            const uint8_t *qs = blk + (fmt == Q4_1 ? 4 : 2);
            for (int j = 0; j < BLOCK / 2; j++) {
                ob[j] = dw * (float)(qs[j] & 0x0f) + mw;
                ob[j + BLOCK / 2] = dw * (float)(qs[j] >> 4) + mw;
            }
        }
    }
}

/* ------------------------------------------------------------------ portable */

/* One W row (block format) against `rows` fp32 rows of x: each block dequantized once. */
static void row_portable_f32(int fmt, const uint8_t *wrow, int64_t k, int rows, const float *x,
                             float *y, int64_t y_stride) {
    int64_t nb = k / BLOCK;
    float w[BLOCK], total[TILE_ROWS] = {0};
    for (int64_t b = 0; b < nb; b++) {
        tserve_dequantize(fmt, wrow + b * unit_bytes(fmt), BLOCK, 0, 1, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * BLOCK;
            float sum = 0.0f;
            for (int j = 0; j < BLOCK; j++) sum += w[j] * xb[j];
            total[r] += sum;
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = total[r];
}

/* One W row against `rows` rows of x: y[r * y_stride]. */
static void row_portable(int fmt, const uint8_t *wrow, int64_t k, int rows, const void *x,
                         const float *xd, const float *xs, float *y, int64_t y_stride) {
    int64_t nb = k / BLOCK;
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        if (fmt == F16 || fmt == BF16) {
            const float *xr = (const float *)x + r * k;
            for (int64_t j = 0; j < k; j++) {
                uint16_t h = load_u16(wrow + 2 * j);
                total += (fmt == F16 ? half_to_float(h) : bf16_to_float(h)) * xr[j];
            }
            y[r * y_stride] = total;
            continue;
        }
        const int8_t *xr = (const int8_t *)x + r * k;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * unit_bytes(fmt);
            const int8_t *xb = xr + b * BLOCK;
            float dw = half_to_float(load_u16(blk)), dx = xd[r * nb + b];
            int32_t dot = 0;
            if (fmt == Q8_0) {
                for (int j = 0; j < BLOCK; j++) dot += (int8_t)blk[2 + j] * xb[j];
                total += dw * dx * (float)dot;
                continue;
            }
            const uint8_t *qs = blk + (fmt == Q4_1 ? 4 : 2);
            for (int j = 0; j < BLOCK / 2; j++)
                dot += (qs[j] & 0x0f) * xb[j] + (qs[j] >> 4) * xb[j + BLOCK / 2];
            float mw = fmt == Q4_1 ? half_to_float(load_u16(blk + 2)) : -8.0f * dw;
            total += dw * dx * (float)dot + mw * xs[r * nb + b];
        }
        y[r * y_stride] = total;
    }
}

typedef void (*row_fn)(const uint8_t *, int64_t, int, const void *, const float *,
                       const float *, float *, int64_t);

/* ------------------------------------------------------------------ AVX2 */
#if defined(__x86_64__)

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

AVX2 INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 u8: the low nibbles (elements 0..15), then the high (16..31). */
AVX2 INLINE __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    return _mm256_set_m128i(hi, lo);
}

/* sum over 32 int8 pairs of u * s as 8 int32 lanes (u: 0..255, s: -127..127). */
AVX2 INLINE __m256 dot_u8s8(__m256i u, __m256i s) {
    __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

AVX2 INLINE void tile_blocks_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                  const int8_t *x, const float *xd, const float *xs, float *y,
                                  int64_t y_stride) {
    int64_t nb = k / BLOCK, unit = unit_bytes(fmt);
    __m256 acc[TILE_ROWS];
    float extra[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), extra[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * unit;
        float dw = _cvtsh_ss(load_u16(blk));
        if (fmt == Q8_0) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            __m256i magnitude = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rows; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + b * BLOCK));
                __m256 dot = dot_u8s8(magnitude, _mm256_sign_epi8(xv, w));
                acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xd[r * nb + b]), acc[r]);
            }
            continue;
        }
        float mw = fmt == Q4_1 ? _cvtsh_ss(load_u16(blk + 2)) : -8.0f * dw;
        __m256i w = unpack_nibbles(blk + (fmt == Q4_1 ? 4 : 2));
        for (int r = 0; r < rows; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + b * BLOCK));
            __m256 dot = dot_u8s8(w, xv);
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * xd[r * nb + b]), acc[r]);
            extra[r] += mw * xs[r * nb + b];
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = hsum(acc[r]) + extra[r];
}

/* 8 bytes (u8 or s8) -> 8 floats. */
AVX2 INLINE __m256 bytes_to_floats(__m128i v, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
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
    __m256 m = _mm256_set1_ps(fmt == Q4_1 ? _cvtsh_ss(load_u16(blk + 2)) : -8.0f * dw);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (fmt == Q4_1 ? 4 : 2)));
    __m128i low = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
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
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (fmt == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 INLINE void tile_floats_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                  const float *x, float *y, int64_t y_stride) {
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        __m256 w = widen_avx2(fmt, wrow + 2 * j);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * k + j), acc[r]);
    }
    for (int r = 0; r < rows; r++) {
        float total = hsum(acc[r]);
        for (int64_t t = j; t < k; t++) {
            uint16_t h = load_u16(wrow + 2 * t);
            total += (fmt == F16 ? half_to_float(h) : bf16_to_float(h)) * x[r * k + t];
        }
        y[r * y_stride] = total;
    }
}

/* The format as a constant in each instance, so each inner loop is specialised. */
#define AVX2_ROW(FMT)                                                                         \
    AVX2 static void row_avx2_##FMT(const uint8_t *wrow, int64_t k, int rows, const void *x,  \
                                    const float *xd, const float *xs, float *y,               \
                                    int64_t y_stride) {                                       \
        (void)xd, (void)xs;                                                                   \
        switch (rows) {                                                                       \
        case 4: AVX2_TILE(FMT, 4); break;                                                     \
        case 3: AVX2_TILE(FMT, 3); break;                                                     \
        case 2: AVX2_TILE(FMT, 2); break;                                                     \
        default: AVX2_TILE(FMT, 1); break;                                                    \
        }                                                                                     \
    }
#define AVX2_TILE(FMT, R)                                                                     \
    ((FMT) == F16 || (FMT) == BF16                                                            \
         ? tile_floats_avx2(FMT, wrow, k, R, (const float *)x, y, y_stride)                   \
         : tile_blocks_avx2(FMT, wrow, k, R, (const int8_t *)x, xd, xs, y, y_stride))

AVX2_ROW(Q4_0)
AVX2_ROW(Q4_1)
AVX2_ROW(Q8_0)
AVX2_ROW(F16)
AVX2_ROW(BF16)

#define AVX2_ROW_F32(FMT)                                                                    \
    AVX2 static void row_avx2_f32_##FMT(const uint8_t *wrow, int64_t k, int rows,            \
                                        const void *x, const float *xd, const float *xs,     \
                                        float *y, int64_t y_stride) {                        \
        (void)xd, (void)xs;                                                                  \
        const float *xf = (const float *)x;                                                  \
        switch (rows) {                                                                      \
        case 4: tile_blocks_f32_avx2(FMT, wrow, k, 4, xf, y, y_stride); break;               \
        case 3: tile_blocks_f32_avx2(FMT, wrow, k, 3, xf, y, y_stride); break;               \
        case 2: tile_blocks_f32_avx2(FMT, wrow, k, 2, xf, y, y_stride); break;               \
        default: tile_blocks_f32_avx2(FMT, wrow, k, 1, xf, y, y_stride); break;              \
        }                                                                                    \
    }

AVX2_ROW_F32(Q4_0)
AVX2_ROW_F32(Q4_1)
AVX2_ROW_F32(Q8_0)

/* ------------------------------------------------------------------ entry */


static row_fn avx2_row(int fmt, int int8) {
    switch (fmt) {
    case Q4_0: return int8 ? row_avx2_Q4_0 : row_avx2_f32_Q4_0;
    case Q4_1: return int8 ? row_avx2_Q4_1 : row_avx2_f32_Q4_1;
    case Q8_0: return int8 ? row_avx2_Q8_0 : row_avx2_f32_Q8_0;
    case F16: return row_avx2_F16;
    case BF16: return row_avx2_BF16;
    default: return 0;
    }
}
#else
static row_fn avx2_row(int fmt, int int8) {
    (void)fmt, (void)int8;
    return 0;
}
#endif

/* Whether tserve_qlinear runs `fmt`. */
int tserve_quant_format_supported(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q8_0 || fmt == F16 || fmt == BF16;
}

/* y[M, N] (row stride n) columns [n0, n1) = x W^T for W [N, k] in `fmt`. With xd non-NULL
 * (block formats only) x is int8 [M, k] with xd, xs [M, k / 32] from tserve_quantize_q8;
 * else x is fp32 [M, k]. */
void tserve_qlinear(int isa, int fmt, const uint8_t *w, int64_t n, int64_t n0, int64_t n1,
                    int64_t k, const void *x, const float *xd, const float *xs, int64_t m,
                    float *y) {
    int int8 = xd != 0, floats = !int8;
    int64_t stride = row_bytes(fmt, k), nb = k / BLOCK, x_row = floats ? 4 * k : k;
    row_fn fast = isa == ISA_AVX2 ? avx2_row(fmt, int8) : 0;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
        for (int64_t j = n0; j < n1; j++) {
            const uint8_t *wrow = w + j * stride;
            for (int64_t r = m0; r < m1; r += TILE_ROWS) {
                int rows = m1 - r < TILE_ROWS ? (int)(m1 - r) : TILE_ROWS;
                const void *xr = (const char *)x + r * x_row;
                const float *dr = floats ? 0 : xd + r * nb, *sr = floats ? 0 : xs + r * nb;
                if (fast)
                    fast(wrow, k, rows, xr, dr, sr, y + r * n + j, n);
                else if (floats && fmt != F16 && fmt != BF16)
                    row_portable_f32(fmt, wrow, k, rows, (const float *)xr, y + r * n + j, n);
                else
                    row_portable(fmt, wrow, k, rows, xr, dr, sr, y + r * n + j, n);
            }
        }
    }
}
