/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Fixed-order reduction (reduce-to-owner) against a rank-ordered fp32 loop written here
 * (bitwise) and a float64 reference (relative error), for every source dtype and op; the CPU
 * executor's combine against a plain loop (bitwise).
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include "kernels/executor.h"
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

TestSuite(kernels_reduce, .init = suite_init, .fini = suite_fini);

/* Independent decoders (bf16: top half of a float; f16: fields by ldexp). */
static float widen(mfsdp_dtype_t dt, const void *src, size_t i)
{
    if (dt == MFSDP_FLOAT32) {
        return ((const float *)src)[i];
    }
    const uint16_t h = ((const uint16_t *)src)[i];
    if (dt == MFSDP_BFLOAT16) {
        const uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    const unsigned e = (h >> 10) & 31u, mant = h & 1023u;
    double v = e == 31  ? (mant ? NAN : INFINITY)
               : e == 0 ? ldexp(mant, -24)
                        : ldexp(1024 + mant, (int)e - 25);
    return (float)((h & 0x8000u) ? -v : v);
}

typedef struct red_case {
    int nsrc;
    mfsdp_dtype_t dtype;
    mfsdp_redop_t op;
    int accumulate;
    size_t n;
} red_case_t;

ParameterizedTestParameters(kernels_reduce, matches_ordered_loop)
{
    static red_case_t cases[3 * 3 * 5 * 2];
    static const size_t counts[] = {1, 15, 448, 4290, 257000};
    static const int nsrcs[] = {1, 2, 3, 4, 8};
    size_t c = 0;
    for (int d = 0; d < 3; d++) {
        for (int op = 0; op < 3; op++) {
            for (int r = 0; r < 5; r++) {
                for (int acc = 0; acc < 2; acc++) {
                    cases[c] = (red_case_t){nsrcs[r], (mfsdp_dtype_t)d, (mfsdp_redop_t)op, acc,
                                            counts[(size_t)(d + op + r + acc) % 5]};
                    c++;
                }
            }
        }
    }
    return cr_make_param_array(red_case_t, cases, c);
}

ParameterizedTest(red_case_t *p, kernels_reduce, matches_ordered_loop)
{
    char what[96];
    snprintf(what, sizeof(what), "reduce nsrc %d dtype %d op %d acc %d n %zu", p->nsrc,
             (int)p->dtype, (int)p->op, p->accumulate, p->n);
    test_rng_t rng = rng_seeded(what);
    const size_t n = p->n, esz = mfsdp_dtype_size(p->dtype);
    void *srcs[8];
    const void *csrc[8];
    float *f32 = xmalloc(n * sizeof(float));
    for (int r = 0; r < p->nsrc; r++) {
        srcs[r] = xmalloc(n * esz);
        fill_normal(&rng, f32, n, 10.0);
        cr_assert_eq(mfsdp_cpu_cast(srcs[r], p->dtype, f32, MFSDP_FLOAT32, n), MFSDP_OK);
        csrc[r] = srcs[r];
    }
    const float scalar = (float)(0.1 + rng_uniform(&rng));
    float *out = xmalloc(n * sizeof(float));
    float *out2 = xmalloc(n * sizeof(float));
    float *init = xmalloc(n * sizeof(float));
    float *loop = xmalloc(n * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    double *mag = xmalloc(n * sizeof(double)); /* the terms' magnitudes: fp32's error scale */
    fill_normal(&rng, init, n, 5.0);
    if (p->accumulate) {
        memcpy(out, init, n * sizeof(float));
        memcpy(out2, init, n * sizeof(float));
    } else {
        poison(out, n);
        poison(out2, n);
    }
    cr_assert_eq(
        mfsdp_cpu_reduce_ordered(out, csrc, p->nsrc, p->dtype, n, p->op, scalar, p->accumulate),
        MFSDP_OK);
    cr_assert_eq(
        mfsdp_cpu_reduce_ordered(out2, csrc, p->nsrc, p->dtype, n, p->op, scalar, p->accumulate),
        MFSDP_OK);
    size_t premul_differs = 0;
    for (size_t i = 0; i < n; i++) {
        /* The documented order, element by element, in fp32. */
        const int pm = p->op == MFSDP_OP_PREMULSUM;
        float s = pm ? widen(p->dtype, srcs[0], i) * scalar : widen(p->dtype, srcs[0], i);
        float plain = widen(p->dtype, srcs[0], i);
        double d = (double)widen(p->dtype, srcs[0], i);
        double a = fabs(d);
        for (int r = 1; r < p->nsrc; r++) {
            const float v = widen(p->dtype, srcs[r], i);
            s = s + (pm ? v * scalar : v);
            plain = plain + v;
            d += (double)v;
            a += fabs((double)v);
        }
        if (p->op == MFSDP_OP_AVG) {
            s = s / (float)p->nsrc;
            d /= p->nsrc;
            a /= p->nsrc;
        } else if (pm) {
            d *= (double)scalar;
            a *= (double)scalar;
            premul_differs += plain * scalar != s;
        }
        loop[i] = p->accumulate ? init[i] + s : s;
        ref[i] = p->accumulate ? (double)init[i] + d : d;
        mag[i] = p->accumulate ? fabs((double)init[i]) + a : a;
    }
    cr_expect(memcmp(out, loop, n * sizeof(float)) == 0, "%s: differs from the ordered loop", what);
    cr_expect(memcmp(out, out2, n * sizeof(float)) == 0, "%s: not reproducible", what);
    /* Relative to the terms' magnitudes, not to the result: a sum that cancels (one element,
     * init = -term) has a tiny result and an fp32 error of the terms' size. */
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)out[i] - ref[i]) * ((double)out[i] - ref[i]);
        den += mag[i] * mag[i];
    }
    const double err = den > 0.0 ? sqrt(num / den) : sqrt(num);
    cr_expect(isfinite(err) && err < 1e-5, "%s: rel err vs float64 %g", what, err);
    if (p->op == MFSDP_OP_PREMULSUM && p->nsrc > 1 && n > 4000) {
        /* The test can tell premul-then-sum from sum-then-scale. */
        cr_expect_gt(premul_differs, 0, "%s: premulsum indistinguishable", what);
    }
    for (int r = 0; r < p->nsrc; r++) {
        free(srcs[r]);
    }
    free(f32);
    free(out);
    free(out2);
    free(init);
    free(loop);
    free(ref);
    free(mag);
}

/* Rank order is observable: 1e8 + 1 + -1e8 + 1 is 1 in rank order, 0 in other orders. */
Test(kernels_reduce, rank_order)
{
    const float v[4] = {1e8f, 1.0f, -1e8f, 1.0f};
    const void *src[4] = {&v[0], &v[1], &v[2], &v[3]};
    float out = NAN;
    cr_assert_eq(mfsdp_cpu_reduce_ordered(&out, src, 4, MFSDP_FLOAT32, 1, MFSDP_OP_SUM, 0.0f, 0),
                 MFSDP_OK);
    cr_expect_eq(out, 1.0f);
    const void *rev[4] = {&v[3], &v[2], &v[1], &v[0]};
    cr_assert_eq(mfsdp_cpu_reduce_ordered(&out, rev, 4, MFSDP_FLOAT32, 1, MFSDP_OP_SUM, 0.0f, 0),
                 MFSDP_OK);
    cr_expect_eq(out, 0.0f);
}

/* The owner's own contribution may be the output (in place). */
Test(kernels_reduce, in_place)
{
    test_rng_t rng = rng_seeded("reduce in place");
    enum { N = 3000 };
    float *a = xmalloc(N * sizeof(float)), *b = xmalloc(N * sizeof(float));
    float *c = xmalloc(N * sizeof(float)), *want = xmalloc(N * sizeof(float));
    fill_normal(&rng, a, N, 1.0);
    fill_normal(&rng, b, N, 1.0);
    fill_normal(&rng, c, N, 1.0);
    for (size_t i = 0; i < N; i++) {
        want[i] = ((a[i] + b[i]) + c[i]) / 3.0f;
    }
    const void *src[3] = {a, b, c};
    cr_assert_eq(mfsdp_cpu_reduce_ordered(b, src, 3, MFSDP_FLOAT32, N, MFSDP_OP_AVG, 0.0f, 0),
                 MFSDP_OK);
    cr_expect(memcmp(b, want, N * sizeof(float)) == 0, "in-place reduce differs");
    free(a);
    free(b);
    free(c);
    free(want);
}

Test(kernels_reduce, nonfinite)
{
    const float a[4] = {NAN, INFINITY, INFINITY, 1.0f};
    const float b[4] = {1.0f, 1.0f, -INFINITY, 2.0f};
    const void *src[2] = {a, b};
    float out[4];
    poison(out, 4);
    cr_assert_eq(mfsdp_cpu_reduce_ordered(out, src, 2, MFSDP_FLOAT32, 4, MFSDP_OP_AVG, 0.0f, 0),
                 MFSDP_OK);
    cr_expect(isnan(out[0]));
    cr_expect(isinf(out[1]) && out[1] > 0);
    cr_expect(isnan(out[2]));
    cr_expect_eq(out[3], 1.5f);
}

Test(kernels_reduce, errors)
{
    float a[4] = {1, 2, 3, 4}, out[4] = {0};
    const void *src[2] = {a, a};
    const void *nul[2] = {a, NULL};
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(NULL, src, 2, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "reduce: null pointer");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, NULL, 2, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "reduce: null pointer");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, nul, 2, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "source 1 is null");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, src, 0, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "no source");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, src, -2, MFSDP_FLOAT32, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "no source");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, src, 2, MFSDP_FLOAT32, 0, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "empty input");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, src, 2, MFSDP_UINT8, 4, MFSDP_OP_SUM, 0, 0),
                MFSDP_ERR_INVALID_ARG, "unsupported source dtype uint8");
    EXPECT_FAIL(mfsdp_cpu_reduce_ordered(out, src, 2, MFSDP_FLOAT32, 4, (mfsdp_redop_t)9, 0, 0),
                MFSDP_ERR_INVALID_ARG, "unknown op 9");
    EXPECT_FAIL(
        mfsdp_cpu_reduce_ordered(out, src, 2, MFSDP_FLOAT32, SIZE_MAX / 2, MFSDP_OP_SUM, 0, 0),
        MFSDP_ERR_OVERFLOW, "overflow");
    for (int i = 0; i < 4; i++) {
        cr_expect_eq(out[i], 0.0f, "a failed reduce wrote its output");
    }
}

/* The CPU executor's combine (one step of the chain/native reduce pipelines and of partial
 * sums): bitwise the plain per-element loop written here, for every dtype, with and without
 * pin (NULL, in place, disjoint) and premul, at lengths around the kernel's block; a partial
 * overlap of pin and pout is refused. */
Test(kernels_reduce, executor_combine_matches_loop)
{
    mfsdp_exec_t *e = NULL;
    cr_assert_eq(mfsdp_exec_cpu_create(&e), MFSDP_OK);
    static const size_t counts[] = {0, 1, 7, 1023, 1024, 1025, 5000};
    for (int d = 0; d < 3; d++) {
        const mfsdp_dtype_t dt = (mfsdp_dtype_t)d;
        const size_t esz = mfsdp_dtype_size(dt);
        for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
            const size_t n = counts[ci];
            for (int pinmode = 0; pinmode < 3; pinmode++) { /* NULL, in place, disjoint */
                for (int pm = 0; pm < 2; pm++) {
                    char what[96];
                    snprintf(what, sizeof(what), "combine dtype %d n %zu pin %d premul %d", d, n,
                             pinmode, pm);
                    test_rng_t rng = rng_seeded(what);
                    float *f32 = xmalloc((n + 1) * sizeof(float));
                    void *x = xmalloc((n + 1) * esz);
                    float *pin = xmalloc((n + 1) * sizeof(float));
                    float *pout = xmalloc((n + 1) * sizeof(float));
                    float *want = xmalloc((n + 1) * sizeof(float));
                    fill_normal(&rng, f32, n + 1, 10.0);
                    cr_assert_eq(mfsdp_cpu_cast(x, dt, f32, MFSDP_FLOAT32, n + 1), MFSDP_OK);
                    fill_normal(&rng, pin, n + 1, 5.0);
                    const float scalar = (float)(0.1 + rng_uniform(&rng));
                    for (size_t i = 0; i < n; i++) {
                        float v = widen(dt, x, i);
                        v = pm ? v * scalar : v;
                        want[i] = pinmode == 0 ? v : pin[i] + v;
                    }
                    const float *p = NULL;
                    if (pinmode == 1) {
                        memcpy(pout, pin, (n + 1) * sizeof(float));
                        p = pout;
                    } else {
                        poison(pout, n + 1);
                        p = pinmode == 2 ? pin : NULL;
                    }
                    const float guard = pout[n];
                    cr_assert_eq(e->ops->combine(e, pout, p, x, dt, n,
                                                 pm ? MFSDP_OP_PREMULSUM : MFSDP_OP_SUM, scalar),
                                 MFSDP_OK, "%s", what);
                    cr_expect(n == 0 || memcmp(pout, want, n * sizeof(float)) == 0,
                              "%s: differs from the loop", what);
                    cr_expect(memcmp(&pout[n], &guard, sizeof(float)) == 0, "%s: wrote past n",
                              what);
                    free(f32);
                    free(x);
                    free(pin);
                    free(pout);
                    free(want);
                }
            }
        }
    }
    /* pin overlapping pout partly: refused, nothing written */
    float buf[64] = {0};
    uint16_t xs[32] = {0};
    cr_expect_neq(e->ops->combine(e, buf + 1, buf, xs, MFSDP_BFLOAT16, 32, MFSDP_OP_SUM, 1.0f),
                  MFSDP_OK);
    e->ops->destroy(e);
}
