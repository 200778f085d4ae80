/* SPDX-License-Identifier: Apache-2.0 */
/*
 * HSDP (a 2-D mesh: FSDP inside a shard group, replicas across groups). The job reduce-
 * scatters in its shard group, then all-reduces the result over the replicate group. Under
 * mfsdp the reduce-scatter delivers each tensor's gradient to its owner; owners of the same
 * tensor in different replicas (the same shard rank: every replica runs the same plan) then
 * all-reduce their owned gradients over the replicate communicator in place of the job's
 * all-reduce of shards — the same bytes in total when owners are balanced. A reduce lands in
 * ctx->hsdp_in first, so that only that call's contribution crosses the replicas.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "runtime/ctx.h"

/* Elements [a, b) of the group's sharded tail (its reduce-scatter entries in tail order,
 * concatenated) between FSDP's output and t (b - a floats): to t widened to fp32 (back 0), or
 * scaled and cast back into the output (back 1). */
static mfsdp_status_t tail_window(struct mfsdp_ctx *ctx, const mfsdp_group_sched_t *gs,
                                  void *recvbuf, mfsdp_dtype_t dtype, size_t a, size_t b, float *t,
                                  int back, float scale)
{
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    size_t elt = mfsdp_dtype_size(dtype);
    size_t pos = 0; /* first tail element of entry k */
    for (size_t k = 0; k < gs->ntail && pos < b; k++) {
        long e = gs->layout->rs_entry[gs->tail[k]];
        if (e < 0) {
            continue;
        }
        size_t s = (size_t)rs->entries[e].s;
        size_t lo = a > pos ? a : pos, hi = b < pos + s ? b : pos + s;
        if (lo < hi) {
            char *o = (char *)recvbuf + rs->entries[e].o_bytes + (lo - pos) * elt;
            float *w = t + (lo - a);
            if (back) {
                MFSDP_CHECK(ctx->exec->ops->scale(ctx->exec, w, hi - lo, scale));
                MFSDP_CHECK(ctx->exec->ops->cast(ctx->exec, o, dtype, w, MFSDP_FLOAT32, hi - lo));
            } else {
                MFSDP_CHECK(ctx->exec->ops->cast(ctx->exec, w, MFSDP_FLOAT32, o, dtype, hi - lo));
            }
        }
        pos += s;
    }
    return MFSDP_OK;
}

/* The contiguous byte range [lo, hi) of hsdp_in holding this rank's owned gradients (which) or
 * sharded-tail slices of group g: the arena lays both out in shard order. */
static void group_range(const struct mfsdp_ctx *ctx, size_t g, int tail, size_t *lo, size_t *hi)
{
    *lo = SIZE_MAX;
    *hi = 0;
    for (size_t k = ctx->plan->group_first[g]; k < ctx->plan->group_first[g + 1]; k++) {
        const mfsdp_shard_t *sh = &ctx->plan->shards[k];
        const mfsdp_arena_slot_t *s = &ctx->slots[k];
        int is_tail = sh->owner == MFSDP_OWNER_SHARDED;
        if (is_tail != tail || s->elems == 0 || s->off[MFSDP_ARENA_GRAD] == MFSDP_ARENA_NONE) {
            continue;
        }
        size_t a = s->off[MFSDP_ARENA_GRAD], b = a + s->elems * sizeof(float);
        *lo = a < *lo ? a : *lo;
        *hi = b > *hi ? b : *hi;
    }
    if (*lo > *hi) {
        *lo = *hi = 0;
    }
}

static mfsdp_status_t reduce_range(struct mfsdp_ctx *ctx, size_t lo, size_t hi, float scale,
                                   int to_grad)
{
    if (hi <= lo) {
        return MFSDP_OK;
    }
    float *v = (float *)(ctx->hsdp_in + lo);
    float *grad = (float *)(mfsdp_arena_base(ctx->arena, MFSDP_ARENA_GRAD) + lo);
    size_t n = (hi - lo) / sizeof(float);
    MFSDP_CHECK(ctx->rtp->ops->allreduce_f32(ctx->rtp, v, n));
    if (to_grad) {
        return ctx->exec->ops->axpy_clear(ctx->exec, grad, v, n, scale);
    }
    return ctx->exec->ops->zero(ctx->exec, v, n * sizeof(float));
}

mfsdp_status_t mfsdp_ctx_replicate(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                   void *recvbuf, size_t count, mfsdp_dtype_t dtype,
                                   mfsdp_redop_t op, double scalar)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(mfsdp_ctx_group_check(ctx, group, "replicate"));
    const char *gname = ctx->manifest->groups[group].name;
    if (ctx->replicate <= 1) {
        MFSDP_WARN("replicate all-reduce of group %s: the manifest declares no replicas "
                   "(\"replicate\" is 1), so this is not HSDP as planned",
                   gname);
        return MFSDP_ERR_STATE;
    }
    if (ctx->rtp == NULL) {
        MFSDP_WARN("replicate all-reduce of group %s: no replicate communicator attached", gname);
        return MFSDP_ERR_STATE;
    }
    if (ctx->awaiting != (long)group) {
        MFSDP_WARN("replicate all-reduce of group %s: %s%s%s", gname,
                   ctx->awaiting < 0 ? "no reduce-scatter is waiting for it" : "group ",
                   ctx->awaiting < 0 ? "" : ctx->manifest->groups[ctx->awaiting].name,
                   ctx->awaiting < 0 ? "" : "'s reduce-scatter is the one waiting");
        return MFSDP_ERR_STATE;
    }
    const mfsdp_group_sched_t *gs = ctx->groups[group].last_rs;
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    if (count != rs->count || dtype != rs->dtype) {
        MFSDP_WARN("replicate all-reduce of group %s: got count %zu of %s, its reduce-scatter "
                   "had %zu of %s",
                   gname, count, mfsdp_dtype_name(dtype), rs->count, mfsdp_dtype_name(rs->dtype));
        return MFSDP_ERR_MISMATCH;
    }
    if (op != MFSDP_OP_SUM && op != MFSDP_OP_AVG && op != MFSDP_OP_PREMULSUM) {
        return MFSDP_ERR_INVALID_ARG;
    }
    if (rs->bytes != 0 && (sendbuf == NULL || recvbuf == NULL)) {
        MFSDP_WARN("replicate all-reduce of group %s: null buffer", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    float scale = op == MFSDP_OP_AVG         ? 1.0f / (float)ctx->replicate
                  : op == MFSDP_OP_PREMULSUM ? (float)scalar
                                             : 1.0f;
    size_t lo, hi;
    group_range(ctx, group, 0, &lo, &hi);
    MFSDP_CHECK(reduce_range(ctx, lo, hi, scale, 1));
    group_range(ctx, group, 1, &lo, &hi);
    MFSDP_CHECK(reduce_range(ctx, lo, hi, scale, 1));

    /* The job's view: zero for owner-managed bytes, its sharded-tail bytes all-reduced as the
     * job's own all-reduce would (under tail "job" they are the only gradient of those
     * tensors). */
    if (rs->bytes != 0 && sendbuf != recvbuf) {
        MFSDP_CHECK(ctx->exec->ops->copy(ctx->exec, recvbuf, sendbuf, rs->bytes));
    }
    for (size_t i = 0; i < gs->nsegs; i++) {
        long e = gs->segs[i].rs_entry;
        if (e >= 0) {
            MFSDP_CHECK(ctx->exec->ops->zero(ctx->exec, (char *)recvbuf + rs->entries[e].o_bytes,
                                             rs->entries[e].s_bytes));
        }
    }
    /* The sharded tail, all-reduced in fp32 through the staging region in windows of at most
     * its size (the budget may have cut it below the tail's floats). */
    size_t tail_elems = 0;
    for (size_t k = 0; k < gs->ntail; k++) {
        long e = gs->layout->rs_entry[gs->tail[k]];
        tail_elems += e >= 0 ? (size_t)rs->entries[e].s : 0;
    }
    size_t cap = ctx->stage_bytes / sizeof(float);
    if (tail_elems != 0 && cap == 0) {
        MFSDP_WARN("replicate all-reduce of group %s: no staging for the sharded tail",
                   ctx->manifest->groups[group].name);
        return MFSDP_ERR_INTERNAL;
    }
    float *t = (float *)ctx->stage;
    for (size_t a = 0; a < tail_elems; a += cap) {
        size_t b = tail_elems - a < cap ? tail_elems : a + cap;
        MFSDP_CHECK(tail_window(ctx, gs, recvbuf, dtype, a, b, t, 0, scale));
        MFSDP_CHECK(ctx->rtp->ops->allreduce_f32(ctx->rtp, t, b - a));
        MFSDP_CHECK(tail_window(ctx, gs, recvbuf, dtype, a, b, t, 1, scale));
    }
    ctx->awaiting = -1;
    return mfsdp_ctx_reduce_done(ctx, group);
}
