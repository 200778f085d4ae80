/* SPDX-License-Identifier: Apache-2.0 */
#include "kernels/hparams.h"

#include <math.h>

#include "core/log.h"

mfsdp_status_t mfsdp_kernel_check_muon_hp(const mfsdp_muon_hp_t *hp)
{
    if (hp == NULL) {
        MFSDP_WARN("muon: null hyper-parameters");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (!isfinite(hp->lr) || !isfinite(hp->weight_decay) || !(hp->momentum >= 0.0f) ||
        !(hp->momentum <= 1.0f)) {
        MFSDP_WARN("muon: bad hyper-parameters lr %g momentum %g weight_decay %g", (double)hp->lr,
                   (double)hp->momentum, (double)hp->weight_decay);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (hp->ns_steps < 0) {
        MFSDP_WARN("muon: negative ns_steps %d", hp->ns_steps);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (hp->scale != MFSDP_SCALE_KELLER && hp->scale != MFSDP_SCALE_MOONLIGHT) {
        MFSDP_WARN("muon: unknown scale rule %d", (int)hp->scale);
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_kernel_check_adamw_hp(const mfsdp_adamw_hp_t *hp, int64_t t)
{
    if (hp == NULL) {
        MFSDP_WARN("adamw: null hyper-parameters");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (t < 1) {
        MFSDP_WARN("adamw: step %lld, steps count from 1", (long long)t);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (!isfinite(hp->lr) || !isfinite(hp->weight_decay) || !(hp->eps >= 0.0f) ||
        !isfinite(hp->eps) || !(hp->beta1 >= 0.0f && hp->beta1 < 1.0f) ||
        !(hp->beta2 >= 0.0f && hp->beta2 < 1.0f)) {
        MFSDP_WARN("adamw: bad hyper-parameters lr %g betas (%g, %g) eps %g weight_decay %g",
                   (double)hp->lr, (double)hp->beta1, (double)hp->beta2, (double)hp->eps,
                   (double)hp->weight_decay);
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}
