/* SPDX-License-Identifier: Apache-2.0 */
/*
 * NCCL transport (floor 4): the transport interface (transport/transport.h) over an NCCL
 * communicator, through a table of the real library's functions. No MPI, and no link-time
 * dependency on libnccl: the table is resolved at run time (dlsym of the pnccl* names, which
 * an interposer such as the shim never overrides), so the same code runs over the real NCCL
 * on device memory and over the test-only NCCL-over-MPI library on host memory.
 *
 * Ordering (docs/design.md, "Identification"): every call is enqueued on the transport's stream
 * (set_stream), in order, and the functions return without waiting for the device. An op
 * list runs wave by wave (core/schedule.h, op->wave): one ncclGroupStart/End per wave holds
 * its sends, receives, broadcasts, reduces and sharded-tail collective; the executor's local
 * work (chain combine before a wave, APPLY and COPYOUT after it) is enqueued on the same
 * stream in between. NCCL matches point-to-point transfers by order per peer pair, which the
 * waves keep identical on both sides.
 *
 * run() must not be called inside a group the caller left open: the local work between waves
 * would be enqueued before the communication it depends on (the group would only launch at
 * the caller's outermost ncclGroupEnd). The shim runs its remapped calls at group depth 0.
 */
#ifndef MFSDP_TRANSPORT_NCCL_H
#define MFSDP_TRANSPORT_NCCL_H

#include <nccl.h>

#include "transport/transport.h"

/* The NCCL functions the transport and the NCCL runtime call. */
typedef struct mfsdp_nccl_api {
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
                           ncclComm_t, cudaStream_t);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*CommCount)(const ncclComm_t, int *);
    ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
    ncclResult_t (*CommCuDevice)(const ncclComm_t, int *);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    const char *(*GetErrorString)(ncclResult_t);
    /* Optional (NULL when absent): details of the last error; buffer registration
     * (MFSDP_NCCL_REGISTER); the version for logs. */
    const char *(*GetLastError)(ncclComm_t);
    ncclResult_t (*MemAlloc)(void **, size_t);
    ncclResult_t (*MemFree)(void *);
    ncclResult_t (*CommRegister)(const ncclComm_t, void *, size_t, void **);
    ncclResult_t (*CommDeregister)(const ncclComm_t, void *);
    ncclResult_t (*GetVersion)(int *);
    /* 1: the loaded library is the test-only NCCL over MPI (it exports the symbol
     * mfsdp_fake_nccl_host_memory): buffers are host memory, calls complete on return. */
    int host_memory;
} mfsdp_nccl_api_t;

/*
 * The loaded library's functions, resolved once (thread-safe) with mfsdp_nccl_sym: pncclX,
 * else ncclX unless that definition lives in the object mfsdp itself is linked into (an
 * interposer's own override: calling it would recurse). MFSDP_ERR_UNSUPPORTED naming the
 * first required function that is missing (no NCCL loaded, or one too old).
 */
mfsdp_status_t mfsdp_nccl_api_get(const mfsdp_nccl_api_t **api_p);

/*
 * A symbol of the loaded NCCL: sym in the process's global scope, else in any loaded object
 * or its dependencies (a library loaded with RTLD_LOCAL, as PyTorch's pip wheels load libnccl,
 * is in no global scope); with not_ours, definitions in the object mfsdp is linked into (an
 * interposer's overrides) are skipped. NULL when absent. Not for hot paths (it may walk every
 * loaded object): resolve once.
 */
void *mfsdp_nccl_sym(const char *sym, int not_ours);

/*
 * A transport over comm (borrowed: the caller keeps and destroys it; nothing is duplicated or
 * split). The table is copied. Not collective: usable on its own before any context exists
 * (e.g. the shim's settings agreement with allreduce_u64 and allgather_bytes). With device
 * memory (api->host_memory == 0) the host values of allreduce_sum/_u64 and allgather_bytes
 * go through a staging executor (mfsdp_transport_nccl_set_staging) and wait for the stream.
 * Errors of NCCL calls are MFSDP_ERR_TRANSPORT, logged with the call's name and
 * ncclGetErrorString (and ncclGetLastError when present). A call that returns ncclInProgress
 * (non-blocking communicator) is polled with ncclCommGetAsyncError until it is done, at most
 * 600 s (mfsdp_transport_nccl_set_timeout), then MFSDP_ERR_TRANSPORT.
 */
mfsdp_status_t mfsdp_transport_nccl_create(ncclComm_t comm, const mfsdp_nccl_api_t *api,
                                           mfsdp_transport_t **t_p);

/* The executor whose memory stages host values (device memory only; borrowed). Staging runs
 * on the transport's stream: the executor is switched to it first. */
mfsdp_status_t mfsdp_transport_nccl_set_staging(mfsdp_transport_t *t, mfsdp_exec_t *exec);

/* Longest wait for a call in progress (non-blocking communicators), in seconds (> 0). */
mfsdp_status_t mfsdp_transport_nccl_set_timeout(mfsdp_transport_t *t, double seconds);

/* The communicator and function table of an NCCL transport (NULL for another transport). */
ncclComm_t mfsdp_transport_nccl_comm(const mfsdp_transport_t *t);
const mfsdp_nccl_api_t *mfsdp_transport_nccl_api(const mfsdp_transport_t *t);

/* An NCCL status as MFSDP_OK, or MFSDP_ERR_TRANSPORT logged with what and the library's text
 * (ncclInProgress is polled to completion first). For callers outside the transport
 * (registration in runtime/). */
mfsdp_status_t mfsdp_transport_nccl_check(mfsdp_transport_t *t, ncclResult_t r, const char *what);

#endif /* MFSDP_TRANSPORT_NCCL_H */
