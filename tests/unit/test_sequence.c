/* SPDX-License-Identifier: Apache-2.0 */
/* Call matching, recording and record join (DESIGN.md section 6). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/sequence.h"

/* root: embed (10, 4) + norm (4); blocks b0..b2: W (6, 4) + bias (6), all float32.
 * At world 2: root AG count = 5*4 + 2 = 22; block AG count = 3*4 + 3 = 15. */
static mfsdp_param_desc_t P[4][2];
static mfsdp_group_desc_t G[4];
static mfsdp_manifest_t M;
static mfsdp_call_t SEQ[16];
static const char *gnames[4] = {"root", "b0", "b1", "b2"};

static void setp(mfsdp_param_desc_t *p, const char *name, int64_t d0, int64_t d1)
{
    memset(p, 0, sizeof(*p));
    p->name = (char *)name;
    p->ndim = d1 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->numel = d0 * (d1 ? d1 : 1);
    p->dtype = MFSDP_FLOAT32;
    p->requires_grad = 1;
    p->optimizer = d1 ? MFSDP_ROLE_MUON : MFSDP_ROLE_ADAMW;
}

static void build(size_t nblocks)
{
    memset(&M, 0, sizeof(M));
    setp(&P[0][0], "embed", 10, 4);
    setp(&P[0][1], "norm", 4, 0);
    for (size_t b = 1; b <= 3; b++) {
        setp(&P[b][0], "W", 6, 4);
        setp(&P[b][1], "bias", 6, 0);
    }
    for (size_t g = 0; g < 4; g++) {
        memset(&G[g], 0, sizeof(G[g]));
        G[g].name = (char *)gnames[g];
        G[g].lr_scale = 1;
        G[g].nparams = 2;
        G[g].params = P[g];
    }
    M.groups = G;
    M.ngroups = 1 + nblocks;
}

static mfsdp_call_sig_t ag(size_t count)
{
    return (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, count, MFSDP_FLOAT32};
}
static mfsdp_call_sig_t rs(size_t count)
{
    return (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, count, MFSDP_FLOAT32};
}

static size_t next(mfsdp_matcher_t *mt, mfsdp_call_sig_t s)
{
    size_t g = 12345;
    char err[256] = "";
    cr_assert_eq(mfsdp_matcher_next(mt, &s, err, sizeof(err), &g), MFSDP_OK, "%s", err);
    return g;
}

Test(sequence, unique_signatures_match_without_sequence)
{
    build(1);
    mfsdp_matcher_t *mt = NULL;
    char err[256] = "";
    cr_assert_eq(mfsdp_matcher_create(&M, 2, err, sizeof(err), &mt), MFSDP_OK, "%s", err);
    cr_expect_eq(next(mt, ag(22)), 0);
    cr_expect_eq(next(mt, ag(15)), 1);
    cr_expect_eq(next(mt, rs(15)), 1);
    cr_expect_eq(next(mt, rs(22)), 0);
    cr_expect_eq(next(mt, ag(16)), MFSDP_GROUP_NONE, "unknown count passes through");
    mfsdp_call_sig_t bf = {MFSDP_CALL_ALLGATHER, 15, MFSDP_BFLOAT16};
    cr_expect_eq(next(mt, bf), MFSDP_GROUP_NONE, "other dtype passes through");
    mfsdp_matcher_destroy(mt);
}

Test(sequence, identical_blocks_need_a_sequence)
{
    build(3);
    mfsdp_matcher_t *mt = (mfsdp_matcher_t *)0x1;
    char err[512] = "";
    cr_expect_eq(mfsdp_matcher_create(&M, 2, err, sizeof(err), &mt), MFSDP_ERR_UNSUPPORTED);
    cr_expect_eq(mt, (mfsdp_matcher_t *)0x1);
    cr_expect(strstr(err, "MFSDP_RECORD") != NULL, "%s", err);
    cr_expect(strstr(err, "b0") != NULL && strstr(err, "b1") != NULL, "%s", err);
}

Test(sequence, sequence_order_and_contradiction)
{
    build(3);
    /* forward root, b0, b1, b2; backward b2 rs, b1 ag, b1 rs, b0 ag, b0 rs, root rs */
    mfsdp_call_t seq[] = {{MFSDP_CALL_ALLGATHER, 0},      {MFSDP_CALL_ALLGATHER, 1},
                          {MFSDP_CALL_ALLGATHER, 2},      {MFSDP_CALL_ALLGATHER, 3},
                          {MFSDP_CALL_REDUCE_SCATTER, 3}, {MFSDP_CALL_ALLGATHER, 2},
                          {MFSDP_CALL_REDUCE_SCATTER, 2}, {MFSDP_CALL_ALLGATHER, 1},
                          {MFSDP_CALL_REDUCE_SCATTER, 1}, {MFSDP_CALL_REDUCE_SCATTER, 0}};
    memcpy(SEQ, seq, sizeof(seq));
    M.sequence = SEQ;
    M.ncalls = sizeof(seq) / sizeof(seq[0]);
    mfsdp_matcher_t *mt = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_matcher_create(&M, 2, err, sizeof(err), &mt), MFSDP_OK, "%s", err);
    for (int iter = 0; iter < 2; iter++) { /* wraps around to the next iteration */
        cr_expect_eq(next(mt, ag(22)), 0);
        cr_expect_eq(next(mt, ag(15)), 1);
        cr_expect_eq(next(mt, ag(7)), MFSDP_GROUP_NONE, "foreign call passes");
        cr_expect_eq(next(mt, ag(15)), 2);
        cr_expect_eq(next(mt, ag(15)), 3);
        cr_expect_eq(next(mt, rs(15)), 3);
        cr_expect_eq(next(mt, ag(15)), 2);
        cr_expect_eq(next(mt, rs(15)), 2);
        cr_expect_eq(next(mt, ag(15)), 1);
        cr_expect_eq(next(mt, rs(15)), 1);
        cr_expect_eq(next(mt, rs(22)), 0);
    }
    /* now expecting ag root (22); a block reduce-scatter contradicts */
    mfsdp_call_sig_t bad = rs(15);
    size_t g = 77;
    cr_expect_eq(mfsdp_matcher_next(mt, &bad, err, sizeof(err), &g), MFSDP_ERR_SEQUENCE);
    cr_expect_eq(g, 77, "no output on error");
    cr_expect(strstr(err, "expected allgather(count=22, float32) of group root") != NULL, "%s",
              err);
    cr_expect(strstr(err, "received reduce_scatter(count=15, float32)") != NULL, "%s", err);
    mfsdp_matcher_destroy(mt);
}

Test(sequence, sequence_entry_without_gradients_rejected)
{
    build(1);
    P[1][0].requires_grad = 0;
    P[1][1].requires_grad = 0;
    mfsdp_call_t seq[] = {{MFSDP_CALL_REDUCE_SCATTER, 1}};
    memcpy(SEQ, seq, sizeof(seq));
    M.sequence = SEQ;
    M.ncalls = 1;
    mfsdp_matcher_t *mt = NULL;
    char err[256] = "";
    cr_expect_eq(mfsdp_matcher_create(&M, 2, err, sizeof(err), &mt), MFSDP_ERR_INVALID_ARG);
    cr_expect(strstr(err, "sequence[0]") != NULL, "%s", err);
}

static mfsdp_record_t *make_record(const mfsdp_call_sig_t *calls, size_t n, int size)
{
    mfsdp_record_t *rec = calloc(1, sizeof(*rec));
    rec->ncomms = 2;
    rec->comms = calloc(2, sizeof(*rec->comms));
    rec->comms[0].size = 1; /* a world-1 comm (e.g. a replicate group) is skipped */
    rec->comms[1].size = size;
    rec->comms[1].ncalls = n;
    rec->comms[1].calls = calloc(n, sizeof(mfsdp_record_call_t));
    for (size_t i = 0; i < n; i++) {
        rec->comms[1].calls[i].sig = calls[i];
        snprintf(rec->comms[1].calls[i].op, 16, "%s",
                 calls[i].kind == MFSDP_CALL_ALLGATHER ? "none" : "avg");
    }
    return rec;
}

Test(sequence, record_roundtrip_and_join)
{
    build(3);
    /* b2 is not re-gathered in backward (reshard_after_forward=False); a foreign call
     * (count 3) sits in the middle. */
    mfsdp_call_sig_t calls[] = {ag(22), ag(15), ag(15), ag(3), ag(15), rs(15), ag(15),
                                rs(15), ag(15), rs(15), rs(22)};
    size_t n = sizeof(calls) / sizeof(calls[0]);
    mfsdp_record_t *rec = make_record(calls, n, 2);
    char path[] = "/tmp/mfsdp-record-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_eq(mfsdp_record_write(rec, f), MFSDP_OK);
    fclose(f);
    mfsdp_record_t *back = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_record_load(path, err, sizeof(err), &back), MFSDP_OK, "%s", err);
    cr_assert_eq(back->ncomms, 2);
    cr_assert_eq(back->comms[1].ncalls, n);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(back->comms[1].calls[i].sig.count, calls[i].count);
        cr_expect_eq(back->comms[1].calls[i].sig.kind, calls[i].kind);
    }
    cr_expect_str_eq(back->comms[1].calls[5].op, "avg");
    unlink(path);

    mfsdp_call_t *seq = NULL;
    size_t nseq = 0;
    cr_assert_eq(mfsdp_record_join(&M, 2, back, err, sizeof(err), &seq, &nseq), MFSDP_OK, "%s",
                 err);
    mfsdp_call_t want[] = {{MFSDP_CALL_ALLGATHER, 0},      {MFSDP_CALL_ALLGATHER, 1},
                           {MFSDP_CALL_ALLGATHER, 2},      {MFSDP_CALL_ALLGATHER, 3},
                           {MFSDP_CALL_REDUCE_SCATTER, 3}, {MFSDP_CALL_ALLGATHER, 2},
                           {MFSDP_CALL_REDUCE_SCATTER, 2}, {MFSDP_CALL_ALLGATHER, 1},
                           {MFSDP_CALL_REDUCE_SCATTER, 1}, {MFSDP_CALL_REDUCE_SCATTER, 0}};
    cr_assert_eq(nseq, sizeof(want) / sizeof(want[0]));
    for (size_t i = 0; i < nseq; i++) {
        cr_expect_eq(seq[i].kind, want[i].kind, "entry %zu kind", i);
        cr_expect_eq(seq[i].group, want[i].group, "entry %zu group %zu want %zu", i,
                     seq[i].group, want[i].group);
    }
    /* the joined sequence drives a matcher */
    M.sequence = seq;
    M.ncalls = nseq;
    mfsdp_matcher_t *mt = NULL;
    cr_assert_eq(mfsdp_matcher_create(&M, 2, err, sizeof(err), &mt), MFSDP_OK, "%s", err);
    for (size_t i = 0; i < n; i++) {
        size_t g = next(mt, calls[i]);
        cr_expect(calls[i].count == 3 ? g == MFSDP_GROUP_NONE : g != MFSDP_GROUP_NONE);
    }
    mfsdp_matcher_destroy(mt);
    free(seq);
    mfsdp_record_free(back);
    mfsdp_record_free(rec);
}

/* FSDP2 with backward prefetch: the last block is re-gathered, and block l-1 is prefetched
 * before the reduce-scatter of block l, so backward all-gathers precede the first
 * reduce-scatter. */
Test(sequence, join_backward_prefetch_order)
{
    build(3);
    mfsdp_call_sig_t calls[] = {ag(22), ag(15), ag(15), ag(15), ag(15), ag(15), rs(15),
                                ag(15), rs(15), rs(15), rs(22)};
    size_t n = sizeof(calls) / sizeof(calls[0]);
    mfsdp_record_t *rec = make_record(calls, n, 2);
    mfsdp_call_t *seq = NULL;
    size_t nseq = 0;
    char err[512] = "";
    cr_assert_eq(mfsdp_record_join(&M, 2, rec, err, sizeof(err), &seq, &nseq), MFSDP_OK, "%s",
                 err);
    size_t want_group[] = {0, 1, 2, 3, 3, 2, 3, 1, 2, 1, 0};
    cr_assert_eq(nseq, n);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(seq[i].group, want_group[i], "entry %zu: group %zu want %zu", i,
                     seq[i].group, want_group[i]);
        cr_expect_eq(seq[i].kind, calls[i].kind);
    }
    free(seq);
    mfsdp_record_free(rec);
}

Test(sequence, join_rejects_too_many_calls_and_wrong_world)
{
    build(3);
    /* three forward all-gathers, then four backward ones for three groups */
    mfsdp_call_sig_t calls[] = {ag(15), ag(15), ag(15), ag(15), ag(15), ag(15), ag(15)};
    mfsdp_record_t *rec = make_record(calls, 7, 2);
    mfsdp_call_t *seq = NULL;
    size_t nseq = 0;
    char err[512] = "";
    cr_expect_eq(mfsdp_record_join(&M, 2, rec, err, sizeof(err), &seq, &nseq),
                 MFSDP_ERR_MISMATCH);
    cr_expect(strstr(err, "only 3 groups") != NULL, "%s", err);
    cr_expect_null(seq);
    cr_expect_eq(mfsdp_record_join(&M, 4, rec, err, sizeof(err), &seq, &nseq),
                 MFSDP_ERR_MISMATCH);
    cr_expect(strstr(err, "size 4") != NULL, "%s", err);
    mfsdp_record_free(rec);
}

Test(sequence, record_load_errors)
{
    char path[] = "/tmp/mfsdp-record-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fputs("{\"format\": \"mfsdp-record/1\", \"comms\": [{\"size\": 2, \"calls\": "
          "[[\"allgather\", 5, \"float64\", \"none\"]]}]}",
          f);
    fclose(f);
    mfsdp_record_t *rec = NULL;
    char err[512] = "";
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "comms[0].calls[0][2]") != NULL, "%s", err);
    f = fopen(path, "w");
    fputs("{\"format\": \"other\"}", f);
    fclose(f);
    cr_expect_eq(mfsdp_record_load(path, err, sizeof(err), &rec), MFSDP_ERR_PARSE);
    cr_expect(strstr(err, "format") != NULL, "%s", err);
    unlink(path);
    cr_expect_eq(mfsdp_record_load("/nonexistent/rec.json", err, sizeof(err), &rec),
                 MFSDP_ERR_IO);
    cr_expect_null(rec);
}
