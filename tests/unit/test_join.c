/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Record join (core/join.h): records generated from FSDP2's call patterns
 * (core/fsdp2_pattern.h, checked against real FSDP2 in test_fsdp2_pattern.c) join into the
 * expected sequence and iteration variants; ambiguous or foreign records are refused.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/join.h"
#include "pattern_util.h"

#define WORLD 2

/* fsdp_train-like: root (embed, norm, lm_head, lm_head.bias) + L blocks (fc1, fc1.bias, fc2,
 * fc2.bias). At world 2 a block's count is 16+4+16+2 = 38, the root's 20+2+16+4 = 42, and the
 * root without lm_head.bias is 38: a colliding unused-param count. */
static mfsdp_manifest_t *fsdp_train_like(int L)
{
    char json[16384];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"root\", \"params\": ["
        "{\"name\": \"embed\", \"shape\": [10, 4], \"dtype\": \"float32\"}, "
        "{\"name\": \"norm\", \"shape\": [4], \"dtype\": \"float32\"}, "
        "{\"name\": \"lm_head.weight\", \"shape\": [8, 4], \"dtype\": \"float32\"}, "
        "{\"name\": \"lm_head.bias\", \"shape\": [8], \"dtype\": \"float32\"}]}");
    for (int l = 0; l < L; l++) {
        off += (size_t)snprintf(
            json + off, sizeof(json) - off,
            ", {\"name\": \"b%d\", \"params\": ["
            "{\"name\": \"b%d.fc1.weight\", \"shape\": [8, 4], \"dtype\": \"float32\"}, "
            "{\"name\": \"b%d.fc1.bias\", \"shape\": [8], \"dtype\": \"float32\"}, "
            "{\"name\": \"b%d.fc2.weight\", \"shape\": [4, 8], \"dtype\": \"float32\"}, "
            "{\"name\": \"b%d.fc2.bias\", \"shape\": [4], \"dtype\": \"float32\"}]}",
            l, l, l, l, l);
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "test", err, sizeof(err), &m), MFSDP_OK,
                 "%s", err);
    return m;
}

/* torchtitan-like: emb, L blocks (attention + MLP, 9 params), out (norm, output). */
static mfsdp_manifest_t *titan_like(int L)
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
    for (int l = 0; l < L; l++) {
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
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "test", err, sizeof(err), &m), MFSDP_OK,
                 "%s", err);
    return m;
}

static pu_call_t CALLS[4096];

static size_t gen(const mfsdp_manifest_t *m, const mfsdp_fsdp2_config_t *cfg, const char *kinds,
                  pu_grads_fn grads, void *arg)
{
    size_t n = 0;
    cr_assert_eq(pu_stream(m, WORLD, cfg, kinds, grads, arg, CALLS, 4096, &n), MFSDP_OK);
    return n;
}

static mfsdp_join_t *join_ok(const mfsdp_manifest_t *m, size_t n)
{
    mfsdp_record_t *rec = pu_record(CALLS, n, WORLD);
    mfsdp_join_t *j = NULL;
    char err[2048] = "";
    cr_assert_eq(mfsdp_record_join(m, WORLD, rec, err, sizeof(err), &j), MFSDP_OK, "%s", err);
    cr_expect_eq(j->comm, 1, "the size-1 comm is skipped");
    mfsdp_record_free(rec);
    return j;
}

static void join_refused(const mfsdp_manifest_t *m, size_t n, const char *const *parts)
{
    mfsdp_record_t *rec = pu_record(CALLS, n, WORLD);
    mfsdp_join_t *j = (mfsdp_join_t *)0x1;
    char err[2048] = "";
    cr_assert_eq(mfsdp_record_join(m, WORLD, rec, err, sizeof(err), &j), MFSDP_ERR_MISMATCH);
    cr_expect_eq(j, (mfsdp_join_t *)0x1, "no output on error");
    for (const char *const *p = parts; *p != NULL; p++) {
        cr_expect(strstr(err, *p) != NULL, "missing '%s' in: %s", *p, err);
    }
    cr_expect(strchr(err, '\n') == NULL && err[0] >= 'a' && err[0] <= 'z', "%s", err);
    mfsdp_record_free(rec);
}

/* The join's sequence as "AG root AG b0 ... RS root", optional entries with a '?'. */
static void expect_sequence(const mfsdp_manifest_t *m, const mfsdp_join_t *j, const char *want)
{
    char got[8192] = "";
    size_t off = 0;
    for (size_t i = 0; i < j->ncalls; i++) {
        off += (size_t)snprintf(got + off, sizeof(got) - off, "%s%s %s%s", i ? " " : "",
                                j->sequence[i].kind == MFSDP_CALL_ALLGATHER ? "AG" : "RS",
                                m->groups[j->sequence[i].group].name,
                                (j->sequence[i].flags & MFSDP_CALL_OPTIONAL) ? "?" : "");
    }
    cr_expect_str_eq(got, want, "\n got: %s\nwant: %s", got, want);
}

/* The joined manifest routes a fresh stream of the same job to its true groups. */
static void expect_routes(mfsdp_manifest_t *m, const mfsdp_join_t *j, size_t n)
{
    mfsdp_call_t *saved = m->sequence;
    size_t saved_n = m->ncalls;
    mfsdp_iteration_t saved_it = m->iteration;
    m->sequence = j->sequence;
    m->ncalls = j->ncalls;
    m->iteration = j->iteration;
    mfsdp_matcher_t *mt = NULL;
    char err[2048] = "";
    cr_assert_eq(mfsdp_matcher_create(m, WORLD, err, sizeof(err), &mt), MFSDP_OK, "%s", err);
    for (size_t i = 0; i < n; i++) {
        mfsdp_match_t mm;
        cr_assert_eq(mfsdp_matcher_next(mt, &CALLS[i].sig, &mm, err, sizeof(err)), MFSDP_OK,
                     "call %zu: %s", i, err);
        cr_assert_eq(mm.group, CALLS[i].group, "call %zu", i);
        if (CALLS[i].sig.kind == MFSDP_CALL_REDUCE_SCATTER) {
            cr_assert_eq(memcmp(mm.has_grad, CALLS[i].has_grad, mm.nparams), 0, "call %zu", i);
        }
    }
    cr_expect_eq(mfsdp_matcher_end(mt, err, sizeof(err)), MFSDP_OK, "%s", err);
    mfsdp_matcher_destroy(mt);
    m->sequence = saved;
    m->ncalls = saved_n;
    m->iteration = saved_it;
}

static const mfsdp_fsdp2_config_t DEFAULT_CFG = {.root = 1, .prefetch = 1, .reshard = NULL};

#define T3 "AG root AG b0 AG b1 AG b2 AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root"
#define N3 "AG root AG b0 AG b1 AG b2 AG b2 AG b1 AG b0"

Test(join, default_fsdp2)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    /* four steps, then the job's final all-gathers (fsdp_train's end) */
    size_t n = gen(m, &DEFAULT_CFG, "T T T T F", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j, T3);
    cr_expect(!j->iteration.forward_only && !j->iteration.no_sync);
    cr_expect_eq(j->period, 1);
    cr_expect_eq(j->npasses[MFSDP_PASS_TRAIN], 4);
    cr_expect_eq(j->npasses[MFSDP_PASS_FORWARD], 0, "the final all-gathers are not a variant");
    cr_expect(strstr(j->config, "root root, backward prefetch 1") != NULL, "%s", j->config);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    /* one iteration (what older shims recorded) joins to the same sequence */
    n = gen(m, &DEFAULT_CFG, "T", NULL, NULL);
    j = join_ok(m, n);
    expect_sequence(m, j, T3);
    cr_expect_eq(j->period, 0);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, no_prefetch)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 0, .reshard = NULL};
    size_t n = gen(m, &cfg, "T T T", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j, "AG root AG b0 AG b1 AG b2 AG b2 RS b2 AG b1 RS b1 AG b0 RS b0 RS root");
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, accumulation_two_and_four)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    size_t n = gen(m, &DEFAULT_CFG, "NT NT NT F", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j, N3 " " T3);
    cr_expect_eq(j->period, 2);
    cr_expect(!j->iteration.forward_only && !j->iteration.no_sync, "an exact multi-pass cycle");
    cr_expect_eq(j->npasses[MFSDP_PASS_NO_SYNC], 3);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    n = gen(m, &DEFAULT_CFG, "NNNT NNNT", NULL, NULL);
    j = join_ok(m, n);
    expect_sequence(m, j, N3 " " N3 " " N3 " " T3);
    cr_expect_eq(j->period, 4);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, eval_every_step)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    /* the root stays unsharded after each eval forward: later training passes skip it */
    size_t n = gen(m, &DEFAULT_CFG, "TF TF TF", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j,
                    "AG root? AG b0 AG b1 AG b2 AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root "
                    "AG root AG b0 AG b1 AG b2");
    cr_expect_eq(j->period, 2);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, torchtitan_wrapping)
{
    mfsdp_manifest_t *m = titan_like(3);
    static const unsigned char keep_out[] = {1, 1, 1, 1, 0};
    mfsdp_fsdp2_config_t cfg = {.root = 0, .prefetch = 1, .reshard = keep_out};
    size_t n = gen(m, &cfg, "T T T", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j,
                    "AG emb AG layers.0 AG layers.1 AG layers.2 AG out AG layers.2 RS out "
                    "AG layers.1 RS layers.2 AG layers.0 RS layers.1 AG emb RS layers.0 RS emb");
    cr_expect(strstr(j->config, "no root group") != NULL, "%s", j->config);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    /* with an eval every step: the output group's forward all-gather and the extra prefetch
     * after an eval are optional */
    n = gen(m, &cfg, "TF TF TF", NULL, NULL);
    j = join_ok(m, n);
    expect_sequence(m, j,
                    "AG emb AG layers.0 AG layers.1 AG layers.2 AG out? AG layers.2 RS out "
                    "AG layers.1 RS layers.2 AG layers.0 RS layers.1 AG emb RS layers.0 AG out? "
                    "RS emb AG emb AG layers.0 AG layers.1 AG layers.2 AG out");
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

/* The root's lm_head.bias gets no gradient in passes 1 and 3 (its count then equals a
 * block's); block 1's fc2.bias none in pass 2. */
static const unsigned char *const *unused_grads(void *arg, size_t pass)
{
    (void)arg;
    static const unsigned char root_no_bias[4] = {1, 1, 1, 0};
    static const unsigned char b1_no_bias[4] = {1, 1, 1, 0};
    static const unsigned char *hg1[4] = {root_no_bias, NULL, NULL, NULL};
    static const unsigned char *hg2[4] = {NULL, NULL, b1_no_bias, NULL};
    return pass % 2 == 1 ? hg1 : pass == 2 ? hg2 : NULL;
}

Test(join, unused_param)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    size_t n = gen(m, &DEFAULT_CFG, "T T T T", unused_grads, NULL);
    cr_assert_eq(CALLS[21].sig.kind, MFSDP_CALL_REDUCE_SCATTER);
    cr_assert_eq(CALLS[21].sig.count, CALLS[20].sig.count, "the colliding count");
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j, T3);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

/* In pass 1 the groups get the has_grad arrays *arg points to (a group without any gradient
 * in that pass: a detached or skipped module); every param has one in the other passes. */
static const unsigned char *const *gradless_pass1(void *arg, size_t pass)
{
    return pass == 1 ? *(const unsigned char *const *const *)arg : NULL;
}

Test(join, group_without_gradients_is_refused)
{
    /* FSDP2 skips the reduce-scatter of a group that got no gradient. The join does not guess
     * which group that was (with identical blocks any of them could be): refused, naming the
     * first call no pattern places. */
    mfsdp_manifest_t *m = fsdp_train_like(1);
    static const unsigned char none[4] = {0, 0, 0, 0};
    const unsigned char *hg[2] = {NULL, none};
    const unsigned char *const *arg = hg;
    size_t n = gen(m, &DEFAULT_CFG, "T T T", gradless_pass1, &arg);
    cr_assert_eq(n, 14);
    const char *parts[] = {"record: no FSDP2 call pattern explains comms[1].calls[8] "
                           "reduce_scatter(count=42, float32)",
                           "expected reduce_scatter(count=38, float32) of group b0", NULL};
    join_refused(m, n, parts);
    mfsdp_manifest_free(m);
}

Test(join, irregular_passes_use_variants)
{
    /* groups of different sizes: the variants identify every call */
    mfsdp_manifest_t *m = fsdp_train_like(1);
    size_t n = gen(m, &DEFAULT_CFG, "T N T F T F F T N N T", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j, "AG root? AG b0 AG b0 RS b0 RS root");
    cr_expect_eq(j->period, 0);
    cr_expect(j->iteration.forward_only && j->iteration.no_sync);
    expect_routes(m, j, n);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
    /* identical blocks: the variants would make calls ambiguous: refused */
    m = fsdp_train_like(3);
    n = gen(m, &DEFAULT_CFG, "T F T T F F T T", NULL, NULL);
    const char *parts[] = {"record: the joined sequence would stop the job", "is ambiguous", NULL};
    join_refused(m, n, parts);
    mfsdp_manifest_free(m);
}

Test(join, record_cut_short)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    size_t n = gen(m, &DEFAULT_CFG, "T T T T", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n - 4); /* the record's cap hit mid-pass */
    expect_sequence(m, j, T3);
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, foreign_call_refused)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    size_t n = gen(m, &DEFAULT_CFG, "T T", NULL, NULL);
    memmove(&CALLS[6], &CALLS[5], (n - 5) * sizeof(CALLS[0]));
    CALLS[5].sig = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, 7, MFSDP_FLOAT32};
    const char *parts[] = {"record: comms[1].calls[5] allgather(count=7, float32) fits no group",
                           NULL};
    join_refused(m, n + 1, parts);
    n = gen(m, &DEFAULT_CFG, "T T", NULL, NULL);
    CALLS[6].sig.count = 37; /* a reduce-scatter no param set explains */
    const char *parts2[] = {"comms[1].calls[6] reduce_scatter(count=37, float32) fits no group",
                            NULL};
    join_refused(m, n, parts2);
    mfsdp_manifest_free(m);
}

Test(join, two_configurations_label_differently)
{
    /* Two identical groups g0, g1. "AG AG AG RS RS" is FSDP2's default with g0 as the root
     * (g1 re-gathered: labels g0 g1 g1 g1 g0) and also no root with g1 kept unsharded after
     * forward (g0 prefetched by g1: labels g0 g1 g0 g1 g0). */
    const char *json =
        "{\"format\": \"mfsdp-manifest/1\", \"groups\": ["
        "{\"name\": \"g0\", \"params\": [{\"name\": \"g0.w\", \"shape\": [6, 4], \"dtype\": "
        "\"float32\"}]}, {\"name\": \"g1\", \"params\": [{\"name\": \"g1.w\", \"shape\": [6, 4], "
        "\"dtype\": \"float32\"}]}]}";
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "test", err, sizeof(err), &m), MFSDP_OK,
                 "%s", err);
    size_t n = gen(m, &DEFAULT_CFG, "T T", NULL, NULL);
    cr_assert_eq(n, 10);
    const char *parts[] = {"record: comms[1].calls[2] allgather(count=12, float32) is group g1",
                           "and group g0 under another", "no root group", "mfsdp-run", NULL};
    join_refused(m, n, parts);
    mfsdp_manifest_free(m);
}

Test(join, two_readings_of_one_configuration_refused)
{
    /* With a root that reshards after forward, a no-sync pass (AG root b0 b1 b2 root b2 b1
     * b0) reads like two forward-only passes (AG root b0 b1 b2, AG root b0 b1 b2), with other
     * groups for the block all-gathers. */
    mfsdp_manifest_t *m = fsdp_train_like(3);
    static const unsigned char all[4] = {1, 1, 1, 1};
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = all};
    size_t n = gen(m, &cfg, "NT NT", NULL, NULL);
    const char *parts[] = {"record: comms[1].calls[5] allgather(count=38, float32) is group b2 or "
                           "group b0 under the same FSDP2 pattern (root root resharded after "
                           "forward",
                           "two readings of the passes", NULL};
    join_refused(m, n, parts);
    /* the same job without accumulation joins */
    n = gen(m, &cfg, "T T T", NULL, NULL);
    mfsdp_join_t *j = join_ok(m, n);
    expect_sequence(m, j,
                    "AG root AG b0 AG b1 AG b2 AG root AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 "
                    "RS root");
    mfsdp_join_free(j);
    mfsdp_manifest_free(m);
}

Test(join, other_refusals)
{
    mfsdp_manifest_t *m = fsdp_train_like(3);
    size_t n = gen(m, &DEFAULT_CFG, "T T", NULL, NULL);
    /* no communicator of the world size */
    mfsdp_record_t *rec = pu_record(CALLS, n, 4);
    mfsdp_join_t *j = NULL;
    char err[2048] = "";
    cr_expect_eq(mfsdp_record_join(m, WORLD, rec, err, sizeof(err), &j), MFSDP_ERR_MISMATCH);
    cr_expect(strstr(err, "no communicator of size 2") != NULL, "%s", err);
    mfsdp_record_free(rec);
    /* a reduce-scatter in the forward: no FSDP2 pattern places it */
    CALLS[3].sig.kind = MFSDP_CALL_REDUCE_SCATTER;
    const char *parts[] = {"record: no FSDP2 call pattern explains comms[1].calls[3] "
                           "reduce_scatter(count=38, float32)",
                           "expected allgather(count=38, float32) of group b2", NULL};
    join_refused(m, n, parts);
    mfsdp_manifest_free(m);
    /* no pass with reduce-scatters */
    m = fsdp_train_like(1);
    n = gen(m, &DEFAULT_CFG, "F N F", NULL, NULL);
    const char *parts2[] = {"record: comms[1] holds no complete training pass", NULL};
    join_refused(m, n, parts2);
    mfsdp_manifest_free(m);
}
