/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mfsdp-perf: the performance harness (DESIGN.md section 10), in the style of nccl-tests.
 *
 *   mfsdp-perf <subcommand> [flags]
 *
 * Every subcommand is a row of `subcmds`; every operation it times is a row of an operation
 * table (init / run / check / flops / fini, as nccl-tests' testColl), so that variants are
 * timed side by side in one run and reported as ratios. Common flags (nccl-tests'
 * spelling): -n iterations (timed runs; the median is reported), -w warm-up runs, -c check,
 * -J/--json machine-readable lines. Subcommands add their own flags.
 *
 * Subcommands:
 *   ns   CPU Newton-Schulz (mfsdp_cpu_newton_schulz) against raw sgemm calls of the same
 *        GEMM shapes, per matrix shape.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mfsdp/kernels.h"
#include "mfsdp_config.h"

#if MFSDP_HAVE_BLAS
#include <cblas.h>
#else
#include "kernels/cpu/gemm.h"
#endif

/* ---------------------------------------------------------------------------------------
 * Common options and helpers
 */

typedef struct perf_opts {
    int iters;  /* -n: timed runs per case */
    int warmup; /* -w: untimed runs per case */
    int check;  /* -c: verify results */
    int json;   /* -J: one JSON object per result line */
} perf_opts_t;

#define PERF_MAX_OPTS 32

typedef struct perf_subcmd {
    const char *name;
    const char *summary;
    const char *usage;         /* subcommand flags, one per line */
    const char *short_opts;    /* getopt spelling of the subcommand's short flags */
    const struct option *opts; /* its long flags, terminated by a zero entry */
    size_t state_size;
    void (*defaults)(void *state);
    int (*parse_opt)(void *state, int opt, const char *arg); /* 0 ok, -1 bad value */
    int (*run)(const perf_opts_t *common, void *state);      /* process exit status */
} perf_subcmd_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n samples (sorts them). */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int parse_int(const char *arg, int lo, int *out)
{
    char *end;
    errno = 0;
    const long v = strtol(arg, &end, 10);
    if (errno != 0 || end == arg || *end != '\0' || v < lo || v > 1000000) {
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* Deterministic N(0, 1) fill (xorshift + Box-Muller): inputs are the same on every run. */
static void fill_normal(float *x, size_t n, uint64_t seed)
{
    uint64_t s = seed | 1u;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        const double u = ((double)(s >> 11) + 0.5) * 0x1p-53;
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        const double v = (double)(s >> 11) * 0x1p-53;
        x[i] = (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
    }
}

/* ---------------------------------------------------------------------------------------
 * ns: Newton-Schulz vs raw GEMMs
 */

#define NS_MAX_SHAPES 16

typedef struct ns_state {
    int nshapes;
    int64_t m[NS_MAX_SHAPES];
    int64_t k[NS_MAX_SHAPES];
    int steps;
} ns_state_t;

/* One shape being timed. Buffers are shared by the two operations. */
typedef struct ns_case {
    int64_t m, k;
    size_t s, l; /* min, max */
    int trans;   /* m > k: the buffer holds X^T */
    int steps;
    float *x0; /* the input, kept */
    float *x;  /* Newton-Schulz in/out; raw GEMMs read it as X */
    float *ws; /* NS workspace; raw GEMMs use it as A, B and Y (same sizes) */
    size_t ws_elems;
} ns_case_t;

typedef struct ns_op {
    const char *name;
    void (*init)(ns_case_t *c);        /* prepare inputs (not timed) */
    int (*run)(ns_case_t *c);          /* one timed run: 0 ok */
    long (*check)(const ns_case_t *c); /* #wrong after a run */
} ns_op_t;

/* Nominal Newton-Schulz flops (DESIGN.md section 4): per step A = X X^T (2 s^2 l),
 * A A (2 s^3), B X (2 s^2 l), whatever routines actually run. */
static double ns_flops(const ns_case_t *c)
{
    const double s = (double)c->s, l = (double)c->l;
    return (double)c->steps * (4.0 * s * s * l + 2.0 * s * s * s);
}

static void ns_op_init(ns_case_t *c)
{
    memcpy(c->x, c->x0, c->s * c->l * sizeof(float));
}

static int ns_op_run(ns_case_t *c)
{
    const mfsdp_status_t st =
        mfsdp_cpu_newton_schulz(c->x, c->m, c->k, c->steps, c->ws, c->ws_elems);
    if (st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: newton-schulz failed: %s\n", mfsdp_status_string(st));
        return -1;
    }
    return 0;
}

/* Newton-Schulz output: every element finite and, after 5 or more steps (fewer have not
 * converged), the mean squared singular value ||X||_F^2 / s inside the quintic band
 * [0.45, 1.3]. */
static long ns_op_check(const ns_case_t *c)
{
    long wrong = 0;
    double sq = 0.0;
    const size_t n = c->s * c->l;
    for (size_t i = 0; i < n; i++) {
        wrong += !isfinite(c->x[i]);
        sq += (double)c->x[i] * c->x[i];
    }
    const double mean_sigma2 = sq / (double)c->s;
    if (c->steps >= 5 && !(mean_sigma2 >= 0.45 && mean_sigma2 <= 1.3)) {
        fprintf(stderr, "mfsdp-perf: %lldx%lld mean sigma^2 %.3f outside [0.45, 1.3]\n",
                (long long)c->m, (long long)c->k, mean_sigma2);
        wrong++;
    }
    return wrong;
}

static void sgemm_rm(int ta, int tb, size_t m, size_t n, size_t kk, const float *a, size_t lda,
                     const float *b, size_t ldb, float *cm, size_t ldc)
{
#if MFSDP_HAVE_BLAS
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                (int)m, (int)n, (int)kk, 1.0f, a, (int)lda, b, (int)ldb, 0.0f, cm, (int)ldc);
#else
    mfsdp_gemm_sgemm(ta ? MFSDP_GEMM_T : MFSDP_GEMM_N, tb ? MFSDP_GEMM_T : MFSDP_GEMM_N, m, n, kk,
                     1.0f, a, lda, b, ldb, 0.0f, cm, ldc);
#endif
}

/* Raw GEMMs get a normalized X so that A and B hold realistic (non-denormal) values. */
static void gemm_op_init(ns_case_t *c)
{
    const size_t n = c->s * c->l;
    double sq = 0.0;
    for (size_t i = 0; i < n; i++) {
        sq += (double)c->x0[i] * c->x0[i];
    }
    const float inv = (float)(1.0 / sqrt(sq));
    for (size_t i = 0; i < n; i++) {
        c->x[i] = c->x0[i] * inv;
    }
}

/* Per step, the three GEMM shapes of Newton-Schulz as plain sgemm calls in the same
 * memory layout: A = X X^T (s x s, inner l), A A (s x s x s), B X (s x l, inner s). */
static int gemm_op_run(ns_case_t *c)
{
    const size_t s = c->s, l = c->l, ldx = (size_t)c->k;
    float *a = c->ws, *b = c->ws + s * s, *y = c->ws + 2 * s * s;
    for (int t = 0; t < c->steps; t++) {
        if (!c->trans) {
            sgemm_rm(0, 1, s, s, l, c->x, ldx, c->x, ldx, a, s);
            sgemm_rm(0, 0, s, s, s, a, s, a, s, b, s);
            sgemm_rm(0, 0, s, l, s, b, s, c->x, ldx, y, ldx);
        } else {
            sgemm_rm(1, 0, s, s, l, c->x, ldx, c->x, ldx, a, s);
            sgemm_rm(0, 0, s, s, s, a, s, a, s, b, s);
            sgemm_rm(0, 0, l, s, s, c->x, ldx, b, s, y, ldx);
        }
    }
    return 0;
}

static long gemm_op_check(const ns_case_t *c)
{
    long wrong = 0;
    const size_t n = c->s * c->l;
    const float *y = c->ws + 2 * c->s * c->s;
    for (size_t i = 0; i < n; i++) {
        wrong += !isfinite(y[i]);
    }
    return wrong;
}

static const ns_op_t ns_ops[] = {
    {"newton_schulz", ns_op_init, ns_op_run, ns_op_check},
    {"sgemm", gemm_op_init, gemm_op_run, gemm_op_check},
};
#define NS_NOPS (sizeof(ns_ops) / sizeof(ns_ops[0]))

static const struct option ns_long_opts[] = {
    {"shapes", required_argument, NULL, 's'},
    {"steps", required_argument, NULL, 't'},
    {NULL, 0, NULL, 0},
};

static void ns_defaults(void *state)
{
    ns_state_t *st = state;
    static const int64_t dm[] = {1024, 4096, 4096}, dk[] = {4096, 4096, 14336};
    st->nshapes = 3;
    memcpy(st->m, dm, sizeof(dm));
    memcpy(st->k, dk, sizeof(dk));
    st->steps = 5;
}

static int ns_parse_opt(void *state, int opt, const char *arg)
{
    ns_state_t *st = state;
    if (opt == 't') {
        return parse_int(arg, 0, &st->steps);
    }
    if (opt != 's') {
        return -1;
    }
    /* "MxK[,MxK...]" */
    st->nshapes = 0;
    const char *p = arg;
    while (*p != '\0') {
        char *end;
        if (st->nshapes == NS_MAX_SHAPES) {
            return -1;
        }
        const long long m = strtoll(p, &end, 10);
        if (end == p || (*end != 'x' && *end != 'X') || m <= 0) {
            return -1;
        }
        p = end + 1;
        const long long k = strtoll(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0') || k <= 0) {
            return -1;
        }
        st->m[st->nshapes] = m;
        st->k[st->nshapes] = k;
        st->nshapes++;
        p = *end == ',' ? end + 1 : end;
    }
    return st->nshapes > 0 ? 0 : -1;
}

/* Time every operation on one case. Runs are interleaved (run i of each op, then run i+1)
 * so that load changes on a shared machine hit all ops alike; each op is checked right
 * after its last run, as ops share buffers. Medians and minima in seconds. */
static int ns_time_ops(const perf_opts_t *o, ns_case_t *c, double *med, double *mn, long *wrong)
{
    double t[NS_NOPS][64];
    const int iters = o->iters < 64 ? o->iters : 64;
    const int total = o->warmup + iters;
    for (int it = 0; it < total; it++) {
        for (size_t op = 0; op < NS_NOPS; op++) {
            ns_ops[op].init(c);
            const double t0 = now_s();
            if (ns_ops[op].run(c) != 0) {
                return -1;
            }
            const double dt = now_s() - t0;
            if (it >= o->warmup) {
                t[op][it - o->warmup] = dt;
            }
            if (it == total - 1) {
                wrong[op] = o->check ? ns_ops[op].check(c) : 0;
            }
        }
    }
    for (size_t op = 0; op < NS_NOPS; op++) {
        med[op] = median(t[op], iters);
        mn[op] = t[op][0]; /* sorted by median() */
    }
    return 0;
}

static int ns_run(const perf_opts_t *o, void *state)
{
    const ns_state_t *st = state;
    int rc = 0;
    const char *env_threads = getenv("OPENBLAS_NUM_THREADS");
    /* Header comments in text mode; with --json every line is one object. */
    FILE *hdr = o->json ? stderr : stdout;
    fprintf(hdr, "# mfsdp-perf ns: CPU Newton-Schulz vs raw sgemm of the same GEMM shapes\n");
    fprintf(hdr,
            "# steps %d, %d timed run(s) per op, interleaved (median; min in parentheses), "
            "%d warm-up, check %d\n",
            st->steps, o->iters, o->warmup, o->check);
    fprintf(hdr, "# NS routines: %s\n", mfsdp_cpu_ns_routines());
#if MFSDP_HAVE_BLAS
    fprintf(hdr,
            "# raw: cblas_sgemm x3 per step (X X^T as NoTrans x Trans, A A, B X); BLAS "
            "threads %d (OPENBLAS_NUM_THREADS=%s)\n",
            openblas_get_num_threads(), env_threads != NULL ? env_threads : "unset");
    {
        float one = 1.0f, out = 0.0f; /* initialize the BLAS outside the timings */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, 1, 1, 1.0f, &one, 1, &one, 1,
                    0.0f, &out, 1);
    }
#else
    (void)env_threads;
    fprintf(hdr, "# raw: portable mfsdp_gemm_sgemm x3 per step (no BLAS in this build)\n");
#endif
    fprintf(hdr, "# GFLOP/s use the nominal Newton-Schulz count steps * (4 s^2 l + 2 s^3), "
                 "s = min(m,k), l = max(m,k), for both columns\n");
    if (!o->json) {
        printf("#%7s %7s %5s %10s %19s %9s %19s %9s %7s %11s %7s\n", "m", "k", "steps",
               "nominal_GF", "ns_ms", "ns_GF/s", "gemm_ms", "gemm_GF/s", "ratio", "ratio(min)",
               "#wrong");
    }
    for (int i = 0; i < st->nshapes; i++) {
        ns_case_t c = {.m = st->m[i], .k = st->k[i], .steps = st->steps};
        c.trans = c.m > c.k;
        c.s = (size_t)(c.trans ? c.k : c.m);
        c.l = (size_t)(c.trans ? c.m : c.k);
        c.ws_elems = mfsdp_ns_workspace_elems(c.m, c.k);
        const size_t n = c.s * c.l;
        if (c.ws_elems == 0) {
            fprintf(stderr, "mfsdp-perf: shape %lldx%lld is too large\n", (long long)c.m,
                    (long long)c.k);
            rc = 1;
            continue;
        }
        c.x0 = malloc(n * sizeof(float));
        c.x = malloc(n * sizeof(float));
        c.ws = malloc(c.ws_elems * sizeof(float));
        if (c.x0 == NULL || c.x == NULL || c.ws == NULL) {
            fprintf(stderr, "mfsdp-perf: out of memory for %lldx%lld\n", (long long)c.m,
                    (long long)c.k);
            rc = 1;
            goto next;
        }
        fill_normal(c.x0, n, 0x5eed0000u + (uint64_t)i);
        memset(c.ws, 0, c.ws_elems * sizeof(float)); /* fault the pages in, untimed */

        double med[NS_NOPS], mn[NS_NOPS];
        long wrong[NS_NOPS];
        if (ns_time_ops(o, &c, med, mn, wrong) != 0) {
            rc = 1;
            goto next;
        }
        const double gf = ns_flops(&c) * 1e-9;
        const double ratio = med[1] / med[0], ratio_min = mn[1] / mn[0];
        if (o->json) {
            printf("{\"subcommand\":\"ns\",\"m\":%lld,\"k\":%lld,\"steps\":%d,"
                   "\"nominal_gflop\":%.3f,\"ns_s\":%.6f,\"ns_min_s\":%.6f,\"ns_gflops\":%.3f,"
                   "\"gemm_s\":%.6f,\"gemm_min_s\":%.6f,\"gemm_gflops\":%.3f,\"ratio\":%.4f,"
                   "\"ratio_min\":%.4f,\"wrong\":%ld,\"routines\":\"%s\"}\n",
                   (long long)c.m, (long long)c.k, c.steps, gf, med[0], mn[0], gf / med[0], med[1],
                   mn[1], gf / med[1], ratio, ratio_min, wrong[0] + wrong[1],
                   mfsdp_cpu_ns_routines());
        } else {
            char ns_ms[32], gemm_ms[32];
            snprintf(ns_ms, sizeof(ns_ms), "%.1f (%.1f)", 1e3 * med[0], 1e3 * mn[0]);
            snprintf(gemm_ms, sizeof(gemm_ms), "%.1f (%.1f)", 1e3 * med[1], 1e3 * mn[1]);
            printf(" %7lld %7lld %5d %10.1f %19s %9.1f %19s %9.1f %7.3f %11.3f %7ld\n",
                   (long long)c.m, (long long)c.k, c.steps, gf, ns_ms, gf / med[0], gemm_ms,
                   gf / med[1], ratio, ratio_min, wrong[0] + wrong[1]);
        }
        fflush(stdout);
        if (wrong[0] + wrong[1] != 0) {
            rc = 1;
        }
    next:
        free(c.x0);
        free(c.x);
        free(c.ws);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------
 * Subcommand table and driver
 */

static const perf_subcmd_t subcmds[] = {
    {
        .name = "ns",
        .summary = "CPU Newton-Schulz vs raw sgemm of the same GEMM shapes",
        .usage = "  -s, --shapes MxK[,MxK...]  matrix shapes (default 1024x4096,4096x4096,"
                 "4096x14336)\n"
                 "  -t, --steps N              Newton-Schulz steps (default 5)\n",
        .short_opts = "s:t:",
        .opts = ns_long_opts,
        .state_size = sizeof(ns_state_t),
        .defaults = ns_defaults,
        .parse_opt = ns_parse_opt,
        .run = ns_run,
    },
};
#define NSUBCMDS (sizeof(subcmds) / sizeof(subcmds[0]))

static const struct option common_long_opts[] = {
    {"iters", required_argument, NULL, 'n'}, {"warmup_iters", required_argument, NULL, 'w'},
    {"check", required_argument, NULL, 'c'}, {"json", no_argument, NULL, 'J'},
    {"help", no_argument, NULL, 'h'},
};
#define NCOMMON (sizeof(common_long_opts) / sizeof(common_long_opts[0]))

static void usage(FILE *f, const perf_subcmd_t *sub)
{
    if (sub == NULL) {
        fprintf(f, "usage: mfsdp-perf <subcommand> [flags]\nsubcommands:\n");
        for (size_t i = 0; i < NSUBCMDS; i++) {
            fprintf(f, "  %-6s %s\n", subcmds[i].name, subcmds[i].summary);
        }
        fprintf(f, "run 'mfsdp-perf <subcommand> -h' for its flags\n");
        return;
    }
    fprintf(f,
            "usage: mfsdp-perf %s [flags]\n%s\n"
            "  -n, --iters N              timed runs per case, median reported (default 3)\n"
            "  -w, --warmup_iters N       untimed runs per case (default 0)\n"
            "  -c, --check 0|1            verify results (default 1)\n"
            "  -J, --json                 one JSON object per result line\n%s",
            sub->name, sub->summary, sub->usage);
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout, NULL);
        return argc < 2 ? 2 : 0;
    }
    const perf_subcmd_t *sub = NULL;
    for (size_t i = 0; i < NSUBCMDS; i++) {
        if (strcmp(argv[1], subcmds[i].name) == 0) {
            sub = &subcmds[i];
        }
    }
    if (sub == NULL) {
        fprintf(stderr, "mfsdp-perf: unknown subcommand '%s'\n", argv[1]);
        usage(stderr, NULL);
        return 2;
    }

    /* Common flags + the subcommand's, in one getopt_long table. */
    struct option all[PERF_MAX_OPTS];
    char shorts[64];
    size_t nall = 0;
    for (size_t i = 0; i < NCOMMON; i++) {
        all[nall++] = common_long_opts[i];
    }
    for (const struct option *p = sub->opts; p->name != NULL && nall < PERF_MAX_OPTS - 1; p++) {
        all[nall++] = *p;
    }
    memset(&all[nall], 0, sizeof(all[nall]));
    snprintf(shorts, sizeof(shorts), "n:w:c:Jh%s", sub->short_opts);

    perf_opts_t o = {.iters = 3, .warmup = 0, .check = 1, .json = 0};
    void *state = calloc(1, sub->state_size);
    if (state == NULL) {
        fprintf(stderr, "mfsdp-perf: out of memory\n");
        return 1;
    }
    sub->defaults(state);
    int opt;
    int bad = 0;
    optind = 2;
    while (!bad && (opt = getopt_long(argc, argv, shorts, all, NULL)) != -1) {
        switch (opt) {
        case 'n':
            bad = parse_int(optarg, 1, &o.iters) != 0 || o.iters > 64;
            break;
        case 'w':
            bad = parse_int(optarg, 0, &o.warmup) != 0;
            break;
        case 'c':
            bad = parse_int(optarg, 0, &o.check) != 0;
            break;
        case 'J':
            o.json = 1;
            break;
        case 'h':
            usage(stdout, sub);
            free(state);
            return 0;
        case '?':
            bad = 1;
            break;
        default:
            bad = sub->parse_opt(state, opt, optarg) != 0;
            break;
        }
        if (bad && opt != '?') {
            fprintf(stderr, "mfsdp-perf %s: bad value for -%c: '%s'\n", sub->name, opt,
                    optarg != NULL ? optarg : "");
        }
    }
    if (bad || optind != argc) {
        usage(stderr, sub);
        free(state);
        return 2;
    }
    const int rc = sub->run(&o, state);
    free(state);
    return rc;
}
