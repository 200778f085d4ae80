/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The test-only NCCL-over-MPI library (tests/lib) checked element by element against MPI
 * references computed on double copies of the same inputs: every collective in and out of
 * place, every builtin op and PreMulSum (host-immediate and device-residence scalars), the
 * dtypes the jobs use, groups (deferred execution, nesting, P2P rings and all-to-all that
 * would deadlock without group semantics, P2P mixed with collectives, several mixed groups
 * in a row, ncclGroupSimulateEnd), ncclCommSplit, two communicators, non-blocking
 * communicators (ncclInProgress, polling), ncclMemAlloc and registration, the pnccl* entry
 * points, and error statuses and messages. Run under mpirun at any number of ranks; prints
 * "#wrong N" per check and exits non-zero when any is wrong.
 */
#include <mpi.h>
#include <nccl.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks;
static long total_wrong;
static int nchecks;

static void report(const char *what, long wrong)
{
    long all = 0;
    MPI_Allreduce(&wrong, &all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%-60s #wrong %ld\n", what, all);
    total_wrong += all;
    nchecks++;
}

static void *tmalloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return p;
}

#define NCCL_OK(call)                                                                              \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess) {                                                                   \
            fprintf(stderr, "rank %d: %s:%d: %s -> %s (%s)\n", rank, __FILE__, __LINE__, #call,    \
                    ncclGetErrorString(r_), ncclGetLastError(NULL));                               \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

/* ---- dtype codecs (independent of the library's) ------------------------------------- */

typedef struct dtype_case {
    ncclDataType_t dt;
    const char *name;
    size_t size;
    int is_float;
    double ulp; /* relative rounding unit for inexact results (avg, premul 1/3) */
} dtype_case_t;

static const dtype_case_t dtypes[] = {
    {ncclFloat32, "float32", 4, 1, 0x1p-23}, {ncclBfloat16, "bfloat16", 2, 1, 0x1p-7},
    {ncclFloat16, "float16", 2, 1, 0x1p-10}, {ncclFloat64, "float64", 8, 1, 0x1p-52},
    {ncclInt32, "int32", 4, 0, 0.0},         {ncclUint8, "uint8", 1, 0, 0.0},
    {ncclInt64, "int64", 8, 0, 0.0},
};

static double half_decode(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* Encode exactly representable values only (the test's inputs are small integers/8). */
static uint16_t half_encode(double v)
{
    if (v == 0.0)
        return 0;
    uint16_t sign = v < 0 ? 0x8000 : 0;
    v = fabs(v);
    int e;
    double f = frexp(v, &e); /* v = f 2^e, f in [0.5, 1) */
    int exp = e + 14;        /* biased exponent of 1.xxx 2^(e-1) */
    uint16_t man = (uint16_t)lrint((f * 2.0 - 1.0) * 1024.0);
    return (uint16_t)(sign | (exp << 10) | man);
}

static void encode(const dtype_case_t *t, const double *x, void *buf, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (t->dt) {
        case ncclFloat32:
            ((float *)buf)[i] = (float)x[i];
            break;
        case ncclFloat64:
            ((double *)buf)[i] = x[i];
            break;
        case ncclBfloat16: {
            float f = (float)x[i];
            uint32_t u;
            memcpy(&u, &f, 4);
            ((uint16_t *)buf)[i] = (uint16_t)(u >> 16); /* inputs have <= 8 significant bits */
            break;
        }
        case ncclFloat16:
            ((uint16_t *)buf)[i] = half_encode(x[i]);
            break;
        case ncclInt32:
            ((int32_t *)buf)[i] = (int32_t)x[i];
            break;
        case ncclUint8:
            ((uint8_t *)buf)[i] = (uint8_t)x[i];
            break;
        case ncclInt64:
            ((int64_t *)buf)[i] = (int64_t)x[i];
            break;
        default:
            break;
        }
    }
}

static double decode1(const dtype_case_t *t, const void *buf, size_t i)
{
    switch (t->dt) {
    case ncclFloat32:
        return ((const float *)buf)[i];
    case ncclFloat64:
        return ((const double *)buf)[i];
    case ncclBfloat16: {
        uint32_t u = (uint32_t)((const uint16_t *)buf)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case ncclFloat16:
        return half_decode(((const uint16_t *)buf)[i]);
    case ncclInt32:
        return ((const int32_t *)buf)[i];
    case ncclUint8:
        return ((const uint8_t *)buf)[i];
    case ncclInt64:
        return (double)((const int64_t *)buf)[i];
    default:
        return NAN;
    }
}

/* Expected value within the datatype's rounding (exact when inexact == 0). */
static int mismatch(const dtype_case_t *t, double got, double want, int inexact)
{
    if (!inexact)
        return got != want;
    /* each rank's term and each partial sum may round once: nranks units at most */
    return fabs(got - want) > (double)nranks * t->ulp * fabs(want) + 1e-300;
}

/* Inputs: small integers so sums and products of up to 4 ranks are exact in every dtype. */
static double input(int r, size_t i, ncclRedOp_t op)
{
    if (op == ncclProd)
        return (double)((r + (int)i) % 3 + 1);
    return (double)((r * 7 + (int)i * 3) % 11 + 1);
}

static const char *op_name(ncclRedOp_t op)
{
    static const char *const names[] = {"sum", "prod", "max", "min", "avg"};
    return (int)op < 5 ? names[op] : "premulsum";
}

/* MPI reference of a reduction over ranks of the double inputs (avg: sum / n). */
static void mpi_reference(const double *x, double *out, size_t n, ncclRedOp_t op, double premul)
{
    MPI_Op mop = op == ncclProd  ? MPI_PROD
                 : op == ncclMax ? MPI_MAX
                 : op == ncclMin ? MPI_MIN
                                 : MPI_SUM;
    double *tmp = tmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        tmp[i] = x[i] * premul;
    MPI_Allreduce(tmp, out, (int)n, MPI_DOUBLE, mop, MPI_COMM_WORLD);
    if (op == ncclAvg)
        for (size_t i = 0; i < n; i++)
            out[i] /= nranks;
    free(tmp);
}

/* ---- collectives --------------------------------------------------------------------- */

#define COUNT 1031

static long check_allreduce(ncclComm_t comm, const dtype_case_t *t, ncclRedOp_t op, int inplace,
                            double premul, int use_p)
{
    size_t n = COUNT;
    double *x = tmalloc(n * sizeof(double)), *want = tmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        x[i] = input(rank, i, op);
    mpi_reference(x, want, n, op, premul);
    void *send = tmalloc(n * t->size), *recv = tmalloc(n * t->size);
    encode(t, x, send, n);
    memset(recv, 0xa5, n * t->size); /* poison */
    if (inplace)
        memcpy(recv, send, n * t->size);
    ncclRedOp_t use = op;
    if (premul != 1.0) {
        double s = premul;
        union {
            double d;
            char bytes[8];
        } sbuf;
        encode(t, &s, sbuf.bytes, 1);
        NCCL_OK(ncclRedOpCreatePreMulSum(&use, sbuf.bytes, t->dt, ncclScalarHostImmediate, comm));
    }
    const void *sp = inplace ? recv : send;
    if (use_p)
        NCCL_OK(pncclAllReduce(sp, recv, n, t->dt, use, comm, NULL));
    else
        NCCL_OK(ncclAllReduce(sp, recv, n, t->dt, use, comm, NULL));
    if (premul != 1.0)
        NCCL_OK(ncclRedOpDestroy(use, comm));
    int inexact = t->is_float && (op == ncclAvg || (premul != 1.0 && premul != 0.5));
    long wrong = 0;
    for (size_t i = 0; i < n; i++) {
        double w = want[i];
        if (!t->is_float && op == ncclAvg)
            w = floor(w); /* integer avg truncates */
        wrong += mismatch(t, decode1(t, recv, i), w, inexact);
    }
    free(x), free(want), free(send), free(recv);
    return wrong;
}

static long check_reduce_scatter(ncclComm_t comm, const dtype_case_t *t, ncclRedOp_t op,
                                 int inplace, double premul)
{
    size_t n = 257, total = n * (size_t)nranks;
    double *x = tmalloc(total * sizeof(double)), *want = tmalloc(total * sizeof(double));
    for (size_t i = 0; i < total; i++)
        x[i] = input(rank, i, op);
    mpi_reference(x, want, total, op, premul);
    void *send = tmalloc(total * t->size), *out = tmalloc(n * t->size);
    encode(t, x, send, total);
    memset(out, 0xa5, n * t->size);
    ncclRedOp_t use = op;
    if (premul != 1.0) {
        double s = premul;
        union {
            double d;
            char bytes[8];
        } sbuf;
        encode(t, &s, sbuf.bytes, 1);
        NCCL_OK(ncclRedOpCreatePreMulSum(&use, sbuf.bytes, t->dt, ncclScalarHostImmediate, comm));
    }
    /* In place: recvbuff == sendbuff + rank * recvcount. */
    void *recv = inplace ? (char *)send + (size_t)rank * n * t->size : out;
    NCCL_OK(ncclReduceScatter(send, recv, n, t->dt, use, comm, NULL));
    if (premul != 1.0)
        NCCL_OK(ncclRedOpDestroy(use, comm));
    int inexact = t->is_float && (op == ncclAvg || (premul != 1.0 && premul != 0.5));
    long wrong = 0;
    for (size_t i = 0; i < n; i++) {
        double w = want[(size_t)rank * n + i];
        if (!t->is_float && op == ncclAvg)
            w = floor(w);
        wrong += mismatch(t, decode1(t, recv, i), w, inexact);
    }
    free(x), free(want), free(send), free(out);
    return wrong;
}

static long check_allgather(ncclComm_t comm, const dtype_case_t *t, int inplace)
{
    size_t n = 333, total = n * (size_t)nranks;
    double *x = tmalloc(n * sizeof(double)), *want = tmalloc(total * sizeof(double));
    for (size_t i = 0; i < n; i++)
        x[i] = input(rank, i, ncclSum);
    MPI_Allgather(x, (int)n, MPI_DOUBLE, want, (int)n, MPI_DOUBLE, MPI_COMM_WORLD);
    void *send = tmalloc(n * t->size), *recv = tmalloc(total * t->size);
    memset(recv, 0xa5, total * t->size);
    encode(t, x, send, n);
    const void *sp = send;
    if (inplace) { /* FSDP2: the shard is copied into recv + rank * count first */
        memcpy((char *)recv + (size_t)rank * n * t->size, send, n * t->size);
        sp = (char *)recv + (size_t)rank * n * t->size;
    }
    NCCL_OK(ncclAllGather(sp, recv, n, t->dt, comm, NULL));
    long wrong = 0;
    for (size_t i = 0; i < total; i++)
        wrong += mismatch(t, decode1(t, recv, i), want[i], 0);
    free(x), free(want), free(send), free(recv);
    return wrong;
}

static long check_broadcast_reduce(ncclComm_t comm, const dtype_case_t *t, int root, int inplace)
{
    size_t n = 500;
    double *x = tmalloc(n * sizeof(double)), *want = tmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        x[i] = input(rank, i, ncclSum);
    void *send = tmalloc(n * t->size), *recv = tmalloc(n * t->size);
    long wrong = 0;
    /* broadcast: everyone ends with the root's inputs */
    encode(t, x, send, n);
    memset(recv, 0xa5, n * t->size);
    if (inplace)
        memcpy(recv, send, n * t->size);
    NCCL_OK(ncclBroadcast(inplace ? recv : send, recv, n, t->dt, root, comm, NULL));
    for (size_t i = 0; i < n; i++)
        wrong += mismatch(t, decode1(t, recv, i), input(root, i, ncclSum), 0);
    /* reduce (sum) to root, against MPI_Reduce of the doubles */
    MPI_Reduce(x, want, (int)n, MPI_DOUBLE, MPI_SUM, root, MPI_COMM_WORLD);
    memset(recv, 0xa5, n * t->size);
    if (inplace && rank == root)
        memcpy(recv, send, n * t->size);
    NCCL_OK(ncclReduce(inplace && rank == root ? recv : send, recv, n, t->dt, ncclSum, root, comm,
                       NULL));
    if (rank == root)
        for (size_t i = 0; i < n; i++)
            wrong += mismatch(t, decode1(t, recv, i), want[i], 0);
    free(x), free(want), free(send), free(recv);
    return wrong;
}

/* ---- groups ------------------------------------------------------------------------------ */

static long check_group_ring_alltoall(ncclComm_t comm)
{
    size_t n = 4099; /* large enough to need a rendezvous: blocking sends would deadlock */
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    float *sendb = tmalloc(n * sizeof(float)), *recvb = tmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        sendb[i] = (float)(rank * 100000 + (int)i);
    memset(recvb, 0xff, n * sizeof(float));
    long wrong = 0;
    /* ring: every rank sends first, then receives; only group semantics make that safe */
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(sendb, n, ncclFloat32, next, comm, NULL));
    NCCL_OK(ncclRecv(recvb, n, ncclFloat32, prev, comm, NULL));
    NCCL_OK(ncclGroupEnd());
    for (size_t i = 0; i < n; i++)
        wrong += recvb[i] != (float)(prev * 100000 + (int)i);
    /* all-to-all with nested groups: nothing may run before the outermost end */
    size_t m = 1000;
    float *a2a_s = tmalloc(m * (size_t)nranks * sizeof(float));
    float *a2a_r = tmalloc(m * (size_t)nranks * sizeof(float));
    for (int p = 0; p < nranks; p++)
        for (size_t i = 0; i < m; i++)
            a2a_s[(size_t)p * m + i] = (float)(rank * 1000 + p * 10 + (int)(i % 7));
    memset(a2a_r, 0xff, m * (size_t)nranks * sizeof(float));
    uint32_t poison;
    memcpy(&poison, a2a_r, sizeof(poison));
    NCCL_OK(ncclGroupStart());
    for (int p = 0; p < nranks; p++) {
        NCCL_OK(ncclGroupStart());
        NCCL_OK(ncclSend(a2a_s + (size_t)p * m, m, ncclFloat32, p, comm, NULL));
        NCCL_OK(ncclRecv(a2a_r + (size_t)p * m, m, ncclFloat32, p, comm, NULL));
        NCCL_OK(ncclGroupEnd());
    }
    uint32_t probe;
    memcpy(&probe, a2a_r, sizeof(probe));
    wrong += probe != poison; /* still deferred inside the outer group */
    NCCL_OK(ncclGroupEnd());
    for (int p = 0; p < nranks; p++)
        for (size_t i = 0; i < m; i++)
            wrong += a2a_r[(size_t)p * m + i] != (float)(p * 1000 + rank * 10 + (int)(i % 7));
    free(sendb), free(recvb), free(a2a_s), free(a2a_r);
    return wrong;
}

static long check_group_mixed(ncclComm_t comm)
{
    /* A group holding an all-reduce, an in-place all-gather, a premulsum reduce-scatter with
     * a device-residence scalar (read when the group runs) and a P2P exchange. */
    size_t n = 300;
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    float *ar = tmalloc(n * sizeof(float)), *ag = tmalloc(n * (size_t)nranks * sizeof(float));
    float *rs_s = tmalloc(n * (size_t)nranks * sizeof(float)), *rs_r = tmalloc(n * sizeof(float));
    float *p2p_s = tmalloc(n * sizeof(float)), *p2p_r = tmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        ar[i] = (float)(rank + (int)i);
        ag[(size_t)rank * n + i] = (float)(rank * 10 + (int)i);
        p2p_s[i] = (float)(rank * 3 + (int)i);
    }
    for (size_t i = 0; i < n * (size_t)nranks; i++)
        rs_s[i] = (float)((int)i % 13 + rank);
    float scalar = 1.0f; /* device residence: the value at execution time counts */
    ncclRedOp_t pm;
    NCCL_OK(ncclRedOpCreatePreMulSum(&pm, &scalar, ncclFloat32, ncclScalarDevice, comm));
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclAllReduce(ar, ar, n, ncclFloat32, ncclSum, comm, NULL));
    NCCL_OK(ncclSend(p2p_s, n, ncclFloat32, next, comm, NULL));
    NCCL_OK(ncclAllGather(ag + (size_t)rank * n, ag, n, ncclFloat32, comm, NULL));
    NCCL_OK(ncclReduceScatter(rs_s, rs_r, n, ncclFloat32, pm, comm, NULL));
    NCCL_OK(ncclRecv(p2p_r, n, ncclFloat32, prev, comm, NULL));
    scalar = 0.25f;
    NCCL_OK(ncclGroupEnd());
    NCCL_OK(ncclRedOpDestroy(pm, comm));
    long wrong = 0;
    for (size_t i = 0; i < n; i++) {
        float sum_ar = 0.0f, sum_rs = 0.0f;
        for (int q = 0; q < nranks; q++) {
            sum_ar += (float)(q + (int)i);
            sum_rs += 0.25f * (float)((int)((size_t)rank * n + i) % 13 + q);
        }
        wrong += ar[i] != sum_ar;
        wrong += rs_r[i] != sum_rs;
        wrong += p2p_r[i] != (float)(prev * 3 + (int)i);
        for (int q = 0; q < nranks; q++)
            wrong += ag[(size_t)q * n + i] != (float)(q * 10 + (int)i);
    }
    free(ar), free(ag), free(rs_s), free(rs_r), free(p2p_s), free(p2p_r);
    return wrong;
}

/* Several groups in a row, each mixing broadcast, reduce, reduce-scatter and a send/recv
 * ring with a different root: what the NCCL transport issues, one group per wave. */
static long check_groups_in_row(ncclComm_t comm)
{
    size_t n = 257;
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    long wrong = 0;
    float *bc = tmalloc(n * sizeof(float)), *rd_s = tmalloc(n * sizeof(float));
    float *rd_r = tmalloc(n * sizeof(float)), *rs_s = tmalloc(n * (size_t)nranks * sizeof(float));
    float *rs_r = tmalloc(n * sizeof(float));
    float *s1 = tmalloc(n * sizeof(float)), *r1 = tmalloc(n * sizeof(float));
    for (int g = 0; g < 3; g++) {
        int root = g % nranks;
        for (size_t i = 0; i < n; i++) {
            bc[i] = rank == root ? (float)(g * 1000 + (int)i) : -1.0f;
            rd_s[i] = (float)(rank + g + (int)i);
            rd_r[i] = -1.0f;
            s1[i] = (float)(rank * 7 + g + (int)i);
        }
        for (size_t i = 0; i < n * (size_t)nranks; i++)
            rs_s[i] = (float)((int)i % 11 + rank + g);
        NCCL_OK(ncclGroupStart());
        NCCL_OK(ncclSend(s1, n, ncclFloat32, next, comm, NULL));
        NCCL_OK(ncclBroadcast(bc, bc, n, ncclFloat32, root, comm, NULL));
        NCCL_OK(ncclReduce(rd_s, rank == root ? rd_r : NULL, n, ncclFloat32, ncclSum, root, comm,
                           NULL));
        NCCL_OK(ncclReduceScatter(rs_s, rs_r, n, ncclFloat32, ncclSum, comm, NULL));
        NCCL_OK(ncclRecv(r1, n, ncclFloat32, prev, comm, NULL));
        NCCL_OK(ncclGroupEnd());
        for (size_t i = 0; i < n; i++) {
            float sum_rd = 0.0f, sum_rs = 0.0f;
            for (int q = 0; q < nranks; q++) {
                sum_rd += (float)(q + g + (int)i);
                sum_rs += (float)((int)((size_t)rank * n + i) % 11 + q + g);
            }
            wrong += bc[i] != (float)(g * 1000 + (int)i);
            wrong += rank == root && rd_r[i] != sum_rd;
            wrong += rank != root && rd_r[i] != -1.0f;
            wrong += rs_r[i] != sum_rs;
            wrong += r1[i] != (float)(prev * 7 + g + (int)i);
        }
    }
    free(bc), free(rd_s), free(rd_r), free(rs_s), free(rs_r), free(s1), free(r1);
    return wrong;
}

/* Poll a non-blocking communicator until its call is done; the number of polls it took. */
static int poll_done(ncclComm_t comm, long *wrong)
{
    int polls = 0;
    ncclResult_t a = ncclInProgress;
    while (a == ncclInProgress && polls < 1000) {
        NCCL_OK(ncclCommGetAsyncError(comm, &a));
        polls++;
    }
    *wrong += a != ncclSuccess;
    return polls;
}

/* ncclConfig_t.blocking = 0: init, split, a lone collective and a group end return
 * ncclInProgress; the communicator refuses calls until polled done. */
static long check_nonblocking(ncclComm_t comm)
{
    long wrong = 0;
    setenv("FAKE_NCCL_INPROGRESS_POLLS", "2", 1);
    ncclUniqueId id;
    if (rank == 0)
        NCCL_OK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t nb;
    wrong += ncclCommInitRankConfig(&nb, nranks, id, rank, &cfg) != ncclInProgress;
    int count = 0;
    wrong += ncclCommCount(nb, &count) != ncclInvalidUsage;
    wrong += strstr(ncclGetLastError(NULL), "still in progress") == NULL;
    wrong += poll_done(nb, &wrong) != 3;
    NCCL_OK(ncclCommCount(nb, &count));
    wrong += count != nranks;
    int32_t x = rank + 1, sum = 0;
    wrong += ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, nb, NULL) != ncclInProgress;
    wrong += ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, nb, NULL) != ncclInvalidUsage;
    poll_done(nb, &wrong);
    wrong += sum != nranks * (nranks + 1) / 2;
    int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
    int32_t got = -1, all[64];
    NCCL_OK(ncclGroupStart());
    wrong += ncclSend(&x, 1, ncclInt32, next, nb, NULL) != ncclSuccess;
    wrong += ncclRecv(&got, 1, ncclInt32, prev, nb, NULL) != ncclSuccess;
    wrong += ncclAllGather(&x, all, 1, ncclInt32, nb, NULL) != ncclSuccess;
    wrong += ncclGroupEnd() != ncclInProgress;
    poll_done(nb, &wrong);
    wrong += got != prev + 1;
    for (int q = 0; q < nranks; q++)
        wrong += all[q] != q + 1;
    ncclComm_t half;
    wrong += ncclCommSplit(nb, rank % 2, rank, &half, &cfg) != ncclInProgress;
    poll_done(half, &wrong);
    NCCL_OK(ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, comm, NULL)); /* blocking one */
    wrong += ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, half, NULL) != ncclInProgress;
    poll_done(half, &wrong);
    int32_t want = 0;
    for (int q = rank % 2; q < nranks; q += 2)
        want += q + 1;
    wrong += sum != want;
    NCCL_OK(ncclCommDestroy(half));
    NCCL_OK(ncclCommDestroy(nb));
    unsetenv("FAKE_NCCL_INPROGRESS_POLLS");
    return wrong;
}

void mfsdp_fake_nccl_stats(long *allocs, long *regs);

/* ncclMemAlloc / ncclCommRegister on host memory: live handles, checked deregistration. */
static long check_register(ncclComm_t comm)
{
    long wrong = 0, a0, r0, a1, r1;
    mfsdp_fake_nccl_stats(&a0, &r0);
    void *p = NULL, *h = NULL, *h2 = NULL;
    NCCL_OK(ncclMemAlloc(&p, 1000));
    wrong += p == NULL || ((uintptr_t)p & 4095) != 0;
    NCCL_OK(ncclCommRegister(comm, p, 1000, &h));
    NCCL_OK(ncclCommRegister(comm, p, 500, &h2));
    wrong += h == NULL || h == h2;
    mfsdp_fake_nccl_stats(&a1, &r1);
    wrong += a1 != a0 + 1 || r1 != r0 + 2;
    wrong += ncclCommDeregister(comm, (void *)&wrong) != ncclInvalidArgument;
    wrong += strstr(ncclGetLastError(NULL), "not a live registration") == NULL;
    NCCL_OK(ncclCommDeregister(comm, h));
    wrong += ncclCommDeregister(comm, h) != ncclInvalidArgument;
    NCCL_OK(ncclCommDeregister(comm, h2));
    wrong += ncclCommRegister(comm, p, 0, &h) != ncclInvalidArgument;
    NCCL_OK(ncclMemFree(p));
    mfsdp_fake_nccl_stats(&a1, &r1);
    wrong += a1 != a0 || r1 != r0;
    return wrong;
}

/* ---- communicators, entry points, errors ---------------------------------------------- */

static long check_comm_queries(ncclComm_t comm)
{
    long wrong = 0;
    int v = 0, count = -1, r = -1, dev = -1;
    NCCL_OK(ncclGetVersion(&v));
    NCCL_OK(ncclCommCount(comm, &count));
    NCCL_OK(ncclCommUserRank(comm, &r));
    NCCL_OK(ncclCommCuDevice(comm, &dev));
    wrong += v != NCCL_VERSION_CODE;
    wrong += count != nranks;
    wrong += r != rank;
    wrong += dev != 0;
    /* nccl* are aliases of the pnccl* entry points, as in NCCL */
    wrong += (void *)ncclAllGather != (void *)pncclAllGather;
    wrong += (void *)ncclReduceScatter != (void *)pncclReduceScatter;
    wrong += (void *)ncclRedOpCreatePreMulSum != (void *)pncclRedOpCreatePreMulSum;
    wrong += (void *)ncclGroupEnd != (void *)pncclGroupEnd;
    return wrong;
}

static long check_split_and_second_comm(ncclComm_t comm)
{
    long wrong = 0;
    ncclComm_t half;
    NCCL_OK(ncclCommSplit(comm, rank % 2, rank, &half, NULL));
    int hn = 0, hr = 0;
    NCCL_OK(ncclCommCount(half, &hn));
    NCCL_OK(ncclCommUserRank(half, &hr));
    wrong += hn != (nranks + 1 - rank % 2) / 2;
    wrong += hr != rank / 2;
    int32_t x = rank, sum = 0;
    NCCL_OK(ncclAllReduce(&x, &sum, 1, ncclInt32, ncclSum, half, NULL));
    int32_t want = 0;
    for (int q = rank % 2; q < nranks; q += 2)
        want += q;
    wrong += sum != want;
    NCCL_OK(ncclCommDestroy(half));
    /* NOCOLOR gives a NULL communicator */
    ncclComm_t none = (ncclComm_t)&x;
    NCCL_OK(ncclCommSplit(comm, rank == 0 ? NCCL_SPLIT_NOCOLOR : 1, rank, &none, NULL));
    wrong += rank == 0 ? none != NULL : none == NULL;
    if (none != NULL)
        NCCL_OK(ncclCommDestroy(none));
    /* a second world communicator from its own id (reverse rank order) */
    ncclUniqueId id;
    if (rank == 0)
        NCCL_OK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t rev;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    NCCL_OK(ncclCommInitRankConfig(&rev, nranks, id, nranks - 1 - rank, &cfg));
    float f = (float)rank, g[64];
    NCCL_OK(ncclAllGather(&f, g, 1, ncclFloat32, rev, NULL));
    for (int q = 0; q < nranks; q++)
        wrong += g[q] != (float)(nranks - 1 - q);
    NCCL_OK(ncclCommDestroy(rev));
    return wrong;
}

/* ncclGroupSimulateEnd ends the group without running it. */
static long check_group_simulate(ncclComm_t comm)
{
    long wrong = 0;
    float x = 1.0f + (float)rank, y = -1.0f;
    ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, NULL));
    wrong += ncclGroupSimulateEnd(NULL) != ncclInvalidArgument; /* the group stays open */
    NCCL_OK(pncclGroupSimulateEnd(&info));
    wrong += y != -1.0f;                         /* nothing ran */
    wrong += info.estimatedTime != 0.0f;         /* written */
    wrong += ncclGroupEnd() != ncclInvalidUsage; /* and the group is closed */
    NCCL_OK(ncclGroupStart());                   /* the next group runs as usual */
    NCCL_OK(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, NULL));
    NCCL_OK(ncclGroupEnd());
    wrong += y != (float)(nranks * (nranks + 1) / 2);
    return wrong;
}

static long check_errors(ncclComm_t comm)
{
    long wrong = 0;
    float buf[8] = {0};
    ncclRedOp_t op;
    wrong += ncclAllReduce(buf, buf, 8, ncclFloat32, ncclSum, NULL, NULL) != ncclInvalidArgument;
    wrong += strstr(ncclGetLastError(NULL), "comm is NULL") == NULL;
    wrong += ncclAllGather(buf, buf, 1, (ncclDataType_t)99, comm, NULL) != ncclInvalidArgument;
    wrong += strstr(ncclGetLastError(NULL), "invalid datatype") == NULL;
    wrong += ncclAllReduce(buf, buf, 8, ncclFloat8e4m3, ncclSum, comm, NULL) != ncclInvalidArgument;
    wrong += ncclAllReduce(buf, buf, 8, ncclFloat32, (ncclRedOp_t)(ncclNumOps + 7), comm, NULL) !=
             ncclInvalidArgument;
    wrong += strstr(ncclGetLastError(NULL), "invalid reduction op") == NULL;
    wrong += ncclBroadcast(buf, buf, 8, ncclFloat32, nranks, comm, NULL) != ncclInvalidArgument;
    wrong += ncclGroupEnd() != ncclInvalidUsage;
    wrong += ncclRedOpDestroy((ncclRedOp_t)(ncclNumOps + 3), comm) != ncclInvalidArgument;
    /* a PreMulSum op is bound to its datatype */
    float two = 2.0f;
    NCCL_OK(ncclRedOpCreatePreMulSum(&op, &two, ncclFloat32, ncclScalarHostImmediate, comm));
    wrong += ncclAllReduce(buf, buf, 4, ncclFloat64, op, comm, NULL) != ncclInvalidArgument;
    wrong += strstr(ncclGetLastError(NULL), "created for datatype") == NULL;
    NCCL_OK(ncclRedOpDestroy(op, comm));
    /* an error inside a group is returned by the group end, and nothing runs */
    NCCL_OK(ncclGroupStart());
    wrong += ncclSend(buf, 1, ncclFloat32, -1, comm, NULL) != ncclInvalidArgument;
    wrong += ncclGroupEnd() != ncclInvalidArgument;
    wrong += strcmp(ncclGetErrorString(ncclSuccess), "no error") != 0;
    ncclComm_t c2;
    ncclUniqueId bogus;
    memset(&bogus, 0, sizeof(bogus));
    wrong += ncclCommInitRank(&c2, nranks, bogus, rank) != ncclInvalidArgument;
    return wrong;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    ncclUniqueId id;
    if (rank == 0)
        NCCL_OK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    NCCL_OK(ncclCommInitRank(&comm, nranks, id, rank));

    char what[128];
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
        const dtype_case_t *t = &dtypes[d];
        for (int op = ncclSum; op <= ncclAvg; op++)
            for (int inplace = 0; inplace < 2; inplace++) {
                snprintf(what, sizeof(what), "allreduce %s %s %s", t->name,
                         op_name((ncclRedOp_t)op), inplace ? "in-place" : "out-of-place");
                report(what, check_allreduce(comm, t, (ncclRedOp_t)op, inplace, 1.0, 0));
            }
        if (t->is_float) {
            snprintf(what, sizeof(what), "allreduce %s premulsum(0.5) via pncclAllReduce", t->name);
            report(what, check_allreduce(comm, t, ncclSum, 0, 0.5, 1));
        }
        for (int op = ncclSum; op <= ncclAvg; op += ncclAvg)
            for (int inplace = 0; inplace < 2; inplace++) {
                snprintf(what, sizeof(what), "reduce_scatter %s %s %s", t->name,
                         op_name((ncclRedOp_t)op), inplace ? "in-place" : "out-of-place");
                report(what, check_reduce_scatter(comm, t, (ncclRedOp_t)op, inplace, 1.0));
            }
        if (t->is_float) {
            snprintf(what, sizeof(what), "reduce_scatter %s premulsum(0.5)", t->name);
            report(what, check_reduce_scatter(comm, t, ncclSum, 0, 0.5));
            snprintf(what, sizeof(what), "reduce_scatter %s premulsum(1/3)", t->name);
            report(what, check_reduce_scatter(comm, t, ncclSum, 0, 1.0 / 3.0));
        }
        for (int inplace = 0; inplace < 2; inplace++) {
            snprintf(what, sizeof(what), "allgather %s %s", t->name,
                     inplace ? "in-place (send == recv + rank*count)" : "out-of-place");
            report(what, check_allgather(comm, t, inplace));
        }
        for (int root = 0; root < nranks; root++) {
            snprintf(what, sizeof(what), "broadcast+reduce %s root %d", t->name, root);
            report(what, check_broadcast_reduce(comm, t, root, root % 2));
        }
    }
    report("group: send/recv ring, nested all-to-all", check_group_ring_alltoall(comm));
    report("group: allreduce+allgather+premulsum(device scalar)+p2p", check_group_mixed(comm));
    report("groups in a row: bcast+reduce+reduce_scatter+p2p", check_groups_in_row(comm));
    report("ncclGroupSimulateEnd: the group ends, nothing runs", check_group_simulate(comm));
    report("non-blocking init/split/collectives/groups", check_nonblocking(comm));
    report("ncclMemAlloc, ncclCommRegister/Deregister", check_register(comm));
    report("comm queries, pnccl aliases", check_comm_queries(comm));
    report("commSplit, NOCOLOR, second comm (InitRankConfig)", check_split_and_second_comm(comm));
    report("error statuses and messages", check_errors(comm));

    NCCL_OK(ncclCommDestroy(comm));
    if (rank == 0)
        printf("%d checks at %d ranks: %ld wrong\n", nchecks, nranks, total_wrong);
    MPI_Finalize();
    return total_wrong == 0 ? 0 : 1;
}
