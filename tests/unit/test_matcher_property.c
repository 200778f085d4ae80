/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Property test of call identification: real call streams, one random corruption each, and
 * an oracle that says what the matcher may do.
 *
 * Streams come from core/fsdp2_pattern.h (FSDP2's measured call patterns) for several
 * manifests (fsdp_train-like with a colliding unused-param count, at world 2 and 3;
 * torchtitan-style; unique signatures without a sequence; mixed-dtype groups; groups of more
 * than 12 params) and configurations (default, no prefetch, root resharded, torchtitan's
 * kept groups; accumulation through no-sync passes, eval passes, irregular schedules; all
 * params, frozen params, params unused in every or in some passes), several passes each,
 * often with the job's final all-gathers. The manifest's sequence is what `mfsdp-plan
 * --record` joins from the clean stream (when the join accepts it), or the training pass with
 * the iteration variants written by hand, or none (signature mode).
 *
 * Each case corrupts one stream once: drop a call, duplicate one, swap two, insert a call of
 * a random group, or change a count (by one element, or to another group's count). The
 * ground truth is each call's true (group, params with a gradient). The oracle is an
 * independent parser of the manifest's model (docs/manifest.md: passes, optional entries,
 * variants, reduce-scatter subsets, where a job may end) that finds every labeling of the
 * corrupted stream. The matcher must either stop with an error (at a call or at its end), or
 * complete with exactly the model's unique labeling of a valid stream. A completed stream
 * whose labels differ from the truth is "indistinguishable": the corruption produced another
 * valid stream of the model (for example a dropped or inserted optional all-gather), which no
 * identification from the wire can tell apart. A silent misroute is a completion on an
 * invalid or ambiguous stream, or labels that differ from the model's.
 *
 *   test_matcher_property [--cases N]      (default 100000; MFSDP_TEST_SEED=S replays)
 *
 * Exit status 0 when there is no silent misroute and every joined manifest identifies its own
 * clean stream.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/join.h"
#include "core/matcher.h"
#include "pattern_util.h"

#define MAXCALLS 400
#define MAXBASE  600
#define ALL_MASK 0xffffffffu
#define NONE_ID  (-1)
#define AMBIG_ID (-2)
#define EMPTY_ID 0

/* ---------------------------------------------------------------- random numbers */

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t rnd_below(size_t n)
{
    return n == 0 ? 0 : (size_t)(rnd() % n);
}

/* ---------------------------------------------------------------- base cases */

typedef enum { SRC_JOIN = 0, SRC_VARIANT = 1, SRC_SIGNATURE = 2 } source_t;
static const char *const src_names[] = {"join", "variants", "signature"};

typedef struct base {
    mfsdp_manifest_t *m;
    int world;
    source_t src;
    char name[160];
    size_t n;
    pu_call_t *calls;
} base_t;

static base_t bases[MAXBASE];
static size_t nbases;

static mfsdp_manifest_t *parse(const char *json)
{
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    if (mfsdp_manifest_parse(json, strlen(json), "property", err, sizeof(err), &m) != MFSDP_OK) {
        fprintf(stderr, "test manifest does not parse: %s\n", err);
        exit(2);
    }
    return m;
}

/* Families of manifests. frozen: a variant with a frozen param. */
static mfsdp_manifest_t *family_fsdp_train(int frozen)
{
    char json[8192];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"root\", \"params\": ["
        "{\"name\": \"embed\", \"shape\": [10, 4], \"dtype\": \"float32\"}, "
        "{\"name\": \"norm\", \"shape\": [4], \"dtype\": \"float32\"}, "
        "{\"name\": \"lm_head.weight\", \"shape\": [8, 4], \"dtype\": \"float32\"}, "
        "{\"name\": \"lm_head.bias\", \"shape\": [8], \"dtype\": \"float32\"}]}");
    for (int l = 0; l < 3; l++) {
        off += (size_t)snprintf(
            json + off, sizeof(json) - off,
            ", {\"name\": \"b%d\", \"params\": ["
            "{\"name\": \"b%d.fc1.weight\", \"shape\": [8, 4], \"dtype\": \"float32\"}, "
            "{\"name\": \"b%d.fc1.bias\", \"shape\": [8], \"dtype\": \"float32\"%s}, "
            "{\"name\": \"b%d.fc2.weight\", \"shape\": [4, 8], \"dtype\": \"float32\"}, "
            "{\"name\": \"b%d.fc2.bias\", \"shape\": [4], \"dtype\": \"float32\"}]}",
            l, l, l, frozen && l == 1 ? ", \"requires_grad\": false" : "", l, l);
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    return parse(json);
}

static mfsdp_manifest_t *family_titan(void)
{
    char json[16384];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"emb\", \"params\": ["
        "{\"name\": \"tok_embeddings.weight\", \"shape\": [16, 4], \"dtype\": \"float32\"}]}");
    static const char *const names[] = {"attention.wq",    "attention.wk",    "attention.wv",
                                        "attention.wo",    "attention_norm",  "feed_forward.w1",
                                        "feed_forward.w2", "feed_forward.w3", "ffn_norm"};
    static const char *const shapes[] = {"[4, 4]", "[2, 4]", "[2, 4]", "[4, 4]", "[4]",
                                         "[8, 4]", "[4, 8]", "[8, 4]", "[4]"};
    for (int l = 0; l < 3; l++) {
        off += (size_t)snprintf(json + off, sizeof(json) - off,
                                ", {\"name\": \"layers.%d\", \"params\": [", l);
        for (int p = 0; p < 9; p++) {
            off += (size_t)snprintf(json + off, sizeof(json) - off,
                                    "%s{\"name\": \"layers.%d.%s\", \"shape\": %s, \"dtype\": "
                                    "\"float32\"}",
                                    p ? ", " : "", l, names[p], shapes[p]);
        }
        off += (size_t)snprintf(json + off, sizeof(json) - off, "]}");
    }
    snprintf(json + off, sizeof(json) - off,
             ", {\"name\": \"out\", \"params\": [{\"name\": \"norm.weight\", \"shape\": [4], "
             "\"dtype\": \"float32\"}, {\"name\": \"output.weight\", \"shape\": [16, 4], "
             "\"dtype\": \"float32\"}]}]}");
    return parse(json);
}

static mfsdp_manifest_t *family_unique(void)
{
    return parse("{\"format\": \"mfsdp-manifest/1\", \"groups\": ["
                 "{\"name\": \"a\", \"params\": [{\"name\": \"a.w\", \"shape\": [6, 4], "
                 "\"dtype\": \"float32\"}, {\"name\": \"a.b\", \"shape\": [6], \"dtype\": "
                 "\"float32\"}]}, "
                 "{\"name\": \"b\", \"params\": [{\"name\": \"b.w\", \"shape\": [10, 4], "
                 "\"dtype\": \"float32\"}]}, "
                 "{\"name\": \"c\", \"params\": [{\"name\": \"c.w\", \"shape\": [14, 4], "
                 "\"dtype\": \"float32\"}, {\"name\": \"c.b\", \"shape\": [14], \"dtype\": "
                 "\"float32\"}]}, "
                 "{\"name\": \"d\", \"params\": [{\"name\": \"d.w\", \"shape\": [3, 4], "
                 "\"dtype\": \"float32\"}]}]}");
}

static mfsdp_manifest_t *family_mixed(void)
{
    char json[8192];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"root\", \"reduce_dtype\": "
        "\"float32\", \"params\": [{\"name\": \"embed\", \"shape\": [10, 4], \"dtype\": "
        "\"bfloat16\"}, {\"name\": \"norm\", \"shape\": [4], \"dtype\": \"float32\"}]}");
    for (int l = 0; l < 3; l++) {
        off += (size_t)snprintf(json + off, sizeof(json) - off,
                                ", {\"name\": \"b%d\", \"reduce_dtype\": \"float32\", \"params\": "
                                "[{\"name\": \"b%d.w\", \"shape\": [6, 4], \"dtype\": "
                                "\"bfloat16\"}, {\"name\": \"b%d.b\", \"shape\": [6], \"dtype\": "
                                "\"float32\"}]}",
                                l, l, l);
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    return parse(json);
}

/* 14 params per block: more than 12, so sets of missing params are met in the middle. */
static mfsdp_manifest_t *family_large(void)
{
    char json[16384];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"root\", \"params\": ["
        "{\"name\": \"embed\", \"shape\": [20, 4], \"dtype\": \"float32\"}]}");
    for (int l = 0; l < 2; l++) {
        off += (size_t)snprintf(json + off, sizeof(json) - off,
                                ", {\"name\": \"b%d\", \"params\": [", l);
        for (int p = 0; p < 14; p++) {
            off += (size_t)snprintf(json + off, sizeof(json) - off,
                                    "%s{\"name\": \"b%d.p%d\", \"shape\": [%d], \"dtype\": "
                                    "\"float32\"}",
                                    p ? ", " : "", l, p, 2 * (p + 1) + (p == 13 ? 2 : 0));
        }
        off += (size_t)snprintf(json + off, sizeof(json) - off, "]}");
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    return parse(json);
}

/* Gradient scenarios: which params get no gradient in which pass. */
typedef struct grads {
    const mfsdp_manifest_t *m;
    int mode;          /* 0 all, 1 one param unused in every pass, 2 unused in some passes */
    size_t group;      /* the group of the unused param */
    size_t param;      /* the unused param */
    uint64_t passmask; /* mode 2: passes where it is unused */
    unsigned char flags[64];
    const unsigned char *hg[64];
} grads_t;

static const unsigned char *const *grads_fn(void *arg, size_t pass)
{
    grads_t *g = arg;
    if (g->mode == 0 || (g->mode == 2 && !((g->passmask >> (pass % 64)) & 1u))) {
        return NULL;
    }
    const mfsdp_group_desc_t *gd = &g->m->groups[g->group];
    for (size_t i = 0; i < gd->nparams; i++) {
        g->flags[i] = (unsigned char)(gd->params[i].requires_grad && i != g->param);
    }
    for (size_t k = 0; k < g->m->ngroups; k++) {
        g->hg[k] = k == g->group ? g->flags : NULL;
    }
    return g->hg;
}

/* The training pass of cfg written by hand, with the iteration variants of the schedule: the
 * forward all-gathers of groups kept unsharded after forward are optional when there are
 * forward-only passes. */
static void variant_manifest(mfsdp_manifest_t *m, const mfsdp_fsdp2_config_t *cfg,
                             const char *kinds)
{
    mfsdp_fsdp2_gen_t *gen = NULL;
    size_t cap = mfsdp_fsdp2_max_pass_calls(m), n = 0;
    mfsdp_fsdp2_call_t *calls = calloc(cap, sizeof(*calls));
    if (calls == NULL || mfsdp_fsdp2_gen_create(m, cfg, &gen) != MFSDP_OK ||
        mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_TRAIN, NULL, calls, cap, &n) != MFSDP_OK) {
        fprintf(stderr, "generator failed\n");
        exit(2);
    }
    int has_f = strchr(kinds, 'F') != NULL, has_n = strchr(kinds, 'N') != NULL;
    free(m->sequence);
    m->sequence = calloc(n + 1, sizeof(*m->sequence));
    m->ncalls = n;
    for (size_t i = 0; i < n; i++) {
        size_t g = calls[i].group;
        int kept = cfg->reshard != NULL ? !cfg->reshard[g] : (cfg->root && g == 0);
        m->sequence[i].kind = calls[i].kind;
        m->sequence[i].group = g;
        m->sequence[i].flags =
            has_f && kept && calls[i].phase == MFSDP_PHASE_FORWARD ? MFSDP_CALL_OPTIONAL : 0;
    }
    m->iteration.forward_only = has_f;
    m->iteration.no_sync = has_n;
    free(calls);
    mfsdp_fsdp2_gen_destroy(gen);
}

static size_t join_refused, join_uncorrupted_fail, variant_clean_stopped;

static void add_base(mfsdp_manifest_t *(*family)(void), int frozen, const char *fname, int world,
                     const mfsdp_fsdp2_config_t *cfg, const char *cfgname, const char *kinds,
                     int gmode, size_t ggroup, size_t gparam, source_t src)
{
    if (nbases == MAXBASE) {
        fprintf(stderr, "too many base cases\n");
        exit(2);
    }
    base_t *b = &bases[nbases];
    b->m = family != NULL ? family() : family_fsdp_train(frozen);
    b->world = world;
    b->src = src;
    grads_t g = {
        .m = b->m, .mode = gmode, .group = ggroup, .param = gparam, .passmask = rnd() | 1u};
    b->calls = calloc(MAXCALLS, sizeof(*b->calls));
    b->n = 0;
    if (pu_stream(b->m, world, cfg, kinds, grads_fn, &g, b->calls, MAXCALLS, &b->n) != MFSDP_OK) {
        fprintf(stderr, "stream generation failed for %s\n", fname);
        exit(2);
    }
    snprintf(b->name, sizeof(b->name), "%s w%d %s [%s] grads%d %s", fname, world, cfgname, kinds,
             gmode, src_names[src]);
    if (src == SRC_JOIN) {
        mfsdp_record_t *rec = pu_record(b->calls, b->n, world);
        mfsdp_join_t *j = NULL;
        char err[2048];
        if (mfsdp_record_join(b->m, world, rec, err, sizeof(err), &j) != MFSDP_OK) {
            join_refused++;
            if (getenv("MFSDP_TEST_VERBOSE") != NULL) {
                printf("  join refused (%s): %s\n", b->name, err);
            }
            mfsdp_record_free(rec);
            mfsdp_manifest_free(b->m);
            free(b->calls);
            return;
        }
        mfsdp_record_free(rec);
        free(b->m->sequence);
        b->m->sequence = j->sequence;
        b->m->ncalls = j->ncalls;
        b->m->iteration = j->iteration;
        j->sequence = NULL;
        mfsdp_join_free(j);
    } else if (src == SRC_VARIANT) {
        variant_manifest(b->m, cfg, kinds);
    }
    nbases++;
}

/* ---------------------------------------------------------------- the oracle */

/* Labels: group << 32 | mask of params with a gradient (ALL_MASK: an all-gather). */
typedef uint64_t label_t;

typedef struct subset_entry {
    size_t count;
    uint32_t mask;
} subset_entry_t;

/* Per group, computed from the shapes (independently of core/layout and core/rs_subset). */
typedef struct ogroup {
    mfsdp_call_sig_t ag, rs; /* full signatures */
    subset_entry_t *subsets; /* every explained reduce-scatter count with its mask */
    size_t nsubsets;
} ogroup_t;

typedef struct oracle {
    const mfsdp_manifest_t *m;
    ogroup_t *g;
    size_t npass;
    size_t plen[3];
    size_t *pentry[3];
    size_t fwd[3];
    int pkind[3]; /* 0 training, 1 no-sync, 2 forward-only */
    /* training pass: positions inside it where a job may also end (docs/manifest.md: a
     * sequence of several passes ends after any of them, or after the forward prefix that
     * starts one) */
    unsigned char *inner_end;
    /* memo over (pass, pos, i) */
    int32_t *memo;
    uint32_t *memo_gen;
    uint32_t gen;
    size_t stride_i;
    /* suffix labelings, interned */
    label_t *node_label;
    int32_t *node_next;
    size_t nnodes, capnodes;
    const pu_call_t *calls;
    size_t n;
} oracle_t;

static size_t dtype_bytes(mfsdp_dtype_t d)
{
    return d == MFSDP_FLOAT32 ? 4 : d == MFSDP_UINT8 ? 1 : 2;
}

static void oracle_groups(oracle_t *o, int world)
{
    const mfsdp_manifest_t *m = o->m;
    o->g = calloc(m->ngroups, sizeof(*o->g));
    for (size_t gi = 0; gi < m->ngroups; gi++) {
        const mfsdp_group_desc_t *gd = &m->groups[gi];
        ogroup_t *og = &o->g[gi];
        size_t s[32], bytes = 0, train[32], ntrain = 0;
        int mixed = 0;
        for (size_t i = 0; i < gd->nparams; i++) {
            int64_t rest = 1;
            for (int d = 1; d < gd->params[i].ndim; d++) {
                rest *= gd->params[i].shape[d];
            }
            s[i] = (size_t)((gd->params[i].shape[0] + world - 1) / world * rest);
            bytes += s[i] * dtype_bytes(gd->params[i].dtype);
            mixed |= gd->params[i].dtype != gd->params[0].dtype;
            if (gd->params[i].requires_grad) {
                train[ntrain++] = i;
            }
        }
        og->ag.kind = MFSDP_CALL_ALLGATHER;
        og->ag.dtype = mixed ? MFSDP_UINT8 : gd->params[0].dtype;
        og->ag.count = bytes / dtype_bytes(og->ag.dtype);
        og->rs.kind = MFSDP_CALL_REDUCE_SCATTER;
        og->rs.dtype = gd->has_reduce_dtype ? gd->reduce_dtype : gd->params[0].dtype;
        og->rs.count = 0;
        for (size_t k = 0; k < ntrain; k++) {
            og->rs.count += s[train[k]];
        }
        /* every set of missing params the rules allow: any set (<= 40 trainable params; the
         * families here have at most 14) */
        og->subsets = calloc(((size_t)1 << ntrain) + 1, sizeof(*og->subsets));
        for (uint64_t miss = 0; ntrain > 0 && miss < ((uint64_t)1 << ntrain); miss++) {
            int nmiss = __builtin_popcountll(miss);
            if (nmiss == (int)ntrain) {
                continue;
            }
            uint32_t mask = 0;
            size_t count = 0;
            for (size_t k = 0; k < ntrain; k++) {
                if (!((miss >> k) & 1u)) {
                    mask |= 1u << train[k];
                    count += s[train[k]];
                }
            }
            og->subsets[og->nsubsets++] = (subset_entry_t){count, mask};
        }
    }
}

static void oracle_init(oracle_t *o, const mfsdp_manifest_t *m, int world)
{
    memset(o, 0, sizeof(*o));
    o->m = m;
    oracle_groups(o, world);
    if (m->ncalls > 0) {
        size_t n = m->ncalls;
        for (int k = 0; k < 3; k++) {
            o->pentry[k] = calloc(n + 1, sizeof(size_t));
        }
        /* training: everything; no-sync: the all-gathers; forward-only: the leading
         * all-gathers of distinct groups */
        size_t f = 0;
        for (; f < n; f++) {
            int seen = 0;
            for (size_t j = 0; j < f; j++) {
                seen |= m->sequence[j].group == m->sequence[f].group;
            }
            if (m->sequence[f].kind != MFSDP_CALL_ALLGATHER || seen) {
                break;
            }
        }
        o->npass = 0;
        o->pkind[o->npass] = 0;
        for (size_t i = 0; i < n; i++) {
            o->pentry[o->npass][o->plen[o->npass]++] = i;
        }
        o->npass++;
        if (m->iteration.no_sync) {
            o->pkind[o->npass] = 1;
            for (size_t i = 0; i < n; i++) {
                if (m->sequence[i].kind == MFSDP_CALL_ALLGATHER) {
                    o->pentry[o->npass][o->plen[o->npass]++] = i;
                }
            }
            o->npass++;
        }
        if (m->iteration.forward_only) {
            o->pkind[o->npass] = 2;
            for (size_t i = 0; i < f; i++) {
                o->pentry[o->npass][o->plen[o->npass]++] = i;
            }
            o->npass++;
        }
        for (size_t k = 0; k < o->npass; k++) {
            size_t ff = 0;
            for (; ff < o->plen[k]; ff++) {
                const mfsdp_call_t *c = &m->sequence[o->pentry[k][ff]];
                int seen = 0;
                for (size_t j = 0; j < ff; j++) {
                    seen |= m->sequence[o->pentry[k][j]].group == c->group;
                }
                if (c->kind != MFSDP_CALL_ALLGATHER || seen) {
                    break;
                }
            }
            o->fwd[k] = ff;
            int all_optional = 1;
            for (size_t p = 0; p < o->plen[k]; p++) {
                all_optional &= (m->sequence[o->pentry[k][p]].flags & MFSDP_CALL_OPTIONAL) != 0;
            }
            if (all_optional) {
                fprintf(stderr, "a pass with only optional entries: not supported by the oracle\n");
                exit(2);
            }
        }
        /* Inner pass starts: the training pass's calls repeat its forward prefix there (all
         * of it, or without a leading optional entry), when that prefix has at least two
         * groups. */
        o->inner_end = calloc(n + 1, 1);
        size_t f0 = o->fwd[0];
        size_t lead = f0 > 0 && (m->sequence[0].flags & MFSDP_CALL_OPTIONAL) != 0;
        for (size_t from = 0; from <= lead && f0 - lead >= 2; from++) {
            size_t want = f0 - from;
            for (size_t at = 1; at + want <= n; at++) {
                size_t same = 0;
                for (size_t j = 0; j < want; j++) {
                    const mfsdp_call_t *x = &m->sequence[at + j], *y = &m->sequence[from + j];
                    same += x->kind == y->kind && x->group == y->group;
                }
                int after_lead = m->sequence[at - 1].kind == m->sequence[0].kind &&
                                 m->sequence[at - 1].group == m->sequence[0].group;
                if (same == want && !(from == 1 && after_lead)) {
                    o->inner_end[at] = o->inner_end[at + want] = 1;
                }
            }
        }
        o->stride_i = (n + 1) * 3;
        o->memo = calloc(o->stride_i * (MAXCALLS + 2), sizeof(int32_t));
        o->memo_gen = calloc(o->stride_i * (MAXCALLS + 2), sizeof(uint32_t));
    }
    o->capnodes = 1 << 16;
    o->node_label = calloc(o->capnodes, sizeof(label_t));
    o->node_next = calloc(o->capnodes, sizeof(int32_t));
}

/* Labels a call may take as (kind, group) in the model. */
static size_t labels_of(const oracle_t *o, const mfsdp_call_sig_t *call, size_t g, label_t *out,
                        size_t cap)
{
    const ogroup_t *og = &o->g[g];
    size_t n = 0;
    if (call->kind == MFSDP_CALL_ALLGATHER) {
        if (call->count == og->ag.count && call->dtype == og->ag.dtype) {
            out[n++] = ((label_t)g << 32) | ALL_MASK;
        }
        return n;
    }
    if (og->rs.count == 0 || call->dtype != og->rs.dtype) {
        return 0;
    }
    for (size_t k = 0; k < og->nsubsets && n < cap; k++) {
        if (og->subsets[k].count == call->count) {
            out[n++] = ((label_t)g << 32) | og->subsets[k].mask;
        }
    }
    return n;
}

static int32_t intern(oracle_t *o, label_t l, int32_t next)
{
    /* linear probing would need a hash; suffixes are few, a scan of recent nodes is enough */
    for (size_t k = o->nnodes; k-- > 1 && k + 64 > o->nnodes;) {
        if (o->node_label[k] == l && o->node_next[k] == next) {
            return (int32_t)k;
        }
    }
    if (o->nnodes == o->capnodes) {
        o->capnodes *= 2;
        o->node_label = realloc(o->node_label, o->capnodes * sizeof(label_t));
        o->node_next = realloc(o->node_next, o->capnodes * sizeof(int32_t));
    }
    o->node_label[o->nnodes] = l;
    o->node_next[o->nnodes] = next;
    return (int32_t)o->nnodes++;
}

/* Two suffix labelings are equal when their chains are. */
static int same_suffix(const oracle_t *o, int32_t a, int32_t b)
{
    while (a != b) {
        if (a <= EMPTY_ID || b <= EMPTY_ID || o->node_label[a] != o->node_label[b]) {
            return 0;
        }
        a = o->node_next[a];
        b = o->node_next[b];
    }
    return 1;
}

static int32_t combine(const oracle_t *o, int32_t a, int32_t b)
{
    if (a == NONE_ID) {
        return b;
    }
    if (b == NONE_ID) {
        return a;
    }
    if (a == AMBIG_ID || b == AMBIG_ID) {
        return AMBIG_ID;
    }
    return same_suffix(o, a, b) ? a : AMBIG_ID;
}

#define IN_PROGRESS INT32_MIN

static int32_t R(oracle_t *o, size_t k, size_t p, size_t i)
{
    size_t idx = i * o->stride_i + k * (o->m->ncalls + 1) + p;
    if (o->memo_gen[idx] == o->gen) {
        return o->memo[idx] == IN_PROGRESS ? NONE_ID : o->memo[idx];
    }
    o->memo_gen[idx] = o->gen;
    o->memo[idx] = IN_PROGRESS;
    int32_t res = NONE_ID;
    if (p == o->plen[k]) {
        if (i == o->n) {
            res = combine(o, res, EMPTY_ID);
        }
        for (size_t k2 = 0; k2 < o->npass; k2++) {
            res = combine(o, res, R(o, k2, 0, i));
        }
    } else {
        const mfsdp_call_t *e = &o->m->sequence[o->pentry[k][p]];
        if (i == o->n &&
            ((o->pkind[k] != 2 && p == o->fwd[k]) || (o->pkind[k] == 0 && o->inner_end[p]))) {
            res = combine(o, res, EMPTY_ID);
        }
        if (e->flags & MFSDP_CALL_OPTIONAL) {
            res = combine(o, res, R(o, k, p + 1, i));
        }
        if (i < o->n && o->calls[i].sig.kind == e->kind) {
            label_t ls[8];
            size_t nl = labels_of(o, &o->calls[i].sig, e->group, ls, 8);
            int32_t sub = nl > 0 ? R(o, k, p + 1, i + 1) : NONE_ID;
            for (size_t j = 0; j < nl && sub != NONE_ID && res != AMBIG_ID; j++) {
                res = combine(o, res, sub == AMBIG_ID ? AMBIG_ID : intern(o, ls[j], sub));
            }
        }
    }
    o->memo[idx] = res;
    return res;
}

/* The model's labelings of calls: NONE_ID (invalid), AMBIG_ID, or a chain of labels in out. */
static int32_t oracle_run(oracle_t *o, const pu_call_t *calls, size_t n, label_t *out)
{
    o->calls = calls;
    o->n = n;
    o->nnodes = 1; /* node 0 is EMPTY */
    int32_t res = NONE_ID;
    if (o->m->ncalls > 0) {
        o->gen++;
        for (size_t k = 0; k < o->npass; k++) {
            res = combine(o, res, R(o, k, 0, 0));
        }
    } else {
        /* signature mode: each call alone */
        res = EMPTY_ID;
        for (size_t i = 0; i < n; i++) {
            label_t ls[8];
            size_t nl = 0;
            for (size_t g = 0; g < o->m->ngroups && nl < 2; g++) {
                nl += labels_of(o, &calls[i].sig, g, ls + nl, 8 - nl);
            }
            if (nl == 0) {
                return NONE_ID;
            }
            if (nl > 1) {
                res = AMBIG_ID;
            }
            out[i] = ls[0];
        }
        return res;
    }
    if (res >= 0) {
        int32_t k = res;
        for (size_t i = 0; i < n; i++, k = o->node_next[k]) {
            out[i] = o->node_label[k];
        }
    }
    return res;
}

/* ---------------------------------------------------------------- the matcher's run */

static label_t truth_label(const pu_call_t *c)
{
    if (c->sig.kind == MFSDP_CALL_ALLGATHER) {
        return ((label_t)c->group << 32) | ALL_MASK;
    }
    uint32_t mask = 0;
    for (size_t i = 0; i < 32; i++) {
        mask |= (uint32_t)(c->has_grad[i] != 0) << i;
    }
    return ((label_t)c->group << 32) | mask;
}

/* Runs the matcher: number of calls routed before it stopped (n when it completed and ended
 * fine), labels in out. *stopped_at_end: it stopped at mfsdp_matcher_end. */
static size_t matcher_run(const base_t *b, const pu_call_t *calls, size_t n, label_t *out,
                          int *completed)
{
    mfsdp_matcher_t *mt = NULL;
    char err[1024];
    if (mfsdp_matcher_create(b->m, b->world, err, sizeof(err), &mt) != MFSDP_OK) {
        fprintf(stderr, "%s: matcher_create failed: %s\n", b->name, err);
        exit(2);
    }
    size_t routed = 0;
    *completed = 0;
    for (; routed < n; routed++) {
        mfsdp_match_t mm;
        if (mfsdp_matcher_next(mt, &calls[routed].sig, &mm, err, sizeof(err)) != MFSDP_OK) {
            break;
        }
        uint32_t mask = ALL_MASK;
        if (calls[routed].sig.kind == MFSDP_CALL_REDUCE_SCATTER) {
            mask = 0;
            for (size_t i = 0; i < mm.nparams; i++) {
                mask |= (uint32_t)(mm.has_grad[i] != 0) << i;
            }
        }
        out[routed] = ((label_t)mm.group << 32) | mask;
    }
    if (routed == n && mfsdp_matcher_end(mt, err, sizeof(err)) == MFSDP_OK) {
        *completed = 1;
    }
    mfsdp_matcher_destroy(mt);
    return routed;
}

/* "group b1" or "group b1 without {b1.fc2.bias}" */
static void label_text(const mfsdp_manifest_t *m, label_t l, char *buf, size_t len)
{
    size_t g = (size_t)(l >> 32), off = 0;
    uint32_t mask = (uint32_t)l;
    const mfsdp_group_desc_t *gd = &m->groups[g];
    off += (size_t)snprintf(buf, len, "group %s", gd->name);
    if (mask == ALL_MASK) {
        return;
    }
    int first = 1;
    for (size_t i = 0; i < gd->nparams && off < len; i++) {
        if (gd->params[i].requires_grad && !((mask >> i) & 1u)) {
            off += (size_t)snprintf(buf + off, len - off, "%s%s", first ? " without {" : ", ",
                                    gd->params[i].name);
            first = 0;
        }
    }
    if (!first && off < len) {
        snprintf(buf + off, len - off, "}");
    }
}

/* ---------------------------------------------------------------- corruptions */

enum { C_DROP, C_DUP, C_SWAP, C_INSERT, C_COUNT, NCORRUPT };
static const char *const corrupt_names[] = {"drop", "duplicate", "swap", "insert", "count"};

static size_t corrupt(const base_t *b, int kind, pu_call_t *out, char *what, size_t wlen)
{
    size_t n = b->n;
    memcpy(out, b->calls, n * sizeof(*out));
    size_t i = rnd_below(n);
    switch (kind) {
    case C_DROP:
        memmove(&out[i], &out[i + 1], (n - i - 1) * sizeof(*out));
        snprintf(what, wlen, "drop call %zu", i);
        return n - 1;
    case C_DUP:
        memmove(&out[i + 1], &out[i], (n - i) * sizeof(*out));
        snprintf(what, wlen, "duplicate call %zu", i);
        return n + 1;
    case C_SWAP: {
        size_t j = rnd() % 2 ? (i + 1 < n ? i + 1 : i - 1) : rnd_below(n);
        pu_call_t t = out[i];
        out[i] = out[j];
        out[j] = t;
        snprintf(what, wlen, "swap calls %zu and %zu", i, j);
        return n;
    }
    case C_INSERT: {
        size_t at = rnd_below(n + 1), g = rnd_below(b->m->ngroups);
        mfsdp_call_kind_t k = rnd() % 2 ? MFSDP_CALL_ALLGATHER : MFSDP_CALL_REDUCE_SCATTER;
        pu_call_t c;
        memset(&c, 0, sizeof(c));
        c.group = g;
        if (k == MFSDP_CALL_REDUCE_SCATTER) {
            const mfsdp_group_desc_t *gd = &b->m->groups[g];
            int any = 0;
            for (size_t p = 0; p < gd->nparams; p++) {
                c.has_grad[p] = (unsigned char)(gd->params[p].requires_grad != 0);
                any |= c.has_grad[p];
            }
            if (!any) {
                k = MFSDP_CALL_ALLGATHER;
                memset(c.has_grad, 0, sizeof(c.has_grad));
            }
        }
        pu_sig(b->m, b->world, g, k, k == MFSDP_CALL_REDUCE_SCATTER ? c.has_grad : NULL, &c.sig);
        memmove(&out[at + 1], &out[at], (n - at) * sizeof(*out));
        out[at] = c;
        snprintf(what, wlen, "insert %s of group %s at %zu",
                 k == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter", b->m->groups[g].name,
                 at);
        return n + 1;
    }
    default: {
        size_t before = out[i].sig.count;
        if (rnd() % 2) {
            out[i].sig.count = rnd() % 2 || before == 1 ? before + 1 : before - 1;
        } else {
            size_t g = rnd_below(b->m->ngroups);
            mfsdp_call_sig_t s = {out[i].sig.kind, 0, out[i].sig.dtype};
            pu_sig(b->m, b->world, g, out[i].sig.kind, NULL, &s);
            if (s.count > 0) {
                out[i].sig.count = s.count;
            }
        }
        snprintf(what, wlen, "count of call %zu %zu -> %zu", i, before, out[i].sig.count);
        return n;
    }
    }
}

static int same_wire(const pu_call_t *a, size_t na, const pu_call_t *b, size_t nb)
{
    if (na != nb) {
        return 0;
    }
    for (size_t i = 0; i < na; i++) {
        if (a[i].sig.kind != b[i].sig.kind || a[i].sig.count != b[i].sig.count ||
            a[i].sig.dtype != b[i].sig.dtype) {
            return 0;
        }
    }
    return 1;
}

/* ---------------------------------------------------------------- main */

static void build_bases(void)
{
    static const unsigned char titan_keep_out[] = {1, 1, 1, 1, 0};
    static const unsigned char titan_keep_two[] = {1, 1, 1, 0, 0};
    static const unsigned char all4[] = {1, 1, 1, 1};
    const mfsdp_fsdp2_config_t dflt = {1, 1, NULL}, nopf = {1, 0, NULL}, rootre = {1, 1, all4};
    const mfsdp_fsdp2_config_t titan = {0, 1, titan_keep_out}, titan_old = {0, 1, titan_keep_two};
    char kinds[5][64] = {"T T T F", "NT NT NT F", "NNNT NNNT", "TF TF TF", ""};
    for (int s = 0; s < 5; s++) {
        for (int rep = 0; rep < 3; rep++) {
            if (s == 4) {
                /* irregular: 5-8 random passes ending with a training pass, maybe final
                 * all-gathers */
                size_t len = 5 + rnd_below(4), off = 0;
                for (size_t k = 0; k + 1 < len; k++) {
                    uint64_t r = rnd() % 4;
                    kinds[4][off++] = r < 2 ? 'T' : r == 2 ? 'N' : 'F';
                }
                kinds[4][off++] = 'T';
                if (rnd() % 2) {
                    kinds[4][off++] = 'F';
                }
                kinds[4][off] = '\0';
            } else if (rep > 0) {
                continue;
            }
            const char *k = kinds[s];
            for (int src = 0; src < 2; src++) {
                for (int gm = 0; gm < 3; gm++) {
                    /* fsdp_train-like: the root's lm_head.bias unused collides with a block */
                    add_base(NULL, 0, "fsdp_train", 2, &dflt, "default", k, gm, 0, 3,
                             (source_t)src);
                    add_base(NULL, 0, "fsdp_train", 3, &dflt, "default", k, gm, 2, 1,
                             (source_t)src);
                    add_base(NULL, 0, "fsdp_train", 2, &nopf, "no-prefetch", k, gm, 2, 3,
                             (source_t)src);
                    add_base(NULL, 0, "fsdp_train", 2, &rootre, "root-reshard", k, gm, 0, 1,
                             (source_t)src);
                    /* torchtitan: the output group's norm (unique), a block's wk (as wv) */
                    add_base(family_titan, 0, "titan", 2, &titan, "titan", k, gm, 4, 0,
                             (source_t)src);
                    add_base(family_titan, 0, "titan", 2, &titan_old, "titan-old", k, gm, 2, 1,
                             (source_t)src);
                    add_base(family_large, 0, "large", 2, &dflt, "default", k, gm, 1, 5,
                             (source_t)src);
                }
                add_base(NULL, 1, "fsdp_train-frozen", 2, &dflt, "default", k, 0, 0, 0,
                         (source_t)src);
                add_base(family_mixed, 0, "mixed", 2, &dflt, "default", k, 0, 0, 0, (source_t)src);
                add_base(family_mixed, 0, "mixed", 2, &nopf, "no-prefetch", k, 2, 1, 1,
                         (source_t)src);
            }
            for (int gm = 0; gm < 3; gm++) {
                add_base(family_unique, 0, "unique", 2, &dflt, "default", k, gm, 0, 1,
                         SRC_SIGNATURE);
            }
        }
    }
}

int main(int argc, char **argv)
{
    size_t ncases = 100000;
    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "--cases") == 0 && a + 1 < argc) {
            ncases = strtoull(argv[++a], NULL, 10);
        } else {
            fprintf(stderr, "usage: %s [--cases N]   (MFSDP_TEST_SEED=S to replay)\n", argv[0]);
            return 2;
        }
    }
    uint64_t seed = 20251201;
    const char *env = getenv("MFSDP_TEST_SEED");
    if (env != NULL && env[0] != '\0') {
        seed = strtoull(env, NULL, 0);
    }
    rng_state = seed;
    printf("matcher property test: seed %" PRIu64 " (replay with MFSDP_TEST_SEED=%" PRIu64
           "), %zu cases\n",
           seed, seed, ncases);
    build_bases();

    /* Clean streams: a joined manifest must identify its own stream; the oracle agrees. */
    static oracle_t oracles[MAXBASE];
    static label_t lm[MAXCALLS + 2], lo[MAXCALLS + 2], lt[MAXCALLS + 2];
    size_t failures = 0;
    for (size_t bi = 0; bi < nbases; bi++) {
        base_t *b = &bases[bi];
        oracle_init(&oracles[bi], b->m, b->world);
        int completed = 0;
        size_t routed = matcher_run(b, b->calls, b->n, lm, &completed);
        int32_t res = oracle_run(&oracles[bi], b->calls, b->n, lo);
        int correct = completed;
        for (size_t i = 0; i < b->n && correct; i++) {
            correct = lm[i] == truth_label(&b->calls[i]);
        }
        if (b->src == SRC_JOIN && !correct) {
            join_uncorrupted_fail++;
            fprintf(stderr,
                    "FAIL %s: the joined manifest stops or misroutes its own stream at "
                    "call %zu\n",
                    b->name, routed);
        }
        if (b->src != SRC_JOIN && !completed) {
            variant_clean_stopped++;
        }
        if (completed && (res < 0 || memcmp(lo, lm, b->n * sizeof(label_t)) != 0)) {
            failures++;
            fprintf(stderr,
                    "FAIL %s: the matcher completes the clean stream, the oracle says "
                    "%s\n",
                    b->name,
                    res == NONE_ID    ? "invalid"
                    : res == AMBIG_ID ? "ambiguous"
                                      : "other labels");
        }
    }

    size_t stopped = 0, stopped_at_end = 0, stopped_valid = 0, correct = 0, noop = 0, indist = 0;
    size_t silent_invalid = 0, silent_ambig = 0, silent_labels = 0;
    size_t routed_before_stop = 0, misrouted_before_stop = 0;
    size_t per_kind[NCORRUPT][3] = {{0}};
    int example_shown[NCORRUPT] = {0};
    static pu_call_t cc[MAXCALLS + 2];
    for (size_t c = 0; c < ncases; c++) {
        size_t bi = rnd_below(nbases);
        const base_t *b = &bases[bi];
        int kind = (int)rnd_below(NCORRUPT);
        char what[160];
        size_t n = corrupt(b, kind, cc, what, sizeof(what));
        if (same_wire(cc, n, b->calls, b->n)) {
            noop++;
            continue;
        }
        for (size_t i = 0; i < n; i++) {
            lt[i] = truth_label(&cc[i]);
        }
        int completed = 0;
        size_t routed = matcher_run(b, cc, n, lm, &completed);
        int32_t res = oracle_run(&oracles[bi], cc, n, lo);
        if (!completed) {
            stopped++;
            per_kind[kind][0]++;
            stopped_at_end += routed == n;
            stopped_valid += res >= 0;
            routed_before_stop += routed;
            for (size_t i = 0; i < routed; i++) {
                misrouted_before_stop += lm[i] != lt[i];
            }
            continue;
        }
        if (res == NONE_ID || res == AMBIG_ID || memcmp(lm, lo, n * sizeof(label_t)) != 0) {
            silent_invalid += res == NONE_ID;
            silent_ambig += res == AMBIG_ID;
            silent_labels += res >= 0;
            fprintf(stderr, "SILENT MISROUTE case %zu (%s; %s): oracle %s\n", c, b->name, what,
                    res == NONE_ID    ? "invalid"
                    : res == AMBIG_ID ? "ambiguous"
                                      : "other labels");
            continue;
        }
        if (memcmp(lm, lt, n * sizeof(label_t)) == 0) {
            correct++;
            per_kind[kind][1]++;
        } else {
            indist++;
            per_kind[kind][2]++;
            if (!example_shown[kind]) {
                size_t i = 0;
                while (lm[i] == lt[i]) {
                    i++;
                }
                char a[200], z[200];
                label_text(b->m, lt[i], a, sizeof(a));
                label_text(b->m, lm[i], z, sizeof(z));
                printf("  indistinguishable example (%s; %s): call %zu is truly %s; the corrupted "
                       "stream is a valid stream of the manifest in which it is %s\n",
                       b->name, what, i, a, z);
                example_shown[kind] = 1;
            }
        }
    }
    size_t silent = silent_invalid + silent_ambig + silent_labels;
    size_t used[3] = {0};
    for (size_t bi = 0; bi < nbases; bi++) {
        used[bases[bi].src]++;
    }
    printf("base streams: %zu (joined manifests %zu, hand-written variants %zu, signature mode "
           "%zu); joins refused %zu; clean streams a hand-written manifest stops: %zu\n",
           nbases, used[SRC_JOIN], used[SRC_VARIANT], used[SRC_SIGNATURE], join_refused,
           variant_clean_stopped);
    printf("cases %zu: stopped %zu (at mfsdp_matcher_end %zu, on a valid stream %zu), "
           "completed-correct %zu, no-op skipped %zu, indistinguishable %zu, silent misroutes "
           "%zu (invalid %zu, ambiguous %zu, labels %zu)\n",
           ncases, stopped, stopped_at_end, stopped_valid, correct, noop, indist, silent,
           silent_invalid, silent_ambig, silent_labels);
    printf("calls routed before the stop: %zu (%.1f per stopped case), of which %zu to another "
           "group or param set than the truth\n",
           routed_before_stop, stopped ? (double)routed_before_stop / (double)stopped : 0.0,
           misrouted_before_stop);
    for (int k = 0; k < NCORRUPT; k++) {
        printf("  %-9s stopped %zu, completed-correct %zu, indistinguishable %zu\n",
               corrupt_names[k], per_kind[k][0], per_kind[k][1], per_kind[k][2]);
    }
    if (silent > 0 || join_uncorrupted_fail > 0 || failures > 0) {
        printf("FAILED: %zu silent misroutes, %zu joined manifests fail their own stream, %zu "
               "clean-stream disagreements\n",
               silent, join_uncorrupted_fail, failures);
        return 1;
    }
    printf("ok: 0 silent misroutes\n");
    return 0;
}
