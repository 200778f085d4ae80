/* SPDX-License-Identifier: Apache-2.0 */
#include "core/layout.h"

#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

/* Fill one buffer layout from the params selected by include[] with dtype chooser. */
static mfsdp_status_t build_buffer(const mfsdp_group_desc_t *g, int world, const int *include,
                                   const mfsdp_dtype_t *elt_dtype, mfsdp_dtype_t wire_dtype,
                                   mfsdp_buffer_layout_t *b)
{
    size_t n = 0;
    for (size_t i = 0; i < g->nparams; i++) {
        n += include[i] ? 1 : 0;
    }
    b->dtype = wire_dtype;
    b->nentries = n;
    b->entries = n ? calloc(n, sizeof(*b->entries)) : NULL;
    if (n != 0 && b->entries == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t off = 0;
    size_t k = 0;
    for (size_t i = 0; i < g->nparams; i++) {
        if (!include[i]) {
            continue;
        }
        const mfsdp_param_desc_t *p = &g->params[i];
        mfsdp_param_layout_t *e = &b->entries[k++];
        if (p->ndim < 1 || p->ndim > MFSDP_MAX_DIMS) {
            return MFSDP_ERR_INVALID_ARG;
        }
        if (p->shard_dim != 0) {
            MFSDP_WARN("param %s: Shard(%d) placement is not supported (only Shard(0))",
                       p->name ? p->name : "?", p->shard_dim);
            return MFSDP_ERR_UNSUPPORTED;
        }
        size_t rest = 1;
        for (int d = 1; d < p->ndim; d++) {
            if (p->shape[d] <= 0 || mfsdp_mul_overflow(rest, (size_t)p->shape[d], &rest)) {
                return p->shape[d] <= 0 ? MFSDP_ERR_INVALID_ARG : MFSDP_ERR_OVERFLOW;
            }
        }
        if (p->shape[0] <= 0) {
            return MFSDP_ERR_INVALID_ARG;
        }
        e->param = i;
        e->rows = p->shape[0];
        e->rest = (int64_t)rest;
        e->c = (p->shape[0] + world - 1) / world;
        e->elt = mfsdp_dtype_size(elt_dtype[i]);
        size_t s, row_bytes, s_bytes;
        if (mfsdp_mul_overflow((size_t)e->c, rest, &s) ||
            mfsdp_mul_overflow(rest, e->elt, &row_bytes) ||
            mfsdp_mul_overflow(s, e->elt, &s_bytes) || s > INT64_MAX) {
            return MFSDP_ERR_OVERFLOW;
        }
        e->s = (int64_t)s;
        e->row_bytes = row_bytes;
        e->s_bytes = s_bytes;
        e->o_bytes = off;
        if (mfsdp_add_overflow(off, s_bytes, &off)) {
            return MFSDP_ERR_OVERFLOW;
        }
    }
    size_t total;
    if (mfsdp_mul_overflow(off, (size_t)world, &total)) {
        return MFSDP_ERR_OVERFLOW; /* the whole n*S buffer must be addressable */
    }
    b->bytes = off;
    b->count = off / mfsdp_dtype_size(wire_dtype);
    return MFSDP_OK;
}

static void buffer_free(mfsdp_buffer_layout_t *b)
{
    free(b->entries);
    b->entries = NULL;
}

void mfsdp_group_layout_destroy(mfsdp_group_layout_t *layout)
{
    if (layout == NULL) {
        return;
    }
    buffer_free(&layout->ag);
    buffer_free(&layout->rs);
    free(layout->rs_entry);
    free(layout);
}

mfsdp_status_t mfsdp_group_layout_create(const mfsdp_group_desc_t *g, int world,
                                         mfsdp_group_layout_t **layout_p)
{
    return mfsdp_group_layout_create_masked(g, world, NULL, layout_p);
}

mfsdp_status_t mfsdp_group_layout_create_masked(const mfsdp_group_desc_t *g, int world,
                                                const unsigned char *has_grad,
                                                mfsdp_group_layout_t **layout_p)
{
    MFSDP_CHECK_ARG(g != NULL && layout_p != NULL && world >= 1);
    MFSDP_CHECK_ARG(g->nparams == 0 || g->params != NULL);
    for (size_t i = 0; has_grad != NULL && i < g->nparams; i++) {
        if (has_grad[i] > 1 || (has_grad[i] && !g->params[i].requires_grad)) {
            MFSDP_WARN("group %s: param %s is marked as having a gradient but %s",
                       g->name ? g->name : "?", g->params[i].name ? g->params[i].name : "?",
                       has_grad[i] > 1 ? "the mark is not 0 or 1" : "it does not require one");
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_group_layout_t *l = calloc(1, sizeof(*l));
    int *ag_inc = calloc(g->nparams + 1, sizeof(int));
    int *rs_inc = calloc(g->nparams + 1, sizeof(int));
    mfsdp_dtype_t *ag_dt = calloc(g->nparams + 1, sizeof(mfsdp_dtype_t));
    mfsdp_dtype_t *rs_dt = calloc(g->nparams + 1, sizeof(mfsdp_dtype_t));
    if (l == NULL || ag_inc == NULL || rs_inc == NULL || ag_dt == NULL || rs_dt == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    l->world = world;
    l->nparams = g->nparams;
    l->rs_entry = calloc(g->nparams + 1, sizeof(long));
    if (l->rs_entry == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }

    /* All-gather: every param in its own dtype; uint8 on the wire when dtypes differ. */
    int mixed = 0;
    for (size_t i = 0; i < g->nparams; i++) {
        ag_inc[i] = 1;
        ag_dt[i] = g->params[i].dtype;
        if (mfsdp_dtype_size(ag_dt[i]) == 0) {
            st = MFSDP_ERR_INVALID_ARG;
            goto out;
        }
        mixed |= (ag_dt[i] != g->params[0].dtype);
    }
    mfsdp_dtype_t ag_wire = g->nparams == 0 ? MFSDP_FLOAT32 : (mixed ? MFSDP_UINT8 : ag_dt[0]);
    MFSDP_CHECK_GOTO(build_buffer(g, world, ag_inc, ag_dt, ag_wire, &l->ag), st, out);

    /* Reduce-scatter: grad-bearing params only, all in the reduce dtype. */
    int have_rs_dtype = g->has_reduce_dtype;
    mfsdp_dtype_t rs_wire = g->reduce_dtype;
    long k = 0;
    for (size_t i = 0; i < g->nparams; i++) {
        l->rs_entry[i] = -1;
        if (!g->params[i].requires_grad) {
            continue;
        }
        if (!have_rs_dtype) {
            rs_wire = g->params[i].dtype;
            have_rs_dtype = 1;
        } else if (!g->has_reduce_dtype && rs_wire != g->params[i].dtype) {
            MFSDP_WARN("group %s: params with gradients have mixed dtypes (%s, %s) and no "
                       "reduce_dtype; FSDP2 reduces in one dtype",
                       g->name ? g->name : "?", mfsdp_dtype_name(rs_wire),
                       mfsdp_dtype_name(g->params[i].dtype));
            st = MFSDP_ERR_UNSUPPORTED;
            goto out;
        }
        if (has_grad != NULL && !has_grad[i]) {
            continue; /* no gradient in this backward: FSDP2 leaves it out */
        }
        rs_inc[i] = 1;
        l->rs_entry[i] = k++;
    }
    if (!have_rs_dtype) {
        rs_wire = ag_wire == MFSDP_UINT8 ? MFSDP_FLOAT32 : ag_wire;
    }
    if (rs_wire == MFSDP_UINT8) {
        st = MFSDP_ERR_INVALID_ARG;
        goto out;
    }
    for (size_t i = 0; i < g->nparams; i++) {
        rs_dt[i] = rs_wire;
    }
    MFSDP_CHECK_GOTO(build_buffer(g, world, rs_inc, rs_dt, rs_wire, &l->rs), st, out);

    *layout_p = l;
    l = NULL;
out:
    mfsdp_group_layout_destroy(l);
    free(ag_inc);
    free(rs_inc);
    free(ag_dt);
    free(rs_dt);
    return st;
}

void mfsdp_layout_piece(const mfsdp_buffer_layout_t *b, int world, size_t entry, int r,
                        mfsdp_piece_t *piece)
{
    const mfsdp_param_layout_t *e = &b->entries[entry];
    (void)world;
    int64_t first = (int64_t)r * e->c;
    int64_t nrows = e->rows - first;
    if (nrows < 0) {
        nrows = 0;
    }
    if (nrows > e->c) {
        nrows = e->c;
    }
    piece->buf_offset = (size_t)r * b->bytes + e->o_bytes;
    piece->full_offset = (size_t)first * e->row_bytes;
    piece->valid = (size_t)nrows * e->row_bytes;
    piece->pad = e->s_bytes - piece->valid;
}
