/* SPDX-License-Identifier: Apache-2.0 */
/*
 * NCCL transport (transport/nccl.h). An op list runs wave by wave: the communication of a
 * wave is one ncclGroupStart/End (its operations run concurrently, so none may depend on
 * another: the schedule puts dependent ones in later waves), the executor's local work is
 * enqueued between waves on the same stream. Nothing waits for the device here except the
 * staging of host values (context creation, the clipping scalar).
 */
#include "transport/nccl.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/checks.h"

#define NCCL_TIMEOUT_DEFAULT 600.0

typedef struct nccl_transport {
    mfsdp_transport_t base;
    mfsdp_nccl_api_t api;
    ncclComm_t comm;
    void *stream; /* cudaStream_t of the intercepted call */
    double timeout;
    mfsdp_exec_t *stage_exec; /* device memory: stages host values */
    void *stage;
    size_t stage_bytes;
} nccl_transport_t;

static const mfsdp_transport_ops_t nccl_ops;

/* ---------------------------------------------------------------------------------------
 * The function table
 */

static mfsdp_nccl_api_t g_api;
static mfsdp_status_t g_api_status = MFSDP_OK;
static pthread_once_t g_api_once = PTHREAD_ONCE_INIT;

/* 1 when fn is defined in the object that holds this code (an interposer built with mfsdp
 * overrides ncclX: calling that definition would come back here). */
static int ours(void *fn)
{
    Dl_info a, b;
    if (dladdr(fn, &a) == 0 || dladdr((void *)&mfsdp_nccl_api_get, &b) == 0) {
        return 0;
    }
    return a.dli_fbase == b.dli_fbase;
}

/* The loaded objects' paths (the main program excluded: it is in the global scope). */
typedef struct loaded {
    char **paths;
    size_t n, cap;
} loaded_t;

static int loaded_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    loaded_t *l = arg;
    if (info->dlpi_name == NULL || info->dlpi_name[0] == '\0') {
        return 0;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        char **p = realloc(l->paths, cap * sizeof(*p));
        if (p == NULL) {
            return 1;
        }
        l->paths = p;
        l->cap = cap;
    }
    l->paths[l->n] = strdup(info->dlpi_name);
    l->n += l->paths[l->n] != NULL;
    return 0;
}

/* sym in the global scope, else in a loaded object or its dependencies, skipping definitions
 * in mfsdp's own object when not_ours. The second search finds a library loaded with
 * RTLD_LOCAL, which dlsym(RTLD_DEFAULT) never sees: PyTorch's pip wheels load libnccl that way
 * (ctypes.CDLL in torch/__init__.py, then libtorch_cuda's DT_NEEDED under an RTLD_LOCAL
 * import), while an LD_PRELOADed interposer still catches libtorch_cuda's calls. */
void *mfsdp_nccl_sym(const char *sym, int not_ours)
{
    void *f = dlsym(RTLD_DEFAULT, sym);
    if (f != NULL && !(not_ours && ours(f))) {
        return f;
    }
    loaded_t l = {NULL, 0, 0};
    dl_iterate_phdr(loaded_cb, &l); /* dlopen is not called under the loader's lock */
    void *found = NULL;
    for (size_t i = 0; i < l.n; i++) {
        if (found == NULL) {
            void *h = dlopen(l.paths[i], RTLD_LAZY | RTLD_NOLOAD);
            void *g = h != NULL ? dlsym(h, sym) : NULL;
            if (g != NULL && !(not_ours && ours(g))) {
                found = g; /* the object stays loaded: the job holds it */
            }
            if (h != NULL) {
                dlclose(h); /* drops the reference RTLD_NOLOAD took */
            }
        }
        free(l.paths[i]);
    }
    free(l.paths);
    return found;
}

static void *resolve(const char *name)
{
    char sym[64];
    snprintf(sym, sizeof(sym), "pnccl%s", name);
    void *f = mfsdp_nccl_sym(sym, 0); /* an interposer never defines pncclX (a test may wrap it) */
    if (f != NULL) {
        return f;
    }
    snprintf(sym, sizeof(sym), "nccl%s", name);
    f = mfsdp_nccl_sym(sym, 1);
    if (f == NULL) {
        f = dlsym(RTLD_DEFAULT, sym); /* only ours: said below */
    }
    if (f != NULL && ours(f)) {
        MFSDP_WARN("nccl%s resolves to mfsdp's own definition (an interposer) and the loaded "
                   "NCCL exports no pnccl%s: it is not used",
                   name, name);
        return NULL;
    }
    return f;
}

/* Required entries of a table, in one place for resolution and for tables handed in. */
#define NCCL_REQUIRED(X)                                                                           \
    X(GroupStart)                                                                                  \
    X(GroupEnd)                                                                                    \
    X(Send)                                                                                        \
    X(Recv)                                                                                        \
    X(Broadcast)                                                                                   \
    X(Reduce)                                                                                      \
    X(AllReduce)                                                                                   \
    X(AllGather)                                                                                   \
    X(CommCount)                                                                                   \
    X(CommUserRank)                                                                                \
    X(CommCuDevice)                                                                                \
    X(CommGetAsyncError)                                                                           \
    X(GetErrorString)
#define NCCL_OPTIONAL(X)                                                                           \
    X(GetLastError)                                                                                \
    X(MemAlloc)                                                                                    \
    X(MemFree)                                                                                     \
    X(CommRegister)                                                                                \
    X(CommDeregister)                                                                              \
    X(GetVersion)

/* The first required entry missing from api, or NULL. */
static const char *missing(const mfsdp_nccl_api_t *api)
{
#define NCCL_MISSING(fn)                                                                           \
    if (api->fn == NULL) {                                                                         \
        return "nccl" #fn;                                                                         \
    }
    NCCL_REQUIRED(NCCL_MISSING)
#undef NCCL_MISSING
    return NULL;
}

static void api_resolve(void)
{
    mfsdp_nccl_api_t a;
    memset(&a, 0, sizeof(a));
#define NCCL_RESOLVE(fn) a.fn = (__typeof__(a.fn))resolve(#fn);
    NCCL_REQUIRED(NCCL_RESOLVE)
    NCCL_OPTIONAL(NCCL_RESOLVE)
#undef NCCL_RESOLVE
    a.host_memory = mfsdp_nccl_sym("mfsdp_fake_nccl_host_memory", 0) != NULL;
    const char *m = missing(&a);
    if (m != NULL) {
        MFSDP_WARN("the NCCL function %s (or p%s) is not loaded in this process: no NCCL "
                   "library, or one older than 2.19",
                   m, m);
        g_api_status = MFSDP_ERR_UNSUPPORTED;
        return;
    }
    int version = 0;
    if (a.GetVersion != NULL && a.GetVersion(&version) == ncclSuccess) {
        MFSDP_INFO(TRANSPORT, "nccl %d.%d.%d%s", version / 10000, version / 100 % 100,
                   version % 100, a.host_memory ? " (the test library over MPI, host memory)" : "");
    }
    g_api = a;
}

mfsdp_status_t mfsdp_nccl_api_get(const mfsdp_nccl_api_t **api_p)
{
    MFSDP_CHECK_ARG(api_p != NULL);
    pthread_once(&g_api_once, api_resolve);
    if (g_api_status != MFSDP_OK) {
        return g_api_status;
    }
    *api_p = &g_api;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Errors and calls in progress
 */

static mfsdp_status_t fail(nccl_transport_t *t, ncclResult_t r, const char *what, const char *how)
{
    const char *detail = t->api.GetLastError != NULL ? t->api.GetLastError(t->comm) : NULL;
    int has = detail != NULL && detail[0] != '\0';
    MFSDP_WARN("%s failed%s: %s%s%s%s", what, how, t->api.GetErrorString(r), has ? " (" : "",
               has ? detail : "", has ? ")" : "");
    return MFSDP_ERR_TRANSPORT;
}

static double seconds_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

/* A non-blocking communicator's call in progress: poll until it is done (bounded). */
static mfsdp_status_t wait_progress(nccl_transport_t *t, const char *what)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    unsigned long polls = 0;
    for (;;) {
        ncclResult_t a = ncclInProgress;
        ncclResult_t q = t->api.CommGetAsyncError(t->comm, &a);
        polls++;
        if (q != ncclSuccess) {
            return fail(t, q, "ncclCommGetAsyncError", "");
        }
        if (a == ncclSuccess) {
            return MFSDP_OK;
        }
        if (a != ncclInProgress) {
            return fail(t, a, what, " (reported by ncclCommGetAsyncError)");
        }
        double el = seconds_since(&t0);
        if (el > t->timeout) {
            MFSDP_WARN("%s is still in progress after %.3g s on a non-blocking communicator "
                       "(ncclCommGetAsyncError polled %lu times): giving up",
                       what, el, polls);
            return MFSDP_ERR_TRANSPORT;
        }
        if (polls < 64) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

static mfsdp_status_t check(nccl_transport_t *t, ncclResult_t r, const char *what)
{
    if (r == ncclSuccess) {
        return MFSDP_OK;
    }
    if (r == ncclInProgress) {
        return wait_progress(t, what);
    }
    return fail(t, r, what, "");
}

/* Inside a group a non-blocking communicator may answer ncclInProgress: the group's end
 * reports (and is waited for). */
static mfsdp_status_t check_in_group(nccl_transport_t *t, ncclResult_t r, const char *what)
{
    return r == ncclSuccess || r == ncclInProgress ? MFSDP_OK : fail(t, r, what, "");
}

mfsdp_status_t mfsdp_transport_nccl_check(mfsdp_transport_t *tb, ncclResult_t r, const char *what)
{
    MFSDP_CHECK_ARG(tb != NULL && tb->ops == &nccl_ops && what != NULL);
    return check((nccl_transport_t *)tb, r, what);
}

#define STREAM(t) ((cudaStream_t)(t)->stream)

static mfsdp_status_t group_start(nccl_transport_t *t)
{
    return check(t, t->api.GroupStart(), "ncclGroupStart");
}

/* Close the group whatever happened inside it (the caller's group depth must not change),
 * then wait for it; st is the status of what was posted. */
static mfsdp_status_t group_end(nccl_transport_t *t, mfsdp_status_t st)
{
    mfsdp_status_t se = check(t, t->api.GroupEnd(), "ncclGroupEnd");
    return st != MFSDP_OK ? st : se;
}

/* ---------------------------------------------------------------------------------------
 * Op lists
 */

/* The ops that run in a wave: every op but the local ones that wait for all (DEP_ALL). */
static int in_a_wave(const mfsdp_sched_op_t *op)
{
    return op->dep != MFSDP_SCHED_DEP_ALL;
}

/* The sharded tail of a group. Reduce: an all-to-all of the packed blocks in the reduce
 * dtype (ncclSend / ncclRecv with every other rank).
 * Gather, in place in FSDP's output (this rank's pieces are in its block): one broadcast
 * per rank and contiguous run of tail pieces in a rank block (an all-gather when the tail is
 * the whole block). */
static mfsdp_status_t post_tail(nccl_transport_t *t, const mfsdp_xfer_t *x)
{
    int gather = x->dir == MFSDP_SCHED_DIR_GATHER;
    MFSDP_CHECK(mfsdp_xfer_check_tail(x));
    if (!gather) {
        /* An all-to-all of the contributions in FSDP's reduce dtype, as point-to-point pairs
         * (the own block stays where it was packed); the caller sums them in rank order. */
        for (int r = 0; r < t->base.world; r++) {
            if (r == t->base.rank) {
                continue;
            }
            const char *s = (const char *)x->tail_send + (size_t)r * x->tail_count;
            char *d = (char *)x->tail_recv + (size_t)r * x->tail_count;
            MFSDP_CHECK(
                check_in_group(t, t->api.Send(s, x->tail_count, ncclUint8, r, t->comm, STREAM(t)),
                               "ncclSend (sharded tail)"));
            MFSDP_CHECK(
                check_in_group(t, t->api.Recv(d, x->tail_count, ncclUint8, r, t->comm, STREAM(t)),
                               "ncclRecv (sharded tail)"));
        }
        return MFSDP_OK;
    }
    const mfsdp_group_sched_t *gs = x->gs;
    const mfsdp_buffer_layout_t *b = &gs->layout->ag;
    size_t sum = 0;
    for (size_t k = 0; k < gs->ntail; k++) {
        sum += b->entries[gs->tail[k]].s_bytes;
    }
    if (sum != x->tail_count) {
        MFSDP_WARN("sharded tail of group %zu: %zu bytes per rank, its pieces hold %zu", gs->group,
                   x->tail_count, sum);
        return MFSDP_ERR_INTERNAL;
    }
    if (gs->ntail > 0 && b->entries[gs->tail[0]].o_bytes == 0 && sum == b->bytes) {
        const char *own = (const char *)x->ag_out + (size_t)t->base.rank * b->bytes;
        return check_in_group(
            t, t->api.AllGather(own, x->ag_out, x->tail_count, ncclUint8, t->comm, STREAM(t)),
            "ncclAllGather (sharded tail)");
    }
    for (int r = 0; r < t->base.world; r++) {
        for (size_t k = 0; k < gs->ntail;) {
            size_t o = b->entries[gs->tail[k]].o_bytes;
            size_t len = b->entries[gs->tail[k]].s_bytes;
            for (k++; k < gs->ntail && b->entries[gs->tail[k]].o_bytes == o + len; k++) {
                len += b->entries[gs->tail[k]].s_bytes;
            }
            char *dst = (char *)x->ag_out + (size_t)r * b->bytes + o;
            MFSDP_CHECK(
                check_in_group(t, t->api.Broadcast(dst, dst, len, ncclUint8, r, t->comm, STREAM(t)),
                               "ncclBroadcast (sharded tail)"));
        }
    }
    return MFSDP_OK;
}

/* A gather transfer, cut at the rank blocks of FSDP's layout on every rank alike (so that
 * the receivers can land each piece straight in FSDP's output whatever the sender knows). */
static mfsdp_status_t post_gather(nccl_transport_t *t, const mfsdp_xfer_t *x,
                                  const mfsdp_sched_op_t *op, long i)
{
    const mfsdp_sched_seg_t *s = &x->gs->segs[op->seg];
    size_t elt;
    char *buf = mfsdp_xfer_buf(x, op, &elt);
    int me = t->base.rank;
    int receiving =
        op->kind == MFSDP_SCHED_RECV || (op->kind == MFSDP_SCHED_BCAST && op->peer != me);
    int into_out = receiving && op->buf == MFSDP_BUF_STAGE && x->bufs[op->seg].stage == NULL;
    if ((into_out && x->ag_out == NULL) || (!into_out && buf == NULL) ||
        op->off + op->len > s->ag_bytes) {
        MFSDP_WARN("segment %u: no buffer bound for op %ld, or a range outside the tensor", op->seg,
                   i);
        return MFSDP_ERR_INTERNAL;
    }
    size_t end = op->off + op->len;
    for (size_t pos = op->off; pos < end;) {
        size_t run;
        char *out = mfsdp_xfer_ag_at(x, op->seg, pos, &run);
        if (out == NULL) {
            return MFSDP_ERR_INTERNAL;
        }
        run = run < end - pos ? run : end - pos;
        char *p = into_out ? out : buf + op->boff + (pos - op->off);
        ncclResult_t r;
        const char *name;
        switch (op->kind) {
        case MFSDP_SCHED_SEND:
            r = t->api.Send(p, run, ncclUint8, op->peer, t->comm, STREAM(t));
            name = "ncclSend";
            break;
        case MFSDP_SCHED_RECV:
            r = t->api.Recv(p, run, ncclUint8, op->peer, t->comm, STREAM(t));
            name = "ncclRecv";
            break;
        default:
            r = t->api.Broadcast(p, p, run, ncclUint8, op->peer, t->comm, STREAM(t));
            name = "ncclBroadcast";
            break;
        }
        MFSDP_CHECK(check_in_group(t, r, name));
        pos += run;
    }
    return MFSDP_OK;
}

static mfsdp_status_t post(nccl_transport_t *t, const mfsdp_xfer_t *x, long i)
{
    const mfsdp_sched_op_t *op = &x->ops->ops[i];
    if (op->kind == MFSDP_SCHED_TAIL) {
        return post_tail(t, x);
    }
    if (x->dir == MFSDP_SCHED_DIR_GATHER) {
        if (op->kind != MFSDP_SCHED_SEND && op->kind != MFSDP_SCHED_RECV &&
            op->kind != MFSDP_SCHED_BCAST) {
            return MFSDP_ERR_INTERNAL;
        }
        return post_gather(t, x, op, i);
    }
    size_t elt;
    char *p = mfsdp_xfer_buf(x, op, &elt);
    if (p == NULL) {
        MFSDP_WARN("segment %u: no buffer bound for op %ld", op->seg, i);
        return MFSDP_ERR_INTERNAL;
    }
    p += op->boff * elt;
    switch (op->kind) {
    case MFSDP_SCHED_SEND:
        return check_in_group(
            t, t->api.Send(p, op->len * elt, ncclUint8, op->peer, t->comm, STREAM(t)), "ncclSend");
    case MFSDP_SCHED_RECV:
        return check_in_group(
            t, t->api.Recv(p, op->len * elt, ncclUint8, op->peer, t->comm, STREAM(t)), "ncclRecv");
    case MFSDP_SCHED_REDUCE: {
        /* fp32 partial sums (own contribution, premul applied), as the MPI transport */
        float *fin = NULL;
        if (t->base.rank == op->peer) {
            fin = x->bufs[op->seg].final;
            if (fin == NULL) {
                MFSDP_WARN("segment %u: no fp32 sum buffer on its owner", op->seg);
                return MFSDP_ERR_INTERNAL;
            }
            fin += op->boff;
        }
        return check_in_group(
            t, t->api.Reduce(p, fin, op->len, ncclFloat32, ncclSum, op->peer, t->comm, STREAM(t)),
            "ncclReduce");
    }
    default:
        return MFSDP_ERR_INTERNAL;
    }
}

/* The list is checked before anything is posted, so that a broken one is an error on every
 * rank instead of a hang: waves of dependencies, local DEP_ALL ops. */
static mfsdp_status_t check_list(const mfsdp_xfer_t *x)
{
    const mfsdp_sched_ops_t *l = x->ops;
    for (size_t i = 0; i < l->nops; i++) {
        const mfsdp_sched_op_t *op = &l->ops[i];
        if (op->seg >= x->gs->nsegs && op->kind != MFSDP_SCHED_TAIL) {
            MFSDP_WARN("op %zu of group %zu: segment %u of %zu", i, x->gs->group, op->seg,
                       x->gs->nsegs);
            return MFSDP_ERR_INTERNAL;
        }
        if (op->dep == MFSDP_SCHED_DEP_ALL) {
            if (!mfsdp_sched_op_is_local(op)) {
                MFSDP_WARN("op %zu of group %zu waits for all others but is a transfer", i,
                           x->gs->group);
                return MFSDP_ERR_INTERNAL;
            }
            continue;
        }
        long nd = op->dep >= 0 && op->ndep > 1 ? op->ndep : 1; /* ops dep .. dep + nd - 1 */
        if (op->wave < 0 || (op->dep < 0 && op->dep != -1) ||
            (op->dep >= 0 && (size_t)(op->dep + nd - 1) >= i)) {
            MFSDP_WARN("op %zu of group %zu: wave %d, dependency %ld (+%ld)", i, x->gs->group,
                       op->wave, op->dep, nd - 1);
            return MFSDP_ERR_INTERNAL;
        }
        for (long q = op->dep; op->dep >= 0 && q < op->dep + nd; q++) {
            const mfsdp_sched_op_t *d = &l->ops[q];
            if (mfsdp_sched_op_is_local(op) ? op->wave < d->wave : op->wave <= d->wave) {
                MFSDP_WARN("op %zu of group %zu (wave %d) would run before op %ld it depends on "
                           "(wave %d)",
                           i, x->gs->group, op->wave, q, d->wave);
                return MFSDP_ERR_INTERNAL;
            }
        }
    }
    return MFSDP_OK;
}

/* What one op list needs on every run, built (and the list checked) on its first run and
 * kept in the op list (mfsdp_sched_ops_t.tp_state) until it is freed: no allocation per call. */
typedef struct nccl_cache {
    size_t nw;         /* waves */
    size_t *first;     /* ops of wave w: order[first[w], first[w+1]) */
    long *order;       /* op indices by wave, list order kept within a wave */
    const void **srcv; /* world entries: the sources of a direct reduce's ordered sum */
} nccl_cache_t;

static void ncache_free(void *state)
{
    nccl_cache_t *c = state;
    if (c != NULL) {
        free(c->first);
        free(c->order);
        free((void *)c->srcv);
        free(c);
    }
}

static mfsdp_status_t ncache_get(const mfsdp_xfer_t *x, int world, nccl_cache_t **c_p)
{
    mfsdp_sched_ops_t *l = x->ops;
    *c_p = mfsdp_sched_ops_state(l, &nccl_ops);
    if (*c_p != NULL) {
        return MFSDP_OK;
    }
    MFSDP_CHECK(check_list(x));
    nccl_cache_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    c->srcv = malloc((size_t)world * sizeof(*c->srcv));
    size_t count;
    mfsdp_status_t st = c->srcv == NULL ? MFSDP_ERR_NO_MEMORY
                                        : mfsdp_sched_wave_order(l, in_a_wave, &c->order, &count,
                                                                 &c->first, &c->nw);
    if (st != MFSDP_OK) {
        ncache_free(c);
        return st;
    }
    mfsdp_sched_ops_keep(l, &nccl_ops, c, ncache_free);
    *c_p = c;
    return MFSDP_OK;
}

static mfsdp_status_t nccl_run(mfsdp_transport_t *tb, const mfsdp_xfer_t *x)
{
    nccl_transport_t *t = (nccl_transport_t *)tb;
    MFSDP_CHECK_ARG(x != NULL && x->ops != NULL && x->gs != NULL && x->exec != NULL);
    MFSDP_CHECK_ARG(x->peer_src == NULL); /* shared host arenas are the MPI transport's */
    if (x->overlap != NULL) {             /* enqueued on the stream before the waves */
        MFSDP_CHECK(x->overlap(x->overlap_arg));
    }
    size_t n = x->ops->nops;
    if (n == 0) {
        return MFSDP_OK;
    }
    nccl_cache_t *c;
    MFSDP_CHECK(ncache_get(x, t->base.world, &c));
    const size_t *first = c->first;
    const long *order = c->order;
    for (size_t w = 0; w < c->nw; w++) {
        int comm = 0;
        /* Partial sums sent in this wave get the own contribution added first (their inputs
         * arrived in earlier waves). */
        for (size_t k = first[w]; k < first[w + 1]; k++) {
            const mfsdp_sched_op_t *op = &x->ops->ops[order[k]];
            comm |= !mfsdp_sched_op_is_local(op);
            if (!mfsdp_sched_op_is_local(op) && op->combine) {
                MFSDP_CHECK(mfsdp_xfer_prepare(x, op));
            }
        }
        if (comm) {
            MFSDP_CHECK(group_start(t));
            mfsdp_status_t sp = MFSDP_OK;
            for (size_t k = first[w]; k < first[w + 1] && sp == MFSDP_OK; k++) {
                if (!mfsdp_sched_op_is_local(&x->ops->ops[order[k]])) {
                    sp = post(t, x, order[k]);
                }
            }
            MFSDP_CHECK(group_end(t, sp));
        }
        for (size_t k = first[w]; k < first[w + 1]; k++) {
            const mfsdp_sched_op_t *op = &x->ops->ops[order[k]];
            if (mfsdp_sched_op_is_local(op)) {
                MFSDP_CHECK(mfsdp_xfer_local(x, op, t->base.rank, t->base.world, c->srcv));
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (x->ops->ops[i].dep == MFSDP_SCHED_DEP_ALL) {
            MFSDP_CHECK(mfsdp_xfer_local(x, &x->ops->ops[i], t->base.rank, t->base.world, c->srcv));
        }
    }
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Point-to-point batches and small collectives
 */

static mfsdp_status_t nccl_p2p(mfsdp_transport_t *tb, const mfsdp_p2p_t *v, size_t n)
{
    nccl_transport_t *t = (nccl_transport_t *)tb;
    MFSDP_CHECK_ARG(n == 0 || v != NULL);
    for (size_t i = 0; i < n; i++) {
        if (v[i].peer < 0 || v[i].peer >= tb->world || (v[i].buf == NULL && v[i].bytes != 0)) {
            MFSDP_WARN("point-to-point %zu: peer %d of %d ranks, %zu bytes at %p", i, v[i].peer,
                       tb->world, v[i].bytes, v[i].buf);
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    if (n == 0) {
        return MFSDP_OK;
    }
    MFSDP_CHECK(group_start(t));
    mfsdp_status_t st = MFSDP_OK;
    for (size_t i = 0; i < n && st == MFSDP_OK; i++) {
        const mfsdp_p2p_t *p = &v[i];
        if (p->send) {
            st = check_in_group(
                t, t->api.Send(p->buf, p->bytes, ncclUint8, p->peer, t->comm, STREAM(t)),
                "ncclSend");
        } else {
            st = check_in_group(
                t, t->api.Recv(p->buf, p->bytes, ncclUint8, p->peer, t->comm, STREAM(t)),
                "ncclRecv");
        }
    }
    return group_end(t, st);
}

/* Device memory: a staging buffer of at least bytes on the transport's stream. */
static mfsdp_status_t stage(nccl_transport_t *t, size_t bytes, const char *what, void **p)
{
    mfsdp_exec_t *e = t->stage_exec;
    if (e == NULL) {
        MFSDP_WARN("%s on an NCCL communicator with device memory needs a staging executor "
                   "(mfsdp_transport_nccl_set_staging) for its host values",
                   what);
        return MFSDP_ERR_STATE;
    }
    MFSDP_CHECK(e->ops->set_stream(e, t->stream));
    if (t->stage_bytes < bytes) {
        e->ops->mem_free(e, t->stage);
        t->stage = NULL;
        t->stage_bytes = 0;
        MFSDP_CHECK(e->ops->mem_alloc(e, bytes, &t->stage));
        t->stage_bytes = bytes;
    }
    *p = t->stage;
    return MFSDP_OK;
}

/* An in-place all-reduce of n host values of type dt (size elt). */
static mfsdp_status_t host_allreduce(nccl_transport_t *t, void *vals, size_t n, size_t elt,
                                     ncclDataType_t dt, ncclRedOp_t op, const char *what)
{
    if (n == 0) {
        return MFSDP_OK;
    }
    if (t->api.host_memory) {
        return check(t, t->api.AllReduce(vals, vals, n, dt, op, t->comm, STREAM(t)), what);
    }
    void *d;
    MFSDP_CHECK(stage(t, n * elt, what, &d));
    mfsdp_exec_t *e = t->stage_exec;
    MFSDP_CHECK(e->ops->upload(e, d, vals, n * elt));
    MFSDP_CHECK(check(t, t->api.AllReduce(d, d, n, dt, op, t->comm, STREAM(t)), what));
    return e->ops->download(e, vals, d, n * elt); /* waits for the stream */
}

static mfsdp_status_t nccl_allreduce_sum(mfsdp_transport_t *tb, double *value)
{
    MFSDP_CHECK_ARG(value != NULL);
    return host_allreduce((nccl_transport_t *)tb, value, 1, sizeof(double), ncclFloat64, ncclSum,
                          "ncclAllReduce (sum of one double)");
}

static mfsdp_status_t nccl_allreduce_u64(mfsdp_transport_t *tb, uint64_t *buf, size_t n, int is_max)
{
    MFSDP_CHECK_ARG(buf != NULL || n == 0);
    return host_allreduce((nccl_transport_t *)tb, buf, n, sizeof(uint64_t), ncclUint64,
                          is_max ? ncclMax : ncclMin, "ncclAllReduce (uint64 min/max)");
}

static mfsdp_status_t nccl_allreduce_f32(mfsdp_transport_t *tb, float *buf, size_t n)
{
    nccl_transport_t *t = (nccl_transport_t *)tb;
    MFSDP_CHECK_ARG(buf != NULL || n == 0);
    if (n == 0) {
        return MFSDP_OK;
    }
    /* Executor memory, in stream order: nothing to stage or wait for. */
    return check(t, t->api.AllReduce(buf, buf, n, ncclFloat32, ncclSum, t->comm, STREAM(t)),
                 "ncclAllReduce (float32 sum)");
}

static mfsdp_status_t nccl_allgather_bytes(mfsdp_transport_t *tb, const void *mine, size_t bytes,
                                           void *all)
{
    nccl_transport_t *t = (nccl_transport_t *)tb;
    MFSDP_CHECK_ARG(mine != NULL && all != NULL);
    if (bytes == 0) {
        return MFSDP_OK;
    }
    const char *what = "ncclAllGather (bytes)";
    if (t->api.host_memory) {
        return check(t, t->api.AllGather(mine, all, bytes, ncclUint8, t->comm, STREAM(t)), what);
    }
    size_t total;
    if (mfsdp_mul_overflow(bytes, (size_t)tb->world, &total)) {
        return MFSDP_ERR_OVERFLOW;
    }
    void *d;
    MFSDP_CHECK(stage(t, total, what, &d));
    mfsdp_exec_t *e = t->stage_exec;
    char *slot = (char *)d + (size_t)tb->rank * bytes; /* in place */
    MFSDP_CHECK(e->ops->upload(e, slot, mine, bytes));
    MFSDP_CHECK(check(t, t->api.AllGather(slot, d, bytes, ncclUint8, t->comm, STREAM(t)), what));
    return e->ops->download(e, all, d, total);
}

static mfsdp_status_t nccl_set_stream(mfsdp_transport_t *tb, void *stream)
{
    ((nccl_transport_t *)tb)->stream = stream;
    return MFSDP_OK;
}

static void nccl_destroy(mfsdp_transport_t *tb)
{
    nccl_transport_t *t = (nccl_transport_t *)tb;
    if (t == NULL) {
        return;
    }
    if (t->stage != NULL) {
        t->stage_exec->ops->mem_free(t->stage_exec, t->stage);
    }
    free(t); /* the communicator is the caller's */
}

static const mfsdp_transport_ops_t nccl_ops = {
    .name = "nccl",
    .run = nccl_run,
    .p2p = nccl_p2p,
    .allreduce_sum = nccl_allreduce_sum,
    .allreduce_f32 = nccl_allreduce_f32,
    .allreduce_u64 = nccl_allreduce_u64,
    .allgather_bytes = nccl_allgather_bytes,
    .set_stream = nccl_set_stream,
    .destroy = nccl_destroy,
};

mfsdp_status_t mfsdp_transport_nccl_create(ncclComm_t comm, const mfsdp_nccl_api_t *api,
                                           mfsdp_transport_t **t_p)
{
    MFSDP_CHECK_ARG(comm != NULL && api != NULL && t_p != NULL);
    const char *m = missing(api);
    if (m != NULL) {
        MFSDP_WARN("the NCCL function table lacks %s", m);
        return MFSDP_ERR_INVALID_ARG;
    }
    nccl_transport_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    t->api = *api;
    t->comm = comm;
    t->timeout = NCCL_TIMEOUT_DEFAULT;
    t->base.ops = &nccl_ops;
    /* A communicator fresh from a non-blocking init may still be in progress. */
    ncclResult_t a = ncclSuccess;
    mfsdp_status_t st = check(t, t->api.CommGetAsyncError(comm, &a), "ncclCommGetAsyncError");
    if (st == MFSDP_OK && a == ncclInProgress) {
        st = wait_progress(t, "the communicator's initialization");
    } else if (st == MFSDP_OK && a != ncclSuccess) {
        st = fail(t, a, "the communicator", " (asynchronous error)");
    }
    if (st == MFSDP_OK) {
        st = check(t, t->api.CommCount(comm, &t->base.world), "ncclCommCount");
    }
    if (st == MFSDP_OK) {
        st = check(t, t->api.CommUserRank(comm, &t->base.rank), "ncclCommUserRank");
    }
    if (st == MFSDP_OK &&
        (t->base.world < 1 || t->base.rank < 0 || t->base.rank >= t->base.world)) {
        MFSDP_WARN("NCCL communicator reports rank %d of %d", t->base.rank, t->base.world);
        st = MFSDP_ERR_TRANSPORT;
    }
    if (st != MFSDP_OK) {
        free(t);
        return st;
    }
    *t_p = &t->base;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_transport_nccl_set_staging(mfsdp_transport_t *tb, mfsdp_exec_t *exec)
{
    MFSDP_CHECK_ARG(tb != NULL && tb->ops == &nccl_ops);
    nccl_transport_t *t = (nccl_transport_t *)tb;
    if (t->stage != NULL && exec != t->stage_exec) {
        t->stage_exec->ops->mem_free(t->stage_exec, t->stage);
        t->stage = NULL;
        t->stage_bytes = 0;
    }
    t->stage_exec = exec;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_transport_nccl_set_timeout(mfsdp_transport_t *tb, double seconds)
{
    MFSDP_CHECK_ARG(tb != NULL && tb->ops == &nccl_ops && seconds > 0.0);
    ((nccl_transport_t *)tb)->timeout = seconds;
    return MFSDP_OK;
}

ncclComm_t mfsdp_transport_nccl_comm(const mfsdp_transport_t *tb)
{
    return tb != NULL && tb->ops == &nccl_ops ? ((const nccl_transport_t *)tb)->comm : NULL;
}

const mfsdp_nccl_api_t *mfsdp_transport_nccl_api(const mfsdp_transport_t *tb)
{
    return tb != NULL && tb->ops == &nccl_ops ? &((const nccl_transport_t *)tb)->api : NULL;
}
