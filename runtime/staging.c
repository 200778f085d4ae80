/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Staging of one group call: buffers carved from the arena's scratch region. The same
 * functions size the region at creation (base == NULL) and bind the buffers of one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "mfsdp/kernels.h"
#include "runtime/ctx.h"

typedef struct carver {
    char *base;
    size_t used;
    int overflow;
} carver_t;

static void *carve(carver_t *c, size_t bytes)
{
    size_t start = (c->used + MFSDP_ARENA_ALIGN - 1) & ~(size_t)(MFSDP_ARENA_ALIGN - 1);
    size_t end;
    if (start < c->used || mfsdp_add_overflow(start, bytes, &end)) {
        c->overflow = 1;
        return NULL;
    }
    c->used = end;
    return c->base != NULL && bytes != 0 ? c->base + start : NULL;
}

static size_t mul_sat(carver_t *c, size_t a, size_t b)
{
    size_t r;
    if (mfsdp_mul_overflow(a, b, &r)) {
        c->overflow = 1;
        return 0;
    }
    return r;
}

mfsdp_status_t mfsdp_ctx_bind_gather(struct mfsdp_ctx *ctx, size_t g, char *base, size_t *need_p)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_sched_t *gs = gst->gs;
    carver_t c = {.base = base};
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        mfsdp_xfer_bufs_t *b = &gst->bufs[i];
        memset(b, 0, sizeof(*b));
        if (s->owner == ctx->rank) {
            b->src = mfsdp_ctx_slot(ctx, s->shard, MFSDP_ARENA_COMM);
        } else if (gst->gather_algo == MFSDP_ALGO_CHAIN) {
            /* A ring of chunks: each is copied out and forwarded from there. */
            b->stage = carve(&c, mfsdp_sched_ring(s->ag_bytes, gst->ag_chunk));
        } /* direct and native: every run lands in place in FSDP's output (no staging) */
    }
    /* The sharded tail needs none: the own slices are copied to their place in FSDP's output
     * and gathered there in place. */
    if (c.overflow) {
        return MFSDP_ERR_OVERFLOW;
    }
    *need_p = c.used;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_bind_reduce(struct mfsdp_ctx *ctx, size_t g, const mfsdp_group_sched_t *gs,
                                     char *base, size_t *need_p, mfsdp_tail_bufs_t *tail)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    size_t elt = mfsdp_dtype_size(gs->layout->rs.dtype);
    size_t n = (size_t)ctx->world;
    carver_t c = {.base = base};
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        mfsdp_xfer_bufs_t *b = &gst->bufs[i];
        memset(b, 0, sizeof(*b));
        if (s->rs_entry < 0) {
            continue;
        }
        int own = s->owner == ctx->rank;
        /* Every algorithm reads the own contribution in place from FSDP's buffer. */
        if (own) {
            b->grad = mfsdp_ctx_grad_target(ctx, s->shard);
        }
        switch (gst->reduce_algo) {
        case MFSDP_ALGO_DIRECT:
            if (own && n > 1) {
                /* The chunk pipeline's ring: slots of one chunk per source rank. */
                size_t stride, nslots;
                mfsdp_sched_direct_ring(gs, s, gst->rs_chunk / sizeof(float), &stride, &nslots);
                b->stage = carve(&c, mul_sat(&c, mul_sat(&c, mul_sat(&c, stride, n), nslots), elt));
            }
            break;
        case MFSDP_ALGO_CHAIN: {
            /* A chunk is received, has the own contribution added in place and is sent
             * on from the same memory: one fp32 ring serves as PIN and POUT. */
            size_t ring = mul_sat(&c, mfsdp_sched_ring(s->numel, gst->rs_chunk / sizeof(float)),
                                  sizeof(float));
            b->pin = carve(&c, ring);
            b->pout = b->pin;
            if (own) {
                b->final = carve(&c, ring);
            }
            break;
        }
        default: { /* native: rings of fp32 partial sums and of the owner's sums */
            size_t ring = mul_sat(&c, mfsdp_sched_ring(s->numel, gst->rs_chunk / sizeof(float)),
                                  sizeof(float));
            b->pout = carve(&c, ring);
            if (own) {
                b->final = carve(&c, ring);
            }
            break;
        }
        }
    }
    tail->send = tail->recv = NULL;
    tail->sum = NULL;
    if (gs->tail_rs_elems != 0) {
        /* One pass's worth (the budget may cut the tail into passes) of packed rank-major
         * blocks in the reduce dtype, sent and received (an all-to-all), and their fp32
         * sum. */
        size_t pass = gs->tail_rs_elems < gst->tail_pass ? gs->tail_rs_elems : gst->tail_pass;
        size_t blocks = mul_sat(&c, mul_sat(&c, pass, elt), n);
        tail->send = carve(&c, blocks);
        tail->recv = carve(&c, blocks);
        tail->sum = carve(&c, mul_sat(&c, pass, sizeof(float)));
    }
    if (c.overflow) {
        return MFSDP_ERR_OVERFLOW;
    }
    *need_p = c.used;
    return MFSDP_OK;
}
