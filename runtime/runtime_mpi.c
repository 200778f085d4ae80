/* SPDX-License-Identifier: Apache-2.0 */
/* Context creation over an MPI communicator (the MPI + CPU backend). */
#include <stdlib.h>

#include "core/checks.h"
#include "core/config.h"
#include "mfsdp/runtime_mpi.h"
#include "runtime/ctx.h"
#include "transport/mpi.h"

mfsdp_status_t mfsdp_ctx_create_mpi(const mfsdp_manifest_t *manifest, const mfsdp_ctx_opts_t *opts,
                                    MPI_Comm comm, mfsdp_ctx_h *ctx_p)
{
    MFSDP_CHECK_ARG(manifest != NULL && ctx_p != NULL && comm != MPI_COMM_NULL);
    int world = 0;
    int rank = 0;
    MFSDP_MPI_CHECK(MPI_Comm_size(comm, &world));
    MFSDP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    struct mfsdp_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    ctx->magic = MFSDP_CTX_MAGIC;
    ctx->rank = rank;
    ctx->world = world;
    mfsdp_status_t st = mfsdp_exec_cpu_create(&ctx->exec); /* MPI moves host memory */
    if (st != MFSDP_OK) {
        free(ctx);
        return st;
    }
    st = mfsdp_transport_mpi_create(comm, &ctx->tp);
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    /* Every rank must plan with the same manifest and settings: compared first, so that a
     * difference is one clear error rather than a hang or a truncated message later. */
    st = mfsdp_ctx_agree(ctx->tp, manifest, world, opts); /* NULL: compared as all zero */
    if (st == MFSDP_OK) {
        /* After the agreement: the manifest and options are the same on every rank, so every
         * rank fails these alike (a rank with another manifest was told so above). */
        st = mfsdp_ctx_check_world(manifest, opts, world);
    }
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    const mfsdp_config_t *cfg;
    st = mfsdp_config_get(&cfg);
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    if (cfg->shm && world > 1) {
        /* The arena in shared memory, so that the ranks of a node can read the owners'
         * weights from it (docs/design.md, "Collectives on owners"). */
        ctx->arena_mem.arg = ctx->tp;
        ctx->arena_mem.alloc = mfsdp_transport_mpi_arena_alloc;
        ctx->arena_mem.free = mfsdp_transport_mpi_arena_free;
    }
    /* Agree on the outcome, so that a rank-local failure (memory) fails every rank instead
     * of leaving the others waiting in their first collective, and on what it resolved. */
    st = mfsdp_ctx_agree_setup(ctx, mfsdp_ctx_init_local(ctx, manifest, opts));
    const char *const *peer = NULL;
    if (st == MFSDP_OK) {
        st = mfsdp_transport_mpi_share(ctx->tp, cfg->shm, &peer);
    }
    if (st == MFSDP_OK) {
        /* Every rank agrees, those whose node shares nothing too (a node of one rank of a
         * multi-node job: peer NULL there, set elsewhere). */
        st =
            mfsdp_ctx_agree_setup(ctx, peer != NULL ? mfsdp_ctx_share_arenas(ctx, peer) : MFSDP_OK);
    }
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    *ctx_p = ctx;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_attach_replicate_mpi(mfsdp_ctx_h ctx, MPI_Comm replicate_comm)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK_ARG(replicate_comm != MPI_COMM_NULL);
    int size = 0;
    MFSDP_MPI_CHECK(MPI_Comm_size(replicate_comm, &size));
    if (size != ctx->replicate) {
        MFSDP_WARN("the replicate communicator has %d ranks; the manifest declares \"replicate\": "
                   "%d",
                   size, ctx->replicate);
        return MFSDP_ERR_MISMATCH;
    }
    if (ctx->rtp != NULL) {
        MFSDP_WARN("a replicate communicator is attached already");
        return MFSDP_ERR_STATE;
    }
    mfsdp_transport_t *rtp = NULL;
    MFSDP_CHECK(mfsdp_transport_mpi_create(replicate_comm, &rtp));
    mfsdp_status_t st = mfsdp_ctx_agree(rtp, ctx->manifest, ctx->world, NULL);
    if (st != MFSDP_OK) {
        rtp->ops->destroy(rtp);
        return st;
    }
    ctx->rtp = rtp;
    return MFSDP_OK;
}
