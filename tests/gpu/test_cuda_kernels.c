/* SPDX-License-Identifier: Apache-2.0 */
/*
 * GPU check of the CUDA kernels (include/mfsdp/kernels_cuda.h): every operation against
 * the CPU kernels (mfsdp_cpu_*) and/or float64 references, on freshly drawn random inputs
 * of odd shapes, outputs poisoned first; error statuses and their log messages; then
 * cuBLAS Newton-Schulz TFLOP/s against raw bf16 GEMMs of the same shapes.
 *
 * A plain executable (no Criterion): one line per check, then "N passed, N failed".
 * Exit status: 0 all passed, 1 a check failed, 77 no GPU (meson's "skip").
 *
 * Usage: test_cuda_kernels [--no-perf] [--perf-only] [--seed N]
 */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "tests/lib/ns_ref.h"
#include "mfsdp/kernels.h"
#include "mfsdp/kernels_cuda.h"

static int npass;
static int nfail;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%s ", ok ? "ok  " : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    if (ok) {
        npass++;
    } else {
        nfail++;
    }
}

/* Infrastructure failures (allocation, copies) end the run: they are not kernel results. */
#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t _e = (call);                                                                   \
        if (_e != cudaSuccess) {                                                                   \
            printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(_e));      \
            printf("%d passed, %d failed\n", npass, nfail + 1);                                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define OKST(call)                                                                                 \
    do {                                                                                           \
        mfsdp_status_t _st = (call);                                                               \
        if (_st != MFSDP_OK) {                                                                     \
            printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #call, mfsdp_status_string(_st));  \
            nfail++;                                                                               \
        }                                                                                          \
    } while (0)

/* ------------------------------------------------------------------ random */

static uint64_t rng_state;

static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(void) /* (0, 1) */
{
    return ((double)(rng_u64() >> 11) + 0.5) * 0x1p-53;
}

static float rng_normal(void)
{
    return (float)(sqrt(-2.0 * log(rng_unit())) * cos(6.283185307179586 * rng_unit()));
}

static void fill_normal(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = scale * rng_normal();
    }
}

/* ------------------------------------------------------------------ device */

static cudaStream_t stream;
static mfsdp_cuda_ctx_t *ctx;

static void *dalloc(size_t bytes)
{
    void *p = NULL;
    CU(cudaMalloc(&p, bytes));
    CU(cudaMemsetAsync(p, 0xff, bytes, stream)); /* poison: NaN for every float type */
    return p;
}

static void h2d(void *d, const void *h, size_t bytes)
{
    CU(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream));
    CU(cudaStreamSynchronize(stream));
}

static void d2h(void *h, const void *d, size_t bytes)
{
    CU(cudaStreamSynchronize(stream));
    CU(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, stream));
    CU(cudaStreamSynchronize(stream));
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        printf("FAIL host malloc of %zu bytes\n", bytes);
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------------ errors */

static char log_path[256];
static long log_pos;

static void log_mark(void)
{
    FILE *f = fopen(log_path, "r");
    log_pos = 0;
    if (f != NULL) {
        fseek(f, 0, SEEK_END);
        log_pos = ftell(f);
        fclose(f);
    }
}

/* 1 when the log written since log_mark() contains needle. */
static int log_has(const char *needle)
{
    char buf[8192];
    FILE *f = fopen(log_path, "r");
    if (f == NULL) {
        return 0;
    }
    fseek(f, log_pos, SEEK_SET);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

#define EXPECT_ERR(call, want, needle)                                                             \
    do {                                                                                           \
        log_mark();                                                                                \
        mfsdp_status_t _st = (call);                                                               \
        int _msg = log_has(needle);                                                                \
        check(_st == (want) && _msg, "error %s -> %s (want %s), log has \"%s\": %s", #call,        \
              mfsdp_status_string(_st), mfsdp_status_string(want), needle, _msg ? "yes" : "no");   \
    } while (0)

/* ------------------------------------------------------------------ metrics */

static double rel_err(const float *a, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)a[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static double rel_err_f(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static int has_nan(const float *a, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i])) {
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ casts */

static const uint32_t special_f32[] = {
    0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, /* +-0, +-inf */
    0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa5a5a5u, /* NaNs: quiet, signaling, payload */
    0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f807fffu, /* bf16 ties and near-ties */
    0x7f7fffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, /* max float; fp16 65504/65520 */
    0x00000001u, 0x00400000u, 0x33000000u, 0x33000001u, /* denormals; fp16 2^-25 */
    0x387fc000u, 0x38800000u, 0x3a001000u, 0xb3800000u, /* fp16 subnormal range */
};

static void test_cast_pair(mfsdp_dtype_t sd, mfsdp_dtype_t dd, size_t n, size_t misalign)
{
    const size_t ss = mfsdp_dtype_size(sd), ds = mfsdp_dtype_size(dd);
    uint8_t *src = xmalloc((n + misalign) * ss);
    uint8_t *want = xmalloc(n * ds);
    uint8_t *got = xmalloc(n * ds);
    /* Random bit patterns cover every class, specials are placed at random positions. */
    for (size_t i = 0; i < n + misalign; i++) {
        if (ss == 4) {
            uint32_t u = (uint32_t)rng_u64();
            if (i % 3 == 0) {
                float f = rng_normal() * (float)ldexp(1.0, (int)(rng_u64() % 40) - 20);
                memcpy(&u, &f, 4);
            }
            if (i % 5 == 1) {
                u = special_f32[rng_u64() % (sizeof(special_f32) / sizeof(special_f32[0]))];
            }
            memcpy(src + i * 4, &u, 4);
        } else {
            const uint16_t h = (uint16_t)rng_u64();
            memcpy(src + i * 2, &h, 2);
        }
    }
    OKST(mfsdp_cpu_cast(want, dd, src + misalign * ss, sd, n));
    void *dsrc = dalloc((n + misalign) * ss);
    void *ddst = dalloc((n + misalign) * ds);
    h2d(dsrc, src, (n + misalign) * ss);
    OKST(mfsdp_cuda_cast(ctx, (char *)ddst + misalign * ds, dd, (char *)dsrc + misalign * ss, sd,
                         n));
    d2h(got, (char *)ddst + misalign * ds, n * ds);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad += memcmp(got + i * ds, want + i * ds, ds) != 0;
    }
    check(bad == 0, "cast %s -> %s n=%zu misalign=%zu: %zu of %zu differ from mfsdp_cpu_cast",
          mfsdp_dtype_name(sd), mfsdp_dtype_name(dd), n, misalign, bad, n);
    CU(cudaFree(dsrc));
    CU(cudaFree(ddst));
    free(src);
    free(want);
    free(got);
}

static void test_casts(void)
{
    const mfsdp_dtype_t dt[3] = {MFSDP_FLOAT32, MFSDP_BFLOAT16, MFSDP_FLOAT16};
    const size_t ns[] = {1, 7, 8, 1000, 130 * 33, 1000 * 257 + 3};
    for (int a = 0; a < 3; a++) {
        for (int b = 0; b < 3; b++) {
            for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
                test_cast_pair(dt[a], dt[b], ns[i], 0);
            }
            test_cast_pair(dt[a], dt[b], 1003, 1); /* scalar path */
        }
    }
}

/* ------------------------------------------------------------------ reduce */

/* The documented order, written independently of both kernels (no contraction: C11). */
static void reduce_ref(float *out, float *const *srcf, int nsrc, size_t n, mfsdp_redop_t op,
                       float scalar, int accumulate)
{
    for (size_t i = 0; i < n; i++) {
        volatile float s = srcf[0][i];
        if (op == MFSDP_OP_PREMULSUM) {
            s = s * scalar;
        }
        for (int r = 1; r < nsrc; r++) {
            volatile float t = srcf[r][i];
            if (op == MFSDP_OP_PREMULSUM) {
                t = t * scalar;
            }
            s = s + t;
        }
        if (op == MFSDP_OP_AVG) {
            s = s / (float)nsrc;
        }
        out[i] = accumulate ? out[i] + s : s;
    }
}

static void test_reduce_case(mfsdp_dtype_t dt, int nsrc, size_t n, mfsdp_redop_t op, int accumulate)
{
    const size_t es = mfsdp_dtype_size(dt);
    void *hsrc[16];
    float *srcf[16];
    void *dsrc[16];
    const float scalar = 0.37f;
    for (int r = 0; r < nsrc; r++) {
        hsrc[r] = xmalloc(n * es);
        srcf[r] = xmalloc(n * sizeof(float));
        fill_normal(srcf[r], n, 3.0f);
        /* Round to the source dtype, then widen: the reference reads what the kernels read. */
        OKST(mfsdp_cpu_cast(hsrc[r], dt, srcf[r], MFSDP_FLOAT32, n));
        OKST(mfsdp_cpu_cast(srcf[r], MFSDP_FLOAT32, hsrc[r], dt, n));
        dsrc[r] = dalloc(n * es);
        h2d(dsrc[r], hsrc[r], n * es);
    }
    float *init = xmalloc(n * sizeof(float));
    fill_normal(init, n, 1.0f);
    float *ref = xmalloc(n * sizeof(float));
    float *cpu = xmalloc(n * sizeof(float));
    float *got = xmalloc(n * sizeof(float));
    memcpy(ref, init, n * sizeof(float));
    memcpy(cpu, init, n * sizeof(float));
    reduce_ref(ref, srcf, nsrc, n, op, scalar, accumulate);
    OKST(mfsdp_cpu_reduce_ordered(cpu, (const void *const *)hsrc, nsrc, dt, n, op, scalar,
                                  accumulate));
    float *dout = dalloc(n * sizeof(float)); /* poisoned */
    if (accumulate) {
        h2d(dout, init, n * sizeof(float));
    }
    OKST(mfsdp_cuda_reduce_ordered(ctx, dout, (const void *const *)dsrc, nsrc, dt, n, op, scalar,
                                   accumulate));
    d2h(got, dout, n * sizeof(float));
    const int bits_ref = memcmp(got, ref, n * sizeof(float)) == 0;
    const int bits_cpu = memcmp(got, cpu, n * sizeof(float)) == 0;
    static const char *opn[] = {"sum", "avg", "premulsum"};
    check(bits_ref && bits_cpu,
          "reduce %s nsrc=%d n=%zu op=%s acc=%d: bitwise = order reference %s, = cpu %s",
          mfsdp_dtype_name(dt), nsrc, n, opn[op], accumulate, bits_ref ? "yes" : "no",
          bits_cpu ? "yes" : "no");
    for (int r = 0; r < nsrc; r++) {
        free(hsrc[r]);
        free(srcf[r]);
        CU(cudaFree(dsrc[r]));
    }
    CU(cudaFree(dout));
    free(init);
    free(ref);
    free(cpu);
    free(got);
}

static void test_reduce(void)
{
    const mfsdp_dtype_t dt[3] = {MFSDP_FLOAT32, MFSDP_BFLOAT16, MFSDP_FLOAT16};
    const int nsrcs[] = {1, 2, 3, 8};
    const size_t ns[] = {1, 13, 4096 + 5};
    for (int d = 0; d < 3; d++) {
        for (size_t a = 0; a < 4; a++) {
            for (size_t b = 0; b < 3; b++) {
                for (int op = 0; op < 3; op++) {
                    test_reduce_case(dt[d], nsrcs[a], ns[b], (mfsdp_redop_t)op, (int)(b & 1));
                }
            }
        }
    }
    test_reduce_case(MFSDP_FLOAT32, 4, 1000 * 257 + 1, MFSDP_OP_AVG, 1);
}

/* ------------------------------------------------------------------ AdamW */

static void test_adamw_case(size_t n, int t, float wd, mfsdp_dtype_t cd, int with_comm)
{
    const mfsdp_adamw_hp_t hp = {
        .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = wd};
    const size_t nb = n * sizeof(float);
    float *w = xmalloc(nb), *m = xmalloc(nb), *v = xmalloc(nb), *g = xmalloc(nb);
    fill_normal(w, n, 1.0f);
    fill_normal(m, n, 0.01f);
    fill_normal(g, n, 0.1f);
    for (size_t i = 0; i < n; i++) {
        v[i] = fabsf(rng_normal()) * 1e-3f;
    }
    /* float64 reference */
    double *rw = xmalloc(n * sizeof(double)), *rm = xmalloc(n * sizeof(double));
    double *rv = xmalloc(n * sizeof(double));
    const double bc1 = 1.0 - pow(0.9f, t), bc2 = 1.0 - pow(0.95f, t);
    for (size_t i = 0; i < n; i++) {
        rm[i] = (double)hp.beta1 * m[i] + (1.0 - (double)hp.beta1) * g[i];
        rv[i] = (double)hp.beta2 * v[i] + (1.0 - (double)hp.beta2) * (double)g[i] * g[i];
        rw[i] = (double)w[i] * (1.0 - (double)hp.lr * wd) -
                (double)hp.lr * (rm[i] / bc1) / (sqrt(rv[i] / bc2) + (double)hp.eps);
    }
    float *dw = dalloc(nb), *dm = dalloc(nb), *dv = dalloc(nb), *dg = dalloc(nb);
    h2d(dw, w, nb);
    h2d(dm, m, nb);
    h2d(dv, v, nb);
    h2d(dg, g, nb);
    const size_t cs = mfsdp_dtype_size(cd);
    void *dc = with_comm ? dalloc(n * cs) : NULL;
    void *cpu_c = xmalloc(n * cs);
    OKST(mfsdp_cpu_adamw_update(w, m, v, g, with_comm ? cpu_c : NULL, cd, n, t, &hp));
    OKST(mfsdp_cuda_adamw_update(ctx, dw, dm, dv, dg, dc, cd, n, t, &hp));
    float *gw = xmalloc(nb), *gm = xmalloc(nb), *gv = xmalloc(nb);
    d2h(gw, dw, nb);
    d2h(gm, dm, nb);
    d2h(gv, dv, nb);
    const double e_w = rel_err(gw, rw, n), e_m = rel_err(gm, rm, n), e_v = rel_err(gv, rv, n);
    const double c_w = rel_err_f(gw, w, n), c_m = rel_err_f(gm, m, n), c_v = rel_err_f(gv, v, n);
    check(e_w < 1e-5 && e_m < 1e-5 && e_v < 1e-5 && c_w < 1e-5 && c_m < 1e-5 && c_v < 1e-5,
          "adamw n=%zu t=%d wd=%g: rel err vs float64 w %.2e m %.2e v %.2e, vs cpu w %.2e m "
          "%.2e v %.2e (< 1e-5)",
          n, t, (double)wd, e_w, e_m, e_v, c_w, c_m, c_v);
    if (with_comm) {
        void *want = xmalloc(n * cs), *got = xmalloc(n * cs);
        OKST(mfsdp_cpu_cast(want, cd, gw, MFSDP_FLOAT32, n));
        d2h(got, dc, n * cs);
        check(memcmp(want, got, n * cs) == 0, "adamw n=%zu w_comm %s bit-exact cast of w", n,
              mfsdp_dtype_name(cd));
        free(want);
        free(got);
        CU(cudaFree(dc));
    }
    CU(cudaFree(dw));
    CU(cudaFree(dm));
    CU(cudaFree(dv));
    CU(cudaFree(dg));
    free(w), free(m), free(v), free(g), free(rw), free(rm), free(rv), free(gw), free(gm);
    free(gv), free(cpu_c);
}

static void test_adamw(void)
{
    test_adamw_case(1, 1, 0.0f, MFSDP_FLOAT32, 0);
    test_adamw_case(15, 1, 0.1f, MFSDP_BFLOAT16, 1);
    test_adamw_case(130 * 33, 10, 0.0f, MFSDP_FLOAT16, 1);
    test_adamw_case(1000 * 257 + 3, 3, 0.01f, MFSDP_BFLOAT16, 1);
    test_adamw_case(64 * 7, 1000, 0.0f, MFSDP_FLOAT32, 1);
}

/* ------------------------------------------------------------------ sqnorm */

static void test_sqnorm_case(size_t n)
{
    float *x = xmalloc(n * sizeof(float));
    fill_normal(x, n, 2.0f);
    double ref = 1.5, cpu = 1.5;
    for (size_t i = 0; i < n; i++) {
        ref += (double)x[i] * x[i];
    }
    OKST(mfsdp_cpu_sqnorm_accumulate(x, n, &cpu));
    float *dx = dalloc((n + 1) * sizeof(float));
    double *dacc = dalloc(2 * sizeof(double));
    void *ws = dalloc(mfsdp_cuda_sqnorm_workspace_bytes());
    const double init[2] = {1.5, 1.5};
    h2d(dacc, init, sizeof(init));
    h2d(dx, x, n * sizeof(float));
    OKST(mfsdp_cuda_sqnorm_accumulate(ctx, dx, n, &dacc[0], ws,
                                      mfsdp_cuda_sqnorm_workspace_bytes()));
    /* Same values at another alignment (scalar path): the fixed shape gives the same bits. */
    h2d(dx + 1, x, n * sizeof(float));
    OKST(mfsdp_cuda_sqnorm_accumulate(ctx, dx + 1, n, &dacc[1], ws,
                                      mfsdp_cuda_sqnorm_workspace_bytes()));
    double got[2];
    d2h(got, dacc, sizeof(got));
    const double e = fabs(got[0] - ref) / ref, ec = fabs(got[0] - cpu) / cpu;
    check(e < 1e-12 && ec < 1e-12 && memcmp(&got[0], &got[1], sizeof(double)) == 0,
          "sqnorm n=%zu: rel err vs float64 %.2e, vs cpu %.2e (< 1e-12); aligned == misaligned "
          "bits: %s",
          n, e, ec, memcmp(&got[0], &got[1], sizeof(double)) == 0 ? "yes" : "no");
    CU(cudaFree(dx));
    CU(cudaFree(dacc));
    CU(cudaFree(ws));
    free(x);
}

static void test_sqnorm(void)
{
    const size_t ns[] = {1, 7, 3 * 5, 1000 * 257, (1u << 20) + 3};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        test_sqnorm_case(ns[i]);
    }
}

/* ------------------------------------------------------------------ pack */

static void test_pack_case(int world, int64_t rows, size_t rcols, size_t esz, size_t before,
                           size_t after)
{
    mfsdp_strided_geom_t g;
    g.world = world;
    g.rows = rows;
    g.rows_per_rank = (rows + world - 1) / world;
    g.row_bytes = rcols * esz;
    g.offset = before * esz;
    const size_t piece = (size_t)g.rows_per_rank * g.row_bytes;
    g.rank_stride = g.offset + piece + after * esz;
    const size_t total = (size_t)world * g.rank_stride, fb = (size_t)rows * g.row_bytes;
    uint8_t *buf = xmalloc(total), *full = xmalloc(fb), *want = xmalloc(fb);
    uint8_t *got = xmalloc(fb), *cpu = xmalloc(fb);
    for (size_t i = 0; i < total; i++) {
        buf[i] = (uint8_t)rng_u64();
    }
    for (size_t i = 0; i < fb; i++) {
        full[i] = (uint8_t)rng_u64();
    }
    /* Independent reference of the layout (docs/design.md, "FSDP2's byte layout"). */
    for (int r = 0; r < world; r++) {
        int64_t real = rows - (int64_t)r * g.rows_per_rank;
        real = real < 0 ? 0 : real > g.rows_per_rank ? g.rows_per_rank : real;
        memcpy(want + (size_t)r * piece, buf + (size_t)r * g.rank_stride + g.offset,
               (size_t)real * g.row_bytes);
    }
    OKST(mfsdp_cpu_pack(cpu, buf, &g));
    uint8_t *dbuf = dalloc(total), *dfull = dalloc(fb);
    h2d(dbuf, buf, total);
    OKST(mfsdp_cuda_pack(ctx, dfull, dbuf, &g));
    d2h(got, dfull, fb);
    check(memcmp(got, want, fb) == 0 && memcmp(got, cpu, fb) == 0,
          "pack world=%d rows=%lld row=%zu B offset=%zu stride=%zu: = reference %s, = cpu %s",
          world, (long long)rows, g.row_bytes, g.offset, g.rank_stride,
          memcmp(got, want, fb) == 0 ? "yes" : "no", memcmp(got, cpu, fb) == 0 ? "yes" : "no");

    /* Unpack into a buffer of 0xab bytes: other params' bytes must stay 0xab. */
    uint8_t *uwant = xmalloc(total), *ucpu = xmalloc(total), *ugot = xmalloc(total);
    memset(uwant, 0xab, total);
    memset(ucpu, 0xab, total);
    for (int r = 0; r < world; r++) {
        int64_t real = rows - (int64_t)r * g.rows_per_rank;
        real = real < 0 ? 0 : real > g.rows_per_rank ? g.rows_per_rank : real;
        uint8_t *p = uwant + (size_t)r * g.rank_stride + g.offset;
        memcpy(p, full + (size_t)r * piece, (size_t)real * g.row_bytes);
        memset(p + (size_t)real * g.row_bytes, 0, piece - (size_t)real * g.row_bytes);
    }
    OKST(mfsdp_cpu_unpack(ucpu, full, &g));
    CU(cudaMemsetAsync(dbuf, 0xab, total, stream));
    h2d(dfull, full, fb);
    OKST(mfsdp_cuda_unpack(ctx, dbuf, dfull, &g));
    d2h(ugot, dbuf, total);
    check(memcmp(ugot, uwant, total) == 0 && memcmp(ugot, ucpu, total) == 0,
          "unpack world=%d rows=%lld row=%zu B offset=%zu stride=%zu: = reference %s, = cpu %s",
          world, (long long)rows, g.row_bytes, g.offset, g.rank_stride,
          memcmp(ugot, uwant, total) == 0 ? "yes" : "no",
          memcmp(ugot, ucpu, total) == 0 ? "yes" : "no");
    CU(cudaFree(dbuf));
    CU(cudaFree(dfull));
    free(buf), free(full), free(want), free(got), free(cpu), free(uwant), free(ucpu), free(ugot);
}

static void test_pack(void)
{
    test_pack_case(1, 1, 1, 4, 0, 0);
    test_pack_case(2, 3, 5, 4, 7, 3);
    test_pack_case(4, 7, 64, 2, 0, 11);
    test_pack_case(4, 130, 33, 4, 130, 0);
    test_pack_case(3, 64, 7, 2, 5, 5);
    test_pack_case(8, 5, 9, 1, 3, 1); /* uint8 group: ranks 5..7 are all padding */
    test_pack_case(3, 1000, 257, 4, 1000, 77);
    test_pack_case(8, 1000, 257, 2, 1, 0);
}

/* ------------------------------------------------------------------ Newton-Schulz */

/* float64 Newton-Schulz of the fp32 input (tests/lib/ns_ref.h). */
static void ns_ref(const float *x, int64_t m, int64_t k, int steps, double *out)
{
    for (int64_t i = 0; i < m * k; i++) {
        out[i] = x[i];
    }
    ns_ref_f64(out, m, k, steps, out);
}

/*
 * The bf16 band. The issue asks for a relative error between 1e-3 and 2e-2 against the
 * fp32/float64 reference. Host emulation of this bf16 iteration on Gaussian inputs gives a
 * mean of 1.3-1.7e-2 per matrix with single draws up to 2.1e-2 (3.5e-2 for 3x5), so a
 * per-matrix 2e-2 bound would flake. Each matrix therefore gets a ceiling of 5e-2 (any
 * layout or coefficient bug is O(1)) and at least 1e-3 when it has 64+ elements (bf16 really
 * used; a tiny matrix can land near bf16 values by chance), and the band is checked
 * on the aggregate relative error over every matrix of the run (agg_check()).
 */
#define NS_CEIL 5e-2

static double agg_num[2], agg_den[2]; /* 0: NS vs float64; 1: Muon update vs cpu fp32 */

static void agg_add(int which, const float *a, const double *ref, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const double d = (double)a[i] - ref[i];
        agg_num[which] += d * d;
        agg_den[which] += ref[i] * ref[i];
    }
}

static int bf16_band(double e, size_t n)
{
    return e < NS_CEIL && (n < 64 || e >= 1e-3);
}

static void agg_check(void)
{
    static const char *what[2] = {"newton-schulz bf16 vs float64",
                                  "muon update (W - W0) bf16 vs cpu fp32"};
    for (int i = 0; i < 2; i++) {
        const double e = agg_den[i] > 0.0 ? sqrt(agg_num[i] / agg_den[i]) : -1.0;
        check(e >= 1e-3 && e < 2e-2,
              "%s: aggregate rel err over all matrices %.3e (issue "
              "band [1e-3, 2e-2])",
              what[i], e);
    }
}

static void test_ns_shape(int64_t m, int64_t k, int steps)
{
    const size_t n = (size_t)(m * k);
    float *x = xmalloc(n * sizeof(float)), *got = xmalloc(n * sizeof(float));
    float *again = xmalloc(n * sizeof(float)), *cpu = xmalloc(n * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    fill_normal(x, n, 1.0f);
    ns_ref(x, m, k, steps, ref);
    memcpy(cpu, x, n * sizeof(float));
    const size_t cws_n = mfsdp_ns_workspace_elems(m, k);
    float *cws = xmalloc(cws_n * sizeof(float));
    OKST(mfsdp_cpu_newton_schulz(cpu, m, k, steps, cws, cws_n));
    const size_t wsb = mfsdp_cuda_ns_workspace_bytes(m, k);
    void *ws = dalloc(wsb);
    float *dx = dalloc(n * sizeof(float));
    h2d(dx, x, n * sizeof(float));
    OKST(mfsdp_cuda_newton_schulz(ctx, dx, m, k, steps, ws, wsb));
    d2h(got, dx, n * sizeof(float));
    h2d(dx, x, n * sizeof(float));
    CU(cudaMemsetAsync(ws, 0xff, wsb, stream)); /* a stale workspace must not matter */
    OKST(mfsdp_cuda_newton_schulz(ctx, dx, m, k, steps, ws, wsb));
    d2h(again, dx, n * sizeof(float));
    const double e = rel_err(got, ref, n), ec = rel_err_f(got, cpu, n);
    if (steps > 0) {
        agg_add(0, got, ref, n);
    }
    check(!has_nan(got, n) && bf16_band(e, n) && ec < NS_CEIL,
          "newton-schulz %lldx%lld steps=%d: bf16 rel err vs float64 %.2e, vs cpu fp32 %.2e "
          "(per matrix: < 5e-2%s)",
          (long long)m, (long long)k, steps, e, ec, n < 64 ? "" : ", >= 1e-3");
    check(memcmp(got, again, n * sizeof(float)) == 0,
          "newton-schulz %lldx%lld: two runs bitwise equal", (long long)m, (long long)k);
    CU(cudaFree(ws));
    CU(cudaFree(dx));
    free(x), free(got), free(again), free(cpu), free(ref), free(cws);
}

static void test_ns_batched(size_t batch, int64_t m, int64_t k)
{
    const size_t n = (size_t)(m * k), tot = batch * n;
    float *x = xmalloc(tot * sizeof(float)), *got = xmalloc(tot * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    fill_normal(x, tot, 1.0f);
    const size_t wsb = mfsdp_cuda_ns_batched_workspace_bytes(batch, m, k);
    void *ws = dalloc(wsb);
    float *dx = dalloc(tot * sizeof(float));
    h2d(dx, x, tot * sizeof(float));
    OKST(mfsdp_cuda_newton_schulz_batched(ctx, dx, batch, m, k, 5, ws, wsb));
    d2h(got, dx, tot * sizeof(float));
    double worst = 0.0;
    int ok = !has_nan(got, tot);
    for (size_t b = 0; b < batch; b++) {
        ns_ref(x + b * n, m, k, 5, ref);
        const double e = rel_err(got + b * n, ref, n);
        agg_add(0, got + b * n, ref, n);
        ok = ok && bf16_band(e, n);
        worst = e > worst ? e : worst;
    }
    check(ok, "newton-schulz batched %zu x %lldx%lld: worst rel err vs float64 %.2e", batch,
          (long long)m, (long long)k, worst);
    CU(cudaFree(ws));
    CU(cudaFree(dx));
    free(x), free(got), free(ref);
}

static void test_ns_split(int64_t k, size_t nsplit, const int64_t *split)
{
    int64_t m = 0;
    for (size_t i = 0; i < nsplit; i++) {
        m += split[i];
    }
    const size_t n = (size_t)(m * k);
    float *x = xmalloc(n * sizeof(float)), *got = xmalloc(n * sizeof(float));
    double *ref = xmalloc(n * sizeof(double));
    fill_normal(x, n, 1.0f);
    int64_t row = 0;
    for (size_t i = 0; i < nsplit; i++) {
        ns_ref(x + row * k, split[i], k, 5, ref + row * k);
        row += split[i];
    }
    int64_t hmax = 0;
    for (size_t i = 0; i < nsplit; i++) {
        hmax = split[i] > hmax ? split[i] : hmax;
    }
    const size_t wsb = mfsdp_cuda_ns_workspace_bytes(hmax, k);
    void *ws = dalloc(wsb);
    float *dx = dalloc(n * sizeof(float));
    h2d(dx, x, n * sizeof(float));
    OKST(mfsdp_cuda_newton_schulz_split(ctx, dx, m, k, nsplit, split, 5, ws, wsb));
    d2h(got, dx, n * sizeof(float));
    const double e = rel_err(got, ref, n);
    agg_add(0, got, ref, n);
    check(!has_nan(got, n) && bf16_band(e, n),
          "newton-schulz split %lldx%lld into %zu blocks (tallest %lld, its workspace): rel err "
          "vs float64 per block %.2e",
          (long long)m, (long long)k, nsplit, (long long)hmax, e);
    CU(cudaFree(ws));
    CU(cudaFree(dx));
    free(x), free(got), free(ref);
}

static void test_newton_schulz(void)
{
    static const int64_t shapes[][2] = {{1, 1}, {3, 5}, {7, 64}, {130, 33}, {64, 7}, {1000, 257}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        test_ns_shape(shapes[i][0], shapes[i][1], 5);
    }
    test_ns_shape(130, 33, 0);
    test_ns_shape(33, 130, 3);
    test_ns_batched(3, 130, 33);
    test_ns_batched(4, 7, 64);
    test_ns_batched(5, 33, 130);
    const int64_t qkv[3] = {32, 64, 32};
    test_ns_split(40, 3, qkv);
    const int64_t heads[4] = {16, 16, 16, 16};
    test_ns_split(96, 4, heads);
}

/* ------------------------------------------------------------------ Muon */

static void test_muon_case(int64_t m, int64_t k, size_t nsplit, const int64_t *split, int nesterov,
                           mfsdp_scale_t scale, float wd, mfsdp_dtype_t cd, int with_comm)
{
    const size_t n = (size_t)(m * k), nb = n * sizeof(float);
    const mfsdp_muon_hp_t hp = {.lr = 0.02f,
                                .momentum = 0.95f,
                                .weight_decay = wd,
                                .nesterov = nesterov,
                                .ns_steps = 5,
                                .scale = scale};
    float *w = xmalloc(nb), *mom = xmalloc(nb), *g = xmalloc(nb), *w0 = xmalloc(nb);
    float *mom0 = xmalloc(nb);
    fill_normal(w, n, 0.5f);
    fill_normal(mom, n, 0.01f);
    fill_normal(g, n, 0.1f);
    memcpy(w0, w, nb);
    memcpy(mom0, mom, nb);
    float *dw = dalloc(nb), *dm = dalloc(nb), *dg = dalloc(nb);
    h2d(dw, w, nb);
    h2d(dm, mom, nb);
    h2d(dg, g, nb);
    const size_t cs = mfsdp_dtype_size(cd);
    void *dc = with_comm ? dalloc(n * cs) : NULL;
    const size_t wsb = mfsdp_cuda_muon_workspace_bytes(m, k);
    void *ws = dalloc(wsb);
    const size_t cws_n = mfsdp_muon_workspace_elems(m, k);
    float *cws = xmalloc(cws_n * sizeof(float));
    OKST(mfsdp_cpu_muon_update(w, mom, g, NULL, cd, m, k, nsplit, split, &hp, cws, cws_n));
    OKST(mfsdp_cuda_muon_update(ctx, dw, dm, dg, dc, cd, m, k, nsplit, split, &hp, ws, wsb));
    float *gw = xmalloc(nb), *gm = xmalloc(nb);
    d2h(gw, dw, nb);
    d2h(gm, dm, nb);
    /* momentum: fp32 element-wise; update: the bf16 band on W - W0 against the fp32 CPU */
    double *dref = xmalloc(n * sizeof(double));
    float *dgot = xmalloc(nb);
    for (size_t i = 0; i < n; i++) {
        dref[i] = (double)w[i] - (double)w0[i];
        dgot[i] = (float)((double)gw[i] - (double)w0[i]);
    }
    const double em = rel_err_f(gm, mom, n), ed = rel_err(dgot, dref, n);
    /* With weight decay the exact decay term dilutes the bf16 error: ceiling only. */
    const int band = wd == 0.0f ? bf16_band(ed, n) : ed < NS_CEIL;
    if (wd == 0.0f) {
        agg_add(1, dgot, dref, n);
    }
    static const char *sc[] = {"keller", "moonlight"};
    check(!has_nan(gw, n) && em < 1e-5 && band,
          "muon %lldx%lld split=%zu nesterov=%d %s wd=%g: momentum rel err %.2e (< 1e-5), "
          "update W-W0 rel err vs cpu fp32 %.2e (bf16 band)",
          (long long)m, (long long)k, nsplit, nesterov, sc[scale], (double)wd, em, ed);
    if (with_comm) {
        void *want = xmalloc(n * cs), *got = xmalloc(n * cs);
        OKST(mfsdp_cpu_cast(want, cd, gw, MFSDP_FLOAT32, n));
        d2h(got, dc, n * cs);
        check(memcmp(want, got, n * cs) == 0, "muon %lldx%lld w_comm %s bit-exact cast of w",
              (long long)m, (long long)k, mfsdp_dtype_name(cd));
        free(want);
        free(got);
        CU(cudaFree(dc));
    }
    CU(cudaFree(dw));
    CU(cudaFree(dm));
    CU(cudaFree(dg));
    CU(cudaFree(ws));
    free(w), free(mom), free(g), free(w0), free(mom0), free(cws), free(gw), free(gm);
    free(dref), free(dgot);
}

static void test_muon(void)
{
    test_muon_case(3, 5, 0, NULL, 1, MFSDP_SCALE_KELLER, 0.0f, MFSDP_BFLOAT16, 1);
    test_muon_case(130, 33, 0, NULL, 1, MFSDP_SCALE_KELLER, 0.0f, MFSDP_BFLOAT16, 1);
    test_muon_case(64, 7, 0, NULL, 0, MFSDP_SCALE_MOONLIGHT, 0.1f, MFSDP_FLOAT32, 1);
    test_muon_case(7, 64, 0, NULL, 1, MFSDP_SCALE_MOONLIGHT, 0.0f, MFSDP_FLOAT16, 1);
    test_muon_case(1000, 257, 0, NULL, 1, MFSDP_SCALE_KELLER, 0.0f, MFSDP_BFLOAT16, 0);
    test_muon_case(257, 1000, 0, NULL, 0, MFSDP_SCALE_KELLER, 0.01f, MFSDP_FLOAT16, 1);
    const int64_t qkv[3] = {32, 64, 32};
    test_muon_case(128, 40, 3, qkv, 1, MFSDP_SCALE_KELLER, 0.0f, MFSDP_BFLOAT16, 1);
}

/* ------------------------------------------------------------------ errors */

static void test_errors(void)
{
    const size_t wsb = mfsdp_cuda_ns_workspace_bytes(64, 32);
    void *ws = dalloc(wsb + 512);
    float *x = dalloc(64 * 32 * sizeof(float));
    float *y = dalloc(64 * 32 * sizeof(float));
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, NULL, 64, 32, 5, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "x != NULL");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, 0, 32, 5, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "m > 0 && k > 0");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, 64, -3, 5, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "m > 0 && k > 0");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, 64, 32, -1, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "steps >= 0");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, INT64_C(1) << 40, INT64_C(1) << 40, 5, ws, wsb),
               MFSDP_ERR_OVERFLOW, "workspace size overflows");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, INT32_C(2000000000), 2, 5, ws, wsb),
               MFSDP_ERR_MISMATCH, "workspace too small");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, 64, 32, 5, ws, wsb - 1), MFSDP_ERR_MISMATCH,
               "workspace too small");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, x, 64, 32, 5, (char *)ws + 16, wsb),
               MFSDP_ERR_INVALID_ARG, "256-byte aligned");
    EXPECT_ERR(mfsdp_cuda_newton_schulz_batched(ctx, x, 0, 8, 8, 5, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "batch > 0");
    const int64_t bad_split[2] = {30, 30};
    EXPECT_ERR(mfsdp_cuda_newton_schulz_split(ctx, x, 64, 32, 2, bad_split, 5, ws, wsb),
               MFSDP_ERR_INVALID_ARG, "row split sums to 60");
    const int64_t neg_split[2] = {70, -6};
    EXPECT_ERR(mfsdp_cuda_newton_schulz_split(ctx, x, 64, 32, 2, neg_split, 5, ws, wsb),
               MFSDP_ERR_INVALID_ARG, "row split 0 is 70");

    mfsdp_muon_hp_t hp = {.lr = 0.02f,
                          .momentum = 0.95f,
                          .weight_decay = 0.0f,
                          .nesterov = 1,
                          .ns_steps = 5,
                          .scale = MFSDP_SCALE_KELLER};
    EXPECT_ERR(
        mfsdp_cuda_muon_update(ctx, x, y, x, NULL, MFSDP_FLOAT32, 64, 32, 0, NULL, NULL, ws, wsb),
        MFSDP_ERR_INVALID_ARG, "hp != NULL");
    hp.scale = (mfsdp_scale_t)7;
    EXPECT_ERR(
        mfsdp_cuda_muon_update(ctx, x, y, x, NULL, MFSDP_FLOAT32, 64, 32, 0, NULL, &hp, ws, wsb),
        MFSDP_ERR_INVALID_ARG, "unknown scale rule 7");
    hp.scale = MFSDP_SCALE_KELLER;
    EXPECT_ERR(mfsdp_cuda_muon_update(ctx, x, y, x, y, MFSDP_UINT8, 64, 32, 0, NULL, &hp, ws, wsb),
               MFSDP_ERR_INVALID_ARG, "comm dtype must be");
    EXPECT_ERR(
        mfsdp_cuda_muon_update(ctx, x, y, x, NULL, MFSDP_FLOAT32, 64, 32, 0, NULL, &hp, ws, 1024),
        MFSDP_ERR_MISMATCH, "muon: workspace too small");

    mfsdp_adamw_hp_t ahp = {
        .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f};
    EXPECT_ERR(mfsdp_cuda_adamw_update(ctx, x, y, x, y, NULL, MFSDP_FLOAT32, 16, 0, &ahp),
               MFSDP_ERR_INVALID_ARG, "t >= 1");
    ahp.beta2 = 1.0f;
    EXPECT_ERR(mfsdp_cuda_adamw_update(ctx, x, y, x, y, NULL, MFSDP_FLOAT32, 16, 1, &ahp),
               MFSDP_ERR_INVALID_ARG, "bad hyper-parameters");
    ahp.beta2 = 0.95f;
    EXPECT_ERR(mfsdp_cuda_adamw_update(ctx, x, y, x, y, NULL, MFSDP_FLOAT32, SIZE_MAX / 2, 1, &ahp),
               MFSDP_ERR_OVERFLOW, "overflows size_t");

    const void *srcs[2] = {x, NULL};
    EXPECT_ERR(mfsdp_cuda_reduce_ordered(ctx, y, srcs, 2, MFSDP_FLOAT32, 16, MFSDP_OP_SUM, 1.0f, 0),
               MFSDP_ERR_INVALID_ARG, "reduce source 1 is null");
    EXPECT_ERR(mfsdp_cuda_reduce_ordered(ctx, y, srcs, 0, MFSDP_FLOAT32, 16, MFSDP_OP_SUM, 1.0f, 0),
               MFSDP_ERR_INVALID_ARG, "nsrc > 0");
    EXPECT_ERR(mfsdp_cuda_reduce_ordered(ctx, y, srcs, MFSDP_CUDA_REDUCE_MAX_SRC + 1, MFSDP_FLOAT32,
                                         16, MFSDP_OP_SUM, 1.0f, 0),
               MFSDP_ERR_UNSUPPORTED, "at most 1024");
    EXPECT_ERR(mfsdp_cuda_reduce_ordered(ctx, y, srcs, 1, MFSDP_UINT8, 16, MFSDP_OP_SUM, 1.0f, 0),
               MFSDP_ERR_INVALID_ARG, "reduce sources must be");
    EXPECT_ERR(
        mfsdp_cuda_reduce_ordered(ctx, y, srcs, 1, MFSDP_FLOAT32, 16, (mfsdp_redop_t)9, 1.0f, 0),
        MFSDP_ERR_INVALID_ARG, "MFSDP_OP_PREMULSUM");

    EXPECT_ERR(mfsdp_cuda_cast(ctx, y, MFSDP_UINT8, x, MFSDP_FLOAT32, 16), MFSDP_ERR_INVALID_ARG,
               "cast supports");
    EXPECT_ERR(mfsdp_cuda_cast(ctx, (char *)x + 8, MFSDP_BFLOAT16, x, MFSDP_FLOAT32, 16),
               MFSDP_ERR_INVALID_ARG, "cast: source and destination overlap");
    EXPECT_ERR(mfsdp_cuda_adamw_update(ctx, x, x + 8, y, y + 32, NULL, MFSDP_FLOAT32, 16, 1, &ahp),
               MFSDP_ERR_INVALID_ARG, "adamw: weights, moments or comm copy overlap");
    EXPECT_ERR(mfsdp_cuda_newton_schulz(ctx, (float *)ws, 8, 8, 5, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "matrix and workspace overlap");
    EXPECT_ERR(
        mfsdp_cuda_muon_update(ctx, x, x, y, NULL, MFSDP_FLOAT32, 8, 8, 0, NULL, &hp, ws, wsb),
        MFSDP_ERR_INVALID_ARG, "muon: workspace, weights, momentum");
    EXPECT_ERR(mfsdp_cuda_cast(ctx, y, MFSDP_BFLOAT16, x, MFSDP_FLOAT32, 0), MFSDP_ERR_INVALID_ARG,
               "n > 0");
    EXPECT_ERR(mfsdp_cuda_cast(ctx, y, MFSDP_BFLOAT16, x, MFSDP_FLOAT32, SIZE_MAX / 2),
               MFSDP_ERR_OVERFLOW, "overflows size_t");

    mfsdp_strided_geom_t g = {
        .world = 4, .rows = 10, .rows_per_rank = 2, .row_bytes = 8, .rank_stride = 64, .offset = 0};
    EXPECT_ERR(mfsdp_cuda_pack(ctx, y, x, &g), MFSDP_ERR_INVALID_ARG, "is not ceil(10 / 4)");
    g.rows_per_rank = 3;
    g.offset = 48;
    EXPECT_ERR(mfsdp_cuda_unpack(ctx, x, y, &g), MFSDP_ERR_INVALID_ARG, "exceeds the rank stride");
    g.offset = 0;
    g.rank_stride = SIZE_MAX / 2;
    EXPECT_ERR(mfsdp_cuda_pack(ctx, y, x, &g), MFSDP_ERR_OVERFLOW, "overflows size_t");
    EXPECT_ERR(mfsdp_cuda_pack(ctx, y, x, NULL), MFSDP_ERR_INVALID_ARG, "g != NULL");

    double *acc = dalloc(sizeof(double));
    EXPECT_ERR(mfsdp_cuda_sqnorm_accumulate(ctx, x, 16, acc, ws, 8), MFSDP_ERR_MISMATCH,
               "sqnorm workspace too small");
    EXPECT_ERR(mfsdp_cuda_sqnorm_accumulate(ctx, x, 16, NULL, ws, wsb), MFSDP_ERR_INVALID_ARG,
               "acc != NULL");
    CU(cudaStreamSynchronize(stream));
    CU(cudaFree(acc));
    CU(cudaFree(ws));
    CU(cudaFree(x));
    CU(cudaFree(y));
}

/* Checks that need no device: run in both modes. */
static void test_host_only(void)
{
    check(mfsdp_cuda_ns_workspace_bytes(0, 5) == 0 && mfsdp_cuda_ns_workspace_bytes(5, -1) == 0,
          "ns workspace query: 0 for bad dims");
    check(mfsdp_cuda_ns_workspace_bytes(INT64_C(1) << 40, INT64_C(1) << 40) == 0 &&
              mfsdp_cuda_ns_batched_workspace_bytes(MFSDP_CUDA_NS_MAX_BATCH + 1, 4, 4) == 0,
          "ns workspace query: 0 on overflow and past the batch limit");
    const size_t w1 = mfsdp_cuda_ns_workspace_bytes(130, 33);
    check(w1 >= 2 * (2 * 130 * 33 + 2 * 33 * 33) && mfsdp_cuda_ns_workspace_bytes(33, 130) == w1 &&
              mfsdp_cuda_muon_workspace_bytes(130, 33) == w1,
          "ns workspace query: %zu bytes for 130x33, symmetric, = muon", w1);
    check(mfsdp_cuda_sqnorm_workspace_bytes() > 0, "sqnorm workspace query: %zu bytes",
          mfsdp_cuda_sqnorm_workspace_bytes());
    float dummy[4];
    EXPECT_ERR(mfsdp_cuda_newton_schulz(NULL, dummy, 2, 2, 5, dummy, 16), MFSDP_ERR_INVALID_ARG,
               "ctx != NULL");
    EXPECT_ERR(mfsdp_cuda_cast(NULL, dummy, MFSDP_BFLOAT16, dummy, MFSDP_FLOAT32, 4),
               MFSDP_ERR_INVALID_ARG, "ctx != NULL");
    EXPECT_ERR(mfsdp_cuda_ctx_create(NULL, NULL), MFSDP_ERR_INVALID_ARG, "ctx_p != NULL");
    check(mfsdp_cuda_ctx_destroy(NULL) == MFSDP_OK, "ctx_destroy(NULL) is a no-op");
}

/* ------------------------------------------------------------------ references */

/*
 * The references of this file against the CPU kernels, on the host: a wrong reference
 * would otherwise only show up on a GPU machine, where time is short. Runs with and
 * without a GPU.
 */
static void test_references_on_cpu(void)
{
    /* reduce_ref == mfsdp_cpu_reduce_ordered, bit for bit */
    {
        const size_t n = 1001;
        float *srcf[3], *a = xmalloc(n * sizeof(float)), *b = xmalloc(n * sizeof(float));
        for (int r = 0; r < 3; r++) {
            srcf[r] = xmalloc(n * sizeof(float));
            fill_normal(srcf[r], n, 2.0f);
        }
        int same = 1;
        for (int op = 0; op < 3; op++) {
            fill_normal(a, n, 1.0f);
            memcpy(b, a, n * sizeof(float));
            reduce_ref(a, srcf, 3, n, (mfsdp_redop_t)op, 0.37f, op == 1);
            OKST(mfsdp_cpu_reduce_ordered(b, (const void *const *)srcf, 3, MFSDP_FLOAT32, n,
                                          (mfsdp_redop_t)op, 0.37f, op == 1));
            same = same && memcmp(a, b, n * sizeof(float)) == 0;
        }
        check(same, "host: reduce order reference == mfsdp_cpu_reduce_ordered bitwise");
        for (int r = 0; r < 3; r++) {
            free(srcf[r]);
        }
        free(a), free(b);
    }
    /* ns_ref (float64) vs mfsdp_cpu_newton_schulz (fp32): agree to fp32 accuracy */
    {
        static const int64_t shapes[][2] = {{3, 5}, {130, 33}, {33, 130}, {64, 7}};
        double worst = 0.0;
        for (size_t i = 0; i < 4; i++) {
            const int64_t m = shapes[i][0], k = shapes[i][1];
            const size_t n = (size_t)(m * k), wn = mfsdp_ns_workspace_elems(m, k);
            float *x = xmalloc(n * sizeof(float)), *ws = xmalloc(wn * sizeof(float));
            double *ref = xmalloc(n * sizeof(double));
            fill_normal(x, n, 1.0f);
            ns_ref(x, m, k, 5, ref);
            OKST(mfsdp_cpu_newton_schulz(x, m, k, 5, ws, wn));
            const double e = rel_err(x, ref, n);
            worst = e > worst ? e : worst;
            free(x), free(ws), free(ref);
        }
        check(worst < 1e-4,
              "host: float64 newton-schulz reference vs mfsdp_cpu_newton_schulz "
              "worst rel err %.2e (< 1e-4)",
              worst);
    }
    /* Muon semantics: cpu update == float64 (momentum, nesterov, NS per block, scale, wd) */
    {
        const int64_t m = 96, k = 40, split[3] = {32, 48, 16};
        const size_t n = (size_t)(m * k), wn = mfsdp_muon_workspace_elems(m, k);
        const mfsdp_muon_hp_t hp = {.lr = 0.02f,
                                    .momentum = 0.95f,
                                    .weight_decay = 0.1f,
                                    .nesterov = 1,
                                    .ns_steps = 5,
                                    .scale = MFSDP_SCALE_MOONLIGHT};
        float *w = xmalloc(n * sizeof(float)), *mom = xmalloc(n * sizeof(float));
        float *g = xmalloc(n * sizeof(float)), *u = xmalloc(n * sizeof(float));
        float *ws = xmalloc(wn * sizeof(float));
        double *wr = xmalloc(n * sizeof(double)), *o = xmalloc(n * sizeof(double));
        fill_normal(w, n, 0.5f);
        fill_normal(mom, n, 0.01f);
        fill_normal(g, n, 0.1f);
        for (size_t i = 0; i < n; i++) {
            const double mi = 0.95 * mom[i] + 0.05 * g[i];
            u[i] = (float)(0.05 * g[i] + 0.95 * mi);
        }
        int64_t row = 0;
        for (int bl = 0; bl < 3; bl++) {
            ns_ref(u + row * k, split[bl], k, 5, o + row * k);
            const double sc = 0.2 * sqrt((double)(split[bl] > k ? split[bl] : k));
            for (int64_t i = row * k; i < (row + split[bl]) * k; i++) {
                wr[i] = (double)w[i] * (1.0 - 0.02 * 0.1) - 0.02 * sc * o[i];
            }
            row += split[bl];
        }
        OKST(mfsdp_cpu_muon_update(w, mom, g, NULL, MFSDP_FLOAT32, m, k, 3, split, &hp, ws, wn));
        const double e = rel_err(w, wr, n);
        check(e < 1e-5,
              "host: muon float64 reference (split, moonlight, wd) vs "
              "mfsdp_cpu_muon_update rel err %.2e (< 1e-5)",
              e);
        free(w), free(mom), free(g), free(u), free(ws), free(wr), free(o);
    }
    /* AdamW float64 formula vs cpu */
    {
        const size_t n = 777;
        const mfsdp_adamw_hp_t hp = {
            .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
        float *w = xmalloc(n * 4), *m = xmalloc(n * 4), *v = xmalloc(n * 4), *g = xmalloc(n * 4);
        double *rw = xmalloc(n * 8);
        fill_normal(w, n, 1.0f);
        fill_normal(m, n, 0.01f);
        fill_normal(g, n, 0.1f);
        for (size_t i = 0; i < n; i++) {
            v[i] = fabsf(rng_normal()) * 1e-3f;
            const double mi = 0.9f * (double)m[i] + (1.0 - 0.9f) * g[i];
            const double vi = 0.95f * (double)v[i] + (1.0 - 0.95f) * (double)g[i] * g[i];
            rw[i] =
                (double)w[i] * (1.0 - 1e-3f * 0.1f) -
                1e-3f * (mi / (1.0 - pow(0.9f, 7))) / (sqrt(vi / (1.0 - pow(0.95f, 7))) + 1e-8f);
        }
        OKST(mfsdp_cpu_adamw_update(w, m, v, g, NULL, MFSDP_FLOAT32, n, 7, &hp));
        const double e = rel_err(w, rw, n);
        check(e < 1e-6, "host: adamw float64 reference vs mfsdp_cpu_adamw_update rel err %.2e", e);
        free(w), free(m), free(v), free(g), free(rw);
    }
    /* pack/unpack layout reference vs cpu */
    {
        mfsdp_strided_geom_t g = {.world = 3,
                                  .rows = 7,
                                  .rows_per_rank = 3,
                                  .row_bytes = 10,
                                  .offset = 6,
                                  .rank_stride = 6 + 30 + 4};
        uint8_t buf[120], full[70], want[70], got[70], ub[120], uw[120];
        for (size_t i = 0; i < sizeof(buf); i++) {
            buf[i] = (uint8_t)rng_u64();
        }
        for (size_t i = 0; i < sizeof(full); i++) {
            full[i] = (uint8_t)rng_u64();
        }
        memset(ub, 0xab, sizeof(ub));
        memset(uw, 0xab, sizeof(uw));
        for (int r = 0; r < 3; r++) {
            const int real = r < 2 ? 3 : 1;
            memcpy(want + r * 30, buf + r * 40 + 6, (size_t)real * 10);
            memcpy(uw + r * 40 + 6, full + r * 30, (size_t)real * 10);
            memset(uw + r * 40 + 6 + real * 10, 0, (size_t)(3 - real) * 10);
        }
        OKST(mfsdp_cpu_pack(got, buf, &g));
        OKST(mfsdp_cpu_unpack(ub, full, &g));
        check(memcmp(got, want, 70) == 0 && memcmp(ub, uw, 120) == 0,
              "host: pack/unpack layout reference == mfsdp_cpu_pack/unpack");
    }
}

/* ------------------------------------------------------------------ perf */

static int gemm_bf16(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                     int k, float alpha, const void *a, int lda, const void *b, int ldb, float beta,
                     void *c, int ldc)
{
    return cublasGemmEx(h, ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &beta,
                        c, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

/* m <= k: the GEMMs of mfsdp_cuda_newton_schulz() on a row-major m x k matrix, nothing else. */
static int raw_ns_gemms(cublasHandle_t h, int s, int l, int steps, void *x0, void *x1, void *a,
                        void *b)
{
    int ok = 1;
    for (int it = 0; it < steps; it++) {
        ok &= gemm_bf16(h, CUBLAS_OP_T, CUBLAS_OP_N, s, s, l, 1.0f, x0, l, x0, l, 0.0f, a, s);
        ok &= gemm_bf16(h, CUBLAS_OP_N, CUBLAS_OP_N, s, s, s, MFSDP_NS_C, a, s, a, s, 1.0f, b, s);
        ok &= gemm_bf16(h, CUBLAS_OP_N, CUBLAS_OP_T, l, s, s, 1.0f, x0, l, b, s, 0.0f, x1, l);
        void *t = x0;
        x0 = x1;
        x1 = t;
    }
    return ok;
}

static void perf_shape(int64_t m, int64_t k)
{
    const int steps = 5, warm = 2, reps = 10;
    const int64_t s = m < k ? m : k, l = m < k ? k : m;
    const size_t n = (size_t)(m * k);
    const double flops = (double)steps * (4.0 * (double)s * s * l + 2.0 * (double)s * s * s);
    float *hx = xmalloc(n * sizeof(float));
    fill_normal(hx, n, 1.0f);
    float *dx = dalloc(n * sizeof(float));
    h2d(dx, hx, n * sizeof(float));
    const size_t wsb = mfsdp_cuda_ns_workspace_bytes(m, k);
    void *ws = dalloc(wsb);
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    int ok = 1;
    for (int i = 0; i < warm; i++) {
        ok &= mfsdp_cuda_newton_schulz(ctx, dx, m, k, steps, ws, wsb) == MFSDP_OK;
    }
    CU(cudaEventRecord(e0, stream));
    for (int i = 0; i < reps; i++) {
        ok &= mfsdp_cuda_newton_schulz(ctx, dx, m, k, steps, ws, wsb) == MFSDP_OK;
    }
    CU(cudaEventRecord(e1, stream));
    CU(cudaEventSynchronize(e1));
    float ms_ns = 0.0f;
    CU(cudaEventElapsedTime(&ms_ns, e0, e1));
    ms_ns /= (float)reps;

    /* Raw GEMMs: own handle on the same stream, bf16 buffers filled with sane values. */
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h, stream) != 0) {
        check(0, "perf: cublasCreate");
        return;
    }
    void *x0 = dalloc(n * 2), *x1 = dalloc(n * 2), *a = dalloc((size_t)(s * s) * 2);
    void *b = dalloc((size_t)(s * s) * 2);
    for (size_t i = 0; i < n; i++) {
        hx[i] *= 1.0f / (float)sqrt((double)n);
    }
    h2d(dx, hx, n * sizeof(float));
    OKST(mfsdp_cuda_cast(ctx, x0, MFSDP_BFLOAT16, dx, MFSDP_FLOAT32, n));
    OKST(mfsdp_cuda_cast(ctx, x1, MFSDP_BFLOAT16, dx, MFSDP_FLOAT32, n));
    CU(cudaMemsetAsync(b, 0, (size_t)(s * s) * 2, stream));
    for (int i = 0; i < warm; i++) {
        ok &= raw_ns_gemms(h, (int)s, (int)l, steps, x0, x1, a, b);
    }
    CU(cudaEventRecord(e0, stream));
    for (int i = 0; i < reps; i++) {
        ok &= raw_ns_gemms(h, (int)s, (int)l, steps, x0, x1, a, b);
    }
    CU(cudaEventRecord(e1, stream));
    CU(cudaEventSynchronize(e1));
    float ms_raw = 0.0f;
    CU(cudaEventElapsedTime(&ms_raw, e0, e1));
    ms_raw /= (float)reps;
    const double tf_ns = flops / (ms_ns * 1e-3) / 1e12, tf_raw = flops / (ms_raw * 1e-3) / 1e12;
    printf("perf newton-schulz %lldx%lld steps=%d: mfsdp %.1f TFLOP/s (%.3f ms), raw bf16 gemm "
           "%.1f TFLOP/s (%.3f ms), ratio %.3f\n",
           (long long)m, (long long)k, steps, tf_ns, ms_ns, tf_raw, ms_raw, tf_ns / tf_raw);
    check(ok, "perf newton-schulz %lldx%lld ran", (long long)m, (long long)k);
    cublasDestroy(h);
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    CU(cudaFree(x0));
    CU(cudaFree(x1));
    CU(cudaFree(a));
    CU(cudaFree(b));
    CU(cudaFree(dx));
    CU(cudaFree(ws));
    free(hx);
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
    int perf = 1, correctness = 1;
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--no-perf") == 0) {
            perf = 0;
        } else if (strcmp(argv[i], "--perf-only") == 0) {
            correctness = 0;
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 0);
        } else {
            fprintf(stderr, "usage: %s [--no-perf] [--perf-only] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    rng_state = seed;
    printf("test_cuda_kernels: seed %llu\n", (unsigned long long)seed);

    /* Kernel warnings go to a file so that the error checks can read their messages. */
    snprintf(log_path, sizeof(log_path), "/tmp/mfsdp-test-cuda-kernels.%d.log", (int)getpid());
    setenv("MFSDP_DEBUG_FILE", log_path, 1);
    mfsdp_log_reinit();

    test_host_only();
    if (correctness) {
        test_references_on_cpu();
    }

    int ndev = 0;
    const cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        printf("no CUDA device (cudaGetDeviceCount: %s, %d devices): GPU checks skipped\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "ok", ndev);
        printf("%d passed, %d failed\n", npass, nfail);
        unlink(log_path);
        return nfail > 0 ? 1 : 77;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    int rt = 0;
    CU(cudaRuntimeGetVersion(&rt));
    printf("device 0: %s, sm_%d%d, %.1f GiB, cuda runtime %d\n", prop.name, prop.major, prop.minor,
           (double)prop.totalGlobalMem / (1 << 30), rt);
    CU(cudaSetDevice(0));
    CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const mfsdp_status_t st = mfsdp_cuda_ctx_create(stream, &ctx);
    check(st == MFSDP_OK, "ctx_create on a non-blocking stream: %s", mfsdp_status_string(st));
    if (st != MFSDP_OK) {
        printf("%d passed, %d failed\n", npass, nfail);
        return 1;
    }
    void *sp = NULL;
    check(mfsdp_cuda_ctx_get_stream(ctx, &sp) == MFSDP_OK && sp == (void *)stream,
          "ctx_get_stream returns the stream");

    if (correctness) {
        test_casts();
        test_reduce();
        test_adamw();
        test_sqnorm();
        test_pack();
        test_newton_schulz();
        test_muon();
        agg_check();
        test_errors();
        const cudaError_t le = cudaDeviceSynchronize();
        check(le == cudaSuccess, "no asynchronous cuda error: %s", cudaGetErrorString(le));
    }
    if (perf) {
        perf_shape(1024, 4096);
        perf_shape(4096, 4096);
        perf_shape(4096, 14336);
    }
    check(mfsdp_cuda_ctx_destroy(ctx) == MFSDP_OK, "ctx_destroy");
    CU(cudaStreamDestroy(stream));
    unlink(log_path);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail > 0 ? 1 : 0;
}
