/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The shim core's operations on an MPI communicator (shim_fe_ops_t): the settings exchange
 * and the context over MPI (the MPI + CPU backend), for the MPI front-end's communicators
 * (libmfsdp_preload_mpi.so).
 */
#include <mpi.h>
#include <stdlib.h>

#include "ld_preload/mpi_ops.h"
#include "mfsdp/runtime_mpi.h"

typedef struct mpi_state {
    MPI_Comm comm;
    int owns; /* the shim made it (a split) and frees it */
} mpi_state_t;

void *shim_mpi_state(MPI_Comm comm, int owns)
{
    mpi_state_t *s = malloc(sizeof(*s));
    if (s != NULL) {
        s->comm = comm;
        s->owns = owns;
    }
    return s;
}

MPI_Comm shim_mpi_comm(const shim_comm_t *c)
{
    return ((const mpi_state_t *)c->fe_state)->comm;
}

static int ar_u64(shim_comm_t *c, uint64_t *buf, size_t n, int is_max)
{
    return PMPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_UINT64_T, is_max ? MPI_MAX : MPI_MIN,
                          shim_mpi_comm(c)) != MPI_SUCCESS;
}

static int gather(shim_comm_t *c, const void *mine, size_t bytes, void *all)
{
    return PMPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE,
                          shim_mpi_comm(c)) != MPI_SUCCESS;
}

static mfsdp_status_t ctx_create(shim_comm_t *c, const mfsdp_manifest_t *m,
                                 const mfsdp_ctx_opts_t *opts, mfsdp_ctx_h *ctx_p)
{
    return mfsdp_ctx_create_mpi(m, opts, shim_mpi_comm(c), ctx_p);
}

static mfsdp_status_t attach(mfsdp_ctx_h ctx, shim_comm_t *replicate)
{
    return mfsdp_ctx_attach_replicate_mpi(ctx, shim_mpi_comm(replicate));
}

static void release(shim_comm_t *c)
{
    mpi_state_t *s = c->fe_state;
    if (s == NULL) {
        return;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (s->owns && s->comm != MPI_COMM_NULL && !finalized) {
        PMPI_Comm_free(&s->comm);
    }
    free(s);
    c->fe_state = NULL;
}

const shim_fe_ops_t shim_mpi_ops = {
    .allreduce_u64 = ar_u64,
    .allgather = gather,
    .ctx_create = ctx_create,
    .attach_replicate = attach,
    .release = release,
};
