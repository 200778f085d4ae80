/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Checkpoint files without a communicator (core/ckpt_index.c, core/ckpt_io.c,
 * runtime/ckpt_offline.c): the layout (which rank writes what, which pieces hold which
 * rows), the index (round trip, its self digest catching every single-byte change, its
 * structural checks), import -> reshard -> export round trips that reproduce the weights and
 * fp32 masters bit for bit at 1..5 ranks and every tail policy, and every corruption of a
 * checkpoint refused by verify with a message naming the file and tensor: a flipped byte in
 * any file, truncation, a missing file, a wrong dtype or shape in a header, a huge header
 * length, overlapping offsets, a header that is not JSON (the last ones re-sealed, i.e.
 * with checksums and index digests recomputed, so that the header checks themselves are
 * what refuses them), a damaged `latest`, an interrupted (*.partial) directory.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/ckpt_io.h"
#include "core/log.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/kernels.h"
#include "tests/lib/ckpt_util.h"

static const char manifest_json[] =
    "{\"format\":\"mfsdp-manifest/1\","
    " \"optimizer\":{\"lr\":0.02,\"weight_decay\":0.01},"
    " \"groups\":["
    "  {\"name\":\"embed\",\"params\":[{\"name\":\"embed.weight\",\"shape\":[37,12],"
    "\"dtype\":\"float32\"}]},"
    "  {\"name\":\"blocks.0\",\"reduce_dtype\":\"float32\",\"params\":["
    "    {\"name\":\"blocks.0.wq\",\"shape\":[24,16],\"dtype\":\"bfloat16\"},"
    "    {\"name\":\"blocks.0.norm\",\"shape\":[24],\"dtype\":\"bfloat16\"},"
    "    {\"name\":\"blocks.0.bias\",\"shape\":[3],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.0.w3\",\"shape\":[5,3,4],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.0.frozen\",\"shape\":[6,4],\"dtype\":\"bfloat16\","
    "\"requires_grad\":false}]},"
    "  {\"name\":\"head\",\"params\":[{\"name\":\"lm_head.weight\",\"shape\":[11,24],"
    "\"dtype\":\"bfloat16\"}]}]}";

static char g_dir[96];
static mfsdp_manifest_t *g_m;

static void quiet(void)
{
    setenv("MFSDP_DEBUG", "NONE", 1);
    mfsdp_log_reinit();
}

static void setup(void)
{
    quiet();
    snprintf(g_dir, sizeof(g_dir), "/tmp/mfsdp-ckpt-unit-%d", (int)getpid());
    mkdir(g_dir, 0755);
    char err[256] = "";
    cr_assert_eq(
        mfsdp_manifest_parse(manifest_json, strlen(manifest_json), "m", err, sizeof(err), &g_m),
        MFSDP_OK, "%s", err);
}

static void teardown(void)
{
    mfsdp_manifest_free(g_m);
    g_m = NULL;
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(ckpt, .init = setup, .fini = teardown);

static size_t nparams(void)
{
    size_t n = 0;
    for (size_t g = 0; g < g_m->ngroups; g++) {
        n += g_m->groups[g].nparams;
    }
    return n;
}

static const mfsdp_param_desc_t *param(size_t t)
{
    for (size_t g = 0; g < g_m->ngroups; g++) {
        if (t < g_m->groups[g].nparams) {
            return &g_m->groups[g].params[t];
        }
        t -= g_m->groups[g].nparams;
    }
    return NULL;
}

/* Full fp32 weights: every value distinct, most not representable in bf16. */
static float value(size_t t, int64_t e)
{
    return (float)(sin(0.37 * (double)e + 1.3 * (double)t) * (1.0 + 0.001 * (double)t));
}

static char *write_full(const char *name)
{
    size_t n = nparams();
    mfsdp_st_entry_t *e = calloc(n, sizeof(*e));
    float **bufs = calloc(n, sizeof(*bufs));
    for (size_t t = 0; t < n; t++) {
        const mfsdp_param_desc_t *p = param(t);
        bufs[t] = malloc((size_t)p->numel * 4);
        for (int64_t i = 0; i < p->numel; i++) {
            bufs[t][i] = value(t, i);
        }
        e[t] = (mfsdp_st_entry_t){.name = p->name,
                                  .dtype = MFSDP_ST_F32,
                                  .ndim = p->ndim,
                                  .bytes = (uint64_t)p->numel * 4,
                                  .data = bufs[t]};
        memcpy(e[t].shape, p->shape, sizeof(p->shape));
    }
    char *path = malloc(256);
    snprintf(path, 256, "%s/%s", g_dir, name);
    char hex[MFSDP_SHA256_HEX];
    cr_assert_eq(mfsdp_st_write(path, e, n, NULL, NULL, 0, NULL, hex, NULL), MFSDP_OK);
    for (size_t t = 0; t < n; t++) {
        free(bufs[t]);
    }
    free(bufs);
    free(e);
    return path;
}

static char *sub(const char *name)
{
    char *p = malloc(256);
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

static mfsdp_plan_opts_t tail_opts(mfsdp_tail_policy_t t)
{
    mfsdp_plan_opts_t o;
    memset(&o, 0, sizeof(o));
    o.tail = t;
    return o;
}

/* Every tensor of a full export, checked against value(): the weight (rounded to the param
 * dtype) or, for an fp32 export, the exact fp32 value. */
static void check_export(const char *path, int fp32)
{
    mfsdp_st_file_t *f = NULL;
    char err[512] = "";
    cr_assert_eq(mfsdp_st_open(path, err, sizeof(err), &f), MFSDP_OK, "%s", err);
    cr_assert_eq(f->hdr->ntensors, nparams());
    cr_assert_str_eq(mfsdp_st_meta(f->hdr, "format"), "pt");
    for (size_t t = 0; t < nparams(); t++) {
        const mfsdp_param_desc_t *p = param(t);
        const mfsdp_st_tensor_t *e = mfsdp_st_find(f->hdr, p->name);
        cr_assert_not_null(e, "%s", p->name);
        mfsdp_dtype_t want = fp32 ? MFSDP_FLOAT32 : p->dtype;
        mfsdp_dtype_t got;
        cr_assert_eq(mfsdp_st_dtype_to(e->dtype, &got), MFSDP_OK);
        cr_assert_eq(got, want, "%s", p->name);
        size_t es = mfsdp_dtype_size(want);
        char *buf = malloc((size_t)p->numel * es);
        cr_assert_eq(mfsdp_st_read(f, e, 0, (size_t)p->numel * es, buf, NULL, 0), MFSDP_OK);
        for (int64_t i = 0; i < p->numel; i++) {
            float v = value(t, i), w;
            if (want == MFSDP_FLOAT32) {
                memcpy(&w, buf + i * 4, 4);
                cr_assert(memcmp(&w, &v, 4) == 0, "%s[%lld]: %g != %g", p->name, (long long)i, w,
                          v);
            } else {
                uint16_t h, r;
                memcpy(&h, buf + i * 2, 2);
                r = want == MFSDP_BFLOAT16 ? mfsdp_f32_to_bf16(v) : mfsdp_f32_to_f16(v);
                cr_assert_eq(h, r, "%s[%lld]", p->name, (long long)i);
            }
        }
        free(buf);
    }
    mfsdp_st_close(f);
}

/* ---- layout ------------------------------------------------------------------------------ */

Test(ckpt, layout_items_and_pieces)
{
    mfsdp_plan_opts_t o = tail_opts(MFSDP_TAIL_SHARD);
    mfsdp_plan_t *plan = NULL;
    cr_assert_eq(mfsdp_plan_create(g_m, 4, &o, &plan), MFSDP_OK);
    mfsdp_ckpt_layout_t *lay = NULL;
    cr_assert_eq(mfsdp_ckpt_layout_of_plan(plan, &lay), MFSDP_OK);
    size_t n = nparams();
    uint64_t model_bytes[4] = {0};
    size_t weights = 0;
    for (int r = 0; r < 4; r++) {
        mfsdp_ckpt_item_t *it = NULL;
        size_t ni = 0;
        cr_assert_eq(mfsdp_ckpt_rank_items(lay, r, &it, &ni), MFSDP_OK);
        int optim = 0;
        for (size_t i = 0; i < ni; i++) {
            const mfsdp_param_desc_t *p = lay->params[it[i].tensor];
            if (it[i].kind == MFSDP_CKPT_OPTIM) {
                optim = 1;
            }
            cr_assert(!(optim && it[i].kind == MFSDP_CKPT_MODEL), "model items come first");
            if (it[i].state == MFSDP_CKPT_WEIGHT) {
                weights++;
                model_bytes[r] += it[i].bytes;
                cr_assert_str_eq(it[i].key, p->name);
                cr_assert_eq(it[i].row_end - it[i].row_begin, p->shape[0], "whole");
                continue;
            }
            cr_assert_eq(it[i].dtype, MFSDP_ST_F32);
            cr_assert(it[i].state != MFSDP_CKPT_MASTER || p->dtype != MFSDP_FLOAT32,
                      "no master for a float32 param: %s", it[i].key);
            cr_assert(p->requires_grad || it[i].state == MFSDP_CKPT_MASTER,
                      "no optimizer state for a frozen param: %s", it[i].key);
            if (lay->owner[it[i].tensor] == MFSDP_OWNER_SHARDED) {
                int64_t c = lay->c[it[i].tensor];
                cr_assert_eq(it[i].row_begin, r * c, "%s", it[i].key);
                cr_assert_lt(it[i].row_begin, it[i].row_end, "no empty slices are stored");
            } else {
                cr_assert_eq(lay->owner[it[i].tensor], r);
            }
        }
        mfsdp_ckpt_items_free(it, ni);
    }
    cr_assert_eq(weights, n, "every weight is written exactly once");
    /* blocks.0.bias has 3 rows at 4 ranks: rank 3 stores no slice, rows 0..2 in three pieces */
    size_t bias = 3;
    cr_assert_str_eq(lay->params[bias]->name, "blocks.0.bias");
    cr_assert_eq(lay->owner[bias], MFSDP_OWNER_SHARDED);
    mfsdp_ckpt_piece_t pc[8];
    cr_assert_eq(mfsdp_ckpt_pieces(lay, bias, MFSDP_CKPT_EXP_AVG, 0, 3, pc, 8), 3);
    cr_assert_eq(pc[2].rank, 2);
    cr_assert_eq(pc[2].row_begin, 2);
    cr_assert_eq(pc[2].row_end, 3);
    cr_assert_eq(mfsdp_ckpt_pieces(lay, bias, MFSDP_CKPT_EXP_AVG, 1, 2, pc, 8), 1);
    cr_assert_eq(pc[0].rank, 1);
    /* the master of a float32 param is its weight */
    cr_assert_eq(mfsdp_ckpt_pieces(lay, bias, MFSDP_CKPT_MASTER, 0, 3, pc, 8), 1);
    cr_assert_eq(pc[0].state, MFSDP_CKPT_WEIGHT);
    cr_assert_eq(pc[0].kind, MFSDP_CKPT_MODEL);
    cr_assert_eq(pc[0].rank, lay->writer[bias]);
    /* a bad owner is refused */
    int *owner = calloc(n, sizeof(int));
    owner[1] = MFSDP_OWNER_SHARDED; /* blocks.0.wq is a muon matrix */
    mfsdp_ckpt_layout_t *bad = NULL;
    cr_assert_eq(mfsdp_ckpt_layout_create(g_m, 4, owner, NULL, &bad), MFSDP_ERR_INVALID_ARG);
    owner[1] = 4;
    cr_assert_eq(mfsdp_ckpt_layout_create(g_m, 4, owner, NULL, &bad), MFSDP_ERR_INVALID_ARG);
    free(owner);
    mfsdp_ckpt_layout_destroy(lay);
    mfsdp_plan_destroy(plan);
}

/* ---- import, reshard, export ------------------------------------------------------------- */

Test(ckpt, import_reshard_export_round_trips)
{
    char *full = write_full("full.safetensors");
    char err[1024] = "";
    static const mfsdp_tail_policy_t tails[] = {MFSDP_TAIL_SHARD, MFSDP_TAIL_OWNER,
                                                MFSDP_TAIL_AUTO};
    char prev[256];
    snprintf(prev, sizeof(prev), "%s/w3", g_dir);
    mfsdp_plan_opts_t o = tail_opts(MFSDP_TAIL_SHARD);
    cr_assert_eq(mfsdp_ckpt_import_full(full, g_m, 3, &o, prev, err, sizeof(err)), MFSDP_OK, "%s",
                 err);
    cr_assert_eq(mfsdp_ckpt_verify(prev, err, sizeof(err)), MFSDP_OK, "%s", err);
    /* 3 -> 1 -> 2 -> 4 -> 5 -> 40 ranks, changing the tail policy on the way (80 files at
     * 40 ranks: more than a reader keeps open at once) */
    static const int worlds[] = {1, 2, 4, 5, 40};
    for (int k = 0; k < 5; k++) {
        char next[256];
        snprintf(next, sizeof(next), "%s/w%d", g_dir, worlds[k]);
        mfsdp_plan_opts_t ok = tail_opts(tails[k % 3]);
        cr_assert_eq(
            mfsdp_ckpt_reshard(prev, worlds[k], k == 0 ? NULL : &ok, next, err, sizeof(err)),
            MFSDP_OK, "%s", err);
        cr_assert_eq(mfsdp_ckpt_verify(next, err, sizeof(err)), MFSDP_OK, "%s", err);
        char *px = sub("param.safetensors"), *fx = sub("fp32.safetensors");
        cr_assert_eq(mfsdp_ckpt_export_full(next, px, 0, err, sizeof(err)), MFSDP_OK, "%s", err);
        cr_assert_eq(mfsdp_ckpt_export_full(next, fx, 1, err, sizeof(err)), MFSDP_OK, "%s", err);
        check_export(px, 0);
        check_export(fx, 1);
        free(px);
        free(fx);
        /* the optimizer state of an import is zero, the step 0 */
        mfsdp_ckpt_reader_t *r = NULL;
        cr_assert_eq(mfsdp_ckpt_reader_open(next, err, sizeof(err), &r), MFSDP_OK, "%s", err);
        cr_assert_eq(r->index->layout->world, worlds[k]);
        cr_assert_eq(r->index->meta.step, 0);
        for (size_t t = 0; t < nparams(); t++) {
            for (int s = MFSDP_CKPT_MOMENTUM; s < MFSDP_CKPT_NSTATES; s++) {
                if (!mfsdp_ckpt_has_state(r->index->layout, t, (mfsdp_ckpt_state_t)s)) {
                    continue;
                }
                size_t bytes = (size_t)param(t)->numel * 4;
                char *z = malloc(bytes), *zero = calloc(1, bytes);
                cr_assert_eq(mfsdp_ckpt_read_rows(r, t, (mfsdp_ckpt_state_t)s, 0,
                                                  param(t)->shape[0], z, err, sizeof(err)),
                             MFSDP_OK, "%s", err);
                cr_assert_eq(memcmp(z, zero, bytes), 0);
                free(z);
                free(zero);
            }
        }
        mfsdp_ckpt_reader_close(r);
        snprintf(prev, sizeof(prev), "%s", next);
    }
    free(full);
}

Test(ckpt, import_refuses_what_does_not_fit)
{
    char *full = write_full("full.safetensors");
    char err[1024] = "";
    char *out = sub("imp");
    /* a manifest with one more param than the file */
    mfsdp_manifest_t *m2 = NULL;
    char text[sizeof(manifest_json) + 200];
    snprintf(text, sizeof(text),
             "%.*s,{\"name\":\"extra\",\"params\":[{\"name\":\"x.w\","
             "\"shape\":[2,2],\"dtype\":\"float32\"}]}]}",
             (int)(sizeof(manifest_json) - 1 - 2), manifest_json);
    cr_assert_eq(mfsdp_manifest_parse(text, strlen(text), "m2", NULL, 0, &m2), MFSDP_OK, "%s",
                 text);
    cr_assert_eq(mfsdp_ckpt_import_full(full, m2, 2, NULL, out, err, sizeof(err)),
                 MFSDP_ERR_NOT_FOUND);
    cr_assert(strstr(err, "tensor 'x.w' of the manifest is missing") != NULL, "%s", err);
    mfsdp_manifest_free(m2);
    /* a shape that differs */
    char *t2 = strdup(manifest_json);
    char *at = strstr(t2, "[24,16]");
    memcpy(at, "[16,24]", 7);
    cr_assert_eq(mfsdp_manifest_parse(t2, strlen(t2), "m3", NULL, 0, &m2), MFSDP_OK);
    cr_assert_eq(mfsdp_ckpt_import_full(full, m2, 2, NULL, out, err, sizeof(err)),
                 MFSDP_ERR_MISMATCH);
    cr_assert(strstr(err, "tensor 'blocks.0.wq' of the manifest is there with another shape") !=
                  NULL,
              "%s", err);
    mfsdp_manifest_free(m2);
    free(t2);
    /* a manifest for another world size (the job it describes would not start at 2) */
    char t3[sizeof(manifest_json) + 32];
    snprintf(t3, sizeof(t3), "{\"world_size\":4,%s", manifest_json + 1);
    cr_assert_eq(mfsdp_manifest_parse(t3, strlen(t3), "m4", NULL, 0, &m2), MFSDP_OK, "%s", t3);
    err[0] = '\0';
    cr_assert_eq(mfsdp_ckpt_import_full(full, m2, 2, NULL, out, err, sizeof(err)),
                 MFSDP_ERR_MISMATCH);
    cr_assert(strstr(err, "the manifest is for world size 4, not 2") != NULL, "%s", err);
    mfsdp_manifest_free(m2);
    struct stat sb;
    cr_assert_neq(stat(out, &sb), 0, "nothing written");
    free(out);
    free(full);
}

/* ---- the index ----------------------------------------------------------------------------- */

static char *slurp(const char *path, size_t *len)
{
    char *b = ckpt_slurp(path, len);
    cr_assert_not_null(b, "%s", path);
    return b;
}

static void spit(const char *path, const char *b, size_t n)
{
    cr_assert_eq(ckpt_spit(path, b, n), 0, "%s", path);
}

static void redigest(char *text, size_t len)
{
    cr_assert_eq(ckpt_redigest(text, len), 0);
}

/* A checkpoint of the test model at `world` ranks under g_dir/name; returns the path of its
 * checkpoint directory (root/step-00000000). */
static char *make_ckpt(const char *name, int world)
{
    char *full = write_full("full-src.safetensors");
    char *root = sub(name);
    char err[1024] = "";
    mfsdp_plan_opts_t o = tail_opts(MFSDP_TAIL_SHARD);
    cr_assert_eq(mfsdp_ckpt_import_full(full, g_m, world, &o, root, err, sizeof(err)), MFSDP_OK,
                 "%s", err);
    char *dir = malloc(300);
    snprintf(dir, 300, "%s/step-00000000", root);
    free(root);
    free(full);
    return dir;
}

Test(ckpt, index_every_byte_flip_is_refused)
{
    char *dir = make_ckpt("c", 2);
    char ipath[400];
    snprintf(ipath, sizeof(ipath), "%s/" MFSDP_CKPT_INDEX_NAME, dir);
    size_t len;
    char *text = slurp(ipath, &len);
    mfsdp_ckpt_index_t *ix = NULL;
    cr_assert_eq(mfsdp_ckpt_index_parse(text, len, "idx", NULL, 0, &ix), MFSDP_OK);
    cr_assert_eq(ix->layout->world, 2);
    mfsdp_ckpt_index_free(ix);
    size_t refused = 0;
    for (size_t i = 0; i < len; i++) {
        char *t = malloc(len);
        memcpy(t, text, len);
        t[i] ^= 0x01;
        ix = NULL;
        mfsdp_status_t st = mfsdp_ckpt_index_parse(t, len, "idx", NULL, 0, &ix);
        cr_assert_neq(st, MFSDP_OK, "a flip of byte %zu ('%c') was accepted", i, text[i]);
        cr_assert_null(ix);
        refused++;
        free(t);
    }
    cr_assert_eq(refused, len);
    /* truncated: refused */
    cr_assert_neq(mfsdp_ckpt_index_parse(text, len - 2, "idx", NULL, 0, &ix), MFSDP_OK);
    cr_assert_neq(mfsdp_ckpt_index_parse(text, 40, "idx", NULL, 0, &ix), MFSDP_OK);
    free(text);
    free(dir);
}

typedef struct index_edit {
    char from[80];
    char to[80];
    int status;
    char expect[120];
} index_edit_t;

ParameterizedTestParameters(ckpt, index_structure)
{
    static index_edit_t cases[] = {
        {"\"world_size\": 2", "\"world_size\": 3", MFSDP_ERR_PARSE, "mfsdp.files"},
        {"\"world_size\": 2", "\"world_size\": 0", MFSDP_ERR_PARSE,
         "mfsdp.world_size: expected an integer"},
        {"\"format\": \"mfsdp-ckpt/1\",\n  \"world", "\"format\": \"mfsdp-ckpt/9\",\n  \"world",
         MFSDP_ERR_UNSUPPORTED, "mfsdp.format: format 'mfsdp-ckpt/9' is not"},
        {"\"step\": 0", "\"step\": 5", MFSDP_ERR_PARSE, "largest group step count is 0"},
        {"\"tail\": \"shard\"", "\"tail\": \"other\"", MFSDP_ERR_PARSE,
         "mfsdp.tail: expected owner"},
        {"\"ctx_steps\": 0", "\"ctx_steps\": 0, \"extra\": 1", MFSDP_ERR_PARSE,
         "mfsdp: unknown key 'extra'"},
        {"\"writer\": 0", "\"writer\": 7", MFSDP_ERR_PARSE, "writer: expected an integer in"},
        {"\"owner\": \"sharded\"", "\"owner\": 9", MFSDP_ERR_PARSE, "owner: expected an integer"},
        {"\"embed.weight\": \"model-0000", "\"embed.weight\": \"xodel-0000", MFSDP_ERR_PARSE,
         "weight_map: tensor 'embed.weight' must map to"},
        {"\"total_size\": ", "\"total_size\": 1", MFSDP_ERR_PARSE, "metadata: total_size"},
        {"\"name\": \"embed\",", "\"name\": \"embex\",", MFSDP_ERR_PARSE,
         "mfsdp.groups[0]: group 'embex', the manifest has 'embed'"},
        {"\"kind\": \"model\"", "\"kind\": \"optim\"", MFSDP_ERR_PARSE, "mfsdp.files[0]: expected"},
        /* a key with a newline (found by fuzz_ckpt_index): still a one-line message */
        {"\"momentum\": ", "\"mom\\ntum\": ", MFSDP_ERR_PARSE,
         "mfsdp.hparams: unknown key 'mom?tum'"},
        {"\"writer\": 0,\n    \"nsteps\": 0", "\"writer\": 0,\n    \"nsteps\": 1", MFSDP_ERR_PARSE,
         "].nsteps: expected an integer in [0, 0]"},
        {"\"requires_grad\": false", "\"requires_grad\": 0", MFSDP_ERR_PARSE,
         "mfsdp.manifest: manifest: groups[1].params[4].requires_grad"},
    };
    return cr_make_param_array(index_edit_t, cases, sizeof(cases) / sizeof(cases[0]));
}

/* Semantic edits with the digest recomputed: the structural checks refuse them. */
ParameterizedTest(index_edit_t *c, ckpt, index_structure)
{
    char *dir = make_ckpt("c", 2);
    char ipath[400];
    snprintf(ipath, sizeof(ipath), "%s/" MFSDP_CKPT_INDEX_NAME, dir);
    size_t len;
    char *text = slurp(ipath, &len);
    char *at = strstr(text, c->from);
    cr_assert_not_null(at, "'%s' not in the index:\n%s", c->from, text);
    size_t nf = strlen(c->from), nt = strlen(c->to);
    char *t = malloc(len + nt + 1);
    size_t head = (size_t)(at - text);
    memcpy(t, text, head);
    memcpy(t + head, c->to, nt);
    memcpy(t + head + nt, at + nf, len - head - nf);
    size_t tlen = len - nf + nt;
    redigest(t, tlen);
    char err[512] = "";
    mfsdp_ckpt_index_t *ix = NULL;
    mfsdp_status_t st = mfsdp_ckpt_index_parse(t, tlen, "idx", err, sizeof(err), &ix);
    cr_assert_eq(st, c->status, "%s -> %s: %s: %s", c->from, c->to, mfsdp_status_string(st), err);
    cr_assert(strstr(err, c->expect) != NULL, "expected '%s' in: %s", c->expect, err);
    cr_assert_null(strchr(err, '\n'), "one line: %s", err);
    free(t);
    free(text);
    free(dir);
}

/* ---- corrupted checkpoints ----------------------------------------------------------------- */

static void reseal(const char *root, const char *dir, const char *name)
{
    cr_assert_eq(ckpt_reseal(root, dir, name), 0, "%s", name);
}

static mfsdp_status_t verify_msg(const char *root, char *err, size_t errlen)
{
    memset(err, 0, errlen);
    return mfsdp_ckpt_verify(root, err, errlen);
}

Test(ckpt, every_flipped_byte_and_truncation_is_refused)
{
    char *dir = make_ckpt("c", 2);
    char *root = sub("c");
    char err[1024];
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "%s", err);
    const char *files[] = {"model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors",
                           "optim-00000-of-00002.safetensors", "optim-00001-of-00002.safetensors"};
    size_t tried = 0;
    for (int k = 0; k < 4; k++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", dir, files[k]);
        size_t len;
        char *orig = slurp(path, &len);
        /* every 7th byte, plus the first and last: the length field, the header, the data */
        for (size_t i = 0; i < len; i += (i == 0 ? 1 : 7)) {
            char *t = malloc(len);
            memcpy(t, orig, len);
            t[i] ^= 0x20;
            spit(path, t, len);
            mfsdp_status_t st = verify_msg(root, err, sizeof(err));
            cr_assert_eq(st, MFSDP_ERR_CHECKSUM, "%s byte %zu: %s (%s)", files[k], i,
                         mfsdp_status_string(st), err);
            cr_assert(strstr(err, files[k]) != NULL && strstr(err, "does not match the index"),
                      "%s", err);
            tried++;
            free(t);
        }
        /* truncated by one byte and to half */
        spit(path, orig, len - 1);
        cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_CHECKSUM);
        cr_assert(strstr(err, "the index says") != NULL && strstr(err, files[k]), "%s", err);
        spit(path, orig, len / 2);
        cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_CHECKSUM);
        /* missing */
        cr_assert_eq(unlink(path), 0);
        cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_NOT_FOUND);
        cr_assert(strstr(err, files[k]) != NULL && strstr(err, "incomplete"), "%s", err);
        spit(path, orig, len);
        cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "%s", err);
        free(orig);
    }
    cr_assert_gt(tried, 100);
    /* the index and latest */
    char ipath[512], lpath[512];
    snprintf(ipath, sizeof(ipath), "%s/" MFSDP_CKPT_INDEX_NAME, dir);
    snprintf(lpath, sizeof(lpath), "%s/latest", root);
    size_t ilen, llen;
    char *itext = slurp(ipath, &ilen), *ltext = slurp(lpath, &llen);
    for (size_t i = 0; i < ilen; i += 13) {
        itext[i] ^= 0x02;
        spit(ipath, itext, ilen);
        cr_assert_neq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "index byte %zu", i);
        cr_assert(strstr(err, MFSDP_CKPT_INDEX_NAME) != NULL, "%s", err);
        itext[i] ^= 0x02;
    }
    spit(ipath, itext, ilen);
    for (size_t i = 0; i < llen; i++) {
        ltext[i] ^= 0x04;
        spit(lpath, ltext, llen);
        cr_assert_neq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "latest byte %zu", i);
        ltext[i] ^= 0x04;
    }
    spit(lpath, ltext, llen);
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "%s", err);
    /* the index gone */
    cr_assert_eq(unlink(ipath), 0);
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_NOT_FOUND);
    cr_assert(strstr(err, "missing") != NULL, "%s", err);
    cr_assert_eq(verify_msg(dir, err, sizeof(err)), MFSDP_ERR_NOT_FOUND);
    cr_assert(strstr(err, "no checkpoint here") != NULL, "%s", err);
    free(itext);
    free(ltext);
    free(root);
    free(dir);
}

typedef struct header_edit {
    char file[48];
    char from[64]; /* in the header text; same length as `to` */
    char to[64];
    int status;
    char expect[120];
} header_edit_t;

ParameterizedTestParameters(ckpt, resealed_header)
{
    static header_edit_t cases[] = {
        /* a wrong dtype, a wrong shape (same byte count) */
        {"model-00000-of-00002.safetensors", "\"blocks.0.wq\":{\"dtype\":\"BF16\"",
         "\"blocks.0.wq\":{\"dtype\":\"F16\" ", MFSDP_ERR_MISMATCH,
         "tensor 'blocks.0.wq': dtype F16, expected BF16"},
        {"model-00000-of-00002.safetensors", "\"shape\":[24,16]", "\"shape\":[16,24]",
         MFSDP_ERR_MISMATCH, "tensor 'blocks.0.wq': shape [16, 24], expected [24, 16]"},
        {"optim-00001-of-00002.safetensors", "\"dtype\":\"F32\"", "\"dtype\":\"I32\"",
         MFSDP_ERR_MISMATCH, "dtype I32, expected F32"},
        /* not JSON, an unknown dtype, overlapping offsets (digits kept the same length) */
        {"model-00001-of-00002.safetensors", "{\"__metadata__\"", "[\"__metadata__\"",
         MFSDP_ERR_PARSE, "does not start with '{'"},
        {"model-00001-of-00002.safetensors", "\"dtype\":\"", "\"dtype\"x\"", MFSDP_ERR_PARSE,
         "not valid JSON"},
        {"optim-00000-of-00002.safetensors", "\"dtype\":\"F32\"", "\"dtype\":\"F31\"",
         MFSDP_ERR_PARSE, "unknown dtype 'F31'"},
        {"optim-00000-of-00002.safetensors", "\"data_offsets\":[912,", "\"data_offsets\":[911,",
         MFSDP_ERR_PARSE,
         "tensor 'embed.weight.exp_avg_sq': data_offsets [911, 1824] hold 913 "
         "bytes but shape x F32 needs 912"},
    };
    return cr_make_param_array(header_edit_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(header_edit_t *c, ckpt, resealed_header)
{
    char *dir = make_ckpt("c", 2);
    char *root = sub("c");
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, c->file);
    size_t len;
    char *b = slurp(path, &len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) {
        n = n << 8 | (unsigned char)b[i];
    }
    char *hdr = strndup(b + 8, (size_t)n);
    char *at = strstr(hdr, c->from);
    cr_assert_not_null(at, "'%s' not in %s", c->from, hdr);
    cr_assert_eq(strlen(c->from), strlen(c->to));
    memcpy(b + 8 + (at - hdr), c->to, strlen(c->to));
    spit(path, b, len);
    reseal(root, dir, c->file);
    char err[1024];
    mfsdp_status_t st = verify_msg(root, err, sizeof(err));
    cr_assert_eq(st, c->status, "%s: %s", mfsdp_status_string(st), err);
    cr_assert(strstr(err, c->expect) != NULL, "expected '%s' in: %s", c->expect, err);
    cr_assert(strstr(err, c->file) != NULL, "the message names the file: %s", err);
    free(hdr);
    free(b);
    free(root);
    free(dir);
}

Test(ckpt, resealed_huge_header_length_and_overlap)
{
    char *dir = make_ckpt("c", 2);
    char *root = sub("c");
    char path[512];
    const char *file = "model-00000-of-00002.safetensors";
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    size_t len;
    char *b = slurp(path, &len);
    char *orig = malloc(len);
    memcpy(orig, b, len);
    b[5] = 0x10; /* a header length of about 2^44 */
    spit(path, b, len);
    reseal(root, dir, file);
    char err[1024];
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, "exceeds the limit") != NULL && strstr(err, file), "%s", err);
    /* overlap: the second tensor's begin moved back by the first one's size, its end kept */
    memcpy(b, orig, len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) {
        n = n << 8 | (unsigned char)b[i];
    }
    char *hdr = strndup(b + 8, (size_t)n);
    mfsdp_st_header_t *h = NULL;
    cr_assert_eq(mfsdp_st_parse_buffer(b, len, "x", NULL, 0, &h), MFSDP_OK);
    cr_assert_geq(h->ntensors, 2);
    char from[64], to[64];
    snprintf(from, sizeof(from), "[%llu,%llu]", (unsigned long long)h->tensors[1].begin,
             (unsigned long long)h->tensors[1].end);
    /* [b,e] -> [b',e'] with the same digit counts and the same length e'-b' = e-b */
    uint64_t shift = h->tensors[1].begin / 2;
    snprintf(to, sizeof(to), "[%*llu,%*llu]",
             (int)snprintf(NULL, 0, "%llu", (unsigned long long)h->tensors[1].begin),
             (unsigned long long)(h->tensors[1].begin - shift),
             (int)snprintf(NULL, 0, "%llu", (unsigned long long)h->tensors[1].end),
             (unsigned long long)(h->tensors[1].end - shift));
    char *at = strstr(hdr, from);
    cr_assert_not_null(at, "%s in %s", from, hdr);
    cr_assert_eq(strlen(from), strlen(to), "%s %s", from, to);
    memcpy(b + 8 + (at - hdr), to, strlen(to));
    spit(path, b, len);
    reseal(root, dir, file);
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_PARSE, "%s", err);
    cr_assert(strstr(err, "overlap tensor") != NULL && strstr(err, file), "%s", err);
    mfsdp_st_header_free(h);
    free(hdr);
    free(orig);
    free(b);
    free(root);
    free(dir);
}

Test(ckpt, partial_and_stale_directories)
{
    char *dir = make_ckpt("c", 2);
    char *root = sub("c");
    char err[1024];
    /* a leftover partial directory is refused by readers and removed by the next save */
    char part[512];
    snprintf(part, sizeof(part), "%s/step-00000007.partial", root);
    cr_assert_eq(mkdir(part, 0755), 0);
    char f[600];
    snprintf(f, sizeof(f), "%s/model-00000-of-00002.safetensors.tmp", part);
    spit(f, "xx", 2);
    cr_assert_eq(verify_msg(part, err, sizeof(err)), MFSDP_ERR_STATE);
    cr_assert(strstr(err, "an interrupted save") != NULL, "%s", err);
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_OK, "%s", err);
    char name[MFSDP_CKPT_NAME_LEN];
    cr_assert_eq(mfsdp_ckpt_begin(root, 0, name, sizeof(name), err, sizeof(err)), MFSDP_OK);
    cr_assert_str_eq(name, "step-00000000-1", "step-00000000 exists: a new name");
    struct stat sb;
    cr_assert_neq(stat(part, &sb), 0, "the stale partial directory is gone");
    /* a partial directory holding something foreign is left alone */
    cr_assert_eq(mkdir(part, 0755), 0);
    snprintf(f, sizeof(f), "%s/notes.txt", part);
    spit(f, "mine", 4);
    cr_assert_eq(mfsdp_ckpt_begin(root, 3, name, sizeof(name), err, sizeof(err)), MFSDP_OK);
    cr_assert_str_eq(name, "step-00000003");
    cr_assert_eq(stat(f, &sb), 0, "foreign files are never removed");
    /* latest naming something that is not a checkpoint directory name */
    char lpath[512];
    snprintf(lpath, sizeof(lpath), "%s/latest", root);
    spit(lpath, "../x 0000000000000000000000000000000000000000000000000000000000000000\n", 70);
    cr_assert_eq(verify_msg(root, err, sizeof(err)), MFSDP_ERR_PARSE);
    cr_assert(strstr(err, "latest: damaged") != NULL, "%s", err);
    free(root);
    free(dir);
}
