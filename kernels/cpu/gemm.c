/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fp32 GEMM layer: cblas when available, else a blocked portable fallback (see gemm.h).
 */
#include "kernels/cpu/gemm.h"

#include "mfsdp_config.h"

#if MFSDP_HAVE_BLAS
#include <cblas.h>
#include <pthread.h>
#include <stdio.h>

static inline CBLAS_TRANSPOSE to_cblas(mfsdp_gemm_op_t op)
{
    return op == MFSDP_GEMM_T ? CblasTrans : CblasNoTrans;
}

void mfsdp_gemm_sgemm(mfsdp_gemm_op_t opa, mfsdp_gemm_op_t opb, size_t m, size_t n, size_t kk,
                      float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                      float beta, float *c, size_t ldc)
{
    cblas_sgemm(CblasRowMajor, to_cblas(opa), to_cblas(opb), (int)m, (int)n, (int)kk, alpha, a,
                (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

void mfsdp_gemm_ssyrk_upper(mfsdp_gemm_op_t opa, size_t n, size_t kk, float alpha, const float *a,
                            size_t lda, float beta, float *c, size_t ldc)
{
    cblas_ssyrk(CblasRowMajor, CblasUpper, to_cblas(opa), (int)n, (int)kk, alpha, a, (int)lda, beta,
                c, (int)ldc);
}

static char backend_desc[160];
static pthread_once_t backend_once = PTHREAD_ONCE_INIT;

static void backend_describe(void)
{
    snprintf(backend_desc, sizeof(backend_desc), "cblas (%s)", openblas_get_config());
}

const char *mfsdp_gemm_backend(void)
{
    pthread_once(&backend_once, backend_describe);
    return backend_desc;
}

void mfsdp_gemm_set_threads(int threads)
{
    if (threads >= 1) {
        openblas_set_num_threads(threads);
    }
}

#else /* !MFSDP_HAVE_BLAS */

/* Block sizes of the portable kernel: a KB x NB tile of op(B) (64 KiB, on the stack: no
 * allocation) is packed contiguous once and stays in L2 while MB rows of A stream over it. */
enum { GEMM_MB = 64, GEMM_NB = 128, GEMM_KB = 128 };

static inline float elem(const float *x, size_t ld, mfsdp_gemm_op_t op, size_t i, size_t j)
{
    return op == MFSDP_GEMM_N ? x[i * ld + j] : x[j * ld + i];
}

/* crow[0, len) += av * brow[0, len): contiguous and unaliased, so it vectorizes. */
static inline void axpy_row(float *restrict crow, const float *restrict brow, float av, size_t len)
{
    for (size_t j = 0; j < len; j++) {
        crow[j] += av * brow[j];
    }
}

/* Rows [i0, i1) of C, columns [jstart, n): C = beta C + alpha op(A) op(B). The syrk
 * fallback passes jstart = i0 so that only the upper block triangle is computed. */
static void gemm_rows(mfsdp_gemm_op_t opa, mfsdp_gemm_op_t opb, size_t i0, size_t i1, size_t jstart,
                      size_t n, size_t kk, float alpha, const float *a, size_t lda, const float *b,
                      size_t ldb, float beta, float *c, size_t ldc)
{
    float tile[GEMM_KB * GEMM_NB];
    for (size_t i = i0; i < i1; i++) {
        float *crow = c + i * ldc;
        for (size_t j = jstart; j < n; j++) {
            crow[j] = beta == 0.0f ? 0.0f : beta * crow[j];
        }
    }
    for (size_t j0 = jstart; j0 < n; j0 += GEMM_NB) {
        const size_t nb = n - j0 < GEMM_NB ? n - j0 : GEMM_NB;
        for (size_t p0 = 0; p0 < kk; p0 += GEMM_KB) {
            const size_t kb = kk - p0 < GEMM_KB ? kk - p0 : GEMM_KB;
            for (size_t p = 0; p < kb; p++) {
                for (size_t j = 0; j < nb; j++) {
                    tile[p * nb + j] = elem(b, ldb, opb, p0 + p, j0 + j);
                }
            }
            for (size_t i = i0; i < i1; i++) {
                for (size_t p = 0; p < kb; p++) {
                    const float av = alpha * elem(a, lda, opa, i, p0 + p);
                    /* A constant length lets -O2's cheap vectorizer take the full tiles. */
                    if (nb == GEMM_NB) {
                        axpy_row(c + i * ldc + j0, tile + p * nb, av, GEMM_NB);
                    } else {
                        axpy_row(c + i * ldc + j0, tile + p * nb, av, nb);
                    }
                }
            }
        }
    }
}

void mfsdp_gemm_sgemm(mfsdp_gemm_op_t opa, mfsdp_gemm_op_t opb, size_t m, size_t n, size_t kk,
                      float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                      float beta, float *c, size_t ldc)
{
    for (size_t i0 = 0; i0 < m; i0 += GEMM_MB) {
        const size_t i1 = i0 + GEMM_MB < m ? i0 + GEMM_MB : m;
        gemm_rows(opa, opb, i0, i1, 0, n, kk, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}

void mfsdp_gemm_ssyrk_upper(mfsdp_gemm_op_t opa, size_t n, size_t kk, float alpha, const float *a,
                            size_t lda, float beta, float *c, size_t ldc)
{
    /* op(A) op(A)^T: the second operand is op(A) transposed, i.e. A with the other op. */
    const mfsdp_gemm_op_t opb = opa == MFSDP_GEMM_N ? MFSDP_GEMM_T : MFSDP_GEMM_N;
    for (size_t i0 = 0; i0 < n; i0 += GEMM_MB) {
        const size_t i1 = i0 + GEMM_MB < n ? i0 + GEMM_MB : n;
        gemm_rows(opa, opb, i0, i1, i0, n, kk, alpha, a, lda, a, lda, beta, c, ldc);
    }
}

const char *mfsdp_gemm_backend(void)
{
    return "portable";
}

void mfsdp_gemm_set_threads(int threads)
{
    (void)threads;
}

#endif /* MFSDP_HAVE_BLAS */
