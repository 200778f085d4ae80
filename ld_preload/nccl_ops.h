/* SPDX-License-Identifier: Apache-2.0 */
/* The shim core's operations on an NCCL communicator (ld_preload/nccl_ops.c). */
#ifndef MFSDP_LD_PRELOAD_NCCL_OPS_H
#define MFSDP_LD_PRELOAD_NCCL_OPS_H

#include <nccl.h>

#include "ld_preload/shim.h"

extern const shim_fe_ops_t shim_nccl_ops;

/* Front-end state for comm (the job's: borrowed, never destroyed here); NULL: no memory. */
void *shim_nccl_state(ncclComm_t comm);

/* The loaded library has every function the NCCL transport needs: MFSDP_OK, else the error
 * with a one-line message naming the first one missing (the same answer every time). */
mfsdp_status_t shim_nccl_usable(char *msg, size_t msglen);

#endif /* MFSDP_LD_PRELOAD_NCCL_OPS_H */
