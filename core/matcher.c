/* SPDX-License-Identifier: Apache-2.0 */
#include "core/matcher.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/layout.h"
#include "core/rs_subset.h"

_Static_assert(MFSDP_MATCH_ENUM_PARAMS == MFSDP_RS_ENUM_PARAMS, "one subset rule");
_Static_assert(MFSDP_MATCH_MAX_MISSING == MFSDP_RS_MAX_MISSING, "one subset rule");

/* Pass kinds of the sequence model (docs/manifest.md "iteration"). */
enum { PASS_TRAIN = 0, PASS_NO_SYNC = 1, PASS_FORWARD = 2, NPASS_KINDS = 3 };

static const char *const pass_names[NPASS_KINDS] = {"training", "no-sync", "forward-only"};

typedef struct pass {
    int kind;
    size_t len;     /* entries */
    size_t *entry;  /* indices into the manifest's sequence */
    size_t fwd_len; /* leading all-gathers with distinct groups */
    size_t base;    /* state index of position 0; position len is the pass end */
    /* per position 0..len: the job may end there (mfsdp_matcher_end): the pass end, the end
     * of its forward prefix, and in a sequence of several passes each inner pass start and
     * the end of the forward prefix that starts there */
    unsigned char *end_ok;
} pass_t;

struct mfsdp_matcher {
    const mfsdp_manifest_t *m;
    int world;
    size_t ngroups;
    mfsdp_call_sig_t *ag;       /* per group, full all-gather */
    mfsdp_call_sig_t *rs;       /* per group, full reduce-scatter (count 0: no gradients) */
    size_t **rs_s;              /* per group and param: reduce shard size, 0 when frozen */
    mfsdp_rs_subset_t **solver; /* per group */
    unsigned char *has_grad;    /* output of the last match */
    size_t max_params;
    /* sequence mode */
    size_t npasses;
    pass_t pass[NPASS_KINDS];
    size_t nstates;
    size_t *state_pass; /* per state: index into pass[] */
    size_t *state_pos;  /* per state: position in the pass */
    size_t nwords;
    uint64_t *live, *next;
    size_t *stack;
    /* progress and failure */
    size_t ncalls;
    int failed;
    mfsdp_status_t fail_st;
    char fail_msg[1024];
};

static const char *kind_name(mfsdp_call_kind_t k)
{
    return k == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter";
}

void mfsdp_call_sig_format(const mfsdp_call_sig_t *sig, char *buf, size_t len)
{
    snprintf(buf, len, "%s(count=%zu, %s)", kind_name(sig->kind), sig->count,
             mfsdp_dtype_name(sig->dtype));
}

static const mfsdp_call_sig_t *sig_of(const mfsdp_matcher_t *mt, size_t g, mfsdp_call_kind_t k)
{
    return k == MFSDP_CALL_ALLGATHER ? &mt->ag[g] : &mt->rs[g];
}

static int bit_get(const uint64_t *b, size_t i)
{
    return (int)((b[i / 64] >> (i % 64)) & 1u);
}

static void bit_set(uint64_t *b, size_t i)
{
    b[i / 64] |= (uint64_t)1 << (i % 64);
}

void mfsdp_matcher_destroy(mfsdp_matcher_t *mt)
{
    if (mt == NULL) {
        return;
    }
    for (size_t g = 0; g < mt->ngroups; g++) {
        if (mt->solver != NULL) {
            mfsdp_rs_subset_destroy(mt->solver[g]);
        }
        if (mt->rs_s != NULL) {
            free(mt->rs_s[g]);
        }
    }
    for (size_t k = 0; k < NPASS_KINDS; k++) {
        free(mt->pass[k].entry);
        free(mt->pass[k].end_ok);
    }
    free(mt->solver);
    free(mt->rs_s);
    free(mt->ag);
    free(mt->rs);
    free(mt->has_grad);
    free(mt->state_pass);
    free(mt->state_pos);
    free(mt->live);
    free(mt->next);
    free(mt->stack);
    free(mt);
}

/* Fail the matcher: this and every later call return st with this message. */
static mfsdp_status_t fail(mfsdp_matcher_t *mt, mfsdp_status_t st, char *err, size_t errlen)
{
    mt->failed = 1;
    mt->fail_st = st;
    SETERR("%s", mt->fail_msg);
    return st;
}

/* ---------------------------------------------------------------- construction */

static mfsdp_status_t add_pass(mfsdp_matcher_t *mt, int kind, const size_t *entry, size_t len)
{
    const mfsdp_manifest_t *m = mt->m;
    if (len == 0) {
        return MFSDP_OK;
    }
    /* A variant identical to a pass already there adds nothing but duplicate states. */
    for (size_t k = 0; k < mt->npasses; k++) {
        if (mt->pass[k].len == len && memcmp(mt->pass[k].entry, entry, len * sizeof(size_t)) == 0) {
            return MFSDP_OK;
        }
    }
    pass_t *p = &mt->pass[mt->npasses];
    p->entry = malloc(len * sizeof(size_t));
    if (p->entry == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    memcpy(p->entry, entry, len * sizeof(size_t));
    p->kind = kind;
    p->len = len;
    /* Forward prefix: leading all-gathers, each of a group not gathered yet in it. */
    size_t f = 0;
    for (; f < len; f++) {
        const mfsdp_call_t *c = &m->sequence[entry[f]];
        int seen = 0;
        for (size_t j = 0; j < f && !seen; j++) {
            seen = m->sequence[entry[j]].group == c->group;
        }
        if (c->kind != MFSDP_CALL_ALLGATHER || seen) {
            break;
        }
    }
    p->fwd_len = f;
    mt->npasses++;
    p->end_ok = calloc(len + 1, 1);
    if (p->end_ok == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    p->end_ok[len] = 1;
    if (kind != PASS_FORWARD) {
        p->end_ok[f] = 1;
    }
    /* A sequence joined from several passes (training, training, evaluation) may end after
     * any of them: an inner pass starts where the calls repeat the sequence's forward
     * prefix (all-gathers of distinct groups, in FSDP's forward order: a backward gathers in
     * the reverse order), its leading optional entry present or skipped (but not right after
     * that entry: that pass began one call earlier). A prefix of one group would also match
     * a lone re-gather in a backward: not used. */
    const mfsdp_call_t *e0 = &m->sequence[entry[0]]; /* len > 0 here */
    size_t skip = f > 0 && (e0->flags & MFSDP_CALL_OPTIONAL) ? 1 : 0;
    if (kind == PASS_TRAIN && f - skip >= 2) {
        for (size_t at = 1; at < len; at++) {
            const mfsdp_call_t *prev = &m->sequence[entry[at - 1]];
            for (size_t from = 0; from <= skip; from++) {
                size_t n = f - from;
                size_t k = 0;
                while (k < n && at + k < len &&
                       m->sequence[entry[at + k]].kind == m->sequence[entry[from + k]].kind &&
                       m->sequence[entry[at + k]].group == m->sequence[entry[from + k]].group) {
                    k++;
                }
                /* without the optional entry: not right after it (the pass started there) */
                if (k == n && (from == 0 || prev->kind != e0->kind || prev->group != e0->group)) {
                    p->end_ok[at] = 1;
                    p->end_ok[at + n] = 1;
                }
            }
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t build_passes(mfsdp_matcher_t *mt)
{
    const mfsdp_manifest_t *m = mt->m;
    mfsdp_status_t st = MFSDP_OK;
    size_t *idx = malloc((m->ncalls + 1) * sizeof(size_t));
    if (idx == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < m->ncalls; i++) {
        idx[i] = i;
    }
    MFSDP_CHECK_GOTO(add_pass(mt, PASS_TRAIN, idx, m->ncalls), st, out);
    if (m->iteration.no_sync) {
        size_t n = 0;
        for (size_t i = 0; i < m->ncalls; i++) {
            if (m->sequence[i].kind == MFSDP_CALL_ALLGATHER) {
                idx[n++] = i;
            }
        }
        MFSDP_CHECK_GOTO(add_pass(mt, PASS_NO_SYNC, idx, n), st, out);
    }
    if (m->iteration.forward_only) {
        for (size_t i = 0; i < m->ncalls; i++) {
            idx[i] = i;
        }
        MFSDP_CHECK_GOTO(add_pass(mt, PASS_FORWARD, idx, mt->pass[0].fwd_len), st, out);
    }
    mt->nstates = 0;
    for (size_t k = 0; k < mt->npasses; k++) {
        mt->pass[k].base = mt->nstates;
        mt->nstates += mt->pass[k].len + 1;
    }
    mt->nwords = (mt->nstates + 63) / 64;
    mt->state_pass = calloc(mt->nstates, sizeof(size_t));
    mt->state_pos = calloc(mt->nstates, sizeof(size_t));
    mt->live = calloc(mt->nwords, sizeof(uint64_t));
    mt->next = calloc(mt->nwords, sizeof(uint64_t));
    mt->stack = calloc(mt->nstates, sizeof(size_t));
    if (mt->state_pass == NULL || mt->state_pos == NULL || mt->live == NULL || mt->next == NULL ||
        mt->stack == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t k = 0; k < mt->npasses; k++) {
        for (size_t p = 0; p <= mt->pass[k].len; p++) {
            mt->state_pass[mt->pass[k].base + p] = k;
            mt->state_pos[mt->pass[k].base + p] = p;
        }
    }
out:
    free(idx);
    return st;
}

/* Close set under the empty moves: skipping an optional entry, and from a pass end to the
 * start of any pass. */
static void closure(mfsdp_matcher_t *mt, uint64_t *set)
{
    size_t top = 0;
    for (size_t s = 0; s < mt->nstates; s++) {
        if (bit_get(set, s)) {
            mt->stack[top++] = s;
        }
    }
    while (top > 0) {
        size_t s = mt->stack[--top];
        const pass_t *p = &mt->pass[mt->state_pass[s]];
        size_t pos = mt->state_pos[s];
        if (pos == p->len) {
            for (size_t k = 0; k < mt->npasses; k++) {
                size_t t = mt->pass[k].base;
                if (!bit_get(set, t)) {
                    bit_set(set, t);
                    mt->stack[top++] = t;
                }
            }
        } else if (mt->m->sequence[p->entry[pos]].flags & MFSDP_CALL_OPTIONAL) {
            if (!bit_get(set, s + 1)) {
                bit_set(set, s + 1);
                mt->stack[top++] = s + 1;
            }
        }
    }
}

mfsdp_status_t mfsdp_matcher_create(const mfsdp_manifest_t *m, int world, char *err, size_t errlen,
                                    mfsdp_matcher_t **matcher_p)
{
    MFSDP_CHECK_ARG(m != NULL && matcher_p != NULL && world >= 1);
    MFSDP_CHECK_ARG(m->ngroups == 0 || m->groups != NULL);
    MFSDP_CHECK_ARG(m->ncalls == 0 || m->sequence != NULL);
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_matcher_t *mt = calloc(1, sizeof(*mt));
    if (mt == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mt->m = m;
    mt->world = world;
    mt->ngroups = m->ngroups;
    mt->ag = calloc(m->ngroups + 1, sizeof(*mt->ag));
    mt->rs = calloc(m->ngroups + 1, sizeof(*mt->rs));
    mt->rs_s = calloc(m->ngroups + 1, sizeof(*mt->rs_s));
    mt->solver = calloc(m->ngroups + 1, sizeof(*mt->solver));
    if (mt->ag == NULL || mt->rs == NULL || mt->rs_s == NULL || mt->solver == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        mfsdp_group_layout_t *l = NULL;
        st = mfsdp_group_layout_create(gd, world, &l);
        if (st == MFSDP_OK) {
            st = mfsdp_rs_subset_create(gd, world, &mt->solver[g]);
        }
        if (st != MFSDP_OK) {
            mfsdp_group_layout_destroy(l);
            SETERR("group %s: cannot compute its FSDP layout at world size %d (%s)", gd->name,
                   world, mfsdp_status_string(st));
            goto err;
        }
        mt->ag[g] = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, l->ag.count, l->ag.dtype};
        mt->rs[g] = (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, l->rs.count, l->rs.dtype};
        mt->rs_s[g] = calloc(gd->nparams + 1, sizeof(size_t));
        if (mt->rs_s[g] == NULL) {
            mfsdp_group_layout_destroy(l);
            st = MFSDP_ERR_NO_MEMORY;
            goto err;
        }
        for (size_t e = 0; e < l->rs.nentries; e++) {
            mt->rs_s[g][l->rs.entries[e].param] = (size_t)l->rs.entries[e].s;
        }
        mfsdp_group_layout_destroy(l);
        mt->max_params = gd->nparams > mt->max_params ? gd->nparams : mt->max_params;
    }
    mt->has_grad = calloc(mt->max_params + 1, 1);
    if (mt->has_grad == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    if (m->ncalls == 0) {
        /* Signature mode: each full signature must belong to one group. */
        for (size_t g = 0; g < m->ngroups; g++) {
            for (int k = 0; k < 2; k++) {
                const mfsdp_call_sig_t *s = sig_of(mt, g, (mfsdp_call_kind_t)k);
                for (size_t h = g + 1; h < m->ngroups && s->count != 0; h++) {
                    const mfsdp_call_sig_t *t = sig_of(mt, h, (mfsdp_call_kind_t)k);
                    if (t->count != s->count || t->dtype != s->dtype) {
                        continue;
                    }
                    char sb[96];
                    mfsdp_call_sig_format(s, sb, sizeof(sb));
                    SETERR("groups %s and %s share the call signature %s and the manifest has "
                           "no sequence: record several iterations with MFSDP_RECORD=path and "
                           "join them with 'mfsdp-plan MANIFEST --world-size N --record path "
                           "--write-manifest OUT'",
                           m->groups[g].name, m->groups[h].name, sb);
                    st = MFSDP_ERR_UNSUPPORTED;
                    goto err;
                }
            }
        }
    } else {
        for (size_t i = 0; i < m->ncalls; i++) {
            const mfsdp_call_t *c = &m->sequence[i];
            if (c->group >= m->ngroups ||
                (c->kind != MFSDP_CALL_ALLGATHER && c->kind != MFSDP_CALL_REDUCE_SCATTER)) {
                SETERR("sequence[%zu]: no such group or call kind", i);
                st = MFSDP_ERR_INVALID_ARG;
                goto err;
            }
            if (sig_of(mt, c->group, c->kind)->count == 0) {
                SETERR("sequence[%zu]: group %s has no reduce_scatter (no param requires a "
                       "gradient)",
                       i, m->groups[c->group].name);
                st = MFSDP_ERR_INVALID_ARG;
                goto err;
            }
        }
        MFSDP_CHECK_GOTO(build_passes(mt), st, err);
        for (size_t k = 0; k < mt->npasses; k++) {
            bit_set(mt->live, mt->pass[k].base);
        }
        closure(mt, mt->live);
    }
    *matcher_p = mt;
    return MFSDP_OK;
err:
    mfsdp_matcher_destroy(mt);
    return st;
}

/* ---------------------------------------------------------------- identification */

/* Does call fit entry (kind, group)? For a reduce-scatter, *nsets_p / sets get the param sets
 * its count explains (one, or two of several). */
static mfsdp_status_t fits(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call, size_t g, int *fit_p,
                           size_t *nsets_p, const unsigned char *sets[2])
{
    const mfsdp_call_sig_t *full = sig_of(mt, g, call->kind);
    *fit_p = 0;
    *nsets_p = 0;
    if (full->count == 0 || full->dtype != call->dtype) {
        return MFSDP_OK;
    }
    if (call->kind == MFSDP_CALL_ALLGATHER) {
        *fit_p = full->count == call->count;
        *nsets_p = *fit_p;
        return MFSDP_OK;
    }
    MFSDP_CHECK(mfsdp_rs_subset_find(mt->solver[g], call->count, nsets_p, sets));
    *fit_p = *nsets_p > 0;
    return MFSDP_OK;
}

/* "allgather(count=15, float32) of group b0" */
static void entry_text(const mfsdp_matcher_t *mt, mfsdp_call_kind_t kind, size_t g, char *buf,
                       size_t len)
{
    char sb[96];
    mfsdp_call_sig_format(sig_of(mt, g, kind), sb, sizeof(sb));
    snprintf(buf, len, "%s of group %s", sb, mt->m->groups[g].name);
}

/* The calls the live states expect, "A or B or C (and N more)". */
static void expected_text(const mfsdp_matcher_t *mt, char *buf, size_t len)
{
    size_t shown_kind[4], shown_group[4], nshown = 0, more = 0, off = 0;
    buf[0] = '\0';
    for (size_t s = 0; s < mt->nstates; s++) {
        const pass_t *p = &mt->pass[mt->state_pass[s]];
        size_t pos = mt->state_pos[s];
        if (!bit_get(mt->live, s) || pos == p->len) {
            continue;
        }
        const mfsdp_call_t *c = &mt->m->sequence[p->entry[pos]];
        int dup = 0;
        for (size_t j = 0; j < nshown && !dup; j++) {
            dup = shown_kind[j] == (size_t)c->kind && shown_group[j] == c->group;
        }
        if (dup) {
            continue;
        }
        if (nshown == 4) {
            more++;
            continue;
        }
        shown_kind[nshown] = (size_t)c->kind;
        shown_group[nshown] = c->group;
        char eb[256];
        entry_text(mt, c->kind, c->group, eb, sizeof(eb));
        if (off < len) {
            off += (size_t)snprintf(buf + off, len - off, "%s%s", nshown ? " or " : "", eb);
        }
        nshown++;
    }
    if (more > 0 && off < len) {
        snprintf(buf + off, len - off, " (or %zu more)", more);
    }
    if (nshown == 0) {
        snprintf(buf, len, "no further call");
    }
}

#define WAY_OUT                                                                                    \
    "record several iterations with MFSDP_RECORD=path and join them with 'mfsdp-plan "             \
    "MANIFEST --world-size N --record path --write-manifest OUT' (an exact multi-pass "            \
    "sequence), declare or remove the \"iteration\" variant that allows the other reading, "       \
    "or run under the PyTorch companion (mfsdp-run), whose tags are exact"

static mfsdp_status_t next_sequence(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call,
                                    mfsdp_match_t *match_p, char *err, size_t errlen)
{
    const mfsdp_manifest_t *m = mt->m;
    size_t cand_group[2] = {0, 0}, cand_state[2] = {0, 0}, ncand = 0;
    size_t nsets = 0, first_state = 0;
    const unsigned char *sets[2] = {NULL, NULL};
    memset(mt->next, 0, mt->nwords * sizeof(uint64_t));
    for (size_t s = 0; s < mt->nstates; s++) {
        const pass_t *p = &mt->pass[mt->state_pass[s]];
        size_t pos = mt->state_pos[s];
        if (!bit_get(mt->live, s) || pos == p->len) {
            continue;
        }
        const mfsdp_call_t *c = &m->sequence[p->entry[pos]];
        if (c->kind != call->kind) {
            continue;
        }
        int fit = 0;
        size_t ns = 0;
        const unsigned char *ss[2] = {NULL, NULL};
        MFSDP_CHECK(fits(mt, call, c->group, &fit, &ns, ss));
        if (!fit) {
            continue;
        }
        bit_set(mt->next, s + 1);
        if (ncand == 0) {
            cand_group[0] = c->group;
            cand_state[0] = s;
            first_state = s;
            nsets = ns;
            sets[0] = ss[0];
            sets[1] = ss[1];
            ncand = 1;
        } else if (ncand == 1 && c->group != cand_group[0]) {
            cand_group[1] = c->group;
            cand_state[1] = s;
            ncand = 2;
        }
    }
    char rb[96];
    mfsdp_call_sig_format(call, rb, sizeof(rb));
    if (ncand == 0) {
        char eb[700];
        expected_text(mt, eb, sizeof(eb));
        snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                 "call %zu: call sequence violated: expected %s, received %s", mt->ncalls, eb, rb);
        return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
    }
    if (ncand == 2) {
        const pass_t *p0 = &mt->pass[mt->state_pass[cand_state[0]]];
        const pass_t *p1 = &mt->pass[mt->state_pass[cand_state[1]]];
        snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                 "call %zu: %s is ambiguous: group %s (sequence[%zu], %s pass) or group %s "
                 "(sequence[%zu], %s pass); " WAY_OUT,
                 mt->ncalls, rb, m->groups[cand_group[0]].name,
                 p0->entry[mt->state_pos[cand_state[0]]], pass_names[p0->kind],
                 m->groups[cand_group[1]].name, p1->entry[mt->state_pos[cand_state[1]]],
                 pass_names[p1->kind]);
        return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
    }
    size_t g = cand_group[0];
    if (call->kind == MFSDP_CALL_REDUCE_SCATTER && nsets > 1) {
        char a[256], b[256];
        mfsdp_rs_subset_format_missing(mt->solver[g], sets[0], a, sizeof(a));
        if (sets[1] == NULL) {
            snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                     "call %zu: %s of group %s may be ambiguous: the params without a gradient "
                     "could be %s, but with more than %d trainable params in the group mfsdp "
                     "cannot rule out another set of the same count; run under the PyTorch "
                     "companion (mfsdp-run), whose tags name the params",
                     mt->ncalls, rb, m->groups[g].name, a, MFSDP_RS_SPLIT_PARAMS);
            return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
        }
        mfsdp_rs_subset_format_missing(mt->solver[g], sets[1], b, sizeof(b));
        snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                 "call %zu: %s of group %s is ambiguous: the params without a gradient are %s "
                 "or %s (the same count); run under the PyTorch companion (mfsdp-run), whose "
                 "tags name the params",
                 mt->ncalls, rb, m->groups[g].name, a, b);
        return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
    }
    const pass_t *p = &mt->pass[mt->state_pass[first_state]];
    match_p->group = g;
    match_p->nparams = m->groups[g].nparams;
    match_p->position = p->entry[mt->state_pos[first_state]];
    match_p->has_grad = NULL;
    if (call->kind == MFSDP_CALL_REDUCE_SCATTER) {
        memcpy(mt->has_grad, sets[0], match_p->nparams);
        match_p->has_grad = mt->has_grad;
    }
    memcpy(mt->live, mt->next, mt->nwords * sizeof(uint64_t));
    closure(mt, mt->live);
    return MFSDP_OK;
}

static mfsdp_status_t next_signature(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call,
                                     mfsdp_match_t *match_p, char *err, size_t errlen)
{
    const mfsdp_manifest_t *m = mt->m;
    size_t found = 0, group[2] = {0, 0};
    const unsigned char *set[2] = {NULL, NULL};
    for (size_t g = 0; g < mt->ngroups && found < 2; g++) {
        int fit = 0;
        size_t ns = 0;
        const unsigned char *ss[2] = {NULL, NULL};
        MFSDP_CHECK(fits(mt, call, g, &fit, &ns, ss));
        for (size_t j = 0; j < ns && found < 2; j++) {
            group[found] = g;
            set[found] = ss[j];
            found++;
        }
    }
    char rb[96];
    mfsdp_call_sig_format(call, rb, sizeof(rb));
    if (found == 0) {
        snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                 "call %zu: %s matches no group of the manifest (%s)", mt->ncalls, rb,
                 call->kind == MFSDP_CALL_ALLGATHER
                     ? "no group's allgather has this signature"
                     : "no group's reduce_scatter over any set of its params has this count");
        return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
    }
    if (found == 2) {
        char a[300] = "", b[300] = "";
        if (call->kind == MFSDP_CALL_REDUCE_SCATTER) {
            char ma[256], mb[256];
            mfsdp_rs_subset_format_missing(mt->solver[group[0]], set[0], ma, sizeof(ma));
            mfsdp_rs_subset_format_missing(mt->solver[group[1]], set[1], mb, sizeof(mb));
            snprintf(a, sizeof(a), " without %s", ma);
            snprintf(b, sizeof(b), " without %s", mb);
        }
        snprintf(mt->fail_msg, sizeof(mt->fail_msg),
                 "call %zu: %s is ambiguous: group %s%s or group %s%s; give the manifest a "
                 "sequence (record several iterations with MFSDP_RECORD=path and join them "
                 "with 'mfsdp-plan MANIFEST --world-size N --record path --write-manifest "
                 "OUT') or run under the PyTorch companion (mfsdp-run)",
                 mt->ncalls, rb, m->groups[group[0]].name, strcmp(a, " without {}") ? a : "",
                 m->groups[group[1]].name, strcmp(b, " without {}") ? b : "");
        return fail(mt, MFSDP_ERR_SEQUENCE, err, errlen);
    }
    match_p->group = group[0];
    match_p->nparams = m->groups[group[0]].nparams;
    match_p->position = MFSDP_GROUP_NONE;
    match_p->has_grad = NULL;
    if (call->kind == MFSDP_CALL_REDUCE_SCATTER) {
        memcpy(mt->has_grad, set[0], match_p->nparams);
        match_p->has_grad = mt->has_grad;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_matcher_next(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call,
                                  mfsdp_match_t *match_p, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(mt != NULL && call != NULL && match_p != NULL);
    MFSDP_CHECK_ARG(call->kind == MFSDP_CALL_ALLGATHER || call->kind == MFSDP_CALL_REDUCE_SCATTER);
    if (mt->failed) {
        SETERR("%s", mt->fail_msg);
        return mt->fail_st;
    }
    mfsdp_match_t match;
    mfsdp_status_t st = mt->m->ncalls > 0 ? next_sequence(mt, call, &match, err, errlen)
                                          : next_signature(mt, call, &match, err, errlen);
    if (st == MFSDP_OK) {
        *match_p = match;
        mt->ncalls++;
    } else if (!mt->failed) {
        snprintf(mt->fail_msg, sizeof(mt->fail_msg), "call %zu: identification failed (%s)",
                 mt->ncalls, mfsdp_status_string(st));
        fail(mt, st, err, errlen);
    }
    return st;
}

mfsdp_status_t mfsdp_matcher_end(const mfsdp_matcher_t *mt, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(mt != NULL);
    if (mt->failed) {
        SETERR("%s", mt->fail_msg);
        return MFSDP_ERR_SEQUENCE;
    }
    if (mt->m->ncalls == 0 || mt->ncalls == 0) {
        return MFSDP_OK;
    }
    for (size_t s = 0; s < mt->nstates; s++) {
        const pass_t *p = &mt->pass[mt->state_pass[s]];
        size_t pos = mt->state_pos[s];
        if (bit_get(mt->live, s) && p->end_ok[pos]) {
            return MFSDP_OK;
        }
    }
    char eb[700];
    expected_text(mt, eb, sizeof(eb));
    SETERR("the job ended in the middle of a pass after %zu calls: expected next %s", mt->ncalls,
           eb);
    return MFSDP_ERR_SEQUENCE;
}

/* ---------------------------------------------------------------- tags and queries */

mfsdp_status_t mfsdp_matcher_check_tag(const mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call,
                                       size_t group, const unsigned char *has_grad, char *err,
                                       size_t errlen)
{
    MFSDP_CHECK_ARG(mt != NULL && call != NULL);
    MFSDP_CHECK_ARG(call->kind == MFSDP_CALL_ALLGATHER || call->kind == MFSDP_CALL_REDUCE_SCATTER);
    if (group >= mt->ngroups) {
        SETERR("tag names group index %zu, but the manifest has %zu groups", group, mt->ngroups);
        return MFSDP_ERR_INVALID_ARG;
    }
    const mfsdp_group_desc_t *gd = &mt->m->groups[group];
    mfsdp_call_sig_t want = *sig_of(mt, group, call->kind);
    const char *over = "";
    if (call->kind == MFSDP_CALL_REDUCE_SCATTER && has_grad != NULL) {
        want.count = 0;
        for (size_t i = 0; i < gd->nparams; i++) {
            if (has_grad[i] > 1 || (has_grad[i] && !gd->params[i].requires_grad)) {
                SETERR("tagged reduce_scatter of group %s: param %s is marked as having a "
                       "gradient but %s",
                       gd->name, gd->params[i].name,
                       has_grad[i] > 1 ? "the mark is not 0 or 1" : "it does not require one");
                return MFSDP_ERR_INVALID_ARG;
            }
            want.count += has_grad[i] ? mt->rs_s[group][i] : 0;
        }
        over = " over the tagged params";
    }
    char wb[96], rb[96];
    mfsdp_call_sig_format(&want, wb, sizeof(wb));
    mfsdp_call_sig_format(call, rb, sizeof(rb));
    if (want.count == 0) {
        SETERR("tagged reduce_scatter of group %s covers no param with a gradient, received %s",
               gd->name, rb);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (want.count != call->count || want.dtype != call->dtype) {
        SETERR("tagged %s of group %s%s: expected %s, received %s", kind_name(call->kind), gd->name,
               over, wb, rb);
        return MFSDP_ERR_MISMATCH;
    }
    return MFSDP_OK;
}

size_t mfsdp_matcher_iteration_calls(const mfsdp_matcher_t *mt)
{
    if (mt == NULL) {
        return 0;
    }
    if (mt->m->ncalls > 0) {
        return mt->m->ncalls;
    }
    size_t n = 0;
    for (size_t g = 0; g < mt->ngroups; g++) {
        n += 1 + (mt->rs[g].count != 0);
    }
    return n;
}

mfsdp_status_t mfsdp_matcher_signature(const mfsdp_matcher_t *mt, size_t group,
                                       mfsdp_call_kind_t kind, mfsdp_call_sig_t *sig_p)
{
    MFSDP_CHECK_ARG(mt != NULL && sig_p != NULL && group < mt->ngroups);
    MFSDP_CHECK_ARG(kind == MFSDP_CALL_ALLGATHER || kind == MFSDP_CALL_REDUCE_SCATTER);
    *sig_p = *sig_of(mt, group, kind);
    return MFSDP_OK;
}
