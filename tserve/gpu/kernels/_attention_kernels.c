/* Attention of a fused step's tokens over the paged KV pool (tserve_attend,
 * called by _decoder_kernels.c once per layer, after the step's K/V is written).
 *
 * Query blocks. A maximal run of tokens of one sequence at consecutive
 * positions (a prefill chunk) attends as a block; a token alone (a decode)
 * attends through tserve_paged_decode, as the forward pass's decode does.
 *
 * Blocking, flash-attention style. A block is cut into query tiles of
 * QUERY_ROWS / group tokens (at least one); a tile's rows are its tokens x the
 * `group` query heads of one KV head, token-major, padded with idle rows to a
 * multiple of LANES. Keys go in key tiles of KEY_TILE positions aligned to
 * position 0. For each key tile the tile's K and V rows are read once (fp32
 * where they lie in the pool, fp16/bf16 widened into a buffer), then
 * S = Q K^T (soft-capped: cap * tanh(S / cap), where the layer caps), the causal mask (key position > query position: -inf; with a
 * sliding window, key position <= query position - window too), the
 * online softmax (running max m, sum l, the old output scaled by
 * exp(m_old - m_new)) and O += P V. Q, S, P and O keep the rows in vector
 * lanes, so every sum runs along keys or head_dim in one fixed order and no
 * operation mixes rows: a row's value does not depend on the tile it sits in,
 * and a key tile that lies wholly past a row's position leaves it exactly as
 * it was (m unchanged, alpha 1, P 0). Splitting a prefill into calls
 * therefore changes no bit. A layer with a sliding window reads only the key
 * tiles that reach into its rows' windows, and in the first of them no key
 * before the window of the tile's first row (zeros stand in: masked, they
 * change no bit, and their blocks may have gone back to the pool); a row none
 * of whose keys a tile holds keeps m = -inf and is left as it was too.
 *
 * Instruction sets: each ISA_* variant (tserve_quant_isa()'s codes, the
 * decoder's `isa`) is the same code in 16-float GCC vectors compiled for it,
 * with register tiles sized for its register file (AVX-512: 32 vectors of 16;
 * AVX2: 16 of 8; portable: SSE2's 16 of 4).
 *
 * Threads: the work items (a query tile x a KV head, or a decode token) are
 * shared among the library's OpenMP threads (omp_get_max_threads), most work
 * first; a step of fewer than MIN_SHARED_KEYS query-head x key pairs runs on
 * the caller.
 */
#include "_glue.h"
#include "_kernels.h"
#include "_quant_common.h"

#include <math.h>
#include <stdlib.h>

#define LANES 16       /* rows of a tile are padded to a multiple of this: every variant's vector */
#define QUERY_ROWS 96  /* rows (tokens x heads of a group) of a query tile */
#define KEY_TILE 64    /* keys per key tile */
#define MAX_REG_KEYS 8 /* the most keys of any S register tile: the key pointers' padding */
#define MIN_SHARED_KEYS 16384 /* query-head x key pairs of a step below which one thread does all */
#define ALIGN 64

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* _cpu_kernels.py's KV_TYPES */

#define INLINE_ALWAYS static inline __attribute__((always_inline))

/* What one call shares among its work items. */
typedef struct {
    const float *qkv;
    int64_t qkv_stride, attn_width;
    const int64_t *positions, *tables, *token_rows;
    int64_t width;
    const void *k_pool, *v_pool;
    int64_t num_slots, block_size, heads, kv_heads, group, head_dim;
    float scale;
    int64_t window; /* a sliding window's keys (0: none): keys past it are masked */
    float softcap;  /* > 0: each score s is softcap * tanh(s / softcap) before the masks */
    int kv_type;
    float *out;
    int64_t tile_tokens, rows; /* a query tile: tokens, rows padded to LANES */
    int64_t max_len;           /* the most keys any token attends to */
} step;

/* A query tile of one KV head (tokens >= 2 in its block), or a decode (kv_head < 0);
 * work: its query-head x key pairs. */
typedef struct {
    int64_t first, tokens, kv_head, work;
} item;

/* One thread's buffers, carved from one allocation. */
typedef struct {
    float *qt, *ot, *s, *m, *l, *alpha, *k_tile, *v_tile, *zeros, *scores;
    int32_t *pos;
    const float **k_rows, **v_rows;
    void *block;
} buffers;

static int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

static int buffers_alloc(const step *c, buffers *b) {
    int64_t rows = c->rows, dim = c->head_dim;
    int64_t keys = KEY_TILE + MAX_REG_KEYS;
    int64_t floats[] = {dim * rows, dim * rows, keys * rows, rows, rows, rows,
                        KEY_TILE * dim, KEY_TILE * dim, dim, c->group * c->max_len, rows};
    float **parts[] = {&b->qt, &b->ot, &b->s, &b->m, &b->l, &b->alpha,
                       &b->k_tile, &b->v_tile, &b->zeros, &b->scores, (float **)&b->pos};
    int64_t total = 2 * keys * (int64_t)sizeof(float *) / 4;
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) total += round_up(floats[i], 16);
    b->block = aligned_alloc(ALIGN, (size_t)total * sizeof(float));
    if (!b->block) return -1;
    float *next = b->block;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        *parts[i] = next;
        next += round_up(floats[i], 16);
    }
    b->k_rows = (const float **)next;
    b->v_rows = b->k_rows + keys;
    memset(b->zeros, 0, (size_t)dim * sizeof(float));
    return 0;
}

#if defined(__x86_64__)
/* `n` fp16 values widened with F16C, 8 an instruction (inlined into the AVX2 and
 * AVX-512 variants; never called elsewhere). */
__attribute__((target("avx,f16c"))) static inline void widen_f16c(const uint16_t *src, float *dst,
                                                                 int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}
#endif

/* Row `row` of a pool of `kv_type`, as floats: where it lies (fp32), else widened into `tmp`. */
INLINE_ALWAYS const float *kv_row(const void *pool, int64_t row, int64_t dim, int kv_type,
                                  int f16c, float *tmp) {
    if (kv_type == KV_F32) return (const float *)pool + row * dim;
    const uint16_t *src = (const uint16_t *)pool + row * dim;
    int64_t i = 0;
    if (kv_type == KV_BF16) {
        for (; i < dim; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(tmp + i, &bits, sizeof bits);
        }
        return tmp;
    }
#if defined(__x86_64__)
    if (f16c) {
        widen_f16c(src, tmp, dim);
        return tmp;
    }
#endif
    (void)f16c;
    for (; i < dim; i++) tmp[i] = half_to_float(src[i]);
    return tmp;
}

/* Q^T of a query tile, scaled; each row's position, m = -inf, l = 0, O^T = 0.
 * Idle rows (past the tile's tokens): zeros at the tile's highest position. */
static void load_queries(const step *c, const buffers *b, const item *w) {
    int64_t rows = c->rows, dim = c->head_dim, group = c->group;
    int64_t lowest = c->positions[w->first], highest = lowest + w->tokens - 1;
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / group, j = r % group;
        int used = t < w->tokens;
        b->pos[r] = (int32_t)(used ? lowest + t : highest);
        b->m[r] = -INFINITY;
        b->l[r] = 0.0f;
        const float *q = c->qkv + (w->first + t) * c->qkv_stride + (w->kv_head * group + j) * dim;
        for (int64_t d = 0; d < dim; d++) b->qt[d * rows + r] = used ? q[d] * c->scale : 0.0f;
    }
    memset(b->ot, 0, (size_t)(dim * rows) * sizeof(float));
}

/* out = O^T / l for the tile's used rows. */
static void store_outputs(const step *c, const buffers *b, const item *w) {
    int64_t rows = c->rows, dim = c->head_dim, group = c->group;
    for (int64_t r = 0; r < w->tokens * group; r++) {
        int64_t t = r / group, j = r % group;
        float inv = 1.0f / b->l[r];
        float *o = c->out + (w->first + t) * c->attn_width + (w->kv_head * group + j) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = b->ot[d * rows + r] * inv;
    }
}

/* CALL(N) for a row block's vectors: N = n (1..RV, RV <= 3), a constant in each branch. */
#define BY_VECTORS(n, RV, CALL)                                                               \
    if ((RV) == 1 || (n) == 1) CALL(1);                                                       \
    else if ((RV) == 2 || (n) == 2) CALL(2);                                                  \
    else CALL(3);

typedef void (*tile_fn)(const step *, const buffers *, const item *);

/* One instance of _attention_tile.h per instruction set: attend_tile_<suffix>.
 * Register tiles (of VL-float vectors, each row vector VL rows): S_KEYS keys x
 * S_VECTORS for S, O_DIMS dims x O_VECTORS for O. */
#define VL 4 /* SSE2, 16 registers: 9 + 3 for S, 8 + 2 for O */
#define TILE_SUFFIX portable
#define TILE_TARGET
#define TILE_F16C 0
#define S_KEYS 3
#define S_VECTORS 3
#define O_DIMS 4
#define O_VECTORS 2
#include "_attention_tile.h"
#if defined(__x86_64__)
#define VL 8 /* AVX2, 16 registers: 12 + 2 for S, 8 + 2 for O */
#define TILE_SUFFIX avx2
#define TILE_TARGET AVX2
#define TILE_F16C 1
#define S_KEYS 6
#define S_VECTORS 2
#define O_DIMS 4
#define O_VECTORS 2
#include "_attention_tile.h"
#define VL 16 /* AVX-512, 32 registers: 24 + 3 for S and for O */
#define TILE_SUFFIX avx512
#define TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define TILE_F16C 1
#define S_KEYS 8
#define S_VECTORS 3
#define O_DIMS 8
#define O_VECTORS 3
#include "_attention_tile.h"
#endif

static tile_fn tile_variant(int isa) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512_VNNI) return attend_tile_avx512;
    if (isa == ISA_AVX2) return attend_tile_avx2;
#endif
    (void)isa;
    return attend_tile_portable;
}

/* A decode token: every head over keys 0..its position (the last `window` of
 * them with a window), as the forward pass's decode. */
static void attend_one(const step *c, const buffers *b, int64_t t) {
    int64_t len = c->positions[t] + 1;
    tserve_paged_decode(c->qkv + t * c->qkv_stride, c->qkv_stride, c->k_pool, c->v_pool,
                        c->num_slots, c->tables + c->token_rows[t] * c->width, c->width, &len,
                        c->block_size, 1, c->heads, c->kv_heads, c->head_dim, c->scale,
                        c->window, c->softcap, c->out + t * c->attn_width, b->scores,
                        c->kv_type);
}

static int more_work_first(const void *a, const void *b) {
    int64_t x = ((const item *)a)->work, y = ((const item *)b)->work;
    return (x < y) - (x > y);
}

/* The step's work items, most work first; NULL when memory cannot be had. */
static item *work_items(const step *c, int64_t tokens, int64_t *count) {
    item *items = malloc((size_t)(tokens * c->kv_heads) * sizeof(item));
    if (!items) return NULL;
    int64_t n = 0;
    for (int64_t t = 0, end; t < tokens; t = end) {
        for (end = t + 1; end < tokens; end++)
            if (c->token_rows[end] != c->token_rows[t] ||
                c->positions[end] != c->positions[t] + (end - t))
                break;
        if (end - t == 1) {
            items[n++] = (item){t, 1, -1, (c->positions[t] + 1) * c->heads};
            continue;
        }
        for (int64_t first = t; first < end; first += c->tile_tokens) {
            int64_t size = end - first < c->tile_tokens ? end - first : c->tile_tokens;
            int64_t keys = c->positions[first + size - 1] + 1;
            if (c->window && keys > c->window + size) keys = c->window + size;
            for (int64_t g = 0; g < c->kv_heads; g++)
                items[n++] = (item){first, size, g, keys * size * c->group};
        }
    }
    qsort(items, (size_t)n, sizeof(item), more_work_first);
    *count = n;
    return items;
}

int tserve_attend(int isa, const float *qkv, int64_t qkv_stride, int64_t tokens,
                  const int64_t *positions, const int64_t *tables, int64_t width,
                  const int64_t *token_rows, const void *k_pool, const void *v_pool,
                  int64_t num_slots, int64_t block_size, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, float scale, int64_t window, float softcap, int kv_type,
                  float *out) {
    step c = {
        .qkv = qkv, .qkv_stride = qkv_stride, .attn_width = heads * head_dim,
        .positions = positions, .tables = tables, .token_rows = token_rows, .width = width,
        .k_pool = k_pool, .v_pool = v_pool, .num_slots = num_slots, .block_size = block_size,
        .heads = heads, .kv_heads = kv_heads, .group = heads / kv_heads, .head_dim = head_dim,
        .scale = scale, .window = window, .softcap = softcap, .kv_type = kv_type, .out = out,
    };
    c.tile_tokens = QUERY_ROWS / c.group > 1 ? QUERY_ROWS / c.group : 1;
    c.rows = round_up(c.tile_tokens * c.group, LANES);
    int64_t count = 0, total = 0;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] >= c.max_len) c.max_len = positions[t] + 1;
    item *items = work_items(&c, tokens, &count);
    if (!items) return -1;
    for (int64_t i = 0; i < count; i++) total += items[i].work;
    int threads = total < MIN_SHARED_KEYS ? 1 : omp_get_max_threads();
    threads = threads < count ? threads : (int)count;
    tile_fn tile = tile_variant(isa);
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (threads > 1) reduction(| : failed)
    {
        buffers b;
        int ready = buffers_alloc(&c, &b) == 0;
        failed |= !ready;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++) {
            if (!ready) continue;
            if (items[i].kv_head < 0) attend_one(&c, &b, items[i].first);
            else tile(&c, &b, items + i);
        }
        if (ready) free(b.block);
    }
    free(items);
    return failed ? -1 : 0;
}
