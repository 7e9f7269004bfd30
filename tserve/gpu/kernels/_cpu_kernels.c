/* Fused fp32 CPU kernels for tserve's own Llama forward pass (tserve/gpu/kernels/_cpu_kernels.py).
 *
 * Each replaces several torch calls that each read and write a whole tensor
 * (and pay a dispatch) with one pass over the data. Single-threaded, as the
 * engine is by default; contiguous rows of floats unless a stride says
 * otherwise. Reductions keep LANES independent partial sums, so the compiler
 * vectorizes them without reassociating anything it is not told to.
 *
 * The KV pool holds fp32, fp16 or bf16 (`kv_type`, a KV_* code). The kernels
 * that touch it compute in fp32: a key or value row is widened as it is read
 * and rounded to nearest even as it is written, as torch's casts do.
 */
#include "_glue.h"
#include "_kernels.h"
#include "_quant_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
/* Each exported loop's body is compiled for x86-64-v4 (AVX-512), x86-64-v3
 * (AVX2, FMA, F16C) and plain x86-64 (_glue.h's GLUE_ENTRY, at the end of
 * this file), and each call runs the best this CPU has, capped by
 * tserve_set_isa_cap (TSERVE_MAX_ISA), so a capped run is what a CPU without
 * the rest would run. Reading fp16 K/V widens 8 values an instruction with F16C, else in
 * portable integer code (from_f16); writing one token's K/V rounds value by
 * value (F16C's, or libgcc's, conversion). */
#endif
#define LANES 16

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* _cpu_kernels.py's KV_TYPES */
enum { KV_F16_F16C = 3 }; /* KV_F16 on a CPU with F16C: the kernels' own choice */

/* The float an fp16 bit pattern stands for, exactly (subnormals, infinities and
 * NaNs included), in integer and float operations that vectorize on any SIMD
 * (GCC 12 widens _Float16 one value at a time even with F16C): the exponent
 * is rebased from 15 to 127; a subnormal or zero is rebuilt as the normal
 * float 2^-14 * (1 + m) minus 2^-14, which rounds nothing. */
static inline __attribute__((always_inline)) float from_f16(uint16_t h) {
    uint32_t shifted = (uint32_t)(h & 0x7fffu) << 13, exponent = shifted & 0x0f800000u;
    uint32_t normal = shifted + ((uint32_t)(127 - 15) << 23);
    if (exponent == 0x0f800000u) normal += (uint32_t)(128 - 16) << 23; /* Inf, NaN */
    uint32_t rebuilt = normal + (1u << 23);
    float f, low;
    memcpy(&f, &normal, sizeof f);
    memcpy(&low, &rebuilt, sizeof low);
    low -= 0x1p-14f;
    f = exponent == 0 ? low : f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__x86_64__)
/* `n` fp16 values widened with F16C, 8 an instruction; only where the CPU has it
 * (inlined into the x86-64-v3 and v4 clones, which have it by definition). */
__attribute__((target("avx,f16c"))) static inline void widen_f16c(const uint16_t *src, float *dst,
                                                                 int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = from_f16(src[i]);
}

/* widen_f16c of a multiple of 8 values. */
__attribute__((target("avx,f16c"))) static inline void widen_f16c_eights(const uint16_t *src,
                                                                        float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}
#endif

/* KV_F16_F16C where the CPU has F16C and `kv_type` is KV_F16, else `kv_type`. */
static int kv_type_here(int kv_type) {
#if defined(__x86_64__)
    if (kv_type == KV_F16 && __builtin_cpu_supports("f16c")) return KV_F16_F16C;
#endif
    return kv_type;
}

/* Row `row` (of `dim` values) of a pool of `kv_type`, as floats: a pointer into
 * the pool itself for fp32, else `tmp` (dim floats) filled with the widened row. */
static inline __attribute__((always_inline)) const float *kv_row(const void *pool, int64_t row,
                                                                 int64_t dim, int kv_type,
                                                                 float *tmp) {
    if (kv_type == KV_F32) return (const float *)pool + row * dim;
#if defined(__x86_64__)
    if (kv_type == KV_F16_F16C) {
        widen_f16c((const uint16_t *)pool + row * dim, tmp, dim);
        return tmp;
    }
#endif
    if (kv_type == KV_F16) {
        const uint16_t *src = (const uint16_t *)pool + row * dim;
        for (int64_t i = 0; i < dim; i++) tmp[i] = from_f16(src[i]);
    } else {
        const uint16_t *src = (const uint16_t *)pool + row * dim;
        for (int64_t i = 0; i < dim; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(tmp + i, &bits, sizeof bits);
        }
    }
    return tmp;
}

/* bf16 nearest to x, ties to even, as torch rounds (NaN stays a quiet NaN). */
static inline __attribute__((always_inline)) uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Values offset .. offset + count (a multiple of 8) of row `row` (of `dim`
 * values) of a pool of `kv_type`, as floats: a pointer into the pool itself
 * for fp32, else `tmp` (count floats) filled with them widened, as kv_row
 * widens them. */
static inline __attribute__((always_inline)) const float *kv_part(const void *pool, int64_t row,
                                                                  int64_t dim, int64_t offset,
                                                                  int64_t count, int kv_type,
                                                                  float *tmp) {
    if (kv_type == KV_F32) return (const float *)pool + row * dim + offset;
    const uint16_t *src = (const uint16_t *)pool + row * dim + offset;
#if defined(__x86_64__)
    if (kv_type == KV_F16_F16C) {
        widen_f16c_eights(src, tmp, count);
        return tmp;
    }
#endif
    if (kv_type == KV_F16) {
        for (int64_t i = 0; i < count; i++) tmp[i] = from_f16(src[i]);
    } else {
        for (int64_t i = 0; i < count; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(tmp + i, &bits, sizeof bits);
        }
    }
    return tmp;
}

/* Writes `dim` floats as row `row` of a pool of `kv_type`, rounded to nearest even. */
static inline __attribute__((always_inline)) void kv_store(void *pool, int64_t row, int64_t dim,
                                                           int kv_type, const float *src) {
    if (kv_type == KV_F32) {
        memcpy((float *)pool + row * dim, src, (size_t)dim * sizeof(float));
    } else if (kv_type == KV_F16) {
        _Float16 *dst = (_Float16 *)pool + row * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = (_Float16)src[i];
    } else {
        uint16_t *dst = (uint16_t *)pool + row * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = to_bf16(src[i]);
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int width = LANES / 2; width > 0; width /= 2)  /* pairwise, as SIMD reductions add */
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    float sum = acc[0];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out[r, i] = silu(gate) * up for gate_up rows [gate (inter) | up (inter)]:
 * silu(g) = g / (1 + e^-g), written with e = exp(-|g|) so exp sees only x <= 0. */
GLUE void silu_mul_body(const float *gate_up, int64_t rows, int64_t inter, float *out,
                     float *scratch) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) scratch[i] = -fabsf(gate[i]);
        exp_nonpositive(scratch, inter);
        for (int64_t i = 0; i < inter; i++) {
            float e = scratch[i], g = gate[i];
            o[i] = (g >= 0.0f ? g : g * e) / (1.0f + e) * up[i];
        }
    }
}

/* out[r, i] = gelu_tanh(gate) * up for gate_up rows [gate (inter) | up (inter)]:
 * gelu_tanh(g) = g (1 + tanh u) / 2 = g / (1 + e^(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3),
 * written with e = exp(-2|u|) so exp sees only x <= 0. */
GLUE void gelu_tanh_mul_body(const float *gate_up, int64_t rows, int64_t inter, float *out,
                                 float *scratch) {
    const float c = 0.7978845608028654f;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float g = gate[i];
            scratch[i] = -2.0f * fabsf(c * (g + 0.044715f * g * g * g));
        }
        exp_nonpositive(scratch, inter);
        for (int64_t i = 0; i < inter; i++) {
            float e = scratch[i], g = gate[i];
            float u = c * (g + 0.044715f * g * g * g);
            o[i] = (u >= 0.0f ? g : g * e) / (1.0f + e) * up[i];
        }
    }
}

/* residual += hidden (when add), then out = RMSNorm(residual) * weight, row by row. */
GLUE void add_rms_norm_body(float *residual, const float *hidden, const float *weight, float *out,
                         int64_t rows, int64_t dim, float eps, int add) {
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        if (add) {
            const float *h = hidden + r * dim;
            for (int64_t i = 0; i < dim; i++) res[i] += h[i];
        }
        float inv = 1.0f / sqrtf(dot(res, res, dim) / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = res[i] * inv * weight[i];
    }
}

/* RoPE (the rotate-half form) in place on the Q and K heads (the first
 * heads + kv_heads) of each token's row of `qkv` ([tokens, row_stride]: Q
 * heads, K heads, V heads, each `head_dim` wide), with cos/sin tables
 * [positions, head_dim / 2]; then writes each token's K and V heads into the
 * pool ([kv_heads, slots, head_dim] each, of `kv_type`) at its slot. */
static inline __attribute__((always_inline)) void rope_store(
    float *qkv, int64_t tokens, int64_t row_stride, int64_t heads, int64_t kv_heads,
    int64_t head_dim, const int64_t *positions, const float *cos_table, const float *sin_table,
    const int64_t *slots, void *k_pool, void *v_pool, int64_t num_slots, int kv_type) {
    int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x1 = row + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t dst = g * num_slots + slots[t];
            kv_store(k_pool, dst, head_dim, kv_type, row + (heads + g) * head_dim);
            kv_store(v_pool, dst, head_dim, kv_type, row + (heads + kv_heads + g) * head_dim);
        }
    }
}

GLUE void rope_store_body(float *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, const int64_t *positions,
                              const float *cos_table, const float *sin_table,
                              const int64_t *slots, void *k_pool, void *v_pool,
                              int64_t num_slots, int kv_type) {
#define ROPE_STORE(T)                                                                     \
    rope_store(qkv, tokens, row_stride, heads, kv_heads, head_dim, positions, cos_table, \
               sin_table, slots, k_pool, v_pool, num_slots, T)
    switch (kv_type) { /* one copy of the loop per type, each with its conversion inlined */
    case KV_F16: ROPE_STORE(KV_F16); break;
    case KV_BF16: ROPE_STORE(KV_BF16); break;
    default: ROPE_STORE(KV_F32); break;
    }
#undef ROPE_STORE
}

/* Decode attention works in vectors of 8 floats (one ymm register in the
 * x86-64-v3 and v4 clones, two xmm in the portable one): register tiles
 * sized for AVX2's 16 registers. */
typedef float f32x8 __attribute__((vector_size(8 * sizeof(float))));
typedef float f32x4 __attribute__((vector_size(4 * sizeof(float))));

/* 8 floats at any float's alignment: a plain (unaligned) vector load. */
typedef float f32x8_any __attribute__((vector_size(8 * sizeof(float)), aligned(sizeof(float))));
#define LOAD8(dst, src) ((dst) = *(const f32x8_any *)(src))

/* The lane sums of a, b, c and d as one vector of four, by two rounds of
 * interleaving adds and one of halves (10 shuffles and adds, not 4 x 6). */
static inline __attribute__((always_inline)) f32x4 sum4(f32x8 a, f32x8 b, f32x8 c, f32x8 d) {
    f32x8 ab = __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
    f32x8 cd = __builtin_shufflevector(c, d, 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(c, d, 2, 10, 3, 11, 6, 14, 7, 15);
    f32x8 all = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(all, all, 0, 1, 2, 3) +
           __builtin_shufflevector(all, all, 4, 5, 6, 7);
}

/* Where key or value p of a sequence lies: its pool row, stepping through the
 * block table one position at a time (no division per key). */
typedef struct {
    const int64_t *table;
    int64_t block_size, head_row, block, offset;
} slot_walk;

static inline __attribute__((always_inline)) slot_walk walk_from(const int64_t *table,
                                                                 int64_t block_size,
                                                                 int64_t head_row, int64_t p) {
    return (slot_walk){table, block_size, head_row, p / block_size, p % block_size};
}

static inline __attribute__((always_inline)) int64_t walk_next(slot_walk *w) {
    int64_t row = w->head_row + w->table[w->block] * w->block_size + w->offset;
    if (++w->offset == w->block_size) w->offset = 0, w->block++;
    return row;
}

/* Keys ahead of the one being scored whose K and V rows score_heads asks for.
 * A step's weights stream through the caches before its attention, so its
 * K/V come from memory; on a 2-core Zen 4, SmolLM2's 64 streams of 64 to 96
 * fp32 keys were read at 6.1-6.4 GB/s (26 warm), 7.7-8.1 with these requests;
 * 16 of 500 to 700 keys at 6.5-6.8 and 8.4-8.8 (fp16 K/V 25-30 % faster
 * too); Gemma 3's fp32 rows (1 KiB) gained nothing, its fp16 ones 10-20 %
 * (benchmarks/decode_attention.py --cold). Asked for 8 or 32 keys ahead, or
 * 2 to 8 KiB of rows ahead, they measured alike. */
#define KV_AHEAD 16

/* Asks for every cache line of row `row` (`dim` values) of a pool of `kv_type`
 * into L2: a prefetch, which neither faults nor waits. Not into L1: its few
 * miss buffers held a key's K row (4 to 16 lines) each, and once they were
 * full every further request waited for one of them to free, the scoring's
 * loads behind it. Asking for K into L2 like V made the cold calls above 20 to
 * 35 % faster (SmolLM2's 16 x 500-700 keys 1.69-1.78 -> 1.05-1.17 ms, 64 x
 * 64-96 0.99-1.06 -> 0.71-0.87, Gemma 3's 64 x 64-96 1.58 -> 1.23). */
static inline __attribute__((always_inline)) void kv_prefetch(const void *pool, int64_t row,
                                                              int64_t dim, int kv_type) {
    int64_t bytes = dim * (kv_type == KV_F32 ? (int64_t)sizeof(float) : 2);
    const char *at = (const char *)pool + row * bytes;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + line, 0, 2);
}

/* Asks for key `row`'s K and V rows (weigh_heads reads V after every score). */
static inline __attribute__((always_inline)) void kv_prefetch_key(const void *k_pool,
                                                                  const void *v_pool, int64_t row,
                                                                  int64_t dim, int kv_type) {
    kv_prefetch(k_pool, row, dim, kv_type);
    kv_prefetch(v_pool, row, dim, kv_type);
}

/* scores[j * len + p] = (q_j . k_p) * scale for NH (1..4) query heads at q
 * (head_dim apart) and keys p = first .. len - 1: NK keys at a time, NH x NK
 * sums of 8 lanes in registers over head_dim (a multiple of 8), reduced four
 * at a time by sum4. A key row of another type than fp32 is widened once
 * into one of `widened`'s NK rows and serves all NH heads. With `ask`
 * (a KV head's first pass; later ones find the rows in cache), the K and V
 * rows of key p + KV_AHEAD are asked for while key p is scored. */
static inline __attribute__((always_inline)) void score_heads(
    int nh, const float *q, const void *k_pool, const void *v_pool, int ask, slot_walk walk,
    int64_t first, int64_t len, int64_t head_dim, float scale, int kv_type, float *widened,
    float *scores) {
    enum { NK = 4 };
    slot_walk ahead = walk; /* KV_AHEAD keys on, never past the last: the table ends there */
    for (int64_t p = first; ask && p < first + KV_AHEAD && p < len; p++)
        kv_prefetch_key(k_pool, v_pool, walk_next(&ahead), head_dim, kv_type);
    for (int64_t p = first; p < len; p += NK) {
        int nk = len - p < NK ? (int)(len - p) : NK;
        for (int c = 0; ask && c < nk && p + c + KV_AHEAD < len; c++)
            kv_prefetch_key(k_pool, v_pool, walk_next(&ahead), head_dim, kv_type);
        const float *k[NK];
        k[0] = kv_row(k_pool, walk_next(&walk), head_dim, kv_type, widened);
        for (int c = 1; c < NK; c++) /* past the last key: the first again, its sums unused */
            k[c] = c < nk ? kv_row(k_pool, walk_next(&walk), head_dim, kv_type,
                                   widened + c * head_dim)
                          : k[0];
        f32x8 acc[4][NK];
        for (int j = 0; j < nh; j++)
            for (int c = 0; c < NK; c++) acc[j][c] = (f32x8){0};
        for (int64_t d = 0; d < head_dim; d += 8) {
            f32x8 keys[NK], qj;
            for (int c = 0; c < NK; c++) LOAD8(keys[c], k[c] + d);
            for (int j = 0; j < nh; j++) {
                LOAD8(qj, q + j * head_dim + d);
                for (int c = 0; c < NK; c++) acc[j][c] += qj * keys[c];
            }
        }
        for (int j = 0; j < nh; j++) {
            f32x4 sums = sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            for (int c = 0; c < nk; c++) scores[j * len + p + c] = sums[c] * scale;
        }
    }
}

/* o[j * head_dim + d] = sum over keys p = first .. len - 1, in that order, of
 * w[j * len + p] v_p[d], for NH (1..4) heads: ND vectors of 8 dims at a time
 * (ND = 8, 6, 4, 4 for 1, 2, 3, 4 heads: up to 3 heads' NH x ND sums, a value
 * and NH weights fit AVX2's 16 registers, 4 heads' AVX-512's 32) summed over
 * all the keys; head_dim a multiple of 8. */
static inline __attribute__((always_inline)) void weigh_heads(
    int nh, const float *w, int64_t len, int64_t first, const void *v_pool, slot_walk start,
    int64_t head_dim, int kv_type, float *tmp, float *o) {
    enum { MAX_ND = 8 };
    const int nd_max = nh == 1 ? 8 : nh == 2 ? 6 : 4;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 8 * nd_max) {
        int nd = (head_dim - d0) / 8 < nd_max ? (int)((head_dim - d0) / 8) : nd_max;
        f32x8 acc[4][MAX_ND];
        for (int j = 0; j < nh; j++)
            for (int c = 0; c < nd_max; c++) acc[j][c] = (f32x8){0};
        slot_walk walk = start;
        for (int64_t p = first; p < len; p++) {
            const float *v = kv_part(v_pool, walk_next(&walk), head_dim, d0, 8 * nd, kv_type, tmp);
            f32x8 weight[4];
            for (int j = 0; j < nh; j++) weight[j] = (f32x8){0} + w[j * len + p];
            for (int c = 0; c < nd_max; c++) { /* nd_max bounds it: the tile stays in registers */
                if (c >= nd) break;
                f32x8 x;
                LOAD8(x, v + 8 * c);
                for (int j = 0; j < nh; j++) acc[j][c] += weight[j] * x;
            }
        }
        for (int j = 0; j < nh; j++)
            for (int c = 0; c < nd; c++)
                memcpy(o + j * head_dim + d0 + 8 * c, &acc[j][c], sizeof acc[j][c]);
    }
}

/* The same sums one value at a time, for a head_dim that is not a multiple of 8. */
static void score_scalar(const float *q, const void *k_pool, slot_walk walk, int64_t first,
                         int64_t len, int64_t group, int64_t head_dim, float scale,
                         int kv_type, float *widened, float *scores) {
    for (int64_t p = first; p < len; p++) {
        const float *k = kv_row(k_pool, walk_next(&walk), head_dim, kv_type, widened);
        for (int64_t j = 0; j < group; j++)
            scores[j * len + p] = dot(q + j * head_dim, k, head_dim) * scale;
    }
}

static void weigh_scalar(const float *w, int64_t len, int64_t first, const void *v_pool,
                         slot_walk walk, int64_t group, int64_t head_dim, int kv_type,
                         float *tmp, float *o) {
    memset(o, 0, (size_t)(group * head_dim) * sizeof(float));
    for (int64_t p = first; p < len; p++) {
        const float *v = kv_row(v_pool, walk_next(&walk), head_dim, kv_type, tmp);
        for (int64_t j = 0; j < group; j++)
            for (int64_t d = 0; d < head_dim; d++) o[j * head_dim + d] += w[j * len + p] * v[d];
    }
}

/* row[0 .. n) = exp(row - max row) / sum, the max and the sum in 8 lanes. */
static inline __attribute__((always_inline)) void softmax_row(float *row, int64_t n) {
    int64_t i = 0;
    float top = row[0], tops[8];
    if (n >= 8) {
        memcpy(tops, row, sizeof tops);
        for (i = 8; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; l++) tops[l] = row[i + l] > tops[l] ? row[i + l] : tops[l];
        for (int l = 0; l < 8; l++) top = tops[l] > top ? tops[l] : top;
    }
    for (; i < n; i++) top = row[i] > top ? row[i] : top;
    for (i = 0; i < n; i++) row[i] -= top;
    exp_nonpositive(row, n);
    f32x8 lanes = {0};
    for (i = 0; i + 8 <= n; i += 8) {
        f32x8 x;
        LOAD8(x, row + i);
        lanes += x;
    }
    float total = 0;
    for (int l = 0; l < 8; l++) total += lanes[l];
    for (; i < n; i++) total += row[i];
    float inv = 1.0f / total;
    for (i = 0; i < n; i++) row[i] *= inv;
}

/* How many of a KV head's `group` query heads pass `pass` takes from head
 * `done` on: the fewest passes of at most `most`, as even as they go (4 at
 * most 3: 2 + 2, not 3 + 1, whose lone head has too few sums in flight). */
static inline int64_t heads_in_pass(int64_t group, int64_t done, int64_t pass, int64_t most) {
    int64_t passes = (group + most - 1) / most, left = passes - pass;
    return (group - done + left - 1) / left;
}

static inline int glue_isa(void);

/* Attention of one query per sequence over its keys in the paged pool, read
 * where they lie (no gather). q: [batch] rows of `q_stride` floats holding
 * `heads` heads; out: [batch, heads, head_dim]. Sequence b has lens[b] keys
 * at positions 0.. (with a sliding `window`, > 0, only its last `window` are
 * read; with `softcap` > 0 each score s becomes softcap * tanh(s / softcap)),
 * position p in slot tables[b * width + p / block_size] *
 * block_size + p % block_size. Query head h reads KV head h / (heads /
 * kv_heads). `scores` is scratch of (heads / kv_heads) * max(lens) floats.
 * The pools are of `kv_type`; a key row of another type than fp32 is widened
 * once into a stack buffer and serves every query head of its group (a value
 * row, chunk by chunk). A KV head's query heads go up to three at a time
 * (four with AVX-512's registers): scores four keys at a time (score_heads),
 * P V by register tiles of dims over all keys (weigh_heads), each sum in a
 * fixed order (a value's over the keys one at a time), whatever the batch.
 * At SmolLM2's shape (9 heads on 3 KV heads of 64 dims, 64 sequences of 64
 * to 96 fp32 keys) a call took 0.63 ms of one core with AVX2 and 0.56 ms
 * with AVX-512 (then reading the 7.8 MB of K and V is most of it), against
 * 3.1 and 0.84 ms for one key and four (head, key) pairs at a time in
 * 16-float vectors. */
static inline __attribute__((always_inline)) void paged_decode(
    const float *q, int64_t q_stride, const void *k_pool, const void *v_pool, int64_t num_slots,
    const int64_t *tables, int64_t width, const int64_t *lens, int64_t block_size,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
    int64_t window, float softcap, float *out, float *scores, int kv_type) {
    int64_t group = heads / kv_heads;
    float widened[4 * head_dim];
    int vectors = head_dim % 8 == 0;
    /* Query heads a pass: 4 where the registers are AVX-512's 32, else 3. */
    int64_t most = glue_isa() >= ISA_AVX512_VNNI ? 4 : 3;
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = lens[b], first = window && len > window ? len - window : 0;
        for (int64_t g = 0; g < kv_heads; g++) {
            slot_walk walk = walk_from(tables + b * width, block_size, g * num_slots, first);
            const float *qg = q + b * q_stride + g * group * head_dim;
            float *o = out + (b * heads + g * group) * head_dim;
            if (!vectors)
                score_scalar(qg, k_pool, walk, first, len, group, head_dim, scale, kv_type,
                             widened, scores);
            for (int64_t j = 0, nh, pass = 0; vectors && j < group; j += nh, pass++) {
                nh = heads_in_pass(group, j, pass, most);
                const float *qj = qg + j * head_dim;
                float *s = scores + j * len;
#define S_ARGS qj, k_pool, v_pool, pass == 0, walk, first, len, head_dim, scale, kv_type, widened, s
                switch (nh) { /* heads as constants: registers */
                case 1: score_heads(1, S_ARGS); break;
                case 2: score_heads(2, S_ARGS); break;
                case 3: score_heads(3, S_ARGS); break;
                default: score_heads(4, S_ARGS); break;
                }
#undef S_ARGS
            }
            for (int64_t j = 0; j < group; j++) {
                float *row = scores + j * len + first;
                if (softcap > 0.0f)
                    for (int64_t p = 0; p < len - first; p++)
                        row[p] = softcap * tanhf(row[p] / softcap);
                softmax_row(row, len - first);
            }
            if (!vectors)
                weigh_scalar(scores, len, first, v_pool, walk, group, head_dim, kv_type, widened,
                             o);
            for (int64_t j = 0, nh, pass = 0; vectors && j < group; j += nh, pass++) {
                nh = heads_in_pass(group, j, pass, most);
                const float *w = scores + j * len;
                float *oj = o + j * head_dim;
#define W_ARGS w, len, first, v_pool, walk, head_dim, kv_type, widened, oj
                switch (nh) {
                case 1: weigh_heads(1, W_ARGS); break;
                case 2: weigh_heads(2, W_ARGS); break;
                case 3: weigh_heads(3, W_ARGS); break;
                default: weigh_heads(4, W_ARGS); break;
                }
#undef W_ARGS
            }
        }
    }
}

GLUE void paged_decode_body(const float *q, int64_t q_stride, const void *k_pool,
                                const void *v_pool, int64_t num_slots, const int64_t *tables,
                                int64_t width, const int64_t *lens, int64_t block_size,
                                int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                float scale, int64_t window, float softcap, float *out,
                                float *scores, int kv_type) {
#define PAGED_DECODE(T)                                                                      \
    paged_decode(q, q_stride, k_pool, v_pool, num_slots, tables, width, lens, block_size,    \
                 batch, heads, kv_heads, head_dim, scale, window, softcap, out, scores, T)
    switch (kv_type_here(kv_type)) { /* one copy of the loop per type, conversion inlined */
    case KV_F16_F16C: PAGED_DECODE(KV_F16_F16C); break;
    case KV_F16: PAGED_DECODE(KV_F16); break;
    case KV_BF16: PAGED_DECODE(KV_BF16); break;
    default: PAGED_DECODE(KV_F32); break;
    }
#undef PAGED_DECODE
}

/* Linear layers for few rows, where the weight's bytes are the cost: y[M, N]
 * = x[M, K] W^T (+ bias), W packed once into panels of PANEL output columns,
 * each stored k-major ([panels][K][PANEL], zero padded past N), so a panel
 * is one sequential stream. Every panel is read from memory once whatever M
 * is: blocks of rows in turn reuse it from L2 (a panel is K * 128 bytes).
 * A tile of the output lives in registers for the whole K loop: with
 * AVX-512, BLOCK_ROWS x PANEL in 24 of the 32 vector registers; with AVX2
 * (16 registers of 8), AVX2_BLOCK_ROWS x PANEL in 12 (one row: 8, odd k
 * apart, so that two FMAs per sum are in flight). Measured on one core of
 * an AVX-512 Xeon, AVX2 x PANEL tiles of 3 rows ran 4 and 16 rows 1.4
 * times as fast as 6 rows x half a panel.
 * With more rows than one block, the first block of a panel waits on memory
 * and the others on the FMAs; so that the two overlap, the later blocks
 * prefetch the next panel into L2 as they run (each a share of its k rows,
 * two lines a row), and its first block finds it there. Measured on one core
 * of an AVX-512 Xeon over SmolLM2's layers, that ran 8 to 64 rows 1.1 to 1.25
 * times as fast on AVX2, 32 and 64 rows 1.25 times on AVX-512.
 * `isa` picks the variant (ISA_* of _quant_common.h: ISA_AVX512_VNNI runs
 * AVX-512 F, ISA_AVX2 AVX2 + FMA); below ISA_AVX2 it must not be called. */
#define PANEL 32
#define BLOCK_ROWS 12
#define AVX2_BLOCK_ROWS 3
#define PREFETCH_ROWS 32 /* k rows ahead (4 KiB): the hardware prefetcher alone lags */

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f")))
/* What a block prefetches of the next panel: at step k of its k loop, k row
 * `first + k * step / 2^16` (its share of rows spread over the loop) into L2. */
typedef struct {
    const float *panel; /* the next panel; NULL: nothing to prefetch */
    int64_t first, step;
} Ahead;

static inline __attribute__((always_inline)) void prefetch_next(const Ahead *ahead, int64_t k) {
    if (!ahead->panel) return;
    int64_t at = ahead->first + ((k * ahead->step) >> 16);
    const char *row = (const char *)(ahead->panel + at * PANEL);
    _mm_prefetch(row, _MM_HINT_T1);
    _mm_prefetch(row + 64, _MM_HINT_T1);
}

/* The share of the next panel's k rows that block `block` (> 0) of `blocks`
 * prefetches: none with fewer than 3 blocks (one block after the first has too
 * few FMAs to hide a panel's read behind; measured slower at 4 rows on AVX2). */
static inline Ahead ahead_for(const float *next, int64_t k_dim, int64_t block, int64_t blocks) {
    Ahead ahead = {0, 0, 0};
    if (!next || block == 0 || blocks < 3) return ahead;
    int64_t share = (k_dim + blocks - 2) / (blocks - 1);
    int64_t first = (block - 1) * share, rows = k_dim - first < share ? k_dim - first : share;
    if (rows <= 0) return ahead;
    ahead.panel = next;
    ahead.first = first;
    ahead.step = ((rows << 16) + k_dim - 1) / k_dim; /* at most 1 << 16: no row skipped */
    return ahead;
}

AVX512 static inline __attribute__((always_inline)) void linear_tile(
    int rows, const float *x, int64_t k_dim, const float *panel, const float *bias,
    float *y, int64_t n_dim, __mmask16 low, __mmask16 high, const Ahead *ahead) {
    __m512 acc[BLOCK_ROWS][2];
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
    __m512 b1 = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) acc[m][0] = b0, acc[m][1] = b1;
    for (int64_t k = 0; k < k_dim; k++) {
        const float *w = panel + k * PANEL;
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL + 16), _MM_HINT_T0);
        prefetch_next(ahead, k);
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        for (int m = 0; m < rows; m++) {
            __m512 xm = _mm512_set1_ps(x[m * k_dim + k]);
            acc[m][0] = _mm512_fmadd_ps(xm, w0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xm, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm512_mask_storeu_ps(y + m * n_dim, low, acc[m][0]);
        _mm512_mask_storeu_ps(y + m * n_dim + 16, high, acc[m][1]);
    }
}

#define TILE(R) \
    case R: linear_tile(R, xs, k_dim, panel, b, ys, n_dim, low, high, &ahead); break;

AVX512 static void linear_avx512(const float *x, int64_t m_dim, int64_t k_dim,
                                 const float *packed, const float *bias, int64_t n_dim,
                                 float *y) {
    for (int64_t p = 0; p * PANEL < n_dim; p++) {
        int64_t cols = n_dim - p * PANEL;
        __mmask16 low = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
        __mmask16 high = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
        const float *panel = packed + p * k_dim * PANEL, *b = bias ? bias + p * PANEL : 0;
        const float *next = (p + 1) * PANEL < n_dim ? panel + k_dim * PANEL : 0;
        int64_t blocks = (m_dim + BLOCK_ROWS - 1) / BLOCK_ROWS;
        for (int64_t m0 = 0; m0 < m_dim; m0 += BLOCK_ROWS) {
            Ahead ahead = ahead_for(next, k_dim, m0 / BLOCK_ROWS, blocks);
            const float *xs = x + m0 * k_dim;
            float *ys = y + m0 * n_dim + p * PANEL;
            switch (m_dim - m0 < BLOCK_ROWS ? (int)(m_dim - m0) : BLOCK_ROWS) {
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
                TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
            }
        }
    }
}
#undef TILE

/* `rows` rows of x against a panel (`w`), as VECS vectors of 8 columns: sums start
 * at the bias (NULL: 0), `cols` of them stored. */
#define VECS (PANEL / 8)
AVX2 static inline __attribute__((always_inline)) void linear_tile_avx2(
    int rows, const float *x, int64_t k_dim, const float *w, const float *bias,
    float *y, int64_t n_dim, int cols, const Ahead *ahead) {
    __m256 acc[AVX2_BLOCK_ROWS][VECS];
    __m256i mask[VECS];
    for (int v = 0; v < VECS; v++) {
        mask[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8 * v),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 b = bias ? _mm256_maskload_ps(bias + 8 * v, mask[v]) : _mm256_setzero_ps();
        for (int m = 0; m < rows; m++) acc[m][v] = b;
    }
    int64_t k = 0;
    if (rows == 1) { /* a second set of sums for odd k: two FMAs in flight per sum */
        __m256 odd[VECS];
        for (int v = 0; v < VECS; v++) odd[v] = _mm256_setzero_ps();
        for (; k + 2 <= k_dim; k += 2, w += 2 * PANEL) {
            for (int v = 0; v < 2 * VECS; v += 2)
                _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL + 8 * v), _MM_HINT_T0);
            prefetch_next(ahead, k);
            prefetch_next(ahead, k + 1);
            __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
            for (int v = 0; v < VECS; v++) {
                acc[0][v] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + 8 * v), acc[0][v]);
                odd[v] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + PANEL + 8 * v), odd[v]);
            }
        }
        for (int v = 0; v < VECS; v++) acc[0][v] = _mm256_add_ps(acc[0][v], odd[v]);
    }
    for (; k < k_dim; k++, w += PANEL) {
        for (int v = 0; v < VECS; v += 2)
            _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL + 8 * v), _MM_HINT_T0);
        prefetch_next(ahead, k);
        __m256 wv[VECS];
        for (int v = 0; v < VECS; v++) wv[v] = _mm256_loadu_ps(w + 8 * v);
        for (int m = 0; m < rows; m++) {
            __m256 xm = _mm256_broadcast_ss(x + m * k_dim + k);
            for (int v = 0; v < VECS; v++) acc[m][v] = _mm256_fmadd_ps(xm, wv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < VECS; v++) _mm256_maskstore_ps(y + m * n_dim + 8 * v, mask[v], acc[m][v]);
}

#define TILE(R) \
    case R: linear_tile_avx2(R, xs, k_dim, panel, b, ys, n_dim, (int)cols, &ahead); break;

AVX2 static void linear_avx2(const float *x, int64_t m_dim, int64_t k_dim, const float *packed,
                             const float *bias, int64_t n_dim, float *y) {
    for (int64_t p = 0; p * PANEL < n_dim; p++) {
        int64_t cols = n_dim - p * PANEL < PANEL ? n_dim - p * PANEL : PANEL;
        const float *panel = packed + p * k_dim * PANEL, *b = bias ? bias + p * PANEL : 0;
        const float *next = (p + 1) * PANEL < n_dim ? panel + k_dim * PANEL : 0;
        int64_t blocks = (m_dim + AVX2_BLOCK_ROWS - 1) / AVX2_BLOCK_ROWS;
        for (int64_t m0 = 0; m0 < m_dim; m0 += AVX2_BLOCK_ROWS) {
            Ahead ahead = ahead_for(next, k_dim, m0 / AVX2_BLOCK_ROWS, blocks);
            const float *xs = x + m0 * k_dim;
            float *ys = y + m0 * n_dim + p * PANEL;
            switch (m_dim - m0 < AVX2_BLOCK_ROWS ? (int)(m_dim - m0) : AVX2_BLOCK_ROWS) {
                TILE(1) TILE(2) TILE(3)
            }
        }
    }
}
#undef TILE
#endif

void tserve_linear(int isa, const float *x, int64_t m_dim, int64_t k_dim, const float *packed,
                   const float *bias, int64_t n_dim, float *y) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX512_VNNI)
        linear_avx512(x, m_dim, k_dim, packed, bias, n_dim, y);
    else if (isa >= ISA_AVX2)
        linear_avx2(x, m_dim, k_dim, packed, bias, n_dim, y);
#else
    (void)isa, (void)x, (void)m_dim, (void)k_dim, (void)packed, (void)bias, (void)n_dim, (void)y;
#endif
}

/* The exported glue loops: each body above compiled once per ISA, the call
 * dispatched by glue_isa() (tserve_glue_isa, for every file's GLUE_ENTRY).
 * ISA codes as _quant_common.h's ISA_*: 2 here is x86-64-v4 (AVX-512
 * F/BW/CD/DQ/VL, VNNI not needed). */
static int isa_cap = ISA_AVX512_VNNI; /* tserve_set_isa_cap's; set once, before any call */

void tserve_set_isa_cap(int cap) { isa_cap = cap; }

#if defined(__x86_64__)
static int glue_best;

__attribute__((constructor)) static void glue_detect(void) {
    __builtin_cpu_init();
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
    glue_best = v4 ? ISA_AVX512_VNNI : v3 ? ISA_AVX2 : ISA_PORTABLE;
}

static inline int glue_isa(void) { return glue_best < isa_cap ? glue_best : isa_cap; }

#else
static inline int glue_isa(void) { return ISA_PORTABLE; }
#endif

/* The variant the glue loops run now (the tests' view of the cap, and _glue.h's). */
int tserve_glue_isa(void) { return glue_isa(); }

GLUE_ENTRY(silu_mul,
           (const float *gate_up, int64_t rows, int64_t inter, float *out, float *scratch),
           (gate_up, rows, inter, out, scratch))
GLUE_ENTRY(gelu_tanh_mul,
           (const float *gate_up, int64_t rows, int64_t inter, float *out, float *scratch),
           (gate_up, rows, inter, out, scratch))
GLUE_ENTRY(add_rms_norm,
           (float *residual, const float *hidden, const float *weight, float *out, int64_t rows,
            int64_t dim, float eps, int add),
           (residual, hidden, weight, out, rows, dim, eps, add))
GLUE_ENTRY(rope_store,
           (float *qkv, int64_t tokens, int64_t row_stride, int64_t heads, int64_t kv_heads,
            int64_t head_dim, const int64_t *positions, const float *cos_table,
            const float *sin_table, const int64_t *slots, void *k_pool, void *v_pool,
            int64_t num_slots, int kv_type),
           (qkv, tokens, row_stride, heads, kv_heads, head_dim, positions, cos_table, sin_table,
            slots, k_pool, v_pool, num_slots, kv_type))
GLUE_ENTRY(paged_decode,
           (const float *q, int64_t q_stride, const void *k_pool, const void *v_pool,
            int64_t num_slots, const int64_t *tables, int64_t width, const int64_t *lens,
            int64_t block_size, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
            float scale, int64_t window, float softcap, float *out, float *scores, int kv_type),
           (q, q_stride, k_pool, v_pool, num_slots, tables, width, lens, block_size, batch, heads,
            kv_heads, head_dim, scale, window, softcap, out, scores, kv_type))
