/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Internal fp32 GEMM layer of the CPU kernels: a thin row-major wrapper over cblas_sgemm /
 * cblas_ssyrk when the build has OpenBLAS (MFSDP_HAVE_BLAS), otherwise a cache-blocked
 * portable C implementation with the same contract. Callers validate dimensions first:
 * every dimension and leading dimension must fit an int (the CBLAS index type), which
 * MFSDP_GEMM_DIM_MAX states.
 */
#ifndef MFSDP_KERNELS_CPU_GEMM_H
#define MFSDP_KERNELS_CPU_GEMM_H

#include <limits.h>
#include <stddef.h>

/* Largest dimension or leading dimension the wrapper accepts (CBLAS uses int). */
#define MFSDP_GEMM_DIM_MAX ((size_t)INT_MAX)

typedef enum mfsdp_gemm_op {
    MFSDP_GEMM_N = 0, /* use the matrix as stored */
    MFSDP_GEMM_T = 1, /* use its transpose */
} mfsdp_gemm_op_t;

/* Row-major C[m x n] = alpha * op(A)[m x kk] * op(B)[kk x n] + beta * C. With beta == 0,
 * C is not read (NaN in C does not propagate), as in BLAS. */
void mfsdp_gemm_sgemm(mfsdp_gemm_op_t opa, mfsdp_gemm_op_t opb, size_t m, size_t n, size_t kk,
                      float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                      float beta, float *c, size_t ldc);

/* Row-major symmetric rank-k update of the UPPER triangle (diagonal included) of
 * C[n x n] = alpha * op(A) * op(A)^T + beta * C, op(A) being n x kk. The strictly lower
 * triangle of C is unspecified on return (BLAS leaves it, the fallback may overwrite it). */
void mfsdp_gemm_ssyrk_upper(mfsdp_gemm_op_t opa, size_t n, size_t kk, float alpha, const float *a,
                            size_t lda, float beta, float *c, size_t ldc);

/* Which implementation is compiled in ("cblas (OpenBLAS <config>)" or "portable"). */
const char *mfsdp_gemm_backend(void);

/* Set the BLAS thread count of this process (MFSDP_THREADS); no-op for the portable GEMM,
 * which is single-threaded. */
void mfsdp_gemm_set_threads(int threads);

#endif /* MFSDP_KERNELS_CPU_GEMM_H */
