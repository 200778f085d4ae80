/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file runtime_nccl.h
 * @brief Creating an mfsdp runtime context over an NCCL communicator (the NCCL backend).
 *
 * The NCCL path needs no MPI (docs/design.md, "Layers"): owner collectives run on the job's own
 * communicator through the loaded library's `pnccl*` functions (resolved at run time: no
 * link-time dependency on libnccl), on the stream set with mfsdp_ctx_set_stream(). The
 * memory the communicator's buffers live in decides the rest:
 *  - the real NCCL: device memory, the CUDA executor (kernels/cuda) and a device owner arena
 *    (cudaMalloc, or ncclMemAlloc registered with ncclCommRegister when MFSDP_NCCL_REGISTER=1);
 *    this needs a build with CUDA;
 *  - the test-only NCCL-over-MPI library (it exports `mfsdp_fake_nccl_host_memory`): host
 *    memory, the CPU executor and a host arena (registered through the library when
 *    MFSDP_NCCL_REGISTER=1).
 * On device memory the pointers of mfsdp_param_view_t (mfsdp_ctx_get_param()) are device
 * pointers, and buffers passed to the context's calls must be device memory of the
 * communicator's GPU. How it works, and what has run where: docs/gpu.md.
 * Kept apart from mfsdp/runtime.h so that code that only drives a context needs no nccl.h.
 */
#ifndef MFSDP_RUNTIME_NCCL_H
#define MFSDP_RUNTIME_NCCL_H

#include <nccl.h>

#include "mfsdp/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief Create a context for @p manifest on @p comm (the FSDP shard group's). Collective
 *        over @p comm.
 *
 * The communicator is borrowed (not duplicated): it must outlive the context, and the
 * context's operations are ordered with the job's on it by the stream. Every rank compares
 * its settings fingerprint (manifest, MFSDP_* values) and then the outcome of its creation
 * with an ncclAllReduce, so a difference or a local failure (memory) is one error on every
 * rank. A failure before the first collective that is local to one rank (a CUDA device that
 * cannot be used) leaves the others waiting in it: abort the communicator then.
 * @param [in]  manifest  must outlive the context
 * @param [in]  opts      NULL for defaults from the MFSDP_* environment
 * @param [in]  comm      an initialized NCCL communicator
 * @param [out] ctx_p     written on success
 * @return MFSDP_OK, MFSDP_ERR_INVALID_ARG, MFSDP_ERR_MISMATCH (manifest or plan world size),
 *         MFSDP_ERR_CONFIG (a bad MFSDP_* value, MFSDP_TRANSPORT=mpi), MFSDP_ERR_UNSUPPORTED
 *         (no NCCL loaded; device memory in a build without CUDA; registration asked of a
 *         library without it), MFSDP_ERR_NO_MEMORY, MFSDP_ERR_CUDA, planner errors,
 *         MFSDP_ERR_TRANSPORT (an NCCL call failed: logged with its name and NCCL's text)
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_create_nccl(const mfsdp_manifest_t *manifest,
                                               const mfsdp_ctx_opts_t *opts, ncclComm_t comm,
                                               mfsdp_ctx_h *ctx_p);

/**
 * @brief HSDP: attach the replicate communicator (the ranks at this rank's position in every
 *        replica) to a context created with mfsdp_ctx_create_nccl(). Collective over
 *        @p replicate_comm (borrowed, like the shard communicator); its size must be the
 *        manifest's "replicate", and every replica must run the same settings (compared).
 * @return MFSDP_OK, MFSDP_ERR_STATE (already attached, or not an NCCL context),
 *         MFSDP_ERR_MISMATCH (size or settings), MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_attach_replicate_nccl(mfsdp_ctx_h ctx,
                                                         ncclComm_t replicate_comm);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_RUNTIME_NCCL_H */
