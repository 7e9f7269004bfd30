/* What the int8 panel kernels of _quant_kernels.c (the block formats) and
 * _kquant_kernels.c (the K-quants) share: the packed layouts' geometry, panels
 * of PANEL rows of W with GROUP bytes of a row per 32-bit lane, so that one
 * 32-byte load holds a group of every row of a panel and an integer
 * multiply-add against GROUP bytes of x broadcast to every lane leaves each
 * row's sum in its own lane; and (on x86-64) the kernels' loads and stores at
 * either width: 256-bit registers for one panel, 512-bit ones (AVX-512) for a
 * pair of adjacent panels, panel p in a vector's low half and its twin, `twin`
 * bytes on, in the high one.
 *
 * Header-only, after _quant_common.h: every function is static inline.
 */
#ifndef TSERVE_PANEL_COMMON_H
#define TSERVE_PANEL_COMMON_H

#include "_quant_common.h"

#define PANEL 8         /* rows of W per panel */
#define GROUP 4         /* bytes of a row per 32-bit lane */
#define GROUP_BYTES (GROUP * PANEL) /* one group of every row of a panel */
/* Rows of x from which AVX-512 takes two panels at a time (the block formats;
 * the K-quants). Below, a pair's 512-bit loads and lane inserts cost more than
 * its wider products save, and the product waits on W from memory: a decode
 * step of the Q4_1 SmolLM2 at 4 streams ran 1.4 times as fast on single panels
 * (Zen 4, weights read from memory). Per product from memory, single panels
 * against pairs: block formats even at 8 rows, pairs ahead from 10; K-quants
 * single 1.1 to 1.9 times as fast up to 16 rows, even at 32, pairs 4 to 6 %
 * ahead at 64. */
#define PAIR_MIN_ROWS 12
#define KPAIR_MIN_ROWS 32

/* Rows of x in a tile of the AVX-512 single-panel kernels below PAIR_MIN_ROWS
 * rows (from it, INT8_TILE_ROWS): every row of x in one tile, so W is unpacked
 * once per block and no lone row makes a pass of its own, its products waiting
 * on one chain. From memory on Zen 4, 9 rows of a Q4_1 weight of SmolLM2's
 * shapes took 6.0 ms against 7.1 in tiles of 8 + 1, and of a Q4_K weight 5.8 to
 * 6.3 against 6.6 to 9.5. More rows in a tile cost more than they save: the
 * K-quants' three accumulators a row no longer fit the 32 registers (Q4_K at
 * 16 rows in tiles of 12 + 4: 11.2 to 11.5 ms against 9.7 to 10.9 in 8 + 8),
 * and the block formats' pairs of 12-row tiles measured no faster at 12 and 16
 * rows. */
#define PANEL_TILE_ROWS 12

/* The tile for a product of `rows` rows of x on the AVX-512 int8 kernels: below
 * PAIR_MIN_ROWS the single panels' PANEL_TILE_ROWS, from it INT8_TILE_ROWS (the
 * pairs', and the K-quants' single panels up to KPAIR_MIN_ROWS). */
static inline int64_t panel_tile(int64_t rows) {
    return rows < PAIR_MIN_ROWS ? PANEL_TILE_ROWS : INT8_TILE_ROWS;
}

/* CALL(R) for a tile of `rows` rows (1..PANEL_TILE_ROWS), R a constant in each branch. */
#define BY_PANEL_TILE_ROWS(rows, CALL)                                                        \
    switch (rows) {                                                                           \
    case 12: CALL(12); break;                                                                 \
    case 11: CALL(11); break;                                                                 \
    case 10: CALL(10); break;                                                                 \
    case 9: CALL(9); break;                                                                   \
    default: BY_INT8_TILE_ROWS(rows, CALL);                                                   \
    }

/* Where byte j of row i's quants lies in a packed block's quants (a K-quant's
 * group's nibbles likewise). */
static inline int64_t panel_quant_at(int i, int j) {
    return j / GROUP * GROUP_BYTES + GROUP * i + j % GROUP;
}

/* Where the fifth bit of element e (of 32) of a Q5 row (Q5_0, Q5_1, a Q5_K group)
 * lies in its 4 bytes of the packed layout: byte fifth_byte(e), bit fifth_shift(e):
 * the bits that the lane of group g (4 bytes of nibbles) meets, elements 4g + j
 * and 16 + 4g + j, in bits 2g and 2g + 1 of byte j. */
static inline int fifth_byte(int e) { return e % 16 % GROUP; }
static inline int fifth_shift(int e) { return 2 * (e % 16 / GROUP) + e / 16; }

/* Bit `from` of each byte of `bits` to bit 4, and `from` + 1 to bit 5 (a 16-bit
 * shift: a mask after it keeps each byte's own bits, shifts being at most 4 left
 * and 3 right). */
#define FIFTH_TO_4(W, bits, from)                                                             \
    ((from) < 4 ? _mm##W##_slli_epi16(bits, 4 - (from))                                       \
     : (from) > 4 ? _mm##W##_srli_epi16(bits, (from) - 4) : (bits))

/* A sweep's work for one tile: `rows` rows of x from row r against the panel at
 * `panel` (with twin nonzero, the pair of it and the panel `twin` bytes on), its
 * `cols` outputs of each row into y (row stride: the product's n); `next`: what its
 * pass asks memory for (prefetch_panels). `sweep`: the caller's own description of
 * the product (its kernels and activations). */
typedef void (*tile_fn)(const void *sweep, const uint8_t *panel, int64_t twin, int64_t next,
                        int64_t r, int rows, float *y, int cols);

/* Within a parallel region (an orphaned `omp for`): y [m, n] from W [n, *] packed in
 * panels of `panel_bytes`, taken `step` (1, or 2: pairs, a last odd one alone) at a
 * time against tiles of `tile` rows of x, CHUNK_ROWS rows at a time (the second
 * tile's pass asks memory for the next panel or pair: prefetch_panels); shares of
 * SHARE_ROWS rows of W go to whichever thread is free, and each output is computed by
 * the same code whichever thread runs it. No barrier at the end: chunks write apart. */
static inline void sweep_panels(const uint8_t *packed, int64_t n, int64_t m, int64_t panel_bytes,
                                int64_t step, int64_t tile, float *y, tile_fn run,
                                const void *sweep) {
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t m0 = 0; m0 < m; m0 += CHUNK_ROWS) {
        int64_t m1 = m0 + CHUNK_ROWS < m ? m0 + CHUNK_ROWS : m;
#pragma omp for schedule(dynamic, SHARE_ROWS / (PANEL * step)) nowait
        for (int64_t u = 0; u < (panels + step - 1) / step; u++) {
            int64_t p = u * step;
            int both = step == 2 && p + 1 < panels;
            int64_t twin = both ? panel_bytes : 0, width = both ? 2 * PANEL : PANEL;
            int cols = n - p * PANEL < width ? (int)(n - p * PANEL) : (int)width;
            for (int64_t r = m0; r < m1; r += tile) {
                int rows = m1 - r < tile ? (int)(m1 - r) : (int)tile;
                int64_t next = r == m0 ? 0 : r == m0 + tile ? step * panel_bytes : -1;
                run(sweep, packed + p * panel_bytes, twin, next, r, rows, y + r * n + p * PANEL,
                    cols);
            }
        }
    }
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* A panel's sums (lanes in row order) into y's first `cols` columns. */
AVX2 INLINE void store_panel(__m256 sums, float *y, int cols) {
    if (cols == PANEL) {
        _mm256_storeu_ps(y, sums);
        return;
    }
    float lanes[PANEL];
    _mm256_storeu_ps(lanes, sums);
    for (int c = 0; c < cols; c++) y[c] = lanes[c];
}

/* The 4 bytes of x at `p` in every 32-bit lane (one load). */
AVX2 INLINE __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* The loads and stores at W bits a vector (256 or 512): 32 bytes of each panel,
 * 8 fp16 of each as floats, 4 bytes of x in every 32-bit lane, and the first
 * `cols` sums stored. */
AVX2 INLINE __m256i bytes_256(const uint8_t *p, int64_t twin) {
    (void)twin;
    return _mm256_loadu_si256((const __m256i *)p);
}

AVX2 INLINE __m256 halves_256(const uint8_t *p, int64_t twin) {
    (void)twin;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

#define x4_256 broadcast4
#define store_256 store_panel

/* q | (bits & mask), a Q5 or Q6 quant's high bits over its nibbles: two operations
 * on AVX2, one vpternlogd with AVX-512 (VL at 256 bits; 0xF8: A | (B & C)). */
#define OR_MASKED_avx2_256(q, bits, mask) _mm256_or_si256(q, _mm256_and_si256(bits, mask))
#define OR_MASKED_vnni_256(q, bits, mask) _mm256_ternarylogic_epi32(q, bits, mask, 0xF8)
#define OR_MASKED_vnni_512(q, bits, mask) _mm512_ternarylogic_epi32(q, bits, mask, 0xF8)

/* bytes_256 and the rest for a pair: panel p's at `p`, its twin's `twin` bytes on. */
AVX512 INLINE __m512i bytes_512(const uint8_t *p, int64_t twin) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + twin)), 1);
}

AVX512 INLINE __m512 halves_512(const uint8_t *p, int64_t twin) {
    __m128i low = _mm_loadu_si128((const __m128i *)p);
    __m128i high = _mm_loadu_si128((const __m128i *)(p + twin));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1));
}

AVX512 INLINE __m512i x4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* acc + the unsigned bytes of w times 4 signed bytes at p broadcast to every lane:
 * one vpdpbusd with an embedded broadcast (GCC would load the broadcast in an
 * instruction of its own, one more a group of every row of x). */
AVX512 INLINE __m256i dpbusd_x4_256(__m256i acc, __m256i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

AVX512 INLINE __m512i dpbusd_x4_512(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* The first `cols` of a pair's 16 sums at y. */
AVX512 INLINE void store_512(__m512 sums, float *y, int cols) {
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1));
    store_panel(_mm512_castps512_ps256(sums), y, cols < PANEL ? cols : PANEL);
    if (cols > PANEL) store_panel(high, y + PANEL, cols - PANEL);
}
#endif

#endif /* TSERVE_PANEL_COMMON_H */
