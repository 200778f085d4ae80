/* SPDX-License-Identifier: Apache-2.0 */
/*
 * MPI transport. A group's op list is executed by one completion loop: every op without a
 * dependency is posted at once (so all owner segments and the sharded-tail collective are
 * in flight together), and each completion posts the ops that waited for it (chain
 * forwarding). Nonblocking collectives (MPI_Ibcast/Ireduce/Iallgather/Ireduce_scatter_block)
 * match by the order in which they are posted, so they are posted in (wave, list) order, which
 * every rank's op list shares: one whose dependencies completed waits for the collectives
 * before it in that order (the native reduce's chunks reuse ring slots, so their reduces wait
 * for earlier ones, and completions come in a different order on each rank).
 */
#include "transport/mpi.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/checks.h"

/* The control block after each shared arena (its own page): how far the rank got in the
 * context's gathers from shared arenas. An owner publishes `arrived` = k once everything it
 * wrote to its comm copies before its k-th such gather is written (release); a reader copies
 * from owner o in gather k once o's `arrived` >= k (acquire), then publishes `done` = k. An
 * owner about to write its comm copies again (its step, new weights, a load) waits until
 * every node peer's `done` reached its own count of such gathers (mfsdp_transport_ops_t
 * .quiesce). No barrier: a rank waits only for the owners it reads and, when it writes, for
 * the readers still copying. */
typedef struct shm_ctrl {
    uint64_t arrived;
    char pad0[56];
    uint64_t done;
    char pad1[56];
} shm_ctrl_t;

/* The owner arena in POSIX shared memory (mfsdp_transport_mpi_share): this rank's mapping and
 * its name until the node's ranks have mapped it, and theirs. */
typedef struct mpi_shm {
    void *map;        /* this rank's mapping: its arena (bytes > 0), then the control block */
    size_t bytes;     /* of the arena (0: none) */
    size_t mapped;    /* of the mapping */
    shm_ctrl_t *ctrl; /* this rank's, in its mapping; NULL: not shared (none, or anonymous) */
    uint64_t seq;     /* gathers from shared arenas this rank entered */
    int linked;       /* 1: `name` still exists (unlinked once the node's ranks mapped it) */
    char name[64];    /* "/mfsdp.<pid>.<n>" */
    MPI_Comm node;    /* the ranks sharing memory with this one, while sharing is on */
    int on;           /* 1: node peers read this rank's arena and it reads theirs */
    unsigned char *node_peer;     /* world entries: 1 for the other ranks of `node` */
    const char **peer;            /* world entries: a node peer's arena, mapped read-only */
    size_t *peer_bytes;           /* ... the mapping's bytes */
    const shm_ctrl_t **peer_ctrl; /* ... its control block */
} mpi_shm_t;

typedef struct mpi_transport {
    mfsdp_transport_t base;
    MPI_Comm comm;
    mpi_shm_t shm;
} mpi_transport_t;

/* What one op list needs on every run, built on its first run and kept in the op list
 * (mfsdp_sched_ops_t.tp_state) until the op list is freed: no allocation and no datatype
 * creation per call. */
typedef struct mpi_cache {
    size_t nops;
    MPI_Request *reqs;
    size_t *cfirst; /* children of op i (ops that wait for it): clist[cfirst[i], cfirst[i+1]) */
    long *clist;    /* ... in op-list order */
    int *ndeps;     /* ops each op waits for */
    int *pending;   /* per run: those not completed yet */
    int *idx;
    const void **srcv; /* world entries: the sources of a direct reduce's ordered sum */
    long *corder;      /* the collective ops in (wave, list) order: their posting order */
    size_t ncoll;
    unsigned char *ready; /* per run: op i's dependencies completed, not posted yet */
    MPI_Datatype tail;    /* one rank block's sharded-tail pieces in FSDP's all-gather output */
} mpi_cache_t;

/* Per-run state of the completion loop. */
typedef struct engine {
    mpi_transport_t *t;
    const mfsdp_xfer_t *x;
    mpi_cache_t *c;
    size_t active;
    size_t next_coll; /* corder index of the next collective to post */
} engine_t;

static mfsdp_status_t post(engine_t *e, long i);

static mfsdp_status_t post_children(engine_t *e, long i)
{
    for (size_t k = e->c->cfirst[i]; k < e->c->cfirst[i + 1]; k++) {
        long c = e->c->clist[k];
        if (--e->c->pending[c] == 0) {
            MFSDP_CHECK(post(e, c));
        }
    }
    return MFSDP_OK;
}

static void cache_free(void *state)
{
    mpi_cache_t *c = state;
    if (c == NULL) {
        return;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && c->tail != MPI_DATATYPE_NULL) { /* after MPI_Finalize MPI freed it */
        MPI_Type_free(&c->tail);
    }
    free(c->reqs);
    free(c->cfirst);
    free(c->clist);
    free(c->ndeps);
    free(c->pending);
    free(c->idx);
    free((void *)c->srcv);
    free(c->corder);
    free(c->ready);
    free(c);
}

static const mfsdp_transport_ops_t mpi_ops;

/* The op list's cache, built on its first run: requests, the dependency lists (children in
 * op-list order, so that they are posted in that order). */
static mfsdp_status_t cache_get(mfsdp_sched_ops_t *l, int world, mpi_cache_t **c_p)
{
    *c_p = mfsdp_sched_ops_state(l, &mpi_ops);
    if (*c_p != NULL) {
        return MFSDP_OK;
    }
    size_t n = l->nops;
    mfsdp_status_t st = MFSDP_OK;
    mpi_cache_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    c->nops = n;
    c->tail = MPI_DATATYPE_NULL;
    c->reqs = malloc(n * sizeof(*c->reqs));
    c->cfirst = calloc(n + 1, sizeof(*c->cfirst));
    c->ndeps = malloc(n * sizeof(*c->ndeps));
    c->pending = malloc(n * sizeof(*c->pending));
    c->idx = malloc(n * sizeof(*c->idx));
    c->srcv = malloc((size_t)world * sizeof(*c->srcv));
    c->ready = calloc(n, 1);
    if (c->reqs == NULL || c->cfirst == NULL || c->ndeps == NULL || c->pending == NULL ||
        c->idx == NULL || c->srcv == NULL || c->ready == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    for (size_t i = 0; i < n; i++) {
        c->reqs[i] = MPI_REQUEST_NULL;
    }
    size_t edges = 0;
    for (size_t i = 0; i < n; i++) {
        const mfsdp_sched_op_t *op = &l->ops[i];
        c->ndeps[i] = op->dep >= 0 ? (op->ndep > 1 ? op->ndep : 1) : 0;
        if (op->dep >= 0 && (size_t)op->dep + (size_t)c->ndeps[i] > i) {
            MFSDP_WARN("op %zu waits for ops %ld..%ld, not all before it", i, op->dep,
                       op->dep + c->ndeps[i] - 1);
            st = MFSDP_ERR_INTERNAL;
            goto err;
        }
        for (int q = 0; q < c->ndeps[i]; q++) {
            c->cfirst[op->dep + q + 1]++;
        }
        edges += (size_t)c->ndeps[i];
    }
    for (size_t i = 0; i < n; i++) {
        c->cfirst[i + 1] += c->cfirst[i];
    }
    c->clist = malloc((edges + 1) * sizeof(*c->clist));
    if (c->clist == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    for (size_t i = 0; i < n; i++) {
        c->pending[i] = 0; /* fill position per parent while building */
    }
    for (size_t k = 0; k < n; k++) {
        for (int q = 0; q < c->ndeps[k]; q++) {
            size_t d = (size_t)l->ops[k].dep + (size_t)q;
            c->clist[c->cfirst[d] + (size_t)c->pending[d]++] = (long)k;
        }
    }
    /* The collectives' posting order: by wave, list order within a wave. */
    MFSDP_CHECK_GOTO(
        mfsdp_sched_wave_order(l, mfsdp_sched_op_is_collective, &c->corder, &c->ncoll, NULL, NULL),
        st, err);
    mfsdp_sched_ops_keep(l, &mpi_ops, c, cache_free);
    *c_p = c;
    return MFSDP_OK;
err:
    cache_free(c);
    return st;
}

/* One rank block's sharded-tail pieces inside FSDP's all-gather buffer as a datatype: the
 * pieces at their offsets, extent one rank block, so that count 1 per rank addresses block
 * r at r * S. Built once per op list (cached). */
static mfsdp_status_t tail_block_type(const mfsdp_xfer_t *x, mpi_cache_t *c, MPI_Datatype *type_p)
{
    if (c->tail != MPI_DATATYPE_NULL) {
        *type_p = c->tail;
        return MFSDP_OK;
    }
    const mfsdp_group_sched_t *gs = x->gs;
    const mfsdp_buffer_layout_t *b = &gs->layout->ag;
    int *len = malloc((gs->ntail + 1) * sizeof(*len));
    MPI_Aint *disp = malloc((gs->ntail + 1) * sizeof(*disp));
    mfsdp_status_t st = MFSDP_OK;
    int nb = 0;
    if (len == NULL || disp == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        const mfsdp_param_layout_t *pe = &b->entries[gs->tail[k]];
        size_t n = pe->s_bytes;
        if (n > INT_MAX || b->bytes > (size_t)INT64_MAX) {
            st = MFSDP_ERR_UNSUPPORTED;
            goto out;
        }
        len[nb] = (int)n;
        disp[nb] = (MPI_Aint)pe->o_bytes;
        nb++;
    }
    MPI_Datatype pieces, block;
    int rc = MPI_Type_create_hindexed(nb, len, disp, MPI_BYTE, &pieces);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Type_create_resized(pieces, 0, (MPI_Aint)b->bytes, &block);
        MPI_Type_free(&pieces);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Type_commit(&block);
            if (rc != MPI_SUCCESS) {
                MPI_Type_free(&block);
            }
        }
    }
    if (rc != MPI_SUCCESS) {
        MFSDP_WARN("building the sharded-tail datatype of group %zu failed (mpi error %d)",
                   gs->group, rc);
        st = MFSDP_ERR_TRANSPORT;
        goto out;
    }
    c->tail = block;
    *type_p = block;
out:
    free(len);
    free(disp);
    return st;
}

static mfsdp_status_t post_tail(engine_t *e, MPI_Request *req)
{
    const mfsdp_xfer_t *x = e->x;
    int gather = x->dir == MFSDP_SCHED_DIR_GATHER;
    if (x->tail_count > INT_MAX) {
        MFSDP_WARN("sharded tail of %zu bytes per rank: above INT_MAX", x->tail_count);
        return MFSDP_ERR_UNSUPPORTED;
    }
    MFSDP_CHECK(mfsdp_xfer_check_tail(x));
    int cnt = (int)x->tail_count;
    int rc;
    if (!gather) {
        /* The contributions in FSDP's reduce dtype; the caller sums them in rank order. */
        rc = MPI_Ialltoall(x->tail_send, cnt, MPI_BYTE, x->tail_recv, cnt, MPI_BYTE, e->t->comm,
                           req);
    } else {
        /* In place in the tail pieces of FSDP's all-gather output (this rank's are in its
         * block): no staging. */
        MPI_Datatype t;
        MFSDP_CHECK(tail_block_type(x, e->c, &t));
        rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, x->ag_out, 1, t, e->t->comm, req);
    }
    if (rc != MPI_SUCCESS) {
        MFSDP_WARN("posting the sharded-tail collective of group %zu failed (mpi error %d)",
                   x->gs->group, rc);
        return MFSDP_ERR_TRANSPORT;
    }
    return MFSDP_OK;
}

/* Receive (or, not being the root, broadcast) a run of an owned tensor straight into FSDP's
 * all-gather output: the schedule cuts gather ops at its rank blocks, so every run is
 * contiguous there and travels as plain bytes (MPI libraries move a contiguous receive with
 * one copy, a derived datatype often through a pack buffer: 3x slower in Open MPI 4.1). */
static mfsdp_status_t post_into_fsdp(engine_t *e, long i, MPI_Request *req)
{
    const mfsdp_xfer_t *x = e->x;
    const mfsdp_sched_op_t *op = &x->ops->ops[i];
    size_t run;
    char *p = mfsdp_xfer_ag_at(x, op->seg, op->off, &run);
    if (p == NULL || op->len > run || op->len > INT_MAX) {
        MFSDP_WARN("segment %u: op %ld crosses a rank block of the all-gather output", op->seg, i);
        return MFSDP_ERR_INTERNAL;
    }
    int rc;
    if (op->kind == MFSDP_SCHED_RECV) {
        rc = MPI_Irecv(p, (int)op->len, MPI_BYTE, op->peer, op->tag, e->t->comm, req);
    } else {
        rc = MPI_Ibcast(p, (int)op->len, MPI_BYTE, op->peer, e->t->comm, req);
    }
    if (rc != MPI_SUCCESS) {
        MFSDP_WARN("posting segment %u into the all-gather output failed (mpi error %d)", op->seg,
                   rc);
        return MFSDP_ERR_TRANSPORT;
    }
    return MFSDP_OK;
}

/* A direct gather op between two ranks of a node that share their arenas (x->peer_src):
 * the receiver copies the run from the owner's arena into FSDP's output itself, the sender
 * has nothing to do. 1: op i was such an op and is complete. */
static mfsdp_status_t shm_gather_op(engine_t *e, long i, int *done_p)
{
    const mfsdp_xfer_t *x = e->x;
    const mfsdp_sched_op_t *op = &x->ops->ops[i];
    *done_p = 0;
    if (x->peer_src == NULL || x->dir != MFSDP_SCHED_DIR_GATHER) {
        return MFSDP_OK;
    }
    if (op->kind == MFSDP_SCHED_SEND && op->buf == MFSDP_BUF_SRC && e->t->shm.node_peer[op->peer]) {
        *done_p = 1; /* the peer reads it from this rank's arena */
        return MFSDP_OK;
    }
    const char *src = x->peer_src[op->seg];
    if (op->kind != MFSDP_SCHED_RECV || src == NULL || x->bufs[op->seg].stage != NULL) {
        return MFSDP_OK;
    }
    size_t run;
    char *dst = mfsdp_xfer_ag_at(x, op->seg, op->off, &run);
    if (dst == NULL || op->len > run) {
        MFSDP_WARN("segment %u: op %ld crosses a rank block of the all-gather output", op->seg, i);
        return MFSDP_ERR_INTERNAL;
    }
    /* The source was computed from the owner's arena layout: it must lie in its mapping. */
    const mpi_shm_t *m = &e->t->shm;
    int o = x->gs->segs[op->seg].owner;
    const char *lo = m->peer[o], *hi = lo != NULL ? lo + m->peer_bytes[o] : NULL;
    if (lo == NULL || src + op->boff < lo || op->len > (size_t)(hi - (src + op->boff))) {
        MFSDP_WARN("segment %u: op %ld would read outside rank %d's shared arena", op->seg, i, o);
        return MFSDP_ERR_INTERNAL;
    }
    MFSDP_CHECK(x->exec->ops->copy(x->exec, dst, src + op->boff, op->len));
    *done_p = 1;
    return MFSDP_OK;
}

/* Post op i (or run it, for a local op) and, for local ops, what waited for it. */
static mfsdp_status_t post_now(engine_t *e, long i)
{
    const mfsdp_xfer_t *x = e->x;
    const mfsdp_sched_op_t *op = &x->ops->ops[i];
    MPI_Comm comm = e->t->comm;
    int rank = e->t->base.rank;
    MPI_Request *req = &e->c->reqs[i];
    size_t elt;
    char *p;
    int done;

    MFSDP_CHECK(shm_gather_op(e, i, &done));
    if (done) {
        return post_children(e, i);
    }

    if (op->kind == MFSDP_SCHED_TAIL) {
        MFSDP_CHECK(post_tail(e, req));
        e->active++;
        return MFSDP_OK;
    }
    if (mfsdp_sched_op_is_local(op)) {
        MFSDP_CHECK(mfsdp_xfer_local(x, op, rank, e->t->base.world, e->c->srcv));
        return post_children(e, i);
    }
    if (op->combine) {
        MFSDP_CHECK(mfsdp_xfer_prepare(x, op));
    }
    if (x->dir == MFSDP_SCHED_DIR_GATHER && op->buf == MFSDP_BUF_STAGE &&
        x->bufs[op->seg].stage == NULL && x->ag_out != NULL &&
        (op->kind == MFSDP_SCHED_RECV || op->kind == MFSDP_SCHED_BCAST)) {
        MFSDP_CHECK(post_into_fsdp(e, i, req));
        e->active++;
        return MFSDP_OK;
    }
    p = mfsdp_xfer_buf(x, op, &elt);
    if (p == NULL) {
        MFSDP_WARN("segment %u: no buffer bound for op %ld", op->seg, i);
        return MFSDP_ERR_INTERNAL;
    }
    p += op->boff * elt;
    size_t bytes = op->len * elt;
    if (bytes > INT_MAX) {
        return MFSDP_ERR_INTERNAL; /* the schedule splits at MFSDP_SCHED_MAX_MSG */
    }
    switch (op->kind) {
    case MFSDP_SCHED_SEND:
        MFSDP_MPI_CHECK(MPI_Isend(p, (int)bytes, MPI_BYTE, op->peer, op->tag, comm, req));
        break;
    case MFSDP_SCHED_RECV:
        MFSDP_MPI_CHECK(MPI_Irecv(p, (int)bytes, MPI_BYTE, op->peer, op->tag, comm, req));
        break;
    case MFSDP_SCHED_BCAST:
        MFSDP_MPI_CHECK(MPI_Ibcast(p, (int)bytes, MPI_BYTE, op->peer, comm, req));
        break;
    case MFSDP_SCHED_REDUCE: {
        float *fin = NULL;
        if (rank == op->peer) {
            fin = x->bufs[op->seg].final;
            if (fin == NULL) {
                return MFSDP_ERR_INTERNAL;
            }
            fin += op->boff;
        }
        MFSDP_MPI_CHECK(MPI_Ireduce(p, fin, (int)op->len, MPI_FLOAT, MPI_SUM, op->peer, comm, req));
        break;
    }
    default:
        return MFSDP_ERR_INTERNAL;
    }
    e->active++;
    return MFSDP_OK;
}

/* Op i's dependencies completed: post it, unless it is a collective that earlier ones in the
 * posting order (corder) still wait for; then every collective whose turn came. */
static mfsdp_status_t post(engine_t *e, long i)
{
    if (!mfsdp_sched_op_is_collective(&e->x->ops->ops[i])) {
        return post_now(e, i);
    }
    e->c->ready[i] = 1;
    while (e->next_coll < e->c->ncoll && e->c->ready[e->c->corder[e->next_coll]]) {
        long k = e->c->corder[e->next_coll++];
        e->c->ready[k] = 0;
        MFSDP_CHECK(post_now(e, k));
    }
    return MFSDP_OK;
}

/* Wait until *v >= want (another process's counter): spin briefly, then yield the core
 * (ranks may outnumber cores). */
static void wait_counter(const uint64_t *v, uint64_t want)
{
    for (unsigned spin = 0; __atomic_load_n(v, __ATOMIC_ACQUIRE) < want; spin++) {
        if (spin >= 256) {
            sched_yield();
        }
    }
}

/* Enter a gather from shared arenas: publish the arrival, then wait for the owners this rank
 * copies from to have arrived too (their writes before it are then visible). */
static mfsdp_status_t shm_enter(mpi_transport_t *t, const mfsdp_xfer_t *x)
{
    mpi_shm_t *m = &t->shm;
    if (!m->on) {
        MFSDP_WARN("group %zu: a gather from shared arenas, but sharing is off", x->gs->group);
        return MFSDP_ERR_INTERNAL;
    }
    uint64_t k = ++m->seq;
    __atomic_store_n(&m->ctrl->arrived, k, __ATOMIC_RELEASE);
    for (size_t i = 0; i < x->gs->nsegs; i++) {
        int o = x->gs->segs[i].owner;
        if (x->peer_src[i] != NULL) {
            wait_counter(&m->peer_ctrl[o]->arrived, k);
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t mpi_quiesce(mfsdp_transport_t *tb)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    mpi_shm_t *m = &t->shm;
    for (int r = 0; m->on && r < t->base.world; r++) {
        if (m->node_peer[r]) {
            wait_counter(&m->peer_ctrl[r]->done, m->seq);
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t run_ops(mpi_transport_t *t, const mfsdp_xfer_t *x);

static mfsdp_status_t mpi_run(mfsdp_transport_t *tb, const mfsdp_xfer_t *x)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(x != NULL && x->ops != NULL && x->gs != NULL);
    if (x->peer_src == NULL) {
        return run_ops(t, x);
    }
    MFSDP_CHECK(shm_enter(t, x));
    mfsdp_status_t st = run_ops(t, x);
    /* Published even after a failure (this rank's, logged): a writer must not wait forever
     * for copies that will not happen. */
    __atomic_store_n(&t->shm.ctrl->done, t->shm.seq, __ATOMIC_RELEASE);
    return st;
}

static mfsdp_status_t run_ops(mpi_transport_t *t, const mfsdp_xfer_t *x)
{
    size_t n = x->ops->nops;
    if (n == 0) {
        return x->overlap != NULL ? x->overlap(x->overlap_arg) : MFSDP_OK;
    }
    if (n > INT_MAX) {
        return MFSDP_ERR_UNSUPPORTED;
    }
    mfsdp_status_t st = MFSDP_OK;
    engine_t e = {.t = t, .x = x};
    MFSDP_CHECK(cache_get(x->ops, t->base.world, &e.c));
    MPI_Request *reqs = e.c->reqs; /* all MPI_REQUEST_NULL between runs */
    memcpy(e.c->pending, e.c->ndeps, n * sizeof(*e.c->pending));
    memset(e.c->ready, 0, n); /* a failed run may have left some set */
    for (size_t i = 0; i < n; i++) {
        if (x->ops->ops[i].dep == -1) {
            MFSDP_CHECK_GOTO(post(&e, (long)i), st, out_wait);
        }
    }
    if (x->overlap != NULL) {
        MFSDP_CHECK_GOTO(x->overlap(x->overlap_arg), st, out_wait);
    }
    while (e.active > 0) {
        int outcount = 0;
        int rc = MPI_Waitsome((int)n, reqs, &outcount, e.c->idx, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS || outcount == MPI_UNDEFINED) {
            MFSDP_WARN("waiting for the %zu ops of group %zu failed (mpi error %d)", n,
                       x->gs->group, rc);
            st = rc != MPI_SUCCESS ? MFSDP_ERR_TRANSPORT : MFSDP_ERR_INTERNAL;
            goto out_cancel;
        }
        for (int k = 0; k < outcount; k++) {
            e.active--;
            MFSDP_CHECK_GOTO(post_children(&e, e.c->idx[k]), st, out_wait);
        }
    }
    if (e.next_coll != e.c->ncoll) {
        MFSDP_WARN("group %zu: %zu of %zu collectives were never posted", x->gs->group,
                   e.c->ncoll - e.next_coll, e.c->ncoll);
        st = MFSDP_ERR_INTERNAL;
        goto out_wait;
    }
    for (size_t i = 0; i < n; i++) {
        if (x->ops->ops[i].dep == MFSDP_SCHED_DEP_ALL) {
            MFSDP_CHECK_GOTO(post(&e, (long)i), st, out_wait);
        }
    }
    return MFSDP_OK;
out_cancel:
    /* A failed wait leaves requests posted: cancel the ones still pending (a peer's matching
     * send is then not left waiting on this rank forever) and complete every one. */
    for (size_t i = 0; i < n; i++) {
        mfsdp_sched_kind_t k = x->ops->ops[i].kind;
        if (reqs[i] != MPI_REQUEST_NULL && (k == MFSDP_SCHED_SEND || k == MFSDP_SCHED_RECV)) {
            MPI_Cancel(&reqs[i]); /* only point-to-point requests can be cancelled */
        }
    }
out_wait:
    /* Do not return while MPI still writes into the caller's buffers; completion also
     * leaves every cached request MPI_REQUEST_NULL for the next run. */
    MPI_Waitall((int)n, reqs, MPI_STATUSES_IGNORE);
    return st;
}

static mfsdp_status_t mpi_p2p(mfsdp_transport_t *tb, const mfsdp_p2p_t *v, size_t n)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(n == 0 || v != NULL);
    if (n == 0) {
        return MFSDP_OK;
    }
    if (n > INT_MAX) {
        return MFSDP_ERR_UNSUPPORTED;
    }
    MPI_Request *reqs = malloc(n * sizeof(*reqs));
    if (reqs == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mfsdp_status_t st = MFSDP_OK;
    size_t posted = 0;
    for (; posted < n; posted++) {
        const mfsdp_p2p_t *p = &v[posted];
        int rc;
        if (p->bytes > INT_MAX) {
            st = MFSDP_ERR_UNSUPPORTED;
            break;
        }
        if (p->send) {
            rc =
                MPI_Isend(p->buf, (int)p->bytes, MPI_BYTE, p->peer, p->tag, t->comm, &reqs[posted]);
        } else {
            rc =
                MPI_Irecv(p->buf, (int)p->bytes, MPI_BYTE, p->peer, p->tag, t->comm, &reqs[posted]);
        }
        if (rc != MPI_SUCCESS) {
            MFSDP_WARN("point-to-point %s of %zu bytes with rank %d failed (mpi error %d)",
                       p->send ? "send" : "receive", p->bytes, p->peer, rc);
            st = MFSDP_ERR_TRANSPORT;
            break;
        }
    }
    if (MPI_Waitall((int)posted, reqs, MPI_STATUSES_IGNORE) != MPI_SUCCESS && st == MFSDP_OK) {
        MFSDP_WARN("waiting for %zu point-to-point transfers failed", posted);
        st = MFSDP_ERR_TRANSPORT;
    }
    free(reqs);
    return st;
}

static mfsdp_status_t mpi_allreduce_sum(mfsdp_transport_t *tb, double *value)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(value != NULL);
    MFSDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, value, 1, MPI_DOUBLE, MPI_SUM, t->comm));
    return MFSDP_OK;
}

static mfsdp_status_t mpi_allreduce_f32(mfsdp_transport_t *tb, float *buf, size_t n)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(buf != NULL || n == 0);
    /* In pieces that fit MPI's int count. */
    for (size_t off = 0; off < n; off += (size_t)INT_MAX) {
        size_t k = n - off < (size_t)INT_MAX ? n - off : (size_t)INT_MAX;
        MFSDP_MPI_CHECK(
            MPI_Allreduce(MPI_IN_PLACE, buf + off, (int)k, MPI_FLOAT, MPI_SUM, t->comm));
    }
    return MFSDP_OK;
}

static mfsdp_status_t mpi_allreduce_u64(mfsdp_transport_t *tb, uint64_t *buf, size_t n, int is_max)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(buf != NULL && n <= INT_MAX);
    MFSDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_UINT64_T,
                                  is_max ? MPI_MAX : MPI_MIN, t->comm));
    return MFSDP_OK;
}

static mfsdp_status_t mpi_allgather_bytes(mfsdp_transport_t *tb, const void *mine, size_t bytes,
                                          void *all)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    MFSDP_CHECK_ARG(mine != NULL && all != NULL && bytes <= INT_MAX);
    MFSDP_MPI_CHECK(MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, t->comm));
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Owner arenas in shared memory
 */

/* Where an arena of bytes ends and its control block's page starts. */
static mfsdp_status_t ctrl_offset(size_t bytes, size_t *off_p)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (mfsdp_add_overflow(bytes, page - 1, off_p)) {
        return MFSDP_ERR_OVERFLOW;
    }
    *off_p &= ~(page - 1);
    return MFSDP_OK;
}

/* This rank's shared-memory object: bytes of arena (0: none, the control block only), then
 * the control block's page; mapped read-write at *p_p. 0: done; an errno value on failure with
 * *what naming the call (nothing left behind). */
static int shm_create(mpi_shm_t *m, size_t bytes, size_t *mapped_p, void **p_p, const char **what)
{
    static unsigned seq; /* names of this process's objects */
    size_t off, mapped;
    *what = "size";
    if (ctrl_offset(bytes, &off) != MFSDP_OK ||
        mfsdp_add_overflow(off, (size_t)sysconf(_SC_PAGESIZE), &mapped)) {
        return EOVERFLOW;
    }
    snprintf(m->name, sizeof(m->name), "/mfsdp.%ld.%u", (long)getpid(),
             __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED));
    *what = "shm_open";
    int fd = shm_open(m->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        return errno;
    }
    /* Reserve the pages now: tmpfs would otherwise fail a later first touch with SIGBUS when
     * /dev/shm is full. */
    *what = "ftruncate";
    int err = ftruncate(fd, (off_t)mapped) == 0 ? 0 : errno;
    if (err == 0) {
        *what = "posix_fallocate";
        err = posix_fallocate(fd, 0, (off_t)mapped);
    }
    void *p = MAP_FAILED;
    if (err == 0) {
        *what = "mmap";
        p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        err = p == MAP_FAILED ? errno : 0;
    }
    close(fd);
    if (err != 0) {
        shm_unlink(m->name);
        return err;
    }
    m->linked = 1;
    m->ctrl = (shm_ctrl_t *)((char *)p + off); /* zeroed: nothing arrived, nothing done */
    *mapped_p = mapped;
    *p_p = p;
    return 0;
}

mfsdp_status_t mfsdp_transport_mpi_arena_alloc(void *arg, size_t bytes, void **ptr_p)
{
    mpi_transport_t *t = arg;
    mpi_shm_t *m = &t->shm;
    MFSDP_CHECK_ARG(t != NULL && ptr_p != NULL && bytes != 0 && m->map == NULL);
    const char *what;
    size_t mapped = bytes;
    void *p = MAP_FAILED;
    int err = shm_create(m, bytes, &mapped, &p, &what);
    if (err != 0) {
        MFSDP_WARN("the %zu-byte owner arena cannot be put in shared memory (%s %s: %s): an "
                   "anonymous mapping instead; all-gathers on this node use messages (a "
                   "larger /dev/shm helps; MFSDP_SHM=0 silences this)",
                   bytes, what, m->name, strerror(err));
        mapped = bytes;
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            MFSDP_WARN("cannot map the %zu-byte owner arena: %m", bytes);
            return MFSDP_ERR_NO_MEMORY;
        }
    }
    m->map = p;
    m->bytes = bytes;
    m->mapped = mapped;
    *ptr_p = p;
    return MFSDP_OK;
}

/* Unmap this rank's object (arena and control block), removing its name if still there. */
static void shm_unmap_own(mpi_shm_t *m)
{
    if (m->map != NULL) {
        munmap(m->map, m->mapped);
    }
    if (m->linked) {
        shm_unlink(m->name);
        m->linked = 0;
    }
    m->map = NULL;
    m->ctrl = NULL;
    m->bytes = 0;
    m->mapped = 0;
}

void mfsdp_transport_mpi_arena_free(void *arg, void *ptr)
{
    mpi_transport_t *t = arg;
    if (t != NULL && ptr != NULL && ptr == t->shm.map && t->shm.bytes != 0) {
        shm_unmap_own(&t->shm);
    }
}

/* Unmap the peers' arenas and leave the node communicator: sharing off. */
static void shm_stop(mpi_transport_t *t)
{
    mpi_shm_t *m = &t->shm;
    int world = t->base.world;
    for (int r = 0; m->peer != NULL && r < world; r++) {
        if (m->peer[r] != NULL) {
            munmap((void *)m->peer[r], m->peer_bytes[r]);
        }
    }
    free(m->peer);
    free(m->peer_bytes);
    free(m->peer_ctrl);
    free(m->node_peer);
    m->peer = NULL;
    m->peer_bytes = NULL;
    m->peer_ctrl = NULL;
    m->node_peer = NULL;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && m->node != MPI_COMM_NULL) {
        MPI_Comm_free(&m->node);
    }
    m->node = MPI_COMM_NULL;
    m->on = 0;
}

/* What a rank tells the ranks of its node about its arena. */
typedef struct shm_card {
    int64_t rank; /* in the transport's communicator */
    int64_t shared;
    uint64_t bytes;  /* the arena's */
    uint64_t mapped; /* the object's: the arena, then the control block's page */
    char name[64];
} shm_card_t;

mfsdp_status_t mfsdp_transport_mpi_share(mfsdp_transport_t *tb, int want,
                                         const char *const **peer_p)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    mpi_shm_t *m = &t->shm;
    MFSDP_CHECK_ARG(t != NULL && peer_p != NULL && !m->on);
    *peer_p = NULL;
    const int world = t->base.world;
    /* Every rank decides alike: on only where every rank wants it and has its arena (and the
     * control block after it) shared. */
    if (want && world > 1 && m->map == NULL) {
        /* No arena (it owns nothing, stages nothing): a control block alone, so that it can
         * count its gathers like every rank. */
        const char *what;
        int err = shm_create(m, 0, &m->mapped, &m->map, &what);
        if (err != 0) {
            MFSDP_WARN("the owner arenas' control block cannot be put in shared memory (%s %s: "
                       "%s); all-gathers on this node use messages",
                       what, m->name, strerror(err));
        }
    }
    int mine = want && m->ctrl != NULL && world > 1, all = 0;
    MFSDP_MPI_CHECK(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, t->comm));
    if (!all) {
        if (m->linked) {
            shm_unlink(m->name);
            m->linked = 0;
        }
        return MFSDP_OK;
    }
    MFSDP_MPI_CHECK(
        MPI_Comm_split_type(t->comm, MPI_COMM_TYPE_SHARED, t->base.rank, MPI_INFO_NULL, &m->node));
    int nn = 0;
    MFSDP_MPI_CHECK(MPI_Comm_size(m->node, &nn));
    shm_card_t card = {
        .rank = t->base.rank, .shared = m->ctrl != NULL, .bytes = m->bytes, .mapped = m->mapped};
    memcpy(card.name, m->name, sizeof(card.name));
    shm_card_t *cards = calloc((size_t)nn, sizeof(*cards));
    m->node_peer = calloc((size_t)world, 1);
    m->peer = calloc((size_t)world, sizeof(*m->peer));
    m->peer_bytes = calloc((size_t)world, sizeof(*m->peer_bytes));
    m->peer_ctrl = calloc((size_t)world, sizeof(*m->peer_ctrl));
    int ok = cards != NULL && m->node_peer != NULL && m->peer != NULL && m->peer_bytes != NULL &&
             m->peer_ctrl != NULL;
    if (!ok) {
        MFSDP_WARN("sharing owner arenas: out of memory; all-gathers use messages");
    }
    /* The node's ranks exchange their cards only if every one of them can take them (a
     * collective with another count on one rank would be an MPI error). */
    int node_ok = 0;
    int rc = MPI_Allreduce(&ok, &node_ok, 1, MPI_INT, MPI_MIN, m->node);
    ok = rc == MPI_SUCCESS && node_ok;
    if (ok) {
        rc = MPI_Allgather(&card, (int)sizeof(card), MPI_BYTE, cards, (int)sizeof(card), MPI_BYTE,
                           m->node);
        if (rc != MPI_SUCCESS) {
            MFSDP_WARN("sharing owner arenas: MPI_Allgather failed (mpi error %d)", rc);
            ok = 0;
        }
    }
    for (int k = 0; ok && k < nn; k++) {
        const shm_card_t *c = &cards[k];
        int r = (int)c->rank;
        if (r < 0 || r >= world) {
            ok = 0;
            break;
        }
        if (r == t->base.rank) {
            continue;
        }
        m->node_peer[r] = 1;
        size_t off = 0;
        if (!c->shared || ctrl_offset((size_t)c->bytes, &off) != MFSDP_OK ||
            off + sizeof(shm_ctrl_t) > (size_t)c->mapped) {
            /* Every rank agreed above that its object is shared: a card that says otherwise
             * or is too small for its control block is not one this code wrote. */
            MFSDP_WARN("rank %d's shared owner arena is not usable (shared %d, %zu bytes); "
                       "all-gathers use messages",
                       r, (int)c->shared, (size_t)c->mapped);
            ok = 0;
            break;
        }
        char name[sizeof(c->name)];
        memcpy(name, c->name, sizeof(name));
        name[sizeof(name) - 1] = '\0';
        int fd = shm_open(name, O_RDONLY, 0);
        void *p = MAP_FAILED;
        if (fd >= 0) {
            p = mmap(NULL, (size_t)c->mapped, PROT_READ, MAP_SHARED, fd, 0);
            close(fd);
        }
        if (p == MAP_FAILED) {
            MFSDP_WARN("cannot map rank %d's owner arena %s (%zu bytes): %m; all-gathers use "
                       "messages",
                       r, name, (size_t)c->mapped);
            ok = 0;
            break;
        }
        m->peer[r] = p;
        m->peer_bytes[r] = (size_t)c->mapped;
        m->peer_ctrl[r] = (const shm_ctrl_t *)((const char *)p + off);
    }
    free(cards);
    /* Every rank of the node mapped what it could: the names can go (the mappings stay, and
     * nothing is left in /dev/shm if a rank dies later). */
    int rc2 = MPI_Barrier(m->node);
    if (m->linked) {
        shm_unlink(m->name);
        m->linked = 0;
    }
    int got = ok && rc2 == MPI_SUCCESS;
    MFSDP_MPI_CHECK(MPI_Allreduce(&got, &all, 1, MPI_INT, MPI_MIN, t->comm));
    if (!all) {
        shm_stop(t);
        return MFSDP_OK;
    }
    m->on = nn > 1;
    if (!m->on) {
        shm_stop(t);
        return MFSDP_OK;
    }
    MFSDP_INFO(TRANSPORT, "rank %d: owner arenas shared with the %d other ranks of its node",
               t->base.rank, nn - 1);
    *peer_p = m->peer;
    return MFSDP_OK;
}

static mfsdp_status_t mpi_set_stream(mfsdp_transport_t *tb, void *stream)
{
    (void)tb;
    (void)stream; /* host memory: every operation completes before its call returns */
    return MFSDP_OK;
}

static void mpi_destroy(mfsdp_transport_t *tb)
{
    mpi_transport_t *t = (mpi_transport_t *)tb;
    if (t == NULL) {
        return;
    }
    shm_stop(t);
    shm_unmap_own(&t->shm); /* a control block alone, or an arena that outlived its context */
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && t->comm != MPI_COMM_NULL) {
        MPI_Comm_free(&t->comm);
    }
    free(t);
}

static const mfsdp_transport_ops_t mpi_ops = {
    .name = "mpi",
    .run = mpi_run,
    .p2p = mpi_p2p,
    .allreduce_sum = mpi_allreduce_sum,
    .allreduce_f32 = mpi_allreduce_f32,
    .allreduce_u64 = mpi_allreduce_u64,
    .allgather_bytes = mpi_allgather_bytes,
    .set_stream = mpi_set_stream,
    .quiesce = mpi_quiesce,
    .destroy = mpi_destroy,
};

mfsdp_status_t mfsdp_transport_mpi_create(MPI_Comm comm, mfsdp_transport_t **t_p)
{
    MFSDP_CHECK_ARG(t_p != NULL && comm != MPI_COMM_NULL);
    mpi_transport_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    t->comm = MPI_COMM_NULL;
    t->shm.node = MPI_COMM_NULL;
    int rc = MPI_Comm_dup(comm, &t->comm);
    if (rc != MPI_SUCCESS) {
        MFSDP_WARN("MPI_Comm_dup failed (mpi error %d)", rc);
        free(t);
        return MFSDP_ERR_TRANSPORT;
    }
    MPI_Comm_rank(t->comm, &t->base.rank);
    MPI_Comm_size(t->comm, &t->base.world);
    t->base.ops = &mpi_ops;
    *t_p = &t->base;
    return MFSDP_OK;
}
