/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file shim.h
 * @brief Tagged mode of the LD_PRELOAD shim (libmfsdp_preload.so), for the PyTorch companion
 *        (python/mfsdp, called through ctypes) and any framework that knows its FSDP groups.
 *
 * In tagged mode the caller names, on the calling thread just before each FSDP collective,
 * which group and phase the collective belongs to; identification is then exact (identical
 * blocks, accumulation, eval passes, unused params and any wrapping need no sequence). The
 * shim still checks the call's count and dtype against the tagged layout and stops on any
 * contradiction. A communicator that has seen a tagged call is a tagged communicator: an
 * untagged all-gather or reduce-scatter on it is an error.
 *
 * Every function returns 0 on success or a negative mfsdp_status_t; the message is then
 * available from mfsdp_shim_last_error() on the same thread. None of them is collective
 * except where stated. They are safe to call from several threads.
 */
#ifndef MFSDP_SHIM_H
#define MFSDP_SHIM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** ABI version of this interface; the companion refuses a shim with another. */
#define MFSDP_SHIM_ABI_VERSION 3

/** What the next collective of this thread is. */
typedef enum mfsdp_shim_tag_kind {
    /** FSDP's all-gather (unshard) of the group: filled from the owners */
    MFSDP_SHIM_TAG_ALLGATHER = 0,
    /** FSDP's reduce-scatter of the group over the params flagged in has_grad */
    MFSDP_SHIM_TAG_REDUCE_SCATTER = 1,
    /** HSDP: the all-reduce of the group's reduce-scatter output over the replicate group */
    MFSDP_SHIM_TAG_REPLICATE = 2,
    /** weight write-back: the next all-gather (float32, count = the group's sum of shard
     *  elements s_i) gets, in this rank's block (recv + rank * count), its rows of the
     *  owners' fp32 master weights of the group's owner-managed params, FSDP's layout in
     *  fp32; the job's own params' bytes and the other ranks' blocks are not written. Used
     *  before the job saves a checkpoint so that its own shards hold the trained weights. */
    MFSDP_SHIM_TAG_SYNC = 3,
    /** momentum export: as MFSDP_SHIM_TAG_SYNC, with the owners' Muon momentum of the group's
     *  owned matrices (the rows torch.optim.Muon's "momentum_buffer" would hold) instead of
     *  their weights; only the owned matrices' bytes of this rank's block are written.
     *  Since ABI 3. */
    MFSDP_SHIM_TAG_SYNC_MOMENTUM = 4,
    /** momentum import: the next all-gather (float32, count = the group's sum of shard elements
     *  s_i) sends the owned matrices' rows of its input, in FSDP's layout in fp32, to their
     *  owners, which take them as their Muon momentum (an optimizer state loaded; zeros
     *  restart it). The output is not written; weights and gradients are unchanged.
     *  Since ABI 3. */
    MFSDP_SHIM_TAG_LOAD_MOMENTUM = 5,
} mfsdp_shim_tag_kind_t;

/** @brief MFSDP_SHIM_ABI_VERSION of the loaded shim. */
int mfsdp_shim_abi_version(void);

/**
 * @brief Register a manifest (mfsdp-manifest/1 JSON) for tagged mode.
 * @return a handle >= 0, or a negative status (bad manifest: the message names the JSON path)
 *
 * The manifest binds to the communicator of its first tagged call; the runtime context is
 * created there (collectively: every rank reaches it on the same FSDP collective). Its
 * "world_size" must equal that communicator's size. Tail policy defaults to "job" and the
 * step mode to manual (mfsdp_shim_step) in tagged mode.
 */
int mfsdp_shim_register(const char *json, size_t len);

/**
 * @brief Tag the next collective this thread issues.
 * @param handle    from mfsdp_shim_register()
 * @param kind      mfsdp_shim_tag_kind_t
 * @param group     group index in the registered manifest
 * @param has_grad  REDUCE_SCATTER: nparams bytes, 1 for each param of the group in this reduce
 *                  (it has a gradient now), else 0; NULL means every requires_grad param.
 *                  Ignored for other kinds.
 * @param nparams   the group's param count (checked; at most 4096)
 */
int mfsdp_shim_tag(int handle, int kind, size_t group, const unsigned char *has_grad,
                   size_t nparams);

/** @brief Drop this thread's pending tag (the tagged collective was not issued). */
int mfsdp_shim_untag(void);

/**
 * @brief 1 when this thread's tag is still pending, else 0. Called right after the tagged
 *        collective returned, 1 means that the collective never reached the shim (the
 *        framework served it without calling ncclAllGather / ncclReduceScatter /
 *        ncclAllReduce, e.g. a process group that copies locally on one rank, or another
 *        transport): the caller must stop, since the owners did not take part.
 */
int mfsdp_shim_tag_pending(void);

/**
 * @brief Run the owners' optimizer step now (the job's optimizer.step()): every group with at
 *        least one reduce since the last step. Muon's and AdamW's lr are multiplied by
 *        @p lr_factor (the job optimizer's current lr / its initial lr, so the job's schedule is
 *        followed). A no-op before the manifest's first tagged call. Local (no collective).
 */
int mfsdp_shim_step(int handle, double lr_factor);

/**
 * @brief This rank's squared L2 norm of the owners' accumulated gradients (owned tensors and
 *        sharded-tail slices), not reduced across ranks: clip_grad_norm_ adds it to the job's
 *        own squared norm before its all-reduce. 0 before the first tagged call.
 */
int mfsdp_shim_grad_sqnorm(int handle, double *sq);

/** @brief Multiply the owners' accumulated gradients by @p coef (clip_grad_norm_). */
int mfsdp_shim_scale_grads(int handle, double coef);

/**
 * @brief Drop the owners' accumulated gradients and restart the accumulation window (the job's
 *        zero_grad() without a step: a skipped step). A no-op before the first tagged call.
 *        Since ABI 2.
 */
int mfsdp_shim_zero_grads(int handle);

/**
 * @brief The job loaded new weights into its shards (load_state_dict): the owners take theirs
 *        from the shards again at each group's next all-gather; optimizer state is kept. A
 *        no-op before the first tagged call. Since ABI 2.
 */
int mfsdp_shim_reload(int handle);

/** @brief This thread's last error message, "" when none. */
const char *mfsdp_shim_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_SHIM_H */
