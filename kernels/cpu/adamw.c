/* SPDX-License-Identifier: Apache-2.0 */
/*
 * AdamW with bias correction on a contiguous fp32 slice (docs/design.md, "The optimizer step"):
 * element-wise, so a slice of a tensor updates exactly as the whole tensor would.
 */
#include <math.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "kernels/hparams.h"
#include "mfsdp/kernels.h"

mfsdp_status_t mfsdp_cpu_adamw_update(float *w, float *m, float *v, const float *g, void *w_comm,
                                      mfsdp_dtype_t comm_dtype, size_t n, int64_t t,
                                      const mfsdp_adamw_hp_t *hp)
{
    size_t bytes;
    if (w == NULL || m == NULL || v == NULL || g == NULL || hp == NULL || n == 0) {
        MFSDP_WARN("adamw: %s", n == 0 ? "empty slice" : "null pointer");
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CHECK(mfsdp_kernel_check_adamw_hp(hp, t));
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("adamw: %zu elements overflow", n);
        return MFSDP_ERR_OVERFLOW;
    }
    MFSDP_CHECK(mfsdp_cpu_check_comm(w, w_comm, comm_dtype, n));
    if (mfsdp_ranges_overlap(w, bytes, m, bytes) || mfsdp_ranges_overlap(w, bytes, v, bytes) ||
        mfsdp_ranges_overlap(m, bytes, v, bytes)) {
        MFSDP_WARN("adamw: weights, first and second moments overlap");
        return MFSDP_ERR_INVALID_ARG;
    }

    /* Bias corrections in double: beta^t underflows gracefully for large t. */
    const float b1 = hp->beta1;
    const float b2 = hp->beta2;
    const float bc1 = (float)(1.0 - pow((double)b1, (double)t));
    const float bc2 = (float)(1.0 - pow((double)b2, (double)t));
    const float decay = 1.0f - hp->lr * hp->weight_decay;
    const float step = hp->lr / bc1;
    const float inv_sqrt_bc2 = (float)(1.0 / sqrt((double)bc2));
    for (size_t i = 0; i < n; i++) {
        const float mi = b1 * m[i] + (1.0f - b1) * g[i];
        const float vi = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i] * decay - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + hp->eps);
    }

    if (w_comm != NULL) {
        MFSDP_CHECK(mfsdp_cpu_cast(w_comm, comm_dtype, w, MFSDP_FLOAT32, n));
    }
    return MFSDP_OK;
}
