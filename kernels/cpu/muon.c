/* SPDX-License-Identifier: Apache-2.0 */
/*
 * One Muon step on an owned fp32 matrix (docs/design.md, "The optimizer step").
 *
 * Workspace layout (floats), mfsdp_muon_workspace_elems(m, k) = m k + ns_ws(m, k):
 *   [0, mk)       U, the Nesterov/momentum update that Newton-Schulz orthogonalizes in place
 *   [mk, ...)     the Newton-Schulz workspace of the largest row block (see newton_schulz.c)
 */
#include <math.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "kernels/hparams.h"
#include "mfsdp/kernels.h"

float mfsdp_muon_scale(int64_t m, int64_t k, mfsdp_scale_t scale)
{
    if (m <= 0 || k <= 0) {
        return 0.0f;
    }
    switch (scale) {
    case MFSDP_SCALE_KELLER:
        return m > k ? sqrtf((float)m / (float)k) : 1.0f;
    case MFSDP_SCALE_MOONLIGHT:
        return 0.2f * sqrtf((float)(m > k ? m : k));
    }
    return 0.0f;
}

size_t mfsdp_muon_workspace_elems(int64_t m, int64_t k)
{
    size_t total;
    size_t bytes;
    const size_t ns = mfsdp_ns_workspace_elems(m, k);
    if (ns == 0) {
        return 0;
    }
    /* ns >= m k, so m k cannot overflow here. */
    if (mfsdp_add_overflow(ns, (size_t)m * (size_t)k, &total) ||
        mfsdp_mul_overflow(total, sizeof(float), &bytes)) {
        return 0;
    }
    return total;
}

mfsdp_status_t mfsdp_cpu_muon_update(float *w, float *mom, const float *g, void *w_comm,
                                     mfsdp_dtype_t comm_dtype, int64_t m, int64_t k, size_t nsplit,
                                     const int64_t *split, const mfsdp_muon_hp_t *hp, float *ws,
                                     size_t ws_elems)
{
    size_t n;
    size_t ns_need;
    size_t need;
    if (w == NULL || mom == NULL || g == NULL || ws == NULL) {
        MFSDP_WARN("muon: null %s", w == NULL     ? "weights"
                                    : mom == NULL ? "momentum"
                                    : g == NULL   ? "gradient"
                                                  : "workspace");
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CHECK(mfsdp_kernel_check_muon_hp(hp));
    MFSDP_CHECK(mfsdp_ns_check_dims(m, k, &n));
    MFSDP_CHECK(mfsdp_ns_split_need(m, k, nsplit, split, &ns_need));
    if (mfsdp_add_overflow(n, ns_need, &need)) {
        MFSDP_WARN("muon: workspace size overflows");
        return MFSDP_ERR_OVERFLOW;
    }
    if (ws_elems < need) {
        MFSDP_WARN("muon: workspace of %zu floats, %lld x %lld needs %zu", ws_elems, (long long)m,
                   (long long)k, need);
        return MFSDP_ERR_MISMATCH;
    }
    MFSDP_CHECK(mfsdp_cpu_check_comm(w, w_comm, comm_dtype, n));
    const size_t bytes = n * sizeof(float);
    if (mfsdp_ranges_overlap(ws, need * sizeof(float), w, bytes) ||
        mfsdp_ranges_overlap(ws, need * sizeof(float), mom, bytes) ||
        mfsdp_ranges_overlap(ws, need * sizeof(float), g, bytes) ||
        mfsdp_ranges_overlap(w, bytes, mom, bytes)) {
        MFSDP_WARN("muon: workspace, weights or momentum overlap");
        return MFSDP_ERR_INVALID_ARG;
    }

    const float beta = hp->momentum;
    const float one_m_beta = 1.0f - beta;
    float *u = ws;
    for (size_t i = 0; i < n; i++) {
        const float mi = beta * mom[i] + one_m_beta * g[i];
        mom[i] = mi;
        u[i] = hp->nesterov ? one_m_beta * g[i] + beta * mi : mi;
    }

    /* Each row block is orthogonalized and scaled as a matrix of its own (QKV as separate
     * matrices); without a split the one block is the whole matrix. */
    const float decay = 1.0f - hp->lr * hp->weight_decay;
    size_t row0 = 0;
    for (size_t b = 0; b < (nsplit == 0 ? 1 : nsplit); b++) {
        const int64_t rows = nsplit == 0 ? m : split[b];
        float *ub = u + row0 * (size_t)k;
        float *wb = w + row0 * (size_t)k;
        const size_t nb = (size_t)rows * (size_t)k;
        mfsdp_ns_run(ub, rows, k, hp->ns_steps, ws + n);
        const float step = hp->lr * mfsdp_muon_scale(rows, k, hp->scale);
        for (size_t i = 0; i < nb; i++) {
            wb[i] = wb[i] * decay - step * ub[i];
        }
        row0 += (size_t)rows;
    }

    if (w_comm != NULL) {
        MFSDP_CHECK(mfsdp_cpu_cast(w_comm, comm_dtype, w, MFSDP_FLOAT32, n));
    }
    return MFSDP_OK;
}
