/* Linear layers over GGUF's K-quant weights as they lie in the file (tserve/gpu/forward/_quant.py).
 *
 * y[M, N] = x[M, K] W^T with W stored row by row (one output feature per
 * row) in Q4_K, Q5_K or Q6_K: super-blocks of 256 weights along K, laid out
 * as ggml lays them (block_q4_K, block_q5_K, block_q6_K in ggml-common.h):
 *
 *   Q4_K (144 bytes): d, dmin (fp16); 12 bytes of 6-bit scales and mins for
 *        8 groups of 32; 128 bytes of nibbles, 32 bytes per pair of groups
 *        (low nibbles: the even group, high: the odd). w = d*sc*q - dmin*m.
 *   Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits before the
 *        nibbles (bit g of byte l: element l of group g).
 *   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
 *        int8 scales (one per 16 weights), d (fp16) last. w = d*sc*(q - 32).
 *
 * Every row of W is read once per call whatever M is: one W row (at most a
 * few KiB) stays in L1 while tiles of up to TILE_ROWS rows of x run over it
 * in turn, CHUNK_ROWS rows of x at a time.
 *
 * Activations are fp32 against weights dequantized in registers: each group
 * of 32 quants is widened to fp32 once per tile of x rows, and a group's
 * products come to scale * sum(q * x) - min * sum(x) (the sums of x per group
 * computed once per call into scratch of its own), so the products are fp32 ones, equal to
 * dequantize-then-matmul up to rounding and summation order.
 *
 * With int8 activations instead (tserve_klinear_int8), x is quantized first,
 * into scratch of its own, as llama.cpp's K-quant products quantize it
 * (q8_K): 8 bits per super-block of 256, one scale d for the super-block,
 * and the sums of q per 16. A super-block's products are then integer dot
 * products of each group's quants with q (exact), each times the group's
 * integer scale, summed in integers over the super-block and scaled once by
 * the weights' d times x's d; less, for Q4_K and Q5_K, the mins times x's
 * sums (scaled by dmin times x's d) and, for Q6_K, 32 times its scales times
 * x's sums (its quants are stored 0..63 for q - 32). One scale per 256
 * rather than per 32 costs a little precision (llama.cpp's choice too) and
 * saves a group's float work: 1.4 to 2 times the rate at 4 to 16 rows.
 *
 * Each kernel has a portable C version and an AVX2 + FMA + F16C one, the int8
 * products an AVX-512 VNNI one too; the caller picks by `isa`
 * (tserve_quant_isa() in _quant_kernels.c says what this CPU runs; the codes
 * are the same). A product splits W's rows (its
 * output columns) among torch's OpenMP threads, a dequantization its output
 * rows, unless it is small; the pre-pass over x runs on the caller.
 * Format codes are GGML's type ids.
 */
#include "_kernels.h"
#include "_quant_common.h"

#include <math.h>
#include <stdlib.h>

#define Q4_K 12
#define Q5_K 13
#define Q6_K 14
#define QK 256 /* weights per super-block */
#define GROUPS 8 /* groups of 32 per super-block */
#define SCRATCH_ALIGN 64 /* bytes */

static int64_t super_bytes(int fmt) {
    switch (fmt) {
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Q4_K / Q5_K: group g's scale and min, as fp32 (d * sc, dmin * m); ggml's get_scale_min_k4. */
static void scale_min(const uint8_t *blk, float scale[GROUPS], float min[GROUPS]) {
    float d = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
    const uint8_t *q = blk + 4;
    for (int g = 0; g < GROUPS; g++) {
        int sc, m;
        if (g < 4) {
            sc = q[g] & 63, m = q[g + 4] & 63;
        } else {
            sc = (q[g + 4] & 0x0f) | ((q[g - 4] >> 6) << 4);
            m = (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
        }
        scale[g] = d * (float)sc, min[g] = dmin * (float)m;
    }
}

/* One super-block as 256 fp32 weights, in the order ggml's dequantize_row_* writes them. */
static void super_floats(int fmt, const uint8_t *blk, float *out) {
    if (fmt == Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = half_to_float(load_u16(blk + 208));
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, out += 128)
            for (int l = 0; l < 32; l++) {
                int s = l / 16;
                out[l] = d * (float)sc[s] *
                         (float)(((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32);
                out[l + 32] = d * (float)sc[s + 2] *
                              (float)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
                out[l + 64] = d * (float)sc[s + 4] *
                              (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                out[l + 96] = d * (float)sc[s + 6] *
                              (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        return;
    }
    float scale[GROUPS], min[GROUPS];
    scale_min(blk, scale, min);
    const uint8_t *qh = blk + 16, *qs = blk + (fmt == Q5_K ? 48 : 16);
    for (int g = 0; g < GROUPS; g++) {
        const uint8_t *pair = qs + 32 * (g / 2);
        int shift = 4 * (g & 1);
        for (int l = 0; l < 32; l++) {
            int q = (pair[l] >> shift) & 0x0f;
            if (fmt == Q5_K) q |= ((qh[l] >> g) & 1) << 4;
            out[32 * g + l] = scale[g] * (float)q - min[g];
        }
    }
}

/* ------------------------------------------------------------------ portable */

/* One W row against `rows` fp32 rows of x: each super-block dequantized once. */
static void row_portable(int fmt, const uint8_t *wrow, int64_t k, int rows, const float *x,
                         float *y, int64_t y_stride) {
    int64_t nb = k / QK, unit = super_bytes(fmt);
    float w[QK], total[TILE_ROWS] = {0};
    for (int64_t b = 0; b < nb; b++) {
        super_floats(fmt, wrow + b * unit, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * k + b * QK;
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += w[j] * xb[j];
            total[r] += sum;
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = total[r];
}

/* ------------------------------------------------------------------ activations to int8
 *
 * llama.cpp's q8_K: x quantized per super-block of 256 (one scale for the
 * super-block, so a row's integer sums over its 8 groups, each weighted by
 * its small integer scale, stay integers until the super-block's end), with
 * the sums of the quants per 16 (the mins' term, and Q6_K's -32). */
#define SUMS (QK / 16) /* sums of x's quants per super-block */

/* 256 floats -> q (one multiply by 127 / max|x|, rounded half to even), d = max|x| / 127. */
static void quantize_super_portable(const float *xb, int8_t *qb, float *d) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < QK; j++) qb[j] = (int8_t)(int)nearbyintf(xb[j] * inverse);
    *d = amax / 127.0f;
}

/* The quants of group g of a super-block as in super_floats: 0..15 / 0..31 (Q4_K,
 * Q5_K) or 0..63 (Q6_K, before its -32). */
static void group_ints(int fmt, const uint8_t *blk, int g, int q[32]) {
    if (fmt == Q6_K) {
        int half = g / 4, within = g % 4;
        const uint8_t *ql = blk + 64 * half + 32 * (within & 1), *qh = blk + 128 + 32 * half;
        int low_shift = 4 * (within >> 1), high_shift = 2 * within;
        for (int l = 0; l < 32; l++)
            q[l] = ((ql[l] >> low_shift) & 0x0f) | (((qh[l] >> high_shift) & 3) << 4);
        return;
    }
    const uint8_t *pair = blk + (fmt == Q5_K ? 48 : 16) + 32 * (g / 2), *qh = blk + 16;
    for (int l = 0; l < 32; l++) {
        q[l] = (pair[l] >> (4 * (g & 1))) & 0x0f;
        if (fmt == Q5_K) q[l] |= ((qh[l] >> g) & 1) << 4;
    }
}

/* Q4_K / Q5_K: group g's 6-bit scale and min (ggml's get_scale_min_k4). */
static void scale_min_ints(const uint8_t *blk, int sc[GROUPS], int m[GROUPS]) {
    const uint8_t *q = blk + 4;
    for (int g = 0; g < GROUPS; g++)
        if (g < 4) {
            sc[g] = q[g] & 63, m[g] = q[g + 4] & 63;
        } else {
            sc[g] = (q[g + 4] & 0x0f) | ((q[g - 4] >> 6) << 4);
            m[g] = (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
        }
}

/* One super-block of W against one of x: its integer sums, scaled. Q4_K / Q5_K:
 * d * xd * sum_g sc_g (q_g . x_g) - dmin * xd * sum_g m_g sum(x_g); Q6_K:
 * d * xd * sum_h sc_h ((q_h . x_h) - 32 sum(x_h)) over its 16 halves of groups. */
static float super_int8_portable(int fmt, const uint8_t *blk, const int8_t *xb, float xd,
                                 const int16_t *sums) {
    int32_t dots = 0, offsets = 0;
    int sc[GROUPS], m[GROUPS];
    if (fmt != Q6_K) scale_min_ints(blk, sc, m);
    for (int g = 0; g < GROUPS; g++) {
        int q[32];
        group_ints(fmt, blk, g, q);
        const int8_t *xg = xb + 32 * g;
        if (fmt == Q6_K) {
            const int8_t *scales = (const int8_t *)(blk + 192) + 2 * g;
            for (int h = 0; h < 2; h++) {
                int32_t dot = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) dot += q[l] * xg[l];
                dots += scales[h] * dot;
                offsets += scales[h] * 32 * sums[2 * g + h];
            }
            continue;
        }
        int32_t dot = 0;
        for (int l = 0; l < 32; l++) dot += q[l] * xg[l];
        dots += sc[g] * dot;
        offsets += m[g] * (sums[2 * g] + sums[2 * g + 1]);
    }
    if (fmt == Q6_K) return half_to_float(load_u16(blk + 208)) * xd * (float)(dots - offsets);
    return half_to_float(load_u16(blk)) * xd * (float)dots -
           half_to_float(load_u16(blk + 2)) * xd * (float)offsets;
}

/* One W row against `rows` int8 rows of x (xd: row stride k / 256; sums: k / 16). */
static void row_portable_int8(int fmt, const uint8_t *wrow, int64_t k, int rows, const int8_t *x,
                              const float *xd, const int16_t *sums, float *y, int64_t y_stride) {
    int64_t nb = k / QK, unit = super_bytes(fmt);
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++)
            total += super_int8_portable(fmt, wrow + b * unit, x + r * k + b * QK,
                                         xd[r * nb + b], sums + (r * nb + b) * SUMS);
        y[r * y_stride] = total;
    }
}

typedef void (*row_fn)(const uint8_t *, int64_t, int, const float *, const float *, float *,
                       int64_t);

typedef void (*row_int8_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *,
                            const int16_t *, float *, int64_t);

/* ------------------------------------------------------------------ AVX2 */
#if defined(__x86_64__)


/* 32 bytes -> 4 x 8 floats (unsigned, or signed with `is_signed`). */
AVX2 INLINE void bytes_floats(__m256i v, int is_signed, __m256i out[4]) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        out[i] = is_signed ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
}

/* Q4_K / Q5_K: the 8 groups' scales (d * sc) and mins (dmin * m), group g in
 * lane g of *scale and *min: llama.cpp's unpacking of the 12 bytes in 32-bit words. */
AVX2 INLINE void scale_min_lanes(const uint8_t *blk, __m256 *scale, __m256 *min) {
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4); /* mins 4..7 */
    uint32_t mins_low = u[1] & six;                           /* mins 0..3 */
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);        /* scales 4..7 */
    u[2] = mins_low;
    u[0] &= six; /* scales 0..3 */
    __m128i bytes = _mm_loadu_si128((const __m128i *)u);
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    *scale = _mm256_mul_ps(sc, _mm256_set1_ps(_cvtsh_ss(load_u16(blk))));
    *min = _mm256_mul_ps(m, _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2))));
}

/* scale_min_lanes into scale[8], min[8]. */
AVX2 INLINE void scale_min_avx2(const uint8_t *blk, float scale[GROUPS], float min[GROUPS]) {
    __m256 sc, m;
    scale_min_lanes(blk, &sc, &m);
    _mm256_storeu_ps(scale, sc);
    _mm256_storeu_ps(min, m);
}

/* The 32 quants of group g (0..7) of a super-block as unsigned bytes: 0..31
 * (Q4_K, Q5_K) or 0..63 (Q6_K, before its -32). */
AVX2 INLINE __m256i group_quants(int fmt, const uint8_t *blk, int g) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    if (fmt == Q6_K) {
        int half = g / 4, within = g % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32 * (within & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
        ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (within >> 1))), low);
        qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * within)),
                              _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16) + 32 * (g / 2);
    __m256i raw = _mm256_loadu_si256((const __m256i *)qs);
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (g & 1))), low);
    if (fmt == Q5_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                       _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
}

/* group_quants as the weights' integer parts: Q6_K's less 32, signed. */
AVX2 INLINE __m256i group_quants_centred(int fmt, const uint8_t *blk, int g) {
    __m256i q = group_quants(fmt, blk, g);
    return fmt == Q6_K ? _mm256_sub_epi8(q, _mm256_set1_epi8(32)) : q;
}

/* Group g of a super-block as 4 x 8 fp32 weights (tserve_kdequantize's AVX2 path).
 * `scale`, `min`: Q4_K/Q5_K's per-group ones (scale_min); Q6_K reads its own. */
AVX2 INLINE void group_floats(int fmt, const uint8_t *blk, int g, const float *scale,
                              const float *min, __m256 w[4]) {
    __m256i q[4];
    bytes_floats(group_quants_centred(fmt, blk, g), fmt == Q6_K, q);
    if (fmt == Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192) + 2 * g;
        float d = _cvtsh_ss(load_u16(blk + 208));
        __m256 first = _mm256_set1_ps(d * (float)sc[0]), second = _mm256_set1_ps(d * (float)sc[1]);
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), first);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[1]), first);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[2]), second);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[3]), second);
        return;
    }
    __m256 s = _mm256_set1_ps(scale[g]), m = _mm256_set1_ps(-min[g]);
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), s, m);
}

/* One W row against `rows` fp32 rows, the groups' scales factored out: per
 * group sum(q * x) in fp32, times the group's scale, less its min times the
 * group's sum of x (`xsum`, row stride k / 32). Fewer multiplies than
 * dequantizing each weight first; the same products up to rounding. */
AVX2 INLINE void tile_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows, const float *x,
                           const float *xsum, float *y, int64_t y_stride) {
    int64_t nb = k / QK, unit = super_bytes(fmt), groups = k / 32;
    __m256 acc[TILE_ROWS][2], offset[TILE_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = offset[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * unit;
        prefetch_ahead(blk, unit);
        float scale[2 * GROUPS], min[GROUPS]; /* Q6_K: 16 scales, one per 16 weights */
        if (fmt != Q6_K) {
            scale_min_avx2(blk, scale, min);
            __m256 mins = _mm256_loadu_ps(min);
            for (int r = 0; r < rows; r++)
                offset[r] = _mm256_fmadd_ps(
                    mins, _mm256_loadu_ps(xsum + r * groups + b * GROUPS), offset[r]);
        } else {
            const int8_t *sc = (const int8_t *)(blk + 192);
            __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 208)));
            __m128i bytes = _mm_loadu_si128((const __m128i *)sc);
            __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
            _mm256_storeu_ps(scale, _mm256_mul_ps(low, d));
            _mm256_storeu_ps(scale + GROUPS, _mm256_mul_ps(high, d));
        }
#pragma GCC unroll 8
        for (int g = 0; g < GROUPS; g++) {
            __m256i qi[4];
            __m256 q[4];
            bytes_floats(group_quants_centred(fmt, blk, g), fmt == Q6_K, qi);
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtepi32_ps(qi[i]);
            for (int r = 0; r < rows; r++) {
                const float *xg = x + r * k + b * QK + 32 * g;
                __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xg));
                __m256 s1 = _mm256_mul_ps(q[2], _mm256_loadu_ps(xg + 16));
                s0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xg + 8), s0);
                s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24), s1);
                if (fmt == Q6_K) { /* the group's halves: scale[2g], scale[2g + 1] */
                    acc[r][0] = _mm256_fmadd_ps(s0, _mm256_set1_ps(scale[2 * g]), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(s1, _mm256_set1_ps(scale[2 * g + 1]), acc[r][1]);
                } else {
                    acc[r][g & 1] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1),
                                                    _mm256_set1_ps(scale[g]), acc[r][g & 1]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        y[r * y_stride] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) - hsum(offset[r]);
}

/* 256 floats -> q, d: quantize_super_portable's numbers (one multiply, round half to even). */
AVX2 static void quantize_super_avx2(const float *xb, int8_t *qb, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < QK; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float top = _mm_cvtss_f32(m), inverse = top > 0.0f ? 127.0f / top : 0.0f;
    __m256 scale = _mm256_set1_ps(inverse);
    for (int i = 0; i < QK; i += 32) {
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), scale),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                            _mm256_packs_epi32(q[2], q[3]));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qb + i), packed);
    }
    *d = top / 127.0f;
}

/* One W row against `rows` int8 rows (xd: row stride k / 256; sums: k / 16), as
 * super_int8_portable: per group one maddubs (unsigned quants times int8 x)
 * and one madd with the group's scale (int16 in every place: Q6_K's two
 * halves, one per 128-bit lane, each its own) summed into int32 for the
 * whole super-block, then one convert and FMA (and one for the mins) per
 * super-block. Exact in integers: |products| <= 63 * 127, pairs times
 * scales below 2^22, a super-block's sums below 2^26. */
AVX2 INLINE void tile_int8_avx2(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                const int8_t *x, const float *xd, const int16_t *sums, float *y,
                                int64_t y_stride) {
    int64_t nb = k / QK, unit = super_bytes(fmt);
    __m256 acc[INT8_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * unit;
        prefetch_ahead(blk, unit);
        __m256i scales[2], offsets; /* offsets: the int16 factors of x's 16 sums */
        float d, dmin = 0.0f;
        if (fmt == Q6_K) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 192));
            offsets = _mm256_cvtepi8_epi16(bytes); /* scale h for x's sum h */
            scales[0] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(bytes));
            scales[1] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(bytes, 8)));
            d = _cvtsh_ss(load_u16(blk + 208));
        } else {
            uint32_t u[4];
            memcpy(u, blk + 4, 12);
            const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
            u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4); /* mins 4..7 */
            uint32_t mins_low = u[1] & six;                           /* mins 0..3 */
            u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);        /* scales 4..7 */
            u[2] = mins_low;
            u[0] &= six; /* scales 0..3 */
            __m128i bytes = _mm_loadu_si128((const __m128i *)u), mins = _mm_srli_si128(bytes, 8);
            scales[0] = scales[1] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(bytes));
            offsets = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)); /* m_g for sums 2g, 2g + 1 */
            d = _cvtsh_ss(load_u16(blk));
            dmin = _cvtsh_ss(load_u16(blk + 2));
        }
        __m256i isum[INT8_TILE_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < GROUPS; g++) {
            __m256i q = group_quants(fmt, blk, g);
            __m256i scale;
            if (fmt == Q6_K) { /* lane h: scale 2g + h, of the 8 in scales[g / 4] */
                int at = 4 * (g % 4);
                scale = _mm256_shuffle_epi8(
                    scales[g / 4],
                    _mm256_set_m128i(_mm_set1_epi16((short)(0x0101 * (at + 2) + 0x0100)),
                                     _mm_set1_epi16((short)(0x0101 * at + 0x0100))));
            } else {
                scale = _mm256_shuffle_epi8(scales[0], _mm256_set1_epi16((short)(0x0202 * g + 0x0100)));
            }
            for (int r = 0; r < rows; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + b * QK + 32 * g));
                isum[r] = _mm256_add_epi32(
                    isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
            }
        }
        for (int r = 0; r < rows; r++) {
            float xdr = xd[r * nb + b];
            __m256i xsums = _mm256_loadu_si256((const __m256i *)(sums + (r * nb + b) * SUMS));
            __m256i offset = _mm256_madd_epi16(offsets, xsums);
            if (fmt == Q6_K) {
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5)); /* 32 x */
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * xdr),
                                         acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * xdr),
                                         acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(dmin * xdr),
                                          acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = hsum(acc[r]);
}

#define AVX2_TILE_INT8(R) tile_int8_avx2(FORMAT, wrow, k, R, x, xd, sums, y, y_stride)

#define AVX2_ROW_INT8(FMT)                                                                   \
    AVX2 static void row_int8_avx2_##FMT(const uint8_t *wrow, int64_t k, int rows,           \
                                         const int8_t *x, const float *xd,                   \
                                         const int16_t *sums, float *y, int64_t y_stride) {  \
        enum { FORMAT = FMT };                                                               \
        BY_INT8_TILE_ROWS(rows, AVX2_TILE_INT8)                                                   \
    }

AVX2_ROW_INT8(Q4_K)
AVX2_ROW_INT8(Q5_K)
AVX2_ROW_INT8(Q6_K)

#define AVX2_TILE(R) tile_avx2(FORMAT, wrow, k, R, x, xsum, y, y_stride)

/* The format and the tile's row count as constants in each instance, so each
 * inner loop is specialised. */
#define AVX2_ROW(FMT)                                                                        \
    AVX2 static void row_avx2_##FMT(const uint8_t *wrow, int64_t k, int rows, const float *x, \
                                    const float *xsum, float *y, int64_t y_stride) {         \
        enum { FORMAT = FMT };                                                               \
        BY_TILE_ROWS(rows, AVX2_TILE)                                                        \
    }

AVX2_ROW(Q4_K)
AVX2_ROW(Q5_K)
AVX2_ROW(Q6_K)


/* ------------------------------------------------------------------ AVX-512 VNNI, int8
 *
 * tile_int8_avx2's scheme with 512-bit registers, two groups a register
 * (x's 64 bytes as they lie): one maddubs, then one vpdpwssd (VNNI: the
 * int16 pairs times the groups' scales, summed into int32 in place). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Groups 2j and 2j + 1 of a super-block as 64 unsigned bytes (0..31 or 0..63). */
AVX512 INLINE __m512i pair_quants(int fmt, const uint8_t *blk, int j) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    if (fmt == Q6_K) { /* groups 2j, 2j + 1: 64 bytes of ql in a row, one shift of 4 */
        int half = j / 2, shift = 4 * (j & 1);
        __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * half));
        ql = _mm512_and_si512(_mm512_srli_epi16(ql, shift), low);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half)));
        qh = _mm512_srlv_epi64(qh, _mm512_setr_epi64(2 * (2 * j % 4), 2 * (2 * j % 4), 2 * (2 * j % 4),
                                                     2 * (2 * j % 4), 2 * (2 * j % 4 + 1),
                                                     2 * (2 * j % 4 + 1), 2 * (2 * j % 4 + 1),
                                                     2 * (2 * j % 4 + 1)));
        qh = _mm512_and_si512(qh, _mm512_set1_epi8(3));
        return _mm512_or_si512(ql, _mm512_slli_epi16(qh, 4));
    }
    const uint8_t *qs = blk + (fmt == Q5_K ? 48 : 16) + 32 * j;
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
    __m512i q = _mm512_and_si512(_mm512_mask_blend_epi64(0xf0, v, _mm512_srli_epi16(v, 4)), low);
    if (fmt == Q5_K) { /* bit g of byte l: element l of group g */
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        qh = _mm512_srlv_epi64(qh, _mm512_setr_epi64(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1,
                                                     2 * j + 1, 2 * j + 1, 2 * j + 1));
        q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(1)), 4));
    }
    return q;
}

/* tile_int8_avx2 with 512-bit registers (the same integer sums; the floats
 * summed in another order). */
AVX512 INLINE void tile_int8_vnni(int fmt, const uint8_t *wrow, int64_t k, int rows,
                                  const int8_t *x, const float *xd, const int16_t *sums, float *y,
                                  int64_t y_stride) {
    int64_t nb = k / QK, unit = super_bytes(fmt);
    __m512 acc[INT8_TILE_ROWS];
    __m256 acc_m[INT8_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps(), acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * unit;
        prefetch_ahead(blk, unit);
        __m512i scales; /* int16: Q4_K/Q5_K's 8 in each 128-bit lane; Q6_K's 16, in order */
        __m256i offsets;
        float d, dmin = 0.0f;
        if (fmt == Q6_K) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 192));
            offsets = _mm256_cvtepi8_epi16(bytes);
            scales = _mm512_castsi256_si512(offsets);
            d = _cvtsh_ss(load_u16(blk + 208));
        } else {
            uint32_t u[4];
            memcpy(u, blk + 4, 12);
            const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
            u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
            uint32_t mins_low = u[1] & six;
            u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
            u[2] = mins_low;
            u[0] &= six;
            __m128i bytes = _mm_loadu_si128((const __m128i *)u), mins = _mm_srli_si128(bytes, 8);
            scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(bytes));
            offsets = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
            d = _cvtsh_ss(load_u16(blk));
            dmin = _cvtsh_ss(load_u16(blk + 2));
        }
        __m512i isum[INT8_TILE_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < GROUPS / 2; j++) {
            __m512i q = pair_quants(fmt, blk, j), scale;
            if (fmt == Q6_K) /* lane L: scale 4j + L (of the group pair's four halves) */
                scale = _mm512_permutexvar_epi16(
                    _mm512_setr_epi32(0x00010001 * (4 * j), 0x00010001 * (4 * j),
                                      0x00010001 * (4 * j), 0x00010001 * (4 * j),
                                      0x00010001 * (4 * j + 1), 0x00010001 * (4 * j + 1),
                                      0x00010001 * (4 * j + 1), 0x00010001 * (4 * j + 1),
                                      0x00010001 * (4 * j + 2), 0x00010001 * (4 * j + 2),
                                      0x00010001 * (4 * j + 2), 0x00010001 * (4 * j + 2),
                                      0x00010001 * (4 * j + 3), 0x00010001 * (4 * j + 3),
                                      0x00010001 * (4 * j + 3), 0x00010001 * (4 * j + 3)),
                    scales);
            else /* lanes 0, 1: scale 2j; lanes 2, 3: 2j + 1 */
                scale = _mm512_shuffle_epi8(
                    scales, _mm512_setr_epi32(0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1),
                                              0x01000100 + 0x02020202 * (2 * j + 1)));
            for (int r = 0; r < rows; r++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x + r * k + b * QK + 64 * j));
                isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(q, xv), scale);
            }
        }
        for (int r = 0; r < rows; r++) {
            float xdr = xd[r * nb + b];
            __m256i xsums = _mm256_loadu_si256((const __m256i *)(sums + (r * nb + b) * SUMS));
            __m256i offset = _mm256_madd_epi16(offsets, xsums);
            if (fmt == Q6_K)
                isum[r] = _mm512_sub_epi32(isum[r],
                                           _mm512_zextsi256_si512(_mm256_slli_epi32(offset, 5)));
            else
                acc_m[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(dmin * xdr),
                                           acc_m[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * xdr), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride] = _mm512_reduce_add_ps(acc[r]) - hsum(acc_m[r]);
}

#define VNNI_TILE_INT8(R) tile_int8_vnni(FORMAT, wrow, k, R, x, xd, sums, y, y_stride)

#define VNNI_ROW_INT8(FMT)                                                                   \
    AVX512 static void row_int8_vnni_##FMT(const uint8_t *wrow, int64_t k, int rows,         \
                                           const int8_t *x, const float *xd,                 \
                                           const int16_t *sums, float *y, int64_t y_stride) { \
        enum { FORMAT = FMT };                                                               \
        BY_INT8_TILE_ROWS(rows, VNNI_TILE_INT8)                                                   \
    }

VNNI_ROW_INT8(Q4_K)
VNNI_ROW_INT8(Q5_K)
VNNI_ROW_INT8(Q6_K)

/* One super-block into 256 floats with the AVX2 group decoder. */
AVX2 static void super_floats_avx2(int fmt, const uint8_t *blk, float *out) {
    float scale[GROUPS], min[GROUPS];
    if (fmt != Q6_K) scale_min_avx2(blk, scale, min);
    for (int g = 0; g < GROUPS; g++) {
        __m256 w[4];
        switch (fmt) { /* constant formats, so each decoder is specialised */
        case Q4_K: group_floats(Q4_K, blk, g, scale, min, w); break;
        case Q5_K: group_floats(Q5_K, blk, g, scale, min, w); break;
        default: group_floats(Q6_K, blk, g, scale, min, w); break;
        }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 32 * g + 8 * i, w[i]);
    }
}
#endif

/* The AVX2 kernels of `fmt` (NULL: none; always, off x86-64). */
static row_fn avx2_row(int fmt) {
#if defined(__x86_64__)
    switch (fmt) {
    case Q4_K: return row_avx2_Q4_K;
    case Q5_K: return row_avx2_Q5_K;
    case Q6_K: return row_avx2_Q6_K;
    }
#endif
    (void)fmt;
    return 0;
}

/* The int8 kernels `isa` runs for `fmt` (NULL: the portable one). */
static row_int8_fn fast_row_int8(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX512_VNNI) switch (fmt) {
        case Q4_K: return row_int8_vnni_Q4_K;
        case Q5_K: return row_int8_vnni_Q5_K;
        case Q6_K: return row_int8_vnni_Q6_K;
        }
    if (isa >= ISA_AVX2) switch (fmt) {
    case Q4_K: return row_int8_avx2_Q4_K;
    case Q5_K: return row_int8_avx2_Q5_K;
    case Q6_K: return row_int8_avx2_Q6_K;
    }
#endif
    (void)isa;
    (void)fmt;
    return 0;
}

/* ------------------------------------------------------------------ entry */

/* Rows `rows` (or 0..n_rows-1 when NULL) of W [*, k] (k a multiple of 256) as fp32
 * into out [n_rows, k]. */
void tserve_kdequantize(int isa, int fmt, const uint8_t *w, int64_t k, const int64_t *rows,
                        int64_t n_rows, float *out) {
    int64_t nb = k / QK, unit = super_bytes(fmt), stride = nb * unit;
    int threads = threads_for(n_rows * (k / 32));
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *row = w + (rows ? rows[i] : i) * stride;
        for (int64_t b = 0; b < nb; b++) {
#if defined(__x86_64__)
            if (isa >= ISA_AVX2) {
                super_floats_avx2(fmt, row + b * unit, out + i * k + b * QK);
                continue;
            }
#endif
            super_floats(fmt, row + b * unit, out + i * k + b * QK);
        }
    }
    (void)isa;
}

/* A product's activations: fp32 rows with their sums per group of 32 (row stride
 * k / 32), or (xq not NULL) int8 rows with their scales (k / 256) and sums per 16
 * (k / 16): quantize_q8k's. */
typedef struct {
    const float *x, *xsum;
    const int8_t *xq;
    const float *xd;
    const int16_t *sums;
} activations;

/* y[M, N] (row stride n) columns [n0, n1) = x W^T: each W row read once per CHUNK_ROWS
 * rows of x, in tiles of TILE_ROWS (int8: INT8_TILE_ROWS). */
static void product(int isa, int fmt, const uint8_t *w, int64_t n, int64_t n0, int64_t n1,
                    int64_t k, const activations *a, int64_t m, float *y) {
    int64_t stride = k / QK * super_bytes(fmt), groups = k / 32, nb = k / QK;
    row_fn fast = isa >= ISA_AVX2 && !a->xq ? avx2_row(fmt) : 0;
    row_int8_fn fast_int8 = a->xq ? fast_row_int8(isa, fmt) : 0;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
        for (int64_t j = n0; j < n1; j++) {
            const uint8_t *wrow = w + j * stride;
            int64_t tile = a->xq ? INT8_TILE_ROWS : TILE_ROWS;
            for (int64_t r = m0; r < m1; r += tile) {
                int rows = m1 - r < tile ? (int)(m1 - r) : (int)tile;
                float *yr = y + r * n + j;
                if (a->xq) {
                    const int8_t *xr = a->xq + r * k;
                    const float *dr = a->xd + r * nb;
                    const int16_t *sr = a->sums + r * nb * SUMS;
                    if (fast_int8)
                        fast_int8(wrow, k, rows, xr, dr, sr, yr, n);
                    else
                        row_portable_int8(fmt, wrow, k, rows, xr, dr, sr, yr, n);
                } else if (fast) {
                    fast(wrow, k, rows, a->x + r * k, a->xsum + r * groups, yr, n);
                } else {
                    row_portable(fmt, wrow, k, rows, a->x + r * k, yr, n);
                }
            }
        }
    }
}

/* y[M, N] = x W^T with the columns shared among the threads as tserve_qlinear's are:
 * SHARE_ROWS at a time, to whichever thread is free. */
static void shared_product(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k,
                           const activations *a, int64_t m, float *y) {
    int threads = threads_for(n * (k / 32) * m);
    int64_t shares = (n + SHARE_ROWS - 1) / SHARE_ROWS;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (int64_t s = 0; s < shares; s++) {
        int64_t n1 = (s + 1) * SHARE_ROWS < n ? (s + 1) * SHARE_ROWS : n;
        product(isa, fmt, w, n, s * SHARE_ROWS, n1, k, a, m, y);
    }
}

/* Scratch of `bytes` bytes on a cache line, as torch's tensors are (NULL: none to be had). */
static void *scratch(int64_t bytes) {
    return aligned_alloc(SCRATCH_ALIGN, (size_t)((bytes + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN *
                                                 SCRATCH_ALIGN));
}

/* y[M, N] = x W^T for fp32 x [M, k] (M >= 1) and W [N, k] in `fmt` (the file's layout):
 * x's sums per group of 32 into a scratch block, then the product. Returns 0, or -1
 * when the scratch cannot be allocated (y untouched). */
int tserve_klinear(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x,
                   int64_t m, float *y) {
    int64_t groups = m * (k / 32);
    float *xsum = scratch(groups * (int64_t)sizeof(float));
    if (!xsum) return -1;
    for (int64_t i = 0; i < groups; i++) {
        float total = 0.0f;
        for (int j = 0; j < 32; j++) total += x[32 * i + j];
        xsum[i] = total;
    }
    activations a = {.x = x, .xsum = xsum};
    shared_product(isa, fmt, w, n, k, &a, m, y);
    free(xsum);
    return 0;
}

/* x [m, k] (k a multiple of 256) -> q [m, k] int8, d [m, k / 256], sums [m, k / 16]:
 * llama.cpp's q8_K (the section "activations to int8"). */
static void quantize_q8k(int isa, const float *x, int64_t m, int64_t k, int8_t *q, float *d,
                         int16_t *sums) {
    int64_t supers = m * (k / QK);
    for (int64_t i = 0; i < supers; i++) {
#if defined(__x86_64__)
        if (isa >= ISA_AVX2)
            quantize_super_avx2(x + i * QK, q + i * QK, d + i);
        else
#endif
            quantize_super_portable(x + i * QK, q + i * QK, d + i);
        for (int h = 0; h < SUMS; h++) {
            int total = 0;
            for (int j = 0; j < 16; j++) total += q[i * QK + 16 * h + j];
            sums[i * SUMS + h] = (int16_t)total;
        }
    }
    (void)isa;
}

/* y[M, N] = x W^T for W [N, k] in `fmt` (the file's layout) and fp32 x [M, k] (M >= 1),
 * quantized per super-block (quantize_q8k) into a scratch copy. Returns 0, or -1
 * when the scratch cannot be allocated (y untouched). */
int tserve_klinear_int8(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k,
                        const float *x, int64_t m, float *y) {
    int64_t supers = m * (k / QK);
    int8_t *xq = scratch(m * k + supers * (int64_t)(sizeof(float) + SUMS * sizeof(int16_t)));
    if (!xq) return -1;
    float *xd = (float *)(xq + m * k); /* m * k: a multiple of 256 */
    int16_t *sums = (int16_t *)(xd + supers);
    quantize_q8k(isa, x, m, k, xq, xd, sums);
    activations a = {.xq = xq, .xd = xd, .sums = sums};
    shared_product(isa, fmt, w, n, k, &a, m, y);
    free(xq);
    return 0;
}
