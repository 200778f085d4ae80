/* SPDX-License-Identifier: Apache-2.0 */
#include "core/join.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/fsdp2_pattern.h"
#include "core/layout.h"
#include "core/matcher.h"
#include "core/rs_subset.h"

/* Pass templates of a configuration: index kind * 2 + warm, where a warm pass follows a
 * forward-only pass (groups that do not reshard after forward are still unsharded). */
#define NTMPL            6
#define TMPL(kind, warm) ((size_t)(kind)*2 + (size_t)(warm))
#define NONE             ((size_t)-1)

enum { P_UNKNOWN = 2 };

typedef struct tmpl {
    size_t len;
    mfsdp_fsdp2_call_t *e;
    size_t *role; /* per entry: index of the same (phase, kind, group) in the model's roles */
} tmpl_t;

/* One FSDP2 configuration and its pass templates. States are (template, position, seen a
 * reduce-scatter) = base[t] + 2 * position + seen; position len is the pass end. */
typedef struct model {
    unsigned char *reshard;
    mfsdp_fsdp2_config_t cfg;
    /* Roles: every (phase, kind, group) of a training pass, cold or warm, in pass order. Every
     * template is a subsequence of them. */
    mfsdp_fsdp2_call_t *role;
    size_t nroles;
    tmpl_t t[NTMPL];
    size_t base[NTMPL + 1];
    size_t nstates;
    char text[160];
} model_t;

/* A state that consumed call i, and the state it went to. */
typedef struct cons {
    size_t state;
    size_t succ;
} cons_t;

typedef struct parse {
    cons_t *cons;
    size_t ncons, capcons;
    size_t *start; /* per call: first index into cons; start[n] = ncons */
    unsigned char *useful;
    size_t fail_at; /* NONE when the whole record parses */
    size_t *fail_live;
    size_t nfail_live;
} parse_t;

typedef struct jctx {
    const mfsdp_manifest_t *m;
    size_t G;
    mfsdp_call_sig_t *ag, *rs;
    mfsdp_rs_subset_t **solver;
    const mfsdp_record_call_t *calls;
    size_t n;
    size_t comm;
    /* scratch over a model's states */
    size_t cap;
    uint32_t *seen, *mark;
    uint32_t seen_now, mark_now;
    size_t *queue, *parent;
} jctx_t;

typedef struct pass_rec {
    size_t t;
    unsigned char *present; /* per template entry: 1, 0, or P_UNKNOWN */
    int complete;
} pass_rec_t;

/* ---------------------------------------------------------------- configurations */

static void model_free(model_t *md)
{
    for (size_t t = 0; t < NTMPL; t++) {
        free(md->t[t].e);
        free(md->t[t].role);
    }
    free(md->role);
    free(md->reshard);
    memset(md, 0, sizeof(*md));
}

static int same_call(const mfsdp_fsdp2_call_t *a, const mfsdp_fsdp2_call_t *b)
{
    return a->kind == b->kind && a->group == b->group && a->phase == b->phase;
}

/* Build the six templates of a configuration. */
static mfsdp_status_t model_build(const mfsdp_manifest_t *m, model_t *md)
{
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_fsdp2_gen_t *gen = NULL;
    size_t cap = mfsdp_fsdp2_max_pass_calls(m) + 1, n = 0;
    mfsdp_fsdp2_call_t *scratch = calloc(cap, sizeof(*scratch));
    if (scratch == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    MFSDP_CHECK_GOTO(mfsdp_fsdp2_gen_create(m, &md->cfg, &gen), st, out);
    for (int kind = 0; kind < MFSDP_PASS_KINDS; kind++) {
        for (int warm = 0; warm < 2; warm++) {
            tmpl_t *t = &md->t[TMPL(kind, warm)];
            mfsdp_fsdp2_gen_reset(gen);
            if (warm) {
                MFSDP_CHECK_GOTO(
                    mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_FORWARD, NULL, scratch, cap, &n), st, out);
            }
            t->e = calloc(cap, sizeof(*t->e));
            t->role = calloc(cap, sizeof(size_t));
            if (t->e == NULL || t->role == NULL) {
                st = MFSDP_ERR_NO_MEMORY;
                goto out;
            }
            MFSDP_CHECK_GOTO(
                mfsdp_fsdp2_gen_pass(gen, (mfsdp_pass_kind_t)kind, NULL, t->e, cap, &t->len), st,
                out);
        }
    }
    /* Roles: merge the cold and the warm training pass (a warm pass skips some forward
     * all-gathers and may prefetch one more group). */
    const tmpl_t *tc = &md->t[TMPL(MFSDP_PASS_TRAIN, 0)], *tw = &md->t[TMPL(MFSDP_PASS_TRAIN, 1)];
    md->role = calloc(tc->len + tw->len + 1, sizeof(*md->role));
    if (md->role == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0, j = 0; i < tc->len || j < tw->len;) {
        int warm_in_cold = 0;
        for (size_t k = i; j < tw->len && k < tc->len && !warm_in_cold; k++) {
            warm_in_cold = same_call(&tw->e[j], &tc->e[k]);
        }
        if (i < tc->len && j < tw->len && same_call(&tc->e[i], &tw->e[j])) {
            md->role[md->nroles++] = tc->e[i++];
            j++;
        } else if (j < tw->len && !warm_in_cold) {
            md->role[md->nroles++] = tw->e[j++];
        } else {
            md->role[md->nroles++] = tc->e[i++];
        }
    }
    for (size_t k = 0; k < NTMPL; k++) {
        tmpl_t *t = &md->t[k];
        size_t from = 0;
        for (size_t p = 0; p < t->len; p++) {
            t->role[p] = NONE;
            for (size_t r = from; r < md->nroles && t->role[p] == NONE; r++) {
                if (same_call(&t->e[p], &md->role[r])) {
                    t->role[p] = r;
                }
            }
            if (t->role[p] == NONE) {
                st = MFSDP_ERR_INTERNAL; /* every pass is a subsequence of the roles */
                goto out;
            }
            from = t->role[p] + 1;
        }
    }
    md->nstates = 0;
    for (size_t k = 0; k < NTMPL; k++) {
        md->base[k] = md->nstates;
        md->nstates += 2 * (md->t[k].len + 1);
    }
    md->base[NTMPL] = md->nstates;
out:
    mfsdp_fsdp2_gen_destroy(gen);
    free(scratch);
    return st;
}

static int model_equal(const model_t *a, const model_t *b)
{
    for (size_t k = 0; k < NTMPL; k++) {
        if (a->t[k].len != b->t[k].len) {
            return 0;
        }
        for (size_t p = 0; p < a->t[k].len; p++) {
            if (!same_call(&a->t[k].e[p], &b->t[k].e[p])) {
                return 0;
            }
        }
    }
    return 1;
}

static void model_text(const mfsdp_manifest_t *m, model_t *md)
{
    size_t G = m->ngroups, first = md->cfg.root ? 1 : 0, kept = 0, off = 0;
    char keep[100] = "";
    for (size_t g = first; g < G; g++) {
        kept += !md->reshard[g];
    }
    if (kept == 0 || kept == G - first) {
        snprintf(keep, sizeof(keep), "%s", kept == 0 ? "none" : "all");
    } else {
        for (size_t g = first; g < G && off < sizeof(keep); g++) {
            if (!md->reshard[g]) {
                off += (size_t)snprintf(keep + off, sizeof(keep) - off, "%s%s", off ? " " : "",
                                        m->groups[g].name);
            }
        }
    }
    char root[64];
    if (md->cfg.root) {
        snprintf(root, sizeof(root), "root %s%s", m->groups[0].name,
                 md->reshard[0] ? " resharded after forward" : "");
    } else {
        snprintf(root, sizeof(root), "no root group");
    }
    snprintf(md->text, sizeof(md->text),
             "%s, backward prefetch %d, kept unsharded after forward: %s", root, md->cfg.prefetch,
             keep);
}

/* The configuration space, FSDP2's defaults first: (root, root resharded after forward,
 * number of last groups kept unsharded after forward; NONE: every group), each with backward
 * prefetch 1 and 0. These are the wrappings seen in practice: FSDP2's default, a root that
 * reshards, reshard_after_forward=False everywhere, torchtitan's wrapping (no root; the
 * [norm, output] group kept, and in older releases the last block too), and without a root
 * every group resharded. Not more: each further configuration is one more way to read a
 * record, and a record that two readings label differently is refused (a root model that
 * keeps its last block, for one, reads a 2-block default record as eval + training). */
static mfsdp_status_t models_build(const mfsdp_manifest_t *m, model_t **models_p, size_t *n_p)
{
    static const struct {
        int root, rr;
        size_t keep;
    } space[] = {
        {1, 0, 0}, {1, 1, 0}, {1, 0, NONE}, {0, 0, 1}, {0, 0, 2}, {0, 0, 0}, {0, 0, NONE},
    };
    size_t G = m->ngroups, n = 0, nspace = sizeof(space) / sizeof(space[0]);
    model_t *models = calloc(2 * nspace + 1, sizeof(*models));
    if (models == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t si = 0; si < nspace; si++) {
        for (int pf = 1; pf >= 0; pf--) {
            size_t first = (size_t)space[si].root, others = G - first;
            size_t keep = space[si].keep == NONE ? others : space[si].keep;
            if (keep > others) {
                continue;
            }
            model_t *md = &models[n];
            md->reshard = calloc(G + 1, 1);
            if (md->reshard == NULL) {
                goto nomem;
            }
            for (size_t g = 0; g < G; g++) {
                md->reshard[g] = g < first ? (unsigned char)space[si].rr : (g < G - keep);
            }
            md->cfg = (mfsdp_fsdp2_config_t){space[si].root, pf, md->reshard};
            mfsdp_status_t st = model_build(m, md);
            if (st != MFSDP_OK) {
                model_free(md);
                for (size_t i = 0; i < n; i++) {
                    model_free(&models[i]);
                }
                free(models);
                return st;
            }
            int dup = 0;
            for (size_t i = 0; i < n && !dup; i++) {
                dup = model_equal(&models[i], md);
            }
            if (dup) {
                model_free(md);
                continue;
            }
            model_text(m, md);
            n++;
        }
    }
    *models_p = models;
    *n_p = n;
    return MFSDP_OK;
nomem:
    for (size_t i = 0; i <= n; i++) {
        model_free(&models[i]);
    }
    free(models);
    return MFSDP_ERR_NO_MEMORY;
}

/* ---------------------------------------------------------------- parsing */

static void decode(const model_t *md, size_t s, size_t *t_p, size_t *p_p, int *r_p)
{
    size_t t = 0;
    while (s >= md->base[t + 1]) {
        t++;
    }
    *t_p = t;
    *p_p = (s - md->base[t]) / 2;
    *r_p = (int)((s - md->base[t]) % 2);
}

static size_t encode(const model_t *md, size_t t, size_t p, int r)
{
    return md->base[t] + 2 * p + (size_t)r;
}

/* Empty moves from s: from a pass end (a training pass needs a reduce-scatter) to the start
 * of any pass. A reduce-scatter is never skipped: with identical blocks, "some group had no
 * gradient" explains almost any record in several ways (which block was it?), so a record
 * with a missing reduce-scatter is refused rather than guessed. */
static size_t eps_moves(const model_t *md, size_t s, size_t out[3])
{
    size_t t, p;
    int r;
    decode(md, s, &t, &p, &r);
    const tmpl_t *tp = &md->t[t];
    if (p < tp->len) {
        return 0;
    }
    size_t kind = t / 2;
    if (kind == MFSDP_PASS_TRAIN && !r) {
        return 0;
    }
    int warm = kind == MFSDP_PASS_FORWARD;
    for (int k = 0; k < MFSDP_PASS_KINDS; k++) {
        out[k] = encode(md, TMPL(k, warm), 0, 0);
    }
    return MFSDP_PASS_KINDS;
}

static int fits(jctx_t *c, const mfsdp_call_sig_t *call, size_t g)
{
    const mfsdp_call_sig_t *full = call->kind == MFSDP_CALL_ALLGATHER ? &c->ag[g] : &c->rs[g];
    if (full->count == 0 || full->dtype != call->dtype) {
        return 0;
    }
    if (call->kind == MFSDP_CALL_ALLGATHER) {
        return full->count == call->count;
    }
    size_t nsets = 0;
    const unsigned char *sets[2];
    if (mfsdp_rs_subset_find(c->solver[g], call->count, &nsets, sets) != MFSDP_OK) {
        return 0;
    }
    return nsets > 0;
}

/* Can state s consume call i? *succ_p gets the state after it. */
static int consumes(jctx_t *c, const model_t *md, size_t s, size_t i, size_t *succ_p)
{
    size_t t, p;
    int r;
    decode(md, s, &t, &p, &r);
    const tmpl_t *tp = &md->t[t];
    const mfsdp_call_sig_t *call = &c->calls[i].sig;
    if (p == tp->len || tp->e[p].kind != call->kind || !fits(c, call, tp->e[p].group)) {
        return 0;
    }
    *succ_p = encode(md, t, p + 1, r || call->kind == MFSDP_CALL_REDUCE_SCATTER);
    return 1;
}

/* Close the list (seeds at list[0..n)) under empty moves; returns the new length. */
static size_t close_list(jctx_t *c, const model_t *md, size_t *list, size_t n)
{
    uint32_t now = ++c->seen_now;
    size_t out = 0;
    for (size_t i = 0; i < n; i++) {
        if (c->seen[list[i]] != now) {
            c->seen[list[i]] = now;
            list[out++] = list[i];
        }
    }
    for (size_t i = 0; i < out; i++) {
        size_t mv[3];
        size_t k = eps_moves(md, list[i], mv);
        for (size_t j = 0; j < k; j++) {
            if (c->seen[mv[j]] != now) {
                c->seen[mv[j]] = now;
                list[out++] = mv[j];
            }
        }
    }
    return out;
}

static void parse_free(parse_t *ps)
{
    free(ps->cons);
    free(ps->start);
    free(ps->useful);
    free(ps->fail_live);
    memset(ps, 0, sizeof(*ps));
}

static size_t initial_states(const model_t *md, size_t *list)
{
    for (int k = 0; k < MFSDP_PASS_KINDS; k++) {
        list[k] = encode(md, TMPL(k, 0), 0, 0);
    }
    return MFSDP_PASS_KINDS;
}

/* Forward: the states that can consume each call; backward: those on a complete parse. */
static mfsdp_status_t parse_model(jctx_t *c, const model_t *md, parse_t *ps)
{
    mfsdp_status_t st = MFSDP_OK;
    size_t *live = calloc(md->nstates + 1, sizeof(size_t));
    size_t *next = calloc(md->nstates + 1, sizeof(size_t));
    memset(ps, 0, sizeof(*ps));
    ps->fail_at = NONE;
    ps->start = calloc(c->n + 1, sizeof(size_t));
    if (live == NULL || next == NULL || ps->start == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    size_t nlive = close_list(c, md, live, initial_states(md, live));
    for (size_t i = 0; i < c->n; i++) {
        ps->start[i] = ps->ncons;
        size_t nnext = 0;
        for (size_t k = 0; k < nlive; k++) {
            size_t succ;
            if (!consumes(c, md, live[k], i, &succ)) {
                continue;
            }
            if (ps->ncons == ps->capcons) {
                size_t cap = ps->capcons ? 2 * ps->capcons : 1024;
                cons_t *nc = realloc(ps->cons, cap * sizeof(*nc));
                if (nc == NULL) {
                    st = MFSDP_ERR_NO_MEMORY;
                    goto out;
                }
                ps->cons = nc;
                ps->capcons = cap;
            }
            ps->cons[ps->ncons++] = (cons_t){live[k], succ};
            next[nnext++] = succ;
        }
        if (nnext == 0) {
            ps->fail_at = i;
            ps->fail_live = live;
            ps->nfail_live = nlive;
            live = NULL;
            goto out;
        }
        nlive = close_list(c, md, next, nnext);
        size_t *tmp = live;
        live = next;
        next = tmp;
    }
    ps->start[c->n] = ps->ncons;
    ps->useful = calloc(ps->ncons + 1, 1);
    if (ps->useful == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t k = ps->start[c->n - 1]; k < ps->ncons; k++) {
        ps->useful[k] = 1; /* a record may end anywhere */
    }
    for (size_t i = c->n - 1; i-- > 0;) {
        uint32_t mark = ++c->mark_now;
        for (size_t k = ps->start[i + 1]; k < ps->start[i + 2]; k++) {
            if (ps->useful[k]) {
                c->mark[ps->cons[k].state] = mark;
            }
        }
        for (size_t k = ps->start[i]; k < ps->start[i + 1]; k++) {
            live[0] = ps->cons[k].succ;
            size_t nl = close_list(c, md, live, 1);
            for (size_t j = 0; j < nl && !ps->useful[k]; j++) {
                ps->useful[k] = c->mark[live[j]] == mark;
            }
        }
    }
out:
    free(live);
    free(next);
    return st;
}

/* The groups the states of a failed parse expected, for a message. */
static void expected_text(jctx_t *c, const model_t *md, const parse_t *ps, char *buf, size_t len)
{
    size_t off = 0, shown = 0;
    size_t seen_kind[4], seen_group[4];
    buf[0] = '\0';
    for (size_t k = 0; k < ps->nfail_live && shown < 4; k++) {
        size_t t, p;
        int r;
        decode(md, ps->fail_live[k], &t, &p, &r);
        if (p == md->t[t].len) {
            continue;
        }
        const mfsdp_fsdp2_call_t *e = &md->t[t].e[p];
        int dup = 0;
        for (size_t j = 0; j < shown && !dup; j++) {
            dup = seen_kind[j] == (size_t)e->kind && seen_group[j] == e->group;
        }
        if (dup) {
            continue;
        }
        seen_kind[shown] = (size_t)e->kind;
        seen_group[shown] = e->group;
        char sb[96];
        mfsdp_call_sig_format(e->kind == MFSDP_CALL_ALLGATHER ? &c->ag[e->group] : &c->rs[e->group],
                              sb, sizeof(sb));
        if (off < len) {
            off += (size_t)snprintf(buf + off, len - off, "%s%s of group %s", shown ? " or " : "",
                                    sb, c->m->groups[e->group].name);
        }
        shown++;
    }
    if (shown == 0) {
        snprintf(buf, len, "the end of the record");
    }
}

/* ---------------------------------------------------------------- one parse, as passes */

static void passes_free(pass_rec_t *pr, size_t n)
{
    for (size_t i = 0; pr != NULL && i < n; i++) {
        free(pr[i].present);
    }
    free(pr);
}

typedef struct path_ctx {
    pass_rec_t *pass;
    size_t npass, cap;
} path_ctx_t;

static mfsdp_status_t open_pass(const model_t *md, path_ctx_t *pc, size_t t)
{
    if (pc->npass == pc->cap) {
        size_t cap = pc->cap ? 2 * pc->cap : 16;
        pass_rec_t *np = realloc(pc->pass, cap * sizeof(*np));
        if (np == NULL) {
            return MFSDP_ERR_NO_MEMORY;
        }
        pc->pass = np;
        pc->cap = cap;
    }
    pass_rec_t *p = &pc->pass[pc->npass];
    p->t = t;
    p->complete = 0;
    p->present = malloc(md->t[t].len + 1);
    if (p->present == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    memset(p->present, P_UNKNOWN, md->t[t].len + 1);
    pc->npass++;
    return MFSDP_OK;
}

/* Apply one empty move a -> b of the chosen parse to the pass list. */
static mfsdp_status_t apply_move(const model_t *md, path_ctx_t *pc, size_t a, size_t b)
{
    size_t ta, pa, tb, pb;
    int ra, rb;
    decode(md, a, &ta, &pa, &ra);
    decode(md, b, &tb, &pb, &rb);
    if (pa < md->t[ta].len) {
        pc->pass[pc->npass - 1].present[pa] = 0; /* a skipped reduce-scatter */
        return MFSDP_OK;
    }
    pc->pass[pc->npass - 1].complete = 1;
    return open_pass(md, pc, tb);
}

/* From the sources, find the first state (breadth first over empty moves) that is a useful
 * consumer of call i, and apply the moves on the way. */
static mfsdp_status_t walk_to(jctx_t *c, const model_t *md, const parse_t *ps, path_ctx_t *pc,
                              const size_t *src, size_t nsrc, size_t i, size_t *chosen_p)
{
    uint32_t mark = ++c->mark_now;
    for (size_t k = ps->start[i]; k < ps->start[i + 1]; k++) {
        if (ps->useful[k]) {
            c->mark[ps->cons[k].state] = mark;
        }
    }
    uint32_t now = ++c->seen_now;
    size_t head = 0, tail = 0, found = NONE;
    for (size_t k = 0; k < nsrc; k++) {
        if (c->seen[src[k]] != now) {
            c->seen[src[k]] = now;
            c->parent[src[k]] = NONE;
            c->queue[tail++] = src[k];
        }
    }
    while (head < tail && found == NONE) {
        size_t s = c->queue[head++];
        if (c->mark[s] == mark) {
            found = s;
            break;
        }
        size_t mv[3];
        size_t k = eps_moves(md, s, mv);
        for (size_t j = 0; j < k; j++) {
            if (c->seen[mv[j]] != now) {
                c->seen[mv[j]] = now;
                c->parent[mv[j]] = s;
                c->queue[tail++] = mv[j];
            }
        }
    }
    if (found == NONE) {
        return MFSDP_ERR_INTERNAL; /* a useful consumer is always reachable */
    }
    /* The moves, from the source to found. */
    size_t depth = 0;
    for (size_t s = found; c->parent[s] != NONE; s = c->parent[s]) {
        c->queue[depth++] = s;
    }
    size_t from = found;
    for (size_t s = found; c->parent[s] != NONE; s = c->parent[s]) {
        from = c->parent[s];
    }
    if (pc->npass == 0) {
        size_t t, p;
        int r;
        decode(md, from, &t, &p, &r);
        MFSDP_CHECK(open_pass(md, pc, t));
    }
    while (depth-- > 0) {
        size_t to = c->queue[depth];
        MFSDP_CHECK(apply_move(md, pc, c->parent[to], to));
    }
    *chosen_p = found;
    return MFSDP_OK;
}

/* One parse of the whole record as a list of passes. */
static mfsdp_status_t extract_passes(jctx_t *c, const model_t *md, const parse_t *ps,
                                     path_ctx_t *pc)
{
    size_t src[3];
    size_t nsrc = initial_states(md, src);
    for (size_t i = 0; i < c->n; i++) {
        size_t s = NONE;
        MFSDP_CHECK(walk_to(c, md, ps, pc, src, nsrc, i, &s));
        size_t succ = NONE;
        if (!consumes(c, md, s, i, &succ)) {
            return MFSDP_ERR_INTERNAL;
        }
        size_t t, p;
        int r;
        decode(md, s, &t, &p, &r);
        pc->pass[pc->npass - 1].present[p] = 1;
        src[0] = succ;
        nsrc = 1;
    }
    size_t t, p;
    int r;
    decode(md, src[0], &t, &p, &r);
    if (p == md->t[t].len && (t / 2 != MFSDP_PASS_TRAIN || r)) {
        pc->pass[pc->npass - 1].complete = 1;
    }
    return MFSDP_OK;
}

/* ---------------------------------------------------------------- output */

/* Roles (indices into the cold training pass) that a pass of kind takes part in. */
static int applies(const model_t *md, int kind, size_t j)
{
    const mfsdp_fsdp2_call_t *e = &md->role[j];
    switch (kind) {
    case MFSDP_PASS_TRAIN:
        return 1;
    case MFSDP_PASS_NO_SYNC:
        return e->kind == MFSDP_CALL_ALLGATHER;
    default:
        return e->kind == MFSDP_CALL_ALLGATHER && e->phase == MFSDP_PHASE_FORWARD;
    }
}

/* Add a pass's presence of each role to pres/abs. A role its template lacks (a forward
 * all-gather a warm pass skips) is absent once the pass got past it. */
static void tally(const model_t *md, const pass_rec_t *pr, size_t *pres, size_t *abs)
{
    const tmpl_t *tp = &md->t[pr->t];
    size_t ncold = md->nroles;
    int kind = (int)(pr->t / 2);
    size_t reached = 0; /* roles below this index were passed */
    for (size_t p = 0; p < tp->len; p++) {
        if (pr->present[p] == 1) {
            reached = tp->role[p] + 1;
        }
    }
    if (pr->complete) {
        reached = ncold;
    }
    for (size_t p = 0; p < tp->len; p++) {
        if (pr->present[p] == 1) {
            pres[tp->role[p]]++;
        } else if (pr->present[p] == 0 || (pr->complete && pr->present[p] == P_UNKNOWN)) {
            abs[tp->role[p]]++;
        }
    }
    for (size_t j = 0; j < ncold && j < reached; j++) {
        int in_tmpl = 0;
        for (size_t p = 0; p < tp->len && !in_tmpl; p++) {
            in_tmpl = tp->role[p] == j;
        }
        if (!in_tmpl && applies(md, kind, j)) {
            abs[j]++;
        }
    }
}

/* Append the roles of kind with pres > 0 to seq (optional where abs > 0). */
static void emit_roles(const model_t *md, int kind, const size_t *pres, const size_t *abs,
                       mfsdp_call_t *seq, size_t *n)
{
    for (size_t j = 0; j < md->nroles; j++) {
        if (applies(md, kind, j) && pres[j] > 0) {
            seq[*n].kind = md->role[j].kind;
            seq[*n].group = md->role[j].group;
            seq[*n].flags = abs[j] > 0 ? MFSDP_CALL_OPTIONAL : 0;
            (*n)++;
        }
    }
}

/* Smallest period q (then warm-up w) of the kinds with two full periods after the warm-up and
 * the warm-up's kinds those of its slots; 0 when none. */
static size_t find_period(const int *kinds, size_t k, size_t *w_p)
{
    for (size_t q = 1; 2 * q <= k; q++) {
        for (size_t w = 0; w + 2 * q <= k; w++) {
            int ok = 1;
            for (size_t i = w; i + q < k && ok; i++) {
                ok = kinds[i] == kinds[i + q];
            }
            for (size_t i = 0; i < w && ok; i++) {
                /* the slot of pass i is i mod q, whose kind the periodic part shows */
                size_t j = i + q * ((w - i + q - 1) / q);
                ok = kinds[i] == kinds[j];
            }
            if (ok) {
                *w_p = w;
                return q;
            }
        }
    }
    return 0;
}

/* Route every recorded call with a matcher of the result; 0 and a message when it stops or
 * routes a call elsewhere. */
static mfsdp_status_t check_result(jctx_t *c, int world, const size_t *label, mfsdp_call_t *seq,
                                   size_t nseq, mfsdp_iteration_t it, int *ok_p, char *msg,
                                   size_t msglen)
{
    mfsdp_manifest_t tmp = *c->m;
    tmp.sequence = seq;
    tmp.ncalls = nseq;
    tmp.iteration = it;
    mfsdp_matcher_t *mt = NULL;
    *ok_p = 0;
    mfsdp_status_t st = mfsdp_matcher_create(&tmp, world, msg, msglen, &mt);
    if (st != MFSDP_OK) {
        return st == MFSDP_ERR_NO_MEMORY ? st : MFSDP_OK;
    }
    *ok_p = 1;
    for (size_t i = 0; i < c->n && *ok_p; i++) {
        mfsdp_match_t mm;
        char e[900];
        st = mfsdp_matcher_next(mt, &c->calls[i].sig, &mm, e, sizeof(e));
        if (st == MFSDP_ERR_NO_MEMORY) {
            break;
        }
        if (st != MFSDP_OK) {
            snprintf(msg, msglen, "comms[%zu].calls[%zu]: %s", c->comm, i, e);
            *ok_p = 0;
        } else if (mm.group != label[i]) {
            snprintf(msg, msglen, "comms[%zu].calls[%zu] goes to group %s instead of %s", c->comm,
                     i, c->m->groups[mm.group].name, c->m->groups[label[i]].name);
            *ok_p = 0;
        }
    }
    mfsdp_matcher_destroy(mt);
    return st == MFSDP_ERR_NO_MEMORY ? st : MFSDP_OK;
}

/* ---------------------------------------------------------------- the join */

void mfsdp_join_free(mfsdp_join_t *j)
{
    if (j != NULL) {
        free(j->sequence);
        free(j);
    }
}

static void ctx_free(jctx_t *c)
{
    for (size_t g = 0; c->solver != NULL && g < c->G; g++) {
        mfsdp_rs_subset_destroy(c->solver[g]);
    }
    free(c->solver);
    free(c->ag);
    free(c->rs);
    free(c->seen);
    free(c->mark);
    free(c->queue);
    free(c->parent);
}

static mfsdp_status_t ctx_init(jctx_t *c, const mfsdp_manifest_t *m, int world, char *err,
                               size_t errlen)
{
    memset(c, 0, sizeof(*c));
    c->m = m;
    c->G = m->ngroups;
    c->ag = calloc(c->G + 1, sizeof(*c->ag));
    c->rs = calloc(c->G + 1, sizeof(*c->rs));
    c->solver = calloc(c->G + 1, sizeof(*c->solver));
    if (c->ag == NULL || c->rs == NULL || c->solver == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t g = 0; g < c->G; g++) {
        mfsdp_group_layout_t *l = NULL;
        mfsdp_status_t st = mfsdp_group_layout_create(&m->groups[g], world, &l);
        if (st == MFSDP_OK) {
            st = mfsdp_rs_subset_create(&m->groups[g], world, &c->solver[g]);
        }
        if (st != MFSDP_OK) {
            mfsdp_group_layout_destroy(l);
            SETERR("group %s: cannot compute its FSDP layout at world size %d (%s)",
                   m->groups[g].name, world, mfsdp_status_string(st));
            return st;
        }
        c->ag[g] = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, l->ag.count, l->ag.dtype};
        c->rs[g] = (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, l->rs.count, l->rs.dtype};
        mfsdp_group_layout_destroy(l);
    }
    return MFSDP_OK;
}

static int fits_any(jctx_t *c, const mfsdp_call_sig_t *call)
{
    for (size_t g = 0; g < c->G; g++) {
        if (fits(c, call, g)) {
            return 1;
        }
    }
    return 0;
}

/* Pick the communicator and check that each of its calls fits some group. */
static mfsdp_status_t choose_comm(jctx_t *c, int world, const mfsdp_record_t *rec, char *err,
                                  size_t errlen)
{
    const mfsdp_record_comm_t *rc = NULL;
    for (size_t k = 0; k < rec->ncomms && rc == NULL; k++) {
        if (rec->comms[k].size != world) {
            continue;
        }
        for (size_t i = 0; i < rec->comms[k].ncalls && rc == NULL; i++) {
            if (fits_any(c, &rec->comms[k].calls[i].sig)) {
                rc = &rec->comms[k];
                c->comm = k;
            }
        }
    }
    if (rc == NULL) {
        SETERR("record: no communicator of size %d made a call of the manifest's groups", world);
        return MFSDP_ERR_MISMATCH;
    }
    c->calls = rc->calls;
    c->n = rc->ncalls;
    for (size_t i = 0; i < c->n; i++) {
        if (!fits_any(c, &c->calls[i].sig)) {
            char sb[96];
            mfsdp_call_sig_format(&c->calls[i].sig, sb, sizeof(sb));
            SETERR("record: comms[%zu].calls[%zu] %s fits no group of the manifest (%s)", c->comm,
                   i, sb,
                   c->calls[i].sig.kind == MFSDP_CALL_ALLGATHER
                       ? "no group's allgather has this signature"
                       : "no group's reduce_scatter over any set of its params has this count");
            return MFSDP_ERR_MISMATCH;
        }
    }
    return MFSDP_OK;
}

/* Build the result from one parse: periodic form first, then training pass + variants; each
 * checked by a matcher over the record. */
static mfsdp_status_t build_output(jctx_t *c, int world, const model_t *md, const size_t *label,
                                   const path_ctx_t *pc, mfsdp_join_t *j, char *err, size_t errlen)
{
    mfsdp_status_t st = MFSDP_OK;
    size_t ncold = md->nroles;
    size_t np = pc->npass;
    /* The last pass is trailing when cut short, or when it is the job's final all-gathers
     * (a forward-only pass that ends the record). */
    size_t k = np;
    if (k > 0 && (!pc->pass[k - 1].complete || pc->pass[k - 1].t / 2 == MFSDP_PASS_FORWARD)) {
        k--;
    }
    int *kinds = calloc(np + 1, sizeof(int));
    size_t *pres = calloc((np + 1) * (ncold + 1), sizeof(size_t));
    size_t *abs = calloc((np + 1) * (ncold + 1), sizeof(size_t));
    mfsdp_call_t *seq = calloc((np + 1) * (ncold + 1), sizeof(*seq));
    char msg_p[1024] = "", msg_v[1024] = "";
    if (kinds == NULL || pres == NULL || abs == NULL || seq == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    int has_train = 0;
    for (size_t i = 0; i < np; i++) {
        kinds[i] = (int)(pc->pass[i].t / 2);
        if (i < k) {
            j->npasses[kinds[i]]++;
        }
        has_train |= kinds[i] == MFSDP_PASS_TRAIN && pc->pass[i].complete;
    }
    if (!has_train) {
        SETERR("record: comms[%zu] holds no complete training pass (with its reduce_scatters) "
               "in its %zu calls: record more iterations",
               c->comm, c->n);
        st = MFSDP_ERR_MISMATCH;
        goto out;
    }

    /* Periodic form. */
    size_t w = 0, q = find_period(kinds, k, &w);
    if (q > 0) {
        size_t nseq = 0;
        for (size_t i = 0; i < np; i++) {
            size_t slot = i % q;
            size_t rep = w + ((slot + q - w % q) % q); /* a pass of the periodic part in slot */
            if (kinds[i] == kinds[rep]) {
                tally(md, &pc->pass[i], pres + slot * (ncold + 1), abs + slot * (ncold + 1));
            }
        }
        for (size_t slot = 0; slot < q; slot++) {
            size_t rep = w + ((slot + q - w % q) % q);
            emit_roles(md, kinds[rep], pres + slot * (ncold + 1), abs + slot * (ncold + 1), seq,
                       &nseq);
        }
        mfsdp_iteration_t it = {0, 0};
        int ok = 0;
        MFSDP_CHECK_GOTO(check_result(c, world, label, seq, nseq, it, &ok, msg_p, sizeof(msg_p)),
                         st, out);
        if (ok) {
            j->period = q;
            j->warmup = w;
            j->iteration = it;
            j->ncalls = nseq;
            goto done;
        }
    }

    /* Training pass + the variants seen. */
    memset(pres, 0, (ncold + 1) * sizeof(size_t));
    memset(abs, 0, (ncold + 1) * sizeof(size_t));
    mfsdp_iteration_t it = {0, 0};
    for (size_t i = 0; i < np; i++) {
        tally(md, &pc->pass[i], pres, abs);
        if (kinds[i] == MFSDP_PASS_FORWARD && i < k) {
            it.forward_only = 1;
        }
        if (kinds[i] == MFSDP_PASS_NO_SYNC) {
            it.no_sync = 1;
        }
    }
    size_t nseq = 0;
    emit_roles(md, MFSDP_PASS_TRAIN, pres, abs, seq, &nseq);
    int ok = 0;
    MFSDP_CHECK_GOTO(check_result(c, world, label, seq, nseq, it, &ok, msg_v, sizeof(msg_v)), st,
                     out);
    if (!ok) {
        /* the periodic form is the one meant for this record when there is one */
        SETERR("record: the joined sequence would stop the job: %s", msg_p[0] ? msg_p : msg_v);
        st = MFSDP_ERR_MISMATCH;
        goto out;
    }
    j->period = 0;
    j->warmup = 0;
    j->iteration = it;
    j->ncalls = nseq;
done:
    j->sequence = seq;
    seq = NULL;
out:
    free(kinds);
    free(pres);
    free(abs);
    free(seq);
    return st;
}

mfsdp_status_t mfsdp_record_join(const mfsdp_manifest_t *m, int world, const mfsdp_record_t *rec,
                                 char *err, size_t errlen, mfsdp_join_t **join_p)
{
    MFSDP_CHECK_ARG(m != NULL && rec != NULL && join_p != NULL && world >= 1);
    MFSDP_CHECK_ARG(m->ngroups > 0 && m->groups != NULL);
    MFSDP_CHECK_ARG(rec->ncomms == 0 || rec->comms != NULL);
    jctx_t c;
    model_t *models = NULL;
    size_t nmodels = 0;
    parse_t *ps = NULL;
    size_t *label = NULL, *label_model = NULL;
    path_ctx_t pc = {NULL, 0, 0};
    mfsdp_join_t *j = NULL;
    mfsdp_status_t st = ctx_init(&c, m, world, err, errlen);
    if (st != MFSDP_OK) {
        goto out;
    }
    MFSDP_CHECK_GOTO(choose_comm(&c, world, rec, err, errlen), st, out);
    MFSDP_CHECK_GOTO(models_build(m, &models, &nmodels), st, out);
    size_t maxstates = 0;
    for (size_t k = 0; k < nmodels; k++) {
        maxstates = models[k].nstates > maxstates ? models[k].nstates : maxstates;
    }
    c.cap = maxstates + 1;
    c.seen = calloc(c.cap, sizeof(uint32_t));
    c.mark = calloc(c.cap, sizeof(uint32_t));
    c.queue = calloc(c.cap, sizeof(size_t));
    c.parent = calloc(c.cap, sizeof(size_t));
    ps = calloc(nmodels + 1, sizeof(*ps));
    label = malloc((c.n + 1) * sizeof(size_t));
    label_model = malloc((c.n + 1) * sizeof(size_t));
    if (c.seen == NULL || c.mark == NULL || c.queue == NULL || c.parent == NULL || ps == NULL ||
        label == NULL || label_model == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < c.n; i++) {
        label[i] = NONE;
    }

    /* Parse under every configuration; collect each call's groups. */
    size_t primary = NONE, furthest = NONE;
    size_t conflict = NONE, cg[2] = {0, 0}, cm[2] = {0, 0};
    for (size_t k = 0; k < nmodels; k++) {
        MFSDP_CHECK_GOTO(parse_model(&c, &models[k], &ps[k]), st, out);
        if (ps[k].fail_at != NONE) {
            if (furthest == NONE || ps[k].fail_at > ps[furthest].fail_at) {
                furthest = k;
            }
            continue;
        }
        if (primary == NONE) {
            primary = k;
        }
        for (size_t i = 0; i < c.n && i < conflict; i++) {
            for (size_t e = ps[k].start[i]; e < ps[k].start[i + 1]; e++) {
                if (!ps[k].useful[e]) {
                    continue;
                }
                size_t t, p;
                int r;
                decode(&models[k], ps[k].cons[e].state, &t, &p, &r);
                size_t g = models[k].t[t].e[p].group;
                if (label[i] == NONE) {
                    label[i] = g;
                    label_model[i] = k;
                } else if (label[i] != g && i < conflict) {
                    conflict = i;
                    cg[0] = label[i];
                    cm[0] = label_model[i];
                    cg[1] = g;
                    cm[1] = k;
                }
            }
        }
    }
    if (primary == NONE) {
        const parse_t *fp = &ps[furthest];
        char sb[96], eb[600];
        mfsdp_call_sig_format(&c.calls[fp->fail_at].sig, sb, sizeof(sb));
        expected_text(&c, &models[furthest], fp, eb, sizeof(eb));
        SETERR("record: no FSDP2 call pattern explains comms[%zu].calls[%zu] %s (the closest, %s, "
               "expected %s)",
               c.comm, fp->fail_at, sb, models[furthest].text, eb);
        st = MFSDP_ERR_MISMATCH;
        goto out;
    }
    if (conflict != NONE) {
        char sb[96];
        mfsdp_call_sig_format(&c.calls[conflict].sig, sb, sizeof(sb));
        if (cm[0] == cm[1]) {
            SETERR("record: comms[%zu].calls[%zu] %s is group %s or group %s under the same "
                   "FSDP2 pattern (%s): two readings of the passes label it differently (a "
                   "no-sync pass reads like two forward-only passes, for example): the record "
                   "does not determine the groups; run under the PyTorch companion (mfsdp-run), "
                   "whose tags are exact",
                   c.comm, conflict, sb, m->groups[cg[0]].name, m->groups[cg[1]].name,
                   models[cm[0]].text);
        } else {
            SETERR("record: comms[%zu].calls[%zu] %s is group %s under one FSDP2 pattern (%s) "
                   "and group %s under another (%s): the record does not determine the groups; "
                   "run under the PyTorch companion (mfsdp-run), whose tags are exact",
                   c.comm, conflict, sb, m->groups[cg[0]].name, models[cm[0]].text,
                   m->groups[cg[1]].name, models[cm[1]].text);
        }
        st = MFSDP_ERR_MISMATCH;
        goto out;
    }

    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    j->comm = c.comm;
    snprintf(j->config, sizeof(j->config), "%s", models[primary].text);
    MFSDP_CHECK_GOTO(extract_passes(&c, &models[primary], &ps[primary], &pc), st, out);
    MFSDP_CHECK_GOTO(build_output(&c, world, &models[primary], label, &pc, j, err, errlen), st,
                     out);
    *join_p = j;
    j = NULL;
out:
    mfsdp_join_free(j);
    passes_free(pc.pass, pc.npass);
    for (size_t k = 0; ps != NULL && k < nmodels; k++) {
        parse_free(&ps[k]);
    }
    free(ps);
    for (size_t k = 0; models != NULL && k < nmodels; k++) {
        model_free(&models[k]);
    }
    free(models);
    free(label);
    free(label_model);
    ctx_free(&c);
    return st;
}
