/* SPDX-License-Identifier: Apache-2.0 */
/* Call identification (core/matcher.h): every route and every error path. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/matcher.h"

/* root: embed (10, 4) + norm (4); blocks b0..b2: W (6, 4) + bias (6), float32.
 * At world 2: root count 5*4 + 2 = 22, block count 3*4 + 3 = 15 (bias alone 3, W alone 12). */
#define GROUP(name, a, b)                                                                          \
    "{\"name\": \"" name "\", \"params\": [{\"name\": \"" name "." a "\", \"shape\": [6, 4], "     \
    "\"dtype\": \"float32\"}, {\"name\": \"" name "." b "\", \"shape\": [6], \"dtype\": "          \
    "\"float32\"}]}"
#define ROOT                                                                                       \
    "{\"name\": \"root\", \"params\": [{\"name\": \"embed\", \"shape\": [10, 4], \"dtype\": "      \
    "\"float32\"}, {\"name\": \"norm\", \"shape\": [4], \"dtype\": \"float32\"}]}"
#define GROUPS3                                                                                    \
    "[" ROOT                                                                                       \
    ", " GROUP("b0", "W", "bias") ", " GROUP("b1", "W", "bias") ", " GROUP("b2", "W", "bias") "]"
/* FSDP2's default training pass over root, b0..b2 */
#define SEQ_DEFAULT                                                                                \
    "[[\"allgather\", \"root\"], [\"allgather\", \"b0\"], [\"allgather\", \"b1\"], "               \
    "[\"allgather\", \"b2\"], [\"allgather\", \"b2\"], [\"allgather\", \"b1\"], "                  \
    "[\"reduce_scatter\", \"b2\"], [\"allgather\", \"b0\"], [\"reduce_scatter\", \"b1\"], "        \
    "[\"reduce_scatter\", \"b0\"], [\"reduce_scatter\", \"root\"]]"
#define SEQ_ROOT_OPTIONAL                                                                          \
    "[[\"allgather\", \"root\", \"optional\"], [\"allgather\", \"b0\"], [\"allgather\", "          \
    "\"b1\"], [\"allgather\", \"b2\"], [\"allgather\", \"b2\"], [\"allgather\", \"b1\"], "         \
    "[\"reduce_scatter\", \"b2\"], [\"allgather\", \"b0\"], [\"reduce_scatter\", \"b1\"], "        \
    "[\"reduce_scatter\", \"b0\"], [\"reduce_scatter\", \"root\"]]"

static mfsdp_manifest_t *manifest(const char *groups, const char *iteration, const char *seq)
{
    char json[8192];
    snprintf(json, sizeof(json), "{\"format\": \"mfsdp-manifest/1\", %s%s%s\"groups\": %s%s%s}",
             iteration ? "\"iteration\": " : "", iteration ? iteration : "", iteration ? ", " : "",
             groups, seq ? ", \"sequence\": " : "", seq ? seq : "");
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "test", err, sizeof(err), &m), MFSDP_OK,
                 "%s", err);
    return m;
}

static mfsdp_matcher_t *matcher(const mfsdp_manifest_t *m, int world)
{
    mfsdp_matcher_t *mt = NULL;
    char err[1024] = "";
    cr_assert_eq(mfsdp_matcher_create(m, world, err, sizeof(err), &mt), MFSDP_OK, "%s", err);
    return mt;
}

static mfsdp_call_sig_t ag(size_t count)
{
    return (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, count, MFSDP_FLOAT32};
}

static mfsdp_call_sig_t rs(size_t count)
{
    return (mfsdp_call_sig_t){MFSDP_CALL_REDUCE_SCATTER, count, MFSDP_FLOAT32};
}

static mfsdp_match_t next_ok(mfsdp_matcher_t *mt, mfsdp_call_sig_t s)
{
    mfsdp_match_t mm;
    char err[1024] = "";
    cr_assert_eq(mfsdp_matcher_next(mt, &s, &mm, err, sizeof(err)), MFSDP_OK, "%s", err);
    return mm;
}

/* Feed calls that must route to groups want[]; -1 in want: expect the error there. */
static void feed(mfsdp_matcher_t *mt, const mfsdp_call_sig_t *calls, const size_t *want, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        mfsdp_match_t mm = next_ok(mt, calls[i]);
        cr_assert_eq(mm.group, want[i], "call %zu: group %zu, want %zu", i, mm.group, want[i]);
    }
}

static void expect_error(mfsdp_matcher_t *mt, mfsdp_call_sig_t s, const char *const *parts)
{
    mfsdp_match_t mm = {.group = 77};
    char err[1024] = "";
    cr_assert_eq(mfsdp_matcher_next(mt, &s, &mm, err, sizeof(err)), MFSDP_ERR_SEQUENCE);
    cr_expect_eq(mm.group, 77, "no output on error");
    for (const char *const *p = parts; *p != NULL; p++) {
        cr_expect(strstr(err, *p) != NULL, "missing '%s' in: %s", *p, err);
    }
    cr_expect(strchr(err, '\n') == NULL, "one line: %s", err);
    cr_expect(err[0] >= 'a' && err[0] <= 'z', "starts lowercase: %s", err);
    /* failed for good: the next call repeats the error */
    char again[1024] = "";
    cr_expect_eq(mfsdp_matcher_next(mt, &s, &mm, again, sizeof(again)), MFSDP_ERR_SEQUENCE);
    cr_expect_str_eq(again, err);
    cr_expect_eq(mfsdp_matcher_end(mt, again, sizeof(again)), MFSDP_ERR_SEQUENCE);
    cr_expect_str_eq(again, err);
}

#define A(c)                                                                                       \
    {                                                                                              \
        MFSDP_CALL_ALLGATHER, (c), MFSDP_FLOAT32                                                   \
    }
#define R(c)                                                                                       \
    {                                                                                              \
        MFSDP_CALL_REDUCE_SCATTER, (c), MFSDP_FLOAT32                                              \
    }

static const mfsdp_call_sig_t T_CALLS[] = {A(22), A(15), A(15), A(15), A(15), A(15),
                                           R(15), A(15), R(15), R(15), R(22)};
static const size_t T_GROUPS[] = {0, 1, 2, 3, 3, 2, 3, 1, 2, 1, 0};
#define T_N 11

/* ---------------------------------------------------------------- signature mode */

Test(matcher, signature_mode_routes_unique_signatures)
{
    mfsdp_manifest_t *m = manifest("[" ROOT ", " GROUP("b0", "W", "bias") "]", NULL, NULL);
    mfsdp_matcher_t *mt = matcher(m, 2);
    cr_expect_eq(mfsdp_matcher_iteration_calls(mt), 4);
    mfsdp_match_t mm = next_ok(mt, ag(22));
    cr_expect_eq(mm.group, 0);
    cr_expect_null(mm.has_grad);
    cr_expect_eq(mm.position, MFSDP_GROUP_NONE);
    cr_expect_eq(next_ok(mt, ag(15)).group, 1);
    mm = next_ok(mt, rs(15));
    cr_expect_eq(mm.group, 1);
    cr_assert_not_null(mm.has_grad);
    cr_expect(mm.nparams == 2 && mm.has_grad[0] == 1 && mm.has_grad[1] == 1);
    /* b0 without its bias: 12, unique */
    mm = next_ok(mt, rs(12));
    cr_expect(mm.group == 1 && mm.has_grad[0] == 1 && mm.has_grad[1] == 0);
    cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK);
    /* an unknown call is an error, never a pass-through */
    const char *parts[] = {"call 4", "allgather(count=16, float32)", "matches no group", NULL};
    expect_error(mt, ag(16), parts);
    mfsdp_matcher_destroy(mt);
    mt = matcher(m, 2);
    mfsdp_call_sig_t bf = {MFSDP_CALL_ALLGATHER, 15, MFSDP_BFLOAT16};
    const char *parts2[] = {"call 0", "allgather(count=15, bfloat16)", NULL};
    expect_error(mt, bf, parts2);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, signature_mode_ambiguous_subset_across_groups)
{
    /* root without its norm (20) vs a group "c" whose full count is 20 */
    mfsdp_manifest_t *m = manifest(
        "[" ROOT ", {\"name\": \"c\", \"params\": [{\"name\": \"c.w\", \"shape\": [10, 4], "
        "\"dtype\": \"float32\"}]}]",
        NULL, NULL);
    mfsdp_matcher_t *mt = matcher(m, 2);
    cr_expect_eq(next_ok(mt, rs(22)).group, 0);
    const char *parts[] = {"reduce_scatter(count=20, float32) is ambiguous",
                           "group root without {norm}",
                           "group c",
                           "sequence",
                           "mfsdp-run",
                           NULL};
    expect_error(mt, rs(20), parts);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, identical_blocks_need_a_sequence)
{
    mfsdp_manifest_t *m = manifest(GROUPS3, NULL, NULL);
    mfsdp_matcher_t *mt = (mfsdp_matcher_t *)0x1;
    char err[1024] = "";
    cr_expect_eq(mfsdp_matcher_create(m, 2, err, sizeof(err), &mt), MFSDP_ERR_UNSUPPORTED);
    cr_expect_eq(mt, (mfsdp_matcher_t *)0x1);
    cr_expect(strstr(err, "MFSDP_RECORD") != NULL, "%s", err);
    cr_expect(strstr(err, "groups b0 and b1") != NULL, "%s", err);
    mfsdp_manifest_free(m);
}

/* ---------------------------------------------------------------- sequence mode */

Test(matcher, sequence_routes_and_wraps)
{
    mfsdp_manifest_t *m = manifest(GROUPS3, NULL, SEQ_DEFAULT);
    mfsdp_matcher_t *mt = matcher(m, 2);
    cr_expect_eq(mfsdp_matcher_iteration_calls(mt), 11);
    cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK, "nothing happened yet");
    for (int iter = 0; iter < 3; iter++) {
        for (size_t i = 0; i < T_N; i++) {
            mfsdp_match_t mm = next_ok(mt, T_CALLS[i]);
            cr_assert_eq(mm.group, T_GROUPS[i], "iteration %d call %zu", iter, i);
            cr_assert_eq(mm.position, i);
            cr_assert_eq(mm.nparams, 2);
            cr_assert(T_CALLS[i].kind == MFSDP_CALL_ALLGATHER ? mm.has_grad == NULL
                                                              : mm.has_grad != NULL);
        }
        cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK, "a pass boundary");
    }
    /* the job's final all-gathers: a complete forward prefix may end the job */
    feed(mt, T_CALLS, T_GROUPS, 3);
    char err[1024] = "";
    cr_expect_eq(mfsdp_matcher_end(mt, err, sizeof(err)), MFSDP_ERR_SEQUENCE);
    cr_expect(strstr(err, "ended in the middle of a pass after 36 calls") != NULL, "%s", err);
    cr_expect(strstr(err, "expected next allgather(count=15, float32) of group b2") != NULL, "%s",
              err);
    feed(mt, T_CALLS + 3, T_GROUPS + 3, 1);
    cr_expect_eq(mfsdp_matcher_end(mt, err, sizeof(err)), MFSDP_OK, "%s", err);
    feed(mt, T_CALLS + 4, T_GROUPS + 4, 3);
    cr_expect_eq(mfsdp_matcher_end(mt, err, sizeof(err)), MFSDP_ERR_SEQUENCE);
    cr_expect(strstr(err, "expected next allgather(count=15, float32) of group b0") != NULL, "%s",
              err);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

/* A sequence of three passes, as a record joins it from a job evaluating every 2 steps:
 * training (its root all-gather optional: the root stayed unsharded after the last eval),
 * training, evaluation. A job may end after any of them, or after a forward that starts
 * one, and nowhere else. */
Test(matcher, sequence_of_passes_ends_between_them)
{
    char seq[4096];
    snprintf(seq, sizeof(seq),
             "[%.*s, %.*s, [\"allgather\", \"root\"], [\"allgather\", \"b0\"], "
             "[\"allgather\", \"b1\"], [\"allgather\", \"b2\"]]",
             (int)strlen(SEQ_ROOT_OPTIONAL) - 2, SEQ_ROOT_OPTIONAL + 1,
             (int)strlen(SEQ_DEFAULT) - 2, SEQ_DEFAULT + 1);
    mfsdp_manifest_t *m = manifest(GROUPS3, NULL, seq);
    mfsdp_matcher_t *mt = matcher(m, 2);
    cr_assert_eq(mfsdp_matcher_iteration_calls(mt), 26);
    char err[1024] = "";
    /* 2 cycles, each position checked: where an end is accepted */
    int ok_at[27] = {0};
    ok_at[0] = ok_at[4] = ok_at[11] = ok_at[15] = ok_at[22] = ok_at[26] = 1;
    for (int cycle = 0; cycle < 2; cycle++) {
        for (size_t i = 0; i < 26; i++) {
            size_t k = i < 22 ? i % 11 : i - 22;
            next_ok(mt, T_CALLS[k]);
            int want = ok_at[i + 1];
            mfsdp_status_t st = mfsdp_matcher_end(mt, err, sizeof(err));
            cr_expect_eq(st, want ? MFSDP_OK : MFSDP_ERR_SEQUENCE,
                         "cycle %d: end after sequence position %zu: %s", cycle, i, err);
        }
    }
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, sequence_violated)
{
    mfsdp_manifest_t *m = manifest(GROUPS3, NULL, SEQ_DEFAULT);
    mfsdp_matcher_t *mt = matcher(m, 2);
    feed(mt, T_CALLS, T_GROUPS, T_N);
    const char *parts[] = {
        "call 11: call sequence violated: expected allgather(count=22, float32) of group root",
        "received reduce_scatter(count=15, float32)", NULL};
    expect_error(mt, rs(15), parts);
    mfsdp_matcher_destroy(mt);
    /* a dropped call: the next block all-gather comes where a reduce-scatter is expected */
    mt = matcher(m, 2);
    feed(mt, T_CALLS, T_GROUPS, 6);
    const char *parts2[] = {
        "call 6: call sequence violated: expected reduce_scatter(count=15, float32) of group b2",
        "received allgather(count=15, float32)", NULL};
    expect_error(mt, ag(15), parts2);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, sequence_entry_without_gradients_rejected)
{
    const char *groups = "[" ROOT ", {\"name\": \"f\", \"params\": [{\"name\": \"f.w\", \"shape\": "
                         "[6, 4], \"dtype\": \"float32\", \"requires_grad\": false}]}]";
    mfsdp_manifest_t *m = manifest(groups, NULL,
                                   "[[\"allgather\", \"root\"], [\"allgather\", \"f\"], "
                                   "[\"reduce_scatter\", \"f\"], [\"reduce_scatter\", \"root\"]]");
    mfsdp_matcher_t *mt = NULL;
    char err[512] = "";
    cr_expect_eq(mfsdp_matcher_create(m, 2, err, sizeof(err), &mt), MFSDP_ERR_INVALID_ARG);
    cr_expect(strstr(err, "sequence[2]: group f has no reduce_scatter") != NULL, "%s", err);
    cr_expect_null(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, unused_param_count_colliding_with_another_group)
{
    /* root without "norm" would be 20; make a root whose count without its bias equals a
     * block's: root = W (6, 4) + bias (6) + tail (4) -> 15 + 2; without tail: 15 */
    const char *groups =
        "[{\"name\": \"root\", \"params\": [{\"name\": \"root.W\", \"shape\": [6, "
        "4], \"dtype\": \"float32\"}, {\"name\": \"root.bias\", \"shape\": [6], "
        "\"dtype\": \"float32\"}, {\"name\": \"root.tail\", \"shape\": [4], "
        "\"dtype\": \"float32\"}]}, " GROUP("b0", "W", "bias") ", " GROUP("b1", "W", "bias") "]";
    mfsdp_manifest_t *m =
        manifest(groups, NULL,
                 "[[\"allgather\", \"root\"], [\"allgather\", \"b0\"], [\"allgather\", \"b1\"], "
                 "[\"allgather\", \"b1\"], [\"allgather\", \"b0\"], [\"reduce_scatter\", \"b1\"], "
                 "[\"reduce_scatter\", \"b0\"], [\"reduce_scatter\", \"root\"]]");
    mfsdp_matcher_t *mt = matcher(m, 2);
    for (int iter = 0; iter < 2; iter++) {
        static const mfsdp_call_sig_t c[] = {A(17), A(15), A(15), A(15), A(15), R(15)};
        static const size_t g[] = {0, 1, 2, 2, 1, 2};
        feed(mt, c, g, 6);
        /* b0 without its bias (12), then root without its tail (15 = a block's count) */
        mfsdp_match_t mm = next_ok(mt, rs(12));
        cr_expect(mm.group == 1 && mm.has_grad[0] == 1 && mm.has_grad[1] == 0);
        mm = next_ok(mt, rs(15));
        cr_expect_eq(mm.group, 0, "routed by position, not by the colliding count");
        cr_expect(mm.has_grad[0] == 1 && mm.has_grad[1] == 1 && mm.has_grad[2] == 0);
    }
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, ambiguous_subset)
{
    /* b0 has two params of equal size (W1, W2: 12 each); one unused: 12 + 3 */
    const char *groups = "[" ROOT ", {\"name\": \"b0\", \"params\": [{\"name\": \"b0.W1\", "
                         "\"shape\": [6, 4], \"dtype\": \"float32\"}, {\"name\": \"b0.W2\", "
                         "\"shape\": [6, 4], \"dtype\": \"float32\"}, {\"name\": \"b0.bias\", "
                         "\"shape\": [6], \"dtype\": \"float32\"}]}]";
    mfsdp_manifest_t *m = manifest(groups, NULL,
                                   "[[\"allgather\", \"root\"], [\"allgather\", \"b0\"], "
                                   "[\"reduce_scatter\", \"b0\"], [\"reduce_scatter\", \"root\"]]");
    mfsdp_matcher_t *mt = matcher(m, 2);
    feed(mt, (mfsdp_call_sig_t[]){ag(22), ag(27), rs(27), rs(22), ag(22), ag(27)},
         (size_t[]){0, 1, 1, 0, 0, 1}, 6);
    /* without the bias: unique (24) */
    mfsdp_match_t mm = next_ok(mt, rs(24));
    cr_expect(mm.has_grad[0] == 1 && mm.has_grad[1] == 1 && mm.has_grad[2] == 0);
    feed(mt, (mfsdp_call_sig_t[]){rs(22), ag(22), ag(27)}, (size_t[]){0, 0, 1}, 3);
    const char *parts[] = {"call 10: reduce_scatter(count=15, float32) of group b0 is ambiguous",
                           "{b0.W1}", "{b0.W2}", "mfsdp-run", NULL};
    expect_error(mt, rs(15), parts);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, optional_entry_and_no_sync_passes)
{
    mfsdp_manifest_t *m = manifest(GROUPS3, "{\"no_sync\": true}", SEQ_ROOT_OPTIONAL);
    mfsdp_matcher_t *mt = matcher(m, 2);
    /* no-sync pass (no reduce-scatters), training pass, a training pass without the root
     * all-gather (optional), then no-sync again */
    static const mfsdp_call_sig_t n_calls[] = {A(22), A(15), A(15), A(15), A(15), A(15), A(15)};
    static const size_t n_groups[] = {0, 1, 2, 3, 3, 2, 1};
    feed(mt, n_calls, n_groups, 7);
    feed(mt, T_CALLS, T_GROUPS, T_N);
    feed(mt, T_CALLS + 1, T_GROUPS + 1, T_N - 1);
    feed(mt, n_calls, n_groups, 7);
    cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
    /* without the no_sync variant the accumulation pass is an error */
    m = manifest(GROUPS3, NULL, SEQ_ROOT_OPTIONAL);
    mt = matcher(m, 2);
    feed(mt, n_calls, n_groups, 6);
    const char *parts[] = {
        "call 6: call sequence violated: expected reduce_scatter(count=15, float32) of group b2",
        "received allgather(count=15, float32)", NULL};
    expect_error(mt, ag(15), parts);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, forward_only_passes)
{
    /* With a mandatory root all-gather, forward-only passes are unambiguous. */
    mfsdp_manifest_t *m = manifest(GROUPS3, "{\"forward_only\": true}", SEQ_DEFAULT);
    mfsdp_matcher_t *mt = matcher(m, 2);
    feed(mt, T_CALLS, T_GROUPS, 4); /* an eval forward */
    feed(mt, T_CALLS, T_GROUPS, T_N);
    feed(mt, T_CALLS, T_GROUPS, 4);
    feed(mt, T_CALLS, T_GROUPS, 4);
    cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK);
    feed(mt, T_CALLS, T_GROUPS, T_N);
    cr_expect_eq(mfsdp_matcher_end(mt, NULL, 0), MFSDP_OK);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, ambiguous_group)
{
    /* Identical blocks, forward_only and an optional root: after a forward prefix the next
     * block all-gather is the last block's backward re-gather or the first block of a new
     * pass that skipped the root. */
    mfsdp_manifest_t *m = manifest(GROUPS3, "{\"forward_only\": true}", SEQ_ROOT_OPTIONAL);
    mfsdp_matcher_t *mt = matcher(m, 2);
    feed(mt, T_CALLS, T_GROUPS, 4);
    const char *parts[] = {"call 4: allgather(count=15, float32) is ambiguous",
                           "group b2 (sequence[4], training pass)",
                           "group b0 (sequence[1], ",
                           "MFSDP_RECORD",
                           "\"iteration\"",
                           "mfsdp-run",
                           NULL};
    expect_error(mt, ag(15), parts);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, large_group_and_mixed_dtypes)
{
    /* a group of 14 params (one AG in uint8: bf16 and fp32 mixed, reduce in fp32): every set
     * of missing params is recognised (distinct power-of-two sizes: each count has one) */
    char groups[8192];
    size_t off = (size_t)snprintf(groups, sizeof(groups),
                                  "[{\"name\": \"big\", \"reduce_dtype\": \"float32\", "
                                  "\"params\": [");
    for (int i = 0; i < 14; i++) {
        off += (size_t)snprintf(groups + off, sizeof(groups) - off,
                                "%s{\"name\": \"p%d\", \"shape\": [%d], \"dtype\": \"%s\"}",
                                i ? ", " : "", i, 2 << i, i % 2 ? "bfloat16" : "float32");
    }
    snprintf(groups + off, sizeof(groups) - off, "]}]");
    mfsdp_manifest_t *m =
        manifest(groups, NULL, "[[\"allgather\", \"big\"], [\"reduce_scatter\", \"big\"]]");
    mfsdp_matcher_t *mt = matcher(m, 2);
    mfsdp_call_sig_t s;
    cr_assert_eq(mfsdp_matcher_signature(mt, 0, MFSDP_CALL_ALLGATHER, &s), MFSDP_OK);
    cr_expect_eq(s.dtype, MFSDP_UINT8);
    /* per-rank elements: p_i has 2^i; bytes: fp32 4, bf16 2 */
    size_t bytes = 0, full = 0;
    for (int i = 0; i < 14; i++) {
        bytes += ((size_t)1 << i) * (i % 2 ? 2 : 4);
        full += (size_t)1 << i;
    }
    cr_expect_eq(s.count, bytes);
    next_ok(mt, s);
    mfsdp_call_sig_t r = {MFSDP_CALL_REDUCE_SCATTER, full - 1 - 8 - 4096, MFSDP_FLOAT32};
    mfsdp_match_t mm = next_ok(mt, r);
    for (int i = 0; i < 14; i++) {
        cr_expect_eq(mm.has_grad[i], !(i == 0 || i == 3 || i == 12), "param %d", i);
    }
    next_ok(mt, s);
    r.count = full - 1 - 2 - 4 - 8; /* four missing: found too (it was not looked for) */
    mm = next_ok(mt, r);
    for (int i = 0; i < 14; i++) {
        cr_expect_eq(mm.has_grad[i], i >= 4, "param %d", i);
    }
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, tagged_mode_checks)
{
    mfsdp_manifest_t *m = manifest(GROUPS3, NULL, SEQ_DEFAULT);
    mfsdp_matcher_t *mt = matcher(m, 2);
    char err[512] = "";
    mfsdp_call_sig_t c = ag(15);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 2, NULL, err, sizeof(err)), MFSDP_OK, "%s", err);
    c = rs(15);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 2, NULL, err, sizeof(err)), MFSDP_OK, "%s", err);
    static const unsigned char no_bias[2] = {1, 0};
    c = rs(12);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 2, no_bias, err, sizeof(err)), MFSDP_OK, "%s",
                 err);
    c = rs(15);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 2, no_bias, err, sizeof(err)), MFSDP_ERR_MISMATCH);
    cr_expect(strstr(err, "tagged reduce_scatter of group b1 over the tagged params: expected "
                          "reduce_scatter(count=12, float32), received reduce_scatter(count=15, "
                          "float32)") != NULL,
              "%s", err);
    c = ag(22);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 1, NULL, err, sizeof(err)), MFSDP_ERR_MISMATCH);
    cr_expect(strstr(err, "tagged allgather of group b0: expected allgather(count=15, float32), "
                          "received allgather(count=22, float32)") != NULL,
              "%s", err);
    c = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, 15, MFSDP_BFLOAT16};
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 1, NULL, err, sizeof(err)), MFSDP_ERR_MISMATCH);
    c = rs(15);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 9, NULL, err, sizeof(err)), MFSDP_ERR_INVALID_ARG);
    static const unsigned char none[2] = {0, 0}, bad[2] = {2, 0};
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 1, none, err, sizeof(err)), MFSDP_ERR_INVALID_ARG);
    cr_expect(strstr(err, "covers no param") != NULL, "%s", err);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 1, bad, err, sizeof(err)), MFSDP_ERR_INVALID_ARG);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
    /* a tag flagging a frozen param */
    const char *groups = "[{\"name\": \"g\", \"params\": [{\"name\": \"g.w\", \"shape\": [6, 4], "
                         "\"dtype\": \"float32\"}, {\"name\": \"g.f\", \"shape\": [6], \"dtype\": "
                         "\"float32\", \"requires_grad\": false}]}]";
    m = manifest(groups, NULL, NULL);
    mt = matcher(m, 2);
    static const unsigned char frozen[2] = {1, 1};
    c = rs(15);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 0, frozen, err, sizeof(err)),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect(strstr(err, "param g.f is marked as having a gradient but it does not require one") !=
                  NULL,
              "%s", err);
    c = rs(12);
    cr_expect_eq(mfsdp_matcher_check_tag(mt, &c, 0, NULL, err, sizeof(err)), MFSDP_OK, "%s", err);
    cr_expect_eq(mfsdp_matcher_iteration_calls(mt), 2);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}

Test(matcher, signatures_and_format)
{
    mfsdp_manifest_t *m = manifest("[" ROOT "]", NULL, NULL);
    mfsdp_matcher_t *mt = matcher(m, 3);
    mfsdp_call_sig_t s;
    cr_assert_eq(mfsdp_matcher_signature(mt, 0, MFSDP_CALL_REDUCE_SCATTER, &s), MFSDP_OK);
    cr_expect_eq(s.count, 4 * 4 + 2); /* ceil(10/3) rows of 4, ceil(4/3) */
    char buf[96];
    mfsdp_call_sig_format(&s, buf, sizeof(buf));
    cr_expect_str_eq(buf, "reduce_scatter(count=18, float32)");
    cr_expect_eq(mfsdp_matcher_signature(mt, 1, MFSDP_CALL_ALLGATHER, &s), MFSDP_ERR_INVALID_ARG);
    mfsdp_matcher_destroy(mt);
    mfsdp_manifest_free(m);
}
