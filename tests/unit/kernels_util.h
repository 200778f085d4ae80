/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Helpers shared by the kernel unit tests: a seeded generator (seed from /dev/urandom or
 * MFSDP_TEST_SEED, printed so that a failure reproduces), NaN poisoning, relative errors
 * and capture of the library's log to check error messages.
 */
#ifndef MFSDP_TESTS_KERNELS_UTIL_H
#define MFSDP_TESTS_KERNELS_UTIL_H

#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"
#include "tests/lib/ns_ref.h"

typedef struct test_rng {
    uint64_t s;
} test_rng_t;

/* splitmix64 */
static inline uint64_t rng_u64(test_rng_t *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline double rng_uniform(test_rng_t *r) /* [0, 1) */
{
    return (double)(rng_u64(r) >> 11) * 0x1p-53;
}

static inline double rng_normal(test_rng_t *r)
{
    double u = rng_uniform(r);
    const double v = rng_uniform(r);
    if (u < 1e-300) {
        u = 1e-300;
    }
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

/* A fresh seed per test (printed), or MFSDP_TEST_SEED to replay one. */
static inline test_rng_t rng_seeded(const char *what)
{
    test_rng_t r;
    const char *env = getenv("MFSDP_TEST_SEED");
    uint64_t seed = 0;
    if (env != NULL) {
        seed = strtoull(env, NULL, 0);
    } else {
        FILE *f = fopen("/dev/urandom", "rb");
        if (f == NULL || fread(&seed, sizeof(seed), 1, f) != 1) {
            seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
        }
        if (f != NULL) {
            fclose(f);
        }
    }
    fprintf(stderr, "[%s] seed 0x%016" PRIx64 " (replay: MFSDP_TEST_SEED=0x%016" PRIx64 ")\n", what,
            seed, seed);
    r.s = seed;
    return r;
}

static inline void fill_normal(test_rng_t *r, float *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)(scale * rng_normal(r));
    }
}

static inline void poison(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = NAN;
    }
}

/* ||out - ref|| / ||ref||; any non-finite output where ref is finite gives +inf. */
static inline double rel_err(const float *out, const double *ref, size_t n)
{
    double num = 0.0;
    double den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) {
            return INFINITY;
        }
        const double d = (double)out[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* Error of out against ref as a ratio to the bound rel * |ref| + ulps * 2^-24 * terms, in
 * norms over the vector (< 1 passes). `terms` is the size of what was summed for each element
 * (|a| + |b| for a + b): an fp32 sum that cancels keeps an absolute error of a few ulps of its
 * terms, which a plain relative error would count against the kernel. */
static inline double bounded_err(const float *out, const double *ref, const double *terms, size_t n,
                                 double rel, double ulps)
{
    double num = 0.0, den = 0.0, t2 = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) {
            return INFINITY;
        }
        const double d = (double)out[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
        t2 += terms[i] * terms[i];
    }
    const double bound = rel * sqrt(den) + ulps * 0x1p-24 * sqrt(t2);
    return bound > 0.0 ? sqrt(num) / bound : (num > 0.0 ? INFINITY : 0.0);
}

static inline void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes == 0 ? 1 : bytes);
    cr_assert_not_null(p, "malloc(%zu)", bytes);
    return p;
}

/* Log capture: every test process logs to its own file; log_since() returns what was
 * written after the mark (static buffer). */
static char log_path[256];

static inline void log_capture_start(void)
{
    snprintf(log_path, sizeof(log_path), "/tmp/mfsdp-kernels-test.%d.log", (int)getpid());
    unlink(log_path);
    setenv("MFSDP_DEBUG_FILE", log_path, 1);
    setenv("MFSDP_DEBUG", "WARN", 1);
    mfsdp_log_reinit();
}

static inline void log_capture_stop(void)
{
    unlink(log_path);
}

static inline long log_mark(void)
{
    struct stat st;
    return stat(log_path, &st) == 0 ? (long)st.st_size : 0;
}

static inline const char *log_since(long mark)
{
    static char buf[8192];
    buf[0] = '\0';
    FILE *f = fopen(log_path, "r");
    if (f == NULL) {
        return buf;
    }
    if (fseek(f, mark, SEEK_SET) == 0) {
        size_t got = fread(buf, 1, sizeof(buf) - 1, f);
        buf[got] = '\0';
    }
    fclose(f);
    return buf;
}

/* Run a call that must fail with status and log a line containing msg. */
#define EXPECT_FAIL(call, status, msg)                                                             \
    do {                                                                                           \
        long _mark = log_mark();                                                                   \
        mfsdp_status_t _st = (call);                                                               \
        cr_expect_eq(_st, (status), "%s: status %d, expected %d", #call, (int)_st, (int)(status)); \
        const char *_log = log_since(_mark);                                                       \
        cr_expect(strstr(_log, (msg)) != NULL, "%s: log \"%s\" lacks \"%s\"", #call, _log, (msg)); \
    } while (0)

/* The iteration in double (tests/lib/ns_ref.h). */
static inline void ref_ns_f64(const double *in, int64_t m, int64_t k, int steps, double *out)
{
    ns_ref_f64(in, m, k, steps, out);
}

#endif /* MFSDP_TESTS_KERNELS_UTIL_H */
