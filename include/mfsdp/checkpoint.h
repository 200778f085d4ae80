/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file checkpoint.h
 * @brief Owner checkpoints in safetensors (docs/checkpoints.md): save and resume a runtime
 *        context at any world size, and offline conversions.
 *
 * A checkpoint root DIR holds one directory per checkpoint, DIR/step-SSSSSSSS, and
 * DIR/latest naming the newest complete one. A checkpoint directory holds, per rank R of the
 * N that saved it, model-RRRRR-of-NNNNN.safetensors (the whole weights it owns, in the param
 * dtype: an ordinary state-dict shard) and optim-RRRRR-of-NNNNN.safetensors (fp32 masters of
 * non-fp32 params, Muon momentum, AdamW m and v), and model.safetensors.index.json (Hugging
 * Face's weight_map, plus mfsdp's section: plan, step counters, hyper-parameters, manifest,
 * a SHA-256 per file). `transformers` and `safetensors` load the model files directly.
 *
 * Writes are crash-safe: files go to temporary names, are fsync'ed and renamed inside
 * DIR/step-S.partial; the index is written last, the directory is then renamed to
 * DIR/step-S and DIR/latest replaced atomically. A crash at any point leaves the previous
 * checkpoint intact and named by DIR/latest. docs/checkpoints.md has the details.
 *
 * The context functions are collective over the context's communicator (call them on every
 * rank, in the same order, with the same path); every rank returns the same status.
 *
 * Resuming a job (the context must be created for the same manifest; world size and plan
 * may differ from the run that saved):
 * @code
 *   mfsdp_ctx_create_mpi(manifest, NULL, comm, &ctx);
 *   if (resume) mfsdp_ctx_load(ctx, "ckpt");          // DIR/latest, any world size
 *   for (step = ...; ; step++) {
 *       ... allgather / reduce ...
 *       if (step % 1000 == 0) mfsdp_ctx_save(ctx, "ckpt");  // returns after a copy
 *   }
 *   mfsdp_ctx_save(ctx, "ckpt");
 *   mfsdp_ctx_save_wait(ctx);                          // committed, or an error
 *   mfsdp_ctx_destroy(&ctx);
 * @endcode
 */
#ifndef MFSDP_CHECKPOINT_H
#define MFSDP_CHECKPOINT_H

#include "mfsdp/runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Per-rank figures of a context's checkpoint activity (mfsdp_ctx_get_ckpt_stats()). */
typedef struct mfsdp_ckpt_stats {
    uint64_t saves;             /**< saves started */
    uint64_t commits;           /**< saves completed and committed (seen by save_wait) */
    uint64_t loads;             /**< successful loads */
    double stall_seconds;       /**< last save: time the caller was held (copy of the owned
                                     bytes, the gather of sharded-tail weights, agreement);
                                     pending lazy steps run before and are not counted */
    uint64_t snapshot_bytes;    /**< last save: bytes copied on this rank */
    double wait_seconds;        /**< last save: time it first waited for the previous save's
                                     background write (0 when that one had finished) */
    double write_seconds;       /**< last completed save: this rank's background write of its
                                     two files (fsync included) */
    uint64_t write_bytes;       /**< last completed save: bytes this rank wrote */
    double load_seconds;        /**< last load: wall time on this rank */
    uint64_t load_bytes;        /**< last load: tensor bytes this rank read */
    uint64_t verify_bytes;      /**< last load: file bytes this rank read to verify checksums */
    int64_t step;               /**< step of the last committed save or of the loaded
                                     checkpoint; -1 when none */
    double max_stall_seconds;   /**< largest stall_seconds of all saves */
    double total_stall_seconds; /**< sum of stall_seconds over all saves */
} mfsdp_ckpt_stats_t;

/**
 * @brief Start a checkpoint of the context into the root @p dir. Collective.
 *
 * Waits for the previous save first: if that one failed, its error is returned here and no
 * new save starts. Then runs pending lazy steps (as mfsdp_ctx_flush()), copies the bytes this
 * rank owns into a host buffer, gathers each sharded-tail weight whole onto one writer rank,
 * and returns; the files are written and committed by a background thread. The checkpoint
 * is named after the largest group step count: @p dir/step-SSSSSSSS.
 * @param [in] ctx  context; every group must have been all-gathered (it has weights) and
 *                  no accumulation window may be open (save at an optimizer-step boundary)
 * @param [in] dir  checkpoint root (created if needed; a filesystem every rank sees)
 * @return MFSDP_OK, MFSDP_ERR_STATE (no weights yet, an open accumulation window, destroyed
 *         context), MFSDP_ERR_INVALID_ARG, MFSDP_ERR_IO, MFSDP_ERR_NO_MEMORY,
 *         MFSDP_ERR_TRANSPORT, or the error of the previous save
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_save(mfsdp_ctx_h ctx, const char *dir);

/**
 * @brief Wait until the pending save (if any) is written and committed. Collective.
 * @return MFSDP_OK (nothing pending, or committed), or the save's error (every rank)
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_save_wait(mfsdp_ctx_h ctx);

/**
 * @brief Load a checkpoint into the context: weights, fp32 masters, optimizer state and
 *        step counters, at any world size and plan. Collective.
 *
 * @p path is a checkpoint root (its `latest`), a checkpoint directory, or a full
 * safetensors file (then as mfsdp_ctx_load_full()). Each rank reads the tensors and
 * sharded-tail slices it owns now from whichever files hold them, and verifies the
 * checksums of a share of the files; the index, names, shapes and dtypes are checked
 * against the context's manifest (groups and params must be the same; hyper-parameters may
 * differ). Afterwards the context behaves as if it had run those steps: every group holds
 * its weights (the next all-gather does not take the job's), AdamW continues at its step.
 * On failure (any rank), every rank returns the error and the context is reset to its
 * freshly created state: no weights, zero optimizer state, zero counters.
 * @return MFSDP_OK, MFSDP_ERR_NOT_FOUND, MFSDP_ERR_PARSE, MFSDP_ERR_CHECKSUM,
 *         MFSDP_ERR_MISMATCH (manifest, shape, dtype), MFSDP_ERR_IO, MFSDP_ERR_UNSUPPORTED,
 *         MFSDP_ERR_STATE (a *.partial directory; destroyed context), MFSDP_ERR_TRANSPORT
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_load(mfsdp_ctx_h ctx, const char *path);

/**
 * @brief Start from the weights of a full safetensors file (every tensor whole, e.g. from
 *        mfsdp_ckpt_export_full() or a Hugging Face shard merged into one file). Collective.
 *
 * The fp32 masters are the file's values converted to fp32 (bit-exact when the file is F32
 * or has the param dtype); the comm copies are the masters in the param dtype. Optimizer
 * state and counters start at zero; every group counts as initialized. Tensors the manifest
 * does not name are ignored. Failure resets the context as mfsdp_ctx_load() does.
 */
MFSDP_API mfsdp_status_t mfsdp_ctx_load_full(mfsdp_ctx_h ctx, const char *path);

/** @brief Checkpoint figures of this rank. Not collective. */
MFSDP_API mfsdp_status_t mfsdp_ctx_get_ckpt_stats(mfsdp_ctx_h ctx, mfsdp_ckpt_stats_t *stats_p);

/* ---- offline (no context, not collective) ---------------------------------------------- */

/**
 * @brief Verify a checkpoint: the index (its own digest, structure, agreement with the
 *        manifest), every file's size and SHA-256, every header, and that each file holds
 *        exactly the tensors the index places there.
 * @param [in]  path    root or checkpoint directory
 * @param [out] err     first error as one line (may be NULL)
 * @param [in]  errlen  size of @p err
 */
MFSDP_API mfsdp_status_t mfsdp_ckpt_verify(const char *path, char *err, size_t errlen);

/**
 * @brief Write every tensor whole into one safetensors file @p out: the weights in the param
 *        dtype, or with @p fp32 the fp32 masters. Written to a temporary name and renamed.
 */
MFSDP_API mfsdp_status_t mfsdp_ckpt_export_full(const char *path, const char *out, int fp32,
                                                char *err, size_t errlen);

/**
 * @brief Re-plan a checkpoint at @p world ranks (its stored manifest; @p opts, or the stored
 *        tail policy when NULL) and write it as a new checkpoint under the root @p out_root.
 */
MFSDP_API mfsdp_status_t mfsdp_ckpt_reshard(const char *path, int world,
                                            const mfsdp_plan_opts_t *opts, const char *out_root,
                                            char *err, size_t errlen);

/**
 * @brief Make a checkpoint for @p world ranks from ordinary weights: every param of
 *        @p manifest read whole from the safetensors file @p in (same shape; F32, BF16 or
 *        F16), zero optimizer state, step 0; written under the root @p out_root.
 */
MFSDP_API mfsdp_status_t mfsdp_ckpt_import_full(const char *in, const mfsdp_manifest_t *manifest,
                                                int world, const mfsdp_plan_opts_t *opts,
                                                const char *out_root, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_CHECKPOINT_H */
