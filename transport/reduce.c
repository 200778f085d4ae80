/* SPDX-License-Identifier: Apache-2.0 */
/* Owner-side arithmetic of reduce op lists, shared by every transport: done by the xfer's
 * executor (CPU kernels on host memory, CUDA kernels on the call's stream). */
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "kernels/executor.h"
#include "transport/transport.h"

void *mfsdp_xfer_buf(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op, size_t *elt_p)
{
    const mfsdp_xfer_bufs_t *b = &x->bufs[op->seg];
    int reduce = x->dir == MFSDP_SCHED_DIR_REDUCE;
    size_t elt = reduce ? sizeof(float) : 1;
    void *p = NULL;
    switch (op->buf) {
    case MFSDP_BUF_SRC:
        p = b->src;
        elt = reduce ? mfsdp_dtype_size(x->dtype) : 1;
        break;
    case MFSDP_BUF_STAGE:
        p = b->stage; /* direct reduce: op->boff addresses the ring slot and source rank */
        if (reduce) {
            elt = mfsdp_dtype_size(x->dtype);
        }
        break;
    case MFSDP_BUF_RSIN:
        p = reduce ? (void *)x->rs_in : NULL;
        elt = mfsdp_dtype_size(x->dtype);
        break;
    case MFSDP_BUF_PIN:
        p = b->pin;
        break;
    case MFSDP_BUF_POUT:
        p = b->pout;
        break;
    case MFSDP_BUF_FINAL:
        p = b->final;
        break;
    }
    *elt_p = elt;
    return p;
}

mfsdp_status_t mfsdp_xfer_check_tail(const mfsdp_xfer_t *x)
{
    int gather = x->dir == MFSDP_SCHED_DIR_GATHER;
    if (gather ? x->ag_out == NULL || x->tail_send != NULL || x->tail_recv != NULL
               : x->tail_send == NULL || x->tail_recv == NULL) {
        MFSDP_WARN("sharded tail of group %zu: the %s needs %s", x->gs->group,
                   gather ? "all-gather" : "reduce",
                   gather ? "FSDP's output and no staging" : "send and receive staging");
        return MFSDP_ERR_INTERNAL;
    }
    return MFSDP_OK;
}

char *mfsdp_xfer_ag_at(const mfsdp_xfer_t *x, uint32_t seg, size_t pos, size_t *run_p)
{
    const mfsdp_sched_seg_t *s = &x->gs->segs[seg];
    const mfsdp_buffer_layout_t *ag = &x->gs->layout->ag;
    const mfsdp_param_layout_t *e = &ag->entries[s->param];
    size_t block = (size_t)e->c * e->row_bytes; /* bytes of one rank's rows */
    if (x->ag_out == NULL || block == 0 || pos >= s->ag_bytes) {
        *run_p = 0;
        return NULL;
    }
    size_t j = pos / block;
    size_t end = (j + 1) * block < s->ag_bytes ? (j + 1) * block : s->ag_bytes;
    *run_p = end - pos;
    return (char *)x->ag_out + j * ag->bytes + e->o_bytes + (pos - j * block);
}

/* Combine elements [off, off+len) of a tensor's contribution read in place from FSDP's
 * reduce-scatter input: the range is cut into runs that are contiguous there (the rows of
 * one rank block), so no packed copy of the contribution is needed. */
static mfsdp_status_t combine_strided(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op,
                                      float *pout, const float *pin)
{
    const mfsdp_sched_seg_t *s = &x->gs->segs[op->seg];
    const mfsdp_buffer_layout_t *rs = &x->gs->layout->rs;
    const mfsdp_param_layout_t *e = &rs->entries[s->rs_entry];
    size_t R = (size_t)e->rest;
    size_t c = (size_t)e->c;
    size_t end = op->off + op->len;
    for (size_t i = op->off; i < end;) {
        size_t row = i / R;
        size_t j = row / c;                 /* rank block holding this row */
        size_t block_end = (j + 1) * c * R; /* first element of the next block */
        size_t run = (block_end < end ? block_end : end) - i;
        const char *src =
            (const char *)x->rs_in + j * rs->bytes + e->o_bytes + (i - j * c * R) * e->elt;
        size_t k = i - op->off;
        MFSDP_CHECK(x->exec->ops->combine(x->exec, pout + k, pin != NULL ? pin + k : NULL, src,
                                          x->dtype, run, x->op, x->scalar));
        i += run;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_xfer_prepare(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op)
{
    const mfsdp_xfer_bufs_t *b = &x->bufs[op->seg];
    if (b->pout == NULL || x->rs_in == NULL || (op->has_in && b->pin == NULL)) {
        MFSDP_WARN("reduce segment %u: staging buffer missing", op->seg);
        return MFSDP_ERR_INTERNAL;
    }
    /* Partial sums live at the op's buffer offset (a ring slot in a chain); the own
     * contribution is read in place from FSDP's input. */
    const float *pin = op->has_in ? b->pin + op->boff : NULL;
    return combine_strided(x, op, b->pout + op->boff, pin);
}

/* Chain gather: bytes [off, off+len) of a tensor, received in a ring slot, copied into its
 * pieces of FSDP's all-gather output (cut at rank-block boundaries). */
static mfsdp_status_t copy_out(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op)
{
    const char *src = (const char *)x->bufs[op->seg].stage;
    if (src == NULL || x->ag_out == NULL) {
        MFSDP_WARN("gather segment %u: no staging or output buffer", op->seg);
        return MFSDP_ERR_INTERNAL;
    }
    src += op->boff;
    size_t end = op->off + op->len;
    for (size_t i = op->off; i < end;) {
        size_t run;
        char *dst = mfsdp_xfer_ag_at(x, op->seg, i, &run);
        if (dst == NULL) {
            return MFSDP_ERR_INTERNAL;
        }
        run = run < end - i ? run : end - i;
        MFSDP_CHECK(x->exec->ops->copy(x->exec, dst, src, run));
        src += run;
        i += run;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_xfer_local(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op, int rank,
                                int world, const void **srcv)
{
    const mfsdp_xfer_bufs_t *b = &x->bufs[op->seg];
    size_t elt = mfsdp_dtype_size(x->dtype);
    if (op->kind == MFSDP_SCHED_COPYOUT) {
        return copy_out(x, op);
    }
    if (b->grad == NULL) {
        MFSDP_WARN("reduce segment %u: no gradient accumulator on its owner", op->seg);
        return MFSDP_ERR_INTERNAL;
    }
    switch (op->apply) {
    case MFSDP_APPLY_ORDERED: {
        /* The direct algorithm: one chunk, contributions in rank order 0..n-1: the other
         * ranks' from their sub-slots of the ring slot at op->boff, the own one in place in
         * FSDP's input (a chunk lies in one rank block there). */
        const mfsdp_sched_seg_t *s = &x->gs->segs[op->seg];
        const mfsdp_buffer_layout_t *rs = &x->gs->layout->rs;
        const mfsdp_param_layout_t *e = &rs->entries[s->rs_entry];
        size_t block = (size_t)e->c * (size_t)e->rest;
        if (x->rs_in == NULL || block == 0 || op->off / block != (op->off + op->len - 1) / block ||
            (world > 1 && b->stage == NULL)) {
            MFSDP_WARN("reduce segment %u: chunk [%zu, +%zu) without staging or across rank "
                       "blocks",
                       op->seg, op->off, op->len);
            return MFSDP_ERR_INTERNAL;
        }
        size_t j = op->off / block;
        const char *own =
            (const char *)x->rs_in + j * rs->bytes + e->o_bytes + (op->off - j * block) * elt;
        if (srcv == NULL) {
            return MFSDP_ERR_INTERNAL;
        }
        for (int r = 0; r < world; r++) {
            srcv[r] = r == rank
                          ? own
                          : (const char *)b->stage + (op->boff + (size_t)r * op->stride) * elt;
        }
        return x->exec->ops->reduce_ordered(x->exec, b->grad + op->off, (const void *const *)srcv,
                                            world, x->dtype, op->len, x->op, x->scalar, 1);
    }
    case MFSDP_APPLY_FINAL:
        return x->exec->ops->apply(x->exec, b->grad + op->off, b->final + op->boff, op->len, x->op,
                                   world);
    case MFSDP_APPLY_LAST:
        MFSDP_CHECK(mfsdp_xfer_prepare(x, op));
        return x->exec->ops->apply(x->exec, b->grad + op->off, b->pout + op->boff, op->len, x->op,
                                   world);
    }
    return MFSDP_ERR_INTERNAL;
}
