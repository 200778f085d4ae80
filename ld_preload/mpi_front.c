/* SPDX-License-Identifier: Apache-2.0 */
/*
 * MPI front-end of the shim: MPI_Allgather, MPI_Reduce_scatter_block and MPI_Reduce_scatter
 * (equal counts) over PMPI; MPI_Comm_free and MPI_Finalize to flush and forget state. This is the one file that converts
 * mfsdp statuses into MPI error codes: a failed remap calls the communicator's error
 * handler (MPI_ERRORS_ARE_FATAL by default, so the job stops with a non-zero exit).
 */
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
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
    int code = st == MFSDP_ERR_NO_MEMORY ? MPI_ERR_NO_MEM
               : st == MFSDP_ERR_INVALID_ARG ? MPI_ERR_ARG
                                             : MPI_ERR_OTHER;
    MPI_Comm_call_errhandler(comm, code);
    return code;
}

/* The shim's state for comm, registered on first sight (a pure function of its size). */
static shim_comm_t *comm_state(MPI_Comm comm)
{
    shim_comm_t *c = shim_comm_find(SHIM_MPI, comm);
    if (c == NULL) {
        int size = 0, rank = 0;
        PMPI_Comm_size(comm, &size);
        PMPI_Comm_rank(comm, &rank);
        c = shim_comm_add(SHIM_MPI, comm, comm, 0, size, rank);
    }
    return c;
}

SHIM_EXPORT int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype,
                              void *recvbuf, int recvcount, MPI_Datatype recvtype, MPI_Comm comm)
{
    mfsdp_dtype_t dt;
    int inter = 0;
    if (shim_inside || comm == MPI_COMM_NULL || !mpi_dtype(recvtype, &dt) || recvcount <= 0 ||
        (sendbuf != MPI_IN_PLACE && (sendtype != recvtype || sendcount != recvcount)) ||
        PMPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS || inter) {
        return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
    }
    shim_comm_t *c = comm_state(comm);
    const void *send = sendbuf;
    if (sendbuf == MPI_IN_PLACE && c != NULL) {
        send = (const char *)recvbuf + (size_t)c->rank * (size_t)recvcount * mfsdp_dtype_size(dt);
    }
    shim_call_t call = {.sig = {MFSDP_CALL_ALLGATHER, (size_t)recvcount, dt},
                        .send = send,
                        .recv = recvbuf,
                        .op_name = "none",
                        .op_supported = 1};
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE: return MPI_SUCCESS;
    case SHIM_ERROR: return mpi_error(comm, st);
    case SHIM_PASS: break;
    }
    return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}

/* MPI ops mfsdp can apply on owners: only MPI_SUM (avg is a post-divide by the job, see
 * MFSDP_GRAD_DIVIDE). */
static int reduce_common(const void *sendbuf, void *recvbuf, int recvcount,
                         MPI_Datatype datatype, MPI_Op op, MPI_Comm comm, int *handled)
{
    mfsdp_dtype_t dt;
    int inter = 0;
    *handled = 0;
    if (shim_inside || comm == MPI_COMM_NULL || sendbuf == MPI_IN_PLACE ||
        !mpi_dtype(datatype, &dt) || dt == MFSDP_UINT8 || recvcount <= 0 ||
        PMPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS || inter) {
        return MPI_SUCCESS;
    }
    shim_comm_t *c = comm_state(comm);
    shim_call_t call = {.sig = {MFSDP_CALL_REDUCE_SCATTER, (size_t)recvcount, dt},
                        .send = sendbuf,
                        .recv = recvbuf,
                        .op = MFSDP_OP_SUM,
                        .scalar = 1.0,
                        .op_name = op == MPI_SUM ? "sum" : "other",
                        .op_supported = op == MPI_SUM};
    mfsdp_status_t st = MFSDP_OK;
    switch (shim_dispatch(c, &call, &st)) {
    case SHIM_DONE: *handled = 1; return MPI_SUCCESS;
    case SHIM_ERROR: *handled = 1; return mpi_error(comm, st);
    case SHIM_PASS: break;
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
    int size = 0, rank = 0, handled = 0, rc = MPI_SUCCESS;
    if (!shim_inside && comm != MPI_COMM_NULL && recvcounts != NULL &&
        PMPI_Comm_size(comm, &size) == MPI_SUCCESS && PMPI_Comm_rank(comm, &rank) == MPI_SUCCESS) {
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
    shim_finalize_all();
    return PMPI_Finalize();
}
