/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file runtime_mpi.h
 * @brief Creating an mfsdp runtime context over an MPI communicator (MPI + CPU backend).
 *
 * Kept apart from mfsdp/runtime.h so that code that only drives a context does not need
 * mpi.h.
 */
#ifndef MFSDP_RUNTIME_MPI_H
#define MFSDP_RUNTIME_MPI_H

#include <mpi.h>

#include "mfsdp/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief Create a context for @p manifest on @p comm. Collective over @p comm.
 *
 * The communicator is duplicated (the context's traffic never mixes with the caller's).
 * The plan is taken from @p opts or computed here (a pure function of the manifest and the
 * world size, so every rank computes the same one). The owner arena is allocated once,
 * page-locked and NUMA-bound where possible.
 * @param [in]  manifest  must outlive the context
 * @param [in]  opts      NULL for defaults from the MFSDP_* environment
 * @param [in]  comm      the FSDP shard group's communicator
 * @param [out] ctx_p     written on success
 * @return MFSDP_OK, MFSDP_ERR_INVALID_ARG, MFSDP_ERR_MISMATCH (manifest world size or the
 *         plan's world size differs from the communicator size), MFSDP_ERR_CONFIG,
 *         MFSDP_ERR_NO_MEMORY, planner errors, MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_create_mpi(const mfsdp_manifest_t *manifest,
                                              const mfsdp_ctx_opts_t *opts, MPI_Comm comm,
                                              mfsdp_ctx_h *ctx_p);

/**
 * @brief HSDP: attach the replicate communicator (the ranks at this rank's position in every
 *        replica) to a context created on the shard communicator. Collective over
 *        @p replicate_comm; its size must be the manifest's "replicate", and every replica
 *        must run the same settings (compared, as at creation).
 * @return MFSDP_OK, MFSDP_ERR_STATE (already attached), MFSDP_ERR_MISMATCH (size or
 *         settings), MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_attach_replicate_mpi(mfsdp_ctx_h ctx, MPI_Comm replicate_comm);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_RUNTIME_MPI_H */
