/* Fused fp32 CPU kernels for tserve's own Llama forward pass (tserve/gpu/_cpu_kernels.py).
 *
 * Each replaces several torch calls that each read and write a whole tensor
 * (and pay a dispatch) with one pass over the data. Single-threaded, as the
 * engine is by default; contiguous rows of floats unless a stride says
 * otherwise. Reductions keep LANES independent partial sums, so the compiler
 * vectorizes them without reassociating anything it is not told to.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
/* Each exported loop is compiled for AVX-512, AVX2 and plain x86-64, the
 * loader picking one from the CPU's flags (an ifunc) when the library loads. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define LANES 16

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

/* exp for x <= 0 (softmax after subtracting the max), vectorizable:
 * 2^k * p(r) with r in [-ln2/2, ln2/2], p a degree-6 polynomial
 * (relative error below 2e-7, as close as fp32 holds); x below -87 gives 0. */
static inline __attribute__((always_inline)) void exp_nonpositive(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = nearbyintf(v * 1.44269504088896341f);
        float r = v - k * 0.693145751953125f - k * 1.428606765330187045e-06f;
        float p = 1.0f / 720;
        p = p * r + 1.0f / 120;
        p = p * r + 1.0f / 24;
        p = p * r + 1.0f / 6;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = x[i] < -87.0f ? 0.0f : p * scale;
    }
}

/* out[r, i] = silu(gate) * up for gate_up rows [gate (inter) | up (inter)]:
 * silu(g) = g / (1 + e^-g), written with e = exp(-|g|) so exp sees only x <= 0. */
CLONES void tserve_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
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

/* residual += hidden (when add), then out = RMSNorm(residual) * weight, row by row. */
CLONES void tserve_add_rms_norm(float *residual, const float *hidden, const float *weight, float *out,
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
 * heads, K heads, V heads, each `head_dim` wide), with cos/sin tables [positions, head_dim / 2]; then copies
 * each token's K and V heads into the pool ([kv_heads, slots, head_dim] each)
 * at its slot. */
CLONES void tserve_rope_store(float *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, const int64_t *positions,
                       const float *cos_table, const float *sin_table, const int64_t *slots,
                       float *k_pool, float *v_pool, int64_t num_slots) {
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
            size_t bytes = (size_t)head_dim * sizeof(float);
            float *k_dst = k_pool + (g * num_slots + slots[t]) * head_dim;
            float *v_dst = v_pool + (g * num_slots + slots[t]) * head_dim;
            memcpy(k_dst, row + (heads + g) * head_dim, bytes);
            memcpy(v_dst, row + (heads + kv_heads + g) * head_dim, bytes);
        }
    }
}

/* Attention of one query per sequence over its keys in the paged pool, read
 * where they lie (no gather). q: [batch] rows of `q_stride` floats holding
 * `heads` heads; out: [batch, heads, head_dim]. Sequence b has lens[b] keys
 * at positions 0.., position p in slot tables[b * width + p / block_size] *
 * block_size + p % block_size. Query head h reads KV head h / (heads /
 * kv_heads). `scores` is scratch of (heads / kv_heads) * max(lens) floats. */
CLONES void tserve_paged_decode(const float *q, int64_t q_stride, const float *k_pool,
                         const float *v_pool, int64_t num_slots, const int64_t *tables,
                         int64_t width, const int64_t *lens, int64_t block_size, int64_t batch,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                         float *out, float *scores) {
    int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = lens[b];
        const int64_t *table = tables + b * width;
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *k_head = k_pool + g * num_slots * head_dim;
            const float *v_head = v_pool + g * num_slots * head_dim;
            const float *qg = q + b * q_stride + g * group * head_dim;
            for (int64_t p = 0; p < len; p++) {
                int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float *k = k_head + slot * head_dim;
                for (int64_t j = 0; j < group; j++)
                    scores[j * len + p] = dot(qg + j * head_dim, k, head_dim) * scale;
            }
            for (int64_t j = 0; j < group; j++) {
                float *row = scores + j * len;
                float top = row[0];
                for (int64_t p = 1; p < len; p++) top = row[p] > top ? row[p] : top;
                for (int64_t p = 0; p < len; p++) row[p] -= top;
                exp_nonpositive(row, len);
                float total = 0;
                for (int64_t p = 0; p < len; p++) total += row[p];
                float inv = 1.0f / total;
                for (int64_t p = 0; p < len; p++) row[p] *= inv;
            }
            float *o = out + (b * heads + g * group) * head_dim;
            memset(o, 0, (size_t)(group * head_dim) * sizeof(float));
            for (int64_t p = 0; p < len; p++) {
                int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float *v = v_head + slot * head_dim;
                for (int64_t j = 0; j < group; j++) {
                    float w = scores[j * len + p];
                    float *oj = o + j * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) oj[d] += w * v[d];
                }
            }
        }
    }
}

/* Linear layers for few rows, where the weight's bytes are the cost: y[M, N]
 * = x[M, K] W^T (+ bias), W packed once into panels of PANEL output columns,
 * each stored k-major ([panels][K][PANEL], zero padded past N), so a panel
 * is one sequential stream. Every panel is read from memory once whatever M
 * is: blocks of up to BLOCK_ROWS rows in turn reuse it from L2 (a panel is
 * K * 128 bytes). A BLOCK_ROWS x PANEL tile of the output lives in 24 of the
 * 32 vector registers for the whole K loop. AVX-512 only:
 * tserve_linear_available() says whether this CPU has it. */
#define PANEL 32
#define BLOCK_ROWS 12
#define PREFETCH_ROWS 32 /* k rows ahead (4 KiB): the hardware prefetcher alone lags */

int tserve_linear_available(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f")))
AVX512 static inline __attribute__((always_inline)) void linear_tile(
    int rows, const float *x, int64_t k_dim, const float *panel, const float *bias,
    float *y, int64_t n_dim, __mmask16 low, __mmask16 high) {
    __m512 acc[BLOCK_ROWS][2];
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
    __m512 b1 = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) acc[m][0] = b0, acc[m][1] = b1;
    for (int64_t k = 0; k < k_dim; k++) {
        const float *w = panel + k * PANEL;
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * PANEL + 16), _MM_HINT_T0);
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
    case R: linear_tile(R, xs, k_dim, panel, b, ys, n_dim, low, high); break;

AVX512 void tserve_linear(const float *x, int64_t m_dim, int64_t k_dim, const float *packed,
                          const float *bias, int64_t n_dim, float *y) {
    for (int64_t p = 0; p * PANEL < n_dim; p++) {
        int64_t cols = n_dim - p * PANEL;
        __mmask16 low = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
        __mmask16 high = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
        const float *panel = packed + p * k_dim * PANEL, *b = bias ? bias + p * PANEL : 0;
        for (int64_t m0 = 0; m0 < m_dim; m0 += BLOCK_ROWS) {
            const float *xs = x + m0 * k_dim;
            float *ys = y + m0 * n_dim + p * PANEL;
            switch (m_dim - m0 < BLOCK_ROWS ? (int)(m_dim - m0) : BLOCK_ROWS) {
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
                TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
            }
        }
    }
}
#else
void tserve_linear(const float *x, int64_t m_dim, int64_t k_dim, const float *packed,
                   const float *bias, int64_t n_dim, float *y) {
    (void)x, (void)m_dim, (void)k_dim, (void)packed, (void)bias, (void)n_dim, (void)y;
}
#endif
