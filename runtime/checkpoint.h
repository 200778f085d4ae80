/* SPDX-License-Identifier: Apache-2.0 */
/* Internal interface of runtime/checkpoint.c (the public one is mfsdp/checkpoint.h). */
#ifndef MFSDP_RUNTIME_CHECKPOINT_H
#define MFSDP_RUNTIME_CHECKPOINT_H

#include "core/ckpt_io.h"
#include "mfsdp/checkpoint.h"
#include "runtime/ctx.h"

/* Called at every progress point of a save, in the caller's thread and in the background
 * writer (the safetensors writer's points, the write protocol's, and "save:begun",
 * "save:snapshot" in the caller). For crash tests only: a test sets it and kills the
 * process at the N-th point; it is never set otherwise. */
extern mfsdp_ckpt_hook_t mfsdp_ckpt_test_hook;

/* Wait for a pending save (collective when one is pending, as mfsdp_ctx_save_wait()) and
 * free the context's checkpoint state; errors are logged. Called by mfsdp_ctx_free(). */
void mfsdp_ckpt_ctx_release(struct mfsdp_ctx *ctx);

/* Checkpoint layout of a context's plan. */
mfsdp_status_t mfsdp_ckpt_ctx_layout(const struct mfsdp_ctx *ctx, mfsdp_ckpt_layout_t **lay_p);

/* 1 when the context may be saved now, as far as its own state says (every group has
 * weights, no accumulation window open, no lazy step pending: saving would not change when
 * steps run) and, with `equal`, every group that reduces has taken the same number of steps
 * (no iteration half-stepped); *step_p: the name a save would get (the largest group step
 * count). The same on every rank: it depends only on the calls made. */
int mfsdp_ckpt_ctx_boundary(const struct mfsdp_ctx *ctx, int equal, int64_t *step_p);

/* MFSDP_OK when the context can be saved and loaded, else MFSDP_ERR_UNSUPPORTED with the
 * reason logged (tail "job"; state in device memory). */
mfsdp_status_t mfsdp_ckpt_ctx_supported(const struct mfsdp_ctx *ctx);

/* This rank's index among the replicas (HSDP, once the replicate communicator is attached),
 * -1 when none is attached. */
int mfsdp_ckpt_ctx_replica(const struct mfsdp_ctx *ctx);

#endif /* MFSDP_RUNTIME_CHECKPOINT_H */
