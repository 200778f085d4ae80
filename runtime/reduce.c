/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Reduce-to-owner: FSDP's reduce-scatter replaced by each owner receiving the op-reduced
 * full gradient of the tensors it owns; sharded-tail slices reduced onto their ranks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/settings.h"
#include "mfsdp/kernels.h"
#include "runtime/ctx.h"

/* The schedule of group g's reduce over the params flagged in has_grad: the group's own for
 * the full set, else a variant built the first time that subset is seen (every rank sees
 * the same subsets in the same order, so every rank builds the same variants). */
static mfsdp_status_t rs_variant(struct mfsdp_ctx *ctx, size_t g, const unsigned char *has_grad,
                                 const mfsdp_group_sched_t **gs_p, mfsdp_sched_ops_t **ops_p)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[g];
    size_t np = gd->nparams;
    if (has_grad == NULL || memcmp(has_grad, gst->full, np) == 0) {
        *gs_p = gst->gs;
        *ops_p = &gst->rs_ops;
        return MFSDP_OK;
    }
    for (size_t v = 0; v < gst->nvariants; v++) {
        if (memcmp(gst->variants[v].mask, has_grad, np) == 0) {
            *gs_p = gst->variants[v].gs;
            *ops_p = &gst->variants[v].rs_ops;
            return MFSDP_OK;
        }
    }
    if (gst->nvariants == MFSDP_CTX_MAX_VARIANTS) {
        MFSDP_WARN("group %s: more than %d different sets of params with gradients", gd->name,
                   MFSDP_CTX_MAX_VARIANTS);
        return MFSDP_ERR_UNSUPPORTED;
    }
    mfsdp_rs_variant_t *nv = realloc(gst->variants, (gst->nvariants + 1) * sizeof(*nv));
    if (nv == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    gst->variants = nv;
    mfsdp_rs_variant_t *v = &nv[gst->nvariants];
    memset(v, 0, sizeof(*v));
    mfsdp_status_t st = MFSDP_OK;
    v->mask = malloc(np + 1);
    if (v->mask == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    memcpy(v->mask, has_grad, np);
    MFSDP_CHECK_GOTO(mfsdp_group_sched_create_masked(ctx->plan, g, has_grad, &v->gs), st, err);
    MFSDP_CHECK_GOTO(mfsdp_sched_build(v->gs, ctx->rank, MFSDP_SCHED_DIR_REDUCE, gst->reduce_algo,
                                       gst->rs_chunk, &v->rs_ops),
                     st, err);
    size_t need;
    mfsdp_tail_bufs_t tb;
    MFSDP_CHECK_GOTO(mfsdp_ctx_bind_reduce(ctx, g, v->gs, NULL, &need, &tb), st, err);
    if (need > ctx->stage_bytes) { /* a subset never needs more than the whole */
        st = MFSDP_ERR_INTERNAL;
        goto err;
    }
    gst->nvariants++;
    *gs_p = v->gs;
    *ops_p = &v->rs_ops;
    return MFSDP_OK;
err:
    mfsdp_sched_ops_free(&v->rs_ops);
    mfsdp_group_sched_destroy(v->gs);
    free(v->mask);
    return st;
}

/* Sharded-tail elements [a, b) of every rank block of FSDP's input, packed rank-major as
 * FSDP's input holds them (the tail block is the group's tail slices in order): block r goes
 * to rank r, in the bytes FSDP's own reduce-scatter would move. */
static mfsdp_status_t tail_pack(struct mfsdp_ctx *ctx, const mfsdp_group_sched_t *gs,
                                const void *sendbuf, mfsdp_dtype_t dtype, size_t a, size_t b,
                                char *dst)
{
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    size_t elt = mfsdp_dtype_size(dtype);
    for (int r = 0; r < ctx->world; r++) {
        size_t t = 0; /* the slice's offset in the tail block */
        for (size_t k = 0; k < gs->ntail; k++) {
            long e = gs->layout->rs_entry[gs->tail[k]];
            if (e < 0) {
                continue;
            }
            const mfsdp_param_layout_t *pe = &rs->entries[e];
            size_t lo = a > t ? a : t, hi = b < t + (size_t)pe->s ? b : t + (size_t)pe->s;
            if (lo < hi) {
                const char *src =
                    (const char *)sendbuf + (size_t)r * rs->bytes + pe->o_bytes + (lo - t) * elt;
                MFSDP_CHECK(ctx->exec->ops->copy(ctx->exec, dst, src, (hi - lo) * elt));
                dst += (hi - lo) * elt;
            }
            t += (size_t)pe->s;
        }
    }
    return MFSDP_OK;
}

/* The fp32 sum of this rank's tail elements over every rank's contribution (count elements
 * per block), in rank order whatever the transport or the pass, in one pass over the blocks:
 * the own block read where it was packed, the others' where the all-to-all put them; the
 * premul factor applied to each (an average is divided later, with the gradients). */
static mfsdp_status_t tail_sum(struct mfsdp_ctx *ctx, const mfsdp_tail_bufs_t *tb,
                               mfsdp_dtype_t dtype, mfsdp_redop_t op, float sc, size_t count)
{
    size_t blk = count * mfsdp_dtype_size(dtype);
    for (int r = 0; r < ctx->world; r++) {
        ctx->tail_src[r] = (const char *)(r == ctx->rank ? tb->send : tb->recv) + (size_t)r * blk;
    }
    return ctx->exec->ops->reduce_ordered(ctx->exec, tb->sum, ctx->tail_src, ctx->world, dtype,
                                          count, op == MFSDP_OP_AVG ? MFSDP_OP_SUM : op, sc, 0);
}

/* The reduced tail elements [a, b) (sum): into the slices' gradients and, as the value FSDP's
 * native collective would have produced in the reduce dtype, into the output shard (sum is
 * scaled in place for that once the gradients have it). */
static mfsdp_status_t tail_apply(struct mfsdp_ctx *ctx, size_t group, const mfsdp_group_sched_t *gs,
                                 void *recvbuf, mfsdp_dtype_t dtype, mfsdp_redop_t op, double post,
                                 size_t a, size_t b, float *sum)
{
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    size_t elt = mfsdp_dtype_size(dtype);
    int n = ctx->world;
    size_t t = 0;
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        long e = gs->layout->rs_entry[pi];
        if (e < 0) {
            continue;
        }
        const mfsdp_param_layout_t *pe = &rs->entries[e];
        size_t lo = a > t ? a : t, hi = b < t + (size_t)pe->s ? b : t + (size_t)pe->s;
        if (lo < hi) {
            size_t len = hi - lo;
            float *grad = mfsdp_ctx_grad_target(ctx, ctx->plan->group_first[group] + pi);
            if (grad != NULL) { /* NULL under tail "job": the job keeps its own gradient */
                MFSDP_CHECK(ctx->exec->ops->apply(ctx->exec, grad + (lo - t), sum, len, op, n));
            }
            if (op == MFSDP_OP_AVG) {
                MFSDP_CHECK(ctx->exec->ops->scale(ctx->exec, sum, len, 1.0f / (float)n));
            }
            if (post != 1.0) {
                MFSDP_CHECK(ctx->exec->ops->scale(ctx->exec, sum, len, (float)post));
            }
            MFSDP_CHECK(ctx->exec->ops->cast(ctx->exec,
                                             (char *)recvbuf + pe->o_bytes + (lo - t) * elt, dtype,
                                             sum, MFSDP_FLOAT32, len));
            sum += len;
        }
        t += (size_t)pe->s;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_reduce(mfsdp_ctx_h ctx, size_t group, const void *sendbuf, void *recvbuf,
                                size_t recvcount, mfsdp_dtype_t dtype, mfsdp_redop_t op,
                                double scalar)
{
    return mfsdp_ctx_reduce_params(ctx, group, NULL, sendbuf, recvbuf, recvcount, dtype, op, scalar,
                                   1.0);
}

mfsdp_status_t mfsdp_ctx_reduce_params(mfsdp_ctx_h ctx, size_t group, const unsigned char *has_grad,
                                       const void *sendbuf, void *recvbuf, size_t recvcount,
                                       mfsdp_dtype_t dtype, mfsdp_redop_t op, double scalar,
                                       double post)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(mfsdp_ctx_group_check(ctx, group, "reduce"));
    mfsdp_group_state_t *gst = &ctx->groups[group];
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[group];
    const char *gname = gd->name;
    for (size_t i = 0; has_grad != NULL && i < gd->nparams; i++) {
        if (has_grad[i] > 1 || (has_grad[i] && !gst->full[i])) {
            MFSDP_WARN("reduce of group %s: param %s %s", gname, gd->params[i].name,
                       has_grad[i] > 1 ? "has a gradient flag other than 0 or 1"
                                       : "is flagged with a gradient but does not require one");
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    if (ctx->awaiting >= 0) {
        MFSDP_WARN("reduce of group %s: the replicate all-reduce of group %s (HSDP) did not follow "
                   "its reduce-scatter",
                   gname, ctx->manifest->groups[ctx->awaiting].name);
        return MFSDP_ERR_STATE;
    }
    const mfsdp_group_sched_t *gs = NULL;
    mfsdp_sched_ops_t *rs_ops = NULL;
    MFSDP_CHECK(rs_variant(ctx, group, has_grad, &gs, &rs_ops));
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    int n = ctx->world;
    if (op != MFSDP_OP_SUM && op != MFSDP_OP_AVG && op != MFSDP_OP_PREMULSUM) {
        MFSDP_WARN("reduce of group %s: unknown reduction op %d", gname, (int)op);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (!(post > 0.0) || !isfinite(post)) {
        MFSDP_WARN("reduce of group %s: post-divide %g must be finite and > 0", gname, post);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (op == MFSDP_OP_PREMULSUM && !isfinite(scalar)) {
        MFSDP_WARN("reduce of group %s: premulsum scalar %g is not finite", gname, scalar);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (dtype != rs->dtype || recvcount != rs->count) {
        MFSDP_WARN("reduce of group %s: got count %zu of %s, the plan expects %zu of %s", gname,
                   recvcount, mfsdp_dtype_name(dtype), rs->count, mfsdp_dtype_name(rs->dtype));
        return MFSDP_ERR_MISMATCH;
    }
    if (rs->bytes != 0 && (sendbuf == NULL || recvbuf == NULL)) {
        MFSDP_WARN("reduce of group %s: null buffer", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (rs->bytes != 0 && (const char *)recvbuf < (const char *)sendbuf + rs->bytes * (size_t)n &&
        (const char *)sendbuf < (const char *)recvbuf + rs->bytes) {
        MFSDP_WARN("reduce of group %s: the output overlaps the input (an in-place "
                   "reduce-scatter is not supported: the owners read the whole input apart from "
                   "the output)",
                   gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (ctx->mode == MFSDP_STEP_LAZY && gst->micro >= ctx->accum) {
        /* The window is complete and its step has not run: the lazy trigger waits for every
         * group that trains, and one of them did not reduce in it. Accumulating would merge
         * two windows' gradients into one step. */
        const char *lag = "another group";
        for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
            if (ctx->groups[g].gs->layout->rs.nentries != 0 && ctx->groups[g].micro < ctx->accum) {
                lag = ctx->manifest->groups[g].name;
                break;
            }
        }
        MFSDP_WARN("reduce of group %s: its accumulation window of %d is complete and the lazy "
                   "step has not run, because group %s did not reduce in that window (an FSDP "
                   "unit unused in an iteration?); the lazy step cannot tell where such a window "
                   "ends, and accumulating would merge two windows into one step: use eager or "
                   "manual steps, or give every trained group a gradient in every window",
                   gname, ctx->accum, lag);
        return MFSDP_ERR_STATE;
    }
    if (rs->nentries == 0) {
        ctx->reduces++;
        gst->last_rs = gs;
        if (ctx->replicate > 1) {
            ctx->awaiting = (long)group; /* its replicate all-reduce completes it */
            return MFSDP_OK;
        }
        ctx->awaiting = -1;
        /* A micro-step in which none of the group's params got a gradient still counts: its
         * window ends when the others' does. */
        return gst->gs->layout->rs.nentries != 0 ? mfsdp_ctx_reduce_done(ctx, group) : MFSDP_OK;
    }
    for (size_t i = 0; i < gd->nparams; i++) {
        if (gs->layout->rs_entry[i] >= 0) {
            ctx->seen[ctx->plan->group_first[group] + i] = 1;
        }
    }

    size_t need;
    mfsdp_tail_bufs_t tb = {0};
    MFSDP_CHECK(mfsdp_ctx_bind_reduce(ctx, group, gs, ctx->stage, &need, &tb));
    /* The owners' gradient is the op's result divided by the job's post-divide: one op. */
    mfsdp_divide_fold(n, post, &op, &scalar);
    float sc = op == MFSDP_OP_PREMULSUM ? (float)scalar : 1.0f;

    /* The sharded tail in passes of at most gst->tail_pass elements per rank block (one pass
     * unless the staging budget cut it): pass 0 rides with the owner segments' op list, the
     * others run alone. Each pass is an all-to-all of the contributions in FSDP's reduce
     * dtype (the bytes FSDP's reduce-scatter moves) and a sum on every rank of its own
     * slices' contributions, in fp32 and rank order as the owners' sums: exact to fp32
     * whatever FSDP's dtype, and bitwise the same for any transport or pass split. */
    size_t T = gs->tail_rs_elems;
    size_t P = T < gst->tail_pass ? T : gst->tail_pass;
    if (T != 0 && (P == 0 || tb.send == NULL || tb.recv == NULL || tb.sum == NULL)) {
        MFSDP_WARN("reduce of group %s: no staging for the sharded tail", gname);
        return MFSDP_ERR_INTERNAL;
    }
    size_t a = 0;
    do { /* tail elements [a, b) of every rank block; one run when there is no tail */
        size_t b = T - a < P ? T : a + P;
        if (T != 0) {
            MFSDP_CHECK(tail_pack(ctx, gs, sendbuf, dtype, a, b, tb.send));
        }
        mfsdp_xfer_t x = {
            .exec = ctx->exec,
            .dir = MFSDP_SCHED_DIR_REDUCE,
            .gs = gs,
            .ops = a == 0 ? rs_ops : &gst->tail_ops,
            .bufs = gst->bufs,
            .dtype = dtype,
            .op = op,
            .scalar = sc,
            .rs_in = sendbuf,
            .tail_send = tb.send,
            .tail_recv = tb.recv,
            .tail_count = (b - a) * mfsdp_dtype_size(dtype),
        };
        MFSDP_CHECK(ctx->tp->ops->run(ctx->tp, &x));
        if (T != 0) {
            MFSDP_CHECK(tail_sum(ctx, &tb, dtype, op, sc, b - a));
            MFSDP_CHECK(tail_apply(ctx, group, gs, recvbuf, dtype, op, post, a, b, tb.sum));
        }
        a = b;
    } while (a < T);

    /* FSDP's output shard: zero for owner-managed bytes. */
    for (size_t i = 0; i < gs->nsegs; i++) {
        long e = gs->segs[i].rs_entry;
        if (e >= 0) {
            MFSDP_CHECK(ctx->exec->ops->zero(ctx->exec, (char *)recvbuf + rs->entries[e].o_bytes,
                                             rs->entries[e].s_bytes));
        }
    }
    ctx->reduces++;
    gst->last_rs = gs;
    if (ctx->replicate > 1) {
        ctx->awaiting = (long)group; /* the replicate all-reduce completes the reduction */
        return MFSDP_OK;
    }
    return mfsdp_ctx_reduce_done(ctx, group);
}

mfsdp_status_t mfsdp_ctx_reduce_done(struct mfsdp_ctx *ctx, size_t group)
{
    mfsdp_group_state_t *gst = &ctx->groups[group];
    if (gst->micro < ctx->accum) {
        gst->micro++;
    }
    if (ctx->mode == MFSDP_STEP_EAGER && gst->micro >= ctx->accum) {
        MFSDP_CHECK(mfsdp_ctx_step_group(ctx, group, -1)); /* eager: no clipping, no collective */
    }
    return MFSDP_OK;
}
