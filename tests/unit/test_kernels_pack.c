/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Strided pack/unpack against FSDP2's layout (docs/design.md, "FSDP2's byte layout") computed here
 * by hand and by a plain per-row loop, and the squared norm against a float64 sum.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

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

TestSuite(kernels_pack, .init = suite_init, .fini = suite_fini);

/* A group at world 4 with params (5,), (10, 3), (2, 4), fp32:
 *   p0: c = 2, s = 2, o = 0;  p1: c = 3, s = 9, o = 2;  p2: c = 1, s = 4, o = 11;  S = 15.
 * p1's pieces start at r*15 + 2 = 2, 17, 32, 47; rank 3 holds row 9 (3 floats) and two rows
 * of padding (6 floats). p2 has rows only on ranks 0 and 1: ranks 2 and 3 are all padding. */
Test(kernels_pack, hand_computed_fsdp2_offsets)
{
    float buf[60];
    float full1[30], back1[30], full2[8], back2[8];
    for (int i = 0; i < 30; i++) {
        full1[i] = (float)(100 + i);
    }
    for (int i = 0; i < 8; i++) {
        full2[i] = (float)(200 + i);
    }
    const mfsdp_strided_geom_t g1 = {
        4, 10, 3, 3 * sizeof(float), 15 * sizeof(float), 2 * sizeof(float)};
    const mfsdp_strided_geom_t g2 = {
        4, 2, 1, 4 * sizeof(float), 15 * sizeof(float), 11 * sizeof(float)};
    for (int i = 0; i < 60; i++) {
        buf[i] = NAN;
    }
    cr_assert_eq(mfsdp_cpu_unpack(buf, full1, &g1), MFSDP_OK);
    cr_assert_eq(mfsdp_cpu_unpack(buf, full2, &g2), MFSDP_OK);
    /* Expected buffer, position by position. */
    for (int r = 0; r < 4; r++) {
        const float *rb = buf + 15 * r;
        cr_expect(isnan(rb[0]) && isnan(rb[1]), "rank %d: p0 area written", r);
        for (int j = 0; j < 9; j++) { /* p1 rows 3r .. 3r+2 */
            const int row = 3 * r + j / 3;
            const float want = row < 10 ? (float)(100 + 3 * row + j % 3) : 0.0f;
            cr_expect_eq(rb[2 + j], want, "rank %d p1[%d]", r, j);
        }
        for (int j = 0; j < 4; j++) { /* p2 row r */
            const float want = r < 2 ? (float)(200 + 4 * r + j) : 0.0f;
            cr_expect_eq(rb[11 + j], want, "rank %d p2[%d]", r, j);
        }
    }
    cr_expect_eq(buf[47], 127.0f);
    cr_expect_eq(buf[49], 129.0f);
    cr_expect_eq(buf[50], 0.0f);
    poison(back1, 30);
    poison(back2, 8);
    cr_assert_eq(mfsdp_cpu_pack(back1, buf, &g1), MFSDP_OK);
    cr_assert_eq(mfsdp_cpu_pack(back2, buf, &g2), MFSDP_OK);
    cr_expect(memcmp(back1, full1, sizeof(full1)) == 0);
    cr_expect(memcmp(back2, full2, sizeof(full2)) == 0);
}

typedef struct pack_case {
    int64_t rows;
    int64_t cols;
    int world;
    int elt; /* bytes per element: 4, 2 or 1 (uint8 groups) */
} pack_case_t;

ParameterizedTestParameters(kernels_pack, random_geometries)
{
    static pack_case_t cases[] = {
        {1, 1, 1, 4},   {1, 1, 4, 4},    {3, 5, 2, 2},      {3, 5, 8, 4},
        {7, 64, 3, 2},  {130, 33, 4, 4}, {130, 33, 7, 1},   {64, 7, 13, 2},
        {64, 7, 64, 4}, {64, 7, 100, 4}, {1000, 257, 8, 4}, {1000, 257, 3, 2},
    };
    return cr_make_param_array(pack_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(pack_case_t *p, kernels_pack, random_geometries)
{
    char what[80];
    snprintf(what, sizeof(what), "pack %lldx%lld world %d elt %d", (long long)p->rows,
             (long long)p->cols, p->world, p->elt);
    test_rng_t rng = rng_seeded(what);
    const size_t rb = (size_t)p->cols * (size_t)p->elt;
    const size_t c = (size_t)((p->rows + p->world - 1) / p->world);
    const size_t before = (size_t)(rng_u64(&rng) % 64) * (size_t)p->elt; /* earlier params */
    const size_t after = (size_t)(rng_u64(&rng) % 64) * (size_t)p->elt;  /* later params */
    const size_t stride = before + c * rb + after;
    const size_t total = stride * (size_t)p->world, fullb = (size_t)p->rows * rb;
    unsigned char *full = xmalloc(fullb), *back = xmalloc(fullb);
    unsigned char *buf = xmalloc(total), *want = xmalloc(total);
    for (size_t i = 0; i < fullb; i++) {
        full[i] = (unsigned char)(rng_u64(&rng) | 1u); /* never 0: padding is visible */
    }
    memset(buf, 0xa5, total);
    memset(want, 0xa5, total);
    /* Row g lives on rank g / c at local row g % c; rows past N0 are zero. */
    for (size_t r = 0; r < (size_t)p->world; r++) {
        for (size_t lr = 0; lr < c; lr++) {
            const size_t g = r * c + lr;
            unsigned char *dst = want + r * stride + before + lr * rb;
            if (g < (size_t)p->rows) {
                memcpy(dst, full + g * rb, rb);
            } else {
                memset(dst, 0, rb);
            }
        }
    }
    const mfsdp_strided_geom_t geom = {p->world, p->rows, (int64_t)c, rb, stride, before};
    cr_assert_eq(mfsdp_cpu_unpack(buf, full, &geom), MFSDP_OK);
    cr_expect(memcmp(buf, want, total) == 0, "%s: unpacked buffer differs", what);
    memset(back, 0xa5, fullb);
    cr_assert_eq(mfsdp_cpu_pack(back, buf, &geom), MFSDP_OK);
    cr_expect(memcmp(back, full, fullb) == 0, "%s: pack does not invert unpack", what);
    free(full);
    free(back);
    free(buf);
    free(want);
}

Test(kernels_pack, errors)
{
    float full[12] = {0}, buf[32] = {0};
    const mfsdp_strided_geom_t ok = {2, 3, 2, 4 * sizeof(float), 10 * sizeof(float), 0};
    mfsdp_strided_geom_t g;
    EXPECT_FAIL(mfsdp_cpu_pack(NULL, buf, &ok), MFSDP_ERR_INVALID_ARG, "pack: null matrix");
    EXPECT_FAIL(mfsdp_cpu_pack(full, NULL, &ok), MFSDP_ERR_INVALID_ARG, "pack: null buffer");
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, NULL), MFSDP_ERR_INVALID_ARG, "null geometry");
    g = ok;
    g.world = 0;
    EXPECT_FAIL(mfsdp_cpu_pack(full, buf, &g), MFSDP_ERR_INVALID_ARG, "invalid geometry world 0");
    g = ok;
    g.rows = 0;
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_INVALID_ARG, "invalid geometry");
    g = ok;
    g.row_bytes = 0;
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_INVALID_ARG, "row_bytes 0");
    g = ok;
    g.rows_per_rank = 1;
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_INVALID_ARG,
                "rows_per_rank 1, ceil(3 / 2) is 2");
    g = ok;
    g.offset = 3 * sizeof(float); /* 3 + 8 floats > stride 10 */
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_MISMATCH, "exceeds the rank stride");
    g = ok;
    g.rank_stride = SIZE_MAX / 2 + 1;
    g.world = 3;
    g.rows = 5;
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_OVERFLOW, "overflow");
    g = ok;
    g.row_bytes = SIZE_MAX / 2;
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, full, &g), MFSDP_ERR_OVERFLOW, "overflow");
    EXPECT_FAIL(mfsdp_cpu_unpack(buf, buf + 4, &ok), MFSDP_ERR_INVALID_ARG, "overlap");
    for (int i = 0; i < 32; i++) {
        cr_expect_eq(buf[i], 0.0f, "a failed unpack wrote its buffer");
    }
}

ParameterizedTestParameters(kernels_pack, sqnorm)
{
    static size_t counts[] = {1, 15, 448, 4290, 257000};
    return cr_make_param_array(size_t, counts, sizeof(counts) / sizeof(counts[0]));
}

ParameterizedTest(size_t *count, kernels_pack, sqnorm)
{
    test_rng_t rng = rng_seeded("sqnorm");
    const size_t n = *count;
    float *x = xmalloc(n * sizeof(float));
    fill_normal(&rng, x, n, 3.0);
    long double ref = 0.0L;
    for (size_t i = n; i-- > 0;) { /* reverse order, extended precision */
        ref += (long double)x[i] * (long double)x[i];
    }
    double acc = 2.5, acc2 = 2.5;
    cr_assert_eq(mfsdp_cpu_sqnorm_accumulate(x, n, &acc), MFSDP_OK);
    cr_assert_eq(mfsdp_cpu_sqnorm_accumulate(x, n, &acc2), MFSDP_OK);
    cr_expect_eq(memcmp(&acc, &acc2, sizeof(acc)), 0, "not reproducible");
    cr_expect_lt(fabs((double)((long double)acc - 2.5L - ref)), 1e-12 * (double)ref + 1e-300,
                 "sqnorm %.17g, ref %.17Lg", acc - 2.5, ref);
    x[n / 2] = NAN;
    cr_assert_eq(mfsdp_cpu_sqnorm_accumulate(x, n, &acc), MFSDP_OK);
    cr_expect(isnan(acc));
    free(x);
}

Test(kernels_pack, sqnorm_errors)
{
    float x[2] = {1, 2};
    double acc = 7.0;
    EXPECT_FAIL(mfsdp_cpu_sqnorm_accumulate(NULL, 2, &acc), MFSDP_ERR_INVALID_ARG,
                "sqnorm: null pointer");
    EXPECT_FAIL(mfsdp_cpu_sqnorm_accumulate(x, 2, NULL), MFSDP_ERR_INVALID_ARG,
                "sqnorm: null pointer");
    EXPECT_FAIL(mfsdp_cpu_sqnorm_accumulate(x, 0, &acc), MFSDP_ERR_INVALID_ARG,
                "sqnorm: empty input");
    cr_expect_eq(acc, 7.0);
}
