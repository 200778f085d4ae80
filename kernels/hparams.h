/* SPDX-License-Identifier: Apache-2.0 */
/* Hyper-parameter validation shared by the CPU and CUDA kernels (one rule, one message). */
#ifndef MFSDP_KERNELS_HPARAMS_H
#define MFSDP_KERNELS_HPARAMS_H

#include "mfsdp/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* MFSDP_ERR_INVALID_ARG (logged) for NULL, non-finite lr/weight_decay, momentum outside
 * [0, 1], negative ns_steps or an unknown scale rule. */
mfsdp_status_t mfsdp_kernel_check_muon_hp(const mfsdp_muon_hp_t *hp);

/* MFSDP_ERR_INVALID_ARG (logged) for NULL, non-finite lr/weight_decay/eps, eps < 0, betas
 * outside [0, 1), or a step t < 1 (steps count from 1). */
mfsdp_status_t mfsdp_kernel_check_adamw_hp(const mfsdp_adamw_hp_t *hp, int64_t t);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_KERNELS_HPARAMS_H */
