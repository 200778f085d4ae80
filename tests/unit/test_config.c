/* SPDX-License-Identifier: Apache-2.0 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "mfsdp/types.h"

typedef struct kv {
    const char *k;
    const char *v;
} kv_t;

static const char *table_lookup(const char *name, void *arg)
{
    for (const kv_t *p = arg; p->k != NULL; p++) {
        if (strcmp(p->k, name) == 0) {
            return p->v;
        }
    }
    return NULL;
}

Test(config, defaults)
{
    kv_t none[] = {{NULL, NULL}};
    mfsdp_config_t cfg;
    char err[256];
    cr_assert_eq(mfsdp_config_parse(table_lookup, none, &cfg, err, sizeof(err)), MFSDP_OK);
    /* Unset: the manifest decides (core/settings.c). */
    cr_expect_eq(cfg.accum_steps_set, 0);
    cr_expect_eq(cfg.step_set, 0);
    cr_expect_eq(cfg.tail_set, 0);
    cr_expect_eq(cfg.clip_set, 0);
    cr_expect_eq(cfg.grad_divide_set, 0);
    cr_expect_eq(cfg.record_max, 100000);
    cr_expect_eq(cfg.mem_limit, 0);
    cr_expect_eq(cfg.chain_chunk, (size_t)1 << 20);
    cr_expect_eq(cfg.lr_set, 0);
    cr_expect_eq(cfg.spread, 1);
}

Test(config, values)
{
    kv_t env[] = {{"MFSDP_STEP", "LAZY"},    {"MFSDP_ACCUM_STEPS", "4"},
                  {"MFSDP_MEM_LIMIT", "3G"}, {"MFSDP_CLIP", "1.5"},
                  {"MFSDP_LR", "0.01"},      {"MFSDP_REDUCE_ALGO", "chain"},
                  {"MFSDP_NESTEROV", "off"}, {NULL, NULL}};
    mfsdp_config_t cfg;
    char err[256];
    cr_assert_eq(mfsdp_config_parse(table_lookup, env, &cfg, err, sizeof(err)), MFSDP_OK, "%s",
                 err);
    cr_expect_eq(cfg.step, MFSDP_CFG_STEP_LAZY);
    cr_expect_eq(cfg.accum_steps, 4);
    cr_expect_eq(cfg.mem_limit, (size_t)3 << 30);
    cr_expect_float_eq(cfg.clip, 1.5, 1e-12);
    cr_expect_eq(cfg.lr_set, 1);
    cr_expect_float_eq(cfg.lr, 0.01, 1e-12);
    cr_expect_eq(cfg.reduce_algo, MFSDP_CFG_ALGO_CHAIN);
    cr_expect_eq(cfg.nesterov, 0);
    cr_expect_eq(cfg.nesterov_set, 1);
}

/* Criterion runs each parameter in a fresh process image: no pointers in parameters. */
typedef struct bad_case {
    char name[32];
    char value[32];
    char expect[48]; /* substring of the message */
} bad_case_t;

ParameterizedTestParameters(config, rejects)
{
    static bad_case_t cases[] = {
        {"MFSDP_STEP", "sometimes", "expected one of eager|lazy"},
        {"MFSDP_ACCUM_STEPS", "0", "expected an integer"},
        {"MFSDP_ACCUM_STEPS", "3x", "expected an integer"},
        {"MFSDP_CLIP", "-1", "expected a finite number"},
        {"MFSDP_CLIP", "nan", "expected a finite number"},
        {"MFSDP_MEM_LIMIT", "12Q", "expected a byte count"},
        {"MFSDP_MEM_LIMIT", "-5", "expected a byte count"},
        {"MFSDP_MEM_LIMIT", "99999999999999999999", "expected a byte count"},
        {"MFSDP_TAIL", "middle", "expected one of owner|shard|auto"},
        {"MFSDP_MLOCK", "maybe", "expected a boolean"},
        {"MFSDP_MOMENTUM", "1.5", "expected a finite number"},
        {"MFSDP_DEBUG_SUBSYS", "RUNTIM", "unknown subsystem 'RUNTIM'"},
        {"MFSDP_DEBUG_SUBSYS", "^PLAN,SHMI", "unknown subsystem 'SHMI'"},
        {"MFSDP_COMPANION", "0", "expected one of tag|manifest"},
    };
    return cr_make_param_array(bad_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_case_t *c, config, rejects)
{
    kv_t env[] = {{c->name, c->value}, {NULL, NULL}};
    mfsdp_config_t cfg;
    memset(&cfg, 0x5a, sizeof(cfg));
    mfsdp_config_t before = cfg;
    char err[256];
    cr_assert_eq(mfsdp_config_parse(table_lookup, env, &cfg, err, sizeof(err)), MFSDP_ERR_CONFIG);
    cr_expect(strstr(err, c->name) != NULL, "message names the variable: %s", err);
    cr_expect(strstr(err, c->expect) != NULL, "message says what is accepted: %s", err);
    cr_expect(memcmp(&cfg, &before, sizeof(cfg)) == 0, "output untouched on failure");
}

Test(config, debug_subsys)
{
    unsigned mask = 0;
    cr_expect_eq(mfsdp_log_subsys_parse("runtime,SHIM", &mask, NULL, 0), 0);
    cr_expect_eq(mask, (unsigned)(MFSDP_SUBSYS_RUNTIME | MFSDP_SUBSYS_SHIM));
    cr_expect_eq(mfsdp_log_subsys_parse("^PLAN", &mask, NULL, 0), 0);
    cr_expect_eq(mask, ~(unsigned)MFSDP_SUBSYS_PLAN);
    cr_expect_eq(mfsdp_log_subsys_parse("", &mask, NULL, 0), 0);
    cr_expect_eq(mask, (unsigned)MFSDP_SUBSYS_ALL);
    char bad[16] = "";
    cr_expect_eq(mfsdp_log_subsys_parse("ALL,TUNR", &mask, bad, sizeof(bad)), -1);
    cr_expect_str_eq(bad, "TUNR");
    kv_t env[] = {{"MFSDP_DEBUG_SUBSYS", "^plan,ckpt"}, {"MFSDP_DEBUG", "VERSION"}, {NULL, NULL}};
    mfsdp_config_t cfg;
    char err[256];
    cr_expect_eq(mfsdp_config_parse(table_lookup, env, &cfg, err, sizeof(err)), MFSDP_OK, "%s",
                 err);
}

/* The process's own environment: an unknown MFSDP_* name fails mfsdp_config_get() itself (the
 * API and the tools, not only the shim), with the closest known name. */
Test(config, unknown_name_fails_get)
{
    setenv("MFSDP_STAGNG_BYTES", "1K", 1);
    const mfsdp_config_t *cfg = NULL;
    cr_assert_eq(mfsdp_config_get(&cfg), MFSDP_ERR_CONFIG);
    cr_expect(strstr(mfsdp_config_error(),
                     "unknown variable MFSDP_STAGNG_BYTES (did you mean MFSDP_STAGING_BYTES?)") !=
                  NULL,
              "%s", mfsdp_config_error());
}

Test(config, script_variables_are_known)
{
    setenv("MFSDP_PERF", "/x/mfsdp-perf", 1);
    setenv("MFSDP_PERF_CORRUPT", "1", 1);
    const mfsdp_config_t *cfg = NULL;
    cr_assert_eq(mfsdp_config_get(&cfg), MFSDP_OK, "%s", mfsdp_config_error());
    cr_expect_str_eq(mfsdp_config_error(), "");
}

Test(config, parse_size)
{
    size_t v = 0;
    cr_expect_eq(mfsdp_parse_size("1024", &v), MFSDP_OK);
    cr_expect_eq(v, 1024);
    cr_expect_eq(mfsdp_parse_size("2k", &v), MFSDP_OK);
    cr_expect_eq(v, 2048);
    cr_expect_eq(mfsdp_parse_size("80GB", &v), MFSDP_OK);
    cr_expect_eq(v, (size_t)80 << 30);
    cr_expect_neq(mfsdp_parse_size("", &v), MFSDP_OK);
    cr_expect_neq(mfsdp_parse_size("G", &v), MFSDP_OK);
    cr_expect_neq(mfsdp_parse_size("17179869184T", &v), MFSDP_OK);
}

Test(status, strings)
{
    cr_expect_str_eq(mfsdp_status_string(MFSDP_OK), "success");
    cr_expect_str_eq(mfsdp_status_string((mfsdp_status_t)-999), "unknown status");
    for (int s = 0; s >= -17; s--) {
        cr_expect_str_neq(mfsdp_status_string((mfsdp_status_t)s), "unknown status");
    }
}

Test(dtype, names_and_sizes)
{
    mfsdp_dtype_t d;
    cr_expect_eq(mfsdp_dtype_parse("bfloat16", &d), MFSDP_OK);
    cr_expect_eq(d, MFSDP_BFLOAT16);
    cr_expect_eq(mfsdp_dtype_size(MFSDP_BFLOAT16), 2);
    cr_expect_eq(mfsdp_dtype_size(MFSDP_FLOAT32), 4);
    cr_expect_eq(mfsdp_dtype_size((mfsdp_dtype_t)42), 0);
    cr_expect_neq(mfsdp_dtype_parse("float64", &d), MFSDP_OK);
    cr_expect_str_eq(mfsdp_dtype_name(MFSDP_FLOAT16), "float16");
}
