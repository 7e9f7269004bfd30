/* What the quantized kernels of _quant_kernels.c and _kquant_kernels.c share
 * (and _attention_kernels.c, for the ISA codes, fp16 bits and AVX2 attribute;
 * _cpu_kernels.c, for the ISA codes and AVX2 attribute of its fp32 panels):
 * the instruction-set codes, the bound below which a product runs on one
 * thread, the tile and chunk of x rows, the switch that makes a tile's row
 * count a constant, fp16 bits to float, an unaligned u16 load, and (on
 * x86-64) the AVX2 function attributes, a prefetch of the weights ahead and
 * a horizontal sum.
 *
 * Header-only: every function is static inline, so each file keeps its own
 * copy and the library exports none of them.
 */
#ifndef TSERVE_QUANT_COMMON_H
#define TSERVE_QUANT_COMMON_H

#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define ISA_PORTABLE 0
#define ISA_AVX2 1 /* AVX2 + FMA + F16C */
#define ISA_AVX512_VNNI 2 /* and AVX-512 F/BW/VL with VNNI: the int8 panels
                           * and the block formats' fp32 rows; every other kernel
                           * runs its AVX2 variant */
#define MIN_SHARED_WORK 4096 /* blocks of 32 weights x rows below which one thread does it all */
#define TILE_ROWS 4          /* rows of x against one pass over a few hundred bytes of W */
#define CHUNK_ROWS 64        /* rows of x kept hot per pass over W */
/* Rows of W a thread takes at a time in a shared product (a multiple of every
 * panel's rows). Shares go to whichever thread is free (OpenMP dynamic), so a
 * thread the OS preempts on a busy machine delays the product by one share, not
 * by its whole static half; each output is still computed by the same code in
 * the same order, so the result does not depend on which thread ran it. */
#define SHARE_ROWS 32

/* CALL(R) for a tile of `rows` rows (1..TILE_ROWS), R a constant in each branch, so
 * that each instance's inner loops are specialised for it. */
#define BY_TILE_ROWS(rows, CALL)                                                              \
    switch (rows) {                                                                           \
    case 4: CALL(4); break;                                                                   \
    case 3: CALL(3); break;                                                                   \
    case 2: CALL(2); break;                                                                   \
    default: CALL(1); break;                                                                  \
    }

/* Rows of x in a tile of the int8 kernels that unpack W's quants once per tile
 * (AVX-512 VNNI's panels and K-quants; AVX2's Q4/Q5 panels, a half block at a
 * time): unpacking for 4 rows cost about as much as the products themselves. */
#define INT8_TILE_ROWS 8

/* CALL(R) for a tile of `rows` rows (1..6), R a constant in each branch. */
#define BY_SIX_ROWS(rows, CALL)                                                               \
    switch (rows) {                                                                           \
    case 6: CALL(6); break;                                                                   \
    case 5: CALL(5); break;                                                                   \
    default: BY_TILE_ROWS(rows, CALL);                                                        \
    }

/* CALL(R) for a tile of `rows` rows (1..INT8_TILE_ROWS), R a constant in each branch. */
#define BY_INT8_TILE_ROWS(rows, CALL)                                                         \
    switch (rows) {                                                                           \
    case 8: CALL(8); break;                                                                   \
    case 7: CALL(7); break;                                                                   \
    default: BY_SIX_ROWS(rows, CALL);                                                         \
    }

static inline float half_to_float(uint16_t h) {
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

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* OpenMP threads for a product of `work` blocks x rows: torch's pool, or 1. */
static inline int threads_for(int64_t work) {
    int threads = omp_get_max_threads();
    return work < MIN_SHARED_WORK || threads < 1 ? 1 : threads;
}

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* A product reads W as one stream (the panels, or the rows, lie one after
 * another). On a shared core the hardware prefetcher alone keeps too few lines
 * in flight: asking for the block PREFETCH_BYTES ahead into L1 reads
 * SmolLM2's Q4_1 decode weights 1.3 times as fast (2048 measured best of
 * 512..8192), 76 MB of Q4_K rows 1.9 times (int8 activations; 1.8 fp32),
 * of Q6_K 1.4 times, and on fp32 activations the file's Q4_1 rows 2.3 times,
 * F16 rows 1.9 times. Past the end of W a prefetch is only a hint: it cannot
 * fault. */
#define PREFETCH_BYTES 2048

AVX2 INLINE void prefetch_lines(const uint8_t *at, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch((const char *)at + line, _MM_HINT_T0);
}

AVX2 INLINE void prefetch_ahead(const uint8_t *block, int64_t bytes) {
    prefetch_lines(block + PREFETCH_BYTES, bytes);
}

/* prefetch_ahead for a panel, or a pair of panels read side by side (src at
 * `offset` bytes into the first, src + twin as far into the second; the next
 * pair follows the second; twin 0: one panel). The second stream runs on into
 * the next pair's first panel; the first one, past its end, would ask for the
 * second panel that its twin reads already, so it asks for the next pair's
 * second panel instead: each pair then starts with both panels on their way
 * from memory.
 *
 * That is a panel's first pass over W (`next` 0): the one that reads it from
 * memory. Where more tiles of x follow, the first pass waits on memory and the
 * others find W in L1, so the second (`next` the bytes from this panel or pair
 * to the next one) asks for the next one's block at the same offset: the next
 * first pass then finds its W in cache, and the wait overlaps the work. Later
 * passes (`next` below 0) ask for nothing. */
AVX2 INLINE void prefetch_panels(const uint8_t *src, int64_t offset, int64_t bytes,
                                 int64_t twin, int64_t next) {
    if (next < 0) return;
    if (next > 0) {
        prefetch_lines(src + next, bytes);
        if (twin) prefetch_lines(src + twin + next, bytes);
        return;
    }
    if (!twin) {
        prefetch_ahead(src, bytes);
        return;
    }
    const uint8_t *first = offset + PREFETCH_BYTES < twin ? src : src + 2 * twin;
    prefetch_ahead(first, bytes);
    prefetch_ahead(src + twin, bytes);
}

AVX2 INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif /* TSERVE_QUANT_COMMON_H */
