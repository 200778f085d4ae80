/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner-collective schedules: op lists are pure functions of the plan (byte-identical when
 * rebuilt), rank-symmetric (every send has the matching receive on its peer, same length,
 * in the same order; collectives appear in the same order on every rank), acyclic, and
 * complete without deadlock under a rendezvous simulation of all ranks together, for every
 * algorithm, both directions, world sizes 1..7 and both tail policies. The chain reduce
 * visits ranks 0..n-1 in order and ends on the owner.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/manifest_util.h"
#include "core/schedule.h"

/* Ops an op waits for: dep .. dep + ndep - 1 (one when ndep <= 1), none for -1/DEP_ALL. */
static long ndeps(const mfsdp_sched_op_t *op)
{
    return op->dep < 0 ? 0 : op->ndep > 1 ? op->ndep : 1;
}

/* 1 when op j of a list waits, directly or through its dependencies, for op i. */
static int depends_on(const mfsdp_sched_ops_t *ops, size_t j, size_t i)
{
    const mfsdp_sched_op_t *op = &ops->ops[j];
    for (long q = 0; q < ndeps(op); q++) {
        size_t d = (size_t)(op->dep + q);
        if (d == i || (d > i && depends_on(ops, d, i))) {
            return 1;
        }
    }
    return 0;
}

/* MPI matches messages of one (source, tag) in posting order, on both sides. Posting order
 * follows completions, which MPI does not order across requests, so two sends (or two
 * receives) with the same peer and tag must be ordered by their dependencies, unless both
 * are posted up front (dep -1, list order). */
static void check_match_order(const mfsdp_sched_ops_t *ops, int r, const char *what)
{
    for (size_t j = 0; j < ops->nops; j++) {
        const mfsdp_sched_op_t *b = &ops->ops[j];
        if (b->kind != MFSDP_SCHED_SEND && b->kind != MFSDP_SCHED_RECV) {
            continue;
        }
        for (size_t i = 0; i < j; i++) {
            const mfsdp_sched_op_t *a = &ops->ops[i];
            if (a->kind != b->kind || a->peer != b->peer || a->tag != b->tag) {
                continue;
            }
            cr_assert((a->dep == -1 && b->dep == -1) || depends_on(ops, j, i),
                      "%s: rank %d ops %zu and %zu (%s peer %d tag %d) may be posted out of "
                      "order",
                      what, r, i, j, a->kind == MFSDP_SCHED_SEND ? "send" : "recv", a->peer,
                      a->tag);
        }
    }
}

/* Rendezvous simulation of one group's op lists on all ranks. */
static void simulate(const mfsdp_group_sched_t *gs, mfsdp_sched_ops_t *ops, int n, const char *what)
{
    int **posted = calloc((size_t)n, sizeof(int *));
    int **done = calloc((size_t)n, sizeof(int *));
    long **seq = calloc((size_t)n, sizeof(long *)); /* posting sequence per op */
    size_t total = 0;
    for (int r = 0; r < n; r++) {
        posted[r] = calloc(ops[r].nops + 1, sizeof(int));
        done[r] = calloc(ops[r].nops + 1, sizeof(int));
        seq[r] = calloc(ops[r].nops + 1, sizeof(long));
        total += ops[r].nops;
        for (size_t i = 0; i < ops[r].nops; i++) {
            long d = ops[r].ops[i].dep;
            cr_assert(d == -1 || d == MFSDP_SCHED_DEP_ALL ||
                          (d >= 0 && (size_t)(d + ndeps(&ops[r].ops[i])) <= i),
                      "%s: rank %d op %zu has dep %ld (+%d)", what, r, i, d, ops[r].ops[i].ndep);
        }
    }
    long clock = 0;
    size_t ndone = 0;
    int progress = 1;
    while (progress) {
        progress = 0;
        /* Post what is ready. */
        for (int r = 0; r < n; r++) {
            size_t left = 0; /* ops other than DEP_ALL ones still running */
            for (size_t i = 0; i < ops[r].nops; i++) {
                left += !done[r][i] && ops[r].ops[i].dep != MFSDP_SCHED_DEP_ALL;
            }
            for (size_t i = 0; i < ops[r].nops; i++) {
                const mfsdp_sched_op_t *op = &ops[r].ops[i];
                if (posted[r][i]) {
                    continue;
                }
                int ready = op->dep == -1 || (op->dep == MFSDP_SCHED_DEP_ALL && left == 0);
                if (op->dep >= 0) {
                    ready = 1;
                    for (long q = 0; q < ndeps(op); q++) {
                        ready &= done[r][op->dep + q];
                    }
                }
                if (!ready) {
                    continue;
                }
                posted[r][i] = 1;
                seq[r][i] = clock++;
                progress = 1;
                if (op->kind == MFSDP_SCHED_APPLY || op->kind == MFSDP_SCHED_COPYOUT) {
                    done[r][i] = 1;
                    ndone++;
                    left -= op->dep != MFSDP_SCHED_DEP_ALL;
                }
            }
        }
        /* Match point-to-point: the k-th send a->b with tag t meets the k-th receive. */
        for (int a = 0; a < n; a++) {
            for (size_t i = 0; i < ops[a].nops; i++) {
                const mfsdp_sched_op_t *s = &ops[a].ops[i];
                if (s->kind != MFSDP_SCHED_SEND || !posted[a][i] || done[a][i]) {
                    continue;
                }
                int b = s->peer;
                cr_assert(b >= 0 && b < n && b != a, "%s: bad peer %d", what, b);
                /* rank of this send among a->b,tag sends (in posting order) */
                size_t k = 0;
                for (size_t j = 0; j < ops[a].nops; j++) {
                    const mfsdp_sched_op_t *o = &ops[a].ops[j];
                    k += o->kind == MFSDP_SCHED_SEND && o->peer == b && o->tag == s->tag &&
                         posted[a][j] && seq[a][j] < seq[a][i];
                }
                /* the k-th posted receive on b from a with that tag */
                long best = -1;
                size_t cnt = 0;
                for (int pass = 0; pass < 1; pass++) {
                    long *order = calloc(ops[b].nops + 1, sizeof(long));
                    size_t no = 0;
                    for (size_t j = 0; j < ops[b].nops; j++) {
                        const mfsdp_sched_op_t *o = &ops[b].ops[j];
                        if (o->kind == MFSDP_SCHED_RECV && o->peer == a && o->tag == s->tag &&
                            posted[b][j]) {
                            order[no++] = (long)j;
                        }
                    }
                    /* sort by posting sequence */
                    for (size_t x = 1; x < no; x++) {
                        for (size_t y = x; y > 0 && seq[b][order[y]] < seq[b][order[y - 1]]; y--) {
                            long t = order[y];
                            order[y] = order[y - 1];
                            order[y - 1] = t;
                        }
                    }
                    cnt = no;
                    if (k < no) {
                        best = order[k];
                    }
                    free(order);
                }
                (void)cnt;
                if (best < 0) {
                    continue;
                }
                const mfsdp_sched_op_t *rv = &ops[b].ops[best];
                cr_assert_eq(rv->len, s->len, "%s: %d->%d tag %d: send %zu, receive %zu", what, a,
                             b, s->tag, s->len, rv->len);
                cr_assert_eq(rv->off, s->off, "%s: %d->%d tag %d: offsets %zu vs %zu", what, a, b,
                             s->tag, s->off, rv->off);
                cr_assert(!done[b][best], "%s: receive matched twice", what);
                done[a][i] = 1;
                done[b][best] = 1;
                ndone += 2;
                progress = 1;
            }
        }
        /* Collectives: complete when every rank posted the same next one. */
        for (;;) {
            const mfsdp_sched_op_t *first = NULL;
            long *pick = calloc((size_t)n, sizeof(long));
            int all = 1;
            for (int r = 0; r < n && all; r++) {
                long best = -1;
                for (size_t i = 0; i < ops[r].nops; i++) {
                    const mfsdp_sched_op_t *o = &ops[r].ops[i];
                    int coll = o->kind == MFSDP_SCHED_BCAST || o->kind == MFSDP_SCHED_REDUCE ||
                               o->kind == MFSDP_SCHED_TAIL;
                    if (coll && !done[r][i] && (best < 0 || (size_t)best > i)) {
                        best = (long)i;
                    }
                }
                if (best < 0 || !posted[r][best]) {
                    all = 0;
                    break;
                }
                pick[r] = best;
                const mfsdp_sched_op_t *o = &ops[r].ops[best];
                if (first == NULL) {
                    first = o;
                } else {
                    cr_assert(o->kind == first->kind && o->peer == first->peer &&
                                  o->seg == first->seg && o->len == first->len &&
                                  o->off == first->off,
                              "%s: collective order differs on rank %d", what, r);
                }
            }
            if (all && first != NULL) {
                for (int r = 0; r < n; r++) {
                    done[r][pick[r]] = 1;
                    ndone++;
                }
                progress = 1;
            }
            free(pick);
            if (!(all && first != NULL)) {
                break;
            }
        }
    }
    cr_assert_eq(ndone, total, "%s: deadlock: %zu of %zu ops completed", what, ndone, total);
    for (int r = 0; r < n; r++) {
        free(posted[r]);
        free(done[r]);
        free(seq[r]);
    }
    free(posted);
    free(done);
    free(seq);
    (void)gs;
}

typedef struct sched_param {
    int world;
    int tail;
    int algo;
} sched_param_t;

ParameterizedTestParameters(schedule, symmetric)
{
    static sched_param_t p[7 * 2 * 3];
    size_t k = 0;
    for (int n = 1; n <= 7; n++) {
        for (int t = 0; t < 2; t++) {
            for (int a = 1; a <= 3; a++) {
                p[k++] = (sched_param_t){n, t, a};
            }
        }
    }
    return cr_make_param_array(sched_param_t, p, k);
}

ParameterizedTest(sched_param_t *prm, schedule, symmetric)
{
    mfsdp_manifest_t *m = test_sched_manifest(0);
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
                cr_assert_eq(mfsdp_sched_build(gs, r, dir, prm->algo, 96, &ops[r]), MFSDP_OK);
                /* Pure: rebuilding gives the same bytes. */
                mfsdp_sched_ops_t again;
                cr_assert_eq(mfsdp_sched_build(gs, r, dir, prm->algo, 96, &again), MFSDP_OK);
                cr_assert_eq(again.nops, ops[r].nops);
                cr_assert(again.nops == 0 ||
                          memcmp(again.ops, ops[r].ops, again.nops * sizeof(*again.ops)) == 0);
                mfsdp_sched_ops_free(&again);
            }
            char what[96];
            snprintf(what, sizeof(what), "n %d tail %d algo %d group %zu dir %d", n, prm->tail,
                     prm->algo, g, dir);
            simulate(gs, ops, n, what);
            for (int r = 0; r < n; r++) {
                check_match_order(&ops[r], r, what);
            }
            /* Direct and native gathers: on every rank but the owner, the ops of a segment tile
             * its tensor in order, each inside one rank block (contiguous in FSDP's output,
             * where it is received in place as plain bytes). */
            if (dir == MFSDP_SCHED_DIR_GATHER && prm->algo != MFSDP_ALGO_CHAIN) {
                for (size_t s = 0; s < gs->nsegs; s++) {
                    const mfsdp_param_layout_t *e = &gs->layout->ag.entries[gs->segs[s].param];
                    size_t block = (size_t)e->c * e->row_bytes;
                    for (int r = 0; r < n && n > 1; r++) {
                        if (r == gs->segs[s].owner) {
                            continue;
                        }
                        size_t next = 0;
                        for (size_t i = 0; i < ops[r].nops; i++) {
                            const mfsdp_sched_op_t *o = &ops[r].ops[i];
                            if (o->seg != s || o->kind == MFSDP_SCHED_TAIL) {
                                continue;
                            }
                            cr_assert_eq(o->off, next, "%s: segment %zu rank %d: gap at %zu", what,
                                         s, r, next);
                            cr_assert(o->len > 0 && o->off / block == (o->off + o->len - 1) / block,
                                      "%s: segment %zu rank %d: op [%zu, +%zu) crosses a rank "
                                      "block of %zu bytes",
                                      what, s, r, o->off, o->len, block);
                            next += o->len;
                        }
                        cr_assert_eq(next, gs->segs[s].ag_bytes,
                                     "%s: segment %zu rank %d: %zu of %zu bytes", what, s, r, next,
                                     gs->segs[s].ag_bytes);
                    }
                }
            }
            /* Each owned tensor with a gradient is applied exactly once on its owner. */
            if (dir == MFSDP_SCHED_DIR_REDUCE) {
                for (size_t s = 0; s < gs->nsegs; s++) {
                    size_t covered = 0;
                    for (int r = 0; r < n; r++) {
                        for (size_t i = 0; i < ops[r].nops; i++) {
                            const mfsdp_sched_op_t *o = &ops[r].ops[i];
                            if (o->kind == MFSDP_SCHED_APPLY && o->seg == s) {
                                cr_assert_eq(r, gs->segs[s].owner, "%s: apply off-owner", what);
                                covered += o->len;
                            }
                        }
                    }
                    cr_assert_eq(covered, gs->segs[s].rs_entry >= 0 ? gs->segs[s].numel : 0,
                                 "%s: segment %zu applied over %zu elements", what, s, covered);
                }
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

/* The chain reduce's partial sums visit ranks 0, 1, ..., n-1 and end on the owner. */
Test(schedule, chain_reduce_rank_order)
{
    mfsdp_manifest_t *m = test_sched_manifest(0);
    for (int n = 2; n <= 5; n++) {
        mfsdp_plan_t *plan = NULL;
        cr_assert_eq(mfsdp_plan_create(m, n, NULL, &plan), MFSDP_OK);
        mfsdp_group_sched_t *gs = NULL;
        cr_assert_eq(mfsdp_group_sched_create(plan, 1, &gs), MFSDP_OK);
        for (size_t s = 0; s < gs->nsegs; s++) {
            int owner = gs->segs[s].owner;
            for (int r = 0; r < n; r++) {
                mfsdp_sched_ops_t ops;
                cr_assert_eq(mfsdp_sched_build(gs, r, MFSDP_SCHED_DIR_REDUCE, MFSDP_ALGO_CHAIN,
                                               1 << 20, &ops),
                             MFSDP_OK);
                for (size_t i = 0; i < ops.nops; i++) {
                    const mfsdp_sched_op_t *o = &ops.ops[i];
                    if (o->seg != s || o->kind == MFSDP_SCHED_TAIL) {
                        continue;
                    }
                    if (o->kind == MFSDP_SCHED_SEND) {
                        int want = r < n - 1 ? r + 1 : owner;
                        cr_expect_eq(o->peer, want, "n %d rank %d sends to %d", n, r, o->peer);
                        cr_expect(o->combine);
                    }
                    if (o->kind == MFSDP_SCHED_RECV && o->buf == MFSDP_BUF_PIN) {
                        cr_expect_eq(o->peer, r - 1);
                    }
                    if (o->kind == MFSDP_SCHED_RECV && o->buf == MFSDP_BUF_FINAL) {
                        cr_expect_eq(r, owner);
                        cr_expect_eq(o->peer, n - 1);
                    }
                }
                mfsdp_sched_ops_free(&ops);
            }
        }
        mfsdp_group_sched_destroy(gs);
        mfsdp_plan_destroy(plan);
    }
    test_sched_manifest_free(m);
}

Test(schedule, bad_arguments)
{
    mfsdp_manifest_t *m = test_sched_manifest(0);
    mfsdp_plan_t *plan = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 3, NULL, &plan), MFSDP_OK);
    mfsdp_group_sched_t *gs = NULL;
    cr_assert_eq(mfsdp_group_sched_create(plan, 0, &gs), MFSDP_OK);
    mfsdp_sched_ops_t ops = {0};
    cr_expect_eq(mfsdp_sched_build(gs, 0, MFSDP_SCHED_DIR_GATHER, MFSDP_ALGO_AUTO, 64, &ops),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_sched_build(gs, 3, MFSDP_SCHED_DIR_GATHER, MFSDP_ALGO_DIRECT, 64, &ops),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_sched_build(gs, 0, MFSDP_SCHED_DIR_GATHER, MFSDP_ALGO_CHAIN, 2, &ops),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_group_sched_create(plan, 3, &gs), MFSDP_ERR_INVALID_ARG);
    cr_expect_null(ops.ops);
    mfsdp_group_sched_destroy(gs);
    mfsdp_plan_destroy(plan);
    test_sched_manifest_free(m);
}
