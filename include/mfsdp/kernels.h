/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file kernels.h
 * @brief The companion kernel library: Muon (Newton-Schulz), AdamW, fixed-order
 *        reductions, casts, strided packing and norms (docs/design.md, "The optimizer step").
 *
 * Two implementations behind one interface: `mfsdp_cpu_*` (C + OpenBLAS, single-threaded
 * per rank) and `mfsdp_cuda_*` (cuBLAS bf16 GEMM with fp32 accumulation, on a caller-given
 * stream; declared in mfsdp/kernels_cuda.h). Matrices are row-major. No function allocates
 * in the hot path: Newton-Schulz and Muon take a caller-supplied workspace whose size is
 * given by mfsdp_ns_workspace_elems(). Every function validates its arguments and returns
 * MFSDP_ERR_INVALID_ARG (null pointers, zero/negative dims or counts, bad enums, overlapping
 * buffers), MFSDP_ERR_OVERFLOW (sizes that overflow size_t, or a matrix dimension above
 * INT_MAX, the BLAS index limit) or MFSDP_ERR_MISMATCH (a workspace that is too small)
 * instead of crashing; on error no output is written. Element counts of 0 are invalid
 * (callers skip empty slices).
 */
#ifndef MFSDP_KERNELS_H
#define MFSDP_KERNELS_H

#include "mfsdp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Quintic Newton-Schulz coefficients (a, b, c). */
#define MFSDP_NS_A 3.4445f
#define MFSDP_NS_B (-4.7750f)
#define MFSDP_NS_C 2.0315f
/** Added to the Frobenius norm before normalizing. */
#define MFSDP_NS_EPS 1e-7f

/** Muon hyper-parameters of one matrix. */
typedef struct mfsdp_muon_hp {
    float lr;            /**< learning rate */
    float momentum;      /**< beta */
    float weight_decay;  /**< decoupled weight decay */
    int nesterov;        /**< 1: U = (1-beta) G + beta M; 0: U = M */
    int ns_steps;        /**< Newton-Schulz iterations, >= 0 */
    mfsdp_scale_t scale; /**< keller or moonlight */
} mfsdp_muon_hp_t;

/** AdamW hyper-parameters. */
typedef struct mfsdp_adamw_hp {
    float lr;
    float beta1;
    float beta2;
    float eps;
    float weight_decay;
} mfsdp_adamw_hp_t;

/**
 * @brief Workspace (in floats) that Newton-Schulz needs for an m x k matrix, or for
 *        the largest row block when the matrix is split. 0 on overflow or bad dims.
 *
 * With s = min(m, k) it is 2 s^2 + m k: the Gram matrix A = X X^T (s x s), the polynomial
 * B = b A + c A A (s x s) and a second m x k buffer for X (steps ping-pong between it and
 * the caller's matrix, ending in the caller's matrix). It grows with m and k, so the value
 * for the whole matrix also covers any split of it.
 */
MFSDP_API size_t mfsdp_ns_workspace_elems(int64_t m, int64_t k);

/**
 * @brief Orthogonalize @p x (m x k, row-major fp32) in place with the quintic iteration:
 *        transpose when m > k, X /= (||X||_F + 1e-7), then @p steps times
 *        A = X X^T, B = b A + c A A, X = a X + B X; transpose back.
 * @param [in,out] x    m*k floats
 * @param [in]     ws   workspace of at least mfsdp_ns_workspace_elems(m, k) floats
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_newton_schulz(float *x, int64_t m, int64_t k, int steps,
                                                 float *ws, size_t ws_elems);

/**
 * @brief Which BLAS routines the CPU Newton-Schulz calls and which GEMM library is compiled
 *        in (for the perf harness and logs).
 * @return a static string, never NULL
 */
MFSDP_API const char *mfsdp_cpu_ns_routines(void);

/** @brief mfsdp_cpu_newton_schulz() on @p batch contiguous same-shape matrices (the
 *         workspace is reused: mfsdp_ns_workspace_elems(m, k) floats suffice). */
MFSDP_API mfsdp_status_t mfsdp_cpu_newton_schulz_batched(float *x, size_t batch, int64_t m,
                                                         int64_t k, int steps, float *ws,
                                                         size_t ws_elems);

/**
 * @brief Newton-Schulz per row block: rows [0, split[0]), [split[0], split[0]+split[1]), ...
 *        each orthogonalized independently (QKV / per-head split). nsplit == 0 means whole.
 *        The split must sum to m. Workspace: the max over blocks.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_newton_schulz_split(float *x, int64_t m, int64_t k,
                                                       size_t nsplit, const int64_t *split,
                                                       int steps, float *ws, size_t ws_elems);

/**
 * @brief One Muon step on an owned matrix (docs/design.md, "The optimizer step"):
 *        M = beta M + (1-beta) G; U = nesterov ? (1-beta) G + beta M : M;
 *        U = NS(U) (per row block if split) * scale; W = W (1 - lr wd) - lr U;
 *        then w_comm = cast(W) when @p w_comm is not NULL.
 *        With a split, each row block is a matrix of its own: orthogonalized alone and
 *        scaled by mfsdp_muon_scale(block rows, k) (as if Q, K, V were separate params).
 *        Workspace: U (m k floats) followed by the Newton-Schulz workspace of the largest
 *        block; mfsdp_muon_workspace_elems(m, k) always suffices.
 * @param [in,out] w        fp32 master, m*k
 * @param [in,out] mom      fp32 momentum, m*k
 * @param [in]     g        fp32 reduced gradient, m*k
 * @param [out]    w_comm   comm-dtype copy (float32/bfloat16/float16) or NULL
 * @param [in]     ws       at least mfsdp_muon_workspace_elems(m, k) floats
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_muon_update(float *w, float *mom, const float *g, void *w_comm,
                                               mfsdp_dtype_t comm_dtype, int64_t m, int64_t k,
                                               size_t nsplit, const int64_t *split,
                                               const mfsdp_muon_hp_t *hp, float *ws,
                                               size_t ws_elems);

/** @brief Workspace (floats) of mfsdp_cpu_muon_update() for an m x k matrix. */
MFSDP_API size_t mfsdp_muon_workspace_elems(int64_t m, int64_t k);

/** @brief The Muon scale factor of an m x k matrix under @p scale (0 for bad arguments). */
MFSDP_API float mfsdp_muon_scale(int64_t m, int64_t k, mfsdp_scale_t scale);

/**
 * @brief AdamW with bias correction on a contiguous slice, step @p t >= 1:
 *        m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 *        W = W (1 - lr wd) - lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps);
 *        w_comm = cast(W) when not NULL.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_adamw_update(float *w, float *m, float *v, const float *g,
                                                void *w_comm, mfsdp_dtype_t comm_dtype, size_t n,
                                                int64_t t, const mfsdp_adamw_hp_t *hp);

/**
 * @brief Fixed-order reduction for reduce-to-owner. For each element i:
 *        s = x_0[i] (times @p scalar for PREMULSUM); then for r = 1..nsrc-1 in that order
 *        s = s + x_r[i] (each times scalar for PREMULSUM), all in fp32; AVG divides the
 *        sum by @p nsrc (so @p nsrc must be the world size); then
 *        out[i] = accumulate ? out[i] + s : s.
 *        Bitwise reproducible: the order never depends on timing. @p out may be one of
 *        the fp32 sources exactly (in place); partial overlaps are not allowed.
 * @param [in,out] out     fp32 destination (gradient accumulator), n floats
 * @param [in]     src     nsrc pointers to n elements of @p src_dtype each, in rank order
 * @param [in]     scalar  PREMULSUM factor (ignored otherwise)
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_reduce_ordered(float *out, const void *const *src, int nsrc,
                                                  mfsdp_dtype_t src_dtype, size_t n,
                                                  mfsdp_redop_t op, float scalar, int accumulate);

/**
 * @brief Convert @p n elements between float32, bfloat16 and float16 (same type = copy).
 *        To 16-bit: round to nearest even; NaN stays NaN (quiet), +-inf kept, overflow to inf.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_cast(void *dst, mfsdp_dtype_t dst_dtype, const void *src,
                                        mfsdp_dtype_t src_dtype, size_t n);

/** @brief Round one float to bfloat16 bits (round to nearest even, NaN kept as quiet NaN). */
MFSDP_API uint16_t mfsdp_f32_to_bf16(float x);
/** @brief Widen bfloat16 bits to float (exact). */
MFSDP_API float mfsdp_bf16_to_f32(uint16_t h);
/** @brief Round one float to IEEE half bits (round to nearest even). */
MFSDP_API uint16_t mfsdp_f32_to_f16(float x);
/** @brief Widen IEEE half bits to float (exact). */
MFSDP_API float mfsdp_f16_to_f32(uint16_t h);

/**
 * @brief Geometry of one parameter inside an FSDP rank-major buffer (docs/design.md, "FSDP2's byte
 * layout"), in bytes, so that mixed-dtype (uint8) groups use the same code.
 */
typedef struct mfsdp_strided_geom {
    int world;             /**< n */
    int64_t rows;          /**< N0: real rows of the parameter */
    int64_t rows_per_rank; /**< c = ceil(N0 / n) */
    size_t row_bytes;      /**< R * element size */
    size_t rank_stride;    /**< S in bytes: distance between rank blocks */
    size_t offset;         /**< o in bytes: offset of the param inside a rank block */
} mfsdp_strided_geom_t;

/**
 * @brief Gather the pieces (r, i) of one parameter from an FSDP buffer into a contiguous
 *        N0 x R matrix (padding rows skipped). One strided 2-D copy.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_pack(void *full, const void *fsdp_buf,
                                        const mfsdp_strided_geom_t *geom);

/**
 * @brief Scatter a contiguous N0 x R matrix into its pieces of an FSDP buffer and zero the
 *        padding rows [N0, n*c) of every piece.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_unpack(void *fsdp_buf, const void *full,
                                          const mfsdp_strided_geom_t *geom);

/**
 * @brief Sum of squares of @p n floats in double, added to *acc_p (for global-norm
 *        clipping). The association is fixed, so the result is bitwise reproducible:
 *        8 partial sums, lane j takes the elements i = j mod 8 in index order, and the
 *        lanes are added in order 0..7.
 */
MFSDP_API mfsdp_status_t mfsdp_cpu_sqnorm_accumulate(const float *x, size_t n, double *acc_p);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_KERNELS_H */
