/* SPDX-License-Identifier: Apache-2.0 */
#include "core/sequence.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/layout.h"

struct mfsdp_matcher {
    const mfsdp_manifest_t *m;
    size_t ngroups;
    mfsdp_call_sig_t *ag; /* per group */
    mfsdp_call_sig_t *rs; /* per group; count 0 when no gradients */
    size_t pos;           /* next expected sequence entry */
};

#define SETERR(...)                                                                           \
    do {                                                                                      \
        if (err != NULL && errlen > 0) {                                                      \
            snprintf(err, errlen, __VA_ARGS__);                                               \
        }                                                                                     \
    } while (0)

static int sig_eq(const mfsdp_call_sig_t *a, const mfsdp_call_sig_t *b)
{
    return a->kind == b->kind && a->count == b->count && a->dtype == b->dtype && a->count != 0;
}

void mfsdp_call_sig_format(const mfsdp_call_sig_t *sig, char *buf, size_t len)
{
    snprintf(buf, len, "%s(count=%zu, %s)",
             sig->kind == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter", sig->count,
             mfsdp_dtype_name(sig->dtype));
}

static const mfsdp_call_sig_t *sig_of(const mfsdp_matcher_t *mt, size_t g, mfsdp_call_kind_t k)
{
    return k == MFSDP_CALL_ALLGATHER ? &mt->ag[g] : &mt->rs[g];
}

void mfsdp_matcher_destroy(mfsdp_matcher_t *mt)
{
    if (mt == NULL) {
        return;
    }
    free(mt->ag);
    free(mt->rs);
    free(mt);
}

/* Number of (group, kind) slots whose signature equals sig; first match in *first. */
static size_t count_matches(const mfsdp_matcher_t *mt, const mfsdp_call_sig_t *sig,
                            size_t *first)
{
    size_t n = 0;
    for (size_t g = 0; g < mt->ngroups; g++) {
        if (sig_eq(sig_of(mt, g, sig->kind), sig)) {
            if (n++ == 0 && first != NULL) {
                *first = g;
            }
        }
    }
    return n;
}

mfsdp_status_t mfsdp_matcher_create(const mfsdp_manifest_t *m, int world, char *err,
                                    size_t errlen, mfsdp_matcher_t **matcher_p)
{
    MFSDP_CHECK_ARG(m != NULL && matcher_p != NULL && world >= 1);
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_matcher_t *mt = calloc(1, sizeof(*mt));
    if (mt == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mt->m = m;
    mt->ngroups = m->ngroups;
    mt->ag = calloc(m->ngroups + 1, sizeof(*mt->ag));
    mt->rs = calloc(m->ngroups + 1, sizeof(*mt->rs));
    if (mt->ag == NULL || mt->rs == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        mfsdp_group_layout_t *l = NULL;
        st = mfsdp_group_layout_create(&m->groups[g], world, &l);
        if (st != MFSDP_OK) {
            SETERR("group %s: cannot compute its FSDP layout (%s)", m->groups[g].name,
                   mfsdp_status_string(st));
            goto err;
        }
        mt->ag[g] = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, l->ag.count, l->ag.dtype};
        mt->rs[g] = (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, l->rs.count, l->rs.dtype};
        mfsdp_group_layout_destroy(l);
    }
    if (m->ncalls == 0) {
        for (size_t g = 0; g < m->ngroups; g++) {
            for (int k = 0; k < 2; k++) {
                const mfsdp_call_sig_t *s = sig_of(mt, g, (mfsdp_call_kind_t)k);
                for (size_t h = g + 1; h < m->ngroups; h++) {
                    if (!sig_eq(s, sig_of(mt, h, (mfsdp_call_kind_t)k))) {
                        continue;
                    }
                    char sb[96];
                    mfsdp_call_sig_format(s, sb, sizeof(sb));
                    SETERR("groups %s and %s share the call signature %s and the manifest has "
                           "no sequence: record one iteration with MFSDP_RECORD=path and join "
                           "it with 'mfsdp-plan MANIFEST --record path --write-manifest OUT'",
                           m->groups[g].name, m->groups[h].name, sb);
                    st = MFSDP_ERR_UNSUPPORTED;
                    goto err;
                }
            }
        }
    } else {
        for (size_t i = 0; i < m->ncalls; i++) {
            const mfsdp_call_t *c = &m->sequence[i];
            if (c->group >= m->ngroups || sig_of(mt, c->group, c->kind)->count == 0) {
                SETERR("sequence[%zu]: group %s has no %s call (no gradients)", i,
                       c->group < m->ngroups ? m->groups[c->group].name : "?",
                       c->kind == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter");
                st = MFSDP_ERR_INVALID_ARG;
                goto err;
            }
        }
    }
    *matcher_p = mt;
    return MFSDP_OK;
err:
    mfsdp_matcher_destroy(mt);
    return st;
}

mfsdp_status_t mfsdp_matcher_signature(const mfsdp_matcher_t *mt, size_t group,
                                       mfsdp_call_kind_t kind, mfsdp_call_sig_t *sig_p)
{
    MFSDP_CHECK_ARG(mt != NULL && sig_p != NULL && group < mt->ngroups);
    MFSDP_CHECK_ARG(kind == MFSDP_CALL_ALLGATHER || kind == MFSDP_CALL_REDUCE_SCATTER);
    *sig_p = *sig_of(mt, group, kind);
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_matcher_next(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *call, char *err,
                                  size_t errlen, size_t *group_p)
{
    MFSDP_CHECK_ARG(mt != NULL && call != NULL && group_p != NULL);
    const mfsdp_manifest_t *m = mt->m;
    size_t first = MFSDP_GROUP_NONE;
    size_t n = count_matches(mt, call, &first);
    if (m->ncalls == 0) {
        *group_p = n == 1 ? first : MFSDP_GROUP_NONE;
        return MFSDP_OK;
    }
    const mfsdp_call_t *exp = &m->sequence[mt->pos];
    const mfsdp_call_sig_t *es = sig_of(mt, exp->group, exp->kind);
    if (sig_eq(es, call)) {
        *group_p = exp->group;
        mt->pos = (mt->pos + 1) % m->ncalls;
        return MFSDP_OK;
    }
    if (n == 0) {
        *group_p = MFSDP_GROUP_NONE; /* not one of ours: pass through */
        return MFSDP_OK;
    }
    char eb[96], rb[96];
    mfsdp_call_sig_format(es, eb, sizeof(eb));
    mfsdp_call_sig_format(call, rb, sizeof(rb));
    SETERR("call sequence violated at sequence[%zu]: expected %s of group %s, received %s "
           "(a signature of group %s)",
           mt->pos, eb, m->groups[exp->group].name, rb, m->groups[first].name);
    return MFSDP_ERR_SEQUENCE;
}

/* ---------------------------------------------------------------- records */

static const char *kind_name(mfsdp_call_kind_t k)
{
    return k == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter";
}

mfsdp_status_t mfsdp_record_write(const mfsdp_record_t *rec, FILE *out)
{
    MFSDP_CHECK_ARG(rec != NULL && out != NULL);
    fprintf(out, "{\"format\": \"mfsdp-record/1\", \"comms\": [");
    for (size_t c = 0; c < rec->ncomms; c++) {
        const mfsdp_record_comm_t *rc = &rec->comms[c];
        fprintf(out, "%s\n  {\"size\": %d, \"calls\": [", c ? "," : "", rc->size);
        for (size_t i = 0; i < rc->ncalls; i++) {
            const mfsdp_record_call_t *k = &rc->calls[i];
            fprintf(out, "%s\n    [\"%s\", %zu, \"%s\", \"%s\"]", i ? "," : "",
                    kind_name(k->sig.kind), k->sig.count, mfsdp_dtype_name(k->sig.dtype),
                    k->op);
        }
        fprintf(out, "]}");
    }
    fprintf(out, "\n]}\n");
    return ferror(out) ? MFSDP_ERR_IO : MFSDP_OK;
}

void mfsdp_record_free(mfsdp_record_t *rec)
{
    if (rec == NULL) {
        return;
    }
    for (size_t c = 0; c < rec->ncomms; c++) {
        free(rec->comms[c].calls);
    }
    free(rec->comms);
    free(rec);
}

static mfsdp_status_t parse_call(json_t *jc, const char *path, size_t c, size_t i,
                                 mfsdp_record_call_t *out, char *err, size_t errlen)
{
    json_t *jk = json_array_get(jc, 0), *jn = json_array_get(jc, 1);
    json_t *jd = json_array_get(jc, 2), *jo = json_array_get(jc, 3);
    if (!json_is_array(jc) || json_array_size(jc) != 4 || !json_is_string(jk) ||
        !json_is_integer(jn) || !json_is_string(jd) || !json_is_string(jo) ||
        json_integer_value(jn) < 0) {
        SETERR("%s: comms[%zu].calls[%zu]: expected [kind, count >= 0, dtype, op]", path, c, i);
        return MFSDP_ERR_PARSE;
    }
    const char *k = json_string_value(jk);
    if (strcmp(k, "allgather") == 0) {
        out->sig.kind = MFSDP_CALL_ALLGATHER;
    } else if (strcmp(k, "reduce_scatter") == 0) {
        out->sig.kind = MFSDP_CALL_REDUCE_SCATTER;
    } else {
        SETERR("%s: comms[%zu].calls[%zu][0]: expected \"allgather\" or \"reduce_scatter\"",
               path, c, i);
        return MFSDP_ERR_PARSE;
    }
    out->sig.count = (size_t)json_integer_value(jn);
    if (mfsdp_dtype_parse(json_string_value(jd), &out->sig.dtype) != MFSDP_OK) {
        SETERR("%s: comms[%zu].calls[%zu][2]: unknown dtype \"%s\"", path, c, i,
               json_string_value(jd));
        return MFSDP_ERR_PARSE;
    }
    snprintf(out->op, sizeof(out->op), "%s", json_string_value(jo));
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_record_load(const char *path, char *err, size_t errlen,
                                 mfsdp_record_t **rec_p)
{
    MFSDP_CHECK_ARG(path != NULL && rec_p != NULL);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        SETERR("%s: line %d column %d: %s", path, jerr.line, jerr.column, jerr.text);
        return jerr.line <= 0 && jerr.position == 0 ? MFSDP_ERR_IO : MFSDP_ERR_PARSE;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_record_t *rec = calloc(1, sizeof(*rec));
    json_t *fmt = json_object_get(root, "format");
    json_t *comms = json_object_get(root, "comms");
    if (rec == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    if (!json_is_string(fmt) || strcmp(json_string_value(fmt), "mfsdp-record/1") != 0) {
        SETERR("%s: format: expected \"mfsdp-record/1\"", path);
        st = MFSDP_ERR_PARSE;
        goto out;
    }
    if (!json_is_array(comms)) {
        SETERR("%s: comms: expected an array", path);
        st = MFSDP_ERR_PARSE;
        goto out;
    }
    rec->ncomms = json_array_size(comms);
    rec->comms = calloc(rec->ncomms + 1, sizeof(*rec->comms));
    if (rec->comms == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t c = 0; c < rec->ncomms; c++) {
        json_t *jc = json_array_get(comms, c);
        json_t *size = json_object_get(jc, "size");
        json_t *calls = json_object_get(jc, "calls");
        if (!json_is_integer(size) || json_integer_value(size) < 1 ||
            json_integer_value(size) > (1 << 24) || !json_is_array(calls)) {
            SETERR("%s: comms[%zu]: expected {\"size\": n >= 1, \"calls\": [...]}", path, c);
            st = MFSDP_ERR_PARSE;
            goto out;
        }
        mfsdp_record_comm_t *rc = &rec->comms[c];
        rc->size = (int)json_integer_value(size);
        rc->ncalls = json_array_size(calls);
        rc->calls = calloc(rc->ncalls + 1, sizeof(*rc->calls));
        if (rc->calls == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        for (size_t i = 0; i < rc->ncalls; i++) {
            st = parse_call(json_array_get(calls, i), path, c, i, &rc->calls[i], err, errlen);
            if (st != MFSDP_OK) {
                goto out;
            }
        }
    }
    *rec_p = rec;
    rec = NULL;
out:
    mfsdp_record_free(rec);
    json_decref(root);
    return st;
}

mfsdp_status_t mfsdp_record_join(const mfsdp_manifest_t *m, int world,
                                 const mfsdp_record_t *rec, char *err, size_t errlen,
                                 mfsdp_call_t **seq_p, size_t *ncalls_p)
{
    MFSDP_CHECK_ARG(m != NULL && rec != NULL && seq_p != NULL && ncalls_p != NULL);
    /* A matcher built as if there were no sequence gives us the signatures; ambiguity is
     * exactly what the join resolves, so build signatures without the uniqueness check. */
    mfsdp_manifest_t tmp = *m;
    tmp.ncalls = 0;
    tmp.sequence = NULL;
    mfsdp_matcher_t *mt = calloc(1, sizeof(*mt));
    mfsdp_call_t *seq = NULL;
    size_t *fwd = NULL, *bwd_ag = NULL, *bwd_rs = NULL;
    mfsdp_status_t st = MFSDP_OK;
    if (mt == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mt->m = &tmp;
    mt->ngroups = m->ngroups;
    mt->ag = calloc(m->ngroups + 1, sizeof(*mt->ag));
    mt->rs = calloc(m->ngroups + 1, sizeof(*mt->rs));
    fwd = calloc(m->ngroups + 1, sizeof(size_t));
    bwd_ag = calloc(m->ngroups + 1, sizeof(size_t));
    bwd_rs = calloc(m->ngroups + 1, sizeof(size_t));
    if (mt->ag == NULL || mt->rs == NULL || fwd == NULL || bwd_ag == NULL || bwd_rs == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        mfsdp_group_layout_t *l = NULL;
        MFSDP_CHECK_GOTO(mfsdp_group_layout_create(&m->groups[g], world, &l), st, out);
        mt->ag[g] = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, l->ag.count, l->ag.dtype};
        mt->rs[g] = (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, l->rs.count, l->rs.dtype};
        mfsdp_group_layout_destroy(l);
    }
    /* The comm: first of the right size with at least one matching call. */
    const mfsdp_record_comm_t *rc = NULL;
    for (size_t c = 0; c < rec->ncomms && rc == NULL; c++) {
        if (rec->comms[c].size != world) {
            continue;
        }
        for (size_t i = 0; i < rec->comms[c].ncalls; i++) {
            if (count_matches(mt, &rec->comms[c].calls[i].sig, NULL) > 0) {
                rc = &rec->comms[c];
                break;
            }
        }
    }
    if (rc == NULL) {
        SETERR("record: no communicator of size %d made a call matching the manifest", world);
        st = MFSDP_ERR_MISMATCH;
        goto out;
    }
    seq = calloc(rc->ncalls + 1, sizeof(*seq));
    if (seq == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    /* Per signature class (keyed by its first group): every group is all-gathered exactly
     * once in the forward pass, in manifest order, so the first k all-gathers of a class of
     * k groups ascend through it; later ones are the backward pass, which descends, as do
     * the reduce-scatters. A class may show fewer backward all-gathers (B) than groups: FSDP2
     * does not re-gather groups with reshard_after_forward=False, conventionally the last
     * ones run, so backward all-gathers are taken to descend from the B-th group. */
    size_t *bwd_total = calloc(m->ngroups + 1, sizeof(size_t));
    if (bwd_total == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < rc->ncalls; i++) {
        const mfsdp_call_sig_t *s = &rc->calls[i].sig;
        size_t first = 0;
        size_t k = count_matches(mt, s, &first);
        if (k == 0 || s->kind != MFSDP_CALL_ALLGATHER) {
            continue;
        }
        if (fwd[first] < k) {
            fwd[first]++;
        } else {
            bwd_total[first]++;
        }
    }
    memset(fwd, 0, (m->ngroups + 1) * sizeof(size_t));
    size_t n = 0;
    for (size_t i = 0; i < rc->ncalls; i++) {
        const mfsdp_call_sig_t *s = &rc->calls[i].sig;
        size_t first = 0;
        size_t k = count_matches(mt, s, &first);
        if (k == 0) {
            continue;
        }
        int is_rs = s->kind == MFSDP_CALL_REDUCE_SCATTER;
        int backward = is_rs || fwd[first] >= k;
        size_t *cursor = is_rs ? &bwd_rs[first] : backward ? &bwd_ag[first] : &fwd[first];
        size_t avail = (!is_rs && backward) ? bwd_total[first] : k;
        if (*cursor >= k || avail > k) {
            char sb[96];
            mfsdp_call_sig_format(s, sb, sizeof(sb));
            SETERR("record: calls[%zu] is %s call number %zu of signature %s in the %s pass, "
                   "but only %zu groups have that signature",
                   i, kind_name(s->kind), (avail > k ? avail : *cursor + 1), sb,
                   backward ? "backward" : "forward", k);
            st = MFSDP_ERR_MISMATCH;
            free(bwd_total);
            goto out;
        }
        size_t want = backward ? avail - 1 - *cursor : *cursor;
        size_t seen = 0, group = first;
        for (size_t g = 0; g < m->ngroups; g++) {
            if (sig_eq(sig_of(mt, g, s->kind), s) && seen++ == want) {
                group = g;
                break;
            }
        }
        (*cursor)++;
        seq[n].kind = s->kind;
        seq[n].group = group;
        n++;
    }
    free(bwd_total);
    *seq_p = seq;
    *ncalls_p = n;
    seq = NULL;
out:
    free(seq);
    free(fwd);
    free(bwd_ag);
    free(bwd_rs);
    mfsdp_matcher_destroy(mt);
    return st;
}
