/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The mfsdp-manifest/1 parser and writer (core/manifest.c): every rejection checked by
 * status and by message (origin, JSON path, what was expected), defaults and the optimizer
 * rule, a canonical round trip through mfsdp_manifest_to_json, and the shipped models
 * checked against their published parameter counts.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "mfsdp/manifest.h"
#include "tests/lib/manifest_compare.h"

#define MODELS_DIR MFSDP_SOURCE_ROOT "/examples/models"

/* A pointer no test result can be: outputs must be left alone on failure. */
#define POISON ((mfsdp_manifest_t *)(uintptr_t)0x5a5a5a5a)

/* Test JSON is written with ' for " (no test needs a literal apostrophe). */
static void dq(char *dst, const char *src, size_t n)
{
    size_t i = 0;
    for (; src[i] != '\0' && i + 1 < n; i++) {
        dst[i] = src[i] == '\'' ? '"' : src[i];
    }
    dst[i] = '\0';
}

static void quiet(void)
{
    setenv("MFSDP_DEBUG", "NONE", 1);
    mfsdp_log_reinit();
}

/* Parse text written with single quotes; asserts success. */
static mfsdp_manifest_t *parse_ok(const char *sq)
{
    static char text[8192];
    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    dq(text, sq, sizeof(text));
    mfsdp_status_t st = mfsdp_manifest_parse(text, strlen(text), "good.json", err, sizeof(err), &m);
    cr_assert_eq(st, MFSDP_OK, "parse failed (%s): %s\n%s", mfsdp_status_string(st), err, text);
    cr_assert_not_null(m);
    return m;
}

static const mfsdp_param_desc_t *find_param(const mfsdp_manifest_t *m, const char *name)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t p = 0; p < m->groups[g].nparams; p++) {
            if (strcmp(m->groups[g].params[p].name, name) == 0) {
                return &m->groups[g].params[p];
            }
        }
    }
    cr_assert_fail("no param %s", name);
    return NULL;
}

/* ---- rejections ------------------------------------------------------------------------ */

typedef struct bad_case {
    char json[700];
    int status;
    char expect[200]; /* substring of the message, with ' for " */
} bad_case_t;

#define HEAD "{'format':'mfsdp-manifest/1',"
#define W    "{'name':'w','shape':[4,3],'dtype':'float32'}"
#define W1   "{'name':'b','shape':[4],'dtype':'float32'}"
/* One group "g" holding params. */
#define ONE(params) HEAD "'groups':[{'name':'g','params':[" params "]}]}"
/* Param "w" (4x3 float32) with extra keys. */
#define PW(extra)     ONE("{'name':'w','shape':[4,3],'dtype':'float32'" extra "}")
#define PB(extra)     ONE("{'name':'b','shape':[4],'dtype':'float32'" extra "}")
#define PSHAPE(shape) ONE("{'name':'w','shape':" shape ",'dtype':'float32'}")
#define OPT(o)        HEAD "'optimizer':{" o "},'groups':[{'name':'g','params':[" W "]}]}"
#define ADAMW(o)      OPT("'adamw':{" o "}")
#define GRP(extra)    HEAD "'groups':[{'name':'g'" extra ",'params':[" W "]}]}"
#define TOP(extra)    HEAD extra "'groups':[{'name':'g','params':[" W "]}]}"
#define SEQ(s)        TOP("'sequence':" s ",")
#define SCHED(o)      OPT("'schedule':{" o "}")
#define TRAIN(o)      TOP("'training':{" o "},")
#define ITER(o)       TOP("'iteration':{" o "},")
#define E(msg)        "model.json: " msg

#define PARSE    MFSDP_ERR_PARSE
#define OVERFLOW MFSDP_ERR_OVERFLOW
#define UNSUP    MFSDP_ERR_UNSUPPORTED

ParameterizedTestParameters(manifest, rejects)
{
    static bad_case_t cases[] = {
        /* not JSON: jansson's position is reported */
        {"{'format': ", PARSE, E("line 1, column 11: not valid JSON: ")},
        {"{'format':'mfsdp-manifest/1',\n 'groups': [}\n", PARSE,
         E("line 2, column 13: not valid JSON: ")},
        {"", PARSE, E("line 1, column 0: not valid JSON: ")},
        {"{} trailing", PARSE, "not valid JSON: end of file expected"},
        {"{'format':'mfsdp-manifest/1','format':'mfsdp-manifest/1'}", PARSE,
         "not valid JSON: duplicate object key"},
        {PSHAPE("[99999999999999999999]"), PARSE, "not valid JSON: too big integer"},
        {ONE("{'name':'a\\u0000b','shape':[4],'dtype':'float32'}"), PARSE,
         "column 79: not valid JSON: \\u0000 is not allowed"},
        {"[1, 2]", PARSE, E("top level: expected an object, got an array")},
        /* format */
        {"{'groups':[]}", PARSE, E("format: missing, expected 'mfsdp-manifest/1'")},
        {"{'format':1}", PARSE, E("format: expected 'mfsdp-manifest/1', got an integer")},
        {"{'format':'fsdp'}", PARSE, E("format: expected 'mfsdp-manifest/1', got 'fsdp'")},
        {"{'format':'mfsdp-manifest/2','layers':[]}", UNSUP,
         E("format: expected 'mfsdp-manifest/1', got 'mfsdp-manifest/2' (unsupported version)")},
        /* unknown keys everywhere, shown safely */
        {TOP("'colour':'red',"), PARSE,
         E("colour: unknown key (expected one of format|world_size|replicate|optimizer|training|"
           "iteration|groups|sequence)")},
        {TOP("'a\\nb':1,"), PARSE, E("a?b: unknown key")},
        {TOP("'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa':"
             "1,"),
         PARSE, E("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...: unknown key")},
        {GRP(",'lr':1"), PARSE,
         E("groups[0].lr: unknown key (expected one of name|reduce_dtype|lr_scale|weight_decay|"
           "params)")},
        {PW(",'bias':true"), PARSE,
         E("groups[0].params[0].bias: unknown key (expected one of name|shape|dtype|optimizer|"
           "requires_grad|split|shard_dim)")},
        {OPT("'beta':0.9"), PARSE, E("optimizer.beta: unknown key")},
        {ADAMW("'beta1':0.9"), PARSE,
         E("optimizer.adamw.beta1: unknown key (expected one of lr|betas|eps|weight_decay)")},
        /* world_size */
        {TOP("'world_size':0,"), PARSE, E("world_size: expected an integer >= 1, got 0")},
        {TOP("'world_size':-4,"), PARSE, E("world_size: expected an integer >= 1, got -4")},
        {TOP("'world_size':'4',"), PARSE, E("world_size: expected an integer >= 1, got a string")},
        {TOP("'world_size':4.0,"), PARSE,
         E("world_size: expected an integer >= 1, got a real number")},
        {TOP("'world_size':2147483648,"), PARSE,
         E("world_size: expected an integer >= 1, got 2147483648")},
        /* groups */
        {HEAD "'sequence':[]}", PARSE,
         E("groups: missing, expected a non-empty array of group objects")},
        {HEAD "'groups':[]}", PARSE,
         E("groups: expected a non-empty array of group objects, got an empty array")},
        {HEAD "'groups':{}}", PARSE,
         E("groups: expected a non-empty array of group objects, got an object")},
        {HEAD "'groups':['g']}", PARSE, E("groups[0]: expected an object, got a string")},
        {HEAD "'groups':[{'params':[" W "]}]}", PARSE,
         E("groups[0].name: missing, expected a non-empty string")},
        {HEAD "'groups':[{'name':'','params':[" W "]}]}", PARSE,
         E("groups[0].name: expected a non-empty string, got ''")},
        {HEAD "'groups':[{'name':7,'params':[" W "]}]}", PARSE,
         E("groups[0].name: expected a non-empty string, got an integer")},
        {HEAD "'groups':[{'name':'g','params':[" W "]},{'name':'g','params':[" W1 "]}]}", PARSE,
         E("groups[1].name: duplicate group name 'g' (first at groups[0])")},
        {HEAD "'groups':[{'name':'g','params':[]}]}", PARSE,
         E("groups[0].params: expected a non-empty array of param objects, got an empty array")},
        {HEAD "'groups':[{'name':'g'}]}", PARSE,
         E("groups[0].params: missing, expected a non-empty array of param objects")},
        {HEAD "'groups':[{'name':'g','params':[7]}]}", PARSE,
         E("groups[0].params[0]: expected an object, got an integer")},
        {GRP(",'reduce_dtype':'uint8'"), PARSE,
         E("groups[0].reduce_dtype: unknown dtype 'uint8' (expected one of "
           "float32|bfloat16|float16)")},
        {GRP(",'reduce_dtype':null"), PARSE,
         E("groups[0].reduce_dtype: expected one of float32|bfloat16|float16, got null")},
        {GRP(",'lr_scale':-1"), PARSE, E("groups[0].lr_scale: expected a number >= 0, got -1")},
        {GRP(",'weight_decay':'0.1'"), PARSE,
         E("groups[0].weight_decay: expected a number >= 0, got a string")},
        {GRP(",'weight_decay':-0.5"), PARSE,
         E("groups[0].weight_decay: expected a number >= 0, got -0.5")},
        /* the brief's example: the path counts groups and params from 0 */
        {HEAD "'groups':[{'name':'a','params':[{'name':'a0','shape':[1],'dtype':'float32'}]},"
              "{'name':'b','params':[{'name':'b0','shape':[1],'dtype':'float32'}]},"
              "{'name':'c','params':[{'name':'c0','shape':[1],'dtype':'float32'}]},"
              "{'name':'d','params':[{'name':'d0','shape':[1],'dtype':'float32'},"
              "{'name':'d1','shape':[1],'dtype':'float32'},"
              "{'name':'d2','shape':[],'dtype':'float32'}]}]}",
         PARSE, E("groups[3].params[2].shape: expected a non-empty array of positive integers")},
        /* param names */
        {ONE("{'shape':[4],'dtype':'float32'}"), PARSE,
         E("groups[0].params[0].name: missing, expected a non-empty string")},
        {ONE("{'name':['w'],'shape':[4],'dtype':'float32'}"), PARSE,
         E("groups[0].params[0].name: expected a non-empty string, got an array")},
        {ONE(W "," W1 "," W), PARSE,
         E("groups[0].params[2].name: duplicate param name 'w' (first at groups[0].params[0])")},
        {HEAD "'groups':[{'name':'g','params':[" W "]},{'name':'h','params':[" W1 "," W "]}]}",
         PARSE,
         E("groups[1].params[1].name: duplicate param name 'w' (first at groups[0].params[0])")},
        /* shapes */
        {ONE("{'name':'w','dtype':'float32'}"), PARSE,
         E("groups[0].params[0].shape: missing, expected a non-empty array of positive integers")},
        {PSHAPE("[]"), PARSE,
         E("groups[0].params[0].shape: expected a non-empty array of positive integers, got an "
           "empty array")},
        {PSHAPE("'4x3'"), PARSE,
         E("groups[0].params[0].shape: expected a non-empty array of positive integers, got a "
           "string")},
        {PSHAPE("[4,-3]"), PARSE,
         E("groups[0].params[0].shape[1]: expected a positive integer, got -3")},
        {PSHAPE("[0]"), PARSE,
         E("groups[0].params[0].shape[0]: expected a positive integer, got 0")},
        {PSHAPE("[4.0,3]"), PARSE,
         E("groups[0].params[0].shape[0]: expected a positive integer, got a real number")},
        {PSHAPE("[4,3.5]"), PARSE,
         E("groups[0].params[0].shape[1]: expected a positive integer, got a real number")},
        {PSHAPE("[true]"), PARSE,
         E("groups[0].params[0].shape[0]: expected a positive integer, got true")},
        {PSHAPE("[1,1,1,1,1,1,1,1,1]"), UNSUP,
         E("groups[0].params[0].shape: expected at most 8 dims, got 9")},
        {PSHAPE("[4294967296,4294967296]"), OVERFLOW,
         E("groups[0].params[0].shape: the number of elements overflows int64")},
        {PSHAPE("[3037000500,3037000500]"), OVERFLOW,
         E("groups[0].params[0].shape: the number of elements overflows int64")},
        {PSHAPE("[1152921504606846976]"), OVERFLOW,
         E("groups[0].params[0].shape: 1152921504606846976 elements * 8 bytes overflows int64")},
        {PSHAPE("[1073741824,1073741824,2]"), OVERFLOW,
         E("groups[0].params[0].shape: 2305843009213693952 elements * 8 bytes overflows int64")},
        {PSHAPE("[1073741824,1073741824,1073741824,1073741824]"), OVERFLOW,
         E("groups[0].params[0].shape: the number of elements overflows int64")},
        {PSHAPE("[576460752303423488,2]"), OVERFLOW,
         E("groups[0].params[0].shape: 1152921504606846976 elements * 8 bytes")},
        /* dtypes */
        {ONE("{'name':'w','shape':[4]}"), PARSE,
         E("groups[0].params[0].dtype: missing, expected one of float32|bfloat16|float16")},
        {PW(",'dtype':'float32'"), PARSE, "not valid JSON: duplicate object key"},
        {ONE("{'name':'w','shape':[4],'dtype':'float64'}"), PARSE,
         E("groups[0].params[0].dtype: unknown dtype 'float64' (expected one of "
           "float32|bfloat16|float16)")},
        {ONE("{'name':'w','shape':[4],'dtype':'uint8'}"), PARSE,
         E("groups[0].params[0].dtype: unknown dtype 'uint8'")},
        {ONE("{'name':'w','shape':[4],'dtype':32}"), PARSE,
         E("groups[0].params[0].dtype: expected one of float32|bfloat16|float16, got an integer")},
        /* optimizer choice */
        {PW(",'optimizer':'sgd'"), PARSE,
         E("groups[0].params[0].optimizer: expected 'muon' or 'adamw', got 'sgd'")},
        {PW(",'optimizer':1"), PARSE,
         E("groups[0].params[0].optimizer: expected 'muon' or 'adamw', got an integer")},
        {PB(",'optimizer':'muon'"), PARSE,
         E("groups[0].params[0].optimizer: muon needs a parameter of 2 or more dims")},
        /* requires_grad */
        {PW(",'requires_grad':'yes'"), PARSE,
         E("groups[0].params[0].requires_grad: expected true or false, got a string")},
        {PW(",'requires_grad':1"), PARSE,
         E("groups[0].params[0].requires_grad: expected true or false, got an integer")},
        /* split */
        {PB(",'split':[2,2]"), PARSE,
         E("groups[0].params[0].split: a split needs a parameter of 2 or more dims")},
        {PW(",'split':[2,1]"), PARSE,
         E("groups[0].params[0].split: entries must sum to shape[0] = 4, they sum to 3")},
        {PW(",'split':[2,3]"), PARSE,
         E("groups[0].params[0].split: entries must sum to shape[0] = 4, they sum to 5")},
        {PW(",'split':[4,0]"), PARSE,
         E("groups[0].params[0].split[1]: expected a positive integer, got 0")},
        {PW(",'split':[5,-1]"), PARSE,
         E("groups[0].params[0].split[1]: expected a positive integer, got -1")},
        {PW(",'split':[2.0,2]"), PARSE,
         E("groups[0].params[0].split[0]: expected a positive integer, got a real number")},
        {PW(",'split':[]"), PARSE,
         E("groups[0].params[0].split: expected a non-empty array of positive integers")},
        {PW(",'split':4"), PARSE,
         E("groups[0].params[0].split: expected a non-empty array of positive integers")},
        {PW(",'split':[9223372036854775807,9223372036854775807]"), PARSE,
         "params[0].split: entries must sum to shape[0] = 4, they sum to 9223372036854775807 or "
         "more"},
        {PW(",'optimizer':'adamw','split':[2,2]"), PARSE,
         E("groups[0].params[0].split: a split only applies to muon params")},
        {ONE("{'name':'embed.weight','shape':[4,3],'dtype':'float32','split':[2,2]}"), PARSE,
         E("groups[0].params[0].split: a split only applies to muon params")},
        /* shard_dim */
        {PW(",'shard_dim':-1"), PARSE,
         E("groups[0].params[0].shard_dim: expected an integer in [0, 1], got -1")},
        {PW(",'shard_dim':2"), PARSE,
         E("groups[0].params[0].shard_dim: expected an integer in [0, 1], got 2")},
        {PB(",'shard_dim':1"), PARSE,
         E("groups[0].params[0].shard_dim: expected an integer in [0, 0], got 1")},
        {PW(",'shard_dim':1.0"), PARSE,
         E("groups[0].params[0].shard_dim: expected an integer in [0, 1], got a real number")},
        /* optimizer hyper-parameters */
        {TOP("'optimizer':[],"), PARSE, E("optimizer: expected an object, got an array")},
        {OPT("'lr':-0.1"), PARSE, E("optimizer.lr: expected a number >= 0, got -0.1")},
        {OPT("'lr':'0.02'"), PARSE, E("optimizer.lr: expected a number >= 0, got a string")},
        {OPT("'momentum':1"), PARSE, E("optimizer.momentum: expected a number in [0, 1), got 1")},
        {OPT("'momentum':1.5"), PARSE,
         E("optimizer.momentum: expected a number in [0, 1), got 1.5")},
        {OPT("'momentum':-0.5"), PARSE,
         E("optimizer.momentum: expected a number in [0, 1), got -0.5")},
        {OPT("'nesterov':'yes'"), PARSE,
         E("optimizer.nesterov: expected true or false, got a string")},
        {OPT("'nesterov':1"), PARSE,
         E("optimizer.nesterov: expected true or false, got an integer")},
        {OPT("'ns_steps':101"), PARSE,
         E("optimizer.ns_steps: expected an integer in [0, 100], got 101")},
        {OPT("'ns_steps':-1"), PARSE,
         E("optimizer.ns_steps: expected an integer in [0, 100], got -1")},
        {OPT("'ns_steps':5.5"), PARSE,
         E("optimizer.ns_steps: expected an integer in [0, 100], got a real number")},
        {OPT("'weight_decay':-1"), PARSE,
         E("optimizer.weight_decay: expected a number >= 0, got -1")},
        {OPT("'scale':'adam'"), PARSE,
         E("optimizer.scale: expected 'keller' or 'moonlight', got 'adam'")},
        {OPT("'scale':3"), PARSE,
         E("optimizer.scale: expected 'keller' or 'moonlight', got an integer")},
        {OPT("'adamw':0"), PARSE, E("optimizer.adamw: expected an object, got an integer")},
        {ADAMW("'lr':-1"), PARSE, E("optimizer.adamw.lr: expected a number >= 0, got -1")},
        {ADAMW("'betas':[0.9]"), PARSE,
         E("optimizer.adamw.betas: expected an array of two numbers in [0, 1)")},
        {ADAMW("'betas':0.9"), PARSE,
         E("optimizer.adamw.betas: expected an array of two numbers in [0, 1)")},
        {ADAMW("'betas':[0.9,1.0]"), PARSE,
         E("optimizer.adamw.betas[1]: expected a number in [0, 1), got 1")},
        {ADAMW("'betas':[-0.1,0.9]"), PARSE,
         E("optimizer.adamw.betas[0]: expected a number in [0, 1), got -0.1")},
        {ADAMW("'betas':['a',0.9]"), PARSE,
         E("optimizer.adamw.betas[0]: expected a number in [0, 1), got a string")},
        {ADAMW("'eps':0"), PARSE, E("optimizer.adamw.eps: expected a number > 0, got 0")},
        {ADAMW("'eps':-1e-8"), PARSE, E("optimizer.adamw.eps: expected a number > 0, got -1e-08")},
        {ADAMW("'weight_decay':-1"), PARSE,
         E("optimizer.adamw.weight_decay: expected a number >= 0, got -1")},
        {OPT("'lr':1e999"), PARSE, "column 52: not valid JSON: real number overflow"},
        /* sequence */
        {SEQ("{}"), PARSE,
         E("sequence: expected an array of ['allgather'|'reduce_scatter', <group name>], got an "
           "object")},
        {SEQ("['allgather','g']"), PARSE,
         E("sequence[0]: expected ['allgather'|'reduce_scatter', <group name>]")},
        {SEQ("[['allgather','g','g']]"), PARSE, E("sequence[0][2]: expected 'optional', got 'g'")},
        {SEQ("[['allgather','g',1]]"), PARSE,
         E("sequence[0][2]: expected 'optional', got an integer")},
        {SEQ("[['allgather','g','optional','x']]"), PARSE,
         E("sequence[0]: expected ['allgather'|'reduce_scatter', <group name>] or [..., <group "
           "name>, 'optional']")},
        /* replicate, schedule, max_norm, training, iteration */
        {TOP("'replicate':0,"), PARSE, E("replicate: expected an integer >= 1, got 0")},
        {TOP("'replicate':'2',"), PARSE, E("replicate: expected an integer >= 1, got a string")},
        {OPT("'max_norm':-1"), PARSE, E("optimizer.max_norm: expected a number >= 0, got -1")},
        {OPT("'schedule':'cosine'"), PARSE,
         E("optimizer.schedule: expected an object, got a string")},
        {SCHED("'warmup_steps':3"), PARSE,
         E("optimizer.schedule.kind: missing, expected one of constant|warmup-cosine|"
           "warmup-linear|wsd")},
        {SCHED("'kind':'cosine'"), PARSE,
         E("optimizer.schedule.kind: expected one of 'constant'|'warmup-cosine'|'warmup-linear'|"
           "'wsd', got 'cosine'")},
        {SCHED("'kind':'wsd','warmup_steps':-1"), PARSE,
         E("optimizer.schedule.warmup_steps: expected an integer in [0, 2^31), got -1")},
        {SCHED("'kind':'wsd','decay_steps':1.5"), PARSE,
         E("optimizer.schedule.decay_steps: expected an integer in [0, 2^31), got a real")},
        {SCHED("'kind':'warmup-cosine','stable_steps':4"), PARSE,
         E("optimizer.schedule.stable_steps: only a 'wsd' schedule has stable steps")},
        {SCHED("'kind':'warmup-linear','decay':'cosine'"), PARSE,
         E("optimizer.schedule.decay: only a 'wsd' schedule chooses its decay")},
        {SCHED("'kind':'wsd','decay':'exp'"), PARSE,
         E("optimizer.schedule.decay: expected one of 'linear'|'cosine'|'sqrt', got 'exp'")},
        {SCHED("'kind':'wsd','min_lr_ratio':1.5"), PARSE,
         E("optimizer.schedule.min_lr_ratio: expected a number in [0, 1], got 1.5")},
        {SCHED("'kind':'constant','warmup_steps':2"), PARSE,
         E("optimizer.schedule: a 'constant' schedule takes no warmup, decay or min_lr_ratio")},
        {SCHED("'kind':'wsd','period':2"), PARSE, E("optimizer.schedule.period: unknown key")},
        {TRAIN("'micro_steps':0"), PARSE,
         E("training.micro_steps: expected an integer in [1, 1000000], got 0")},
        {TRAIN("'grad_divide':'avg'"), PARSE,
         E("training.grad_divide: expected one of 'fsdp2'|'force_sum'|'world', got 'avg'")},
        {TRAIN("'grad_divide':0"), PARSE,
         E("training.grad_divide: expected 'fsdp2', 'force_sum', 'world' or a number > 0, got 0")},
        {TRAIN("'tail':'replicated'"), PARSE,
         E("training.tail: expected one of 'owner'|'shard'|'auto'|'job', got 'replicated'")},
        {TRAIN("'step':'manual'"), PARSE,
         E("training.step: expected one of 'eager'|'lazy', got 'manual'")},
        {TRAIN("'accum':2"), PARSE,
         E("training.accum: unknown key (expected one of micro_steps|grad_divide|tail|step)")},
        {TOP("'training':[],"), PARSE, E("training: expected an object, got an array")},
        {ITER("'forward_only':1"), PARSE,
         E("iteration.forward_only: expected true or false, got an integer")},
        {ITER("'eval':true"), PARSE,
         E("iteration.eval: unknown key (expected one of forward_only|no_sync)")},
        {SEQ("[['allgather']]"), PARSE,
         E("sequence[0]: expected ['allgather'|'reduce_scatter', <group name>]")},
        {SEQ("[['allgather','g'],['broadcast','g']]"), PARSE,
         E("sequence[1][0]: expected 'allgather' or 'reduce_scatter', got 'broadcast'")},
        {SEQ("[[0,'g']]"), PARSE,
         E("sequence[0][0]: expected 'allgather' or 'reduce_scatter', got an integer")},
        {SEQ("[['allgather','g'],['reduce_scatter','nope']]"), PARSE,
         E("sequence[1][1]: no group named 'nope'")},
        {SEQ("[['allgather',0]]"), PARSE,
         E("sequence[0][1]: expected a group name, got an integer")},
        {SEQ("[['allgather','w']]"), PARSE, E("sequence[0][1]: no group named 'w'")},
    };
    return cr_make_param_array(bad_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_case_t *c, manifest, rejects, .init = quiet)
{
    char text[sizeof(c->json)], expect[sizeof(c->expect)], err[512];
    dq(text, c->json, sizeof(text));
    dq(expect, c->expect, sizeof(expect));
    memset(err, 'x', sizeof(err));
    err[sizeof(err) - 1] = '\0';
    mfsdp_manifest_t *m = POISON;
    mfsdp_status_t st =
        mfsdp_manifest_parse(text, strlen(text), "model.json", err, sizeof(err), &m);
    if (st == MFSDP_OK) {
        mfsdp_manifest_free(m);
    }
    cr_assert_eq(st, c->status, "status %s (%d), expected %d; message: %s\ninput: %s",
                 mfsdp_status_string(st), st, c->status, err, text);
    cr_expect_eq(m, POISON, "output written on failure");
    cr_expect(strstr(err, expect) != NULL, "message\n  %s\ndoes not contain\n  %s\ninput: %s", err,
              expect, text);
    cr_expect(strncmp(err, "model.json: ", 12) == 0, "message does not start with the origin");
    cr_expect(strchr(err, '\n') == NULL, "message is not one line: %s", err);
}

Test(manifest, error_buffer_and_arguments, .init = quiet)
{
    const char *bad = "{\"format\":\"mfsdp-manifest/1\",\"groups\":[]}";
    mfsdp_manifest_t *m = POISON;
    /* A short buffer gets a truncated, terminated message. */
    char small[12];
    memset(small, 'x', sizeof(small));
    cr_expect_eq(mfsdp_manifest_parse(bad, strlen(bad), "model.json", small, sizeof(small), &m),
                 MFSDP_ERR_PARSE);
    cr_expect_str_eq(small, "model.json:");
    /* No buffer at all, no origin. */
    cr_expect_eq(mfsdp_manifest_parse(bad, strlen(bad), NULL, NULL, 0, &m), MFSDP_ERR_PARSE);
    char err[256];
    cr_expect_eq(mfsdp_manifest_parse(bad, strlen(bad), NULL, err, sizeof(err), &m),
                 MFSDP_ERR_PARSE);
    cr_expect(strncmp(err, "manifest: groups: ", 18) == 0, "%s", err);
    cr_expect_eq(m, POISON);
    /* Null arguments. */
    cr_expect_eq(mfsdp_manifest_parse(NULL, 5, "x", err, sizeof(err), &m), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_manifest_parse(bad, strlen(bad), "x", err, sizeof(err), NULL),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_manifest_load(NULL, err, sizeof(err), &m), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_manifest_to_json(NULL, NULL), MFSDP_ERR_INVALID_ARG);
    size_t idx = 99;
    cr_expect_eq(mfsdp_manifest_find_group(NULL, "g", &idx), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(idx, 99);
    cr_expect_eq(m, POISON);
    mfsdp_manifest_free(NULL);
}

/* ---- accepted manifests ---------------------------------------------------------------- */

Test(manifest, defaults)
{
    mfsdp_manifest_t *m = parse_ok(ONE(W "," W1));
    cr_expect_eq(m->world_size, 0);
    cr_expect_float_eq(m->hp.lr, 0.02, 0);
    cr_expect_float_eq(m->hp.momentum, 0.95, 0);
    cr_expect_eq(m->hp.nesterov, 1);
    cr_expect_eq(m->hp.ns_steps, 5);
    cr_expect_float_eq(m->hp.weight_decay, 0.0, 0);
    cr_expect_eq(m->hp.scale, MFSDP_SCALE_KELLER);
    cr_expect_float_eq(m->hp.adamw_lr, 0.001, 0);
    cr_expect_float_eq(m->hp.adamw_beta1, 0.9, 0);
    cr_expect_float_eq(m->hp.adamw_beta2, 0.95, 0);
    cr_expect_float_eq(m->hp.adamw_eps, 1e-8, 0);
    cr_expect_float_eq(m->hp.adamw_weight_decay, 0.0, 0);
    cr_assert_eq(m->ngroups, 1);
    const mfsdp_group_desc_t *g = &m->groups[0];
    cr_expect_str_eq(g->name, "g");
    cr_expect_eq(g->has_reduce_dtype, 0);
    cr_expect_float_eq(g->lr_scale, 1.0, 0);
    cr_expect_eq(g->has_weight_decay, 0);
    cr_assert_eq(g->nparams, 2);
    const mfsdp_param_desc_t *w = &g->params[0], *b = &g->params[1];
    cr_expect_str_eq(w->name, "w");
    cr_expect_eq(w->ndim, 2);
    cr_expect_eq(w->shape[0], 4);
    cr_expect_eq(w->shape[1], 3);
    cr_expect_eq(w->numel, 12);
    cr_expect_eq(w->dtype, MFSDP_FLOAT32);
    cr_expect_eq(w->optimizer, MFSDP_ROLE_MUON);
    cr_expect_eq(w->requires_grad, 1);
    cr_expect_eq(w->nsplit, 0);
    cr_expect_null(w->split);
    cr_expect_eq(w->shard_dim, 0);
    cr_expect_eq(b->ndim, 1);
    cr_expect_eq(b->numel, 4);
    cr_expect_eq(b->optimizer, MFSDP_ROLE_ADAMW);
    cr_expect_eq(m->ncalls, 0);
    cr_expect_null(m->sequence);
    cr_expect_eq(m->replicate, 1);
    cr_expect_eq(m->hp.schedule.kind, MFSDP_SCHEDULE_CONSTANT);
    cr_expect_float_eq(m->hp.max_norm, 0.0, 0);
    cr_expect_eq(m->training.micro_steps, 1);
    cr_expect_eq(m->training.divide, MFSDP_DIVIDE_FSDP2);
    cr_expect_eq(m->training.has_tail, 0);
    cr_expect_eq(m->training.has_step, 0);
    cr_expect_eq(m->iteration.forward_only, 0);
    cr_expect_eq(m->iteration.no_sync, 0);
    mfsdp_manifest_free(m);

    /* warmup-cosine names its decay; an optional sequence entry is flagged */
    m = parse_ok(TOP("'optimizer':{'schedule':{'kind':'warmup-cosine','warmup_steps':5,"
                     "'decay_steps':50}},'training':{'grad_divide':'force_sum'},"
                     "'sequence':[['allgather','g','optional'],['reduce_scatter','g']],"));
    cr_expect_eq(m->hp.schedule.decay, MFSDP_DECAY_COSINE);
    cr_expect_float_eq(m->hp.schedule.min_lr_ratio, 0.0, 0);
    cr_expect_eq(m->training.divide, MFSDP_DIVIDE_FORCE_SUM);
    cr_expect_eq(m->sequence[0].flags, MFSDP_CALL_OPTIONAL);
    cr_expect_eq(m->sequence[1].flags, 0);
    mfsdp_manifest_free(m);

    /* The default hyper-parameters are the same through mfsdp_hparams_default(). */
    mfsdp_hparams_t hp;
    memset(&hp, 0xff, sizeof(hp));
    mfsdp_hparams_default(&hp);
    cr_expect_float_eq(hp.lr, 0.02, 0);
    cr_expect_eq(hp.ns_steps, 5);
    cr_expect_float_eq(hp.adamw_eps, 1e-8, 0);
}

Test(manifest, optimizer_rule)
{
    mfsdp_manifest_t *m =
        parse_ok(ONE("{'name':'blocks.0.fc.weight','shape':[8,4],'dtype':'float32'},"
                     "{'name':'model.embed_tokens.weight','shape':[100,4],'dtype':'float32'},"
                     "{'name':'tok_embedding','shape':[100,4],'dtype':'float32'},"
                     "{'name':'lm_head.weight','shape':[100,4],'dtype':'float32'},"
                     "{'name':'transformer.wte.weight','shape':[100,4],'dtype':'float32'},"
                     "{'name':'transformer.wpe.weight','shape':[16,4],'dtype':'float32'},"
                     "{'name':'blocks.0.fc.bias','shape':[8],'dtype':'float32'},"
                     "{'name':'blocks.0.conv.weight','shape':[6,3,5],'dtype':'float32'},"
                     "{'name':'row','shape':[1,5],'dtype':'float32'},"
                     "{'name':'forced.adamw','shape':[8,4],'dtype':'float32','optimizer':'adamw'},"
                     "{'name':'lm_head.muon','shape':[100,4],'dtype':'float32','optimizer':'muon'},"
                     "{'name':'Embed.upper','shape':[8,4],'dtype':'float32'}"));
    static const struct {
        const char *name;
        mfsdp_role_t role;
    } want[] = {
        {"blocks.0.fc.weight", MFSDP_ROLE_MUON},
        {"model.embed_tokens.weight", MFSDP_ROLE_ADAMW},
        {"tok_embedding", MFSDP_ROLE_ADAMW},
        {"lm_head.weight", MFSDP_ROLE_ADAMW},
        {"transformer.wte.weight", MFSDP_ROLE_ADAMW},
        {"transformer.wpe.weight", MFSDP_ROLE_ADAMW},
        {"blocks.0.fc.bias", MFSDP_ROLE_ADAMW},
        {"blocks.0.conv.weight", MFSDP_ROLE_MUON},
        {"row", MFSDP_ROLE_MUON},
        {"forced.adamw", MFSDP_ROLE_ADAMW},
        {"lm_head.muon", MFSDP_ROLE_MUON},
        {"Embed.upper", MFSDP_ROLE_MUON}, /* the name match is case-sensitive */
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        cr_expect_eq(find_param(m, want[i].name)->optimizer, want[i].role, "%s", want[i].name);
    }
    cr_expect_eq(find_param(m, "blocks.0.conv.weight")->numel, 90);
    mfsdp_manifest_free(m);
}

/* Every key given, non-default values everywhere, keys in an unusual order. */
#define FULL                                                                                       \
    "{'sequence':[['allgather','root'],['allgather','blk'],['reduce_scatter','blk'],"              \
    "['reduce_scatter','root']],"                                                                  \
    "'groups':[{'params':[{'dtype':'float16','shape':[10,6],'name':'embed'}],'name':'root'},"      \
    "{'name':'blk','reduce_dtype':'bfloat16','lr_scale':0.5,'weight_decay':0.1,'params':["         \
    "{'name':'qkv','shape':[9,4],'dtype':'bfloat16','split':[3,3,3],'optimizer':'muon'},"          \
    "{'name':'bias','shape':[9],'dtype':'float32','requires_grad':false},"                         \
    "{'name':'conv','shape':[2,3,4,5,1,1,1,7],'dtype':'float16','shard_dim':1},"                   \
    "{'name':'frozen','shape':[5,4],'dtype':'bfloat16','requires_grad':false,"                     \
    "'optimizer':'adamw'}]}],"                                                                     \
    "'world_size':8,'format':'mfsdp-manifest/1','replicate':2,"                                    \
    "'training':{'step':'lazy','tail':'job','grad_divide':2.5,'micro_steps':4},"                   \
    "'iteration':{'no_sync':true,'forward_only':true},"                                            \
    "'optimizer':{'adamw':{'weight_decay':0.01,'eps':1e-10,'betas':[0.8,0.99],'lr':3e-4},"         \
    "'max_norm':1.5,'schedule':{'min_lr_ratio':0.1,'decay':'sqrt','decay_steps':30,"               \
    "'stable_steps':20,'warmup_steps':10,'kind':'wsd'},"                                           \
    "'scale':'moonlight','weight_decay':0.1,'ns_steps':0,'nesterov':false,'momentum':0,"           \
    "'lr':1}}"

Test(manifest, every_field)
{
    mfsdp_manifest_t *m = parse_ok(FULL);
    cr_expect_eq(m->world_size, 8);
    cr_expect_eq(m->replicate, 2);
    cr_expect_eq(m->hp.schedule.kind, MFSDP_SCHEDULE_WSD);
    cr_expect_eq(m->hp.schedule.warmup_steps, 10);
    cr_expect_eq(m->hp.schedule.stable_steps, 20);
    cr_expect_eq(m->hp.schedule.decay_steps, 30);
    cr_expect_eq(m->hp.schedule.decay, MFSDP_DECAY_SQRT);
    cr_expect_float_eq(m->hp.schedule.min_lr_ratio, 0.1, 0);
    cr_expect_float_eq(m->hp.max_norm, 1.5, 0);
    cr_expect_eq(m->training.micro_steps, 4);
    cr_expect_eq(m->training.divide, MFSDP_DIVIDE_FACTOR);
    cr_expect_float_eq(m->training.divide_factor, 2.5, 0);
    cr_expect_eq(m->training.has_tail, 1);
    cr_expect_eq(m->training.tail, MFSDP_TAIL_JOB);
    cr_expect_eq(m->training.has_step, 1);
    cr_expect_eq(m->training.step, MFSDP_STEP_LAZY);
    cr_expect_eq(m->iteration.forward_only, 1);
    cr_expect_eq(m->iteration.no_sync, 1);
    cr_expect_float_eq(m->hp.lr, 1.0, 0);
    cr_expect_float_eq(m->hp.momentum, 0.0, 0);
    cr_expect_eq(m->hp.nesterov, 0);
    cr_expect_eq(m->hp.ns_steps, 0);
    cr_expect_float_eq(m->hp.weight_decay, 0.1, 0);
    cr_expect_eq(m->hp.scale, MFSDP_SCALE_MOONLIGHT);
    cr_expect_float_eq(m->hp.adamw_lr, 3e-4, 0);
    cr_expect_float_eq(m->hp.adamw_beta1, 0.8, 0);
    cr_expect_float_eq(m->hp.adamw_beta2, 0.99, 0);
    cr_expect_float_eq(m->hp.adamw_eps, 1e-10, 0);
    cr_expect_float_eq(m->hp.adamw_weight_decay, 0.01, 0);
    cr_assert_eq(m->ngroups, 2);
    const mfsdp_group_desc_t *root = &m->groups[0], *blk = &m->groups[1];
    cr_expect_str_eq(root->name, "root");
    cr_expect_eq(root->params[0].dtype, MFSDP_FLOAT16);
    cr_expect_str_eq(blk->name, "blk");
    cr_expect_eq(blk->has_reduce_dtype, 1);
    cr_expect_eq(blk->reduce_dtype, MFSDP_BFLOAT16);
    cr_expect_float_eq(blk->lr_scale, 0.5, 0);
    cr_expect_eq(blk->has_weight_decay, 1);
    cr_expect_float_eq(blk->weight_decay, 0.1, 0);
    cr_assert_eq(blk->nparams, 4);
    /* mixed dtypes in one group, in FSDP order */
    cr_expect_eq(blk->params[0].dtype, MFSDP_BFLOAT16);
    cr_expect_eq(blk->params[1].dtype, MFSDP_FLOAT32);
    cr_expect_eq(blk->params[2].dtype, MFSDP_FLOAT16);
    const mfsdp_param_desc_t *qkv = &blk->params[0];
    cr_assert_eq(qkv->nsplit, 3);
    for (size_t i = 0; i < 3; i++) {
        cr_expect_eq(qkv->split[i], 3);
    }
    cr_expect_eq(blk->params[1].requires_grad, 0);
    const mfsdp_param_desc_t *conv = &blk->params[2];
    cr_expect_eq(conv->ndim, 8);
    cr_expect_eq(conv->numel, 2 * 3 * 4 * 5 * 7);
    cr_expect_eq(conv->shard_dim, 1); /* accepted here; the layout refuses it */
    cr_expect_eq(blk->params[3].optimizer, MFSDP_ROLE_ADAMW);
    cr_assert_eq(m->ncalls, 4);
    cr_expect_eq(m->sequence[0].kind, MFSDP_CALL_ALLGATHER);
    cr_expect_eq(m->sequence[0].group, 0);
    cr_expect_eq(m->sequence[1].kind, MFSDP_CALL_ALLGATHER);
    cr_expect_eq(m->sequence[1].group, 1);
    cr_expect_eq(m->sequence[2].kind, MFSDP_CALL_REDUCE_SCATTER);
    cr_expect_eq(m->sequence[2].group, 1);
    cr_expect_eq(m->sequence[3].kind, MFSDP_CALL_REDUCE_SCATTER);
    cr_expect_eq(m->sequence[3].group, 0);
    size_t idx = 99;
    cr_expect_eq(mfsdp_manifest_find_group(m, "blk", &idx), MFSDP_OK);
    cr_expect_eq(idx, 1);
    idx = 99;
    cr_expect_eq(mfsdp_manifest_find_group(m, "blocks", &idx), MFSDP_ERR_NOT_FOUND);
    cr_expect_eq(idx, 99);
    mfsdp_manifest_free(m);
}

Test(manifest, limits_and_lengths)
{
    /* The largest numel whose fp64 footprint fits int64; boundary values of every range. */
    mfsdp_manifest_t *m = parse_ok(
        HEAD "'world_size':2147483647,'optimizer':{'momentum':0.999999,'ns_steps':100,'lr':0},"
             "'groups':[{'name':'g','lr_scale':0,'weight_decay':0,'params':["
             "{'name':'huge','shape':[1152921504606846975],'dtype':'float32'},"
             "{'name':'w','shape':[4,3],'dtype':'float32','split':[4]}]}],'sequence':[]}");
    cr_expect_eq(m->world_size, 2147483647);
    cr_expect_eq(m->groups[0].params[0].numel, INT64_MAX / 8);
    cr_expect_eq(m->groups[0].params[1].nsplit, 1);
    cr_expect_eq(m->hp.ns_steps, 100);
    cr_expect_eq(m->groups[0].has_weight_decay, 1);
    cr_expect_eq(m->ncalls, 0);
    mfsdp_manifest_free(m);

    /* len is honoured: the text need not be NUL-terminated, what follows is not read. */
    char text[512];
    dq(text, ONE(W) "@@garbage", sizeof(text));
    size_t len = strlen(text) - strlen("@@garbage");
    char err[256] = "";
    cr_expect_eq(mfsdp_manifest_parse(text, len, "x", err, sizeof(err), &m), MFSDP_OK, "%s", err);
    mfsdp_manifest_free(m);
    cr_expect_eq(mfsdp_manifest_parse(text, len + 1, "x", err, sizeof(err), &m), MFSDP_ERR_PARSE);
}

/* ---- canonical writer ------------------------------------------------------------------ */

static void round_trip(const mfsdp_manifest_t *m, const char *what)
{
    char *j1 = NULL, *j2 = NULL, err[512] = "";
    mfsdp_manifest_t *back = NULL;
    cr_assert_eq(mfsdp_manifest_to_json(m, &j1), MFSDP_OK, "%s", what);
    cr_assert_eq(mfsdp_manifest_parse(j1, strlen(j1), "to_json", err, sizeof(err), &back), MFSDP_OK,
                 "%s: %s\n%s", what, err, j1);
    const char *diff = test_manifest_diff(m, back);
    cr_expect_null(diff, "%s: %s differs after the round trip", what, diff);
    /* Canonical: writing the re-read manifest gives the same bytes. */
    cr_assert_eq(mfsdp_manifest_to_json(back, &j2), MFSDP_OK);
    cr_expect_str_eq(j1, j2, "%s", what);
    free(j1);
    free(j2);
    mfsdp_manifest_free(back);
}

Test(manifest, to_json_round_trip)
{
    mfsdp_manifest_t *m = parse_ok(FULL);
    round_trip(m, "full");
    char *j = NULL;
    cr_assert_eq(mfsdp_manifest_to_json(m, &j), MFSDP_OK);
    /* Fixed key order and every field explicit, whatever the input order was. */
    const char *order[] = {"\"format\"",
                           "\"world_size\"",
                           "\"optimizer\"",
                           "\"lr\": 1",
                           "\"momentum\": 0",
                           "\"nesterov\": false",
                           "\"ns_steps\": 0",
                           "\"scale\": \"moonlight\"",
                           "\"adamw\"",
                           "\"betas\": [0.8, 0.99]",
                           "\"groups\"",
                           "\"name\": \"root\"",
                           "\"lr_scale\": 1",
                           "\"optimizer\": \"adamw\"",
                           "\"requires_grad\": true",
                           "\"shard_dim\": 0",
                           "\"name\": \"blk\"",
                           "\"reduce_dtype\": \"bfloat16\"",
                           "\"lr_scale\": 0.5",
                           "\"weight_decay\": 0.1",
                           "\"split\": [3, 3, 3]",
                           "\"shard_dim\": 1",
                           "\"sequence\"",
                           "[\"reduce_scatter\", \"root\"]"};
    const char *at = j;
    for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
        const char *hit = strstr(at, order[i]);
        cr_expect_not_null(hit, "%s missing or out of order in\n%s", order[i], j);
        at = hit != NULL ? hit : at;
    }
    free(j);
    mfsdp_manifest_free(m);

    /* Doubles that need 17 digits, tiny and subnormal values, names that need escaping. */
    m = parse_ok(HEAD "'optimizer':{'lr':0.30000000000000004,'weight_decay':5e-324,"
                      "'adamw':{'eps':1e-300,'lr':0.1,'betas':[0.1,0.30000000000000004]}},"
                      "'groups':[{'name':'q\\'uote\\\\back\\tslash \\u00e9\\u4e2d','lr_scale':"
                      "123456789.123,'params':[{'name':'\\u0001ctl','shape':[1],"
                      "'dtype':'bfloat16'}]}]}");
    cr_expect_float_eq(m->hp.lr, 0.1 + 0.2, 0);
    cr_expect_str_eq(m->groups[0].name, "q\"uote\\back\tslash \xc3\xa9\xe4\xb8\xad");
    cr_expect_str_eq(m->groups[0].params[0].name, "\x01"
                                                  "ctl");
    round_trip(m, "escapes and doubles");
    mfsdp_manifest_free(m);

    m = parse_ok(ONE(W));
    round_trip(m, "minimal");
    mfsdp_manifest_free(m);
}

Test(manifest, to_json_of_a_manifest_built_in_c, .init = quiet)
{
    int64_t split[2] = {2, 1};
    mfsdp_param_desc_t params[2] = {
        {.name = "w",
         .ndim = 2,
         .shape = {3, 5},
         .numel = 15,
         .dtype = MFSDP_BFLOAT16,
         .optimizer = MFSDP_ROLE_MUON,
         .requires_grad = 1,
         .nsplit = 2,
         .split = split},
        {.name = "b",
         .ndim = 1,
         .shape = {5},
         .numel = 5,
         .dtype = MFSDP_FLOAT32,
         .optimizer = MFSDP_ROLE_ADAMW,
         .requires_grad = 0},
    };
    mfsdp_group_desc_t group = {.name = "blk",
                                .lr_scale = 2.0,
                                .nparams = 2,
                                .params = params,
                                .has_reduce_dtype = 1,
                                .reduce_dtype = MFSDP_FLOAT32};
    mfsdp_call_t seq[1] = {{MFSDP_CALL_REDUCE_SCATTER, 0, 0}};
    mfsdp_manifest_t m = {
        .world_size = 3, .ngroups = 1, .groups = &group, .ncalls = 1, .sequence = seq};
    mfsdp_hparams_default(&m.hp);
    round_trip(&m, "built in c");

    /* Inconsistent or out-of-range content is refused and nothing is written. */
    char *j = (char *)"untouched";
    params[0].numel = 14;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    params[0].numel = 15;
    params[1].dtype = MFSDP_UINT8;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    params[1].dtype = MFSDP_FLOAT32;
    params[1].ndim = 0;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    params[1].ndim = 1;
    seq[0].group = 1;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    seq[0].group = 0;
    m.hp.momentum = 1.0;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    m.hp.momentum = 0.95;
    m.hp.lr = INFINITY;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    m.hp.lr = 0.02;
    params[0].optimizer = (mfsdp_role_t)7;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    params[0].optimizer = MFSDP_ROLE_MUON;
    params[1].name = NULL;
    cr_expect_eq(mfsdp_manifest_to_json(&m, &j), MFSDP_ERR_INVALID_ARG);
    cr_expect_str_eq(j, "untouched");
}

/* ---- files ----------------------------------------------------------------------------- */

static mfsdp_manifest_t *load_model(const char *file)
{
    char path[1024], err[512] = "";
    mfsdp_manifest_t *m = NULL;
    snprintf(path, sizeof(path), "%s/%s", MODELS_DIR, file);
    mfsdp_status_t st = mfsdp_manifest_load(path, err, sizeof(err), &m);
    cr_assert_eq(st, MFSDP_OK, "%s: %s", path, err);
    return m;
}

static int64_t total_numel(const mfsdp_manifest_t *m, size_t *nparams_p)
{
    int64_t total = 0;
    size_t n = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t p = 0; p < m->groups[g].nparams; p++) {
            total += m->groups[g].params[p].numel;
            n++;
        }
    }
    *nparams_p = n;
    return total;
}

Test(manifest, every_example_model_loads_and_round_trips)
{
    DIR *d = opendir(MODELS_DIR);
    cr_assert_not_null(d, "%s: %s", MODELS_DIR, strerror(errno));
    int n = 0;
    for (struct dirent *e = readdir(d); e != NULL; e = readdir(d)) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".json") != 0) {
            continue;
        }
        mfsdp_manifest_t *m = load_model(e->d_name);
        round_trip(m, e->d_name);
        mfsdp_manifest_free(m);
        n++;
    }
    closedir(d);
    cr_expect_geq(n, 4, "expected tiny, gpt2-124m, llama3-8b and llama3-70b at least");
}

Test(manifest, gpt2_124m)
{
    mfsdp_manifest_t *m = load_model("gpt2-124m.json");
    size_t nparams;
    /* The published GPT-2 small count with lm_head tied to wte. */
    cr_expect_eq(total_numel(m, &nparams), 124439808);
    cr_expect_eq(nparams, 148);
    cr_expect_eq(m->ngroups, 13);
    const mfsdp_param_desc_t *qkv = find_param(m, "transformer.h.5.attn.c_attn.weight");
    cr_expect_eq(qkv->shape[0], 2304);
    cr_expect_eq(qkv->shape[1], 768);
    cr_assert_eq(qkv->nsplit, 3);
    cr_expect_eq(qkv->split[0] + qkv->split[1] + qkv->split[2], 2304);
    cr_expect_eq(qkv->optimizer, MFSDP_ROLE_MUON);
    cr_expect_eq(find_param(m, "transformer.wte.weight")->optimizer, MFSDP_ROLE_ADAMW);
    cr_expect_eq(find_param(m, "transformer.wpe.weight")->optimizer, MFSDP_ROLE_ADAMW);
    cr_expect_eq(find_param(m, "transformer.h.11.mlp.c_proj.weight")->shape[1], 3072);
    mfsdp_manifest_free(m);
}

static void check_llama(const char *file, int64_t published, int layers, int64_t hidden,
                        int64_t ffn)
{
    mfsdp_manifest_t *m = load_model(file);
    size_t nparams;
    cr_expect_eq(total_numel(m, &nparams), published, "%s", file);
    cr_expect_eq(nparams, (size_t)layers * 9 + 3);
    cr_assert_eq(m->ngroups, (size_t)layers + 1);
    size_t idx;
    cr_assert_eq(mfsdp_manifest_find_group(m, "root", &idx), MFSDP_OK);
    cr_expect_eq(m->groups[idx].nparams, 3);
    size_t muon = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        cr_expect_eq(m->groups[g].has_reduce_dtype, 1);
        cr_expect_eq(m->groups[g].reduce_dtype, MFSDP_FLOAT32);
        for (size_t p = 0; p < m->groups[g].nparams; p++) {
            cr_expect_eq(m->groups[g].params[p].dtype, MFSDP_BFLOAT16);
            muon += m->groups[g].params[p].optimizer == MFSDP_ROLE_MUON;
        }
    }
    cr_expect_eq(muon, (size_t)layers * 7, "q k v o gate up down per layer");
    char name[64];
    snprintf(name, sizeof(name), "layers.%d", layers - 1);
    cr_assert_eq(mfsdp_manifest_find_group(m, name, &idx), MFSDP_OK);
    const mfsdp_group_desc_t *last = &m->groups[idx];
    cr_assert_eq(last->nparams, 9);
    static const char *const suffix[9] = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
        "mlp.down_proj.weight",    "input_layernorm.weight",  "post_attention_layernorm.weight"};
    const int64_t rows[9] = {hidden, 1024, 1024, hidden, ffn, ffn, hidden, hidden, hidden};
    for (int i = 0; i < 9; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.%s", layers - 1, suffix[i]);
        cr_expect_str_eq(last->params[i].name, name);
        cr_expect_eq(last->params[i].shape[0], rows[i], "%s", name);
    }
    cr_expect_eq(last->params[6].shape[1], ffn);
    cr_expect_eq(find_param(m, "model.embed_tokens.weight")->shape[0], 128256);
    cr_expect_eq(find_param(m, "model.embed_tokens.weight")->optimizer, MFSDP_ROLE_ADAMW);
    cr_expect_eq(find_param(m, "lm_head.weight")->optimizer, MFSDP_ROLE_ADAMW);
    mfsdp_manifest_free(m);
}

Test(manifest, llama3_8b)
{
    check_llama("llama3-8b.json", 8030261248LL, 32, 4096, 14336);
}

Test(manifest, llama3_70b)
{
    check_llama("llama3-70b.json", 70553706496LL, 80, 8192, 28672);
}

/* The scaled-down Llama of mfsdp-perf optstep (docs/PERFORMANCE.md): 2 x 128256 x 1024
 * (embed, lm_head) + 1024 (norm) + 4 x (4 x 1024^2 + 3 x 3584 x 1024 + 2 x 1024). */
Test(manifest, llama_mini)
{
    check_llama("llama-mini.json",
                2LL * 128256 * 1024 + 1024 +
                    4LL * (4LL * 1024 * 1024 + 3LL * 3584 * 1024 + 2 * 1024),
                4, 1024, 3584);
}

Test(manifest, tiny)
{
    mfsdp_manifest_t *m = load_model("tiny.json");
    cr_expect_eq(m->ngroups, 3);
    int one_d = 0, frozen = 0, split = 0, mixed = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        for (size_t p = 0; p < gd->nparams; p++) {
            one_d += gd->params[p].ndim == 1;
            frozen += !gd->params[p].requires_grad;
            split += gd->params[p].nsplit > 0;
            mixed |= gd->params[p].dtype != gd->params[0].dtype;
        }
    }
    cr_expect(one_d > 0 && frozen > 0 && split > 0 && mixed, "tiny lost a feature");
    cr_expect_gt(m->ncalls, 0);
    mfsdp_manifest_free(m);
}

Test(manifest, load_errors, .init = quiet)
{
    char err[512];
    mfsdp_manifest_t *m = POISON;
    const char *missing = MODELS_DIR "/no-such-model.json";
    cr_expect_eq(mfsdp_manifest_load(missing, err, sizeof(err), &m), MFSDP_ERR_IO);
    cr_expect(strstr(err, missing) != NULL, "%s", err);
    cr_expect(strstr(err, strerror(ENOENT)) != NULL, "%s", err);
    cr_expect_eq(mfsdp_manifest_load(MODELS_DIR, err, sizeof(err), &m), MFSDP_ERR_IO);
    cr_expect(strstr(err, strerror(EISDIR)) != NULL, "%s", err);

    /* A file's own name is the origin of its parse errors. */
    char path[] = "/tmp/mfsdp-test-manifest-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char *text = "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": \"g\"}]}";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    cr_expect_eq(mfsdp_manifest_load(path, err, sizeof(err), &m), MFSDP_ERR_PARSE);
    char want[256];
    snprintf(want, sizeof(want), "%s: groups[0].params: missing", path);
    cr_expect(strstr(err, want) == err, "%s", err);
    unlink(path);
    cr_expect_eq(m, POISON);
}
