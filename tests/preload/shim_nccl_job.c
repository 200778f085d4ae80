/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NCCL shim (libmfsdp_preload.so) on a small NCCL job over the test NCCL library, run by
 * shim_nccl_check.py under mpirun with LD_PRELOAD, MFSDP_MANIFEST=MANIFEST (rank 0 writes a
 * one-group manifest there first: the shim reads it at its first intercepted call) and
 * FAKE_NCCL_TRACE (the test library appends "kind count dtype op inplace nranks stream" per
 * call to PREFIX.<rank>, which this program reads back after each of its calls).
 *
 *   stream R      R replicas (HSDP when R > 1; world = R x shard). Every call has its own
 *                 stream value (the test library never dereferences it): each trace line a
 *                 remapped call adds must carry that call's stream -- the shim's settings
 *                 exchange, the transport's transfers, HSDP's attach and all-reduce -- except,
 *                 in the first call, the context creation's uint64 all-reduces, which run
 *                 before the context has a stream (documented). A pass-through call carries
 *                 its stream too. The first all-gather returns FSDP's layout exactly.
 *   group         calls inside a group the job opened: an all-gather that passes through (a
 *                 communicator of another size than the manifest's) works inside the group;
 *                 ncclGroupSimulateEnd closes a group (a remapped call after it succeeds);
 *                 then an all-gather the shim would remap, inside a group, is refused.
 *   group-pass    the same under a shim that remaps nothing (no manifest, or MFSDP_RECORD):
 *                 the last all-gather inside a group passes through and is exact.
 *   group-ar R    HSDP (R replicas): the replicate all-reduce inside a group is refused.
 * Built twice: this program, and a library (SHIM_NCCL_JOB_LIBRARY) that shim_nccl_local.c
 * loads with RTLD_LOCAL.
 * Prints "ok: ..." per check and "shim_nccl_job: checks passed" at the end; exits 2 when a
 * check fails. In the group modes the refusal stops the job: the shim makes it exit non-zero
 * (the checker expects that, with one error line).
 */
#include <mpi.h>
#include <nccl.h>

#ifdef SHIM_NCCL_JOB_LIBRARY
/* Also built as a library that shim_nccl_local.c loads with RTLD_LOCAL, so that the test NCCL
 * library it needs is in no global scope: PyTorch's pip wheels load libnccl that way. */
__attribute__((visibility("default"))) int shim_nccl_job_main(int argc, char **argv);
#define main shim_nccl_job_main
#endif

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define W_ROWS 7
#define W_COLS 5
#define B_ROWS 6

static int rank, world;
static long wrong;
static char trace_path[4096];
static long trace_seen; /* trace lines read so far */

__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "shim_nccl_job: rank %d: FAIL: ", rank);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    wrong++;
}

static float weight(int param, int row, int col)
{
    return (float)(param * 100 + row * 10 + col + 1) / 64.0f;
}

/* One trace line: kind, dtype, stream. */
typedef struct line {
    char kind[32];
    int dtype;
    unsigned long long stream;
} line_t;

/* The trace lines added since the last call (at most max). */
static int new_lines(line_t *out, int max)
{
    FILE *f = fopen(trace_path, "r");
    if (f == NULL) {
        return 0; /* nothing traced yet */
    }
    char buf[512];
    long i = 0;
    int n = 0;
    while (fgets(buf, sizeof(buf), f) != NULL) {
        if (i++ < trace_seen) {
            continue;
        }
        line_t l;
        size_t count;
        int op, inplace, nranks;
        if (sscanf(buf, "%31s %zu %d %d %d %d %llx", l.kind, &count, &l.dtype, &op, &inplace,
                   &nranks, &l.stream) != 7) {
            fail("trace line %ld without a stream column: %s", i, buf);
            continue;
        }
        if (n < max) {
            out[n++] = l;
        }
    }
    fclose(f);
    trace_seen = i;
    return n;
}

/* Every line the call added carries its stream. First call: the shim's settings exchange
 * (first, on the stream), the context's creation (uint64 all-reduces without a stream: the
 * context has none before it exists), then the call's own transfers (on the stream). */
static void check_stream(const char *what, unsigned long long stream, int first)
{
    line_t l[4096];
    int n = new_lines(l, 4096);
    int on = 0, creation = 0, runs = 0;
    if (first && n > 0 && l[0].stream != stream) {
        fail("%s: the settings exchange (the first NCCL call, %s) is on stream 0x%llx, the "
             "call's is 0x%llx",
             what, l[0].kind, l[0].stream, stream);
    }
    for (int i = 0; i < n; i++) {
        if (l[i].stream == stream) {
            on++;
        } else if (first && l[i].stream == 0 && strcmp(l[i].kind, "allreduce") == 0 &&
                   l[i].dtype == (int)ncclUint64) {
            creation++;
            runs += i == 0 || l[i - 1].stream != 0;
        } else {
            fail("%s: a trace line (%s) on stream 0x%llx, the call's is 0x%llx", what, l[i].kind,
                 l[i].stream, stream);
        }
    }
    if (on == 0) {
        fail("%s: no NCCL call on the call's stream (%d lines, %d of the creation)", what, n,
             creation);
    }
    if (first && (creation == 0 || runs != 1)) {
        fail("%s: the context's creation is %d lines in %d runs, want one run", what, creation,
             runs);
    }
    printf("ok: rank %d: %s: %d NCCL calls on stream 0x%llx%s", rank, what, on, stream,
           first ? "" : "\n");
    if (first) {
        printf(" (and %d of the context's creation)\n", creation);
    }
}

static void nccl_ok(ncclResult_t r, const char *what)
{
    if (r != ncclSuccess) {
        fprintf(stderr, "shim_nccl_job: rank %d: %s: %s\n", rank, what, ncclGetErrorString(r));
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
}

/* FSDP's in-place all-gather of the group on comm (shard size s, rank r): this rank's shard
 * of the initial weights in its block, the others poisoned; returns the mismatches against
 * the initial weights in every block when exact, else the non-finite values. grouped: inside
 * a group of its own (*rc_p: the all-gather's status; the group's end runs it). */
static long allgather_in(float *buf, int S, int cw, int cb, int s, int r, ncclComm_t comm,
                         unsigned long long stream, int exact, int grouped, ncclResult_t *rc_p)
{
    for (int i = 0; i < s * S; i++) {
        buf[i] = -12345.0f;
    }
    float *mine = buf + (size_t)r * (size_t)S;
    for (int i = 0; i < cw; i++) {
        for (int j = 0; j < W_COLS; j++) {
            int row = r * cw + i;
            mine[i * W_COLS + j] = row < W_ROWS ? weight(0, row, j) : 0.0f;
        }
    }
    for (int i = 0; i < cb; i++) {
        int row = r * cb + i;
        mine[cw * W_COLS + i] = row < B_ROWS ? weight(1, row, 0) : 0.0f;
    }
    if (grouped) {
        nccl_ok(ncclGroupStart(), "ncclGroupStart");
    }
    ncclResult_t rc =
        ncclAllGather(mine, buf, (size_t)S, ncclFloat32, comm, (cudaStream_t)(uintptr_t)stream);
    if (grouped) {
        ncclGroupEnd();
    }
    if (rc_p != NULL) {
        *rc_p = rc;
        if (rc != ncclSuccess) {
            return 0;
        }
    } else {
        nccl_ok(rc, "ncclAllGather");
    }
    long bad = 0;
    for (int q = 0; q < s; q++) {
        const float *blk = buf + (size_t)q * (size_t)S;
        for (int i = 0; i < cw * W_COLS + cb; i++) {
            int is_w = i < cw * W_COLS;
            int row = q * (is_w ? cw : cb) + (is_w ? i / W_COLS : i - cw * W_COLS);
            float want = is_w ? (row < W_ROWS ? weight(0, row, i % W_COLS) : 0.0f)
                              : (row < B_ROWS ? weight(1, row, 0) : 0.0f);
            bad +=
                exact ? blk[i] != want : !(blk[i] == blk[i] && blk[i] > -1e30f && blk[i] < 1e30f);
        }
    }
    return bad;
}

static long allgather(float *buf, int S, int cw, int cb, int s, int r, ncclComm_t comm,
                      unsigned long long stream, int exact)
{
    return allgather_in(buf, S, cw, cb, s, r, comm, stream, exact, 0, NULL);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const char *mode = argc >= 3 ? argv[1] : "";
    int R = argc >= 4 ? atoi(argv[3]) : 1;
    const char *prefix = getenv("FAKE_NCCL_TRACE");
    int group_mode = strcmp(mode, "group") == 0 || strcmp(mode, "group-pass") == 0;
    if ((strcmp(mode, "stream") != 0 && !group_mode && strcmp(mode, "group-ar") != 0) || R < 1 ||
        world % R != 0 || prefix == NULL) {
        if (rank == 0) {
            fprintf(stderr, "usage: FAKE_NCCL_TRACE=PREFIX shim_nccl_job "
                            "stream|group|group-pass|group-ar MANIFEST [REPLICAS]\n");
        }
        MPI_Finalize();
        return 2;
    }
    snprintf(trace_path, sizeof(trace_path), "%s.%d", prefix, rank);
    const int s = world / R, r = rank % s; /* torch's mesh: rows are shard groups */
    if (rank == 0) {
        FILE *f = fopen(argv[2], "w");
        if (f == NULL) {
            perror(argv[2]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        fprintf(f,
                "{\"format\": \"mfsdp-manifest/1\", \"world_size\": %d, \"replicate\": %d, "
                "\"groups\": [{\"name\": \"g\", \"params\": [{\"name\": \"w\", \"shape\": [%d, "
                "%d], \"dtype\": \"float32\"}, {\"name\": \"b\", \"shape\": [%d], \"dtype\": "
                "\"float32\"}]}]}\n",
                s, R, W_ROWS, W_COLS, B_ROWS);
        fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    ncclUniqueId id;
    if (rank == 0) {
        nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    }
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t wcomm, shard, rep = NULL;
    nccl_ok(ncclCommInitRank(&wcomm, world, id, rank), "ncclCommInitRank");
    shard = wcomm;
    if (R > 1) {
        nccl_ok(ncclCommSplit(wcomm, rank / s, rank, &shard, NULL), "ncclCommSplit (shard)");
        nccl_ok(ncclCommSplit(wcomm, r, rank, &rep, NULL), "ncclCommSplit (replicate)");
    }
    const int cw = (W_ROWS + s - 1) / s, cb = (B_ROWS + s - 1) / s;
    const int S = cw * W_COLS + cb; /* per-rank count: no padding between params */
    float *buf = malloc((size_t)s * (size_t)S * sizeof(float));
    float *out = malloc((size_t)S * sizeof(float));
    int refused = 0;

    long bad = allgather(buf, S, cw, cb, s, r, shard, 0x1001, 1);
    if (bad != 0) {
        fail("first all-gather: %ld elements differ from FSDP's layout", bad);
    }
    if (strcmp(mode, "stream") == 0) {
        check_stream("all-gather (settings exchange, context, owner gather)", 0x1001, 1);
        for (int i = 0; i < s * S; i++) {
            buf[i] = (float)((i * 7 + rank * 3) % 11) / 8.0f - 0.5f; /* gradients */
        }
        nccl_ok(ncclReduceScatter(buf, out, (size_t)S, ncclFloat32, ncclAvg, shard,
                                  (cudaStream_t)0x1002),
                "ncclReduceScatter");
        check_stream("reduce-scatter (reduce to owners, eager step)", 0x1002, 0);
        if (R > 1) {
            nccl_ok(
                ncclAllReduce(out, out, (size_t)S, ncclFloat32, ncclAvg, rep, (cudaStream_t)0x1005),
                "ncclAllReduce (replicate)");
            check_stream("HSDP replicate all-reduce (attach, owners' all-reduce)", 0x1005, 0);
        }
        bad = allgather(buf, S, cw, cb, s, r, shard, 0x1003, 0);
        if (bad != 0) {
            fail("second all-gather: %ld non-finite elements", bad);
        }
        check_stream("all-gather (owner broadcast of the stepped weights)", 0x1003, 0);
        int32_t x = rank, sum = 0; /* not an FSDP collective: passes through */
        nccl_ok(ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, wcomm, (cudaStream_t)0x1004),
                "ncclAllReduce (int32)");
        if (sum != world * (world - 1) / 2) {
            fail("pass-through all-reduce: sum %d, want %d", (int)sum, world * (world - 1) / 2);
        }
        check_stream("pass-through all-reduce", 0x1004, 0);
    } else if (group_mode) {
        /* A communicator of one rank: not the manifest's size, so its calls pass through, and
         * inside a group they run at the group's end as NCCL says. */
        ncclComm_t solo;
        nccl_ok(ncclCommSplit(wcomm, rank, 0, &solo, NULL), "ncclCommSplit (solo)");
        float v = 3.0f + (float)rank, got = -1.0f;
        nccl_ok(ncclGroupStart(), "ncclGroupStart");
        nccl_ok(ncclAllGather(&v, &got, 1, ncclFloat32, solo, NULL), "ncclAllGather (solo)");
        int deferred = got == -1.0f;
        nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
        if (!deferred || got != v) {
            fail("pass-through in a group: deferred %d, value %g (want %g)", deferred, got, v);
        } else {
            printf("ok: rank %d: an all-gather that passes through runs inside the job's group\n",
                   rank);
        }
        nccl_ok(ncclCommDestroy(solo), "ncclCommDestroy (solo)");
        ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
        nccl_ok(ncclGroupStart(), "ncclGroupStart");
        nccl_ok(ncclGroupSimulateEnd(&info), "ncclGroupSimulateEnd");
        bad = allgather(buf, S, cw, cb, s, r, shard, 0x1006, 1);
        if (bad != 0) {
            fail("all-gather after ncclGroupSimulateEnd: %ld elements differ", bad);
        } else {
            printf("ok: rank %d: ncclGroupSimulateEnd closed the group: the next all-gather "
                   "ran at depth 0\n",
                   rank);
        }
        ncclResult_t rc = ncclSuccess;
        bad = allgather_in(buf, S, cw, cb, s, r, shard, 0, 1, 1, &rc);
        if (strcmp(mode, "group") == 0) {
            refused = rc != ncclSuccess;
            printf("%s: rank %d: an all-gather the shim would remap, inside a group: %s\n",
                   refused ? "ok" : "FAIL", rank, ncclGetErrorString(rc));
            wrong += !refused;
        } else if (rc != ncclSuccess || bad != 0) {
            fail("with nothing to remap, an all-gather inside a group: %s, %ld elements differ",
                 ncclGetErrorString(rc), bad);
        } else {
            printf("ok: rank %d: with nothing to remap, an all-gather inside a group passes\n",
                   rank);
        }
    } else { /* group-ar */
        for (int i = 0; i < s * S; i++) {
            buf[i] = 0.25f;
        }
        nccl_ok(ncclReduceScatter(buf, out, (size_t)S, ncclFloat32, ncclAvg, shard, NULL),
                "ncclReduceScatter");
        if (R > 1) {
            nccl_ok(ncclGroupStart(), "ncclGroupStart");
            ncclResult_t rc = ncclAllReduce(out, out, (size_t)S, ncclFloat32, ncclAvg, rep, NULL);
            ncclGroupEnd();
            refused = rc != ncclSuccess;
            printf("%s: rank %d: the HSDP replicate all-reduce inside a group: %s\n",
                   refused ? "ok" : "FAIL", rank, ncclGetErrorString(rc));
            wrong += !refused;
        }
    }

    /* A comm whose remap was refused reports it at destroy too: expected then. */
    ncclComm_t comms[3] = {rep, shard != wcomm ? shard : NULL, wcomm};
    for (int i = 0; i < 3; i++) {
        ncclResult_t d = comms[i] != NULL ? ncclCommDestroy(comms[i]) : ncclSuccess;
        if (d != ncclSuccess && !refused) {
            fail("ncclCommDestroy: %s", ncclGetErrorString(d));
        }
    }
    long total = 0;
    MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0 && total == 0) {
        printf("shim_nccl_job: checks passed\n");
    }
    fflush(stdout);
    free(buf);
    free(out);
    MPI_Finalize();
    return total == 0 ? 0 : 2;
}
