/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Rank agreement (run under mpirun at 2..4 ranks): a rank whose MFSDP_* setting or manifest
 * differs from the others makes context creation fail on EVERY rank with MFSDP_ERR_MISMATCH
 * and one message naming the variable and the ranks, never a hang or a truncation.
 *   test_agree tail      the last rank runs with MFSDP_TAIL=owner, the others with shard
 *   test_agree manifest  the last rank's manifest has a different learning rate
 *   test_agree options   the last rank passes another staging budget in its mfsdp_ctx_opts_t
 *   test_agree same      every rank agrees: creation succeeds
 *   test_agree badvalue  the last rank has MFSDP_SPREAD=maybe (its configuration fails to
 *                        parse): it still takes part, every rank fails (no hang)
 *   test_agree typo      every rank has MFSDP_STAGNG_BYTES (a misspelling): every rank fails
 *                        with MFSDP_ERR_CONFIG, naming MFSDP_STAGING_BYTES
 *   test_agree table     only the last rank sets MFSDP_ALGO_TABLE (the others compared one
 *                        item less: a truncated exchange)
 *   test_agree world     the last rank's manifest states world_size 99 (it returned before
 *                        the exchange: the others waited)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mfsdp/runtime_mpi.h"
#include "tests/lib/mpi_check.h"

static const char *manifest_text(double lr)
{
    static char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"format\": \"mfsdp-manifest/1\", \"optimizer\": {\"lr\": %g}, \"groups\": "
             "[{\"name\": \"g\", \"params\": [{\"name\": \"w\", \"shape\": [8, 4], \"dtype\": "
             "\"float32\"}, {\"name\": \"b\", \"shape\": [8], \"dtype\": \"float32\"}]}]}",
             lr);
    return buf;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    const char *mode = argc > 1 ? argv[1] : "same";
    int last = g_rank == g_world - 1;
    setenv("MFSDP_MLOCK", "0", 1);
    if (strcmp(mode, "tail") == 0) {
        setenv("MFSDP_TAIL", last ? "owner" : "shard", 1);
    }
    if (strcmp(mode, "badvalue") == 0 && last) {
        setenv("MFSDP_SPREAD", "maybe", 1);
    }
    if (strcmp(mode, "typo") == 0) {
        setenv("MFSDP_STAGNG_BYTES", "1K", 1);
    }
    char table[64];
    snprintf(table, sizeof(table), "/tmp/mfsdp-agree-%d.csv", (int)getpid());
    if (strcmp(mode, "table") == 0 && last) {
        FILE *f = fopen(table, "w");
        if (f == NULL ||
            fputs("coll,nranks,min_bytes,max_bytes,algo\nallgather,-1,0,-1,chain\n", f) < 0) {
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        fclose(f);
        setenv("MFSDP_ALGO_TABLE", table, 1);
    }
    double lr = strcmp(mode, "manifest") == 0 && last ? 0.05 : 0.02;
    const char *text = manifest_text(lr);
    char wtext[600];
    if (strcmp(mode, "world") == 0 && last) {
        snprintf(wtext, sizeof(wtext), "{\"world_size\": 99, %s", text + 1);
        text = wtext;
    }
    mfsdp_manifest_t *m = NULL;
    char err[256];
    if (mfsdp_manifest_parse(text, strlen(text), "inline", err, sizeof(err), &m) != MFSDP_OK) {
        fprintf(stderr, "parse: %s\n", err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    mfsdp_ctx_h ctx = NULL;
    /* Options given in code take part too: one rank with another staging budget would cut
     * its reduce into other chunks than the others expect. */
    mfsdp_ctx_opts_t opts = {.staging_bytes = strcmp(mode, "options") == 0 && last ? 4096 : 0};
    capture_begin(); /* the warning goes to stderr: its text is checked */
    mfsdp_status_t st = mfsdp_ctx_create_mpi(m, &opts, MPI_COMM_WORLD, &ctx);
    const char *log = capture_end();
    int fail = 0;
    if (strcmp(mode, "same") == 0) {
        fail = st != MFSDP_OK;
    } else if (strcmp(mode, "typo") == 0) {
        fail = st != MFSDP_ERR_CONFIG ||
               strstr(log, "unknown variable MFSDP_STAGNG_BYTES (did you mean "
                           "MFSDP_STAGING_BYTES?)") == NULL;
    } else if (strcmp(mode, "badvalue") == 0) {
        fail = st != MFSDP_ERR_MISMATCH ||
               strstr(log, "the MFSDP_* configuration differs across ranks: 'valid' on rank") ==
                   NULL ||
               (last && strstr(log, "MFSDP_SPREAD=maybe: expected a boolean") == NULL);
    } else if (strcmp(mode, "table") == 0) {
        fail = st != MFSDP_ERR_MISMATCH ||
               strstr(log, "MFSDP_ALGO_TABLE (its rows) differs across ranks: '(unset)' on "
                           "rank") == NULL;
        unlink(table);
    } else if (strcmp(mode, "world") == 0) {
        fail = st != MFSDP_ERR_MISMATCH || strstr(log, "the manifest differs across ranks") == NULL;
    } else {
        char want[128];
        snprintf(want, sizeof(want), "%s differs across ranks:",
                 strcmp(mode, "tail") == 0      ? "MFSDP_TAIL"
                 : strcmp(mode, "options") == 0 ? "the context options (mfsdp_ctx_opts_t)"
                                                : "the manifest");
        fail = st != MFSDP_ERR_MISMATCH || strstr(log, want) == NULL ||
               (strcmp(mode, "tail") == 0 &&
                (strstr(log, "'shard' on rank") == NULL || strstr(log, "'owner' on rank") == NULL));
    }
    if (fail) {
        fprintf(stderr, "[rank %d] mode %s: status %s, log:\n%s\n", g_rank, mode,
                mfsdp_status_string(st), log);
    } else if (g_rank == 0) {
        printf("ok: mode %s: every rank got %s\n%s", mode, mfsdp_status_string(st), log);
    }
    mfsdp_ctx_destroy(&ctx);
    mfsdp_manifest_free(m);
    int total = 0;
    g_failures += fail;
    MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
