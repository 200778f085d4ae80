/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Muon and AdamW updates against float64 references of docs/design.md, "The optimizer step" written
 * here (momentum, Nesterov, Newton-Schulz per block, keller/moonlight scale, decoupled weight
 * decay, comm-dtype copy; AdamW with bias correction over several steps).
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

TestSuite(kernels_muon, .init = suite_init, .fini = suite_fini);

/* bf16 rounding written independently: nearest of the two neighbouring bf16 values in
 * double, ties to the even pattern (finite inputs within range only). */
static uint16_t ref_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    const double dl = fabs((double)x - flo), dh = fabs((double)fhi - x);
    const uint32_t pick = dl < dh ? lo : dh < dl ? hi : (((lo >> 16) & 1u) ? hi : lo);
    return (uint16_t)(pick >> 16);
}

static void check_comm(const float *w, const void *comm, mfsdp_dtype_t dt, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (dt == MFSDP_FLOAT32) {
            cr_expect(memcmp(&((const float *)comm)[i], &w[i], 4) == 0, "comm[%zu]", i);
        } else if (dt == MFSDP_BFLOAT16) {
            cr_expect_eq(((const uint16_t *)comm)[i], ref_bf16(w[i]), "comm bf16[%zu]", i);
        } else {
#ifdef __FLT16_MAX__
            const _Float16 h = (_Float16)w[i];
            uint16_t hb;
            memcpy(&hb, &h, 2);
            cr_expect_eq(((const uint16_t *)comm)[i], hb, "comm f16[%zu]", i);
#else
            cr_expect_eq(mfsdp_f32_to_f16(w[i]), ((const uint16_t *)comm)[i]);
#endif
        }
    }
}

#define MAX_SPLIT 4

typedef struct muon_case {
    int64_t m;
    int64_t k;
    int nsplit;
    int64_t split[MAX_SPLIT];
    int nesterov;
    int scale; /* mfsdp_scale_t */
    float weight_decay;
    int ns_steps;
    int comm;  /* -1: no comm copy, else mfsdp_dtype_t */
    int nstep; /* Muon steps in a row (momentum carries over) */
} muon_case_t;

ParameterizedTestParameters(kernels_muon, matches_float64)
{
    static muon_case_t cases[] = {
        {1, 1, 0, {0}, 1, MFSDP_SCALE_KELLER, 0.0f, 5, MFSDP_FLOAT32, 1},
        {3, 5, 0, {0}, 1, MFSDP_SCALE_MOONLIGHT, 0.1f, 5, MFSDP_BFLOAT16, 2},
        {7, 64, 0, {0}, 0, MFSDP_SCALE_KELLER, 0.01f, 5, MFSDP_FLOAT16, 1},
        {130, 33, 0, {0}, 1, MFSDP_SCALE_KELLER, 0.1f, 5, MFSDP_BFLOAT16, 2},
        {130, 33, 0, {0}, 0, MFSDP_SCALE_MOONLIGHT, 0.0f, 3, -1, 1},
        {64, 7, 0, {0}, 1, MFSDP_SCALE_MOONLIGHT, 0.05f, 5, MFSDP_FLOAT32, 3},
        {64, 7, 0, {0}, 0, MFSDP_SCALE_KELLER, 0.0f, 0, MFSDP_BFLOAT16, 1},
        {1000, 257, 0, {0}, 1, MFSDP_SCALE_KELLER, 0.1f, 5, MFSDP_BFLOAT16, 1},
        {257, 1000, 0, {0}, 0, MFSDP_SCALE_MOONLIGHT, 0.1f, 5, -1, 1},
        {96, 40, 3, {32, 32, 32}, 1, MFSDP_SCALE_KELLER, 0.1f, 5, MFSDP_BFLOAT16, 2},
        {96, 40, 3, {10, 50, 36}, 1, MFSDP_SCALE_KELLER, 0.0f, 5, MFSDP_FLOAT32, 1},
        {96, 40, 3, {10, 50, 36}, 0, MFSDP_SCALE_MOONLIGHT, 0.1f, 4, -1, 1},
    };
    return cr_make_param_array(muon_case_t, cases, sizeof(cases) / sizeof(cases[0]));
}

ParameterizedTest(muon_case_t *p, kernels_muon, matches_float64)
{
    char what[128];
    snprintf(what, sizeof(what),
             "muon %lldx%lld nsplit %d nesterov %d scale %d wd %g ns %d "
             "comm %d steps %d",
             (long long)p->m, (long long)p->k, p->nsplit, p->nesterov, p->scale,
             (double)p->weight_decay, p->ns_steps, p->comm, p->nstep);
    test_rng_t rng = rng_seeded(what);
    const size_t n = (size_t)(p->m * p->k);
    const mfsdp_muon_hp_t hp = {.lr = 0.02f,
                                .momentum = 0.95f,
                                .weight_decay = p->weight_decay,
                                .nesterov = p->nesterov,
                                .ns_steps = p->ns_steps,
                                .scale = (mfsdp_scale_t)p->scale};
    const size_t wsn = mfsdp_muon_workspace_elems(p->m, p->k);
    float *w = xmalloc(n * sizeof(float)), *mom = xmalloc(n * sizeof(float));
    float *g = xmalloc(n * sizeof(float)), *ws = xmalloc(wsn * sizeof(float));
    float *comm = xmalloc(n * sizeof(float));
    double *rw = xmalloc(n * sizeof(double)), *rm = xmalloc(n * sizeof(double));
    double *ru = xmalloc(n * sizeof(double)), *rx = xmalloc(n * sizeof(double));
    double *w_before = xmalloc(n * sizeof(double)), *delta = xmalloc(n * sizeof(double));
    float *dgot = xmalloc(n * sizeof(float));
    double *mterm = xmalloc(n * sizeof(double));
    /* Small weights: the fp32 rounding of W stays far below the update being checked. */
    fill_normal(&rng, w, n, 0.05);
    fill_normal(&rng, mom, n, 0.01);
    for (size_t i = 0; i < n; i++) {
        rw[i] = w[i];
        rm[i] = mom[i];
    }
    const int64_t whole[1] = {p->m};
    const int nb = p->nsplit == 0 ? 1 : p->nsplit;
    const int64_t *blocks = p->nsplit == 0 ? whole : p->split;
    for (int step = 0; step < p->nstep; step++) {
        fill_normal(&rng, g, n, 0.01);
        poison(ws, wsn);
        memset(comm, 0xff, n * sizeof(float)); /* NaN in every dtype */
        for (size_t i = 0; i < n; i++) {
            w_before[i] = w[i];
        }
        cr_assert_eq(mfsdp_cpu_muon_update(w, mom, g, p->comm < 0 ? NULL : comm,
                                           p->comm < 0 ? MFSDP_FLOAT32 : (mfsdp_dtype_t)p->comm,
                                           p->m, p->k, (size_t)p->nsplit,
                                           p->nsplit ? p->split : NULL, &hp, ws, wsn),
                     MFSDP_OK);
        /* Reference step in double. */
        const double beta = 0.95, lr = 0.02, wd = (double)p->weight_decay;
        for (size_t i = 0; i < n; i++) {
            mterm[i] = beta * fabs(rm[i]) + (1.0 - beta) * fabs((double)g[i]);
            rm[i] = beta * rm[i] + (1.0 - beta) * g[i];
            ru[i] = p->nesterov ? (1.0 - beta) * g[i] + beta * rm[i] : rm[i];
        }
        size_t off = 0;
        for (int b = 0; b < nb; b++) {
            const int64_t rows = blocks[b];
            const size_t len = (size_t)rows * (size_t)p->k;
            ref_ns_f64(ru + off, rows, p->k, p->ns_steps, rx + off);
            const double scale = p->scale == MFSDP_SCALE_KELLER
                                     ? sqrt(fmax(1.0, (double)rows / (double)p->k))
                                     : 0.2 * sqrt((double)(rows > p->k ? rows : p->k));
            for (size_t i = off; i < off + len; i++) {
                const double nw = rw[i] * (1.0 - lr * wd) - lr * scale * rx[i];
                rw[i] = nw;
            }
            off += len;
        }
        /* Compare the update itself (W - W_before), not only W, which it barely moves. */
        for (size_t i = 0; i < n; i++) {
            delta[i] = rw[i] - w_before[i];
            dgot[i] = (float)((double)w[i] - w_before[i]);
        }
        /* W's error relative to the weights' scale before or after the step: an update can
         * cancel a tiny matrix (1x1: w - lr * sign(w)) to almost nothing, which makes a plain
         * relative error of W measure the cancellation, not the kernel. */
        double num = 0.0, nwb = 0.0, na = 0.0;
        for (size_t i = 0; i < n; i++) {
            num += ((double)w[i] - rw[i]) * ((double)w[i] - rw[i]);
            na += rw[i] * rw[i];
            nwb += w_before[i] * w_before[i];
        }
        const double err_w = isfinite(num) ? sqrt(num / fmax(fmax(na, nwb), 1e-300)) : INFINITY;
        /* momentum: within 1e-5 of itself plus 4 ulps of its two terms (they may cancel) */
        const double err_m = bounded_err(mom, rm, mterm, n, 1e-5, 4.0);
        const double err_d = rel_err(dgot, delta, n);
        fprintf(stderr, "[%s] step %d: rel err W %.3g update %.3g, momentum error/bound %.3g\n",
                what, step, err_w, err_d, err_m);
        cr_expect_lt(err_w, 1e-5, "%s step %d: W rel err %g", what, step, err_w);
        cr_expect_lt(err_m, 1.0, "%s step %d: momentum error / bound %g", what, step, err_m);
        cr_expect_lt(err_d, 1e-4, "%s step %d: update rel err %g", what, step, err_d);
        if (p->comm >= 0) {
            check_comm(w, comm, (mfsdp_dtype_t)p->comm, n);
        }
        /* Continue from the reference so that errors do not compound across steps. */
        for (size_t i = 0; i < n; i++) {
            w[i] = (float)rw[i];
            mom[i] = (float)rm[i];
            rw[i] = w[i];
            rm[i] = mom[i];
        }
    }
    free(w);
    free(mom);
    free(g);
    free(ws);
    free(comm);
    free(rw);
    free(rm);
    free(ru);
    free(rx);
    free(w_before);
    free(delta);
    free(dgot);
    free(mterm);
}

Test(kernels_muon, scale)
{
    cr_expect_float_eq(mfsdp_muon_scale(400, 100, MFSDP_SCALE_KELLER), 2.0f, 1e-6f);
    cr_expect_float_eq(mfsdp_muon_scale(100, 400, MFSDP_SCALE_KELLER), 1.0f, 1e-6f);
    cr_expect_float_eq(mfsdp_muon_scale(100, 400, MFSDP_SCALE_MOONLIGHT), 4.0f, 1e-6f);
    cr_expect_float_eq(mfsdp_muon_scale(2500, 3, MFSDP_SCALE_MOONLIGHT), 10.0f, 1e-5f);
    cr_expect_eq(mfsdp_muon_scale(0, 3, MFSDP_SCALE_KELLER), 0.0f);
    cr_expect_eq(mfsdp_muon_scale(3, 3, (mfsdp_scale_t)7), 0.0f);
}

Test(kernels_muon, nonfinite_gradient)
{
    const int64_t m = 4, k = 6;
    const size_t n = 24, wsn = mfsdp_muon_workspace_elems(m, k);
    float w[24], mom[24] = {0}, g[24];
    float *ws = xmalloc(wsn * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        w[i] = 1.0f;
        g[i] = (float)i;
    }
    g[5] = NAN;
    const mfsdp_muon_hp_t hp = {0.02f, 0.95f, 0.0f, 1, 5, MFSDP_SCALE_KELLER};
    cr_assert_eq(mfsdp_cpu_muon_update(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, ws, wsn),
                 MFSDP_OK);
    /* Momentum is element-wise, Newton-Schulz mixes everything (the norm is NaN). */
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(isnan(mom[i]) != 0, i == 5, "mom[%zu] = %g", i, (double)mom[i]);
        cr_expect(isnan(w[i]), "w[%zu] = %g", i, (double)w[i]);
    }
    free(ws);
}

Test(kernels_muon, errors)
{
    const int64_t m = 6, k = 4;
    const size_t n = 24, wsn = mfsdp_muon_workspace_elems(m, k);
    cr_assert_eq(wsn, 24 + 2 * 16 + 24);
    float w[24], mom[24], g[24];
    uint16_t comm[24];
    float *ws = xmalloc(wsn * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        w[i] = (float)i;
        mom[i] = (float)(2 * i);
        g[i] = 1.0f;
    }
    const mfsdp_muon_hp_t hp = {0.02f, 0.95f, 0.0f, 1, 5, MFSDP_SCALE_KELLER};
    mfsdp_muon_hp_t bad = hp;
#define MUON(W, M, G, C, DT, MM, KK, NS, SP, HP, WS, WSN)                                          \
    mfsdp_cpu_muon_update(W, M, G, C, DT, MM, KK, NS, SP, HP, WS, WSN)
    EXPECT_FAIL(MUON(NULL, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "muon: null weights");
    EXPECT_FAIL(MUON(w, NULL, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "muon: null momentum");
    EXPECT_FAIL(MUON(w, mom, NULL, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "muon: null gradient");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, NULL, wsn),
                MFSDP_ERR_INVALID_ARG, "muon: null workspace");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, NULL, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "null hyper-parameters");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, 0, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "invalid matrix shape 0 x 4");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, INT64_MAX, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_OVERFLOW, "too large");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, ws, wsn - 1),
                MFSDP_ERR_MISMATCH, "needs 80");
    EXPECT_FAIL(MUON(w, mom, g, comm, MFSDP_UINT8, m, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "unsupported dtype 3 (uint8)");
    EXPECT_FAIL(MUON(w, mom, g, w + 2, MFSDP_BFLOAT16, m, k, 0, NULL, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "comm copy overlaps");
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &hp, w, wsn),
                MFSDP_ERR_INVALID_ARG, "overlap");
    const int64_t split[2] = {3, 2};
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 2, split, &hp, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "split sums to 5 rows");
    bad = hp;
    bad.ns_steps = -2;
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &bad, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "negative ns_steps -2");
    bad = hp;
    bad.scale = (mfsdp_scale_t)5;
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &bad, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "unknown scale rule 5");
    bad = hp;
    bad.momentum = 1.5f;
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &bad, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "bad hyper-parameters");
    bad = hp;
    bad.lr = NAN;
    EXPECT_FAIL(MUON(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 0, NULL, &bad, ws, wsn),
                MFSDP_ERR_INVALID_ARG, "bad hyper-parameters lr nan");
#undef MUON
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(w[i], (float)i, "a failed update wrote W");
        cr_expect_eq(mom[i], (float)(2 * i), "a failed update wrote the momentum");
    }
    free(ws);
}

/* AdamW over several steps against double, with bias correction and weight decay. */
ParameterizedTestParameters(kernels_muon, adamw_matches_float64)
{
    static size_t counts[] = {1, 15, 448, 4290, 448, 257000};
    return cr_make_param_array(size_t, counts, sizeof(counts) / sizeof(counts[0]));
}

ParameterizedTest(size_t *count, kernels_muon, adamw_matches_float64)
{
    const size_t n = *count;
    test_rng_t rng = rng_seeded("adamw");
    const mfsdp_adamw_hp_t hp = {
        .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    const mfsdp_dtype_t comm_dt[3] = {MFSDP_BFLOAT16, MFSDP_FLOAT32, MFSDP_FLOAT16};
    float *w = xmalloc(n * sizeof(float)), *m = xmalloc(n * sizeof(float));
    float *v = xmalloc(n * sizeof(float)), *g = xmalloc(n * sizeof(float));
    float *comm = xmalloc(n * sizeof(float)), *dgot = xmalloc(n * sizeof(float));
    double *rw = xmalloc(n * sizeof(double)), *rm = xmalloc(n * sizeof(double));
    double *rv = xmalloc(n * sizeof(double)), *delta = xmalloc(n * sizeof(double));
    double *mterm = xmalloc(n * sizeof(double)), *wterm = xmalloc(n * sizeof(double));
    fill_normal(&rng, w, n, 0.01); /* small: fp32 rounding of W far below the lr 1e-3 step */
    poison(m, n);                  /* state starts at zero: write it explicitly after poisoning */
    for (size_t i = 0; i < n; i++) {
        m[i] = v[i] = 0.0f;
        rw[i] = w[i];
        rm[i] = rv[i] = 0.0;
    }
    for (int64_t t = 1; t <= 6; t++) {
        fill_normal(&rng, g, n, 0.01 * (double)t);
        memset(comm, 0xff, n * sizeof(float));
        double *before = delta;
        for (size_t i = 0; i < n; i++) {
            before[i] = rw[i];
        }
        const mfsdp_dtype_t dt = comm_dt[t % 3];
        cr_assert_eq(mfsdp_cpu_adamw_update(w, m, v, g, comm, dt, n, t, &hp), MFSDP_OK);
        const double b1 = 0.9f, b2 = 0.95f, lr = 1e-3f, eps = 1e-8f, wd = 0.1f;
        for (size_t i = 0; i < n; i++) {
            mterm[i] = b1 * fabs(rm[i]) + (1 - b1) * fabs((double)g[i]);
            rm[i] = b1 * rm[i] + (1 - b1) * g[i];
            rv[i] = b2 * rv[i] + (1 - b2) * (double)g[i] * g[i];
            const double mh = rm[i] / (1 - pow(b1, (double)t));
            const double vh = rv[i] / (1 - pow(b2, (double)t));
            const double step = lr * mh / (sqrt(vh) + eps);
            wterm[i] = fabs(rw[i]) + fabs(step);
            rw[i] = rw[i] * (1 - lr * wd) - step;
            dgot[i] = (float)((double)w[i] - before[i]);
            delta[i] = rw[i] - before[i];
        }
        /* m within 1e-5 of itself plus 4 ulps of its terms (they cancel for gradients of
         * alternating sign), W likewise (a small W and its step cancel); v's terms are both
         * positive. */
        const double ev = rel_err(v, rv, n);
        const double ew = bounded_err(w, rw, wterm, n, 1e-5, 4.0); /* W and its step cancel */
        const double em = bounded_err(m, rm, mterm, n, 1e-5, 4.0);
        /* The update, element by element within 1e-4 of itself plus 4 ulps of W: W is
         * stored in fp32 and the kernel rounds W * (1 - lr * wd), the Adam term and their
         * difference, so W_after - W_before is never more exact than a few ulps of W. When
         * the step cancels (momentum of alternating gradients against weight decay), the
         * update shrinks towards that floor and a plain relative error measures the
         * cancellation, not the kernel (seed 0x914117a08bf992c3, n = 1, t = 5: update
         * 1.6e-6, error 1.6e-9 = 1.3 ulps of W). A wrong formula misses by the update's own
         * size, 1e3 times this bound and more. Reported as a ratio to the bound (< 1). */
        for (size_t i = 0; i < n; i++) {
            mterm[i] = fabs(rw[i]); /* the update's terms now: W's size */
        }
        const double ed = bounded_err(dgot, delta, mterm, n, 1e-4, 8.0);
        cr_expect_lt(ew, 1.0, "t %lld: W error / bound %g", (long long)t, ew);
        cr_expect_lt(em, 1.0, "t %lld: m error / bound %g", (long long)t, em);
        cr_expect_lt(ev, 1e-5, "t %lld: v rel err %g", (long long)t, ev);
        cr_expect_lt(ed, 1.0, "t %lld: update error / bound %g", (long long)t, ed);
        check_comm(w, comm, dt, n);
        for (size_t i = 0; i < n; i++) { /* continue from the reference */
            w[i] = (float)rw[i];
            m[i] = (float)rm[i];
            v[i] = (float)rv[i];
            rw[i] = w[i];
            rm[i] = m[i];
            rv[i] = v[i];
        }
    }
    free(w);
    free(m);
    free(v);
    free(g);
    free(comm);
    free(dgot);
    free(rw);
    free(rm);
    free(rv);
    free(delta);
    free(mterm);
    free(wterm);
}

Test(kernels_muon, adamw_errors)
{
    float w[4] = {1, 2, 3, 4}, m[4] = {0}, v[4] = {0}, g[4] = {1, 1, 1, 1};
    const mfsdp_adamw_hp_t hp = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f};
    mfsdp_adamw_hp_t bad;
    EXPECT_FAIL(mfsdp_cpu_adamw_update(NULL, m, v, g, NULL, MFSDP_FLOAT32, 4, 1, &hp),
                MFSDP_ERR_INVALID_ARG, "adamw: null pointer");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, 4, 1, NULL),
                MFSDP_ERR_INVALID_ARG, "adamw: null pointer");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, 0, 1, &hp),
                MFSDP_ERR_INVALID_ARG, "adamw: empty slice");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, 4, 0, &hp),
                MFSDP_ERR_INVALID_ARG, "step 0, steps count from 1");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, SIZE_MAX / 2, 1, &hp),
                MFSDP_ERR_OVERFLOW, "overflow");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, g, MFSDP_UINT8, 4, 1, &hp),
                MFSDP_ERR_INVALID_ARG, "unsupported dtype");
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, w + 1, v, g, NULL, MFSDP_FLOAT32, 4, 1, &hp),
                MFSDP_ERR_INVALID_ARG, "overlap");
    bad = hp;
    bad.beta1 = 1.0f;
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, 4, 1, &bad),
                MFSDP_ERR_INVALID_ARG, "bad hyper-parameters");
    bad = hp;
    bad.eps = -1.0f;
    EXPECT_FAIL(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, 4, 1, &bad),
                MFSDP_ERR_INVALID_ARG, "bad hyper-parameters");
    for (int i = 0; i < 4; i++) {
        cr_expect_eq(w[i], (float)(i + 1), "a failed update wrote W");
        cr_expect_eq(m[i], 0.0f);
        cr_expect_eq(v[i], 0.0f);
    }
}
