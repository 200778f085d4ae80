/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The runtime: owner-broadcast all-gather, reduce-to-owner and the owner-side step driver
 * on top of a transport (DESIGN.md sections 3-7). Communicator-specific creation lives in
 * runtime_mpi.c; everything here talks to the transport table only.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/checks.h"
#include "core/config.h"
#include "kernels/cpu/gemm.h"
#include "mfsdp/kernels.h"
#include "runtime/checkpoint.h"
#include "runtime/ctx.h"

/* ---------------------------------------------------------------------------------------
 * Context checks
 */

static mfsdp_status_t ctx_check(const struct mfsdp_ctx *ctx)
{
    if (ctx == NULL) {
        MFSDP_WARN("context is null (destroyed or never created)");
        return MFSDP_ERR_STATE;
    }
    if (ctx->magic != MFSDP_CTX_MAGIC) {
        MFSDP_WARN("context %p is not a live mfsdp context (destroyed?)", (const void *)ctx);
        return MFSDP_ERR_STATE;
    }
    return MFSDP_OK;
}

static mfsdp_status_t group_check(const struct mfsdp_ctx *ctx, size_t group, const char *what)
{
    if (group >= ctx->manifest->ngroups) {
        MFSDP_WARN("%s: group index %zu out of range (the manifest has %zu groups)", what,
                   group, ctx->manifest->ngroups);
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Arena views
 */

static void *slot_ptr(const struct mfsdp_ctx *ctx, size_t shard, mfsdp_arena_cat_t cat)
{
    const mfsdp_arena_slot_t *s = &ctx->slots[shard];
    char *base = mfsdp_arena_base(ctx->arena, cat); /* NULL while sizing, before the arena */
    if (s->elems == 0 || s->off[cat] == MFSDP_ARENA_NONE || base == NULL) {
        return NULL;
    }
    return base + s->off[cat];
}

static const mfsdp_param_desc_t *shard_param(const struct mfsdp_ctx *ctx, size_t shard)
{
    const mfsdp_shard_t *sh = &ctx->plan->shards[shard];
    return &ctx->manifest->groups[sh->group].params[sh->param];
}

/* Real (non-padding) elements of this rank's slice of a sharded tensor. */
static size_t slice_valid(const struct mfsdp_ctx *ctx, const mfsdp_param_layout_t *e)
{
    int64_t first = (int64_t)ctx->rank * e->c;
    int64_t rows = e->rows - first;
    rows = rows < 0 ? 0 : (rows > e->c ? e->c : rows);
    return (size_t)rows * (size_t)e->rest;
}

/* ---------------------------------------------------------------------------------------
 * Staging: carved from the arena's scratch region per call. The same function sizes the
 * region at creation (base == NULL) and binds the buffers of one call.
 */

typedef struct carver {
    char *base;
    size_t used;
    int overflow;
} carver_t;

static void *carve(carver_t *c, size_t bytes)
{
    size_t start = (c->used + MFSDP_ARENA_ALIGN - 1) & ~(size_t)(MFSDP_ARENA_ALIGN - 1);
    size_t end;
    if (start < c->used || mfsdp_add_overflow(start, bytes, &end)) {
        c->overflow = 1;
        return NULL;
    }
    c->used = end;
    return c->base != NULL && bytes != 0 ? c->base + start : NULL;
}

static size_t mul_sat(carver_t *c, size_t a, size_t b)
{
    size_t r;
    if (mfsdp_mul_overflow(a, b, &r)) {
        c->overflow = 1;
        return 0;
    }
    return r;
}

typedef struct tail_bufs {
    void *send;
    void *recv;
} tail_bufs_t;

static mfsdp_status_t bind_gather(struct mfsdp_ctx *ctx, size_t g, char *base, size_t *need_p,
                                  tail_bufs_t *tail)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_sched_t *gs = gst->gs;
    carver_t c = {.base = base};
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        mfsdp_xfer_bufs_t *b = &gst->bufs[i];
        memset(b, 0, sizeof(*b));
        if (s->owner == ctx->rank) {
            b->src = slot_ptr(ctx, s->shard, MFSDP_ARENA_COMM);
        } else if (ctx->gather_algo == MFSDP_ALGO_CHAIN) {
            /* A ring of chunks: each is copied out and forwarded from there. */
            b->stage = carve(&c, mfsdp_sched_ring(s->ag_bytes, ctx->chunk));
        } else if (s->ag_bytes > MFSDP_SCHED_MAX_MSG) {
            /* Too large for one in-place receive: staged, then unpacked. */
            b->stage = carve(&c, s->ag_bytes);
        }
    }
    if (gs->tail_ag_bytes != 0) {
        /* Own slices packed (they are not contiguous in the arena); the all-gather lands
         * straight in FSDP's output (tail->recv stays NULL). */
        tail->send = carve(&c, gs->tail_ag_bytes);
        tail->recv = NULL;
    }
    if (c.overflow) {
        return MFSDP_ERR_OVERFLOW;
    }
    *need_p = c.used;
    return MFSDP_OK;
}

static mfsdp_status_t bind_reduce(struct mfsdp_ctx *ctx, size_t g, char *base, size_t *need_p,
                                  tail_bufs_t *tail)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_sched_t *gs = gst->gs;
    size_t elt = mfsdp_dtype_size(gs->layout->rs.dtype);
    size_t n = (size_t)ctx->world;
    carver_t c = {.base = base};
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        mfsdp_xfer_bufs_t *b = &gst->bufs[i];
        memset(b, 0, sizeof(*b));
        if (s->rs_entry < 0) {
            continue;
        }
        int own = s->owner == ctx->rank;
        size_t fbytes = mul_sat(&c, s->numel, sizeof(float));
        if (ctx->reduce_algo == MFSDP_ALGO_DIRECT) {
            /* Sent as one message (or summed from one slot): packed once. Chain and native
             * read the contribution in place from FSDP's buffer. */
            b->src = carve(&c, mul_sat(&c, s->numel, elt));
        }
        if (own) {
            b->grad = slot_ptr(ctx, s->shard, MFSDP_ARENA_GRAD);
        }
        switch (ctx->reduce_algo) {
        case MFSDP_ALGO_DIRECT:
            if (own) {
                b->stage = carve(&c, mul_sat(&c, mul_sat(&c, s->numel, elt), n));
            }
            break;
        case MFSDP_ALGO_CHAIN: {
            /* A chunk is received, has the own contribution added in place and is sent
             * on from the same memory: one fp32 ring serves as PIN and POUT. */
            size_t ring = mul_sat(&c, mfsdp_sched_ring(s->numel, ctx->chunk / sizeof(float)),
                                  sizeof(float));
            b->pin = carve(&c, ring);
            b->pout = b->pin;
            if (own) {
                b->final = carve(&c, ring);
            }
            break;
        }
        default:
            b->pout = carve(&c, fbytes);
            if (own) {
                b->final = carve(&c, fbytes);
            }
            break;
        }
    }
    tail->send = tail->recv = NULL;
    if (gs->tail_rs_elems != 0) {
        /* Packed rank-major fp32 blocks: MPI cannot sum 16-bit floats, and Open MPI 4.1
         * refuses MPI_SUM on a derived datatype that would address FSDP's buffer in place. */
        size_t tb = mul_sat(&c, gs->tail_rs_elems, sizeof(float));
        tail->send = carve(&c, mul_sat(&c, tb, n));
        tail->recv = carve(&c, tb);
    }
    if (c.overflow) {
        return MFSDP_ERR_OVERFLOW;
    }
    *need_p = c.used;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Creation (local part)
 */

static mfsdp_algo_t resolve_algo(mfsdp_algo_t opt, int cfg, int world)
{
    if (opt != MFSDP_ALGO_AUTO) {
        return opt;
    }
    switch (cfg) {
    case MFSDP_CFG_ALGO_DIRECT: return MFSDP_ALGO_DIRECT;
    case MFSDP_CFG_ALGO_CHAIN: return MFSDP_ALGO_CHAIN;
    case MFSDP_CFG_ALGO_NATIVE: return MFSDP_ALGO_NATIVE;
    default: break;
    }
    /* Provisional until the perf harness measures the crossover: the fixed-order direct
     * reduction within a node-sized world, the pipelined chain (the ring's traffic) above. */
    return world <= 8 ? MFSDP_ALGO_DIRECT : MFSDP_ALGO_CHAIN;
}

static void resolve_hparams(const mfsdp_config_t *cfg, mfsdp_hparams_t *hp)
{
    if (cfg->lr_set) hp->lr = cfg->lr;
    if (cfg->momentum_set) hp->momentum = cfg->momentum;
    if (cfg->ns_steps_set) hp->ns_steps = (int)cfg->ns_steps;
    if (cfg->weight_decay_set) hp->weight_decay = cfg->weight_decay;
    if (cfg->nesterov_set) hp->nesterov = cfg->nesterov;
    if (cfg->scale_set) hp->scale = cfg->scale == 1 ? MFSDP_SCALE_MOONLIGHT : MFSDP_SCALE_KELLER;
    if (cfg->adamw_lr_set) hp->adamw_lr = cfg->adamw_lr;
    if (cfg->adamw_weight_decay_set) hp->adamw_weight_decay = cfg->adamw_weight_decay;
}

static mfsdp_status_t build_ops(struct mfsdp_ctx *ctx, mfsdp_group_state_t *gst)
{
    MFSDP_CHECK(mfsdp_sched_build(gst->gs, ctx->rank, MFSDP_SCHED_DIR_GATHER, ctx->gather_algo,
                                  ctx->chunk, &gst->ag_ops));
    MFSDP_CHECK(mfsdp_sched_build(gst->gs, ctx->rank, MFSDP_SCHED_DIR_REDUCE, ctx->reduce_algo,
                                  ctx->chunk, &gst->rs_ops));
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_init_local(struct mfsdp_ctx *ctx, const mfsdp_manifest_t *manifest,
                                    const mfsdp_ctx_opts_t *opts)
{
    static const mfsdp_ctx_opts_t defaults;
    const mfsdp_config_t *cfg;
    if (opts == NULL) {
        opts = &defaults;
    }
    MFSDP_CHECK(mfsdp_config_get(&cfg));
    ctx->manifest = manifest;
    ctx->hp = manifest->hp;
    resolve_hparams(cfg, &ctx->hp);
    ctx->gather_algo = resolve_algo(opts->gather_algo, cfg->gather_algo, ctx->world);
    ctx->reduce_algo = resolve_algo(opts->reduce_algo, cfg->reduce_algo, ctx->world);
    ctx->chunk = opts->chain_chunk != 0 ? opts->chain_chunk : cfg->chain_chunk;
    if (ctx->chunk < sizeof(float)) {
        MFSDP_WARN("chain chunk of %zu bytes is too small (at least %zu)", ctx->chunk,
                   sizeof(float));
        return MFSDP_ERR_INVALID_ARG;
    }
    ctx->accum = opts->accum_steps > 0 ? opts->accum_steps : (int)cfg->accum_steps;
    if (cfg->threads_set) {
        mfsdp_gemm_set_threads((int)cfg->threads); /* MFSDP_THREADS: process-wide BLAS */
    }
    ctx->clip = opts->has_clip ? opts->clip : cfg->clip;
    if (!(ctx->clip >= 0.0) || !isfinite(ctx->clip)) {
        MFSDP_WARN("clipping threshold %g must be finite and >= 0", ctx->clip);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (opts->has_step_mode) {
        ctx->mode = opts->step_mode;
    } else if (cfg->step_set) {
        ctx->mode = cfg->step == MFSDP_CFG_STEP_LAZY ? MFSDP_STEP_LAZY : MFSDP_STEP_EAGER;
    } else {
        ctx->mode = ctx->clip > 0.0 ? MFSDP_STEP_LAZY : MFSDP_STEP_EAGER;
    }
    if (ctx->mode != MFSDP_STEP_EAGER && ctx->mode != MFSDP_STEP_LAZY) {
        return MFSDP_ERR_INVALID_ARG;
    }
    if (ctx->clip > 0.0 && ctx->mode == MFSDP_STEP_EAGER) {
        MFSDP_WARN("gradient clipping (%g) needs the lazy step: the global norm is known only "
                   "when every group's reduce has landed (set MFSDP_STEP=lazy)",
                   ctx->clip);
        return MFSDP_ERR_INVALID_ARG;
    }

    /* The plan: a pure function of (manifest, world, options), identical on every rank. */
    if (opts->plan != NULL) {
        ctx->plan = opts->plan;
    } else {
        mfsdp_plan_opts_t po;
        if (opts->has_plan_opts) {
            po = opts->plan_opts;
        } else {
            memset(&po, 0, sizeof(po));
            po.tail = cfg->tail == MFSDP_CFG_TAIL_OWNER   ? MFSDP_TAIL_OWNER
                      : cfg->tail == MFSDP_CFG_TAIL_SHARD ? MFSDP_TAIL_SHARD
                                                          : MFSDP_TAIL_AUTO;
            po.mem_limit = cfg->mem_limit;
            po.no_spread = !cfg->spread;
        }
        MFSDP_CHECK(mfsdp_plan_create(manifest, ctx->world, &po, &ctx->own_plan));
        ctx->plan = ctx->own_plan;
    }
    if (ctx->plan->world != ctx->world || ctx->plan->manifest != manifest) {
        MFSDP_WARN("the plan is for world size %d and %s manifest; the communicator has %d "
                   "ranks",
                   ctx->plan->world, ctx->plan->manifest == manifest ? "this" : "another",
                   ctx->world);
        return MFSDP_ERR_MISMATCH;
    }

    /* Schedules and op lists per group. */
    size_t ng = manifest->ngroups;
    ctx->groups = calloc(ng, sizeof(*ctx->groups));
    if (ctx->groups == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t g = 0; g < ng; g++) {
        mfsdp_group_state_t *gst = &ctx->groups[g];
        MFSDP_CHECK(mfsdp_group_sched_create(ctx->plan, g, &gst->gs));
        gst->bufs = calloc(gst->gs->nsegs + 1, sizeof(*gst->bufs));
        if (gst->bufs == NULL) {
            return MFSDP_ERR_NO_MEMORY;
        }
        MFSDP_CHECK(build_ops(ctx, gst));
    }

    /* Arena: tensors by category, then staging (largest group call) and the workspace. */
    mfsdp_arena_sizes_t sizes;
    ctx->slots = calloc(ctx->plan->nshards + 1, sizeof(*ctx->slots));
    if (ctx->slots == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    MFSDP_CHECK(mfsdp_arena_layout(ctx->plan, ctx->rank, ctx->slots, &sizes));
    size_t stage = 0;
    for (size_t g = 0; g < ng; g++) {
        size_t need_ag, need_rs;
        tail_bufs_t tb;
        MFSDP_CHECK(bind_gather(ctx, g, NULL, &need_ag, &tb));
        MFSDP_CHECK(bind_reduce(ctx, g, NULL, &need_rs, &tb));
        stage = need_ag > stage ? need_ag : stage;
        stage = need_rs > stage ? need_rs : stage;
    }
    size_t ws = 0;
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        const mfsdp_shard_t *sh = &ctx->plan->shards[i];
        if (sh->owner == ctx->rank && sh->role == MFSDP_ROLE_MUON) {
            size_t w = mfsdp_muon_workspace_elems(sh->rows, sh->cols);
            if (w == 0) {
                MFSDP_WARN("no muon workspace size for a %lld x %lld matrix",
                           (long long)sh->rows, (long long)sh->cols);
                return MFSDP_ERR_OVERFLOW;
            }
            ws = w > ws ? w : ws;
        }
    }
    stage = (stage + MFSDP_ARENA_ALIGN - 1) & ~(size_t)(MFSDP_ARENA_ALIGN - 1);
    size_t scratch;
    if (mfsdp_mul_overflow(ws, sizeof(float), &scratch) ||
        mfsdp_add_overflow(scratch, stage, &scratch)) {
        return MFSDP_ERR_OVERFLOW;
    }
    mfsdp_arena_opts_t ao = {.mlock = cfg->mlock && !opts->no_mlock, .numa_bind = cfg->numa_bind};
    MFSDP_CHECK(mfsdp_arena_create(&sizes, scratch, &ao, &ctx->arena));
    ctx->stage = mfsdp_arena_scratch(ctx->arena);
    ctx->stage_bytes = stage;
    ctx->ws = ws != 0 ? (float *)(ctx->stage + stage) : NULL;
    ctx->ws_elems = ws;
    ctx->last_norm = -1.0;
    mfsdp_arena_report(ctx->arena, ctx->rank);
    MFSDP_INFO(RUNTIME,
               "rank %d/%d: %zu groups, gather %d, reduce %d, chunk %zu, %s step, accum %d, "
               "clip %g, arena peak %zu bytes",
               ctx->rank, ctx->world, ng, (int)ctx->gather_algo, (int)ctx->reduce_algo,
               ctx->chunk, ctx->mode == MFSDP_STEP_LAZY ? "lazy" : "eager", ctx->accum,
               ctx->clip, mfsdp_arena_peak_bytes(ctx->arena));
    return MFSDP_OK;
}

void mfsdp_ctx_free(struct mfsdp_ctx *ctx)
{
    if (ctx == NULL) {
        return;
    }
    mfsdp_ckpt_ctx_release(ctx); /* joins a pending save (collective when one is pending) */
    ctx->magic = 0;
    if (ctx->groups != NULL) {
        for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
            mfsdp_group_state_t *gst = &ctx->groups[g];
            mfsdp_sched_ops_free(&gst->ag_ops);
            mfsdp_sched_ops_free(&gst->rs_ops);
            mfsdp_group_sched_destroy(gst->gs);
            free(gst->bufs);
        }
    }
    free(ctx->groups);
    free(ctx->slots);
    mfsdp_arena_destroy(ctx->arena);
    mfsdp_plan_destroy(ctx->own_plan);
    if (ctx->tp != NULL) {
        ctx->tp->ops->destroy(ctx->tp);
    }
    free(ctx);
}

void mfsdp_ctx_destroy(mfsdp_ctx_h *ctx_p)
{
    if (ctx_p == NULL || *ctx_p == NULL) {
        return;
    }
    if ((*ctx_p)->magic != MFSDP_CTX_MAGIC) {
        MFSDP_WARN("mfsdp_ctx_destroy: %p is not a live context; ignored", (void *)*ctx_p);
        return;
    }
    mfsdp_ctx_free(*ctx_p);
    *ctx_p = NULL;
}

/* ---------------------------------------------------------------------------------------
 * Optimizer step
 */

/* Visit every local gradient of group g: fn(grad, elems, arg). */
typedef mfsdp_status_t (*grad_fn)(float *grad, size_t elems, void *arg);

static mfsdp_status_t for_each_grad(struct mfsdp_ctx *ctx, size_t g, grad_fn fn, void *arg)
{
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        float *grad = s->owner == ctx->rank ? slot_ptr(ctx, s->shard, MFSDP_ARENA_GRAD) : NULL;
        if (grad != NULL) {
            MFSDP_CHECK(fn(grad, s->numel, arg));
        }
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t shard = ctx->plan->group_first[g] + gs->tail[k];
        float *grad = slot_ptr(ctx, shard, MFSDP_ARENA_GRAD);
        if (grad != NULL) {
            MFSDP_CHECK(fn(grad, ctx->slots[shard].elems, arg));
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t sq_fn(float *grad, size_t n, void *arg)
{
    return mfsdp_cpu_sqnorm_accumulate(grad, n, (double *)arg);
}

static mfsdp_status_t scale_fn(float *grad, size_t n, void *arg)
{
    float c = *(const float *)arg;
    for (size_t i = 0; i < n; i++) {
        grad[i] *= c;
    }
    return MFSDP_OK;
}

static mfsdp_status_t zero_fn(float *grad, size_t n, void *arg)
{
    (void)arg;
    memset(grad, 0, n * sizeof(float));
    return MFSDP_OK;
}

static mfsdp_status_t step_group_run(struct mfsdp_ctx *ctx, size_t g)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[g];
    const mfsdp_group_sched_t *gs = gst->gs;
    if (!gst->initialized) {
        MFSDP_WARN("group %s: optimizer step before its first all-gather (no weights yet)",
                   gd->name);
        return MFSDP_ERR_STATE;
    }
    int64_t t = gst->nsteps + 1;
    double lr_scale = gd->lr_scale;
    mfsdp_muon_hp_t mh = {
        .lr = (float)(ctx->hp.lr * lr_scale),
        .momentum = (float)ctx->hp.momentum,
        .weight_decay = (float)(gd->has_weight_decay ? gd->weight_decay : ctx->hp.weight_decay),
        .nesterov = ctx->hp.nesterov,
        .ns_steps = ctx->hp.ns_steps,
        .scale = ctx->hp.scale,
    };
    mfsdp_adamw_hp_t ah = {
        .lr = (float)(ctx->hp.adamw_lr * lr_scale),
        .beta1 = (float)ctx->hp.adamw_beta1,
        .beta2 = (float)ctx->hp.adamw_beta2,
        .eps = (float)ctx->hp.adamw_eps,
        .weight_decay =
            (float)(gd->has_weight_decay ? gd->weight_decay : ctx->hp.adamw_weight_decay),
    };
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->owner != ctx->rank || s->rs_entry < 0) {
            continue; /* not ours, or frozen: torch's optimizers skip params without grad */
        }
        const mfsdp_shard_t *sh = &ctx->plan->shards[s->shard];
        const mfsdp_param_desc_t *p = shard_param(ctx, s->shard);
        float *w = slot_ptr(ctx, s->shard, MFSDP_ARENA_MASTER);
        float *grad = slot_ptr(ctx, s->shard, MFSDP_ARENA_GRAD);
        void *comm = slot_ptr(ctx, s->shard, MFSDP_ARENA_COMM);
        if (sh->role == MFSDP_ROLE_MUON) {
            MFSDP_CHECK(mfsdp_cpu_muon_update(w, slot_ptr(ctx, s->shard, MFSDP_ARENA_MOMENTUM),
                                              grad, comm, p->dtype, sh->rows, sh->cols,
                                              p->nsplit, p->split, &mh, ctx->ws, ctx->ws_elems));
        } else {
            MFSDP_CHECK(mfsdp_cpu_adamw_update(w, slot_ptr(ctx, s->shard, MFSDP_ARENA_ADAM_M),
                                               slot_ptr(ctx, s->shard, MFSDP_ARENA_ADAM_V),
                                               grad, comm, p->dtype, s->numel, t, &ah));
        }
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        size_t shard = ctx->plan->group_first[g] + pi;
        float *grad = slot_ptr(ctx, shard, MFSDP_ARENA_GRAD);
        size_t valid = slice_valid(ctx, &gs->layout->ag.entries[pi]);
        if (grad == NULL || valid == 0) {
            continue;
        }
        /* Only the real rows: padding stays exactly zero, as FSDP keeps it. */
        MFSDP_CHECK(mfsdp_cpu_adamw_update(slot_ptr(ctx, shard, MFSDP_ARENA_MASTER),
                                           slot_ptr(ctx, shard, MFSDP_ARENA_ADAM_M),
                                           slot_ptr(ctx, shard, MFSDP_ARENA_ADAM_V), grad,
                                           slot_ptr(ctx, shard, MFSDP_ARENA_COMM),
                                           gd->params[pi].dtype, valid, t, &ah));
    }
    MFSDP_CHECK(for_each_grad(ctx, g, zero_fn, NULL));
    gst->micro = 0;
    gst->nsteps = t;
    ctx->steps++;
    return MFSDP_OK;
}

/* Step every group selected by min_micro (groups with at least that many accumulated
 * micro-steps). With clipping: one scalar all-reduce of the squared norm over them. The
 * selection depends only on call counts, identical on every rank. */
/* step_group_run() with its wall time added to ctx->step_seconds (mfsdp_ctx_stats_t). */
static mfsdp_status_t step_group(struct mfsdp_ctx *ctx, size_t g)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    mfsdp_status_t st = step_group_run(ctx, g);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    ctx->step_seconds += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return st;
}

static mfsdp_status_t step_groups(struct mfsdp_ctx *ctx, int min_micro)
{
    size_t ng = ctx->manifest->ngroups;
    size_t nsel = 0;
    for (size_t g = 0; g < ng; g++) {
        nsel += ctx->groups[g].micro >= min_micro;
    }
    if (nsel == 0) {
        return MFSDP_OK;
    }
    if (ctx->clip > 0.0) {
        double sq = 0.0;
        for (size_t g = 0; g < ng; g++) {
            if (ctx->groups[g].micro >= min_micro) {
                MFSDP_CHECK(for_each_grad(ctx, g, sq_fn, &sq));
            }
        }
        MFSDP_CHECK(ctx->tp->ops->allreduce_sum(ctx->tp, &sq));
        double norm = sqrt(sq);
        double coef = ctx->clip / (norm + 1e-6);
        ctx->last_norm = norm;
        if (coef < 1.0) {
            float c = (float)coef;
            for (size_t g = 0; g < ng; g++) {
                if (ctx->groups[g].micro >= min_micro) {
                    MFSDP_CHECK(for_each_grad(ctx, g, scale_fn, &c));
                }
            }
        }
    }
    for (size_t g = 0; g < ng; g++) {
        if (ctx->groups[g].micro >= min_micro) {
            MFSDP_CHECK(step_group(ctx, g));
        }
    }
    return MFSDP_OK;
}

/* Lazy trigger: every group that reduces has completed its accumulation window. */
static int lazy_ready(const struct mfsdp_ctx *ctx)
{
    int any = 0;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        const mfsdp_group_state_t *gst = &ctx->groups[g];
        if (gst->gs->layout->rs.nentries == 0) {
            continue;
        }
        if (gst->micro < ctx->accum) {
            return 0;
        }
        any = 1;
    }
    return any;
}

mfsdp_status_t mfsdp_ctx_step(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(ctx_check(ctx));
    return step_groups(ctx, 1);
}

mfsdp_status_t mfsdp_ctx_flush(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(ctx_check(ctx));
    if (ctx->mode != MFSDP_STEP_LAZY) {
        return MFSDP_OK;
    }
    return step_groups(ctx, ctx->accum);
}

/* ---------------------------------------------------------------------------------------
 * All-gather
 */

static void geom_of(const mfsdp_buffer_layout_t *b, const mfsdp_param_layout_t *e, int world,
                    mfsdp_strided_geom_t *geom)
{
    geom->world = world;
    geom->rows = e->rows;
    geom->rows_per_rank = e->c;
    geom->row_bytes = e->row_bytes;
    geom->rank_stride = b->bytes;
    geom->offset = e->o_bytes;
}

/* First all-gather of a group: the weights come from each rank's FSDP shard. Owned tensors
 * are gathered onto their owners (one point-to-point batch), sharded-tail slices are kept. */
static mfsdp_status_t take_initial_weights(struct mfsdp_ctx *ctx, size_t g, const char *send)
{
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag;
    const mfsdp_group_desc_t *gd = &ctx->manifest->groups[g];
    int n = ctx->world;
    size_t cap = gs->nsegs * (size_t)n + 1;
    mfsdp_p2p_t *v = calloc(cap, sizeof(*v));
    if (v == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t nv = 0;
    mfsdp_status_t st = MFSDP_OK;
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        char *comm = slot_ptr(ctx, s->shard, MFSDP_ARENA_COMM);
        for (int r = 0; r < n; r++) {
            mfsdp_piece_t pc;
            mfsdp_layout_piece(ag, n, s->param, r, &pc);
            if (pc.valid == 0) {
                continue;
            }
            const char *mine = send + ag->entries[s->param].o_bytes;
            if (s->owner == ctx->rank && r == ctx->rank) {
                memcpy(comm + pc.full_offset, mine, pc.valid);
            } else if (s->owner == ctx->rank) {
                v[nv++] = (mfsdp_p2p_t){0, r, 2 * (int)i, comm + pc.full_offset, pc.valid};
            } else if (r == ctx->rank) {
                v[nv++] = (mfsdp_p2p_t){1, s->owner, 2 * (int)i, (void *)mine, pc.valid};
            }
        }
    }
    MFSDP_CHECK_GOTO(ctx->tp->ops->p2p(ctx->tp, v, nv), st, out);
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->owner != ctx->rank) {
            continue;
        }
        MFSDP_CHECK_GOTO(mfsdp_cpu_cast(slot_ptr(ctx, s->shard, MFSDP_ARENA_MASTER),
                                        MFSDP_FLOAT32, slot_ptr(ctx, s->shard, MFSDP_ARENA_COMM),
                                        gd->params[s->param].dtype, s->numel),
                         st, out);
    }
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        size_t shard = ctx->plan->group_first[g] + pi;
        const mfsdp_param_layout_t *e = &ag->entries[pi];
        char *comm = slot_ptr(ctx, shard, MFSDP_ARENA_COMM);
        size_t valid = slice_valid(ctx, e);
        memcpy(comm, send + e->o_bytes, valid * e->elt);
        memset(comm + valid * e->elt, 0, e->s_bytes - valid * e->elt);
        MFSDP_CHECK_GOTO(mfsdp_cpu_cast(slot_ptr(ctx, shard, MFSDP_ARENA_MASTER), MFSDP_FLOAT32,
                                        comm, gd->params[pi].dtype, (size_t)e->s),
                         st, out);
    }
out:
    free(v);
    return st;
}

mfsdp_status_t mfsdp_ctx_allgather(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                   void *recvbuf, size_t count, mfsdp_dtype_t dtype)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK(group_check(ctx, group, "allgather"));
    mfsdp_group_state_t *gst = &ctx->groups[group];
    const mfsdp_group_sched_t *gs = gst->gs;
    const mfsdp_buffer_layout_t *ag = &gs->layout->ag;
    const char *gname = ctx->manifest->groups[group].name;
    if (dtype != ag->dtype || count != ag->count) {
        MFSDP_WARN("allgather of group %s: got count %zu of %s, the plan expects %zu of %s",
                   gname, count, mfsdp_dtype_name(dtype), ag->count, mfsdp_dtype_name(ag->dtype));
        return MFSDP_ERR_MISMATCH;
    }
    if (recvbuf == NULL || (!gst->initialized && sendbuf == NULL && ag->bytes != 0)) {
        MFSDP_WARN("allgather of group %s: null buffer", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t total = ag->bytes * (size_t)ctx->world;
    const char *in_place = (const char *)recvbuf + (size_t)ctx->rank * ag->bytes;
    if (sendbuf != NULL && (const char *)sendbuf != in_place &&
        (const char *)sendbuf < (const char *)recvbuf + total &&
        (const char *)recvbuf < (const char *)sendbuf + ag->bytes) {
        MFSDP_WARN("allgather of group %s: send buffer overlaps the receive buffer but is not "
                   "its in-place slot (recv + rank * count)",
                   gname);
        return MFSDP_ERR_INVALID_ARG;
    }

    if (ctx->mode == MFSDP_STEP_LAZY && lazy_ready(ctx)) {
        MFSDP_CHECK(step_groups(ctx, ctx->accum));
    }
    if (!gst->initialized) {
        MFSDP_CHECK(take_initial_weights(ctx, group, sendbuf));
        gst->initialized = 1;
    }

    size_t need;
    tail_bufs_t tb = {0};
    MFSDP_CHECK(bind_gather(ctx, group, ctx->stage, &need, &tb));
    size_t toff = 0;
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        const mfsdp_param_layout_t *e = &ag->entries[pi];
        memcpy((char *)tb.send + toff,
               slot_ptr(ctx, ctx->plan->group_first[group] + pi, MFSDP_ARENA_COMM), e->s_bytes);
        toff += e->s_bytes;
    }
    mfsdp_xfer_t x = {
        .dir = MFSDP_SCHED_DIR_GATHER,
        .gs = gs,
        .ops = &gst->ag_ops,
        .bufs = gst->bufs,
        .ag_out = recvbuf,
        .tail_send = tb.send,
        .tail_recv = tb.recv,
        .tail_count = gs->tail_ag_bytes,
    };
    MFSDP_CHECK(ctx->tp->ops->run(ctx->tp, &x));

    /* Unpack: one strided copy per tensor (padding rows zeroed), or only the padding for
     * tensors received in place, and the tail. */
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        const void *full = s->owner == ctx->rank ? gst->bufs[i].src
                           : ctx->gather_algo == MFSDP_ALGO_CHAIN ? NULL /* copied out */
                                                                 : gst->bufs[i].stage;
        if (full != NULL) {
            mfsdp_strided_geom_t geom;
            geom_of(ag, &ag->entries[s->param], ctx->world, &geom);
            MFSDP_CHECK(mfsdp_cpu_unpack(recvbuf, full, &geom));
            continue;
        }
        for (int r = 0; r < ctx->world; r++) {
            mfsdp_piece_t pc;
            mfsdp_layout_piece(ag, ctx->world, s->param, r, &pc);
            memset((char *)recvbuf + pc.buf_offset + pc.valid, 0, pc.pad);
        }
    }
    for (int r = 0; r < ctx->world && gs->ntail != 0 && tb.recv != NULL; r++) {
        const char *blk = (const char *)tb.recv + (size_t)r * gs->tail_ag_bytes;
        toff = 0;
        for (size_t k = 0; k < gs->ntail; k++) {
            const mfsdp_param_layout_t *e = &ag->entries[gs->tail[k]];
            memcpy((char *)recvbuf + (size_t)r * ag->bytes + e->o_bytes, blk + toff, e->s_bytes);
            toff += e->s_bytes;
        }
    }
    ctx->allgathers++;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Reduce
 */

mfsdp_status_t mfsdp_ctx_reduce(mfsdp_ctx_h ctx, size_t group, const void *sendbuf,
                                void *recvbuf, size_t recvcount, mfsdp_dtype_t dtype,
                                mfsdp_redop_t op, double scalar)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK(group_check(ctx, group, "reduce"));
    mfsdp_group_state_t *gst = &ctx->groups[group];
    const mfsdp_group_sched_t *gs = gst->gs;
    const mfsdp_buffer_layout_t *rs = &gs->layout->rs;
    const char *gname = ctx->manifest->groups[group].name;
    int n = ctx->world;
    if (op != MFSDP_OP_SUM && op != MFSDP_OP_AVG && op != MFSDP_OP_PREMULSUM) {
        MFSDP_WARN("reduce of group %s: unknown reduction op %d", gname, (int)op);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (op == MFSDP_OP_PREMULSUM && !isfinite(scalar)) {
        MFSDP_WARN("reduce of group %s: premulsum scalar %g is not finite", gname, scalar);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (dtype != rs->dtype || recvcount != rs->count) {
        MFSDP_WARN("reduce of group %s: got count %zu of %s, the plan expects %zu of %s", gname,
                   recvcount, mfsdp_dtype_name(dtype), rs->count, mfsdp_dtype_name(rs->dtype));
        return MFSDP_ERR_MISMATCH;
    }
    if (rs->bytes != 0 && (sendbuf == NULL || recvbuf == NULL)) {
        MFSDP_WARN("reduce of group %s: null buffer", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (rs->bytes != 0 && (const char *)recvbuf < (const char *)sendbuf + rs->bytes * (size_t)n &&
        (const char *)sendbuf < (const char *)recvbuf + rs->bytes) {
        MFSDP_WARN("reduce of group %s: the output overlaps the input", gname);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (rs->nentries == 0) {
        ctx->reduces++;
        return MFSDP_OK;
    }

    size_t need;
    tail_bufs_t tb = {0};
    MFSDP_CHECK(bind_reduce(ctx, group, ctx->stage, &need, &tb));
    float sc = op == MFSDP_OP_PREMULSUM ? (float)scalar : 1.0f;

    /* Direct: own contributions (each tensor's full local gradient) packed once. */
    for (size_t i = 0; i < gs->nsegs; i++) {
        const mfsdp_sched_seg_t *s = &gs->segs[i];
        if (s->rs_entry < 0 || gst->bufs[i].src == NULL) {
            continue;
        }
        mfsdp_strided_geom_t geom;
        geom_of(rs, &rs->entries[s->rs_entry], n, &geom);
        MFSDP_CHECK(mfsdp_cpu_pack(gst->bufs[i].src, sendbuf, &geom));
    }
    /* Sharded tail: rank-major fp32 blocks with the premul factor applied. */
    if (tb.send != NULL) {
        float *dst = tb.send;
        for (int r = 0; r < n; r++) {
            for (size_t k = 0; k < gs->ntail; k++) {
                long e = gs->layout->rs_entry[gs->tail[k]];
                if (e < 0) {
                    continue;
                }
                const mfsdp_param_layout_t *pe = &rs->entries[e];
                const char *src = (const char *)sendbuf + (size_t)r * rs->bytes + pe->o_bytes;
                MFSDP_CHECK(mfsdp_xfer_combine(dst, NULL, src, dtype, (size_t)pe->s, op, sc));
                dst += pe->s;
            }
        }
    }
    mfsdp_xfer_t x = {
        .dir = MFSDP_SCHED_DIR_REDUCE,
        .gs = gs,
        .ops = &gst->rs_ops,
        .bufs = gst->bufs,
        .dtype = dtype,
        .op = op,
        .scalar = sc,
        .rs_in = sendbuf,
        .tail_send = tb.send,
        .tail_recv = tb.recv,
        .tail_count = gs->tail_rs_elems,
    };
    MFSDP_CHECK(ctx->tp->ops->run(ctx->tp, &x));

    /* FSDP's output shard: zero for owner-managed bytes, the reduced slice for the tail. */
    for (size_t i = 0; i < gs->nsegs; i++) {
        long e = gs->segs[i].rs_entry;
        if (e >= 0) {
            memset((char *)recvbuf + rs->entries[e].o_bytes, 0, rs->entries[e].s_bytes);
        }
    }
    const float *sum = tb.recv;
    for (size_t k = 0; k < gs->ntail; k++) {
        size_t pi = gs->tail[k];
        long e = gs->layout->rs_entry[pi];
        if (e < 0) {
            continue;
        }
        const mfsdp_param_layout_t *pe = &rs->entries[e];
        size_t shard = ctx->plan->group_first[group] + pi;
        float *grad = slot_ptr(ctx, shard, MFSDP_ARENA_GRAD);
        MFSDP_CHECK(mfsdp_xfer_apply(grad, sum, (size_t)pe->s, op, n));
        /* The value FSDP's native collective would have produced, in the reduce dtype
         * (the send staging is free again and at least world times this size). */
        float *val = tb.send;
        for (size_t j = 0; j < (size_t)pe->s; j++) {
            val[j] = op == MFSDP_OP_AVG ? sum[j] / (float)n : sum[j];
        }
        MFSDP_CHECK(mfsdp_cpu_cast((char *)recvbuf + pe->o_bytes, dtype, val, MFSDP_FLOAT32,
                                   (size_t)pe->s));
        sum += pe->s;
    }
    ctx->reduces++;
    if (gst->micro < ctx->accum) {
        gst->micro++;
    }
    if (ctx->mode == MFSDP_STEP_EAGER && gst->micro >= ctx->accum) {
        MFSDP_CHECK(step_group(ctx, group)); /* eager: no clipping, no collective */
    }
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Getters
 */

mfsdp_status_t mfsdp_ctx_get_param(mfsdp_ctx_h ctx, const char *name, mfsdp_param_view_t *view_p)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(name != NULL && view_p != NULL);
    const mfsdp_manifest_t *m = ctx->manifest;
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            if (strcmp(p->name, name) != 0) {
                continue;
            }
            size_t shard = ctx->plan->group_first[g] + i;
            const mfsdp_shard_t *sh = &ctx->plan->shards[shard];
            const mfsdp_param_layout_t *e = &ctx->groups[g].gs->layout->ag.entries[i];
            mfsdp_param_view_t v;
            memset(&v, 0, sizeof(v));
            v.group = g;
            v.param = i;
            v.role = sh->role;
            v.owner = sh->owner;
            v.initialized = ctx->groups[g].initialized;
            v.dtype = p->dtype;
            v.ndim = p->ndim;
            memcpy(v.shape, p->shape, sizeof(v.shape));
            v.rows = sh->rows;
            v.cols = sh->cols;
            v.numel = p->numel;
            v.local_elems = ctx->slots[shard].elems;
            v.local = v.local_elems != 0;
            if (sh->owner == MFSDP_OWNER_SHARDED) {
                v.local_offset = (size_t)ctx->rank * (size_t)e->c * (size_t)e->rest;
                v.local_valid = slice_valid(ctx, e);
            } else {
                v.local_valid = v.local_elems;
            }
            if (v.local) {
                v.master = slot_ptr(ctx, shard, MFSDP_ARENA_MASTER);
                v.grad = slot_ptr(ctx, shard, MFSDP_ARENA_GRAD);
                v.comm = slot_ptr(ctx, shard, MFSDP_ARENA_COMM);
            }
            *view_p = v;
            return MFSDP_OK;
        }
    }
    MFSDP_WARN("no parameter named '%s' in the manifest", name);
    return MFSDP_ERR_NOT_FOUND;
}

mfsdp_status_t mfsdp_ctx_get_stats(mfsdp_ctx_h ctx, mfsdp_ctx_stats_t *stats_p)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(stats_p != NULL);
    mfsdp_ctx_stats_t s;
    memset(&s, 0, sizeof(s));
    mfsdp_arena_sizes_t sizes;
    mfsdp_arena_sizes(ctx->arena, &sizes);
    s.rank = ctx->rank;
    s.world = ctx->world;
    memcpy(s.arena_bytes, sizes.cat, sizeof(s.arena_bytes));
    s.staging_bytes = mfsdp_arena_scratch_bytes(ctx->arena);
    s.peak_bytes = mfsdp_arena_peak_bytes(ctx->arena);
    s.mlocked = mfsdp_arena_locked(ctx->arena);
    s.numa_node = mfsdp_arena_numa_node(ctx->arena);
    s.steps = ctx->steps;
    s.step_seconds = ctx->step_seconds;
    s.allgathers = ctx->allgathers;
    s.reduces = ctx->reduces;
    s.last_grad_norm = ctx->last_norm;
    s.gather_algo = ctx->gather_algo;
    s.reduce_algo = ctx->reduce_algo;
    s.step_mode = ctx->mode;
    s.accum_steps = ctx->accum;
    *stats_p = s;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_get_plan(mfsdp_ctx_h ctx, const mfsdp_plan_t **plan_p)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(plan_p != NULL);
    *plan_p = ctx->plan;
    return MFSDP_OK;
}
