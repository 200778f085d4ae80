/* SPDX-License-Identifier: Apache-2.0 */
/*
 * MPI front-end of the shim: MPI_Allgather, MPI_Reduce_scatter_block, MPI_Reduce_scatter
 * (equal counts) and MPI_Allreduce (HSDP's replicate all-reduce) over PMPI; MPI_Comm_free and
 * MPI_Finalize to flush and forget state. This is the one file that converts mfsdp statuses
 * into MPI error codes: a refused call calls the communicator's error handler
 * (MPI_ERRORS_ARE_FATAL by default, so the job stops with a non-zero exit on every rank).
 *
 * Only calls whose datatype FSDP can use (float; bytes for mixed-dtype groups) reach the
 * identification: an all-gather of integers cannot be an FSDP collective and passes through.
 */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "ld_preload/mpi_ops.h"
#include "ld_preload/shim.h"

#define SHIM_EXPORT __attribute__((visibility("default")))

static int mpi_dtype(MPI_Datatype t, mfsdp_dtype_t *dt)
{
    if (t == MPI_FLOAT) {
        *dt = MFSDP_FLOAT32;
    } else if (t == MPI_BYTE || t == MPI_UINT8_T || t == MPI_UNSIGNED_CHAR) {
        *dt = MFSDP_UINT8;
    } else {
        return 0; /* MPI has no standard bfloat16: such calls pass through */
    }
    return 1;
}

static int mpi_error(MPI_Comm comm, mfsdp_status_t st)
{
    int code = st == MFSDP_ERR_NO_MEMORY     ? MPI_ERR_NO_MEM
               : st == MFSDP_ERR_INVALID_ARG ? MPI_ERR_ARG
                                             : MPI_ERR_OTHER;
    MPI_Comm_call_errhandler(comm, code);
    return code;
}

static int usable(MPI_Comm comm)
{
    int inter = 0;
    return !shim_inside && comm != MPI_COMM_NULL &&
           PMPI_Comm_test_inter(comm, &inter) == MPI_SUCCESS && !inter;
}

/* The shim's state for comm, registered on first sight. */
static shim_comm_t *comm_state(MPI_Comm comm)
{
    shim_comm_t *c = shim_comm_find(SHIM_MPI, comm);
    if (c == NULL) {
        int size = 0, rank = 0;
        PMPI_Comm_size(comm, &size);
        PMPI_Comm_rank(comm, &rank);
        void *st = shim_mpi_state(comm, 0);
        c = st != NULL ? shim_comm_add(SHIM_MPI, comm, &shim_mpi_ops, st, size, rank) : NULL;
        if (c == NULL) {
            free(st);
        }
    }
    return c;
}

/* Whether count elements of t are the same contiguous bytes as bytes bytes (a send type other
 * than the receive type, e.g. MPI_BYTE for MPI_FLOAT). */
static int same_bytes(int count, MPI_Datatype t, size_t bytes)
{
    int size = 0;
    MPI_Aint lb = 0, extent = 0;
    return count >= 0 && PMPI_Type_size(t, &size) == MPI_SUCCESS &&
           PMPI_Type_get_extent(t, &lb, &extent) == MPI_SUCCESS && lb == 0 &&
           extent == (MPI_Aint)size && (size_t)count * (size_t)size == bytes;
}

SHIM_EXPORT int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype,
                              void *recvbuf, int recvcount, MPI_Datatype recvtype, MPI_Comm comm)
{
    mfsdp_dtype_t dt = MFSDP_UINT8;
    if (!usable(comm) || recvcount <= 0) {
        return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
    }
    /* A datatype mfsdp does not handle (MPI has no standard bfloat16), or a send side that is
     * not the receive side's bytes, is never remapped: on a managed communicator it is refused,
     * elsewhere it passes through (shim_dispatch), as the NCCL front-end's. */
    int typed = mpi_dtype(recvtype, &dt);
    int known =
        typed && (sendbuf == MPI_IN_PLACE || (sendtype == recvtype && sendcount == recvcount) ||
                  same_bytes(sendcount, sendtype, (size_t)recvcount * mfsdp_dtype_size(dt)));
    shim_comm_t *c = comm_state(comm);
    if (c == NULL) {
        return mpi_error(comm, MFSDP_ERR_NO_MEMORY);
    }
    const void *send = sendbuf;
    if (sendbuf == MPI_IN_PLACE) {
        send = (const char *)recvbuf + (size_t)c->rank * (size_t)recvcount * mfsdp_dtype_size(dt);
    }
    shim_call_t call = {
        .kind = SHIM_ALLGATHER,
        .count = (size_t)recvcount,
        .dtype_known = known,
        .local_why =
            typed && !known ? "whose send count and type are not the receive block's bytes" : NULL,
        .dtype = dt,
        .send = send,
        .recv = recvbuf,
        .op_name = "none",
        .op_supported = 1};
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE:
        return MPI_SUCCESS;
    case SHIM_ERROR:
        return mpi_error(comm, st);
    case SHIM_PASS:
        break;
    }
    return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}

/* MPI ops mfsdp can apply on owners: only MPI_SUM (an average is the job's post-divide, which
 * the manifest's training.grad_divide declares). */
static shim_call_t reduce_call(shim_kind_t kind, const void *sendbuf, void *recvbuf, size_t count,
                               int known, mfsdp_dtype_t dt, MPI_Op op)
{
    shim_call_t call = {.kind = kind,
                        .count = count,
                        .dtype_known = known,
                        .dtype = dt,
                        .send = sendbuf,
                        .recv = recvbuf,
                        .op = MFSDP_OP_SUM,
                        .scalar = 1.0,
                        .op_name = op == MPI_SUM ? "sum" : "other",
                        .op_supported = op == MPI_SUM};
    return call;
}

static int reduce_common(const void *sendbuf, void *recvbuf, int recvcount, MPI_Datatype datatype,
                         MPI_Op op, MPI_Comm comm, int *handled)
{
    mfsdp_dtype_t dt = MFSDP_FLOAT32;
    *handled = 0;
    if (!usable(comm) || recvcount <= 0) {
        return MPI_SUCCESS;
    }
    /* A datatype mfsdp cannot sum is refused on a managed communicator (shim_dispatch). */
    int known = mpi_dtype(datatype, &dt) && dt != MFSDP_UINT8;
    shim_comm_t *c = comm_state(comm);
    if (c == NULL) {
        *handled = 1;
        return mpi_error(comm, MFSDP_ERR_NO_MEMORY);
    }
    /* MPI_IN_PLACE: the input is recvbuf. Identified like any call; remapped, the runtime
     * refuses it (the owners need the input apart from the output), so a managed
     * communicator never passes it through. */
    shim_call_t call = reduce_call(SHIM_REDUCE_SCATTER, sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf,
                                   recvbuf, (size_t)recvcount, known, dt, op);
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE:
        *handled = 1;
        return MPI_SUCCESS;
    case SHIM_ERROR:
        *handled = 1;
        return mpi_error(comm, st);
    case SHIM_PASS:
        break;
    }
    return MPI_SUCCESS;
}

SHIM_EXPORT int MPI_Reduce_scatter_block(const void *sendbuf, void *recvbuf, int recvcount,
                                         MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
    int handled = 0;
    int rc = reduce_common(sendbuf, recvbuf, recvcount, datatype, op, comm, &handled);
    if (handled) {
        return rc;
    }
    return PMPI_Reduce_scatter_block(sendbuf, recvbuf, recvcount, datatype, op, comm);
}

SHIM_EXPORT int MPI_Reduce_scatter(const void *sendbuf, void *recvbuf, const int recvcounts[],
                                   MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
    int size = 0, handled = 0, rc = MPI_SUCCESS;
    if (usable(comm) && recvcounts != NULL && PMPI_Comm_size(comm, &size) == MPI_SUCCESS) {
        int equal = 1;
        for (int r = 1; r < size; r++) {
            equal &= recvcounts[r] == recvcounts[0];
        }
        if (equal) { /* only the FSDP-shaped (equal counts) form is remapped */
            rc = reduce_common(sendbuf, recvbuf, recvcounts[0], datatype, op, comm, &handled);
            if (handled) {
                return rc;
            }
        }
    }
    return PMPI_Reduce_scatter(sendbuf, recvbuf, recvcounts, datatype, op, comm);
}

/* HSDP: the all-reduce of a reduce-scatter's output over the replicate group. Anything else
 * (the loss, norms) passes through; shim_allreduce() decides from rank-identical state. */
SHIM_EXPORT int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
                              MPI_Op op, MPI_Comm comm)
{
    mfsdp_dtype_t dt;
    if (!usable(comm) || !mpi_dtype(datatype, &dt) || dt == MFSDP_UINT8 || count <= 0) {
        return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
    }
    shim_comm_t *c = comm_state(comm);
    if (c == NULL) {
        return mpi_error(comm, MFSDP_ERR_NO_MEMORY);
    }
    shim_call_t call = reduce_call(SHIM_ALLREDUCE, sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf,
                                   recvbuf, (size_t)count, 1, dt, op);
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_allreduce(c, &call, &st)) {
    case SHIM_DONE:
        return MPI_SUCCESS;
    case SHIM_ERROR:
        return mpi_error(comm, st);
    case SHIM_PASS:
        break;
    }
    return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
}

/* A freed handle may be reused by the next communicator: forget (and flush) its state. */
SHIM_EXPORT int MPI_Comm_free(MPI_Comm *comm)
{
    if (!shim_inside && comm != NULL && *comm != MPI_COMM_NULL) {
        shim_comm_remove(shim_comm_find(SHIM_MPI, *comm));
    }
    return PMPI_Comm_free(comm);
}

SHIM_EXPORT int MPI_Finalize(void)
{
    int world_rank = 0;
    PMPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    int fail = shim_finalize_all(world_rank);
    int rc = PMPI_Finalize();
    if (fail) {
        /* The error was printed: a job whose remap failed or trained nothing under its
         * manifest must not exit 0. */
        exit(3);
    }
    return rc;
}
