/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Internal helpers shared by the CPU kernels (Newton-Schulz, Muon, AdamW, casts).
 */
#ifndef MFSDP_KERNELS_CPU_CPU_H
#define MFSDP_KERNELS_CPU_CPU_H

#include <stdint.h>
#include <string.h>

#include "mfsdp/kernels.h"

/* Exact widening of bfloat16 / IEEE half bits, inline for the hot loops (casts, reductions);
 * mfsdp_bf16_to_f32() and mfsdp_f16_to_f32() are these. */
static inline float mfsdp_bf16_widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static inline float mfsdp_f16_widen(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x03ffu;
    uint32_t u;
    float x;
    if (e == 0) {
        /* Zero or subnormal: mant * 2^-24, exact in float. */
        x = (float)mant * 0x1p-24f;
        return sign ? -x : x;
    }
    u = sign | (e == 0x1fu ? 0x7f800000u : (e + 112u) << 23) | (mant << 13);
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* Validate a row split of an m x k matrix (nsplit == 0: the whole matrix) and return the
 * Newton-Schulz workspace (floats) its largest block needs. Logs and returns
 * MFSDP_ERR_INVALID_ARG or MFSDP_ERR_OVERFLOW on a bad split; writes *need_p only on
 * success. m and k must already be validated (> 0, within the GEMM limits). */
mfsdp_status_t mfsdp_ns_split_need(int64_t m, int64_t k, size_t nsplit, const int64_t *split,
                                   size_t *need_p);

/* Validate the dimensions of an m x k matrix for Newton-Schulz / Muon and return m*k. */
mfsdp_status_t mfsdp_ns_check_dims(int64_t m, int64_t k, size_t *elems_p);

/* Newton-Schulz on one already-validated matrix; ws holds mfsdp_ns_workspace_elems(m, k). */
void mfsdp_ns_run(float *x, int64_t m, int64_t k, int steps, float *ws);

/* Sum of squares of n floats in double with the fixed association documented at
 * mfsdp_cpu_sqnorm_accumulate() (bitwise reproducible). */
double mfsdp_sqnorm_f32(const float *x, size_t n);

/* 1 when [a, a+abytes) and [b, b+bbytes) overlap (compared as integers: the buffers are
 * unrelated objects). */
static inline int mfsdp_ranges_overlap(const void *a, size_t abytes, const void *b, size_t bbytes)
{
    const uintptr_t pa = (uintptr_t)a;
    const uintptr_t pb = (uintptr_t)b;
    return pa < pb + bbytes && pb < pa + abytes;
}

/* 1 when dtype is a floating type the kernels convert (float32, bfloat16, float16). */
int mfsdp_cpu_float_dtype(mfsdp_dtype_t dtype);

/* The executor's combine (kernels/executor.h): pout[i] = (pin ? pin[i] + : ) x[i] (times
 * scalar when premul), in fp32, element for element the same operations as a plain loop
 * (bitwise) but vectorized in L1-sized blocks. pin is NULL, pout itself, or disjoint from it. */
void mfsdp_cpu_combine(float *pout, const float *pin, const void *x, mfsdp_dtype_t dtype, size_t n,
                       int premul, float scalar);

/* Validate the optional comm-dtype copy of an update: w_comm == NULL, or a float dtype
 * whose n elements do not overlap the n fp32 master weights at w. */
mfsdp_status_t mfsdp_cpu_check_comm(const float *w, const void *w_comm, mfsdp_dtype_t dtype,
                                    size_t n);

#endif /* MFSDP_KERNELS_CPU_CPU_H */
