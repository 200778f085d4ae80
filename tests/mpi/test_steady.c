/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Steady state of the MPI transport: after a group's first all-gather and reduce, later
 * calls create no MPI datatype and allocate nothing in the library (the request arrays,
 * dependency lists and datatypes are built once per op list and kept with it).
 *
 * Counted here: MPI_Type_create_hindexed / MPI_Type_create_resized / MPI_Type_commit through
 * PMPI wrappers, and every malloc/calloc/realloc made by code linked into this executable
 * (the library is a static archive; the link wraps those symbols: -Wl,--wrap=malloc ...).
 * Open MPI's own allocations inside its calls are not counted (a shared library).
 * Every algorithm pair (direct, chain, native) with a sharded tail and owned tensors, bf16
 * and fp32 groups; 1..4 ranks. The sharded tail's reduce sends FSDP's bytes (all-to-alls in
 * the reduce dtype, counted through a PMPI wrapper) and gives bitwise the same slices under
 * every algorithm pair and budget.
 *
 * Built a second time with -DTEST_TRANSPORT_NCCL (test_steady_nccl): the contexts run on a
 * communicator of the test NCCL library (host memory, the CPU executor), and the NCCL
 * transport is held to the same: no allocation after an op list's first run. (There the
 * message and pass counts below are not taken: the test library moves bytes with PMPI.)
 *
 * Staging budget: the direct reduce under a budget of a few KiB (MFSDP_STAGING_BYTES, here
 * through the option) stages no more than the budget (the context's comm_staging_bytes),
 * cuts each tensor into many chunks (more point-to-point messages than under the default
 * 64 MiB) and the sharded tail into several all-to-all passes, and gives owners bitwise
 * the same gradients as the default budget. The chain
 * pipelines and the native reduce under a budget below what they stage by default: their
 * chunks shrink to fit it (the native reduce then posts more MPI_Ireduce calls, in the same
 * order on every rank), the all-gathers and the chains' sums stay bitwise the same, the
 * native sums within rounding (MPI may sum another count in another order).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/algo_table.h"
#include "core/layout.h"
#include "mfsdp/runtime_mpi.h"
#ifdef TEST_TRANSPORT_NCCL
#include <nccl.h>

#include "mfsdp/runtime_nccl.h"
static ncclComm_t g_ncomm;
#endif
#include "tests/lib/mpi_check.h"
#include "tests/unit/manifest_util.h"

static int g_counting;
static long g_types, g_allocs, g_p2p, g_a2a, g_a2a_bytes, g_ired;

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
/* Default visibility (the build hides symbols): a shared library on the link line that
 * references realloc makes ld resolve the reference against the wrapper, which must not be
 * hidden for that. At run time such a library still calls libc's: only this executable's
 * objects are counted. */
#define WRAPPER __attribute__((visibility("default")))
WRAPPER void *__wrap_malloc(size_t n);
WRAPPER void *__wrap_calloc(size_t k, size_t n);
WRAPPER void *__wrap_realloc(void *p, size_t n);

void *__wrap_malloc(size_t n)
{
    g_allocs += g_counting;
    return __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n)
{
    g_allocs += g_counting;
    return __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n)
{
    g_allocs += g_counting;
    return __real_realloc(p, n);
}

int MPI_Isend(const void *buf, int count, MPI_Datatype dt, int dest, int tag, MPI_Comm comm,
              MPI_Request *req)
{
    g_p2p += g_counting;
    return PMPI_Isend(buf, count, dt, dest, tag, comm, req);
}
int MPI_Irecv(void *buf, int count, MPI_Datatype dt, int src, int tag, MPI_Comm comm,
              MPI_Request *req)
{
    g_p2p += g_counting;
    return PMPI_Irecv(buf, count, dt, src, tag, comm, req);
}

/* The sharded tail's reduce: its all-to-alls and the bytes they send (all blocks). */
int MPI_Ialltoall(const void *s, int scount, MPI_Datatype sdt, void *r, int rcount,
                  MPI_Datatype rdt, MPI_Comm comm, MPI_Request *req)
{
    if (g_counting) {
        int size = 0, n = 0;
        PMPI_Type_size(sdt, &size);
        PMPI_Comm_size(comm, &n);
        g_a2a++;
        g_a2a_bytes += (long)scount * size * n;
    }
    return PMPI_Ialltoall(s, scount, sdt, r, rcount, rdt, comm, req);
}

int MPI_Ireduce(const void *s, void *r, int count, MPI_Datatype dt, MPI_Op op, int root,
                MPI_Comm comm, MPI_Request *req)
{
    g_ired += g_counting;
    return PMPI_Ireduce(s, r, count, dt, op, root, comm, req);
}

int MPI_Type_create_hindexed(int count, const int len[], const MPI_Aint disp[], MPI_Datatype old,
                             MPI_Datatype *t)
{
    g_types += g_counting;
    return PMPI_Type_create_hindexed(count, len, disp, old, t);
}
int MPI_Type_create_resized(MPI_Datatype old, MPI_Aint lb, MPI_Aint extent, MPI_Datatype *t)
{
    g_types += g_counting;
    return PMPI_Type_create_resized(old, lb, extent, t);
}
int MPI_Type_commit(MPI_Datatype *t)
{
    g_types += g_counting;
    return PMPI_Type_commit(t);
}

static void add_param(mfsdp_group_desc_t *g, const char *name, int ndim, int64_t r, int64_t c,
                      mfsdp_dtype_t dt)
{
    mfsdp_param_desc_t *p = &g->params[g->nparams++];
    memset(p, 0, sizeof(*p));
    p->name = strdup(name);
    p->ndim = ndim;
    p->shape[0] = r;
    p->shape[1] = c;
    p->numel = ndim == 1 ? r : r * c;
    p->dtype = dt;
    p->requires_grad = 1;
    p->optimizer = ndim == 2 ? MFSDP_ROLE_MUON : MFSDP_ROLE_ADAMW;
}

/* Two groups: bf16 (two matrices, a norm) and fp32 (one matrix, a norm). The 1-D norms form
 * the sharded tail. */
static mfsdp_manifest_t *manifest(void)
{
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    mfsdp_hparams_default(&m->hp);
    m->ngroups = 2;
    m->groups = calloc(2, sizeof(*m->groups));
    for (size_t g = 0; g < 2; g++) {
        m->groups[g].name = strdup(g == 0 ? "a" : "b");
        m->groups[g].lr_scale = 1.0;
        m->groups[g].params = calloc(4, sizeof(mfsdp_param_desc_t));
    }
    add_param(&m->groups[0], "a.q", 2, 67, 48, MFSDP_BFLOAT16);
    add_param(&m->groups[0], "a.o", 2, 33, 20, MFSDP_BFLOAT16);
    add_param(&m->groups[0], "a.norm", 1, 1201, 1, MFSDP_BFLOAT16);
    add_param(&m->groups[1], "b.w", 2, 29, 31, MFSDP_FLOAT32);
    add_param(&m->groups[1], "b.norm", 1, 601, 1, MFSDP_FLOAT32);
    return m;
}

static void manifest_free(mfsdp_manifest_t *m)
{
    test_manifest_free_owned(m);
}

/* One context's run: 4 iterations of (all-gather, reduce) of both groups on fixed inputs. */
typedef struct run_out {
    long types[4], allocs[4], p2p[4], a2a[4], a2a_bytes[4], ired[4];
    float *slices; /* the sharded-tail slices' gradients, in manifest order */
    size_t nslices;
    size_t staging, budget;
    float *grads; /* the owned tensors' gradients, in manifest order */
    size_t ngrads;
    uint64_t gathered; /* FNV-1a of the last all-gather outputs of both groups */
} run_out_t;

static void put_elem(void *buf, mfsdp_dtype_t dt, size_t i, float v)
{
    if (dt == MFSDP_FLOAT32) {
        ((float *)buf)[i] = v;
    } else { /* bf16: the top half of the float, truncated */
        uint32_t u;
        memcpy(&u, &v, sizeof(u));
        ((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
    }
}

static int run(const mfsdp_manifest_t *m, mfsdp_algo_t ga, mfsdp_algo_t ra, size_t budget,
               run_out_t *out)
{
    memset(out, 0, sizeof(*out));
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.has_plan_opts = 1;
    o.plan_opts.tail = MFSDP_TAIL_SHARD;
    o.gather_algo = ga;
    o.reduce_algo = ra;
    o.chain_chunk = 256; /* several chunks per tensor */
    o.has_step_mode = 1;
    o.step_mode = MFSDP_STEP_MANUAL;
    o.staging_bytes = budget;
    mfsdp_ctx_h ctx = NULL;
#ifdef TEST_TRANSPORT_NCCL
    mfsdp_status_t st = mfsdp_ctx_create_nccl(m, &o, g_ncomm, &ctx);
#else
    mfsdp_status_t st = mfsdp_ctx_create_mpi(m, &o, MPI_COMM_WORLD, &ctx);
#endif
    CHECK(st == MFSDP_OK, "ctx create: %s", mfsdp_status_string(st));
    if (ctx == NULL) {
        return -1;
    }
    void *ag_send[2], *ag_recv[2], *rs_send[2], *rs_recv[2];
    size_t ag_count[2], rs_count[2];
    mfsdp_dtype_t ag_dt[2], rs_dt[2];
    for (size_t g = 0; g < 2; g++) {
        mfsdp_group_layout_t *l = NULL;
        CHECK_OK(mfsdp_group_layout_create(&m->groups[g], g_world, &l));
        ag_count[g] = l->ag.count;
        rs_count[g] = l->rs.count;
        ag_dt[g] = l->ag.dtype;
        rs_dt[g] = l->rs.dtype;
        ag_send[g] = calloc(1, l->ag.bytes + 1);
        ag_recv[g] = calloc((size_t)g_world, l->ag.bytes + 1);
        rs_send[g] = calloc((size_t)g_world, l->rs.bytes + 1);
        rs_recv[g] = calloc(1, l->rs.bytes + 1);
        /* Contributions that differ per rank and element (so the sum's order shows). */
        for (size_t i = 0; i < rs_count[g] * (size_t)g_world; i++) {
            uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(g_rank * 40503u + g * 7u);
            put_elem(rs_send[g], rs_dt[g], i, (float)(h % 20011u) / 997.0f - 10.0f);
        }
        mfsdp_group_layout_destroy(l);
    }
    for (int it = 0; it < 4; it++) {
        g_types = g_allocs = g_p2p = g_a2a = g_a2a_bytes = g_ired = 0;
        g_counting = 1;
        for (size_t g = 0; g < 2; g++) {
            CHECK_OK(mfsdp_ctx_allgather(ctx, g, ag_send[g], ag_recv[g], ag_count[g], ag_dt[g]));
            CHECK_OK(mfsdp_ctx_reduce(ctx, g, rs_send[g], rs_recv[g], rs_count[g], rs_dt[g],
                                      MFSDP_OP_AVG, 0.0));
        }
        g_counting = 0;
        out->types[it] = g_types;
        out->allocs[it] = g_allocs;
        out->p2p[it] = g_p2p;
        out->a2a[it] = g_a2a;
        out->a2a_bytes[it] = g_a2a_bytes;
        out->ired[it] = g_ired;
    }
    out->gathered = 1469598103934665603ull;
    for (size_t g = 0; g < 2; g++) {
        mfsdp_group_layout_t *l = NULL;
        CHECK_OK(mfsdp_group_layout_create(&m->groups[g], g_world, &l));
        const unsigned char *b = ag_recv[g];
        for (size_t i = 0; i < l->ag.bytes * (size_t)g_world; i++) {
            out->gathered = (out->gathered ^ b[i]) * 1099511628211ull;
        }
        mfsdp_group_layout_destroy(l);
    }
    mfsdp_ctx_stats_t stats;
    CHECK_OK(mfsdp_ctx_get_stats(ctx, &stats));
    out->staging = stats.comm_staging_bytes;
    out->budget = stats.staging_budget;
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            mfsdp_param_view_t v;
            CHECK_OK(mfsdp_ctx_get_param(ctx, m->groups[g].params[i].name, &v));
            if (v.owner == MFSDP_OWNER_SHARDED && v.grad != NULL) {
                out->slices = realloc(out->slices, (out->nslices + v.local_elems) * sizeof(float));
                memcpy(out->slices + out->nslices, v.grad, v.local_elems * sizeof(float));
                out->nslices += v.local_elems;
                continue;
            }
            if (v.owner != g_rank || v.grad == NULL) {
                continue;
            }
            out->grads = realloc(out->grads, (out->ngrads + v.local_elems) * sizeof(float));
            memcpy(out->grads + out->ngrads, v.grad, v.local_elems * sizeof(float));
            out->ngrads += v.local_elems;
        }
        free(ag_send[g]);
        free(ag_recv[g]);
        free(rs_send[g]);
        free(rs_recv[g]);
    }
    mfsdp_ctx_destroy(&ctx);
    return 0;
}

static void check_steady(const run_out_t *r, const char *what)
{
    for (int it = 1; it < 4; it++) {
        CHECK(r->types[it] == 0 && r->allocs[it] == 0,
              "%s, call %d: %ld datatype calls, %ld allocations (first call: %ld, %ld)", what,
              it + 1, r->types[it], r->allocs[it], r->types[0], r->allocs[0]);
    }
}

static void run_free(run_out_t *r)
{
    free(r->grads);
    free(r->slices);
}

/* got[i] within rounding of want[i] for every i (MPI may sum another count in another
 * order); the first element that is not is reported. */
static void check_close(const float *got, const float *want, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        float d = got[i] - want[i];
        if (!(d * d <= 1e-10f * (1.0f + want[i] * want[i]))) {
            CHECK(0, "%s, element %zu: %.9g, expected %.9g", what, i, got[i], want[i]);
            return;
        }
    }
}

/* What FSDP's own reduce-scatter of the sharded tail (the 1-D params) sends per rank: every
 * rank block of each slice, in the group's reduce dtype. */
static long fsdp_tail_bytes(const mfsdp_manifest_t *m)
{
    long bytes = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        mfsdp_group_layout_t *l = NULL;
        CHECK_OK(mfsdp_group_layout_create(&m->groups[g], g_world, &l));
        for (size_t i = 0; l != NULL && i < m->groups[g].nparams; i++) {
            if (m->groups[g].params[i].ndim == 1 && l->rs_entry[i] >= 0) {
                bytes += (long)g_world * (long)l->rs.entries[l->rs_entry[i]].s *
                         (long)mfsdp_dtype_size(l->rs.dtype);
            }
        }
        mfsdp_group_layout_destroy(l);
    }
    return bytes;
}

/* The sharded tail of run r against the first run (def): bitwise the same slices (every rank
 * sums its slices in rank order, whatever the algorithms or passes), and, where MPI's calls
 * are counted, sent in FSDP's bytes per iteration (the reduce dtype, not fp32). */
static void check_tail(const run_out_t *r, const run_out_t *def, long fsdp_bytes, int counted,
                       const char *what)
{
    CHECK(r->nslices == def->nslices && r->nslices > 0 &&
              memcmp(r->slices, def->slices, r->nslices * sizeof(float)) == 0,
          "%s: sharded-tail slices differ from the first run's (%zu vs %zu elements)", what,
          r->nslices, def->nslices);
    for (int it = 0; counted && it < 4; it++) {
        CHECK(r->a2a_bytes[it] == fsdp_bytes,
              "%s, call %d: the sharded tail's all-to-alls sent %ld bytes, FSDP's reduce-scatter "
              "%ld",
              what, it + 1, r->a2a_bytes[it], fsdp_bytes);
    }
}

/* Algorithms (ga, ra) at the default budget (*d) and under budget (*r): both runs steady,
 * the default staging above the budget and the small one within it. -1 (nothing to free)
 * when a run failed. */
static int run_pair(const mfsdp_manifest_t *m, mfsdp_algo_t ga, mfsdp_algo_t ra, size_t budget,
                    run_out_t *d, run_out_t *r, const char *what)
{
    if (run(m, ga, ra, 0, d) != 0) {
        return -1;
    }
    if (run(m, ga, ra, budget, r) != 0) {
        run_free(d);
        return -1;
    }
    check_steady(r, what);
    CHECK(d->staging > budget && r->staging <= budget,
          "%s: %zu staging bytes by default, %zu under a budget of %zu", what, d->staging,
          r->staging, budget);
    return 0;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
#ifdef TEST_TRANSPORT_NCCL
    const int counted = 0; /* the test NCCL library's traffic is not seen by the wrappers */
    ncclUniqueId id;
    if (g_rank == 0 && ncclGetUniqueId(&id) != ncclSuccess) {
        PMPI_Abort(MPI_COMM_WORLD, 2);
    }
    PMPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (ncclCommInitRank(&g_ncomm, g_world, id, g_rank) != ncclSuccess) {
        PMPI_Abort(MPI_COMM_WORLD, 2);
    }
#else
    const int counted = 1;
#endif
    static const mfsdp_algo_t algos[] = {MFSDP_ALGO_DIRECT, MFSDP_ALGO_CHAIN, MFSDP_ALGO_NATIVE};
    mfsdp_manifest_t *m = manifest();
    run_out_t def = {0};
    const long tail_bytes = fsdp_tail_bytes(m);
    for (int ga = 0; ga < 3; ga++) {
        for (int ra = 0; ra < 3; ra++) {
            run_out_t r;
            if (run(m, algos[ga], algos[ra], 0, &r) != 0) {
                continue;
            }
            char what[96];
            snprintf(what, sizeof(what), "gather %s, reduce %s", mfsdp_algo_name(algos[ga]),
                     mfsdp_algo_name(algos[ra]));
            check_steady(&r, what);
            if (g_rank == 0 && ga == 0 && ra == 0) {
                printf("test_steady: first call %ld datatype calls, %ld allocations; later "
                       "calls %ld, %ld\n",
                       r.types[0], r.allocs[0], r.types[1], r.allocs[1]);
            }
            if (ga == 0 && ra == 0) {
                def = r;
            }
            check_tail(&r, &def, tail_bytes, counted, what);
            if (ga != 0 || ra != 0) {
                run_free(&r);
            }
        }
    }
    /* The direct reduce under a small budget. */
    const size_t small = 3072;
    run_out_t r;
    if (run(m, MFSDP_ALGO_DIRECT, MFSDP_ALGO_DIRECT, small, &r) == 0) {
        check_steady(&r, "direct under a 3 KiB budget");
        CHECK(r.budget == small && r.staging <= small,
              "budget %zu: %zu staging bytes (budget reported %zu)", small, r.staging, r.budget);
        CHECK(def.staging <= def.budget && def.budget == (size_t)64 << 20,
              "default budget %zu: %zu staging bytes", def.budget, def.staging);
        if (g_world > 1 && counted) {
            CHECK(r.p2p[1] >= 4 * def.p2p[1],
                  "3 KiB budget: %ld point-to-point calls per iteration, default %ld: too few "
                  "chunks",
                  r.p2p[1], def.p2p[1]);
        }
        CHECK(r.ngrads == def.ngrads &&
                  (r.ngrads == 0 || memcmp(r.grads, def.grads, r.ngrads * sizeof(float)) == 0),
              "3 KiB budget: owners' gradients differ from the default budget's (%zu vs %zu "
              "elements)",
              r.ngrads, def.ngrads);
        /* The sharded tail went in several passes, in FSDP's bytes, with bitwise the same
         * sums. */
        CHECK(!counted || r.a2a[1] > def.a2a[1],
              "3 KiB budget: %ld tail all-to-alls per iteration, "
              "default %ld: the tail was not cut into passes",
              r.a2a[1], def.a2a[1]);
        check_tail(&r, &def, tail_bytes, counted, "direct under a 3 KiB budget");
        if (g_rank == 0) {
            printf(
                "test_steady: direct reduce, budget %zu: %zu staging bytes, %ld messages and %ld "
                "tail passes per iteration; default budget: %zu bytes, %ld messages, %ld "
                "passes\n",
                small, r.staging, r.p2p[1], r.a2a[1], def.staging, def.p2p[1], def.a2a[1]);
        }
        run_free(&r);
    }
    /* The chain pipelines under a budget below what their default chunk stages: the chunks
     * shrink to fit it, the results stay bitwise the same (the sums keep their rank order). */
    run_out_t dc, rc;
    const size_t tight = 1536;
    if (g_world > 1 && run_pair(m, MFSDP_ALGO_CHAIN, MFSDP_ALGO_CHAIN, tight, &dc, &rc,
                                "chain under a 1.5 KiB budget") == 0) {
        CHECK(rc.gathered == dc.gathered, "chain under the budget: all-gather outputs differ");
        CHECK(rc.ngrads == dc.ngrads &&
                  (rc.ngrads == 0 || memcmp(rc.grads, dc.grads, rc.ngrads * sizeof(float)) == 0),
              "chain under the budget: owners' gradients differ (%zu vs %zu elements)", rc.ngrads,
              dc.ngrads);
        check_tail(&rc, &def, tail_bytes, counted, "chain under a 1.5 KiB budget");
        if (g_rank == 0) {
            printf("test_steady: chain, budget %zu: %zu staging bytes; default budget: %zu\n",
                   tight, rc.staging, dc.staging);
        }
        run_free(&dc);
        run_free(&rc);
    }
    /* The native reduce under a budget below its default staging: chunked into rings. */
    run_out_t dn, rn;
    if (g_world > 1 && run_pair(m, MFSDP_ALGO_DIRECT, MFSDP_ALGO_NATIVE, tight, &dn, &rn,
                                "native reduce under a 1.5 KiB budget") == 0) {
        if (counted) {
            CHECK(rn.ired[1] > dn.ired[1],
                  "native reduce under the budget: %ld MPI_Ireduce per iteration, default %ld: "
                  "not chunked",
                  rn.ired[1], dn.ired[1]);
        }
        long mine = (long)rn.ngrads, all = 0; /* owners' elements compared, over ranks */
        PMPI_Allreduce(&mine, &all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        CHECK(rn.ngrads == dn.ngrads && all > 0,
              "native reduce under the budget: %zu vs %zu gradient elements (%ld on all ranks)",
              rn.ngrads, dn.ngrads, all);
        size_t nn = rn.ngrads < dn.ngrads ? rn.ngrads : dn.ngrads;
        check_close(rn.grads, dn.grads, nn, "native reduce under the budget against unchunked");
        /* and against the direct reduce's exact rank-order sums (the default run) */
        check_close(rn.grads, def.grads, rn.ngrads < def.ngrads ? rn.ngrads : def.ngrads,
                    "native reduce under the budget against the direct reduce");
        check_tail(&rn, &def, tail_bytes, counted, "native reduce under a 1.5 KiB budget");
        if (g_rank == 0) {
            printf("test_steady: native reduce, budget %zu: %zu staging bytes, %ld reduces per "
                   "iteration; default budget: %zu bytes, %ld reduces\n",
                   tight, rn.staging, rn.ired[1], dn.staging, dn.ired[1]);
        }
        run_free(&dn);
        run_free(&rn);
    }
    run_free(&def);
    manifest_free(m);
#ifdef TEST_TRANSPORT_NCCL
    ncclCommDestroy(g_ncomm);
#endif
    int total = 0;
    PMPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("test_steady: %d ranks, %d failures\n", g_world, total);
    }
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
