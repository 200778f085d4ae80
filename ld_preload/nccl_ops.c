/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The shim core's operations on an NCCL communicator (shim_fe_ops_t), with no MPI: the
 * settings exchange through a standalone NCCL transport on the job's own communicator
 * (created at the comm's first exchange, destroyed at its release), contexts through
 * mfsdp_ctx_create_nccl and HSDP's replicate communicator through
 * mfsdp_ctx_attach_replicate_nccl. The core calls them inside an intercepted collective that
 * every rank of the comm is in, outside any group the job opened, so every rank issues them
 * in the same order; they run on that call's stream (shim_comm_t.stream).
 *
 * Memory follows the library: host values go straight through the test NCCL library (host
 * memory); with the real NCCL (device memory) they are staged through a CUDA executor on the
 * communicator's device, which needs a build with CUDA.
 */
#include "ld_preload/nccl_ops.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/executor.h"
#include "mfsdp/runtime_nccl.h"
#include "mfsdp_config.h"
#include "transport/nccl.h"

typedef struct nccl_state {
    ncclComm_t comm;
    mfsdp_transport_t *agree; /* the settings exchange's transport (NULL until used) */
    mfsdp_exec_t *stage;      /* device memory: stages its host values */
} nccl_state_t;

static pthread_once_t usable_once = PTHREAD_ONCE_INIT;
static mfsdp_status_t usable_status;
static char usable_msg[512];

static void usable_check(void)
{
    const mfsdp_nccl_api_t *api;
    char log[512] = "";
    mfsdp_log_capture_begin();
    usable_status = mfsdp_nccl_api_get(&api);
    mfsdp_log_capture_end(log, sizeof(log));
    if (usable_status != MFSDP_OK) {
        snprintf(usable_msg, sizeof(usable_msg),
                 "the loaded NCCL library cannot carry mfsdp's owner collectives: %s",
                 log[0] ? log : mfsdp_status_string(usable_status));
    }
}

mfsdp_status_t shim_nccl_usable(char *msg, size_t msglen)
{
    pthread_once(&usable_once, usable_check);
    if (usable_status != MFSDP_OK && msg != NULL && msglen > 0) {
        snprintf(msg, msglen, "%s", usable_msg);
    }
    return usable_status;
}

void *shim_nccl_state(ncclComm_t comm)
{
    nccl_state_t *s = calloc(1, sizeof(*s));
    if (s != NULL) {
        s->comm = comm;
    }
    return s;
}

static ncclComm_t comm_of(const shim_comm_t *c)
{
    return ((const nccl_state_t *)c->fe_state)->comm;
}

/* Device memory: a CUDA executor on the communicator's device stages the host values. */
static mfsdp_status_t staging(nccl_state_t *s, const mfsdp_nccl_api_t *api, mfsdp_transport_t *t)
{
#if MFSDP_HAVE_CUDA
    int dev = -1;
    MFSDP_CHECK(
        mfsdp_transport_nccl_check(t, api->CommCuDevice(s->comm, &dev), "ncclCommCuDevice"));
    MFSDP_CHECK(mfsdp_exec_cuda_create(dev, &s->stage));
    return mfsdp_transport_nccl_set_staging(t, s->stage);
#else
    (void)s;
    (void)api;
    (void)t;
    MFSDP_WARN("the NCCL communicator works on device memory, but this mfsdp was built without "
               "CUDA (-Dcuda=disabled): rebuild with CUDA to run the shim on a GPU job");
    return MFSDP_ERR_UNSUPPORTED;
#endif
}

/* The exchange's transport on the stream of the call in progress. */
static mfsdp_status_t agree_transport(shim_comm_t *c, mfsdp_transport_t **t_p)
{
    nccl_state_t *s = c->fe_state;
    if (s->agree == NULL) {
        const mfsdp_nccl_api_t *api;
        MFSDP_CHECK(mfsdp_nccl_api_get(&api));
        mfsdp_transport_t *t = NULL;
        MFSDP_CHECK(mfsdp_transport_nccl_create(s->comm, api, &t));
        mfsdp_status_t st = api->host_memory ? MFSDP_OK : staging(s, api, t);
        if (st != MFSDP_OK) {
            t->ops->destroy(t);
            if (s->stage != NULL) {
                s->stage->ops->destroy(s->stage);
                s->stage = NULL;
            }
            return st;
        }
        s->agree = t;
    }
    MFSDP_CHECK(s->agree->ops->set_stream(s->agree, c->stream));
    *t_p = s->agree;
    return MFSDP_OK;
}

static int ar_u64(shim_comm_t *c, uint64_t *buf, size_t n, int is_max)
{
    mfsdp_transport_t *t;
    return agree_transport(c, &t) != MFSDP_OK ||
           t->ops->allreduce_u64(t, buf, n, is_max) != MFSDP_OK;
}

static int gather(shim_comm_t *c, const void *mine, size_t bytes, void *all)
{
    mfsdp_transport_t *t;
    return agree_transport(c, &t) != MFSDP_OK ||
           t->ops->allgather_bytes(t, mine, bytes, all) != MFSDP_OK;
}

static mfsdp_status_t ctx_create(shim_comm_t *c, const mfsdp_manifest_t *m,
                                 const mfsdp_ctx_opts_t *opts, mfsdp_ctx_h *ctx_p)
{
    return mfsdp_ctx_create_nccl(m, opts, comm_of(c), ctx_p);
}

static mfsdp_status_t attach(mfsdp_ctx_h ctx, shim_comm_t *replicate)
{
    return mfsdp_ctx_attach_replicate_nccl(ctx, comm_of(replicate));
}

static void release(shim_comm_t *c)
{
    nccl_state_t *s = c->fe_state;
    if (s == NULL) {
        return;
    }
    if (s->agree != NULL) {
        s->agree->ops->destroy(s->agree); /* frees its staging buffer first */
    }
    if (s->stage != NULL) {
        s->stage->ops->destroy(s->stage);
    }
    free(s);
    c->fe_state = NULL;
}

const shim_fe_ops_t shim_nccl_ops = {
    .allreduce_u64 = ar_u64,
    .allgather = gather,
    .ctx_create = ctx_create,
    .attach_replicate = attach,
    .release = release,
};
