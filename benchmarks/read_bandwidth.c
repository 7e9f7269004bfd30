/* One core's streaming read bandwidth: sum a buffer much larger than the caches.
 *
 *   cc -O3 -march=native benchmarks/read_bandwidth.c -o read_bandwidth
 *   ./read_bandwidth [MIB [PASSES]]       (default 512 MiB, 7 passes)
 *
 * One thread writes the buffer once (so every page is resident), then reads
 * all of it PASSES times, summing 64-bit words into eight accumulators (the
 * compiler vectorizes the loop; there is no other work per byte). Prints one
 * JSON object: the buffer size, each pass's GB/s (1e9 bytes/s) and the best
 * and median of them. The sum is printed too, so the reads cannot be elided.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t sum(const uint64_t *restrict words, size_t n) {
    uint64_t s[8] = {0};
    for (size_t i = 0; i < n; i += 8)
        for (int j = 0; j < 8; j++)
            s[j] += words[i + j];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 512;
    int passes = argc > 2 ? atoi(argv[2]) : 7;
    if (mib < 1 || passes < 1 || passes > 100) {
        fprintf(stderr, "usage: %s [MIB >= 1 [PASSES 1..100]]\n", argv[0]);
        return 2;
    }
    size_t bytes = mib << 20, n = bytes / sizeof(uint64_t);
    uint64_t *words = aligned_alloc(64, bytes);
    if (words == NULL) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
    memset(words, 1, bytes);
    double rates[100];
    uint64_t total = 0;
    for (int p = 0; p < passes; p++) {
        double start = now();
        total += sum(words, n);
        rates[p] = (double)bytes / (now() - start) / 1e9;
    }
    printf("{\"mib\": %zu, \"passes\": [", mib);
    for (int p = 0; p < passes; p++)
        printf("%s%.3f", p ? ", " : "", rates[p]);
    qsort(rates, (size_t)passes, sizeof rates[0], by_value);
    printf("], \"best_gb_s\": %.3f, \"median_gb_s\": %.3f, \"sum\": %llu}\n",
           rates[passes - 1], rates[passes / 2], (unsigned long long)total);
    free(words);
    return 0;
}
