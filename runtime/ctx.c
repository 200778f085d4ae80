/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Context set-up (plan, schedules, arena), teardown, checks and getters.
 * Communicator-specific creation lives in runtime_mpi.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/algo_table.h"
#include "core/checks.h"
#include "core/config.h"
#include "core/settings.h"
#include "kernels/cpu/gemm.h"
#include "mfsdp/kernels.h"
#include "runtime/checkpoint.h"
#include "runtime/ctx.h"

/* ---------------------------------------------------------------------------------------
 * Context checks
 */

mfsdp_status_t mfsdp_ctx_check(const struct mfsdp_ctx *ctx)
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

mfsdp_status_t mfsdp_ctx_group_check(const struct mfsdp_ctx *ctx, size_t group, const char *what)
{
    if (group >= ctx->manifest->ngroups) {
        MFSDP_WARN("%s: group index %zu out of range (the manifest has %zu groups)", what, group,
                   ctx->manifest->ngroups);
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Creation (local part)
 */

/* The algorithm of one group and direction: the option given in code, else MFSDP_*_ALGO, else
 * the first matching row of the measured table (MFSDP_ALGO_TABLE), else the built-in rule.
 * Every input is agreed across ranks (the table by its rows), so every rank resolves alike. */
static mfsdp_algo_t resolve_algo(mfsdp_algo_t opt, int cfg, const mfsdp_algo_table_t *table,
                                 int reduce, int world, size_t bytes)
{
    if (opt != MFSDP_ALGO_AUTO) {
        return opt;
    }
    switch (cfg) {
    case MFSDP_CFG_ALGO_DIRECT:
        return MFSDP_ALGO_DIRECT;
    case MFSDP_CFG_ALGO_CHAIN:
        return MFSDP_ALGO_CHAIN;
    case MFSDP_CFG_ALGO_NATIVE:
        return MFSDP_ALGO_NATIVE;
    default:
        break;
    }
    mfsdp_algo_t a;
    if (mfsdp_algo_table_pick(table, reduce, world, bytes, &a)) {
        return a;
    }
    /* Measured at 2 and 4 ranks (docs/PERFORMANCE.md): direct is the fastest reduce at every
     * size, 4-8x native; for the all-gather direct and native are within each other's run-to-run
     * spread, chain behind. Above a node-sized world the owner's n-1 sends of a whole tensor
     * serialize on one link, which the pipelined chain spreads (a model argument: not measured). */
    return world <= 8 ? MFSDP_ALGO_DIRECT : MFSDP_ALGO_CHAIN;
}

/* Resolve every group's algorithms (gst->gather_algo, gst->reduce_algo) and the context's
 * summary of them (AUTO when groups differ). */
static mfsdp_status_t resolve_algos(struct mfsdp_ctx *ctx, const mfsdp_ctx_opts_t *opts,
                                    const mfsdp_config_t *cfg)
{
    mfsdp_algo_table_t table = {0};
    /* Loaded (and so checked) whenever it is named, even when the code fixes both algorithms:
     * a broken table must not pass unnoticed because this context did not need it. */
    if (cfg->algo_table != NULL && cfg->algo_table[0] != '\0') {
        char err[512];
        mfsdp_status_t st = mfsdp_algo_table_load(cfg->algo_table, &table, err, sizeof(err));
        if (st != MFSDP_OK) {
            MFSDP_WARN("MFSDP_ALGO_TABLE: %s", err);
            return st == MFSDP_ERR_NO_MEMORY ? st : MFSDP_ERR_CONFIG;
        }
    }
    size_t n = (size_t)ctx->world;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        mfsdp_group_state_t *gst = &ctx->groups[g];
        const mfsdp_group_layout_t *l = gst->gs->layout;
        size_t agb = l->ag.bytes * n, rsb = l->rs.bytes * n; /* the whole buffers */
        gst->gather_algo =
            resolve_algo(opts->gather_algo, cfg->gather_algo, &table, 0, ctx->world, agb);
        gst->reduce_algo =
            resolve_algo(opts->reduce_algo, cfg->reduce_algo, &table, 1, ctx->world, rsb);
        ctx->gather_algo =
            g == 0 || gst->gather_algo == ctx->gather_algo ? gst->gather_algo : MFSDP_ALGO_AUTO;
        ctx->reduce_algo =
            g == 0 || gst->reduce_algo == ctx->reduce_algo ? gst->reduce_algo : MFSDP_ALGO_AUTO;
        MFSDP_INFO(RUNTIME, "group %s: all-gather of %zu bytes: %s; reduce of %zu bytes: %s%s",
                   ctx->manifest->groups[g].name, agb, mfsdp_algo_name(gst->gather_algo), rsb,
                   mfsdp_algo_name(gst->reduce_algo),
                   table.nrows != 0 ? " (MFSDP_ALGO_TABLE consulted)" : "");
    }
    if (ctx->manifest->ngroups == 0) {
        ctx->gather_algo =
            resolve_algo(opts->gather_algo, cfg->gather_algo, NULL, 0, ctx->world, 0);
        ctx->reduce_algo =
            resolve_algo(opts->reduce_algo, cfg->reduce_algo, NULL, 1, ctx->world, 0);
    }
    mfsdp_algo_table_free(&table);
    return MFSDP_OK;
}

/* The reduce's staging plan of group g, the same on every rank: the sharded-tail reduce's
 * blocks (2 world blocks of tail_pass elements in the reduce dtype, tail_pass floats) and
 * the pipeline chunk (in the schedule's unit, 4 bytes per element) such that every ring a
 * rank may hold fits the staging budget with them:
 *  - direct: the most owned tensors with a gradient any rank has in the group, each with a
 *    ring of MFSDP_SCHED_WINDOW slots of one chunk per rank (in the reduce dtype);
 *  - chain: one fp32 ring of MFSDP_SCHED_WINDOW chunks per tensor with a gradient, and one
 *    more per owned one, the chunk at most MFSDP_CHAIN_CHUNK;
 *  - native: the same rings (partial sums, and the owner's sums), the chunk at most one
 *    message (MFSDP_SCHED_MAX_MSG): a collective per chunk costs more than a message.
 * The tail goes in one pass when it fits beside one-element chunks, else in passes that take
 * half of the room left beside them. A budget without room for both is refused. */
static mfsdp_status_t reduce_plan(struct mfsdp_ctx *ctx, size_t g, size_t *chunk_p,
                                  size_t *tail_pass_p)
{
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    const mfsdp_algo_t algo = ctx->groups[g].reduce_algo;
    const char *gname = ctx->manifest->groups[g].name;
    size_t n = (size_t)ctx->world;
    /* most owned tensors with a gradient on a rank; all of them (at one rank too: the
     * staging binds the rings whatever the world size) */
    size_t kmax = 0, ngrad = 0;
    size_t *owned = calloc(n, sizeof(*owned));
    if (owned == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < gs->nsegs; i++) {
        if (gs->segs[i].rs_entry >= 0) {
            size_t k = ++owned[gs->segs[i].owner];
            kmax = k > kmax ? k : kmax;
            ngrad++;
        }
    }
    free(owned);
    size_t elt = mfsdp_dtype_size(gs->layout->rs.dtype);
    size_t per = 0, rings = 0, cap = MFSDP_SCHED_MAX_MSG / sizeof(float);
    if (algo == MFSDP_ALGO_DIRECT) {
        rings = kmax;
        per = kmax * MFSDP_SCHED_WINDOW * n * elt; /* ring bytes per chunk element */
    } else {
        rings = ngrad + kmax;
        per = rings * MFSDP_SCHED_WINDOW * sizeof(float);
        cap = algo == MFSDP_ALGO_CHAIN ? ctx->chunk / sizeof(float) : cap;
    }
    size_t slack = (rings + 4) * MFSDP_ARENA_ALIGN; /* the rings' and the tail's 3 carves */
    /* Tail bytes per element of a pass: the blocks sent and received, and the fp32 sum
     * (mfsdp_ctx_bind_reduce). */
    size_t tail_per = 2 * n * elt + sizeof(float);
    size_t T = gs->tail_rs_elems;
    size_t room = ctx->budget > slack + per ? ctx->budget - slack - per : 0;
    size_t pass = T;
    if (T != 0 && T > room / tail_per) {
        pass = room / 2 / tail_per; /* passes get half the room, the rings the rest */
        pass = pass != 0 ? pass : room / tail_per;
        pass = pass < T ? pass : T;
    }
    /* A pass's block is one message per peer: at most MFSDP_SCHED_MAX_MSG bytes. */
    pass = pass < MFSDP_SCHED_MAX_MSG / elt ? pass : MFSDP_SCHED_MAX_MSG / elt;
    size_t fixed = pass * tail_per + slack;
    size_t ce = per == 0 ? 1 : ctx->budget > fixed ? (ctx->budget - fixed) / per : 0;
    ce = ce < cap ? ce : cap;
    if ((T != 0 && pass == 0) || ce == 0) {
        MFSDP_WARN("MFSDP_STAGING_BYTES=%zu is too small for the %s reduce of group %s: one "
                   "sharded-tail element per pass needs %zu bytes, a one-element chunk %zu more "
                   "(%zu rings of %d slots, %zu bytes per element), alignment %zu",
                   ctx->budget, mfsdp_algo_name(algo), gname, T != 0 ? tail_per : 0, per, rings,
                   MFSDP_SCHED_WINDOW, rings != 0 ? per / rings / MFSDP_SCHED_WINDOW : 0, slack);
        return MFSDP_ERR_CONFIG;
    }
    *chunk_p = per == 0 ? ctx->chunk : ce * sizeof(float);
    *tail_pass_p = pass;
    MFSDP_INFO(RUNTIME,
               "group %s: staging budget %zu: %s reduce in chunks of %zu elements (%zu rings), "
               "sharded tail of %zu elements per rank in passes of %zu",
               gname, ctx->budget, mfsdp_algo_name(algo), per == 0 ? (size_t)0 : ce, rings, T,
               pass);
    return MFSDP_OK;
}

/* The chain all-gather's chunk (bytes) for group g, the same on every rank: a ring of
 * MFSDP_SCHED_WINDOW chunks per tensor a rank receives (at most every owned tensor of the
 * group) fits the budget; at most MFSDP_CHAIN_CHUNK. Direct and native gathers receive in
 * place and stage nothing (nor does the sharded tail: gathered in place). */
static mfsdp_status_t gather_plan(struct mfsdp_ctx *ctx, size_t g, size_t *chunk_p)
{
    const mfsdp_group_sched_t *gs = ctx->groups[g].gs;
    *chunk_p = ctx->chunk;
    if (ctx->groups[g].gather_algo != MFSDP_ALGO_CHAIN || ctx->world == 1 || gs->nsegs == 0) {
        return MFSDP_OK;
    }
    size_t fixed = (gs->nsegs + 2) * MFSDP_ARENA_ALIGN;
    size_t per = gs->nsegs * MFSDP_SCHED_WINDOW; /* ring bytes per chunk byte */
    size_t c = ctx->budget > fixed ? (ctx->budget - fixed) / per : 0;
    if (c < sizeof(float)) {
        MFSDP_WARN("MFSDP_STAGING_BYTES=%zu is too small for the chain all-gather of group %s: "
                   "%zu tensors x %d slots of a %zu-byte chunk need %zu",
                   ctx->budget, ctx->manifest->groups[g].name, gs->nsegs, MFSDP_SCHED_WINDOW,
                   sizeof(float), fixed + per * sizeof(float));
        return MFSDP_ERR_CONFIG;
    }
    *chunk_p = c < ctx->chunk ? c : ctx->chunk;
    return MFSDP_OK;
}

static mfsdp_status_t build_ops(struct mfsdp_ctx *ctx, size_t g)
{
    mfsdp_group_state_t *gst = &ctx->groups[g];
    MFSDP_CHECK(reduce_plan(ctx, g, &gst->rs_chunk, &gst->tail_pass));
    MFSDP_CHECK(gather_plan(ctx, g, &gst->ag_chunk));
    MFSDP_CHECK(mfsdp_sched_build_tail(&gst->tail_ops));
    MFSDP_CHECK(mfsdp_sched_build(gst->gs, ctx->rank, MFSDP_SCHED_DIR_GATHER, gst->gather_algo,
                                  gst->ag_chunk, &gst->ag_ops));
    MFSDP_CHECK(mfsdp_sched_build(gst->gs, ctx->rank, MFSDP_SCHED_DIR_REDUCE, gst->reduce_algo,
                                  gst->rs_chunk, &gst->rs_ops));
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
    mfsdp_settings_t set;
    char serr[512];
    if (mfsdp_settings_resolve(manifest, cfg, &set, serr, sizeof(serr)) != MFSDP_OK) {
        MFSDP_WARN("%s", serr);
        return MFSDP_ERR_CONFIG;
    }
    ctx->manifest = manifest;
    ctx->hp = set.hp;
    ctx->chunk = opts->chain_chunk != 0 ? opts->chain_chunk : cfg->chain_chunk;
    if (ctx->chunk < sizeof(float)) {
        MFSDP_WARN("chain chunk of %zu bytes is too small (at least %zu)", ctx->chunk,
                   sizeof(float));
        return MFSDP_ERR_INVALID_ARG;
    }
    ctx->budget = opts->staging_bytes != 0 ? opts->staging_bytes : cfg->staging_bytes;
    ctx->accum = opts->accum_steps > 0 ? opts->accum_steps : set.micro_steps;
    if (cfg->threads_set) {
        mfsdp_gemm_set_threads((int)cfg->threads); /* MFSDP_THREADS: process-wide BLAS */
    }
    ctx->clip = opts->has_clip ? opts->clip : set.clip;
    if (!(ctx->clip >= 0.0) || !isfinite(ctx->clip)) {
        MFSDP_WARN("clipping threshold %g must be finite and >= 0", ctx->clip);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (opts->has_step_mode) {
        ctx->mode = opts->step_mode;
    } else if (set.has_step) {
        ctx->mode = set.step;
    } else {
        ctx->mode = ctx->clip > 0.0 ? MFSDP_STEP_LAZY : MFSDP_STEP_EAGER;
    }
    if (ctx->mode != MFSDP_STEP_EAGER && ctx->mode != MFSDP_STEP_LAZY &&
        ctx->mode != MFSDP_STEP_MANUAL) {
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
            po.tail = set.tail;
            po.mem_limit = set.mem_limit;
            po.no_spread = !set.spread;
        }
        MFSDP_CHECK(mfsdp_plan_create(manifest, ctx->world, &po, &ctx->own_plan));
        ctx->plan = ctx->own_plan;
    }
    if (ctx->clip > 0.0 && ctx->plan->tail == MFSDP_TAIL_JOB) {
        MFSDP_WARN("gradient clipping (%g) with tail policy \"job\": the global norm needs the "
                   "tail's gradients, which only the job holds (clip in the job with the PyTorch "
                   "companion, or use tail owner/shard)",
                   ctx->clip);
        return MFSDP_ERR_UNSUPPORTED;
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
        const mfsdp_group_desc_t *gd = &manifest->groups[g];
        MFSDP_CHECK(mfsdp_group_sched_create(ctx->plan, g, &gst->gs));
        gst->bufs = calloc(gst->gs->nsegs + 1, sizeof(*gst->bufs));
        gst->full = calloc(gd->nparams + 1, 1);
        if (gst->bufs == NULL || gst->full == NULL) {
            return MFSDP_ERR_NO_MEMORY;
        }
        for (size_t i = 0; i < gd->nparams; i++) {
            gst->full[i] = gd->params[i].requires_grad ? 1 : 0;
        }
    }
    MFSDP_CHECK(resolve_algos(ctx, opts, cfg));
    for (size_t g = 0; g < ng; g++) {
        MFSDP_CHECK(build_ops(ctx, g));
    }
    ctx->awaiting = -1;
    ctx->replicate = manifest->replicate > 1 ? manifest->replicate : 1;
    ctx->seen = calloc(ctx->plan->nshards + 1, 1);
    ctx->shard_steps = calloc(ctx->plan->nshards + 1, sizeof(*ctx->shard_steps));
    ctx->tail_src = calloc((size_t)ctx->world, sizeof(*ctx->tail_src));
    if (ctx->seen == NULL || ctx->shard_steps == NULL || ctx->tail_src == NULL) {
        return MFSDP_ERR_NO_MEMORY;
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
        mfsdp_tail_bufs_t tb;
        MFSDP_CHECK(mfsdp_ctx_bind_gather(ctx, g, NULL, &need_ag));
        MFSDP_CHECK(mfsdp_ctx_bind_reduce(ctx, g, ctx->groups[g].gs, NULL, &need_rs, &tb));
        stage = need_ag > stage ? need_ag : stage;
        stage = need_rs > stage ? need_rs : stage;
        /* Every plan above is sized to the budget. */
        if (need_ag > ctx->budget || need_rs > ctx->budget) {
            MFSDP_WARN("group %s stages %zu bytes per rank (all-gather %zu, reduce %zu), above "
                       "MFSDP_STAGING_BYTES=%zu (a bug: the plans are sized to it)",
                       manifest->groups[g].name, need_ag > need_rs ? need_ag : need_rs, need_ag,
                       need_rs, ctx->budget);
            return MFSDP_ERR_INTERNAL;
        }
    }
    size_t ws = 0;
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        const mfsdp_shard_t *sh = &ctx->plan->shards[i];
        if (sh->owner == ctx->rank && sh->role == MFSDP_ROLE_MUON) {
            size_t w = ctx->exec->ops->muon_workspace(ctx->exec, sh->rows, sh->cols);
            if (w == 0) {
                MFSDP_WARN("no muon workspace size for a %lld x %lld matrix", (long long)sh->rows,
                           (long long)sh->cols);
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
    mfsdp_arena_opts_t ao = {.mlock = cfg->mlock && !opts->no_mlock,
                             .numa_bind = cfg->numa_bind,
                             .kind = ctx->arena_kind,
                             .mem = ctx->arena_mem};
    MFSDP_CHECK(mfsdp_arena_create(&sizes, scratch, &ao, &ctx->arena));
    if (ctx->replicate > 1) {
        /* One reduce's gradients, in GRAD's layout, until the replicate all-reduce (in the
         * executor's memory: the replicate transport and the executor work on it). */
        ctx->hsdp_bytes = sizes.cat[MFSDP_ARENA_GRAD];
        void *p = NULL;
        MFSDP_CHECK(ctx->exec->ops->mem_alloc(ctx->exec, ctx->hsdp_bytes + 1, &p));
        ctx->hsdp_in = p;
    }
    ctx->stage = mfsdp_arena_scratch(ctx->arena);
    ctx->stage_bytes = stage;
    ctx->ws = ws != 0 ? (float *)(ctx->stage + stage) : NULL;
    ctx->ws_elems = ws;
    ctx->last_norm = -1.0;
    mfsdp_arena_report(ctx->arena, ctx->rank);
    MFSDP_INFO(RUNTIME,
               "rank %d/%d: %zu groups, gather %d, reduce %d, chunk %zu, %s step, accum %d, "
               "clip %g, arena peak %zu bytes",
               ctx->rank, ctx->world, ng, (int)ctx->gather_algo, (int)ctx->reduce_algo, ctx->chunk,
               ctx->mode == MFSDP_STEP_LAZY    ? "lazy"
               : ctx->mode == MFSDP_STEP_EAGER ? "eager"
                                               : "manual",
               ctx->accum, ctx->clip, mfsdp_arena_peak_bytes(ctx->arena));
    return MFSDP_OK;
}

static int agree_u64(void *arg, uint64_t *buf, size_t n, int is_max)
{
    mfsdp_transport_t *t = arg;
    return t->ops->allreduce_u64(t, buf, n, is_max) != MFSDP_OK;
}

static int agree_gather(void *arg, const void *mine, size_t bytes, void *all)
{
    mfsdp_transport_t *t = arg;
    return t->ops->allgather_bytes(t, mine, bytes, all) != MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_check_world(const mfsdp_manifest_t *manifest, const mfsdp_ctx_opts_t *opts,
                                     int world)
{
    if (manifest->world_size != 0 && manifest->world_size != world) {
        MFSDP_WARN("the manifest is for world size %d but the communicator has %d ranks",
                   manifest->world_size, world);
        return MFSDP_ERR_MISMATCH;
    }
    if (opts != NULL && opts->plan != NULL && opts->plan->world != world) {
        MFSDP_WARN("the plan is for world size %d but the communicator has %d ranks",
                   opts->plan->world, world);
        return MFSDP_ERR_MISMATCH;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_agree(mfsdp_transport_t *tp, const mfsdp_manifest_t *manifest, int world,
                               const mfsdp_ctx_opts_t *opts)
{
    /* A rank whose MFSDP_* values do not parse still takes part (cfg NULL: its fingerprint
     * says so), so that every rank fails together instead of the others waiting for it. */
    const mfsdp_config_t *cfg = NULL;
    mfsdp_status_t cst = mfsdp_config_get(&cfg);
    if (cst != MFSDP_OK) {
        cfg = NULL;
    }
    mfsdp_fp_item_t items[MFSDP_FP_MAX];
    size_t n = mfsdp_settings_fingerprint(manifest, world, cfg, items);
    /* The options given in code that shape the wire or the step (the MFSDP_* variables they
     * override are in the fingerprint already): a rank with another staging budget would cut
     * other chunks, another algorithm post other messages. NULL is compared as all zero. */
    static const mfsdp_ctx_opts_t no_opts;
    if (opts == NULL) {
        opts = &no_opts;
    }
    if (n >= MFSDP_FP_MAX) {
        MFSDP_WARN("internal: settings fingerprint full (%zu entries)", n);
        return MFSDP_ERR_INTERNAL;
    }
    char v[192];
    snprintf(v, sizeof(v),
             "gather %d reduce %d chunk %zu staging %zu accum %d step %d:%d clip %d:%.17g "
             "plan %d:%d:%d:%zu:%d",
             (int)opts->gather_algo, (int)opts->reduce_algo, opts->chain_chunk, opts->staging_bytes,
             opts->accum_steps, opts->has_step_mode, (int)opts->step_mode, opts->has_clip,
             opts->clip, opts->plan != NULL, opts->has_plan_opts, (int)opts->plan_opts.tail,
             opts->plan_opts.mem_limit, opts->plan_opts.no_spread);
    mfsdp_fp_item_set(&items[n++], "the context options (mfsdp_ctx_opts_t)", v);
    mfsdp_agree_ops_t ops = {agree_u64, agree_gather, tp, tp->rank, tp->world};
    char err[1024];
    mfsdp_status_t st = mfsdp_settings_agree(items, n, &ops, err, sizeof(err));
    if (st != MFSDP_OK) {
        MFSDP_WARN("%s", err);
        return st;
    }
    return cst; /* every rank's configuration is bad alike, or none is */
}

/* What this rank resolved for the wire for group g: its algorithms and the chunks its
 * schedules were cut with (pure functions of agreed inputs, unless a table changed under the
 * job). */
static uint64_t group_wire_hash(const struct mfsdp_ctx *ctx, size_t g)
{
    const mfsdp_group_state_t *gst = &ctx->groups[g];
    const uint64_t v[4] = {(uint64_t)gst->gather_algo, (uint64_t)gst->reduce_algo,
                           (uint64_t)gst->ag_chunk, (uint64_t)gst->rs_chunk};
    return mfsdp_hash_bytes(MFSDP_HASH_INIT, v, sizeof(v));
}

static uint64_t wire_hash(const struct mfsdp_ctx *ctx)
{
    uint64_t h = MFSDP_HASH_INIT;
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        uint64_t v = group_wire_hash(ctx, g);
        h = mfsdp_hash_bytes(h, &v, sizeof(v));
    }
    return h;
}

/* The ranks resolved different wire set-ups (every rank is here): name the first group that
 * differs and what each rank resolved for it, in one message identical on every rank. */
static mfsdp_status_t wire_mismatch(struct mfsdp_ctx *ctx)
{
    size_t ng = ctx->manifest->ngroups;
    size_t g = ng;
    /* In batches on the stack: every rank makes the same calls (ng is agreed), none can fail
     * alone for want of memory. */
    for (size_t b = 0; b < ng && g == ng; b += 64) {
        uint64_t lo[64], hi[64];
        size_t k = ng - b < 64 ? ng - b : 64;
        for (size_t j = 0; j < k; j++) {
            lo[j] = hi[j] = group_wire_hash(ctx, b + j);
        }
        if (ctx->tp->ops->allreduce_u64(ctx->tp, lo, k, 0) != MFSDP_OK ||
            ctx->tp->ops->allreduce_u64(ctx->tp, hi, k, 1) != MFSDP_OK) {
            break; /* the message names no group */
        }
        for (size_t j = 0; j < k && g == ng; j++) {
            g = lo[j] != hi[j] ? b + j : ng;
        }
    }
    char err[1024] = "";
    if (g < ng) {
        const mfsdp_group_state_t *gst = &ctx->groups[g];
        char v[96];
        snprintf(v, sizeof(v), "ag %s %zu, rs %s %zu", mfsdp_algo_name(gst->gather_algo),
                 gst->ag_chunk, mfsdp_algo_name(gst->reduce_algo), gst->rs_chunk);
        mfsdp_fp_item_t it;
        mfsdp_fp_item_set(&it, "the algorithms and chunks (all-gather, reduce) resolved", v);
        mfsdp_agree_ops_t ops = {agree_u64, agree_gather, ctx->tp, ctx->tp->rank, ctx->tp->world};
        (void)mfsdp_settings_agree(&it, 1, &ops, err, sizeof(err));
        char *hint = strstr(err, MFSDP_AGREE_HINT); /* the settings did agree: not that hint */
        if (hint != NULL) {
            *hint = '\0';
        }
    }
    MFSDP_WARN("context creation: the ranks resolved different collective algorithms or chunks "
               "for the same groups, although their settings agreed%s%s%s%s; was "
               "MFSDP_ALGO_TABLE rewritten while the job started? (MFSDP_DEBUG=INFO "
               "MFSDP_DEBUG_SUBSYS=RUNTIME logs each group's choice)",
               g < ng ? ": group " : "", g < ng ? ctx->manifest->groups[g].name : "",
               g < ng ? ": " : "", err);
    return MFSDP_ERR_MISMATCH;
}

mfsdp_status_t mfsdp_ctx_agree_setup(struct mfsdp_ctx *ctx, mfsdp_status_t st)
{
    /* hi: the largest error magnitude, then the largest hash; lo: the smallest hash. */
    uint64_t hi[2] = {st == MFSDP_OK ? 0 : (uint64_t)(-(int64_t)st), 0};
    if (st == MFSDP_OK) {
        hi[1] = wire_hash(ctx);
    }
    uint64_t lo = hi[1];
    if (ctx->tp->ops->allreduce_u64(ctx->tp, hi, 2, 1) != MFSDP_OK ||
        ctx->tp->ops->allreduce_u64(ctx->tp, &lo, 1, 0) != MFSDP_OK) {
        MFSDP_WARN("context creation: agreeing on the set-up with the other ranks failed");
        return st != MFSDP_OK ? st : MFSDP_ERR_TRANSPORT;
    }
    if (hi[0] != 0) {
        if (st == MFSDP_OK) {
            st = (mfsdp_status_t)(-(int64_t)hi[0]);
            MFSDP_WARN("context creation failed on another rank (%s)", mfsdp_status_string(st));
        }
        return st;
    }
    return lo != hi[1] ? wire_mismatch(ctx) : MFSDP_OK;
}

void mfsdp_ctx_free(struct mfsdp_ctx *ctx)
{
    if (ctx == NULL) {
        return;
    }
    mfsdp_ckpt_ctx_release(ctx); /* joins a pending save (collective when one is pending) */
    if (ctx->exec != NULL && ctx->exec->ops->sync != NULL) {
        /* Work still queued on the device (a flush's steps) may use what is freed below. */
        (void)ctx->exec->ops->sync(ctx->exec);
    }
    ctx->magic = 0;
    if (ctx->groups != NULL) {
        for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
            mfsdp_group_state_t *gst = &ctx->groups[g];
            mfsdp_sched_ops_free(&gst->ag_ops);
            mfsdp_sched_ops_free(&gst->rs_ops);
            mfsdp_sched_ops_free(&gst->tail_ops);
            mfsdp_group_sched_destroy(gst->gs);
            free(gst->bufs);
            for (size_t v = 0; v < gst->nvariants; v++) {
                mfsdp_sched_ops_free(&gst->variants[v].rs_ops);
                mfsdp_group_sched_destroy(gst->variants[v].gs);
                free(gst->variants[v].mask);
            }
            free(gst->variants);
            free(gst->full);
            free(gst->peer_src);
        }
    }
    free(ctx->groups);
    free(ctx->seen);
    free(ctx->shard_steps);
    free(ctx->tail_src);
    if (ctx->hsdp_in != NULL) {
        ctx->exec->ops->mem_free(ctx->exec, ctx->hsdp_in);
    }
    if (ctx->rtp != NULL) {
        ctx->rtp->ops->destroy(ctx->rtp);
    }
    free(ctx->slots);
    mfsdp_arena_destroy(ctx->arena);
    mfsdp_plan_destroy(ctx->own_plan);
    if (ctx->tp != NULL) {
        ctx->tp->ops->destroy(ctx->tp);
    }
    if (ctx->exec != NULL) {
        ctx->exec->ops->destroy(ctx->exec);
    }
    free(ctx);
}

mfsdp_status_t mfsdp_ctx_share_arenas(struct mfsdp_ctx *ctx, const char *const *peer)
{
    const size_t ng = ctx->manifest->ngroups;
    const size_t ns = ctx->plan->nshards;
    mfsdp_arena_slot_t *slots = calloc(ns + 1, sizeof(*slots));
    const char **comm = calloc(ns + 1, sizeof(*comm)); /* per shard: its owner's comm copy */
    mfsdp_status_t st = slots != NULL && comm != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY;
    /* Where each node peer keeps its tensors: its arena layout, a pure function of the plan. */
    for (int r = 0; st == MFSDP_OK && r < ctx->world; r++) {
        if (peer[r] == NULL || r == ctx->rank) {
            continue;
        }
        mfsdp_arena_sizes_t sizes;
        size_t base;
        st = mfsdp_arena_layout(ctx->plan, r, slots, &sizes);
        if (st == MFSDP_OK) {
            st = mfsdp_arena_cat_offset(&sizes, MFSDP_ARENA_COMM, &base);
        }
        for (size_t i = 0; st == MFSDP_OK && i < ns; i++) {
            if (ctx->plan->shards[i].owner == r &&
                slots[i].off[MFSDP_ARENA_COMM] != MFSDP_ARENA_NONE) {
                comm[i] = peer[r] + base + slots[i].off[MFSDP_ARENA_COMM];
            }
        }
    }
    for (size_t g = 0; st == MFSDP_OK && g < ng; g++) {
        mfsdp_group_state_t *gst = &ctx->groups[g];
        if (gst->gather_algo != MFSDP_ALGO_DIRECT) {
            continue;
        }
        gst->peer_src = calloc(gst->gs->nsegs + 1, sizeof(*gst->peer_src));
        if (gst->peer_src == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            break;
        }
        for (size_t k = 0; k < gst->gs->nsegs; k++) {
            const mfsdp_sched_seg_t *sg = &gst->gs->segs[k];
            gst->peer_src[k] = sg->owner != ctx->rank ? comm[sg->shard] : NULL;
        }
        ctx->gather_shared = 1;
    }
    free(slots);
    free(comm);
    return st;
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

mfsdp_status_t mfsdp_ctx_set_stream(mfsdp_ctx_h ctx, void *stream)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(ctx->exec->ops->set_stream(ctx->exec, stream));
    MFSDP_CHECK(ctx->tp->ops->set_stream(ctx->tp, stream));
    if (ctx->rtp != NULL) {
        MFSDP_CHECK(ctx->rtp->ops->set_stream(ctx->rtp, stream));
    }
    ctx->stream = stream;
    return MFSDP_OK;
}

/* ---------------------------------------------------------------------------------------
 * Getters
 */

mfsdp_status_t mfsdp_ctx_get_param(mfsdp_ctx_h ctx, const char *name, mfsdp_param_view_t *view_p)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
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
                v.local_valid = mfsdp_ctx_slice_valid(ctx, e);
            } else {
                v.local_valid = v.local_elems;
            }
            if (v.local) {
                v.master = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_MASTER);
                v.grad = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_GRAD);
                v.comm = mfsdp_ctx_slot(ctx, shard, MFSDP_ARENA_COMM);
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
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
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
    s.comm_staging_bytes = ctx->stage_bytes;
    s.staging_budget = ctx->budget;
    s.step_mode = ctx->mode;
    s.accum_steps = ctx->accum;
    s.gather_shared = ctx->gather_shared;
    *stats_p = s;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_group_algos(mfsdp_ctx_h ctx, size_t group, mfsdp_algo_t *gather_p,
                                     mfsdp_algo_t *reduce_p)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK(mfsdp_ctx_group_check(ctx, group, "group_algos"));
    if (gather_p != NULL) {
        *gather_p = ctx->groups[group].gather_algo;
    }
    if (reduce_p != NULL) {
        *reduce_p = ctx->groups[group].reduce_algo;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_get_plan(mfsdp_ctx_h ctx, const mfsdp_plan_t **plan_p)
{
    MFSDP_CHECK(mfsdp_ctx_check(ctx));
    MFSDP_CHECK_ARG(plan_p != NULL);
    *plan_p = ctx->plan;
    return MFSDP_OK;
}
