/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Waves of the owner-collective op lists (core/schedule.h, op->wave): what a transport that
 * runs one NCCL group per wave relies on. For every algorithm, both directions, world sizes
 * 1..7, both tail policies and chain chunks from 4 bytes (many windows per segment) to 1 MiB:
 *  - a communication op is in a later wave than its dependency; a local op (APPLY, COPYOUT)
 *    in the same or a later one; DEP_ALL ops are local;
 *  - in every wave, the sends from a to b and the receives on b from a, in list order (NCCL
 *    matches point-to-point by order per peer pair, it has no tags), pair up one to one with
 *    the same segment, offset and length; no rank sends to itself;
 *  - the collectives of a wave (BCAST, REDUCE, TAIL) are the same on every rank, in order.
 * Given NCCL's group semantics (the operations of one group run concurrently), a transport
 * that runs wave 0, 1, ... in order on every rank therefore never waits for an operation its
 * peer posts in a later wave: no deadlock, whatever the message sizes.
 * The 2-segment chain with different owners and more chunks than the window is the case in
 * which waves by dependency depth alone deadlock (an owner would send every chunk in its
 * first group while its successor receives them over several).
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/schedule.h"
#include "tests/unit/manifest_util.h"

static int is_local(const mfsdp_sched_op_t *o)
{
    return o->kind == MFSDP_SCHED_APPLY || o->kind == MFSDP_SCHED_COPYOUT;
}

static int is_coll(const mfsdp_sched_op_t *o)
{
    return o->kind == MFSDP_SCHED_BCAST || o->kind == MFSDP_SCHED_REDUCE ||
           o->kind == MFSDP_SCHED_TAIL;
}

/* The waves of every rank's list against the rules above; returns the number of waves. */
static int check_waves(mfsdp_sched_ops_t *ops, int n, const char *what)
{
    int maxw = -1;
    for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < ops[r].nops; i++) {
            const mfsdp_sched_op_t *o = &ops[r].ops[i];
            cr_assert(o->wave >= 0, "%s: rank %d op %zu has wave %d", what, r, i, o->wave);
            maxw = o->wave > maxw ? o->wave : maxw;
            if (o->dep == MFSDP_SCHED_DEP_ALL) {
                cr_assert(is_local(o), "%s: rank %d op %zu waits for all but is not local", what, r,
                          i);
                continue;
            }
            if (o->dep < 0) {
                continue;
            }
            for (long q = o->dep; q < o->dep + (o->ndep > 1 ? o->ndep : 1); q++) {
                const mfsdp_sched_op_t *d = &ops[r].ops[q];
                if (is_local(o)) {
                    cr_assert(o->wave >= d->wave,
                              "%s: rank %d local op %zu (wave %d) before its "
                              "dependency %ld (wave %d)",
                              what, r, i, o->wave, q, d->wave);
                } else {
                    cr_assert(o->wave > d->wave,
                              "%s: rank %d op %zu (wave %d) not after its "
                              "dependency %ld (wave %d)",
                              what, r, i, o->wave, q, d->wave);
                }
            }
        }
    }
    for (int w = 0; w <= maxw; w++) {
        /* Point-to-point, per ordered pair. */
        for (int a = 0; a < n; a++) {
            for (int b = 0; b < n; b++) {
                size_t i = 0, j = 0;
                for (;;) {
                    while (i < ops[a].nops &&
                           !(ops[a].ops[i].wave == w && ops[a].ops[i].kind == MFSDP_SCHED_SEND &&
                             ops[a].ops[i].peer == b)) {
                        i++;
                    }
                    while (j < ops[b].nops &&
                           !(ops[b].ops[j].wave == w && ops[b].ops[j].kind == MFSDP_SCHED_RECV &&
                             ops[b].ops[j].peer == a)) {
                        j++;
                    }
                    if (i == ops[a].nops || j == ops[b].nops) {
                        cr_assert(i == ops[a].nops && j == ops[b].nops,
                                  "%s: wave %d: %s from %d to %d without a match", what, w,
                                  i < ops[a].nops ? "send" : "receive", a, b);
                        break;
                    }
                    const mfsdp_sched_op_t *s = &ops[a].ops[i], *v = &ops[b].ops[j];
                    cr_assert(a != b, "%s: rank %d sends to itself", what, a);
                    cr_assert(s->seg == v->seg && s->off == v->off && s->len == v->len,
                              "%s: wave %d: %d->%d send (seg %u off %zu len %zu) meets receive "
                              "(seg %u off %zu len %zu)",
                              what, w, a, b, s->seg, s->off, s->len, v->seg, v->off, v->len);
                    i++;
                    j++;
                }
            }
        }
        /* Collectives: the same sequence everywhere. */
        size_t *at = calloc((size_t)n, sizeof(size_t));
        for (;;) {
            const mfsdp_sched_op_t *first = NULL;
            int ended = 0;
            for (int r = 0; r < n; r++) {
                while (at[r] < ops[r].nops &&
                       !(ops[r].ops[at[r]].wave == w && is_coll(&ops[r].ops[at[r]]))) {
                    at[r]++;
                }
                if (at[r] == ops[r].nops) {
                    ended++;
                    continue;
                }
                const mfsdp_sched_op_t *o = &ops[r].ops[at[r]];
                if (first == NULL) {
                    first = o;
                }
                cr_assert(o->kind == first->kind && o->peer == first->peer &&
                              o->seg == first->seg && o->off == first->off && o->len == first->len,
                          "%s: wave %d: collectives differ on rank %d", what, w, r);
                at[r]++;
            }
            cr_assert(ended == 0 || ended == n, "%s: wave %d: %d of %d ranks lack a collective",
                      what, w, ended, n);
            if (ended == n) {
                break;
            }
        }
        free(at);
    }
    return maxw + 1;
}

typedef struct wave_param {
    int world;
    int tail;
    int algo;
    size_t chunk;
} wave_param_t;

ParameterizedTestParameters(waves, matched)
{
    static wave_param_t p[7 * 2 * 3 * 3];
    static const size_t chunks[] = {4, 96, 1 << 20};
    size_t k = 0;
    for (int n = 1; n <= 7; n++) {
        for (int t = 0; t < 2; t++) {
            for (int a = 1; a <= 3; a++) {
                for (int c = 0; c < 3; c++) {
                    p[k++] = (wave_param_t){n, t, a, chunks[c]};
                }
            }
        }
    }
    return cr_make_param_array(wave_param_t, p, k);
}

ParameterizedTest(wave_param_t *prm, waves, matched)
{
    mfsdp_manifest_t *m = test_sched_manifest(1);
    mfsdp_plan_opts_t po = {.tail = prm->tail ? MFSDP_TAIL_SHARD : MFSDP_TAIL_OWNER};
    mfsdp_plan_t *plan = NULL;
    cr_assert_eq(mfsdp_plan_create(m, prm->world, &po, &plan), MFSDP_OK);
    int n = prm->world;
    for (size_t g = 0; g < m->ngroups; g++) {
        mfsdp_group_sched_t *gs = NULL;
        cr_assert_eq(mfsdp_group_sched_create(plan, g, &gs), MFSDP_OK);
        for (int dir = 0; dir < 2; dir++) {
            mfsdp_sched_ops_t *ops = calloc((size_t)n, sizeof(*ops));
            for (int r = 0; r < n; r++) {
                cr_assert_eq(mfsdp_sched_build(gs, r, dir, prm->algo, prm->chunk, &ops[r]),
                             MFSDP_OK);
            }
            char what[128];
            snprintf(what, sizeof(what), "n %d tail %d algo %d chunk %zu group %zu dir %d", n,
                     prm->tail, prm->algo, prm->chunk, g, dir);
            int nw = check_waves(ops, n, what);
            /* The native and direct gathers are one wave; the native reduce's window w of
             * chunks is wave w (one wave when every tensor is one chunk), as the direct
             * reduce's (whose chunks are also cut at rank blocks). */
            int one_chunk = prm->chunk == (size_t)1 << 20; /* the test tensors are smaller */
            if ((prm->algo != MFSDP_ALGO_CHAIN && dir == MFSDP_SCHED_DIR_GATHER) ||
                (prm->algo == MFSDP_ALGO_NATIVE && one_chunk)) {
                cr_assert(nw <= 1, "%s: %d waves, expected one", what, nw);
            }
            if (prm->algo == MFSDP_ALGO_NATIVE && dir == MFSDP_SCHED_DIR_REDUCE && n > 1 &&
                prm->chunk == 4) {
                cr_assert(nw > 1, "%s: %d waves: one-element chunks should fill many windows", what,
                          nw);
            }
            for (int r = 0; r < n; r++) {
                mfsdp_sched_ops_free(&ops[r]);
            }
            free(ops);
        }
        mfsdp_group_sched_destroy(gs);
    }
    mfsdp_plan_destroy(plan);
    test_sched_manifest_free(m);
}

/* Two segments with different owners, each more chunks than the window: owners send window w
 * in wave 2w (not all at once), and a chain of n ranks takes n - 1 + 2 (windows - 1) waves. */
Test(waves, chain_windows)
{
    mfsdp_manifest_t *m = test_sched_manifest(1);
    for (int n = 2; n <= 5; n++) {
        mfsdp_plan_t *plan = NULL;
        cr_assert_eq(mfsdp_plan_create(m, n, NULL, &plan), MFSDP_OK);
        mfsdp_group_sched_t *gs = NULL;
        cr_assert_eq(mfsdp_group_sched_create(plan, 1, &gs), MFSDP_OK);
        cr_assert_geq(gs->nsegs, 2);
        const size_t chunk = 64;
        mfsdp_sched_ops_t *ops = calloc((size_t)n, sizeof(*ops));
        for (int r = 0; r < n; r++) {
            cr_assert_eq(
                mfsdp_sched_build(gs, r, MFSDP_SCHED_DIR_GATHER, MFSDP_ALGO_CHAIN, chunk, &ops[r]),
                MFSDP_OK);
        }
        check_waves(ops, n, "chain_windows");
        size_t multi = 0;
        for (size_t s = 0; s < gs->nsegs; s++) {
            size_t nchunks = (gs->segs[s].ag_bytes + chunk - 1) / chunk;
            size_t windows = (nchunks + MFSDP_SCHED_WINDOW - 1) / MFSDP_SCHED_WINDOW;
            if (windows < 2) {
                continue; /* a small tensor (bias) */
            }
            multi++;
            int o = gs->segs[s].owner, last = -1;
            for (size_t i = 0; i < ops[o].nops; i++) {
                const mfsdp_sched_op_t *op = &ops[o].ops[i];
                if (op->seg == s && op->kind == MFSDP_SCHED_SEND) {
                    cr_expect_eq(op->wave, 2 * (int)(op->off / chunk / MFSDP_SCHED_WINDOW));
                }
            }
            int end = (o + n - 1) % n; /* last rank of the chain */
            for (size_t i = 0; i < ops[end].nops; i++) {
                const mfsdp_sched_op_t *op = &ops[end].ops[i];
                if (op->seg == s && op->wave > last) {
                    last = op->wave;
                }
            }
            cr_expect_eq(last, n - 2 + 2 * (int)(windows - 1), "n %d segment %zu: last wave %d", n,
                         s, last);
        }
        for (int r = 0; r < n; r++) {
            mfsdp_sched_ops_free(&ops[r]);
        }
        free(ops);
        mfsdp_group_sched_destroy(gs);
        mfsdp_plan_destroy(plan);
    }
    test_sched_manifest_free(m);
}

/* mfsdp_sched_wave_order: the selected ops by wave, list order kept within a wave; the wave
 * starts; a selected op with a negative wave refused, an unselected one ignored. */
static int select_coll(const mfsdp_sched_op_t *o)
{
    return is_coll(o);
}

Test(waves, order)
{
    /* kind, wave: list order 0..6 */
    static const struct {
        mfsdp_sched_kind_t kind;
        int wave;
    } spec[] = {{MFSDP_SCHED_REDUCE, 2}, {MFSDP_SCHED_SEND, 0},   {MFSDP_SCHED_TAIL, 0},
                {MFSDP_SCHED_REDUCE, 1}, {MFSDP_SCHED_APPLY, -1}, {MFSDP_SCHED_REDUCE, 0},
                {MFSDP_SCHED_BCAST, 2}};
    mfsdp_sched_op_t v[7];
    memset(v, 0, sizeof(v));
    for (size_t i = 0; i < 7; i++) {
        v[i].kind = spec[i].kind;
        v[i].wave = spec[i].wave;
    }
    mfsdp_sched_ops_t l = {.nops = 7, .ops = v};
    long *order = NULL;
    size_t *first = NULL, count = 0, nw = 0;
    cr_assert_eq(mfsdp_sched_wave_order(&l, select_coll, &order, &count, &first, &nw), MFSDP_OK);
    static const long want[] = {2, 5, 3, 0, 6};
    static const size_t want_first[] = {0, 2, 3, 5};
    cr_assert_eq(count, 5);
    cr_assert_eq(nw, 3);
    for (size_t k = 0; k < 5; k++) {
        cr_expect_eq(order[k], want[k], "order[%zu] = %ld, expected %ld", k, order[k], want[k]);
    }
    for (size_t w = 0; w <= 3; w++) {
        cr_expect_eq(first[w], want_first[w], "first[%zu] = %zu", w, first[w]);
    }
    free(order);
    free(first);
    /* Without first_p; then a selected op with a negative wave. */
    cr_assert_eq(mfsdp_sched_wave_order(&l, select_coll, &order, &count, NULL, NULL), MFSDP_OK);
    cr_expect_eq(count, 5);
    free(order);
    v[3].wave = -1;
    order = NULL;
    cr_expect_eq(mfsdp_sched_wave_order(&l, select_coll, &order, &count, NULL, NULL),
                 MFSDP_ERR_INTERNAL);
    cr_expect_null(order);
}
