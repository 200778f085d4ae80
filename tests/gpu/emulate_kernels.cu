/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Host emulation of the CUDA element-wise kernels, for machines without a GPU.
 *
 * The ops of kernels/cuda/ are __host__ __device__ (MFSDP_HD): this program includes the
 * kernel sources and runs the very same op code on the host, thread by thread, with the
 * kernels' fixed element-to-thread assignment (for_each_chunk) and, for the reductions, the
 * kernels' fixed tree. It checks the vector (16-byte) and scalar paths against the CPU
 * kernels: casts and the ordered reduction bit for bit, the reduce-pipeline ops of the cuda
 * executor (combine, apply, scale, axpy_clear) bit for bit against the CPU executor's, AdamW,
 * the Muon momentum/apply ops,
 * the Newton-Schulz load/normalize ops and the squared norm (alignment-independent bits).
 *
 * What it cannot check: the device itself (intrinsics are replaced by plain IEEE host
 * arithmetic; cvt.rn by the host conversion routines of cuda_bf16.h / cuda_fp16.h),
 * cuBLAS, launches, streams and copies. tests/gpu/test_cuda_kernels.c does that on a GPU.
 * Prints one line per check and "N passed, N failed"; exit 0 or 1.
 */
#include "kernels/cuda/elementwise.cu"
#include "kernels/cuda/muon.cu"
#include "kernels/cuda/newton_schulz.cu"
#include "kernels/executor.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

using namespace mfsdp_cuda;

static int npass, nfail;

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%s ", ok ? "ok  " : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    (ok ? npass : nfail)++;
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_normal(void)
{
    const double u1 = ((double)(rng_u64() >> 11) + 0.5) * 0x1p-53;
    const double u2 = ((double)(rng_u64() >> 11) + 0.5) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* 64-byte aligned, plus an offset of `skew` bytes (skew 4: misaligned for 16-byte paths). */
static void *amalloc(size_t bytes, size_t skew)
{
    char *p = (char *)aligned_alloc(64, ((bytes + skew + 63) / 64) * 64 + 64);
    if (p == NULL) {
        printf("FAIL aligned_alloc\n");
        exit(1);
    }
    memset(p, 0xff, bytes + skew);
    return p + skew;
}

static void afree(void *p, size_t skew)
{
    free((char *)p - skew);
}

/* The grid of an element-wise launch (ew_launch), every thread run in turn. */
template <bool VEC, typename Op> static void emulate_ew(const Op &op, size_t n)
{
    const size_t nthreads = (size_t)ew_blocks(chunks8(n)) * MFSDP_CUDA_THREADS;
    for (size_t t = 0; t < nthreads; t++) {
        for_each_chunk<VEC>(op, n, t, nthreads);
    }
}

template <typename Op> static void emulate_ew(const Op &op, size_t n, bool vec)
{
    vec ? emulate_ew<true>(op, n) : emulate_ew<false>(op, n);
}

/* block_tree_sum of one block, sequentially: the same pairs are added in the same order. */
template <typename T> static T tree_sum(T *v, unsigned nthreads)
{
    for (unsigned half = nthreads / 2; half > 0; half >>= 1) {
        for (unsigned t = 0; t < half; t++) {
            v[t] = v[t] + v[t + half];
        }
    }
    return v[0];
}

/* A reduction launch of `blocks` blocks: make(thread) builds a fresh per-thread op. */
template <bool VEC, typename T, typename Make>
static void emulate_red(Make make, size_t n, unsigned blocks, T *partials)
{
    T acc[MFSDP_CUDA_THREADS];
    const size_t nthreads = (size_t)blocks * MFSDP_CUDA_THREADS;
    for (unsigned b = 0; b < blocks; b++) {
        for (unsigned t = 0; t < MFSDP_CUDA_THREADS; t++) {
            auto op = make();
            for_each_chunk<VEC>(op, n, (size_t)b * MFSDP_CUDA_THREADS + t, nthreads);
            acc[t] = op.acc;
        }
        partials[b] = tree_sum(acc, MFSDP_CUDA_THREADS);
    }
}

static const uint32_t specials[] = {
    0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
    0x7f800001u, 0x7fa5a5a5u, 0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f807fffu,
    0x7f7fffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x00000001u, 0x00400000u,
    0x33000000u, 0x33000001u, 0x387fc000u, 0x38800000u, 0x3a001000u, 0xb3800000u,
};

template <typename S, typename D>
static void check_cast(mfsdp_dtype_t sd, mfsdp_dtype_t dd, size_t n, size_t skew)
{
    const size_t ss = sizeof(S), ds = sizeof(D);
    uint8_t *src = (uint8_t *)amalloc(n * ss, skew * ss),
            *dst = (uint8_t *)amalloc(n * ds, skew * ds);
    uint8_t *want = (uint8_t *)amalloc(n * ds, 0);
    for (size_t i = 0; i < n; i++) {
        if (ss == 4) {
            uint32_t u = (uint32_t)rng_u64();
            if (i % 3 == 0) {
                const float f = rng_normal() * (float)ldexp(1.0, (int)(rng_u64() % 40) - 20);
                memcpy(&u, &f, 4);
            }
            if (i % 5 == 1) {
                u = specials[rng_u64() % (sizeof(specials) / sizeof(specials[0]))];
            }
            memcpy(src + i * 4, &u, 4);
        } else {
            const uint16_t h = (uint16_t)rng_u64();
            memcpy(src + i * 2, &h, 2);
        }
    }
    mfsdp_cpu_cast(want, dd, src, sd, n);
    const cast_op<S, D> op{(const S *)src, (D *)dst};
    emulate_ew(op, n, aligned16(src) && aligned16(dst));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad += memcmp(dst + i * ds, want + i * ds, ds) != 0;
    }
    check(bad == 0, "emulated cast %s -> %s n=%zu %s path: %zu differ from mfsdp_cpu_cast",
          mfsdp_dtype_name(sd), mfsdp_dtype_name(dd), n, skew ? "scalar" : "16-byte", bad);
    afree(src, skew * ss);
    afree(dst, skew * ds);
    afree(want, 0);
}

/* Same-dtype casts are a cudaMemcpyAsync on the device, not an op: not emulated. */
template <typename S> static void check_casts_from(mfsdp_dtype_t sd)
{
    for (size_t skew = 0; skew < 2; skew++) {
        if (sd != MFSDP_FLOAT32) {
            check_cast<S, float>(sd, MFSDP_FLOAT32, 1003, skew);
        }
        if (sd != MFSDP_BFLOAT16) {
            check_cast<S, __nv_bfloat16>(sd, MFSDP_BFLOAT16, 1003, skew);
        }
        if (sd != MFSDP_FLOAT16) {
            check_cast<S, __half>(sd, MFSDP_FLOAT16, 1003, skew);
        }
    }
}

template <typename S>
static void check_reduce(mfsdp_dtype_t sd, int nsrc, size_t n, mfsdp_redop_t op, int acc,
                         size_t skew)
{
    reduce_op<S> r{};
    float *init = (float *)amalloc(n * 4, 0), *want = (float *)amalloc(n * 4, 0);
    float *out = (float *)amalloc(n * 4, skew * 4), *tmp = (float *)amalloc(n * 4, 0);
    void *srcs[8];
    bool vec = aligned16(out);
    for (int q = 0; q < nsrc; q++) {
        srcs[q] = amalloc(n * sizeof(S), skew * sizeof(S));
        for (size_t i = 0; i < n; i++) {
            tmp[i] = 3.0f * rng_normal();
        }
        mfsdp_cpu_cast(srcs[q], sd, tmp, MFSDP_FLOAT32, n);
        r.src.p[q] = srcs[q];
        vec = vec && aligned16(srcs[q]);
    }
    for (size_t i = 0; i < n; i++) {
        init[i] = rng_normal();
    }
    memcpy(want, init, n * 4);
    memcpy(out, init, n * 4);
    mfsdp_cpu_reduce_ordered(want, (const void *const *)srcs, nsrc, sd, n, op, 0.37f, acc);
    r.out = out;
    r.nsrc = nsrc;
    r.premul = op == MFSDP_OP_PREMULSUM;
    r.avg = op == MFSDP_OP_AVG;
    r.accumulate = acc;
    r.scalar = 0.37f;
    emulate_ew(r, n, vec);
    check(memcmp(out, want, n * 4) == 0,
          "emulated reduce %s nsrc=%d n=%zu op=%d acc=%d %s path: bitwise = cpu %s",
          mfsdp_dtype_name(sd), nsrc, n, (int)op, acc, vec ? "16-byte" : "scalar",
          memcmp(out, want, n * 4) == 0 ? "yes" : "no");
    for (int q = 0; q < nsrc; q++) {
        afree(srcs[q], skew * sizeof(S));
    }
    afree(init, 0), afree(want, 0), afree(out, skew * 4), afree(tmp, 0);
}

template <typename D> static void check_adamw(mfsdp_dtype_t cd, size_t n, size_t skew)
{
    const mfsdp_adamw_hp_t hp = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    float *w[2], *m[2], *v[2], *g = (float *)amalloc(n * 4, skew * 4);
    void *wc = amalloc(n * sizeof(D), skew * sizeof(D)), *want_c = amalloc(n * sizeof(D), 0);
    for (int c = 0; c < 2; c++) {
        w[c] = (float *)amalloc(n * 4, skew * 4);
        m[c] = (float *)amalloc(n * 4, skew * 4);
        v[c] = (float *)amalloc(n * 4, skew * 4);
    }
    for (size_t i = 0; i < n; i++) {
        w[0][i] = w[1][i] = rng_normal();
        m[0][i] = m[1][i] = 0.01f * rng_normal();
        v[0][i] = v[1][i] = 1e-3f * fabsf(rng_normal());
        g[i] = 0.1f * rng_normal();
    }
    mfsdp_cpu_adamw_update(w[0], m[0], v[0], g, want_c, cd, n, 5, &hp);
    float c[8];
    adamw_consts(&hp, 5, c);
    const adamw_op<D> op{w[1], m[1], v[1], g,    (D *)wc, c[0], c[1],
                         c[2], c[3], c[4], c[5], c[6],    c[7]};
    const bool vec = aligned16(w[1]) && aligned16(wc);
    emulate_ew(op, n, vec);
    const bool same = memcmp(w[0], w[1], n * 4) == 0 && memcmp(m[0], m[1], n * 4) == 0 &&
                      memcmp(v[0], v[1], n * 4) == 0 && memcmp(want_c, wc, n * sizeof(D)) == 0;
    check(same, "emulated adamw n=%zu comm %s %s path: w, m, v, w_comm bitwise = cpu %s", n,
          mfsdp_dtype_name(cd), vec ? "16-byte" : "scalar", same ? "yes" : "no");
    for (int k = 0; k < 2; k++) {
        afree(w[k], skew * 4), afree(m[k], skew * 4), afree(v[k], skew * 4);
    }
    afree(g, skew * 4), afree(wc, skew * sizeof(D)), afree(want_c, 0);
}

/* Momentum op + NS load/normalize: fp32 momentum, bf16 U, the fixed-tree norm. */
static void check_muon_ops(size_t n, size_t skew, int nesterov)
{
    const float beta = 0.95f;
    float *mom = (float *)amalloc(n * 4, skew * 4), *g = (float *)amalloc(n * 4, skew * 4);
    float *mref = (float *)amalloc(n * 4, 0);
    __nv_bfloat16 *u = (__nv_bfloat16 *)amalloc(n * 2, 0);
    for (size_t i = 0; i < n; i++) {
        mom[i] = mref[i] = 0.01f * rng_normal();
        g[i] = 0.1f * rng_normal();
    }
    double ss = 0.0;
    size_t bad_u = 0;
    for (size_t i = 0; i < n; i++) { /* the CPU kernel's formula, then bf16 */
        mref[i] = beta * mref[i] + (1.0f - beta) * g[i];
    }
    float partials[MFSDP_CUDA_NS_NRED];
    const bool vec = aligned16(mom) && aligned16(g);
    auto make = [&]() { return muon_mom_op{mom, g, u, beta, 1.0f - beta, nesterov, 0.0f}; };
    if (vec) {
        emulate_red<true, float>(make, n, MFSDP_CUDA_NS_NRED, partials);
    } else {
        emulate_red<false, float>(make, n, MFSDP_CUDA_NS_NRED, partials);
    }
    for (size_t i = 0; i < n; i++) {
        const float ui = nesterov ? (1.0f - beta) * g[i] + beta * mref[i] : mref[i];
        const float ub = __bfloat162float(__float2bfloat16_rn(ui));
        bad_u += __bfloat162float(u[i]) != ub;
        ss += (double)ub * ub;
    }
    const float tot = tree_sum(partials, MFSDP_CUDA_NS_NRED);
    const double en = fabs((double)tot - ss) / ss;
    check(memcmp(mom, mref, n * 4) == 0 && bad_u == 0 && en < 1e-5,
          "emulated muon momentum n=%zu nesterov=%d %s path: momentum bitwise = cpu formula %s, "
          "%zu bf16 U differ, norm^2 rel err %.1e",
          n, nesterov, vec ? "16-byte" : "scalar", memcmp(mom, mref, n * 4) == 0 ? "yes" : "no",
          bad_u, en);

    /* normalize: X = bf16(X / (sqrt(tot) + eps)) */
    const float den = add_rn(sqrtf(tot), MFSDP_NS_EPS);
    __nv_bfloat16 *x = (__nv_bfloat16 *)amalloc(n * 2, 0);
    memcpy(x, u, n * 2);
    emulate_ew(ns_scale_op{x, den}, n, true);
    size_t bad_x = 0;
    for (size_t i = 0; i < n; i++) {
        const float want = __bfloat162float(__float2bfloat16_rn(__bfloat162float(u[i]) / den));
        bad_x += __bfloat162float(x[i]) != want;
    }
    check(bad_x == 0, "emulated ns normalize n=%zu: %zu of %zu differ", n, bad_x, n);

    /* apply: W = W (1 - lr wd) - (lr scale) X, with a bf16 comm copy */
    float *w = (float *)amalloc(n * 4, skew * 4), *wref = (float *)amalloc(n * 4, 0);
    __nv_bfloat16 *wc = (__nv_bfloat16 *)amalloc(n * 2, skew * 2);
    for (size_t i = 0; i < n; i++) {
        w[i] = wref[i] = rng_normal();
        wref[i] = wref[i] * (1.0f - 0.02f * 0.1f) - 0.03f * __bfloat162float(x[i]);
    }
    const muon_apply_op<__nv_bfloat16> ap{w, x, wc, 1.0f - 0.02f * 0.1f, 0.03f};
    emulate_ew(ap, n, aligned16(w) && aligned16(wc));
    uint16_t *cref = (uint16_t *)amalloc(n * 2, 0);
    mfsdp_cpu_cast(cref, MFSDP_BFLOAT16, wref, MFSDP_FLOAT32, n);
    const bool ok = memcmp(w, wref, n * 4) == 0 && memcmp(wc, cref, n * 2) == 0;
    check(ok, "emulated muon apply n=%zu %s path: w and bf16 w_comm bitwise = cpu formula %s", n,
          aligned16(w) ? "16-byte" : "scalar", ok ? "yes" : "no");
    afree(mom, skew * 4), afree(g, skew * 4), afree(mref, 0), afree(u, 0), afree(x, 0);
    afree(w, skew * 4), afree(wref, 0), afree(wc, skew * 2), afree(cref, 0);
}

/* The cuda executor's reduce-pipeline ops against the CPU executor (kernels/executor.h). */
static mfsdp_exec_t *cpu_exec(void)
{
    static mfsdp_exec_t *e;
    if (e == NULL && mfsdp_exec_cpu_create(&e) != MFSDP_OK) {
        printf("FAIL mfsdp_exec_cpu_create\n");
        exit(1);
    }
    return e;
}

template <typename S>
static void check_combine(mfsdp_dtype_t sd, size_t n, mfsdp_redop_t op, int with_pin, int inplace,
                          size_t skew)
{
    mfsdp_exec_t *e = cpu_exec();
    float *tmp = (float *)amalloc(n * 4, 0), *want = (float *)amalloc(n * 4, 0);
    float *out = (float *)amalloc(n * 4, skew * 4), *pin = (float *)amalloc(n * 4, skew * 4);
    float *pin_ref = (float *)amalloc(n * 4, 0);
    void *x = amalloc(n * sizeof(S), skew * sizeof(S));
    for (size_t i = 0; i < n; i++) {
        tmp[i] = 3.0f * rng_normal();
        pin[i] = pin_ref[i] = rng_normal();
    }
    mfsdp_cpu_cast(x, sd, tmp, MFSDP_FLOAT32, n);
    float *ref_out = inplace ? pin_ref : want, *emu_out = inplace ? pin : out;
    e->ops->combine(e, ref_out, with_pin ? pin_ref : NULL, x, sd, n, op, 0.37f);
    const combine_op<S> c{emu_out, with_pin ? pin : NULL, (const S *)x, op == MFSDP_OP_PREMULSUM,
                          0.37f};
    const bool vec = aligned16(emu_out) && aligned16(x) && aligned16(pin);
    emulate_ew(c, n, vec);
    const bool same = memcmp(emu_out, ref_out, n * 4) == 0;
    check(same, "emulated combine %s n=%zu op=%d %s%s %s path: bitwise = cpu executor %s",
          mfsdp_dtype_name(sd), n, (int)op, with_pin ? "pin" : "no pin", inplace ? " in place" : "",
          vec ? "16-byte" : "scalar", same ? "yes" : "no");
    afree(tmp, 0), afree(want, 0), afree(out, skew * 4), afree(pin, skew * 4);
    afree(pin_ref, 0), afree(x, skew * sizeof(S));
}

static void check_apply_scale_axpy(size_t n, size_t skew)
{
    mfsdp_exec_t *e = cpu_exec();
    float *g[2], *v[2], *x = (float *)amalloc(n * 4, skew * 4);
    for (int k = 0; k < 2; k++) {
        g[k] = (float *)amalloc(n * 4, k ? skew * 4 : 0);
        v[k] = (float *)amalloc(n * 4, k ? skew * 4 : 0);
    }
    for (int avg = 0; avg < 2; avg++) {
        for (size_t i = 0; i < n; i++) {
            g[0][i] = g[1][i] = rng_normal();
            x[i] = 2.0f * rng_normal();
        }
        mfsdp_redop_t op = avg ? MFSDP_OP_AVG : MFSDP_OP_SUM;
        e->ops->apply(e, g[0], x, n, op, 3);
        emulate_ew(apply_op{g[1], x, avg, 3.0f}, n, aligned16(g[1]) && aligned16(x));
        const bool same = memcmp(g[0], g[1], n * 4) == 0;
        check(same, "emulated apply n=%zu %s %s path: bitwise = cpu executor %s", n,
              avg ? "avg/3" : "sum", aligned16(g[1]) ? "16-byte" : "scalar", same ? "yes" : "no");
    }
    for (size_t i = 0; i < n; i++) {
        g[0][i] = g[1][i] = rng_normal();
    }
    e->ops->scale(e, g[0], n, 0.37f);
    emulate_ew(scale_op{g[1], 0.37f}, n, aligned16(g[1]));
    bool same = memcmp(g[0], g[1], n * 4) == 0;
    check(same, "emulated scale n=%zu %s path: bitwise = cpu executor %s", n,
          aligned16(g[1]) ? "16-byte" : "scalar", same ? "yes" : "no");
    for (size_t i = 0; i < n; i++) {
        g[0][i] = g[1][i] = rng_normal();
        v[0][i] = v[1][i] = 3.0f * rng_normal();
    }
    e->ops->axpy_clear(e, g[0], v[0], n, 0.3f);
    emulate_ew(axpy_clear_op{g[1], v[1], 0.3f}, n, aligned16(g[1]) && aligned16(v[1]));
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) {
        nonzero += v[1][i] != 0.0f || signbit(v[1][i]);
    }
    same = memcmp(g[0], g[1], n * 4) == 0 && memcmp(v[0], v[1], n * 4) == 0 && nonzero == 0;
    check(same, "emulated axpy_clear n=%zu %s path: y bitwise = cpu executor and x cleared %s", n,
          aligned16(g[1]) ? "16-byte" : "scalar", same ? "yes" : "no");
    for (int k = 0; k < 2; k++) {
        afree(g[k], k ? skew * 4 : 0), afree(v[k], k ? skew * 4 : 0);
    }
    afree(x, skew * 4);
}

static void check_sqnorm(size_t n)
{
    float *a = (float *)amalloc(n * 4, 0), *b = (float *)amalloc(n * 4, 4);
    for (size_t i = 0; i < n; i++) {
        a[i] = b[i] = 2.0f * rng_normal();
    }
    double pa[MFSDP_CUDA_SQ_NRED], pb[MFSDP_CUDA_SQ_NRED], cpu = 0.0;
    emulate_red<true, double>([&]() { return sq_op{a, 0.0}; }, n, MFSDP_CUDA_SQ_NRED, pa);
    emulate_red<false, double>([&]() { return sq_op{b, 0.0}; }, n, MFSDP_CUDA_SQ_NRED, pb);
    const double ta = tree_sum(pa, MFSDP_CUDA_SQ_NRED), tb = tree_sum(pb, MFSDP_CUDA_SQ_NRED);
    mfsdp_cpu_sqnorm_accumulate(a, n, &cpu);
    check(memcmp(&ta, &tb, sizeof(ta)) == 0 && fabs(ta - cpu) <= 1e-12 * cpu,
          "emulated sqnorm n=%zu: 16-byte and scalar paths same bits %s, rel err vs cpu %.1e", n,
          memcmp(&ta, &tb, sizeof(ta)) == 0 ? "yes" : "no", fabs(ta - cpu) / cpu);
    afree(a, 0), afree(b, 4);
}

int main(void)
{
    setenv("MFSDP_DEBUG", "NONE", 1);
    check_casts_from<float>(MFSDP_FLOAT32);
    check_casts_from<__nv_bfloat16>(MFSDP_BFLOAT16);
    check_casts_from<__half>(MFSDP_FLOAT16);
    for (int op = 0; op < 3; op++) {
        for (int acc = 0; acc < 2; acc++) {
            check_reduce<float>(MFSDP_FLOAT32, 3, 1003, (mfsdp_redop_t)op, acc, acc);
            check_reduce<__nv_bfloat16>(MFSDP_BFLOAT16, 5, 4099, (mfsdp_redop_t)op, acc, 1 - acc);
            check_reduce<__half>(MFSDP_FLOAT16, 2, 17, (mfsdp_redop_t)op, acc, acc);
        }
    }
    check_reduce<float>(MFSDP_FLOAT32, 1, 1, MFSDP_OP_AVG, 1, 0);
    for (int op = 0; op < 3; op++) {
        for (int pin = 0; pin < 2; pin++) {
            check_combine<float>(MFSDP_FLOAT32, 1003, (mfsdp_redop_t)op, pin, 0, (size_t)pin);
            check_combine<__nv_bfloat16>(MFSDP_BFLOAT16, 4099, (mfsdp_redop_t)op, pin, pin,
                                         (size_t)(1 - pin));
            check_combine<__half>(MFSDP_FLOAT16, 17, (mfsdp_redop_t)op, pin, 0, 0);
        }
    }
    check_combine<float>(MFSDP_FLOAT32, 4096, MFSDP_OP_PREMULSUM, 1, 1, 0);
    check_apply_scale_axpy(1003, 0);
    check_apply_scale_axpy(4099, 1);
    check_apply_scale_axpy(1, 0);
    check_adamw<float>(MFSDP_FLOAT32, 1001, 0);
    check_adamw<__nv_bfloat16>(MFSDP_BFLOAT16, 1001, 1);
    check_adamw<__half>(MFSDP_FLOAT16, 4096, 0);
    check_muon_ops(130 * 33, 0, 1);
    check_muon_ops(64 * 7 + 1, 1, 0);
    check_muon_ops(1000 * 257, 0, 1);
    check_sqnorm(1);
    check_sqnorm(1000 * 257 + 5);
    check_sqnorm((1u << 20) + 3);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail == 0 ? 0 : 1;
}
