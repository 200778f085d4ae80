/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner planner (docs/design.md, "Owners"): assigns every Muon matrix (and, by tail policy, every
 * AdamW tensor) to one owner rank, balancing Newton-Schulz FLOPs and owned bytes at once.
 *
 * The plan must be byte-identical on every rank, so everything here is a pure function of
 * (manifest, world, opts): fixed iteration orders, explicit tie-breaks, no hashing, no
 * time, no randomness. Floating-point loads are computed by the same operations in the same
 * order everywhere, so comparisons give the same answers on every rank.
 *
 * Algorithm.
 *  1. Items: Muon matrices, plus AdamW tensors placed whole (tail policy owner, or auto
 *     when the rule below keeps them whole). Each item has FLOPs f and owned bytes b.
 *  2. Lower bounds over the items, for FLOPs and bytes separately:
 *     LB = max(total / n, p1, p_n + p_{n+1}) (p sorted descending; the last term only with
 *     more than n items: two of the n+1 largest share a rank).
 *  3. Normalized load of a rank: L = max(F / LB_f, B / LB_b) (a term is dropped when its
 *     bound is 0). Items go largest-first (key = L of the item alone, ties by ascending
 *     shard index) onto the rank with the smallest load after adding it (ties: smaller sum
 *     F / LB_f + B / LB_b after adding, then lowest rank), subject to the spread cap
 *     (a group puts at most ceil(k/n) + 1 of its k items on one rank, unless no_spread) and
 *     mem_limit. Spread is a soft constraint: when only it blocks every fitting rank the item
 *     ignores it (logged at INFO); memory is hard.
 *  4. Refinement: ranks in descending load order (ties: lowest rank first); for the first
 *     rank r that has one, apply the best single move (an item of r to another rank) or swap
 *     (an item of r with an item of another rank q) that leaves both max(L_r, L_q) below the
 *     old L_r by more than rounding noise, respecting spread and memory. Candidates are
 *     scanned in a fixed order (moves before swaps, items in largest-first order, ranks
 *     ascending) and the first strictly best one wins. Each step lowers the sorted load vector
 *     lexicographically, so it terminates; an iteration cap bounds the work anyway.
 *
 * Tail policy auto. An AdamW tensor is sharded (kept in FSDP's even slices) when placing
 * it whole would unbalance the owners:
 *   - its bytes exceed those of the largest Muon matrix: no other item is as coarse, so
 *     its owner cannot be balanced by giving it fewer matrices without starving it of
 *     Newton-Schulz work (an embedding owner ends up with bytes but no FLOPs, and the
 *     others take its share of FLOPs); with no Muon matrix at all every tail tensor is
 *     sharded, as plain FSDP does;
 *   - or its bytes exceed the mean bytes per rank of all tensors (b * n > sum of all bytes):
 *     it alone would put its owner above a perfectly balanced load;
 *   - or its whole arena cost does not fit mem_limit.
 * Everything else (norms, biases, small embeddings) stays whole on an owner.
 *
 * Arena accounting (docs/design.md, "Layers" (owner arenas)), in elements per category, and bytes:
 *   Muon          MASTER, COMM, GRAD, MOMENTUM     numel * (4 + elt + 4 + 4)
 *   AdamW whole   MASTER, COMM, GRAD, ADAM_M, ADAM_V  numel * (4 + elt + 4 + 4 + 4)
 *   AdamW sharded every rank keeps its FSDP shard s = c * R elements in MASTER, COMM, GRAD,
 *                 ADAM_M, ADAM_V: s * (16 + elt) on every rank (padding included)
 * elt is the param dtype size (the communication copy). On each rank the owned tensors come
 * first in each category in ascending shard index, then the sharded tail slices: a tensor's
 * arena_offset indexes MASTER, COMM and GRAD (which hold every tensor), its state_offset
 * MOMENTUM (Muon) or ADAM_M and ADAM_V (AdamW), which hold only tensors of that role.
 */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "core/checks.h"
#include "core/layout.h"
#include "mfsdp/plan.h"

#define PLAN_FORMAT "mfsdp-plan/1"

/* One placeable tensor. */
typedef struct plan_item {
    size_t shard; /* index into plan->shards */
    size_t group;
    double f;     /* NS FLOPs */
    double b;     /* owned bytes (as double for normalized loads) */
    size_t arena; /* arena bytes of the whole tensor */
    double key;   /* normalized size, for the largest-first order */
    int owner;
} plan_item_t;

/* Mutable state of the assignment. */
typedef struct plan_state {
    int n;
    size_t nitems;
    plan_item_t *items;
    double *F;        /* per rank NS FLOPs */
    double *B;        /* per rank owned bytes */
    size_t *A;        /* per rank arena bytes, sharded tail included */
    unsigned *cnt;    /* ngroups x n items per (group, rank) */
    unsigned *cap;    /* per group spread cap (UINT_MAX when off) */
    double inv_f;     /* 1 / LB_f, or 0 when LB_f == 0 */
    double inv_b;     /* 1 / LB_b, or 0 when LB_b == 0 */
    size_t mem_limit; /* 0 = unlimited */
} plan_state_t;

static inline double load_of(const plan_state_t *s, double f, double b)
{
    double lf = f * s->inv_f;
    double lb = b * s->inv_b;
    return lf > lb ? lf : lb;
}

static inline double sum_of(const plan_state_t *s, double f, double b)
{
    return f * s->inv_f + b * s->inv_b;
}

static inline int mem_ok(const plan_state_t *s, int r, size_t remove, size_t add)
{
    if (s->mem_limit == 0) {
        return 1;
    }
    /* A[r] >= remove always holds: remove is an item r currently holds. */
    size_t a = s->A[r] - remove;
    return add <= s->mem_limit && a <= s->mem_limit - add;
}

static inline unsigned *cnt_at(const plan_state_t *s, size_t group, int r)
{
    return &s->cnt[group * (size_t)s->n + (size_t)r];
}

static void item_assign(plan_state_t *s, plan_item_t *it, int r)
{
    if (it->owner >= 0) {
        int o = it->owner;
        s->F[o] -= it->f;
        s->B[o] -= it->b;
        s->A[o] -= it->arena;
        (*cnt_at(s, it->group, o))--;
    }
    it->owner = r;
    s->F[r] += it->f;
    s->B[r] += it->b;
    s->A[r] += it->arena;
    (*cnt_at(s, it->group, r))++;
}

/* Descending key, then ascending shard index: a total order, so qsort is deterministic. */
static int item_cmp(const void *a, const void *b)
{
    const plan_item_t *x = a;
    const plan_item_t *y = b;
    if (x->key != y->key) {
        return x->key > y->key ? -1 : 1;
    }
    return x->shard < y->shard ? -1 : (x->shard > y->shard);
}

static int dbl_desc(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;
    return x > y ? -1 : (x < y);
}

/* LB = max(total / n, p1, p_n + p_{n+1}) of the values v[0..m) (sorted in place). */
static double lower_bound(double *v, size_t m, int n)
{
    if (m == 0) {
        return 0.0;
    }
    qsort(v, m, sizeof(*v), dbl_desc);
    double total = 0.0;
    for (size_t i = 0; i < m; i++) {
        total += v[i];
    }
    double lb = total / n;
    if (v[0] > lb) {
        lb = v[0];
    }
    if (m > (size_t)n && v[n - 1] + v[n] > lb) {
        lb = v[n - 1] + v[n];
    }
    return lb;
}

/* Newton-Schulz FLOPs of one rows x cols block: steps * (4 s^2 l + 2 s^3). */
static double ns_block_flops(int steps, int64_t rows, int64_t cols)
{
    double s = (double)(rows < cols ? rows : cols);
    double l = (double)(rows < cols ? cols : rows);
    return (double)steps * (4.0 * s * s * l + 2.0 * s * s * s);
}

static const char *param_name(const mfsdp_param_desc_t *p)
{
    return p->name != NULL ? p->name : "?";
}

/* Fill the per-param metadata that does not depend on owners. */
static mfsdp_status_t shards_describe(const mfsdp_manifest_t *m, int world, mfsdp_plan_t *plan)
{
    size_t k = 0;
    int steps = m->hp.ns_steps;
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        plan->group_first[g] = k;
        if (gd->nparams == 0) {
            continue;
        }
        if (gd->params == NULL) {
            MFSDP_WARN("group %s: no params array", gd->name ? gd->name : "?");
            return MFSDP_ERR_INVALID_ARG;
        }
        for (size_t i = 0; i < gd->nparams; i++) {
            const mfsdp_param_desc_t *p = &gd->params[i];
            if (p->shard_dim != 0) {
                MFSDP_WARN("param %s: Shard(%d) placement is not supported (only Shard(0))",
                           param_name(p), p->shard_dim);
                return MFSDP_ERR_UNSUPPORTED;
            }
            if (p->ndim < 1 || p->ndim > MFSDP_MAX_DIMS) {
                MFSDP_WARN("param %s: %d dims, expected 1..%d", param_name(p), p->ndim,
                           MFSDP_MAX_DIMS);
                return MFSDP_ERR_INVALID_ARG;
            }
            if (p->optimizer != MFSDP_ROLE_MUON && p->optimizer != MFSDP_ROLE_ADAMW) {
                MFSDP_WARN("param %s: unknown optimizer role %d", param_name(p), (int)p->optimizer);
                return MFSDP_ERR_INVALID_ARG;
            }
            if (p->optimizer == MFSDP_ROLE_MUON && p->ndim < 2) {
                MFSDP_WARN("param %s: muon needs a parameter of two or more dims", param_name(p));
                return MFSDP_ERR_INVALID_ARG;
            }
            size_t cols = 1;
            for (int d = 0; d < p->ndim; d++) {
                if (p->shape[d] <= 0) {
                    MFSDP_WARN("param %s: dim %d is %" PRId64 ", expected > 0", param_name(p), d,
                               p->shape[d]);
                    return MFSDP_ERR_INVALID_ARG;
                }
                if (d > 0 && mfsdp_mul_overflow(cols, (size_t)p->shape[d], &cols)) {
                    MFSDP_WARN("param %s: size overflows", param_name(p));
                    return MFSDP_ERR_OVERFLOW;
                }
            }
            size_t numel;
            if (mfsdp_mul_overflow((size_t)p->shape[0], cols, &numel) || numel > INT64_MAX) {
                MFSDP_WARN("param %s: size overflows", param_name(p));
                return MFSDP_ERR_OVERFLOW;
            }
            size_t elt = mfsdp_dtype_size(p->dtype);
            if (elt == 0 || p->dtype == MFSDP_UINT8) {
                MFSDP_WARN("param %s: bad dtype %d", param_name(p), (int)p->dtype);
                return MFSDP_ERR_INVALID_ARG;
            }
            mfsdp_shard_t *sh = &plan->shards[k++];
            sh->group = g;
            sh->param = i;
            sh->role = p->optimizer;
            sh->rows = p->shape[0];
            sh->cols = (int64_t)cols;
            sh->numel = (int64_t)numel;
            sh->owner = MFSDP_OWNER_SHARDED;
            /* Per element: fp32 master + comm copy + fp32 grad + (momentum | m and v). */
            size_t per = 4 + elt + 4 + (sh->role == MFSDP_ROLE_MUON ? 4 : 8);
            if (mfsdp_mul_overflow(numel, per, &sh->arena_bytes)) {
                MFSDP_WARN("param %s: arena size overflows", param_name(p));
                return MFSDP_ERR_OVERFLOW;
            }
            if (sh->role != MFSDP_ROLE_MUON) {
                continue;
            }
            if (p->nsplit == 0) {
                sh->ns_flops = ns_block_flops(steps, sh->rows, sh->cols);
                continue;
            }
            if (p->split == NULL) {
                MFSDP_WARN("param %s: split count without split array", param_name(p));
                return MFSDP_ERR_INVALID_ARG;
            }
            int64_t rows = 0;
            for (size_t b = 0; b < p->nsplit; b++) {
                if (p->split[b] <= 0 || p->split[b] > sh->rows - rows) {
                    MFSDP_WARN("param %s: split blocks must be > 0 and sum to %" PRId64,
                               param_name(p), sh->rows);
                    return MFSDP_ERR_INVALID_ARG;
                }
                rows += p->split[b];
                sh->ns_flops += ns_block_flops(steps, p->split[b], sh->cols);
            }
            if (rows != sh->rows) {
                MFSDP_WARN("param %s: split blocks must be > 0 and sum to %" PRId64, param_name(p),
                           sh->rows);
                return MFSDP_ERR_INVALID_ARG;
            }
        }
        /* FSDP geometry of the all-gather buffer, from the one layout model. */
        mfsdp_group_layout_t *lay = NULL;
        MFSDP_CHECK(mfsdp_group_layout_create(gd, world, &lay));
        for (size_t i = 0; i < gd->nparams; i++) {
            mfsdp_shard_t *sh = &plan->shards[plan->group_first[g] + i];
            const mfsdp_param_layout_t *e = &lay->ag.entries[i];
            sh->fsdp_c = e->c;
            sh->fsdp_s = e->s;
            sh->fsdp_o_bytes = e->o_bytes;
            /* In a mixed-dtype (uint8) group only the byte offset is exact; the element
             * offset is its quotient by the param dtype size. */
            sh->fsdp_o = (int64_t)(e->o_bytes / e->elt);
        }
        mfsdp_group_layout_destroy(lay);
    }
    plan->group_first[m->ngroups] = k;
    return MFSDP_OK;
}

/* Place items largest-first onto the least-loaded feasible rank. */
static mfsdp_status_t place_greedy(plan_state_t *s, const mfsdp_plan_t *plan)
{
    for (size_t i = 0; i < s->nitems; i++) {
        plan_item_t *it = &s->items[i];
        int best = -1;
        int best_spread = 1;
        double best_l = 0.0;
        double best_sum = 0.0;
        for (int pass = 0; pass < 2 && best < 0; pass++) {
            /* pass 0: spread and memory; pass 1: memory only (spread is soft). */
            for (int r = 0; r < s->n; r++) {
                if (pass == 0 && *cnt_at(s, it->group, r) >= s->cap[it->group]) {
                    continue;
                }
                if (!mem_ok(s, r, 0, it->arena)) {
                    continue;
                }
                double l = load_of(s, s->F[r] + it->f, s->B[r] + it->b);
                double sm = sum_of(s, s->F[r] + it->f, s->B[r] + it->b);
                if (best < 0 || l < best_l || (l == best_l && sm < best_sum)) {
                    best = r;
                    best_l = l;
                    best_sum = sm;
                }
            }
            best_spread = pass == 0;
        }
        if (best < 0) {
            const mfsdp_shard_t *sh = &plan->shards[it->shard];
            const mfsdp_param_desc_t *p = &plan->manifest->groups[sh->group].params[sh->param];
            MFSDP_WARN("plan does not fit the memory limit: no rank has room for %s "
                       "(%zu arena bytes) under the limit of %zu bytes",
                       param_name(p), it->arena, s->mem_limit);
            return MFSDP_ERR_MEM_LIMIT;
        }
        if (!best_spread) {
            const mfsdp_shard_t *sh = &plan->shards[it->shard];
            MFSDP_INFO(PLAN, "%s: memory limit forces a group spread above %u on rank %d",
                       param_name(&plan->manifest->groups[sh->group].params[sh->param]),
                       s->cap[it->group], best);
        }
        item_assign(s, it, best);
    }
    return MFSDP_OK;
}

/* Room for one more item of group g on rank q (swaps inside one group keep counts). */
static inline int spread_ok(const plan_state_t *s, size_t g, int q)
{
    return *cnt_at(s, g, q) < s->cap[g];
}

typedef struct rank_load {
    double l;
    int r;
} rank_load_t;

/* Descending load, ties by ascending rank: a total order. */
static int rank_load_cmp(const void *a, const void *b)
{
    const rank_load_t *x = a;
    const rank_load_t *y = b;
    if (x->l != y->l) {
        return x->l > y->l ? -1 : 1;
    }
    return x->r < y->r ? -1 : (x->r > y->r);
}

/* Try to find and apply one improving move/swap for rank r. Returns 1 when applied. */
static int refine_rank(plan_state_t *s, int r)
{
    /* An accepted change must lower r by more than rounding noise: the incremental float
     * loads are not exact sums, and noise-sized "improvements" could cycle. */
    double best = load_of(s, s->F[r], s->B[r]) * (1.0 - 1e-12);
    size_t bi = SIZE_MAX, bj = SIZE_MAX;
    int bq = -1;
    for (size_t i = 0; i < s->nitems; i++) {
        const plan_item_t *x = &s->items[i];
        if (x->owner != r) {
            continue;
        }
        double fr = s->F[r] - x->f;
        double br = s->B[r] - x->b;
        double lr_after = load_of(s, fr, br);
        if (lr_after >= best) {
            continue; /* neither a move nor a swap of x can beat the best found */
        }
        /* Moves. */
        for (int q = 0; q < s->n; q++) {
            if (q == r || !spread_ok(s, x->group, q) || !mem_ok(s, q, 0, x->arena)) {
                continue;
            }
            double lq = load_of(s, s->F[q] + x->f, s->B[q] + x->b);
            double pair = lq > lr_after ? lq : lr_after;
            if (pair < best) {
                best = pair;
                bi = i;
                bj = SIZE_MAX;
                bq = q;
            }
        }
    }
    for (size_t i = 0; i < s->nitems; i++) {
        const plan_item_t *x = &s->items[i];
        if (x->owner != r) {
            continue;
        }
        if (load_of(s, s->F[r] - x->f, s->B[r] - x->b) >= best) {
            continue;
        }
        /* Swaps with every item of another rank. */
        for (size_t j = 0; j < s->nitems; j++) {
            const plan_item_t *y = &s->items[j];
            int q = y->owner;
            if (q == r || (y->f >= x->f && y->b >= x->b)) {
                continue; /* y no smaller than x in both: cannot lower r */
            }
            double fr = s->F[r] - x->f + y->f;
            double br = s->B[r] - x->b + y->b;
            double fq = s->F[q] - y->f + x->f;
            double bq2 = s->B[q] - y->b + x->b;
            double l1 = load_of(s, fr, br);
            double l2 = load_of(s, fq, bq2);
            double pair = l1 > l2 ? l1 : l2;
            if (pair >= best) {
                continue;
            }
            if (x->group != y->group &&
                (!spread_ok(s, x->group, q) || !spread_ok(s, y->group, r))) {
                continue;
            }
            if (!mem_ok(s, q, y->arena, x->arena) || !mem_ok(s, r, x->arena, y->arena)) {
                continue;
            }
            best = pair;
            bi = i;
            bj = j;
            bq = q;
        }
    }
    if (bi == SIZE_MAX) {
        return 0;
    }
    item_assign(s, &s->items[bi], bq);
    if (bj != SIZE_MAX) {
        item_assign(s, &s->items[bj], r);
    }
    return 1;
}

static mfsdp_status_t refine(plan_state_t *s)
{
    rank_load_t *order = malloc((size_t)s->n * sizeof(*order));
    if (order == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t cap = 8 * s->nitems + 64;
    for (size_t iter = 0; iter < cap; iter++) {
        for (int r = 0; r < s->n; r++) {
            order[r].l = load_of(s, s->F[r], s->B[r]);
            order[r].r = r;
        }
        qsort(order, (size_t)s->n, sizeof(*order), rank_load_cmp);
        int applied = 0;
        for (int k = 0; k < s->n && !applied; k++) {
            applied = refine_rank(s, order[k].r);
        }
        if (!applied) {
            break;
        }
    }
    free(order);
    return MFSDP_OK;
}

/* Decide which AdamW tensors are sharded (see the auto rule at the top). Writes
 * shard->owner = MFSDP_OWNER_SHARDED, or -2 for a tensor to place. */
static void tail_decide(mfsdp_plan_t *plan, mfsdp_tail_policy_t tail, size_t mem_limit,
                        const size_t *bytes)
{
    /* Sum of all whole-tensor bytes, saturating (only compared against b * n). */
    size_t total = 0;
    size_t muon_max = 0;
    for (size_t k = 0; k < plan->nshards; k++) {
        if (mfsdp_add_overflow(total, bytes[k], &total)) {
            total = SIZE_MAX;
        }
        if (plan->shards[k].role == MFSDP_ROLE_MUON && bytes[k] > muon_max) {
            muon_max = bytes[k];
        }
    }
    for (size_t k = 0; k < plan->nshards; k++) {
        mfsdp_shard_t *sh = &plan->shards[k];
        sh->owner = -2;
        if (sh->role != MFSDP_ROLE_ADAMW || tail == MFSDP_TAIL_OWNER) {
            continue;
        }
        if (tail == MFSDP_TAIL_SHARD || tail == MFSDP_TAIL_JOB) {
            sh->owner = MFSDP_OWNER_SHARDED;
            continue;
        }
        size_t bn;
        int coarse = bytes[k] > muon_max;
        int big = mfsdp_mul_overflow(bytes[k], (size_t)plan->world, &bn) || bn > total;
        int nofit = mem_limit != 0 && sh->arena_bytes > mem_limit;
        if (coarse || big || nofit) {
            sh->owner = MFSDP_OWNER_SHARDED;
        }
    }
}

/* Per-rank totals, owned lists and arena offsets from the final owners. */
static mfsdp_status_t plan_finalize(mfsdp_plan_t *plan, size_t tail_elems, size_t tail_bytes)
{
    int n = plan->world;
    for (size_t k = 0; k < plan->nshards; k++) {
        const mfsdp_shard_t *sh = &plan->shards[k];
        if (sh->owner >= 0) {
            plan->ranks[sh->owner].nowned++;
        }
    }
    for (int r = 0; r < n; r++) {
        mfsdp_rank_plan_t *rp = &plan->ranks[r];
        if (rp->nowned != 0) {
            rp->owned = calloc(rp->nowned, sizeof(*rp->owned));
            if (rp->owned == NULL) {
                return MFSDP_ERR_NO_MEMORY;
            }
        }
        rp->nowned = 0;
    }
    /* Owned tensors: ascending shard index in every category. */
    for (size_t k = 0; k < plan->nshards; k++) {
        mfsdp_shard_t *sh = &plan->shards[k];
        if (sh->owner < 0) {
            continue;
        }
        mfsdp_rank_plan_t *rp = &plan->ranks[sh->owner];
        const mfsdp_param_desc_t *p = &plan->manifest->groups[sh->group].params[sh->param];
        size_t numel = (size_t)sh->numel;
        rp->owned[rp->nowned++] = k;
        sh->arena_offset = rp->arena_elems[MFSDP_ARENA_MASTER];
        rp->arena_elems[MFSDP_ARENA_MASTER] += numel;
        rp->arena_elems[MFSDP_ARENA_COMM] += numel;
        rp->arena_elems[MFSDP_ARENA_GRAD] += numel;
        if (sh->role == MFSDP_ROLE_MUON) {
            sh->state_offset = rp->arena_elems[MFSDP_ARENA_MOMENTUM];
            rp->arena_elems[MFSDP_ARENA_MOMENTUM] += numel;
        } else {
            sh->state_offset = rp->arena_elems[MFSDP_ARENA_ADAM_M];
            rp->arena_elems[MFSDP_ARENA_ADAM_M] += numel;
            rp->arena_elems[MFSDP_ARENA_ADAM_V] += numel;
        }
        rp->ns_flops += sh->ns_flops;
        rp->owned_bytes += numel * mfsdp_dtype_size(p->dtype); /* <= arena, no overflow */
        rp->arena_bytes += sh->arena_bytes;
    }
    /* Sharded tail slices follow, at the same tail offset on every rank. */
    size_t toff = 0;
    for (size_t k = 0; k < plan->nshards; k++) {
        mfsdp_shard_t *sh = &plan->shards[k];
        if (sh->owner != MFSDP_OWNER_SHARDED) {
            continue;
        }
        sh->arena_offset = toff;
        sh->state_offset = toff;
        toff += (size_t)sh->fsdp_s;
    }
    for (int r = 0; r < n; r++) {
        mfsdp_rank_plan_t *rp = &plan->ranks[r];
        rp->tail_elems = tail_elems;
        static const mfsdp_arena_cat_t tail_cats[] = {MFSDP_ARENA_MASTER, MFSDP_ARENA_COMM,
                                                      MFSDP_ARENA_GRAD, MFSDP_ARENA_ADAM_M,
                                                      MFSDP_ARENA_ADAM_V};
        for (size_t c = 0; c < sizeof(tail_cats) / sizeof(tail_cats[0]); c++) {
            if (mfsdp_add_overflow(rp->arena_elems[tail_cats[c]], tail_elems,
                                   &rp->arena_elems[tail_cats[c]])) {
                return MFSDP_ERR_OVERFLOW;
            }
        }
        if (mfsdp_add_overflow(rp->arena_bytes, tail_bytes, &rp->arena_bytes)) {
            return MFSDP_ERR_OVERFLOW;
        }
        if (rp->ns_flops > plan->max_flops) {
            plan->max_flops = rp->ns_flops;
        }
        if (rp->owned_bytes > plan->max_owned_bytes) {
            plan->max_owned_bytes = rp->owned_bytes;
        }
        if (rp->arena_bytes > plan->max_arena_bytes) {
            plan->max_arena_bytes = rp->arena_bytes;
        }
    }
    return MFSDP_OK;
}

void mfsdp_plan_destroy(mfsdp_plan_t *plan)
{
    if (plan == NULL) {
        return;
    }
    if (plan->ranks != NULL) {
        for (int r = 0; r < plan->world; r++) {
            free(plan->ranks[r].owned);
        }
    }
    free(plan->ranks);
    free(plan->shards);
    free(plan->group_first);
    free(plan);
}

mfsdp_status_t mfsdp_plan_create(const mfsdp_manifest_t *manifest, int world,
                                 const mfsdp_plan_opts_t *opts, mfsdp_plan_t **plan_p)
{
    MFSDP_CHECK_ARG(manifest != NULL && plan_p != NULL);
    MFSDP_CHECK_ARG(manifest->ngroups == 0 || manifest->groups != NULL);
    if (world < 1) {
        MFSDP_WARN("world size %d: expected >= 1", world);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (manifest->world_size != 0 && manifest->world_size != world) {
        MFSDP_WARN("world size %d does not match the manifest's world_size %d", world,
                   manifest->world_size);
        return MFSDP_ERR_MISMATCH;
    }
    mfsdp_plan_opts_t o = {0};
    if (opts != NULL) {
        o = *opts;
    }
    if (o.tail != MFSDP_TAIL_OWNER && o.tail != MFSDP_TAIL_SHARD && o.tail != MFSDP_TAIL_AUTO &&
        o.tail != MFSDP_TAIL_JOB) {
        MFSDP_WARN("tail policy %d: expected owner, shard, auto or job", (int)o.tail);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (manifest->hp.ns_steps < 0) {
        MFSDP_WARN("ns_steps %d: expected >= 0", manifest->hp.ns_steps);
        return MFSDP_ERR_INVALID_ARG;
    }

    mfsdp_status_t st = MFSDP_OK;
    plan_state_t s = {0};
    size_t *bytes = NULL;
    double *vals = NULL;
    size_t nshards = 0;
    for (size_t g = 0; g < manifest->ngroups; g++) {
        nshards += manifest->groups[g].nparams;
    }
    mfsdp_plan_t *plan = calloc(1, sizeof(*plan));
    if (plan == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    plan->world = world;
    plan->tail = o.tail;
    plan->manifest = manifest;
    plan->nshards = nshards;
    plan->shards = calloc(nshards + 1, sizeof(*plan->shards));
    plan->group_first = calloc(manifest->ngroups + 1, sizeof(*plan->group_first));
    plan->ranks = calloc((size_t)world, sizeof(*plan->ranks));
    bytes = calloc(nshards + 1, sizeof(*bytes));
    if (plan->shards == NULL || plan->group_first == NULL || plan->ranks == NULL || bytes == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    MFSDP_CHECK_GOTO(shards_describe(manifest, world, plan), st, out);
    for (size_t k = 0; k < nshards; k++) {
        const mfsdp_shard_t *sh = &plan->shards[k];
        const mfsdp_param_desc_t *p = &manifest->groups[sh->group].params[sh->param];
        bytes[k] = (size_t)sh->numel * mfsdp_dtype_size(p->dtype); /* <= arena_bytes */
    }
    tail_decide(plan, o.tail, o.mem_limit, bytes);

    /* Sharded tail: every rank keeps s elements of each in five categories. */
    size_t tail_elems = 0, tail_bytes = 0;
    for (size_t k = 0; k < nshards; k++) {
        const mfsdp_shard_t *sh = &plan->shards[k];
        if (sh->owner != MFSDP_OWNER_SHARDED) {
            s.nitems++;
            continue;
        }
        if (o.tail == MFSDP_TAIL_JOB) {
            continue; /* the job's own optimizer keeps these: no arena bytes */
        }
        const mfsdp_param_desc_t *p = &manifest->groups[sh->group].params[sh->param];
        size_t cost;
        if (mfsdp_mul_overflow((size_t)sh->fsdp_s, 16 + mfsdp_dtype_size(p->dtype), &cost) ||
            mfsdp_add_overflow(tail_elems, (size_t)sh->fsdp_s, &tail_elems) ||
            mfsdp_add_overflow(tail_bytes, cost, &tail_bytes)) {
            st = MFSDP_ERR_OVERFLOW;
            goto out;
        }
        if (o.mem_limit != 0 && cost > o.mem_limit) {
            MFSDP_WARN("tensor %s needs %zu arena bytes per rank for its tail slice, over the "
                       "memory limit of %zu bytes",
                       param_name(p), cost, o.mem_limit);
            st = MFSDP_ERR_MEM_LIMIT;
            goto out;
        }
    }
    if (o.mem_limit != 0 && tail_bytes > o.mem_limit) {
        MFSDP_WARN("sharded tail slices need %zu arena bytes per rank, over the memory limit "
                   "of %zu bytes",
                   tail_bytes, o.mem_limit);
        st = MFSDP_ERR_MEM_LIMIT;
        goto out;
    }

    /* Items. */
    s.n = world;
    s.mem_limit = o.mem_limit;
    s.items = calloc(s.nitems + 1, sizeof(*s.items));
    s.F = calloc((size_t)world, sizeof(*s.F));
    s.B = calloc((size_t)world, sizeof(*s.B));
    s.A = calloc((size_t)world, sizeof(*s.A));
    s.cap = calloc(manifest->ngroups + 1, sizeof(*s.cap));
    vals = calloc(s.nitems + 1, sizeof(*vals));
    size_t ncnt;
    if (mfsdp_mul_overflow(manifest->ngroups + 1, (size_t)world, &ncnt)) {
        st = MFSDP_ERR_OVERFLOW;
        goto out;
    }
    s.cnt = calloc(ncnt, sizeof(*s.cnt));
    if (s.items == NULL || s.F == NULL || s.B == NULL || s.A == NULL || s.cap == NULL ||
        vals == NULL || s.cnt == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (int r = 0; r < world; r++) {
        s.A[r] = tail_bytes;
    }
    size_t ni = 0;
    for (size_t k = 0; k < nshards; k++) {
        mfsdp_shard_t *sh = &plan->shards[k];
        if (sh->owner == MFSDP_OWNER_SHARDED) {
            continue;
        }
        const mfsdp_param_desc_t *p = &manifest->groups[sh->group].params[sh->param];
        if (o.mem_limit != 0 &&
            (sh->arena_bytes > o.mem_limit || sh->arena_bytes > o.mem_limit - tail_bytes)) {
            MFSDP_WARN("tensor %s needs %zu arena bytes%s, over the memory limit of %zu bytes",
                       param_name(p), sh->arena_bytes,
                       sh->arena_bytes > o.mem_limit ? "" : " next to the sharded tail",
                       o.mem_limit);
            st = MFSDP_ERR_MEM_LIMIT;
            goto out;
        }
        plan_item_t *it = &s.items[ni++];
        it->shard = k;
        it->group = sh->group;
        it->f = sh->ns_flops;
        it->b = (double)bytes[k];
        it->arena = sh->arena_bytes;
        it->owner = -1;
        s.cap[sh->group]++;
    }
    for (size_t g = 0; g < manifest->ngroups; g++) {
        size_t k = s.cap[g];
        size_t c = (k + (size_t)world - 1) / (size_t)world + 1;
        s.cap[g] = o.no_spread || c > UINT_MAX ? UINT_MAX : (unsigned)c;
    }

    /* Lower bounds, then normalized sizes. */
    for (size_t i = 0; i < s.nitems; i++) {
        vals[i] = s.items[i].f;
    }
    plan->lb_flops = lower_bound(vals, s.nitems, world);
    for (size_t i = 0; i < s.nitems; i++) {
        vals[i] = s.items[i].b;
    }
    plan->lb_bytes = lower_bound(vals, s.nitems, world);
    s.inv_f = plan->lb_flops > 0.0 ? 1.0 / plan->lb_flops : 0.0;
    s.inv_b = plan->lb_bytes > 0.0 ? 1.0 / plan->lb_bytes : 0.0;
    for (size_t i = 0; i < s.nitems; i++) {
        s.items[i].key = load_of(&s, s.items[i].f, s.items[i].b);
    }
    qsort(s.items, s.nitems, sizeof(*s.items), item_cmp);

    MFSDP_CHECK_GOTO(place_greedy(&s, plan), st, out);
    MFSDP_CHECK_GOTO(refine(&s), st, out);

    for (size_t i = 0; i < s.nitems; i++) {
        plan->shards[s.items[i].shard].owner = s.items[i].owner;
    }
    MFSDP_CHECK_GOTO(plan_finalize(plan, tail_elems, tail_bytes), st, out);
    MFSDP_INFO(PLAN,
               "plan: %zu tensors on %d ranks, max ns flops %.4g (lb %.4g), max owned bytes "
               "%zu (lb %.4g), max arena bytes %zu",
               nshards, world, plan->max_flops, plan->lb_flops, plan->max_owned_bytes,
               plan->lb_bytes, plan->max_arena_bytes);
    *plan_p = plan;
    plan = NULL;
out:
    free(s.items);
    free(s.F);
    free(s.B);
    free(s.A);
    free(s.cnt);
    free(s.cap);
    free(vals);
    free(bytes);
    mfsdp_plan_destroy(plan);
    return st;
}

/* ---- JSON ---------------------------------------------------------------------------- */

static const char *const role_names[] = {[MFSDP_ROLE_MUON] = "muon", [MFSDP_ROLE_ADAMW] = "adamw"};
static const char *const tail_names[] = {[MFSDP_TAIL_OWNER] = "owner",
                                         [MFSDP_TAIL_SHARD] = "shard",
                                         [MFSDP_TAIL_AUTO] = "auto",
                                         [MFSDP_TAIL_JOB] = "job"};
static const char *const cat_names[MFSDP_ARENA_NCAT] = {
    [MFSDP_ARENA_MASTER] = "master", [MFSDP_ARENA_COMM] = "comm",
    [MFSDP_ARENA_GRAD] = "grad",     [MFSDP_ARENA_MOMENTUM] = "momentum",
    [MFSDP_ARENA_ADAM_M] = "adam_m", [MFSDP_ARENA_ADAM_V] = "adam_v",
};

/* Sets key to value and reports failure (the value is always consumed). */
static int jset(json_t *obj, const char *key, json_t *value)
{
    return value == NULL || json_object_set_new(obj, key, value) != 0;
}

static int jpush(json_t *arr, json_t *value)
{
    return value == NULL || json_array_append_new(arr, value) != 0;
}

static json_t *jsize(size_t v)
{
    return v > (size_t)INT64_MAX ? NULL : json_integer((json_int_t)v);
}

/* Imbalance vs the lower bound; 0 when the bound is 0. */
static double ratio(double v, double lb)
{
    return lb > 0.0 ? v / lb : 0.0;
}

mfsdp_status_t mfsdp_plan_to_json(const mfsdp_plan_t *plan, char **json_p)
{
    MFSDP_CHECK_ARG(plan != NULL && json_p != NULL && plan->manifest != NULL);
    MFSDP_CHECK_ARG((unsigned)plan->tail <= MFSDP_TAIL_JOB);
    const mfsdp_manifest_t *m = plan->manifest;
    json_t *root = json_object();
    if (root == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    /* Children are attached as soon as they exist (root owns them; the borrowed pointers stay
     * valid), in a fixed insertion order that jansson keeps; reals print as %.17g. */
    int bad = 0;
    json_t *bounds = json_object();
    json_t *params = json_array();
    json_t *ranks = json_array();
    json_t *groups = json_array();
    bad |= jset(root, "format", json_string(PLAN_FORMAT));
    bad |= jset(root, "world_size", json_integer(plan->world));
    bad |= jset(root, "tail", json_string(tail_names[plan->tail]));
    bad |= jset(root, "bounds", bounds);
    bad |= jset(root, "params", params);
    bad |= jset(root, "ranks", ranks);
    bad |= jset(root, "groups", groups);
    if (bad) {
        json_decref(root);
        return MFSDP_ERR_NO_MEMORY;
    }
    bad |= jset(bounds, "lb_flops", json_real(plan->lb_flops));
    bad |= jset(bounds, "max_flops", json_real(plan->max_flops));
    bad |= jset(bounds, "flops_ratio", json_real(ratio(plan->max_flops, plan->lb_flops)));
    bad |= jset(bounds, "lb_bytes", json_real(plan->lb_bytes));
    bad |= jset(bounds, "max_owned_bytes", jsize(plan->max_owned_bytes));
    bad |= jset(bounds, "bytes_ratio",
                json_real(ratio((double)plan->max_owned_bytes, plan->lb_bytes)));
    bad |= jset(bounds, "max_arena_bytes", jsize(plan->max_arena_bytes));

    for (size_t k = 0; k < plan->nshards && !bad; k++) {
        const mfsdp_shard_t *sh = &plan->shards[k];
        const mfsdp_param_desc_t *p = &m->groups[sh->group].params[sh->param];
        json_t *o = json_object();
        json_t *fsdp = json_object();
        if (o == NULL || fsdp == NULL) {
            json_decref(o);
            json_decref(fsdp);
            bad = 1;
            break;
        }
        bad |= jset(o, "name", json_string(param_name(p)));
        bad |= jset(o, "group", jsize(sh->group));
        bad |= jset(o, "role", json_string(role_names[sh->role]));
        bad |= jset(o, "dtype", json_string(mfsdp_dtype_name(p->dtype)));
        bad |= jset(o, "rows", json_integer(sh->rows));
        bad |= jset(o, "cols", json_integer(sh->cols));
        bad |= jset(o, "numel", json_integer(sh->numel));
        bad |= jset(fsdp, "c", json_integer(sh->fsdp_c));
        bad |= jset(fsdp, "s", json_integer(sh->fsdp_s));
        bad |= jset(fsdp, "o", json_integer(sh->fsdp_o));
        bad |= jset(fsdp, "o_bytes", jsize(sh->fsdp_o_bytes));
        bad |= jset(o, "fsdp", fsdp);
        bad |= jset(o, "owner",
                    sh->owner == MFSDP_OWNER_SHARDED ? json_string("sharded")
                                                     : json_integer(sh->owner));
        bad |= jset(o, "arena_offset", jsize(sh->arena_offset));
        bad |= jset(o, "state_offset", jsize(sh->state_offset));
        bad |= jset(o, "ns_flops", json_real(sh->ns_flops));
        bad |= jset(o, "arena_bytes", jsize(sh->arena_bytes));
        bad |= jpush(params, o);
    }
    for (int r = 0; r < plan->world && !bad; r++) {
        const mfsdp_rank_plan_t *rp = &plan->ranks[r];
        json_t *o = json_object();
        json_t *owned = json_array();
        json_t *cats = json_object();
        if (o == NULL || owned == NULL || cats == NULL) {
            json_decref(o);
            json_decref(owned);
            json_decref(cats);
            bad = 1;
            break;
        }
        for (size_t i = 0; i < rp->nowned; i++) {
            bad |= jpush(owned, jsize(rp->owned[i]));
        }
        for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
            bad |= jset(cats, cat_names[c], jsize(rp->arena_elems[c]));
        }
        bad |= jset(o, "rank", json_integer(r));
        bad |= jset(o, "owned", owned);
        bad |= jset(o, "ns_flops", json_real(rp->ns_flops));
        bad |= jset(o, "flops_ratio", json_real(ratio(rp->ns_flops, plan->lb_flops)));
        bad |= jset(o, "owned_bytes", jsize(rp->owned_bytes));
        bad |= jset(o, "bytes_ratio", json_real(ratio((double)rp->owned_bytes, plan->lb_bytes)));
        bad |= jset(o, "tail_elems", jsize(rp->tail_elems));
        bad |= jset(o, "arena_elems", cats);
        bad |= jset(o, "arena_bytes", jsize(rp->arena_bytes));
        bad |= jpush(ranks, o);
    }
    for (size_t g = 0; g < m->ngroups && !bad; g++) {
        json_t *o = json_object();
        json_t *owners = json_array();
        if (o == NULL || owners == NULL) {
            json_decref(o);
            json_decref(owners);
            bad = 1;
            break;
        }
        for (size_t k = plan->group_first[g]; k < plan->group_first[g + 1]; k++) {
            int ow = plan->shards[k].owner;
            bad |= jpush(owners,
                         ow == MFSDP_OWNER_SHARDED ? json_string("sharded") : json_integer(ow));
        }
        bad |= jset(o, "name", json_string(m->groups[g].name ? m->groups[g].name : "?"));
        bad |= jset(o, "owners", owners);
        bad |= jpush(groups, o);
    }
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(17));
    json_decref(root);
    if (text == NULL) {
        MFSDP_WARN("plan serialization failed");
        return MFSDP_ERR_NO_MEMORY;
    }
    *json_p = text;
    return MFSDP_OK;
}
