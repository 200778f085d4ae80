/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Context creation over an NCCL communicator (the NCCL backend): the NCCL transport, an
 * executor and an owner arena of the memory the communicator works on, and every agreement
 * through NCCL itself. No MPI call here or below (the build checks the symbols).
 */
#include <stdint.h>
#include <stdlib.h>

#include "core/checks.h"
#include "core/config.h"
#include "mfsdp/runtime_nccl.h"
#include "mfsdp_config.h"
#include "runtime/ctx.h"
#include "transport/nccl.h"

/* ---------------------------------------------------------------------------------------
 * Owner-arena memory (alloc/arena.h callbacks; arg is the context, whose transport and
 * executor outlive the arena)
 */

static mfsdp_status_t exec_alloc(void *arg, size_t bytes, void **ptr_p)
{
    struct mfsdp_ctx *ctx = arg;
    return ctx->exec->ops->mem_alloc(ctx->exec, bytes, ptr_p);
}

static void exec_free(void *arg, void *ptr)
{
    struct mfsdp_ctx *ctx = arg;
    ctx->exec->ops->mem_free(ctx->exec, ptr);
}

static mfsdp_status_t nccl_alloc(void *arg, size_t bytes, void **ptr_p)
{
    struct mfsdp_ctx *ctx = arg;
    const mfsdp_nccl_api_t *api = mfsdp_transport_nccl_api(ctx->tp);
    void *p = NULL;
    MFSDP_CHECK(mfsdp_transport_nccl_check(ctx->tp, api->MemAlloc(&p, bytes), "ncclMemAlloc"));
    /* ncclMemAlloc does not zero; the arena promises zeroed memory. */
    mfsdp_status_t st = ctx->exec->ops->zero(ctx->exec, p, bytes);
    if (st == MFSDP_OK) {
        st = ctx->exec->ops->sync(ctx->exec);
    }
    if (st != MFSDP_OK) {
        api->MemFree(p);
        return st;
    }
    *ptr_p = p;
    return MFSDP_OK;
}

static void nccl_free(void *arg, void *ptr)
{
    struct mfsdp_ctx *ctx = arg;
    ncclResult_t r = mfsdp_transport_nccl_api(ctx->tp)->MemFree(ptr);
    if (r != ncclSuccess) {
        mfsdp_transport_nccl_check(ctx->tp, r, "ncclMemFree");
    }
}

static mfsdp_status_t nccl_reg(void *arg, void *ptr, size_t bytes, void **handle_p)
{
    struct mfsdp_ctx *ctx = arg;
    const mfsdp_nccl_api_t *api = mfsdp_transport_nccl_api(ctx->tp);
    return mfsdp_transport_nccl_check(
        ctx->tp, api->CommRegister(mfsdp_transport_nccl_comm(ctx->tp), ptr, bytes, handle_p),
        "ncclCommRegister (owner arena)");
}

static mfsdp_status_t nccl_dereg(void *arg, void *handle)
{
    struct mfsdp_ctx *ctx = arg;
    const mfsdp_nccl_api_t *api = mfsdp_transport_nccl_api(ctx->tp);
    return mfsdp_transport_nccl_check(
        ctx->tp, api->CommDeregister(mfsdp_transport_nccl_comm(ctx->tp), handle),
        "ncclCommDeregister (owner arena)");
}

/* The arena's kind and memory: device memory from the executor (cudaMalloc) or, to
 * register, from ncclMemAlloc; the test library's host memory as a host arena, or through
 * its ncclMemAlloc to register. */
static mfsdp_status_t arena_memory(struct mfsdp_ctx *ctx, const mfsdp_nccl_api_t *api, int reg)
{
    if (reg && (api->MemAlloc == NULL || api->MemFree == NULL || api->CommRegister == NULL ||
                api->CommDeregister == NULL)) {
        MFSDP_WARN("MFSDP_NCCL_REGISTER=1 but the loaded NCCL lacks ncclMemAlloc, ncclMemFree, "
                   "ncclCommRegister or ncclCommDeregister (NCCL >= 2.19 has them)");
        return MFSDP_ERR_UNSUPPORTED;
    }
    if (!reg && api->host_memory) {
        return MFSDP_OK; /* a host arena, as over MPI */
    }
    ctx->arena_kind = MFSDP_ARENA_DEVICE;
    ctx->arena_mem.arg = ctx;
    ctx->arena_mem.alloc = reg ? nccl_alloc : exec_alloc;
    ctx->arena_mem.free = reg ? nccl_free : exec_free;
    ctx->arena_mem.reg = reg ? nccl_reg : NULL;
    ctx->arena_mem.dereg = reg ? nccl_dereg : NULL;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Creation
 */

/* The executor for the memory api's communicators work on. */
static mfsdp_status_t make_exec(const mfsdp_nccl_api_t *api, ncclComm_t comm, mfsdp_transport_t *tp,
                                mfsdp_exec_t **e_p)
{
    if (api->host_memory) {
        return mfsdp_exec_cpu_create(e_p);
    }
#if MFSDP_HAVE_CUDA
    int dev = -1;
    MFSDP_CHECK(mfsdp_transport_nccl_check(tp, api->CommCuDevice(comm, &dev), "ncclCommCuDevice"));
    MFSDP_CHECK(mfsdp_exec_cuda_create(dev, e_p));
    return mfsdp_transport_nccl_set_staging(tp, *e_p);
#else
    (void)comm;
    (void)tp;
    MFSDP_WARN("the NCCL communicator works on device memory, but this mfsdp was built without "
               "CUDA (-Dcuda=disabled): no executor for it");
    return MFSDP_ERR_UNSUPPORTED;
#endif
}

mfsdp_status_t mfsdp_ctx_create_nccl(const mfsdp_manifest_t *manifest, const mfsdp_ctx_opts_t *opts,
                                     ncclComm_t comm, mfsdp_ctx_h *ctx_p)
{
    MFSDP_CHECK_ARG(manifest != NULL && ctx_p != NULL && comm != NULL);
    const mfsdp_config_t *cfg = NULL; /* a bad configuration fails in the agreement below */
    (void)mfsdp_config_get(&cfg);
    const mfsdp_nccl_api_t *api;
    MFSDP_CHECK(mfsdp_nccl_api_get(&api));
    struct mfsdp_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    ctx->magic = MFSDP_CTX_MAGIC;
    mfsdp_status_t st = mfsdp_transport_nccl_create(comm, api, &ctx->tp);
    if (st != MFSDP_OK) {
        free(ctx);
        return st;
    }
    ctx->rank = ctx->tp->rank;
    ctx->world = ctx->tp->world;
    st = make_exec(api, comm, ctx->tp, &ctx->exec);
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    /* Every rank must plan with the same manifest and settings (MFSDP_TRANSPORT and
     * MFSDP_NCCL_REGISTER included): compared first, so that a difference is one clear error
     * rather than a hang or a truncated transfer later. */
    st = mfsdp_ctx_agree(ctx->tp, manifest, ctx->world, opts); /* NULL: compared as all zero */
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_check_world(manifest, opts, ctx->world); /* alike on every rank now */
    }
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    if (cfg->transport == MFSDP_CFG_TRANSPORT_MPI) {
        MFSDP_WARN("MFSDP_TRANSPORT=mpi asks for the MPI transport, but this context is being "
                   "created on an NCCL communicator (mfsdp_ctx_create_nccl)");
        mfsdp_ctx_free(ctx);
        return MFSDP_ERR_CONFIG;
    }
    st = arena_memory(ctx, api, cfg->nccl_register);
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_init_local(ctx, manifest, opts);
    }
    /* Agree on the outcome, so that a rank-local failure (memory) fails every rank instead
     * of leaving the others waiting in their first collective, and on what it resolved. */
    st = mfsdp_ctx_agree_setup(ctx, st);
    if (st != MFSDP_OK) {
        mfsdp_ctx_free(ctx);
        return st;
    }
    MFSDP_INFO(RUNTIME, "rank %d/%d: nccl transport, %s executor, %s owner arena%s", ctx->rank,
               ctx->world, ctx->exec->ops->name,
               mfsdp_arena_kind(ctx->arena) == MFSDP_ARENA_DEVICE ? "device" : "host",
               mfsdp_arena_registered(ctx->arena) ? " (registered)" : "");
    *ctx_p = ctx;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_attach_replicate_nccl(mfsdp_ctx_h ctx, ncclComm_t replicate_comm)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK_ARG(replicate_comm != NULL);
    const mfsdp_nccl_api_t *api = mfsdp_transport_nccl_api(ctx->tp);
    if (api == NULL) {
        MFSDP_WARN("the context was not created on an NCCL communicator: attach the replicate "
                   "communicator of its own kind");
        return MFSDP_ERR_STATE;
    }
    if (ctx->rtp != NULL) {
        MFSDP_WARN("a replicate communicator is attached already");
        return MFSDP_ERR_STATE;
    }
    mfsdp_transport_t *rtp = NULL;
    MFSDP_CHECK(mfsdp_transport_nccl_create(replicate_comm, api, &rtp));
    mfsdp_status_t st = MFSDP_OK;
    if (rtp->world != ctx->replicate) {
        MFSDP_WARN("the replicate communicator has %d ranks; the manifest declares \"replicate\": "
                   "%d",
                   rtp->world, ctx->replicate);
        st = MFSDP_ERR_MISMATCH;
        goto err;
    }
    if (ctx->exec->ops->device_memory) {
        MFSDP_CHECK_GOTO(mfsdp_transport_nccl_set_staging(rtp, ctx->exec), st, err);
    }
    MFSDP_CHECK_GOTO(rtp->ops->set_stream(rtp, ctx->stream), st, err);
    MFSDP_CHECK_GOTO(mfsdp_ctx_agree(rtp, ctx->manifest, ctx->world, NULL), st, err);
    ctx->rtp = rtp;
    return MFSDP_OK;
err:
    rtp->ops->destroy(rtp);
    return st;
}
