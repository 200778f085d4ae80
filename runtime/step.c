/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The owner-side optimizer step: Muon on owned matrices, AdamW on the tail, clipping,
 * eager and lazy triggers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/checks.h"
#include "mfsdp/kernels.h"
#include "core/settings.h"
#include "runtime/ctx.h"

/* ---------------------------------------------------------------------------------------
 * Optimizer step
 */

/* Visit every local gradient of group g: fn(ctx, grad, elems, arg). */
typedef mfsdp_status_t (*grad_fn)(struct mfsdp_ctx *ctx, float *grad, size_t elems, void *arg);

static mfsdp_status_t for_each_grad(struct mfsdp_ctx *ctx, size_t g, grad_fn fn, void *arg)
{
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        float *grad =
            s->owner == ctx->rank ? mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_GRAD) : NULL;
        if (grad != NULL) {
            MFSDP_CHECK(fn(ctx, grad, s->numel, arg));
        }
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t shard = ctx->plan->group_first[g] + gs->tail[k];
        float *grad = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_GRAD);
        if (grad != NULL) {
            MFSDP_CHECK(fn(ctx, grad, ctx->slots[shard].elems, arg));
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t sq_fn(struct mfsdp_ctx *ctx, float *grad, size_t n, void *arg)
{
    return ctx->exec->ops->sqnorm(ctx->exec, grad, n, (double *)arg);
}

static mfsdp_status_t scale_fn(struct mfsdp_ctx *ctx, float *grad, size_t n, void *arg)
{
    return ctx->exec->ops->scale(ctx->exec, grad, n, *(const float *)arg);
}

static mfsdp_status_t zero_fn(struct mfsdp_ctx *ctx, float *grad, size_t n, void *arg)
{
    (void)arg;
    return ctx->exec->ops->zero(ctx->exec, grad, n * sizeof(float));
}

/* Group g's accumulation window starts over: its gradients zeroed, no param seen. */
static mfsdp_status_t window_reset(struct mfsdp_ctx *ctx, size_t g)
{
    MFSDP_CHECK(for_each_grad(ctx, g, zero_fn, NULL));
    memset(ctx->seen + ctx->plan->group_first[g], 0, ctx->manifest->groups[g].nparams);
    ctx->groups[g].micro = 0;
    return MFSDP_OK;
}

static mfsdp_status_t step_group_run(struct mfsdp_ctx *ctx, size_t g, int64_t job_t)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[g];
    const mfsdp_group_sched_t *gs = gst->gs;
    if (!gst->initialized) {
        MFSDP_WARN("group %s: optimizer step before its first all-gather (no weights yet)",
                   gd->name);
        return MFSDP_ERR_STATE;
    }
    MFSDP_CHECK(mfsdp_ctx_comm_write(ctx)); /* the step rewrites the owned comm copies */
    /* The schedule's factor at the job's step (in a round of steps, the round's; an eager step,
     * this group's own count), or the job's own factor (the companion). */
    job_t = job_t >= 0 ? job_t : gst->nsteps;
    double factor =
        ctx->lr_factor_set ? ctx->lr_factor : mfsdp_schedule_factor(&ctx->hp.schedule, job_t);
    double lr_scale = gd->lr_scale * factor;
    mfsdp_muon_hp_t mh = {
        .lr = (float)(ctx->hp.lr * lr_scale),
        .momentum = (float)ctx->hp.momentum,
        .weight_decay = (float)(gd->has_weight_decay ? gd->weight_decay : ctx->hp.weight_decay),
        .nesterov = ctx->hp.nesterov,
        .ns_steps = ctx->hp.ns_steps,
        .scale = ctx->hp.scale,
    };
    mfsdp_adamw_hp_t ah = {
        .lr = (float)(ctx->hp.adamw_lr * lr_scale),
        .beta1 = (float)ctx->hp.adamw_beta1,
        .beta2 = (float)ctx->hp.adamw_beta2,
        .eps = (float)ctx->hp.adamw_eps,
        .weight_decay =
            (float)(gd->has_weight_decay ? gd->weight_decay : ctx->hp.adamw_weight_decay),
    };
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->owner != ctx->rank || !ctx->seen[s->shard]) {
            continue; /* not ours, or no gradient (frozen, or unused in this window): torch's
                         optimizers skip a param whose grad is None */
        }
        int64_t t = ++ctx->shard_steps[s->shard];
        const mfsdp_shard_t *sh = &ctx->plan->shards[s->shard];
        const mfsdp_param_desc_t *p = mfsdp_ctx_shard_param(ctx, s->shard);
        float *w = mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_MASTER);
        float *grad = mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_GRAD);
        void *comm = mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_COMM);
        if (sh->role == MFSDP_ROLE_MUON) {
            MFSDP_CHECK(ctx->exec->ops->muon(
                ctx->exec, w, mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_MOMENTUM), grad, comm,
                p->dtype, sh->rows, sh->cols, p->nsplit, p->split, &mh, ctx->ws, ctx->ws_elems));
        } else {
            MFSDP_CHECK(ctx->exec->ops->adamw(ctx->exec, w,
                                              mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_ADAM_M),
                                              mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_ADAM_V),
                                              grad, comm, p->dtype, s->numel, t, &ah));
        }
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        size_t shard = ctx->plan->group_first[g] + pi;
        float *grad = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_GRAD);
        size_t valid = mfsdp_ctx_slice_valid(ctx, &gs->layout->ag.entries[pi]);
        if (grad == NULL || !ctx->seen[shard]) {
            continue;
        }
        int64_t t = ++ctx->shard_steps[shard];
        if (valid == 0) {
            continue; /* a rank holding only padding rows of this tensor */
        }
        /* Only the real rows: padding stays exactly zero, as FSDP keeps it. */
        MFSDP_CHECK(ctx->exec->ops->adamw(ctx->exec, mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_MASTER),
                                          mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_ADAM_M),
                                          mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_ADAM_V), grad,
                                          mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_COMM),
                                          gd->params[pi].dtype, valid, t, &ah));
    }
    MFSDP_CHECK(window_reset(ctx, g));
    gst->nsteps++;
    ctx->steps++;
    return MFSDP_OK;
}

/* Step every group selected by min_micro (groups with at least that many accumulated
 * micro-steps). With clipping: one scalar all-reduce of the squared norm over them. The
 * selection depends only on call counts, identical on every rank. */
/* step_group_run() with its wall time added to ctx->step_seconds (mfsdp_ctx_stats_t). */
mfsdp_status_t mfsdp_ctx_step_group(struct mfsdp_ctx *ctx, size_t g, int64_t job_t)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    mfsdp_status_t st = step_group_run(ctx, g, job_t);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ctx->step_seconds += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return st;
}

mfsdp_status_t mfsdp_ctx_step_groups(struct mfsdp_ctx *ctx, int min_micro)
{
    size_t ng = ctx->manifest->ngroups;
    size_t nsel = 0;
    for (size_t g = 0; g < ng; g++) {
        nsel += ctx->groups[g].micro >= min_micro;
    }
    if (nsel == 0) {
        return MFSDP_OK;
    }
    if (ctx->clip > 0.0) {
        double sq = 0.0;
        for (size_t g = 0; g < ng; g++) {
            if (ctx->groups[g].micro >= min_micro) {
                MFSDP_CHECK(for_each_grad(ctx, g, sq_fn, &sq));
            }
        }
        MFSDP_CHECK(ctx->tp->ops->allreduce_sum(ctx->tp, &sq));
        double norm = sqrt(sq);
        double coef = ctx->clip / (norm + 1e-6);
        ctx->last_norm = norm;
        if (coef < 1.0) {
            float c = (float)coef;
            for (size_t g = 0; g < ng; g++) {
                if (ctx->groups[g].micro >= min_micro) {
                    MFSDP_CHECK(for_each_grad(ctx, g, scale_fn, &c));
                }
            }
        }
    }
    /* One step of the job: every group follows the schedule at the same t, the most steps any
     * group has taken (torch's LambdaLR advances for params without a gradient too). */
    int64_t t = 0;
    for (size_t g = 0; g < ng; g++) {
        t = ctx->groups[g].nsteps > t ? ctx->groups[g].nsteps : t;
    }
    for (size_t g = 0; g < ng; g++) {
        if (ctx->groups[g].micro >= min_micro) {
            MFSDP_CHECK(mfsdp_ctx_step_group(ctx, g, t));
        }
    }
    return MFSDP_OK;
}

/* Lazy trigger: every group that reduces has completed its accumulation window. */
int mfsdp_ctx_lazy_ready(const struct mfsdp_ctx *ctx)
{
    int any = 0;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        const mfsdp_group_state_t *gst = &ctx->groups[g];
        if (gst->gs->layout->rs.nentries == 0) {
            continue;
        }
        if (gst->micro < ctx->accum) {
            return 0;
        }
        any = 1;
    }
    return any;
}

mfsdp_status_t mfsdp_ctx_step(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    return mfsdp_ctx_step_groups(ctx, 1);
}

mfsdp_status_t mfsdp_ctx_flush(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    if (ctx->mode != MFSDP_STEP_LAZY) {
        return MFSDP_OK; /* eager steps ran already; manual ones are the caller's */
    }
    return mfsdp_ctx_step_groups(ctx, ctx->accum);
}

mfsdp_status_t mfsdp_ctx_set_lr_factor(mfsdp_ctx_h ctx, double factor)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    if (isnan(factor) || isinf(factor)) {
        MFSDP_WARN("lr factor %g is not finite", factor);
        return MFSDP_ERR_INVALID_ARG;
    }
    ctx->lr_factor_set = factor >= 0.0;
    ctx->lr_factor = factor >= 0.0 ? factor : 0.0;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_grad_sqnorm(mfsdp_ctx_h ctx, double *sq_p)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK_ARG(sq_p != NULL);
    double sq = 0.0;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        MFSDP_CHECK(for_each_grad(ctx, g, sq_fn, &sq));
    }
    *sq_p = sq;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_zero_grads(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        mfsdp_group_state_t *gst = &ctx->groups[g];
        size_t first = ctx->plan->group_first[g], np = ctx->manifest->groups[g].nparams;
        int any = gst->micro != 0;
        for (size_t i = 0; i < np && !any; i++) {
            any = ctx->seen[first + i] != 0;
        }
        if (any) { /* a group that stepped last holds zeros already */
            MFSDP_CHECK(window_reset(ctx, g));
        }
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_reload_weights(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    if (ctx->awaiting >= 0) {
        MFSDP_WARN("reload of the weights: the replicate all-reduce of group %s (HSDP) did not "
                   "follow its reduce-scatter",
                   ctx->manifest->groups[ctx->awaiting].name);
        return MFSDP_ERR_STATE;
    }
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        ctx->groups[g].initialized = 0; /* the next all-gather takes them (allgather.c) */
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_scale_grads(mfsdp_ctx_h ctx, double coef)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    if (!isfinite(coef)) {
        MFSDP_WARN("gradient scale %g is not finite", coef);
        return MFSDP_ERR_INVALID_ARG;
    }
    float c = (float)coef;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        MFSDP_CHECK(for_each_grad(ctx, g, scale_fn, &c));
    }
    return MFSDP_OK;
}
