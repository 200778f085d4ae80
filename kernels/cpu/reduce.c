/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Fixed-order reduction for reduce-to-owner (docs/design.md, "Owners", "direct"): each element
 * is summed over ranks 0..n-1 in that order in fp32, so the result is bitwise independent
 * of the order in which contributions arrived.
 */
#include <string.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "mfsdp/kernels.h"

/* Elements per block: the block accumulator (4 KiB) stays in L1 while every source
 * streams through it once. The per-element operation sequence is the same as a plain
 * element-by-element loop over ranks, so blocking changes no bit. Full blocks are
 * processed with the constant length, which lets -O2's cheap vectorizer handle the loops
 * (it does not vectorize loops of unknown trip count). */
enum { REDUCE_BLOCK = 1024 };

/* acc[j] = (first ? 0 + : acc[j] +) (premul ? scalar * x[j] : x[j]) for one source block.
 * Kept branch-free inside the loops so that each dtype/flag combination vectorizes. */
#define ACCUM_LOOP(LOAD)                                                                           \
    do {                                                                                           \
        if (first && !premul) {                                                                    \
            for (size_t j = 0; j < len; j++)                                                       \
                acc[j] = LOAD(j);                                                                  \
        } else if (first) {                                                                        \
            for (size_t j = 0; j < len; j++)                                                       \
                acc[j] = LOAD(j) * scalar;                                                         \
        } else if (!premul) {                                                                      \
            for (size_t j = 0; j < len; j++)                                                       \
                acc[j] = acc[j] + LOAD(j);                                                         \
        } else {                                                                                   \
            for (size_t j = 0; j < len; j++)                                                       \
                acc[j] = acc[j] + LOAD(j) * scalar;                                                \
        }                                                                                          \
    } while (0)

static inline __attribute__((always_inline)) void accum_block(float *acc, const void *src,
                                                              mfsdp_dtype_t dtype, size_t off,
                                                              size_t len, int first, int premul,
                                                              float scalar)
{
    const float *f32 = (const float *)src + off;
    const uint16_t *u16 = (const uint16_t *)src + off;
#define LOAD_F32(j)  f32[j]
#define LOAD_BF16(j) mfsdp_bf16_widen(u16[j])
#define LOAD_F16(j)  mfsdp_f16_widen(u16[j])
    switch (dtype) {
    case MFSDP_BFLOAT16:
        ACCUM_LOOP(LOAD_BF16);
        break;
    case MFSDP_FLOAT16:
        ACCUM_LOOP(LOAD_F16);
        break;
    default:
        ACCUM_LOOP(LOAD_F32);
        break;
    }
#undef LOAD_F32
#undef LOAD_BF16
#undef LOAD_F16
}

/* One block of len elements into o[0, len): all sources in rank order, then AVG's division,
 * then store or accumulate. */
static inline __attribute__((always_inline)) void
reduce_block(float *o, const void *const *src, int nsrc, mfsdp_dtype_t dtype, size_t off,
             size_t len, mfsdp_redop_t op, int premul, float scalar, int accumulate)
{
    float acc[REDUCE_BLOCK];
    for (int r = 0; r < nsrc; r++) {
        accum_block(acc, src[r], dtype, off, len, r == 0, premul, scalar);
    }
    if (op == MFSDP_OP_AVG) {
        const float div = (float)nsrc;
        for (size_t j = 0; j < len; j++) {
            acc[j] = acc[j] / div;
        }
    }
    if (accumulate) {
        for (size_t j = 0; j < len; j++) {
            o[j] = o[j] + acc[j];
        }
    } else {
        memcpy(o, acc, len * sizeof(float));
    }
}

/* pout = pin + x (disjoint arrays), one block: restrict lets the loop vectorize. */
static inline __attribute__((always_inline)) void
add_block(float *restrict o, const float *restrict p, const float *restrict a, size_t len)
{
    for (size_t j = 0; j < len; j++) {
        o[j] = p[j] + a[j];
    }
}

/* One block of combine: the contribution widened (times scalar) through the L1 accumulator,
 * then stored, added in place, or added to pin. */
static inline __attribute__((always_inline)) void combine_block(float *pout, const float *pin,
                                                                const void *x, mfsdp_dtype_t dtype,
                                                                size_t off, size_t len, int premul,
                                                                float scalar)
{
    float acc[REDUCE_BLOCK];
    accum_block(acc, x, dtype, off, len, 1, premul, scalar);
    float *o = pout + off;
    if (pin == NULL) {
        memcpy(o, acc, len * sizeof(float));
    } else if (pin == pout) {
        for (size_t j = 0; j < len; j++) {
            o[j] = o[j] + acc[j];
        }
    } else {
        add_block(o, pin + off, acc, len);
    }
}

void mfsdp_cpu_combine(float *pout, const float *pin, const void *x, mfsdp_dtype_t dtype, size_t n,
                       int premul, float scalar)
{
    for (size_t i0 = 0; i0 < n; i0 += REDUCE_BLOCK) {
        if (n - i0 >= REDUCE_BLOCK) {
            combine_block(pout, pin, x, dtype, i0, REDUCE_BLOCK, premul, scalar);
        } else {
            combine_block(pout, pin, x, dtype, i0, n - i0, premul, scalar);
        }
    }
}

mfsdp_status_t mfsdp_cpu_reduce_ordered(float *out, const void *const *src, int nsrc,
                                        mfsdp_dtype_t src_dtype, size_t n, mfsdp_redop_t op,
                                        float scalar, int accumulate)
{
    size_t bytes;
    if (out == NULL || src == NULL || n == 0 || nsrc < 1) {
        MFSDP_WARN("reduce: %s", out == NULL || src == NULL ? "null pointer"
                                 : n == 0                   ? "empty input"
                                                            : "no source");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (!mfsdp_cpu_float_dtype(src_dtype)) {
        MFSDP_WARN("reduce: unsupported source dtype %s", mfsdp_dtype_name(src_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    if (op != MFSDP_OP_SUM && op != MFSDP_OP_AVG && op != MFSDP_OP_PREMULSUM) {
        MFSDP_WARN("reduce: unknown op %d", (int)op);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("reduce: %zu elements overflow", n);
        return MFSDP_ERR_OVERFLOW;
    }
    for (int r = 0; r < nsrc; r++) {
        if (src[r] == NULL) {
            MFSDP_WARN("reduce: source %d is null", r);
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    const int premul = op == MFSDP_OP_PREMULSUM;
    for (size_t i0 = 0; i0 < n; i0 += REDUCE_BLOCK) {
        if (n - i0 >= REDUCE_BLOCK) {
            reduce_block(out + i0, src, nsrc, src_dtype, i0, REDUCE_BLOCK, op, premul, scalar,
                         accumulate);
        } else {
            reduce_block(out + i0, src, nsrc, src_dtype, i0, n - i0, op, premul, scalar,
                         accumulate);
        }
    }
    return MFSDP_OK;
}
