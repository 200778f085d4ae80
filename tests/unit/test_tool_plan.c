/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The mfsdp-plan tool, run as a child process: the table, JSON identical to the library's
 * plan, environment defaults, --env, one-line errors with exit codes 1 and 2, and the record
 * join (--record --write-manifest).
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mfsdp/plan.h"
#include "tool_util.h"
#include "pattern_util.h"

#define TOOL MFSDP_BUILD_ROOT "/tools/mfsdp-plan"
#define EX8B MFSDP_SOURCE_ROOT "/examples/models/llama3-8b.json"

static run_result_t run_tool(const char *const *args, const char *const *env)
{
    return tool_run(TOOL, args, env);
}

static size_t count_lines(const char *s)
{
    size_t n = 0;
    for (; *s != '\0'; s++) {
        n += *s == '\n';
    }
    return n;
}

Test(tool_plan, table_llama3_8b_64)
{
    const char *args[] = {EX8B, "--world-size", "64", NULL};
    run_result_t r = run_tool(args, NULL);
    cr_assert_eq(r.rc, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    cr_assert_not_null(strstr(r.out, "world size 64, tail auto"), "%s", r.out);
    /* Bound lines: ratios parsed back. */
    const char *f = strstr(r.out, "# NS FLOPs");
    const char *b = strstr(r.out, "# owned");
    cr_assert(f != NULL && b != NULL);
    double rf = 0, rb = 0;
    cr_assert_eq(sscanf(strstr(f, "max/LB"), "max/LB %lf", &rf), 1);
    cr_assert_eq(sscanf(strstr(b, "max/LB"), "max/LB %lf", &rb), 1);
    cr_assert(rf >= 1.0 && rf <= 1.05, "flops max/LB %f", rf);
    cr_assert(rb >= 1.0 && rb <= 1.05, "bytes max/LB %f", rb);
    /* One row per rank 0..63 with 7 columns, then one row per group. */
    int rows = 0, groups = 0;
    char *save = NULL;
    for (char *line = strtok_r(r.out, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        int rank;
        size_t owned;
        double gf, om, am, fr, br;
        if (sscanf(line, " %d %zu %lf %lf %lf %lf %lf", &rank, &owned, &gf, &om, &am, &fr, &br) ==
            7) {
            cr_assert_eq(rank, rows, "%s", line);
            cr_assert_leq(fr, 1.05);
            cr_assert_leq(br, 1.05);
            cr_assert_gt(am, om);
            rows++;
        } else if (strncmp(line, "  layers.", 9) == 0 || strncmp(line, "  root", 6) == 0) {
            groups++;
        }
    }
    cr_assert_eq(rows, 64);
    cr_assert_eq(groups, 33);
    run_free(&r);
}

/* The tool's JSON is byte-identical to the library's plan of the same manifest. */
static void check_json_equals_library(const char *tail_arg, mfsdp_tail_policy_t tail,
                                      const char *const *env)
{
    const char *args[] = {EX8B, "-n", "16", "--json", tail_arg ? "--tail" : NULL, tail_arg, NULL};
    run_result_t r = run_tool(args, env);
    cr_assert_eq(r.rc, 0, "stderr: %s", r.err);
    json_error_t jerr;
    json_t *root = json_loads(r.out, 0, &jerr);
    cr_assert_not_null(root, "line %d: %s", jerr.line, jerr.text);
    cr_assert_str_eq(json_string_value(json_object_get(root, "format")), "mfsdp-plan/1");
    cr_assert_eq(json_integer_value(json_object_get(root, "world_size")), 16);
    json_decref(root);

    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    cr_assert_eq(mfsdp_manifest_load(EX8B, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    mfsdp_plan_opts_t o = {.tail = tail};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 16, &o, &p), MFSDP_OK);
    char *js = NULL;
    cr_assert_eq(mfsdp_plan_to_json(p, &js), MFSDP_OK);
    cr_assert_eq(r.outlen, strlen(js) + 1);
    cr_assert_eq(r.out[r.outlen - 1], '\n');
    r.out[r.outlen - 1] = '\0';
    cr_assert_str_eq(r.out, js);
    free(js);
    mfsdp_plan_destroy(p);
    mfsdp_manifest_free(m);
    run_free(&r);
}

Test(tool_plan, json_matches_library)
{
    check_json_equals_library(NULL, MFSDP_TAIL_AUTO, NULL);
    check_json_equals_library("owner", MFSDP_TAIL_OWNER, NULL);
}

Test(tool_plan, env_defaults)
{
    /* MFSDP_TAIL sets the default; --tail overrides it. */
    const char *shard[] = {"MFSDP_TAIL=shard", NULL};
    check_json_equals_library(NULL, MFSDP_TAIL_SHARD, shard);
    check_json_equals_library("auto", MFSDP_TAIL_AUTO, shard);
    /* MFSDP_MEM_LIMIT too: the embedding's slices alone need more than 1 GiB at n = 8. */
    const char *mem[] = {"MFSDP_MEM_LIMIT=1G", NULL};
    const char *args[] = {EX8B, "-n", "8", NULL};
    run_result_t r = run_tool(args, mem);
    cr_assert_eq(r.rc, 1);
    cr_assert_not_null(strstr(r.err, "memory limit of 1073741824 bytes"), "%s", r.err);
    run_free(&r);
    const char *args2[] = {EX8B, "-n", "8", "--mem-limit", "0", NULL};
    r = run_tool(args2, mem);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    run_free(&r);
}

Test(tool_plan, env_and_help)
{
    const char *args[] = {"--env", NULL};
    const char *env[] = {"MFSDP_MEM_LIMIT=2G", NULL};
    run_result_t r = run_tool(args, env);
    cr_assert_eq(r.rc, 0);
    cr_assert_not_null(strstr(r.out, "MFSDP_MEM_LIMIT"));
    cr_assert_not_null(strstr(r.out, "current=2G"), "%s", r.out);
    cr_assert_not_null(strstr(r.out, "MFSDP_TAIL"));
    cr_assert_not_null(strstr(r.out, "MFSDP_DEBUG_FILE"));
    run_free(&r);
    const char *help[] = {"--help", NULL};
    r = run_tool(help, NULL);
    cr_assert_eq(r.rc, 0);
    cr_assert_not_null(strstr(r.out, "usage: mfsdp-plan MANIFEST --world-size N"));
    cr_assert_str_empty(r.err);
    run_free(&r);
}

/* Bad inputs: arguments separated by single spaces; @EX@ is the 8B manifest, @BAD@ and
 * @WS4@ are files written by the test. */
typedef struct bad_case {
    char args[160];
    char env[48];
    int rc;
    char expect[96];
} bad_case_t;

ParameterizedTestParameters(tool_plan, bad_input)
{
    static bad_case_t cases[] = {
        {"", "", 2, "missing MANIFEST"},
        {"@EX@", "", 2, "missing --world-size"},
        {"@EX@ -n 0", "", 2, "--world-size '0'"},
        {"@EX@ --world-size 8x", "", 2, "--world-size '8x'"},
        {"@EX@ -n 8 --tail both", "", 2, "--tail 'both'"},
        {"@EX@ -n 8 --mem-limit 3Q", "", 2, "--mem-limit '3Q'"},
        {"@EX@ -n 8 --frobnicate", "", 2, "unknown option '--frobnicate'"},
        {"@EX@ -n", "", 2, "needs a value"},
        {"@EX@ @EX@ -n 8", "", 2, "one MANIFEST expected"},
        {"/nonexistent/m.json -n 8", "", 1, "cannot open"},
        {"@BAD@ -n 2", "", 1, "groups[0].params[0].shape[1]"},
        {"@WS4@ -n 8", "", 1, "world size 8 does not match the manifest's world_size 4"},
        {"@EX@ -n 8 --mem-limit 1G", "", 1, "model.embed_tokens.weight"},
        {"@EX@ -n 8", "MFSDP_TAIL=bad", 1, "MFSDP_TAIL=bad"},
    };
    return cr_make_param_array(bad_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

ParameterizedTest(bad_case_t *c, tool_plan, bad_input)
{
    char bad[64], ws4[64];
    snprintf(bad, sizeof(bad), "/tmp/mfsdp-tool-plan-bad-%d.json", (int)getpid());
    snprintf(ws4, sizeof(ws4), "/tmp/mfsdp-tool-plan-ws4-%d.json", (int)getpid());
    write_file(bad, "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", "
                    "\"params\": [{\"name\": \"w\", \"shape\": [4, -4], \"dtype\": "
                    "\"float32\"}]}]}");
    write_file(ws4, "{\"format\": \"mfsdp-manifest/1\", \"world_size\": 4, \"groups\": "
                    "[{\"name\": \"g\", \"params\": [{\"name\": \"w\", \"shape\": [4, 4], "
                    "\"dtype\": \"float32\"}]}]}");
    const char *args[16] = {NULL};
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(c->args, " ", &save); tok != NULL && n < 15;
         tok = strtok_r(NULL, " ", &save)) {
        args[n++] = strcmp(tok, "@EX@") == 0    ? EX8B
                    : strcmp(tok, "@BAD@") == 0 ? bad
                    : strcmp(tok, "@WS4@") == 0 ? ws4
                                                : tok;
    }
    const char *env[] = {c->env[0] ? c->env : NULL, NULL};
    run_result_t r = run_tool(args, env);
    unlink(bad);
    unlink(ws4);
    cr_assert_eq(r.rc, c->rc, "'%s': rc %d, stderr: %s", c->args, r.rc, r.err);
    cr_assert_str_empty(r.out, "'%s': stdout: %s", c->args, r.out);
    cr_assert_eq(count_lines(r.err), 1, "'%s': stderr must be one line: %s", c->args, r.err);
    cr_assert_eq(strncmp(r.err, "mfsdp-plan: ", 12), 0, "%s", r.err);
    cr_assert_not_null(strstr(r.err, c->expect), "'%s': stderr: %s", c->args, r.err);
    run_free(&r);
}

/* ---- --record: the join writes sequence and iteration variants ------------------------ */

/* root + blocks of a fsdp_train-like job; blocks: 0 gives root + one block of another size */
static void write_join_manifest(const char *path, int blocks)
{
    char json[8192];
    size_t off = (size_t)snprintf(
        json, sizeof(json),
        "{\"format\": \"mfsdp-manifest/1\", \"world_size\": 2, \"groups\": [{\"name\": "
        "\"root\", \"params\": [{\"name\": \"embed\", \"shape\": [10, 4], \"dtype\": "
        "\"float32\"}, {\"name\": \"norm\", \"shape\": [4], \"dtype\": \"float32\"}]}");
    for (int l = 0; l < blocks; l++) {
        off += (size_t)snprintf(json + off, sizeof(json) - off,
                                ", {\"name\": \"blocks.%d\", \"params\": [{\"name\": "
                                "\"blocks.%d.w\", \"shape\": [6, 4], \"dtype\": \"float32\"}, "
                                "{\"name\": \"blocks.%d.b\", \"shape\": [6], \"dtype\": "
                                "\"float32\"}]}",
                                l, l, l);
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    write_file(path, json);
}

/* The record of passes (kinds as for pu_stream) of FSDP2's default wrapping; extra: a foreign
 * all-gather count inserted at call 5 (0: none). */
static void write_join_record(const char *manifest_path, const char *path, const char *kinds,
                              size_t extra)
{
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_load(manifest_path, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    static pu_call_t calls[512];
    size_t n = 0;
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = NULL};
    cr_assert_eq(pu_stream(m, 2, &cfg, kinds, NULL, NULL, calls, 511, &n), MFSDP_OK);
    if (extra != 0) {
        memmove(&calls[6], &calls[5], (n - 5) * sizeof(calls[0]));
        calls[5].sig = (mfsdp_call_sig_t){MFSDP_CALL_ALLGATHER, extra, MFSDP_FLOAT32};
        n++;
    }
    mfsdp_record_t *rec = pu_record(calls, n, 2);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    cr_assert_eq(mfsdp_record_write(rec, f), MFSDP_OK);
    fclose(f);
    mfsdp_record_free(rec);
    mfsdp_manifest_free(m);
}

/* Run --record and return the written manifest's "sequence" as "AG root AG blocks.0 ... " with
 * '?' on optional entries, and its iteration in *it. */
static void join_with_tool(const char *kinds, int blocks, const char *want_seq,
                           mfsdp_iteration_t want_it)
{
    char mp[64], rp[64], op[64];
    snprintf(mp, sizeof(mp), "/tmp/mfsdp-tool-join-m-%d.json", (int)getpid());
    snprintf(rp, sizeof(rp), "/tmp/mfsdp-tool-join-r-%d.json", (int)getpid());
    snprintf(op, sizeof(op), "/tmp/mfsdp-tool-join-o-%d.json", (int)getpid());
    write_join_manifest(mp, blocks);
    write_join_record(mp, rp, kinds, 0);
    const char *args[] = {mp, "--world-size", "2", "--record", rp, "--write-manifest", op, NULL};
    run_result_t r = run_tool(args, NULL);
    cr_assert_eq(r.rc, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_manifest_load(op, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    char got[4096] = "";
    size_t off = 0;
    for (size_t i = 0; i < m->ncalls; i++) {
        off += (size_t)snprintf(got + off, sizeof(got) - off, "%s%s %s%s", i ? " " : "",
                                m->sequence[i].kind == MFSDP_CALL_ALLGATHER ? "AG" : "RS",
                                m->groups[m->sequence[i].group].name,
                                (m->sequence[i].flags & MFSDP_CALL_OPTIONAL) ? "?" : "");
    }
    cr_expect_str_eq(got, want_seq, "\n got: %s\nwant: %s", got, want_seq);
    cr_expect_eq(m->iteration.forward_only, want_it.forward_only);
    cr_expect_eq(m->iteration.no_sync, want_it.no_sync);
    mfsdp_manifest_free(m);
    unlink(mp);
    unlink(rp);
    unlink(op);
    run_free(&r);
}

Test(tool_plan, record_join_writes_sequence_and_variants)
{
    const mfsdp_iteration_t none = {0, 0}, both = {1, 1};
    join_with_tool("T T T F", 2,
                   "AG root AG blocks.0 AG blocks.1 AG blocks.1 AG blocks.0 "
                   "RS blocks.1 RS blocks.0 RS root",
                   none);
    /* accumulation over 2 micro-batches: an exact two-pass cycle */
    join_with_tool("NT NT NT", 2,
                   "AG root AG blocks.0 AG blocks.1 AG blocks.1 AG blocks.0 "
                   "AG root AG blocks.0 AG blocks.1 AG blocks.1 AG blocks.0 "
                   "RS blocks.1 RS blocks.0 RS root",
                   none);
    /* irregular passes: the training pass and the variants seen */
    join_with_tool("T N T F T F F T", 1, "AG root? AG blocks.0 AG blocks.0 RS blocks.0 RS root",
                   both);
}

Test(tool_plan, record_join_refusal_is_one_line)
{
    char mp[64], rp[64], op[64];
    snprintf(mp, sizeof(mp), "/tmp/mfsdp-tool-join-m-%d.json", (int)getpid());
    snprintf(rp, sizeof(rp), "/tmp/mfsdp-tool-join-r-%d.json", (int)getpid());
    snprintf(op, sizeof(op), "/tmp/mfsdp-tool-join-o-%d.json", (int)getpid());
    write_join_manifest(mp, 2);
    write_join_record(mp, rp, "T T", 7);
    const char *args[] = {mp, "--world-size", "2", "--record", rp, "--write-manifest", op, NULL};
    run_result_t r = run_tool(args, NULL);
    cr_expect_eq(r.rc, 1);
    cr_expect_str_empty(r.out);
    cr_expect_eq(count_lines(r.err), 1, "%s", r.err);
    cr_expect_not_null(strstr(r.err, "mfsdp-plan: record: comms[1].calls[5] allgather(count=7, "
                                     "float32) fits no group of the manifest"),
                       "%s", r.err);
    cr_expect_neq(access(op, F_OK), 0, "nothing written");
    run_free(&r);
    /* a record that is not a record */
    write_file(rp, "{\"format\": \"mfsdp-record/2\", \"comms\": []}");
    r = run_tool(args, NULL);
    cr_expect_eq(r.rc, 1);
    cr_expect_eq(count_lines(r.err), 1, "%s", r.err);
    cr_expect_not_null(strstr(r.err, "format: expected \"mfsdp-record/1\""), "%s", r.err);
    run_free(&r);
    unlink(mp);
    unlink(rp);
}
