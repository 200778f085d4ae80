/* SPDX-License-Identifier: Apache-2.0 */
/* Internal state of a runtime context (runtime/runtime.c, runtime/runtime_mpi.c). */
#ifndef MFSDP_RUNTIME_CTX_H
#define MFSDP_RUNTIME_CTX_H

#include "alloc/arena.h"
#include "core/schedule.h"
#include "mfsdp/runtime.h"
#include "transport/transport.h"

#define MFSDP_CTX_MAGIC 0x6d66736470637478ULL /* "mfsdpctx" */

struct mfsdp_ckpt_ctx; /* runtime/checkpoint.c: the pending save and its figures */

typedef struct mfsdp_group_state {
    mfsdp_group_sched_t *gs;
    mfsdp_sched_ops_t ag_ops;
    mfsdp_sched_ops_t rs_ops;
    mfsdp_xfer_bufs_t *bufs;  /* gs->nsegs (+1) entries, bound per call */
    int initialized;          /* weights taken from the first all-gather */
    int micro;                /* micro-steps accumulated since the last step */
    int64_t nsteps;           /* optimizer steps run on this group (AdamW t) */
} mfsdp_group_state_t;

struct mfsdp_ctx {
    uint64_t magic;
    const mfsdp_manifest_t *manifest;
    mfsdp_plan_t *own_plan;
    const mfsdp_plan_t *plan;
    int rank;
    int world;
    mfsdp_transport_t *tp;
    mfsdp_arena_t *arena;
    mfsdp_arena_slot_t *slots;   /* plan->nshards */
    mfsdp_group_state_t *groups; /* manifest->ngroups */
    /* resolved settings */
    mfsdp_algo_t gather_algo;
    mfsdp_algo_t reduce_algo;
    size_t chunk;
    mfsdp_step_mode_t mode;
    int accum;
    double clip;
    mfsdp_hparams_t hp;
    /* scratch: staging then optimizer workspace */
    char *stage;
    size_t stage_bytes;
    float *ws;
    size_t ws_elems;
    /* counters */
    uint64_t steps;
    uint64_t allgathers;
    uint64_t reduces;
    double step_seconds; /* wall time inside owner optimizer steps */
    double last_norm;
    struct mfsdp_ckpt_ctx *ckpt; /* checkpoints (runtime/checkpoint.c); NULL until used */
};

/* A tensor's region of one arena category on this rank, NULL when it has none (the same
 * view as runtime.c's slot_ptr(), for runtime/checkpoint.c). */
static inline void *mfsdp_ctx_slot(const struct mfsdp_ctx *ctx, size_t shard, mfsdp_arena_cat_t cat)
{
    const mfsdp_arena_slot_t *s = &ctx->slots[shard];
    char *base = mfsdp_arena_base(ctx->arena, cat);
    if (s->elems == 0 || s->off[cat] == MFSDP_ARENA_NONE || base == NULL) {
        return NULL;
    }
    return base + s->off[cat];
}

/* Everything but the transport: plan, schedules, arena. Not collective. */
mfsdp_status_t mfsdp_ctx_init_local(struct mfsdp_ctx *ctx, const mfsdp_manifest_t *manifest,
                                    const mfsdp_ctx_opts_t *opts);
/* Release what mfsdp_ctx_init_local() and the transport hold, and the context itself. */
void mfsdp_ctx_free(struct mfsdp_ctx *ctx);

#endif /* MFSDP_RUNTIME_CTX_H */
