/* The entry points of tserve's kernel library that another of its C files calls:
 * _cpu_kernels.c's fused steps, _attention_kernels.c's attention and the
 * products of _quant_kernels.c and _kquant_kernels.c, called by
 * _decoder_kernels.c (and tserve_paged_decode, by _attention_kernels.c). Included
 * by the files that define them, so the compiler checks each definition against its
 * declaration here.
 */
#ifndef TSERVE_KERNELS_H
#define TSERVE_KERNELS_H

#include <stdint.h>

/* _cpu_kernels.c */
void tserve_add_rms_norm(float *residual, const float *hidden, const float *weight, float *out,
                         int64_t rows, int64_t dim, float eps, int add);
void tserve_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
                     float *scratch);
void tserve_gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
                          float *scratch);
void tserve_rope_store(float *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, const int64_t *positions,
                       const float *cos_table, const float *sin_table, const int64_t *slots,
                       void *k_pool, void *v_pool, int64_t num_slots, int kv_type);
void tserve_paged_decode(const float *q, int64_t q_stride, const void *k_pool,
                         const void *v_pool, int64_t num_slots, const int64_t *tables,
                         int64_t width, const int64_t *lens, int64_t block_size, int64_t batch,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                         int64_t window, float softcap, float *out, float *scores,
                         int kv_type);

/* _attention_kernels.c: returns 0, or -1 when scratch cannot be had */
int tserve_attend(int isa, const float *qkv, int64_t qkv_stride, int64_t tokens,
                  const int64_t *positions, const int64_t *tables, int64_t width,
                  const int64_t *token_rows, const void *k_pool, const void *v_pool,
                  int64_t num_slots, int64_t block_size, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, float scale, int64_t window, float softcap, int kv_type,
                  float *out);

/* _quant_kernels.c */
void tserve_quantize_q8(int isa, const float *x, int64_t m, int64_t k, int8_t *q, float *d,
                        float *s, int32_t *isum);
void tserve_qlinear(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x,
                    int64_t m, float *y);
int tserve_qlinear_int8(int isa, int fmt, const uint8_t *packed, int64_t n, int64_t k,
                        const float *x, int64_t m, float *y);

/* _kquant_kernels.c */
int tserve_klinear(int isa, int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x,
                   int64_t m, float *y);
/* the packed layout of the K-quants (tserve_pack and the rest reach these for them);
 * Q4_K, Q5_K, Q6_K by their GGML ids */
#define TSERVE_IS_KQUANT(fmt) ((fmt) == 12 || (fmt) == 13 || (fmt) == 14)
int64_t tserve_kpacked_bytes(int fmt, int64_t n, int64_t k);
void tserve_kpack(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out);
void tserve_kunpack(int isa, int fmt, const uint8_t *packed, int64_t k, const int64_t *rows,
                    int64_t n_rows, float *out);
int tserve_kqlinear_int8(int isa, int fmt, const uint8_t *packed, int64_t n, int64_t k,
                         const float *x, int64_t m, float *y);

#endif /* TSERVE_KERNELS_H */
