/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libnccl_mpi_fake.so -- a TEST-ONLY stand-in for NCCL that implements a subset of the NCCL
 * API with MPI on HOST memory. It is never installed and must never be used by a real job:
 * it exists so that the NCCL flavour of examples/fsdp_train and the NCCL front-end of the
 * LD_PRELOAD shim can run under mpirun on machines without a GPU.
 *
 * - Types and prototypes come from the real nccl.h, so a job compiles unchanged against
 *   either library. Every entry point is a strong `pncclX` with a weak `ncclX` alias, as in
 *   NCCL, so a preloaded interposer can forward to `pncclX`.
 * - Buffers are host pointers; the stream argument is only recorded (FAKE_NCCL_TRACE) and
 *   every call has completed when it returns (as if the stream were synchronized).
 * - The job may call MPI_Init itself (NCCL jobs that use MPI only to broadcast the unique
 *   id). A job that does not (fsdp_train_nccl_nompi: ranks from RANK/WORLD_SIZE, the id
 *   through a file) still runs under mpirun: the first ncclCommInitRank initializes MPI
 *   (PMPI_Init) and the library finalizes it at exit.
 *   The library's own traffic goes through the PMPI_ names: it stands in for NCCL, which uses
 *   no MPI, so an MPI interposer (the shim's MPI front-end, a tracing tool) must not see it.
 *   ncclCommInitRank splits MPI_COMM_WORLD by a hash of the unique id, so it is collective
 *   over MPI_COMM_WORLD: every process of the job must create its communicators in the same
 *   order (true of FSDP/HSDP jobs, not of arbitrary subset communicators).
 * - Group semantics: calls between the outermost ncclGroupStart/End are deferred; at the
 *   outermost End all sends and receives are posted non-blocking, the collectives run in
 *   call order, then everything is waited for, so matched P2P inside a group never
 *   deadlocks. Collectives of one group on several communicators must be issued in the same
 *   order on every rank (a limitation NCCL does not have).
 * - Reductions: sum/prod/max/min/avg and PreMulSum ops on int8/uint8/int32/uint32/int64/
 *   uint64/float16/float32/float64/bfloat16. Avg is the sum divided by nranks in the
 *   datatype; PreMulSum multiplies each rank's input by the scalar (in the datatype) before
 *   summing. fp8 types travel in copy-only collectives (all-gather, broadcast, send/recv).
 * - Messages go to stderr when NCCL_DEBUG is WARN, INFO or TRACE, and are always available
 *   through ncclGetLastError().
 * - FAKE_NCCL_TRACE=prefix appends one line per collective or P2P call, in issue order, to
 *   the file prefix.<MPI_COMM_WORLD rank>: "kind count dtype op inplace nranks stream" (the
 *   stream argument as 0x-hex), so tests can check what a job puts on the wire and on which
 *   stream.
 * - ncclGroupSimulateEnd ends a group like ncclGroupEnd but runs none of its calls (a
 *   simulation); estimatedTime is 0.
 * - Non-blocking communicators (ncclConfig_t.blocking = 0 at init or split): init, split, a
 *   collective or P2P call outside a group and the outermost ncclGroupEnd complete their work
 *   and return ncclInProgress; ncclCommGetAsyncError then answers ncclInProgress
 *   FAKE_NCCL_INPROGRESS_POLLS times (default 3; "forever" never finishes, to test timeouts)
 *   before ncclSuccess. Calling the communicator again before that is ncclInvalidUsage, as
 *   NCCL requires polling first.
 * - ncclMemAlloc returns page-aligned host memory; ncclCommRegister hands out a handle per
 *   registration, ncclCommDeregister accepts only a live handle of that communicator.
 *   mfsdp_fake_nccl_stats() reports live allocations and registrations (leak checks).
 */
#include <mpi.h>
#include <nccl.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAKE_EXPORT   __attribute__((visibility("default")))
#define FAKE_MAX_OPS  64
#define FAKE_ID_MAGIC "fake-nccl-over-mpi/1"

/* Strong pncclX definition plus the weak ncclX alias that jobs link against. */
#define FAKE_ALIAS(name)                                                                           \
    extern __typeof(p##name) name __attribute__((weak, alias("p" #name), visibility("default")))

typedef struct fake_redop {
    int used;
    ncclDataType_t dtype;
    ncclScalarResidence_t residence;
    double value;       /* ncclScalarHostImmediate: read at creation */
    const void *scalar; /* ncclScalarDevice: read when the collective runs */
} fake_redop_t;

#define FAKE_MAX_REGS 64

typedef struct fake_reg {
    void *buff;
    size_t size;
} fake_reg_t;

struct ncclComm {
    MPI_Comm mpi;
    int rank;
    int nranks;
    ncclUniqueId id;
    fake_redop_t ops[FAKE_MAX_OPS];
    int nonblocking;
    long pending; /* ncclCommGetAsyncError answers ncclInProgress this many more times; -1:
                     forever */
    fake_reg_t *regs[FAKE_MAX_REGS];
};

static long live_allocs, live_regs; /* for mfsdp_fake_nccl_stats() */

typedef enum {
    FAKE_ALLGATHER,
    FAKE_REDUCE_SCATTER,
    FAKE_ALLREDUCE,
    FAKE_BROADCAST,
    FAKE_REDUCE,
    FAKE_SEND,
    FAKE_RECV,
} fake_kind_t;

typedef struct fake_call {
    fake_kind_t kind;
    const void *send;
    void *recv;
    size_t count;
    ncclDataType_t dtype;
    ncclRedOp_t op;
    int root; /* root, or peer for send/recv */
    ncclComm_t comm;
    cudaStream_t stream; /* recorded only */
} fake_call_t;

/* Group state is per thread, as in NCCL. */
static _Thread_local int group_depth;
static _Thread_local fake_call_t *group_calls;
static _Thread_local size_t group_ncalls;
static _Thread_local size_t group_cap;
static _Thread_local ncclResult_t group_error;
static _Thread_local char last_error[256];

static pthread_once_t half_ops_once = PTHREAD_ONCE_INIT;
static MPI_Datatype bf16_type = MPI_DATATYPE_NULL;
static MPI_Datatype fp16_type = MPI_DATATYPE_NULL;
static MPI_Op half_ops[2][4]; /* [bf16, fp16][sum, prod, max, min] */
static int half_ops_rc = MPI_SUCCESS;
static unsigned long long id_counter;
static pthread_once_t trace_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *trace_file;

__attribute__((format(printf, 1, 2))) static void fake_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    const char *dbg = getenv("NCCL_DEBUG");
    if (dbg != NULL &&
        (strcmp(dbg, "WARN") == 0 || strcmp(dbg, "INFO") == 0 || strcmp(dbg, "TRACE") == 0))
        fprintf(stderr, "%d fake-nccl WARN %s\n", (int)getpid(), last_error);
}

/* ---- datatypes ---------------------------------------------------------------------- */

static size_t dtype_size(ncclDataType_t dt)
{
    switch (dt) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    default:
        return 0;
    }
}

static float bf16_to_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint16_t float_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float fp16_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint16_t float_to_fp16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (absu >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (absu < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (absu < 0x33000000u)
            return sign;
        uint32_t man = (absu & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(absu >> 23) + 13; /* 14..24 */
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = ((absu >> 13) - (112u << 10));
    uint32_t rem = absu & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static float half_load(int is_bf16, uint16_t h)
{
    return is_bf16 ? bf16_to_float(h) : fp16_to_float(h);
}

static uint16_t half_store(int is_bf16, float f)
{
    return is_bf16 ? float_to_bf16(f) : float_to_fp16(f);
}

#define HALF_OP_FN(name, is_bf16, expr)                                                            \
    static void name(void *in, void *inout, int *len, MPI_Datatype *type)                          \
    {                                                                                              \
        const uint16_t *x = in;                                                                    \
        uint16_t *y = inout;                                                                       \
        for (int i = 0; i < *len; i++) {                                                           \
            float a = half_load(is_bf16, x[i]), b = half_load(is_bf16, y[i]);                      \
            y[i] = half_store(is_bf16, (expr));                                                    \
        }                                                                                          \
    }
HALF_OP_FN(bf16_sum, 1, a + b)
HALF_OP_FN(bf16_prod, 1, a *b)
HALF_OP_FN(bf16_max, 1, a > b ? a : b)
HALF_OP_FN(bf16_min, 1, a < b ? a : b)
HALF_OP_FN(fp16_sum, 0, a + b)
HALF_OP_FN(fp16_prod, 0, a *b)
HALF_OP_FN(fp16_max, 0, a > b ? a : b)
HALF_OP_FN(fp16_min, 0, a < b ? a : b)

static void half_ops_init(void)
{
    MPI_User_function *fns[2][4] = {{bf16_sum, bf16_prod, bf16_max, bf16_min},
                                    {fp16_sum, fp16_prod, fp16_max, fp16_min}};
    int rc = MPI_Type_contiguous(1, MPI_UINT16_T, &bf16_type);
    if (rc == MPI_SUCCESS)
        rc = MPI_Type_commit(&bf16_type);
    if (rc == MPI_SUCCESS)
        rc = MPI_Type_contiguous(1, MPI_UINT16_T, &fp16_type);
    if (rc == MPI_SUCCESS)
        rc = MPI_Type_commit(&fp16_type);
    for (int t = 0; t < 2 && rc == MPI_SUCCESS; t++)
        for (int o = 0; o < 4 && rc == MPI_SUCCESS; o++)
            rc = MPI_Op_create(fns[t][o], 1, &half_ops[t][o]);
    half_ops_rc = rc;
}

/* MPI datatype and op for a reduction; base is the builtin op the reduction runs with. */
static ncclResult_t mpi_reduce_types(ncclDataType_t dt, ncclRedOp_t base, MPI_Datatype *type,
                                     MPI_Op *op)
{
    int oi = base == ncclProd ? 1 : base == ncclMax ? 2 : base == ncclMin ? 3 : 0;
    if (dt == ncclFloat16 || dt == ncclBfloat16) {
        pthread_once(&half_ops_once, half_ops_init);
        if (half_ops_rc != MPI_SUCCESS) {
            fake_warn("could not create the 16-bit float MPI operations");
            return ncclSystemError;
        }
        int t = dt == ncclBfloat16 ? 0 : 1;
        *type = t == 0 ? bf16_type : fp16_type;
        *op = half_ops[t][oi];
        return ncclSuccess;
    }
    static const MPI_Op builtin[4] = {MPI_SUM, MPI_PROD, MPI_MAX, MPI_MIN};
    switch (dt) {
    case ncclInt8:
        *type = MPI_INT8_T;
        break;
    case ncclUint8:
        *type = MPI_UINT8_T;
        break;
    case ncclInt32:
        *type = MPI_INT32_T;
        break;
    case ncclUint32:
        *type = MPI_UINT32_T;
        break;
    case ncclInt64:
        *type = MPI_INT64_T;
        break;
    case ncclUint64:
        *type = MPI_UINT64_T;
        break;
    case ncclFloat32:
        *type = MPI_FLOAT;
        break;
    case ncclFloat64:
        *type = MPI_DOUBLE;
        break;
    default:
        fake_warn("datatype %d cannot be reduced", (int)dt);
        return ncclInvalidArgument;
    }
    *op = builtin[oi];
    return ncclSuccess;
}

/* Read a scalar of datatype dt as a double. */
static double scalar_load(ncclDataType_t dt, const void *p)
{
    switch (dt) {
    case ncclInt8:
        return *(const int8_t *)p;
    case ncclUint8:
        return *(const uint8_t *)p;
    case ncclInt32:
        return *(const int32_t *)p;
    case ncclUint32:
        return *(const uint32_t *)p;
    case ncclInt64:
        return (double)*(const int64_t *)p;
    case ncclUint64:
        return (double)*(const uint64_t *)p;
    case ncclFloat16:
        return fp16_to_float(*(const uint16_t *)p);
    case ncclBfloat16:
        return bf16_to_float(*(const uint16_t *)p);
    case ncclFloat32:
        return *(const float *)p;
    case ncclFloat64:
        return *(const double *)p;
    default:
        return 0.0;
    }
}

#define SCALE_INT(T)                                                                               \
    do {                                                                                           \
        T *x = buf;                                                                                \
        T m = (T)s;                                                                                \
        for (size_t i = 0; i < n; i++)                                                             \
            x[i] = (T)(x[i] * m);                                                                  \
    } while (0)

/* buf[i] *= s in the datatype (PreMulSum). */
static void buffer_scale(ncclDataType_t dt, void *buf, size_t n, double s)
{
    switch (dt) {
    case ncclInt8:
        SCALE_INT(int8_t);
        break;
    case ncclUint8:
        SCALE_INT(uint8_t);
        break;
    case ncclInt32:
        SCALE_INT(int32_t);
        break;
    case ncclUint32:
        SCALE_INT(uint32_t);
        break;
    case ncclInt64:
        SCALE_INT(int64_t);
        break;
    case ncclUint64:
        SCALE_INT(uint64_t);
        break;
    case ncclFloat32: {
        float *x = buf;
        float m = (float)s;
        for (size_t i = 0; i < n; i++)
            x[i] *= m;
        break;
    }
    case ncclFloat64: {
        double *x = buf;
        for (size_t i = 0; i < n; i++)
            x[i] *= s;
        break;
    }
    case ncclFloat16:
    case ncclBfloat16: {
        int bf = dt == ncclBfloat16;
        uint16_t *x = buf;
        float m = (float)s;
        for (size_t i = 0; i < n; i++)
            x[i] = half_store(bf, half_load(bf, x[i]) * m);
        break;
    }
    default:
        break;
    }
}

#define DIV_INT(T)                                                                                 \
    do {                                                                                           \
        T *x = buf;                                                                                \
        for (size_t i = 0; i < n; i++)                                                             \
            x[i] = (T)(x[i] / (T)d);                                                               \
    } while (0)

/* buf[i] /= d in the datatype (the second half of Avg). */
static void buffer_divide(ncclDataType_t dt, void *buf, size_t n, int d)
{
    switch (dt) {
    case ncclInt8:
        DIV_INT(int8_t);
        break;
    case ncclUint8:
        DIV_INT(uint8_t);
        break;
    case ncclInt32:
        DIV_INT(int32_t);
        break;
    case ncclUint32:
        DIV_INT(uint32_t);
        break;
    case ncclInt64:
        DIV_INT(int64_t);
        break;
    case ncclUint64:
        DIV_INT(uint64_t);
        break;
    case ncclFloat32: {
        float *x = buf;
        for (size_t i = 0; i < n; i++)
            x[i] = x[i] / (float)d;
        break;
    }
    case ncclFloat64: {
        double *x = buf;
        for (size_t i = 0; i < n; i++)
            x[i] = x[i] / (double)d;
        break;
    }
    case ncclFloat16:
    case ncclBfloat16: {
        int bf = dt == ncclBfloat16;
        uint16_t *x = buf;
        for (size_t i = 0; i < n; i++)
            x[i] = half_store(bf, half_load(bf, x[i]) / (float)d);
        break;
    }
    default:
        break;
    }
}

/* ---- argument checks ---------------------------------------------------------------- */

static ncclResult_t check_comm(ncclComm_t comm, const char *fn)
{
    if (comm == NULL) {
        fake_warn("%s: comm is NULL", fn);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

static ncclResult_t check_dtype(ncclDataType_t dt, const char *fn)
{
    if (dtype_size(dt) == 0) {
        fake_warn("%s: invalid datatype %d", fn, (int)dt);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

/* Bytes for count elements of dt; MPI counts are int, so larger messages are refused. */
static ncclResult_t check_bytes(size_t count, ncclDataType_t dt, int nranks, const char *fn)
{
    size_t esz = dtype_size(dt);
    if (count > (size_t)INT32_MAX / esz / (size_t)nranks) {
        fake_warn("%s: count %zu too large for the MPI-based test library", fn, count);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

/* Validate a reduction op; on success *base is the builtin op the MPI reduction uses and
 * *premul the factor to apply first (1 when none). */
static ncclResult_t resolve_op(ncclComm_t comm, ncclRedOp_t op, ncclDataType_t dt,
                               ncclRedOp_t *base, double *premul, const char *fn)
{
    *premul = 1.0;
    if ((int)op >= 0 && op < ncclNumOps) {
        if (dt == ncclFloat8e4m3 || dt == ncclFloat8e5m2) {
            fake_warn("%s: reductions on fp8 are not supported by the test library", fn);
            return ncclInvalidArgument;
        }
        *base = op == ncclAvg ? ncclSum : op;
        return ncclSuccess;
    }
    int slot = (int)op - (int)ncclNumOps;
    if (slot < 0 || slot >= FAKE_MAX_OPS || !comm->ops[slot].used) {
        fake_warn("%s: invalid reduction op %d", fn, (int)op);
        return ncclInvalidArgument;
    }
    if (comm->ops[slot].dtype != dt) {
        fake_warn("%s: op %d was created for datatype %d, used with %d", fn, (int)op,
                  (int)comm->ops[slot].dtype, (int)dt);
        return ncclInvalidArgument;
    }
    *base = ncclSum;
    *premul = comm->ops[slot].residence == ncclScalarHostImmediate
                  ? comm->ops[slot].value
                  : scalar_load(dt, comm->ops[slot].scalar);
    return ncclSuccess;
}

static ncclResult_t mpi_result(int rc, const char *what)
{
    if (rc == MPI_SUCCESS)
        return ncclSuccess;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fake_warn("%s failed: %s", what, msg);
    return ncclSystemError;
}

static int ranges_overlap(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + blen && pb < pa + alen;
}

/* ---- non-blocking communicators ------------------------------------------------------ */

/* A non-blocking communicator's call just completed: report it as in progress. */
static ncclResult_t in_progress(ncclComm_t comm, ncclResult_t res)
{
    if (res != ncclSuccess || comm == NULL || !comm->nonblocking)
        return res;
    const char *e = getenv("FAKE_NCCL_INPROGRESS_POLLS");
    comm->pending = e == NULL ? 3 : strcmp(e, "forever") == 0 ? -1 : atol(e);
    return ncclInProgress;
}

/* NCCL: after ncclInProgress the communicator must be polled until it is done. */
static ncclResult_t check_ready(ncclComm_t comm, const char *fn)
{
    if (comm != NULL && comm->pending != 0) {
        fake_warn("%s: the communicator's previous call is still in progress (poll "
                  "ncclCommGetAsyncError until it is not)",
                  fn);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

static int config_nonblocking(const ncclConfig_t *config)
{
    return config != NULL && config->blocking == 0;
}

/* ---- execution (immediate, or at the outermost group end) ---------------------------- */

/* A scaled copy of send when PreMulSum needs one; *tmp_p is NULL when not needed. */
static ncclResult_t premul_copy(const void *send, size_t n, ncclDataType_t dt, double premul,
                                void **tmp_p)
{
    *tmp_p = NULL;
    if (premul == 1.0)
        return ncclSuccess;
    size_t bytes = n * dtype_size(dt);
    void *tmp = malloc(bytes ? bytes : 1);
    if (tmp == NULL) {
        fake_warn("out of host memory (%zu bytes)", bytes);
        return ncclSystemError;
    }
    memcpy(tmp, send, bytes);
    buffer_scale(dt, tmp, n, premul);
    *tmp_p = tmp;
    return ncclSuccess;
}

static ncclResult_t exec_allgather(const fake_call_t *c)
{
    ncclComm_t comm = c->comm;
    size_t bytes = c->count * dtype_size(c->dtype);
    char *recv = c->recv;
    int ib = (int)bytes;
    if (c->send == recv + (size_t)comm->rank * bytes)
        return mpi_result(
            PMPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, ib, MPI_BYTE, comm->mpi),
            "MPI_Allgather");
    const void *send = c->send;
    void *tmp = NULL;
    if (ranges_overlap(send, bytes, recv, bytes * (size_t)comm->nranks)) {
        tmp = malloc(bytes ? bytes : 1);
        if (tmp == NULL) {
            fake_warn("out of host memory (%zu bytes)", bytes);
            return ncclSystemError;
        }
        memcpy(tmp, send, bytes);
        send = tmp;
    }
    ncclResult_t res = mpi_result(PMPI_Allgather(send, ib, MPI_BYTE, recv, ib, MPI_BYTE, comm->mpi),
                                  "MPI_Allgather");
    free(tmp);
    return res;
}

static ncclResult_t exec_reduce_scatter(const fake_call_t *c)
{
    ncclComm_t comm = c->comm;
    ncclRedOp_t base;
    double premul;
    MPI_Datatype type;
    MPI_Op mop;
    ncclResult_t res = resolve_op(comm, c->op, c->dtype, &base, &premul, "ncclReduceScatter");
    if (res == ncclSuccess)
        res = mpi_reduce_types(c->dtype, base, &type, &mop);
    if (res != ncclSuccess)
        return res;
    size_t total = c->count * (size_t)comm->nranks;
    size_t esz = dtype_size(c->dtype);
    const void *send = c->send;
    void *tmp = NULL;
    res = premul_copy(send, total, c->dtype, premul, &tmp);
    if (res != ncclSuccess)
        return res;
    if (tmp == NULL && ranges_overlap(send, total * esz, c->recv, c->count * esz)) {
        tmp = malloc(total > 0 ? total * esz : 1);
        if (tmp == NULL) {
            fake_warn("out of host memory (%zu bytes)", total * esz);
            return ncclSystemError;
        }
        memcpy(tmp, send, total * esz);
    }
    if (tmp != NULL)
        send = tmp;
    res = mpi_result(PMPI_Reduce_scatter_block(send, c->recv, (int)c->count, type, mop, comm->mpi),
                     "MPI_Reduce_scatter_block");
    free(tmp);
    if (res == ncclSuccess && c->op == ncclAvg)
        buffer_divide(c->dtype, c->recv, c->count, comm->nranks);
    return res;
}

static ncclResult_t exec_allreduce(const fake_call_t *c)
{
    ncclComm_t comm = c->comm;
    ncclRedOp_t base;
    double premul;
    MPI_Datatype type;
    MPI_Op mop;
    ncclResult_t res = resolve_op(comm, c->op, c->dtype, &base, &premul, "ncclAllReduce");
    if (res == ncclSuccess)
        res = mpi_reduce_types(c->dtype, base, &type, &mop);
    if (res != ncclSuccess)
        return res;
    size_t bytes = c->count * dtype_size(c->dtype);
    int inplace = c->send == c->recv;
    void *tmp = NULL;
    if (inplace) {
        buffer_scale(c->dtype, c->recv, c->count, premul);
    } else {
        res = premul_copy(c->send, c->count, c->dtype, premul, &tmp);
        if (res != ncclSuccess)
            return res;
        if (tmp == NULL && ranges_overlap(c->send, bytes, c->recv, bytes)) {
            fake_warn("ncclAllReduce: partially overlapping buffers");
            return ncclInvalidArgument;
        }
    }
    const void *send = inplace ? MPI_IN_PLACE : tmp != NULL ? tmp : c->send;
    res = mpi_result(PMPI_Allreduce(send, c->recv, (int)c->count, type, mop, comm->mpi),
                     "MPI_Allreduce");
    free(tmp);
    if (res == ncclSuccess && c->op == ncclAvg)
        buffer_divide(c->dtype, c->recv, c->count, comm->nranks);
    return res;
}

static ncclResult_t exec_reduce(const fake_call_t *c)
{
    ncclComm_t comm = c->comm;
    ncclRedOp_t base;
    double premul;
    MPI_Datatype type;
    MPI_Op mop;
    ncclResult_t res = resolve_op(comm, c->op, c->dtype, &base, &premul, "ncclReduce");
    if (res == ncclSuccess)
        res = mpi_reduce_types(c->dtype, base, &type, &mop);
    if (res != ncclSuccess)
        return res;
    int is_root = comm->rank == c->root;
    const void *send = c->send;
    void *tmp = NULL;
    if (is_root && send == c->recv) {
        buffer_scale(c->dtype, c->recv, c->count, premul);
        send = MPI_IN_PLACE;
    } else {
        res = premul_copy(send, c->count, c->dtype, premul, &tmp);
        if (res != ncclSuccess)
            return res;
        if (tmp != NULL)
            send = tmp;
    }
    res = mpi_result(
        PMPI_Reduce(send, is_root ? c->recv : NULL, (int)c->count, type, mop, c->root, comm->mpi),
        "MPI_Reduce");
    free(tmp);
    if (res == ncclSuccess && is_root && c->op == ncclAvg)
        buffer_divide(c->dtype, c->recv, c->count, comm->nranks);
    return res;
}

static ncclResult_t exec_broadcast(const fake_call_t *c)
{
    ncclComm_t comm = c->comm;
    size_t bytes = c->count * dtype_size(c->dtype);
    if (comm->rank == c->root && c->send != c->recv)
        memmove(c->recv, c->send, bytes);
    return mpi_result(PMPI_Bcast(c->recv, (int)bytes, MPI_BYTE, c->root, comm->mpi), "MPI_Bcast");
}

static ncclResult_t exec_collective(const fake_call_t *c)
{
    switch (c->kind) {
    case FAKE_ALLGATHER:
        return exec_allgather(c);
    case FAKE_REDUCE_SCATTER:
        return exec_reduce_scatter(c);
    case FAKE_ALLREDUCE:
        return exec_allreduce(c);
    case FAKE_BROADCAST:
        return exec_broadcast(c);
    case FAKE_REDUCE:
        return exec_reduce(c);
    default:
        fake_warn("internal error: call kind %d is not a collective", (int)c->kind);
        return ncclInternalError;
    }
}

/* Run a batch of calls: P2P posted first (non-blocking), collectives in order, then wait. */
static ncclResult_t exec_calls(const fake_call_t *calls, size_t n)
{
    ncclResult_t res = ncclSuccess;
    size_t np2p = 0;
    for (size_t i = 0; i < n; i++)
        np2p += calls[i].kind == FAKE_SEND || calls[i].kind == FAKE_RECV;
    MPI_Request *reqs = NULL;
    if (np2p > 0) {
        reqs = malloc(np2p * sizeof(*reqs));
        if (reqs == NULL) {
            fake_warn("out of host memory");
            return ncclSystemError;
        }
    }
    size_t nreq = 0;
    for (size_t i = 0; i < n && res == ncclSuccess; i++) {
        const fake_call_t *c = &calls[i];
        int bytes = (int)(c->count * dtype_size(c->dtype));
        if (c->kind == FAKE_RECV)
            res = mpi_result(
                PMPI_Irecv(c->recv, bytes, MPI_BYTE, c->root, 0, c->comm->mpi, &reqs[nreq++]),
                "MPI_Irecv");
        else if (c->kind == FAKE_SEND)
            res = mpi_result(
                PMPI_Isend(c->send, bytes, MPI_BYTE, c->root, 0, c->comm->mpi, &reqs[nreq++]),
                "MPI_Isend");
    }
    for (size_t i = 0; i < n && res == ncclSuccess; i++)
        if (calls[i].kind != FAKE_SEND && calls[i].kind != FAKE_RECV)
            res = exec_collective(&calls[i]);
    if (nreq > 0) {
        ncclResult_t wres =
            mpi_result(PMPI_Waitall((int)nreq, reqs, MPI_STATUSES_IGNORE), "MPI_Waitall");
        if (res == ncclSuccess)
            res = wres;
    }
    free(reqs);
    return res;
}

static void trace_open(void)
{
    const char *prefix = getenv("FAKE_NCCL_TRACE");
    if (prefix == NULL || *prefix == '\0')
        return;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    char path[4096];
    snprintf(path, sizeof(path), "%s.%d", prefix, rank);
    trace_file = fopen(path, "a");
    if (trace_file == NULL)
        fake_warn("cannot open FAKE_NCCL_TRACE file %s", path);
}

static void trace_call(const fake_call_t *c)
{
    static const char *const names[] = {"allgather", "reduce_scatter", "allreduce", "broadcast",
                                        "reduce",    "send",           "recv"};
    pthread_once(&trace_once, trace_open);
    if (trace_file == NULL)
        return;
    size_t bytes = c->count * dtype_size(c->dtype);
    int inplace = 0;
    if (c->kind == FAKE_ALLGATHER)
        inplace = c->send == (const char *)c->recv + (size_t)c->comm->rank * bytes;
    else if (c->kind == FAKE_REDUCE_SCATTER)
        inplace = c->recv == (const char *)c->send + (size_t)c->comm->rank * bytes;
    else if (c->kind != FAKE_SEND && c->kind != FAKE_RECV)
        inplace = c->send == c->recv;
    pthread_mutex_lock(&trace_lock);
    fprintf(trace_file, "%s %zu %d %d %d %d 0x%llx\n", names[c->kind], c->count, (int)c->dtype,
            (int)c->op, inplace, c->comm->nranks, (unsigned long long)(uintptr_t)c->stream);
    fflush(trace_file);
    pthread_mutex_unlock(&trace_lock);
}

static ncclResult_t submit(const fake_call_t *c)
{
    trace_call(c);
    if (group_depth == 0)
        return in_progress(c->comm, exec_calls(c, 1));
    if (group_ncalls == group_cap) {
        size_t cap = group_cap ? 2 * group_cap : 16;
        fake_call_t *calls = realloc(group_calls, cap * sizeof(*calls));
        if (calls == NULL) {
            fake_warn("out of host memory");
            group_error = ncclSystemError;
            return ncclSystemError;
        }
        group_calls = calls;
        group_cap = cap;
    }
    group_calls[group_ncalls++] = *c;
    return ncclSuccess;
}

/* ---- version, ids, communicators ------------------------------------------------------ */

FAKE_EXPORT ncclResult_t pncclGetVersion(int *version)
{
    if (version == NULL) {
        fake_warn("ncclGetVersion: version is NULL");
        return ncclInvalidArgument;
    }
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
FAKE_ALIAS(ncclGetVersion);

FAKE_EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId)
{
    if (uniqueId == NULL) {
        fake_warn("ncclGetUniqueId: uniqueId is NULL");
        return ncclInvalidArgument;
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long ctr = __atomic_fetch_add(&id_counter, 1, __ATOMIC_RELAXED);
    long long fields[4] = {(long long)getpid(), (long long)ts.tv_sec, (long long)ts.tv_nsec,
                           (long long)ctr};
    snprintf(id.internal, 32, "%s", FAKE_ID_MAGIC);
    memcpy(id.internal + 32, fields, sizeof(fields));
    gethostname(id.internal + 64, 63);
    *uniqueId = id;
    return ncclSuccess;
}
FAKE_ALIAS(ncclGetUniqueId);

static int id_color(const ncclUniqueId *id)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof(id->internal); i++) {
        h ^= (unsigned char)id->internal[i];
        h *= 1099511628211ull;
    }
    return (int)(h & 0x7fffffffu);
}

static ncclResult_t comm_wrap(MPI_Comm mpi, int nranks, int rank, const ncclUniqueId *id,
                              ncclComm_t *comm_p)
{
    int size = 0, me = 0;
    MPI_Comm_size(mpi, &size);
    MPI_Comm_rank(mpi, &me);
    if (size != nranks || me != rank) {
        fake_warn("ncclCommInitRank: %d ranks joined the id (expected %d) and rank %d sits at "
                  "position %d: inconsistent nranks/rank or an id hash collision",
                  size, nranks, rank, me);
        PMPI_Comm_free(&mpi);
        return ncclInvalidUsage;
    }
    ncclComm_t comm = calloc(1, sizeof(*comm));
    if (comm == NULL) {
        fake_warn("out of host memory");
        PMPI_Comm_free(&mpi);
        return ncclSystemError;
    }
    comm->mpi = mpi;
    comm->rank = rank;
    comm->nranks = nranks;
    if (id != NULL)
        comm->id = *id;
    *comm_p = comm;
    return ncclSuccess;
}

/* At exit of a job whose MPI the library initialized. */
static void fake_finalize_mpi(void)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
        PMPI_Finalize();
}

FAKE_EXPORT ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                                 int rank, ncclConfig_t *config)
{
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) { /* a job without MPI: the library brings its own */
        ncclResult_t ir = mpi_result(PMPI_Init(NULL, NULL), "MPI_Init");
        if (ir != ncclSuccess)
            return ir;
        if (atexit(fake_finalize_mpi) != 0) {
            fake_warn("ncclCommInitRank: cannot register MPI_Finalize at exit");
            return ncclSystemError;
        }
    }
    if (comm == NULL || nranks < 1 || rank < 0 || rank >= nranks) {
        fake_warn("ncclCommInitRank: invalid arguments (comm %p, nranks %d, rank %d)", (void *)comm,
                  nranks, rank);
        return ncclInvalidArgument;
    }
    if (strncmp(commId.internal, FAKE_ID_MAGIC, 32) != 0) {
        fake_warn("ncclCommInitRank: the unique id was not made by ncclGetUniqueId");
        return ncclInvalidArgument;
    }
    MPI_Comm mpi;
    ncclResult_t res = mpi_result(PMPI_Comm_split(MPI_COMM_WORLD, id_color(&commId), rank, &mpi),
                                  "MPI_Comm_split");
    if (res != ncclSuccess)
        return res;
    /* Everyone who joined must hold the same id: a hash collision would merge two comms. */
    int size = 0;
    MPI_Comm_size(mpi, &size);
    char *ids = malloc((size_t)size * sizeof(commId.internal));
    if (ids == NULL) {
        fake_warn("out of host memory");
        PMPI_Comm_free(&mpi);
        return ncclSystemError;
    }
    res = mpi_result(PMPI_Allgather(commId.internal, (int)sizeof(commId.internal), MPI_BYTE, ids,
                                    (int)sizeof(commId.internal), MPI_BYTE, mpi),
                     "MPI_Allgather");
    for (int i = 0; i < size && res == ncclSuccess; i++)
        if (memcmp(ids + (size_t)i * sizeof(commId.internal), commId.internal,
                   sizeof(commId.internal)) != 0) {
            fake_warn("ncclCommInitRank: two unique ids hash to the same color");
            res = ncclInternalError;
        }
    free(ids);
    if (res != ncclSuccess) {
        PMPI_Comm_free(&mpi);
        return res;
    }
    res = comm_wrap(mpi, nranks, rank, &commId, comm);
    if (res == ncclSuccess && config_nonblocking(config)) {
        (*comm)->nonblocking = 1;
        res = in_progress(*comm, res);
    }
    return res;
}
FAKE_ALIAS(ncclCommInitRankConfig);

FAKE_EXPORT ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                           int rank)
{
    return pncclCommInitRankConfig(comm, nranks, commId, rank, NULL);
}
FAKE_ALIAS(ncclCommInitRank);

FAKE_EXPORT ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                        ncclConfig_t *config)
{
    ncclResult_t res = check_comm(comm, "ncclCommSplit");
    if (res == ncclSuccess)
        res = check_ready(comm, "ncclCommSplit");
    if (res != ncclSuccess)
        return res;
    if (newcomm == NULL || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) {
        fake_warn("ncclCommSplit: invalid arguments (color %d)", color);
        return ncclInvalidArgument;
    }
    MPI_Comm mpi;
    res = mpi_result(
        PMPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &mpi),
        "MPI_Comm_split");
    if (res != ncclSuccess)
        return res;
    if (mpi == MPI_COMM_NULL) {
        *newcomm = NULL;
        return ncclSuccess;
    }
    int size = 0, me = 0;
    MPI_Comm_size(mpi, &size);
    MPI_Comm_rank(mpi, &me);
    res = comm_wrap(mpi, size, me, NULL, newcomm);
    if (res == ncclSuccess && config_nonblocking(config)) {
        (*newcomm)->nonblocking = 1;
        res = in_progress(*newcomm, res);
    }
    return res;
}
FAKE_ALIAS(ncclCommSplit);

static ncclResult_t comm_free(ncclComm_t comm, const char *fn)
{
    if (comm == NULL)
        return ncclSuccess;                   /* NCCL accepts NULL here */
    for (int i = 0; i < FAKE_MAX_REGS; i++) { /* NCCL drops what is still registered */
        if (comm->regs[i] != NULL) {
            free(comm->regs[i]);
            __atomic_fetch_sub(&live_regs, 1, __ATOMIC_RELAXED);
        }
    }
    ncclResult_t res = mpi_result(PMPI_Comm_free(&comm->mpi), fn);
    free(comm);
    return res;
}

FAKE_EXPORT ncclResult_t pncclCommFinalize(ncclComm_t comm)
{
    return check_comm(comm, "ncclCommFinalize");
}
FAKE_ALIAS(ncclCommFinalize);

FAKE_EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm)
{
    return comm_free(comm, "ncclCommDestroy");
}
FAKE_ALIAS(ncclCommDestroy);

FAKE_EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm)
{
    return comm_free(comm, "ncclCommAbort");
}
FAKE_ALIAS(ncclCommAbort);

/* The integer queries: validate, then write one field (what names it in messages). */
static ncclResult_t comm_query(const ncclComm_t comm, int *out, const char *fn, const char *what,
                               int value_if_ok)
{
    ncclResult_t res = check_comm(comm, fn);
    if (res == ncclSuccess)
        res = check_ready(comm, fn);
    if (res == ncclSuccess && out == NULL) {
        fake_warn("%s: %s is NULL", fn, what);
        res = ncclInvalidArgument;
    }
    if (res == ncclSuccess)
        *out = value_if_ok;
    return res;
}

FAKE_EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count)
{
    return comm_query(comm, count, "ncclCommCount", "count", comm ? comm->nranks : 0);
}
FAKE_ALIAS(ncclCommCount);

FAKE_EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank)
{
    return comm_query(comm, rank, "ncclCommUserRank", "rank", comm ? comm->rank : 0);
}
FAKE_ALIAS(ncclCommUserRank);

/* There is no GPU behind a fake communicator; device 0 keeps callers' bookkeeping simple. */
FAKE_EXPORT ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device)
{
    return comm_query(comm, device, "ncclCommCuDevice", "device", 0);
}
FAKE_ALIAS(ncclCommCuDevice);

FAKE_EXPORT ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
    ncclResult_t res = check_comm(comm, "ncclCommGetAsyncError");
    if (res == ncclSuccess && asyncError == NULL) {
        fake_warn("ncclCommGetAsyncError: asyncError is NULL");
        res = ncclInvalidArgument;
    }
    if (res == ncclSuccess) {
        /* Every call completes before it returns; non-blocking ones say so after a while. */
        *asyncError = comm->pending != 0 ? ncclInProgress : ncclSuccess;
        if (comm->pending > 0)
            comm->pending--;
    }
    return res;
}
FAKE_ALIAS(ncclCommGetAsyncError);

FAKE_EXPORT const char *pncclGetErrorString(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error";
    case ncclSystemError:
        return "unhandled system error";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}
FAKE_ALIAS(ncclGetErrorString);

FAKE_EXPORT const char *pncclGetLastError(ncclComm_t comm)
{
    return last_error;
}
FAKE_ALIAS(ncclGetLastError);

/* Host memory stands in for device memory. */
FAKE_EXPORT ncclResult_t pncclMemAlloc(void **ptr, size_t size)
{
    if (ptr == NULL) {
        fake_warn("ncclMemAlloc: ptr is NULL");
        return ncclInvalidArgument;
    }
    void *p = NULL;
    if (posix_memalign(&p, 4096, size ? size : 1) != 0) {
        fake_warn("ncclMemAlloc: out of host memory (%zu bytes)", size);
        return ncclSystemError;
    }
    memset(p, 0xFF, size); /* NCCL does not zero it either (as floats: NaN) */
    __atomic_fetch_add(&live_allocs, 1, __ATOMIC_RELAXED);
    *ptr = p;
    return ncclSuccess;
}
FAKE_ALIAS(ncclMemAlloc);

FAKE_EXPORT ncclResult_t pncclMemFree(void *ptr)
{
    if (ptr != NULL)
        __atomic_fetch_sub(&live_allocs, 1, __ATOMIC_RELAXED);
    free(ptr);
    return ncclSuccess;
}
FAKE_ALIAS(ncclMemFree);

/* Nothing to register on the host: a handle remembers the range, so that deregistration
 * can check it. */
FAKE_EXPORT ncclResult_t pncclCommRegister(const ncclComm_t comm, void *buff, size_t size,
                                           void **handle)
{
    ncclResult_t res = check_comm(comm, "ncclCommRegister");
    if (res == ncclSuccess)
        res = check_ready(comm, "ncclCommRegister");
    if (res == ncclSuccess && (handle == NULL || buff == NULL || size == 0)) {
        fake_warn("ncclCommRegister: invalid arguments (buff %p, size %zu, handle %p)", buff, size,
                  (void *)handle);
        res = ncclInvalidArgument;
    }
    if (res != ncclSuccess)
        return res;
    for (int i = 0; i < FAKE_MAX_REGS; i++) {
        if (comm->regs[i] != NULL)
            continue;
        fake_reg_t *r = malloc(sizeof(*r));
        if (r == NULL) {
            fake_warn("out of host memory");
            return ncclSystemError;
        }
        r->buff = buff;
        r->size = size;
        comm->regs[i] = r;
        __atomic_fetch_add(&live_regs, 1, __ATOMIC_RELAXED);
        *handle = r;
        return ncclSuccess;
    }
    fake_warn("ncclCommRegister: more than %d live registrations", FAKE_MAX_REGS);
    return ncclInvalidUsage;
}
FAKE_ALIAS(ncclCommRegister);

FAKE_EXPORT ncclResult_t pncclCommDeregister(const ncclComm_t comm, void *handle)
{
    ncclResult_t res = check_comm(comm, "ncclCommDeregister");
    if (res != ncclSuccess)
        return res;
    for (int i = 0; i < FAKE_MAX_REGS; i++) {
        if (handle != NULL && comm->regs[i] == handle) {
            free(comm->regs[i]);
            comm->regs[i] = NULL;
            __atomic_fetch_sub(&live_regs, 1, __ATOMIC_RELAXED);
            return ncclSuccess;
        }
    }
    fake_warn("ncclCommDeregister: %p is not a live registration of this communicator", handle);
    return ncclInvalidArgument;
}
FAKE_ALIAS(ncclCommDeregister);

/* Test hook (not an NCCL API): live ncclMemAlloc allocations and registrations. */
FAKE_EXPORT void mfsdp_fake_nccl_stats(long *allocs, long *regs);
FAKE_EXPORT void mfsdp_fake_nccl_stats(long *allocs, long *regs)
{
    if (allocs != NULL)
        *allocs = __atomic_load_n(&live_allocs, __ATOMIC_RELAXED);
    if (regs != NULL)
        *regs = __atomic_load_n(&live_regs, __ATOMIC_RELAXED);
}

/* ---- reduction operators -------------------------------------------------------------- */

FAKE_EXPORT ncclResult_t pncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar,
                                                   ncclDataType_t datatype,
                                                   ncclScalarResidence_t residence, ncclComm_t comm)
{
    ncclResult_t res = check_comm(comm, "ncclRedOpCreatePreMulSum");
    if (res == ncclSuccess)
        res = check_dtype(datatype, "ncclRedOpCreatePreMulSum");
    if (res != ncclSuccess)
        return res;
    if (op == NULL || scalar == NULL ||
        (residence != ncclScalarDevice && residence != ncclScalarHostImmediate) ||
        datatype == ncclFloat8e4m3 || datatype == ncclFloat8e5m2) {
        fake_warn("ncclRedOpCreatePreMulSum: invalid arguments");
        return ncclInvalidArgument;
    }
    for (int i = 0; i < FAKE_MAX_OPS; i++) {
        fake_redop_t *r = &comm->ops[i];
        if (r->used)
            continue;
        r->used = 1;
        r->dtype = datatype;
        r->residence = residence;
        r->scalar = scalar;
        r->value = residence == ncclScalarHostImmediate ? scalar_load(datatype, scalar) : 0.0;
        *op = (ncclRedOp_t)((int)ncclNumOps + i);
        return ncclSuccess;
    }
    fake_warn("ncclRedOpCreatePreMulSum: more than %d live operators", FAKE_MAX_OPS);
    return ncclInvalidUsage;
}
FAKE_ALIAS(ncclRedOpCreatePreMulSum);

FAKE_EXPORT ncclResult_t pncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm)
{
    ncclResult_t res = check_comm(comm, "ncclRedOpDestroy");
    if (res != ncclSuccess)
        return res;
    int slot = (int)op - (int)ncclNumOps;
    if (slot < 0 || slot >= FAKE_MAX_OPS || !comm->ops[slot].used) {
        fake_warn("ncclRedOpDestroy: op %d was not created on this communicator", (int)op);
        return ncclInvalidArgument;
    }
    comm->ops[slot].used = 0;
    return ncclSuccess;
}
FAKE_ALIAS(ncclRedOpDestroy);

/* ---- collectives and point-to-point ---------------------------------------------------- */

static ncclResult_t enqueue(fake_kind_t kind, const void *send, void *recv, size_t count,
                            ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t comm,
                            cudaStream_t stream, const char *fn)
{
    ncclResult_t res = check_comm(comm, fn);
    if (res == ncclSuccess)
        res = check_ready(comm, fn);
    if (res == ncclSuccess)
        res = check_dtype(dt, fn);
    if (res == ncclSuccess)
        res = check_bytes(count, dt, comm->nranks, fn);
    if (res == ncclSuccess && (root < 0 || root >= comm->nranks)) {
        fake_warn("%s: %s %d out of range [0, %d)", fn,
                  kind == FAKE_SEND || kind == FAKE_RECV ? "peer" : "root", root, comm->nranks);
        res = ncclInvalidArgument;
    }
    if (res == ncclSuccess &&
        (kind == FAKE_REDUCE_SCATTER || kind == FAKE_ALLREDUCE || kind == FAKE_REDUCE)) {
        ncclRedOp_t base;
        double premul;
        res = resolve_op(comm, op, dt, &base, &premul, fn); /* validate now, as NCCL does */
    }
    if (res == ncclSuccess && count > 0) {
        int need_send = kind != FAKE_RECV && !(kind == FAKE_BROADCAST && comm->rank != root);
        int need_recv = kind != FAKE_SEND && !(kind == FAKE_REDUCE && comm->rank != root);
        if ((need_send && send == NULL) || (need_recv && recv == NULL)) {
            fake_warn("%s: NULL buffer", fn);
            res = ncclInvalidArgument;
        }
    }
    if (res != ncclSuccess) {
        if (group_depth > 0)
            group_error = res;
        return res;
    }
    fake_call_t c = {kind, send, recv, count, dt, op, root, comm, stream};
    return submit(&c);
}

FAKE_EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                        ncclDataType_t datatype, ncclComm_t comm,
                                        cudaStream_t stream)
{
    return enqueue(FAKE_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm,
                   stream, "ncclAllGather");
}
FAKE_ALIAS(ncclAllGather);

FAKE_EXPORT ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                            ncclDataType_t datatype, ncclRedOp_t op,
                                            ncclComm_t comm, cudaStream_t stream)
{
    return enqueue(FAKE_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm,
                   stream, "ncclReduceScatter");
}
FAKE_ALIAS(ncclReduceScatter);

FAKE_EXPORT ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                        ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream)
{
    return enqueue(FAKE_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm, stream,
                   "ncclAllReduce");
}
FAKE_ALIAS(ncclAllReduce);

FAKE_EXPORT ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                        ncclDataType_t datatype, int root, ncclComm_t comm,
                                        cudaStream_t stream)
{
    return enqueue(FAKE_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream,
                   "ncclBroadcast");
}
FAKE_ALIAS(ncclBroadcast);

FAKE_EXPORT ncclResult_t pncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
                                    ncclComm_t comm, cudaStream_t stream)
{
    return enqueue(FAKE_BROADCAST, buff, buff, count, datatype, ncclSum, root, comm, stream,
                   "ncclBcast");
}
FAKE_ALIAS(ncclBcast);

FAKE_EXPORT ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                                     ncclDataType_t datatype, ncclRedOp_t op, int root,
                                     ncclComm_t comm, cudaStream_t stream)
{
    return enqueue(FAKE_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm, stream,
                   "ncclReduce");
}
FAKE_ALIAS(ncclReduce);

FAKE_EXPORT ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                                   int peer, ncclComm_t comm, cudaStream_t stream)
{
    return enqueue(FAKE_SEND, sendbuff, NULL, count, datatype, ncclSum, peer, comm, stream,
                   "ncclSend");
}
FAKE_ALIAS(ncclSend);

FAKE_EXPORT ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclComm_t comm, cudaStream_t stream)
{
    return enqueue(FAKE_RECV, NULL, recvbuff, count, datatype, ncclSum, peer, comm, stream,
                   "ncclRecv");
}
FAKE_ALIAS(ncclRecv);

/* nccl.h declares these with an empty parameter list: give them prototypes. */
ncclResult_t pncclGroupStart(void);
ncclResult_t pncclGroupEnd(void);

FAKE_EXPORT ncclResult_t pncclGroupStart(void)
{
    if (group_depth == 0) {
        group_ncalls = 0;
        group_error = ncclSuccess;
    }
    group_depth++;
    return ncclSuccess;
}
FAKE_ALIAS(ncclGroupStart);

static ncclResult_t group_end(int simulate, const char *fn)
{
    if (group_depth == 0) {
        fake_warn("%s: not inside a group", fn);
        return ncclInvalidUsage;
    }
    if (--group_depth > 0)
        return ncclSuccess;
    ncclResult_t res = group_error;
    if (res == ncclSuccess && !simulate)
        res = exec_calls(group_calls, group_ncalls);
    /* Non-blocking communicators of the group report the group as in progress. */
    for (size_t i = 0;
         !simulate && i < group_ncalls && (res == ncclSuccess || res == ncclInProgress); i++) {
        ncclComm_t c = group_calls[i].comm;
        if (c->nonblocking && c->pending == 0)
            res = in_progress(c, ncclSuccess);
    }
    group_ncalls = 0;
    group_error = ncclSuccess;
    free(group_calls);
    group_calls = NULL;
    group_cap = 0;
    return res;
}

FAKE_EXPORT ncclResult_t pncclGroupEnd(void)
{
    return group_end(0, "ncclGroupEnd");
}
FAKE_ALIAS(ncclGroupEnd);

FAKE_EXPORT ncclResult_t pncclGroupSimulateEnd(ncclSimInfo_t *simInfo)
{
    if (simInfo == NULL) {
        fake_warn("ncclGroupSimulateEnd: simInfo is NULL");
        return ncclInvalidArgument;
    }
    simInfo->estimatedTime = 0.0f;
    return group_end(1, "ncclGroupSimulateEnd");
}
FAKE_ALIAS(ncclGroupSimulateEnd);

/* Marker for mfsdp's NCCL transport (transport/nccl.c): this library works on host memory, so
 * host values need no staging and the CPU executor does the owners' local work. */
FAKE_EXPORT const char mfsdp_fake_nccl_host_memory[] = "nccl-over-mpi host memory";
