/* SPDX-License-Identifier: Apache-2.0 */
/*
 * core/settings.c: the rules that decide what an owner's gradient and learning rate are.
 * Expected values are computed by hand (or by the loops quoted in the comments, the ones of
 * FSDP2's _get_gradient_divide_factors and torchtitan's linear_warmup_stable_decay), not by
 * calling the code under test.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <string.h>

#include "core/settings.h"

/* FSDP2: pre = 1; while f % pre == 0 and f / pre > pre: pre *= 2. */
typedef struct pre_case {
    int dp;
    double pre;
} pre_case_t;

ParameterizedTestParameters(settings, fsdp2_predivide)
{
    static pre_case_t cases[] = {
        {1, 1.0},  {2, 2.0},  {3, 2.0},  {4, 2.0},  {6, 4.0},   {8, 4.0},
        {12, 4.0}, {16, 4.0}, {32, 8.0}, {64, 8.0}, {96, 16.0}, {1024, 32.0},
    };
    return cr_make_param_array(pre_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(pre_case_t *c, settings, fsdp2_predivide)
{
    cr_expect_eq(mfsdp_fsdp2_predivide((double)c->dp), c->pre, "dp %d: got %g, want %g", c->dp,
                 mfsdp_fsdp2_predivide((double)c->dp), c->pre);
}

/* Strings are held in the struct: Criterion runs each parameter in a fresh process image,
 * where a pointer into the parent's static data would not be valid. */
typedef struct div_case {
    char what[48];
    mfsdp_divide_rule_t rule;
    double factor;
    mfsdp_dtype_t dtype;
    int dp;
    mfsdp_redop_t wire;
    double wire_scalar;
    mfsdp_status_t st;
    double post;     /* on success */
    char needle[48]; /* on failure: part of the message */
} div_case_t;

ParameterizedTestParameters(settings, divide_resolve)
{
    static div_case_t cases[] = {
        {"fsdp2 fp32 avg", MFSDP_DIVIDE_FSDP2, 0, MFSDP_FLOAT32, 4, MFSDP_OP_AVG, 1, MFSDP_OK, 1,
         ""},
        {"fsdp2 bf16 premulsum", MFSDP_DIVIDE_FSDP2, 0, MFSDP_BFLOAT16, 4, MFSDP_OP_PREMULSUM, 0.25,
         MFSDP_OK, 1, ""},
        /* fp16: the job pre-divided by 4 (dp 6), the owner post-divides by 6 / 4. */
        {"fsdp2 fp16 sum dp 6", MFSDP_DIVIDE_FSDP2, 0, MFSDP_FLOAT16, 6, MFSDP_OP_SUM, 1, MFSDP_OK,
         1.5, ""},
        {"fsdp2 fp16 sum dp 8", MFSDP_DIVIDE_FSDP2, 0, MFSDP_FLOAT16, 8, MFSDP_OP_SUM, 1, MFSDP_OK,
         2, ""},
        {"fsdp2 fp32 sum dp 1", MFSDP_DIVIDE_FSDP2, 0, MFSDP_FLOAT32, 1, MFSDP_OP_SUM, 1, MFSDP_OK,
         1, ""},
        /* A sum that FSDP2 would only issue under force_sum: the factor is unknown. */
        {"fsdp2 fp32 sum dp 4", MFSDP_DIVIDE_FSDP2, 0, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 1,
         MFSDP_ERR_UNSUPPORTED, 0, "force_sum"},
        {"fsdp2 bf16 sum dp 2", MFSDP_DIVIDE_FSDP2, 0, MFSDP_BFLOAT16, 2, MFSDP_OP_SUM, 1,
         MFSDP_ERR_UNSUPPORTED, 0, "MFSDP_GRAD_DIVIDE"},
        {"force_sum fp32 dp 4", MFSDP_DIVIDE_FORCE_SUM, 0, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 1,
         MFSDP_OK, 4, ""},
        {"force_sum fp16 dp 8", MFSDP_DIVIDE_FORCE_SUM, 0, MFSDP_FLOAT16, 8, MFSDP_OP_SUM, 1,
         MFSDP_OK, 2, ""},
        {"force_sum with avg", MFSDP_DIVIDE_FORCE_SUM, 0, MFSDP_FLOAT32, 4, MFSDP_OP_AVG, 1,
         MFSDP_ERR_UNSUPPORTED, 0, "expects reduce-scatters with op sum"},
        {"world dp 3", MFSDP_DIVIDE_WORLD, 0, MFSDP_BFLOAT16, 3, MFSDP_OP_SUM, 1, MFSDP_OK, 3, ""},
        {"world with premulsum", MFSDP_DIVIDE_WORLD, 0, MFSDP_FLOAT32, 3, MFSDP_OP_PREMULSUM, 0.5,
         MFSDP_ERR_UNSUPPORTED, 0, "premulsum"},
        {"factor 6", MFSDP_DIVIDE_FACTOR, 6, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 1, MFSDP_OK, 6, ""},
        {"factor 0", MFSDP_DIVIDE_FACTOR, 0, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 1,
         MFSDP_ERR_UNSUPPORTED, 0, "expected a finite number > 0"},
        {"factor nan", MFSDP_DIVIDE_FACTOR, NAN, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 1,
         MFSDP_ERR_UNSUPPORTED, 0, "expected a finite number > 0"},
    };
    return cr_make_param_array(div_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(div_case_t *c, settings, divide_resolve)
{
    mfsdp_redop_t op = (mfsdp_redop_t)-1;
    double scalar = -1, post = -1;
    char err[512] = "";
    mfsdp_status_t st = mfsdp_divide_resolve(c->rule, c->factor, c->dtype, c->dp, c->wire,
                                             c->wire_scalar, &op, &scalar, &post, err, sizeof(err));
    cr_assert_eq(st, c->st, "%s: status %d, want %d (%s)", c->what, st, c->st, err);
    if (st != MFSDP_OK) {
        cr_expect(strstr(err, c->needle) != NULL, "%s: message '%s' lacks '%s'", c->what, err,
                  c->needle);
        /* Outputs are written only on success. */
        cr_expect_eq(post, -1.0, "%s: post written on failure", c->what);
        return;
    }
    cr_expect_eq(op, c->wire, "%s: the op applied is the wire's", c->what);
    cr_expect_eq(scalar, c->wire == MFSDP_OP_PREMULSUM ? c->wire_scalar : 1.0, "%s: scalar %g",
                 c->what, scalar);
    cr_expect_eq(post, c->post, "%s: post %g, want %g", c->what, post, c->post);
}

Test(settings, divide_fold)
{
    mfsdp_redop_t op = MFSDP_OP_SUM;
    double s = 1.0;
    mfsdp_divide_fold(4, 4.0, &op, &s); /* sum / world = avg */
    cr_expect_eq(op, MFSDP_OP_AVG);
    op = MFSDP_OP_SUM;
    s = 1.0;
    mfsdp_divide_fold(4, 2.0, &op, &s); /* sum / 2 = premulsum 0.5 */
    cr_expect_eq(op, MFSDP_OP_PREMULSUM);
    cr_expect_eq(s, 0.5);
    op = MFSDP_OP_PREMULSUM;
    s = 0.25;
    mfsdp_divide_fold(4, 1.0, &op, &s); /* nothing to fold */
    cr_expect_eq(op, MFSDP_OP_PREMULSUM);
    cr_expect_eq(s, 0.25);
}

/* torchtitan: t < W: (t+1)/(W+1); t < W+S: 1; else p = (t+1-W-S)/(D+1),
 * factor = m + (1-m) * shape(p) with linear 1-p, cosine (1+cos(pi p))/2, sqrt 1-sqrt(p). */
Test(settings, schedule_factor)
{
    mfsdp_schedule_t cos_s = {.kind = MFSDP_SCHEDULE_WARMUP_COSINE,
                              .warmup_steps = 2,
                              .decay_steps = 3,
                              .decay = MFSDP_DECAY_COSINE,
                              .min_lr_ratio = 0.1};
    const double want_cos[] = {1.0 / 3.0,
                               2.0 / 3.0,
                               0.1 + 0.9 * 0.5 * (1.0 + cos(M_PI * 0.25)),
                               0.1 + 0.9 * 0.5 * (1.0 + cos(M_PI * 0.5)),
                               0.1 + 0.9 * 0.5 * (1.0 + cos(M_PI * 0.75)),
                               0.1,
                               0.1};
    for (int t = 0; t < 7; t++) {
        cr_expect(fabs(mfsdp_schedule_factor(&cos_s, t) - want_cos[t]) < 1e-15,
                  "cosine t=%d: %.17g vs %.17g", t, mfsdp_schedule_factor(&cos_s, t), want_cos[t]);
    }
    cr_expect_eq(mfsdp_schedule_factor(&cos_s, 1000), 0.1, "past the end: the last factor");

    mfsdp_schedule_t wsd = {.kind = MFSDP_SCHEDULE_WSD,
                            .warmup_steps = 1,
                            .stable_steps = 2,
                            .decay_steps = 3,
                            .decay = MFSDP_DECAY_SQRT,
                            .min_lr_ratio = 0.0};
    const double want_wsd[] = {0.5, 1.0, 1.0, 1.0 - sqrt(0.25), 1.0 - sqrt(0.5), 1.0 - sqrt(0.75),
                               0.0};
    for (int t = 0; t < 7; t++) {
        cr_expect(fabs(mfsdp_schedule_factor(&wsd, t) - want_wsd[t]) < 1e-15,
                  "wsd t=%d: %.17g vs %.17g", t, mfsdp_schedule_factor(&wsd, t), want_wsd[t]);
    }

    mfsdp_schedule_t lin = {.kind = MFSDP_SCHEDULE_WARMUP_LINEAR,
                            .warmup_steps = 0,
                            .decay_steps = 4,
                            .decay = MFSDP_DECAY_LINEAR};
    const double want_lin[] = {0.8, 0.6, 0.4, 0.2, 0.0};
    for (int t = 0; t < 5; t++) {
        cr_expect(fabs(mfsdp_schedule_factor(&lin, t) - want_lin[t]) < 1e-15,
                  "linear t=%d: %.17g vs %.17g", t, mfsdp_schedule_factor(&lin, t), want_lin[t]);
    }
    mfsdp_schedule_t constant = {.kind = MFSDP_SCHEDULE_CONSTANT};
    cr_expect_eq(mfsdp_schedule_factor(&constant, 17), 1.0);
    cr_expect_eq(mfsdp_schedule_factor(NULL, 3), 1.0);
}

Test(settings, schedule_parse)
{
    mfsdp_schedule_t s;
    char err[512];
    cr_assert_eq(mfsdp_schedule_parse("wsd,warmup=10,stable=20,decay=30,min=0.1,shape=sqrt", &s,
                                      err, sizeof(err)),
                 MFSDP_OK, "%s", err);
    cr_expect_eq(s.kind, MFSDP_SCHEDULE_WSD);
    cr_expect_eq(s.warmup_steps, 10);
    cr_expect_eq(s.stable_steps, 20);
    cr_expect_eq(s.decay_steps, 30);
    cr_expect_eq(s.decay, MFSDP_DECAY_SQRT);
    cr_expect_eq(s.min_lr_ratio, 0.1);
    cr_assert_eq(mfsdp_schedule_parse("warmup-cosine,warmup=5,decay=100", &s, err, sizeof(err)),
                 MFSDP_OK, "%s", err);
    cr_expect_eq(s.decay, MFSDP_DECAY_COSINE);
    cr_expect_eq(s.stable_steps, 0);

    static const char *bad[] = {
        "cosine",                      /* unknown kind */
        "warmup-linear,warmup=-1",     /* negative */
        "warmup-linear,stable=3",      /* stable only with wsd */
        "warmup-cosine,shape=sqrt",    /* shape only with wsd */
        "wsd,min=1.5",                 /* min outside [0, 1] */
        "wsd,warmup",                  /* no value */
        "constant,warmup=3",           /* a constant schedule takes none */
        "warmup-linear,decay=3,foo=1", /* unknown item */
        "wsd,warmup=5,warmup=7",       /* an item given twice: not the last one silently */
        "wsd,decay=10,shape=cosine,shape=sqrt",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        memset(&s, 0x5a, sizeof(s));
        mfsdp_schedule_t before = s;
        cr_expect_eq(mfsdp_schedule_parse(bad[i], &s, err, sizeof(err)), MFSDP_ERR_CONFIG,
                     "'%s' accepted", bad[i]);
        cr_expect(strstr(err, "MFSDP_LR_SCHEDULE") != NULL, "'%s': message '%s'", bad[i], err);
        cr_expect(memcmp(&s, &before, sizeof(s)) == 0, "'%s': output written on failure", bad[i]);
    }
}

static const char *one_var(const char *name, void *arg)
{
    const char *const *kv = arg;
    return strcmp(name, kv[0]) == 0 ? kv[1] : NULL;
}

/* MFSDP_MOMENTUM follows the manifest's rule, [0, 1): a momentum of 1 never decays. */
Test(settings, momentum_below_one)
{
    static const char json[] = "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\", "
                               "\"params\": [{\"name\": \"w\", \"shape\": [4, 4], \"dtype\": "
                               "\"float32\"}]}]}";
    mfsdp_manifest_t *m = NULL;
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "m", NULL, 0, &m), MFSDP_OK);
    const char *kv[2] = {"MFSDP_MOMENTUM", "1"};
    mfsdp_config_t cfg;
    char err[512] = "";
    cr_assert_eq(mfsdp_config_parse(one_var, kv, &cfg, err, sizeof(err)), MFSDP_OK, "%s", err);
    mfsdp_settings_t s;
    cr_expect_eq(mfsdp_settings_resolve(m, &cfg, &s, err, sizeof(err)), MFSDP_ERR_CONFIG);
    cr_expect(strstr(err, "MFSDP_MOMENTUM=1: expected a number in [0, 1)") != NULL, "%s", err);
    kv[1] = "0.9";
    cr_assert_eq(mfsdp_config_parse(one_var, kv, &cfg, err, sizeof(err)), MFSDP_OK, "%s", err);
    cr_expect_eq(mfsdp_settings_resolve(m, &cfg, &s, err, sizeof(err)), MFSDP_OK, "%s", err);
    cr_expect_float_eq(s.hp.momentum, 0.9f, 1e-6);
    mfsdp_manifest_free(m);
}
