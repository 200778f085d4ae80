/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner planner: determinism, balance against independently computed lower bounds on
 * Llama-3 shapes, per-group spread, tail policies, memory limits, hand-checked arena
 * accounting. Manifests are built in C here so the tests do not depend on the parser;
 * the shipped example manifests are loaded too when they exist.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "mfsdp/plan.h"

/* ---- manifest builder ----------------------------------------------------------------- */

static mfsdp_manifest_t *tm_new(void)
{
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    cr_assert_not_null(m);
    m->hp.lr = 0.02;
    m->hp.momentum = 0.95;
    m->hp.nesterov = 1;
    m->hp.ns_steps = 5;
    m->hp.adamw_lr = 1e-3;
    m->hp.adamw_beta1 = 0.9;
    m->hp.adamw_beta2 = 0.95;
    m->hp.adamw_eps = 1e-8;
    return m;
}

static size_t tm_group(mfsdp_manifest_t *m, const char *fmt, ...)
{
    char name[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    m->groups = realloc(m->groups, (m->ngroups + 1) * sizeof(*m->groups));
    cr_assert_not_null(m->groups);
    mfsdp_group_desc_t *g = &m->groups[m->ngroups];
    memset(g, 0, sizeof(*g));
    g->name = strdup(name);
    g->lr_scale = 1.0;
    return m->ngroups++;
}

/* Append a param; the optimizer follows the manifest's default rule. */
static mfsdp_param_desc_t *tm_param(mfsdp_manifest_t *m, size_t gi, const char *name,
                                    mfsdp_dtype_t dtype, int ndim, int64_t d0, int64_t d1)
{
    mfsdp_group_desc_t *g = &m->groups[gi];
    g->params = realloc(g->params, (g->nparams + 1) * sizeof(*g->params));
    cr_assert_not_null(g->params);
    mfsdp_param_desc_t *p = &g->params[g->nparams++];
    memset(p, 0, sizeof(*p));
    p->name = strdup(name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim > 1 ? d1 : 0;
    p->numel = ndim > 1 ? d0 * d1 : d0;
    p->dtype = dtype;
    p->requires_grad = 1;
    int embed = strstr(name, "embed") || strstr(name, "lm_head") || strstr(name, "wte") ||
                strstr(name, "wpe");
    p->optimizer = ndim >= 2 && !embed ? MFSDP_ROLE_MUON : MFSDP_ROLE_ADAMW;
    return p;
}

static void tm_free(mfsdp_manifest_t *m)
{
    if (m == NULL) {
        return;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            free(m->groups[g].params[i].name);
            free(m->groups[g].params[i].split);
        }
        free(m->groups[g].params);
        free(m->groups[g].name);
    }
    free(m->groups);
    free(m->sequence);
    free(m);
}

/* Llama-3 shapes: one group per block plus a root group (embed, final norm, lm_head). */
static mfsdp_manifest_t *tm_llama(int layers, int64_t hidden, int64_t kv, int64_t ffn)
{
    const int64_t vocab = 128256;
    mfsdp_manifest_t *m = tm_new();
    char name[128];
    for (int l = 0; l < layers; l++) {
        size_t g = tm_group(m, "layers.%d", l);
        static const char *const attn[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
        for (int i = 0; i < 4; i++) {
            snprintf(name, sizeof(name), "layers.%d.self_attn.%s.weight", l, attn[i]);
            int64_t rows = (i == 1 || i == 2) ? kv : hidden;
            tm_param(m, g, name, MFSDP_BFLOAT16, 2, rows, hidden);
        }
        snprintf(name, sizeof(name), "layers.%d.mlp.gate_proj.weight", l);
        tm_param(m, g, name, MFSDP_BFLOAT16, 2, ffn, hidden);
        snprintf(name, sizeof(name), "layers.%d.mlp.up_proj.weight", l);
        tm_param(m, g, name, MFSDP_BFLOAT16, 2, ffn, hidden);
        snprintf(name, sizeof(name), "layers.%d.mlp.down_proj.weight", l);
        tm_param(m, g, name, MFSDP_BFLOAT16, 2, hidden, ffn);
        snprintf(name, sizeof(name), "layers.%d.input_layernorm.weight", l);
        tm_param(m, g, name, MFSDP_BFLOAT16, 1, hidden, 0);
        snprintf(name, sizeof(name), "layers.%d.post_attention_layernorm.weight", l);
        tm_param(m, g, name, MFSDP_BFLOAT16, 1, hidden, 0);
    }
    size_t root = tm_group(m, "root");
    tm_param(m, root, "embed_tokens.weight", MFSDP_BFLOAT16, 2, vocab, hidden);
    tm_param(m, root, "norm.weight", MFSDP_BFLOAT16, 1, hidden, 0);
    tm_param(m, root, "lm_head.weight", MFSDP_BFLOAT16, 2, vocab, hidden);
    return m;
}

static mfsdp_manifest_t *tm_llama8b(void)
{
    return tm_llama(32, 4096, 1024, 14336);
}

static mfsdp_manifest_t *tm_llama70b(void)
{
    return tm_llama(80, 8192, 1024, 28672);
}

/* ---- independent references --------------------------------------------------------- */

static double ref_ns_flops(int steps, double rows, double cols)
{
    double s = fmin(rows, cols);
    double l = fmax(rows, cols);
    return steps * (4.0 * s * s * l + 2.0 * s * s * s);
}

static int cmp_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : (x < y);
}

/* LB = max(total / n, p1, p_n + p_{n+1}), computed from scratch. */
static double ref_lb(double *v, size_t m, int n)
{
    if (m == 0) {
        return 0;
    }
    qsort(v, m, sizeof(*v), cmp_desc);
    double total = 0;
    for (size_t i = 0; i < m; i++) {
        total += v[i];
    }
    double lb = fmax(total / n, v[0]);
    if (m > (size_t)n) {
        lb = fmax(lb, v[n - 1] + v[n]);
    }
    return lb;
}

static const mfsdp_param_desc_t *plan_param(const mfsdp_plan_t *p, size_t k)
{
    return &p->manifest->groups[p->shards[k].group].params[p->shards[k].param];
}

static size_t dtype_bytes(mfsdp_dtype_t d)
{
    return d == MFSDP_FLOAT32 ? 4 : 2;
}

/* Structural invariants every plan must satisfy; returns the number of placed tensors. */
static size_t check_plan_invariants(const mfsdp_plan_t *p, int spread)
{
    const mfsdp_manifest_t *m = p->manifest;
    int n = p->world;
    size_t nplaced = 0;
    size_t *seen = calloc(p->nshards + 1, sizeof(*seen));
    cr_assert_not_null(seen);
    for (int r = 0; r < n; r++) {
        const mfsdp_rank_plan_t *rp = &p->ranks[r];
        double flops = 0;
        size_t bytes = 0;
        for (size_t i = 0; i < rp->nowned; i++) {
            size_t k = rp->owned[i];
            cr_assert_lt(k, p->nshards);
            if (i > 0) {
                cr_assert_gt(k, rp->owned[i - 1], "owned list must ascend");
            }
            cr_assert_eq(p->shards[k].owner, r);
            seen[k]++;
            flops += p->shards[k].ns_flops;
            bytes += (size_t)p->shards[k].numel * dtype_bytes(plan_param(p, k)->dtype);
        }
        cr_expect_float_eq(rp->ns_flops, flops, 1e-9 * (flops + 1));
        cr_expect_eq(rp->owned_bytes, bytes);
        cr_expect_leq(rp->ns_flops, p->max_flops);
        cr_expect_leq(rp->owned_bytes, p->max_owned_bytes);
        cr_expect_leq(rp->arena_bytes, p->max_arena_bytes);
    }
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_shard_t *sh = &p->shards[k];
        if (sh->role == MFSDP_ROLE_MUON) {
            cr_assert(sh->owner >= 0 && sh->owner < n, "muon matrix %zu not owned", k);
        }
        if (sh->owner >= 0) {
            cr_assert_eq(seen[k], 1, "tensor %zu owned %zu times", k, seen[k]);
            nplaced++;
        } else {
            cr_assert_eq(sh->owner, MFSDP_OWNER_SHARDED);
            cr_assert_eq(sh->role, MFSDP_ROLE_ADAMW);
            cr_assert_eq(seen[k], 0);
        }
    }
    /* Spread: no group puts more than ceil(k/n) + 1 of its k placed tensors on one rank. */
    if (spread) {
        unsigned *cnt = calloc((size_t)n, sizeof(*cnt));
        for (size_t g = 0; g < m->ngroups; g++) {
            memset(cnt, 0, (size_t)n * sizeof(*cnt));
            size_t kg = 0;
            for (size_t k = p->group_first[g]; k < p->group_first[g + 1]; k++) {
                if (p->shards[k].owner >= 0) {
                    cnt[p->shards[k].owner]++;
                    kg++;
                }
            }
            size_t cap = (kg + (size_t)n - 1) / (size_t)n + 1;
            for (int r = 0; r < n; r++) {
                cr_assert_leq(cnt[r], cap, "group %zu puts %u of %zu on rank %d", g, cnt[r], kg, r);
            }
        }
        free(cnt);
    }
    free(seen);
    return nplaced;
}

/* Lower bounds of a plan recomputed from the placed tensors. */
static void ref_bounds(const mfsdp_plan_t *p, double *lbf, double *lbb)
{
    double *f = calloc(p->nshards + 1, sizeof(*f));
    double *b = calloc(p->nshards + 1, sizeof(*b));
    size_t m = 0;
    for (size_t k = 0; k < p->nshards; k++) {
        if (p->shards[k].owner < 0) {
            continue;
        }
        const mfsdp_param_desc_t *pd = plan_param(p, k);
        f[m] = pd->optimizer == MFSDP_ROLE_MUON
                   ? ref_ns_flops(5, (double)pd->shape[0], (double)(pd->numel / pd->shape[0]))
                   : 0.0;
        b[m] = (double)pd->numel * (double)dtype_bytes(pd->dtype);
        m++;
    }
    *lbf = ref_lb(f, m, p->world);
    *lbb = ref_lb(b, m, p->world);
    free(f);
    free(b);
}

static char *plan_json(const mfsdp_manifest_t *m, int n, mfsdp_tail_policy_t tail)
{
    mfsdp_plan_opts_t o = {.tail = tail};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, n, &o, &p), MFSDP_OK);
    char *js = NULL;
    cr_assert_eq(mfsdp_plan_to_json(p, &js), MFSDP_OK);
    mfsdp_plan_destroy(p);
    return js;
}

/* Captures MFSDP_WARN lines into a per-test file. */
static char log_path[256];

static void log_to_file(void)
{
    snprintf(log_path, sizeof(log_path), "/tmp/mfsdp-test-planner-%d.log", (int)getpid());
    unlink(log_path);
    setenv("MFSDP_DEBUG_FILE", log_path, 1);
    setenv("MFSDP_DEBUG", "WARN", 1);
    mfsdp_log_reinit();
}

static char *log_read(void)
{
    static char buf[8192];
    buf[0] = '\0';
    FILE *f = fopen(log_path, "r");
    if (f != NULL) {
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        buf[n] = '\0';
        fclose(f);
    }
    return buf;
}

static void log_fini(void)
{
    if (log_path[0] != '\0') {
        unlink(log_path);
    }
}

TestSuite(planner, .fini = log_fini);

/* ---- determinism ---------------------------------------------------------------------- */

Test(planner, deterministic_json)
{
    mfsdp_manifest_t *m1 = tm_llama8b();
    char *a = plan_json(m1, 16, MFSDP_TAIL_AUTO);
    /* Other plans in between (different world, policy) must not change anything. */
    free(plan_json(m1, 8, MFSDP_TAIL_OWNER));
    free(plan_json(m1, 64, MFSDP_TAIL_SHARD));
    char *b = plan_json(m1, 16, MFSDP_TAIL_AUTO);
    /* A separately built manifest with the same content. */
    mfsdp_manifest_t *m2 = tm_llama8b();
    char *c = plan_json(m2, 16, MFSDP_TAIL_AUTO);
    cr_assert_str_eq(a, b);
    cr_assert_str_eq(a, c);
    json_error_t err;
    json_t *root = json_loads(a, 0, &err);
    cr_assert_not_null(root, "%s", err.text);
    cr_expect_str_eq(json_string_value(json_object_get(root, "format")), "mfsdp-plan/1");
    cr_expect_eq(json_integer_value(json_object_get(root, "world_size")), 16);
    cr_expect_str_eq(json_string_value(json_object_get(root, "tail")), "auto");
    cr_expect_eq(json_array_size(json_object_get(root, "ranks")), 16);
    cr_expect_eq(json_array_size(json_object_get(root, "params")), 32 * 9 + 3);
    cr_expect_eq(json_array_size(json_object_get(root, "groups")), 33);
    json_decref(root);
    free(a);
    free(b);
    free(c);
    tm_free(m1);
    tm_free(m2);
}

Test(planner, json_matches_plan)
{
    mfsdp_manifest_t *m = tm_llama8b();
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 8, &o, &p), MFSDP_OK);
    char *js = NULL;
    cr_assert_eq(mfsdp_plan_to_json(p, &js), MFSDP_OK);
    json_t *root = json_loads(js, 0, NULL);
    cr_assert_not_null(root);
    json_t *params = json_object_get(root, "params");
    for (size_t k = 0; k < p->nshards; k++) {
        json_t *e = json_array_get(params, k);
        cr_assert_str_eq(json_string_value(json_object_get(e, "name")), plan_param(p, k)->name);
        json_t *ow = json_object_get(e, "owner");
        if (p->shards[k].owner == MFSDP_OWNER_SHARDED) {
            cr_assert_str_eq(json_string_value(ow), "sharded");
        } else {
            cr_assert_eq(json_integer_value(ow), p->shards[k].owner);
        }
        cr_assert_eq(json_real_value(json_object_get(e, "ns_flops")), p->shards[k].ns_flops);
        cr_assert_eq((size_t)json_integer_value(json_object_get(e, "arena_bytes")),
                     p->shards[k].arena_bytes);
    }
    json_t *ranks = json_object_get(root, "ranks");
    for (int r = 0; r < 8; r++) {
        json_t *e = json_array_get(ranks, (size_t)r);
        cr_assert_eq((size_t)json_integer_value(json_object_get(e, "owned_bytes")),
                     p->ranks[r].owned_bytes);
        cr_assert_eq(json_array_size(json_object_get(e, "owned")), p->ranks[r].nowned);
    }
    json_t *bounds = json_object_get(root, "bounds");
    cr_assert_eq(json_real_value(json_object_get(bounds, "lb_flops")), p->lb_flops);
    cr_assert_eq(json_real_value(json_object_get(bounds, "lb_bytes")), p->lb_bytes);
    json_decref(root);
    free(js);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* ---- balance on Llama-3 shapes -------------------------------------------------------- */

typedef struct balance_case {
    int n;
    int tail;
    int model; /* 8 or 70 */
} balance_case_t;

ParameterizedTestParameters(planner, llama_balance)
{
    static balance_case_t cases[] = {
        {8, MFSDP_TAIL_OWNER, 8},  {8, MFSDP_TAIL_SHARD, 8},   {8, MFSDP_TAIL_AUTO, 8},
        {16, MFSDP_TAIL_OWNER, 8}, {16, MFSDP_TAIL_SHARD, 8},  {16, MFSDP_TAIL_AUTO, 8},
        {64, MFSDP_TAIL_OWNER, 8}, {64, MFSDP_TAIL_SHARD, 8},  {64, MFSDP_TAIL_AUTO, 8},
        {64, MFSDP_TAIL_AUTO, 70}, {512, MFSDP_TAIL_AUTO, 70},
    };
    return cr_make_param_array(balance_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(balance_case_t *c, planner, llama_balance)
{
    mfsdp_manifest_t *m = c->model == 70 ? tm_llama70b() : tm_llama8b();
    mfsdp_plan_opts_t o = {.tail = (mfsdp_tail_policy_t)c->tail};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, c->n, &o, &p), MFSDP_OK);
    check_plan_invariants(p, 1);
    double lbf, lbb;
    ref_bounds(p, &lbf, &lbb);
    cr_assert_float_eq(p->lb_flops, lbf, 1e-9 * lbf);
    cr_assert_float_eq(p->lb_bytes, lbb, 1e-9 * lbb);
    double rf = p->max_flops / lbf;
    double rb = (double)p->max_owned_bytes / lbb;
    cr_log_info("llama%d n=%d tail=%d: flops max/lb %.4f, owned bytes max/lb %.4f", c->model, c->n,
                c->tail, rf, rb);
    /* Tail policy owner puts the embedding and lm_head whole on two ranks: those hold
     * bytes but few FLOPs, the other ranks take their FLOPs share, so both bounds cannot be
     * met at once (the hotspot docs/design.md, "Owners" describes). auto and shard must. */
    double bound = c->tail == MFSDP_TAIL_OWNER ? 1.15 : 1.05;
    cr_expect_leq(rf, bound, "flops max/lb %.4f at n=%d", rf, c->n);
    cr_expect_leq(rb, bound, "bytes max/lb %.4f at n=%d", rb, c->n);
    cr_expect_geq(rf, 1.0 - 1e-12);
    cr_expect_geq(rb, 1.0 - 1e-12);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* ---- tail policies -------------------------------------------------------------------- */

Test(planner, tail_owner_and_shard)
{
    mfsdp_manifest_t *m = tm_llama8b();
    mfsdp_plan_t *p = NULL;
    mfsdp_plan_opts_t own = {.tail = MFSDP_TAIL_OWNER};
    cr_assert_eq(mfsdp_plan_create(m, 16, &own, &p), MFSDP_OK);
    for (size_t k = 0; k < p->nshards; k++) {
        cr_assert_geq(p->shards[k].owner, 0);
        cr_assert_lt(p->shards[k].owner, 16);
    }
    for (int r = 0; r < 16; r++) {
        cr_assert_eq(p->ranks[r].tail_elems, 0);
    }
    mfsdp_plan_destroy(p);

    mfsdp_plan_opts_t sh = {.tail = MFSDP_TAIL_SHARD};
    cr_assert_eq(mfsdp_plan_create(m, 16, &sh, &p), MFSDP_OK);
    size_t tail = 0, tail_bytes = 0;
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_param_desc_t *pd = plan_param(p, k);
        if (pd->optimizer == MFSDP_ROLE_ADAMW) {
            cr_assert_eq(p->shards[k].owner, MFSDP_OWNER_SHARDED, "%s", pd->name);
            size_t s = (size_t)((pd->shape[0] + 15) / 16) * (size_t)(pd->numel / pd->shape[0]);
            cr_assert_eq(p->shards[k].arena_offset, tail);
            tail += s;
            tail_bytes += s * (16 + 2);
        } else {
            cr_assert_geq(p->shards[k].owner, 0);
        }
    }
    for (int r = 0; r < 16; r++) {
        const mfsdp_rank_plan_t *rp = &p->ranks[r];
        cr_assert_eq(rp->tail_elems, tail);
        cr_assert_eq(rp->arena_elems[MFSDP_ARENA_ADAM_M], tail);
        cr_assert_eq(rp->arena_elems[MFSDP_ARENA_ADAM_V], tail);
        /* Muon only otherwise: 4 + 2 + 4 + 4 bytes per owned element. */
        cr_assert_eq(rp->arena_bytes, rp->owned_bytes / 2 * 14 + tail_bytes);
        cr_assert_eq(rp->arena_elems[MFSDP_ARENA_MASTER],
                     rp->arena_elems[MFSDP_ARENA_MOMENTUM] + tail);
    }
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* Auto rule: shard an AdamW tensor iff its bytes exceed the largest Muon matrix's, or
 * bytes * n > bytes of all tensors, or its whole arena cost exceeds mem_limit. */
ParameterizedTestParameters(planner, tail_auto_rule)
{
    static int worlds[] = {1, 2, 8, 16, 64};
    return cr_make_param_array(int, worlds, sizeof(worlds) / sizeof(worlds[0]));
}

ParameterizedTest(int *n, planner, tail_auto_rule)
{
    mfsdp_manifest_t *m = tm_llama8b();
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, *n, &o, &p), MFSDP_OK);
    double total = 0, muon_max = 0;
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_param_desc_t *pd = plan_param(p, k);
        total += (double)pd->numel * 2;
        if (pd->optimizer == MFSDP_ROLE_MUON) {
            muon_max = fmax(muon_max, (double)pd->numel * 2);
        }
    }
    size_t nsharded = 0;
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_param_desc_t *pd = plan_param(p, k);
        if (pd->optimizer != MFSDP_ROLE_ADAMW) {
            continue;
        }
        double b = (double)pd->numel * 2;
        int expect_sharded = b > muon_max || b * *n > total;
        cr_assert_eq(p->shards[k].owner == MFSDP_OWNER_SHARDED, expect_sharded, "%s at n=%d",
                     pd->name, *n);
        nsharded += expect_sharded;
    }
    /* The embedding and lm_head (128256 x 4096) are coarser than any matrix; norms stay. */
    cr_assert_eq(nsharded, 2);
    check_plan_invariants(p, 1);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* Eight 100x100 fp32 matrices (40000 B, arena 160000 B each) and a bf16 bias of 19000
 * (38000 B: not coarser than a matrix; 8 * 38000 < 358000 total: not above the mean). */
static mfsdp_manifest_t *tm_bias_model(void)
{
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    m->groups[g].has_reduce_dtype = 1;
    m->groups[g].reduce_dtype = MFSDP_FLOAT32;
    char name[32];
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof(name), "w%d", i);
        tm_param(m, g, name, MFSDP_FLOAT32, 2, 100, 100);
    }
    tm_param(m, g, "bias", MFSDP_BFLOAT16, 1, 19000, 0);
    return m;
}

Test(planner, tail_auto_mean_and_mem_rules)
{
    log_to_file();
    mfsdp_manifest_t *m = tm_bias_model();
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 8, &o, &p), MFSDP_OK);
    cr_assert_geq(p->shards[8].owner, 0, "bias stays whole");
    cr_assert_eq(p->shards[8].arena_bytes, 19000 * 18);
    mfsdp_plan_destroy(p);
    /* Whole it costs 342000 B > 250000 B; its slice (2375 * 18 = 42750 B) plus one matrix
     * (160000 B) fits: auto shards it. */
    o.mem_limit = 250000;
    cr_assert_eq(mfsdp_plan_create(m, 8, &o, &p), MFSDP_OK);
    cr_assert_eq(p->shards[8].owner, MFSDP_OWNER_SHARDED);
    for (int r = 0; r < 8; r++) {
        cr_assert_eq(p->ranks[r].arena_bytes, 160000 + 42750);
    }
    mfsdp_plan_destroy(p);
    /* Tail policy owner with the same limit cannot place it. */
    o.tail = MFSDP_TAIL_OWNER;
    cr_assert_eq(mfsdp_plan_create(m, 8, &o, &p), MFSDP_ERR_MEM_LIMIT);
    cr_assert_not_null(strstr(log_read(), "tensor bias needs 342000 arena bytes, over the "
                                          "memory limit of 250000 bytes"),
                       "%s", log_read());
    /* Mean rule: at n = 16, 16 * 38000 > 358000. */
    o.tail = MFSDP_TAIL_AUTO;
    o.mem_limit = 0;
    cr_assert_eq(mfsdp_plan_create(m, 16, &o, &p), MFSDP_OK);
    cr_assert_eq(p->shards[8].owner, MFSDP_OWNER_SHARDED);
    mfsdp_plan_destroy(p);
    tm_free(m);

    /* No Muon matrix at all: every tail tensor is sharded, as plain FSDP does. */
    m = tm_new();
    size_t g = tm_group(m, "g");
    tm_param(m, g, "norm", MFSDP_FLOAT32, 1, 64, 0);
    tm_param(m, g, "embed", MFSDP_FLOAT32, 2, 64, 8);
    cr_assert_eq(mfsdp_plan_create(m, 4, &o, &p), MFSDP_OK);
    cr_assert_eq(p->shards[0].owner, MFSDP_OWNER_SHARDED);
    cr_assert_eq(p->shards[1].owner, MFSDP_OWNER_SHARDED);
    cr_assert_eq(p->lb_bytes, 0.0);
    for (int r = 0; r < 4; r++) {
        cr_assert_eq(p->ranks[r].nowned, 0);
        cr_assert_eq(p->ranks[r].tail_elems, 16 + 16 * 8);
    }
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* ---- small and edge cases ------------------------------------------------------------- */

Test(planner, fewer_matrices_than_ranks)
{
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    tm_param(m, g, "a.weight", MFSDP_FLOAT32, 2, 64, 32);
    tm_param(m, g, "b.weight", MFSDP_FLOAT32, 2, 32, 32);
    tm_param(m, g, "c.weight", MFSDP_FLOAT32, 2, 16, 48);
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 8, NULL, &p), MFSDP_OK);
    check_plan_invariants(p, 1);
    int empty = 0;
    for (int r = 0; r < 8; r++) {
        cr_assert_leq(p->ranks[r].nowned, 1);
        empty += p->ranks[r].nowned == 0;
        if (p->ranks[r].nowned == 0) {
            cr_assert_eq(p->ranks[r].arena_bytes, 0);
            cr_assert_eq(p->ranks[r].ns_flops, 0.0);
        }
    }
    cr_assert_eq(empty, 5);
    /* Largest first, lowest rank on ties: a -> 0, b -> 1, c -> 2. */
    cr_assert_eq(p->shards[0].owner, 0);
    cr_assert_eq(p->shards[1].owner, 1);
    cr_assert_eq(p->shards[2].owner, 2);
    cr_assert_float_eq(p->lb_flops, ref_ns_flops(5, 64, 32), 1e-6);
    cr_assert_float_eq(p->max_flops, p->lb_flops, 1e-6);
    cr_assert_float_eq(p->lb_bytes, 64.0 * 32 * 4, 1e-9);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

Test(planner, empty_manifest_and_world_one)
{
    mfsdp_manifest_t *m = tm_new();
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 4, NULL, &p), MFSDP_OK);
    cr_assert_eq(p->nshards, 0);
    cr_assert_eq(p->lb_flops, 0.0);
    char *js = NULL;
    cr_assert_eq(mfsdp_plan_to_json(p, &js), MFSDP_OK);
    free(js);
    mfsdp_plan_destroy(p);
    tm_free(m);

    /* An empty group between two others keeps group_first consistent. */
    m = tm_new();
    size_t g0 = tm_group(m, "a");
    tm_param(m, g0, "a.weight", MFSDP_FLOAT32, 2, 8, 8);
    tm_group(m, "empty");
    size_t g2 = tm_group(m, "c");
    tm_param(m, g2, "c.weight", MFSDP_FLOAT32, 2, 8, 4);
    cr_assert_eq(mfsdp_plan_create(m, 2, NULL, &p), MFSDP_OK);
    cr_assert_eq(p->nshards, 2);
    cr_assert_eq(p->group_first[0], 0);
    cr_assert_eq(p->group_first[1], 1);
    cr_assert_eq(p->group_first[2], 1);
    cr_assert_eq(p->group_first[3], 2);
    cr_assert_eq(p->shards[1].group, 2);
    check_plan_invariants(p, 1);
    mfsdp_plan_destroy(p);
    tm_free(m);

    m = tm_llama(2, 256, 64, 512);
    cr_assert_eq(mfsdp_plan_create(m, 1, NULL, &p), MFSDP_OK);
    for (size_t k = 0; k < p->nshards; k++) {
        cr_assert_eq(p->shards[k].owner, 0);
    }
    mfsdp_plan_destroy(p);
    tm_free(m);
}

Test(planner, split_flops)
{
    log_to_file();
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    mfsdp_param_desc_t *qkv = tm_param(m, g, "qkv.weight", MFSDP_FLOAT32, 2, 96, 32);
    qkv->nsplit = 3;
    qkv->split = calloc(3, sizeof(int64_t));
    qkv->split[0] = 64;
    qkv->split[1] = 16;
    qkv->split[2] = 16;
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 2, NULL, &p), MFSDP_OK);
    double expect = ref_ns_flops(5, 64, 32) + 2 * ref_ns_flops(5, 16, 32);
    cr_assert_float_eq(p->shards[0].ns_flops, expect, 1e-6);
    mfsdp_plan_destroy(p);
    qkv->split[2] = 15; /* does not sum to 96 */
    cr_assert_eq(mfsdp_plan_create(m, 2, NULL, &p), MFSDP_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(log_read(), "qkv.weight: split blocks must be > 0 and sum to 96"),
                       "%s", log_read());
    tm_free(m);
}

Test(planner, errors)
{
    log_to_file();
    mfsdp_manifest_t *m = tm_llama(2, 256, 64, 512);
    mfsdp_plan_t *p = (mfsdp_plan_t *)0x1;
    cr_assert_eq(mfsdp_plan_create(NULL, 4, NULL, &p), MFSDP_ERR_INVALID_ARG);
    cr_assert_eq(mfsdp_plan_create(m, 0, NULL, &p), MFSDP_ERR_INVALID_ARG);
    mfsdp_plan_opts_t bad_tail = {.tail = (mfsdp_tail_policy_t)7};
    cr_assert_eq(mfsdp_plan_create(m, 4, &bad_tail, &p), MFSDP_ERR_INVALID_ARG);
    cr_assert_eq(p, (mfsdp_plan_t *)0x1, "output written on failure");

    m->world_size = 4;
    cr_assert_eq(mfsdp_plan_create(m, 8, NULL, &p), MFSDP_ERR_MISMATCH);
    cr_assert_not_null(strstr(log_read(), "world size 8 does not match the manifest's "
                                          "world_size 4"),
                       "%s", log_read());
    cr_assert_eq(mfsdp_plan_create(m, 4, NULL, &p), MFSDP_OK);
    mfsdp_plan_destroy(p);
    m->world_size = 0;

    m->groups[0].params[1].shard_dim = 1;
    p = (mfsdp_plan_t *)0x1;
    cr_assert_eq(mfsdp_plan_create(m, 4, NULL, &p), MFSDP_ERR_UNSUPPORTED);
    cr_assert_not_null(strstr(log_read(), "layers.0.self_attn.k_proj.weight: Shard(1)"), "%s",
                       log_read());
    m->groups[0].params[1].shard_dim = 0;

    m->groups[0].params[7].optimizer = MFSDP_ROLE_MUON; /* a 1-D norm */
    cr_assert_eq(mfsdp_plan_create(m, 4, NULL, &p), MFSDP_ERR_INVALID_ARG);
    m->groups[0].params[7].optimizer = MFSDP_ROLE_ADAMW;
    cr_assert_eq(p, (mfsdp_plan_t *)0x1);
    cr_assert_eq(mfsdp_plan_to_json(NULL, NULL), MFSDP_ERR_INVALID_ARG);
    tm_free(m);
}

Test(planner, matrix_over_mem_limit)
{
    log_to_file();
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    tm_param(m, g, "small.weight", MFSDP_FLOAT32, 2, 16, 16);
    tm_param(m, g, "big.weight", MFSDP_FLOAT32, 2, 256, 128); /* 32768 * 16 B = 524288 */
    mfsdp_plan_opts_t o = {.mem_limit = 500000};
    mfsdp_plan_t *p = (mfsdp_plan_t *)0x1;
    cr_assert_eq(mfsdp_plan_create(m, 4, &o, &p), MFSDP_ERR_MEM_LIMIT);
    cr_assert_eq(p, (mfsdp_plan_t *)0x1);
    const char *log = log_read();
    cr_assert_not_null(strstr(log, "big.weight"), "%s", log);
    cr_assert_not_null(strstr(log, "524288"), "%s", log);
    cr_assert_not_null(strstr(log, "500000"), "%s", log);
    o.mem_limit = 524288;
    cr_assert_eq(mfsdp_plan_create(m, 4, &o, &p), MFSDP_OK);
    for (int r = 0; r < 4; r++) {
        cr_assert_leq(p->ranks[r].arena_bytes, o.mem_limit);
    }
    mfsdp_plan_destroy(p);
    tm_free(m);
}

Test(planner, plan_over_mem_limit)
{
    /* Three equal matrices, each fits, two ranks: 3 * cost > 2 * limit. */
    log_to_file();
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    tm_param(m, g, "a.weight", MFSDP_FLOAT32, 2, 64, 64); /* 4096 * 16 B = 65536 */
    tm_param(m, g, "b.weight", MFSDP_FLOAT32, 2, 64, 64);
    tm_param(m, g, "c.weight", MFSDP_FLOAT32, 2, 64, 64);
    mfsdp_plan_opts_t o = {.mem_limit = 100000, .no_spread = 1};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 2, &o, &p), MFSDP_ERR_MEM_LIMIT);
    cr_assert_not_null(strstr(log_read(), "plan does not fit the memory limit"), "%s", log_read());
    cr_assert_eq(mfsdp_plan_create(m, 3, &o, &p), MFSDP_OK);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(p->ranks[r].nowned, 1);
    }
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* ---- arena accounting by hand --------------------------------------------------------- */

/* Group g: a [4,3] f32 muon, b [5] bf16 adamw, c [2,2] bf16 muon, d [7] f32 adamw. */
static mfsdp_manifest_t *tm_tiny(void)
{
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    m->groups[g].has_reduce_dtype = 1; /* mixed dtypes need one (FSDP2 rule) */
    m->groups[g].reduce_dtype = MFSDP_FLOAT32;
    tm_param(m, g, "a", MFSDP_FLOAT32, 2, 4, 3);
    tm_param(m, g, "b", MFSDP_BFLOAT16, 1, 5, 0);
    tm_param(m, g, "c", MFSDP_BFLOAT16, 2, 2, 2);
    tm_param(m, g, "d", MFSDP_FLOAT32, 1, 7, 0);
    return m;
}

Test(planner, arena_by_hand_sharded_tail)
{
    mfsdp_manifest_t *m = tm_tiny();
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_SHARD};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 2, &o, &p), MFSDP_OK);
    const mfsdp_shard_t *a = &p->shards[0], *b = &p->shards[1], *c = &p->shards[2],
                        *d = &p->shards[3];
    /* NS FLOPs: a: s=3 l=4: 5*(4*9*4 + 2*27) = 990; c: s=l=2: 5*(32 + 16) = 240. */
    cr_assert_eq(a->ns_flops, 990.0);
    cr_assert_eq(c->ns_flops, 240.0);
    cr_assert_eq(b->ns_flops, 0.0);
    /* Geometry (mixed dtypes: byte offsets): a c=2 s=6 at 0; b c=3 s=3 at 24 B;
     * c c=1 s=2 at 30 B; d c=4 s=4 at 34 B. */
    cr_assert_eq(a->fsdp_c, 2);
    cr_assert_eq(a->fsdp_s, 6);
    cr_assert_eq(b->fsdp_c, 3);
    cr_assert_eq(b->fsdp_s, 3);
    cr_assert_eq(b->fsdp_o_bytes, 24);
    cr_assert_eq(b->fsdp_o, 12);
    cr_assert_eq(c->fsdp_o_bytes, 30);
    cr_assert_eq(c->fsdp_o, 15);
    cr_assert_eq(d->fsdp_s, 4);
    cr_assert_eq(d->fsdp_o_bytes, 34);
    cr_assert_eq(b->rows, 5);
    cr_assert_eq(b->cols, 1);
    /* Whole-tensor costs: a 12*(4+4+4+4) = 192, c 4*(4+2+4+4) = 56. */
    cr_assert_eq(a->arena_bytes, 192);
    cr_assert_eq(c->arena_bytes, 56);
    /* Owners: a (larger) -> 0, c -> 1; b and d sharded at tail offsets 0 and 3. */
    cr_assert_eq(a->owner, 0);
    cr_assert_eq(c->owner, 1);
    cr_assert_eq(b->owner, MFSDP_OWNER_SHARDED);
    cr_assert_eq(d->owner, MFSDP_OWNER_SHARDED);
    cr_assert_eq(b->arena_offset, 0);
    cr_assert_eq(d->arena_offset, 3);
    cr_assert_eq(a->arena_offset, 0);
    cr_assert_eq(c->arena_offset, 0);
    /* Tail per rank: 3*(16+2) + 4*(16+4) = 134 B, 7 elements. */
    const mfsdp_rank_plan_t *r0 = &p->ranks[0], *r1 = &p->ranks[1];
    cr_assert_eq(r0->tail_elems, 7);
    size_t e0[MFSDP_ARENA_NCAT] = {19, 19, 19, 12, 7, 7};
    size_t e1[MFSDP_ARENA_NCAT] = {11, 11, 11, 4, 7, 7};
    for (int k = 0; k < MFSDP_ARENA_NCAT; k++) {
        cr_assert_eq(r0->arena_elems[k], e0[k], "rank 0 cat %d", k);
        cr_assert_eq(r1->arena_elems[k], e1[k], "rank 1 cat %d", k);
    }
    cr_assert_eq(r0->arena_bytes, 192 + 134);
    cr_assert_eq(r1->arena_bytes, 56 + 134);
    cr_assert_eq(r0->owned_bytes, 48);
    cr_assert_eq(r1->owned_bytes, 8);
    cr_assert_eq(p->max_arena_bytes, 326);
    /* LB flops = max(1230/2, 990) = 990; LB bytes = max(56/2, 48) = 48. */
    cr_assert_eq(p->lb_flops, 990.0);
    cr_assert_eq(p->lb_bytes, 48.0);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

Test(planner, arena_by_hand_owner_tail)
{
    mfsdp_manifest_t *m = tm_tiny();
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_OWNER};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 1, &o, &p), MFSDP_OK);
    /* Everything on rank 0 in shard order: master offsets a 0, b 12, c 17, d 21;
     * state: momentum a 0, c 12; adam b 0, d 5. */
    size_t off[4] = {0, 12, 17, 21};
    size_t soff[4] = {0, 0, 12, 5};
    for (int k = 0; k < 4; k++) {
        cr_assert_eq(p->shards[k].owner, 0);
        cr_assert_eq(p->shards[k].arena_offset, off[k], "shard %d", k);
        cr_assert_eq(p->shards[k].state_offset, soff[k], "shard %d", k);
    }
    cr_assert_eq(p->shards[1].arena_bytes, 5 * (16 + 2));
    cr_assert_eq(p->shards[3].arena_bytes, 7 * (16 + 4));
    size_t e[MFSDP_ARENA_NCAT] = {28, 28, 28, 16, 12, 12};
    for (int k = 0; k < MFSDP_ARENA_NCAT; k++) {
        cr_assert_eq(p->ranks[0].arena_elems[k], e[k], "cat %d", k);
    }
    cr_assert_eq(p->ranks[0].arena_bytes, 192 + 90 + 56 + 140);
    cr_assert_eq(p->ranks[0].owned_bytes, 48 + 10 + 8 + 28);
    cr_assert_eq(p->ranks[0].nowned, 4);
    cr_assert_eq(p->ranks[0].tail_elems, 0);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

Test(planner, spread_constraint_binds)
{
    /* One group of 4 equal matrices and 4 tiny ones on 2 ranks: cap = ceil(8/2)+1 = 5. With
     * no_spread the plan may pile up; with spread no rank takes more than 5. */
    mfsdp_manifest_t *m = tm_new();
    size_t g = tm_group(m, "g");
    char name[32];
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof(name), "w%d", i);
        tm_param(m, g, name, MFSDP_FLOAT32, 2, i < 4 ? 64 : 2, i < 4 ? 64 : 2);
    }
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 2, NULL, &p), MFSDP_OK);
    check_plan_invariants(p, 1);
    cr_assert_eq(p->ranks[0].nowned + p->ranks[1].nowned, 8);
    mfsdp_plan_destroy(p);
    tm_free(m);
}

/* ---- shipped example manifests (when the parser and the files exist) ----------------- */

typedef struct example_case {
    char model[24]; /* examples/models/<model>.json */
    int n;
    int ref_layers; /* > 0: compare bounds with tm_llama(ref_layers, ...) */
    int bounded;    /* 1: max <= 1.05 LB expected */
} example_case_t;

ParameterizedTestParameters(planner, example_manifests)
{
    static example_case_t cases[] = {
        {"llama3-8b", 8, 32, 1},   {"llama3-8b", 16, 32, 1},   {"llama3-8b", 64, 32, 1},
        {"llama3-70b", 64, 80, 1}, {"llama3-70b", 512, 80, 1}, {"gpt2-124m", 8, 0, 1},
        {"gpt2-124m", 16, 0, 0},   {"gpt2-124m", 64, 0, 1},    {"tiny", 1, 0, 1},
        {"tiny", 3, 0, 1},         {"tiny", 64, 0, 1},
    };
    return cr_make_param_array(example_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(example_case_t *c, planner, example_manifests)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/examples/models/%s.json", MFSDP_SOURCE_ROOT, c->model);
    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    cr_assert_eq(mfsdp_manifest_load(path, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    mfsdp_plan_opts_t o = {.tail = MFSDP_TAIL_AUTO};
    mfsdp_plan_t *p = NULL;
    cr_assert_eq(mfsdp_plan_create(m, c->n, &o, &p), MFSDP_OK);
    check_plan_invariants(p, 1);
    double lbf = p->lb_flops, lbb = p->lb_bytes;
    cr_log_info("%s n=%d: flops max/lb %.4f, owned bytes max/lb %.4f", c->model, c->n,
                lbf > 0 ? p->max_flops / lbf : 0.0,
                lbb > 0 ? (double)p->max_owned_bytes / lbb : 0.0);
    cr_expect_geq(p->max_flops, lbf * (1 - 1e-12));
    cr_expect_geq((double)p->max_owned_bytes, lbb * (1 - 1e-12));
    if (c->bounded) {
        /* (gpt2 at 16 ranks: 36 matrices of equal FLOPs on 16 ranks force 3 on some rank,
         * 1.2x the LB formula; see the report of the planner tests) */
        cr_expect_leq(p->max_flops, 1.05 * lbf);
        cr_expect_leq((double)p->max_owned_bytes, 1.05 * lbb);
    }
    if (c->ref_layers > 0) {
        /* The shipped manifest has the shapes of the C-built one: same bounds. */
        mfsdp_manifest_t *ref = c->ref_layers == 80 ? tm_llama70b() : tm_llama8b();
        mfsdp_plan_t *q = NULL;
        cr_assert_eq(mfsdp_plan_create(ref, c->n, &o, &q), MFSDP_OK);
        cr_expect_eq(p->nshards, q->nshards);
        cr_expect_float_eq(p->lb_flops, q->lb_flops, 1e-9 * q->lb_flops);
        cr_expect_float_eq(p->lb_bytes, q->lb_bytes, 1e-9 * q->lb_bytes);
        mfsdp_plan_destroy(q);
        tm_free(ref);
    }
    mfsdp_plan_destroy(p);
    mfsdp_manifest_free(m);
}
