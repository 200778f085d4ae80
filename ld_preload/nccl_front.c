/* SPDX-License-Identifier: Apache-2.0 */
/*
 * NCCL front-end of the shim (libmfsdp_preload.so, no MPI anywhere): ncclAllGather,
 * ncclReduceScatter and ncclAllReduce (HSDP's replicate all-reduce), ncclRedOpCreatePreMulSum
 * / ncclRedOpDestroy (to learn PreMulSum scalars), ncclGroupStart / ncclGroupEnd /
 * ncclGroupSimulateEnd (the calling thread's group depth) and ncclCommFinalize / Destroy /
 * Abort (to flush and forget a communicator's state while it still works). Real functions
 * are the library's exported pncclX names (or a definition of ncclX other than ours), resolved
 * once with mfsdp_nccl_sym, which also finds a libnccl loaded with RTLD_LOCAL (PyTorch's pip
 * wheels): no link-time dependency on libnccl. This is the one file that converts mfsdp
 * statuses into ncclResult_t.
 *
 * A communicator is registered at its first intercepted call (size and rank from the real
 * ncclCommCount / ncclCommUserRank), so communicators made any way (ncclCommInitRank*,
 * ncclCommSplit, ncclCommShrink, ...) are all seen. Owner collectives, the settings exchange
 * and the contexts run on the job's own communicator through the NCCL transport
 * (ld_preload/nccl_ops.c), on the intercepted call's stream: the real NCCL on device memory,
 * or the test-only NCCL-over-MPI library (tests/lib) on host memory.
 *
 * Groups: a call the shim would remap cannot run inside a group the job keeps open (NCCL
 * defers it to the job's ncclGroupEnd, but the runtime must launch each of its own groups
 * before the local work that follows it): such a call stops the job with one error. Calls
 * that pass through are forwarded inside the group as they are.
 */
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ld_preload/nccl_ops.h"
#include "ld_preload/shim.h"
#include "mfsdp/kernels.h"
#include "transport/nccl.h"

#define SHIM_EXPORT __attribute__((visibility("default")))

typedef ncclResult_t (*ag_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t);
typedef ncclResult_t (*rs_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
typedef ncclResult_t (*comm_fn)(ncclComm_t);
typedef ncclResult_t (*count_fn)(const ncclComm_t, int *);
typedef ncclResult_t (*premul_fn)(ncclRedOp_t *, void *, ncclDataType_t, ncclScalarResidence_t,
                                  ncclComm_t);
typedef ncclResult_t (*opdestroy_fn)(ncclRedOp_t, ncclComm_t);
typedef ncclResult_t (*group_fn)(void);
#ifdef NCCL_SIM_INFO_INITIALIZER
typedef ncclResult_t (*simend_fn)(ncclSimInfo_t *);
#endif

static struct {
    ag_fn allgather;
    rs_fn reduce_scatter;
    rs_fn allreduce;
    comm_fn finalize;
    comm_fn destroy;
    comm_fn abort;
    count_fn count;
    count_fn user_rank;
    premul_fn premul;
    opdestroy_fn op_destroy;
    group_fn group_start;
    group_fn group_end;
#ifdef NCCL_SIM_INFO_INITIALIZER
    simend_fn group_simulate_end;
#endif
} real;

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

/* pncclX, else an ncclX that is not this library's own: in the global scope or, as PyTorch's
 * pip wheels load libnccl (RTLD_LOCAL), in the loaded object that holds it. */
static void *resolve(const char *pname, const char *name)
{
    void *f = mfsdp_nccl_sym(pname, 0); /* never ours: the shim defines no pncclX */
    return f != NULL ? f : mfsdp_nccl_sym(name, 1);
}

static void resolve_all(void)
{
    real.allgather = (ag_fn)resolve("pncclAllGather", "ncclAllGather");
    real.reduce_scatter = (rs_fn)resolve("pncclReduceScatter", "ncclReduceScatter");
    real.allreduce = (rs_fn)resolve("pncclAllReduce", "ncclAllReduce");
    real.finalize = (comm_fn)resolve("pncclCommFinalize", "ncclCommFinalize");
    real.destroy = (comm_fn)resolve("pncclCommDestroy", "ncclCommDestroy");
    real.abort = (comm_fn)resolve("pncclCommAbort", "ncclCommAbort");
    real.count = (count_fn)resolve("pncclCommCount", "ncclCommCount");
    real.user_rank = (count_fn)resolve("pncclCommUserRank", "ncclCommUserRank");
    real.premul = (premul_fn)resolve("pncclRedOpCreatePreMulSum", "ncclRedOpCreatePreMulSum");
    real.op_destroy = (opdestroy_fn)resolve("pncclRedOpDestroy", "ncclRedOpDestroy");
    real.group_start = (group_fn)resolve("pncclGroupStart", "ncclGroupStart");
    real.group_end = (group_fn)resolve("pncclGroupEnd", "ncclGroupEnd");
#ifdef NCCL_SIM_INFO_INITIALIZER
    real.group_simulate_end = (simend_fn)resolve("pncclGroupSimulateEnd", "ncclGroupSimulateEnd");
#endif
}

#define REAL(fn) (pthread_once(&real_once, resolve_all), real.fn)

/* The job called a function the shim overrides but the loaded library lacks (no NCCL loaded,
 * or one too old): said once, never forwarded into nothing. */
static ncclResult_t missing(const char *name)
{
    static atomic_int said;
    if (atomic_fetch_add(&said, 1) == 0) {
        fprintf(stderr,
                "mfsdp: error: %s was called, but the loaded NCCL library defines neither %s nor "
                "p%s (is libnccl loaded, and is it 2.19 or newer?)\n",
                name, name, name);
        fflush(stderr);
    }
    return ncclInvalidUsage;
}

/* ---------------------------------------------------------------- groups */

/* Groups the calling thread has open (NCCL's depth is per thread too). The runtime's own
 * groups go to the pncclX functions directly and are never counted. */
static __thread int group_depth;

/* nccl.h declares these with an empty parameter list: give them prototypes. */
SHIM_EXPORT ncclResult_t ncclGroupStart(void);
SHIM_EXPORT ncclResult_t ncclGroupEnd(void);

SHIM_EXPORT ncclResult_t ncclGroupStart(void)
{
    group_fn f = REAL(group_start);
    if (f == NULL) {
        return missing("ncclGroupStart");
    }
    ncclResult_t r = f();
    if (r == ncclSuccess && !shim_inside) {
        group_depth++;
    }
    return r;
}

SHIM_EXPORT ncclResult_t ncclGroupEnd(void)
{
    group_fn f = REAL(group_end);
    if (f == NULL) {
        return missing("ncclGroupEnd");
    }
    if (group_depth > 0 && !shim_inside) {
        group_depth--; /* NCCL leaves the group whatever the end returns */
    }
    return f();
}

#ifdef NCCL_SIM_INFO_INITIALIZER
/* Ends the group too (without running it): PyTorch's time estimator uses it. */
SHIM_EXPORT ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t *simInfo)
{
    simend_fn f = REAL(group_simulate_end);
    if (f == NULL) {
        return missing("ncclGroupSimulateEnd");
    }
    if (group_depth > 0 && !shim_inside) {
        group_depth--;
    }
    return f(simInfo);
}
#endif

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
        return missing("ncclRedOpCreatePreMulSum");
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
        return missing("ncclRedOpDestroy");
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

static ncclResult_t nccl_error(mfsdp_status_t st);

/* The shim's state for comm, registered at its first intercepted call. NULL with *r set when
 * it cannot be tracked (said once): its calls then fail rather than pass unidentified. */
static shim_comm_t *comm_state(ncclComm_t comm, ncclResult_t *r)
{
    static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
    shim_comm_t *c = shim_comm_find(SHIM_NCCL, comm);
    if (c != NULL) {
        return c;
    }
    pthread_mutex_lock(&reg_lock); /* one entry when two threads call a new comm at once */
    c = shim_comm_find(SHIM_NCCL, comm);
    if (c != NULL) {
        pthread_mutex_unlock(&reg_lock);
        return c;
    }
    int size = 0, rank = 0;
    count_fn fc = REAL(count), fr = REAL(user_rank);
    *r = fc == NULL   ? missing("ncclCommCount")
         : fr == NULL ? missing("ncclCommUserRank")
                      : fc(comm, &size);
    if (*r == ncclSuccess) {
        *r = fr(comm, &rank);
    }
    if (*r == ncclSuccess && (size < 1 || rank < 0 || rank >= size)) {
        *r = ncclInternalError;
    }
    if (*r != ncclSuccess) {
        if (fc != NULL && fr != NULL) {
            fprintf(stderr,
                    "mfsdp: error: ncclCommCount/ncclCommUserRank on communicator %p failed "
                    "(%d; size %d, rank %d): the shim cannot track it, so its calls fail\n",
                    (void *)comm, (int)*r, size, rank);
        }
        pthread_mutex_unlock(&reg_lock);
        return NULL;
    }
    void *st = shim_nccl_state(comm);
    c = st != NULL ? shim_comm_add(SHIM_NCCL, comm, &shim_nccl_ops, st, size, rank) : NULL;
    if (c == NULL) {
        free(st);
        *r = ncclSystemError;
        pthread_mutex_unlock(&reg_lock);
        return NULL;
    }
    /* Every mode exchanges settings over the comm at its first all-gather or reduce-scatter,
     * through the NCCL transport: a library without what it needs stops the job here, once. */
    char msg[768];
    mfsdp_status_t us = shim_nccl_usable(msg, sizeof(msg));
    if (us != MFSDP_OK) {
        pthread_mutex_lock(&c->lock);
        shim_fatal(c, 1, us, "%s", msg);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&reg_lock);
    return c;
}

/* Flush and forget the comm's state first (pending steps and the last checkpoint are
 * collective over it), then finalize or destroy it. A comm whose remap failed reports the
 * failure here too, so that a job that ignored the collective's error code does not end
 * cleanly. */
static ncclResult_t release(ncclComm_t comm, comm_fn f, const char *name)
{
    if (f == NULL) {
        return missing(name);
    }
    mfsdp_status_t st = shim_inside ? MFSDP_OK : shim_comm_remove(shim_comm_find(SHIM_NCCL, comm));
    premul_purge(comm);
    ncclResult_t r = f(comm);
    return r == ncclSuccess && st != MFSDP_OK ? nccl_error(st) : r;
}

/* PyTorch finalizes a communicator (flushing NCCL's work) before destroying it: by then it
 * must carry nothing of mfsdp's any more. */
SHIM_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    return release(comm, REAL(finalize), "ncclCommFinalize");
}

SHIM_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    return release(comm, REAL(destroy), "ncclCommDestroy");
}

/* An abort is the job's way out of a communicator it gave up on (or, before PyTorch 2.6,
 * its teardown): nothing collective may run on it any more, and PyTorch's watchdog may call
 * it while another thread is inside a remapped call. */
SHIM_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (REAL(abort) == NULL) {
        return missing("ncclCommAbort");
    }
    if (!shim_inside) {
        shim_comm_abandon(shim_comm_find(SHIM_NCCL, comm));
    }
    premul_purge(comm);
    return REAL(abort)(comm);
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
        return missing("ncclAllGather");
    }
    if (shim_inside || sendcount == 0) {
        return f(sendbuff, recvbuff, sendcount, datatype, comm, stream);
    }
    ncclResult_t r = ncclSuccess;
    shim_comm_t *c = comm_state(comm, &r);
    if (c == NULL) {
        return r;
    }
    shim_call_t call = {.kind = SHIM_ALLGATHER,
                        .count = sendcount,
                        .send = sendbuff,
                        .recv = recvbuff,
                        .op_name = "none",
                        .op_supported = 1,
                        .stream = (void *)stream,
                        .in_group = group_depth > 0};
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

/* A reduce-scatter or an all-reduce (same argument list): identified by shim_dispatch or,
 * for the HSDP replicate all-reduce, shim_allreduce; passed to the real NCCL otherwise. */
typedef shim_result_t (*route_fn)(shim_comm_t *, const shim_call_t *, mfsdp_status_t *);

static ncclResult_t reduce_call(const char *name, rs_fn f, shim_kind_t kind, route_fn route,
                                const void *sendbuff, void *recvbuff, size_t count,
                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream)
{
    if (f == NULL) {
        return missing(name);
    }
    if (shim_inside || count == 0) {
        return f(sendbuff, recvbuff, count, datatype, op, comm, stream);
    }
    ncclResult_t r = ncclSuccess;
    shim_comm_t *c = comm_state(comm, &r);
    if (c == NULL) {
        return r;
    }
    shim_call_t call = {.kind = kind,
                        .count = count,
                        .send = sendbuff,
                        .recv = recvbuff,
                        .stream = (void *)stream,
                        .in_group = group_depth > 0};
    call.dtype_known = nccl_dtype(datatype, &call.dtype) && call.dtype != MFSDP_UINT8;
    nccl_op(op, comm, &call);
    mfsdp_status_t st = MFSDP_OK;
    switch (route(c, &call, &st)) {
    case SHIM_DONE:
        return ncclSuccess;
    case SHIM_ERROR:
        return nccl_error(st);
    case SHIM_PASS:
        break;
    }
    return f(sendbuff, recvbuff, count, datatype, op, comm, stream);
}

SHIM_EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t stream)
{
    return reduce_call("ncclReduceScatter", REAL(reduce_scatter), SHIM_REDUCE_SCATTER,
                       shim_dispatch, sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
}

/* HSDP: the all-reduce of a reduce-scatter's output over the replicate group (shim.c decides
 * from rank-identical state; every other all-reduce passes through). */
SHIM_EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream)
{
    return reduce_call("ncclAllReduce", REAL(allreduce), SHIM_ALLREDUCE, shim_allreduce, sendbuff,
                       recvbuff, count, datatype, op, comm, stream);
}
