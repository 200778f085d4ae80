/* SPDX-License-Identifier: Apache-2.0 */
/*
 * NCCL front-end of the shim: ncclAllGather, ncclReduceScatter, ncclRedOpCreatePreMulSum /
 * ncclRedOpDestroy (to learn PreMulSum scalars), ncclCommInitRank / InitRankConfig / Split /
 * Destroy / Abort (to track communicators). Real functions are the library's exported
 * pncclX names (or the next definition of ncclX), resolved once with dlsym(RTLD_NEXT): no
 * link-time dependency on libnccl. This is the one file that converts mfsdp statuses into
 * ncclResult_t.
 *
 * Transport today: owner collectives run on the runtime's MPI transport over host memory,
 * on an MPI communicator split from MPI_COMM_WORLD with the NCCL comm's ranks. That is
 * what the test-only NCCL-over-MPI library (tests/lib) provides; it marks itself with the
 * symbol mfsdp_fake_nccl_host_memory. With the real NCCL (device buffers) the NCCL
 * transport is not implemented yet, so every call passes through untouched (one WARN).
 */
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "ld_preload/mpi_ops.h"
#include "ld_preload/shim.h"
#include "mfsdp/kernels.h"

#define SHIM_EXPORT __attribute__((visibility("default")))

typedef ncclResult_t (*ag_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t);
typedef ncclResult_t (*rs_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
typedef ncclResult_t (*init_fn)(ncclComm_t *, int, ncclUniqueId, int);
typedef ncclResult_t (*initcfg_fn)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
typedef ncclResult_t (*destroy_fn)(ncclComm_t);
typedef ncclResult_t (*count_fn)(const ncclComm_t, int *);
typedef ncclResult_t (*premul_fn)(ncclRedOp_t *, void *, ncclDataType_t, ncclScalarResidence_t,
                                  ncclComm_t);
typedef ncclResult_t (*opdestroy_fn)(ncclRedOp_t, ncclComm_t);
typedef ncclResult_t (*ar_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);

static struct {
    ag_fn allgather;
    rs_fn reduce_scatter;
    init_fn init_rank;
    initcfg_fn init_rank_config;
    split_fn split;
    destroy_fn destroy;
    destroy_fn abort;
    count_fn count;
    count_fn user_rank;
    premul_fn premul;
    opdestroy_fn op_destroy;
    ar_fn allreduce;
    int host_memory; /* the real library is the host-memory NCCL-over-MPI test library */
} real;

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

static void *resolve(const char *pname, const char *name)
{
    void *f = dlsym(RTLD_NEXT, pname);
    if (f == NULL) {
        f = dlsym(RTLD_NEXT, name);
    }
    if (f == NULL) {
        MFSDP_WARN("cannot resolve %s in the real NCCL library", name);
    }
    return f;
}

static void resolve_all(void)
{
    real.allgather = (ag_fn)resolve("pncclAllGather", "ncclAllGather");
    real.reduce_scatter = (rs_fn)resolve("pncclReduceScatter", "ncclReduceScatter");
    real.init_rank = (init_fn)resolve("pncclCommInitRank", "ncclCommInitRank");
    real.init_rank_config =
        (initcfg_fn)resolve("pncclCommInitRankConfig", "ncclCommInitRankConfig");
    real.split = (split_fn)resolve("pncclCommSplit", "ncclCommSplit");
    real.destroy = (destroy_fn)resolve("pncclCommDestroy", "ncclCommDestroy");
    real.abort = (destroy_fn)resolve("pncclCommAbort", "ncclCommAbort");
    real.count = (count_fn)resolve("pncclCommCount", "ncclCommCount");
    real.user_rank = (count_fn)resolve("pncclCommUserRank", "ncclCommUserRank");
    real.premul = (premul_fn)resolve("pncclRedOpCreatePreMulSum", "ncclRedOpCreatePreMulSum");
    real.op_destroy = (opdestroy_fn)resolve("pncclRedOpDestroy", "ncclRedOpDestroy");
    real.allreduce = (ar_fn)resolve("pncclAllReduce", "ncclAllReduce");
    real.host_memory = dlsym(RTLD_DEFAULT, "mfsdp_fake_nccl_host_memory") != NULL;
}

#define REAL(fn) (pthread_once(&real_once, resolve_all), real.fn)

/* ---------------------------------------------------------------- PreMulSum scalars */

#define MAX_PREMUL 64
static pthread_mutex_t premul_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int used;
    ncclComm_t comm;
    ncclRedOp_t op;
    int known; /* host scalar read successfully */
    double scalar;
} premul[MAX_PREMUL];

static int premul_lookup(ncclComm_t comm, ncclRedOp_t op, double *scalar)
{
    int found = -1;
    pthread_mutex_lock(&premul_lock);
    for (int i = 0; i < MAX_PREMUL; i++) {
        if (premul[i].used && premul[i].comm == comm && premul[i].op == op) {
            found = premul[i].known;
            *scalar = premul[i].scalar;
            break;
        }
    }
    pthread_mutex_unlock(&premul_lock);
    return found;
}

/* A destroyed communicator's PreMulSum ops die with it (NCCL destroys them too); its handle
 * may be reused by the next communicator. */
static void premul_purge(ncclComm_t comm)
{
    pthread_mutex_lock(&premul_lock);
    for (int i = 0; i < MAX_PREMUL; i++) {
        if (premul[i].used && premul[i].comm == comm) {
            premul[i].used = 0;
        }
    }
    pthread_mutex_unlock(&premul_lock);
}

static int nccl_dtype(ncclDataType_t t, mfsdp_dtype_t *dt)
{
    switch (t) {
    case ncclFloat32:
        *dt = MFSDP_FLOAT32;
        return 1;
    case ncclBfloat16:
        *dt = MFSDP_BFLOAT16;
        return 1;
    case ncclFloat16:
        *dt = MFSDP_FLOAT16;
        return 1;
    case ncclUint8:
    case ncclInt8:
        *dt = MFSDP_UINT8;
        return 1;
    default:
        return 0;
    }
}

SHIM_EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar,
                                                  ncclDataType_t datatype,
                                                  ncclScalarResidence_t residence, ncclComm_t comm)
{
    premul_fn f = REAL(premul);
    if (f == NULL) {
        return ncclSystemError;
    }
    ncclResult_t r = f(op, scalar, datatype, residence, comm);
    if (r != ncclSuccess || shim_inside) {
        return r;
    }
    double s = 0;
    int known = 0;
    if (residence == ncclScalarHostImmediate && scalar != NULL) {
        known = 1;
        switch (datatype) {
        case ncclFloat32:
            s = *(const float *)scalar;
            break;
        case ncclFloat64:
            s = *(const double *)scalar;
            break;
        case ncclBfloat16:
            s = mfsdp_bf16_to_f32(*(const uint16_t *)scalar);
            break;
        case ncclFloat16:
            s = mfsdp_f16_to_f32(*(const uint16_t *)scalar);
            break;
        default:
            known = 0;
            break;
        }
    }
    pthread_mutex_lock(&premul_lock);
    for (int i = 0; i < MAX_PREMUL; i++) {
        if (!premul[i].used) {
            premul[i].used = 1;
            premul[i].comm = comm;
            premul[i].op = *op;
            premul[i].known = known;
            premul[i].scalar = s;
            break;
        }
    }
    pthread_mutex_unlock(&premul_lock);
    return r;
}

SHIM_EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm)
{
    opdestroy_fn f = REAL(op_destroy);
    if (f == NULL) {
        return ncclSystemError;
    }
    pthread_mutex_lock(&premul_lock);
    for (int i = 0; i < MAX_PREMUL; i++) {
        if (premul[i].used && premul[i].comm == comm && premul[i].op == op) {
            premul[i].used = 0;
        }
    }
    pthread_mutex_unlock(&premul_lock);
    return f(op, comm);
}

/* ---------------------------------------------------------------- communicators */

static uint64_t id_hash(const ncclUniqueId *id)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof(id->internal); i++) {
        h = (h ^ (unsigned char)id->internal[i]) * 1099511628211ull;
    }
    return h;
}

/* Track a new comm. Its MPI twin is a split of parent keyed by the NCCL rank. The split is
 * collective over parent, so it is only done where every rank of parent is known to create
 * the comm at the same point: an InitRank comm that spans MPI_COMM_WORLD, or an
 * ncclCommSplit (collective over its parent by NCCL's rules). Other comms pass through. */
static void track(ncclComm_t comm, MPI_Comm parent, int color, int from_init)
{
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    int size = 0, rank = 0;
    if (REAL(count) == NULL || REAL(user_rank) == NULL || real.count(comm, &size) != ncclSuccess ||
        real.user_rank(comm, &rank) != ncclSuccess) {
        return;
    }
    if (!real.host_memory || !inited || finalized) {
        static int warned;
        if (!warned++) {
            MFSDP_WARN("nccl front-end: %s; NCCL calls pass through untouched",
                       !real.host_memory
                           ? "the NCCL transport for device buffers is not implemented yet"
                           : "MPI is not initialized (the CPU transport needs it)");
        }
        return;
    }
    int world = 0;
    PMPI_Comm_size(MPI_COMM_WORLD, &world);
    if (from_init && size != world) {
        MFSDP_INFO(SHIM, "nccl comm of size %d does not span MPI_COMM_WORLD (%d): pass-through",
                   size, world);
        return;
    }
    MPI_Comm mpi = MPI_COMM_NULL;
    if (PMPI_Comm_split(parent, color & 0x7fffffff, rank, &mpi) != MPI_SUCCESS) {
        MFSDP_WARN("nccl front-end: MPI_Comm_split for a new communicator failed");
        return;
    }
    void *st = shim_mpi_state(mpi, 1);
    if (st == NULL || shim_comm_add(SHIM_NCCL, comm, &shim_mpi_ops, st, size, rank) == NULL) {
        free(st);
        PMPI_Comm_free(&mpi);
    }
}

SHIM_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    init_fn f = REAL(init_rank);
    if (f == NULL) {
        return ncclSystemError;
    }
    ncclResult_t r = f(comm, nranks, id, rank);
    if (r == ncclSuccess && !shim_inside) {
        track(*comm, MPI_COMM_WORLD, (int)(id_hash(&id) & 0x7fffffff), 1);
    }
    return r;
}

SHIM_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                                int rank, ncclConfig_t *config)
{
    initcfg_fn f = REAL(init_rank_config);
    if (f == NULL) {
        return ncclSystemError;
    }
    ncclResult_t r = f(comm, nranks, id, rank, config);
    if (r == ncclSuccess && !shim_inside) {
        track(*comm, MPI_COMM_WORLD, (int)(id_hash(&id) & 0x7fffffff), 1);
    }
    return r;
}

SHIM_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                       ncclConfig_t *config)
{
    split_fn f = REAL(split);
    if (f == NULL) {
        return ncclSystemError;
    }
    ncclResult_t r = f(comm, color, key, newcomm, config);
    shim_comm_t *parent = shim_comm_find(SHIM_NCCL, comm);
    if (r == ncclSuccess && !shim_inside && parent != NULL && *newcomm != NULL) {
        track(*newcomm, shim_mpi_comm(parent), color < 0 ? 0 : color, 0);
    } else if (r == ncclSuccess && parent != NULL && *newcomm == NULL) {
        MPI_Comm unused = MPI_COMM_NULL; /* ranks with NCCL_SPLIT_NOCOLOR still take part */
        PMPI_Comm_split(shim_mpi_comm(parent), MPI_UNDEFINED, key, &unused);
    }
    return r;
}

static ncclResult_t nccl_error(mfsdp_status_t st);

/* Flush and forget the comm's state first (pending steps are collective over it), then destroy
 * it. A comm whose remap failed reports the failure here too, so that a job that ignored the
 * collective's error code does not end cleanly. */
static ncclResult_t release(ncclComm_t comm, destroy_fn f)
{
    if (f == NULL) {
        return ncclSystemError;
    }
    mfsdp_status_t st = shim_comm_remove(shim_comm_find(SHIM_NCCL, comm));
    premul_purge(comm);
    ncclResult_t r = f(comm);
    return r == ncclSuccess && st != MFSDP_OK ? nccl_error(st) : r;
}

SHIM_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    return release(comm, REAL(destroy));
}

SHIM_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    return release(comm, REAL(abort));
}

/* ---------------------------------------------------------------- collectives */

static ncclResult_t nccl_error(mfsdp_status_t st)
{
    switch (st) {
    case MFSDP_ERR_INVALID_ARG:
    case MFSDP_ERR_MISMATCH:
        return ncclInvalidArgument;
    case MFSDP_ERR_NO_MEMORY:
    case MFSDP_ERR_IO:
        return ncclSystemError;
    case MFSDP_ERR_TRANSPORT:
        return ncclRemoteError;
    case MFSDP_ERR_INTERNAL:
        return ncclInternalError;
    default:
        return ncclInvalidUsage;
    }
}

/* What the shim needs of an NCCL reduction op: sum, avg and host-scalar PreMulSum only. */
static void nccl_op(ncclRedOp_t op, ncclComm_t comm, shim_call_t *call)
{
    call->scalar = 1.0;
    call->op_supported = 1;
    if (op == ncclSum) {
        call->op = MFSDP_OP_SUM;
        call->op_name = "sum";
    } else if (op == ncclAvg) {
        call->op = MFSDP_OP_AVG;
        call->op_name = "avg";
    } else if ((int)op >= (int)ncclNumOps) {
        call->op = MFSDP_OP_PREMULSUM;
        call->op_name = "premulsum";
        int known = premul_lookup(comm, op, &call->scalar);
        call->op_supported = known == 1; /* device-resident or unknown scalar: refuse */
    } else {
        call->op_name = op == ncclProd ? "prod" : op == ncclMax ? "max" : "min";
        call->op_supported = 0;
    }
}

SHIM_EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                       ncclDataType_t datatype, ncclComm_t comm,
                                       cudaStream_t stream)
{
    ag_fn f = REAL(allgather);
    if (f == NULL) {
        return ncclSystemError;
    }
    shim_comm_t *c = shim_inside ? NULL : shim_comm_find(SHIM_NCCL, comm);
    if (c == NULL || sendcount == 0) {
        return f(sendbuff, recvbuff, sendcount, datatype, comm, stream);
    }
    shim_call_t call = {.kind = SHIM_ALLGATHER,
                        .count = sendcount,
                        .send = sendbuff,
                        .recv = recvbuff,
                        .op_name = "none",
                        .op_supported = 1};
    call.dtype_known = nccl_dtype(datatype, &call.dtype);
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE:
        return ncclSuccess;
    case SHIM_ERROR:
        return nccl_error(st);
    case SHIM_PASS:
        break;
    }
    return f(sendbuff, recvbuff, sendcount, datatype, comm, stream);
}

SHIM_EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t stream)
{
    rs_fn f = REAL(reduce_scatter);
    if (f == NULL) {
        return ncclSystemError;
    }
    shim_comm_t *c = shim_inside ? NULL : shim_comm_find(SHIM_NCCL, comm);
    if (c == NULL || recvcount == 0) {
        return f(sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
    }
    shim_call_t call = {
        .kind = SHIM_REDUCE_SCATTER, .count = recvcount, .send = sendbuff, .recv = recvbuff};
    call.dtype_known = nccl_dtype(datatype, &call.dtype) && call.dtype != MFSDP_UINT8;
    nccl_op(op, comm, &call);
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE:
        return ncclSuccess;
    case SHIM_ERROR:
        return nccl_error(st);
    case SHIM_PASS:
        break;
    }
    return f(sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
}

/* HSDP: the all-reduce of a reduce-scatter's output over the replicate group (shim.c decides
 * from rank-identical state; every other all-reduce passes through). */
SHIM_EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream)
{
    ar_fn f = REAL(allreduce);
    if (f == NULL) {
        return ncclSystemError;
    }
    shim_comm_t *c = shim_inside ? NULL : shim_comm_find(SHIM_NCCL, comm);
    if (c == NULL || count == 0) {
        return f(sendbuff, recvbuff, count, datatype, op, comm, stream);
    }
    shim_call_t call = {.kind = SHIM_ALLREDUCE, .count = count, .send = sendbuff, .recv = recvbuff};
    call.dtype_known = nccl_dtype(datatype, &call.dtype) && call.dtype != MFSDP_UINT8;
    nccl_op(op, comm, &call);
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_allreduce(c, &call, &st)) {
    case SHIM_DONE:
        return ncclSuccess;
    case SHIM_ERROR:
        return nccl_error(st);
    case SHIM_PASS:
        break;
    }
    return f(sendbuff, recvbuff, count, datatype, op, comm, stream);
}
