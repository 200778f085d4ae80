/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Test-only float64 reference of the Newton-Schulz iteration (docs/design.md, "The optimizer
 * step"), shared by the CPU kernel tests, the GPU kernel check and the multi-rank training test: X
 * = in (transposed when m > k), X /= ||X||_F + 1e-7, steps of A = X X^T, B = b A + c A A, X = a X +
 * B X; the result back in the m x k layout. It is written independently of kernels/ (plain loops,
 * no BLAS). in and out may be the same buffer.
 */
#ifndef MFSDP_TESTS_NS_REF_H
#define MFSDP_TESTS_NS_REF_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static inline void *ns_ref_alloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "ns_ref: out of memory (%zu bytes)\n", bytes);
        abort(); /* test code: no way to continue */
    }
    return p;
}

static inline void ns_ref_f64(const double *in, int64_t m, int64_t k, int steps, double *out)
{
    const double ca = 3.4445, cb = -4.7750, cc = 2.0315;
    const int trans = m > k;
    const size_t s = (size_t)(trans ? k : m), l = (size_t)(trans ? m : k);
    double *x = ns_ref_alloc(s * l * sizeof(double));
    double *y = ns_ref_alloc(s * l * sizeof(double));
    double *a = ns_ref_alloc(s * s * sizeof(double));
    double *b = ns_ref_alloc(s * s * sizeof(double));
    for (size_t i = 0; i < s; i++) {
        for (size_t j = 0; j < l; j++) {
            x[i * l + j] = trans ? in[j * (size_t)k + i] : in[i * (size_t)k + j];
        }
    }
    double norm = 0.0;
    for (size_t i = 0; i < s * l; i++) {
        norm += x[i] * x[i];
    }
    norm = sqrt(norm) + 1e-7;
    for (size_t i = 0; i < s * l; i++) {
        x[i] /= norm;
    }
    for (int t = 0; t < steps; t++) {
        for (size_t i = 0; i < s; i++) {
            for (size_t j = 0; j < s; j++) {
                double acc = 0.0;
                for (size_t p = 0; p < l; p++) {
                    acc += x[i * l + p] * x[j * l + p];
                }
                a[i * s + j] = acc;
            }
        }
        for (size_t i = 0; i < s; i++) {
            for (size_t j = 0; j < s; j++) {
                b[i * s + j] = cb * a[i * s + j];
            }
            for (size_t p = 0; p < s; p++) {
                const double aip = cc * a[i * s + p];
                for (size_t j = 0; j < s; j++) {
                    b[i * s + j] += aip * a[p * s + j];
                }
            }
        }
        for (size_t i = 0; i < s; i++) {
            for (size_t j = 0; j < l; j++) {
                y[i * l + j] = ca * x[i * l + j];
            }
            for (size_t p = 0; p < s; p++) {
                const double bip = b[i * s + p];
                for (size_t j = 0; j < l; j++) {
                    y[i * l + j] += bip * x[p * l + j];
                }
            }
        }
        double *tmp = x;
        x = y;
        y = tmp;
    }
    for (size_t i = 0; i < s; i++) {
        for (size_t j = 0; j < l; j++) {
            if (trans) {
                out[j * (size_t)k + i] = x[i * l + j];
            } else {
                out[i * (size_t)k + j] = x[i * l + j];
            }
        }
    }
    free(x);
    free(y);
    free(a);
    free(b);
}

#endif /* MFSDP_TESTS_NS_REF_H */
