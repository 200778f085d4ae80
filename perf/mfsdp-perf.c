/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mfsdp-perf: the performance harness (docs/PERFORMANCE.md), in the style of nccl-tests.
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
 *   ns            CPU Newton-Schulz (mfsdp_cpu_newton_schulz) against raw sgemm calls of the
 *                 same GEMM shapes, per matrix shape.
 *   allgather     (mpirun) MPI_Allgather vs mfsdp_ctx_allgather (owner-broadcast) on one
 *                 FSDP-layout buffer of K owner segments, every algorithm in turn.
 *   reducescatter (mpirun) MPI_Reduce_scatter_block vs mfsdp_ctx_reduce (reduce-to-owner).
 *   optstep       (mpirun) the Muon step of a manifest's matrices: mfsdp owners vs
 *                 FSDP2-Muon (gather everywhere) vs DMuon-style (gather to one rank).
 *   ckpt          (mpirun) owner checkpoints of a manifest's model: the save's stall, the
 *                 background write and the load, in GB/s per rank; the loaded state is
 *                 checked against the saved one.
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

#if MFSDP_HAVE_MPI
#include <mpi.h>

#include <ftw.h>
#include <unistd.h>
#include <sys/stat.h>

#include "core/algo_table.h"
#include "core/config.h"
#include "core/layout.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/manifest.h"
#include "mfsdp/plan.h"
#include "mfsdp/runtime_mpi.h"
#endif

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

/* -c 0: nothing is checked, and #wrong says so (n/a; JSON null), as nccl-tests prints N/A. */
static int g_checked = 1;

/* #wrong as printed: the count, or n/a / null when unchecked (buf holds 24 chars). */
static const char *wrong_txt(long w, int json, char *buf)
{
    if (!g_checked) {
        return json ? "null" : "n/a";
    }
    snprintf(buf, 24, "%ld", w);
    return buf;
}

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
    int mpi; /* 1: runs under mpirun (MPI_Init before run, MPI_Finalize after) */
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

/* Paired runs of mfsdp (mine) and a baseline (other): every run times all systems back to back
 * (rotated order), so run k of both saw the same machine. *wins: runs in which mfsdp was
 * faster; *p: the one-sided sign test's p-value of that many wins or more if neither were
 * faster (0.5 each); ratio[3]: median, min and max of other / mine per run. */
typedef struct paired {
    int wins, runs;
    double p, ratio[3];
} paired_t;

static paired_t paired_runs(const double *mine, const double *other, int n)
{
    n = n < 64 ? n : 64; /* the harness times at most 64 runs */
    paired_t r = {0, n, 0.0, {0.0, 0.0, 0.0}};
    double q[64];
    for (int k = 0; k < n; k++) {
        r.wins += mine[k] < other[k];
        q[k] = mine[k] > 0.0 ? other[k] / mine[k] : 0.0;
    }
    double c = 1.0; /* C(n, j), from j = 0 */
    for (int j = 0; j <= n; j++) {
        if (j >= r.wins) {
            r.p += c;
        }
        c = c * (double)(n - j) / (double)(j + 1);
    }
    r.p = ldexp(r.p, -n);
    if (n > 0) {
        r.ratio[0] = median(q, n); /* sorts q */
        r.ratio[1] = q[0];
        r.ratio[2] = q[n - 1];
    }
    return r;
}

static void print_paired(FILE *f, const char *other, const paired_t *r)
{
    fprintf(f,
            "# paired runs: mfsdp faster than %s in %d of %d (per-run time ratio median %.3f, "
            "min %.3f, max %.3f; one-sided sign test p = %.3g)\n",
            other, r->wins, r->runs, r->ratio[0], r->ratio[1], r->ratio[2], r->p);
}

/* The same as fields of a baseline's --json row. */
static void print_paired_json(const paired_t *r)
{
    printf(",\"mfsdp_faster_runs\":%d,\"runs\":%d,\"sign_test_p\":%.4g", r->wins, r->runs, r->p);
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

/* Nominal Newton-Schulz flops (docs/design.md, "Owners"): per step A = X X^T (2 s^2 l),
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

static int corrupt_requested(void);

/* dgemm, row-major: c = alpha a op(b) + beta c (plain loops without BLAS). */
static void dgemm_rm(int tb, size_t m, size_t n, size_t kk, double alpha, const double *a,
                     const double *b, double beta, double *cm)
{
#if MFSDP_HAVE_BLAS
    cblas_dgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n,
                (int)kk, alpha, a, (int)kk, b, tb ? (int)kk : (int)n, beta, cm, (int)n);
#else
    for (size_t i = 0; i < m; i++) {
        for (size_t j = 0; j < n; j++) {
            double acc = 0.0;
            for (size_t q = 0; q < kk; q++) {
                acc += a[i * kk + q] * (tb ? b[j * kk + q] : b[q * n + j]);
            }
            cm[i * n + j] = alpha * acc + beta * cm[i * n + j];
        }
    }
#endif
}

/* The harness's own Newton-Schulz, in double from the same input: X = G / (||G||_F + eps)
 * (G or G^T, whichever has fewer rows: s x l), then steps times A = X X^T,
 * X = a X + (b A + c A A) X, with the quintic's coefficients (docs/design.md, "The
 * optimizer step"). Returned in the input's m x k layout; NULL without memory. */
static double *ns_reference(const ns_case_t *c)
{
    const size_t s = c->s, l = c->l, n = s * l;
    double *x = malloc(n * sizeof(double)), *y = malloc(n * sizeof(double));
    double *a = malloc(s * s * sizeof(double)), *b = malloc(s * s * sizeof(double));
    if (x == NULL || y == NULL || a == NULL || b == NULL) {
        free(x), free(y), free(a), free(b);
        return NULL;
    }
    double sq = 0.0;
    for (size_t i = 0; i < s; i++) {
        for (size_t j = 0; j < l; j++) {
            const double v = c->trans ? c->x0[j * s + i] : c->x0[i * l + j];
            x[i * l + j] = v;
            sq += v * v;
        }
    }
    const double inv = 1.0 / (sqrt(sq) + (double)MFSDP_NS_EPS);
    for (size_t i = 0; i < n; i++) {
        x[i] *= inv;
    }
    for (int step = 0; step < c->steps; step++) {
        dgemm_rm(1, s, s, l, 1.0, x, x, 0.0, a); /* A = X X^T */
        memcpy(b, a, s * s * sizeof(double));
        dgemm_rm(0, s, s, s, (double)MFSDP_NS_C, a, a, (double)MFSDP_NS_B, b); /* bA + cA A */
        memcpy(y, x, n * sizeof(double));
        dgemm_rm(0, s, l, s, 1.0, b, x, (double)MFSDP_NS_A, y); /* aX + B X */
        double *t = x;
        x = y;
        y = t;
    }
    for (size_t i = 0; i < s; i++) {
        for (size_t j = 0; j < l; j++) {
            y[c->trans ? j * s + i : i * l + j] = x[i * l + j];
        }
    }
    free(x), free(a), free(b);
    return y;
}

/* Newton-Schulz output against the harness's double-precision reference (ns_reference):
 * element i is wrong when |x_i - ref_i| > 1e-3 max|ref| (measured: fp32 within 2e-7..5e-7 of
 * it at max|ref| 0.1..0.2, a margin of about 400; 3 steps instead of 5 are off by 8e-3..4e-2
 * and fail half the elements). Costs about one fp64 Newton-Schulz per shape (-c 0 skips it).
 * Also every element finite and, after 5 or more steps, the mean squared singular value
 * ||X||_F^2 / s inside the quintic band [0.45, 1.3]. */
static long ns_op_check(const ns_case_t *c)
{
    long wrong = 0;
    double sq = 0.0;
    const size_t n = c->s * c->l;
    double *ref = ns_reference(c);
    if (ref == NULL) {
        fprintf(stderr, "mfsdp-perf: no memory for the %lldx%lld reference\n", (long long)c->m,
                (long long)c->k);
        return (long)n;
    }
    double big = 0.0;
    for (size_t i = 0; i < n; i++) {
        big = fabs(ref[i]) > big ? fabs(ref[i]) : big;
    }
    if (corrupt_requested()) {
        c->x[n / 2] += 0.01f; /* test-only (MFSDP_PERF_CORRUPT=1): the check must see this */
    }
    const double tol = 1e-3 * big;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)c->x[i] - ref[i]);
        wrong += !isfinite(c->x[i]) || !(d <= tol);
        sq += (double)c->x[i] * c->x[i];
    }
    free(ref);
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
        char wb[24];
        const double ratio = med[1] / med[0], ratio_min = mn[1] / mn[0];
        if (o->json) {
            printf("{\"subcommand\":\"ns\",\"m\":%lld,\"k\":%lld,\"steps\":%d,"
                   "\"nominal_gflop\":%.3f,\"ns_s\":%.6f,\"ns_min_s\":%.6f,\"ns_gflops\":%.3f,"
                   "\"gemm_s\":%.6f,\"gemm_min_s\":%.6f,\"gemm_gflops\":%.3f,\"ratio\":%.4f,"
                   "\"ratio_min\":%.4f,\"wrong\":%s,\"routines\":\"%s\"}\n",
                   (long long)c.m, (long long)c.k, c.steps, gf, med[0], mn[0], gf / med[0], med[1],
                   mn[1], gf / med[1], ratio, ratio_min, wrong_txt(wrong[0] + wrong[1], 1, wb),
                   mfsdp_cpu_ns_routines());
        } else {
            char ns_ms[32], gemm_ms[32];
            snprintf(ns_ms, sizeof(ns_ms), "%.1f (%.1f)", 1e3 * med[0], 1e3 * mn[0]);
            snprintf(gemm_ms, sizeof(gemm_ms), "%.1f (%.1f)", 1e3 * med[1], 1e3 * mn[1]);
            printf(" %7lld %7lld %5d %10.1f %19s %9.1f %19s %9.1f %7.3f %11.3f %7s\n",
                   (long long)c.m, (long long)c.k, c.steps, gf, ns_ms, gf / med[0], gemm_ms,
                   gf / med[1], ratio, ratio_min, wrong_txt(wrong[0] + wrong[1], 0, wb));
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

#if MFSDP_HAVE_MPI
/* ---------------------------------------------------------------------------------------
 * MPI helpers (allgather, reducescatter, optstep)
 */

static int g_rank, g_world;

/* Median over timed runs of the slowest rank's time of each run. */
static double run_max(double t)
{
    double m = t;
    MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

static long sum_long(long v)
{
    long s = v;
    MPI_Allreduce(&v, &s, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return s;
}

/* A context of the harness on MPI_COMM_WORLD: the given tail policy and algorithm (both
 * directions), manual steps, one reduce per step, no clipping, no page-locking (the figures
 * must not depend on the mlock limit). The context borrows m. */
static mfsdp_status_t perf_ctx_create(const mfsdp_manifest_t *m, mfsdp_tail_policy_t tail,
                                      mfsdp_algo_t algo, mfsdp_ctx_h *ctx_p)
{
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.has_plan_opts = 1;
    o.plan_opts.tail = tail;
    o.gather_algo = algo;
    o.reduce_algo = algo;
    o.has_step_mode = 1;
    o.step_mode = MFSDP_STEP_MANUAL;
    o.accum_steps = 1;
    o.has_clip = 1;
    o.clip = 0.0;
    o.no_mlock = 1;
    return mfsdp_ctx_create_mpi(m, &o, MPI_COMM_WORLD, ctx_p);
}

/* The --manifest of a subcommand that needs one: 0 and *m_p, or the exit status (2) after
 * one error line. */
static int load_manifest(const char *sub, const char *path, mfsdp_manifest_t **m_p)
{
    if (path == NULL) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf %s: --manifest is required\n", sub);
        }
        return 2;
    }
    char err[256] = "";
    if (mfsdp_manifest_load(path, err, sizeof(err), m_p) != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: manifest %s: %s\n", path, err);
        return 2;
    }
    return 0;
}

/* Test-only: MFSDP_PERF_CORRUPT=1 flips one element of mfsdp's result on rank 0 after the
 * collective, so that tests can prove that the harness's check fails. */
static int corrupt_requested(void)
{
    const char *e = getenv("MFSDP_PERF_CORRUPT");
    return e != NULL && strcmp(e, "1") == 0;
}

static int parse_size(const char *arg, size_t *out)
{
    char *end;
    errno = 0;
    const double v = strtod(arg, &end);
    if (errno != 0 || end == arg || !(v > 0)) {
        return -1;
    }
    double mul = 1;
    switch (*end) {
    case 'K':
    case 'k':
        mul = 1024.0;
        end++;
        break;
    case 'M':
    case 'm':
        mul = 1048576.0;
        end++;
        break;
    case 'G':
    case 'g':
        mul = 1073741824.0;
        end++;
        break;
    default:
        break;
    }
    if (*end != '\0' || v * mul > 68719476736.0) {
        return -1;
    }
    *out = (size_t)(v * mul);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * allgather / reducescatter: native MPI collective vs mfsdp owner collective on one
 * FSDP-layout buffer
 */

#define COLL_MAX_SEGS 256
#define COLL_COLS     64 /* columns of every synthesized segment matrix */

typedef struct coll_state {
    int reduce; /* 0 allgather, 1 reducescatter */
    size_t minbytes, maxbytes;
    int factor;
    mfsdp_dtype_t dtype;
    int segments;
    const char *manifest;
    int algo;             /* -1: every algorithm in turn */
    const char *tune_out; /* --tune-out: the algorithm table to write (NULL: none) */
    int sharded;          /* --sharded: every segment a 1-D tensor of the sharded tail */
} coll_state_t;

#define COLL_USAGE                                                                                 \
    "  -b, --minbytes N[K|M|G]    smallest buffer (whole gathered / reduced buffer; default "      \
    "1M)\n"                                                                                        \
    "  -e, --maxbytes N[K|M|G]    largest buffer (default 64M)\n"                                  \
    "  -f, --stepfactor F         size multiplier (default 2)\n"                                   \
    "  -d, --datatype T           float or bfloat16 (default bfloat16)\n"                          \
    "  -o, --op sum               reduction (sum only)\n"                                          \
    "      --segments K           K owner segments of equal size (default 8)\n"                    \
    "      --manifest FILE        segments: the params of the manifest's group with the most "     \
    "params\n"                                                                                     \
    "      --algo A               direct, chain, native, auto or all (default all, in turn)\n"     \
    "      --sharded              every segment a 1-D (AdamW) tensor kept in FSDP's slices (tail " \
    "policy shard): the sharded tail's all-gather / all-to-all and sum instead of owners\n"        \
    "      --tune-out FILE        write the fastest algorithm per size (in-place all-gather, "     \
    "reduce-scatter) as MFSDP_ALGO_TABLE rows for this collective and rank count (other rows "     \
    "of FILE are kept; needs --algo all)\n"                                                        \
    "  env MFSDP_PERF_CORRUPT=1   test only: flip one element of mfsdp's result (#wrong > 0)\n"

static const struct option coll_long_opts[] = {
    {"minbytes", required_argument, NULL, 'b'},
    {"maxbytes", required_argument, NULL, 'e'},
    {"stepfactor", required_argument, NULL, 'f'},
    {"datatype", required_argument, NULL, 'd'},
    {"op", required_argument, NULL, 'o'},
    {"segments", required_argument, NULL, 'K'},
    {"manifest", required_argument, NULL, 'M'},
    {"algo", required_argument, NULL, 'A'},
    {"tune-out", required_argument, NULL, 'T'},
    {"sharded", no_argument, NULL, 'S'},
    {NULL, 0, NULL, 0},
};

static void coll_defaults(void *state)
{
    coll_state_t *st = state;
    st->minbytes = 1u << 20;
    st->maxbytes = 64u << 20;
    st->factor = 2;
    st->dtype = MFSDP_BFLOAT16;
    st->segments = 8;
    st->manifest = NULL;
    st->algo = -1;
    st->tune_out = NULL;
    st->sharded = 0;
}

static void allgather_defaults(void *state)
{
    coll_defaults(state);
}

static void reducescatter_defaults(void *state)
{
    coll_defaults(state);
    ((coll_state_t *)state)->reduce = 1;
}

static int coll_parse_opt(void *state, int opt, const char *arg)
{
    coll_state_t *st = state;
    switch (opt) {
    case 'b':
        return parse_size(arg, &st->minbytes);
    case 'e':
        return parse_size(arg, &st->maxbytes);
    case 'f':
        return parse_int(arg, 2, &st->factor);
    case 'd':
        if (strcmp(arg, "float") == 0) {
            st->dtype = MFSDP_FLOAT32;
        } else if (strcmp(arg, "bfloat16") == 0) {
            st->dtype = MFSDP_BFLOAT16;
        } else {
            return -1;
        }
        return 0;
    case 'o':
        return strcmp(arg, "sum") == 0 ? 0 : -1;
    case 'K':
        if (parse_int(arg, 1, &st->segments) != 0 || st->segments > COLL_MAX_SEGS) {
            return -1;
        }
        return 0;
    case 'M':
        st->manifest = arg;
        return 0;
    case 'A':
        if (strcmp(arg, "all") == 0) {
            st->algo = -1;
        } else if (strcmp(arg, "direct") == 0) {
            st->algo = MFSDP_ALGO_DIRECT;
        } else if (strcmp(arg, "chain") == 0) {
            st->algo = MFSDP_ALGO_CHAIN;
        } else if (strcmp(arg, "native") == 0) {
            st->algo = MFSDP_ALGO_NATIVE;
        } else if (strcmp(arg, "auto") == 0) {
            st->algo = MFSDP_ALGO_AUTO;
        } else {
            return -1;
        }
        return 0;
    case 'T':
        st->tune_out = arg;
        return 0;
    case 'S':
        st->sharded = 1;
        return 0;
    default:
        return -1;
    }
}

/* One size of the benchmark: K segment matrices [rows_i, COLL_COLS], rows_i a multiple of
 * the world size (no padding rows), in one group: the FSDP per-rank block is S bytes,
 * segment i at byte offset off[i] with c_i = rows_i / n rows per rank. */
typedef struct coll_case {
    int reduce;
    int sharded; /* segments are 1-D tensors of the sharded tail (rows x COLL_COLS elements) */
    mfsdp_dtype_t dt;
    size_t elt;
    int nseg;
    int64_t rows[COLL_MAX_SEGS];
    size_t off[COLL_MAX_SEGS]; /* elements in the per-rank block */
    size_t sel;                /* elements of one per-rank block */
    size_t S;                  /* bytes of one per-rank block */
    mfsdp_ctx_h ctx;
    char *send;  /* allgather: S; reducescatter: n * S */
    char *recv;  /* allgather: n * S; reducescatter: S */
    char *recv2; /* in-place buffer: n * S */
    MPI_Datatype mtype;
    MPI_Op mop;
    int corrupt;
    mfsdp_manifest_t *manifest;
} coll_case_t;

/* Rank r's value of element e (in the per-rank block, or in block j of a reduce-scatter
 * input): small integers, exact in bfloat16, and their sum over <= 16 ranks too. */
static float fill_val(int r, int j, size_t e)
{
    return (float)((int)((e * 7u + (size_t)r * 13u + (size_t)j * 5u) % 17u) - 8);
}

static void put_elt(void *buf, mfsdp_dtype_t dt, size_t e, float v)
{
    if (dt == MFSDP_FLOAT32) {
        ((float *)buf)[e] = v;
    } else {
        ((uint16_t *)buf)[e] = mfsdp_f32_to_bf16(v);
    }
}

static float get_elt(const void *buf, mfsdp_dtype_t dt, size_t e)
{
    return dt == MFSDP_FLOAT32 ? ((const float *)buf)[e]
                               : mfsdp_bf16_to_f32(((const uint16_t *)buf)[e]);
}

/* bfloat16 sum for MPI_Reduce_scatter_block (MPI has no bfloat16 type): widen, add in fp32,
 * round to nearest even (kernels/cpu/cast.c's rule), inline so that the loop vectorizes as
 * a job's own op would. */
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt)
{
    (void)dt;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) {
        const uint32_t ua = (uint32_t)a[i] << 16, ub = (uint32_t)b[i] << 16;
        float fa, fb;
        memcpy(&fa, &ua, sizeof(fa));
        memcpy(&fb, &ub, sizeof(fb));
        const float f = fa + fb;
        uint32_t u;
        memcpy(&u, &f, sizeof(u));
        b[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x0040u)
                                               : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* The synthesized manifest of a case: one group "bench" of K Muon matrices, or, --sharded, of
 * K vectors of as many elements (AdamW: the sharded tail under tail policy shard). */
static char *coll_manifest_json(const coll_case_t *c)
{
    const size_t cap = 256 + (size_t)c->nseg * 128;
    char *s = malloc(cap);
    if (s == NULL) {
        return NULL;
    }
    const char *dts = c->dt == MFSDP_FLOAT32 ? "float32" : "bfloat16";
    size_t n = (size_t)snprintf(s, cap,
                                "{\"format\": \"mfsdp-manifest/1\", \"groups\": [{\"name\": "
                                "\"bench\", \"params\": [");
    for (int i = 0; i < c->nseg; i++) {
        if (c->sharded) {
            n += (size_t)snprintf(s + n, cap - n,
                                  "%s{\"name\": \"seg%d\", \"shape\": [%lld], \"dtype\": \"%s\"}",
                                  i ? ", " : "", i, (long long)c->rows[i] * COLL_COLS, dts);
            continue;
        }
        n += (size_t)snprintf(s + n, cap - n,
                              "%s{\"name\": \"seg%d\", \"shape\": [%lld, %d], \"dtype\": \"%s\"}",
                              i ? ", " : "", i, (long long)c->rows[i], COLL_COLS, dts);
    }
    snprintf(s + n, cap - n, "]}]}");
    return s;
}

/* Segment weights: equal (--segments K) or the element counts of the params of the
 * manifest's group with the most params (the block layout, e.g. one Llama block: q, k, v, o, gate,
 * up, down, two norms). */
static int coll_weights(const coll_state_t *st, double *w, int *nseg)
{
    if (st->manifest == NULL) {
        *nseg = st->segments;
        for (int i = 0; i < *nseg; i++) {
            w[i] = 1.0 / *nseg;
        }
        return 0;
    }
    char err[256] = "";
    mfsdp_manifest_t *m = NULL;
    if (mfsdp_manifest_load(st->manifest, err, sizeof(err), &m) != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: manifest %s: %s\n", st->manifest, err);
        return -1;
    }
    /* The group with the most params (a transformer block, not the root group of the
     * embeddings), the first of those with the most elements. */
    size_t best = 0;
    double best_n = -1;
    for (size_t g = 0; g < m->ngroups; g++) {
        double tot = 0;
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            tot += (double)m->groups[g].params[i].numel;
        }
        const size_t np = m->groups[g].nparams, bp = m->groups[best].nparams;
        if (best_n < 0 || np > bp || (np == bp && tot > best_n)) {
            best_n = tot;
            best = g;
        }
    }
    const mfsdp_group_desc_t *g = &m->groups[best];
    if (g->nparams > COLL_MAX_SEGS) {
        fprintf(stderr, "mfsdp-perf: group %s has %zu params (max %d)\n", g->name, g->nparams,
                COLL_MAX_SEGS);
        mfsdp_manifest_free(m);
        return -1;
    }
    *nseg = (int)g->nparams;
    for (size_t i = 0; i < g->nparams; i++) {
        w[i] = (double)g->params[i].numel / best_n;
    }
    if (g_rank == 0) {
        fprintf(stderr, "# segments: the %zu params of group '%s' of %s, scaled\n", g->nparams,
                g->name, st->manifest);
    }
    mfsdp_manifest_free(m);
    return 0;
}

/* Shapes of one size: segment i gets w_i of the bytes, rounded down to whole [n, COLL_COLS]
 * row blocks, at least one. */
static void coll_shape(coll_case_t *c, const double *w, size_t bytes)
{
    const size_t unit = (size_t)g_world * COLL_COLS; /* elements of n rows */
    const double tot_elems = (double)bytes / (double)c->elt;
    c->sel = 0;
    for (int i = 0; i < c->nseg; i++) {
        size_t units = (size_t)(tot_elems * w[i] / (double)unit);
        units = units ? units : 1;
        c->rows[i] = (int64_t)(units * (size_t)g_world);
        c->off[i] = c->sel;
        c->sel += units * COLL_COLS;
    }
    c->S = c->sel * c->elt;
}

/* Operations (as nccl-tests' testColl): init (untimed), run (timed), check. */
typedef struct coll_op {
    const char *name;
    int mfsdp;    /* 1: the mfsdp owner collective */
    int in_place; /* 1: in-place variant */
} coll_op_t;

static void coll_fill_send(coll_case_t *c, char *dst)
{
    if (!c->reduce) {
        for (size_t e = 0; e < c->sel; e++) {
            put_elt(dst, c->dt, e, fill_val(g_rank, 0, e));
        }
        return;
    }
    for (int j = 0; j < g_world; j++) {
        char *blk = dst + (size_t)j * c->S;
        for (size_t e = 0; e < c->sel; e++) {
            put_elt(blk, c->dt, e, fill_val(g_rank, j, e));
        }
    }
}

/* Prepare one run; poison outputs before the checked (last) run. */
static void coll_init(coll_case_t *c, const coll_op_t *op, int last)
{
    const size_t n = (size_t)g_world;
    if (!c->reduce) {
        if (op->in_place) {
            if (last) {
                memset(c->recv2, 0xA5, n * c->S);
            }
            memcpy(c->recv2 + (size_t)g_rank * c->S, c->send, c->S);
        } else if (last) {
            memset(c->recv, 0xA5, n * c->S);
        }
        return;
    }
    if (op->in_place) {
        memcpy(c->recv2, c->send, n * c->S); /* MPI_IN_PLACE reads its input from recvbuf */
    } else if (last) {
        memset(c->recv, 0x5A, c->S);
    }
    if (op->mfsdp && last) {
        mfsdp_ctx_scale_grads(c->ctx, 0.0); /* the checked run's reduce is the only one */
    }
}

static int coll_run(coll_case_t *c, const coll_op_t *op)
{
    const int S = (int)(c->S / c->elt);
    int rc = MPI_SUCCESS;
    mfsdp_status_t st = MFSDP_OK;
    if (!c->reduce) {
        if (!op->mfsdp) {
            rc = op->in_place
                     ? MPI_Allgather(MPI_IN_PLACE, 0, c->mtype, c->recv2, S, c->mtype,
                                     MPI_COMM_WORLD)
                     : MPI_Allgather(c->send, S, c->mtype, c->recv, S, c->mtype, MPI_COMM_WORLD);
        } else {
            char *out = op->in_place ? c->recv2 : c->recv;
            const void *in = op->in_place ? out + (size_t)g_rank * c->S : c->send;
            st = mfsdp_ctx_allgather(c->ctx, 0, in, out, c->sel, c->dt);
        }
    } else {
        if (!op->mfsdp) {
            rc = op->in_place ? MPI_Reduce_scatter_block(MPI_IN_PLACE, c->recv2, S, c->mtype,
                                                         c->mop, MPI_COMM_WORLD)
                              : MPI_Reduce_scatter_block(c->send, c->recv, S, c->mtype, c->mop,
                                                         MPI_COMM_WORLD);
        } else {
            st = mfsdp_ctx_reduce(c->ctx, 0, c->send, c->recv, c->sel, c->dt, MFSDP_OP_SUM, 1.0);
        }
    }
    if (rc != MPI_SUCCESS || st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: rank %d: %s failed: %s\n", g_rank, op->name,
                st != MFSDP_OK ? mfsdp_status_string(st) : "MPI error");
        return -1;
    }
    return 0;
}

/* #wrong of this rank against the host-computed reference. */
static long coll_check(coll_case_t *c, const coll_op_t *op)
{
    long wrong = 0;
    const size_t n = (size_t)g_world;
    const int corrupt = c->corrupt && op->mfsdp && g_rank == 0;
    if (!c->reduce) {
        char *out = op->in_place ? c->recv2 : c->recv;
        if (corrupt) {
            put_elt(out, c->dt, 0, get_elt(out, c->dt, 0) + 1.0f);
        }
        for (size_t r = 0; r < n; r++) {
            const char *blk = out + r * c->S;
            for (size_t e = 0; e < c->sel; e++) {
                wrong += get_elt(blk, c->dt, e) != fill_val((int)r, 0, e);
            }
        }
        return wrong;
    }
    if (!op->mfsdp || c->sharded) {
        /* Native, or the sharded tail: FSDP's output shard holds the sums (block g_rank). */
        const char *out = op->in_place ? c->recv2 : c->recv;
        if (corrupt) {
            put_elt(c->recv, c->dt, 0, get_elt(c->recv, c->dt, 0) + 1.0f);
        }
        for (size_t e = 0; e < c->sel; e++) {
            float ref = 0.0f;
            for (size_t r = 0; r < n; r++) {
                ref += fill_val((int)r, g_rank, e);
            }
            wrong += get_elt(out, c->dt, e) != ref;
        }
        /* ... and the context the fp32 gradients of this rank's slices: segment i's slice on
         * rank g_rank is block g_rank's elements off[i] .. off[i] + c_i x COLL_COLS. */
        for (int i = 0; op->mfsdp && i < c->nseg; i++) {
            char name[32];
            snprintf(name, sizeof(name), "seg%d", i);
            mfsdp_param_view_t v;
            const size_t len = (size_t)(c->rows[i] / g_world) * COLL_COLS;
            if (mfsdp_ctx_get_param(c->ctx, name, &v) != MFSDP_OK ||
                v.owner != MFSDP_OWNER_SHARDED || v.grad == NULL || v.local_elems != len) {
                wrong += (long)len;
                continue;
            }
            for (size_t k = 0; k < len; k++) {
                float ref = 0.0f;
                for (size_t r = 0; r < n; r++) {
                    ref += fill_val((int)r, g_rank, c->off[i] + k);
                }
                wrong += v.grad[k] != ref;
            }
        }
        return wrong;
    }
    /* Reduce-to-owner: recvbuf is zero (owner-managed bytes) and each owner holds the full
     * summed gradient of its segments: row q of segment i came from block q / c_i. */
    for (size_t b = 0; b < c->S; b++) {
        wrong += c->recv[b] != 0;
    }
    for (int i = 0; i < c->nseg; i++) {
        char name[32];
        snprintf(name, sizeof(name), "seg%d", i);
        mfsdp_param_view_t v;
        if (mfsdp_ctx_get_param(c->ctx, name, &v) != MFSDP_OK) {
            wrong++;
            continue;
        }
        if (v.owner != g_rank) {
            continue;
        }
        if (v.grad == NULL) {
            wrong += (long)v.numel;
            continue;
        }
        const int64_t ci = c->rows[i] / g_world;
        for (int64_t q = 0; q < c->rows[i]; q++) {
            const int j = (int)(q / ci);
            for (int64_t col = 0; col < COLL_COLS; col++) {
                const size_t e = c->off[i] + (size_t)((q - j * ci) * COLL_COLS + col);
                float ref = 0.0f;
                for (size_t r = 0; r < n; r++) {
                    ref += fill_val((int)r, j, e);
                }
                float got = v.grad[q * COLL_COLS + col];
                if (corrupt && q == 0 && col == 0) {
                    got += 1.0f;
                }
                wrong += got != ref;
            }
        }
    }
    return wrong;
}

static const coll_op_t coll_ops[] = {
    {"native", 0, 0},
    {"native_inplace", 0, 1},
    {"mfsdp", 1, 0},
    {"mfsdp_inplace", 1, 1},
};
#define COLL_NOPS 4

/* Allocate buffers and the context of one (size, algorithm); prime it with one untimed
 * call (the first all-gather takes the initial weights). */
static int coll_setup(coll_case_t *c, mfsdp_algo_t algo)
{
    const size_t n = (size_t)g_world;
    c->send = malloc(c->reduce ? n * c->S : c->S);
    c->recv = malloc(c->reduce ? c->S : n * c->S);
    c->recv2 = malloc(n * c->S);
    if (c->send == NULL || c->recv == NULL || c->recv2 == NULL) {
        fprintf(stderr, "mfsdp-perf: rank %d: out of memory for %zu-byte blocks\n", g_rank, c->S);
        return -1;
    }
    memset(c->recv, 0, c->reduce ? c->S : n * c->S);
    memset(c->recv2, 0, n * c->S);
    coll_fill_send(c, c->send);
    char *json = coll_manifest_json(c);
    char err[256] = "";
    mfsdp_manifest_t *m = NULL;
    mfsdp_status_t st =
        json != NULL ? mfsdp_manifest_parse(json, strlen(json), "mfsdp-perf", err, sizeof(err), &m)
                     : MFSDP_ERR_NO_MEMORY;
    free(json);
    if (st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: synthesized manifest: %s %s\n", mfsdp_status_string(st), err);
        return -1;
    }
    st = perf_ctx_create(m, c->sharded ? MFSDP_TAIL_SHARD : MFSDP_TAIL_OWNER, algo, &c->ctx);
    /* The context borrows the manifest: it lives until coll_teardown(). */
    if (st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: context: %s\n", mfsdp_status_string(st));
        mfsdp_manifest_free(m);
        return -1;
    }
    c->manifest = m;
    /* Prime: the first all-gather takes the initial weights from the send buffers. */
    if (!c->reduce) {
        st = mfsdp_ctx_allgather(c->ctx, 0, c->send, c->recv, c->sel, c->dt);
    } else {
        char *w = malloc(c->S), *full = malloc(n * c->S);
        if (w == NULL || full == NULL) {
            free(w);
            free(full);
            return -1;
        }
        memset(w, 0, c->S);
        st = mfsdp_ctx_allgather(c->ctx, 0, w, full, c->sel, c->dt);
        free(w);
        free(full);
    }
    if (st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: priming all-gather: %s\n", mfsdp_status_string(st));
        return -1;
    }
    return 0;
}

static void coll_teardown(coll_case_t *c)
{
    mfsdp_ctx_destroy(&c->ctx);
    mfsdp_manifest_free(c->manifest);
    c->manifest = NULL;
    free(c->send);
    free(c->recv);
    free(c->recv2);
    c->send = c->recv = c->recv2 = NULL;
}

static void coll_print(const coll_state_t *st, const perf_opts_t *o, const coll_case_t *c,
                       const char *sys, const double *t, const long *wrong, int nvar,
                       const double *ratio, size_t staging, size_t peak, int shared)
{
    const double n = (double)g_world;
    const double size = (double)(c->S * (size_t)g_world);
    const char *type = c->dt == MFSDP_FLOAT32 ? "float" : "bfloat16";
    double algbw[2], busbw[2];
    char wb[24];
    for (int v = 0; v < nvar; v++) {
        algbw[v] = size / t[v] * 1e-9;
        busbw[v] = algbw[v] * (n - 1) / n;
    }
    if (o->json) {
        printf("{\"subcommand\":\"%s\",\"ranks\":%d,\"system\":\"%s\",\"size\":%.0f,"
               "\"count\":%zu,\"type\":\"%s\",\"redop\":\"%s\",\"root\":-1,"
               "\"time_us\":%.1f,\"algbw\":%.4f,\"busbw\":%.4f,\"wrong\":%s",
               st->reduce ? "reducescatter" : "allgather", g_world, sys, size,
               c->sel * (size_t)g_world, type, st->reduce ? "sum" : "none", 1e6 * t[0], algbw[0],
               busbw[0], wrong_txt(wrong[0], 1, wb));
        if (nvar > 1) {
            printf(",\"ip_time_us\":%.1f,\"ip_algbw\":%.4f,\"ip_busbw\":%.4f,\"ip_wrong\":%s",
                   1e6 * t[1], algbw[1], busbw[1], wrong_txt(wrong[1], 1, wb));
        }
        if (ratio != NULL) {
            printf(",\"ratio\":%.4f", ratio[0]);
            if (nvar > 1) {
                printf(",\"ip_ratio\":%.4f", ratio[1]);
            }
            printf(",\"staging_bytes\":%zu,\"peak_bytes\":%zu,\"shared\":%d", staging, peak,
                   shared);
        }
        printf("}\n");
    } else {
        printf("%12.0f %12zu %8s %5s %4d %-13s", size, c->sel * (size_t)g_world, type,
               st->reduce ? "sum" : "none", -1, sys);
        for (int v = 0; v < 2; v++) {
            if (v < nvar) {
                printf(" %10.1f %7.3f %7.3f %6s", 1e6 * t[v], algbw[v], busbw[v],
                       wrong_txt(wrong[v], 0, wb));
            } else {
                printf(" %10s %7s %7s %6s", "n/a", "", "", "");
            }
        }
        if (ratio != NULL) {
            printf(" %6.3f", ratio[0]);
            if (nvar > 1) {
                printf(" %6.3f", ratio[1]);
            } else {
                printf(" %6s", "n/a");
            }
            printf(" %11zu %11zu", staging, peak);
        }
        printf("\n");
    }
    fflush(stdout);
}

/* --tune-out: the fastest algorithm at each measured size as MFSDP_ALGO_TABLE rows for this
 * collective and world size, boundaries at the geometric means of neighbouring sizes (the
 * first row from 0 bytes, the last without bound), equal neighbours merged; FILE's rows for
 * other collectives or rank counts are kept. Rank 0 only. Returns 0, or 1 with a message. */
#define COLL_MAX_SIZES 64
static int coll_write_table(const coll_state_t *st, const size_t *size, const mfsdp_algo_t *best,
                            int nsizes)
{
    mfsdp_algo_table_t old = {0};
    char err[512];
    if (access(st->tune_out, F_OK) == 0 &&
        mfsdp_algo_table_load(st->tune_out, &old, err, sizeof(err)) != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: --tune-out: not overwriting %s: %s\n", st->tune_out, err);
        return 1;
    }
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", st->tune_out) >= (int)sizeof(tmp)) {
        fprintf(stderr, "mfsdp-perf: --tune-out: path too long\n");
        mfsdp_algo_table_free(&old);
        return 1;
    }
    FILE *f = fopen(tmp, "w");
    if (f == NULL) {
        fprintf(stderr, "mfsdp-perf: --tune-out: cannot write %s: %s\n", tmp, strerror(errno));
        mfsdp_algo_table_free(&old);
        return 1;
    }
    char line[160];
    fprintf(f, "# mfsdp algorithm table (MFSDP_ALGO_TABLE), written by mfsdp-perf --tune-out:\n"
               "# the fastest mfsdp algorithm measured per buffer size (all-gather in place, "
               "reduce-scatter out of place); the first matching row wins\n"
               "coll,nranks,min_bytes,max_bytes,algo\n");
    for (size_t i = 0; i < old.nrows; i++) {
        if (old.rows[i].reduce != st->reduce || old.rows[i].nranks != g_world) {
            mfsdp_algo_row_format(&old.rows[i], line, sizeof(line));
            fprintf(f, "%s\n", line);
        }
    }
    mfsdp_algo_table_free(&old);
    for (int i = 0; i < nsizes;) {
        int j = i;
        while (j + 1 < nsizes && best[j + 1] == best[i]) {
            j++;
        }
        mfsdp_algo_row_t r = {
            .reduce = st->reduce,
            .nranks = g_world,
            .min_bytes = i == 0 ? 0 : (size_t)sqrt((double)size[i - 1] * (double)size[i]) + 1,
            .max_bytes =
                j == nsizes - 1 ? SIZE_MAX : (size_t)sqrt((double)size[j] * (double)size[j + 1]),
            .algo = best[i],
        };
        mfsdp_algo_row_format(&r, line, sizeof(line));
        fprintf(f, "%s\n", line);
        i = j + 1;
    }
    if (fclose(f) != 0 || rename(tmp, st->tune_out) != 0) {
        fprintf(stderr, "mfsdp-perf: --tune-out: writing %s failed: %s\n", st->tune_out,
                strerror(errno));
        unlink(tmp);
        return 1;
    }
    fprintf(stderr, "# --tune-out: %d size(s) of %s at %d ranks written to %s\n", nsizes,
            st->reduce ? "reducescatter" : "allgather", g_world, st->tune_out);
    return 0;
}

static int coll_run_all(const perf_opts_t *o, void *state)
{
    const coll_state_t *st = state;
    double w[COLL_MAX_SEGS];
    coll_case_t c;
    memset(&c, 0, sizeof(c));
    c.reduce = st->reduce;
    c.sharded = st->sharded;
    c.dt = st->dtype;
    c.elt = mfsdp_dtype_size(c.dt);
    c.corrupt = corrupt_requested();
    if (coll_weights(st, w, &c.nseg) != 0) {
        return 2;
    }
    if (st->minbytes > st->maxbytes) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf: -b %zu is above -e %zu\n", st->minbytes, st->maxbytes);
        }
        return 2;
    }
    if (st->tune_out != NULL && st->algo >= 0) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf: --tune-out compares every algorithm: drop --algo\n");
        }
        return 2;
    }
    if (st->tune_out != NULL && st->sharded) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf: --tune-out measures the owners' algorithms: drop "
                            "--sharded\n");
        }
        return 2;
    }
    c.mtype = c.dt == MFSDP_FLOAT32 ? MPI_FLOAT : MPI_UINT16_T;
    c.mop = MPI_SUM;
    if (c.dt == MFSDP_BFLOAT16) {
        MPI_Op_create(bf16_sum, 1, &c.mop);
    }
    mfsdp_algo_t algos[4];
    int nalgo = 0;
    if (st->algo < 0) {
        algos[nalgo++] = MFSDP_ALGO_DIRECT;
        algos[nalgo++] = MFSDP_ALGO_CHAIN;
        algos[nalgo++] = MFSDP_ALGO_NATIVE;
    } else {
        algos[nalgo++] = (mfsdp_algo_t)st->algo;
    }
    const int nops = st->reduce ? 3 : 4; /* reduce-to-owner has no in-place form */
    FILE *hdr = o->json ? stderr : stdout;
    const mfsdp_config_t *cfg = NULL;
    const size_t budget = mfsdp_config_get(&cfg) == MFSDP_OK ? cfg->staging_bytes : 0;
    if (g_rank == 0) {
        fprintf(hdr, "# mfsdp-perf %s: native %s vs mfsdp %s on one FSDP-layout buffer, %d ranks\n",
                st->reduce ? "reducescatter" : "allgather",
                st->reduce ? "MPI_Reduce_scatter_block" : "MPI_Allgather",
                st->reduce ? "reduce-to-owner" : "owner-broadcast", g_world);
        fprintf(hdr,
                "# %d segments [rows, %d]%s per buffer, rows a multiple of %d; size = bytes of the "
                "whole buffer (n blocks); time = median over %d run(s) of the slowest rank, "
                "%d warm-up, interleaved; busbw = algbw * (n-1)/n; check %d\n",
                c.nseg, COLL_COLS,
                c.sharded ? " as 1-D tensors of the sharded tail (tail policy shard)" : "", g_world,
                o->iters, o->warmup, o->check);
        fprintf(hdr,
                "# ratio = mfsdp busbw / native busbw of the same run (out-of-place, "
                "in-place); staging = the context's communication staging bytes per rank "
                "(largest group call; MFSDP_STAGING_BYTES budget %zu), peak = all its bytes "
                "(max over ranks)\n",
                budget);
        if (!st->reduce) {
            fprintf(hdr, "# direct all-gather: %s (MFSDP_SHM=%d; JSON: \"shared\" per row)\n",
                    cfg != NULL && cfg->shm
                        ? "copies the owners' tensors from their arenas in shared memory"
                        : "receives the owners' tensors as messages",
                    cfg != NULL ? cfg->shm : 0);
        }
        if (!o->json) {
            printf("#%11s %12s %8s %5s %4s %-13s %10s %7s %7s %6s %10s %7s %7s %6s %6s %6s %11s "
                   "%11s\n",
                   "size", "count", "type", "redop", "root", "system", "time", "algbw", "busbw",
                   "#wrong", "time", "algbw", "busbw", "#wrong", "ratio", "ratio", "staging",
                   "peak");
            printf("#%11s %12s %8s %5s %4s %-13s %10s %7s %7s %6s %10s %7s %7s %6s %6s %6s %11s "
                   "%11s\n",
                   "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "oop", "(us)",
                   "(GB/s)", "(GB/s)", "ip", "oop", "ip", "(B)", "(B)");
        }
    }
    int rc = 0;
    double t[COLL_NOPS][64];
    const int iters = o->iters < 64 ? o->iters : 64;
    size_t tsize[COLL_MAX_SIZES];       /* --tune-out: the sizes measured */
    mfsdp_algo_t tbest[COLL_MAX_SIZES]; /* ... and the fastest algorithm at each */
    double tbest_s = 0.0;
    int ntune = 0;
    for (size_t bytes = st->minbytes; bytes <= st->maxbytes && rc == 0;
         bytes *= (size_t)st->factor) {
        coll_shape(&c, w, bytes);
        const int tune = st->tune_out != NULL && ntune < COLL_MAX_SIZES;
        for (int a = 0; a < nalgo && rc == 0; a++) {
            int ok = coll_setup(&c, algos[a]) == 0;
            int all_ok = ok;
            MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            long wrong[COLL_NOPS] = {0};
            if (!all_ok) {
                rc = 1;
                coll_teardown(&c);
                break;
            }
            const int total = o->warmup + iters;
            for (int it = 0; it < total && rc == 0; it++) {
                for (int op = 0; op < nops; op++) {
                    const int last = it == total - 1;
                    coll_init(&c, &coll_ops[op], last && o->check);
                    MPI_Barrier(MPI_COMM_WORLD);
                    const double t0 = now_s();
                    const int bad = coll_run(&c, &coll_ops[op]);
                    const double dt = run_max(now_s() - t0);
                    if (sum_long(bad != 0) != 0) {
                        rc = 1;
                        break;
                    }
                    if (it >= o->warmup) {
                        t[op][it - o->warmup] = dt;
                    }
                    if (last && o->check) {
                        wrong[op] = sum_long(coll_check(&c, &coll_ops[op]));
                    }
                }
            }
            if (rc == 0) {
                double med[COLL_NOPS];
                for (int op = 0; op < nops; op++) {
                    med[op] = median(t[op], iters);
                }
                /* FSDP2 gathers in place and reduce-scatters out of place */
                const double mine_s = med[st->reduce ? 2 : 3];
                if (tune && (a == 0 || mine_s < tbest_s)) {
                    tsize[ntune] = c.S * (size_t)g_world;
                    tbest[ntune] = algos[a];
                    tbest_s = mine_s;
                }
                mfsdp_ctx_stats_t s;
                memset(&s, 0, sizeof(s));
                mfsdp_ctx_get_stats(c.ctx, &s);
                unsigned long long mine[3] = {s.comm_staging_bytes, s.peak_bytes,
                                              (unsigned long long)s.gather_shared},
                                   mx[3];
                MPI_Allreduce(mine, mx, 3, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
                if (g_rank == 0) {
                    char sys[32];
                    coll_print(st, o, &c, "native", med, wrong, 2, NULL, 0, 0, 0);
                    snprintf(sys, sizeof(sys), "mfsdp-%s", mfsdp_algo_name(s.gather_algo));
                    if (st->reduce) {
                        snprintf(sys, sizeof(sys), "mfsdp-%s", mfsdp_algo_name(s.reduce_algo));
                    }
                    const double ratio[2] = {med[0] / med[2], nops > 3 ? med[1] / med[3] : 0.0};
                    coll_print(st, o, &c, sys, med + 2, wrong + 2, nops - 2, ratio, (size_t)mx[0],
                               (size_t)mx[1], !st->reduce && mx[2] != 0);
                }
                for (int op = 0; op < nops; op++) {
                    if (wrong[op] != 0) {
                        rc = 1;
                    }
                }
            }
            coll_teardown(&c);
        }
        ntune += tune && rc == 0;
        if (st->factor < 2 || bytes > st->maxbytes / (size_t)st->factor) {
            break;
        }
    }
    if (rc == 0 && st->tune_out != NULL && g_rank == 0) {
        rc = coll_write_table(st, tsize, tbest, ntune);
    }
    if (c.dt == MFSDP_BFLOAT16) {
        MPI_Op_free(&c.mop);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------
 * optstep: the Muon step of every Muon matrix of a manifest, three placements
 */

typedef struct opt_state {
    const char *manifest;
} opt_state_t;

static const struct option opt_long_opts[] = {
    {"manifest", required_argument, NULL, 'M'},
    {NULL, 0, NULL, 0},
};

static void opt_defaults(void *state)
{
    ((opt_state_t *)state)->manifest = NULL;
}

static int opt_parse_opt(void *state, int opt, const char *arg)
{
    if (opt != 'M') {
        return -1;
    }
    ((opt_state_t *)state)->manifest = arg;
    return 0;
}

/* One Muon matrix: m x k, FSDP shard of c rows per rank (zero padding rows). */
typedef struct opt_mat {
    const mfsdp_param_desc_t *p;
    size_t group;       /* manifest group of the matrix */
    int64_t m, k, c;    /* c: FSDP rows per rank */
    int64_t fsdp_o;     /* element offset of its shard in the group's per-rank block */
    mfsdp_muon_hp_t hp; /* the group's Muon hyper-parameters (lr_scale, weight_decay) */
    int owner;          /* mfsdp owner (the plan) */
    int root;           /* DMuon root: round-robin over matrices */
    int gs_borrowed;    /* 1: gs points into a caller's buffer (trainstep) */
    float *gs;          /* this rank's gradient shard (c k), as after FSDP's reduce-scatter */
    /* mfsdp (owner only): full W, M, G */
    float *ow, *om, *og;
    /* FSDP2-Muon: gathered G (n c k), full W, M (n c k, padding rows unused) */
    float *fg, *fw, *fm;
    /* DMuon: root's gathered G, full W, M (n c k); every rank's returned W shard (c k) */
    float *dg, *dw, *dm, *dws;
} opt_mat_t;

typedef struct opt_ctx {
    size_t nmat;
    opt_mat_t *mat;
    float *ws;
    size_t ws_elems;
    MPI_Request *req;
    size_t maxmk;      /* elements of the largest matrix */
    double muon_bytes; /* fp32 bytes of all Muon matrices */
} opt_ctx_t;

static void opt_fill(float *x, size_t n, uint64_t seed, float scale)
{
    fill_normal(x, n, seed);
    for (size_t i = 0; i < n; i++) {
        x[i] *= scale;
    }
}

/* This rank's real rows of matrix a: the first one and how many. */
static int64_t opt_my_rows(const opt_mat_t *a, int64_t *first_p)
{
    const int64_t first = g_rank * a->c;
    const int64_t nrows = a->m - first;
    *first_p = first;
    return nrows < 0 ? 0 : (nrows > a->c ? a->c : nrows);
}

/* Initial state of matrix i: W ~ 0.02 N, M ~ 0.01 N, G ~ N (the same on every system). */
static void opt_init_mat(opt_mat_t *a, size_t i, float *tmp)
{
    const size_t mk = (size_t)(a->m * a->k), ck = (size_t)(a->c * a->k);
    int64_t first;
    const int64_t nrows = opt_my_rows(a, &first);
    opt_fill(tmp, mk, 0x6000u + i * 3, 1.0f);
    memset(a->gs, 0, ck * sizeof(float));
    if (nrows > 0) {
        memcpy(a->gs, tmp + (size_t)(first * a->k), (size_t)(nrows * a->k) * sizeof(float));
    }
    if (a->og != NULL) {
        memcpy(a->og, tmp, mk * sizeof(float));
    }
    opt_fill(tmp, mk, 0x6001u + i * 3, 0.02f);
    if (a->ow != NULL) {
        memcpy(a->ow, tmp, mk * sizeof(float));
    }
    memcpy(a->fw, tmp, mk * sizeof(float));
    if (a->dw != NULL) {
        memcpy(a->dw, tmp, mk * sizeof(float));
    }
    opt_fill(tmp, mk, 0x6002u + i * 3, 0.01f);
    if (a->om != NULL) {
        memcpy(a->om, tmp, mk * sizeof(float));
    }
    memcpy(a->fm, tmp, mk * sizeof(float));
    if (a->dm != NULL) {
        memcpy(a->dm, tmp, mk * sizeof(float));
    }
}

static int opt_update(opt_ctx_t *x, opt_mat_t *a, float *w, float *mom, const float *g)
{
    const mfsdp_status_t st =
        mfsdp_cpu_muon_update(w, mom, g, NULL, MFSDP_FLOAT32, a->m, a->k, a->p->nsplit, a->p->split,
                              &a->hp, x->ws, x->ws_elems);
    if (st != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: rank %d: muon update %s: %s\n", g_rank, a->p->name,
                mfsdp_status_string(st));
        return -1;
    }
    return 0;
}

/* mfsdp: owners step the matrices they own; no collective. */
static int opt_run_mfsdp(opt_ctx_t *x, double *comm, double *comp)
{
    const double t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        if (a->owner == g_rank && opt_update(x, a, a->ow, a->om, a->og) != 0) {
            return -1;
        }
    }
    *comm = 0.0;
    *comp = now_s() - t0;
    return 0;
}

/* FSDP2-Muon: all-gather every gradient, Newton-Schulz everywhere, keep the own rows. */
static int opt_run_fsdp2(opt_ctx_t *x, double *comm, double *comp)
{
    double t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        const int ck = (int)(a->c * a->k);
        MPI_Iallgather(a->gs, ck, MPI_FLOAT, a->fg, ck, MPI_FLOAT, MPI_COMM_WORLD, &x->req[i]);
    }
    MPI_Waitall((int)x->nmat, x->req, MPI_STATUSES_IGNORE);
    *comm = now_s() - t0;
    t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        if (opt_update(x, a, a->fw, a->fm, a->fg) != 0) {
            return -1;
        }
    }
    *comp = now_s() - t0;
    return 0;
}

/* DMuon/Dion-style: gather each gradient to its round-robin root, Newton-Schulz there,
 * scatter the updated rows back. */
static int opt_run_dmuon(opt_ctx_t *x, double *comm, double *comp)
{
    double t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        const int ck = (int)(a->c * a->k);
        MPI_Igather(a->gs, ck, MPI_FLOAT, a->dg, ck, MPI_FLOAT, a->root, MPI_COMM_WORLD,
                    &x->req[i]);
    }
    MPI_Waitall((int)x->nmat, x->req, MPI_STATUSES_IGNORE);
    *comm = now_s() - t0;
    t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        if (a->root == g_rank && opt_update(x, a, a->dw, a->dm, a->dg) != 0) {
            return -1;
        }
    }
    *comp = now_s() - t0;
    t0 = now_s();
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        const int ck = (int)(a->c * a->k);
        MPI_Iscatter(a->dw, ck, MPI_FLOAT, a->dws, ck, MPI_FLOAT, a->root, MPI_COMM_WORLD,
                     &x->req[i]);
    }
    MPI_Waitall((int)x->nmat, x->req, MPI_STATUSES_IGNORE);
    *comm += now_s() - t0;
    return 0;
}

/* Elements of x that differ from ref beyond the harness's fp32 tolerance
 * |x - ref| <= 1e-5 (1 + |ref|) (the systems reduce gradients in different orders), or
 * whose reference is not finite. */
static long count_mismatch(const float *x, const float *ref, size_t n)
{
    long wrong = 0;
    for (size_t e = 0; e < n; e++) {
        const float tol = 1e-5f * (1.0f + fabsf(ref[e]));
        wrong += !isfinite(ref[e]) || !(fabsf(x[e] - ref[e]) <= tol);
    }
    return wrong;
}

/* Mismatches of this rank's rows of matrix a between the reference ref (the whole m x k
 * matrix, mfsdp's result) and the two baselines' results: FSDP2-Muon's full copy fw and
 * DMuon's returned rows dws. */
static long opt_cmp_rows(const opt_mat_t *a, const float *ref)
{
    int64_t first;
    const size_t n = (size_t)(opt_my_rows(a, &first) * a->k), off = (size_t)(first * a->k);
    return count_mismatch(a->fw + off, ref + off, n) + count_mismatch(a->dws, ref + off, n);
}

/* After one step from the initial state: this rank's rows of every matrix agree across the
 * three placements (mfsdp's owner broadcasts its result, untimed). */
static long opt_check(opt_ctx_t *x, float *tmp)
{
    long wrong = 0;
    const int corrupt = corrupt_requested() && g_rank == 0;
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        const size_t mk = (size_t)(a->m * a->k);
        if (a->owner == g_rank) {
            memcpy(tmp, a->ow, mk * sizeof(float));
        }
        MPI_Bcast(tmp, (int)mk, MPI_FLOAT, a->owner, MPI_COMM_WORLD);
        if (corrupt && i == 0) {
            tmp[(size_t)(g_rank * a->c * a->k)] += 1.0f;
        }
        wrong += opt_cmp_rows(a, tmp);
    }
    return wrong;
}

/* The Muon hyper-parameters of group g as the runtime's owner step derives them
 * (runtime/step.c): the manifest's, lr times the group's lr_scale, the group's weight decay
 * when it sets one; the schedule's factor is 1 (the harness sets it so on its contexts). */
static void opt_group_hp(const mfsdp_manifest_t *m, size_t g, mfsdp_muon_hp_t *hp)
{
    const mfsdp_group_desc_t *gd = &m->groups[g];
    hp->lr = (float)(m->hp.lr * gd->lr_scale);
    hp->momentum = (float)m->hp.momentum;
    hp->weight_decay = (float)(gd->has_weight_decay ? gd->weight_decay : m->hp.weight_decay);
    hp->nesterov = m->hp.nesterov;
    hp->ns_steps = m->hp.ns_steps;
    hp->scale = m->hp.scale;
}

/* The Muon matrices of a plan with the buffers of the two baselines (and, with owner_bufs,
 * mfsdp's raw owner buffers ow, om, og); with borrow_gs the gradient shards gs are left
 * NULL for the caller to point into its reduce-scatter output. 0, or -1 out of memory
 * (whatever was allocated is released by opt_free()). */
static int opt_build(opt_ctx_t *x, const mfsdp_manifest_t *m, const mfsdp_plan_t *plan,
                     int owner_bufs, int borrow_gs)
{
    memset(x, 0, sizeof(*x));
    x->mat = calloc(plan->nshards, sizeof(*x->mat));
    x->req = calloc(plan->nshards + 1, sizeof(*x->req));
    int oom = x->mat == NULL || x->req == NULL;
    for (size_t s = 0; s < plan->nshards && !oom; s++) {
        const mfsdp_shard_t *sh = &plan->shards[s];
        if (sh->role != MFSDP_ROLE_MUON) {
            continue;
        }
        opt_mat_t *a = &x->mat[x->nmat];
        a->p = &m->groups[sh->group].params[sh->param];
        a->group = sh->group;
        a->m = sh->rows;
        a->k = sh->cols;
        a->c = (a->m + g_world - 1) / g_world;
        a->fsdp_o = sh->fsdp_o;
        opt_group_hp(m, sh->group, &a->hp);
        a->owner = sh->owner;
        a->root = (int)(x->nmat % (size_t)g_world);
        a->gs_borrowed = borrow_gs;
        const size_t mk = (size_t)(a->m * a->k), nck = (size_t)(g_world * a->c * a->k);
        x->maxmk = mk > x->maxmk ? mk : x->maxmk;
        x->muon_bytes += 4.0 * (double)mk;
        const size_t ws = mfsdp_muon_workspace_elems(a->m, a->k);
        x->ws_elems = ws > x->ws_elems ? ws : x->ws_elems;
        x->nmat++;
        if (!borrow_gs) {
            a->gs = malloc((size_t)(a->c * a->k) * sizeof(float));
            oom |= !a->gs;
        }
        a->dws = malloc((size_t)(a->c * a->k) * sizeof(float));
        a->fg = malloc(nck * sizeof(float));
        a->fw = calloc(nck, sizeof(float));
        a->fm = calloc(nck, sizeof(float));
        oom |= !a->dws || !a->fg || !a->fw || !a->fm;
        if (owner_bufs && a->owner == g_rank) {
            a->ow = malloc(mk * sizeof(float));
            a->om = malloc(mk * sizeof(float));
            a->og = malloc(mk * sizeof(float));
            oom |= !a->ow || !a->om || !a->og;
        }
        if (a->root == g_rank) {
            a->dg = malloc(nck * sizeof(float));
            a->dw = calloc(nck, sizeof(float));
            a->dm = calloc(nck, sizeof(float));
            oom |= !a->dg || !a->dw || !a->dm;
        }
    }
    x->ws = malloc((x->ws_elems ? x->ws_elems : 1) * sizeof(float));
    oom |= x->ws == NULL;
    if (!oom) {
        memset(x->ws, 0, x->ws_elems * sizeof(float));
    }
    return oom ? -1 : 0;
}

static void opt_free(opt_ctx_t *x)
{
    for (size_t i = 0; i < x->nmat; i++) {
        opt_mat_t *a = &x->mat[i];
        if (!a->gs_borrowed) {
            free(a->gs);
        }
        free(a->dws);
        free(a->fg);
        free(a->fw);
        free(a->fm);
        free(a->ow);
        free(a->om);
        free(a->og);
        free(a->dg);
        free(a->dw);
        free(a->dm);
    }
    free(x->mat);
    free(x->req);
    free(x->ws);
    memset(x, 0, sizeof(*x));
}

typedef int (*opt_fn)(opt_ctx_t *, double *, double *);

static int opt_run(const perf_opts_t *o, void *state)
{
    const opt_state_t *st = state;
    mfsdp_manifest_t *m = NULL;
    const int load_rc = load_manifest("optstep", st->manifest, &m);
    if (load_rc != 0) {
        return load_rc;
    }
    /* The placement a context gets by default (tail policy auto): the AdamW tensors it keeps
     * in FSDP's slices do not weigh on the owners' balance of Newton-Schulz work. */
    mfsdp_plan_opts_t po;
    memset(&po, 0, sizeof(po));
    po.tail = MFSDP_TAIL_AUTO;
    mfsdp_plan_t *plan = NULL;
    mfsdp_status_t pst = mfsdp_plan_create(m, g_world, &po, &plan);
    if (pst != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: plan: %s\n", mfsdp_status_string(pst));
        mfsdp_manifest_free(m);
        return 1;
    }
    opt_ctx_t x;
    int oom = opt_build(&x, m, plan, 1, 0) != 0;
    float *tmp = malloc((x.maxmk ? x.maxmk : 1) * sizeof(float));
    oom |= tmp == NULL;
    int all_ok = !oom, ok = !oom;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int rc = 0;
    if (!all_ok || x.nmat == 0) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf: optstep: %s\n",
                    x.nmat == 0 ? "the manifest has no Muon matrix" : "out of memory");
        }
        rc = 1;
        goto done;
    }
    for (size_t i = 0; i < x.nmat; i++) {
        opt_init_mat(&x.mat[i], i, tmp);
    }

    static const char *names[] = {"mfsdp", "fsdp2-muon", "dmuon"};
    static const opt_fn fns[] = {opt_run_mfsdp, opt_run_fsdp2, opt_run_dmuon};
    double tt[3][64], tc[3][64], tp[3][64];
    const int iters = o->iters < 64 ? o->iters : 64;
    const int total = o->warmup + iters;
    for (int it = 0; it < total && rc == 0; it++) {
        const int last = it == total - 1 && o->check;
        if (last) {
            for (size_t i = 0; i < x.nmat; i++) {
                opt_init_mat(&x.mat[i], i, tmp);
            }
        }
        /* The order of the systems rotates from run to run, so that a load change on a
         * shared machine does not always hit the same one. */
        for (int q = 0; q < 3 && rc == 0; q++) {
            const int s = (q + it) % 3;
            double comm = 0, comp = 0;
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = now_s();
            const int bad = fns[s](&x, &comm, &comp);
            const double wall = now_s() - t0;
            if (sum_long(bad != 0) != 0) {
                rc = 1;
                break;
            }
            if (it >= o->warmup) {
                tt[s][it - o->warmup] = run_max(wall);
                tc[s][it - o->warmup] = run_max(comm);
                tp[s][it - o->warmup] = run_max(comp);
            }
        }
    }
    long wrong = 0;
    if (rc == 0 && o->check) {
        wrong = sum_long(opt_check(&x, tmp));
    }
    if (rc == 0 && g_rank == 0) {
        /* before median() sorts the runs */
        const paired_t pr[3] = {
            {0}, paired_runs(tt[0], tt[1], iters), paired_runs(tt[0], tt[2], iters)};
        double med[3][3];
        for (int s = 0; s < 3; s++) {
            med[s][0] = median(tt[s], iters);
            med[s][1] = median(tc[s], iters);
            med[s][2] = median(tp[s], iters);
        }
        FILE *hdr = o->json ? stderr : stdout;
        fprintf(hdr,
                "# mfsdp-perf optstep: %s, %zu Muon matrices (%.1f MB fp32), %d ranks, "
                "%d NS steps, %d timed run(s) (median of the slowest rank; order rotated), "
                "%d warm-up, check %d\n",
                st->manifest, x.nmat, x.muon_bytes * 1e-6, g_world, m->hp.ns_steps, o->iters,
                o->warmup, o->check);
        fprintf(hdr,
                "# mfsdp: owners (planner, max NS %.2f GFLOP/rank, lower bound %.2f) step "
                "whole matrices, no collective; fsdp2-muon: MPI_Iallgather of every "
                "gradient, Muon on every rank; dmuon: MPI_Igather to rank i %% n, Muon "
                "there, MPI_Iscatter of the rows back\n",
                plan->max_flops * 1e-9, plan->lb_flops * 1e-9);
        fprintf(hdr, "# comm, compute: max over ranks of the time in MPI waits / in "
                     "mfsdp_cpu_muon_update; total: the slowest rank's wall time\n");
        if (!o->json) {
            printf("#%-11s %10s %10s %10s %14s %7s\n", "system", "total_ms", "comm_ms",
                   "compute_ms", "vs_mfsdp", "#wrong");
        }
        for (int s = 0; s < 3; s++) {
            const double ratio = med[s][0] / med[0][0];
            char wb[24];
            if (o->json) {
                printf("{\"subcommand\":\"optstep\",\"ranks\":%d,\"system\":\"%s\","
                       "\"total_s\":%.6f,\"comm_s\":%.6f,\"compute_s\":%.6f,"
                       "\"time_vs_mfsdp\":%.4f,\"wrong\":%s",
                       g_world, names[s], med[s][0], med[s][1], med[s][2], ratio,
                       wrong_txt(wrong, 1, wb));
                if (s != 0) {
                    print_paired_json(&pr[s]);
                }
                printf("}\n");
            } else {
                printf(" %-11s %10.1f %10.1f %10.1f %14.3f %7s\n", names[s], 1e3 * med[s][0],
                       1e3 * med[s][1], 1e3 * med[s][2], ratio, wrong_txt(wrong, 0, wb));
            }
        }
        fprintf(hdr, "# mfsdp speedup: %.3fx vs fsdp2-muon, %.3fx vs dmuon (%d ranks)\n",
                med[1][0] / med[0][0], med[2][0] / med[0][0], g_world);
        print_paired(hdr, "fsdp2-muon", &pr[1]);
        print_paired(hdr, "dmuon", &pr[2]);
        fflush(stdout);
    }
    if (wrong != 0) {
        rc = 1;
    }
done:
    opt_free(&x);
    free(tmp);
    mfsdp_plan_destroy(plan);
    mfsdp_manifest_free(m);
    return rc;
}
/* ---------------------------------------------------------------------------------------
 * ckpt: owner-checkpoint save and load throughput (mfsdp_ctx_save / save_wait / load)
 */

typedef struct ckpt_state {
    const char *manifest;
    const char *dir;
    const char *tail;
} ckpt_state_t;

static const struct option ckpt_long_opts[] = {
    {"manifest", required_argument, NULL, 'M'},
    {"dir", required_argument, NULL, 'D'},
    {"tail", required_argument, NULL, 'T'},
    {NULL, 0, NULL, 0},
};

static void ckpt_defaults(void *state)
{
    ckpt_state_t *st = state;
    st->manifest = NULL;
    st->dir = "mfsdp-perf-ckpt";
    st->tail = "shard";
}

static int ckpt_parse_opt(void *state, int opt, const char *arg)
{
    ckpt_state_t *st = state;
    switch (opt) {
    case 'M':
        st->manifest = arg;
        return 0;
    case 'D':
        st->dir = arg;
        return 0;
    case 'T':
        if (strcmp(arg, "owner") != 0 && strcmp(arg, "shard") != 0) {
            return -1;
        }
        st->tail = arg;
        return 0;
    default:
        return -1;
    }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Remove a directory tree (rank 0, between runs). */
static void rm_tree(const char *path)
{
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* The first all-gather of every group gives the context its weights: rank r's shard bytes
 * are a pattern of finite values of every dtype (bytes 0x38..0x3f). */
static mfsdp_status_t ckpt_prime(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m)
{
    mfsdp_status_t st = MFSDP_OK;
    for (size_t g = 0; g < m->ngroups && st == MFSDP_OK; g++) {
        mfsdp_group_layout_t *l = NULL;
        st = mfsdp_group_layout_create(&m->groups[g], g_world, &l);
        if (st != MFSDP_OK) {
            break;
        }
        char *full = malloc(l->ag.bytes * (size_t)g_world);
        if (full == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
        } else {
            char *mine = full + l->ag.bytes * (size_t)g_rank;
            for (size_t b = 0; b < l->ag.bytes; b++) {
                mine[b] = (char)(0x38 + ((b * 7 + (size_t)g_rank * 3 + g) & 7));
            }
            st = mfsdp_ctx_allgather(ctx, g, mine, full, l->ag.count, l->ag.dtype);
        }
        free(full);
        mfsdp_group_layout_destroy(l);
    }
    return st;
}

/* Elements of every local tensor whose fp32 master or comm copy differs between a and b. */
static long ckpt_compare(mfsdp_ctx_h a, mfsdp_ctx_h b, const mfsdp_manifest_t *m, int corrupt)
{
    long wrong = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            const char *name = m->groups[g].params[i].name;
            mfsdp_param_view_t va, vb;
            if (mfsdp_ctx_get_param(a, name, &va) != MFSDP_OK ||
                mfsdp_ctx_get_param(b, name, &vb) != MFSDP_OK || va.local_elems != vb.local_elems) {
                wrong++;
                continue;
            }
            if (va.local_elems == 0) {
                continue;
            }
            size_t elt = mfsdp_dtype_size(va.dtype);
            for (size_t e = 0; e < va.local_elems; e++) {
                float x = va.master[e];
                if (corrupt && wrong == 0 && g_rank == 0 && e == 0) {
                    x = -x - 1.0f; /* MFSDP_PERF_CORRUPT: the check must see this */
                }
                wrong += memcmp(&x, &vb.master[e], sizeof(float)) != 0 ||
                         memcmp((const char *)va.comm + e * elt, (const char *)vb.comm + e * elt,
                                elt) != 0;
            }
        }
    }
    return wrong;
}

static int ckpt_run(const perf_opts_t *o, void *state)
{
    const ckpt_state_t *st = state;
    mfsdp_manifest_t *m = NULL;
    const int load_rc = load_manifest("ckpt", st->manifest, &m);
    if (load_rc != 0) {
        return load_rc;
    }
    mfsdp_tail_policy_t tail = strcmp(st->tail, "owner") == 0 ? MFSDP_TAIL_OWNER : MFSDP_TAIL_SHARD;
    mfsdp_ctx_h a = NULL;
    mfsdp_status_t cs = perf_ctx_create(m, tail, MFSDP_ALGO_DIRECT, &a);
    if (cs == MFSDP_OK) {
        cs = ckpt_prime(a, m);
    }
    if (cs != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf ckpt: context: %s\n", mfsdp_status_string(cs));
        mfsdp_ctx_destroy(&a);
        mfsdp_manifest_free(m);
        return 1;
    }
    const int runs = o->warmup + o->iters;
    /* Per timed run, the slowest rank's figure (times) and this rank's bytes. */
    double stall[64], wr[64], ld[64], wbw[64], lbw[64];
    uint64_t snap = 0, wbytes = 0, lbytes = 0;
    long wrong = 0;
    int rc = 0;
    if (g_rank == 0) {
        /* header comments: stdout, or stderr under --json (as the other subcommands) */
        fprintf(o->json ? stderr : stdout,
                "# mfsdp-perf ckpt: %s, %d ranks, tail %s, %d timed run(s) after %d warm-up; "
                "each run saves into %s/run-K (fsync'ed files, committed index) and loads it "
                "into a fresh context; median of the slowest rank, check %d\n",
                st->manifest, g_world, st->tail, o->iters, o->warmup, st->dir, o->check);
    }
    for (int k = 0; k < runs && rc == 0; k++) {
        char root[4096];
        snprintf(root, sizeof(root), "%s/run-%d", st->dir, k);
        if (g_rank == 0) {
            rm_tree(root);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        mfsdp_status_t s1 = mfsdp_ctx_save(a, root);
        mfsdp_status_t s2 = s1 == MFSDP_OK ? mfsdp_ctx_save_wait(a) : s1;
        mfsdp_ckpt_stats_t sv, lv;
        mfsdp_ctx_get_ckpt_stats(a, &sv);
        mfsdp_ctx_h b = NULL;
        mfsdp_status_t s3 = s2 == MFSDP_OK ? perf_ctx_create(m, tail, MFSDP_ALGO_DIRECT, &b) : s2;
        MPI_Barrier(MPI_COMM_WORLD);
        mfsdp_status_t s4 = s3 == MFSDP_OK ? mfsdp_ctx_load(b, root) : s3;
        if (s4 != MFSDP_OK) {
            fprintf(stderr, "mfsdp-perf ckpt: rank %d: run %d: %s\n", g_rank, k,
                    mfsdp_status_string(s4));
            rc = 1;
        } else {
            mfsdp_ctx_get_ckpt_stats(b, &lv);
            int t = k - o->warmup;
            if (t >= 0) {
                stall[t] = run_max(sv.stall_seconds);
                wr[t] = run_max(sv.write_seconds);
                ld[t] = run_max(lv.load_seconds);
                /* per-rank bandwidth of the slowest rank */
                double w = sv.write_seconds > 0 ? (double)sv.write_bytes / sv.write_seconds : 0;
                double l = lv.load_seconds > 0
                               ? (double)(lv.load_bytes + lv.verify_bytes) / lv.load_seconds
                               : 0;
                wbw[t] = -run_max(-w); /* the minimum over ranks */
                lbw[t] = -run_max(-l);
                snap = sv.snapshot_bytes;
                wbytes = sv.write_bytes;
                lbytes = lv.load_bytes + lv.verify_bytes;
            }
            if (o->check && k == runs - 1) {
                wrong = sum_long(ckpt_compare(a, b, m, corrupt_requested()));
            }
        }
        mfsdp_ctx_destroy(&b);
        int bad = rc;
        MPI_Allreduce(&bad, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (g_rank == 0) {
            rm_tree(root);
        }
    }
    if (rc == 0) {
        double gsnap = run_max((double)snap), gw = run_max((double)wbytes),
               gl = run_max((double)lbytes);
        double mst = median(stall, o->iters), mwr = median(wr, o->iters),
               mld = median(ld, o->iters), mwb = median(wbw, o->iters), mlb = median(lbw, o->iters);
        if (g_rank == 0) {
            char wb[24];
            if (o->json) {
                printf("{\"subcommand\": \"ckpt\", \"system\": \"mfsdp\", \"ranks\": %d, "
                       "\"manifest\": \"%s\", "
                       "\"tail\": \"%s\", \"snapshot_bytes\": %.0f, \"write_bytes\": %.0f, "
                       "\"load_bytes\": %.0f, \"stall_s\": %.6f, \"write_s\": %.6f, "
                       "\"write_gbs\": %.4f, \"load_s\": %.6f, \"load_gbs\": %.4f, "
                       "\"wrong\": %s}\n",
                       g_world, st->manifest, st->tail, gsnap, gw, gl, mst, mwr, mwb / 1e9, mld,
                       mlb / 1e9, wrong_txt(wrong, 1, wb));
            } else {
                printf("#  ranks snapshot-MB  stall-ms  write-MB   write-s  write-GB/s   load-MB"
                       "    load-s   load-GB/s  #wrong\n"
                       "%8d %12.1f %9.1f %9.1f %9.3f %11.3f %9.1f %9.3f %11.3f %7s\n"
                       "# per rank (max over ranks for bytes and times; GB/s of the slowest "
                       "rank); load-MB counts tensor bytes read plus bytes read to verify "
                       "checksums\n",
                       g_world, gsnap / 1e6, 1e3 * mst, gw / 1e6, mwr, mwb / 1e9, gl / 1e6, mld,
                       mlb / 1e9, wrong_txt(wrong, 0, wb));
            }
            fflush(stdout);
        }
        if (o->check && wrong != 0) {
            rc = 1;
        }
    }
    mfsdp_ctx_destroy(&a);
    mfsdp_manifest_free(m);
    if (g_rank == 0) {
        rmdir(st->dir); /* only when empty: the runs removed their own */
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------
 * trainstep: one FSDP training step of a manifest's shapes (gather, forward GEMMs,
 * re-gather, backward GEMMs, reduce, optimizer step), four systems side by side
 */

typedef struct ts_state {
    const char *manifest;
    int tokens;
} ts_state_t;

static const struct option ts_long_opts[] = {
    {"manifest", required_argument, NULL, 'M'},
    {"tokens", required_argument, NULL, 'T'},
    {NULL, 0, NULL, 0},
};

static void ts_defaults(void *state)
{
    ts_state_t *st = state;
    st->manifest = NULL;
    st->tokens = 8192;
}

static int ts_parse_opt(void *state, int opt, const char *arg)
{
    ts_state_t *st = state;
    if (opt == 'M') {
        st->manifest = arg;
        return 0;
    }
    return opt == 'T' ? parse_int(arg, 1, &st->tokens) : -1;
}

/* The systems, in table order. The first three keep FSDP's shards of the weights. */
enum { TS_ADAMW = 0, TS_FSDP2 = 1, TS_DMUON = 2, TS_MFSDP = 3, TS_NSYS = 4 };
static const char *const ts_names[TS_NSYS] = {"fsdp-adamw", "fsdp2-muon", "dmuon", "mfsdp"};

/* One param group: its shards of the plan and the baselines' FSDP state. With every param
 * float32 and requiring a gradient, the all-gather and reduce-scatter layouts coincide. */
typedef struct ts_group {
    size_t first, nshards; /* plan shards [first, first + nshards) */
    size_t S;              /* elements of one rank's block */
    mfsdp_adamw_hp_t ah;   /* the group's AdamW hyper-parameters */
    float *w[3];           /* the baselines' weight shards (S) */
    float *am[3], *av[3];  /* their AdamW moments (S; used for AdamW params only) */
    float *w0;             /* the initial shard: mfsdp's first all-gather takes it */
    float *rs;             /* the baselines' reduce-scatter output (S): gradient shard */
} ts_group_t;

typedef struct ts_ctx {
    const mfsdp_manifest_t *m;
    const mfsdp_plan_t *plan; /* the mfsdp context's */
    mfsdp_ctx_h ctx;
    ts_group_t *g;
    opt_ctx_t x;               /* the Muon baselines' matrices (optstep's code) */
    size_t T;                  /* tokens per rank */
    size_t width;              /* activation columns: the widest dimension of any param */
    float *full;               /* the gathered group: n S_max */
    float *rsin;               /* the reduce-scatter input: n S_max */
    float *rsout;              /* mfsdp's reduce recvbuf (S_max): zeros, owner-managed */
    float *wc;                 /* one weight, contiguous (FSDP2's copy-out): max numel */
    float *dwc;                /* its gradient: max numel */
    float *xa, *dy, *ya, *dxa; /* activations T x width: input, output grad, output, input grad */
    int64_t nsteps[3];         /* optimizer steps of each baseline (AdamW bias correction) */
} ts_ctx_t;

typedef struct ts_times {
    double comm;     /* all-gathers and reduces of forward and backward */
    double gather;   /* of which all-gathers */
    double compute;  /* GEMMs, copy-out/copy-in, norm gradients */
    double opt;      /* the optimizer step, its collectives included */
    double opt_comm; /* of which collectives */
} ts_times_t;

static const mfsdp_shard_t *ts_shard(const ts_ctx_t *t, size_t g, size_t i)
{
    return &t->plan->shards[t->g[g].first + i];
}

static const mfsdp_param_desc_t *ts_param(const ts_ctx_t *t, const mfsdp_shard_t *sh)
{
    return &t->m->groups[sh->group].params[sh->param];
}

/* Rank r's real rows of a shard (the rest of its c rows are padding). */
static int64_t ts_rows(const mfsdp_shard_t *sh, int r)
{
    const int64_t nrows = sh->rows - r * sh->fsdp_c;
    return nrows < 0 ? 0 : (nrows > sh->fsdp_c ? sh->fsdp_c : nrows);
}

/* Where param sh lies in group g's rank-major FSDP buffer (fp32). */
static mfsdp_strided_geom_t ts_geom(const ts_ctx_t *t, size_t g, const mfsdp_shard_t *sh)
{
    return (mfsdp_strided_geom_t){.world = g_world,
                                  .rows = sh->rows,
                                  .rows_per_rank = sh->fsdp_c,
                                  .row_bytes = (size_t)sh->cols * sizeof(float),
                                  .rank_stride = t->g[g].S * sizeof(float),
                                  .offset = (size_t)sh->fsdp_o * sizeof(float)};
}

/* FSDP2's copy-out: the rank-major gathered group -> the param's contiguous rows (the
 * kernels' strided pack, as the runtime's). */
static int ts_copy_out(const ts_ctx_t *t, size_t g, const mfsdp_shard_t *sh, float *dst)
{
    const mfsdp_strided_geom_t geom = ts_geom(t, g, sh);
    return mfsdp_cpu_pack(dst, t->full, &geom) == MFSDP_OK ? 0 : -1;
}

/* FSDP2's copy-in: a param's contiguous gradient -> the reduce-scatter input, padding zero. */
static int ts_copy_in(ts_ctx_t *t, size_t g, const mfsdp_shard_t *sh, const float *src)
{
    const mfsdp_strided_geom_t geom = ts_geom(t, g, sh);
    return mfsdp_cpu_unpack(t->rsin, src, &geom) == MFSDP_OK ? 0 : -1;
}

/* All-gather of group g: MPI_Allgather of the baseline's shard, or mfsdp's owner-broadcast. */
static int ts_gather(ts_ctx_t *t, int sys, size_t g)
{
    const size_t S = t->g[g].S;
    if (sys == TS_MFSDP) {
        const mfsdp_status_t st =
            mfsdp_ctx_allgather(t->ctx, g, t->g[g].w0, t->full, S, MFSDP_FLOAT32);
        if (st != MFSDP_OK) {
            fprintf(stderr, "mfsdp-perf: rank %d: all-gather of group %zu: %s\n", g_rank, g,
                    mfsdp_status_string(st));
            return -1;
        }
        return 0;
    }
    return MPI_Allgather(t->g[g].w[sys], (int)S, MPI_FLOAT, t->full, (int)S, MPI_FLOAT,
                         MPI_COMM_WORLD) == MPI_SUCCESS
               ? 0
               : -1;
}

/* Reduce of group g's gradients (sum): MPI_Reduce_scatter_block, or reduce-to-owner. */
static int ts_reduce(ts_ctx_t *t, int sys, size_t g)
{
    const size_t S = t->g[g].S;
    if (sys == TS_MFSDP) {
        const mfsdp_status_t st =
            mfsdp_ctx_reduce(t->ctx, g, t->rsin, t->rsout, S, MFSDP_FLOAT32, MFSDP_OP_SUM, 1.0);
        if (st != MFSDP_OK) {
            fprintf(stderr, "mfsdp-perf: rank %d: reduce of group %zu: %s\n", g_rank, g,
                    mfsdp_status_string(st));
            return -1;
        }
        return 0;
    }
    return MPI_Reduce_scatter_block(t->rsin, t->g[g].rs, (int)S, MPI_FLOAT, MPI_SUM,
                                    MPI_COMM_WORLD) == MPI_SUCCESS
               ? 0
               : -1;
}

/* Forward of group g: Y = X W^T per weight W (out x in) on X (T x in). */
static int ts_forward(ts_ctx_t *t, size_t g)
{
    for (size_t i = 0; i < t->g[g].nshards; i++) {
        const mfsdp_shard_t *sh = ts_shard(t, g, i);
        if (ts_param(t, sh)->ndim < 2) {
            continue; /* norms: element-wise, no GEMM */
        }
        const size_t out = (size_t)sh->rows, in = (size_t)sh->cols;
        if (ts_copy_out(t, g, sh, t->wc) != 0) {
            return -1;
        }
        sgemm_rm(0, 1, t->T, out, in, t->xa, in, t->wc, in, t->ya, out);
    }
    return 0;
}

/* Backward of group g, params in reverse order: dX = dY W, dW = dY^T X per weight; a norm's
 * gradient sum_t dY[t, j] X[t, j]; each gradient copied into the reduce-scatter input. */
static int ts_backward(ts_ctx_t *t, size_t g)
{
    for (size_t i = t->g[g].nshards; i-- > 0;) {
        const mfsdp_shard_t *sh = ts_shard(t, g, i);
        const size_t out = (size_t)sh->rows, in = (size_t)sh->cols;
        if (ts_param(t, sh)->ndim < 2) {
            for (size_t j = 0; j < out; j++) {
                double sum = 0.0;
                for (size_t r = 0; r < t->T; r++) {
                    sum += (double)t->dy[r * out + j] * t->xa[r * out + j];
                }
                t->dwc[j] = (float)sum;
            }
        } else {
            if (ts_copy_out(t, g, sh, t->wc) != 0) {
                return -1;
            }
            sgemm_rm(0, 0, t->T, in, out, t->dy, out, t->wc, in, t->dxa, in);
            sgemm_rm(1, 0, out, in, t->T, t->dy, out, t->xa, in, t->dwc, in);
        }
        if (ts_copy_in(t, g, sh, t->dwc) != 0) {
            return -1;
        }
    }
    return 0;
}

/* AdamW on the baseline's shards of every param of the given role (real rows only). */
static int ts_adamw(ts_ctx_t *t, int sys, int muon_too)
{
    const int64_t step = ++t->nsteps[sys];
    for (size_t g = 0; g < t->m->ngroups; g++) {
        ts_group_t *gr = &t->g[g];
        for (size_t i = 0; i < gr->nshards; i++) {
            const mfsdp_shard_t *sh = ts_shard(t, g, i);
            if (sh->role == MFSDP_ROLE_MUON && !muon_too) {
                continue;
            }
            const size_t o = (size_t)sh->fsdp_o;
            const size_t n = (size_t)(ts_rows(sh, g_rank) * sh->cols);
            const mfsdp_status_t st =
                n == 0 ? MFSDP_OK
                       : mfsdp_cpu_adamw_update(gr->w[sys] + o, gr->am[sys] + o, gr->av[sys] + o,
                                                gr->rs + o, NULL, MFSDP_FLOAT32, n, step, &gr->ah);
            if (st != MFSDP_OK) {
                fprintf(stderr, "mfsdp-perf: rank %d: adamw: %s\n", g_rank,
                        mfsdp_status_string(st));
                return -1;
            }
        }
    }
    return 0;
}

/* The optimizer step of one system. The Muon baselines are optstep's (opt_run_fsdp2,
 * opt_run_dmuon) on the gradient shards just reduced; their results' rows go back into the
 * FSDP weight shards; AdamW params are stepped on the shards. */
static int ts_optimizer(ts_ctx_t *t, int sys, double *comm)
{
    *comm = 0.0;
    if (sys == TS_MFSDP) {
        const mfsdp_status_t st = mfsdp_ctx_step(t->ctx);
        if (st != MFSDP_OK) {
            fprintf(stderr, "mfsdp-perf: rank %d: owner step: %s\n", g_rank,
                    mfsdp_status_string(st));
            return -1;
        }
        return 0;
    }
    if (sys == TS_ADAMW) {
        return ts_adamw(t, sys, 1);
    }
    double comp = 0.0;
    const int bad =
        sys == TS_FSDP2 ? opt_run_fsdp2(&t->x, comm, &comp) : opt_run_dmuon(&t->x, comm, &comp);
    if (bad != 0) {
        return -1;
    }
    for (size_t i = 0; i < t->x.nmat; i++) {
        const opt_mat_t *a = &t->x.mat[i];
        int64_t first;
        const size_t n = (size_t)(opt_my_rows(a, &first) * a->k);
        const float *src = sys == TS_FSDP2 ? a->fw + (size_t)(first * a->k) : a->dws;
        memcpy(t->g[a->group].w[sys] + a->fsdp_o, src, n * sizeof(float));
    }
    return ts_adamw(t, sys, 0);
}

/* One training step of one system; per-phase times of this rank. */
static int ts_step(ts_ctx_t *t, int sys, ts_times_t *tm)
{
    memset(tm, 0, sizeof(*tm));
    const size_t ng = t->m->ngroups;
    for (size_t g = 0; g < ng; g++) {
        double t0 = now_s();
        if (ts_gather(t, sys, g) != 0) {
            return -1;
        }
        const double t1 = now_s();
        if (ts_forward(t, g) != 0) {
            return -1;
        }
        tm->comm += t1 - t0;
        tm->gather += t1 - t0;
        tm->compute += now_s() - t1;
    }
    for (size_t g = ng; g-- > 0;) {
        double t0 = now_s();
        if (ts_gather(t, sys, g) != 0) {
            return -1;
        }
        const double t1 = now_s();
        if (ts_backward(t, g) != 0) {
            return -1;
        }
        const double t2 = now_s();
        if (ts_reduce(t, sys, g) != 0) {
            return -1;
        }
        tm->comm += (t1 - t0) + (now_s() - t2);
        tm->gather += t1 - t0;
        tm->compute += t2 - t1;
    }
    const double t0 = now_s();
    const int bad = ts_optimizer(t, sys, &tm->opt_comm);
    tm->opt = now_s() - t0;
    return bad;
}

/* Initial weights of every param (0.02 N, seeded by shard index: the same on every rank):
 * each baseline's shard and mfsdp's first all-gather input; the Muon baselines' full copies. */
static void ts_init_weights(ts_ctx_t *t, float *tmp)
{
    for (size_t g = 0; g < t->m->ngroups; g++) {
        ts_group_t *gr = &t->g[g];
        memset(gr->w0, 0, gr->S * sizeof(float));
        for (size_t i = 0; i < gr->nshards; i++) {
            const mfsdp_shard_t *sh = ts_shard(t, g, i);
            opt_fill(tmp, (size_t)sh->numel, 0x7000u + gr->first + i, 0.02f);
            memcpy(gr->w0 + sh->fsdp_o, tmp + (size_t)(g_rank * sh->fsdp_c * sh->cols),
                   (size_t)(ts_rows(sh, g_rank) * sh->cols) * sizeof(float));
        }
        for (int s = 0; s < 3; s++) {
            memcpy(gr->w[s], gr->w0, gr->S * sizeof(float));
        }
    }
    for (size_t i = 0; i < t->x.nmat; i++) {
        opt_mat_t *a = &t->x.mat[i];
        const size_t shard = t->g[a->group].first + (size_t)(a->p - t->m->groups[a->group].params);
        opt_fill(tmp, (size_t)(a->m * a->k), 0x7000u + shard, 0.02f);
        memcpy(a->fw, tmp, (size_t)(a->m * a->k) * sizeof(float));
        if (a->dw != NULL) {
            memcpy(a->dw, tmp, (size_t)(a->m * a->k) * sizeof(float));
        }
    }
}

/* After the same number of steps on every system: this rank's rows of every param agree
 * with mfsdp's owner weights (broadcast from the owner, untimed): the Muon matrices on both
 * Muon baselines, AdamW params on all three baselines. */
static long ts_check(ts_ctx_t *t, float *tmp)
{
    long wrong = 0;
    int corrupt = corrupt_requested() && g_rank == 0;
    for (size_t g = 0; g < t->m->ngroups; g++) {
        ts_group_t *gr = &t->g[g];
        for (size_t i = 0; i < gr->nshards; i++) {
            const mfsdp_shard_t *sh = ts_shard(t, g, i);
            mfsdp_param_view_t v;
            if (mfsdp_ctx_get_param(t->ctx, ts_param(t, sh)->name, &v) != MFSDP_OK) {
                wrong++; /* the same on every rank: none waits in the broadcast */
                continue;
            }
            if (v.owner == g_rank) {
                memcpy(tmp, v.master, (size_t)sh->numel * sizeof(float));
            }
            MPI_Bcast(tmp, (int)sh->numel, MPI_FLOAT, v.owner, MPI_COMM_WORLD);
            const size_t off = (size_t)(g_rank * sh->fsdp_c * sh->cols);
            const size_t n = (size_t)(ts_rows(sh, g_rank) * sh->cols);
            if (corrupt && sh->role == MFSDP_ROLE_MUON && n > 0) {
                tmp[off] += 1.0f; /* test-only (MFSDP_PERF_CORRUPT=1): one element, once */
                corrupt = 0;
            }
            for (int s = sh->role == MFSDP_ROLE_MUON ? TS_FSDP2 : TS_ADAMW; s <= TS_DMUON; s++) {
                wrong += count_mismatch(gr->w[s] + sh->fsdp_o, tmp + off, n);
            }
        }
    }
    return wrong;
}

/* Rank-identical requirements of the manifest: float32 params (the GEMMs are sgemm) that
 * all require a gradient, so that the all-gather and reduce-scatter layouts coincide. */
static int ts_supported(const mfsdp_manifest_t *m, const char *path)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        const char *why = gd->has_reduce_dtype && gd->reduce_dtype != MFSDP_FLOAT32
                              ? "a reduce_dtype other than float32"
                              : NULL;
        for (size_t i = 0; i < gd->nparams && why == NULL; i++) {
            if (gd->params[i].dtype != MFSDP_FLOAT32) {
                why = "a param that is not float32";
            } else if (!gd->params[i].requires_grad) {
                why = "a frozen param";
            }
        }
        if (why != NULL) {
            if (g_rank == 0) {
                fprintf(stderr,
                        "mfsdp-perf trainstep: %s: group %s has %s; trainstep needs float32 "
                        "params that all require a gradient (e.g. examples/models/"
                        "llama-small.json)\n",
                        path, gd->name, why);
            }
            return -1;
        }
    }
    return 0;
}

static void ts_free(ts_ctx_t *t)
{
    if (t->g != NULL) {
        for (size_t g = 0; g < t->m->ngroups; g++) {
            for (int s = 0; s < 3; s++) {
                free(t->g[g].w[s]);
                free(t->g[g].am[s]);
                free(t->g[g].av[s]);
            }
            free(t->g[g].w0);
            free(t->g[g].rs);
        }
    }
    free(t->g);
    opt_free(&t->x);
    free(t->full);
    free(t->rsin);
    free(t->rsout);
    free(t->wc);
    free(t->dwc);
    free(t->xa);
    free(t->dy);
    free(t->ya);
    free(t->dxa);
    mfsdp_ctx_destroy(&t->ctx);
}

/* Buffers of every group and of the step, after the context and its plan exist. 0 or -1
 * (out of memory, or a param the plan did not give one owner). */
static int ts_alloc(ts_ctx_t *t, size_t *maxnumel_p)
{
    const mfsdp_manifest_t *m = t->m;
    size_t smax = 0, maxnumel = 1, width = 1;
    t->g = calloc(m->ngroups, sizeof(*t->g));
    if (t->g == NULL) {
        return -1;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        ts_group_t *gr = &t->g[g];
        gr->first = t->plan->group_first[g];
        gr->nshards = t->plan->group_first[g + 1] - gr->first;
        const mfsdp_group_desc_t *gd = &m->groups[g];
        gr->ah.lr = (float)(m->hp.adamw_lr * gd->lr_scale);
        gr->ah.beta1 = (float)m->hp.adamw_beta1;
        gr->ah.beta2 = (float)m->hp.adamw_beta2;
        gr->ah.eps = (float)m->hp.adamw_eps;
        gr->ah.weight_decay =
            (float)(gd->has_weight_decay ? gd->weight_decay : m->hp.adamw_weight_decay);
        for (size_t i = 0; i < gr->nshards; i++) {
            const mfsdp_shard_t *sh = ts_shard(t, g, i);
            if (sh->owner < 0) {
                fprintf(stderr, "mfsdp-perf: trainstep: %s has no single owner\n",
                        ts_param(t, sh)->name);
                return -1;
            }
            gr->S += (size_t)sh->fsdp_s;
            maxnumel = (size_t)sh->numel > maxnumel ? (size_t)sh->numel : maxnumel;
            const size_t wide = (size_t)(sh->rows > sh->cols ? sh->rows : sh->cols);
            width = wide > width ? wide : width;
        }
        smax = gr->S > smax ? gr->S : smax;
        int oom = 0;
        for (int s = 0; s < 3; s++) {
            gr->w[s] = malloc(gr->S * sizeof(float));
            gr->am[s] = calloc(gr->S, sizeof(float));
            gr->av[s] = calloc(gr->S, sizeof(float));
            oom |= !gr->w[s] || !gr->am[s] || !gr->av[s];
        }
        gr->w0 = malloc(gr->S * sizeof(float));
        gr->rs = calloc(gr->S, sizeof(float));
        if (oom || !gr->w0 || !gr->rs) {
            return -1;
        }
    }
    if (opt_build(&t->x, m, t->plan, 0, 1) != 0) {
        return -1;
    }
    for (size_t i = 0; i < t->x.nmat; i++) {
        opt_mat_t *a = &t->x.mat[i];
        a->gs = t->g[a->group].rs + a->fsdp_o;
    }
    const size_t n = (size_t)g_world, act = t->T * width;
    t->width = width;
    t->full = malloc(n * smax * sizeof(float));
    t->rsin = malloc(n * smax * sizeof(float));
    t->rsout = malloc(smax * sizeof(float));
    t->wc = malloc(maxnumel * sizeof(float));
    t->dwc = malloc(maxnumel * sizeof(float));
    t->xa = malloc(act * sizeof(float));
    t->dy = malloc(act * sizeof(float));
    t->ya = malloc(act * sizeof(float));
    t->dxa = malloc(act * sizeof(float));
    if (!t->full || !t->rsin || !t->rsout || !t->wc || !t->dwc || !t->xa || !t->dy || !t->ya ||
        !t->dxa) {
        return -1;
    }
    /* Synthetic activations, different on every rank: X ~ N, dY ~ N / sqrt(T). */
    opt_fill(t->xa, act, 0x7100u + (uint64_t)g_rank, 1.0f);
    opt_fill(t->dy, act, 0x7200u + (uint64_t)g_rank, (float)(1.0 / sqrt((double)t->T)));
    *maxnumel_p = maxnumel;
    return 0;
}

static int ts_run(const perf_opts_t *o, void *state)
{
    const ts_state_t *st = state;
    mfsdp_manifest_t *m = NULL;
    const int load_rc = load_manifest("trainstep", st->manifest, &m);
    if (load_rc != 0) {
        return load_rc;
    }
    if (ts_supported(m, st->manifest) != 0) {
        mfsdp_manifest_free(m);
        return 2;
    }
    ts_ctx_t t;
    memset(&t, 0, sizeof(t));
    t.m = m;
    t.T = (size_t)st->tokens;
    float *tmp = NULL;
    size_t maxnumel = 0;
    int rc = 0;
    mfsdp_status_t cst = perf_ctx_create(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_AUTO, &t.ctx);
    if (cst == MFSDP_OK) {
        cst = mfsdp_ctx_get_plan(t.ctx, &t.plan);
    }
    if (cst == MFSDP_OK) {
        cst = mfsdp_ctx_set_lr_factor(t.ctx, 1.0); /* the baselines have no schedule */
    }
    if (cst != MFSDP_OK) {
        fprintf(stderr, "mfsdp-perf: trainstep: context: %s\n", mfsdp_status_string(cst));
        rc = 1;
        goto done;
    }
    int ok = ts_alloc(&t, &maxnumel) == 0;
    if (ok) {
        tmp = malloc(maxnumel * sizeof(float));
        ok = tmp != NULL;
    }
    int all_ok = ok;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok) {
        if (g_rank == 0) {
            fprintf(stderr, "mfsdp-perf: trainstep: setup failed (out of memory at %d tokens?)\n",
                    st->tokens);
        }
        rc = 1;
        goto done;
    }
    ts_init_weights(&t, tmp);
    /* Prime mfsdp (untimed): each group's first all-gather takes the initial weights. */
    for (size_t g = 0; g < m->ngroups && rc == 0; g++) {
        rc = sum_long(ts_gather(&t, TS_MFSDP, g) != 0) != 0;
    }

    double tt[TS_NSYS][64], tc[TS_NSYS][64], tp[TS_NSYS][64], to[TS_NSYS][64], toc[TS_NSYS][64],
        tg[TS_NSYS][64];
    const int iters = o->iters < 64 ? o->iters : 64;
    const int total = o->warmup + iters;
    for (int it = 0; it < total && rc == 0; it++) {
        /* The order of the systems rotates from run to run (as optstep's). */
        for (int q = 0; q < TS_NSYS && rc == 0; q++) {
            const int s = (q + it) % TS_NSYS;
            ts_times_t tm;
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = now_s();
            const int bad = ts_step(&t, s, &tm);
            const double wall = now_s() - t0;
            if (sum_long(bad != 0) != 0) {
                rc = 1;
                break;
            }
            if (it >= o->warmup) {
                const int k = it - o->warmup;
                tt[s][k] = run_max(wall);
                tc[s][k] = run_max(tm.comm);
                tp[s][k] = run_max(tm.compute);
                to[s][k] = run_max(tm.opt);
                toc[s][k] = run_max(tm.opt_comm);
                tg[s][k] = run_max(tm.gather);
            }
        }
    }
    long wrong = 0;
    if (rc == 0 && o->check) {
        wrong = sum_long(ts_check(&t, tmp));
    }
    if (rc == 0 && g_rank == 0) {
        /* before median() sorts the runs */
        const paired_t p_fsdp2 = paired_runs(tt[TS_MFSDP], tt[TS_FSDP2], iters);
        const paired_t p_dmuon = paired_runs(tt[TS_MFSDP], tt[TS_DMUON], iters);
        double med[TS_NSYS][6];
        for (int s = 0; s < TS_NSYS; s++) {
            med[s][0] = median(tt[s], iters);
            med[s][1] = median(tc[s], iters);
            med[s][2] = median(tp[s], iters);
            med[s][3] = median(to[s], iters);
            med[s][4] = median(toc[s], iters);
            med[s][5] = median(tg[s], iters);
        }
        /* Analytic FLOPs per rank: forward + backward 6 T m k per weight; Newton-Schulz of
         * every Muon matrix (FSDP2-Muon runs all of it on every rank), and mfsdp's most
         * loaded owner. */
        double fb = 0.0, ns = 0.0, nparams = 0.0;
        for (size_t s = 0; s < t.plan->nshards; s++) {
            const mfsdp_shard_t *sh = &t.plan->shards[s];
            nparams += (double)sh->numel;
            ns += sh->ns_flops;
            if (ts_param(&t, sh)->ndim >= 2) {
                fb += 6.0 * (double)t.T * (double)sh->numel;
            }
        }
        const double bound = med[TS_ADAMW][0] + 1.2 * med[TS_MFSDP][3];
        const int met = med[TS_MFSDP][0] <= bound;
        const double r_fsdp2 = med[TS_FSDP2][0] / med[TS_MFSDP][0];
        const double r_dmuon = med[TS_DMUON][0] / med[TS_MFSDP][0];
        FILE *hdr = o->json ? stderr : stdout;
        fprintf(hdr,
                "# mfsdp-perf trainstep: %s, %.2f M params (%zu Muon matrices), %d ranks, %zu "
                "tokens per rank, %d NS steps, %d timed run(s) (median of the slowest rank; "
                "order rotated), %d warm-up, check %d\n",
                st->manifest, nparams * 1e-6, t.x.nmat, g_world, t.T, m->hp.ns_steps, o->iters,
                o->warmup, o->check);
        fprintf(hdr, "# per group in order: all-gather, forward Y = X W^T; in reverse: all-gather, "
                     "dX = dY W, dW = dY^T X, reduce (sum). fsdp-adamw, fsdp2-muon, dmuon: "
                     "MPI_Allgather / MPI_Reduce_scatter_block; mfsdp: mfsdp_ctx_allgather / "
                     "mfsdp_ctx_reduce. Optimizer: AdamW on shards; Muon after MPI_Iallgather "
                     "on every rank; Muon after MPI_Igather to rank i %% n, MPI_Iscatter back; "
                     "mfsdp_ctx_step (owners, no collective)\n");
        fprintf(hdr, "# comm: collectives of forward/backward; fwdbwd: GEMMs and copies; "
                     "opt: optimizer step (opt_comm: its collectives); each the max over ranks\n");
        if (!o->json) {
            printf("#%-11s %10s %10s %10s %10s %11s %9s %7s\n", "system", "step_ms", "comm_ms",
                   "fwdbwd_ms", "opt_ms", "opt_comm_ms", "vs_mfsdp", "#wrong");
        }
        for (int s = 0; s < TS_NSYS; s++) {
            const double ratio = med[s][0] / med[TS_MFSDP][0];
            char wb[24];
            if (o->json) {
                printf("{\"subcommand\":\"trainstep\",\"ranks\":%d,\"tokens\":%zu,"
                       "\"system\":\"%s\",\"step_s\":%.6f,\"comm_s\":%.6f,\"fwdbwd_s\":%.6f,"
                       "\"opt_s\":%.6f,\"opt_comm_s\":%.6f,\"gather_s\":%.6f,"
                       "\"time_vs_mfsdp\":%.4f,\"wrong\":%s",
                       g_world, t.T, ts_names[s], med[s][0], med[s][1], med[s][2], med[s][3],
                       med[s][4], med[s][5], ratio, wrong_txt(wrong, 1, wb));
                if (s == TS_FSDP2 || s == TS_DMUON) {
                    print_paired_json(s == TS_FSDP2 ? &p_fsdp2 : &p_dmuon);
                }
                if (s == TS_MFSDP) {
                    printf(",\"bound_s\":%.6f,\"bound_met\":%s,\"ns_fwdbwd_flops\":%.4f,"
                           "\"ns_fwdbwd_flops_mfsdp\":%.4f",
                           bound, met ? "true" : "false", ns / fb, t.plan->max_flops / fb);
                }
                printf("}\n");
            } else {
                printf(" %-11s %10.1f %10.1f %10.1f %10.1f %11.1f %9.3f %7s\n", ts_names[s],
                       1e3 * med[s][0], 1e3 * med[s][1], 1e3 * med[s][2], 1e3 * med[s][3],
                       1e3 * med[s][4], ratio, wrong_txt(wrong, 0, wb));
            }
        }
        fprintf(hdr,
                "# target mfsdp step <= fsdp-adamw step + 1.2 x mfsdp owner step: %.1f <= %.1f "
                "+ 1.2 x %.1f = %.1f ms: %s\n",
                1e3 * med[TS_MFSDP][0], 1e3 * med[TS_ADAMW][0], 1e3 * med[TS_MFSDP][3], 1e3 * bound,
                met ? "met" : "NOT met");
        fprintf(hdr,
                "# mfsdp speedup: %.3fx vs fsdp2-muon, %.3fx vs dmuon: faster than both: %s "
                "(%d ranks)\n",
                r_fsdp2, r_dmuon, r_fsdp2 > 1.0 && r_dmuon > 1.0 ? "yes" : "NO", g_world);
        print_paired(hdr, "fsdp2-muon", &p_fsdp2);
        print_paired(hdr, "dmuon", &p_dmuon);
        fprintf(hdr,
                "# analytic FLOPs per rank: forward+backward %.1f G; Newton-Schulz %.1f G "
                "(fsdp2-muon: all of it), mfsdp's most loaded owner %.1f G; NS/(fwd+bwd) = "
                "%.3f (fsdp2-muon), %.3f (mfsdp)\n",
                fb * 1e-9, ns * 1e-9, t.plan->max_flops * 1e-9, ns / fb, t.plan->max_flops / fb);
        fflush(stdout);
    }
    if (wrong != 0) {
        rc = 1;
    }
done:
    ts_free(&t);
    free(tmp);
    mfsdp_manifest_free(m);
    return rc;
}
#endif /* MFSDP_HAVE_MPI */

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
#if MFSDP_HAVE_MPI
    {
        .name = "allgather",
        .summary = "MPI_Allgather vs mfsdp owner-broadcast on one FSDP-layout buffer (mpirun)",
        .usage = COLL_USAGE,
        .short_opts = "b:e:f:d:o:",
        .opts = coll_long_opts,
        .state_size = sizeof(coll_state_t),
        .defaults = allgather_defaults,
        .parse_opt = coll_parse_opt,
        .run = coll_run_all,
        .mpi = 1,
    },
    {
        .name = "reducescatter",
        .summary = "MPI_Reduce_scatter_block vs mfsdp reduce-to-owner (mpirun)",
        .usage = COLL_USAGE,
        .short_opts = "b:e:f:d:o:",
        .opts = coll_long_opts,
        .state_size = sizeof(coll_state_t),
        .defaults = reducescatter_defaults,
        .parse_opt = coll_parse_opt,
        .run = coll_run_all,
        .mpi = 1,
    },
    {
        .name = "optstep",
        .summary = "Muon step latency: mfsdp owners vs FSDP2-Muon vs DMuon-style (mpirun)",
        .usage = "  -M, --manifest FILE        model manifest (required): its Muon matrices\n",
        .short_opts = "",
        .opts = opt_long_opts,
        .state_size = sizeof(opt_state_t),
        .defaults = opt_defaults,
        .parse_opt = opt_parse_opt,
        .run = opt_run,
        .mpi = 1,
    },
    {
        .name = "ckpt",
        .summary = "owner-checkpoint save (stall, write) and load throughput per rank (mpirun)",
        .usage = "  -M, --manifest FILE        model manifest (required)\n"
                 "  -D, --dir DIR              checkpoint root, emptied per run (default "
                 "mfsdp-perf-ckpt)\n"
                 "      --tail owner|shard     tail policy of the plan (default shard)\n",
        .short_opts = "M:D:",
        .opts = ckpt_long_opts,
        .state_size = sizeof(ckpt_state_t),
        .defaults = ckpt_defaults,
        .parse_opt = ckpt_parse_opt,
        .run = ckpt_run,
        .mpi = 1,
    },
    {
        .name = "trainstep",
        .summary = "one FSDP training step: fsdp-adamw vs fsdp2-muon vs dmuon vs mfsdp (mpirun)",
        .usage = "  -M, --manifest FILE        model manifest (required; float32 params)\n"
                 "  -T, --tokens N             synthetic tokens per rank (default 8192)\n",
        .short_opts = "M:T:",
        .opts = ts_long_opts,
        .state_size = sizeof(ts_state_t),
        .defaults = ts_defaults,
        .parse_opt = ts_parse_opt,
        .run = ts_run,
        .mpi = 1,
    },
#endif
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
            fprintf(f, "  %-14s %s\n", subcmds[i].name, subcmds[i].summary);
        }
        fprintf(f, "run 'mfsdp-perf <subcommand> -h' for its flags\n");
        return;
    }
    fprintf(
        f,
        "usage: mfsdp-perf %s [flags]\n%s\n"
        "  -n, --iters N              timed runs per case (1..64), median reported (default 3)\n"
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
            if (bad) {
                fprintf(stderr, "mfsdp-perf %s: -n takes 1..64 timed runs\n", sub->name);
            }
            break;
        case 'w':
            bad = parse_int(optarg, 0, &o.warmup) != 0;
            break;
        case 'c':
            bad = parse_int(optarg, 0, &o.check) != 0 || o.check > 1;
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
    int rc;
    g_checked = o.check;
#if MFSDP_HAVE_MPI
    if (sub->mpi) {
        int provided;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &g_world);
        rc = sub->run(&o, state);
        int worst = rc;
        MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        rc = worst;
        MPI_Finalize();
    } else
#endif
    {
        rc = sub->run(&o, state);
    }
    free(state);
    return rc;
}
