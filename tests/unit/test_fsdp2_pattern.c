/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The FSDP2 call-pattern generator against what real FSDP2 issues.
 *
 * The expected streams below were recorded from torch 2.15.0 (CPU, gloo, 2 ranks) with
 * tests/unit/fsdp2_measure.py, which wraps FSDP2's foreach_all_gather / foreach_reduce and
 * prints one line per scenario: a root (embedding, norm, head) and three blocks wrapped with
 * fully_shard, or torchtitan's wrapping (embedding, blocks, [norm, output] kept unsharded
 * after forward, a root without params). Passes are separated by '|'. The fsdp_train example's
 * own sequence (--write-manifest) is checked too.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/fsdp2_pattern.h"
#include "mfsdp_config.h"

#define FSDP_TRAIN MFSDP_BUILD_ROOT "/examples/fsdp_train_mpi"

/* A manifest with groups named in names (space separated), two params each (a matrix and a
 * bias); frozen names "group.param" of params that do not require a gradient (or NULL). */
static mfsdp_manifest_t *manifest(const char *names, const char *frozen)
{
    char json[8192], list[256];
    size_t off =
        (size_t)snprintf(json, sizeof(json), "{\"format\": \"mfsdp-manifest/1\", \"groups\": [");
    snprintf(list, sizeof(list), "%s", names);
    int first = 1;
    for (char *save = NULL, *g = strtok_r(list, " ", &save); g != NULL;
         g = strtok_r(NULL, " ", &save)) {
        char w[64], b[64];
        snprintf(w, sizeof(w), "%s.w", g);
        snprintf(b, sizeof(b), "%s.b", g);
        int fw = frozen != NULL && strstr(frozen, w) != NULL;
        int fb = frozen != NULL && strstr(frozen, b) != NULL;
        off += (size_t)snprintf(json + off, sizeof(json) - off,
                                "%s{\"name\": \"%s\", \"params\": ["
                                "{\"name\": \"%s\", \"shape\": [6, 4], \"dtype\": \"float32\", "
                                "\"requires_grad\": %s}, "
                                "{\"name\": \"%s\", \"shape\": [6], \"dtype\": \"float32\", "
                                "\"requires_grad\": %s}]}",
                                first ? "" : ", ", g, w, fw ? "false" : "true", b,
                                fb ? "false" : "true");
        first = 0;
    }
    snprintf(json + off, sizeof(json) - off, "]}");
    mfsdp_manifest_t *m = NULL;
    char err[256] = "";
    cr_assert_eq(mfsdp_manifest_parse(json, strlen(json), "test", err, sizeof(err), &m), MFSDP_OK,
                 "%s", err);
    return m;
}

/* Passes of kinds ("T", "N", "F" separated by spaces) as "AG x AG y RS y | AG x ...". */
static char *stream(const mfsdp_manifest_t *m, const mfsdp_fsdp2_config_t *cfg, const char *kinds,
                    const unsigned char *const *has_grad)
{
    mfsdp_fsdp2_gen_t *gen = NULL;
    cr_assert_eq(mfsdp_fsdp2_gen_create(m, cfg, &gen), MFSDP_OK);
    size_t cap = mfsdp_fsdp2_max_pass_calls(m);
    mfsdp_fsdp2_call_t *calls = calloc(cap, sizeof(*calls));
    char *out = calloc(1, 8192);
    size_t off = 0;
    for (const char *k = kinds; *k != '\0'; k++) {
        if (*k == ' ') {
            continue;
        }
        mfsdp_pass_kind_t kind = *k == 'T'   ? MFSDP_PASS_TRAIN
                                 : *k == 'N' ? MFSDP_PASS_NO_SYNC
                                             : MFSDP_PASS_FORWARD;
        size_t n = 0;
        cr_assert_eq(mfsdp_fsdp2_gen_pass(gen, kind, has_grad, calls, cap, &n), MFSDP_OK);
        off += (size_t)snprintf(out + off, 8192 - off, "%s", off ? " |" : "");
        for (size_t i = 0; i < n; i++) {
            off += (size_t)snprintf(out + off, 8192 - off, "%s%s %s", off ? " " : "",
                                    calls[i].kind == MFSDP_CALL_ALLGATHER ? "AG" : "RS",
                                    m->groups[calls[i].group].name);
            /* phases: forward all-gathers precede everything of the backward */
            if (i > 0 && calls[i].phase == MFSDP_PHASE_FORWARD) {
                cr_assert_eq(calls[i - 1].phase, MFSDP_PHASE_FORWARD);
            }
            cr_assert(calls[i].phase == MFSDP_PHASE_BACKWARD ||
                      calls[i].kind == MFSDP_CALL_ALLGATHER);
        }
    }
    free(calls);
    mfsdp_fsdp2_gen_destroy(gen);
    return out;
}

static void expect_stream(const char *names, const mfsdp_fsdp2_config_t *cfg, const char *kinds,
                          const char *measured)
{
    mfsdp_manifest_t *m = manifest(names, NULL);
    char *got = stream(m, cfg, kinds, NULL);
    cr_expect_str_eq(got, measured, "passes %s\n got: %s\nwant: %s", kinds, got, measured);
    free(got);
    mfsdp_manifest_free(m);
}

#define ROOT3     "root b0 b1 b2"
#define TITAN     "emb b0 b1 b2 out"
#define T_DEFAULT "AG root AG b0 AG b1 AG b2 AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root"

Test(fsdp2_pattern, default_measured)
{
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = NULL};
    expect_stream(ROOT3, &cfg, "T T", T_DEFAULT " | " T_DEFAULT);
}

Test(fsdp2_pattern, no_prefetch_measured)
{
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 0, .reshard = NULL};
    expect_stream(ROOT3, &cfg, "T",
                  "AG root AG b0 AG b1 AG b2 AG b2 RS b2 AG b1 RS b1 AG b0 RS b0 RS root");
}

Test(fsdp2_pattern, root_resharded_measured)
{
    static const unsigned char all[] = {1, 1, 1, 1};
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = all};
    expect_stream(ROOT3, &cfg, "T",
                  "AG root AG b0 AG b1 AG b2 AG root AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root");
}

Test(fsdp2_pattern, accumulation_no_sync_measured)
{
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = NULL};
    expect_stream(ROOT3, &cfg, "N T N",
                  "AG root AG b0 AG b1 AG b2 AG b2 AG b1 AG b0 | " T_DEFAULT
                  " | AG root AG b0 AG b1 AG b2 AG b2 AG b1 AG b0");
}

Test(fsdp2_pattern, eval_forward_measured)
{
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = NULL};
    /* the root stays unsharded after the eval forward: the next passes skip its all-gather */
    expect_stream(ROOT3, &cfg, "T F T F",
                  T_DEFAULT " | AG root AG b0 AG b1 AG b2 | "
                            "AG b0 AG b1 AG b2 AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root | "
                            "AG root AG b0 AG b1 AG b2");
    expect_stream(ROOT3, &cfg, "T F F T",
                  T_DEFAULT " | AG root AG b0 AG b1 AG b2 | AG b0 AG b1 AG b2 | "
                            "AG b0 AG b1 AG b2 AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS root");
}

Test(fsdp2_pattern, torchtitan_measured)
{
    /* the output group reshard_after_forward=False; torchtitan's older default also keeps
     * the last block */
    static const unsigned char keep_out[] = {1, 1, 1, 1, 0};
    static const unsigned char keep_two[] = {1, 1, 1, 0, 0};
    mfsdp_fsdp2_config_t cfg = {.root = 0, .prefetch = 1, .reshard = keep_out};
    const char *t = "AG emb AG b0 AG b1 AG b2 AG out AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb "
                    "RS b0 RS emb";
    char two[512];
    snprintf(two, sizeof(two), "%s | %s", t, t);
    expect_stream(TITAN, &cfg, "T T", two);
    expect_stream(TITAN, &cfg, "N T",
                  "AG emb AG b0 AG b1 AG b2 AG out AG b2 AG b1 AG b0 AG emb | AG emb AG b0 AG b1 "
                  "AG b2 AG out AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb RS b0 RS emb");
    /* after an eval forward the output group is still unsharded, and the embedding group's
     * pre-backward prefetches it (FSDP2 kept the eval forward's post-forward order) */
    expect_stream(TITAN, &cfg, "T F T F",
                  "AG emb AG b0 AG b1 AG b2 AG out AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb "
                  "RS b0 RS emb | AG emb AG b0 AG b1 AG b2 AG out | AG emb AG b0 AG b1 AG b2 "
                  "AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb RS b0 AG out RS emb | "
                  "AG emb AG b0 AG b1 AG b2 AG out");
    cfg.reshard = keep_two;
    expect_stream(TITAN, &cfg, "T",
                  "AG emb AG b0 AG b1 AG b2 AG out RS out AG b1 RS b2 AG b0 RS b1 AG emb RS b0 "
                  "RS emb");
}

Test(fsdp2_pattern, frozen_and_gradientless_groups)
{
    /* A frozen param is never reduced; a group without any gradient in a pass is not
     * reduce-scattered (measured: a block whose output is detached, a frozen block). */
    mfsdp_manifest_t *m = manifest(ROOT3, "b1.b");
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = NULL};
    mfsdp_fsdp2_gen_t *gen = NULL;
    cr_assert_eq(mfsdp_fsdp2_gen_create(m, &cfg, &gen), MFSDP_OK);
    mfsdp_fsdp2_call_t calls[12];
    size_t n = 0;
    cr_assert_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_TRAIN, NULL, calls, 12, &n), MFSDP_OK);
    cr_assert_eq(n, 11);
    cr_expect_null(calls[8].has_grad, "NULL: every requires_grad param");
    static const unsigned char none[2] = {0, 0}, only_w[2] = {1, 0};
    const unsigned char *hg[4] = {NULL, only_w, none, NULL};
    cr_assert_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_TRAIN, hg, calls, 12, &n), MFSDP_OK);
    cr_assert_eq(n, 10, "no reduce_scatter of b1");
    for (size_t i = 0; i < n; i++) {
        cr_expect(!(calls[i].kind == MFSDP_CALL_REDUCE_SCATTER && calls[i].group == 2));
        if (calls[i].kind == MFSDP_CALL_REDUCE_SCATTER && calls[i].group == 1) {
            cr_expect_eq(calls[i].has_grad, only_w);
        }
    }
    /* a mark on the frozen param is refused, and a too small buffer changes nothing */
    static const unsigned char frozen_marked[2] = {1, 1};
    const unsigned char *bad[4] = {NULL, NULL, frozen_marked, NULL};
    cr_expect_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_TRAIN, bad, calls, 12, &n),
                 MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_FORWARD, NULL, calls, 3, &n),
                 MFSDP_ERR_OVERFLOW);
    cr_assert_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_FORWARD, NULL, calls, 12, &n), MFSDP_OK);
    cr_expect_eq(n, 4, "the failed pass left every group sharded");
    mfsdp_fsdp2_gen_destroy(gen);
    mfsdp_fsdp2_config_t bad_cfg = {.root = 1, .prefetch = 2, .reshard = NULL};
    cr_expect_eq(mfsdp_fsdp2_gen_create(m, &bad_cfg, &gen), MFSDP_ERR_INVALID_ARG);
    mfsdp_manifest_free(m);
    cr_expect_str_eq(mfsdp_pass_kind_name(MFSDP_PASS_NO_SYNC), "no-sync");
}

Test(fsdp2_pattern, kept_unsharded_groups_and_single_group)
{
    /* reshard_after_forward=False everywhere: no backward all-gather at all */
    static const unsigned char none[] = {0, 0, 0, 0};
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = 1, .reshard = none};
    expect_stream(ROOT3, &cfg, "T F T",
                  "AG root AG b0 AG b1 AG b2 RS b2 RS b1 RS b0 RS root | AG root AG b0 AG b1 "
                  "AG b2 | RS b2 RS b1 RS b0 RS root");
    mfsdp_fsdp2_config_t one = {.root = 1, .prefetch = 1, .reshard = NULL};
    expect_stream("root", &one, "T F T", "AG root RS root | AG root | RS root");
}

/* The sequence fsdp_train --write-manifest declares is the generator's training pass. */
static void check_fsdp_train(const char *dims, int prefetch)
{
#if MFSDP_HAVE_BLAS && MFSDP_HAVE_MPI
    cr_assert_eq(access(FSDP_TRAIN, X_OK), 0, "%s is not built (ninja -C the build folder)",
                 FSDP_TRAIN);
    char path[] = "/tmp/mfsdp-fsdp2-pattern-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        if (freopen("/dev/null", "w", stdout) == NULL) {
            _exit(126);
        }
        execl(FSDP_TRAIN, FSDP_TRAIN, "--reference", "--steps", "0", "--quiet", "--dims", dims,
              "--write-manifest", path, prefetch ? NULL : "--no-prefetch", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s failed (%d)", FSDP_TRAIN, status);
    mfsdp_manifest_t *m = NULL;
    char err[256] = "";
    cr_assert_eq(mfsdp_manifest_load(path, err, sizeof(err), &m), MFSDP_OK, "%s", err);
    unlink(path);
    mfsdp_fsdp2_config_t cfg = {.root = 1, .prefetch = prefetch, .reshard = NULL};
    mfsdp_fsdp2_gen_t *gen = NULL;
    cr_assert_eq(mfsdp_fsdp2_gen_create(m, &cfg, &gen), MFSDP_OK);
    size_t cap = mfsdp_fsdp2_max_pass_calls(m), n = 0;
    mfsdp_fsdp2_call_t *calls = calloc(cap, sizeof(*calls));
    cr_assert_eq(mfsdp_fsdp2_gen_pass(gen, MFSDP_PASS_TRAIN, NULL, calls, cap, &n), MFSDP_OK);
    cr_assert_eq(n, m->ncalls, "dims %s prefetch %d", dims, prefetch);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(calls[i].kind, m->sequence[i].kind, "entry %zu", i);
        cr_expect_eq(calls[i].group, m->sequence[i].group, "entry %zu", i);
    }
    free(calls);
    mfsdp_fsdp2_gen_destroy(gen);
    mfsdp_manifest_free(m);
#else
    (void)dims;
    (void)prefetch;
    cr_skip_test("examples/fsdp_train is built only with BLAS and MPI");
#endif
}

Test(fsdp2_pattern, fsdp_train_example_sequence)
{
    check_fsdp_train("16,8,16,4,3", 1);
    check_fsdp_train("16,8,16,4,3", 0);
    check_fsdp_train("16,8,16,4,1", 1);
    check_fsdp_train("16,8,16,4,5", 0);
}
