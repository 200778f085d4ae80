/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Internal state of a runtime context, shared by the files of runtime/: ctx.c (set-up,
 * teardown, getters), staging.c (per-call buffers), allgather.c, reduce.c, step.c and the
 * communicator-specific constructors (runtime_mpi.c).
 */
#ifndef MFSDP_RUNTIME_CTX_H
#define MFSDP_RUNTIME_CTX_H

#include "alloc/arena.h"
#include "mfsdp/kernels.h"
#include "core/schedule.h"
#include "mfsdp/runtime.h"
#include "transport/transport.h"

#define MFSDP_CTX_MAGIC 0x6d66736470637478ULL /* "mfsdpctx" */

/* The reduce-scatter of a group over a subset of its params (FSDP2 leaves out params that got
 * no gradient in a backward): its schedule, built the first time the subset is seen. */
typedef struct mfsdp_rs_variant {
    unsigned char *mask;     /* nparams flags */
    mfsdp_group_sched_t *gs; /* same segments as the group's, reduce layout over mask */
    mfsdp_sched_ops_t rs_ops;
} mfsdp_rs_variant_t;

/* Most subsets of one group a context keeps schedules for. */
#define MFSDP_CTX_MAX_VARIANTS 256

struct mfsdp_ckpt_ctx; /* runtime/checkpoint.c: the pending save and its figures */

typedef struct mfsdp_group_state {
    mfsdp_group_sched_t *gs;
    mfsdp_sched_ops_t ag_ops;
    mfsdp_sched_ops_t rs_ops;
    mfsdp_xfer_bufs_t *bufs; /* gs->nsegs (+1) entries, bound per call */
    unsigned char *full;     /* nparams: the requires_grad mask (the full reduce) */
    mfsdp_rs_variant_t *variants;
    size_t nvariants;
    const mfsdp_group_sched_t *last_rs; /* schedule of the group's last reduce */
    int initialized;                    /* weights taken from the first all-gather */
    int micro;                          /* micro-steps accumulated since the last step */
    int64_t nsteps;                     /* optimizer steps run on this group (the schedule's t) */
    size_t rs_chunk;  /* the reduce schedule's chunk argument (4 x elements per chunk; direct
                         and chain: sized to the staging budget) */
    size_t ag_chunk;  /* the gather schedule's chunk (bytes; chain: sized to the budget) */
    size_t tail_pass; /* sharded-tail reduce: elements per rank block per pass */
    mfsdp_algo_t gather_algo; /* resolved for this group (an algorithm table picks per group) */
    mfsdp_algo_t reduce_algo;
    mfsdp_sched_ops_t tail_ops; /* its later passes (one TAIL op) */
    /* direct gather from shared arenas (mfsdp_ctx_share_arenas): gs->nsegs entries, the
     * owner's comm copy of each segment in this process, NULL where it is not mapped; NULL
     * when the group's gathers use messages */
    const char **peer_src;
} mfsdp_group_state_t;

struct mfsdp_ctx {
    uint64_t magic;
    const mfsdp_manifest_t *manifest;
    mfsdp_plan_t *own_plan;
    const mfsdp_plan_t *plan;
    int rank;
    int world;
    mfsdp_transport_t *tp;
    mfsdp_exec_t *exec; /* local work on the arena's memory (cpu | cuda) */
    void *stream;       /* the stream of the intercepted call (mfsdp_ctx_set_stream) */
    /* Set by the constructor before mfsdp_ctx_init_local(): zero = a host arena (mmap);
     * the NCCL constructor brings device memory and registration (alloc/arena.h). */
    mfsdp_arena_kind_t arena_kind;
    mfsdp_arena_mem_t arena_mem;
    mfsdp_arena_t *arena;
    int gather_shared;           /* some group's gathers read node peers' arenas */
    mfsdp_arena_slot_t *slots;   /* plan->nshards */
    mfsdp_group_state_t *groups; /* manifest->ngroups */
    /* resolved settings */
    mfsdp_algo_t gather_algo; /* every group's, or AUTO when the groups' differ */
    mfsdp_algo_t reduce_algo;
    size_t chunk;
    size_t budget; /* staging bytes per rank the direct reduce's chunks are sized to */
    mfsdp_step_mode_t mode;
    int accum;
    double clip;
    mfsdp_hparams_t hp;
    int lr_factor_set; /* 1: lr_factor replaces the manifest's schedule */
    double lr_factor;  /* the job's lr / its initial lr (mfsdp_ctx_set_lr_factor) */
    /* per shard (plan->nshards) */
    unsigned char *seen;   /* a gradient arrived in the current accumulation window */
    int64_t *shard_steps;  /* optimizer steps of this tensor (AdamW's t: torch counts per
                              param, and skips a param without gradient) */
    const void **tail_src; /* world entries: the sharded-tail reduce's sources, per call */
    /* HSDP (manifest "replicate" > 1): a reduce lands in hsdp_in (GRAD's layout); the
     * replicate all-reduce sums it over the replicas into the gradients. */
    int replicate;
    mfsdp_transport_t *rtp; /* over the replicate communicator, once attached */
    char *hsdp_in;
    size_t hsdp_bytes;
    long awaiting; /* group whose replicate all-reduce is due, -1 */
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

/* ---- arena views ---- */

/* A shard's region of one arena category, NULL when it has none (or while sizing). */
static inline void *mfsdp_ctx_slot(const struct mfsdp_ctx *ctx, size_t shard, mfsdp_arena_cat_t cat)
{
    const mfsdp_arena_slot_t *s = &ctx->slots[shard];
    char *base = mfsdp_arena_base(ctx->arena, cat); /* NULL while sizing, before the arena */
    if (s->elems == 0 || s->off[cat] == MFSDP_ARENA_NONE || base == NULL) {
        return NULL;
    }
    return base + s->off[cat];
}

static inline const mfsdp_param_desc_t *mfsdp_ctx_shard_param(const struct mfsdp_ctx *ctx,
                                                              size_t shard)
{
    const mfsdp_shard_t *sh = &ctx->plan->shards[shard];
    return &ctx->manifest->groups[sh->group].params[sh->param];
}

/* Real (non-padding) elements of this rank's slice of a sharded tensor. */
static inline size_t mfsdp_ctx_slice_valid(const struct mfsdp_ctx *ctx,
                                           const mfsdp_param_layout_t *e)
{
    int64_t first = (int64_t)ctx->rank * e->c;
    int64_t rows = e->rows - first;
    rows = rows < 0 ? 0 : (rows > e->c ? e->c : rows);
    return (size_t)rows * (size_t)e->rest;
}

/* Where a reduce accumulates shard's gradient: its GRAD slot, or under HSDP its slot in the
 * per-call buffer that the replicate all-reduce sums over the replicas first. */
static inline float *mfsdp_ctx_grad_target(const struct mfsdp_ctx *ctx, size_t shard)
{
    if (ctx->replicate > 1) {
        const mfsdp_arena_slot_t *s = &ctx->slots[shard];
        if (s->elems == 0 || s->off[MFSDP_ARENA_GRAD] == MFSDP_ARENA_NONE || ctx->hsdp_in == NULL) {
            return NULL;
        }
        return (float *)(ctx->hsdp_in + s->off[MFSDP_ARENA_GRAD]);
    }
    return (float *)mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_GRAD);
}

/* ---- shared between the files of runtime/ ---- */

/* MFSDP_ERR_STATE (logged) unless ctx is a live context. */
mfsdp_status_t mfsdp_ctx_check(const struct mfsdp_ctx *ctx);
/* MFSDP_ERR_INVALID_ARG (logged, naming what) for a group index out of range. */
mfsdp_status_t mfsdp_ctx_group_check(const struct mfsdp_ctx *ctx, size_t group, const char *what);

/* The packed sharded tail of one reduce: send and recv hold world blocks of one pass in the
 * reduce dtype (the contributions sent, those received), sum its fp32 sum. (The all-gather
 * gathers the tail in place and stages none.) */
typedef struct mfsdp_tail_bufs {
    void *send;
    void *recv;
    float *sum;
} mfsdp_tail_bufs_t;

/* Bind the staging buffers of group g's all-gather / reduce (under schedule gs: the group's or
 * one of its subset variants) at base (NULL: only size them into *need_p). */
mfsdp_status_t mfsdp_ctx_bind_gather(struct mfsdp_ctx *ctx, size_t g, char *base, size_t *need_p);
mfsdp_status_t mfsdp_ctx_bind_reduce(struct mfsdp_ctx *ctx, size_t g, const mfsdp_group_sched_t *gs,
                                     char *base, size_t *need_p, mfsdp_tail_bufs_t *tail);

/* FSDP's strided geometry of one param in a buffer layout (pack/unpack). */
void mfsdp_ctx_geom(const mfsdp_buffer_layout_t *b, const mfsdp_param_layout_t *e, int world,
                    mfsdp_strided_geom_t *geom);

/* Steps: one group (timed; job_t: the job's step the schedule follows, -1 for the group's
 * own count), every group with at least min_micro micro-steps (clipping included; one job
 * step for all), and the lazy trigger. */
mfsdp_status_t mfsdp_ctx_step_group(struct mfsdp_ctx *ctx, size_t g, int64_t job_t);
mfsdp_status_t mfsdp_ctx_step_groups(struct mfsdp_ctx *ctx, int min_micro);
int mfsdp_ctx_lazy_ready(const struct mfsdp_ctx *ctx);
/* A reduce of group completed (its replicate all-reduce too, under HSDP): count the micro-step
 * and run an eager step when the window is complete. */
mfsdp_status_t mfsdp_ctx_reduce_done(struct mfsdp_ctx *ctx, size_t group);

/* Compare every rank's settings fingerprint (manifest, MFSDP_* values, and the options given
 * in code, NULL compared as all zero) over tp: one clear error on every rank
 * (MFSDP_ERR_MISMATCH) instead of a hang or a truncation later. A rank whose MFSDP_* values
 * do not parse takes part too, so that every rank fails. Collective over tp. */
mfsdp_status_t mfsdp_ctx_agree(mfsdp_transport_t *tp, const mfsdp_manifest_t *manifest, int world,
                               const mfsdp_ctx_opts_t *opts);
/* The manifest's and the given plan's world size against the communicator's (after the
 * agreement, so that every rank decides alike). */
mfsdp_status_t mfsdp_ctx_check_world(const mfsdp_manifest_t *manifest, const mfsdp_ctx_opts_t *opts,
                                     int world);

/* Everything but the transport: plan, schedules, arena. Not collective. */
mfsdp_status_t mfsdp_ctx_init_local(struct mfsdp_ctx *ctx, const mfsdp_manifest_t *manifest,
                                    const mfsdp_ctx_opts_t *opts);

/* Collective, after mfsdp_ctx_init_local() returned st on this rank: agree on the outcome (a
 * rank-local failure fails every rank, the largest error magnitude wins) and, when every rank
 * succeeded, on what each rank resolved for the wire (per group: algorithms and chunks). A
 * rank that resolved otherwise than its peers (a measured table rewritten between the settings
 * agreement and the set-up) is MFSDP_ERR_MISMATCH on every rank instead of messages that
 * never match. Returns the agreed status. */
mfsdp_status_t mfsdp_ctx_agree_setup(struct mfsdp_ctx *ctx, mfsdp_status_t st);
/* The node peers' arenas are mapped in this process (peer: world entries, NULL where not;
 * from the transport, identical in its on/off state on every rank): every group whose gathers
 * run the direct algorithm reads the owners' comm copies from there (gst->peer_src). Local. */
mfsdp_status_t mfsdp_ctx_share_arenas(struct mfsdp_ctx *ctx, const char *const *peer);
/* Before this rank writes the comm copies of its owned tensors (every writer: the step, the
 * initial or reloaded weights, a checkpoint load): wait until no node peer still copies
 * from them (transport quiesce). Not collective. */
static inline mfsdp_status_t mfsdp_ctx_comm_write(struct mfsdp_ctx *ctx)
{
    if (!ctx->gather_shared || ctx->tp->ops->quiesce == NULL) {
        return MFSDP_OK;
    }
    return ctx->tp->ops->quiesce(ctx->tp);
}
/* Release what mfsdp_ctx_init_local() and the transport hold, and the context itself. */
void mfsdp_ctx_free(struct mfsdp_ctx *ctx);

#endif /* MFSDP_RUNTIME_CTX_H */
