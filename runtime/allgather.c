/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner-broadcast all-gather: FSDP's rank-major all-gather buffer filled from the owners
 * (docs/design.md, "FSDP2's byte layout"), and the initial weights taken from a group's first
 * all-gather.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "mfsdp/kernels.h"
#include "runtime/ctx.h"

/* ---------------------------------------------------------------------------------------
 * All-gather
 */

void mfsdp_ctx_geom(const mfsdp_buffer_layout_t *b, const mfsdp_param_layout_t *e, int world,
                    mfsdp_strided_geom_t *geom)
{
    geom->world = world;
    geom->rows = e->rows;
    geom->rows_per_rank = e->c;
    geom->row_bytes = e->row_bytes;
    geom->rank_stride = b->bytes;
    geom->offset = e->o_bytes;
}

/* The owner's copies of its own tensors into FSDP's all-gather output (one strided copy each,
 * padding rows zeroed): pieces no transfer of the call reads or writes, so this runs while
 * the transfers are in flight (mfsdp_xfer_t.overlap). */
typedef struct unpack_arg {
    struct mfsdp_ctx *ctx;
    const mfsdp_group_sched_t *gs;
    const mfsdp_xfer_bufs_t *bufs;
    void *recvbuf;
} unpack_arg_t;

static mfsdp_status_t unpack_owned(void *arg)
{
    const unpack_arg_t *a = arg;
    const mfsdp_buffer_layout_t *ag = &a->gs->layout->ag;
    for (size_t i = 0; i < a->gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &a->gs->segs[i];
        if (s->owner != a->ctx->rank) {
            continue;
        }
        if (a->bufs[i].src == NULL) {
            MFSDP_WARN("segment %zu: the owner has no copy of its tensor", i);
            return MFSDP_ERR_INTERNAL;
        }
        mfsdp_strided_geom_t geom;
        mfsdp_ctx_geom(ag, &ag->entries[s->param], a->ctx->world, &geom);
        MFSDP_CHECK(a->ctx->exec->ops->unpack(a->ctx->exec, a->recvbuf, a->bufs[i].src, &geom));
    }
    return MFSDP_OK;
}

/* First all-gather of a group: the weights come from each rank's FSDP shard. Owned tensors
 * are gathered onto their owners (one point-to-point batch), sharded-tail slices are kept. */
static mfsdp_status_t take_initial_weights(struct mfsdp_ctx *ctx, size_t g, const char *send)
{
    MFSDP_CHECK(mfsdp_ctx_comm_write(ctx));
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag;
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[g];
    int n = ctx->world;
    size_t cap = gs->nsegs * (size_t)n + 1;
    mfsdp_p2p_t *v = calloc(cap, sizeof(*v));
    if (v == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t nv = 0;
    mfsdp_status_t st = MFSDP_OK;
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        char *comm = mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_COMM);
        for (int r = 0; r < n; r++) {
            mfsdp_piece_t pc;
            mfsdp_layout_piece(ag, n, s->param, r, &pc);
            if (pc.valid == 0) {
                continue;
            }
            const char *mine = send + ag->entries[s->param].o_bytes;
            if (s->owner == ctx->rank && r == ctx->rank) {
                MFSDP_CHECK_GOTO(
                    ctx->exec->ops->copy(ctx->exec, comm + pc.full_offset, mine, pc.valid), st,
                    out);
            } else if (s->owner == ctx->rank) {
                v[nv++] = (mfsdp_p2p_t){0, r, 2 * (int)i, comm + pc.full_offset, pc.valid};
            } else if (r == ctx->rank) {
                v[nv++] = (mfsdp_p2p_t){1, s->owner, 2 * (int)i, (void *)mine, pc.valid};
            }
        }
    }
    MFSDP_CHECK_GOTO(ctx->tp->ops->p2p(ctx->tp, v, nv), st, out);
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->owner != ctx->rank) {
            continue;
        }
        MFSDP_CHECK_GOTO(
            ctx->exec->ops->cast(ctx->exec, mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_MASTER),
                                 MFSDP_FLOAT32, mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_COMM),
                                 gd->params[s->param].dtype, s->numel),
            st, out);
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        size_t shard = ctx->plan->group_first[g] + pi;
        const mfsdp_param_layout_t *e = &ag->entries[pi];
        char *comm = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_COMM);
        if (comm == NULL) {
            continue; /* tail "job": the job keeps its slices */
        }
        size_t valid = mfsdp_ctx_slice_valid(ctx, e);
        MFSDP_CHECK_GOTO(ctx->exec->ops->copy(ctx->exec, comm, send + e->o_bytes, valid * e->elt),
                         st, out);
        MFSDP_CHECK_GOTO(
            ctx->exec->ops->zero(ctx->exec, comm + valid * e->elt, e->s_bytes - valid * e->elt), st,
            out);
        MFSDP_CHECK_GOTO(
            ctx->exec->ops->cast(ctx->exec, mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_MASTER),
                                 MFSDP_FLOAT32, comm, gd->params[pi].dtype, (size_t)e->s),
            st, out);
    }
out:
    free(v);
    return st;
}

mfsdp_status_t mfsdp_ctx_allgather(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                   void *recvbuf, size_t count, mfsdp_dtype_t dtype)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(mfsdp_ctx_group_check(ctx, group, "allgather"));
    mfsdp_group_state_t *gst = &ctx->groups[group];
    const mfsdp_group_sched_t *gs = gst->gs;
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag;
    const char *gname = ctx->manifest->groups[group].name;
    if (dtype != ag->dtype || count != ag->count) {
        MFSDP_WARN("allgather of group %s: got count %zu of %s, the plan expects %zu of %s", gname,
                   count, mfsdp_dtype_name(dtype), ag->count, mfsdp_dtype_name(ag->dtype));
        return MFSDP_ERR_MISMATCH;
    }
    if (ctx->awaiting >= 0) {
        MFSDP_WARN("allgather of group %s: the replicate all-reduce of group %s (HSDP) did not "
                   "follow its reduce-scatter",
                   gname, ctx->manifest->groups[ctx->awaiting].name);
        return MFSDP_ERR_STATE;
    }
    int job_tail = ctx->plan->tail == MFSDP_TAIL_JOB && gs->ntail != 0;
    if (recvbuf == NULL || ((!gst->initialized || job_tail) && sendbuf == NULL && ag->bytes != 0)) {
        MFSDP_WARN("allgather of group %s: null buffer", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t total = ag->bytes * (size_t)ctx->world;
    const char *in_place = (const char *)recvbuf + (size_t)ctx->rank * ag->bytes;
    if (sendbuf != NULL && (const char *)sendbuf != in_place &&
        (const char *)sendbuf < (const char *)recvbuf + total &&
        (const char *)recvbuf < (const char *)sendbuf + ag->bytes) {
        MFSDP_WARN("allgather of group %s: send buffer overlaps the receive buffer but is not "
                   "its in-place slot (recv + rank * count)",
                   gname);
        return MFSDP_ERR_INVALID_ARG;
    }

    if (ctx->mode == MFSDP_STEP_LAZY && mfsdp_ctx_lazy_ready(ctx)) {
        MFSDP_CHECK(mfsdp_ctx_step_groups(ctx, ctx->accum));
    }
    if (!gst->initialized) {
        MFSDP_CHECK(take_initial_weights(ctx, group, sendbuf));
        gst->initialized = 1;
    }

    size_t need;
    MFSDP_CHECK(mfsdp_ctx_bind_gather(ctx, group, ctx->stage, &need));
    /* The own sharded-tail slices go straight to their place in FSDP's output (rank block
     * rank), from which the tail collective sends them in place: no staging. */
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        const mfsdp_param_layout_t *e = &ag->entries[pi];
        char *dst = (char *)recvbuf + (size_t)ctx->rank * ag->bytes + e->o_bytes;
        const char *mine =
            mfsdp_ctx_slot(ctx, ctx->plan->group_first[group] + pi, MFSDP_ARENA_COMM);
        if (mine == NULL) { /* tail "job": the job's own (trained) slice travels */
            mine = (const char *)sendbuf + e->o_bytes;
        }
        if (mine != dst) { /* tail "job" in place: already there */
            MFSDP_CHECK(ctx->exec->ops->copy(ctx->exec, dst, mine, e->s_bytes));
        }
    }
    unpack_arg_t ua = {ctx, gs, gst->bufs, recvbuf};
    mfsdp_xfer_t x = {
        .exec = ctx->exec,
        .dir = MFSDP_SCHED_DIR_GATHER,
        .gs = gs,
        .ops = &gst->ag_ops,
        .bufs = gst->bufs,
        .ag_out = recvbuf,
        .tail_send = NULL, /* in place in ag_out */
        .tail_recv = NULL,
        .tail_count = gs->tail_ag_bytes,
        .overlap = unpack_owned,
        .overlap_arg = &ua,
        .peer_src = gst->peer_src,
    };
    MFSDP_CHECK(ctx->tp->ops->run(ctx->tp, &x));

    /* Every received tensor landed in place in FSDP's output (the chain copied its chunks
     * out): only its padding rows are zeroed here. The own tensors were unpacked while the
     * transfers ran. */
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->owner == ctx->rank) {
            continue;
        }
        for (int r = 0; r < ctx->world; r++) {
            mfsdp_piece_t pc;
            mfsdp_layout_piece(ag, ctx->world, s->param, r, &pc);
            MFSDP_CHECK(ctx->exec->ops->zero(ctx->exec, (char *)recvbuf + pc.buf_offset + pc.valid,
                                             pc.pad));
        }
    }
    ctx->allgathers++;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Weight write-back
 */

/* One exchange between this rank's FSDP block of a group in fp32 (param i at element offset
 * o_i = sum of earlier s_j, rows [rank * c_i, (rank + 1) * c_i) of it) and the owners' arena
 * category cat of the group's owned tensors. to_owners = 0: the owners send each rank its rows
 * (padding rows of the block zeroed); 1: every rank sends its rows to the owner, which writes
 * them into its slot (padding rows of the block not read). With cat MOMENTUM only the owned
 * trainable Muon tensors take part (every rank knows roles and requires_grad, so all post the
 * same transfers). */
static mfsdp_status_t exchange_state(struct mfsdp_ctx *ctx, size_t group, mfsdp_arena_cat_t cat,
                                     int to_owners, float *block, size_t count, const char *what)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(mfsdp_ctx_group_check(ctx, group, what));
    const mfsdp_group_sched_t *gs = ctx->groups[group].gs;
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag;
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[group];
    size_t np = gd->nparams;
    size_t *off = calloc(np + 1, sizeof(size_t));
    if (off == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < np; i++) {
        off[i + 1] = off[i] + (size_t)ag->entries[i].s;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_p2p_t *v = NULL;
    if (count != off[np] || (block == NULL && count != 0)) {
        MFSDP_WARN("%s of group %s: got %zu floats, its FSDP shard has %zu", what, gd->name, count,
                   off[np]);
        st = block == NULL ? MFSDP_ERR_INVALID_ARG : MFSDP_ERR_MISMATCH;
        goto out;
    }
    if (cat == MFSDP_ARENA_MASTER && !ctx->groups[group].initialized) {
        MFSDP_WARN("%s of group %s: no weights yet (before its first all-gather)", what, gd->name);
        st = MFSDP_ERR_STATE;
        goto out;
    }
    int n = ctx->world;
    v = calloc(gs->nsegs * (size_t)n + 1, sizeof(*v));
    if (v == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    size_t nv = 0;
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (cat == MFSDP_ARENA_MOMENTUM && (ctx->plan->shards[s->shard].role != MFSDP_ROLE_MUON ||
                                            !gd->params[s->param].requires_grad)) {
            continue; /* no momentum (AdamW; frozen: the arena gives it none): its rows of the
                         block are neither written nor read */
        }
        const mfsdp_param_layout_t *e = &ag->entries[s->param];
        float *slot = mfsdp_ctx_slot(ctx, s->shard, cat);
        if (s->owner == ctx->rank && slot == NULL) {
            MFSDP_WARN("%s of group %s: the owner holds no such state for %s", what, gd->name,
                       gd->params[s->param].name);
            st = MFSDP_ERR_INTERNAL;
            goto out;
        }
        float *mine = block + off[s->param];
        size_t row = (size_t)e->rest;
        if (!to_owners) {
            size_t valid = mfsdp_ctx_slice_valid(ctx, e);
            MFSDP_CHECK_GOTO(ctx->exec->ops->zero(ctx->exec, mine + valid,
                                                  ((size_t)e->s - valid) * sizeof(float)),
                             st, out); /* padding rows */
        }
        for (int r = 0; r < n; r++) {
            int64_t first = (int64_t)r * e->c;
            int64_t rows = e->rows - first;
            rows = rows < 0 ? 0 : (rows > e->c ? e->c : rows);
            size_t bytes = (size_t)rows * row * sizeof(float);
            if (bytes == 0) {
                continue;
            }
            float *rows_of_r = slot != NULL ? slot + (size_t)first * row : NULL;
            if (s->owner == ctx->rank && r == ctx->rank) {
                MFSDP_CHECK_GOTO(to_owners
                                     ? ctx->exec->ops->copy(ctx->exec, rows_of_r, mine, bytes)
                                     : ctx->exec->ops->copy(ctx->exec, mine, rows_of_r, bytes),
                                 st, out);
            } else if (s->owner == ctx->rank) { /* 1: send, 0: receive */
                v[nv++] = (mfsdp_p2p_t){!to_owners, r, 2 * (int)i + 1, rows_of_r, bytes};
            } else if (r == ctx->rank) {
                v[nv++] = (mfsdp_p2p_t){to_owners, s->owner, 2 * (int)i + 1, mine, bytes};
            }
        }
    }
    MFSDP_CHECK_GOTO(ctx->tp->ops->p2p(ctx->tp, v, nv), st, out);
    for (size_t k = 0; cat == MFSDP_ARENA_MASTER && k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        const float *master =
            mfsdp_ctx_slot(ctx, ctx->plan->group_first[group] + pi, MFSDP_ARENA_MASTER);
        if (master != NULL) { /* NULL under tail "job": the job's own bytes stay */
            MFSDP_CHECK_GOTO(ctx->exec->ops->copy(ctx->exec, block + off[pi], master,
                                                  (size_t)ag->entries[pi].s * sizeof(float)),
                             st, out);
        }
    }
out:
    free(v);
    free(off);
    return st;
}

mfsdp_status_t mfsdp_ctx_scatter_masters(mfsdp_ctx_h ctx, size_t group, float *block, size_t count)
{
    return exchange_state(ctx, group, MFSDP_ARENA_MASTER, 0, block, count, "scatter_masters");
}

mfsdp_status_t mfsdp_ctx_scatter_momentum(mfsdp_ctx_h ctx, size_t group, float *block, size_t count)
{
    return exchange_state(ctx, group, MFSDP_ARENA_MOMENTUM, 0, block, count, "scatter_momentum");
}

mfsdp_status_t mfsdp_ctx_gather_momentum(mfsdp_ctx_h ctx, size_t group, const float *block,
                                         size_t count)
{
    /* read only: the block is the source of every transfer */
    return exchange_state(ctx, group, MFSDP_ARENA_MOMENTUM, 1, (float *)block, count,
                          "gather_momentum");
}
