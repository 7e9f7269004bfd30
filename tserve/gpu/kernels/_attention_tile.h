/* One instruction set's query-tile attention, for _attention_kernels.c: included
 * once per variant with VL (floats per vector), TILE_SUFFIX, TILE_TARGET,
 * TILE_F16C and the register tiles S_KEYS x S_VECTORS (S) and O_DIMS x
 * O_VECTORS (O) defined; defines attend_tile_<TILE_SUFFIX> and undefines them.
 *
 * Vectors are GCC vectors of VL floats, each VL rows of a tile (rows in lanes:
 * no operation mixes rows). Layouts, `rows` a multiple of LANES: Q^T and O^T
 * [head_dim][rows], S and P [keys][rows], m, l, alpha and positions [rows];
 * K and V are rows of head_dim floats, where the key pointers say.
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define vf CAT(vf, TILE_SUFFIX)
#define vi CAT(vi, TILE_SUFFIX)
#define splat CAT(splat, TILE_SUFFIX)
#define pick CAT(pick, TILE_SUFFIX)
#define vmax CAT(vmax, TILE_SUFFIX)
#define exp_nonpositive CAT(exp_nonpositive, TILE_SUFFIX)
#define scores_tile CAT(scores_tile, TILE_SUFFIX)
#define values_tile CAT(values_tile, TILE_SUFFIX)
#define softmax_tile CAT(softmax_tile, TILE_SUFFIX)
#define query_tile CAT(query_tile, TILE_SUFFIX)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

TILE_TARGET INLINE_ALWAYS vf splat(float x) { return (vf){0} + x; }
TILE_TARGET INLINE_ALWAYS vf pick(vi mask, vf yes, vf no) {
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}
TILE_TARGET INLINE_ALWAYS vf vmax(vf a, vf b) { return pick(a > b, a, b); }

/* e^x for x <= 0 lane by lane (-inf included): 2^k * p(r), r in [-ln2/2, ln2/2],
 * p of degree 6 (relative error below 2e-7); below -87, 0. e^0 is exactly 1. */
TILE_TARGET INLINE_ALWAYS vf exp_nonpositive(vf x) { return EXP_NONPOSITIVE_VECTOR(vf, vi, x); }

/* S[k0 + kk][vectors v0..v0+RV) = Q . K row k0 + kk, for S_KEYS keys. */
TILE_TARGET INLINE_ALWAYS void scores_tile(const buffers *b, int64_t rows, int64_t dim,
                                           int64_t k0, int64_t v0, int RV) {
    vf acc[S_KEYS][S_VECTORS];
    for (int kk = 0; kk < S_KEYS; kk++)
        for (int rv = 0; rv < RV; rv++) acc[kk][rv] = splat(0.0f);
    const float *const *keys = b->k_rows + k0;
    for (int64_t d = 0; d < dim; d++) {
        vf q[S_VECTORS];
        for (int rv = 0; rv < RV; rv++) q[rv] = *(const vf *)(b->qt + d * rows + (v0 + rv) * VL);
        for (int kk = 0; kk < S_KEYS; kk++) {
            float key = keys[kk][d];
            for (int rv = 0; rv < RV; rv++) acc[kk][rv] += q[rv] * key;
        }
    }
    for (int kk = 0; kk < S_KEYS; kk++)
        for (int rv = 0; rv < RV; rv++) *(vf *)(b->s + (k0 + kk) * rows + (v0 + rv) * VL) = acc[kk][rv];
}

/* O^T[d0 + dd][vectors v0..v0+RV) = O^T * alpha + sum over `keys` keys, in
 * order, of P * V[key][d0 + dd], for RD dims. */
TILE_TARGET INLINE_ALWAYS void values_tile(const buffers *b, int64_t rows, int64_t keys,
                                           int64_t d0, int64_t v0, int RD, int RV) {
    vf acc[O_DIMS][O_VECTORS], alpha[O_VECTORS];
    for (int rv = 0; rv < RV; rv++) alpha[rv] = *(const vf *)(b->alpha + (v0 + rv) * VL);
    for (int dd = 0; dd < RD; dd++)
        for (int rv = 0; rv < RV; rv++)
            acc[dd][rv] = *(const vf *)(b->ot + (d0 + dd) * rows + (v0 + rv) * VL) * alpha[rv];
    for (int64_t k = 0; k < keys; k++) {
        vf p[O_VECTORS];
        for (int rv = 0; rv < RV; rv++) p[rv] = *(const vf *)(b->s + k * rows + (v0 + rv) * VL);
        const float *v = b->v_rows[k] + d0;
        for (int dd = 0; dd < RD; dd++) {
            float value = v[dd];
            for (int rv = 0; rv < RV; rv++) acc[dd][rv] += p[rv] * value;
        }
    }
    for (int dd = 0; dd < RD; dd++)
        for (int rv = 0; rv < RV; rv++)
            *(vf *)(b->ot + (d0 + dd) * rows + (v0 + rv) * VL) = acc[dd][rv];
}

/* The softmax step of one key tile: S becomes P in place (keys at positions
 * past a row's own masked first, where the tile reaches past `lowest`, the
 * tile's first position; with a sliding `window`, keys at or before a row's
 * position - window too, where the tile starts at or before `highest` -
 * window); m, l and alpha (the factor of the old O) updated. A row with no
 * key yet (m = -inf) gets P = 0 and alpha = 0 (its O and l are 0). */
TILE_TARGET INLINE_ALWAYS void softmax_tile(const buffers *b, int64_t rows, int64_t keys,
                                            int64_t first_key, int64_t lowest, int64_t highest,
                                            int64_t window, float softcap) {
    int64_t edge = window ? highest - window : -1; /* keys up to it may be outside a window */
    for (int64_t v0 = 0; v0 < rows; v0 += VL) {
        vi pos = *(const vi *)(b->pos + v0);
        vf top = splat(-INFINITY);
        for (int64_t k = 0; k < keys; k++) {
            vf *s = (vf *)(b->s + k * rows + v0);
            if (softcap > 0.0f) { /* tanh x = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) */
                vf x = *s / softcap, a = pick(x < 0.0f, -x, x);
                vf e = exp_nonpositive(-2.0f * a), t = (1.0f - e) / (1.0f + e);
                *s = softcap * pick(x < 0.0f, -t, t);
            }
            if (first_key + k > lowest)
                *s = pick(pos < (int32_t)(first_key + k), splat(-INFINITY), *s);
            if (first_key + k <= edge)
                *s = pick(pos - (int32_t)window >= (int32_t)(first_key + k), splat(-INFINITY), *s);
            top = vmax(top, *s);
        }
        vf m_old = *(const vf *)(b->m + v0), m_new = vmax(m_old, top);
        vf m_use = window ? pick(m_new == splat(-INFINITY), splat(0.0f), m_new) : m_new;
        vf sum = splat(0.0f);
        for (int64_t k = 0; k < keys; k++) {
            vf *s = (vf *)(b->s + k * rows + v0);
            *s = exp_nonpositive(*s - m_use);
            sum += *s;
        }
        vf alpha = exp_nonpositive(m_old - m_use);
        *(vf *)(b->alpha + v0) = alpha;
        *(vf *)(b->l + v0) = *(const vf *)(b->l + v0) * alpha + sum;
        *(vf *)(b->m + v0) = m_new;
    }
}

/* One query tile of one KV head over keys 0..its rows' positions, pool of `kv_type`. */
TILE_TARGET INLINE_ALWAYS void query_tile(const step *c, const buffers *b, const item *w,
                                          int kv_type) {
    int64_t rows = c->rows, dim = c->head_dim, g = w->kv_head;
    int64_t lowest = c->positions[w->first], highest = lowest + w->tokens - 1;
    const int64_t *table = c->tables + c->token_rows[w->first] * c->width;
    load_queries(c, b, w);
    int64_t head_row = g * c->num_slots, vectors = rows / VL;
    int64_t start = c->window && lowest >= c->window ? lowest - c->window + 1 : 0;
    for (int64_t first_key = start / KEY_TILE * KEY_TILE; first_key <= highest;
         first_key += KEY_TILE) {
        int64_t keys = highest + 1 - first_key < KEY_TILE ? highest + 1 - first_key : KEY_TILE;
        for (int64_t k = 0; k < keys; k++) {
            int64_t p = first_key + k;
            if (p < start) { /* before every row's window: masked, and its block may be gone */
                b->k_rows[k] = b->v_rows[k] = b->zeros;
                continue;
            }
            int64_t row = head_row + table[p / c->block_size] * c->block_size + p % c->block_size;
            b->k_rows[k] = kv_row(c->k_pool, row, dim, kv_type, TILE_F16C, b->k_tile + k * dim);
            b->v_rows[k] = kv_row(c->v_pool, row, dim, kv_type, TILE_F16C, b->v_tile + k * dim);
        }
        int64_t padded = (keys + S_KEYS - 1) / S_KEYS * S_KEYS;
        for (int64_t k = keys; k < padded; k++) b->k_rows[k] = b->zeros;
        for (int64_t v0 = 0; v0 < vectors; v0 += S_VECTORS) {
            int64_t left = vectors - v0 < S_VECTORS ? vectors - v0 : S_VECTORS;
            for (int64_t k0 = 0; k0 < padded; k0 += S_KEYS) {
#define SCORES(N) scores_tile(b, rows, dim, k0, v0, N)
                BY_VECTORS(left, S_VECTORS, SCORES)
#undef SCORES
            }
        }
        softmax_tile(b, rows, keys, first_key, lowest, highest, c->window, c->softcap);
        for (int64_t v0 = 0; v0 < vectors; v0 += O_VECTORS) {
            int64_t left = vectors - v0 < O_VECTORS ? vectors - v0 : O_VECTORS, d0 = 0;
#define VALUES(N) values_tile(b, rows, keys, d0, v0, O_DIMS, N)
#define VALUES_ONE_DIM(N) values_tile(b, rows, keys, d0, v0, 1, N)
            for (; d0 + O_DIMS <= dim; d0 += O_DIMS) BY_VECTORS(left, O_VECTORS, VALUES)
            for (; d0 < dim; d0++) BY_VECTORS(left, O_VECTORS, VALUES_ONE_DIM)
#undef VALUES
#undef VALUES_ONE_DIM
        }
    }
    store_outputs(c, b, w);
}

/* query_tile with the pool type's widening inlined, one copy per type. */
TILE_TARGET static void CAT(attend_tile, TILE_SUFFIX)(const step *c, const buffers *b,
                                                      const item *w) {
    switch (c->kv_type) {
    case KV_F16: query_tile(c, b, w, KV_F16); break;
    case KV_BF16: query_tile(c, b, w, KV_BF16); break;
    default: query_tile(c, b, w, KV_F32); break;
    }
}

#undef vf
#undef vi
#undef splat
#undef pick
#undef vmax
#undef exp_nonpositive
#undef scores_tile
#undef values_tile
#undef softmax_tile
#undef query_tile
#undef VL
#undef TILE_SUFFIX
#undef TILE_TARGET
#undef TILE_F16C
#undef S_KEYS
#undef S_VECTORS
#undef O_DIMS
#undef O_VECTORS
