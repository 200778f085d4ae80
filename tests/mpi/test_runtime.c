/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Multi-rank runtime test, run by meson under mpirun at 1..4 ranks. On random param groups
 * (odd shapes, rows < ranks, 1-D params, mixed dtypes, frozen params, both tail policies,
 * every algorithm) it proves:
 *  - allgather: byte-identical to a native MPI_Allgather of FSDP even shards of the same
 *    weights (in place and out of place, before and after training);
 *  - reduce: each owner holds exactly the reduced full gradient (sum, avg, premulsum);
 *    direct and chain bitwise equal to a rank-ordered fp32 sum, bitwise reproducible over 5
 *    runs; native within rounding; sharded-tail slices bitwise the rank-ordered fp32 sum
 *    under every algorithm; the FSDP output shard zero for owner-managed bytes and the
 *    reduced slice for sharded-tail bytes;
 *  - training: 20 optimizer steps through the API match a float64 single-process
 *    full-matrix Muon + AdamW reference (computed here from the summed gradients) within
 *    1e-5 relative, eager and lazy, with accumulation, clipping and per-group lr/wd;
 *  - no MPI call inside the step but the single scalar all-reduce with clipping (counted
 *    by PMPI wrappers defined in this file);
 *  - error statuses and messages (world size, counts, dtypes, group index, op, destroyed
 *    context, eager + clipping) identical on every rank, without hangs.
 *
 * Built a second time with -DTEST_TRANSPORT_NCCL (test_runtime_nccl): every context is created
 * with mfsdp_ctx_create_nccl on communicators of the test NCCL library made from
 * MPI_COMM_WORLD (HSDP: ncclCommSplit twins, mfsdp_ctx_attach_replicate_nccl), so the same
 * checks run over the NCCL transport (host memory, CPU executor). The counting wrappers then
 * count the NCCL calls the runtime makes (this executable exports pnccl* wrappers that the
 * transport resolves, forwarding to the library), and every MPI call the runtime would make
 * is a failure: the NCCL path uses no MPI. Arguments: "register" runs with
 * MFSDP_NCCL_REGISTER=1 (owner arenas from ncclMemAlloc, registered, released at destroy),
 * "transport-mpi" checks that MFSDP_TRANSPORT=mpi is refused alike on every rank.
 */
#include <math.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/algo_table.h"
#include "core/log.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/kernels.h"
#include "mfsdp/runtime_mpi.h"
#include "runtime/checkpoint.h"
#include "tests/lib/ns_ref.h"
#include "tests/unit/manifest_util.h"
#ifdef TEST_TRANSPORT_NCCL
#include <dlfcn.h>
#include <nccl.h>

#include "mfsdp/runtime_nccl.h"
#endif

#include "tests/lib/mpi_check.h"

/* ---------------------------------------------------------------------------------------
 * PMPI wrappers: count MPI calls while g_counting is set.
 */
static int g_counting;
static int g_shm_expect;      /* direct gathers read the owners' arenas (MPI, MFSDP_SHM) */
static int g_calls_total;     /* calls that start communication (waits excluded) */
static int g_calls_allreduce; /* MPI_Allreduce calls */
static int g_calls_wait;      /* MPI_Wait* calls: their number depends on timing */

#ifdef TEST_TRANSPORT_NCCL
/* Over NCCL the runtime makes no MPI call at all (its own traffic: the test library uses
 * PMPI, this file too): every MPI call is counted here, and the communication calls counted
 * below are NCCL's. */
static int g_mpi_calls;

static void count_mpi(void)
{
    g_mpi_calls++;
}

static void count(int is_allreduce)
{
    if (g_counting) {
        g_calls_total++;
        g_calls_allreduce += is_allreduce;
    }
}

#define count(is_allreduce)  count_mpi()
#define count_wait()         count_mpi()
#define count_nccl(is_allre) (count)(is_allre)

/* The transport resolves pncclX in the global scope: these exported definitions come first
 * (the build hides symbols by default: export them), and forward to the test library's. */
#define TEST_EXPORT __attribute__((visibility("default")))
#define NEXT(fn)                                                                                   \
    static __typeof__(&fn) next_;                                                                  \
    if (next_ == NULL) {                                                                           \
        next_ = (__typeof__(&fn))dlsym(RTLD_NEXT, #fn);                                            \
    }
TEST_EXPORT ncclResult_t pncclAllReduce(const void *s, void *r, size_t c, ncclDataType_t d,
                                        ncclRedOp_t o, ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclAllReduce);
    count_nccl(1);
    return next_(s, r, c, d, o, comm, st);
}
TEST_EXPORT ncclResult_t pncclAllGather(const void *s, void *r, size_t c, ncclDataType_t d,
                                        ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclAllGather);
    count_nccl(0);
    return next_(s, r, c, d, comm, st);
}
TEST_EXPORT ncclResult_t pncclReduceScatter(const void *s, void *r, size_t c, ncclDataType_t d,
                                            ncclRedOp_t o, ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclReduceScatter);
    count_nccl(0);
    return next_(s, r, c, d, o, comm, st);
}
TEST_EXPORT ncclResult_t pncclBroadcast(const void *s, void *r, size_t c, ncclDataType_t d,
                                        int root, ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclBroadcast);
    count_nccl(0);
    return next_(s, r, c, d, root, comm, st);
}
TEST_EXPORT ncclResult_t pncclReduce(const void *s, void *r, size_t c, ncclDataType_t d,
                                     ncclRedOp_t o, int root, ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclReduce);
    count_nccl(0);
    return next_(s, r, c, d, o, root, comm, st);
}
TEST_EXPORT ncclResult_t pncclSend(const void *b, size_t c, ncclDataType_t d, int peer,
                                   ncclComm_t comm, cudaStream_t st)
{
    NEXT(pncclSend);
    count_nccl(0);
    return next_(b, c, d, peer, comm, st);
}
TEST_EXPORT ncclResult_t pncclRecv(void *b, size_t c, ncclDataType_t d, int peer, ncclComm_t comm,
                                   cudaStream_t st)
{
    NEXT(pncclRecv);
    count_nccl(0);
    return next_(b, c, d, peer, comm, st);
}

void mfsdp_fake_nccl_stats(long *allocs, long *regs);
static int g_register; /* MFSDP_NCCL_REGISTER=1 in this run */
static ncclComm_t g_ncomm;

static ncclComm_t nccl_world(int nonblocking)
{
    ncclUniqueId id;
    if (g_rank == 0) {
        ncclGetUniqueId(&id);
    }
    PMPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = nonblocking ? 0 : 1;
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, g_world, id, g_rank, &cfg);
    if (r != ncclSuccess && !(nonblocking && r == ncclInProgress)) {
        fprintf(stderr, "[rank %d] ncclCommInitRankConfig: %s\n", g_rank, ncclGetErrorString(r));
        PMPI_Abort(MPI_COMM_WORLD, 1);
    }
    return c; /* a non-blocking one is still initializing: the context waits for it */
}
#else
static void count(int is_allreduce)
{
    if (g_counting) {
        g_calls_total++;
        g_calls_allreduce += is_allreduce;
    }
}

static void count_wait(void)
{
    if (g_counting) {
        g_calls_wait++;
    }
}
#endif

int MPI_Allreduce(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o, MPI_Comm comm)
{
    count(1);
    return PMPI_Allreduce(s, r, c, d, o, comm);
}
int MPI_Iallreduce(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o, MPI_Comm comm,
                   MPI_Request *q)
{
    count(0);
    return PMPI_Iallreduce(s, r, c, d, o, comm, q);
}
int MPI_Isend(const void *b, int c, MPI_Datatype d, int p, int t, MPI_Comm comm, MPI_Request *q)
{
    count(0);
    return PMPI_Isend(b, c, d, p, t, comm, q);
}
int MPI_Irecv(void *b, int c, MPI_Datatype d, int p, int t, MPI_Comm comm, MPI_Request *q)
{
    count(0);
    return PMPI_Irecv(b, c, d, p, t, comm, q);
}
int MPI_Send(const void *b, int c, MPI_Datatype d, int p, int t, MPI_Comm comm)
{
    count(0);
    return PMPI_Send(b, c, d, p, t, comm);
}
int MPI_Recv(void *b, int c, MPI_Datatype d, int p, int t, MPI_Comm comm, MPI_Status *st)
{
    count(0);
    return PMPI_Recv(b, c, d, p, t, comm, st);
}
int MPI_Ibcast(void *b, int c, MPI_Datatype d, int root, MPI_Comm comm, MPI_Request *q)
{
    count(0);
    return PMPI_Ibcast(b, c, d, root, comm, q);
}
int MPI_Bcast(void *b, int c, MPI_Datatype d, int root, MPI_Comm comm)
{
    count(0);
    return PMPI_Bcast(b, c, d, root, comm);
}
int MPI_Ireduce(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o, int root, MPI_Comm comm,
                MPI_Request *q)
{
    count(0);
    return PMPI_Ireduce(s, r, c, d, o, root, comm, q);
}
int MPI_Reduce(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o, int root, MPI_Comm comm)
{
    count(0);
    return PMPI_Reduce(s, r, c, d, o, root, comm);
}
int MPI_Iallgather(const void *s, int sc, MPI_Datatype sd, void *r, int rc, MPI_Datatype rd,
                   MPI_Comm comm, MPI_Request *q)
{
    count(0);
    return PMPI_Iallgather(s, sc, sd, r, rc, rd, comm, q);
}
int MPI_Allgather(const void *s, int sc, MPI_Datatype sd, void *r, int rc, MPI_Datatype rd,
                  MPI_Comm comm)
{
    count(0);
    return PMPI_Allgather(s, sc, sd, r, rc, rd, comm);
}
int MPI_Ireduce_scatter_block(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o,
                              MPI_Comm comm, MPI_Request *q)
{
    count(0);
    return PMPI_Ireduce_scatter_block(s, r, c, d, o, comm, q);
}
int MPI_Reduce_scatter_block(const void *s, void *r, int c, MPI_Datatype d, MPI_Op o, MPI_Comm comm)
{
    count(0);
    return PMPI_Reduce_scatter_block(s, r, c, d, o, comm);
}
int MPI_Waitall(int n, MPI_Request *q, MPI_Status *st)
{
    count_wait();
    return PMPI_Waitall(n, q, st);
}
int MPI_Waitsome(int n, MPI_Request *q, int *oc, int *idx, MPI_Status *st)
{
    count_wait();
    return PMPI_Waitsome(n, q, oc, idx, st);
}
int MPI_Barrier(MPI_Comm comm)
{
    count(0);
    return PMPI_Barrier(comm);
}

/* ---------------------------------------------------------------------------------------
 * Deterministic random numbers (identical on every rank).
 */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static double urand(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    uint64_t h = mix(mix(mix(mix(a) ^ b) ^ c) ^ d);
    return (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* ---------------------------------------------------------------------------------------
 * Hand-built manifests (the public struct; the JSON parser is tested elsewhere).
 */
static void add_param(mfsdp_group_desc_t *g, const char *name, int ndim, const int64_t *shape,
                      mfsdp_dtype_t dtype, int requires_grad)
{
    mfsdp_param_desc_t *p = &g->params[g->nparams++];
    memset(p, 0, sizeof(*p));
    p->name = strdup(name);
    p->ndim = ndim;
    p->numel = 1;
    for (int d = 0; d < ndim; d++) {
        p->shape[d] = shape[d];
        p->numel *= shape[d];
    }
    p->dtype = dtype;
    p->requires_grad = requires_grad;
    p->optimizer = ndim >= 2 && strstr(name, "embed") == NULL ? MFSDP_ROLE_MUON : MFSDP_ROLE_ADAMW;
}

static void manifest_free(mfsdp_manifest_t *m)
{
    test_manifest_free_owned(m);
}

/* A random manifest: 1..3 groups of 1..4 params with odd shapes. */
static mfsdp_manifest_t *random_manifest(uint64_t seed)
{
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    mfsdp_hparams_default(&m->hp);
    m->hp.weight_decay = 0.01;
    m->hp.adamw_weight_decay = 0.02;
    m->ngroups = 1 + mix(seed) % 3;
    m->groups = calloc(m->ngroups, sizeof(*m->groups));
    static const int64_t rows[] = {1, 2, 3, 5, 7, 9, 13, 24, 31};
    static const int64_t cols[] = {1, 3, 4, 6, 11, 16, 20};
    for (size_t g = 0; g < m->ngroups; g++) {
        mfsdp_group_desc_t *gd = &m->groups[g];
        char name[64];
        snprintf(name, sizeof(name), "g%zu", g);
        gd->name = strdup(name);
        gd->lr_scale = g == 1 ? 0.5 : 1.0;
        if (g == 2) {
            gd->has_weight_decay = 1;
            gd->weight_decay = 0.05;
        }
        size_t np = 1 + mix(seed * 31 + g) % 4;
        gd->params = calloc(np + 1, sizeof(*gd->params));
        uint64_t kind = (seed + g) % 3; /* 0 fp32, 1 bf16, 2 mixed */
        if (kind == 2) {
            gd->has_reduce_dtype = 1;
            gd->reduce_dtype = MFSDP_FLOAT32;
        }
        for (size_t i = 0; i < np; i++) {
            uint64_t h = mix(seed * 1000 + g * 10 + i);
            int64_t shape[3];
            int ndim;
            const char *stem = "w";
            if (h % 5 == 0) {
                ndim = 1;
                shape[0] = rows[(h >> 8) % 9] + 1;
                stem = "norm";
            } else if (h % 7 == 1) {
                ndim = 3;
                shape[0] = rows[(h >> 8) % 9];
                shape[1] = 2;
                shape[2] = cols[(h >> 16) % 7];
            } else {
                ndim = 2;
                shape[0] = rows[(h >> 8) % 9];
                shape[1] = cols[(h >> 16) % 7] + 1;
                if (h % 11 == 3) {
                    stem = "embed";
                }
            }
            mfsdp_dtype_t dt = kind == 0   ? MFSDP_FLOAT32
                               : kind == 1 ? MFSDP_BFLOAT16
                                           : ((h >> 24) & 1 ? MFSDP_BFLOAT16 : MFSDP_FLOAT32);
            int rg = !(i > 0 && (h >> 32) % 6 == 0); /* some frozen params */
            snprintf(name, sizeof(name), "g%zu.%s%zu", g, stem, i);
            add_param(gd, name, ndim, shape, dt, rg);
        }
    }
    return m;
}

/* ---------------------------------------------------------------------------------------
 * FSDP layout computed independently here (docs/design.md, "FSDP2's byte layout").
 */
typedef struct lay {
    size_t n;      /* entries */
    size_t idx[8]; /* group param index */
    int64_t rows[8], rest[8], c[8];
    size_t elt[8], o[8]; /* bytes */
    size_t S;            /* bytes per rank */
    mfsdp_dtype_t wire;
    size_t count;
} lay_t;

static void layout_of_masked(const mfsdp_group_desc_t *g, int rs, int n, const unsigned char *mask,
                             lay_t *l)
{
    memset(l, 0, sizeof(*l));
    int mixed = 0;
    mfsdp_dtype_t rsd = g->has_reduce_dtype ? g->reduce_dtype : MFSDP_FLOAT32;
    int have = g->has_reduce_dtype;
    for (size_t i = 0; i < g->nparams; i++) {
        mixed |= g->params[i].dtype != g->params[0].dtype;
        if (!have && g->params[i].requires_grad) {
            rsd = g->params[i].dtype;
            have = 1;
        }
    }
    for (size_t i = 0; i < g->nparams; i++) {
        const mfsdp_param_desc_t *p = &g->params[i];
        if (rs && (!p->requires_grad || (mask != NULL && !mask[i]))) {
            continue;
        }
        size_t k = l->n++;
        l->idx[k] = i;
        l->rows[k] = p->shape[0];
        l->rest[k] = p->numel / p->shape[0];
        l->c[k] = (p->shape[0] + n - 1) / n;
        l->elt[k] = mfsdp_dtype_size(rs ? rsd : p->dtype);
        l->o[k] = l->S;
        l->S += (size_t)(l->c[k] * l->rest[k]) * l->elt[k];
    }
    l->wire = rs ? rsd : (mixed ? MFSDP_UINT8 : g->params[0].dtype);
    l->count = l->S / mfsdp_dtype_size(l->wire);
}

static void layout_of(const mfsdp_group_desc_t *g, int rs, int n, lay_t *l)
{
    layout_of_masked(g, rs, n, NULL, l);
}

/* Element e of a full tensor, written in dtype. */
static void put(void *dst, mfsdp_dtype_t dt, size_t e, double v)
{
    if (dt == MFSDP_FLOAT32) {
        ((float *)dst)[e] = (float)v;
    } else if (dt == MFSDP_BFLOAT16) {
        ((uint16_t *)dst)[e] = mfsdp_f32_to_bf16((float)v);
    } else {
        ((uint16_t *)dst)[e] = mfsdp_f32_to_f16((float)v);
    }
}

static double get(const void *src, mfsdp_dtype_t dt, size_t e)
{
    if (dt == MFSDP_FLOAT32) {
        return ((const float *)src)[e];
    }
    if (dt == MFSDP_BFLOAT16) {
        return mfsdp_bf16_to_f32(((const uint16_t *)src)[e]);
    }
    return mfsdp_f16_to_f32(((const uint16_t *)src)[e]);
}

/* Rank r's even shard of a group, from full tensors (bytes of the params' dtypes). */
static void build_shard(const lay_t *l, void *const *full, int r, char *out)
{
    memset(out, 0, l->S);
    for (size_t k = 0; k < l->n; k++) {
        int64_t first = r * l->c[k];
        int64_t nrows = l->rows[k] - first;
        nrows = nrows < 0 ? 0 : (nrows > l->c[k] ? l->c[k] : nrows);
        size_t rb = (size_t)l->rest[k] * l->elt[k];
        if (nrows > 0) {
            memcpy(out + l->o[k], (const char *)full[l->idx[k]] + (size_t)first * rb,
                   (size_t)nrows * rb);
        }
    }
}

/* Initial weights of a param: deterministic values in its dtype. */
static void *initial_weights(const mfsdp_param_desc_t *p, uint64_t seed, size_t gi, size_t pi)
{
    void *w = malloc((size_t)p->numel * mfsdp_dtype_size(p->dtype));
    for (int64_t e = 0; e < p->numel; e++) {
        put(w, p->dtype, (size_t)e, 0.5 * urand(seed, gi, pi, (uint64_t)e));
    }
    return w;
}

/* ---------------------------------------------------------------------------------------
 * Context helpers
 */

/* A context over the whole world: on MPI_COMM_WORLD, or on the NCCL world communicator. */
static mfsdp_status_t create_world(const mfsdp_manifest_t *m, const mfsdp_ctx_opts_t *o,
                                   mfsdp_ctx_h *ctx_p)
{
#ifdef TEST_TRANSPORT_NCCL
    mfsdp_status_t st = mfsdp_ctx_create_nccl(m, o, g_ncomm, ctx_p);
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_set_stream(*ctx_p, NULL); /* the job's stream: host memory ignores it */
    }
    return st;
#else
    return mfsdp_ctx_create_mpi(m, o, MPI_COMM_WORLD, ctx_p);
#endif
}

/* Options with the given tail policy and step mode, everything else left to the defaults. */
static mfsdp_ctx_opts_t tail_step_opts(mfsdp_tail_policy_t tail, mfsdp_step_mode_t mode)
{
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.has_plan_opts = 1;
    o.plan_opts.tail = tail;
    o.has_step_mode = 1;
    o.step_mode = mode;
    return o;
}

static mfsdp_ctx_h make_ctx(const mfsdp_manifest_t *m, mfsdp_tail_policy_t tail, mfsdp_algo_t ga,
                            mfsdp_algo_t ra, mfsdp_step_mode_t mode, int accum, double clip)
{
    mfsdp_ctx_opts_t o = tail_step_opts(tail, mode);
    o.gather_algo = ga;
    o.reduce_algo = ra;
    o.chain_chunk = 64; /* many chunks per segment: exercises the pipeline */
    o.accum_steps = accum;
    o.has_clip = 1;
    o.clip = clip;
    mfsdp_ctx_h ctx = NULL;
    mfsdp_status_t st = create_world(m, &o, &ctx);
    CHECK(st == MFSDP_OK, "ctx create: %s", mfsdp_status_string(st));
    return st == MFSDP_OK ? ctx : NULL;
}

/* Every group's weights as full tensors (param dtype), per group/param. */
typedef struct weights {
    size_t ng;
    void ***w; /* w[g][i] */
} weights_t;

static weights_t make_weights(const mfsdp_manifest_t *m, uint64_t seed)
{
    weights_t W = {.ng = m->ngroups};
    W.w = calloc(m->ngroups, sizeof(*W.w));
    for (size_t g = 0; g < m->ngroups; g++) {
        W.w[g] = calloc(m->groups[g].nparams, sizeof(void *));
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            W.w[g][i] = initial_weights(&m->groups[g].params[i], seed, g, i);
        }
    }
    return W;
}

static void free_weights(const mfsdp_manifest_t *m, weights_t *W)
{
    for (size_t g = 0; g < W->ng; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            free(W->w[g][i]);
        }
        free(W->w[g]);
    }
    free(W->w);
}

/* mfsdp allgather of group g vs native MPI_Allgather of even shards of W (byte equal). */
static void check_allgather(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m, size_t g, void *const *full,
                            int in_place, const char *what)
{
    lay_t l;
    layout_of(&m->groups[g], 0, g_world, &l);
    size_t tot = l.S * (size_t)g_world;
    char *mine = malloc(l.S + 1);
    char *expect = malloc(tot + 1);
    char *recv = malloc(tot + 1);
    build_shard(&l, full, g_rank, mine);
    PMPI_Allgather(mine, (int)l.S, MPI_BYTE, expect, (int)l.S, MPI_BYTE, MPI_COMM_WORLD);
    memset(recv, 0xA5, tot);
    const void *send = mine;
    if (in_place) {
        memcpy(recv + (size_t)g_rank * l.S, mine, l.S);
        send = recv + (size_t)g_rank * l.S;
    }
    mfsdp_status_t st = mfsdp_ctx_allgather(ctx, g, send, recv, l.count, l.wire);
    CHECK(st == MFSDP_OK, "%s: allgather group %zu: %s", what, g, mfsdp_status_string(st));
    CHECK(memcmp(recv, expect, tot) == 0, "%s: allgather group %zu differs from MPI_Allgather",
          what, g);
    free(mine);
    free(expect);
    free(recv);
}

/* ---------------------------------------------------------------------------------------
 * 1. All-gather exactness
 */
static void test_allgather(uint64_t seed)
{
    static const mfsdp_algo_t algos[] = {MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_ALGO_NATIVE};
    mfsdp_manifest_t *m = random_manifest(seed);
    weights_t W = make_weights(m, seed);
    for (int tail = 0; tail < 2; tail++) {
        for (int a = 0; a < 3; a++) {
            mfsdp_ctx_h ctx = make_ctx(m, tail ? MFSDP_TAIL_SHARD : MFSDP_TAIL_OWNER, algos[a],
                                       MFSDP_ALGO_DIRECT, MFSDP_STEP_LAZY, 1000, 0.0);
            if (ctx == NULL) {
                continue;
            }
            char what[96];
            mfsdp_ctx_stats_t st;
            CHECK_OK(mfsdp_ctx_get_stats(ctx, &st));
            int shared = algos[a] == MFSDP_ALGO_DIRECT && g_shm_expect;
            CHECK(st.gather_shared == shared,
                  "seed %llu gather %s: gathers from shared arenas %d, expected %d",
                  (unsigned long long)seed, mfsdp_algo_name(algos[a]), st.gather_shared, shared);
            for (int rep = 0; rep < 2; rep++) {
                for (size_t g = 0; g < m->ngroups; g++) {
                    snprintf(what, sizeof(what), "seed %llu tail %s gather %s rep %d",
                             (unsigned long long)seed, tail ? "shard" : "owner",
                             mfsdp_algo_name(algos[a]), rep);
                    check_allgather(ctx, m, g, W.w[g], (rep + (int)g) % 2, what);
                }
            }
            mfsdp_ctx_destroy(&ctx);
        }
    }
    free_weights(m, &W);
    manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * 2. Reduce-to-owner exactness
 */

/* Contribution (full local gradient) of rank r for group param i, element e. */
static double contrib(uint64_t seed, int r, size_t g, size_t i, size_t e, int step)
{
    return urand(seed ^ 0xC0FFEEULL, (uint64_t)r * 131 + (uint64_t)step, g * 17 + i, e);
}

/* Rank r's reduce-scatter input of group g (world blocks). */
static char *rs_input(const mfsdp_manifest_t *m, size_t g, const lay_t *l, uint64_t seed, int r,
                      int step)
{
    char *buf = calloc((size_t)g_world, l->S + 1);
    for (size_t k = 0; k < l->n; k++) {
        const mfsdp_param_desc_t *p = &m->groups[g].params[l->idx[k]];
        void *full = malloc((size_t)p->numel * l->elt[k]);
        for (int64_t e = 0; e < p->numel; e++) {
            put(full, l->wire, (size_t)e, contrib(seed, r, g, l->idx[k], (size_t)e, step));
        }
        for (int j = 0; j < g_world; j++) {
            int64_t first = j * l->c[k];
            int64_t nrows = l->rows[k] - first;
            nrows = nrows < 0 ? 0 : (nrows > l->c[k] ? l->c[k] : nrows);
            size_t rb = (size_t)l->rest[k] * l->elt[k];
            if (nrows > 0) {
                memcpy(buf + (size_t)j * l->S + l->o[k], (char *)full + (size_t)first * rb,
                       (size_t)nrows * rb);
            }
        }
        free(full);
    }
    return buf;
}

/* The rank-ordered fp32 reduction of element e, as the direct algorithm defines it. */
static float ordered(const lay_t *l, uint64_t seed, size_t g, size_t i, size_t e, mfsdp_redop_t op,
                     float sc, int step)
{
    float s = 0.0f;
    for (int r = 0; r < g_world; r++) {
        char tmp[4];
        put(tmp, l->wire, 0, contrib(seed, r, g, i, e, step));
        float x = (float)get(tmp, l->wire, 0);
        if (op == MFSDP_OP_PREMULSUM) {
            x = x * sc;
        }
        s = r == 0 ? x : s + x;
    }
    if (op == MFSDP_OP_AVG) {
        s = s / (float)g_world;
    }
    return 0.0f + s;
}

static double reduced_ref(const lay_t *l, uint64_t seed, size_t g, size_t i, size_t e,
                          mfsdp_redop_t op, double sc, int step)
{
    double s = 0.0;
    for (int r = 0; r < g_world; r++) {
        char tmp[4];
        put(tmp, l->wire, 0, contrib(seed, r, g, i, e, step));
        s += get(tmp, l->wire, 0) * (op == MFSDP_OP_PREMULSUM ? sc : 1.0);
    }
    return op == MFSDP_OP_AVG ? s / g_world : s;
}

static void test_reduce(uint64_t seed)
{
    static const mfsdp_algo_t algos[] = {MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_ALGO_NATIVE};
    static const mfsdp_redop_t ops[] = {MFSDP_OP_SUM, MFSDP_OP_AVG, MFSDP_OP_PREMULSUM};
    const float sc = 0.37f;
    mfsdp_manifest_t *m = random_manifest(seed);
    weights_t W = make_weights(m, seed);
    for (int tail = 0; tail < 2; tail++) {
        for (int a = 0; a < 3; a++) {
            for (int o = 0; o < 3; o++) {
                int runs = algos[a] == MFSDP_ALGO_DIRECT && o == 1 ? 5 : 1;
                float **first = NULL; /* grads of run 0 per (g, param), for reproducibility */
                size_t nslots = 0;
                for (size_t g = 0; g < m->ngroups; g++) {
                    nslots += m->groups[g].nparams;
                }
                first = calloc(nslots, sizeof(*first));
                for (int run = 0; run < runs; run++) {
                    mfsdp_ctx_h ctx =
                        make_ctx(m, tail ? MFSDP_TAIL_SHARD : MFSDP_TAIL_OWNER, MFSDP_ALGO_NATIVE,
                                 algos[a], MFSDP_STEP_LAZY, 1000, 0.0);
                    if (ctx == NULL) {
                        continue;
                    }
                    char what[128];
                    snprintf(what, sizeof(what), "seed %llu tail %s reduce %s op %d run %d",
                             (unsigned long long)seed, tail ? "shard" : "owner",
                             mfsdp_algo_name(algos[a]), (int)ops[o], run);
                    size_t slot = 0;
                    for (size_t g = 0; g < m->ngroups; g++) {
                        check_allgather(ctx, m, g, W.w[g], 0, what);
                        lay_t l;
                        layout_of(&m->groups[g], 1, g_world, &l);
                        char *in = rs_input(m, g, &l, seed, g_rank, 0);
                        char *out = malloc(l.S + 1);
                        memset(out, 0x5A, l.S);
                        mfsdp_status_t st =
                            mfsdp_ctx_reduce(ctx, g, in, out, l.count, l.wire, ops[o], sc);
                        CHECK(st == MFSDP_OK, "%s: reduce group %zu: %s", what, g,
                              mfsdp_status_string(st));
                        for (size_t k = 0; k < l.n; k++) {
                            size_t i = l.idx[k];
                            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
                            mfsdp_param_view_t v;
                            CHECK_OK(mfsdp_ctx_get_param(ctx, p->name, &v));
                            size_t sbytes = (size_t)(l.c[k] * l.rest[k]) * l.elt[k];
                            if (v.owner == MFSDP_OWNER_SHARDED) {
                                /* Slice of rank g_rank: bitwise the rank-ordered fp32 sum
                                 * (each rank sums its slices' contributions in rank order,
                                 * whatever the algorithm); the output shard holds the
                                 * reduced slice in the wire dtype. */
                                CHECK(v.grad != NULL, "%s: %s slice has no grad", what, p->name);
                                for (size_t e = 0; v.grad && e < v.local_valid; e++) {
                                    float want =
                                        ordered(&l, seed, g, i, v.local_offset + e, ops[o], sc, 0);
                                    if (memcmp(&v.grad[e], &want, sizeof(float)) != 0) {
                                        CHECK(0, "%s: %s slice[%zu] = %.9g, rank-ordered sum %.9g",
                                              what, p->name, e, v.grad[e], want);
                                        break;
                                    }
                                    double ref = reduced_ref(&l, seed, g, i, v.local_offset + e,
                                                             ops[o], sc, 0);
                                    double got = get(out + l.o[k], l.wire, e);
                                    CHECK(fabs(got - ref) <= 1e-2 * (1 + fabs(ref)),
                                          "%s: %s output[%zu] %g vs %g", what, p->name, e, got,
                                          ref);
                                }
                                continue;
                            }
                            /* Owner-managed bytes of the output are zero. */
                            for (size_t b = 0; b < sbytes; b++) {
                                if (out[l.o[k] + b] != 0) {
                                    CHECK(0, "%s: %s output byte %zu not zeroed", what, p->name, b);
                                    break;
                                }
                            }
                            if (v.owner != g_rank) {
                                CHECK(v.grad == NULL && v.master == NULL,
                                      "%s: %s visible on a non-owner", what, p->name);
                                continue;
                            }
                            CHECK(v.grad != NULL, "%s: owner of %s has no grad", what, p->name);
                            if (v.grad == NULL) {
                                continue;
                            }
                            for (size_t e = 0; e < (size_t)p->numel; e++) {
                                if (algos[a] == MFSDP_ALGO_NATIVE) {
                                    double ref = reduced_ref(&l, seed, g, i, e, ops[o], sc, 0);
                                    if (!(fabs(v.grad[e] - ref) <= 1e-5 * (1 + fabs(ref)))) {
                                        CHECK(0, "%s: %s[%zu] = %g, expected %g", what, p->name, e,
                                              v.grad[e], ref);
                                        break;
                                    }
                                } else {
                                    float ref = ordered(&l, seed, g, i, e, ops[o], sc, 0);
                                    if (memcmp(&v.grad[e], &ref, sizeof(float)) != 0) {
                                        CHECK(0, "%s: %s[%zu] = %.9g, rank-ordered sum %.9g", what,
                                              p->name, e, v.grad[e], ref);
                                        break;
                                    }
                                }
                            }
                            size_t fi = slot + i;
                            if (run == 0) {
                                first[fi] = malloc((size_t)p->numel * sizeof(float));
                                memcpy(first[fi], v.grad, (size_t)p->numel * sizeof(float));
                            } else {
                                CHECK(memcmp(first[fi], v.grad, (size_t)p->numel * sizeof(float)) ==
                                          0,
                                      "%s: %s not bitwise reproducible", what, p->name);
                            }
                        }
                        free(in);
                        free(out);
                        slot += m->groups[g].nparams;
                    }
                    mfsdp_ctx_destroy(&ctx);
                }
                for (size_t s = 0; s < nslots; s++) {
                    free(first[s]);
                }
                free(first);
            }
        }
    }
    free_weights(m, &W);
    manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * 3. Training against a float64 single-process reference
 */
typedef struct ref_param {
    double *w, *mom, *m, *v, *g;
    int64_t numel, rows, cols;
    int muon, rg;
    int had; /* a gradient arrived in this window */
    int t;   /* AdamW steps taken (torch counts per param) */
} ref_param_t;

/* Newton-Schulz in float64, in place (tests/lib/ns_ref.h). */
static void ns_ref(double *x, int64_t m, int64_t k, int steps)
{
    ns_ref_f64(x, m, k, steps, x);
}

typedef struct train_cfg {
    mfsdp_tail_policy_t tail;
    mfsdp_algo_t ga, ra;
    mfsdp_step_mode_t mode;
    int accum;
    double clip;
    mfsdp_redop_t op;
    int drop;     /* leave params out of reduces, as FSDP2 does for unused params */
    int schedule; /* a warmup-cosine lr schedule in the manifest */
    double post;  /* the job's post-divide of the reduce output (0: none) */
    int resume;   /* halfway: save, load into a fresh context, go on with that one */
} train_cfg_t;

/* Which params of group g have a gradient in micro-step mi: about a quarter of them drop out,
 * at least one stays (FSDP2 issues no reduce-scatter for a group without any). */
static void drop_mask(const mfsdp_group_desc_t *gd, uint64_t seed, size_t g, int mi,
                      unsigned char *mask)
{
    int kept = 0;
    for (size_t i = 0; i < gd->nparams; i++) {
        mask[i] = gd->params[i].requires_grad &&
                  mix(seed * 7919 + g * 131 + i * 17 + (uint64_t)mi) % 4 != 0;
        kept += mask[i];
    }
    for (size_t i = 0; i < gd->nparams && kept == 0; i++) {
        if (gd->params[i].requires_grad) {
            mask[i] = 1;
            kept = 1;
        }
    }
}

/* The lr factor at step t of the schedule set below (torchtitan's formula, written here
 * independently of core/settings.c), and the job's factor in manual mode. */
static double sched_factor(int t)
{
    const int w = 3, d = 12;
    const double mn = 0.1;
    if (t > w + d) {
        t = w + d;
    }
    if (t < w) {
        return (t + 1.0) / (w + 1.0);
    }
    double p = (double)(t + 1 - w) / (d + 1.0);
    return mn + (1.0 - mn) * 0.5 * (1.0 + cos(M_PI * p));
}

static double manual_factor(int t)
{
    return 0.25 + 0.75 * fabs(cos(0.7 * t));
}

/* The float64 reference of every param, from the initial weights W. */
static ref_param_t **ref_create(const mfsdp_manifest_t *m, const weights_t *W)
{
    ref_param_t **R = calloc(m->ngroups, sizeof(*R));
    for (size_t g = 0; g < m->ngroups; g++) {
        R[g] = calloc(m->groups[g].nparams, sizeof(**R));
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            ref_param_t *q = &R[g][i];
            q->numel = p->numel;
            q->rows = p->shape[0];
            q->cols = p->numel / p->shape[0];
            q->muon = p->optimizer == MFSDP_ROLE_MUON;
            q->rg = p->requires_grad;
            q->w = calloc((size_t)p->numel, sizeof(double));
            q->mom = calloc((size_t)p->numel, sizeof(double));
            q->m = calloc((size_t)p->numel, sizeof(double));
            q->v = calloc((size_t)p->numel, sizeof(double));
            q->g = calloc((size_t)p->numel, sizeof(double));
            for (int64_t e = 0; e < p->numel; e++) {
                q->w[e] = get(W->w[g][i], p->dtype, (size_t)e);
            }
        }
    }
    return R;
}

static void ref_free(const mfsdp_manifest_t *m, ref_param_t **R)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            free(R[g][i].w);
            free(R[g][i].mom);
            free(R[g][i].m);
            free(R[g][i].v);
            free(R[g][i].g);
        }
        free(R[g]);
    }
    free(R);
}

/* The context's masters on this rank against the reference; returns the worst relative
 * error (and checks frozen params kept their initial weights exactly). */
static double compare_masters(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m, ref_param_t **R,
                              const weights_t *W, const char *what)
{
    double worst = 0;
    size_t ng = m->ngroups;
    for (size_t g = 0; g < ng; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            ref_param_t *q = &R[g][i];
            mfsdp_param_view_t v;
            CHECK_OK(mfsdp_ctx_get_param(ctx, p->name, &v));
            if (!v.local || v.master == NULL) {
                continue;
            }
            double nref = 0, nd = 0;
            for (int64_t e = 0; e < q->numel; e++) {
                nref += q->w[e] * q->w[e];
            }
            for (size_t e = 0; e < v.local_valid; e++) {
                double d = v.master[e] - q->w[v.local_offset + e];
                nd += d * d;
            }
            double rel = sqrt(nd) / (sqrt(nref) + 1e-30);
            worst = rel > worst ? rel : worst;
            CHECK(rel <= 1e-5, "%s: %s differs from the reference by %.3g relative", what, p->name,
                  rel);
            if (!p->requires_grad) {
                /* Frozen: exactly the initial weights. */
                for (size_t e = 0; e < v.local_valid; e++) {
                    double w0 = get(W->w[g][i], p->dtype, v.local_offset + e);
                    if (v.master[e] != (float)w0) {
                        CHECK(0, "%s: frozen %s changed", what, p->name);
                        break;
                    }
                }
            }
        }
    }
    return worst;
}

/* The owners' Muon momentum through this rank's FSDP block of each group (the job's optimizer
 * state under the PyTorch companion). Only trainable Muon params hold momentum (the arena gives
 * a frozen one none, and torch keeps no state for it); every other param's rows are neither
 * written nor read, so they hold NaN wherever a gather must not read and the sentinel wherever
 * a scatter must not write. 1. mfsdp_ctx_scatter_momentum against the float64 reference's
 * momentum: the same m = mu m + (1 - mu) g on the same (clipped) summed gradients as
 * kernels/cpu/muon.c, with no Newton-Schulz in between, so the masters' 1e-5 holds; padding
 * rows zero. 2. A round trip of distinct values through mfsdp_ctx_gather_momentum and back,
 * bitwise (the owners' momentum then holds no NaN: each rank checks its rows of it). 3. A wrong
 * count or a NULL block is refused alike on every rank, before any transfer (nothing left
 * posted). 4. The trained momentum put back from 1's block, and checked bitwise, for what the
 * test does next. */
static void check_momentum(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m, ref_param_t **R,
                           const lay_t *LA, const char *what)
{
    const float sentinel = -7.0f;
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        size_t cnt = 0, off[9];
        for (size_t i = 0; i < gd->nparams; i++) {
            off[i] = cnt;
            cnt += (size_t)(LA[g].c[i] * LA[g].rest[i]);
        }
        off[gd->nparams] = cnt;
        float *trained = malloc(cnt * sizeof(float) + 4), *sent = malloc(cnt * sizeof(float) + 4);
        float *back = malloc(cnt * sizeof(float) + 4);
        for (size_t e = 0; e < cnt; e++) {
            trained[e] = back[e] = sentinel;
        }
        CHECK_OK(mfsdp_ctx_scatter_momentum(ctx, g, trained, cnt));
        for (size_t i = 0; i < gd->nparams; i++) {
            const ref_param_t *q = &R[g][i];
            int has = q->muon && q->rg;
            int64_t first = g_rank * LA[g].c[i], rows = q->rows - first;
            rows = rows < 0 ? 0 : (rows > LA[g].c[i] ? LA[g].c[i] : rows);
            size_t valid = (size_t)(rows * LA[g].rest[i]);
            const double *ref = q->mom + (size_t)first * (size_t)LA[g].rest[i];
            double nd = 0, nr = 1e-30;
            int bad = 0;
            for (size_t e = 0; e < off[i + 1] - off[i]; e++) {
                float x = trained[off[i] + e];
                if (!has) {
                    bad |= x != sentinel;
                } else if (e < valid) {
                    nd += (x - ref[e]) * (x - ref[e]);
                    nr += ref[e] * ref[e];
                } else {
                    bad |= x != 0.0f;
                }
                sent[off[i] + e] =
                    has && e < valid ? 0.5f + (float)g_rank + (float)(off[i] + e) / 4096.0f : NAN;
            }
            CHECK(!bad, "%s: scatter_momentum of %s: %s", what, gd->params[i].name,
                  has ? "padding rows not zero" : "wrote a param without momentum");
            CHECK(sqrt(nd / nr) <= 1e-5, "%s: scatter_momentum of %s is %.3g off the reference",
                  what, gd->params[i].name, sqrt(nd / nr));
        }
        CHECK_OK(mfsdp_ctx_gather_momentum(ctx, g, sent, cnt));
        CHECK_OK(mfsdp_ctx_scatter_momentum(ctx, g, back, cnt));
        for (size_t i = 0; i < gd->nparams; i++) {
            size_t bad = 0;
            for (size_t e = off[i]; e < off[i + 1]; e++) {
                float want = !(R[g][i].muon && R[g][i].rg) ? sentinel
                             : isnan(sent[e])              ? 0.0f
                                                           : sent[e];
                bad += memcmp(&back[e], &want, sizeof(float)) != 0;
            }
            CHECK(bad == 0,
                  "%s: momentum of %s through gather_momentum and back: %zu of %zu differ", what,
                  gd->params[i].name, bad, off[i + 1] - off[i]);
        }
        char log[1024] = "";
        mfsdp_log_capture_begin();
        mfsdp_status_t st[4] = {
            mfsdp_ctx_gather_momentum(ctx, g, trained, cnt + 1),
            mfsdp_ctx_scatter_momentum(ctx, g, back, cnt - 1), /* cnt > 0: a group has params */
            mfsdp_ctx_scatter_momentum(ctx, g, NULL, cnt),
            mfsdp_ctx_gather_momentum(ctx, g, NULL, cnt),
        };
        mfsdp_log_capture_end(log, sizeof(log));
        CHECK(st[0] == MFSDP_ERR_MISMATCH && st[1] == MFSDP_ERR_MISMATCH &&
                  st[2] == MFSDP_ERR_INVALID_ARG && st[3] == MFSDP_ERR_INVALID_ARG &&
                  strstr(log, "its FSDP shard has") != NULL,
              "%s: group %s: count + 1, count - 1, NULL, NULL: %s, %s, %s, %s (%s)", what, gd->name,
              mfsdp_status_string(st[0]), mfsdp_status_string(st[1]), mfsdp_status_string(st[2]),
              mfsdp_status_string(st[3]), log);
        for (size_t e = 0; e < cnt; e++) {
            back[e] = sentinel;
        }
        CHECK_OK(mfsdp_ctx_gather_momentum(ctx, g, trained, cnt));
        CHECK_OK(mfsdp_ctx_scatter_momentum(ctx, g, back, cnt));
        CHECK(memcmp(back, trained, cnt * sizeof(float)) == 0,
              "%s: group %s: the trained momentum did not come back bitwise", what, gd->name);
        free(trained);
        free(sent);
        free(back);
    }
}

/* One optimizer step of the float64 reference: full-matrix Muon and AdamW on the summed
 * gradients, lr times f, global-norm clipping when clip > 0; params without gradient in the
 * window, frozen ones and (job) the job's AdamW tensors are left alone. */
static void ref_step(const mfsdp_manifest_t *m, ref_param_t **R, double f, double clip, int job)
{
    const mfsdp_hparams_t *hp = &m->hp;
    size_t ng = m->ngroups;
    double coef = 1.0;
    if (clip > 0) {
        double sq = 0;
        for (size_t g = 0; g < ng; g++) {
            for (size_t i = 0; i < m->groups[g].nparams; i++) {
                for (int64_t e = 0; e < R[g][i].numel; e++) {
                    sq += R[g][i].g[e] * R[g][i].g[e];
                }
            }
        }
        double c = clip / (sqrt(sq) + 1e-6);
        coef = c < 1.0 ? c : 1.0;
    }
    for (size_t g = 0; g < ng; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        double lr = hp->lr * gd->lr_scale * f, alr = hp->adamw_lr * gd->lr_scale * f;
        double wd = gd->has_weight_decay ? gd->weight_decay : hp->weight_decay;
        double awd = gd->has_weight_decay ? gd->weight_decay : hp->adamw_weight_decay;
        for (size_t i = 0; i < gd->nparams; i++) {
            ref_param_t *q = &R[g][i];
            if (!q->rg || !q->had || (job && !q->muon)) {
                continue; /* frozen, no gradient (skipped as torch does), or the job's */
            }
            q->had = 0;
            int64_t n = q->numel;
            for (int64_t e = 0; e < n; e++) {
                q->g[e] *= coef;
            }
            if (q->muon) {
                double beta = hp->momentum;
                double *u = malloc(sizeof(double) * (size_t)n);
                for (int64_t e = 0; e < n; e++) {
                    q->mom[e] = beta * q->mom[e] + (1 - beta) * q->g[e];
                    u[e] = hp->nesterov ? (1 - beta) * q->g[e] + beta * q->mom[e] : q->mom[e];
                }
                ns_ref(u, q->rows, q->cols, hp->ns_steps);
                double s = q->rows > q->cols ? sqrt((double)q->rows / (double)q->cols) : 1.0;
                for (int64_t e = 0; e < n; e++) {
                    q->w[e] = q->w[e] * (1 - lr * wd) - lr * s * u[e];
                }
                free(u);
            } else {
                double b1 = hp->adamw_beta1, b2 = hp->adamw_beta2;
                q->t++;
                double bc1 = 1 - pow(b1, q->t), bc2 = 1 - pow(b2, q->t);
                for (int64_t e = 0; e < n; e++) {
                    q->m[e] = b1 * q->m[e] + (1 - b1) * q->g[e];
                    q->v[e] = b2 * q->v[e] + (1 - b2) * q->g[e] * q->g[e];
                    q->w[e] = q->w[e] * (1 - alr * awd) -
                              alr * (q->m[e] / bc1) / (sqrt(q->v[e] / bc2) + hp->adamw_eps);
                }
            }
            memset(q->g, 0, sizeof(double) * (size_t)n);
        }
    }
}

/* A restart halfway through training: save the context, load the checkpoint into a fresh
 * one, destroy the old. Whatever the checkpoint forgets (a tensor's AdamW step count when
 * it skipped steps, the schedule's t, a master) shows in the comparison with the reference. */
static mfsdp_ctx_h restart(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m, const train_cfg_t *tc,
                           const char *what)
{
    char dir[64];
    int tag = 0;
    if (g_rank == 0) {
        tag = (int)getpid();
    }
    PMPI_Bcast(&tag, 1, MPI_INT, 0, MPI_COMM_WORLD);
    snprintf(dir, sizeof(dir), "/tmp/mfsdp-test-runtime-%d", tag);
    mfsdp_status_t st = mfsdp_ctx_save(ctx, dir);
    CHECK(st == MFSDP_OK, "%s: save: %s", what, mfsdp_status_string(st));
    st = mfsdp_ctx_save_wait(ctx);
    CHECK(st == MFSDP_OK, "%s: save_wait: %s", what, mfsdp_status_string(st));
    mfsdp_ctx_h fresh = make_ctx(m, tc->tail, tc->ga, tc->ra, tc->mode, tc->accum, tc->clip);
    if (fresh == NULL) {
        return ctx;
    }
    st = mfsdp_ctx_load(fresh, dir);
    CHECK(st == MFSDP_OK, "%s: load: %s", what, mfsdp_status_string(st));
    mfsdp_ctx_destroy(&ctx);
    PMPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0) {
        char cmd[96];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        CHECK(system(cmd) == 0, "%s: %s failed", what, cmd);
    }
    return fresh;
}

static void test_train(uint64_t seed, const train_cfg_t *tc)
{
    const int nsteps = 20;
    const double sc = 0.25;
    mfsdp_manifest_t *m = random_manifest(seed);
    weights_t W = make_weights(m, seed);
    char what[200];
    static const char *const tails[] = {"owner", "shard", "auto", "job"};
    static const char *const modes[] = {"eager", "lazy", "manual"};
    snprintf(what, sizeof(what),
             "train seed %llu tail %s gather %s reduce %s %s accum %d clip %g op %d%s%s%s",
             (unsigned long long)seed, tails[tc->tail], mfsdp_algo_name(tc->ga),
             mfsdp_algo_name(tc->ra), modes[tc->mode], tc->accum, tc->clip, (int)tc->op,
             tc->drop ? " drop" : "", tc->schedule ? " schedule" : "", tc->resume ? " resume" : "");
    if (tc->schedule) {
        m->hp.schedule.kind = MFSDP_SCHEDULE_WARMUP_COSINE;
        m->hp.schedule.warmup_steps = 3;
        m->hp.schedule.decay_steps = 12;
        m->hp.schedule.decay = MFSDP_DECAY_COSINE;
        m->hp.schedule.min_lr_ratio = 0.1;
    }
    int job = tc->tail == MFSDP_TAIL_JOB;
    mfsdp_ctx_h ctx = make_ctx(m, tc->tail, tc->ga, tc->ra, tc->mode, tc->accum, tc->clip);
    if (ctx == NULL) {
        free_weights(m, &W);
        manifest_free(m);
        return;
    }

    /* Reference state, full tensors in double. */
    size_t ng = m->ngroups;
    ref_param_t **R = ref_create(m, &W);
    lay_t *LA = calloc(ng, sizeof(*LA)), *LR = calloc(ng, sizeof(*LR));
    for (size_t g = 0; g < ng; g++) {
        layout_of(&m->groups[g], 0, g_world, &LA[g]);
        layout_of(&m->groups[g], 1, g_world, &LR[g]);
    }

    int micro_total = 0;
    int *calls_first = calloc(ng, sizeof(int));
    for (int step = 0; step < nsteps; step++) {
        for (int mi = 0; mi < tc->accum; mi++, micro_total++) {
            /* Forward all-gathers (the lazy step of the previous iteration runs in the
             * first), then backward reduces in reverse group order. */
            for (size_t g = 0; g < ng; g++) {
                size_t tot = LA[g].S * (size_t)g_world;
                char *recv = malloc(tot + 1);
                char *send = calloc(1, LA[g].S + 1);
                build_shard(&LA[g], W.w[g], g_rank, send);
                CHECK_OK(mfsdp_ctx_allgather(ctx, g, send, recv, LA[g].count, LA[g].wire));
                free(recv);
                free(send);
            }
            for (size_t gg = ng; gg-- > 0;) {
                unsigned char mask[8];
                lay_t lm;
                if (tc->drop) {
                    drop_mask(&m->groups[gg], seed, gg, micro_total, mask);
                }
                layout_of_masked(&m->groups[gg], 1, g_world, tc->drop ? mask : NULL, &lm);
                const lay_t *l = &lm;
                if (l->n == 0) {
                    continue;
                }
                char *in = rs_input(m, gg, l, seed, g_rank, micro_total);
                char *out = malloc(l->S + 1);
                /* Eager: the reduce that closes the window runs the step inside; it must make
                 * exactly the MPI calls of one that does not (no collective in the step). */
                g_calls_total = g_calls_allreduce = 0;
                g_counting = 1;
                double post = tc->post > 0 ? tc->post : 1.0;
                CHECK_OK(mfsdp_ctx_reduce_params(ctx, gg, tc->drop ? mask : NULL, in, out, l->count,
                                                 l->wire, tc->op, sc, post));
                g_counting = 0;
                /* The job's output: the collective's result (without its post-divide) on its
                 * sharded-tail slices, zero where owners manage the bytes. */
                for (size_t k = 0; k < l->n; k++) {
                    mfsdp_param_view_t pv;
                    CHECK_OK(mfsdp_ctx_get_param(ctx, m->groups[gg].params[l->idx[k]].name, &pv));
                    int64_t first = g_rank * l->c[k], rows = l->rows[k] - first;
                    rows = rows < 0 ? 0 : (rows > l->c[k] ? l->c[k] : rows);
                    for (int64_t e = 0; e < l->c[k] * l->rest[k]; e++) {
                        double got = get(out + l->o[k], l->wire, (size_t)e), want = 0.0;
                        if (pv.owner == MFSDP_OWNER_SHARDED && e < rows * l->rest[k]) {
                            want = reduced_ref(l, seed, gg, l->idx[k],
                                               (size_t)(first * l->rest[k] + e), tc->op, sc,
                                               micro_total);
                        }
                        double tol = pv.owner == MFSDP_OWNER_SHARDED
                                         ? (l->wire == MFSDP_FLOAT32 ? 1e-5 : 2e-2)
                                         : 0.0;
                        if (fabs(got - want) > tol * (fabs(want) + 1e-2)) {
                            CHECK(0, "%s: reduce output of %s element %lld: %g, want %g", what,
                                  m->groups[gg].params[l->idx[k]].name, (long long)e, got, want);
                            break;
                        }
                    }
                }
                if (tc->mode == MFSDP_STEP_EAGER && tc->accum > 1 && !tc->drop) {
                    if (mi == 0) {
                        calls_first[gg] = g_calls_total;
                    } else if (mi == tc->accum - 1) {
                        CHECK(g_calls_total == calls_first[gg],
                              "%s: group %zu reduce with eager step made %d MPI calls, without "
                              "%d",
                              what, gg, g_calls_total, calls_first[gg]);
                    }
                }
                free(in);
                free(out);
                /* Mid-backward with eager steps, the groups reduced so far have stepped and the
                 * others not: no consistent checkpoint (the shim's save rule without a
                 * sequence); once all have, there is one. */
                if (tc->mode == MFSDP_STEP_EAGER && tc->accum == 1 && !tc->drop && !job) {
                    int64_t at;
                    int mid = 0, eq = mfsdp_ckpt_ctx_boundary(ctx, 1, &at);
                    for (size_t h = 0; h < gg; h++) {
                        for (size_t i = 0; i < m->groups[h].nparams; i++) {
                            mid |= m->groups[h].params[i].requires_grad;
                        }
                    }
                    CHECK(eq == !mid && mfsdp_ckpt_ctx_boundary(ctx, 0, NULL) && at == step + 1,
                          "%s: step %d group %zu: boundary %d (step %lld), want %d", what, step, gg,
                          eq, (long long)at, !mid);
                }
                for (size_t k = 0; k < l->n; k++) {
                    ref_param_t *q = &R[gg][l->idx[k]];
                    q->had = 1;
                    for (int64_t e = 0; e < q->numel; e++) {
                        q->g[e] += reduced_ref(l, seed, gg, l->idx[k], (size_t)e, tc->op, sc,
                                               micro_total) /
                                   post;
                    }
                }
            }
        }
        if (tc->mode == MFSDP_STEP_MANUAL) { /* the job's optimizer.step(), its schedule */
            CHECK_OK(mfsdp_ctx_set_lr_factor(ctx, manual_factor(step)));
            CHECK_OK(mfsdp_ctx_step(ctx));
        }
        /* Reference step. */
        double f = tc->mode == MFSDP_STEP_MANUAL ? manual_factor(step)
                   : tc->schedule                ? sched_factor(step)
                                                 : 1.0;
        ref_step(m, R, f, tc->clip, job);
        if (tc->resume && step == nsteps / 2) {
            ctx = restart(ctx, m, tc, what);
        }
    }
    /* The last step is pending in a lazy context: flush it, counting MPI calls. */
    g_calls_total = g_calls_allreduce = g_calls_wait = 0;
    g_counting = 1;
    mfsdp_status_t st = mfsdp_ctx_flush(ctx);
    g_counting = 0;
    CHECK(st == MFSDP_OK, "%s: flush: %s", what, mfsdp_status_string(st));
    if (tc->mode == MFSDP_STEP_LAZY) {
        int want = tc->clip > 0 ? 1 : 0;
        CHECK(g_calls_total == want && g_calls_allreduce == want && g_calls_wait == 0,
              "%s: step made %d MPI calls (%d all-reduces, %d waits), expected %d", what,
              g_calls_total, g_calls_allreduce, g_calls_wait, want);
    }
    mfsdp_ctx_stats_t stats;
    CHECK_OK(mfsdp_ctx_get_stats(ctx, &stats));
    CHECK(stats.steps >= (uint64_t)nsteps, "%s: only %llu group steps", what,
          (unsigned long long)stats.steps);
    if (job) { /* the context holds no AdamW state: a checkpoint of it is refused */
        char log[1024] = "";
        mfsdp_log_capture_begin();
        st = mfsdp_ctx_save(ctx, "/nonexistent/mfsdp-ckpt");
        mfsdp_log_capture_end(log, sizeof(log));
        CHECK(st == MFSDP_ERR_UNSUPPORTED && strstr(log, "tail is \"job\"") != NULL,
              "%s: save with tail job: %s (%s)", what, mfsdp_status_string(st), log);
    }
    for (size_t g = 0; job && g < ng; g++) { /* no context state for the job's tensors */
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            mfsdp_param_view_t v;
            CHECK_OK(mfsdp_ctx_get_param(ctx, m->groups[g].params[i].name, &v));
            CHECK(v.role == MFSDP_ROLE_MUON || (v.local == 0 && v.master == NULL),
                  "%s: the context holds %s, a tensor of the job's", what,
                  m->groups[g].params[i].name);
        }
    }
    unsigned long long peak = stats.peak_bytes, maxpeak = 0;
    PMPI_Reduce(&peak, &maxpeak, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("%s: peak context bytes per rank (arena + staging) %llu\n", what, maxpeak);
    }

    double worst = compare_masters(ctx, m, R, &W, what);
    /* The write-back of masters into this rank's FSDP shard (the companion's checkpoints):
     * the reference's rows, zero padding, the job's own params untouched. */
    for (size_t g = 0; g < ng; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        size_t cnt = 0, off[8];
        for (size_t i = 0; i < gd->nparams; i++) {
            off[i] = cnt;
            cnt += (size_t)(LA[g].c[i] * LA[g].rest[i]);
        }
        float *block = malloc(cnt * sizeof(float) + 4);
        for (size_t e = 0; e < cnt; e++) {
            block[e] = -7.0f; /* a sentinel no weight holds */
        }
        CHECK_OK(mfsdp_ctx_scatter_masters(ctx, g, block, cnt));
        for (size_t i = 0; i < gd->nparams; i++) {
            ref_param_t *q = &R[g][i];
            int64_t first = g_rank * LA[g].c[i], rows = q->rows - first;
            rows = rows < 0 ? 0 : (rows > LA[g].c[i] ? LA[g].c[i] : rows);
            size_t valid = (size_t)(rows * LA[g].rest[i]);
            double nd = 0, nr = 1e-30;
            int bad_pad = 0, touched = 0;
            for (size_t e = 0; e < (size_t)(LA[g].c[i] * LA[g].rest[i]); e++) {
                float x = block[off[i] + e];
                if (job && !q->muon) {
                    touched |= x != -7.0f;
                } else if (e < valid) {
                    double d = x - q->w[(size_t)first * (size_t)LA[g].rest[i] + e];
                    nd += d * d;
                    nr += q->w[(size_t)first * (size_t)LA[g].rest[i] + e] *
                          q->w[(size_t)first * (size_t)LA[g].rest[i] + e];
                } else {
                    bad_pad |= x != 0.0f;
                }
            }
            CHECK(!touched, "%s: scatter_masters wrote %s, the job's own", what,
                  gd->params[i].name);
            CHECK(!bad_pad, "%s: scatter_masters left padding of %s non-zero", what,
                  gd->params[i].name);
            CHECK(sqrt(nd / nr) <= 1e-5, "%s: scatter_masters of %s is %.3g off the reference",
                  what, gd->params[i].name, sqrt(nd / nr));
        }
        free(block);
    }
    check_momentum(ctx, m, R, LA, what);
    double gworst = 0;
    PMPI_Allreduce(&worst, &gworst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("%s: max relative error vs float64 reference %.3g\n", what, gworst);
    }

    /* After training the all-gather must still be exactly FSDP's layout of the owners'
     * comm-dtype weights: rebuild full tensors from the owners and compare. */
    for (size_t g = 0; g < ng; g++) {
        void **full = calloc(m->groups[g].nparams, sizeof(void *));
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            size_t elt = mfsdp_dtype_size(p->dtype);
            mfsdp_param_view_t v;
            CHECK_OK(mfsdp_ctx_get_param(ctx, p->name, &v));
            full[i] = calloc((size_t)p->numel + 64, elt);
            if (job && v.owner < 0) {
                /* the job's own tensor: its shards (which this job never updates) travel */
                memcpy(full[i], W.w[g][i], (size_t)p->numel * elt);
            } else if (v.owner >= 0) {
                if (v.owner == g_rank) {
                    memcpy(full[i], v.comm, (size_t)p->numel * elt);
                }
                PMPI_Bcast(full[i], (int)((size_t)p->numel * elt), MPI_BYTE, v.owner,
                           MPI_COMM_WORLD);
            } else {
                size_t sl = v.local_elems * elt;
                char *all = malloc(sl * (size_t)g_world + 1);
                PMPI_Allgather(v.comm, (int)sl, MPI_BYTE, all, (int)sl, MPI_BYTE, MPI_COMM_WORLD);
                memcpy(full[i], all, (size_t)p->numel * elt);
                free(all);
            }
        }
        check_allgather(ctx, m, g, full, (int)g % 2, what);
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            free(full[i]);
        }
        free(full);
    }

    mfsdp_ctx_destroy(&ctx);
    ref_free(m, R);
    free(calls_first);
    free(LA);
    free(LR);
    free_weights(m, &W);
    manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * 4. Errors: same status on every rank, clear messages, no hang
 */
static void expect_status(mfsdp_status_t got, mfsdp_status_t want, const char *log,
                          const char *needle, const char *what)
{
    CHECK(got == want, "%s: got %s, expected %s", what, mfsdp_status_string(got),
          mfsdp_status_string(want));
    CHECK(needle == NULL || strstr(log, needle) != NULL, "%s: log lacks '%s': %s", what, needle,
          log);
    int mine = (int)got, lo = 0, hi = 0;
    PMPI_Allreduce(&mine, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    PMPI_Allreduce(&mine, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    CHECK(lo == hi, "%s: ranks disagree (%d..%d)", what, lo, hi);
}

/* One 2048 x 2048 float32 matrix: its owner's arena (master, comm copy, gradient, momentum)
 * is about 64 MiB, the other ranks' nearly nothing. */
static void test_local_failure(void)
{
    static const char text[] =
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", \"params\": "
        "[{\"name\": \"w\", \"shape\": [2048, 2048], \"dtype\": \"float32\"}]}]}";
    mfsdp_manifest_t *big = NULL;
    char err[256];
    CHECK_OK(mfsdp_manifest_parse(text, strlen(text), "inline", err, sizeof(err), &big));
    if (big == NULL) {
        return;
    }
    long pages = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f != NULL) {
        CHECK(fscanf(f, "%ld", &pages) == 1, "cannot read /proc/self/statm");
        fclose(f);
    }
    /* The largest address space of any rank, plus 32 MiB: the same limit everywhere. */
    long mine = pages * sysconf(_SC_PAGESIZE), most = 0;
    PMPI_Allreduce(&mine, &most, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
    struct rlimit saved, lim;
    CHECK(getrlimit(RLIMIT_AS, &saved) == 0, "getrlimit: %s", strerror(errno));
    lim = saved;
    lim.rlim_cur = (rlim_t)most + ((rlim_t)32 << 20);
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.no_mlock = 1;
    mfsdp_ctx_h ctx = NULL;
    capture_begin();
    CHECK(setrlimit(RLIMIT_AS, &lim) == 0, "setrlimit: %s", strerror(errno));
    mfsdp_status_t st = create_world(big, &o, &ctx);
    CHECK(setrlimit(RLIMIT_AS, &saved) == 0, "setrlimit: %s", strerror(errno));
    const char *log = capture_end();
    int owner = strstr(log, "cannot map the") != NULL;
    int owners = 0;
    PMPI_Allreduce(&owner, &owners, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(owners == 1, "one rank (the owner) should fail to map its arena, %d did", owners);
    expect_status(st, MFSDP_ERR_NO_MEMORY, log, owner ? "cannot map the" : "failed on another rank",
                  "one rank's failure agreed");
    CHECK(ctx == NULL, "ctx written on failure");
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(big);
}

static void test_errors(void)
{
    mfsdp_manifest_t *m = random_manifest(7);
    mfsdp_status_t st;
    const char *log;

    /* Manifest world size differs from the communicator. */
    m->world_size = g_world + 1;
    mfsdp_ctx_h ctx = NULL;
    capture_begin();
    st = create_world(m, NULL, &ctx);
    log = capture_end();
    expect_status(st, MFSDP_ERR_MISMATCH, log, "communicator has", "world size mismatch");
    CHECK(ctx == NULL, "ctx written on failure");
    m->world_size = g_world;

    /* Eager step with clipping. */
    capture_begin();
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.has_step_mode = 1;
    o.step_mode = MFSDP_STEP_EAGER;
    o.has_clip = 1;
    o.clip = 1.0;
    st = create_world(m, &o, &ctx);
    log = capture_end();
    expect_status(st, MFSDP_ERR_INVALID_ARG, log, "lazy", "eager + clip");

    /* Options given in code differ on one rank (a chain chunk): compared before anything
     * else, one mismatch on every rank. */
    memset(&o, 0, sizeof(o));
    o.chain_chunk = g_rank == 0 ? 2 : 0;
    capture_begin();
    st = create_world(m, &o, &ctx);
    log = capture_end();
    if (g_world > 1) {
        expect_status(st, MFSDP_ERR_MISMATCH, log, "the context options (mfsdp_ctx_opts_t) differs",
                      "one rank's options");
    } else { /* nothing to differ from: the chunk itself is refused */
        expect_status(st, MFSDP_ERR_INVALID_ARG, log, "chain chunk of 2 bytes", "a 2-byte chunk");
    }
    CHECK(ctx == NULL, "ctx written on failure");

    /* A failure on one rank only (out of memory: every rank runs under the same address-space
     * limit, which leaves room for the small arenas but not for the owner's) fails every rank
     * alike: the outcome of creation is agreed. */
    test_local_failure();

    /* Defaults come from the environment (set in main before the first call). */
    st = create_world(m, NULL, &ctx);
    CHECK(st == MFSDP_OK, "create with defaults: %s", mfsdp_status_string(st));
    if (st == MFSDP_OK) {
        mfsdp_ctx_stats_t s;
        CHECK_OK(mfsdp_ctx_get_stats(ctx, &s));
        CHECK(s.gather_algo == MFSDP_ALGO_CHAIN && s.reduce_algo == MFSDP_ALGO_NATIVE,
              "MFSDP_GATHER_ALGO/MFSDP_REDUCE_ALGO ignored: %d %d", (int)s.gather_algo,
              (int)s.reduce_algo);
        CHECK(s.step_mode == MFSDP_STEP_EAGER && s.accum_steps == 1 && s.world == g_world,
              "defaults: mode %d accum %d world %d", (int)s.step_mode, s.accum_steps, s.world);
        CHECK(s.peak_bytes >= s.staging_bytes, "peak %zu < staging %zu", s.peak_bytes,
              s.staging_bytes);
        mfsdp_ctx_destroy(&ctx);
    }

    ctx = make_ctx(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_ALGO_DIRECT, MFSDP_STEP_LAZY, 1,
                   0.0);
    if (ctx == NULL) {
        manifest_free(m);
        return;
    }
    lay_t l, lr;
    layout_of(&m->groups[0], 0, g_world, &l);
    layout_of(&m->groups[0], 1, g_world, &lr);
    char *buf = calloc((size_t)g_world + 1, l.S + lr.S + 16);
    char *out = calloc(1, lr.S + 16);

    capture_begin();
    st = mfsdp_ctx_allgather(ctx, 0, buf, buf + l.S * (size_t)g_world, l.count + 1, l.wire);
    log = capture_end();
    expect_status(st, MFSDP_ERR_MISMATCH, log, "the plan expects", "allgather wrong count");

    capture_begin();
    st = mfsdp_ctx_allgather(ctx, 0, buf, buf + l.S * (size_t)g_world, l.count,
                             l.wire == MFSDP_FLOAT16 ? MFSDP_FLOAT32 : MFSDP_FLOAT16);
    log = capture_end();
    expect_status(st, MFSDP_ERR_MISMATCH, log, "the plan expects", "allgather wrong dtype");

    capture_begin();
    st = mfsdp_ctx_allgather(ctx, m->ngroups, buf, buf, l.count, l.wire);
    log = capture_end();
    expect_status(st, MFSDP_ERR_INVALID_ARG, log, "out of range", "allgather bad group");

    if (lr.n != 0) {
        capture_begin();
        st = mfsdp_ctx_reduce(ctx, 0, buf, out, lr.count + 3, lr.wire, MFSDP_OP_SUM, 1.0);
        log = capture_end();
        expect_status(st, MFSDP_ERR_MISMATCH, log, "the plan expects", "reduce wrong count");
    }
    capture_begin();
    st = mfsdp_ctx_reduce(ctx, 0, buf, out, lr.count, lr.wire, (mfsdp_redop_t)9, 1.0);
    log = capture_end();
    expect_status(st, MFSDP_ERR_INVALID_ARG, log, "unknown reduction op", "reduce bad op");

    capture_begin();
    mfsdp_param_view_t v;
    st = mfsdp_ctx_get_param(ctx, "no.such.param", &v);
    log = capture_end();
    expect_status(st, MFSDP_ERR_NOT_FOUND, log, "no.such.param", "unknown param");

    mfsdp_ctx_destroy(&ctx);
    CHECK(ctx == NULL, "destroy did not clear the handle");
    capture_begin();
    st = mfsdp_ctx_allgather(ctx, 0, buf, buf + l.S * (size_t)g_world, l.count, l.wire);
    log = capture_end();
    expect_status(st, MFSDP_ERR_STATE, log, "destroyed", "allgather after destroy");
    capture_begin();
    st = mfsdp_ctx_reduce(ctx, 0, buf, out, lr.count, lr.wire, MFSDP_OP_SUM, 1.0);
    log = capture_end();
    expect_status(st, MFSDP_ERR_STATE, log, "destroyed", "reduce after destroy");
    capture_begin();
    st = mfsdp_ctx_step(ctx);
    log = capture_end();
    expect_status(st, MFSDP_ERR_STATE, log, "destroyed", "step after destroy");
    mfsdp_ctx_destroy(&ctx); /* harmless */

    free(buf);
    free(out);
    manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * 4. HSDP: a 2-D mesh of 2 replicas x (world / 2) shard ranks. The job reduce-scatters (avg)
 *    in its shard group and all-reduces (avg) over its replicate group; the owners' masters
 *    must follow the float64 reference on the average over every rank's contribution.
 */
static void test_hsdp(uint64_t seed, mfsdp_tail_policy_t tail, int drop)
{
    if (g_world % 2 != 0) {
        return; /* 1 and 3 ranks: no mesh with 2 replicas */
    }
    const int nsteps = 8, shard = g_world / 2, grank = g_rank, gworld = g_world;
    MPI_Comm sc, rc;
    PMPI_Comm_split(MPI_COMM_WORLD, grank / shard, grank, &sc); /* consecutive ranks */
    PMPI_Comm_split(MPI_COMM_WORLD, grank % shard, grank, &rc); /* same position */
    mfsdp_manifest_t *m = random_manifest(seed);
    m->replicate = 2;
    weights_t W = make_weights(m, seed);
    char what[128];
    snprintf(what, sizeof(what), "hsdp seed %llu 2 x %d tail %s%s", (unsigned long long)seed, shard,
             tail == MFSDP_TAIL_JOB     ? "job"
             : tail == MFSDP_TAIL_SHARD ? "shard"
                                        : "owner",
             drop ? " drop" : "");
    mfsdp_ctx_opts_t o = tail_step_opts(tail, MFSDP_STEP_EAGER);
    o.gather_algo = MFSDP_ALGO_DIRECT;
    o.reduce_algo = MFSDP_ALGO_CHAIN;
    o.chain_chunk = 64;
    o.accum_steps = 1;
    o.has_clip = 1;
    mfsdp_ctx_h ctx = NULL;
#ifdef TEST_TRANSPORT_NCCL
    /* the same mesh as ncclCommSplit twins of the NCCL world communicator */
    ncclComm_t nsc = NULL, nrc = NULL;
    ncclCommSplit(g_ncomm, grank / shard, grank, &nsc, NULL);
    ncclCommSplit(g_ncomm, grank % shard, grank, &nrc, NULL);
    mfsdp_status_t st = mfsdp_ctx_create_nccl(m, &o, nsc, &ctx);
    CHECK(st == MFSDP_OK, "%s: create: %s", what, mfsdp_status_string(st));
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_attach_replicate_nccl(ctx, nrc);
        CHECK(st == MFSDP_OK, "%s: attach: %s", what, mfsdp_status_string(st));
    }
    if (st == MFSDP_OK) {
        /* a second attach is refused, as over MPI */
        setenv("MFSDP_DEBUG", "NONE", 1);
        mfsdp_log_reinit();
        mfsdp_status_t again = mfsdp_ctx_attach_replicate_nccl(ctx, nrc);
        setenv("MFSDP_DEBUG", "WARN", 1);
        mfsdp_log_reinit();
        CHECK(again == MFSDP_ERR_STATE, "%s: second attach: %s", what, mfsdp_status_string(again));
    }
#else
    mfsdp_status_t st = mfsdp_ctx_create_mpi(m, &o, sc, &ctx);
    CHECK(st == MFSDP_OK, "%s: create: %s", what, mfsdp_status_string(st));
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_attach_replicate_mpi(ctx, rc);
        CHECK(st == MFSDP_OK, "%s: attach: %s", what, mfsdp_status_string(st));
    }
#endif
    if (st != MFSDP_OK) {
        mfsdp_ctx_destroy(&ctx);
        free_weights(m, &W);
        manifest_free(m);
        PMPI_Comm_free(&sc);
        PMPI_Comm_free(&rc);
#ifdef TEST_TRANSPORT_NCCL
        ncclCommDestroy(nsc);
        ncclCommDestroy(nrc);
#endif
        return;
    }
    /* The FSDP layout helpers work at the shard group's size. */
    int srank = 0;
    PMPI_Comm_rank(sc, &srank);
    g_world = shard;
    g_rank = srank;
    int job = tail == MFSDP_TAIL_JOB;
    ref_param_t **R = ref_create(m, &W);
    for (int step = 0; step < nsteps; step++) {
        for (size_t g = 0; g < m->ngroups; g++) {
            lay_t l;
            layout_of(&m->groups[g], 0, shard, &l);
            char *recv = malloc(l.S * (size_t)shard + 1);
            char *send = calloc(1, l.S + 1);
            build_shard(&l, W.w[g], srank, send);
            CHECK_OK(mfsdp_ctx_allgather(ctx, g, send, recv, l.count, l.wire));
            free(recv);
            free(send);
        }
        for (size_t g = m->ngroups; g-- > 0;) {
            unsigned char mask[8];
            lay_t l;
            if (drop) {
                drop_mask(&m->groups[g], seed, g, step, mask);
            }
            layout_of_masked(&m->groups[g], 1, shard, drop ? mask : NULL, &l);
            if (l.n == 0) {
                continue;
            }
            /* every global rank contributes its own gradient */
            char *in = rs_input(m, g, &l, seed, grank, step);
            char *out = malloc(l.S + 1), *red = malloc(l.S + 1);
            CHECK_OK(mfsdp_ctx_reduce_params(ctx, g, drop ? mask : NULL, in, out, l.count, l.wire,
                                             MFSDP_OP_AVG, 1.0, 1.0));
            CHECK_OK(mfsdp_ctx_replicate(ctx, g, out, red, l.count, l.wire, MFSDP_OP_AVG, 1.0));
            /* The job's view of the all-reduce: zero where owners manage the bytes, its
             * sharded-tail slices averaged over every rank, as its own all-reduce would. */
            for (size_t k = 0; k < l.n; k++) {
                const mfsdp_param_desc_t *p = &m->groups[g].params[l.idx[k]];
                mfsdp_param_view_t pv;
                CHECK_OK(mfsdp_ctx_get_param(ctx, p->name, &pv));
                int mine = pv.owner == MFSDP_OWNER_SHARDED;
                int64_t first = srank * l.c[k];
                int64_t nrows = l.rows[k] - first;
                nrows = nrows < 0 ? 0 : (nrows > l.c[k] ? l.c[k] : nrows);
                for (int64_t e = 0; e < l.c[k] * l.rest[k]; e++) {
                    double got = get(red + l.o[k], l.wire, (size_t)e), want = 0.0;
                    if (mine && e < nrows * l.rest[k]) {
                        for (int r = 0; r < gworld; r++) {
                            char tmp[4];
                            put(tmp, l.wire, 0,
                                contrib(seed, r, g, l.idx[k], (size_t)(first * l.rest[k] + e),
                                        step));
                            want += get(tmp, l.wire, 0);
                        }
                        want /= gworld;
                    }
                    double tol = mine ? (l.wire == MFSDP_FLOAT32 ? 1e-6 : 2e-2) : 0.0;
                    if (fabs(got - want) > tol * (fabs(want) + 1e-3)) {
                        CHECK(0, "%s: replicate output of %s element %lld: %g, want %g", what,
                              p->name, (long long)e, got, want);
                        break;
                    }
                }
            }
            free(in);
            free(out);
            free(red);
            for (size_t k = 0; k < l.n; k++) {
                ref_param_t *q = &R[g][l.idx[k]];
                q->had = 1;
                for (int64_t e = 0; e < q->numel; e++) {
                    double sum = 0;
                    for (int r = 0; r < gworld; r++) {
                        char tmp[4];
                        put(tmp, l.wire, 0, contrib(seed, r, g, l.idx[k], (size_t)e, step));
                        sum += get(tmp, l.wire, 0);
                    }
                    q->g[e] += sum / gworld;
                }
            }
        }
        ref_step(m, R, 1.0, 0.0, job);
    }
    double worst = compare_masters(ctx, m, R, &W, what);
    /* the replicas' owners hold bitwise the same masters */
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            mfsdp_param_view_t v;
            CHECK_OK(mfsdp_ctx_get_param(ctx, m->groups[g].params[i].name, &v));
            if (!v.local || v.master == NULL) {
                continue;
            }
            float *other = malloc(v.local_elems * sizeof(float) + 4);
            int peer = 0, rr = 0;
            PMPI_Comm_rank(rc, &rr);
            peer = 1 - rr;
            PMPI_Sendrecv(v.master, (int)v.local_elems, MPI_FLOAT, peer, 7, other,
                          (int)v.local_elems, MPI_FLOAT, peer, 7, rc, MPI_STATUS_IGNORE);
            CHECK(memcmp(other, v.master, v.local_elems * sizeof(float)) == 0,
                  "%s: %s differs between the replicas", what, m->groups[g].params[i].name);
            free(other);
        }
    }
    /* A reduce must be followed by its replicate all-reduce: every rank refuses the next
     * all-gather alike. */
    lay_t l;
    layout_of(&m->groups[0], 1, shard, &l);
    if (l.n > 0) {
        char *in = rs_input(m, 0, &l, seed, grank, 99), *out = malloc(l.S + 1);
        CHECK_OK(mfsdp_ctx_reduce(ctx, 0, in, out, l.count, l.wire, MFSDP_OP_AVG, 1.0));
        layout_of(&m->groups[0], 0, shard, &l);
        char *recv = malloc(l.S * (size_t)shard + 1), *send = calloc(1, l.S + 1);
        setenv("MFSDP_DEBUG", "NONE", 1);
        mfsdp_log_reinit();
        st = mfsdp_ctx_allgather(ctx, 0, send, recv, l.count, l.wire);
        setenv("MFSDP_DEBUG", "WARN", 1);
        mfsdp_log_reinit();
        CHECK(st == MFSDP_ERR_STATE, "%s: all-gather before the replicate all-reduce: %s", what,
              mfsdp_status_string(st));
        free(in);
        free(out);
        free(recv);
        free(send);
    }
    g_world = gworld;
    g_rank = grank;
    double gw = 0;
    PMPI_Allreduce(&worst, &gw, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("%s: max relative error vs float64 reference %.3g\n", what, gw);
    }
    mfsdp_ctx_destroy(&ctx);
    ref_free(m, R);
    free_weights(m, &W);
    manifest_free(m);
    PMPI_Comm_free(&sc);
    PMPI_Comm_free(&rc);
#ifdef TEST_TRANSPORT_NCCL
    ncclCommDestroy(nsc); /* borrowed by the context: freed after it */
    ncclCommDestroy(nrc);
#endif
}

/* HSDP with a sharded tail larger than the staging region (the budget cuts it into passes):
 * the replicate all-reduce goes through the region in windows. Every global rank r contributes
 * r + 1 to every tail element, so each element of the job's output and of the owners' slice
 * gradient must be exactly the sum over ranks (small integers, exact in fp32). */
/* Options of a context with manual steps and direct collectives under the given tail. */
static mfsdp_ctx_opts_t manual_direct_opts(mfsdp_tail_policy_t tail)
{
    mfsdp_ctx_opts_t o = tail_step_opts(tail, MFSDP_STEP_MANUAL);
    o.gather_algo = MFSDP_ALGO_DIRECT;
    o.reduce_algo = MFSDP_ALGO_DIRECT;
    return o;
}

static void test_hsdp_big_tail(void)
{
    if (g_world % 2 != 0) {
        return;
    }
#ifdef TEST_TRANSPORT_NCCL
    return; /* the window loop is the transport's caller's: over MPI only */
#endif
    const long T = 20000; /* 1-D tail elements: 40 KB per rank at 2 ranks */
    int shard = g_world / 2, srank = 0;
    MPI_Comm sc, rc;
    PMPI_Comm_split(MPI_COMM_WORLD, g_rank / shard, g_rank, &sc);
    PMPI_Comm_split(MPI_COMM_WORLD, g_rank % shard, g_rank, &rc);
    PMPI_Comm_rank(sc, &srank);
    char js[512];
    snprintf(js, sizeof(js),
             "{\"format\": \"mfsdp-manifest/1\", \"replicate\": 2, \"groups\": [{\"name\": "
             "\"g\", \"params\": [{\"name\": \"w\", \"shape\": [8, 8], \"dtype\": \"float32\"}, "
             "{\"name\": \"n\", \"shape\": [%ld], \"dtype\": \"float32\"}]}]}",
             T);
    mfsdp_manifest_t *m = NULL;
    char err[256];
    CHECK_OK(mfsdp_manifest_parse(js, strlen(js), "big tail", err, sizeof(err), &m));
    mfsdp_ctx_opts_t o = manual_direct_opts(MFSDP_TAIL_SHARD);
    o.staging_bytes = 65536;
    mfsdp_ctx_h ctx = NULL;
    CHECK_OK(mfsdp_ctx_create_mpi(m, &o, sc, &ctx));
    CHECK_OK(mfsdp_ctx_attach_replicate_mpi(ctx, rc));
    mfsdp_ctx_stats_t stats;
    CHECK_OK(mfsdp_ctx_get_stats(ctx, &stats));
    const long c = (T + shard - 1) / shard, cw = (8 + shard - 1) / shard;
    const size_t S = (size_t)(cw * 8 + c);
    CHECK((size_t)c * sizeof(float) > stats.comm_staging_bytes,
          "big tail: %ld tail floats per rank fit the %zu staged bytes: no windows", c,
          stats.comm_staging_bytes);
    float *send = calloc(S, sizeof(float)), *recv = calloc(S * (size_t)shard, sizeof(float));
    float *in = calloc(S * (size_t)shard, sizeof(float)), *out = calloc(S, sizeof(float));
    float *red = calloc(S, sizeof(float));
    CHECK_OK(mfsdp_ctx_allgather(ctx, 0, send, recv, S, MFSDP_FLOAT32));
    for (int r = 0; r < shard; r++) {
        for (long e = 0; e < c && r * c + e < T; e++) {
            in[(size_t)r * S + (size_t)(cw * 8 + e)] = (float)(g_rank + 1);
        }
    }
    CHECK_OK(mfsdp_ctx_reduce(ctx, 0, in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
    CHECK_OK(mfsdp_ctx_replicate(ctx, 0, out, red, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
    const float want = (float)(g_world * (g_world + 1) / 2);
    long bad = 0;
    mfsdp_param_view_t v;
    CHECK_OK(mfsdp_ctx_get_param(ctx, "n", &v));
    for (size_t e = 0; v.grad != NULL && e < v.local_valid; e++) {
        bad += v.grad[e] != want;
    }
    for (long e = 0; e < c && srank * c + e < T; e++) {
        bad += red[cw * 8 + e] != want;
    }
    CHECK(bad == 0, "big tail: %ld tail elements differ from %g after the replicate all-reduce",
          bad, (double)want);
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);
    free(send);
    free(recv);
    free(in);
    free(out);
    free(red);
    PMPI_Comm_free(&sc);
    PMPI_Comm_free(&rc);
}

/* An owner that rewrites its weights while a node peer still copies them from its shared
 * arena. One group of one matrix (so its owner reads nothing in the gather and does not wait
 * there); manual steps, no clipping (the step runs no collective). After a gather and a reduce,
 * one reader sleeps before the next gather while the owner gathers and steps at once: the
 * owner's step must wait for the reader's copy (transport quiesce), so the reader's second
 * gather still holds the first one's weights, and the third the stepped ones. */
#ifndef TEST_TRANSPORT_NCCL
static void test_shm_writer_waits(void)
{
    if (!g_shm_expect) {
        return;
    }
    char js[512];
    snprintf(js, sizeof(js),
             "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", \"params\": "
             "[{\"name\": \"w\", \"shape\": [%d, 32], \"dtype\": \"float32\"}]}]}",
             16 * g_world);
    mfsdp_manifest_t *m = NULL;
    char err[256];
    CHECK_OK(mfsdp_manifest_parse(js, strlen(js), "writer waits", err, sizeof(err), &m));
    mfsdp_ctx_opts_t o = manual_direct_opts(MFSDP_TAIL_OWNER);
    mfsdp_ctx_h ctx = NULL;
    CHECK_OK(mfsdp_ctx_create_mpi(m, &o, MPI_COMM_WORLD, &ctx));
    if (ctx == NULL) {
        mfsdp_manifest_free(m);
        return;
    }
    const size_t S = 16 * 32, T = S * (size_t)g_world;
    float *send = malloc(S * sizeof(float)), *in = malloc(T * sizeof(float));
    float *out = malloc(S * sizeof(float)), *recv[3];
    for (int k = 0; k < 3; k++) {
        recv[k] = malloc(T * sizeof(float));
    }
    for (size_t e = 0; e < S; e++) {
        send[e] = 0.001f * (float)((size_t)g_rank * S + e + 1);
    }
    for (size_t e = 0; e < T; e++) {
        in[e] = 0.5f - 0.001f * (float)(e % 997);
    }
    mfsdp_param_view_t v;
    CHECK_OK(mfsdp_ctx_get_param(ctx, "w", &v));
    const int reader = (v.owner + 1) % g_world;
    CHECK_OK(mfsdp_ctx_allgather(ctx, 0, send, recv[0], S, MFSDP_FLOAT32));
    CHECK_OK(mfsdp_ctx_reduce(ctx, 0, in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
    if (g_rank == reader) {
        usleep(300000);
    }
    CHECK_OK(mfsdp_ctx_allgather(ctx, 0, send, recv[1], S, MFSDP_FLOAT32));
    CHECK_OK(mfsdp_ctx_step(ctx));
    CHECK_OK(mfsdp_ctx_allgather(ctx, 0, send, recv[2], S, MFSDP_FLOAT32));
    CHECK(memcmp(recv[0], recv[1], T * sizeof(float)) == 0,
          "writer waits: rank %d (owner %d) gathered weights the owner's later step wrote", g_rank,
          v.owner);
    CHECK(memcmp(recv[1], recv[2], T * sizeof(float)) != 0,
          "writer waits: the step did not change the weights (the check above proves nothing)");
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);
    free(send);
    free(in);
    free(out);
    for (int k = 0; k < 3; k++) {
        free(recv[k]);
    }
}
#endif

/* A group that gets no gradient in a window. Two groups a and b of one [4] fp32 AdamW param
 * each (tail owner). Eager, accumulating 2: b's second micro-step reduces with no param
 * flagged; it still counts, so b steps at the window's end with a (2 group steps, not 1).
 * Lazy: in iteration 1 only a reduces; a's reduce in iteration 2 would merge two windows into
 * one step and is refused alike on every rank, naming b. Manual: b's first step, in the job's
 * third, follows the schedule at the job's step. */
static mfsdp_ctx_h skip_ctx(mfsdp_manifest_t **m_p, mfsdp_step_mode_t mode, int accum)
{
    /* AdamW lr 0.1 under a linear warm-up over 4 steps: f(t) = (t + 1) / 5 */
    const char *js = "{\"format\": \"mfsdp-manifest/1\", \"optimizer\": {\"adamw\": {\"lr\": "
                     "0.1}, \"schedule\": {\"kind\": \"warmup-linear\", \"warmup_steps\": 4, "
                     "\"decay_steps\": 0}}, \"groups\": ["
                     "{\"name\": \"a\", \"params\": [{\"name\": \"a.n\", \"shape\": [4], "
                     "\"dtype\": \"float32\"}]}, "
                     "{\"name\": \"b\", \"params\": [{\"name\": \"b.n\", \"shape\": [4], "
                     "\"dtype\": \"float32\"}]}]}";
    char err[256];
    CHECK_OK(mfsdp_manifest_parse(js, strlen(js), "skip", err, sizeof(err), m_p));
    mfsdp_ctx_opts_t o = tail_step_opts(MFSDP_TAIL_OWNER, mode);
    o.accum_steps = accum;
    mfsdp_ctx_h ctx = NULL;
    CHECK_OK(create_world(*m_p, &o, &ctx));
    return ctx;
}

/* One iteration on skip_ctx's context: both groups gathered, then b (when reduce_b) and a
 * reduced (the backward's order). */
typedef struct skip_bufs {
    size_t S;
    float *send, *recv, *in, *out;
} skip_bufs_t;

static void skip_gather(mfsdp_ctx_h ctx, const skip_bufs_t *b)
{
    for (size_t g = 0; g < 2; g++) {
        CHECK_OK(mfsdp_ctx_allgather(ctx, g, b->send, b->recv, b->S, MFSDP_FLOAT32));
    }
}

static void skip_iteration(mfsdp_ctx_h ctx, const skip_bufs_t *b, int reduce_b)
{
    skip_gather(ctx, b);
    if (reduce_b) {
        CHECK_OK(mfsdp_ctx_reduce(ctx, 1, b->in, b->out, b->S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
    }
    CHECK_OK(mfsdp_ctx_reduce(ctx, 0, b->in, b->out, b->S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
}

static void test_skipped_group(void)
{
    const size_t S = (size_t)((4 + g_world - 1) / g_world);
    float *send = calloc(S, sizeof(float)), *recv = calloc(S * (size_t)g_world, sizeof(float));
    float *in = calloc(S * (size_t)g_world, sizeof(float)), *out = calloc(S, sizeof(float));
    for (size_t i = 0; i < S * (size_t)g_world; i++) {
        in[i] = 0.125f * (float)(i + 1);
    }
    const skip_bufs_t bufs = {S, send, recv, in, out};
    mfsdp_manifest_t *m = NULL;
    mfsdp_ctx_h ctx = skip_ctx(&m, MFSDP_STEP_EAGER, 2);
    const unsigned char none = 0;
    if (ctx != NULL) {
        skip_gather(ctx, &bufs);
    }
    for (int micro = 0; micro < 2 && ctx != NULL; micro++) {
        CHECK_OK(mfsdp_ctx_reduce(ctx, 1, in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
        /* the empty subset's FSDP buffers hold nothing: count 0 */
        CHECK_OK(mfsdp_ctx_reduce_params(ctx, 0, micro == 0 ? NULL : &none, in, out,
                                         micro == 0 ? S : 0, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0,
                                         1.0));
    }
    mfsdp_ctx_stats_t st;
    CHECK_OK(mfsdp_ctx_get_stats(ctx, &st));
    CHECK(st.steps == 2,
          "skipped group, eager: %llu group steps after the window, want 2 (a's "
          "micro-step without a gradient must count)",
          (unsigned long long)st.steps);
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);

    ctx = skip_ctx(&m, MFSDP_STEP_LAZY, 1);
    for (int it = 0; it < 2 && ctx != NULL; it++) {
        skip_iteration(ctx, &bufs, it == 0);
    }
    if (ctx != NULL) {
        skip_gather(ctx, &bufs);
        capture_begin();
        mfsdp_status_t rs = mfsdp_ctx_reduce(ctx, 0, in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0);
        const char *log = capture_end();
        CHECK(rs == MFSDP_ERR_STATE, "skipped group, lazy: a reduce into a complete window: %s",
              mfsdp_status_string(rs));
        CHECK(strstr(log, "because group b did not reduce in that window") != NULL,
              "skipped group, lazy: message: %s", log);
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);

    /* Lazy, a save inside the window (b reduced, a not yet): refused, and nothing stepped (it
     * stepped b alone before the refusal, a state no uninterrupted run reaches). */
    ctx = skip_ctx(&m, MFSDP_STEP_LAZY, 1);
    if (ctx != NULL) {
        skip_gather(ctx, &bufs);
        CHECK_OK(mfsdp_ctx_reduce(ctx, 1, in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
        char dir[64];
        long pid = (long)getpid();
        PMPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
        snprintf(dir, sizeof(dir), "/tmp/mfsdp-skip-save-%ld", pid);
        capture_begin();
        mfsdp_status_t sv = mfsdp_ctx_save(ctx, dir);
        const char *log = capture_end();
        CHECK(sv == MFSDP_ERR_STATE, "skipped group, lazy: a save inside the window: %s (%s)",
              mfsdp_status_string(sv), log);
        CHECK_OK(mfsdp_ctx_get_stats(ctx, &st));
        CHECK(st.steps == 0, "skipped group, lazy: the refused save stepped %llu group(s)",
              (unsigned long long)st.steps);
        PMPI_Barrier(MPI_COMM_WORLD);
        if (g_rank == 0) {
            rmdir(dir); /* created empty at most */
        }
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);

    /* Manual: a skipped step. A NaN gradient reduced into a, then zero_grads (the job's
     * zero_grad() without a step): a's gradient is exactly zero and the next step leaves its
     * weights alone. Then reload_weights: the owners take new shards at the next all-gather. */
    ctx = skip_ctx(&m, MFSDP_STEP_MANUAL, 1);
    if (ctx != NULL) {
        skip_gather(ctx, &bufs);
        float *nan_in = calloc(S * (size_t)g_world, sizeof(float));
        for (size_t i = 0; i < S * (size_t)g_world; i++) {
            nan_in[i] = NAN;
        }
        CHECK_OK(mfsdp_ctx_reduce(ctx, 0, nan_in, out, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0));
        CHECK_OK(mfsdp_ctx_zero_grads(ctx));
        mfsdp_param_view_t a;
        CHECK_OK(mfsdp_ctx_get_param(ctx, "a.n", &a));
        for (size_t e = 0; a.grad != NULL && e < a.local_valid; e++) {
            CHECK(a.grad[e] == 0.0f && !signbit(a.grad[e]),
                  "skipped step: a.n's gradient[%zu] = %g after zero_grads, want 0", e,
                  (double)a.grad[e]);
        }
        CHECK_OK(mfsdp_ctx_step(ctx));
        for (size_t e = 0; a.master != NULL && e < a.local_valid; e++) {
            CHECK(a.master[e] == 0.0f, "skipped step: a.n[%zu] = %g moved after zero_grads", e,
                  (double)a.master[e]);
        }
        for (size_t i = 0; i < S; i++) {
            send[i] = 3.5f; /* the job loads new weights into its shards */
        }
        CHECK_OK(mfsdp_ctx_reload_weights(ctx));
        skip_gather(ctx, &bufs);
        for (size_t e = 0; a.master != NULL && e < a.local_valid; e++) {
            CHECK(a.master[e] == 3.5f, "reload: a.n[%zu] = %g, want the loaded 3.5", e,
                  (double)a.master[e]);
        }
        size_t bad = 0;
        for (size_t i = 0; i < S * (size_t)g_world; i++) {
            bad += recv[i] != (i < 4 ? 3.5f : 0.0f); /* block-major rows 0..3, then padding */
        }
        CHECK(bad == 0, "reload: %zu elements of the all-gather differ from the loaded shards",
              bad);
        free(nan_in);
        for (size_t i = 0; i < S; i++) {
            send[i] = 0.0f;
        }
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);

    /* Manual steps: b gets its first gradient in the job's step 2, so its lr factor is f(2) =
     * 0.6 (the schedule follows the job's steps, not b's own count, f(0) = 0.2). A first AdamW
     * step moves each weight by lr x f x g / (|g| + eps), about -0.06 here. */
    ctx = skip_ctx(&m, MFSDP_STEP_MANUAL, 1);
    for (int it = 0; it < 3 && ctx != NULL; it++) {
        skip_iteration(ctx, &bufs, it == 2);
        CHECK_OK(mfsdp_ctx_step(ctx));
    }
    mfsdp_param_view_t v;
    CHECK_OK(mfsdp_ctx_get_param(ctx, "b.n", &v));
    for (size_t e = 0; v.master != NULL && e < v.local_valid; e++) {
        CHECK(fabs(v.master[e] + 0.06) < 1e-5,
              "skipped group, manual: b.n[%zu] = %.7f after its "
              "first step in the job's step 2, want -0.06",
              e, (double)v.master[e]);
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);
    free(send);
    free(recv);
    free(in);
    free(out);
}

#ifdef TEST_TRANSPORT_NCCL
/* MFSDP_TRANSPORT=mpi asks for the MPI transport: refused alike on every rank. */
static void test_transport_mpi(void)
{
    mfsdp_manifest_t *m = random_manifest(9);
    mfsdp_ctx_h ctx = NULL;
    capture_begin();
    mfsdp_status_t st = create_world(m, NULL, &ctx);
    const char *log = capture_end();
    expect_status(st, MFSDP_ERR_CONFIG, log, "MFSDP_TRANSPORT=mpi", "MFSDP_TRANSPORT=mpi");
    CHECK(ctx == NULL, "ctx written on failure");
    manifest_free(m);
}

/* MFSDP_NCCL_REGISTER=1: one arena from ncclMemAlloc, registered once, both released at
 * destroy (the training above ran on such arenas: ncclMemAlloc's memory is not zeroed, the
 * context zeroes it). */
static void test_registration(void)
{
    long a0 = 0, r0 = 0, a1 = 0, r1 = 0;
    mfsdp_fake_nccl_stats(&a0, &r0);
    mfsdp_manifest_t *m = random_manifest(11);
    mfsdp_ctx_h ctx =
        make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_STEP_LAZY, 1, 0.0);
    mfsdp_fake_nccl_stats(&a1, &r1);
    CHECK(a1 == a0 + 1 && r1 == r0 + 1, "live allocations %ld -> %ld, registrations %ld -> %ld", a0,
          a1, r0, r1);
    mfsdp_ctx_destroy(&ctx);
    mfsdp_fake_nccl_stats(&a1, &r1);
    CHECK(a1 == a0 && r1 == r0, "after destroy: %ld allocations, %ld registrations left", a1 - a0,
          r1 - r0);
    CHECK(a0 == 0 && r0 == 0, "leaks from earlier contexts: %ld allocations, %ld registrations", a0,
          r0);
    manifest_free(m);
}
#endif

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    setenv("MFSDP_MLOCK", "0", 0);
#ifndef TEST_TRANSPORT_NCCL
    /* Direct gathers read the owners' arenas on this node unless MFSDP_SHM=0 or the test
     * says the arenas cannot be shared (TEST_SHM_EXPECT=0: a /dev/shm too small for them). */
    const char *shm = getenv("MFSDP_SHM"), *expect = getenv("TEST_SHM_EXPECT");
    g_shm_expect = g_world > 1 && (shm == NULL || strcmp(shm, "0") != 0) &&
                   (expect == NULL || strcmp(expect, "0") != 0);
#endif
    setenv("MFSDP_GATHER_ALGO", "chain", 1);
    setenv("MFSDP_REDUCE_ALGO", "native", 1);
    const char *mode = argc > 1 && (argv[1][0] < '0' || argv[1][0] > '9') ? argv[1] : "";
    int nseeds = argc > 1 && mode[0] == '\0' ? atoi(argv[1]) : 5;
#ifdef TEST_TRANSPORT_NCCL
    if (strcmp(mode, "register") == 0) {
        /* registered arenas, on a non-blocking communicator (every call polled) */
        setenv("MFSDP_NCCL_REGISTER", "1", 1);
        g_register = 1;
    } else if (strcmp(mode, "transport-mpi") == 0) {
        setenv("MFSDP_TRANSPORT", "mpi", 1);
    } else if (mode[0] != '\0') {
        fprintf(stderr, "usage: test_runtime_nccl [NSEEDS | register | transport-mpi]\n");
        PMPI_Abort(MPI_COMM_WORLD, 2);
    }
    g_ncomm = nccl_world(g_register);
    if (strcmp(mode, "transport-mpi") == 0) {
        test_transport_mpi();
        goto done;
    }
    if (g_register) {
        test_allgather(1000);
        test_reduce(2000);
        static const train_cfg_t reg_cfgs[] = {
            {MFSDP_TAIL_SHARD, MFSDP_ALGO_CHAIN, MFSDP_ALGO_CHAIN, MFSDP_STEP_LAZY, 2, 0.5,
             MFSDP_OP_SUM, 0, 0, 0.0, 0},
            {MFSDP_TAIL_OWNER, MFSDP_ALGO_NATIVE, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1, 0.0,
             MFSDP_OP_AVG, 1, 0, 0.0, 0},
        };
        test_train(3100, &reg_cfgs[0]);
        test_train(3101, &reg_cfgs[1]);
        test_hsdp(4001, MFSDP_TAIL_SHARD, 1);
        test_registration();
        goto done;
    }
#else
    if (mode[0] != '\0') {
        fprintf(stderr, "usage: test_runtime [NSEEDS]\n");
        PMPI_Abort(MPI_COMM_WORLD, 2);
    }
#endif

    test_errors();
    for (int s = 0; s < nseeds; s++) {
        test_allgather(1000 + (uint64_t)s);
        test_reduce(2000 + (uint64_t)s);
    }
    /* Trailing fields left out are zero. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
    static const train_cfg_t cfgs[] = {
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_AVG},
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_CHAIN, MFSDP_ALGO_CHAIN, MFSDP_STEP_LAZY, 2, 0.5,
         MFSDP_OP_SUM},
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_NATIVE, MFSDP_ALGO_NATIVE, MFSDP_STEP_LAZY, 1, 0.0,
         MFSDP_OP_PREMULSUM},
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_ALGO_NATIVE, MFSDP_STEP_EAGER, 2, 0.0,
         MFSDP_OP_AVG},
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_CHAIN, MFSDP_ALGO_DIRECT, MFSDP_STEP_LAZY, 1, 2.0,
         MFSDP_OP_AVG},
        /* params without gradient in some reduces (unused this step), eager and lazy */
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_AVG, 1, 0},
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_CHAIN, MFSDP_ALGO_CHAIN, MFSDP_STEP_LAZY, 2, 0.7,
         MFSDP_OP_SUM, 1, 0},
        /* the manifest's lr schedule; the job's own factor with manual steps */
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_NATIVE, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_AVG, 0, 1},
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_ALGO_NATIVE, MFSDP_STEP_MANUAL, 2, 0.0,
         MFSDP_OP_PREMULSUM, 1, 0},
        /* tail "job": AdamW tensors stay the job's */
        {MFSDP_TAIL_JOB, MFSDP_ALGO_CHAIN, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_AVG, 1, 0},
        {MFSDP_TAIL_JOB, MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_STEP_MANUAL, 1, 0.0,
         MFSDP_OP_SUM, 0, 0},
        /* the job post-divides its reduce output (FSDP2's fp16 / force_sum paths) */
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_CHAIN, MFSDP_ALGO_NATIVE, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_SUM, 0, 0, 2.5},
        {MFSDP_TAIL_JOB, MFSDP_ALGO_DIRECT, MFSDP_ALGO_DIRECT, MFSDP_STEP_LAZY, 2, 0.0,
         MFSDP_OP_AVG, 1, 0, 1.5},
        /* a restart from a checkpoint halfway, with params that skipped steps before it */
        {MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_STEP_EAGER, 1, 0.0,
         MFSDP_OP_AVG, 1, 1, 0, 1},
        {MFSDP_TAIL_OWNER, MFSDP_ALGO_CHAIN, MFSDP_ALGO_DIRECT, MFSDP_STEP_LAZY, 2, 0.7,
         MFSDP_OP_SUM, 1, 0, 0, 1},
    };
#pragma GCC diagnostic pop
    for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++) {
        test_train(3000 + c, &cfgs[c]);
    }
    test_hsdp(4000, MFSDP_TAIL_OWNER, 0);
    test_hsdp(4001, MFSDP_TAIL_SHARD, 1);
    test_hsdp(4002, MFSDP_TAIL_JOB, 1);
    test_hsdp_big_tail();
    test_skipped_group();
#ifndef TEST_TRANSPORT_NCCL
    test_shm_writer_waits();
#endif

#ifdef TEST_TRANSPORT_NCCL
done:
    CHECK(g_mpi_calls == 0, "the NCCL path made %d MPI calls", g_mpi_calls);
    ncclCommDestroy(g_ncomm);
#endif
    int total = 0;
    PMPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("test_runtime: %d ranks, %d failures\n", g_world, total);
    }
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
