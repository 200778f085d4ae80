/* SPDX-License-Identifier: Apache-2.0 */
/*
 * float32 <-> bfloat16 / float16 conversions against references written here: widening
 * by ldexp of the decoded fields, narrowing by nearest-neighbour search in the sorted
 * table of every finite 16-bit value (ties to the even bit pattern, overflow past
 * max + half an ulp to inf), cross-checked with the compiler's _Float16 where it exists.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <float.h>

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

TestSuite(kernels_cast, .init = suite_init, .fini = suite_fini);

typedef struct fmt16 {
    int mant_bits; /* 7 (bf16) or 10 (f16) */
    int bias;      /* 127 or 15 */
    uint16_t inf;  /* 0x7f80 or 0x7c00: also the count of finite non-negative patterns */
} fmt16_t;

static const fmt16_t BF16 = {7, 127, 0x7f80};
static const fmt16_t F16 = {10, 15, 0x7c00};

static uint32_t fbits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float bitsf(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Decode a 16-bit pattern (NaN comes back as NaN). */
static double ref_widen(const fmt16_t *f, uint16_t h)
{
    const int ebits = 15 - f->mant_bits;
    const unsigned e = (h >> f->mant_bits) & ((1u << ebits) - 1u);
    const unsigned mant = h & ((1u << f->mant_bits) - 1u);
    double v;
    if (e == (1u << ebits) - 1u) {
        v = mant == 0 ? INFINITY : NAN;
    } else if (e == 0) {
        v = ldexp((double)mant, 1 - f->bias - f->mant_bits);
    } else {
        v = ldexp((double)((1u << f->mant_bits) + mant), (int)e - f->bias - f->mant_bits);
    }
    return (h & 0x8000u) ? -v : v;
}

/* Round a finite-or-inf double to the format (not for NaN). */
static uint16_t ref_round(const fmt16_t *f, double x)
{
    const uint16_t sign = signbit(x) ? 0x8000u : 0;
    const double a = fabs(x);
    const unsigned nfin = f->inf; /* patterns 0 .. inf-1 are the finite non-negatives */
    const double max = ref_widen(f, (uint16_t)(nfin - 1));
    const double prev = ref_widen(f, (uint16_t)(nfin - 2));
    if (a >= max + (max - prev) / 2) {
        return sign | f->inf;
    }
    if (a >= max) {
        return (uint16_t)(sign | (nfin - 1));
    }
    /* Largest pattern lo with value <= a. */
    unsigned lo = 0, hi = nfin - 1;
    while (hi - lo > 1) {
        const unsigned mid = (lo + hi) / 2;
        if (ref_widen(f, (uint16_t)mid) <= a) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if (ref_widen(f, (uint16_t)hi) <= a) {
        lo = hi;
    }
    if (lo == nfin - 1) {
        return (uint16_t)(sign | lo);
    }
    const double dl = a - ref_widen(f, (uint16_t)lo);
    const double du = ref_widen(f, (uint16_t)(lo + 1)) - a;
    unsigned r = dl < du ? lo : du < dl ? lo + 1 : ((lo & 1u) ? lo + 1 : lo);
    return (uint16_t)(sign | r);
}

/* Check one narrowing against the reference; NaN must stay a quiet NaN of the same sign. */
static int check_narrow(const fmt16_t *f, float x, uint16_t got)
{
    if (isnan(x)) {
        const uint16_t quiet = (uint16_t)(1u << (f->mant_bits - 1));
        const int ok = (got & 0x7fffu) > f->inf && (got & quiet) &&
                       ((got & 0x8000u) != 0) == (signbit(x) != 0);
        cr_expect(ok, "NaN 0x%08x -> 0x%04x is not a quiet NaN of the same sign", fbits(x), got);
        return ok;
    }
    const uint16_t want = ref_round(f, (double)x);
    cr_expect_eq(got, want, "%s(0x%08x = %a) = 0x%04x, want 0x%04x", f == &BF16 ? "bf16" : "f16",
                 fbits(x), (double)x, got, want);
    return got == want;
}

static uint16_t narrow(const fmt16_t *f, float x)
{
    return f == &BF16 ? mfsdp_f32_to_bf16(x) : mfsdp_f32_to_f16(x);
}

Test(kernels_cast, widen_exhaustive)
{
    uint16_t *all = xmalloc(65536 * sizeof(uint16_t));
    float *out = xmalloc(65536 * sizeof(float));
    for (unsigned h = 0; h < 65536; h++) {
        all[h] = (uint16_t)h;
    }
    for (int fi = 0; fi < 2; fi++) {
        const fmt16_t *f = fi == 0 ? &BF16 : &F16;
        const mfsdp_dtype_t dt = fi == 0 ? MFSDP_BFLOAT16 : MFSDP_FLOAT16;
        poison(out, 65536);
        cr_assert_eq(mfsdp_cpu_cast(out, MFSDP_FLOAT32, all, dt, 65536), MFSDP_OK);
        long bad = 0;
        for (unsigned h = 0; h < 65536; h++) {
            const float s =
                fi == 0 ? mfsdp_bf16_to_f32((uint16_t)h) : mfsdp_f16_to_f32((uint16_t)h);
            const double ref = ref_widen(f, (uint16_t)h);
            uint32_t want = fbits((float)ref);
            if (isnan(ref)) {
                /* Widening keeps the payload: the pattern moves to the top of the float. */
                want = ((uint32_t)(h & 0x8000u) << 16) | 0x7f800000u |
                       ((uint32_t)(h & ((1u << f->mant_bits) - 1u)) << (23 - f->mant_bits));
            }
            bad += fbits(s) != want || fbits(out[h]) != want;
            if (fbits(s) != want || fbits(out[h]) != want) {
                cr_expect(0, "%s 0x%04x -> 0x%08x / array 0x%08x, want 0x%08x",
                          fi == 0 ? "bf16" : "f16", h, fbits(s), fbits(out[h]), want);
                if (bad > 10) {
                    break;
                }
            }
        }
#ifdef __FLT16_MAX__
        if (fi == 1) {
            for (unsigned h = 0; h < 65536; h++) {
                _Float16 hv;
                const uint16_t hb = (uint16_t)h;
                memcpy(&hv, &hb, 2);
                if (!isnan((float)hv)) {
                    cr_expect_eq(fbits(mfsdp_f16_to_f32(hb)), fbits((float)hv), "f16 0x%04x", h);
                }
            }
        }
#endif
    }
    free(all);
    free(out);
}

/* Midpoints between neighbours (exact ties), one float ulp either side, every neighbour
 * pair of the format, including subnormals and the overflow boundary. */
Test(kernels_cast, narrow_ties_exhaustive)
{
    for (int fi = 0; fi < 2; fi++) {
        const fmt16_t *f = fi == 0 ? &BF16 : &F16;
        long bad = 0;
        for (unsigned h = 0; h + 1 <= f->inf && bad < 10; h++) {
            const double lo = ref_widen(f, (uint16_t)h);
            /* Past the largest finite value the "neighbour" is max + one ulp (inf). */
            const double hi = h + 1 < f->inf ? ref_widen(f, (uint16_t)(h + 1))
                                             : lo + (lo - ref_widen(f, (uint16_t)(h - 1)));
            const float mid = (float)((lo + hi) / 2);
            cr_assert_eq((double)mid, (lo + hi) / 2, "midpoint not exact");
            const float xs[6] = {
                mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY), -mid, (float)lo, -(float)lo};
            for (int j = 0; j < 6; j++) {
                bad += !check_narrow(f, xs[j], narrow(f, xs[j]));
            }
        }
    }
}

Test(kernels_cast, narrow_random_and_edges)
{
    test_rng_t rng = rng_seeded("cast narrow");
    const uint32_t edges[] = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, /* zeros, infs */
        0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, /* NaNs: quiet, low payload */
        0x7fbfffffu, 0x7f80ffffu, 0x7fffffffu, 0xffffffffu, /* signalling, all-ones */
        0x7f7fffffu, 0xff7fffffu, 0x7f7f7fffu, 0x7f7f8000u, /* FLT_MAX, bf16 overflow edge */
        0x7f7e8000u, 0x7f7f0000u, 0x00000001u, 0x80000001u, /* ties, float subnormals */
        0x00008000u, 0x00018000u, 0x007fffffu, 0x00800000u, 0x3f808000u, 0x3f818000u,
        0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477ff001u, /* f16 max / overflow edge */
        0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, /* f16 min normal / subnormal */
        0x337fffffu, 0x33800000u, 0x33c00000u, 0x34000000u, 0x387fe000u, 0x387ff000u,
    };
    for (int fi = 0; fi < 2; fi++) {
        const fmt16_t *f = fi == 0 ? &BF16 : &F16;
        for (size_t i = 0; i < sizeof(edges) / sizeof(edges[0]); i++) {
            check_narrow(f, bitsf(edges[i]), narrow(f, bitsf(edges[i])));
        }
        long bad = 0;
        for (int i = 0; i < 400000 && bad < 10; i++) {
            /* Uniform bit patterns (all classes), and values inside the format's range. */
            const float x =
                (i & 1) ? bitsf((uint32_t)rng_u64(&rng))
                        : (float)(rng_normal(&rng) * ldexp(1.0, (int)(rng_u64(&rng) % 60) - 30));
            bad += !check_narrow(f, x, narrow(f, x));
        }
    }
#ifdef __FLT16_MAX__
    /* The compiler's conversion (libgcc/F16C) agrees on non-NaN inputs. */
    for (int i = 0; i < 200000; i++) {
        const float x = bitsf((uint32_t)rng_u64(&rng));
        if (isnan(x)) {
            continue;
        }
        const _Float16 hv = (_Float16)x;
        uint16_t hb;
        memcpy(&hb, &hv, 2);
        cr_expect_eq(mfsdp_f32_to_f16(x), hb, "f16(0x%08x)", fbits(x));
    }
#endif
}

/* Array casts between every pair of float dtypes, outputs poisoned, element counts of the
 * test shapes (1x1, 3x5, 7x64, 130x33, 64x7, 1000x257). */
ParameterizedTestParameters(kernels_cast, arrays)
{
    static size_t counts[] = {1, 15, 448, 4290, 448, 257000};
    return cr_make_param_array(size_t, counts, sizeof(counts) / sizeof(counts[0]));
}

ParameterizedTest(size_t *count, kernels_cast, arrays)
{
    const size_t n = *count;
    test_rng_t rng = rng_seeded("cast arrays");
    const mfsdp_dtype_t dts[3] = {MFSDP_FLOAT32, MFSDP_BFLOAT16, MFSDP_FLOAT16};
    float *f32 = xmalloc(n * sizeof(float));
    uint16_t *src16 = xmalloc(n * sizeof(uint16_t));
    void *dst = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        f32[i] = (float)(rng_normal(&rng) * 100.0);
    }
    if (n > 2) {
        f32[0] = NAN;
        f32[1] = -INFINITY;
        f32[2] = 1e30f; /* f16 overflow */
    }
    for (int si = 0; si < 3; si++) {
        const void *src = f32;
        if (dts[si] != MFSDP_FLOAT32) {
            for (size_t i = 0; i < n; i++) {
                src16[i] = (uint16_t)(rng_u64(&rng) & 0xffffu); /* every class */
            }
            src = src16;
        }
        for (int di = 0; di < 3; di++) {
            const size_t dsz = mfsdp_dtype_size(dts[di]);
            memset(dst, 0xff, n * dsz); /* NaN in every format */
            cr_assert_eq(mfsdp_cpu_cast(dst, dts[di], src, dts[si], n), MFSDP_OK);
            for (size_t i = 0; i < n; i++) {
                const double v =
                    dts[si] == MFSDP_FLOAT32
                        ? (double)f32[i]
                        : ref_widen(dts[si] == MFSDP_BFLOAT16 ? &BF16 : &F16, src16[i]);
                if (dts[di] == MFSDP_FLOAT32) {
                    const float got = ((const float *)dst)[i];
                    cr_expect(isnan(v) ? isnan(got) : fbits(got) == fbits((float)v),
                              "%d->%d [%zu]: %a, want %a", si, di, i, (double)got, v);
                } else {
                    const fmt16_t *f = dts[di] == MFSDP_BFLOAT16 ? &BF16 : &F16;
                    const uint16_t got = ((const uint16_t *)dst)[i];
                    if (isnan(v)) {
                        cr_expect((got & 0x7fffu) > f->inf, "%d->%d [%zu]: NaN lost", si, di, i);
                    } else {
                        cr_expect_eq(got, ref_round(f, v), "%d->%d [%zu]", si, di, i);
                    }
                }
            }
        }
    }
    free(f32);
    free(src16);
    free(dst);
}

Test(kernels_cast, errors)
{
    float a[8] = {0};
    uint16_t h[8] = {0};
    EXPECT_FAIL(mfsdp_cpu_cast(NULL, MFSDP_FLOAT32, h, MFSDP_BFLOAT16, 8), MFSDP_ERR_INVALID_ARG,
                "cast: null pointer");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_FLOAT32, NULL, MFSDP_BFLOAT16, 8), MFSDP_ERR_INVALID_ARG,
                "cast: null pointer");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_FLOAT32, h, MFSDP_BFLOAT16, 0), MFSDP_ERR_INVALID_ARG,
                "cast: empty input");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_UINT8, h, MFSDP_BFLOAT16, 8), MFSDP_ERR_INVALID_ARG,
                "unsupported dtype bfloat16 -> uint8");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_FLOAT32, h, (mfsdp_dtype_t)42, 8), MFSDP_ERR_INVALID_ARG,
                "unsupported dtype invalid -> float32");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_FLOAT32, h, MFSDP_BFLOAT16, SIZE_MAX / 2),
                MFSDP_ERR_OVERFLOW, "overflow");
    EXPECT_FAIL(mfsdp_cpu_cast(a, MFSDP_FLOAT32, (char *)a + 4, MFSDP_BFLOAT16, 4),
                MFSDP_ERR_INVALID_ARG, "overlap");
    for (int i = 0; i < 8; i++) {
        cr_expect_eq(a[i], 0.0f, "a failed cast wrote its output");
    }
    /* Same dtype is a copy, overlap allowed (memmove). */
    float b[6] = {1, 2, 3, 4, 5, 6};
    cr_assert_eq(mfsdp_cpu_cast(b + 1, MFSDP_FLOAT32, b, MFSDP_FLOAT32, 5), MFSDP_OK);
    for (int i = 1; i < 6; i++) {
        cr_expect_eq(b[i], (float)i);
    }
}
