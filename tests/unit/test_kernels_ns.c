/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CPU Newton-Schulz against a float64 reference of the same iteration (docs/design.md, "The
 * optimizer step"), written here independently: explicit transpose, naive triple loops.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <limits.h>

#include "kernels_util.h"
#include "mfsdp/kernels.h"

static void suite_init(void)
{
    log_capture_start();
}

static void suite_fini(void)
{
    log_capture_stop();
}

TestSuite(kernels_ns, .init = suite_init, .fini = suite_fini);

/* The reference of the float input, through ref_ns_f64() (kernels_util.h). */
static void ref_ns(const float *in, int64_t m, int64_t k, int steps, double *out)
{
    const size_t n = (size_t)m * (size_t)k;
    double *d = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        d[i] = in[i];
    }
    ref_ns_f64(d, m, k, steps, out);
    free(d);
}

/* Run the library NS on a copy of in (workspace poisoned) and compare with the reference. */
static double ns_vs_ref(const float *in, int64_t m, int64_t k, int steps)
{
    const size_t n = (size_t)m * (size_t)k;
    const size_t wsn = mfsdp_ns_workspace_elems(m, k);
    cr_assert_gt(wsn, 0);
    float *x = xmalloc(n * sizeof(float));
    float *ws = xmalloc(wsn * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    memcpy(x, in, n * sizeof(float));
    poison(ws, wsn);
    cr_assert_eq(mfsdp_cpu_newton_schulz(x, m, k, steps, ws, wsn), MFSDP_OK);
    ref_ns(in, m, k, steps, ref);
    const double err = rel_err(x, ref, n);
    free(x);
    free(ws);
    free(ref);
    return err;
}

typedef struct shape {
    int64_t m;
    int64_t k;
} shape_t;

ParameterizedTestParameters(kernels_ns, matches_float64)
{
    static shape_t shapes[] = {{1, 1},  {3, 5},      {7, 64},     {130, 33},
                               {64, 7}, {1000, 257}, {257, 1000}, {5, 3}};
    return cr_make_param_array(shape_t, shapes, sizeof(shapes) / sizeof(shapes[0]));
}

ParameterizedTest(shape_t *p, kernels_ns, matches_float64)
{
    char what[64];
    snprintf(what, sizeof(what), "ns %lldx%lld", (long long)p->m, (long long)p->k);
    test_rng_t rng = rng_seeded(what);
    const size_t n = (size_t)(p->m * p->k);
    float *in = xmalloc(n * sizeof(float));
    fill_normal(&rng, in, n, 1.0);
    const double err = ns_vs_ref(in, p->m, p->k, 5);
    fprintf(stderr, "[%s] rel err %.3g\n", what, err);
    cr_expect_lt(err, 1e-4, "%s: rel err %g", what, err);
    free(in);
}

/* Odd and even step counts take different ping-pong paths through the workspace. */
Test(kernels_ns, step_counts)
{
    test_rng_t rng = rng_seeded("ns steps");
    const shape_t shapes[] = {{37, 50}, {50, 37}};
    for (size_t sh = 0; sh < 2; sh++) {
        const size_t n = (size_t)(shapes[sh].m * shapes[sh].k);
        float *in = xmalloc(n * sizeof(float));
        fill_normal(&rng, in, n, 3.0);
        for (int steps = 0; steps <= 6; steps++) {
            const double err = ns_vs_ref(in, shapes[sh].m, shapes[sh].k, steps);
            cr_expect_lt(err, 1e-4, "%lldx%lld steps %d: rel err %g", (long long)shapes[sh].m,
                         (long long)shapes[sh].k, steps, err);
        }
        free(in);
    }
}

Test(kernels_ns, batched_equals_loop)
{
    test_rng_t rng = rng_seeded("ns batch");
    const int64_t m = 33, k = 20;
    const size_t batch = 4, n = (size_t)(m * k);
    const size_t wsn = mfsdp_ns_workspace_elems(m, k);
    float *in = xmalloc(batch * n * sizeof(float));
    float *xb = xmalloc(batch * n * sizeof(float));
    float *xl = xmalloc(batch * n * sizeof(float));
    float *ws = xmalloc(wsn * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    fill_normal(&rng, in, batch * n, 1.0);
    memcpy(xb, in, batch * n * sizeof(float));
    memcpy(xl, in, batch * n * sizeof(float));
    poison(ws, wsn);
    cr_assert_eq(mfsdp_cpu_newton_schulz_batched(xb, batch, m, k, 5, ws, wsn), MFSDP_OK);
    for (size_t b = 0; b < batch; b++) {
        poison(ws, wsn);
        cr_assert_eq(mfsdp_cpu_newton_schulz(xl + b * n, m, k, 5, ws, wsn), MFSDP_OK);
        ref_ns(in + b * n, m, k, 5, ref);
        const double err = rel_err(xb + b * n, ref, n);
        cr_expect_lt(err, 1e-4, "batch %zu: rel err %g", b, err);
    }
    cr_expect(memcmp(xb, xl, batch * n * sizeof(float)) == 0, "batched differs from a loop");
    free(in);
    free(xb);
    free(xl);
    free(ws);
    free(ref);
}

Test(kernels_ns, split_equals_blocks)
{
    test_rng_t rng = rng_seeded("ns split");
    const int64_t m = 96, k = 40;
    const int64_t split[3] = {10, 50, 36}; /* a wide block, a tall one, one nearly square */
    const size_t n = (size_t)(m * k);
    size_t wsn = 0;
    for (int b = 0; b < 3; b++) {
        const size_t w = mfsdp_ns_workspace_elems(split[b], k);
        wsn = w > wsn ? w : wsn;
    }
    float *in = xmalloc(n * sizeof(float));
    float *xs = xmalloc(n * sizeof(float));
    float *xb = xmalloc(n * sizeof(float));
    float *ws = xmalloc(wsn * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    fill_normal(&rng, in, n, 1.0);
    memcpy(xs, in, n * sizeof(float));
    poison(ws, wsn);
    /* Exactly the largest block's workspace is enough. */
    cr_assert_eq(mfsdp_cpu_newton_schulz_split(xs, m, k, 3, split, 5, ws, wsn), MFSDP_OK);
    size_t row = 0;
    for (int b = 0; b < 3; b++) {
        const size_t off = row * (size_t)k, nb = (size_t)split[b] * (size_t)k;
        memcpy(xb + off, in + off, nb * sizeof(float));
        poison(ws, wsn);
        cr_assert_eq(mfsdp_cpu_newton_schulz(xb + off, split[b], k, 5, ws, wsn), MFSDP_OK);
        ref_ns(in + off, split[b], k, 5, ref + off);
        const double err = rel_err(xs + off, ref + off, nb);
        cr_expect_lt(err, 1e-4, "block %d: rel err %g", b, err);
        row += (size_t)split[b];
    }
    cr_expect(memcmp(xs, xb, n * sizeof(float)) == 0, "split differs from per-block calls");
    /* nsplit == 0 is the whole matrix. */
    memcpy(xs, in, n * sizeof(float));
    memcpy(xb, in, n * sizeof(float));
    const size_t wsw = mfsdp_ns_workspace_elems(m, k);
    float *ws2 = xmalloc(wsw * sizeof(float));
    cr_assert_eq(mfsdp_cpu_newton_schulz_split(xs, m, k, 0, NULL, 5, ws2, wsw), MFSDP_OK);
    cr_assert_eq(mfsdp_cpu_newton_schulz(xb, m, k, 5, ws2, wsw), MFSDP_OK);
    cr_expect(memcmp(xs, xb, n * sizeof(float)) == 0, "nsplit 0 differs from the whole");
    free(in);
    free(xs);
    free(xb);
    free(ws);
    free(ws2);
    free(ref);
}

/* Eigenvalues of a symmetric n x n matrix (cyclic Jacobi, in place; a is destroyed). */
static void jacobi_eigenvalues(double *a, size_t n, double *eig)
{
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0.0;
        for (size_t i = 0; i < n; i++) {
            for (size_t j = i + 1; j < n; j++) {
                off += a[i * n + j] * a[i * n + j];
            }
        }
        if (off < 1e-26) {
            break;
        }
        for (size_t p = 0; p < n; p++) {
            for (size_t q = p + 1; q < n; q++) {
                const double apq = a[p * n + q];
                if (fabs(apq) < 1e-300) {
                    continue;
                }
                const double theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                const double t =
                    (theta >= 0 ? 1.0 : -1.0) / (fabs(theta) + sqrt(theta * theta + 1.0));
                const double c = 1.0 / sqrt(t * t + 1.0), s = t * c;
                for (size_t r = 0; r < n; r++) { /* columns p, q */
                    const double arp = a[r * n + p], arq = a[r * n + q];
                    a[r * n + p] = c * arp - s * arq;
                    a[r * n + q] = s * arp + c * arq;
                }
                for (size_t r = 0; r < n; r++) { /* rows p, q */
                    const double apr = a[p * n + r], aqr = a[q * n + r];
                    a[p * n + r] = c * apr - s * aqr;
                    a[q * n + r] = s * apr + c * aqr;
                }
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        eig[i] = a[i * n + i];
    }
}

/* A well-conditioned input (Gaussian 64 x 512: singular values within a factor ~2.1) comes
 * out with every singular value inside the quintic's band around 1, checked on the
 * eigenvalues of the Gram matrix computed here in double. */
Test(kernels_ns, singular_values_in_band)
{
    test_rng_t rng = rng_seeded("ns band");
    const shape_t shapes[] = {{64, 512}, {512, 64}};
    for (size_t sh = 0; sh < 2; sh++) {
        const int64_t m = shapes[sh].m, k = shapes[sh].k;
        const size_t s = (size_t)(m < k ? m : k), l = (size_t)(m < k ? k : m);
        const size_t n = s * l, wsn = mfsdp_ns_workspace_elems(m, k);
        float *x = xmalloc(n * sizeof(float));
        float *ws = xmalloc(wsn * sizeof(float));
        double *g = xmalloc(s * s * sizeof(double));
        double *eig = xmalloc(s * sizeof(double));
        fill_normal(&rng, x, n, 0.5);
        cr_assert_eq(mfsdp_cpu_newton_schulz(x, m, k, 5, ws, wsn), MFSDP_OK);
        /* Gram matrix of the s-dimensional side: its eigenvalues are sigma^2. */
        for (size_t i = 0; i < s; i++) {
            for (size_t j = 0; j < s; j++) {
                double acc = 0.0;
                for (size_t p = 0; p < l; p++) {
                    acc += m < k ? (double)x[i * l + p] * x[j * l + p]
                                 : (double)x[p * s + i] * x[p * s + j];
                }
                g[i * s + j] = acc;
            }
        }
        jacobi_eigenvalues(g, s, eig);
        double lo = INFINITY, hi = 0.0;
        for (size_t i = 0; i < s; i++) {
            lo = fmin(lo, eig[i]);
            hi = fmax(hi, eig[i]);
        }
        fprintf(stderr, "[ns band %lldx%lld] eig(X X^T) in [%.4f, %.4f], sigma in [%.4f, %.4f]\n",
                (long long)m, (long long)k, lo, hi, sqrt(lo), sqrt(hi));
        /* The quintic does not converge to 1: it maps [~0.1, 1] into a band of singular
         * values of about [0.68, 1.13] (Keller's coefficients trade exactness for speed).
         * Eigenvalues of X X^T are sigma^2. The input spans sigma_max / sigma_min ~ 2.1. */
        cr_expect(sqrt(lo) >= 0.65 && sqrt(hi) <= 1.2, "%lldx%lld: singular values in [%g, %g]",
                  (long long)m, (long long)k, sqrt(lo), sqrt(hi));
        free(x);
        free(ws);
        free(g);
        free(eig);
    }
}

/* Non-finite input: the library and the reference agree on which outputs are NaN/inf. */
Test(kernels_ns, nonfinite_propagates)
{
    test_rng_t rng = rng_seeded("ns nonfinite");
    const int64_t m = 9, k = 13;
    const size_t n = (size_t)(m * k), wsn = mfsdp_ns_workspace_elems(m, k);
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    float *in = xmalloc(n * sizeof(float));
    float *x = xmalloc(n * sizeof(float));
    float *ws = xmalloc(wsn * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    for (int v = 0; v < 3; v++) {
        fill_normal(&rng, in, n, 1.0);
        in[rng_u64(&rng) % n] = bad[v];
        memcpy(x, in, n * sizeof(float));
        cr_assert_eq(mfsdp_cpu_newton_schulz(x, m, k, 5, ws, wsn), MFSDP_OK);
        ref_ns(in, m, k, 5, ref);
        size_t nan_out = 0;
        for (size_t i = 0; i < n; i++) {
            cr_expect_eq(isnan(x[i]) != 0, isnan(ref[i]) != 0, "bad %g at %zu: out %g ref %g",
                         (double)bad[v], i, (double)x[i], ref[i]);
            nan_out += isnan(x[i]) != 0;
        }
        cr_expect_eq(nan_out, n, "bad %g: %zu of %zu outputs are NaN", (double)bad[v], nan_out, n);
    }
    /* A zero matrix stays zero (the 1e-7 keeps the normalization finite). */
    memset(x, 0, n * sizeof(float));
    cr_assert_eq(mfsdp_cpu_newton_schulz(x, m, k, 5, ws, wsn), MFSDP_OK);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(x[i], 0.0f);
    }
    free(in);
    free(x);
    free(ws);
    free(ref);
}

Test(kernels_ns, workspace_size)
{
    cr_expect_eq(mfsdp_ns_workspace_elems(3, 5), 2 * 9 + 15);
    cr_expect_eq(mfsdp_ns_workspace_elems(5, 3), 2 * 9 + 15);
    cr_expect_eq(mfsdp_ns_workspace_elems(1, 1), 3);
    cr_expect_eq(mfsdp_ns_workspace_elems(0, 5), 0);
    cr_expect_eq(mfsdp_ns_workspace_elems(5, -1), 0);
    cr_expect_eq(mfsdp_ns_workspace_elems((int64_t)INT_MAX + 1, 1), 0);
    cr_expect_eq(mfsdp_ns_workspace_elems(INT_MAX, INT_MAX), 0);
    cr_expect_eq(mfsdp_muon_workspace_elems(3, 5), 2 * 9 + 2 * 15);
    cr_expect_eq(mfsdp_muon_workspace_elems(0, 5), 0);
    cr_expect_eq(mfsdp_muon_workspace_elems(INT_MAX, INT_MAX), 0);
    cr_expect(strstr(mfsdp_cpu_ns_routines(), "sgemm") != NULL);
}

Test(kernels_ns, errors)
{
    const int64_t m = 6, k = 4;
    const size_t n = (size_t)(m * k), wsn = mfsdp_ns_workspace_elems(m, k);
    float *x = xmalloc(2 * n * sizeof(float));
    float *ws = xmalloc(wsn * sizeof(float));
    for (size_t i = 0; i < 2 * n; i++) {
        x[i] = (float)i;
    }
    float *keep = xmalloc(2 * n * sizeof(float));
    memcpy(keep, x, 2 * n * sizeof(float));
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(NULL, m, k, 5, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "null matrix");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, m, k, 5, NULL, wsn), MFSDP_ERR_INVALID_ARG,
                "null workspace");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, 0, k, 5, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "invalid matrix shape 0 x 4");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, m, -3, 5, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "invalid matrix shape 6 x -3");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, (int64_t)INT_MAX + 1, k, 5, ws, wsn), MFSDP_ERR_OVERFLOW,
                "too large");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, INT64_MAX, INT64_MAX, 5, ws, wsn), MFSDP_ERR_OVERFLOW,
                "too large");
    /* (2^31 - 1)^2 floats fit size_t in bytes, the workspace 2 s^2 + m k does not. */
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, INT_MAX, INT_MAX, 5, ws, wsn), MFSDP_ERR_OVERFLOW,
                "workspace of 2147483647 x 2147483647 overflows");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, m, k, -1, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "negative step count -1");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, m, k, 5, ws, wsn - 1), MFSDP_ERR_MISMATCH, "needs 56");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz(x, m, k, 5, x + 3, wsn), MFSDP_ERR_INVALID_ARG,
                "workspace overlaps");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_batched(x, 0, m, k, 5, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "empty batch");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_batched(x, SIZE_MAX / 8, m, k, 5, ws, wsn),
                MFSDP_ERR_OVERFLOW, "overflows");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_batched(x, 2, m, k, 5, x + n, wsn), MFSDP_ERR_INVALID_ARG,
                "workspace overlaps");
    const int64_t short_split[2] = {2, 3};
    const int64_t long_split[3] = {2, 3, 4};
    const int64_t neg_split[2] = {7, -1};
    const int64_t zero_split[3] = {3, 0, 3};
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_split(x, m, k, 2, NULL, 5, ws, wsn), MFSDP_ERR_INVALID_ARG,
                "split is null");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_split(x, m, k, 2, short_split, 5, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "split sums to 5 rows, the matrix has 6");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_split(x, m, k, 3, long_split, 5, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "split[2] = 4 does not fit the 1 rows left");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_split(x, m, k, 2, neg_split, 5, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "split[0] = 7");
    EXPECT_FAIL(mfsdp_cpu_newton_schulz_split(x, m, k, 3, zero_split, 5, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "split[1] = 0");
    /* Failed calls wrote nothing. */
    cr_expect(memcmp(x, keep, 2 * n * sizeof(float)) == 0, "a failed call wrote its matrix");
    free(x);
    free(ws);
    free(keep);
}
