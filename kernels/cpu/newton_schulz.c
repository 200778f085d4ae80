/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CPU Newton-Schulz (docs/design.md, "The optimizer step") in fp32 on the GEMM layer of gemm.h.
 *
 * With s = min(m, k) and l = max(m, k), X is the s x l orientation of the input. The input
 * is never transposed in memory: when m > k the row-major m x k buffer already is X^T, so
 * A = X X^T is computed as x^T x and (B X)^T as x B (B is symmetric).
 *
 * Per step (nominal 4 s^2 l + 2 s^3 flops, executed 3 s^2 l + s^3):
 *   A  = X X^T                 ssyrk, upper triangle (s^2 l), then mirrored
 *   B  = b A + c A A           ssyrk of the symmetric A (A A = A A^T, s^3) onto a copy of A
 *   B += a I                   so that a X + B X is one GEMM: X' = (B + aI) X
 *   X' = B X                   sgemm (2 s^2 l) into the other buffer of a ping-pong pair
 *
 * Workspace layout (floats), mfsdp_ns_workspace_elems(m, k) = 2 s^2 + m k:
 *   [0, s^2)            A
 *   [s^2, 2 s^2)        B
 *   [2 s^2, 2 s^2 + mk) the second X buffer; the start buffer is chosen by the parity of
 *                       the step count so that the last step lands in the caller's x
 *                       (no copy back).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/gemm.h"
#include "mfsdp/kernels.h"

mfsdp_status_t mfsdp_ns_check_dims(int64_t m, int64_t k, size_t *elems_p)
{
    size_t elems;
    size_t bytes;
    if (m <= 0 || k <= 0) {
        MFSDP_WARN("invalid matrix shape %lld x %lld", (long long)m, (long long)k);
        return MFSDP_ERR_INVALID_ARG;
    }
    if ((uint64_t)m > MFSDP_GEMM_DIM_MAX || (uint64_t)k > MFSDP_GEMM_DIM_MAX ||
        mfsdp_mul_overflow((size_t)m, (size_t)k, &elems) ||
        mfsdp_mul_overflow(elems, sizeof(float), &bytes)) {
        MFSDP_WARN("matrix shape %lld x %lld is too large", (long long)m, (long long)k);
        return MFSDP_ERR_OVERFLOW;
    }
    *elems_p = elems;
    return MFSDP_OK;
}

size_t mfsdp_ns_workspace_elems(int64_t m, int64_t k)
{
    size_t mk;
    size_t ss;
    size_t total;
    size_t bytes;
    if (m <= 0 || k <= 0 || (uint64_t)m > MFSDP_GEMM_DIM_MAX || (uint64_t)k > MFSDP_GEMM_DIM_MAX) {
        return 0;
    }
    const size_t s = (size_t)(m < k ? m : k);
    if (mfsdp_mul_overflow((size_t)m, (size_t)k, &mk) || mfsdp_mul_overflow(s, s, &ss) ||
        mfsdp_mul_overflow(ss, 2, &ss) || mfsdp_add_overflow(ss, mk, &total) ||
        mfsdp_mul_overflow(total, sizeof(float), &bytes)) {
        return 0;
    }
    return total;
}

mfsdp_status_t mfsdp_ns_split_need(int64_t m, int64_t k, size_t nsplit, const int64_t *split,
                                   size_t *need_p)
{
    size_t need = 0;
    int64_t sum = 0;
    if (nsplit == 0) {
        need = mfsdp_ns_workspace_elems(m, k);
        if (need == 0) {
            MFSDP_WARN("newton-schulz workspace of %lld x %lld overflows", (long long)m,
                       (long long)k);
            return MFSDP_ERR_OVERFLOW;
        }
        *need_p = need;
        return MFSDP_OK;
    }
    if (split == NULL) {
        MFSDP_WARN("split is null with nsplit %zu", nsplit);
        return MFSDP_ERR_INVALID_ARG;
    }
    for (size_t i = 0; i < nsplit; i++) {
        if (split[i] <= 0 || split[i] > m - sum) {
            MFSDP_WARN("split[%zu] = %lld does not fit the %lld rows left of %lld", i,
                       (long long)split[i], (long long)(m - sum), (long long)m);
            return MFSDP_ERR_INVALID_ARG;
        }
        sum += split[i];
        const size_t w = mfsdp_ns_workspace_elems(split[i], k);
        if (w == 0) {
            MFSDP_WARN("newton-schulz workspace of block %zu overflows", i);
            return MFSDP_ERR_OVERFLOW;
        }
        need = w > need ? w : need;
    }
    if (sum != m) {
        MFSDP_WARN("split sums to %lld rows, the matrix has %lld", (long long)sum, (long long)m);
        return MFSDP_ERR_INVALID_ARG;
    }
    *need_p = need;
    return MFSDP_OK;
}

/* Copy the upper triangle of the n x n row-major a onto its lower triangle, in tiles so
 * that the column walk stays in cache. */
static void mirror_upper(float *a, size_t n)
{
    enum { TILE = 32 };
    for (size_t i0 = 0; i0 < n; i0 += TILE) {
        const size_t i1 = i0 + TILE < n ? i0 + TILE : n;
        for (size_t j0 = 0; j0 <= i0; j0 += TILE) {
            for (size_t i = i0; i < i1; i++) {
                const size_t j1 = j0 + TILE < i ? j0 + TILE : i;
                for (size_t j = j0; j < j1; j++) {
                    a[i * n + j] = a[j * n + i];
                }
            }
        }
    }
}

void mfsdp_ns_run(float *x, int64_t m, int64_t k, int steps, float *ws)
{
    const int trans = m > k;
    const size_t s = (size_t)(trans ? k : m);
    const size_t l = (size_t)(trans ? m : k);
    const size_t ldx = (size_t)k;
    const size_t n = s * l;
    float *a_mat = ws;
    float *b_mat = ws + s * s;
    float *other = ws + 2 * s * s;
    /* Start where an even number of swaps ends in x. */
    float *cur = (steps & 1) ? other : x;
    float *nxt = cur == x ? other : x;

    const double norm = sqrt(mfsdp_sqnorm_f32(x, n));
    const float inv = (float)(1.0 / (norm + (double)MFSDP_NS_EPS));
    for (size_t i = 0; i < n; i++) {
        cur[i] = x[i] * inv;
    }

    for (int step = 0; step < steps; step++) {
        /* A = X X^T (x^T x when the buffer holds X^T). */
        mfsdp_gemm_ssyrk_upper(trans ? MFSDP_GEMM_T : MFSDP_GEMM_N, s, l, 1.0f, cur, ldx, 0.0f,
                               a_mat, s);
        mirror_upper(a_mat, s);
        /* B = b A + c A A^T (A is symmetric), computed onto the upper triangle of a copy. */
        for (size_t i = 0; i < s; i++) {
            memcpy(b_mat + i * s + i, a_mat + i * s + i, (s - i) * sizeof(float));
        }
        mfsdp_gemm_ssyrk_upper(MFSDP_GEMM_N, s, s, MFSDP_NS_C, a_mat, s, MFSDP_NS_B, b_mat, s);
        for (size_t i = 0; i < s; i++) {
            b_mat[i * s + i] += MFSDP_NS_A;
        }
        mirror_upper(b_mat, s);
        /* X' = (B + aI) X, or X'^T = X^T (B + aI) in the transposed layout. */
        if (!trans) {
            mfsdp_gemm_sgemm(MFSDP_GEMM_N, MFSDP_GEMM_N, s, l, s, 1.0f, b_mat, s, cur, ldx, 0.0f,
                             nxt, ldx);
        } else {
            mfsdp_gemm_sgemm(MFSDP_GEMM_N, MFSDP_GEMM_N, l, s, s, 1.0f, cur, ldx, b_mat, s, 0.0f,
                             nxt, ldx);
        }
        float *t = cur;
        cur = nxt;
        nxt = t;
    }
}

/* Validation shared by the three entry points: everything but the batch count. */
static mfsdp_status_t ns_check(const float *x, int64_t m, int64_t k, size_t nsplit,
                               const int64_t *split, int steps, const float *ws, size_t ws_elems,
                               size_t batch, size_t *elems_p)
{
    size_t elems;
    size_t need;
    size_t total;
    if (x == NULL || ws == NULL) {
        MFSDP_WARN("newton-schulz: null %s", x == NULL ? "matrix" : "workspace");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (steps < 0) {
        MFSDP_WARN("newton-schulz: negative step count %d", steps);
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CHECK(mfsdp_ns_check_dims(m, k, &elems));
    MFSDP_CHECK(mfsdp_ns_split_need(m, k, nsplit, split, &need));
    if (ws_elems < need) {
        MFSDP_WARN("newton-schulz: workspace of %zu floats, %lld x %lld needs %zu", ws_elems,
                   (long long)m, (long long)k, need);
        return MFSDP_ERR_MISMATCH;
    }
    if (mfsdp_mul_overflow(elems, batch, &total) ||
        mfsdp_mul_overflow(total, sizeof(float), &total)) {
        MFSDP_WARN("newton-schulz: batch of %zu matrices of %zu floats overflows", batch, elems);
        return MFSDP_ERR_OVERFLOW;
    }
    if (mfsdp_ranges_overlap(x, total, ws, need * sizeof(float))) {
        MFSDP_WARN("newton-schulz: workspace overlaps the matrix");
        return MFSDP_ERR_INVALID_ARG;
    }
    *elems_p = elems;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_cpu_newton_schulz_split(float *x, int64_t m, int64_t k, size_t nsplit,
                                             const int64_t *split, int steps, float *ws,
                                             size_t ws_elems)
{
    size_t elems;
    MFSDP_CHECK(ns_check(x, m, k, nsplit, split, steps, ws, ws_elems, 1, &elems));
    if (nsplit == 0) {
        mfsdp_ns_run(x, m, k, steps, ws);
        return MFSDP_OK;
    }
    float *block = x;
    for (size_t i = 0; i < nsplit; i++) {
        mfsdp_ns_run(block, split[i], k, steps, ws);
        block += (size_t)split[i] * (size_t)k;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_cpu_newton_schulz(float *x, int64_t m, int64_t k, int steps, float *ws,
                                       size_t ws_elems)
{
    return mfsdp_cpu_newton_schulz_split(x, m, k, 0, NULL, steps, ws, ws_elems);
}

mfsdp_status_t mfsdp_cpu_newton_schulz_batched(float *x, size_t batch, int64_t m, int64_t k,
                                               int steps, float *ws, size_t ws_elems)
{
    size_t elems;
    if (batch == 0) {
        MFSDP_WARN("newton-schulz: empty batch");
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CHECK(ns_check(x, m, k, 0, NULL, steps, ws, ws_elems, batch, &elems));
    for (size_t i = 0; i < batch; i++) {
        mfsdp_ns_run(x + i * elems, m, k, steps, ws);
    }
    return MFSDP_OK;
}

static char routines_desc[320];
static pthread_once_t routines_once = PTHREAD_ONCE_INIT;

static void routines_describe(void)
{
    snprintf(routines_desc, sizeof(routines_desc),
             "A=XX^T: ssyrk(upper)+mirror; B=bA+cAA: ssyrk(upper, A symmetric)+mirror; "
             "X=(B+aI)X: sgemm; gemm layer: %s",
             mfsdp_gemm_backend());
}

const char *mfsdp_cpu_ns_routines(void)
{
    pthread_once(&routines_once, routines_describe);
    return routines_desc;
}
