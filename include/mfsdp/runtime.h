/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file runtime.h
 * @brief The mfsdp runtime: owner-broadcast all-gather, reduce-to-owner, owner-side
 *        optimizer step (docs/design.md).
 *
 * A context binds a manifest and its owner plan to a communicator. It keeps, on every
 * rank, one owner arena (fp32 master weights, comm-dtype copies, fp32 gradient
 * accumulators, Muon momentum, AdamW moments) for the tensors the rank owns whole and for
 * its slices of sharded-tail tensors. FSDP's collectives map onto it:
 *
 *  - mfsdp_ctx_allgather() replaces `AllGather(send, recv, S, dtype)` of one param group:
 *    it fills FSDP's rank-major buffer (docs/design.md, "FSDP2's byte layout") from the owners,
 * padding rows zeroed. The first call of a group also takes the initial weights from @p sendbuf
 *    (each rank's FSDP shard), so the job's own initialization is kept.
 *  - mfsdp_ctx_reduce() replaces `ReduceScatter(send, recv, S', dtype, op)`: every owner
 *    receives the op-reduced full gradient of the matrices it owns and accumulates it into
 *    its fp32 gradient; sharded-tail slices are reduced onto their ranks.
 *  - The optimizer step runs on owners only (Muon on owned matrices, AdamW on the tail),
 *    eagerly when a group's last micro-step reduce lands, or lazily before the next
 *    iteration's first all-gather (required with gradient clipping).
 *
 * All functions taking a context are collective over the context's communicator unless
 * stated otherwise: every rank must call them in the same order with the same group,
 * count, dtype and op. Argument checks that can fail depend only on such rank-identical
 * arguments, so every rank fails the same way and no rank waits for another. A NULL
 * pointer passed on one rank only is still rejected on that rank, but its peers may then
 * wait; do not do that.
 *
 * The communicator-specific constructors live in mfsdp/runtime_mpi.h (MPI + CPU) and
 * mfsdp/runtime_nccl.h (NCCL: CUDA on device memory, or the CPU over the test library).
 *
 * A C trainer's iteration (FSDP's buffers and calls, remapped):
 * @code
 *   mfsdp_ctx_h ctx;
 *   mfsdp_ctx_create_mpi(manifest, NULL, comm, &ctx);
 *   for (;;) {
 *       for (g = 0; g < ngroups; g++)      // forward: unshard each group
 *           mfsdp_ctx_allgather(ctx, g, my_shard[g], full[g], S[g], ag_dtype[g]);
 *       ...                                  // backward, reduce-scatter inputs in grad[g]
 *       for (g = ngroups; g-- > 0;)
 *           mfsdp_ctx_reduce(ctx, g, grad[g], out[g], S_rs[g], rs_dtype[g], MFSDP_OP_AVG, 0);
 *   }                                        // steps run on owners (eager or lazy)
 *   mfsdp_ctx_flush(ctx);                    // the last lazy step
 *   mfsdp_ctx_get_param(ctx, "layers.0.wq", &view);  // view.master on the owner
 *   mfsdp_ctx_destroy(&ctx);
 * @endcode
 */
#ifndef MFSDP_RUNTIME_H
#define MFSDP_RUNTIME_H

#include "mfsdp/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Opaque runtime context. */
typedef struct mfsdp_ctx *mfsdp_ctx_h;

/** Options of a context. Zero-initialized means: take everything from MFSDP_* variables. */
typedef struct mfsdp_ctx_opts {
    /** A plan to use (borrowed: must outlive the context and be built for the same
     *  manifest and world size), or NULL to plan inside mfsdp_ctx_create_mpi(). */
    const mfsdp_plan_t *plan;
    /** 1: plan with @ref plan_opts; 0: plan with MFSDP_TAIL, MFSDP_MEM_LIMIT, MFSDP_SPREAD. */
    int has_plan_opts;
    mfsdp_plan_opts_t plan_opts; /**< used when @ref has_plan_opts is 1 */
    /** Owner-broadcast algorithm; AUTO: MFSDP_GATHER_ALGO, and when that is auto too, per
     *  group the first matching row of the measured table MFSDP_ALGO_TABLE, else direct up to
     *  8 ranks and chain above. */
    mfsdp_algo_t gather_algo;
    mfsdp_algo_t reduce_algo;    /**< reduce-to-owner algorithm; AUTO: MFSDP_REDUCE_ALGO */
    size_t chain_chunk;          /**< chain pipeline chunk in bytes; 0: MFSDP_CHAIN_CHUNK */
    int has_step_mode;           /**< 1: use @ref step_mode; 0: MFSDP_STEP, the manifest */
    mfsdp_step_mode_t step_mode; /**< eager, lazy or manual */
    int accum_steps;             /**< reduces per optimizer step; 0: MFSDP_ACCUM_STEPS, the
                                      manifest's training.micro_steps */
    int has_clip;                /**< 1: use @ref clip; 0: MFSDP_CLIP, the manifest */
    double clip;                 /**< global gradient-norm threshold, 0 = off */
    int no_mlock;                /**< 1: do not page-lock the arena (else MFSDP_MLOCK) */
    size_t staging_bytes;        /**< staging budget per rank; 0: MFSDP_STAGING_BYTES */
} mfsdp_ctx_opts_t;

/** One parameter as seen from this rank (mfsdp_ctx_get_param()). */
typedef struct mfsdp_param_view {
    size_t group;        /**< group index in the manifest */
    size_t param;        /**< param index in its group */
    mfsdp_role_t role;   /**< MUON or ADAMW */
    int owner;           /**< owner rank, or MFSDP_OWNER_SHARDED */
    int local;           /**< 1 when this rank holds the tensor (owner) or a slice of it */
    int initialized;     /**< 1 once the group's first all-gather took the weights */
    mfsdp_dtype_t dtype; /**< param (comm) dtype */
    int ndim;            /**< as in the manifest */
    int64_t shape[MFSDP_MAX_DIMS];
    int64_t rows;  /**< 2-D view rows */
    int64_t cols;  /**< 2-D view cols */
    int64_t numel; /**< elements of the whole tensor */
    /** Elements held here: numel for an owned tensor, the FSDP slice (c * R, including
     *  padding rows) for a sharded-tail tensor, 0 when not local. */
    size_t local_elems;
    /** Element offset of the local data in the whole tensor (r * c * R for a slice). */
    size_t local_offset;
    /** Elements of the local data that are real rows (the rest is zero padding). */
    size_t local_valid;
    const float *master; /**< fp32 master weights (local_elems), NULL when not local */
    const float *grad;   /**< fp32 accumulated gradient, NULL when not local or frozen */
    const void *comm;    /**< comm-dtype copy (local_elems of dtype), NULL when not local */
} mfsdp_param_view_t;

/** Counters and memory of a context on this rank (mfsdp_ctx_get_stats()). */
typedef struct mfsdp_ctx_stats {
    int rank;                             /**< this rank */
    int world;                            /**< communicator size */
    size_t arena_bytes[MFSDP_ARENA_NCAT]; /**< owner-arena bytes per category */
    size_t staging_bytes;                 /**< communication staging + optimizer workspace */
    size_t peak_bytes;                    /**< everything the context keeps allocated */
    int mlocked;                          /**< 1 when the arena is page-locked */
    int numa_node;                        /**< NUMA node the arena is bound to, -1 if none */
    uint64_t steps;                       /**< optimizer steps run (any group) */
    uint64_t allgathers;                  /**< mfsdp_ctx_allgather() calls completed */
    uint64_t reduces;                     /**< mfsdp_ctx_reduce() calls completed */
    double step_seconds;                  /**< wall time spent in owner optimizer steps */
    double last_grad_norm;                /**< global norm of the last clipped step, or -1 */
    mfsdp_algo_t gather_algo;             /**< resolved algorithms: every group's, or AUTO
                                               when groups differ (mfsdp_ctx_group_algos) */
    mfsdp_algo_t reduce_algo;
    mfsdp_step_mode_t step_mode; /**< resolved step mode */
    int accum_steps;             /**< resolved micro-steps per step */
    size_t comm_staging_bytes;   /**< communication staging: the largest group call's need */
    size_t staging_budget;       /**< MFSDP_STAGING_BYTES (or the option) it is held to */
    int gather_shared; /**< 1: direct all-gathers copy the tensors of owners on this rank's node
                            from their arenas in shared memory (MPI, MFSDP_SHM) */
} mfsdp_ctx_stats_t;

/**
 * @brief Owner-broadcast all-gather of one param group into FSDP's rank-major layout.
 *
 * Equivalent to `AllGather(sendbuf, recvbuf, count, dtype)` of FSDP even shards of the
 * current weights (docs/design.md, "FSDP2's byte layout"): recvbuf[r*S + o_i, +s_i) holds rows
 * [r*c_i, (r+1)*c_i) of param i and zero for rows >= N0_i. In a lazy context, the pending
 * optimizer steps run first, once every group that has gradients has completed its
 * accumulation window (so the backward pass's re-gathers do not trigger them; with
 * clipping this is where the one scalar all-reduce happens). The first call of each group
 * takes the initial weights from @p sendbuf (this rank's FSDP shard of every param).
 * @param [in]  ctx      context
 * @param [in]  group    group index in the manifest
 * @param [in]  sendbuf  this rank's shard (count elements); may equal recvbuf + r*count*elt
 *                       (FSDP's in-place convention); read on a group's first call, and on
 *                       every call under tail policy "job" (the job's own slices of its
 *                       AdamW tensors travel)
 * @param [out] recvbuf  world * count elements
 * @param [in]  count    S in units of @p dtype; must equal the group's all-gather count
 * @param [in]  dtype    the group's all-gather dtype (MFSDP_UINT8 for mixed-dtype groups)
 * @return MFSDP_OK, MFSDP_ERR_STATE (destroyed context), MFSDP_ERR_INVALID_ARG (group
 *         index, NULL buffer), MFSDP_ERR_MISMATCH (count or dtype), MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_allgather(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                             void *recvbuf, size_t count, mfsdp_dtype_t dtype);

/**
 * @brief Reduce-to-owner of one group's gradients (replaces FSDP's reduce-scatter).
 *
 * @p sendbuf is FSDP's reduce-scatter input: world blocks of @p recvcount elements over the
 * group's params that have a gradient. Each owned tensor's full gradient, reduced with
 * @p op (sum, avg = sum / world, premulsum = sum of scalar * contribution), is accumulated
 * into its owner's fp32 gradient; sharded-tail slices are reduced onto their ranks. On
 * return @p recvbuf holds zeros for owner-managed bytes and the reduced slice (in @p dtype)
 * for sharded-tail bytes. In an eager context, the group's optimizer step runs when this
 * call completes its accumulation window. In a lazy context, a reduce into a window that is
 * complete but not yet stepped (another group that trains did not reduce in that window, so
 * the lazy trigger never fired) returns MFSDP_ERR_STATE instead of merging two windows.
 * @param [in]  ctx        context
 * @param [in]  group      group index
 * @param [in]  sendbuf    world * recvcount elements of @p dtype
 * @param [out] recvbuf    recvcount elements (must not overlap @p sendbuf)
 * @param [in]  recvcount  S' of the group's reduce-scatter layout
 * @param [in]  dtype      the group's reduce dtype
 * @param [in]  op         MFSDP_OP_SUM, MFSDP_OP_AVG or MFSDP_OP_PREMULSUM
 * @param [in]  scalar     PREMULSUM factor (ignored for other ops; must be finite)
 * @return MFSDP_OK, MFSDP_ERR_STATE, MFSDP_ERR_INVALID_ARG, MFSDP_ERR_MISMATCH,
 *         MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_reduce(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                          void *recvbuf, size_t recvcount, mfsdp_dtype_t dtype,
                                          mfsdp_redop_t op, double scalar);

/**
 * @brief Reduce-to-owner of a reduce-scatter over a subset of the group's params.
 *
 * FSDP2 reduces only the params that got a gradient in this backward (frozen and unused
 * params drop out, so the count shrinks). @p has_grad holds one flag per param of the group:
 * 1 when the param is in this reduce-scatter. NULL means every requires_grad param (then this
 * is mfsdp_ctx_reduce()). A param without gradient in a whole accumulation window is not
 * stepped and keeps its optimizer state, as torch's optimizers skip a param whose grad is
 * None. Every rank must pass the same flags. A reduce with no flag set (recvcount 0) still
 * counts as one of the group's micro-steps.
 *
 * @p op and @p scalar are the job's reduce-scatter op; @p post is the divide the job applies
 * to the collective's output afterwards (FSDP2's fp16 and force_sum paths, an MPI job's
 * average), 1 when none: the owners' gradient is the op's result divided by @p post, and
 * @p recvbuf gets the op's result, as the job's collective would return it.
 * @return as mfsdp_ctx_reduce(); MFSDP_ERR_INVALID_ARG for a flag on a param that does not
 *         require a gradient, MFSDP_ERR_MISMATCH when recvcount is not that subset's S'
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_reduce_params(mfsdp_ctx_h ctx, size_t group,
                                                 const unsigned char *has_grad, const void *sendbuf,
                                                 void *recvbuf, size_t recvcount,
                                                 mfsdp_dtype_t dtype, mfsdp_redop_t op,
                                                 double scalar, double post);

/**
 * @brief HSDP: replaces the job's all-reduce of a group's reduce-scatter output over the
 *        replicate group (manifest "replicate" > 1).
 *
 * Owners of the same tensor in different replicas all-reduce the gradient the preceding
 * mfsdp_ctx_reduce() / mfsdp_ctx_reduce_params() of @p group delivered, then accumulate it
 * (this completes the reduce: an eager step may run here). @p op is the job's all-reduce op
 * (avg over the replicas, sum, or premulsum). On return @p recvbuf is what the job's
 * all-reduce would have produced for the bytes the job still owns (tail policy "job") and zero
 * for owner-managed bytes. Collective over the replicate communicator
 * (mfsdp_ctx_attach_replicate_mpi()); every reduce of an HSDP context must be followed by it.
 * @return MFSDP_OK, MFSDP_ERR_STATE (not HSDP, nothing attached, or not the group whose
 *         reduce is waiting), MFSDP_ERR_MISMATCH (count or dtype differ from that reduce),
 *         MFSDP_ERR_INVALID_ARG, MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_replicate(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                             void *recvbuf, size_t count, mfsdp_dtype_t dtype,
                                             mfsdp_redop_t op, double scalar);

/**
 * @brief Write the owners' fp32 master weights back into this rank's FSDP shard of a group
 *        (before the job saves its own checkpoint, so that it holds the trained weights).
 *
 * @p block is this rank's shard in FSDP's layout, in float32: the params in FSDP order, param
 * i at element offset o_i = sum of earlier s_j, rows [rank * c_i, (rank + 1) * c_i) of it, rows
 * past the tensor zero. Owner-managed params (and sharded-tail slices the context holds) are
 * written; the job's own params (tail "job") are left untouched. Collective (owners send each
 * rank its rows: the owned bytes cross the network once).
 * @param [out] block  count floats
 * @param [in]  count  sum of the group's s_i
 * @return MFSDP_OK, MFSDP_ERR_STATE (group not all-gathered yet), MFSDP_ERR_MISMATCH (count),
 *         MFSDP_ERR_INVALID_ARG, MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_scatter_masters(mfsdp_ctx_h ctx, size_t group, float *block,
                                                   size_t count);

/**
 * @brief Write the owners' Muon momentum into this rank's FSDP shard of a group, in the layout
 *        of mfsdp_ctx_scatter_masters() (fp32, padding rows zero): the job's optimizer state
 *        dict then holds each owned matrix's momentum as the shards torch.optim.Muon keeps
 *        ("momentum_buffer"; mfsdp's Muon updates it as torch does, m = mu m + (1 - mu) g).
 *        Only owned trainable Muon tensors are written (a frozen one has no momentum); the
 *        rows of every other param are left untouched. Collective (owners send each rank its
 *        rows). Call it between steps (in lazy step mode after mfsdp_ctx_flush()).
 * @return MFSDP_OK, MFSDP_ERR_MISMATCH (count), MFSDP_ERR_INVALID_ARG, MFSDP_ERR_TRANSPORT
 * @since the shim's tagged-mode ABI 3
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_scatter_momentum(mfsdp_ctx_h ctx, size_t group, float *block,
                                                    size_t count);

/**
 * @brief The reverse of mfsdp_ctx_scatter_momentum(): every rank sends the rows of this
 *        rank's FSDP shard (same layout) of each owned trainable Muon tensor to its owner,
 *        which replaces its momentum with them (a resume, or an optimizer state loaded
 *        mid-run; zero rows restart the momentum from zero). Padding rows and other params'
 *        rows are not read. Weights, gradients and step counts are unchanged. Collective.
 * @return MFSDP_OK, MFSDP_ERR_MISMATCH (count), MFSDP_ERR_INVALID_ARG, MFSDP_ERR_TRANSPORT
 * @since the shim's tagged-mode ABI 3
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_gather_momentum(mfsdp_ctx_h ctx, size_t group,
                                                   const float *block, size_t count);

/**
 * @brief Multiply the learning rates of the following steps by @p factor (the job's own
 *        schedule: its current lr / its initial lr). Replaces the manifest's schedule; a
 *        negative factor returns to it. Not collective (every rank should set the same).
 * @return MFSDP_OK, MFSDP_ERR_STATE, MFSDP_ERR_INVALID_ARG (not finite)
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_set_lr_factor(mfsdp_ctx_h ctx, double factor);

/**
 * @brief This rank's squared L2 norm of the accumulated gradients it holds (owned tensors and
 *        sharded-tail slices), not reduced across ranks. Not collective.
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_grad_sqnorm(mfsdp_ctx_h ctx, double *sq_p);

/** @brief Multiply the accumulated gradients this rank holds by @p coef. Not collective. */
MFSDP_API mfsdp_status_t mfsdp_ctx_scale_grads(mfsdp_ctx_h ctx, double coef);

/**
 * @brief Drop the accumulated gradients this rank holds (set to zero, non-finite values too)
 *        and restart every group's accumulation window: what the job's zero_grad() does to a
 *        step it skips (a GradScaler-style inf check, a skipped batch). Every rank must call it
 *        at the same point. Not collective.
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_zero_grads(mfsdp_ctx_h ctx);

/**
 * @brief The job loaded new weights into its shards (load_state_dict): the owners take their
 *        weights from the shards again at each group's next all-gather, as at the first one.
 *        Optimizer state (momentum, AdamW moments, step counts) is kept, as torch keeps it.
 *        Every rank must call it at the same point. Not collective.
 * @return MFSDP_OK, MFSDP_ERR_STATE (a reduce waits for its replicate all-reduce)
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_reload_weights(mfsdp_ctx_h ctx);

/**
 * @brief End the accumulation window now: run the optimizer step of every group that has
 *        at least one accumulated micro-step (Muon on owned matrices, AdamW on the tail).
 *
 * Runs no collective, except exactly one scalar all-reduce of the squared gradient norm
 * when clipping is on. Collective only in that case, but call it on every rank.
 * @param [in] ctx  context
 * @return MFSDP_OK, MFSDP_ERR_STATE (destroyed context, or a group whose weights were
 *         never all-gathered), kernel errors, MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_step(mfsdp_ctx_h ctx);

/**
 * @brief Run the pending lazy steps (groups whose accumulation window is complete); a
 *        no-op in an eager context. Call before reading weights, checkpointing or exit.
 * @param [in] ctx  context
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_flush(mfsdp_ctx_h ctx);

/**
 * @brief Look up a parameter by name. Not collective.
 * @param [in]  ctx     context
 * @param [in]  name    fully-qualified name as in the manifest
 * @param [out] view_p  written on success; pointers stay valid until the next mutating
 *                      call (allgather, reduce, step, flush, destroy)
 * @return MFSDP_OK, MFSDP_ERR_STATE, MFSDP_ERR_INVALID_ARG, MFSDP_ERR_NOT_FOUND
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_get_param(mfsdp_ctx_h ctx, const char *name,
                                             mfsdp_param_view_t *view_p);

/**
 * @brief The stream of the intercepted call (a `cudaStream_t`; NULL: the legacy default
 *        stream). Everything later calls enqueue — copies, reductions, the transfers, the
 *        eager step of a reduce, the lazy step of an all-gather — goes on it, in call order,
 *        before the call returns, so that events the job records after its call cover that
 *        work; the host does not wait for it (only the clipping norm does). Set it before
 *        each remapped call whose stream differs from the last. Not collective; with host
 *        memory (the MPI backend, the test NCCL library) every call completes before it
 *        returns and the stream is ignored.
 * @param [in] ctx     context
 * @param [in] stream  cudaStream_t as `void *`
 * @return MFSDP_OK, MFSDP_ERR_STATE (destroyed context), MFSDP_ERR_CUDA
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_set_stream(mfsdp_ctx_h ctx, void *stream);

/**
 * @brief Counters, resolved settings and memory of this rank. Not collective.
 * @param [in]  ctx      context
 * @param [out] stats_p  written on success
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_get_stats(mfsdp_ctx_h ctx, mfsdp_ctx_stats_t *stats_p);

/**
 * @brief The algorithms one param group runs (with `auto` and an algorithm table,
 *        MFSDP_ALGO_TABLE, they can differ by group). Not collective.
 * @param [in]  ctx       context
 * @param [in]  group     group index (manifest order)
 * @param [out] gather_p  its owner-broadcast algorithm (may be NULL)
 * @param [out] reduce_p  its reduce-to-owner algorithm (may be NULL)
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_group_algos(mfsdp_ctx_h ctx, size_t group,
                                               mfsdp_algo_t *gather_p, mfsdp_algo_t *reduce_p);

/**
 * @brief The plan the context runs (owned by the context or borrowed from the options).
 *        Not collective.
 * @param [in]  ctx     context
 * @param [out] plan_p  written on success
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_get_plan(mfsdp_ctx_h ctx, const mfsdp_plan_t **plan_p);

/**
 * @brief Release a context and set *ctx_p to NULL, so that a later call with the same
 *        variable returns MFSDP_ERR_STATE. Pending lazy steps are not run: call
 *        mfsdp_ctx_flush() first. Collective: it frees the context's duplicated
 *        communicator (before MPI_Finalize).
 * @param [in,out] ctx_p  NULL or *ctx_p == NULL is allowed
 */
MFSDP_API void mfsdp_ctx_destroy(mfsdp_ctx_h *ctx_p);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_RUNTIME_H */
