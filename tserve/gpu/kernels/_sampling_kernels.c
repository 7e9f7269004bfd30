/* The sampler's pass over a sampled row's logits where most of its tokens can
 * be drawn (tserve/gpu/sampling/_candidates.py): their probabilities up to a
 * common factor, or a draw among them. numpy took a dozen whole-row passes
 * for it (compare, nonzero, subtract, scale, exp, widen, cumsum), each over
 * the whole vocabulary: 262,144 floats a row for Gemma 3, whose soft-capped
 * logits keep most tokens within reach of the top one, 2.6 ms a row at
 * temperature 1 (benchmarks/sampling.py). Single-threaded; one call a row.
 */
#include "_glue.h"

#include <stdint.h>

enum { BLOCK = 16 }; /* logits at a time: one AVX-512 vector, two AVX2 (_candidates.py's _BLOCK) */

/* Logits in [0, n) at least `cut`, in BLOCK independent counts (vectorized). */
GLUE int64_t count_at_least(const float *logits, int64_t n, float cut) {
    int32_t counts[BLOCK] = {0};
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK)
        for (int l = 0; l < BLOCK; l++) counts[l] += logits[i + l] >= cut;
    int64_t total = 0;
    for (int l = 0; l < BLOCK; l++) total += counts[l];
    for (; i < n; i++) total += logits[i] >= cut;
    return total;
}

/* A sampled row's candidates where they are most of it. `logits` [vocab]
 * (finite max `top`), `inv_t` = 1 / temperature as a float. Counts the
 * tokens whose logit is at least `cut` into *count; where they are more
 * than `dense_above`, every token is a candidate: *count = vocab and, unless
 * `whole_only` (sample_draw draws such a row), probs[i] = exp((logit - top)
 * * inv_t) (the subtraction and the scaling each rounded to float, as numpy
 * does them). Else nothing is written but the count (numpy's compare and
 * gather of a few candidates beat a scalar one). probs holds `vocab` values. */
GLUE void sample_candidates_body(const float *logits, int64_t vocab, float top, float inv_t,
                                 float cut, int64_t dense_above, int whole_only, float *probs,
                                 int64_t *count) {
    *count = count_at_least(logits, vocab, cut);
    if (*count <= dense_above) return;
    *count = vocab;
    if (whole_only) return;
    for (int64_t i = 0; i < vocab; i++) probs[i] = (logits[i] - top) * inv_t;
    exp_nonpositive(probs, vocab);
}

GLUE_ENTRY(sample_candidates,
           (const float *logits, int64_t vocab, float top, float inv_t, float cut,
            int64_t dense_above, int whole_only, float *probs, int64_t *count),
           (logits, vocab, top, inv_t, cut, dense_above, whole_only, probs, count))

typedef float f32xb __attribute__((vector_size(BLOCK * 4)));
typedef int32_t i32xb __attribute__((vector_size(BLOCK * 4)));

/* probs[0..BLOCK) = exp((logits[0..BLOCK) - top) * inv_t), _glue.h's exp as
 * one vector (an AVX-512 register, two AVX2 ones); returns their sum, added
 * as a tree in double. */
GLUE double block_weights(const float *logits, float top, float inv_t, float *probs) {
    f32xb x;
    memcpy(&x, logits, sizeof x);
    x = EXP_NONPOSITIVE_VECTOR(f32xb, i32xb, (x - top) * inv_t);
    memcpy(probs, &x, sizeof x);
    double sums[BLOCK / 2];
    for (int l = 0; l < BLOCK / 2; l++) sums[l] = (double)probs[l] + (double)probs[l + BLOCK / 2];
    for (int width = BLOCK / 4; width > 0; width /= 2)
        for (int l = 0; l < width; l++) sums[l] += sums[l + width];
    return sums[0];
}

/* The token a draw `u` in [0, 1) picks among all `vocab` tokens of a row,
 * each weighed exp((logit - top) * inv_t): the first whose running sum
 * exceeds u times the whole sum, without a vocab-long array. One pass over
 * the logits sums each block's weights (into `sums`, vocab / BLOCK values)
 * and those sums; a walk over `sums` then finds the block where the running
 * sum passes u times the whole, whose weights are recomputed and gone
 * through one by one. The same token as a search of the running sums of
 * numpy's exp in the sampler picks, up to rounding in the sums' last bits. */
GLUE void sample_draw_body(const float *logits, int64_t vocab, float top, float inv_t, double u,
                           double *sums, int64_t *token) {
    float probs[BLOCK];
    int64_t blocks = vocab / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        total += sums[b] = block_weights(logits + b * BLOCK, top, inv_t, probs);
    for (int64_t i = blocks * BLOCK; i < vocab; i++) {
        float p = (logits[i] - top) * inv_t;
        exp_nonpositive(&p, 1);
        total += p;
    }
    double goal = u * total, before = 0.0;
    int64_t last = -1; /* the last block of positive weight: where rounding leaves no token */
    for (int64_t b = 0; b < blocks; b++) {
        if (sums[b] > 0.0) last = b;
        if (before + sums[b] <= goal) {
            before += sums[b];
            continue;
        }
        block_weights(logits + b * BLOCK, top, inv_t, probs);
        for (int l = 0; l < BLOCK; l++)
            if ((before += probs[l]) > goal) {
                *token = b * BLOCK + l;
                return;
            }
    }
    int64_t tail = -1;
    for (int64_t i = blocks * BLOCK; i < vocab; i++) {
        float p = (logits[i] - top) * inv_t;
        exp_nonpositive(&p, 1);
        if (p > 0.0f) tail = i;
        if ((before += p) > goal) {
            *token = i;
            return;
        }
    }
    *token = tail >= 0 ? tail : vocab - 1; /* its last token of positive weight */
    if (tail < 0 && last >= 0) {
        block_weights(logits + last * BLOCK, top, inv_t, probs);
        for (int l = 0; l < BLOCK; l++)
            if (probs[l] > 0.0f) *token = last * BLOCK + l;
    }
}

GLUE_ENTRY(sample_draw,
           (const float *logits, int64_t vocab, float top, float inv_t, double u, double *sums,
            int64_t *token),
           (logits, vocab, top, inv_t, u, sums, token))
