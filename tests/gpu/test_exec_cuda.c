/* SPDX-License-Identifier: Apache-2.0 */
/*
 * GPU check of the device executor (kernels/cuda/exec_cuda.cu) against the CPU executor
 * (kernels/cpu/exec_cpu.c), op by op, on the same random inputs: copies, zeroing, upload and
 * download, casts, the reduce-pipeline ops (combine, apply, scale, axpy_clear) and the ordered
 * reduction bit for bit, pack/unpack bit for bit, sqnorm and AdamW within rounding, Muon within
 * the bf16 Newton-Schulz band (through a workspace that is not 256-byte aligned, as the owner
 * arena hands it), zeroed mem_alloc, work ordered on a non-default stream, and the errors an
 * overlapping copy and a too small workspace give.
 *
 * A plain executable: one line per check, then "N passed, N failed". Exit 0, 1, or 77 when
 * there is no GPU (meson's skip). Built wherever CUDA is; it has not run on a GPU yet.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/executor.h"
#include "mfsdp/kernels.h"

static int npass, nfail;
static mfsdp_exec_t *ge; /* device */
static mfsdp_exec_t *ce; /* host */

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
    ok ? npass++ : nfail++;
}

/* Infrastructure failures end the run. */
#define OK(call)                                                                                   \
    do {                                                                                           \
        mfsdp_status_t _st = (call);                                                               \
        if (_st != MFSDP_OK) {                                                                     \
            printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #call, mfsdp_status_string(_st));  \
            printf("%d passed, %d failed\n", npass, nfail + 1);                                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static uint64_t rng = 0x2545f4914f6cdd1dull;

static float rnd(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 4.0 - 2.0);
}

static void *hbuf(size_t bytes)
{
    void *p = calloc(1, bytes + 16);
    if (p == NULL) {
        printf("FAIL out of host memory\n");
        exit(1);
    }
    return p;
}

/* Device memory of the executor holding a copy of host bytes (at a byte offset, to test
 * unaligned paths); released by dfree. */
static void *dup_dev(const void *h, size_t bytes, size_t skew)
{
    void *d = NULL;
    OK(ge->ops->mem_alloc(ge, bytes + skew + 256, &d));
    char *p = (char *)d + skew;
    OK(ge->ops->upload(ge, p, h, bytes));
    return p;
}

static void dfree(void *p, size_t skew)
{
    ge->ops->mem_free(ge, (char *)p - skew);
}

static void down(void *h, const void *d, size_t bytes)
{
    OK(ge->ops->download(ge, h, d, bytes));
}

static void fill_dtype(void *x, mfsdp_dtype_t dt, size_t n)
{
    float *tmp = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        tmp[i] = rnd();
    }
    OK(ce->ops->cast(ce, x, dt, tmp, MFSDP_FLOAT32, n));
    free(tmp);
}

static void test_memory(void)
{
    size_t n = 100003;
    void *d = NULL;
    OK(ge->ops->mem_alloc(ge, n, &d));
    unsigned char *h = hbuf(n);
    memset(h, 0x5a, n);
    down(h, d, n);
    size_t nz = 0;
    for (size_t i = 0; i < n; i++) {
        nz += h[i] != 0;
    }
    check(nz == 0, "mem_alloc of %zu bytes is zeroed (%zu non-zero)", n, nz);
    for (size_t i = 0; i < n; i++) {
        h[i] = (unsigned char)(i * 13);
    }
    OK(ge->ops->upload(ge, d, h, n));
    void *d2 = NULL;
    OK(ge->ops->mem_alloc(ge, n, &d2));
    OK(ge->ops->copy(ge, d2, d, n));
    OK(ge->ops->zero(ge, (char *)d2 + 10, 100));
    unsigned char *g = hbuf(n);
    down(g, d2, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad += g[i] != (i >= 10 && i < 110 ? 0 : (unsigned char)(i * 13));
    }
    check(bad == 0, "upload, device copy, zero, download: %zu bytes wrong", bad);
    check(ge->ops->copy(ge, (char *)d + 1, d, 100) == MFSDP_ERR_INVALID_ARG,
          "an overlapping device copy is refused");
    void *none = (void *)1;
    OK(ge->ops->mem_alloc(ge, 0, &none));
    check(none == NULL, "mem_alloc of 0 bytes gives NULL");
    ge->ops->mem_free(ge, d);
    ge->ops->mem_free(ge, d2);
    free(h);
    free(g);
}

static void test_cast(mfsdp_dtype_t sd, mfsdp_dtype_t dd, size_t n)
{
    size_t ss = mfsdp_dtype_size(sd), ds = mfsdp_dtype_size(dd);
    void *src = hbuf(n * ss), *want = hbuf(n * ds), *got = hbuf(n * ds);
    fill_dtype(src, sd, n);
    OK(ce->ops->cast(ce, want, dd, src, sd, n));
    void *dsrc = dup_dev(src, n * ss, 0), *ddst = dup_dev(got, n * ds, 0);
    OK(ge->ops->cast(ge, ddst, dd, dsrc, sd, n));
    down(got, ddst, n * ds);
    check(memcmp(got, want, n * ds) == 0, "cast %s -> %s n=%zu: bitwise = cpu executor",
          mfsdp_dtype_name(sd), mfsdp_dtype_name(dd), n);
    dfree(dsrc, 0), dfree(ddst, 0), free(src), free(want), free(got);
}

static void test_combine(mfsdp_dtype_t dt, size_t n, mfsdp_redop_t op, int with_pin, int inplace,
                         size_t skew)
{
    size_t es = mfsdp_dtype_size(dt);
    void *x = hbuf(n * es);
    float *pin = hbuf(n * 4), *want = hbuf(n * 4), *got = hbuf(n * 4);
    fill_dtype(x, dt, n);
    for (size_t i = 0; i < n; i++) {
        pin[i] = rnd();
    }
    memcpy(want, pin, n * 4);
    OK(ce->ops->combine(ce, want, with_pin ? (inplace ? want : pin) : NULL, x, dt, n, op, 0.37f));
    float *dpin = dup_dev(pin, n * 4, skew * 4);
    void *dx = dup_dev(x, n * es, skew * es);
    float *dout = inplace ? dpin : dup_dev(got, n * 4, 0);
    OK(ge->ops->combine(ge, dout, with_pin ? dpin : NULL, dx, dt, n, op, 0.37f));
    down(got, dout, n * 4);
    check(memcmp(got, want, n * 4) == 0,
          "combine %s n=%zu op=%d %s%s skew %zu: bitwise = cpu executor", mfsdp_dtype_name(dt), n,
          (int)op, with_pin ? "pin" : "no pin", inplace ? " in place" : "", skew);
    if (!inplace) {
        dfree(dout, 0);
    }
    dfree(dpin, skew * 4), dfree(dx, skew * es);
    free(x), free(pin), free(want), free(got);
}

static void test_apply_scale_axpy(size_t n)
{
    float *g = hbuf(n * 4), *s = hbuf(n * 4), *w = hbuf(n * 4), *got = hbuf(n * 4);
    float *x = hbuf(n * 4), *xw = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        g[i] = rnd();
        s[i] = rnd();
        x[i] = rnd();
    }
    for (int avg = 0; avg < 2; avg++) {
        memcpy(w, g, n * 4);
        OK(ce->ops->apply(ce, w, s, n, avg ? MFSDP_OP_AVG : MFSDP_OP_SUM, 3));
        float *dg = dup_dev(g, n * 4, 0), *ds = dup_dev(s, n * 4, 4);
        OK(ge->ops->apply(ge, dg, ds, n, avg ? MFSDP_OP_AVG : MFSDP_OP_SUM, 3));
        down(got, dg, n * 4);
        check(memcmp(got, w, n * 4) == 0, "apply %s n=%zu: bitwise = cpu executor",
              avg ? "avg/3" : "sum", n);
        dfree(dg, 0), dfree(ds, 4);
    }
    memcpy(w, g, n * 4);
    OK(ce->ops->scale(ce, w, n, 0.37f));
    float *dg = dup_dev(g, n * 4, 0);
    OK(ge->ops->scale(ge, dg, n, 0.37f));
    down(got, dg, n * 4);
    check(memcmp(got, w, n * 4) == 0, "scale n=%zu: bitwise = cpu executor", n);
    dfree(dg, 0);
    memcpy(w, g, n * 4);
    memcpy(xw, x, n * 4);
    OK(ce->ops->axpy_clear(ce, w, xw, n, 0.3f));
    dg = dup_dev(g, n * 4, 0);
    float *dx = dup_dev(x, n * 4, 0);
    OK(ge->ops->axpy_clear(ge, dg, dx, n, 0.3f));
    down(got, dg, n * 4);
    down(x, dx, n * 4);
    check(memcmp(got, w, n * 4) == 0 && memcmp(x, xw, n * 4) == 0,
          "axpy_clear n=%zu: y bitwise = cpu executor, x cleared", n);
    dfree(dg, 0), dfree(dx, 0);
    free(g), free(s), free(w), free(got), free(x), free(xw);
}

static void test_reduce(mfsdp_dtype_t dt, int nsrc, size_t n, mfsdp_redop_t op)
{
    size_t es = mfsdp_dtype_size(dt);
    void *hs[8];
    void *ds[8];
    float *want = hbuf(n * 4), *got = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        want[i] = rnd();
    }
    float *dout = dup_dev(want, n * 4, 0);
    for (int r = 0; r < nsrc; r++) {
        hs[r] = hbuf(n * es);
        fill_dtype(hs[r], dt, n);
        ds[r] = dup_dev(hs[r], n * es, 0);
    }
    OK(ce->ops->reduce_ordered(ce, want, (const void *const *)hs, nsrc, dt, n, op, 0.37f, 1));
    OK(ge->ops->reduce_ordered(ge, dout, (const void *const *)ds, nsrc, dt, n, op, 0.37f, 1));
    down(got, dout, n * 4);
    check(memcmp(got, want, n * 4) == 0, "reduce_ordered %s x%d n=%zu op=%d: bitwise = cpu",
          mfsdp_dtype_name(dt), nsrc, n, (int)op);
    for (int r = 0; r < nsrc; r++) {
        dfree(ds[r], 0);
        free(hs[r]);
    }
    dfree(dout, 0), free(want), free(got);
}

static void test_pack(int world, int64_t rows, size_t row_bytes, size_t before)
{
    int64_t c = (rows + world - 1) / world;
    size_t stride = before + (size_t)c * row_bytes + 24;
    mfsdp_strided_geom_t geom = {world, rows, c, row_bytes, stride, before};
    size_t tot = stride * (size_t)world, full = (size_t)rows * row_bytes;
    unsigned char *buf = hbuf(tot), *f = hbuf(full), *want = hbuf(full), *got = hbuf(tot);
    for (size_t i = 0; i < tot; i++) {
        buf[i] = (unsigned char)(i * 31 + 7);
    }
    OK(ce->ops->pack(ce, want, buf, &geom));
    void *dbuf = dup_dev(buf, tot, 0), *df = dup_dev(f, full, 0);
    OK(ge->ops->pack(ge, df, dbuf, &geom));
    down(f, df, full);
    check(memcmp(f, want, full) == 0, "pack world %d rows %lld: bitwise = cpu", world,
          (long long)rows);
    memcpy(got, buf, tot);
    OK(ce->ops->unpack(ce, got, want, &geom));
    OK(ge->ops->unpack(ge, dbuf, df, &geom));
    down(buf, dbuf, tot);
    check(memcmp(buf, got, tot) == 0, "unpack world %d rows %lld: bitwise = cpu", world,
          (long long)rows);
    dfree(dbuf, 0), dfree(df, 0), free(buf), free(f), free(want), free(got);
}

static double rel(const float *a, const float *b, size_t n)
{
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / den);
}

static void test_sqnorm_adamw(size_t n)
{
    float *x = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        x[i] = rnd();
    }
    double a = 1.5, b = 1.5;
    OK(ce->ops->sqnorm(ce, x, n, &a));
    float *dx = dup_dev(x, n * 4, 0);
    OK(ge->ops->sqnorm(ge, dx, n, &b)); /* waits and hands the value back */
    check(fabs(a - b) <= 1e-12 * a, "sqnorm n=%zu: %.17g vs cpu %.17g", n, b, a);
    mfsdp_adamw_hp_t hp = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    float *w = hbuf(n * 4), *m = hbuf(n * 4), *v = hbuf(n * 4), *wg = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        w[i] = rnd();
        m[i] = 0.01f * rnd();
        v[i] = 1e-3f * fabsf(rnd());
    }
    float *dw = dup_dev(w, n * 4, 0), *dm = dup_dev(m, n * 4, 0), *dv = dup_dev(v, n * 4, 0);
    OK(ce->ops->adamw(ce, w, m, v, x, NULL, MFSDP_FLOAT32, n, 3, &hp));
    OK(ge->ops->adamw(ge, dw, dm, dv, dx, NULL, MFSDP_FLOAT32, n, 3, &hp));
    down(wg, dw, n * 4);
    check(rel(wg, w, n) < 1e-6, "adamw n=%zu: relative difference to cpu %.2g", n, rel(wg, w, n));
    dfree(dx, 0), dfree(dw, 0), dfree(dm, 0), dfree(dv, 0);
    free(x), free(w), free(m), free(v), free(wg);
}

static void test_muon(int64_t rows, int64_t cols)
{
    size_t n = (size_t)(rows * cols);
    mfsdp_muon_hp_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.lr = 0.02f;
    hp.momentum = 0.95f;
    hp.nesterov = 1;
    hp.ns_steps = 5;
    hp.weight_decay = 0.01f;
    float *w = hbuf(n * 4), *mom = hbuf(n * 4), *g = hbuf(n * 4), *wg = hbuf(n * 4);
    for (size_t i = 0; i < n; i++) {
        w[i] = 0.1f * rnd();
        g[i] = rnd();
    }
    size_t cw = ce->ops->muon_workspace(ce, rows, cols);
    size_t gw = ge->ops->muon_workspace(ge, rows, cols);
    float *cws = hbuf(cw * 4);
    float *dw = dup_dev(w, n * 4, 0), *dm = dup_dev(mom, n * 4, 0), *dg = dup_dev(g, n * 4, 0);
    void *dws = NULL;
    OK(ge->ops->mem_alloc(ge, gw * 4 + 64, &dws));
    float *ws = (float *)((char *)dws + 64); /* 64-byte aligned, as the arena gives it */
    OK(ce->ops->muon(ce, w, mom, g, NULL, MFSDP_FLOAT32, rows, cols, 0, NULL, &hp, cws, cw));
    OK(ge->ops->muon(ge, dw, dm, dg, NULL, MFSDP_FLOAT32, rows, cols, 0, NULL, &hp, ws, gw));
    down(wg, dw, n * 4);
    double e = rel(wg, w, n);
    check(e < 2e-2,
          "muon %lldx%lld (bf16 Newton-Schulz, unaligned workspace): relative "
          "difference to the cpu fp32 step %.2g",
          (long long)rows, (long long)cols, e);
    check(ge->ops->muon(ge, dw, dm, dg, NULL, MFSDP_FLOAT32, rows, cols, 0, NULL, &hp, ws, 8) !=
              MFSDP_OK,
          "muon with a too small workspace is refused");
    ge->ops->mem_free(ge, dws);
    dfree(dw, 0), dfree(dm, 0), dfree(dg, 0);
    free(w), free(mom), free(g), free(wg), free(cws);
}

/* The executor on two streams: work queued on the first is finished before anything queued
 * on the second after set_stream (the context's buffers are shared by its streams); a stream
 * being captured into a CUDA graph is refused. */
static void test_streams(cudaStream_t s)
{
    cudaStream_t s2 = NULL, s3 = NULL;
    check(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess &&
              cudaStreamCreateWithFlags(&s3, cudaStreamNonBlocking) == cudaSuccess,
          "streams for the ordering check");
    size_t n = (size_t)1 << 24;
    float *h = hbuf(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        h[i] = (float)(i % 1000) * 0.5f;
    }
    void *x = NULL, *y = NULL, *z = NULL;
    OK(ge->ops->mem_alloc(ge, n * sizeof(float), &x));
    OK(ge->ops->mem_alloc(ge, n * sizeof(float), &y));
    OK(ge->ops->mem_alloc(ge, n * sizeof(float), &z));
    OK(ge->ops->upload(ge, x, h, n * sizeof(float)));
    for (int k = 0; k < 20; k++) { /* a long queue on s: y = x scaled by 2, twenty times over */
        OK(ge->ops->copy(ge, y, x, n * sizeof(float)));
        OK(ge->ops->scale(ge, (float *)y, n, 2.0f));
    }
    OK(ge->ops->set_stream(ge, s2));
    OK(ge->ops->copy(ge, z, y, n * sizeof(float))); /* on s2: must see s's last scale */
    float *g = hbuf(n * sizeof(float));
    down(g, z, n * sizeof(float));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad += g[i] != h[i] * 2.0f;
    }
    check(bad == 0, "work on a new stream after set_stream sees the old stream's: %zu wrong", bad);
    check(cudaStreamBeginCapture(s3, cudaStreamCaptureModeRelaxed) == cudaSuccess,
          "begin a capture");
    check(ge->ops->set_stream(ge, s3) == MFSDP_ERR_UNSUPPORTED, "a capturing stream is refused");
    cudaGraph_t graph = NULL;
    if (cudaStreamEndCapture(s3, &graph) == cudaSuccess && graph != NULL) {
        cudaGraphDestroy(graph);
    }
    OK(ge->ops->set_stream(ge, s));
    ge->ops->mem_free(ge, x);
    ge->ops->mem_free(ge, y);
    ge->ops->mem_free(ge, z);
    free(h);
    free(g);
    cudaStreamSynchronize(s2);
    cudaStreamDestroy(s2);
    cudaStreamDestroy(s3);
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    setenv("MFSDP_DEBUG", "NONE", 1);
    OK(mfsdp_exec_cuda_create(0, &ge));
    OK(mfsdp_exec_cpu_create(&ce));
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        printf("FAIL cudaStreamCreate\n");
        return 1;
    }
    OK(ge->ops->set_stream(ge, s)); /* everything below is ordered on a non-default stream */
    check(ge->ops->device_memory == 1 && strcmp(ge->ops->name, "cuda") == 0, "executor kind");
    test_memory();
    test_cast(MFSDP_FLOAT32, MFSDP_BFLOAT16, 100003);
    test_cast(MFSDP_BFLOAT16, MFSDP_FLOAT32, 4099);
    test_cast(MFSDP_FLOAT32, MFSDP_FLOAT16, 1001);
    static const mfsdp_dtype_t dts[] = {MFSDP_FLOAT32, MFSDP_BFLOAT16, MFSDP_FLOAT16};
    for (int d = 0; d < 3; d++) {
        for (int op = 0; op < 3; op++) {
            test_combine(dts[d], 10007, (mfsdp_redop_t)op, 1, 0, 0);
            test_combine(dts[d], 1003, (mfsdp_redop_t)op, 0, 0, 1);
            test_combine(dts[d], 4096, (mfsdp_redop_t)op, 1, 1, 0);
        }
        test_reduce(dts[d], 3, 10007, MFSDP_OP_AVG);
        test_reduce(dts[d], 5, 333, MFSDP_OP_PREMULSUM);
    }
    test_apply_scale_axpy(100003);
    test_apply_scale_axpy(7);
    test_pack(4, 37, 12, 8);
    test_pack(3, 2, 6, 0);
    test_sqnorm_adamw(100003);
    test_muon(96, 64);
    test_muon(33, 130);
    test_streams(s);
    OK(ge->ops->sync(ge));
    ge->ops->destroy(ge);
    ce->ops->destroy(ce);
    cudaStreamDestroy(s);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail == 0 ? 0 : 1;
}
