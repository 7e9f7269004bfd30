/* Linear layers over GGUF's K-quant weights (tserve/gpu/forward/_quant.py): fp32
 * activations against the file's rows, int8 ones against a packed copy.
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
 * Every byte of W is read once per call whatever M is: one W row (at most a
 * few KiB), or one panel's super-block, stays in L1 while tiles of rows of x
 * run over it in turn, CHUNK_ROWS rows of x at a time.
 *
 * fp32 activations (tserve_klinear) meet weights dequantized in registers: each group
 * of 32 quants is widened to fp32 once per tile of x rows, and a group's
 * products come to scale * sum(q * x) - min * sum(x) (the sums of x per group
 * computed once per call into scratch of its own), so the products are fp32 ones, equal to
 * dequantize-then-matmul up to rounding and summation order.
 *
 * With int8 activations instead (tserve_kqlinear_int8), x is quantized first,
 * into scratch of its own, as llama.cpp's K-quant products quantize it
 * (q8_K): 8 bits per super-block of 256, one scale d for the super-block,
 * and the sums of q per 16. A super-block's products are then integer dot
 * products of each group's quants with q (exact), each times the group's
 * integer scale, summed in integers over the super-block and scaled once by
 * the weights' d times x's d; less, for Q4_K and Q5_K, the mins times x's
 * sums (scaled by dmin times x's d) and, for Q6_K, 32 times its scales times
 * x's sums (its quants are stored 0..63 for q - 32). One scale per 256
 * rather than per 32 costs a little precision (llama.cpp's choice too) and
 * saves a group's float work. W is repacked for them at load ("the packed
 * layout, int8" below).
 *
 * Each kernel has a portable C version and an AVX2 + FMA + F16C one, the int8
 * products AVX-512 VNNI ones too (one panel, or a pair); the caller picks by `isa`
 * (tserve_quant_isa() in _quant_kernels.c says what this CPU runs; the codes
 * are the same). A product splits W's rows (its
 * output columns) among torch's OpenMP threads, a dequantization its output
 * rows, unless it is small; the pre-pass over x runs on the caller.
 * Format codes are GGML's type ids.
 */
#include "_kernels.h"
#include "_quant_common.h"
#include "_panel_common.h"

#include <math.h>
#include <stdlib.h>

#define Q4_K 12
#define Q5_K 13
#define Q6_K 14
#define QK 256 /* weights per super-block */
#define GROUPS 8 /* groups of 32 per super-block */
#define SCRATCH_ALIGN 64 /* bytes */
#define MAX_SUPER_BYTES 210 /* Q6_K's */

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

typedef void (*row_fn)(const uint8_t *, int64_t, int, const float *, const float *, float *,
                       int64_t);

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

/* One super-block into 256 floats, with the AVX2 group decoder where `isa` has it. */
static void super_floats_isa(int isa, int fmt, const uint8_t *blk, float *out) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX2) {
        super_floats_avx2(fmt, blk, out);
        return;
    }
#endif
    (void)isa;
    super_floats(fmt, blk, out);
}

/* ------------------------------------------------------------------ the packed layout, int8
 *
 * For int8 activations W is repacked once at load (tserve_kpack) into panels
 * of PANEL rows (_panel_common.h), super-block after super-block along K, so
 * that one pass of integer products serves PANEL outputs (AVX-512: a pair of
 * panels, 16) and a super-block's float work (the scales, the conversion,
 * the FMAs) is paid once per panel rather than once per W row and x row. One
 * super-block of a panel, each field in row order:
 *
 *   Q4_K, Q5_K (160 + 8 groups): d, dmin (8 fp16 each); the groups' scales,
 *        then their mins, as bytes (group g's: 8 bytes, one a row); then the
 *        groups: 128 bytes of nibbles each (Q5_K: 160, its fifth bits after).
 *   Q6_K (144 + 8 groups): d (8 fp16); the 16 int8 scales (one per 16
 *        weights, 8 bytes each, one a row); then the groups: 128 bytes of low
 *        nibbles and 64 of high bit pairs each.
 *
 * A group's nibbles lie as a Q4_1 panel block's (_quant_kernels.c): byte j of
 * a row holds element j (low nibble) and 16 + j (high), the row's 16 bytes
 * GROUP to a lane, so one 32-byte load's low nibbles are elements 4t..4t+3
 * of every row and its high ones 16 + 4t..: each half of 16 is one of Q6_K's
 * scale steps and one of x's sums. Q5_K's fifth bits lie as Q5_1's (4 bytes a
 * row: byte j, bits 2t and 2t + 1, elements 4t + j and 16 + 4t + j); Q6_K's
 * high bit pairs 4 bytes a row per half (half s, byte j, bits 2t and 2t + 1:
 * element 16s + 4t + j). The scales as bytes rather than 6 bits cost Q4_K and
 * Q5_K 4 bytes a row per super-block (148 of 144, 180 of 176); Q6_K keeps 210.
 *
 * Per x row, group half and panel: four byte multiply-adds (maddubs) of the
 * quants against 4 bytes of x broadcast, their int16 sums (at most 4 * 2 * 31
 * * 127; Q6_K's quants up to 63 let only two share a sum) times the half's scale in one int16
 * multiply-add into the super-block's int32 sum (VNNI: vpdpwssd), each row's
 * in its lane; the mins (Q6_K: 32 times its scales) times x's sums per 16 the
 * same way; one conversion and FMA per super-block. The integers are
 * super_int8_portable's, exact; the floats are summed in another order. At 1
 * to 64 rows of x this takes 0.40-0.59 of the time of the same integer sums
 * over the file's rows (Q4_K; Q6_K 0.53-0.71), which paid the float work and
 * a reduction across lanes per W row and x row. */

#define K_HEAD_Q4 160 /* d, dmin, scales, mins */
#define K_HEAD_Q6 144 /* d, scales */

static int64_t kpanel_head(int fmt) { return fmt == Q6_K ? K_HEAD_Q6 : K_HEAD_Q4; }
static int64_t kpanel_group_bytes(int fmt) { return fmt == Q4_K ? 128 : fmt == Q5_K ? 160 : 192; }
static int64_t kpanel_super_bytes(int fmt) {
    return kpanel_head(fmt) + GROUPS * kpanel_group_bytes(fmt);
}

/* Where the high bits (Q5_K: 1, Q6_K: 2) of element e (of 32) of row i lie in a
 * packed group: byte khigh_at(fmt, i, e), shifted by khigh_shift(fmt, e); Q5_K's
 * as a Q5 block's fifth bits, Q6_K's pairs one half of 16 after the other. */
static int64_t khigh_at(int fmt, int i, int e) {
    return 128 + (fmt == Q6_K ? GROUP_BYTES * (e / 16) : 0) + GROUP * i + fifth_byte(e);
}
static int khigh_shift(int fmt, int e) { return fifth_shift(e) - (fmt == Q6_K ? e / 16 : 0); }

/* Group g's 32 quants (group_ints's) into a zeroed super-block of the file's layout. */
static void put_group_ints(int fmt, uint8_t *blk, int g, const int q[32]) {
    if (fmt == Q6_K) {
        int half = g / 4, within = g % 4;
        uint8_t *ql = blk + 64 * half + 32 * (within & 1), *qh = blk + 128 + 32 * half;
        for (int l = 0; l < 32; l++) {
            ql[l] |= (uint8_t)((q[l] & 0x0f) << (4 * (within >> 1)));
            qh[l] |= (uint8_t)(((q[l] >> 4) & 3) << (2 * within));
        }
        return;
    }
    uint8_t *pair = blk + (fmt == Q5_K ? 48 : 16) + 32 * (g / 2);
    for (int l = 0; l < 32; l++) {
        pair[l] |= (uint8_t)((q[l] & 0x0f) << (4 * (g & 1)));
        if (fmt == Q5_K) blk[16 + l] |= (uint8_t)(((q[l] >> 4) & 1) << g);
    }
}

/* Row i of a file super-block `blk` into its panel's packed super-block `dst` (zeroed). */
static void kpack_row(int fmt, const uint8_t *blk, int i, uint8_t *dst) {
    if (fmt == Q6_K) {
        memcpy(dst + 2 * i, blk + 208, 2);
        for (int h = 0; h < 2 * GROUPS; h++) dst[16 + PANEL * h + i] = blk[192 + h];
    } else {
        int sc[GROUPS], m[GROUPS];
        scale_min_ints(blk, sc, m);
        memcpy(dst + 2 * i, blk, 2);
        memcpy(dst + 16 + 2 * i, blk + 2, 2);
        for (int g = 0; g < GROUPS; g++) {
            dst[32 + PANEL * g + i] = (uint8_t)sc[g];
            dst[96 + PANEL * g + i] = (uint8_t)m[g];
        }
    }
    for (int g = 0; g < GROUPS; g++) {
        uint8_t *group = dst + kpanel_head(fmt) + g * kpanel_group_bytes(fmt);
        int q[32];
        group_ints(fmt, blk, g, q);
        for (int j = 0; j < 16; j++)
            group[panel_quant_at(i, j)] = (uint8_t)((q[j] & 0x0f) | (q[j + 16] & 0x0f) << 4);
        if (fmt != Q4_K)
            for (int e = 0; e < 32; e++)
                group[khigh_at(fmt, i, e)] |=
                    (uint8_t)(((q[e] >> 4) & (fmt == Q6_K ? 3 : 1)) << khigh_shift(fmt, e));
    }
}

/* Row i of a packed super-block `src` back as a super-block of the file's layout. */
static void kfile_row(int fmt, const uint8_t *src, int i, uint8_t *blk) {
    memset(blk, 0, (size_t)super_bytes(fmt));
    for (int g = 0; g < GROUPS; g++) {
        const uint8_t *group = src + kpanel_head(fmt) + g * kpanel_group_bytes(fmt);
        int q[32];
        for (int j = 0; j < 16; j++) {
            uint8_t byte = group[panel_quant_at(i, j)];
            q[j] = byte & 0x0f, q[j + 16] = byte >> 4;
        }
        if (fmt != Q4_K)
            for (int e = 0; e < 32; e++)
                q[e] |= ((group[khigh_at(fmt, i, e)] >> khigh_shift(fmt, e)) &
                         (fmt == Q6_K ? 3 : 1)) << 4;
        put_group_ints(fmt, blk, g, q);
    }
    if (fmt == Q6_K) {
        memcpy(blk + 208, src + 2 * i, 2);
        for (int h = 0; h < 2 * GROUPS; h++) blk[192 + h] = src[16 + PANEL * h + i];
        return;
    }
    memcpy(blk, src + 2 * i, 2);
    memcpy(blk + 2, src + 16 + 2 * i, 2);
    const uint8_t *sc = src + 32 + i, *m = src + 96 + i; /* group g's: [PANEL * g] */
    uint8_t *q = blk + 4; /* ggml's 12 bytes: get_scale_min_k4 read backwards */
    for (int g = 0; g < 4; g++) {
        int sc_high = sc[PANEL * (g + 4)], m_high = m[PANEL * (g + 4)];
        q[g] = (uint8_t)(sc[PANEL * g] | (sc_high >> 4) << 6);
        q[g + 4] = (uint8_t)(m[PANEL * g] | (m_high >> 4) << 6);
        q[g + 8] = (uint8_t)((sc_high & 0x0f) | (m_high & 0x0f) << 4);
    }
}

/* Bytes of W [n, k] (k a multiple of 256) in the packed layout. */
int64_t tserve_kpacked_bytes(int fmt, int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * (k / QK) * kpanel_super_bytes(fmt);
}

/* W [n, k] (the file's rows) -> out [tserve_kpacked_bytes] (rows past n: zeros). */
void tserve_kpack(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    int64_t nb = k / QK, unit = super_bytes(fmt), psb = kpanel_super_bytes(fmt);
    int64_t panels = (n + PANEL - 1) / PANEL;
    memset(out, 0, (size_t)(panels * nb * psb));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < PANEL && p * PANEL + i < n; i++)
                kpack_row(fmt, w + (p * PANEL + i) * nb * unit + b * unit, i,
                          out + (p * nb + b) * psb);
}

/* Rows `rows` (or 0..n_rows-1 when NULL) of a packed W [*, k] as fp32 into out [n_rows, k],
 * as tserve_kdequantize gives the file's rows. */
void tserve_kunpack(int isa, int fmt, const uint8_t *packed, int64_t k, const int64_t *rows,
                    int64_t n_rows, float *out) {
    int64_t nb = k / QK, psb = kpanel_super_bytes(fmt);
    int threads = threads_for(n_rows * (k / 32));
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        int64_t row = rows ? rows[r] : r;
        const uint8_t *panel = packed + row / PANEL * nb * psb;
        uint8_t blk[MAX_SUPER_BYTES];
        for (int64_t b = 0; b < nb; b++) {
            kfile_row(fmt, panel + b * psb, (int)(row % PANEL), blk);
            super_floats_isa(isa, fmt, blk, out + r * k + b * QK);
        }
    }
}

/* One packed panel (`cols` real rows of W) against `rows` int8 rows of x: each
 * row back in the file's layout, then super_int8_portable per super-block. */
static void kpanel_portable(int fmt, const uint8_t *panel, int64_t k, int rows, const int8_t *x,
                            const float *xd, const int16_t *sums, float *y, int64_t y_stride,
                            int cols) {
    int64_t nb = k / QK, psb = kpanel_super_bytes(fmt);
    uint8_t blk[MAX_SUPER_BYTES];
    for (int c = 0; c < cols; c++) {
        float total[INT8_TILE_ROWS] = {0};
        for (int64_t b = 0; b < nb; b++) {
            kfile_row(fmt, panel + b * psb, c, blk);
            for (int r = 0; r < rows; r++)
                total[r] += super_int8_portable(fmt, blk, x + r * k + b * QK, xd[r * nb + b],
                                                sums + (r * nb + b) * SUMS);
        }
        for (int r = 0; r < rows; r++) y[r * y_stride + c] = total[r];
    }
}

/* A packed K-quant kernel: (panel, twin, next, k, rows, x, xd, sums, y, y_stride, cols),
 * as _quant_kernels.c's panel_fn with x's sums per 16 for its sums per 32. */
typedef void (*kpanel_fn)(const uint8_t *, int64_t, int64_t, int64_t, int, const int8_t *,
                          const float *, const int16_t *, float *, int64_t, int);

#if defined(__x86_64__)

/* Lane i (of each panel): the int16 pair (a[i], b[i]) of two rows' bytes (8 each). */
AVX2 INLINE __m256i pairs_256(const uint8_t *a, const uint8_t *b, int64_t twin, int is_signed) {
    (void)twin;
    __m128i v = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a),
                                  _mm_loadl_epi64((const __m128i *)b));
    return is_signed ? _mm256_cvtepi8_epi16(v) : _mm256_cvtepu8_epi16(v);
}

AVX512 INLINE __m512i pairs_512(const uint8_t *a, const uint8_t *b, int64_t twin, int is_signed) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(pairs_256(a, b, 0, is_signed)),
                              pairs_256(a + twin, b + twin, 0, is_signed), 1);
}

/* acc + the int16 pairs of a times b's, summed per 32-bit lane (VNNI: in one instruction). */
AVX2 INLINE __m256i madd_avx2_256(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
AVX512 INLINE __m256i madd_vnni_256(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpwssd_epi32(acc, a, b);
}
AVX512 INLINE __m512i madd_vnni_512(__m512i acc, __m512i a, __m512i b) {
    return _mm512_dpwssd_epi32(acc, a, b);
}

/* A packed panel (or pair) against `rows` int8 rows of x, at W bits a vector. */
#define K_PANEL(W, TARGET, SUFFIX)                                                            \
    TARGET INLINE void kpanel_##SUFFIX##_##W(int fmt, const uint8_t *panel, int64_t twin,    \
                                             int64_t next, int64_t k, int rows,              \
                                             const int8_t *x,                                \
                                             const float *xd, const int16_t *sums, float *y, \
                                             int64_t y_stride, int cols) {                   \
        const int64_t nb = k / QK, psb = kpanel_super_bytes(fmt);                             \
        const int64_t head = kpanel_head(fmt), gb = kpanel_group_bytes(fmt);                  \
        const __m##W##i low = _mm##W##_set1_epi8(0x0f);                                       \
        const __m##W##i high = _mm##W##_set1_epi8(fmt == Q6_K ? 0x30 : 0x10);                 \
        __m##W acc[PANEL_TILE_ROWS];                                                          \
        for (int r = 0; r < rows; r++) acc[r] = _mm##W##_setzero_ps();                        \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const uint8_t *src = panel + b * psb;                                             \
            prefetch_panels(src, b * psb, psb, twin, next);                                   \
            __m##W##i isum[PANEL_TILE_ROWS], imin[PANEL_TILE_ROWS];                           \
            for (int r = 0; r < rows; r++) isum[r] = imin[r] = _mm##W##_setzero_si##W();      \
            for (int g = 0; g < GROUPS; g++) {                                                \
                const uint8_t *group = src + head + g * gb;                                   \
                for (int h = 0; h < 2; h++) { /* elements 16h.. of every row */               \
                    const uint8_t *sc = src + (fmt == Q6_K ? 16 + PANEL * (2 * g + h)         \
                                                           : 32 + PANEL * g);                 \
                    __m##W##i scale = pairs_##W(sc, sc, twin, fmt == Q6_K), q[4];             \
                    __m##W##i bits = fmt == Q4_K ? low                                        \
                                                 : bytes_##W(group + 128 + (fmt == Q6_K ?     \
                                                             GROUP_BYTES * h : 0), twin);     \
                    for (int t = 0; t < 4; t++) {                                             \
                        __m##W##i v = bytes_##W(group + GROUP_BYTES * t, twin);               \
                        q[t] = _mm##W##_and_si##W(h ? _mm##W##_srli_epi16(v, 4) : v, low);    \
                        if (fmt == Q5_K)                                                      \
                            q[t] = OR_MASKED_##SUFFIX##_##W(q[t], FIFTH_TO_4(W, bits, 2 * t + h), \
                                                            high);                            \
                        else if (fmt == Q6_K)                                                 \
                            q[t] = OR_MASKED_##SUFFIX##_##W(q[t], FIFTH_TO_4(W, bits, 2 * t), \
                                                            high);                            \
                    }                                                                         \
                    for (int r = 0; r < rows; r++) {                                          \
                        const int8_t *xb = x + r * k + b * QK + 32 * g + 16 * h;              \
                        __m##W##i a = _mm##W##_add_epi16(                                     \
                            _mm##W##_maddubs_epi16(q[0], x4_##W(xb)),                         \
                            _mm##W##_maddubs_epi16(q[1], x4_##W(xb + 4)));                    \
                        __m##W##i c = _mm##W##_add_epi16(                                     \
                            _mm##W##_maddubs_epi16(q[2], x4_##W(xb + 8)),                     \
                            _mm##W##_maddubs_epi16(q[3], x4_##W(xb + 12)));                   \
                        if (fmt == Q6_K)                                                      \
                            isum[r] = madd_##SUFFIX##_##W(madd_##SUFFIX##_##W(isum[r], a, scale), \
                                                          c, scale);                          \
                        else                                                                  \
                            isum[r] = madd_##SUFFIX##_##W(isum[r], _mm##W##_add_epi16(a, c),  \
                                                          scale);                             \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int g = 0; g < GROUPS; g++) { /* x's sums 2g, 2g + 1 times the offsets */    \
                __m##W##i offsets =                                                           \
                    fmt == Q6_K ? pairs_##W(src + 16 + PANEL * 2 * g,                         \
                                            src + 16 + PANEL * (2 * g + 1), twin, 1)          \
                                : pairs_##W(src + 96 + PANEL * g, src + 96 + PANEL * g, twin, 0); \
                for (int r = 0; r < rows; r++)                                                \
                    imin[r] = madd_##SUFFIX##_##W(                                            \
                        imin[r], offsets,                                                     \
                        x4_##W((const int8_t *)(sums + (r * nb + b) * SUMS + 2 * g)));        \
            }                                                                                 \
            __m##W dw = halves_##W(src, twin);                                                \
            __m##W dmin = fmt == Q6_K ? dw : halves_##W(src + 16, twin);                      \
            for (int r = 0; r < rows; r++) {                                                  \
                __m##W xdr = _mm##W##_set1_ps(xd[r * nb + b]);                                \
                if (fmt == Q6_K) /* 32 times the scales times x's sums */                     \
                    isum[r] = _mm##W##_sub_epi32(isum[r], _mm##W##_slli_epi32(imin[r], 5));   \
                acc[r] = _mm##W##_fmadd_ps(_mm##W##_cvtepi32_ps(isum[r]),                     \
                                           _mm##W##_mul_ps(dw, xdr), acc[r]);                 \
                if (fmt != Q6_K)                                                              \
                    acc[r] = _mm##W##_fnmadd_ps(_mm##W##_cvtepi32_ps(imin[r]),                \
                                                _mm##W##_mul_ps(dmin, xdr), acc[r]);          \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < rows; r++) store_##W(acc[r], y + r * y_stride, cols);             \
    }

K_PANEL(256, AVX2, avx2)
K_PANEL(256, AVX512, vnni)
K_PANEL(512, AVX512, vnni)

/* Rows of x in a tile of the AVX2 K-quant panels: a half's four groups, the scales
 * and six rows' block sums fit AVX2's 16 registers with room to spare. On Zen 4,
 * 1,024 x 2,048 at 9 / 16 / 64 rows: Q4_K 0.199 / 0.349 / 1.330 ms against 0.221 /
 * 0.363 / 1.384 in tiles of 4, Q6_K 0.249 / 0.421 / 1.598 against 0.275 / 0.439 /
 * 1.695; tiles of 8 were as fast for Q4_K, slower for Q6_K (0.267 / 0.422 /
 * 1.668). */
#define KAVX2_TILE_ROWS 6

#define BY_KAVX2_TILE_ROWS BY_SIX_ROWS /* tiles of 1..KAVX2_TILE_ROWS rows */
_Static_assert(KAVX2_TILE_ROWS == 6, "BY_KAVX2_TILE_ROWS dispatches tiles of 1..6 rows");

/* kpanel_<SUFFIX><W>_<FMT>: one format, width and instruction set (a kpanel_fn), the
 * tile's row count a constant in each instance: AVX2 (16 registers) tiles of
 * KAVX2_TILE_ROWS, VNNI (32) of INT8_TILE_ROWS (single panels below PAIR_MIN_ROWS
 * rows of x: panel_tile's). */
#define K_TILE_avx2256(R)                                                                     \
    kpanel_avx2_256(FORMAT, panel, twin, next, k, R, x, xd, sums, y, y_stride, cols)
#define K_TILE_vnni256(R)                                                                     \
    kpanel_vnni_256(FORMAT, panel, twin, next, k, R, x, xd, sums, y, y_stride, cols)
#define K_TILE_vnni512(R)                                                                     \
    kpanel_vnni_512(FORMAT, panel, twin, next, k, R, x, xd, sums, y, y_stride, cols)

#define K_KERNEL(TARGET, SUFFIX, W, FMT, BY_ROWS)                                             \
    TARGET static void kpanel_##SUFFIX##W##_##FMT(const uint8_t *panel, int64_t twin,         \
                                                  int64_t next, int64_t k, int rows,          \
                                                  const int8_t *x,                            \
                                                  const float *xd, const int16_t *sums,       \
                                                  float *y, int64_t y_stride, int cols) {     \
        enum { FORMAT = FMT };                                                                \
        BY_ROWS(rows, K_TILE_##SUFFIX##W)                                                     \
    }

K_KERNEL(AVX2, avx2, 256, Q4_K, BY_KAVX2_TILE_ROWS)
K_KERNEL(AVX2, avx2, 256, Q5_K, BY_KAVX2_TILE_ROWS)
K_KERNEL(AVX2, avx2, 256, Q6_K, BY_KAVX2_TILE_ROWS)
K_KERNEL(AVX512, vnni, 256, Q4_K, BY_PANEL_TILE_ROWS)
K_KERNEL(AVX512, vnni, 256, Q5_K, BY_PANEL_TILE_ROWS)
K_KERNEL(AVX512, vnni, 256, Q6_K, BY_PANEL_TILE_ROWS)
K_KERNEL(AVX512, vnni, 512, Q4_K, BY_INT8_TILE_ROWS)
K_KERNEL(AVX512, vnni, 512, Q5_K, BY_INT8_TILE_ROWS)
K_KERNEL(AVX512, vnni, 512, Q6_K, BY_INT8_TILE_ROWS)
#endif

/* The packed kernel `isa` runs for `fmt` one panel at a time (NULL: the portable one). */
static kpanel_fn fast_kpanel(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX512_VNNI) switch (fmt) {
        case Q4_K: return kpanel_vnni256_Q4_K;
        case Q5_K: return kpanel_vnni256_Q5_K;
        case Q6_K: return kpanel_vnni256_Q6_K;
        }
    if (isa >= ISA_AVX2) switch (fmt) {
        case Q4_K: return kpanel_avx2256_Q4_K;
        case Q5_K: return kpanel_avx2256_Q5_K;
        case Q6_K: return kpanel_avx2256_Q6_K;
        }
#endif
    (void)isa;
    (void)fmt;
    return 0;
}

/* The kernel that takes two adjacent panels at a time (NULL: none for `isa`). */
static kpanel_fn fast_kpair(int isa, int fmt) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX512_VNNI) switch (fmt) {
        case Q4_K: return kpanel_vnni512_Q4_K;
        case Q5_K: return kpanel_vnni512_Q5_K;
        case Q6_K: return kpanel_vnni512_Q6_K;
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
        for (int64_t b = 0; b < nb; b++) super_floats_isa(isa, fmt, row + b * unit, out + i * k + b * QK);
    }
}

/* y[M, N] (row stride n) columns [n0, n1) = x W^T for fp32 x and its sums per
 * group of 32 (row stride k / 32): each W row read once per CHUNK_ROWS rows of x,
 * in tiles of TILE_ROWS. */
static void product(int isa, int fmt, const uint8_t *w, int64_t n, int64_t n0, int64_t n1,
                    int64_t k, const float *x, const float *xsum, int64_t m, float *y) {
    int64_t stride = k / QK * super_bytes(fmt), groups = k / 32;
    row_fn fast = isa >= ISA_AVX2 ? avx2_row(fmt) : 0;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
        for (int64_t j = n0; j < n1; j++) {
            const uint8_t *wrow = w + j * stride;
            for (int64_t r = m0; r < m1; r += TILE_ROWS) {
                int rows = m1 - r < TILE_ROWS ? (int)(m1 - r) : TILE_ROWS;
                float *yr = y + r * n + j;
                if (fast)
                    fast(wrow, k, rows, x + r * k, xsum + r * groups, yr, n);
                else
                    row_portable(fmt, wrow, k, rows, x + r * k, yr, n);
            }
        }
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
    int threads = threads_for(n * (k / 32) * m);
    int64_t shares = (n + SHARE_ROWS - 1) / SHARE_ROWS; /* to whichever thread is free */
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (int64_t s = 0; s < shares; s++) {
        int64_t n1 = (s + 1) * SHARE_ROWS < n ? (s + 1) * SHARE_ROWS : n;
        product(isa, fmt, w, n, s * SHARE_ROWS, n1, k, x, xsum, m, y);
    }
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

/* A product's kernels and activations (quantize_q8k's), for kpanel_tile. */
typedef struct {
    int fmt;
    int64_t n, k, nb;
    kpanel_fn fast, pair; /* one panel, two (NULL: portable; none) */
    const int8_t *xq;
    const float *xd;
    const int16_t *sums;
} kpanel_sweep;

/* A tile_fn: a panel (or pair) against rows r.. of x. */
static void kpanel_tile(const void *sweep, const uint8_t *panel, int64_t twin, int64_t next,
                        int64_t r, int rows, float *y, int cols) {
    const kpanel_sweep *s = sweep;
    kpanel_fn run = twin ? s->pair : s->fast;
    const int8_t *xr = s->xq + r * s->k;
    const float *dr = s->xd + r * s->nb;
    const int16_t *sr = s->sums + r * s->nb * SUMS;
    if (run)
        run(panel, twin, next, s->k, rows, xr, dr, sr, y, s->n, cols);
    else
        kpanel_portable(s->fmt, panel, s->k, rows, xr, dr, sr, y, s->n, cols);
}

/* y[M, N] = x W^T for W [N, k] packed by tserve_kpack and fp32 x [M, k] (M >= 1),
 * quantized per super-block (quantize_q8k) into a scratch copy; the panels (from
 * KPAIR_MIN_ROWS rows of x on AVX-512, pairs of them) swept as tserve_qlinear_int8's
 * are. Returns 0, or -1 when the scratch cannot be allocated (y untouched). */
int tserve_kqlinear_int8(int isa, int fmt, const uint8_t *packed, int64_t n, int64_t k,
                         const float *x, int64_t m, float *y) {
    int64_t nb = k / QK, supers = m * nb;
    kpanel_fn fast = fast_kpanel(isa, fmt), pair = m >= KPAIR_MIN_ROWS ? fast_kpair(isa, fmt) : 0;
    int8_t *xq = scratch(m * k + supers * (int64_t)(sizeof(float) + SUMS * sizeof(int16_t)));
    if (!xq) return -1;
    float *xd = (float *)(xq + m * k); /* m * k: a multiple of 256 */
    int16_t *sums = (int16_t *)(xd + supers);
    quantize_q8k(isa, x, m, k, xq, xd, sums);
    kpanel_sweep sweep = {fmt, n, k, nb, fast, pair, xq, xd, sums};
    int64_t tile = !fast ? INT8_TILE_ROWS : isa < ISA_AVX512_VNNI ? KAVX2_TILE_ROWS : panel_tile(m);
    int threads = threads_for(n * (k / 32) * m);
#pragma omp parallel num_threads(threads) if (threads > 1)
    sweep_panels(packed, n, m, nb * kpanel_super_bytes(fmt), pair ? 2 : 1, tile, y, kpanel_tile,
                 &sweep);
    free(xq);
    return 0;
}
