/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libnccl-tuner-mfsdp.so as NCCL sees it: dlopen'ed, both entry points (v5 for NCCL 2.28,
 * v4 for 2.27) found with dlsym and driven through init / getCollInfo / finalize|destroy
 * with a logger that records what the plugin says. Every decision is checked the way
 * NCCL reads it: the lowest non-negative cell of the cost table wins, a non-zero channel
 * count overrides NCCL's. No GPU and no NCCL are needed.
 *
 * MFSDP_TUNER_SO (the built plugin), MFSDP_NM and MFSDP_READELF come from meson.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plugin/nccl_tuner_abi.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* ---- the fake NCCL logger ---- */

#define LOG_MAX 64
typedef struct log_entry {
    ncclDebugLogLevel level;
    unsigned long flags;
    char text[600];
} log_entry_t;
static log_entry_t log_entries[LOG_MAX];
static int log_count;

static void fake_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                        const char *fmt, ...)
{
    /* Tests that look at messages make few calls; the rest only need the logger to work. */
    if (log_count == LOG_MAX) {
        return;
    }
    log_entry_t *e = &log_entries[log_count++];
    e->level = level;
    e->flags = flags;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->text, sizeof(e->text), fmt, ap);
    va_end(ap);
}

static void log_reset(void)
{
    log_count = 0;
}

/* Messages containing `needle` (at any level). */
static int log_find(const char *needle, int *level_p)
{
    int n = 0;
    for (int i = 0; i < log_count; i++) {
        if (strstr(log_entries[i].text, needle) != NULL) {
            if (level_p != NULL) {
                *level_p = (int)log_entries[i].level;
            }
            n++;
        }
    }
    return n;
}

static void log_dump(void)
{
    for (int i = 0; i < log_count; i++) {
        cr_log_info("log[%d] level %d: %s", i, (int)log_entries[i].level, log_entries[i].text);
    }
}

/* ---- the plugin, through either ABI ---- */

enum { ABI_V4 = 0, ABI_V5 = 1 };
static const char *const abi_names[] = {"v4", "v5"};
static void *plugin_handle;
static const ncclTuner_v4_t *tuner_v4;
static const ncclTuner_v5_t *tuner_v5;

static void plugin_open(void)
{
    plugin_handle = dlopen(MFSDP_TUNER_SO, RTLD_NOW | RTLD_LOCAL);
    cr_assert_not_null(plugin_handle, "dlopen %s: %s", MFSDP_TUNER_SO, dlerror());
    tuner_v5 = dlsym(plugin_handle, "ncclTunerPlugin_v5");
    tuner_v4 = dlsym(plugin_handle, "ncclTunerPlugin_v4");
    cr_assert_not_null(tuner_v5, "dlsym ncclTunerPlugin_v5");
    cr_assert_not_null(tuner_v4, "dlsym ncclTunerPlugin_v4");
    unsetenv("MFSDP_TUNER_CONFIG");
    unsetenv("NCCL_ALGO");
    unsetenv("NCCL_PROTO");
    log_reset();
}

static void plugin_close(void)
{
    if (plugin_handle != NULL) {
        dlclose(plugin_handle);
    }
}

TestSuite(tuner, .init = plugin_open, .fini = plugin_close);

static ncclResult_t t_init(int abi, size_t nranks, size_t nnodes, void **ctx_p)
{
    if (abi == ABI_V5) {
        ncclNvlDomainInfo_v5_t nvl = {1, (int)nranks, (int)nranks};
        ncclTunerConstants_v5_t constants;
        memset(&constants, 0x3c, sizeof(constants));
        ncclTunerConstants_v5_t before = constants;
        ncclResult_t res =
            tuner_v5->init(ctx_p, 0x1234abcdULL, nranks, nnodes, fake_logger, &nvl, &constants);
        cr_expect(memcmp(&constants, &before, sizeof(constants)) == 0,
                  "v5 init leaves NCCL's tuning constants alone");
        return res;
    }
    return tuner_v4->init(nranks, nnodes, fake_logger, ctx_p);
}

static ncclResult_t t_get(int abi, void *ctx, ncclFunc_t coll, size_t nbytes, int pipe_ops,
                          float *table, int num_algo, int num_proto, int reg_buff, int *nchannels)
{
    /* NCCL passes its float[7][3] cast to float**. */
    if (abi == ABI_V5) {
        return tuner_v5->getCollInfo(ctx, coll, nbytes, pipe_ops, (float **)table, num_algo,
                                     num_proto, reg_buff, nchannels);
    }
    return tuner_v4->getCollInfo(ctx, coll, nbytes, pipe_ops, (float **)table, num_algo, num_proto,
                                 reg_buff, nchannels);
}

static ncclResult_t t_fini(int abi, void *ctx)
{
    return abi == ABI_V5 ? tuner_v5->finalize(ctx) : tuner_v4->destroy(ctx);
}

/* ---- cost tables as NCCL builds them ---- */

#define NA         NCCL_NUM_ALGORITHMS
#define NP         NCCL_NUM_PROTOCOLS
#define CELL(a, p) ((a)*NP + (p))

/* Broadcast/Reduce: NCCL fills the ring row only, everything else is ruled out. */
static void ring_only_table(float *t)
{
    for (int i = 0; i < NA * NP; i++) {
        t[i] = NCCL_ALGO_PROTO_IGNORE;
    }
    t[CELL(NCCL_ALGO_RING, NCCL_PROTO_LL)] = 31.5f;
    t[CELL(NCCL_ALGO_RING, NCCL_PROTO_LL128)] = 27.25f;
    t[CELL(NCCL_ALGO_RING, NCCL_PROTO_SIMPLE)] = 29.0f;
}

/* Any collective: distinct costs everywhere, a few cells ruled out. */
static void full_table(float *t, unsigned seed)
{
    for (int i = 0; i < NA * NP; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (seed >> 16) % 7 == 0 ? NCCL_ALGO_PROTO_IGNORE : 1.0f + (float)((seed >> 8) % 997);
    }
}

/* NCCL's selection (enqueue.cc topoGetAlgoInfo): the lowest non-negative cell. */
static int nccl_pick(const float *t, int *algo_p, int *proto_p)
{
    float best = 3600000000.0f;
    int found = 0;
    for (int a = 0; a < NA; a++) {
        for (int p = 0; p < NP; p++) {
            if (t[CELL(a, p)] >= 0.0f && t[CELL(a, p)] < best) {
                best = t[CELL(a, p)];
                *algo_p = a;
                *proto_p = p;
                found = 1;
            }
        }
    }
    return found;
}

/* The one cell the plugin changed: it must now be 0.0 and must not have been ruled out. */
static int changed_cell(const float *before, const float *after)
{
    int changed = -1;
    for (int i = 0; i < NA * NP; i++) {
        if (memcmp(&before[i], &after[i], sizeof(float)) != 0) {
            cr_assert_eq(changed, -1, "more than one cell changed (%d and %d)", changed, i);
            changed = i;
        }
    }
    if (changed >= 0) {
        cr_assert(before[changed] >= 0.0f, "cell %d was ruled out (%g) and was chosen", changed,
                  before[changed]);
        cr_assert(after[changed] == 0.0f, "cell %d set to %g, expected 0.0", changed,
                  after[changed]);
    }
    return changed;
}

/* ---- exports ---- */

static int read_lines(const char *cmd, char lines[][512], int max)
{
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen %s", cmd);
    int n = 0;
    char buf[512];
    while (fgets(buf, sizeof(buf), p) != NULL) {
        buf[strcspn(buf, "\n")] = '\0';
        if (buf[0] == '\0') {
            continue;
        }
        cr_assert_lt(n, max, "too many lines from %s (%s)", cmd, buf);
        snprintf(lines[n++], 512, "%s", buf);
    }
    cr_assert_eq(pclose(p), 0, "%s failed", cmd);
    return n;
}

Test(tuner, exports_exactly_the_two_entry_points)
{
    char lines[16][512];
    int n = read_lines(MFSDP_NM " -D --defined-only " MFSDP_TUNER_SO, lines, 16);
    for (int i = 0; i < n; i++) {
        cr_log_info("nm: %s", lines[i]);
    }
    cr_assert_eq(n, 2, "expected 2 defined dynamic symbols, found %d", n);
    int seen_v4 = 0, seen_v5 = 0;
    for (int i = 0; i < n; i++) {
        const char *name = strrchr(lines[i], ' ');
        cr_assert_not_null(name, "nm line '%s'", lines[i]);
        name++;
        seen_v4 += strcmp(name, "ncclTunerPlugin_v4") == 0;
        seen_v5 += strcmp(name, "ncclTunerPlugin_v5") == 0;
    }
    cr_expect_eq(seen_v4, 1);
    cr_expect_eq(seen_v5, 1);
}

Test(tuner, needs_only_libc)
{
    /* Inside NCCL nothing of libmfsdp (MPI, BLAS, jansson) may come along; sanitizer
     * runtimes appear only in sanitized builds. */
    char lines[16][512];
    int n = read_lines(MFSDP_READELF " -d " MFSDP_TUNER_SO " | grep NEEDED", lines, 16);
    cr_assert_gt(n, 0);
    for (int i = 0; i < n; i++) {
        cr_expect(strstr(lines[i], "[libc.so.6]") != NULL || strstr(lines[i], "[libasan.so") ||
                      strstr(lines[i], "[libubsan.so"),
                  "unexpected dependency: %s", lines[i]);
    }
}

Test(tuner, names_and_entry_points)
{
    cr_expect_str_eq(tuner_v5->name, "mfsdp");
    cr_expect_str_eq(tuner_v4->name, "mfsdp");
    cr_expect_not_null(tuner_v5->init);
    cr_expect_not_null(tuner_v5->getCollInfo);
    cr_expect_not_null(tuner_v5->finalize);
    cr_expect_not_null(tuner_v4->init);
    cr_expect_not_null(tuner_v4->getCollInfo);
    cr_expect_not_null(tuner_v4->destroy);
}

/* ---- the cost model (numbers worked by hand from docs/tuner.md) ---- */

typedef struct model_case {
    int coll;
    int nranks;
    int nnodes;
    size_t nbytes;
    int pipe_ops;
    int proto;
    int channels;
} model_case_t;

ParameterizedTestParameters(tuner, model)
{
    static model_case_t cases[] = {
        /* One node, 8 ranks: LL while the pieces are small (latency) ... */
        {ncclFuncBroadcast, 8, 1, 0, 1, NCCL_PROTO_LL, 1},
        {ncclFuncBroadcast, 8, 1, 64 * KiB, 1, NCCL_PROTO_LL, 1},
        {ncclFuncReduce, 8, 1, 256 * KiB, 1, NCCL_PROTO_LL, 1},
        /* ... LL128 from about 350 KiB per channel, a channel per 512 KiB ... */
        {ncclFuncBroadcast, 8, 1, 512 * KiB, 1, NCCL_PROTO_LL128, 1},
        {ncclFuncReduce, 8, 1, 1 * MiB, 1, NCCL_PROTO_LL128, 2},
        {ncclFuncBroadcast, 8, 1, 4 * MiB, 1, NCCL_PROTO_LL128, 8},
        /* ... Simple for large ops, at most the 16 channels that fill NVLink. */
        {ncclFuncBroadcast, 8, 1, 64 * MiB, 1, NCCL_PROTO_SIMPLE, 16},
        {ncclFuncReduce, 8, 1, SIZE_MAX, 1, NCCL_PROTO_SIMPLE, 16},
        /* Many ops per channel: fewer channels each, so bigger pieces. */
        {ncclFuncReduce, 8, 1, 4 * MiB, 4, NCCL_PROTO_SIMPLE, 2},
        {ncclFuncBroadcast, 8, 1, 64 * MiB, 64, NCCL_PROTO_SIMPLE, 1},
        {ncclFuncBroadcast, 8, 1, 64 * KiB, 8, NCCL_PROTO_LL, 1},
        /* Two ranks: a short ring, Simple's latency matters less. */
        {ncclFuncBroadcast, 2, 1, 4 * MiB, 1, NCCL_PROTO_SIMPLE, 8},
        /* Across nodes: network hops, and the NIC fills with 3 channels. */
        {ncclFuncBroadcast, 16, 2, 64 * KiB, 1, NCCL_PROTO_LL, 1},
        {ncclFuncReduce, 16, 2, 4 * MiB, 1, NCCL_PROTO_LL128, 3},
        {ncclFuncBroadcast, 16, 2, 256 * MiB, 1, NCCL_PROTO_SIMPLE, 3},
        /* 3 channels would move 60 GB/s, the NIC only 50: Simple (LL128 at 60). */
        {ncclFuncReduce, 16, 2, 16 * MiB, 1, NCCL_PROTO_SIMPLE, 3},
        /* 64 ranks: LL's low latency over 63 hops, but not at half the NIC's rate. */
        {ncclFuncBroadcast, 64, 8, 16 * MiB, 1, NCCL_PROTO_LL128, 3},
    };
    return cr_make_param_array(model_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(model_case_t *c, tuner, model)
{
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, (size_t)c->nranks, (size_t)c->nnodes, &ctx), ncclSuccess);
        float table[NA * NP], before[NA * NP];
        ring_only_table(table);
        memcpy(before, table, sizeof(table));
        int nch = 0;
        cr_assert_eq(
            t_get(abi, ctx, (ncclFunc_t)c->coll, c->nbytes, c->pipe_ops, table, NA, NP, 0, &nch),
            ncclSuccess);
        int changed = changed_cell(before, table);
        cr_assert_eq(changed, CELL(NCCL_ALGO_RING, c->proto),
                     "%s: %zu bytes, %d pipe ops, %d ranks, %d nodes: cell %d, expected ring/%d",
                     abi_names[abi], c->nbytes, c->pipe_ops, c->nranks, c->nnodes, changed,
                     c->proto);
        int algo = -1, proto = -1;
        cr_assert(nccl_pick(table, &algo, &proto));
        cr_expect_eq(algo, NCCL_ALGO_RING);
        cr_expect_eq(proto, c->proto);
        cr_expect_eq(nch, c->channels, "%s: %zu bytes, %d pipe ops: %d channels, expected %d",
                     abi_names[abi], c->nbytes, c->pipe_ops, nch, c->channels);
        cr_assert_eq(t_fini(abi, ctx), ncclSuccess);
    }
}

Test(tuner, many_pipe_ops_never_more_channels)
{
    /* Monotone in numPipeOps: more ops per channel never asks for more channels. */
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        for (size_t nbytes = 1; nbytes <= 1024 * MiB; nbytes *= 4) {
            int prev = 1 << 30;
            for (int ops = 1; ops <= 128; ops *= 2) {
                float table[NA * NP];
                ring_only_table(table);
                int nch = 0;
                cr_assert_eq(
                    t_get(abi, ctx, ncclFuncBroadcast, nbytes, ops, table, NA, NP, 0, &nch),
                    ncclSuccess);
                cr_assert(nch >= 1 && nch <= prev, "%zu bytes, %d ops: %d channels after %d",
                          nbytes, ops, nch, prev);
                prev = nch;
            }
        }
        t_fini(abi, ctx);
    }
}

Test(tuner, single_rank_untouched)
{
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 1, 1, &ctx), ncclSuccess);
        float table[NA * NP], before[NA * NP];
        ring_only_table(table);
        memcpy(before, table, sizeof(table));
        int nch = 0;
        t_get(abi, ctx, ncclFuncBroadcast, 4 * MiB, 1, table, NA, NP, 0, &nch);
        cr_expect(memcmp(table, before, sizeof(table)) == 0);
        cr_expect_eq(nch, 0);
        t_fini(abi, ctx);
    }
}

/* ---- everything that is not an owner segment is left to NCCL ---- */

Test(tuner, other_collectives_untouched)
{
    const ncclFunc_t others[] = {ncclFuncAllGather, ncclFuncReduceScatter, ncclFuncAllReduce,
                                 ncclFuncSendRecv,  ncclFuncSend,          ncclFuncRecv,
                                 ncclFuncAlltoAll,  ncclFuncScatter,       ncclFuncGather};
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        unsigned seed = 7;
        for (size_t k = 0; k < sizeof(others) / sizeof(others[0]); k++) {
            for (size_t nbytes = 0; nbytes <= 1024 * MiB; nbytes = nbytes * 8 + 1) {
                for (int ops = 1; ops <= 16; ops *= 4) {
                    float table[NA * NP], before[NA * NP];
                    full_table(table, seed++);
                    memcpy(before, table, sizeof(table));
                    int nch = 0x5a5a;
                    cr_assert_eq(
                        t_get(abi, ctx, others[k], nbytes, ops, table, NA, NP, ops & 1, &nch),
                        ncclSuccess);
                    cr_assert(memcmp(table, before, sizeof(table)) == 0,
                              "%s: coll %d %zu bytes: cost table changed", abi_names[abi],
                              (int)others[k], nbytes);
                    cr_assert_eq(nch, 0x5a5a, "%s: coll %d: nChannels written", abi_names[abi],
                                 (int)others[k]);
                }
            }
        }
        t_fini(abi, ctx);
    }
}

Test(tuner, ruled_out_cells_never_chosen)
{
    /* Every mask of the ring row (LL, LL128, Simple ruled out or not) over sizes, pipe ops,
     * rank and node counts: a ruled-out cell is never the winner; when the model's cell is
     * ruled out, the table and the channel count stay NCCL's. */
    const size_t shapes[][2] = {{2, 1}, {8, 1}, {16, 2}, {64, 8}};
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            void *ctx = NULL;
            cr_assert_eq(t_init(abi, shapes[s][0], shapes[s][1], &ctx), ncclSuccess);
            for (int mask = 0; mask < 8; mask++) {
                for (size_t nbytes = 0; nbytes <= 1024 * MiB; nbytes = nbytes * 2 + 1024) {
                    for (int ops = 1; ops <= 64; ops *= 8) {
                        float table[NA * NP], before[NA * NP], allowed[NA * NP];
                        ring_only_table(allowed);
                        ring_only_table(table);
                        for (int p = 0; p < NP; p++) {
                            if (mask & (1 << p)) {
                                table[CELL(NCCL_ALGO_RING, p)] = NCCL_ALGO_PROTO_IGNORE;
                            }
                        }
                        memcpy(before, table, sizeof(table));
                        int nch = 0;
                        cr_assert_eq(
                            t_get(abi, ctx, ncclFuncReduce, nbytes, ops, table, NA, NP, 0, &nch),
                            ncclSuccess);
                        int changed = changed_cell(before, table);
                        if (changed < 0) {
                            cr_assert_eq(nch, 0, "channels set without a protocol");
                            /* Same inputs with the full ring row: the model's pick is a
                             * ruled-out cell of this mask. */
                            int nch_all = 0;
                            t_get(abi, ctx, ncclFuncReduce, nbytes, ops, allowed, NA, NP, 0,
                                  &nch_all);
                            int algo = -1, proto = -1;
                            nccl_pick(allowed, &algo, &proto);
                            cr_assert(mask & (1 << proto), "untouched although ring/%d was allowed",
                                      proto);
                        } else {
                            cr_assert_gt(nch, 0);
                        }
                    }
                }
            }
            t_fini(abi, ctx);
        }
    }
}

Test(tuner, small_tables_untouched)
{
    /* Fewer algorithms or protocols than the model addresses: nothing to do safely. */
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        float table[NA * NP], before[NA * NP];
        for (int i = 0; i < NA * NP; i++) {
            table[i] = 5.0f + (float)i;
        }
        memcpy(before, table, sizeof(table));
        int nch = 0;
        t_get(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, table, 1, NP, 0, &nch);
        t_get(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, table, NA, 2, 0, &nch);
        t_get(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, NULL, NA, NP, 0, &nch);
        t_get(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, table, NA, NP, 0, NULL);
        t_get(abi, NULL, ncclFuncBroadcast, 64 * KiB, 1, table, NA, NP, 0, &nch);
        cr_expect(memcmp(table, before, sizeof(table)) == 0);
        cr_expect_eq(nch, 0);
        t_fini(abi, ctx);
        cr_expect_eq(t_fini(abi, NULL), ncclSuccess);
    }
}

/* ---- NCCL_ALGO / NCCL_PROTO: defer ---- */

typedef struct env_case {
    char name[16];
    char value[16];
} env_case_t;

ParameterizedTestParameters(tuner, defers_to_nccl_env)
{
    static env_case_t cases[] = {
        {"NCCL_ALGO", "ring"},
        {"NCCL_PROTO", "simple"},
        {"NCCL_PROTO", "^LL128"},
    };
    return cr_make_param_array(env_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

static char tmp_dir[64];

static void write_file(const char *path, const char *text, size_t len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "fopen %s", path);
    cr_assert_eq(fwrite(text, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}

/* A config file in a fresh directory, named by MFSDP_TUNER_CONFIG. */
static const char *use_config(const char *text, size_t len)
{
    static char path[128];
    snprintf(tmp_dir, sizeof(tmp_dir), "/tmp/mfsdp-tuner-XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_dir));
    snprintf(path, sizeof(path), "%s/tuner.csv", tmp_dir);
    write_file(path, text, len);
    setenv("MFSDP_TUNER_CONFIG", path, 1);
    return path;
}

static void drop_config(const char *path)
{
    unlink(path);
    rmdir(tmp_dir);
    unsetenv("MFSDP_TUNER_CONFIG");
}

ParameterizedTest(env_case_t *c, tuner, defers_to_nccl_env)
{
    /* A config row that would match, to show it is off too. */
    static const char rows[] = "broadcast,-1,-1,ring,ll,4,-1,-1\n";
    const char *path = use_config(rows, sizeof(rows) - 1);
    setenv(c->name, c->value, 1);
    char needle[40];
    snprintf(needle, sizeof(needle), "%s=%s", c->name, c->value);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        const ncclFunc_t colls[] = {ncclFuncBroadcast, ncclFuncReduce, ncclFuncAllReduce};
        for (size_t k = 0; k < 3; k++) {
            for (size_t nbytes = 1; nbytes <= 256 * MiB; nbytes *= 16) {
                float table[NA * NP], before[NA * NP];
                ring_only_table(table);
                memcpy(before, table, sizeof(table));
                int nch = 0;
                cr_assert_eq(t_get(abi, ctx, colls[k], nbytes, 1, table, NA, NP, 0, &nch),
                             ncclSuccess);
                cr_assert(memcmp(table, before, sizeof(table)) == 0, "%s: table changed",
                          abi_names[abi]);
                cr_assert_eq(nch, 0);
            }
        }
        int level = -1;
        cr_expect_eq(log_find(needle, &level), 1, "%s: deferral logged once", abi_names[abi]);
        cr_expect_eq(level, NCCL_LOG_INFO);
        /* the rows the user gave are dropped: a warning, to every subsystem */
        cr_expect_eq(log_find("the 1 rows of", &level), 1);
        cr_expect_eq(level, NCCL_LOG_WARN);
        t_fini(abi, ctx);
    }
    drop_config(path);
}

/* NCCL treats an empty NCCL_ALGO / NCCL_PROTO as unset (every algorithm stays enabled): so
 * does the plugin, whose rows keep applying. */
Test(tuner, empty_nccl_env_is_unset)
{
    static const char rows[] = "broadcast,-1,-1,ring,ll,4,-1,-1\n";
    const char *path = use_config(rows, sizeof(rows) - 1);
    setenv("NCCL_PROTO", "", 1);
    setenv("NCCL_ALGO", "", 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        float table[NA * NP];
        ring_only_table(table);
        int nch = 0;
        cr_assert_eq(t_get(abi, ctx, ncclFuncBroadcast, 4 * MiB, 1, table, NA, NP, 0, &nch),
                     ncclSuccess);
        cr_expect_eq(table[CELL(NCCL_ALGO_RING, NCCL_PROTO_LL)], 0.0f, "%s: row not applied",
                     abi_names[abi]);
        cr_expect_eq(nch, 4);
        t_fini(abi, ctx);
    }
    unsetenv("NCCL_PROTO");
    unsetenv("NCCL_ALGO");
    drop_config(path);
}

/* ---- MFSDP_TUNER_CONFIG rows ---- */

static const char good_config[] = "# mfsdp tuner overrides\n"                          /* 1 */
                                  "\n"                                                 /* 2 */
                                  "  broadcast, 0, 1048576, ring, simple, 3, -1, -1\n" /* 3 */
                                  "broadcast,0,-1,ring,ll,5,-1,-1\r\n"                 /* 4: CRLF */
                                  "allreduce,0,65536,tree,ll,2,1,8,-1,1\n"             /* 5 */
                                  "   # indented comment\n"                            /* 6 */
                                  "allgather,1024,-1,pat,simple,-1,-1,-1,2\n"          /* 7 */
                                  "reduce,0,-1,RING,LL128,0,2,-1\n" /* 8: names in any case */
                                  "\t\n";                           /* 9: blank */

typedef struct expect_pick {
    int changed; /* cell index, or -1: untouched */
    int nch;     /* channel count after the call (0: NCCL's own) */
} expect_pick_t;

static expect_pick_t run_one(int abi, void *ctx, ncclFunc_t coll, size_t nbytes, int ops,
                             int reg_buff, float *table, int num_algo)
{
    float before[NA * NP];
    memcpy(before, table, sizeof(before));
    int nch = 0;
    cr_assert_eq(t_get(abi, ctx, coll, nbytes, ops, table, num_algo, NP, reg_buff, &nch),
                 ncclSuccess);
    expect_pick_t r = {changed_cell(before, table), nch};
    return r;
}

Test(tuner, config_rows_applied)
{
    const char *path = use_config(good_config, sizeof(good_config) - 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        cr_expect_eq(log_find("5 config rows", NULL), 1, "init reports the rows read");
        float t[NA * NP];
        expect_pick_t r;

        /* Line 3 beats the model (which would say LL) for a small broadcast. */
        ring_only_table(t);
        r = run_one(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_RING, NCCL_PROTO_SIMPLE));
        cr_expect_eq(r.nch, 3);
        /* Above line 3's range, line 4. */
        ring_only_table(t);
        r = run_one(abi, ctx, ncclFuncBroadcast, 4 * MiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_RING, NCCL_PROTO_LL));
        cr_expect_eq(r.nch, 5);
        /* Line 3's cell ruled out by NCCL: the next matching row (line 4) applies. */
        ring_only_table(t);
        t[CELL(NCCL_ALGO_RING, NCCL_PROTO_SIMPLE)] = NCCL_ALGO_PROTO_IGNORE;
        r = run_one(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_RING, NCCL_PROTO_LL));
        cr_expect_eq(r.nch, 5);
        /* Both ruled out, no further row: the model, whose LL is ruled out: NCCL's. */
        ring_only_table(t);
        t[CELL(NCCL_ALGO_RING, NCCL_PROTO_SIMPLE)] = NCCL_ALGO_PROTO_IGNORE;
        t[CELL(NCCL_ALGO_RING, NCCL_PROTO_LL)] = NCCL_ALGO_PROTO_IGNORE;
        r = run_one(abi, ctx, ncclFuncBroadcast, 64 * KiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, -1);
        cr_expect_eq(r.nch, 0);

        /* Line 5: allreduce, 1 node, 8 ranks, registered buffers only. */
        full_table(t, 11);
        t[CELL(NCCL_ALGO_TREE, NCCL_PROTO_LL)] = 40.0f;
        r = run_one(abi, ctx, ncclFuncAllReduce, 4096, 3, 1, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_TREE, NCCL_PROTO_LL));
        cr_expect_eq(r.nch, 2);
        full_table(t, 11);
        r = run_one(abi, ctx, ncclFuncAllReduce, 4096, 3, 0, t, NA);
        cr_expect_eq(r.changed, -1, "regBuff 0 does not match line 5; allreduce has no model");
        cr_expect_eq(r.nch, 0);
        full_table(t, 11);
        r = run_one(abi, ctx, ncclFuncAllReduce, 65537, 3, 1, t, NA);
        cr_expect_eq(r.changed, -1, "above line 5's max_bytes");

        /* Line 7: allgather with numPipeOps 2 only; channels -1 keeps NCCL's. */
        full_table(t, 12);
        t[CELL(NCCL_ALGO_PAT, NCCL_PROTO_SIMPLE)] = 3.0f;
        r = run_one(abi, ctx, ncclFuncAllGather, 2048, 2, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_PAT, NCCL_PROTO_SIMPLE));
        cr_expect_eq(r.nch, 0);
        full_table(t, 12);
        r = run_one(abi, ctx, ncclFuncAllGather, 2048, 1, 0, t, NA);
        cr_expect_eq(r.changed, -1);
        full_table(t, 12);
        r = run_one(abi, ctx, ncclFuncAllGather, 512, 2, 0, t, NA);
        cr_expect_eq(r.changed, -1, "below line 7's min_bytes");
        /* PAT (index 6) beyond a 6-algorithm table: the row is skipped, never written. */
        full_table(t, 12);
        float before[NA * NP];
        memcpy(before, t, sizeof(t));
        int nch = 0;
        t_get(abi, ctx, ncclFuncAllGather, 2048, 2, t, 6, NP, 0, &nch);
        cr_expect(memcmp(t, before, sizeof(t)) == 0);
        cr_expect_eq(nch, 0);

        /* Line 8 wants 2 nodes: on this 1-node communicator the model decides a reduce. */
        ring_only_table(t);
        r = run_one(abi, ctx, ncclFuncReduce, 64 * KiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_RING, NCCL_PROTO_LL));
        cr_expect_eq(r.nch, 1);
        t_fini(abi, ctx);

        /* On 2 nodes line 8 applies, channels 0 keeps NCCL's. */
        cr_assert_eq(t_init(abi, 16, 2, &ctx), ncclSuccess);
        ring_only_table(t);
        r = run_one(abi, ctx, ncclFuncReduce, 64 * KiB, 1, 0, t, NA);
        cr_expect_eq(r.changed, CELL(NCCL_ALGO_RING, NCCL_PROTO_LL128));
        cr_expect_eq(r.nch, 0);
        t_fini(abi, ctx);
    }
    drop_config(path);
}

Test(tuner, empty_config_variable_is_unset)
{
    setenv("MFSDP_TUNER_CONFIG", "", 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        cr_expect_eq(log_find("0 config rows", NULL), 1);
        t_fini(abi, ctx);
        log_reset();
    }
}

Test(tuner, comments_only_config)
{
    static const char text[] = "# nothing yet\n\n   \n";
    const char *path = use_config(text, sizeof(text) - 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        cr_expect_eq(log_find("0 config rows from", NULL), 1);
        t_fini(abi, ctx);
        log_reset();
    }
    drop_config(path);
}

Test(tuner, logs_through_nccl_logger_only)
{
    /* Every message goes to NCCL's logger under NCCL_TUNING, lowercase after the prefix. */
    const char *path = use_config(good_config, sizeof(good_config) - 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_assert_eq(t_init(abi, 8, 1, &ctx), ncclSuccess);
        float t[NA * NP];
        ring_only_table(t);
        run_one(abi, ctx, ncclFuncBroadcast, 4 * MiB, 1, 0, t, NA);
        ring_only_table(t);
        run_one(abi, ctx, ncclFuncReduce, 4 * MiB, 1, 0, t, NA);
        t_fini(abi, ctx);
        cr_assert_geq(log_count, 3);
        for (int i = 0; i < log_count; i++) {
            cr_expect_eq(log_entries[i].flags, (unsigned long)NCCL_TUNING);
            cr_expect(strncmp(log_entries[i].text, "mfsdp tuner: ", 13) == 0, "%s",
                      log_entries[i].text);
            char first = log_entries[i].text[13];
            cr_expect(!(first >= 'A' && first <= 'Z') ||
                          strncmp(log_entries[i].text + 13, "NCCL_", 5) == 0,
                      "lowercase: %s", log_entries[i].text);
        }
        cr_expect_eq(log_find("config line 4 -> ring/ll, channels 5", NULL), 1);
        cr_expect_eq(
            log_find("reduce 4194304 bytes pipeOps 1: model -> ring/ll128, channels 8", NULL), 1);
    }
    drop_config(path);
    /* A NULL logger is allowed (NCCL always passes one; nothing may crash without it). */
    void *ctx = NULL;
    cr_assert_eq(tuner_v4->init(8, 1, NULL, &ctx), ncclSuccess);
    float t[NA * NP];
    ring_only_table(t);
    int nch = 0;
    cr_expect_eq(
        tuner_v4->getCollInfo(ctx, ncclFuncBroadcast, MiB, 1, (float **)t, NA, NP, 0, &nch),
        ncclSuccess);
    cr_expect_gt(nch, 0);
    cr_expect_eq(tuner_v4->destroy(ctx), ncclSuccess);
}

/* ---- bad config files stop init ---- */

typedef struct bad_line {
    char line[96];
    char expect[80];
} bad_line_t;

ParameterizedTestParameters(tuner, bad_config_line)
{
    static bad_line_t cases[] = {
        {"gather,0,1,ring,simple,-1,-1,-1", "unknown collective 'gather'"},
        {"sendrecv,0,1,ring,simple,-1,-1,-1", "unknown collective 'sendrecv'"},
        {"broadcast,0,1,chain,simple,-1,-1,-1", "unknown algorithm 'chain'"},
        {"broadcast,0,1,ring,ll64,-1,-1,-1", "unknown protocol 'll64'"},
        {"broadcast,zero,1,ring,simple,-1,-1,-1", "min_bytes 'zero' is not a byte count"},
        {"broadcast,,1,ring,simple,-1,-1,-1", "min_bytes '' is not a byte count"},
        {"broadcast,0,1k,ring,simple,-1,-1,-1", "max_bytes '1k' is not a byte count"},
        {"broadcast,0,-2,ring,simple,-1,-1,-1", "max_bytes '-2' is not a byte count"},
        {"broadcast,0,99999999999999999999999,ring,simple,-1,-1,-1", "max_bytes '9999"},
        {"broadcast,10,5,ring,simple,-1,-1,-1", "min_bytes 10 > max_bytes 5"},
        {"broadcast,0,1,ring,simple,-1,-1", "expected 8 to 10 comma-separated fields"},
        {"broadcast,0,1,ring,simple,-1,-1,-1,1,1,9", "found 11"},
        {"broadcast 0 1 ring simple -1 -1 -1", "found 1"},
        {"broadcast,0,1,ring,simple,65,-1,-1", "channels '65' is not -1 or 0..64"},
        {"broadcast,0,1,ring,simple,two,-1,-1", "channels 'two'"},
        {"broadcast,0,1,ring,simple,-1,0,-1", "nNodes '0' is not -1 or a positive integer"},
        {"broadcast,0,1,ring,simple,-1,-1,-3", "nRanks '-3' is not -1 or a positive"},
        {"broadcast,0,1,ring,simple,-1,-1,-1,x", "numPipeOps 'x'"},
        {"broadcast,0,1,ring,simple,-1,-1,-1,-1,2", "regBuff '2' is not -1, 0 or 1"},
        {"broadcast,0,1,ring,simple,-1,-1,-1 # why", "nRanks '-1 # why'"},
    };
    return cr_make_param_array(bad_line_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(bad_line_t *c, tuner, bad_config_line)
{
    /* Line 1 good, line 2 a comment, line 3 the bad one, line 4 good again. */
    char text[512];
    int len = snprintf(text, sizeof(text),
                       "broadcast,0,-1,ring,simple,-1,-1,-1\n# comment\n%s\n"
                       "reduce,0,-1,ring,ll,-1,-1,-1\n",
                       c->line);
    const char *path = use_config(text, (size_t)len);
    char where[160];
    snprintf(where, sizeof(where), "%s:3: ", path);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = (void *)&ctx;
        cr_expect_eq(t_init(abi, 8, 1, &ctx), ncclInvalidUsage, "%s: '%s' accepted", abi_names[abi],
                     c->line);
        cr_expect_eq(ctx, (void *)&ctx, "context written on failure");
        int level = -1;
        int n = log_find(where, &level);
        if (n != 1 || log_find(c->expect, NULL) != 1) {
            log_dump();
        }
        cr_expect_eq(n, 1, "%s: message names %s", abi_names[abi], where);
        cr_expect_eq(level, NCCL_LOG_WARN);
        cr_expect_eq(log_find(c->expect, NULL), 1, "%s: message says '%s'", abi_names[abi],
                     c->expect);
    }
    drop_config(path);
}

Test(tuner, nul_byte_in_config)
{
    static const char text[] = "broadcast,0,-1,ring,simple,-1,-1,-1\nreduce,0\0,1\n";
    const char *path = use_config(text, sizeof(text) - 1);
    char where[160];
    snprintf(where, sizeof(where), "%s:2: line contains a NUL byte", path);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_expect_eq(t_init(abi, 8, 1, &ctx), ncclInvalidUsage);
        cr_expect_eq(log_find(where, NULL), 1);
    }
    drop_config(path);
}

Test(tuner, missing_config_file)
{
    setenv("MFSDP_TUNER_CONFIG", "/nonexistent/mfsdp-tuner.csv", 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_expect_eq(t_init(abi, 8, 1, &ctx), ncclSystemError);
        cr_expect_null(ctx);
        int level = -1;
        cr_expect_eq(log_find("cannot open MFSDP_TUNER_CONFIG file "
                              "'/nonexistent/mfsdp-tuner.csv': No such file or directory",
                              &level),
                     1);
        cr_expect_eq(level, NCCL_LOG_WARN);
        /* warnings go to every subsystem: NCCL drops a message whose flags miss
         * NCCL_DEBUG_SUBSYS, which by default lacks TUNING */
        for (int i = 0; i < log_count; i++) {
            if (log_entries[i].level == NCCL_LOG_WARN) {
                cr_expect_eq(log_entries[i].flags, ~0UL);
            }
        }
    }
}

Test(tuner, config_is_a_directory)
{
    /* fopen succeeds on a directory, the first read fails. */
    setenv("MFSDP_TUNER_CONFIG", "/tmp", 1);
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        void *ctx = NULL;
        cr_expect_eq(t_init(abi, 8, 1, &ctx), ncclSystemError);
        cr_expect_null(ctx);
        cr_expect_eq(log_find("error reading /tmp after line 0: Is a directory", NULL), 1);
    }
}

Test(tuner, init_without_context_pointer)
{
    for (int abi = ABI_V4; abi <= ABI_V5; abi++) {
        log_reset();
        cr_expect_eq(t_init(abi, 8, 1, NULL), ncclInvalidArgument);
        cr_expect_eq(log_find("init called without a context pointer", NULL), 1);
    }
}
