/* SPDX-License-Identifier: Apache-2.0 */
#include "core/schedule.h"

#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

/* Tags: 2 * MFSDP_SCHED_WINDOW per segment: (main flow, final hop of the reduce chain) x
 * ring slot. MPI guarantees at least 32767. Messages match receives in posting order per
 * (source, tag); receives into different ring slots are posted in whatever order their
 * slots are released, so each slot has its own tag, and distinct tags per segment keep
 * forwarded chunks of different segments apart. Within one (segment, slot) tag, sends and
 * receives are ordered by their dependencies. */
#define SCHED_TAG_LIMIT    32767
#define SCHED_TAGS_PER_SEG (2 * MFSDP_SCHED_WINDOW)

void mfsdp_group_sched_destroy(mfsdp_group_sched_t *gs)
{
    if (gs == NULL) {
        return;
    }
    mfsdp_group_layout_destroy(gs->layout);
    free(gs->segs);
    free(gs->tail);
    free(gs);
}

mfsdp_status_t mfsdp_group_sched_create(const mfsdp_plan_t *plan, size_t g,
                                        mfsdp_group_sched_t **gs_p)
{
    return mfsdp_group_sched_create_masked(plan, g, NULL, gs_p);
}

mfsdp_status_t mfsdp_group_sched_create_masked(const mfsdp_plan_t *plan, size_t g,
                                               const unsigned char *has_grad,
                                               mfsdp_group_sched_t **gs_p)
{
    MFSDP_CHECK_ARG(plan != NULL && plan->manifest != NULL && gs_p != NULL);
    MFSDP_CHECK_ARG(g < plan->manifest->ngroups);
    const mfsdp_group_desc_t *gd = &plan->manifest->groups[g];
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_group_sched_t *gs = calloc(1, sizeof(*gs));
    if (gs == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    gs->group = g;
    gs->world = plan->world;
    MFSDP_CHECK_GOTO(mfsdp_group_layout_create_masked(gd, plan->world, has_grad, &gs->layout), st,
                     out_err);
    size_t first = plan->group_first[g];
    if (plan->group_first[g + 1] - first != gd->nparams) {
        MFSDP_WARN("plan has %zu shards for group %s of %zu params",
                   plan->group_first[g + 1] - first, gd->name, gd->nparams);
        st = MFSDP_ERR_INTERNAL;
        goto out_err;
    }
    gs->segs = calloc(gd->nparams + 1, sizeof(*gs->segs));
    gs->tail = calloc(gd->nparams + 1, sizeof(*gs->tail));
    if (gs->segs == NULL || gs->tail == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out_err;
    }
    for (size_t i = 0; i < gd->nparams; i++) {
        const mfsdp_shard_t *sh = &plan->shards[first + i];
        const mfsdp_param_layout_t *ag = &gs->layout->ag.entries[i];
        long rs = gs->layout->rs_entry[i];
        if (sh->group != g || sh->param != i) {
            st = MFSDP_ERR_INTERNAL;
            goto out_err;
        }
        if (sh->owner == MFSDP_OWNER_SHARDED) {
            gs->tail[gs->ntail++] = i;
            if (mfsdp_add_overflow(gs->tail_ag_bytes, ag->s_bytes, &gs->tail_ag_bytes)) {
                st = MFSDP_ERR_OVERFLOW;
                goto out_err;
            }
            if (rs >= 0) {
                gs->tail_rs_elems += (size_t)gs->layout->rs.entries[rs].s;
            }
            continue;
        }
        if (sh->owner < 0 || sh->owner >= plan->world) {
            MFSDP_WARN("plan: shard %zu has owner %d outside [0, %d)", first + i, sh->owner,
                       plan->world);
            st = MFSDP_ERR_INTERNAL;
            goto out_err;
        }
        mfsdp_sched_seg_t *s = &gs->segs[gs->nsegs++];
        s->shard = first + i;
        s->param = i;
        s->owner = sh->owner;
        if (mfsdp_mul_overflow((size_t)ag->rows, (size_t)ag->rest, &s->numel) ||
            mfsdp_mul_overflow(s->numel, ag->elt, &s->ag_bytes)) {
            st = MFSDP_ERR_OVERFLOW;
            goto out_err;
        }
        s->rs_entry = rs;
    }
    if (gs->nsegs + 1 > SCHED_TAG_LIMIT / SCHED_TAGS_PER_SEG) {
        MFSDP_WARN("group %s has %zu owner segments; at most %d are supported", gd->name, gs->nsegs,
                   SCHED_TAG_LIMIT / SCHED_TAGS_PER_SEG - 1);
        st = MFSDP_ERR_UNSUPPORTED;
        goto out_err;
    }
    *gs_p = gs;
    return MFSDP_OK;
out_err:
    mfsdp_group_sched_destroy(gs);
    return st;
}

/* A growable op list. */
typedef struct oplist {
    mfsdp_sched_op_t *v;
    size_t n, cap;
    int oom;
} oplist_t;

static long push(oplist_t *l, const mfsdp_sched_op_t *op)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        mfsdp_sched_op_t *v = realloc(l->v, cap * sizeof(*v));
        if (v == NULL) {
            l->oom = 1;
            return -1;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n] = *op;
    return (long)l->n++;
}

static mfsdp_sched_op_t mkop(mfsdp_sched_kind_t kind, uint32_t seg, int peer, mfsdp_sched_buf_t buf,
                             size_t off, size_t len, int tag, long dep)
{
    mfsdp_sched_op_t op;
    memset(&op, 0, sizeof(op));
    op.kind = kind;
    op.seg = seg;
    op.peer = peer;
    op.buf = buf;
    op.off = off;
    op.len = len;
    op.boff = off;
    op.tag = tag;
    op.dep = dep;
    return op;
}

/* Pieces of [0, total) of at most step units. */
#define FOR_CHUNKS(off, len, total, step)                                                          \
    for (size_t off = 0, len = 0;                                                                  \
         off < (total) && ((len = ((total)-off < (step) ? (total)-off : (step))), 1); off += len)

/* The runs [off, off + len) of a tensor of total bytes, cut at FSDP's rank blocks of
 * block bytes and at MFSDP_SCHED_MAX_MSG: each run is contiguous in FSDP's all-gather output
 * (one receive lands it there in place, with no datatype and no staging). */
#define FOR_BLOCK_RUNS(off, len, total, block)                                                     \
    for (size_t j_ = 0; (block) != 0 && j_ * (block) < (total); j_++)                              \
        FOR_CHUNKS(po_, len, (total)-j_ *(block) < (block) ? (total)-j_ * (block) : (block),       \
                   MFSDP_SCHED_MAX_MSG)                                                            \
    for (size_t off = j_ * (block) + po_, once_ = 1; once_ != 0; once_ = 0)

static void gather_ops(const mfsdp_group_sched_t *gs, oplist_t *l, const mfsdp_sched_seg_t *s,
                       uint32_t si, int rank, int n, mfsdp_algo_t algo, size_t chunk)
{
    int tag = SCHED_TAGS_PER_SEG * (int)si;
    int o = s->owner;
    const mfsdp_param_layout_t *e = &gs->layout->ag.entries[s->param];
    size_t block = (size_t)e->c * e->row_bytes; /* bytes of one rank block of the tensor */
    if (n == 1) {
        return; /* the owner's copy is the whole result */
    }
    switch (algo) {
    case MFSDP_ALGO_DIRECT:
        if (rank == o) {
            for (int j = 0; j < n; j++) {
                if (j == o) {
                    continue;
                }
                FOR_BLOCK_RUNS(off, len, s->ag_bytes, block)
                {
                    mfsdp_sched_op_t op =
                        mkop(MFSDP_SCHED_SEND, si, j, MFSDP_BUF_SRC, off, len, tag, -1);
                    push(l, &op);
                }
            }
        } else {
            FOR_BLOCK_RUNS(off, len, s->ag_bytes, block)
            {
                mfsdp_sched_op_t op =
                    mkop(MFSDP_SCHED_RECV, si, o, MFSDP_BUF_STAGE, off, len, tag, -1);
                push(l, &op);
            }
        }
        break;
    case MFSDP_ALGO_CHAIN: {
        int pos = (rank - o + n) % n;
        int next = (rank + 1) % n;
        int prev = (rank + n - 1) % n;
        long rel[MFSDP_SCHED_WINDOW]; /* op that frees each ring slot */
        size_t k = 0;
        FOR_CHUNKS(off, len, s->ag_bytes, chunk)
        {
            size_t slot = k % MFSDP_SCHED_WINDOW;
            int stag = tag + (int)slot;
            int w2 = 2 * (int)(k / MFSDP_SCHED_WINDOW); /* waves: hop - 1 + 2 * window */
            if (pos == 0) {
                mfsdp_sched_op_t op =
                    mkop(MFSDP_SCHED_SEND, si, next, MFSDP_BUF_SRC, off, len, stag, -1);
                op.wave = w2;
                push(l, &op);
                k++;
                continue;
            }
            /* receive into the ring slot once its previous chunk left, copy it out, then
             * forward it */
            mfsdp_sched_op_t op = mkop(MFSDP_SCHED_RECV, si, prev, MFSDP_BUF_STAGE, off, len, stag,
                                       k >= MFSDP_SCHED_WINDOW ? rel[slot] : -1);
            op.boff = slot * chunk;
            op.wave = pos - 1 + w2;
            long d = push(l, &op);
            op = mkop(MFSDP_SCHED_COPYOUT, si, rank, MFSDP_BUF_STAGE, off, len, stag, d);
            op.boff = slot * chunk;
            op.wave = pos - 1 + w2;
            d = push(l, &op);
            if (pos < n - 1) {
                op = mkop(MFSDP_SCHED_SEND, si, next, MFSDP_BUF_STAGE, off, len, stag, d);
                op.boff = slot * chunk;
                op.wave = pos + w2;
                d = push(l, &op);
            }
            rel[slot] = d;
            k++;
        }
        break;
    }
    default: /* NATIVE */
        FOR_BLOCK_RUNS(off, len, s->ag_bytes, block)
        {
            mfsdp_sched_op_t op =
                mkop(MFSDP_SCHED_BCAST, si, o, rank == o ? MFSDP_BUF_SRC : MFSDP_BUF_STAGE, off,
                     len, tag, -1);
            push(l, &op);
        }
        break;
    }
}

/* The sharded tail's collective: one op, first in a list, and alone in the reduce's later
 * passes (mfsdp_sched_build_tail), with the same tag in both. */
static mfsdp_sched_op_t tail_op(void)
{
    return mkop(MFSDP_SCHED_TAIL, 0, 0, MFSDP_BUF_STAGE, 0, 0, SCHED_TAG_LIMIT - 1, -1);
}

void mfsdp_sched_direct_ring(const mfsdp_group_sched_t *gs, const mfsdp_sched_seg_t *s,
                             size_t chunk_elems, size_t *stride_p, size_t *nslots_p)
{
    size_t stride = 0, chunks = 0;
    if (s->rs_entry >= 0 && chunk_elems != 0) {
        const mfsdp_param_layout_t *e = &gs->layout->rs.entries[s->rs_entry];
        size_t block = (size_t)e->c * (size_t)e->rest;
        for (size_t j = 0; block != 0 && j * block < s->numel; j++) {
            size_t piece = s->numel - j * block < block ? s->numel - j * block : block;
            size_t longest = piece < chunk_elems ? piece : chunk_elems;
            stride = longest > stride ? longest : stride;
            chunks += (piece + chunk_elems - 1) / chunk_elems;
        }
    }
    *stride_p = stride;
    *nslots_p = chunks < MFSDP_SCHED_WINDOW ? chunks : MFSDP_SCHED_WINDOW;
}

static void reduce_ops(const mfsdp_group_sched_t *gs, oplist_t *l, const mfsdp_sched_seg_t *s,
                       uint32_t si, int rank, int n, mfsdp_algo_t algo, size_t chunk_elems,
                       size_t max_elems)
{
    int tag = SCHED_TAGS_PER_SEG * (int)si;
    int o = s->owner;
    switch (algo) {
    case MFSDP_ALGO_DIRECT: {
        size_t stride, nslots;
        mfsdp_sched_direct_ring(gs, s, chunk_elems, &stride, &nslots);
        const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
        const mfsdp_param_layout_t *e = &rs->entries[s->rs_entry];
        size_t block = (size_t)e->c * (size_t)e->rest; /* elements of one rank block */
        long rel[MFSDP_SCHED_WINDOW];                  /* the sum that frees each slot */
        size_t k = 0;
        for (size_t j = 0; block != 0 && j * block < s->numel; j++) {
            size_t piece = s->numel - j * block < block ? s->numel - j * block : block;
            FOR_CHUNKS(po, len, piece, chunk_elems)
            {
                size_t off = j * block + po;
                size_t slot = k % MFSDP_SCHED_WINDOW;
                int stag = tag + (int)slot;
                int wave = (int)(k / MFSDP_SCHED_WINDOW);
                mfsdp_sched_op_t op;
                if (rank != o) {
                    op = mkop(MFSDP_SCHED_SEND, si, o, MFSDP_BUF_RSIN, off, len, stag, -1);
                    op.boff = j * rs->count + e->o_bytes / e->elt + po;
                    op.wave = wave;
                    push(l, &op);
                    k++;
                    continue;
                }
                long first = -1;
                for (int r = 0; r < n; r++) {
                    if (r == o) {
                        continue;
                    }
                    op = mkop(MFSDP_SCHED_RECV, si, r, MFSDP_BUF_STAGE, off, len, stag,
                              k >= MFSDP_SCHED_WINDOW ? rel[slot] : -1);
                    op.slot = r;
                    op.boff = (slot * (size_t)n + (size_t)r) * stride;
                    op.wave = wave;
                    long d = push(l, &op);
                    first = first < 0 ? d : first;
                }
                op = mkop(MFSDP_SCHED_APPLY, si, o, MFSDP_BUF_STAGE, off, len, stag, first);
                op.ndep = n - 1;
                op.apply = MFSDP_APPLY_ORDERED;
                op.boff = slot * (size_t)n * stride;
                op.stride = stride;
                op.wave = wave;
                rel[slot] = push(l, &op);
                k++;
            }
        }
        return;
    }
    case MFSDP_ALGO_CHAIN: {
        /* Partial sums flow 0 -> 1 -> ... -> n-1 (rank order, like direct), then the last
         * rank hands the full sum to the owner unless it is the owner. PIN (= POUT) and
         * FINAL are rings of MFSDP_SCHED_WINDOW chunks: a chunk's slot is reused once the
         * chunk WINDOW earlier was sent on (or applied). */
        long rel[MFSDP_SCHED_WINDOW], relf[MFSDP_SCHED_WINDOW];
        size_t k = 0;
        FOR_CHUNKS(off, len, s->numel, chunk_elems)
        {
            size_t slot = k % MFSDP_SCHED_WINDOW;
            size_t boff = slot * chunk_elems;
            int stag = tag + (int)slot;                      /* chain hops */
            int ftag = tag + MFSDP_SCHED_WINDOW + (int)slot; /* last rank -> owner */
            int w2 = 2 * (int)(k / MFSDP_SCHED_WINDOW);      /* waves: hop - 1 + 2 * window */
            long dep = k >= MFSDP_SCHED_WINDOW ? rel[slot] : -1;
            mfsdp_sched_op_t op;
            if (rank > 0) {
                op = mkop(MFSDP_SCHED_RECV, si, rank - 1, MFSDP_BUF_PIN, off, len, stag, dep);
                op.boff = boff;
                op.wave = rank - 1 + w2;
                dep = push(l, &op);
            }
            if (rank < n - 1 || rank != o) {
                op = mkop(MFSDP_SCHED_SEND, si, rank < n - 1 ? rank + 1 : o, MFSDP_BUF_POUT, off,
                          len, rank < n - 1 ? stag : ftag, dep);
                op.combine = 1;
                op.wave = rank + w2; /* hop rank + 1, or n (to the owner) from rank n - 1 */
            } else {
                op = mkop(MFSDP_SCHED_APPLY, si, o, MFSDP_BUF_PIN, off, len, stag, dep);
                op.apply = MFSDP_APPLY_LAST;
                op.wave = rank > 0 ? rank - 1 + w2 : 0; /* after the receive, if any */
            }
            op.has_in = rank > 0;
            op.boff = boff;
            rel[slot] = push(l, &op);
            if (rank == o && o != n - 1) {
                op = mkop(MFSDP_SCHED_RECV, si, n - 1, MFSDP_BUF_FINAL, off, len, ftag,
                          k >= MFSDP_SCHED_WINDOW ? relf[slot] : -1);
                op.boff = boff;
                op.wave = n - 1 + w2;
                long d = push(l, &op);
                op = mkop(MFSDP_SCHED_APPLY, si, o, MFSDP_BUF_FINAL, off, len, ftag, d);
                op.apply = MFSDP_APPLY_FINAL;
                op.boff = boff;
                op.wave = n - 1 + w2;
                relf[slot] = push(l, &op);
            }
            k++;
        }
        return;
    }
    default: { /* NATIVE */
        /* One MPI_Ireduce / ncclReduce per chunk of fp32 partial sums. POUT (every rank) and
         * FINAL (the owner) are rings of MFSDP_SCHED_WINDOW chunks: chunk k reuses the slot of
         * chunk k - WINDOW once that one was reduced (and applied, on the owner), one wave
         * later, so collectives are posted in (wave, list) order on every rank. */
        size_t step = chunk_elems < max_elems ? chunk_elems : max_elems;
        long rel[MFSDP_SCHED_WINDOW];
        size_t k = 0;
        FOR_CHUNKS(off, len, s->numel, step)
        {
            size_t slot = k % MFSDP_SCHED_WINDOW;
            mfsdp_sched_op_t op = mkop(MFSDP_SCHED_REDUCE, si, o, MFSDP_BUF_POUT, off, len, tag,
                                       k >= MFSDP_SCHED_WINDOW ? rel[slot] : -1);
            op.combine = 1;
            op.boff = slot * step;
            op.wave = (int)(k / MFSDP_SCHED_WINDOW);
            long d = push(l, &op);
            if (rank == o) {
                op = mkop(MFSDP_SCHED_APPLY, si, o, MFSDP_BUF_FINAL, off, len, tag, d);
                op.apply = MFSDP_APPLY_FINAL;
                op.boff = slot * step;
                op.wave = (int)(k / MFSDP_SCHED_WINDOW);
                d = push(l, &op);
            }
            rel[slot] = d;
            k++;
        }
        return;
    }
    }
}

mfsdp_status_t mfsdp_sched_build(const mfsdp_group_sched_t *gs, int rank, mfsdp_sched_dir_t dir,
                                 mfsdp_algo_t algo, size_t chunk, mfsdp_sched_ops_t *ops_p)
{
    MFSDP_CHECK_ARG(gs != NULL && ops_p != NULL && rank >= 0 && rank < gs->world);
    MFSDP_CHECK_ARG(dir == MFSDP_SCHED_DIR_GATHER || dir == MFSDP_SCHED_DIR_REDUCE);
    MFSDP_CHECK_ARG(algo == MFSDP_ALGO_DIRECT || algo == MFSDP_ALGO_CHAIN ||
                    algo == MFSDP_ALGO_NATIVE);
    MFSDP_CHECK_ARG(chunk >= sizeof(float));
    /* A direct reduce's chunk is one message (at most chunk bytes at any reduce dtype). */
    MFSDP_CHECK_ARG(dir != MFSDP_SCHED_DIR_REDUCE || algo != MFSDP_ALGO_DIRECT ||
                    chunk <= MFSDP_SCHED_MAX_MSG);
    oplist_t l = {0};
    int n = gs->world;
    int has_tail = dir == MFSDP_SCHED_DIR_GATHER ? gs->tail_ag_bytes != 0 : gs->tail_rs_elems != 0;
    if (has_tail) {
        mfsdp_sched_op_t op = tail_op();
        push(&l, &op);
    }
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (dir == MFSDP_SCHED_DIR_GATHER) {
            gather_ops(gs, &l, s, (uint32_t)i, rank, n, algo, chunk);
        } else if (s->rs_entry >= 0) {
            reduce_ops(gs, &l, s, (uint32_t)i, rank, n, algo, chunk / sizeof(float),
                       MFSDP_SCHED_MAX_MSG / sizeof(float));
        }
    }
    if (l.oom) {
        free(l.v);
        return MFSDP_ERR_NO_MEMORY;
    }
    *ops_p = (mfsdp_sched_ops_t){.nops = l.n, .ops = l.v};
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_sched_build_tail(mfsdp_sched_ops_t *ops_p)
{
    MFSDP_CHECK_ARG(ops_p != NULL);
    mfsdp_sched_op_t *op = malloc(sizeof(*op));
    if (op == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    *op = tail_op();
    *ops_p = (mfsdp_sched_ops_t){.nops = 1, .ops = op};
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_sched_wave_order(const mfsdp_sched_ops_t *l,
                                      int (*keep)(const mfsdp_sched_op_t *op), long **order_p,
                                      size_t *count_p, size_t **first_p, size_t *nw_p)
{
    MFSDP_CHECK_ARG(l != NULL && keep != NULL && order_p != NULL && count_p != NULL);
    size_t nw = 0, count = 0;
    for (size_t i = 0; i < l->nops; i++) {
        const mfsdp_sched_op_t *op = &l->ops[i];
        if (!keep(op)) {
            continue;
        }
        if (op->wave < 0) {
            MFSDP_WARN("op %zu has wave %d", i, op->wave);
            return MFSDP_ERR_INTERNAL;
        }
        nw = (size_t)op->wave + 1 > nw ? (size_t)op->wave + 1 : nw;
        count++;
    }
    size_t *first = calloc(nw + 1, sizeof(*first));
    size_t *fill = malloc((nw + 1) * sizeof(*fill));
    long *order = malloc((count + 1) * sizeof(*order));
    if (first == NULL || fill == NULL || order == NULL) {
        free(first);
        free(fill);
        free(order);
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < l->nops; i++) {
        if (keep(&l->ops[i])) {
            first[l->ops[i].wave + 1]++;
        }
    }
    for (size_t w = 0; w < nw; w++) {
        first[w + 1] += first[w];
    }
    memcpy(fill, first, (nw + 1) * sizeof(*fill));
    for (size_t i = 0; i < l->nops; i++) {
        if (keep(&l->ops[i])) {
            order[fill[l->ops[i].wave]++] = (long)i;
        }
    }
    free(fill);
    *order_p = order;
    *count_p = count;
    if (first_p != NULL) {
        *first_p = first;
        *nw_p = nw;
    } else {
        free(first);
    }
    return MFSDP_OK;
}

static void release_state(mfsdp_sched_ops_t *ops)
{
    if (ops->tp_state != NULL && ops->tp_state_free != NULL) {
        ops->tp_state_free(ops->tp_state);
    }
    ops->tp_state = NULL;
    ops->tp_owner = NULL;
    ops->tp_state_free = NULL;
}

void *mfsdp_sched_ops_state(mfsdp_sched_ops_t *ops, const void *owner)
{
    if (ops->tp_state != NULL && ops->tp_owner == owner) {
        return ops->tp_state;
    }
    release_state(ops);
    return NULL;
}

void mfsdp_sched_ops_keep(mfsdp_sched_ops_t *ops, const void *owner, void *state,
                          void (*free_fn)(void *state))
{
    release_state(ops);
    ops->tp_state = state;
    ops->tp_owner = owner;
    ops->tp_state_free = free_fn;
}

void mfsdp_sched_ops_free(mfsdp_sched_ops_t *ops)
{
    if (ops != NULL) {
        release_state(ops);
        free(ops->ops);
        ops->ops = NULL;
        ops->nops = 0;
    }
}
