/* A whole step of a decoder of any architecture tserve runs
 * (tserve/gpu/models/_architectures.py) over quantized weights in one call
 * (tserve/gpu/forward/_decoder.py).
 *
 * The same arithmetic as PagedLlama's forward pass on the CPU kernels
 * (tserve/gpu/forward/_llama.py), layer after layer, with no Python between the
 * pieces: per layer the residual add and RMSNorm, the Q/K/V product (and the
 * architecture's Q/K/V biases and Q/K head norms where it has them), RoPE and
 * the K/V write, attention (within a sliding window on a local layer), the
 * output product (and its post-norm), the add and norm again, the gate/up
 * product, act(gate) * up and the down product (and its post-norm); after the last layer
 * its output added to the residual. Each piece is the library's own entry
 * point (_kernels.h), so a decode step gives the logits the forward pass
 * does, bit for bit.
 *
 * Attention runs over the pool (tserve_attend, _attention_kernels.c): every
 * token of the step has its K/V written before any attends, so token t at
 * position p attends to keys 0..p of its sequence where they lie; a prefill
 * chunk's tokens attend as one causal block, a decode alone. A step may mix
 * them, and how a prefill splits into calls changes no value.
 *
 * Progress: `progress` (when not NULL) grows by one after every layer, a
 * relaxed atomic add, for a watcher on another thread to see the step live.
 *
 * Threads: the products split their rows among OpenMP threads as they do
 * alone, attention its query tiles; everything else runs on the caller.
 */
#include "_kernels.h"

#include <stdlib.h>
#include <string.h>

/* How a product runs: QuantizedLinear's kernel choices (tserve/gpu/forward/_quant.py). */
enum {
    ROUTE_PACKED_INT8 = 0, /* a packed quantized format, int8 activations */
    ROUTE_FP32 = 1,        /* a block or float format as the file lays it, fp32 activations */
    ROUTE_K_FP32 = 2,      /* a K-quant as the file lays it, fp32 activations */
};

#define MAX_PARTS 3 /* Q, K and V, each in a format of its own */

/* Rows [offset, offset + n) of a product's W, all in one format, run by `route`. */
typedef struct {
    const uint8_t *data;
    int64_t n;
    int32_t route, fmt;
} tserve_part;

/* y [m, n] = x [m, k] W^T, W the rows of `count` parts one after another (a
 * file's tensors of different formats side by side, as Q4_K_M's Q6_K V beside
 * Q4_K Q and K); _decoder_abi.py's Product. */
typedef struct {
    int64_t n, k;
    int32_t count;
    tserve_part parts[MAX_PARTS];
} tserve_product;

/* One decoder layer; the pools are its [kv_heads, num_slots, head_dim] slices. _Layer.
 * The architecture's optional parts are NULL (0) where it has none
 * (tserve/gpu/models/_architectures.py): qkv_bias [qkv.n] added to the Q/K/V
 * product; q_norm and k_norm [head_dim] the RMSNorm weights of every Q and K
 * head before RoPE; post_attn_norm and post_mlp_norm [hidden] RMSNorms of the
 * attention's and the MLP's outputs before each is added to the residual;
 * rope_cos and rope_sin a table of the layer's own (else the model's); window
 * the keys a sliding-window layer attends to (its last ones); group its KV
 * layer group: the row of the step's slots and block tables it uses. */
typedef struct {
    tserve_product qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm;
    void *k_pool, *v_pool;
    const float *qkv_bias, *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    const float *rope_cos, *rope_sin;
    int64_t window, group;
} tserve_layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 }; /* the MLP's gate activation: _decoder_abi.py's */

/* The model; `layers` holds num_layers of them. _Decoder. */
typedef struct {
    const tserve_layer *layers;
    int64_t num_layers, hidden, heads, kv_heads, head_dim;
    const float *rope_cos, *rope_sin; /* [positions, head_dim / 2] */
    int64_t num_slots, block_size;
    float eps, scale, softcap; /* softcap > 0: attention scores capped (tserve_attend) */
    int32_t kv_type, isa, activation;
    int64_t *progress; /* NULL, or a counter that grows by one per layer run */
} tserve_decoder;

/* y [m, p->n] = x [m, k] W^T for one part. Returns 0, or -1 when scratch cannot be had. */
static int part_product(const tserve_part *p, int64_t k, int isa, const float *x, int64_t m,
                        float *y) {
    switch (p->route) {
    case ROUTE_PACKED_INT8: return tserve_qlinear_int8(isa, p->fmt, p->data, p->n, k, x, m, y);
    case ROUTE_FP32: tserve_qlinear(isa, p->fmt, p->data, p->n, k, x, m, y); return 0;
    default: return tserve_klinear(isa, p->fmt, p->data, p->n, k, x, m, y);
    }
}

/* y = x W^T for `m` rows. Parts after the first write their columns of y: in
 * place for one row, else through scratch whose rows are copied in. Returns 0,
 * or -1 when scratch cannot be had. */
static int product(const tserve_product *w, int isa, const float *x, int64_t m, float *y) {
    if (w->count == 1) return part_product(w->parts, w->k, isa, x, m, y);
    int64_t widest = 0;
    for (int i = 0; i < w->count; i++) widest = w->parts[i].n > widest ? w->parts[i].n : widest;
    float *part_y = m > 1 ? malloc((size_t)(m * widest) * sizeof(float)) : 0;
    if (m > 1 && !part_y) return -1;
    int failed = 0;
    int64_t column = 0;
    for (int i = 0; i < w->count && !failed; i++) {
        const tserve_part *p = w->parts + i;
        if (m == 1) {
            failed = part_product(p, w->k, isa, x, 1, y + column);
        } else {
            failed = part_product(p, w->k, isa, x, m, part_y);
            for (int64_t r = 0; r < m && !failed; r++)
                memcpy(y + r * w->n + column, part_y + r * p->n, (size_t)p->n * sizeof(float));
        }
        column += p->n;
    }
    free(part_y);
    return failed ? -1 : 0;
}

/* Scratch of one step, carved from one allocation. */
typedef struct {
    float *x, *qkv, *attn, *out, *gate_up, *act, *silu;
    void *block;
} scratch;

#define ALIGN 64 /* bytes: each part of the scratch starts on a cache line, as torch's tensors do */

static int64_t aligned_floats(int64_t n) { return (n + ALIGN / 4 - 1) / (ALIGN / 4) * (ALIGN / 4); }

static int scratch_alloc(const tserve_decoder *model, int64_t tokens, scratch *s) {
    const tserve_layer *first = model->layers;
    int64_t inter = first->down.k, attn_width = model->heads * model->head_dim;
    int64_t floats[] = {
        tokens * model->hidden, tokens * first->qkv.n, tokens * attn_width,
        tokens * model->hidden, tokens * first->gate_up.n, tokens * inter, inter,
    };
    int64_t total = 0;
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++)
        total += aligned_floats(floats[i]);
    s->block = aligned_alloc(ALIGN, (size_t)total * sizeof(float));
    if (!s->block) return -1;
    float **parts[] = {&s->x, &s->qkv, &s->attn, &s->out, &s->gate_up, &s->act, &s->silu};
    float *next = s->block;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        *parts[i] = next;
        next += aligned_floats(floats[i]);
    }
    return 0;
}

/* Attention of every token over its sequence's keys 0..position, into s->attn.
 * Returns 0, or -1 when scratch cannot be had. */
static int attend(const tserve_decoder *model, const tserve_layer *layer, int64_t tokens,
                  const int64_t *positions, const int64_t *tables, int64_t width,
                  const int64_t *token_rows, const scratch *s) {
    return tserve_attend(model->isa, s->qkv, layer->qkv.n, tokens, positions, tables, width,
                         token_rows, layer->k_pool, layer->v_pool, model->num_slots,
                         model->block_size, model->heads, model->kv_heads, model->head_dim,
                         model->scale, layer->window, model->softcap, model->kv_type, s->attn);
}

/* The architecture's steps between the Q/K/V product and RoPE, in place on
 * qkv [tokens, qkv.n]: the biases, then each Q and K head's RMSNorm. */
static void qkv_extras(const tserve_decoder *model, const tserve_layer *layer, int64_t tokens,
                       float *qkv) {
    int64_t n = layer->qkv.n, dim = model->head_dim;
    if (layer->qkv_bias)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t j = 0; j < n; j++) qkv[t * n + j] += layer->qkv_bias[j];
    if (layer->q_norm)
        for (int64_t t = 0; t < tokens; t++) {
            float *q = qkv + t * n, *k = q + model->heads * dim;
            tserve_add_rms_norm(q, 0, layer->q_norm, q, model->heads, dim, model->eps, 0);
            tserve_add_rms_norm(k, 0, layer->k_norm, k, model->kv_heads, dim, model->eps, 0);
        }
}

/* Every layer over `tokens` packed tokens. residual [tokens, hidden]: their
 * embeddings on entry, the last layer's output plus its residual on return.
 * Token t sits at positions[t]; in a layer of KV group g its K/V goes to pool
 * slot slots[g * slot_stride + t], and its sequence's blocks are row
 * token_rows[t] of the [*, width] tables at tables + g * table_stride
 * (covering positions[t] + 1 keys). Returns 0, or -1 when scratch cannot be
 * had (residual is then partly updated: the step is lost). */
int tserve_decoder_step(const tserve_decoder *model, float *residual, int64_t tokens,
                        const int64_t *positions, const int64_t *slots, const int64_t *tables,
                        int64_t width, const int64_t *token_rows, int64_t slot_stride,
                        int64_t table_stride) {
    scratch s;
    if (scratch_alloc(model, tokens, &s)) return -1;
    int isa = model->isa, failed = 0;
    int64_t hidden = model->hidden;
    for (int64_t i = 0; i < model->num_layers && !failed; i++) {
        const tserve_layer *layer = model->layers + i;
        const int64_t *layer_slots = slots + layer->group * slot_stride;
        const int64_t *layer_tables = tables + layer->group * table_stride;
        tserve_add_rms_norm(residual, s.out, layer->attn_norm, s.x, tokens, hidden, model->eps,
                            i > 0);
        failed |= product(&layer->qkv, isa, s.x, tokens, s.qkv);
        qkv_extras(model, layer, tokens, s.qkv);
        tserve_rope_store(s.qkv, tokens, layer->qkv.n, model->heads, model->kv_heads,
                          model->head_dim, positions,
                          layer->rope_cos ? layer->rope_cos : model->rope_cos,
                          layer->rope_sin ? layer->rope_sin : model->rope_sin, layer_slots,
                          layer->k_pool, layer->v_pool, model->num_slots, model->kv_type);
        failed |= attend(model, layer, tokens, positions, layer_tables, width, token_rows, &s);
        failed |= product(&layer->o, isa, s.attn, tokens, s.out);
        if (layer->post_attn_norm)
            tserve_add_rms_norm(s.out, 0, layer->post_attn_norm, s.out, tokens, hidden,
                                model->eps, 0);
        tserve_add_rms_norm(residual, s.out, layer->mlp_norm, s.x, tokens, hidden, model->eps, 1);
        failed |= product(&layer->gate_up, isa, s.x, tokens, s.gate_up);
        if (model->activation == ACT_GELU_TANH)
            tserve_gelu_tanh_mul(s.gate_up, tokens, layer->down.k, s.act, s.silu);
        else
            tserve_silu_mul(s.gate_up, tokens, layer->down.k, s.act, s.silu);
        failed |= product(&layer->down, isa, s.act, tokens, s.out);
        if (layer->post_mlp_norm)
            tserve_add_rms_norm(s.out, 0, layer->post_mlp_norm, s.out, tokens, hidden,
                                model->eps, 0);
        if (model->progress) __atomic_fetch_add(model->progress, 1, __ATOMIC_RELAXED);
    }
    for (int64_t j = 0; j < tokens * hidden && !failed; j++) residual[j] += s.out[j];
    free(s.block);
    return failed ? -1 : 0;
}

/* One product as a layer's would run: y [m, n] = x [m, k] W^T by w's route, for
 * the output head of the native runner (tserve/gpu/forward/_native.py), so that it takes
 * the kernels QuantizedLinear does. Returns 0, or -1 when scratch cannot be had. */
int tserve_product_run(const tserve_product *w, int isa, const float *x, int64_t m, float *y) {
    return product(w, isa, x, m, y);
}
