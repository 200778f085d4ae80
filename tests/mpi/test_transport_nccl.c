/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NCCL transport (transport/nccl.c) over the test NCCL library on host memory, run by
 * meson under mpirun at 1..4 ranks (MPI only bootstraps the unique id and checks results).
 *  - the function table: resolved from the pnccl* entry points, the test library marked as
 *    host memory; a table missing a function is refused;
 *  - small collectives and point-to-point batches (host values, executor memory), the same
 *    through the device-memory staging path (a CPU executor standing in for device memory),
 *    the stream of set_stream handed to every NCCL call;
 *  - op lists wave by wave on messages far above MPI's eager limit (64 KiB chunks, two
 *    owners of multi-window tensors: the case in which waves by dependency depth deadlock):
 *    the all-gather byte-exact in FSDP's layout (in place and staged receives, the tail in
 *    place as broadcasts and as one all-gather), the reduce bitwise the rank-ordered fp32 sum
 * (direct, chain) and within rounding (native), the tail's all-to-all byte-exact, for every
 * algorithm;
 *  - the sharded tail's buffers (gathered in place, no staging; the reduce's two staging
 *    blocks) refused alike by this transport and the MPI one;
 *  - errors: a failing call named with NCCL's text (MFSDP_ERR_TRANSPORT), a failing group
 *    end, an asynchronous error, calls in progress on a non-blocking communicator polled to
 *    completion, a call that never completes (timeout), a broken op list refused before any
 *    call (no hang), staging without an executor.
 * Prints the failures and "test_transport_nccl: N ranks, N failures".
 */
#include <math.h>
#include <mpi.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/algo_table.h"
#include "core/log.h"
#include "core/schedule.h"
#include "kernels/executor.h"
#include "mfsdp/kernels.h"
#include "transport/mpi.h"
#include "transport/nccl.h"

#include "tests/lib/mpi_check.h"

/* The same status on every rank, and the log names what failed. */
static void expect(mfsdp_status_t got, mfsdp_status_t want, const char *log, const char *needle,
                   const char *what)
{
    CHECK(got == want, "%s: got %s, expected %s", what, mfsdp_status_string(got),
          mfsdp_status_string(want));
    CHECK(needle == NULL || strstr(log, needle) != NULL, "%s: log lacks '%s': %s", what, needle,
          log);
    int mine = (int)got, lo = 0, hi = 0;
    MPI_Allreduce(&mine, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    CHECK(lo == hi, "%s: ranks disagree (%d..%d)", what, lo, hi);
}

/* ---------------------------------------------------------------------------------------
 * A table of wrappers around the real one: error injection, stream recording
 */
static const mfsdp_nccl_api_t *g_real;
static struct {
    int send_fail;          /* ncclSend returns ncclSystemError */
    int group_end_fail;     /* ncclGroupEnd runs the group, then returns ncclInternalError */
    int allreduce_progress; /* ncclAllReduce runs, then returns ncclInProgress */
    int async_error;        /* ncclCommGetAsyncError reports ncclRemoteError */
    cudaStream_t last_stream;
    long calls;
} inj;

static ncclResult_t w_send(const void *b, size_t c, ncclDataType_t d, int p, ncclComm_t comm,
                           cudaStream_t s)
{
    inj.last_stream = s;
    inj.calls++;
    return inj.send_fail ? ncclSystemError : g_real->Send(b, c, d, p, comm, s);
}

static ncclResult_t w_recv(void *b, size_t c, ncclDataType_t d, int p, ncclComm_t comm,
                           cudaStream_t s)
{
    inj.last_stream = s;
    inj.calls++;
    return g_real->Recv(b, c, d, p, comm, s);
}

static ncclResult_t w_group_end(void)
{
    ncclResult_t r = g_real->GroupEnd();
    return inj.group_end_fail && r == ncclSuccess ? ncclInternalError : r;
}

static ncclResult_t w_allreduce(const void *a, void *b, size_t c, ncclDataType_t d, ncclRedOp_t o,
                                ncclComm_t comm, cudaStream_t s)
{
    inj.last_stream = s;
    inj.calls++;
    ncclResult_t r = g_real->AllReduce(a, b, c, d, o, comm, s);
    return inj.allreduce_progress && r == ncclSuccess ? ncclInProgress : r;
}

static ncclResult_t w_allgather(const void *a, void *b, size_t c, ncclDataType_t d, ncclComm_t comm,
                                cudaStream_t s)
{
    inj.last_stream = s;
    inj.calls++;
    return g_real->AllGather(a, b, c, d, comm, s);
}

static ncclResult_t w_async(ncclComm_t comm, ncclResult_t *e)
{
    ncclResult_t r = g_real->CommGetAsyncError(comm, e);
    if (inj.async_error && r == ncclSuccess) {
        *e = ncclRemoteError;
    }
    return r;
}

static mfsdp_nccl_api_t wrapped(void)
{
    mfsdp_nccl_api_t a = *g_real;
    a.Send = w_send;
    a.Recv = w_recv;
    a.GroupEnd = w_group_end;
    a.AllReduce = w_allreduce;
    a.AllGather = w_allgather;
    a.CommGetAsyncError = w_async;
    return a;
}

static ncclComm_t make_comm(int nonblocking)
{
    ncclUniqueId id;
    if (g_rank == 0) {
        ncclGetUniqueId(&id);
    }
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t c = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = nonblocking ? 0 : 1;
    ncclResult_t r = ncclCommInitRankConfig(&c, g_world, id, g_rank, &cfg);
    CHECK(r == (nonblocking ? ncclInProgress : ncclSuccess), "init: %s", ncclGetErrorString(r));
    return c;
}

/* ---------------------------------------------------------------------------------------
 * 1. The table, small collectives, point-to-point, staging, streams
 */
static void test_api_and_small(ncclComm_t comm)
{
    const mfsdp_nccl_api_t *api = NULL;
    CHECK_OK(mfsdp_nccl_api_get(&api));
    CHECK(api->host_memory == 1, "the test library is not seen as host memory");
    CHECK((void *)api->AllGather == (void *)pncclAllGather &&
              (void *)api->GroupStart == (void *)pncclGroupStart &&
              (void *)api->CommRegister == (void *)pncclCommRegister,
          "the table does not hold the pnccl* entry points");
    const mfsdp_nccl_api_t *again = NULL;
    CHECK_OK(mfsdp_nccl_api_get(&again));
    CHECK(again == api, "resolved twice");

    mfsdp_nccl_api_t w = wrapped();
    mfsdp_transport_t *t = NULL;
    CHECK_OK(mfsdp_transport_nccl_create(comm, &w, &t));
    if (t == NULL) {
        return;
    }
    CHECK(t->rank == g_rank && t->world == g_world, "rank %d/%d", t->rank, t->world);
    CHECK(mfsdp_transport_nccl_comm(t) == comm, "comm accessor");
    void *stream = (void *)(uintptr_t)0x5eed;
    CHECK_OK(t->ops->set_stream(t, stream));

    double d = g_rank + 0.5;
    CHECK_OK(t->ops->allreduce_sum(t, &d));
    CHECK(d == g_world * (g_world - 1) / 2.0 + 0.5 * g_world, "allreduce_sum %g", d);
    CHECK(inj.last_stream == (cudaStream_t)stream, "the stream did not reach ncclAllReduce");
    uint64_t u[3] = {(uint64_t)g_rank, 100 - (uint64_t)g_rank, 7};
    CHECK_OK(t->ops->allreduce_u64(t, u, 3, 1));
    CHECK(u[0] == (uint64_t)g_world - 1 && u[1] == 100 && u[2] == 7, "u64 max");
    u[0] = (uint64_t)g_rank + 3;
    CHECK_OK(t->ops->allreduce_u64(t, u, 1, 0));
    CHECK(u[0] == 3, "u64 min %llu", (unsigned long long)u[0]);
    char mine[5], all[5 * 64];
    memset(mine, 'a' + g_rank, sizeof(mine));
    CHECK_OK(t->ops->allgather_bytes(t, mine, sizeof(mine), all));
    for (int r = 0; r < g_world; r++) {
        CHECK(all[r * 5] == 'a' + r && all[r * 5 + 4] == 'a' + r, "allgather_bytes block %d", r);
    }
    float f[3] = {1.0f, (float)g_rank, -2.0f};
    CHECK_OK(t->ops->allreduce_f32(t, f, 3));
    CHECK(f[0] == (float)g_world && f[1] == (float)(g_world * (g_world - 1) / 2) &&
              f[2] == -2.0f * g_world,
          "allreduce_f32");

    /* A point-to-point batch: a large and a small message to the next rank, from the
     * previous, listed in the same order on both sides. */
    size_t big = (size_t)1 << 20;
    int next = (g_rank + 1) % g_world, prev = (g_rank + g_world - 1) % g_world;
    unsigned char *sb = malloc(big), *rb = malloc(big);
    int ss = g_rank * 11, rs = -1;
    for (size_t i = 0; i < big; i++) {
        sb[i] = (unsigned char)(i * 7 + (size_t)g_rank);
    }
    mfsdp_p2p_t v[4] = {
        {1, next, 0, sb, big},
        {0, prev, 0, rb, big},
        {1, next, 0, &ss, sizeof(ss)},
        {0, prev, 0, &rs, sizeof(rs)},
    };
    long calls = inj.calls;
    CHECK_OK(t->ops->p2p(t, v, 4));
    CHECK(inj.calls - calls == 4, "%ld calls for 4 transfers", inj.calls - calls);
    size_t bad = 0;
    for (size_t i = 0; i < big; i++) {
        bad += rb[i] != (unsigned char)(i * 7 + (size_t)prev);
    }
    CHECK(bad == 0 && rs == prev * 11, "p2p: %zu bytes wrong, small %d", bad, rs);
    mfsdp_p2p_t badp = {1, g_world, 0, sb, 4};
    capture_begin();
    mfsdp_status_t st = t->ops->p2p(t, &badp, 1);
    expect(st, MFSDP_ERR_INVALID_ARG, capture_end(), "peer", "p2p peer out of range");
    free(sb);
    free(rb);
    t->ops->destroy(t);

    /* Device memory: host values through a staging executor (the CPU one stands in). */
    mfsdp_nccl_api_t dev = w;
    dev.host_memory = 0;
    CHECK_OK(mfsdp_transport_nccl_create(comm, &dev, &t));
    d = 1.0;
    capture_begin();
    st = t->ops->allreduce_sum(t, &d);
    expect(st, MFSDP_ERR_STATE, capture_end(), "staging executor", "device memory, no staging");
    mfsdp_exec_t *e = NULL;
    CHECK_OK(mfsdp_exec_cpu_create(&e));
    CHECK_OK(mfsdp_transport_nccl_set_staging(t, e));
    CHECK_OK(t->ops->set_stream(t, stream));
    d = g_rank + 0.25;
    CHECK_OK(t->ops->allreduce_sum(t, &d));
    CHECK(d == g_world * (g_world - 1) / 2.0 + 0.25 * g_world, "staged allreduce_sum %g", d);
    CHECK(inj.last_stream == (cudaStream_t)stream, "staged call on another stream");
    u[0] = (uint64_t)g_rank;
    u[1] = 5;
    CHECK_OK(t->ops->allreduce_u64(t, u, 2, 1));
    CHECK(u[0] == (uint64_t)g_world - 1 && u[1] == 5, "staged u64");
    char big_mine[300], *big_all = malloc(300 * (size_t)g_world);
    memset(big_mine, 'A' + g_rank, sizeof(big_mine));
    CHECK_OK(t->ops->allgather_bytes(t, big_mine, sizeof(big_mine), big_all));
    for (int r = 0; r < g_world; r++) {
        CHECK(big_all[r * 300] == 'A' + r && big_all[r * 300 + 299] == 'A' + r,
              "staged allgather block %d", r);
    }
    free(big_all);
    t->ops->destroy(t); /* frees the staging through the executor */
    e->ops->destroy(e);
}

/* ---------------------------------------------------------------------------------------
 * 2. Op lists
 */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static float contrib(int r, size_t param, size_t e)
{
    uint64_t h = mix(mix((uint64_t)r * 7919 + param) ^ e);
    return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static unsigned char weight_byte(size_t param, size_t b)
{
    return (unsigned char)(mix(param * 1000003 + b) >> 17);
}

static void add_param(mfsdp_group_desc_t *g, const char *name, int ndim, int64_t r, int64_t c,
                      mfsdp_role_t role)
{
    mfsdp_param_desc_t *p = &g->params[g->nparams++];
    memset(p, 0, sizeof(*p));
    p->name = (char *)name;
    p->ndim = ndim;
    p->shape[0] = r;
    p->shape[1] = ndim > 1 ? c : 0;
    p->numel = r * (ndim > 1 ? c : 1);
    p->dtype = MFSDP_FLOAT32;
    p->requires_grad = 1;
    p->optimizer = role;
}

/* Two Muon matrices of several 64 KiB windows each (owners spread over ranks) and an AdamW
 * vector (a sharded tail under tail "shard"); tail_only: a group of tail tensors only. */
static mfsdp_manifest_t *manifest(int tail_only)
{
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    mfsdp_hparams_default(&m->hp);
    m->ngroups = 1;
    m->groups = calloc(1, sizeof(*m->groups));
    mfsdp_group_desc_t *g = &m->groups[0];
    g->name = "g";
    g->lr_scale = 1.0;
    g->params = calloc(4, sizeof(*g->params));
    if (tail_only) {
        add_param(g, "n1", 1, 1001, 0, MFSDP_ROLE_ADAMW);
        add_param(g, "n2", 1, 37, 0, MFSDP_ROLE_ADAMW);
    } else {
        add_param(g, "a", 2, 300, 256, MFSDP_ROLE_MUON);
        add_param(g, "n", 1, 1003, 0, MFSDP_ROLE_ADAMW);
        add_param(g, "b", 2, 401, 200, MFSDP_ROLE_MUON);
    }
    return m;
}

static void manifest_free(mfsdp_manifest_t *m)
{
    free(m->groups[0].params);
    free(m->groups);
    free(m);
}

static void test_tail_buffers(mfsdp_transport_t *t, mfsdp_exec_t *e, const char *name);

/* One op list through the transport and its result against the expected bytes or sums. */
static void run_case(mfsdp_transport_t *t, mfsdp_exec_t *e, int tail_only, int tail_shard,
                     mfsdp_algo_t algo, int dir, int staged)
{
    const size_t chunk = 64 << 10;
    char what[160];
    snprintf(what, sizeof(what), "%s %s %s%s%s", dir ? "reduce" : "gather", mfsdp_algo_name(algo),
             tail_shard ? "tail shard" : "tail owner", tail_only ? " (tail only)" : "",
             staged ? " staged" : "");
    mfsdp_manifest_t *m = manifest(tail_only);
    mfsdp_plan_opts_t po = {.tail = tail_shard ? MFSDP_TAIL_SHARD : MFSDP_TAIL_OWNER};
    mfsdp_plan_t *plan = NULL;
    mfsdp_group_sched_t *gs = NULL;
    mfsdp_sched_ops_t ops = {0};
    CHECK_OK(mfsdp_plan_create(m, g_world, &po, &plan));
    CHECK_OK(mfsdp_group_sched_create(plan, 0, &gs));
    CHECK_OK(mfsdp_sched_build(gs, g_rank, dir, algo, chunk, &ops));
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag, *rs = &gs->layout->rs;
    int n = g_world;
    mfsdp_xfer_bufs_t *bufs = calloc(gs->nsegs + 1, sizeof(*bufs));
    void **owned = calloc(gs->nsegs + 1, sizeof(void *));
    mfsdp_xfer_t x = {.exec = e, .dir = dir, .gs = gs, .ops = &ops, .bufs = bufs};
    char *ag_out = NULL, *rs_in = NULL, *tail_send = NULL, *tail_recv = NULL;
    if (dir == MFSDP_SCHED_DIR_GATHER) {
        ag_out = malloc(ag->bytes * (size_t)n + 1);
        memset(ag_out, 0xEE, ag->bytes * (size_t)n);
        x.ag_out = ag_out;
        for (size_t i = 0; i < gs->nsegs; i++) {
            const mfsdp_sched_seg_t *s = &gs->segs[i];
            if (s->owner == g_rank) {
                unsigned char *full = malloc(s->ag_bytes);
                for (size_t b = 0; b < s->ag_bytes; b++) {
                    full[b] = weight_byte(s->param, b);
                }
                bufs[i].src = owned[i] = full;
            } else if (algo == MFSDP_ALGO_CHAIN) {
                bufs[i].stage = owned[i] = malloc(mfsdp_sched_ring(s->ag_bytes, chunk));
            } else if (staged) {
                bufs[i].stage = owned[i] = calloc(1, s->ag_bytes);
            }
        }
        /* The own tail slices in this rank's block of ag_out: the tail is gathered in place. */
        for (size_t k = 0; k < gs->ntail; k++) {
            const mfsdp_param_layout_t *pe = &ag->entries[gs->tail[k]];
            char *dst = ag_out + (size_t)g_rank * ag->bytes + pe->o_bytes;
            for (size_t b = 0; b < pe->s_bytes; b++) {
                dst[b] = (char)weight_byte(gs->tail[k], (size_t)g_rank * 1000 + b);
            }
        }
        x.tail_count = gs->tail_ag_bytes;
    } else {
        rs_in = malloc(rs->bytes * (size_t)n + 1);
        for (size_t k = 0; k < rs->nentries; k++) {
            const mfsdp_param_layout_t *pe = &rs->entries[k];
            for (int j = 0; j < n; j++) {
                float *blk = (float *)(rs_in + (size_t)j * rs->bytes + pe->o_bytes);
                for (size_t el = 0; el < (size_t)pe->s; el++) {
                    size_t ge = (size_t)j * (size_t)pe->s + el; /* element of the tensor */
                    blk[el] = ge < (size_t)(pe->rows * pe->rest)
                                  ? contrib(g_rank, (size_t)pe->param, ge)
                                  : 0.0f;
                }
            }
        }
        x.rs_in = rs_in;
        x.dtype = MFSDP_FLOAT32;
        x.op = MFSDP_OP_SUM;
        x.scalar = 1.0f;
        for (size_t i = 0; i < gs->nsegs; i++) {
            const mfsdp_sched_seg_t *s = &gs->segs[i];
            int own = s->owner == g_rank;
            float *grad = own ? calloc(s->numel, sizeof(float)) : NULL;
            bufs[i].grad = grad;
            owned[i] = grad;
            if (algo == MFSDP_ALGO_DIRECT) {
                /* Contributions are read in place from rs_in; the owner's ring of chunks. */
                if (own) {
                    size_t stride, nslots;
                    mfsdp_sched_direct_ring(gs, s, chunk / sizeof(float), &stride, &nslots);
                    bufs[i].stage = malloc(nslots * (size_t)n * stride * sizeof(float) + 1);
                }
            } else if (algo == MFSDP_ALGO_CHAIN) {
                size_t ring = mfsdp_sched_ring(s->numel, chunk / sizeof(float));
                bufs[i].pin = bufs[i].pout = malloc(ring * sizeof(float));
                bufs[i].final = own ? malloc(ring * sizeof(float)) : NULL;
            } else {
                bufs[i].pout = malloc(s->numel * sizeof(float));
                bufs[i].final = own ? malloc(s->numel * sizeof(float)) : NULL;
            }
        }
        if (gs->tail_rs_elems != 0) {
            float *ts = malloc(gs->tail_rs_elems * sizeof(float) * (size_t)n);
            size_t off = 0;
            for (int j = 0; j < n; j++) {
                for (size_t k = 0; k < gs->ntail; k++) {
                    const mfsdp_param_layout_t *pe =
                        &rs->entries[gs->layout->rs_entry[gs->tail[k]]];
                    for (size_t el = 0; el < (size_t)pe->s; el++) {
                        ts[off++] = contrib(g_rank, gs->tail[k], (size_t)j * (size_t)pe->s + el);
                    }
                }
            }
            tail_send = (char *)ts;
            tail_recv = malloc(gs->tail_rs_elems * sizeof(float) * (size_t)n);
        }
        x.tail_count = gs->tail_rs_elems * sizeof(float); /* bytes per rank block */
    }
    x.tail_send = tail_send;
    x.tail_recv = tail_recv;

    mfsdp_status_t st = t->ops->run(t, &x);
    CHECK(st == MFSDP_OK, "%s: run: %s", what, mfsdp_status_string(st));

    size_t bad = 0, checked = 0;
    double worst = 0.0;
    if (dir == MFSDP_SCHED_DIR_GATHER) {
        for (size_t i = 0; i < gs->nsegs; i++) {
            const mfsdp_sched_seg_t *s = &gs->segs[i];
            if (s->owner == g_rank) {
                continue; /* the runtime unpacks the owner's own copy */
            }
            for (int r = 0; r < n; r++) {
                mfsdp_piece_t pc;
                mfsdp_layout_piece(ag, n, s->param, r, &pc);
                for (size_t b = 0; b < pc.valid; b++) {
                    unsigned char want = weight_byte(s->param, pc.full_offset + b);
                    unsigned char got = algo != MFSDP_ALGO_CHAIN && staged
                                            ? ((unsigned char *)bufs[i].stage)[pc.full_offset + b]
                                            : (unsigned char)ag_out[pc.buf_offset + b];
                    bad += got != want;
                    checked++;
                }
                for (size_t b = 0; b < pc.pad; b++) { /* padding is the runtime's */
                    bad += (unsigned char)ag_out[pc.buf_offset + pc.valid + b] != 0xEE;
                }
            }
        }
        for (int r = 0; r < n; r++) {
            for (size_t k = 0; k < gs->ntail; k++) {
                const mfsdp_param_layout_t *pe = &ag->entries[gs->tail[k]];
                for (size_t b = 0; b < pe->s_bytes; b++) {
                    char want = (char)weight_byte(gs->tail[k], (size_t)r * 1000 + b);
                    bad += ag_out[(size_t)r * ag->bytes + pe->o_bytes + b] != want;
                    checked++;
                }
            }
        }
    } else {
        for (size_t i = 0; i < gs->nsegs; i++) {
            const mfsdp_sched_seg_t *s = &gs->segs[i];
            if (s->owner != g_rank) {
                continue;
            }
            for (size_t el = 0; el < s->numel; el++) {
                float want = 0.0f;
                double mag = 0.0;
                for (int r = 0; r < n; r++) {
                    want = r == 0 ? contrib(r, s->param, el) : want + contrib(r, s->param, el);
                    mag += fabs(contrib(r, s->param, el));
                }
                want = 0.0f + want; /* the gradient started at zero */
                float got = bufs[i].grad[el];
                if (algo == MFSDP_ALGO_NATIVE) {
                    /* another summation order: within a few roundings of the magnitudes */
                    double rel = fabs((double)got - want) / (mag + 1e-30);
                    worst = rel > worst ? rel : worst;
                    bad += rel > 1e-6;
                } else {
                    bad += memcmp(&got, &want, sizeof(float)) != 0;
                }
                checked++;
            }
        }
        /* The tail's all-to-all: block r of tail_recv holds, byte for byte, rank r's
         * contributions to this rank's slices (the own block is the caller's). */
        for (int r = 0; r < n && tail_recv != NULL; r++) {
            if (r == g_rank) {
                continue;
            }
            const float *got = (const float *)tail_recv + (size_t)r * gs->tail_rs_elems;
            for (size_t k = 0; k < gs->ntail; k++) {
                const mfsdp_param_layout_t *pe = &rs->entries[gs->layout->rs_entry[gs->tail[k]]];
                for (size_t el = 0; el < (size_t)pe->s; el++) {
                    float want = contrib(r, gs->tail[k], (size_t)g_rank * (size_t)pe->s + el);
                    bad += memcmp(&got[el], &want, sizeof(float)) != 0;
                    checked++;
                }
                got += pe->s;
            }
        }
    }
    CHECK(bad == 0, "%s: %zu of %zu values wrong (worst relative %.3g)", what, bad, checked, worst);
    long tot = (long)checked, all = 0;
    MPI_Allreduce(&tot, &all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    CHECK(n == 1 || all > 0, "%s: nothing was checked on any rank", what);

    for (size_t i = 0; i < gs->nsegs; i++) {
        free(owned[i]);
        if (dir == MFSDP_SCHED_DIR_REDUCE) {
            if (algo == MFSDP_ALGO_DIRECT) {
                free(bufs[i].src);
                free(bufs[i].stage);
            } else {
                free(bufs[i].pout);
                free(bufs[i].final);
            }
        }
    }
    free(owned);
    free(bufs);
    free(ag_out);
    free(rs_in);
    free(tail_send);
    free(tail_recv);
    mfsdp_sched_ops_free(&ops);
    mfsdp_group_sched_destroy(gs);
    mfsdp_plan_destroy(plan);
    manifest_free(m);
}

static void test_op_lists(ncclComm_t comm)
{
    const mfsdp_nccl_api_t *api = NULL;
    mfsdp_transport_t *t = NULL;
    mfsdp_exec_t *e = NULL;
    CHECK_OK(mfsdp_nccl_api_get(&api));
    CHECK_OK(mfsdp_transport_nccl_create(comm, api, &t));
    CHECK_OK(mfsdp_exec_cpu_create(&e));
    static const mfsdp_algo_t algos[] = {MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_ALGO_NATIVE};
    for (int dir = 0; dir < 2; dir++) {
        for (int a = 0; a < 3; a++) {
            for (int tail = 0; tail < 2; tail++) {
                run_case(t, e, 0, tail, algos[a], dir, 0);
            }
            if (dir == MFSDP_SCHED_DIR_GATHER) {
                run_case(t, e, 0, 1, algos[a], dir, 1); /* staged receives */
            }
            run_case(t, e, 1, 1, algos[a], dir, 0); /* the tail is the whole block */
        }
    }

    /* A broken op list is refused before anything is posted: no rank waits. */
    mfsdp_manifest_t *m = manifest(0);
    mfsdp_plan_t *plan = NULL;
    mfsdp_group_sched_t *gs = NULL;
    mfsdp_sched_ops_t ops = {0};
    CHECK_OK(mfsdp_plan_create(m, g_world, NULL, &plan));
    CHECK_OK(mfsdp_group_sched_create(plan, 0, &gs));
    mfsdp_sched_op_t bad[2];
    memset(bad, 0, sizeof(bad));
    bad[0].kind = MFSDP_SCHED_SEND;
    bad[0].peer = (g_rank + 1) % g_world;
    bad[0].dep = -1;
    bad[1] = bad[0];
    bad[1].dep = 0; /* same wave as its dependency */
    ops.ops = bad;
    ops.nops = 2;
    mfsdp_xfer_bufs_t bufs[8];
    memset(bufs, 0, sizeof(bufs));
    mfsdp_xfer_t x = {
        .exec = e, .dir = MFSDP_SCHED_DIR_GATHER, .gs = gs, .ops = &ops, .bufs = bufs};
    capture_begin();
    mfsdp_status_t st = t->ops->run(t, &x);
    expect(st, MFSDP_ERR_INTERNAL, capture_end(), "would run before op 0",
           "op in the wave of its dependency");
    bad[1].dep = MFSDP_SCHED_DEP_ALL;
    capture_begin();
    st = t->ops->run(t, &x);
    expect(st, MFSDP_ERR_INTERNAL, capture_end(), "waits for all others but is a transfer",
           "transfer after all");
    bad[1].dep = -1;
    bad[1].seg = 99;
    capture_begin();
    st = t->ops->run(t, &x);
    expect(st, MFSDP_ERR_INTERNAL, capture_end(), "segment 99", "segment out of range");
    test_tail_buffers(t, e, "nccl");
    mfsdp_transport_t *mt = NULL;
    CHECK_OK(mfsdp_transport_mpi_create(MPI_COMM_WORLD, &mt));
    if (mt != NULL) {
        test_tail_buffers(mt, e, "mpi");
        mt->ops->destroy(mt);
    }
    mfsdp_group_sched_destroy(gs);
    mfsdp_plan_destroy(plan);
    manifest_free(m);
    e->ops->destroy(e);
    t->ops->destroy(t);
}

/* The sharded tail's buffers, checked by both transports before anything is posted: the
 * all-gather runs in place in FSDP's output (staging for it is refused), the reduce's
 * all-to-all needs both staging blocks. */
static void test_tail_buffers(mfsdp_transport_t *t, mfsdp_exec_t *e, const char *name)
{
    mfsdp_manifest_t *m = manifest(0);
    mfsdp_plan_t *plan = NULL;
    mfsdp_group_sched_t *gs = NULL;
    mfsdp_sched_ops_t ops = {0};
    mfsdp_plan_opts_t po = {.tail = MFSDP_TAIL_SHARD};
    CHECK_OK(mfsdp_plan_create(m, g_world, &po, &plan));
    CHECK_OK(mfsdp_group_sched_create(plan, 0, &gs));
    CHECK_OK(mfsdp_sched_build_tail(&ops));
    mfsdp_xfer_bufs_t *bufs = calloc(gs->nsegs + 1, sizeof(*bufs));
    size_t bytes = gs->layout->ag.bytes * (size_t)g_world + gs->tail_rs_elems * 4 * g_world + 8;
    char *a = calloc(1, bytes), *b = calloc(1, bytes);
    char what[96];
    static const struct {
        int gather, out, send, recv;
        const char *needle;
    } cases[] = {
        {1, 1, 0, 1, "the all-gather needs FSDP's output and no staging"},
        {1, 1, 1, 0, "the all-gather needs FSDP's output and no staging"},
        {1, 0, 0, 0, "the all-gather needs FSDP's output and no staging"},
        {0, 0, 1, 0, "the reduce needs send and receive staging"},
        {0, 0, 0, 1, "the reduce needs send and receive staging"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        mfsdp_xfer_t x = {
            .exec = e,
            .dir = cases[k].gather ? MFSDP_SCHED_DIR_GATHER : MFSDP_SCHED_DIR_REDUCE,
            .gs = gs,
            .ops = &ops,
            .bufs = bufs,
            .dtype = MFSDP_FLOAT32,
            .op = MFSDP_OP_SUM,
            .scalar = 1.0f,
            .ag_out = cases[k].out ? a : NULL,
            .tail_send = cases[k].send ? b : NULL,
            .tail_recv = cases[k].recv ? b : NULL,
            .tail_count = cases[k].gather ? gs->tail_ag_bytes : gs->tail_rs_elems * 4,
        };
        snprintf(what, sizeof(what), "%s: tail buffers, case %zu", name, k);
        capture_begin();
        mfsdp_status_t st = t->ops->run(t, &x);
        expect(st, MFSDP_ERR_INTERNAL, capture_end(), cases[k].needle, what);
    }
    free(a);
    free(b);
    free(bufs);
    mfsdp_sched_ops_free(&ops);
    mfsdp_group_sched_destroy(gs);
    mfsdp_plan_destroy(plan);
    manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * 3. Errors and non-blocking communicators
 */
static void test_errors(ncclComm_t comm)
{
    mfsdp_nccl_api_t w = wrapped();
    mfsdp_transport_t *t = NULL;
    mfsdp_status_t st;
    CHECK_OK(mfsdp_transport_nccl_create(comm, &w, &t));
    if (t == NULL) {
        return;
    }
    int next = (g_rank + 1) % g_world;
    int word = 1;
    /* every rank's sends fail alike: nothing is left posted */
    mfsdp_p2p_t v = {1, next, 0, &word, sizeof(word)};
    inj.send_fail = 1;
    capture_begin();
    st = t->ops->p2p(t, &v, 1);
    expect(st, MFSDP_ERR_TRANSPORT, capture_end(), "ncclSend failed: unhandled system error",
           "failing ncclSend");
    inj.send_fail = 0;
    inj.group_end_fail = 1;
    double d = 1.0;
    mfsdp_p2p_t ring[2] = {{1, next, 0, &word, sizeof(word)},
                           {0, (g_rank + g_world - 1) % g_world, 0, &d, sizeof(word)}};
    capture_begin();
    st = t->ops->p2p(t, ring, 2);
    expect(st, MFSDP_ERR_TRANSPORT, capture_end(), "ncclGroupEnd failed: internal error",
           "failing ncclGroupEnd");
    inj.group_end_fail = 0;
    /* in progress, then an asynchronous error */
    inj.allreduce_progress = 1;
    inj.async_error = 1;
    capture_begin();
    st = t->ops->allreduce_sum(t, &d);
    expect(st, MFSDP_ERR_TRANSPORT, capture_end(), "reported by ncclCommGetAsyncError",
           "asynchronous error");
    inj.async_error = 0;
    inj.allreduce_progress = 0;
    /* a table without a function */
    mfsdp_nccl_api_t holed = w;
    holed.AllGather = NULL;
    mfsdp_transport_t *t2 = NULL;
    capture_begin();
    st = mfsdp_transport_nccl_create(comm, &holed, &t2);
    expect(st, MFSDP_ERR_INVALID_ARG, capture_end(), "lacks ncclAllGather", "holed table");
    capture_begin();
    st = mfsdp_transport_nccl_set_timeout(t, 0.0);
    expect(st, MFSDP_ERR_INVALID_ARG, capture_end(), "seconds", "zero timeout");
    t->ops->destroy(t);

    /* A non-blocking communicator: creation waits for its initialization, calls in progress
     * are polled to completion, with results. */
    setenv("FAKE_NCCL_INPROGRESS_POLLS", "5", 1);
    ncclComm_t nb = make_comm(1);
    const mfsdp_nccl_api_t *api = NULL;
    CHECK_OK(mfsdp_nccl_api_get(&api));
    CHECK_OK(mfsdp_transport_nccl_create(nb, api, &t));
    if (t == NULL) {
        return;
    }
    d = 2.0;
    CHECK_OK(t->ops->allreduce_sum(t, &d));
    CHECK(d == 2.0 * g_world, "non-blocking allreduce %g", d);
    int got = -1;
    word = g_rank;
    mfsdp_p2p_t nr[2] = {{1, next, 0, &word, sizeof(word)},
                         {0, (g_rank + g_world - 1) % g_world, 0, &got, sizeof(got)}};
    CHECK_OK(t->ops->p2p(t, nr, 2));
    CHECK(got == (g_rank + g_world - 1) % g_world, "non-blocking p2p got %d", got);
    /* a call that never completes: a clear timeout on every rank */
    setenv("FAKE_NCCL_INPROGRESS_POLLS", "forever", 1);
    CHECK_OK(mfsdp_transport_nccl_set_timeout(t, 0.2));
    capture_begin();
    st = t->ops->allreduce_sum(t, &d);
    expect(st, MFSDP_ERR_TRANSPORT, capture_end(), "still in progress after", "timeout");
    unsetenv("FAKE_NCCL_INPROGRESS_POLLS");
    t->ops->destroy(t);
    ncclCommDestroy(nb);
    /* accessors refuse another transport */
    CHECK(mfsdp_transport_nccl_comm(NULL) == NULL && mfsdp_transport_nccl_api(NULL) == NULL,
          "accessors of NULL");
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    const mfsdp_nccl_api_t *api = NULL;
    if (mfsdp_nccl_api_get(&api) != MFSDP_OK) {
        fprintf(stderr, "no NCCL table\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    g_real = api;
    ncclComm_t comm = make_comm(0);
    test_api_and_small(comm);
    test_op_lists(comm);
    test_errors(comm);
    ncclCommDestroy(comm);
    int total = 0;
    MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("test_transport_nccl: %d ranks, %d failures\n", g_world, total);
    }
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
