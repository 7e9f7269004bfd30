/* What the fp32 loops of _cpu_kernels.c and _sampling_kernels.c share: the
 * per-ISA entry points (GLUE_ENTRY) and exp over non-positive floats.
 *
 * GLUE_ENTRY(name, params, args) compiles name##_body for x86-64-v4
 * (AVX-512), x86-64-v3 (AVX2, FMA, F16C) and plain x86-64, and exports
 * tserve_##name, which runs the variant tserve_glue_isa() names: the best
 * this CPU has, capped by tserve_set_isa_cap (TSERVE_MAX_ISA), so a capped
 * run is what a CPU without the rest would run. Both are _cpu_kernels.c's.
 */
#ifndef TSERVE_GLUE_H
#define TSERVE_GLUE_H

#include "_quant_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GLUE static inline __attribute__((always_inline))

/* The variant the glue loops run now (an ISA_* code). */
int tserve_glue_isa(void);

#if defined(__x86_64__)
#define GLUE_ENTRY(name, params, args)                                                        \
    __attribute__((target("arch=x86-64-v4"))) static void name##_v4 params { name##_body args; } \
    __attribute__((target("arch=x86-64-v3"))) static void name##_v3 params { name##_body args; } \
    static void name##_v1 params { name##_body args; }                                        \
    void tserve_##name params {                                                               \
        switch (tserve_glue_isa()) {                                                          \
        case ISA_AVX512_VNNI: name##_v4 args; break;                                          \
        case ISA_AVX2: name##_v3 args; break;                                                 \
        default: name##_v1 args; break;                                                       \
        }                                                                                     \
    }
#else
#define GLUE_ENTRY(name, params, args)                                                        \
    void tserve_##name params { name##_body args; }
#endif

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

/* The same polynomial over a GCC vector `X` of floats, `VF` its type and `VI`
 * its int32 twin (any width), as a statement expression: one vector operation
 * a step, where GCC leaves exp_nonpositive's loop over a few values scalar. k
 * is rounded by adding and taking away 1.5 * 2^23 (nearest, as nearbyintf). */
#define EXP_NONPOSITIVE_VECTOR(VF, VI, X)                                                     \
    ({                                                                                        \
        VF x_ = (X);                                                                          \
        VI under_ = x_ < -87.0f;                                                              \
        VF v_ = (VF)(((VI)x_ & ~under_) | ((VI)((VF){0} - 87.0f) & under_));                  \
        VF k_ = (v_ * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                     \
        VF r_ = v_ - k_ * 0.693145751953125f - k_ * 1.428606765330187045e-06f;                \
        VF p_ = (VF){0} + 1.0f / 720;                                                         \
        p_ = p_ * r_ + 1.0f / 120;                                                            \
        p_ = p_ * r_ + 1.0f / 24;                                                             \
        p_ = p_ * r_ + 1.0f / 6;                                                              \
        p_ = p_ * r_ + 0.5f;                                                                  \
        p_ = p_ * r_ + 1.0f;                                                                  \
        p_ = p_ * r_ + 1.0f;                                                                  \
        VI bits_ = (__builtin_convertvector(k_, VI) + 127) << 23;                             \
        (VF)((VI)(p_ * (VF)bits_) & ~under_); /* below -87: 0 */                              \
    })

#endif
