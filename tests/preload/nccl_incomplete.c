/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libnccl_incomplete.so -- TEST-ONLY: an "NCCL" of one rank that lacks most of the API (no
 * ncclSend, no ncclAllReduce, no ncclCommFinalize, ...), for shim_nccl_nompi.c: the NCCL shim in a
 * process without MPI and without a usable NCCL must stop with one clear error naming what is
 * missing, never forward into nothing. It works on host memory and has no MPI either.
 * ncclCommCount fails on the communicator BAD_COMM (the shim cannot track it then).
 */
#include <nccl.h>
#include <string.h>

#define STUB_EXPORT __attribute__((visibility("default")))
#define STUB_ALIAS(name)                                                                           \
    extern __typeof(p##name) name __attribute__((weak, alias("p" #name), visibility("default")))

/* The communicator whose ncclCommCount fails (shim_nccl_nompi.c passes its address). */
STUB_EXPORT int nccl_incomplete_bad_comm;

static int depth; /* group depth, for the program's checks */

STUB_EXPORT int nccl_incomplete_group_depth(void);
STUB_EXPORT int nccl_incomplete_group_depth(void)
{
    return depth;
}

STUB_EXPORT ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                        ncclDataType_t datatype, ncclComm_t comm,
                                        cudaStream_t stream)
{
    (void)comm;
    (void)stream;
    if (datatype != ncclFloat32) {
        return ncclInvalidArgument;
    }
    memmove(recvbuff, sendbuff, sendcount * sizeof(float)); /* one rank */
    return ncclSuccess;
}
STUB_ALIAS(ncclAllGather);

STUB_EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int *count)
{
    if ((void *)comm == (void *)&nccl_incomplete_bad_comm) {
        return ncclInvalidArgument;
    }
    *count = 1;
    return ncclSuccess;
}
STUB_ALIAS(ncclCommCount);

STUB_EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank)
{
    (void)comm;
    *rank = 0;
    return ncclSuccess;
}
STUB_ALIAS(ncclCommUserRank);

ncclResult_t pncclGroupStart(void);
ncclResult_t pncclGroupEnd(void);

STUB_EXPORT ncclResult_t pncclGroupStart(void)
{
    depth++;
    return ncclSuccess;
}
STUB_ALIAS(ncclGroupStart);

STUB_EXPORT ncclResult_t pncclGroupEnd(void)
{
    if (depth == 0) {
        return ncclInvalidUsage;
    }
    depth--;
    return ncclSuccess;
}
STUB_ALIAS(ncclGroupEnd);

STUB_EXPORT const char *pncclGetErrorString(ncclResult_t result)
{
    return result == ncclSuccess ? "no error" : "an error";
}
STUB_ALIAS(ncclGetErrorString);
