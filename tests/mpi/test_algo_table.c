/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The measured algorithm table (MFSDP_ALGO_TABLE) in a context, under mpirun at 2..4 ranks.
 * Two groups, a small one (192 bytes gathered) and a large one (24 960 bytes), and a table
 * whose rows send the small group's all-gather to chain and the large group's reduce to
 * native; each rank writes it to its own path (paths may differ, the rows are agreed):
 *   test_algo_table pick      the groups run the table's algorithms (and the built-in rule
 *                             where no row matches); the context reports "auto" (mixed);
 *                             every all-gather equals MPI_Allgather of the same shards and
 *                             every owner's reduced gradient is the exact sum
 *   test_algo_table override  MFSDP_GATHER_ALGO=native wins over the table's all-gather rows
 *   test_algo_table bad       a bad row on every rank: MFSDP_ERR_CONFIG everywhere, the message
 *                             names the file's line
 *   test_algo_table mismatch  the last rank's table says otherwise: MFSDP_ERR_MISMATCH on
 *                             every rank, naming MFSDP_ALGO_TABLE
 *   test_algo_table rewritten the last rank's table is rewritten between the settings
 *                             agreement's read and the set-up's (fopen is wrapped at link
 *                             time: its second open of the table rewrites the file first): the
 *                             rows agreed, the ranks resolve different algorithms,
 *                             MFSDP_ERR_MISMATCH on every rank instead of a hang
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mfsdp/runtime_mpi.h"
#include "tests/lib/mpi_check.h"

static int g_checked; /* owners' gradients checked on this rank */

static const char *manifest_text =
    "{\"format\": \"mfsdp-manifest/1\", \"groups\": ["
    "{\"name\": \"small\", \"params\": [{\"name\": \"a.w\", \"shape\": [12, 4], \"dtype\": "
    "\"float32\"}]},"
    "{\"name\": \"large\", \"params\": [{\"name\": \"b.w\", \"shape\": [96, 64], \"dtype\": "
    "\"float32\"}, {\"name\": \"b.v\", \"shape\": [96, 32], \"dtype\": \"float32\"}]}]}";

static const char *table_text = "coll,nranks,min_bytes,max_bytes,algo\n"
                                "allgather,-1,0,4095,chain\n"
                                "reducescatter,-1,4096,-1,native\n";

/* The "rewritten" mode's fopen (-Wl,--wrap; the library is linked in statically, and with
 * large-file support its calls are to fopen64): the second open of g_rewrite finds other rows
 * in it. Default visibility, as test_steady's wrappers. */
static const char *g_rewrite;
static int g_table_opens;

FILE *__real_fopen(const char *path, const char *mode);
FILE *__real_fopen64(const char *path, const char *mode);
__attribute__((visibility("default"))) FILE *__wrap_fopen(const char *path, const char *mode);
__attribute__((visibility("default"))) FILE *__wrap_fopen64(const char *path, const char *mode);

static void rewrite_on_second_open(const char *path)
{
    if (g_rewrite != NULL && strcmp(path, g_rewrite) == 0 && ++g_table_opens == 2) {
        FILE *f = __real_fopen(path, "w");
        if (f != NULL) {
            fputs("allgather,-1,0,-1,native\nreducescatter,-1,0,-1,chain\n", f);
            fclose(f);
        }
    }
}

FILE *__wrap_fopen(const char *path, const char *mode)
{
    rewrite_on_second_open(path);
    return __real_fopen(path, mode);
}

FILE *__wrap_fopen64(const char *path, const char *mode)
{
    rewrite_on_second_open(path);
    return __real_fopen64(path, mode);
}

/* Create the context with stderr captured: *log_p is what the library said. */
static int g_fixed; /* the code fixes both algorithms (mfsdp_ctx_opts_t) */

static mfsdp_status_t create(const mfsdp_manifest_t *m, mfsdp_ctx_h *ctx, const char **log_p)
{
    mfsdp_ctx_opts_t opts = {.has_step_mode = 1, .step_mode = MFSDP_STEP_MANUAL};
    if (g_fixed) {
        opts.gather_algo = opts.reduce_algo = MFSDP_ALGO_DIRECT;
    }
    capture_begin();
    mfsdp_status_t st = mfsdp_ctx_create_mpi(m, &opts, MPI_COMM_WORLD, ctx);
    *log_p = capture_end();
    return st;
}

/* Rank r's value of element e of block j: small integers, exact in fp32 sums. */
static float val(int r, int j, size_t e)
{
    return (float)((int)((7 * e + 13 * (size_t)r + 5 * (size_t)j) % 17) - 8);
}

/* One all-gather and one reduce of every group, checked element by element. */
static void run_groups(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        /* FSDP's per-rank block of the group: the params' shards (c rows each), padded. */
        size_t S = 0;
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            size_t c = (size_t)((p->shape[0] + g_world - 1) / g_world);
            S += c * (size_t)p->shape[1];
        }
        size_t n = (size_t)g_world;
        float *send = calloc(S, sizeof(float));
        float *out = calloc(S * n, sizeof(float));
        float *want = calloc(S * n, sizeof(float));
        float *rsin = calloc(S * n, sizeof(float));
        float *rsout = calloc(S, sizeof(float));
        size_t o = 0;
        for (size_t i = 0; i < m->groups[g].nparams; i++) { /* real rows only: padding is 0 */
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            size_t R = (size_t)p->shape[1], c = (size_t)((p->shape[0] + g_world - 1) / g_world);
            for (size_t e = 0; e < c * R; e++) {
                int real = (size_t)g_rank * c + e / R < (size_t)p->shape[0];
                send[o + e] = real ? val(g_rank, 0, o + e) : 0.0f;
                for (size_t j = 0; j < n; j++) {
                    int realj = j * c + e / R < (size_t)p->shape[0];
                    rsin[j * S + o + e] = realj ? val(g_rank, (int)j + 1, o + e) : 0.0f;
                }
            }
            o += c * R;
        }
        MPI_Allgather(send, (int)S, MPI_FLOAT, want, (int)S, MPI_FLOAT, MPI_COMM_WORLD);
        for (int k = 0; k < 2; k++) { /* the first takes the weights, the second sends them */
            memset(out, 0xff, S * n * sizeof(float));
            mfsdp_status_t st = mfsdp_ctx_allgather(ctx, g, send, out, S, MFSDP_FLOAT32);
            CHECK(st == MFSDP_OK, "all-gather %d of group %zu: %s", k, g, mfsdp_status_string(st));
            size_t wrong = 0;
            for (size_t e = 0; e < S * n; e++) {
                wrong += memcmp(&out[e], &want[e], sizeof(float)) != 0;
            }
            CHECK(wrong == 0, "all-gather %d of group %zu: %zu wrong elements", k, g, wrong);
        }
        mfsdp_status_t st =
            mfsdp_ctx_reduce(ctx, g, rsin, rsout, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0);
        CHECK(st == MFSDP_OK, "reduce of group %zu: %s", g, mfsdp_status_string(st));
        o = 0;
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            size_t R = (size_t)p->shape[1], c = (size_t)((p->shape[0] + g_world - 1) / g_world);
            mfsdp_param_view_t v;
            CHECK(mfsdp_ctx_get_param(ctx, p->name, &v) == MFSDP_OK, "view of %s", p->name);
            if (v.local && v.owner == g_rank && v.grad != NULL) { /* the owner: whole tensor */
                size_t wrong = 0;
                for (size_t x = 0; x < (size_t)p->shape[0] * R; x++) {
                    size_t j = x / (c * R), e = o + x % (c * R);
                    float sum = 0.0f;
                    for (int r = 0; r < g_world; r++) {
                        sum += val(r, (int)j + 1, e);
                    }
                    wrong += v.grad[x] != sum;
                }
                CHECK(wrong == 0, "reduced gradient of %s: %zu wrong elements", p->name, wrong);
                g_checked++;
            }
            o += c * R;
        }
        free(send);
        free(out);
        free(want);
        free(rsin);
        free(rsout);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    const char *mode = argc > 1 ? argv[1] : "pick";
    int last = g_rank == g_world - 1;
    setenv("MFSDP_MLOCK", "0", 1);
    setenv("MFSDP_TAIL", "owner", 1);
    if (strcmp(mode, "override") == 0) {
        setenv("MFSDP_GATHER_ALGO", "native", 1);
    }
    /* Each rank its own file: the content is what must agree. In the temporary directory, not
     * the working one: a run killed before its unlink (by hand, from a source tree) leaves
     * nothing where it could be committed. */
    const char *tmp =
        getenv("TMPDIR") != NULL && getenv("TMPDIR")[0] != '\0' ? getenv("TMPDIR") : "/tmp";
    char path[512];
    snprintf(path, sizeof(path), "%s/test_algo_table.%d.%d.csv", tmp, (int)getpid(), g_rank);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int bad_fixed = strcmp(mode, "bad_fixed") == 0; /* both algorithms fixed in code */
    if (strcmp(mode, "bad") == 0 || bad_fixed) {
        fputs("coll,nranks,min_bytes,max_bytes,algo\nallgather,-1,0,-1,ring\n", f);
        g_fixed = bad_fixed;
    } else if (strcmp(mode, "mismatch") == 0 && last) {
        fputs("allgather,-1,0,-1,native\n", f);
    } else {
        fputs(table_text, f);
    }
    fclose(f);
    setenv("MFSDP_ALGO_TABLE", path, 1);
    int rewritten = strcmp(mode, "rewritten") == 0;
    if (rewritten && last) {
        g_rewrite = path;
    }

    mfsdp_manifest_t *m = NULL;
    char err[256];
    if (mfsdp_manifest_parse(manifest_text, strlen(manifest_text), "inline", err, sizeof(err),
                             &m) != MFSDP_OK) {
        fprintf(stderr, "parse: %s\n", err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    mfsdp_ctx_h ctx = NULL;
    const char *log = "";
    mfsdp_status_t st = create(m, &ctx, &log);
    if (strcmp(mode, "bad") == 0 || bad_fixed) {
        /* refused even when no group needs the table: named, so it is checked */
        CHECK(st == MFSDP_ERR_CONFIG, "bad table: %s", mfsdp_status_string(st));
        CHECK(strstr(log, "line 2: algorithm 'ring'") != NULL, "message: %s", log);
    } else if (strcmp(mode, "mismatch") == 0) {
        CHECK(st == MFSDP_ERR_MISMATCH, "mismatch: %s", mfsdp_status_string(st));
        CHECK(strstr(log, "MFSDP_ALGO_TABLE (its rows) differs across ranks") != NULL,
              "message: %s", log);
    } else if (rewritten) {
        CHECK(st == MFSDP_ERR_MISMATCH, "rewritten: %s", mfsdp_status_string(st));
        CHECK(strstr(log, "MFSDP_ALGO_TABLE (its rows) differs") == NULL, "the rows agreed: %s",
              log);
        CHECK(strstr(log, "resolved different collective algorithms") != NULL, "message: %s", log);
        /* the first group that differs and what each rank resolved for it */
        char others[64], last_rank[160];
        snprintf(others, sizeof(others), "' on rank%s, ",
                 g_world > 2 ? "s 0-1" : " 0"); /* up to 3 ranks in the meson cases */
        snprintf(last_rank, sizeof(last_rank),
                 "'ag native 1048576, rs chain 1048576' on rank %d; was MFSDP_ALGO_TABLE "
                 "rewritten",
                 g_world - 1);
        const char *d = strstr(log, "group small: the algorithms and chunks (all-gather, reduce) "
                                    "resolved differs across ranks: 'ag chain 1048576, rs direct ");
        CHECK(d != NULL && strstr(d, others) != NULL && strstr(d, last_rank) != NULL &&
                  strstr(log, "every rank must run") == NULL,
              "per-rank detail: %s", log);
        CHECK(!last || g_table_opens == 2, "the table was opened %d times, expected 2",
              g_table_opens);
    } else {
        CHECK(st == MFSDP_OK, "create: %s\n%s", mfsdp_status_string(st), log);
    }
    if (st == MFSDP_OK) {
        int override = strcmp(mode, "override") == 0;
        mfsdp_algo_t want_g[2] = {override ? MFSDP_ALGO_NATIVE : MFSDP_ALGO_CHAIN,
                                  override ? MFSDP_ALGO_NATIVE : MFSDP_ALGO_DIRECT};
        mfsdp_algo_t want_r[2] = {MFSDP_ALGO_DIRECT, MFSDP_ALGO_NATIVE};
        for (size_t g = 0; g < 2; g++) {
            mfsdp_algo_t ga, ra;
            CHECK(mfsdp_ctx_group_algos(ctx, g, &ga, &ra) == MFSDP_OK, "group_algos");
            CHECK(ga == want_g[g] && ra == want_r[g],
                  "group %zu runs gather %d reduce %d, expected %d %d", g, (int)ga, (int)ra,
                  (int)want_g[g], (int)want_r[g]);
        }
        CHECK(mfsdp_ctx_group_algos(ctx, 2, NULL, NULL) == MFSDP_ERR_INVALID_ARG, "group 2");
        mfsdp_ctx_stats_t s;
        CHECK(mfsdp_ctx_get_stats(ctx, &s) == MFSDP_OK, "stats");
        CHECK(s.gather_algo == (override ? MFSDP_ALGO_NATIVE : MFSDP_ALGO_AUTO) &&
                  s.reduce_algo == MFSDP_ALGO_AUTO,
              "stats: gather %d reduce %d (mixed groups report auto)", (int)s.gather_algo,
              (int)s.reduce_algo);
        run_groups(ctx, m);
        int checked = 0;
        MPI_Allreduce(&g_checked, &checked, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        CHECK(checked == 3, "%d owners' gradients checked, expected one per tensor (3)", checked);
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);
    unlink(path);
    int total = 0;
    MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0 && total == 0) {
        printf("ok: mode %s at %d ranks\n", mode, g_world);
    }
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
