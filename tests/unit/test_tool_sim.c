/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The mfsdp-sim scale simulator, run as a child process. Its numbers are checked against
 * computations made here independently: Newton-Schulz FLOPs recomputed from the manifest
 * JSON (not the library's parser), the planner's own bounds, the round-robin DMuon sums,
 * the memory rule and the alpha-beta times on a tiny manifest computed by hand, and the
 * ZeRO-1 > 80 GB flag for Llama-3-70B from a hand computation of both memories. Bad flags
 * and values exit with one line on stderr and nothing on stdout.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mfsdp/kernels.h"
#include "mfsdp/plan.h"
#include "tool_util.h"

#define TOOL   MFSDP_BUILD_ROOT "/perf/mfsdp-sim"
#define MODELS MFSDP_SOURCE_ROOT "/examples/models/"
#define GPT2   MODELS "gpt2-124m.json"
#define L8B    MODELS "llama3-8b.json"
#define L70B   MODELS "llama3-70b.json"
#define TINY   MODELS "tiny.json"

static run_result_t run_tool(const char *const *args)
{
    return tool_run(TOOL, args, NULL);
}

/* Run with --json and return the parsed document (the caller json_decref's it). */
static json_t *run_json(const char *const *args)
{
    const char *a[64];
    int n = 0;
    for (const char *const *p = args; *p != NULL && n < 62; p++) {
        a[n++] = *p;
    }
    a[n++] = "--json";
    a[n] = NULL;
    run_result_t r = run_tool(a);
    cr_assert_eq(r.rc, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    json_error_t jerr;
    json_t *root = json_loads(r.out, 0, &jerr);
    cr_assert_not_null(root, "line %d: %s", jerr.line, jerr.text);
    cr_assert_str_eq(json_string_value(json_object_get(root, "format")), "mfsdp-sim/1");
    run_free(&r);
    return root;
}

static double jnum(const json_t *o, const char *a, const char *b)
{
    const json_t *v = json_object_get(o, a);
    if (b != NULL) {
        v = json_object_get(v, b);
    }
    cr_assert(json_is_number(v), "%s.%s is not a number", a, b ? b : "");
    return json_number_value(v);
}

static const json_t *config_at(const json_t *root, size_t run, size_t cfg)
{
    const json_t *runs = json_object_get(root, "runs");
    const json_t *c = json_array_get(json_object_get(json_array_get(runs, run), "configs"), cfg);
    cr_assert_not_null(c);
    return c;
}

static void assert_close(double got, double want, double rel, const char *what)
{
    double tol = rel * fabs(want) + 1e-300;
    cr_assert(fabs(got - want) <= tol, "%s: got %.17g, want %.17g", what, got, want);
}

/* ---- an independent reading of the manifest ------------------------------------------ */

typedef struct mtensor {
    int muon;
    double rows, cols, numel;
    double flops;
} mtensor_t;

typedef struct mmodel {
    size_t n;
    mtensor_t *t;
    double params;
    double ns_total;
} mmodel_t;

/* docs/manifest.md: muon for >= 2 dims unless the name contains embed, lm_head, wte or
 * wpe; an explicit "optimizer" wins. NS FLOPs steps (4 s^2 l + 2 s^3) per row block. */
static mmodel_t read_model(const char *path)
{
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    cr_assert_not_null(root, "%s: %s", path, jerr.text);
    int steps = 5;
    const json_t *opt = json_object_get(root, "optimizer");
    if (json_object_get(opt, "ns_steps") != NULL) {
        steps = (int)json_integer_value(json_object_get(opt, "ns_steps"));
    }
    mmodel_t m = {0};
    const json_t *groups = json_object_get(root, "groups");
    size_t cap = 0;
    for (size_t g = 0; g < json_array_size(groups); g++) {
        cap += json_array_size(json_object_get(json_array_get(groups, g), "params"));
    }
    m.t = calloc(cap + 1, sizeof(*m.t));
    for (size_t g = 0; g < json_array_size(groups); g++) {
        const json_t *ps = json_object_get(json_array_get(groups, g), "params");
        for (size_t i = 0; i < json_array_size(ps); i++) {
            const json_t *p = json_array_get(ps, i);
            const char *name = json_string_value(json_object_get(p, "name"));
            const json_t *shape = json_object_get(p, "shape");
            mtensor_t *t = &m.t[m.n++];
            t->rows = (double)json_integer_value(json_array_get(shape, 0));
            t->cols = 1.0;
            for (size_t d = 1; d < json_array_size(shape); d++) {
                t->cols *= (double)json_integer_value(json_array_get(shape, d));
            }
            t->numel = t->rows * t->cols;
            m.params += t->numel;
            const char *o = json_string_value(json_object_get(p, "optimizer"));
            if (o != NULL) {
                t->muon = strcmp(o, "muon") == 0;
            } else {
                t->muon = json_array_size(shape) >= 2 && strstr(name, "embed") == NULL &&
                          strstr(name, "lm_head") == NULL && strstr(name, "wte") == NULL &&
                          strstr(name, "wpe") == NULL;
            }
            if (!t->muon) {
                continue;
            }
            const json_t *split = json_object_get(p, "split");
            size_t nb = split != NULL ? json_array_size(split) : 1;
            for (size_t b = 0; b < nb; b++) {
                double r =
                    split != NULL ? (double)json_integer_value(json_array_get(split, b)) : t->rows;
                double s = r < t->cols ? r : t->cols, l = r < t->cols ? t->cols : r;
                t->flops += steps * (4.0 * s * s * l + 2.0 * s * s * s);
            }
            m.ns_total += t->flops;
        }
    }
    json_decref(root);
    return m;
}

/* ---- Newton-Schulz FLOPs -------------------------------------------------------------- */

/* FSDP2-Muon runs every matrix on every rank: the sum over all matrices of the formula. */
static void check_fsdp2_flops(const char *path)
{
    mmodel_t m = read_model(path);
    cr_assert_gt(m.ns_total, 0.0);
    const char *args[] = {"-m", path, "-r", "8,64", NULL};
    json_t *root = run_json(args);
    const json_t *run = json_array_get(json_object_get(root, "runs"), 0);
    assert_close(jnum(run, "ns_flops_total", NULL), m.ns_total, 1e-12, path);
    assert_close(jnum(run, "params", NULL), m.params, 0.0, path);
    for (size_t c = 0; c < 2; c++) {
        assert_close(jnum(config_at(root, 0, c), "ns_flops", "fsdp2"), m.ns_total, 1e-12, path);
    }
    json_decref(root);
    free(m.t);
}

Test(tool_sim, fsdp2_flops_are_the_manifest_sum)
{
    check_fsdp2_flops(GPT2);
    check_fsdp2_flops(L8B);
    check_fsdp2_flops(L70B);
    check_fsdp2_flops(TINY); /* splits, 3-D params, explicit optimizers */
}

/* mfsdp's per-rank max and bound are the planner's; DMuon's per-rank max is the round-robin
 * sum recomputed here; every per-rank max is at least the plan's lower bound. */
static void check_against_planner(const char *path, const char *ranks, const int *ns, size_t k)
{
    mmodel_t mm = read_model(path);
    const char *args[] = {"-m", path, "-r", ranks, NULL};
    json_t *root = run_json(args);
    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    cr_assert_eq(mfsdp_manifest_load(path, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    for (size_t i = 0; i < k; i++) {
        int n = ns[i];
        const json_t *c = config_at(root, 0, i);
        cr_assert_eq(json_integer_value(json_object_get(c, "ranks")), n);
        mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
        mfsdp_plan_t *p = NULL;
        cr_assert_eq(mfsdp_plan_create(m, n, &o, &p), MFSDP_OK);
        double mx = jnum(c, "ns_flops", "mfsdp_max"), lb = jnum(c, "ns_flops", "mfsdp_lb");
        cr_assert_eq(mx, p->max_flops, "n=%d: %.17g vs planner %.17g", n, mx, p->max_flops);
        cr_assert_eq(lb, p->lb_flops, "n=%d", n);
        cr_assert_geq(mx, lb * (1.0 - 1e-12), "n=%d", n);
        cr_assert_eq(jnum(c, "owned_bytes", "mfsdp_max"), (double)p->max_owned_bytes);
        cr_assert_eq(jnum(c, "owned_bytes", "mfsdp_lb"), p->lb_bytes);
        /* Round robin: the j-th Muon matrix in manifest order goes to rank j mod n. */
        double *f = calloc((size_t)n, sizeof(*f));
        size_t j = 0;
        for (size_t t = 0; t < mm.n; t++) {
            if (mm.t[t].muon) {
                f[j++ % (size_t)n] += mm.t[t].flops;
            }
        }
        double dmax = 0.0;
        for (int r = 0; r < n; r++) {
            dmax = f[r] > dmax ? f[r] : dmax;
        }
        free(f);
        assert_close(jnum(c, "ns_flops", "dmuon_max"), dmax, 1e-12, "dmuon max");
        cr_assert_geq(dmax, lb * (1.0 - 1e-12));
        mfsdp_plan_destroy(p);
    }
    mfsdp_manifest_free(m);
    json_decref(root);
    free(mm.t);
}

Test(tool_sim, mfsdp_is_the_planner_and_dmuon_is_round_robin)
{
    static const int n8b[] = {8, 16, 64, 1024};
    check_against_planner(L8B, "8,16,64,1024", n8b, 4);
    static const int n70b[] = {32, 256};
    check_against_planner(L70B, "32,256", n70b, 2);
    static const int ntiny[] = {1, 3, 5};
    check_against_planner(TINY, "1,3,5", ntiny, 3);
}

/* ---- memory and time on a manifest computed by hand ---------------------------------- */

/* g0 (reduce float32): w1 [8, 4] bfloat16 (muon), b1 [8] bfloat16 (adamw);
 * g1: w2 [4, 8] float32 (muon). */
static const char hand_manifest[] =
    "{\"format\": \"mfsdp-manifest/1\", \"groups\": ["
    "{\"name\": \"g0\", \"reduce_dtype\": \"float32\", \"params\": ["
    "{\"name\": \"w1\", \"shape\": [8, 4], \"dtype\": \"bfloat16\"},"
    "{\"name\": \"b1\", \"shape\": [8], \"dtype\": \"bfloat16\"}]},"
    "{\"name\": \"g1\", \"params\": ["
    "{\"name\": \"w2\", \"shape\": [4, 8], \"dtype\": \"float32\"}]}]}";

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(tool_sim, memory_rule_by_hand)
{
    char path[64];
    snprintf(path, sizeof(path), "/tmp/mfsdp-tool-sim-hand-%d.json", (int)getpid());
    write_file(path, hand_manifest);
    const char *args[] = {"-m", path, "-r", "2", "--tail", "shard", NULL};
    json_t *root = run_json(args);
    unlink(path);
    const json_t *c = config_at(root, 0, 0);
    /* n = 2. FSDP shards s = ceil(rows / 2) * cols: w1 16, b1 4, w2 16.
     * staging = 2 max_g U_g + max_g V_g with U_g0 = 2 (16*2 + 4*2) = 80, U_g1 = 2*16*4 = 128,
     * V_g0 = 2 (16*4 + 4*4) = 160, V_g1 = 128: 2*128 + 160 = 416. */
    cr_assert_eq(jnum(c, "memory_bytes", "staging"), 416.0);
    /* shard state = sum s (4 + 4 + state): w1 16*12 + b1 4*16 + w2 16*12 = 448. */
    cr_assert_eq(jnum(c, "memory_bytes", "shard_state"), 448.0);
    /* The NS workspace of a 4 x 8 (or 8 x 4) matrix, 2 s^2 + m k floats = 64 floats; the
     * owner's Muon working set adds U: 96 floats = 384 bytes. */
    cr_assert_eq(mfsdp_ns_workspace_elems(8, 4), 64);
    cr_assert_eq(mfsdp_muon_workspace_elems(8, 4), 96);
    /* fsdp2 = 448 + 416 + (32 elements gathered in fp32 + 256 workspace bytes) = 1248;
     * dmuon: each rank owns one matrix, the same 384 transient bytes: 1248. */
    cr_assert_eq(jnum(c, "memory_bytes", "fsdp2"), 1248.0);
    cr_assert_eq(jnum(c, "memory_bytes", "dmuon"), 1248.0);
    /* mfsdp: arena of w2's owner = 32 (4 + 4 + 4 + 4) = 512 plus b1's sharded slice
     * 4 (16 + 2) = 72; + staging 416 + working set 384 = 1384 (w1's owner: 448 + 72 + 416 +
     * 384 = 1320). */
    cr_assert_eq(jnum(c, "memory_bytes", "mfsdp"), 1384.0);
    /* zero1: full params and grads 2 (32*2 + 8*2 + 32*4) = 416, arena minus the comm copy
     * (w2's owner: 584 - 128 - 8 = 448; w1's owner: 520 - 64 - 8 = 448), + 384: 1248. */
    cr_assert_eq(jnum(c, "memory_bytes", "zero1"), 1248.0);
    json_decref(root);

    /* Limits of 1300 and 1250 bytes: mfsdp does not fit, ZeRO-1 fits, no OOM flag. */
    write_file(path, hand_manifest);
    const char *args2[] = {"-m", path, "-r", "2", "--tail", "shard", "--mem-gb", "1.3e-6", NULL};
    root = run_json(args2);
    unlink(path);
    c = config_at(root, 0, 0);
    cr_assert(json_is_false(json_object_get(c, "mfsdp_fits")));
    cr_assert(json_is_false(json_object_get(c, "zero1_exceeds")));
    cr_assert(json_is_false(json_object_get(c, "zero1_oom_mfsdp_fits")));
    assert_close(jnum(c, "memory_bytes", "limit"), 1300.0, 1e-12, "limit");
    json_decref(root);
}

Test(tool_sim, time_model_by_hand)
{
    char path[64];
    snprintf(path, sizeof(path), "/tmp/mfsdp-tool-sim-hand-%d.json", (int)getpid());
    write_file(path, hand_manifest);
    /* 1e6 FLOP/s at efficiency 1, 1000 B/s NVLink, 500 B/s network, alpha 10 / 100 us,
     * 2 GPUs per node, MFU 0.5, 1000 tokens. */
    const char *args[] = {"-m",
                          path,
                          "-r",
                          "2,4",
                          "--tail",
                          "shard",
                          "--tflops",
                          "1e-6",
                          "--ns-eff",
                          "1",
                          "--nvlink-gbs",
                          "1e-6",
                          "--ib-gbs",
                          "0.5e-6",
                          "--alpha-us",
                          "10",
                          "--alpha-ib-us",
                          "100",
                          "--gpus-per-node",
                          "2",
                          "--mfu",
                          "0.5",
                          "--tokens",
                          "1000",
                          NULL};
    json_t *root = run_json(args);
    unlink(path);
    const double R = 1e6;
    /* Each matrix: 5 (4 * 16 * 8 + 2 * 64) = 3200 FLOPs; both: 6400. */
    const double f = 3200.0;
    /* n = 2, one node: pieces w1 16 * 4 = 64 B, w2 16 * 4 = 64 B (gathered in fp32). */
    const json_t *c = config_at(root, 0, 0);
    cr_assert_str_eq(json_string_value(json_object_get(c, "link")), "nvlink");
    assert_close(jnum(c, "opt_step_s", "mfsdp"), f / R, 1e-12, "mfsdp");
    assert_close(jnum(c, "opt_step_s", "fsdp2_ns"), 2 * f / R, 1e-12, "fsdp2 ns");
    assert_close(jnum(c, "opt_step_s", "fsdp2_comm"), 2 * (10e-6 + 64.0 / 1000.0), 1e-12,
                 "fsdp2 comm");
    /* DMuon, one chunk: each owner receives 64 B and sends 64 B over NVLink, one step. */
    assert_close(jnum(c, "opt_step_s", "dmuon_ns"), f / R, 1e-12, "dmuon ns");
    assert_close(jnum(c, "opt_step_s", "dmuon_comm"), 2 * (10e-6 + 64.0 / 1000.0), 1e-12,
                 "dmuon comm");
    /* ZeRO-1: per group a ring all-gather of the parameters, pieces g0 16*2 + 4*2 = 40 B,
     * g1 16 * 4 = 64 B. */
    assert_close(jnum(c, "opt_step_s", "zero1_comm"),
                 (10e-6 + 40.0 / 1000.0) + (10e-6 + 64.0 / 1000.0), 1e-12, "zero1 comm");
    /* 6 * 72 params * 1000 tokens / (0.5 * 1e6). */
    assert_close(jnum(c, "e2e_s", "fwd_bwd"), 6.0 * 72 * 1000 / (0.5 * R), 1e-12, "fwd+bwd");
    assert_close(jnum(c, "speedup", "vs_fsdp2"),
                 jnum(c, "opt_step_s", "fsdp2") / jnum(c, "opt_step_s", "mfsdp"), 1e-12, "speedup");

    /* n = 4 on two nodes: the ring's 3 steps are 2 NVLink (10 us) + 1 network (100 us) and
     * its bytes go at the network's 500 B/s; pieces are now 2 rows: w1 8 * 4 = 32 B. */
    c = config_at(root, 0, 1);
    cr_assert_eq(json_integer_value(json_object_get(c, "nodes")), 2);
    cr_assert_str_eq(json_string_value(json_object_get(c, "link")), "network");
    assert_close(jnum(c, "opt_step_s", "fsdp2_comm"), 2 * (120e-6 + 3 * 32.0 / 500.0), 1e-12,
                 "fsdp2 comm, 2 nodes");
    /* DMuon, one chunk (w1 -> rank 0, w2 -> rank 1, both on node 0): rank 0 receives 32 B
     * from its node peer (NVLink) and 2 * 32 B from node 1 (network: 0.128 s); ranks 2 and 3
     * send 64 B to node 0 (0.128 s). Latency: 1 NVLink + 2 network steps. */
    assert_close(jnum(c, "opt_step_s", "dmuon_comm"), 2 * (210e-6 + 64.0 / 500.0), 1e-12,
                 "dmuon comm, 2 nodes");
    json_decref(root);
}

/* ---- ZeRO-1 over 80 GB for Llama-3-70B ------------------------------------------------ */

/* Hand computation: ZeRO-1 holds bf16 params and grads of all 70.55 B parameters (282 GB)
 * on every rank, over 80 GB at any n. mfsdp fits when max_r (arena_r + W_r) + staging
 * <= 80 GB, arena from the planner, staging from the shapes: the root group (embed, norm,
 * lm_head) is the largest: 2 x its bf16 bytes + its fp32 gradient bytes. */
Test(tool_sim, zero1_over_80gb_for_70b)
{
    const char *args[] = {"-m", L70B, NULL};
    json_t *root = run_json(args);
    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    cr_assert_eq(mfsdp_manifest_load(L70B, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    mmodel_t mm = read_model(L70B);
    cr_assert_gt(2.0 * 2.0 * mm.params, 80e9);
    static const int ns[] = {8, 16, 32, 64, 128, 256, 512, 1024};
    int flagged = 0;
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        int n = ns[i];
        mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
        mfsdp_plan_t *p = NULL;
        cr_assert_eq(mfsdp_plan_create(m, n, &o, &p), MFSDP_OK);
        /* Root group: 128256 x 8192 twice and 8192, padded to n. */
        double c_emb = ceil(128256.0 / n), c_norm = ceil(8192.0 / n);
        double root_elems = n * (2.0 * c_emb * 8192.0 + c_norm);
        double staging = 2.0 * root_elems * 2.0 + root_elems * 4.0;
        double worst = 0.0;
        for (int r = 0; r < n; r++) {
            double w = 0.0;
            const mfsdp_rank_plan_t *rp = &p->ranks[r];
            for (size_t k = 0; k < rp->nowned; k++) {
                const mfsdp_shard_t *sh = &p->shards[rp->owned[k]];
                if (sh->role == MFSDP_ROLE_MUON) {
                    double s = (double)(sh->rows < sh->cols ? sh->rows : sh->cols);
                    double ws = 4.0 * (2.0 * (double)sh->numel + 2.0 * s * s);
                    w = ws > w ? ws : w;
                }
            }
            double v = (double)rp->arena_bytes + w;
            worst = v > worst ? v : worst;
        }
        int want = worst + staging <= 80e9;
        const json_t *c = config_at(root, 0, i);
        assert_close(jnum(c, "memory_bytes", "mfsdp"), worst + staging, 1e-12, "mfsdp memory");
        cr_assert(json_is_true(json_object_get(c, "zero1_exceeds")), "n=%d", n);
        cr_assert_eq(json_is_true(json_object_get(c, "zero1_oom_mfsdp_fits")), want, "n=%d", n);
        flagged += want;
        mfsdp_plan_destroy(p);
    }
    /* At 8 ranks the arenas alone are over 80 GB; from 32 on everything fits. */
    cr_assert(json_is_false(json_object_get(config_at(root, 0, 0), "zero1_oom_mfsdp_fits")));
    cr_assert(json_is_true(json_object_get(config_at(root, 0, 2), "zero1_oom_mfsdp_fits")));
    cr_assert_geq(flagged, 6);
    mfsdp_manifest_free(m);
    json_decref(root);
    free(mm.t);

    /* The table marks the same rows. */
    const char *targs[] = {"-m", L70B, "-r", "8,64", NULL};
    run_result_t r = run_tool(targs);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    const char *mem = strstr(r.out, "# peak memory");
    cr_assert_not_null(mem);
    int n1 = 0, n2 = 0;
    char flag1[64] = "", flag2[64] = "";
    const char *l1 = strstr(mem, "\n       8 ");
    const char *l2 = strstr(mem, "\n      64 ");
    cr_assert(l1 != NULL && l2 != NULL, "%s", mem);
    cr_assert_eq(sscanf(l1, " %d %*f %*f %*f %*f %*f %63s", &n1, flag1), 2, "%s", l1);
    cr_assert_eq(sscanf(l2, " %d %*f %*f %*f %*f %*f %63s", &n2, flag2), 2, "%s", l2);
    cr_assert_str_eq(flag1, "mfsdp-OOM");
    cr_assert_str_eq(flag2, "ZERO1-OOM");
    run_free(&r);
}

/* ---- presets, overrides, consistency --------------------------------------------------- */

Test(tool_sim, presets_and_overrides)
{
    const char *a[] = {"-m", L8B, "-r", "8", "--gpu", "h200", NULL};
    json_t *root = run_json(a);
    const json_t *g = json_object_get(root, "gpu");
    cr_assert_str_eq(json_string_value(json_object_get(g, "preset")), "h200");
    cr_assert_eq(jnum(g, "mem_gb", NULL), 141.0);
    cr_assert_eq(jnum(g, "tflops", NULL), 989.0);
    const json_t *c = config_at(root, 0, 0);
    double R = 989e12 * jnum(g, "ns_eff", NULL);
    assert_close(jnum(c, "opt_step_s", "fsdp2_ns"), jnum(c, "ns_flops", "fsdp2") / R, 1e-12,
                 "fsdp2 ns");
    assert_close(jnum(c, "opt_step_s", "mfsdp"), jnum(c, "ns_flops", "mfsdp_max") / R, 1e-12,
                 "mfsdp");
    assert_close(jnum(c, "opt_step_s", "fsdp2"),
                 jnum(c, "opt_step_s", "fsdp2_ns") + jnum(c, "opt_step_s", "fsdp2_comm"), 1e-12,
                 "fsdp2 = ns + comm");
    mmodel_t mm = read_model(L8B);
    assert_close(jnum(c, "e2e_s", "fwd_bwd"), 6.0 * mm.params * 8192.0 / (0.40 * 989e12), 1e-12,
                 "fwd+bwd default tokens and mfu");
    assert_close(jnum(c, "e2e_speedup", "vs_fsdp2"),
                 jnum(c, "e2e_s", "fsdp2") / jnum(c, "e2e_s", "mfsdp"), 1e-12, "e2e speedup");
    free(mm.t);
    json_decref(root);

    /* An override renames the preset and changes the node count. */
    const char *b[] = {"-m", L8B, "-r", "8", "--gpus-per-node", "4", "--ib-gbs", "12.5", NULL};
    root = run_json(b);
    g = json_object_get(root, "gpu");
    cr_assert_str_eq(json_string_value(json_object_get(g, "preset")), "a100+");
    cr_assert_eq(jnum(g, "ib_gbs", NULL), 12.5);
    c = config_at(root, 0, 0);
    cr_assert_eq(json_integer_value(json_object_get(c, "nodes")), 2);
    cr_assert_str_eq(json_string_value(json_object_get(c, "link")), "network");
    json_decref(root);

    /* Gathering bf16 halves fsdp2's bytes: the bandwidth part of its comm time halves. */
    const char *d32[] = {"-m", L8B, "-r", "64", "--alpha-us", "0", "--alpha-ib-us", "0", NULL};
    const char *d16[] = {
        "-m",       L8B, "-r", "64", "--alpha-us", "0", "--alpha-ib-us", "0", "--gather-dtype",
        "bfloat16", NULL};
    json_t *r32 = run_json(d32), *r16 = run_json(d16);
    assert_close(jnum(config_at(r16, 0, 0), "opt_step_s", "fsdp2_comm"),
                 0.5 * jnum(config_at(r32, 0, 0), "opt_step_s", "fsdp2_comm"), 1e-9, "bf16");
    json_decref(r32);
    json_decref(r16);
}

Test(tool_sim, table_and_paper)
{
    const char *a[] = {"-m", L8B, "-r", "8,64", NULL};
    run_result_t r = run_tool(a);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_str_empty(r.err);
    cr_assert_not_null(strstr(r.out, "# gpu a100: 312.0 TFLOP/s"));
    cr_assert_not_null(strstr(r.out, "llama3-8b.json: 8.030 B params, 224 muon matrices"));
    /* Three blocks with one row per rank count each. */
    int rows8 = 0;
    for (const char *p = r.out; (p = strstr(p, "\n       8 ")) != NULL; p++) {
        rows8++;
    }
    cr_assert_eq(rows8, 3, "%s", r.out);
    run_free(&r);

    const char *pa[] = {"--paper", NULL};
    r = run_tool(pa);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_not_null(strstr(r.out, "arXiv 2607.05895"));
    const char *p = strstr(r.out, "paper-e2e\n");
    cr_assert_not_null(p, "%s", r.out);
    int n = 0, nodes = 0;
    double mf, ff, df, x, paper;
    cr_assert_eq(
        sscanf(p + 10, " %d %d %lf %lf %lf %lf %lf", &n, &nodes, &mf, &ff, &df, &x, &paper), 7);
    cr_assert_eq(n, 8);
    cr_assert_eq(paper, 4.2);
    const char *p64 = strstr(p + 10, "\n      64 ");
    cr_assert_not_null(p64);
    cr_assert_eq(sscanf(p64, " %d %d %lf %lf %lf %lf %lf", &n, &nodes, &mf, &ff, &df, &x, &paper),
                 7);
    cr_assert_eq(nodes, 8);
    cr_assert_eq(paper, 54.6);
    cr_assert_gt(x, 1.0);
    run_free(&r);

    const char *pj[] = {"--paper", NULL};
    json_t *root = run_json(pj);
    cr_assert_eq(jnum(json_object_get(root, "paper"), "opt_speedup_vs_fsdp2", "64"), 54.6);
    cr_assert_eq(json_array_size(json_object_get(root, "runs")), 1);
    json_decref(root);

    const char *h[] = {"--help", NULL};
    r = run_tool(h);
    cr_assert_eq(r.rc, 0);
    cr_assert_not_null(strstr(r.out, "usage: mfsdp-sim"));
    cr_assert_str_empty(r.err);
    run_free(&r);
}

/* ---- bad input ------------------------------------------------------------------------ */

typedef struct bad_case {
    char args[160];
    int rc;
    char expect[96];
} bad_case_t;

ParameterizedTestParameters(tool_sim, bad_input)
{
    static bad_case_t cases[] = {
        {"-r 0", 2, "--ranks '0': '0' is not an integer in 1..65536"},
        {"-r 8,x", 2, "'x' is not an integer"},
        {"-r 8,,16", 2, "'' is not an integer"},
        {"-r 8,8", 2, "8 appears twice"},
        {"-r 70000", 2, "1..65536"},
        {"--gpu tpu", 2, "--gpu 'tpu': expected a100, h100 or h200"},
        {"--tflops 0", 2, "--tflops '0': expected a number of TFLOP/s > 0"},
        {"--tflops abc", 2, "--tflops 'abc'"},
        {"--ns-eff 1.5", 2, "--ns-eff '1.5': expected a fraction in (0, 1]"},
        {"--ns-eff 0", 2, "--ns-eff '0'"},
        {"--mem-gb -1", 2, "--mem-gb '-1'"},
        {"--nvlink-gbs 0", 2, "--nvlink-gbs '0'"},
        {"--ib-gbs nan", 2, "--ib-gbs 'nan'"},
        {"--alpha-us -1", 2, "--alpha-us '-1': expected a latency in us >= 0"},
        {"--alpha-ib-us x", 2, "--alpha-ib-us 'x'"},
        {"--gpus-per-node 0", 2, "--gpus-per-node '0': expected an integer in 1..1024"},
        {"--gpus-per-node 2.5", 2, "--gpus-per-node '2.5'"},
        {"--mfu 0", 2, "--mfu '0'"},
        {"--mfu 1.01", 2, "--mfu '1.01'"},
        {"--tokens 0", 2, "--tokens '0'"},
        {"--tokens 1e3", 2, "--tokens '1e3': expected an integer"},
        {"--gather-dtype fp8", 2, "--gather-dtype 'fp8': expected float32 or bfloat16"},
        {"--tail both", 2, "--tail 'both'"},
        {"--frobnicate", 2, "unknown option '--frobnicate'"},
        {"-m", 2, "option '-m' needs a value"},
        {"--ranks", 2, "option '--ranks' needs a value"},
        {"@8B@", 2, "unexpected argument"},
        {"--paper --gpu h100", 2, "--paper uses the a100 preset"},
        {"--paper -r 8", 2, "--paper runs 8 and 64 ranks"},
        {"--paper -m @8B@ -m @8B@", 2, "at most one --manifest"},
        {"-m /nonexistent/m.json", 1, "cannot open"},
        {"-m @BAD@", 1, "groups[0].params[0].shape[1]"},
        {"-m @WS4@ -r 4,8", 1, "at 8 ranks: world size 8 does not match the manifest's"},
        {"-m @SH1@ -r 2", 1, "Shard(1) placement is not supported"},
    };
    return cr_make_param_array(bad_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_case_t *c, tool_sim, bad_input)
{
    char bad[64], ws4[64], sh1[64];
    snprintf(bad, sizeof(bad), "/tmp/mfsdp-tool-sim-bad-%d.json", (int)getpid());
    snprintf(ws4, sizeof(ws4), "/tmp/mfsdp-tool-sim-ws4-%d.json", (int)getpid());
    snprintf(sh1, sizeof(sh1), "/tmp/mfsdp-tool-sim-sh1-%d.json", (int)getpid());
    write_file(bad, "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", "
                    "\"params\": [{\"name\": \"w\", \"shape\": [4, -4], \"dtype\": "
                    "\"float32\"}]}]}");
    write_file(ws4, "{\"format\": \"mfsdp-manifest/1\", \"world_size\": 4, \"groups\": "
                    "[{\"name\": \"g\", \"params\": [{\"name\": \"w\", \"shape\": [4, 4], "
                    "\"dtype\": \"float32\"}]}]}");
    write_file(sh1, "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", "
                    "\"params\": [{\"name\": \"w\", \"shape\": [4, 4], \"dtype\": "
                    "\"float32\", \"shard_dim\": 1}]}]}");
    const char *args[24] = {NULL};
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(c->args, " ", &save); tok != NULL && n < 23;
         tok = strtok_r(NULL, " ", &save)) {
        args[n++] = strcmp(tok, "@8B@") == 0    ? L8B
                    : strcmp(tok, "@BAD@") == 0 ? bad
                    : strcmp(tok, "@WS4@") == 0 ? ws4
                    : strcmp(tok, "@SH1@") == 0 ? sh1
                                                : tok;
    }
    run_result_t r = run_tool(args);
    unlink(bad);
    unlink(ws4);
    unlink(sh1);
    cr_assert_eq(r.rc, c->rc, "'%s': rc %d, stderr: %s", c->args, r.rc, r.err);
    cr_assert_str_empty(r.out, "'%s': stdout: %s", c->args, r.out);
    size_t lines = 0;
    for (const char *p = r.err; *p != '\0'; p++) {
        lines += *p == '\n';
    }
    cr_assert_eq(lines, 1, "'%s': stderr must be one line: %s", c->args, r.err);
    cr_assert_eq(strncmp(r.err, "mfsdp-sim: ", 11), 0, "%s", r.err);
    cr_assert_not_null(strstr(r.err, c->expect), "'%s': stderr: %s", c->args, r.err);
    run_free(&r);
}
