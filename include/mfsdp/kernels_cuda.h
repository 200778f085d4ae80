/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file kernels_cuda.h
 * @brief CUDA implementation of the kernel library (docs/design.md, "The optimizer step"): the
 * operations of mfsdp/kernels.h with the prefix `mfsdp_cuda_`, on device memory.
 *
 * Every operation is enqueued on the stream of a context (::mfsdp_cuda_ctx_t) and returns
 * as soon as the work is enqueued: no function synchronizes the device or the stream and
 * none allocates memory, except mfsdp_cuda_ctx_create() and mfsdp_cuda_ctx_destroy().
 * "Outputs written only on success" means here: when a function returns an error, nothing
 * was enqueued by its failing step or after it; work enqueued before a CUDA error may
 * still run (a CUDA launch failure leaves outputs unspecified). All pointers except the
 * host-side arrays named as such (@p src of mfsdp_cuda_reduce_ordered(), @p split, the
 * hyper-parameter structs, @p geom) are device pointers. CUDA types stay out of this
 * header: streams are passed as `void *` (a `cudaStream_t`, NULL = the legacy default
 * stream).
 *
 * Precision: Newton-Schulz runs in bfloat16 with fp32 accumulation (cuBLAS GemmEx,
 * CUBLAS_COMPUTE_32F), keeping X in bf16 between steps as the PyTorch reference does; the
 * Frobenius norm is accumulated in fp32. Momentum, AdamW, reductions and the master update
 * are fp32. Reductions use a fixed order (rank order for mfsdp_cuda_reduce_ordered(), a
 * fixed-shape tree for norms), never floating-point atomics, so results are bitwise
 * reproducible run to run on the same device.
 *
 * Errors: MFSDP_ERR_INVALID_ARG (null pointers, zero/negative dims, bad enums, overlapping
 * buffers, a misaligned workspace),
 * MFSDP_ERR_OVERFLOW (sizes that overflow size_t or cuBLAS' int dimensions),
 * MFSDP_ERR_MISMATCH (workspace too small), MFSDP_ERR_UNSUPPORTED (documented limits),
 * MFSDP_ERR_CUDA (a CUDA runtime or cuBLAS call failed; logged with MFSDP_WARN).
 */
#ifndef MFSDP_KERNELS_CUDA_H
#define MFSDP_KERNELS_CUDA_H

#include "mfsdp/kernels.h"
#include "mfsdp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Most sources mfsdp_cuda_reduce_ordered() sums in one call (all go in one launch). */
#define MFSDP_CUDA_REDUCE_MAX_SRC 1024
/** Largest batch of mfsdp_cuda_newton_schulz_batched(). */
#define MFSDP_CUDA_NS_MAX_BATCH 65535

/** Opaque CUDA context: a stream, a cuBLAS handle bound to it and cuBLAS' workspace. */
typedef struct mfsdp_cuda_ctx mfsdp_cuda_ctx_t;

/**
 * @brief Create a context on the current device: a cuBLAS handle bound to @p stream with a
 *        workspace of its own (so cuBLAS never allocates later). Allocates; may synchronize.
 * @param [in]  stream  cudaStream_t of the caller (NULL: legacy default stream)
 * @param [out] ctx_p   the new context
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_ctx_create(void *stream, mfsdp_cuda_ctx_t **ctx_p);

/**
 * @brief Synchronize the context's stream, then free the context. NULL is a no-op.
 * @param [in] ctx  context from mfsdp_cuda_ctx_create()
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_ctx_destroy(mfsdp_cuda_ctx_t *ctx);

/**
 * @brief Rebind the context (and its cuBLAS handle) to another stream, e.g. the stream of
 *        the intercepted collective. The caller orders the old and the new stream when a
 *        workspace is reused across them.
 * @param [in,out] ctx     context
 * @param [in]     stream  cudaStream_t (NULL: legacy default stream)
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_ctx_set_stream(mfsdp_cuda_ctx_t *ctx, void *stream);

/**
 * @brief Stream the context enqueues on.
 * @param [in]  ctx       context
 * @param [out] stream_p  the cudaStream_t as `void *`
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_ctx_get_stream(const mfsdp_cuda_ctx_t *ctx, void **stream_p);

/**
 * @brief Device workspace in bytes that Newton-Schulz or Muon need for one m x k matrix
 *        (also enough for any row-block split of it). 0 on bad dims or overflow.
 */
MFSDP_API size_t mfsdp_cuda_ns_workspace_bytes(int64_t m, int64_t k);

/** @brief Device workspace in bytes of mfsdp_cuda_newton_schulz_batched(). 0 on error. */
MFSDP_API size_t mfsdp_cuda_ns_batched_workspace_bytes(size_t batch, int64_t m, int64_t k);

/** @brief Device workspace in bytes of mfsdp_cuda_muon_update() (= the NS workspace). */
MFSDP_API size_t mfsdp_cuda_muon_workspace_bytes(int64_t m, int64_t k);

/** @brief Device workspace in bytes of mfsdp_cuda_sqnorm_accumulate() (any n). */
MFSDP_API size_t mfsdp_cuda_sqnorm_workspace_bytes(void);

/**
 * @brief Orthogonalize @p x (m x k, row-major fp32, device) in place: X = bf16(x),
 *        transposed when m > k; X /= (||X||_F + 1e-7); @p steps times A = X X^T,
 *        B = b A + c A A, X = a X + B X (bf16 GEMMs, fp32 accumulation, the b A and a X
 *        terms added in the GEMM epilogue as torch.addmm does); x = fp32(X^(T)).
 *        No transpose is materialized: both cases are expressed through cuBLAS operands.
 *        Deterministic for a given device and cuBLAS version.
 * @param [in]     ctx       context (stream, cuBLAS handle)
 * @param [in,out] x         m*k floats on the device
 * @param [in]     m, k      rows and columns, >= 1
 * @param [in]     steps     iterations, >= 0
 * @param [in]     ws        device workspace of at least mfsdp_cuda_ns_workspace_bytes(m, k)
 *                           bytes, 256-byte aligned (as cudaMalloc returns); its content
 *                           on entry does not matter
 * @param [in]     ws_bytes  its size
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_newton_schulz(mfsdp_cuda_ctx_t *ctx, float *x, int64_t m,
                                                  int64_t k, int steps, void *ws, size_t ws_bytes);

/**
 * @brief mfsdp_cuda_newton_schulz() on @p batch contiguous same-shape matrices at once
 *        (strided-batched GEMMs; one norm per matrix).
 * @param [in] ws  at least mfsdp_cuda_ns_batched_workspace_bytes(batch, m, k) bytes
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_newton_schulz_batched(mfsdp_cuda_ctx_t *ctx, float *x,
                                                          size_t batch, int64_t m, int64_t k,
                                                          int steps, void *ws, size_t ws_bytes);

/**
 * @brief Newton-Schulz per row block (QKV / per-head split): rows [0, split[0]),
 *        [split[0], split[0] + split[1]), ... each orthogonalized on its own. nsplit == 0
 *        means the whole matrix. The split (a host array) must sum to @p m.
 * @param [in] ws  at least mfsdp_cuda_ns_workspace_bytes() of the largest block
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_newton_schulz_split(mfsdp_cuda_ctx_t *ctx, float *x, int64_t m,
                                                        int64_t k, size_t nsplit,
                                                        const int64_t *split, int steps, void *ws,
                                                        size_t ws_bytes);

/**
 * @brief One Muon step on an owned matrix, as mfsdp_cpu_muon_update():
 *        M = beta M + (1-beta) G; U = nesterov ? (1-beta) G + beta M : M (fp32);
 *        U = NS_bf16(U) per row block, times mfsdp_muon_scale() of the block's shape;
 *        W = W (1 - lr wd) - lr U (fp32); w_comm = cast(W) (RNE) when not NULL.
 * @param [in,out] w           fp32 master, m*k (device)
 * @param [in,out] mom         fp32 momentum, m*k (device)
 * @param [in]     g           fp32 reduced gradient, m*k (device)
 * @param [out]    w_comm      comm-dtype copy (float32/bfloat16/float16) or NULL
 * @param [in]     comm_dtype  dtype of @p w_comm
 * @param [in]     nsplit, split  row blocks (host array), as mfsdp_cuda_newton_schulz_split()
 * @param [in]     hp          hyper-parameters (host)
 * @param [in]     ws          at least mfsdp_cuda_muon_workspace_bytes(m, k) bytes,
 *                             256-byte aligned
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_muon_update(mfsdp_cuda_ctx_t *ctx, float *w, float *mom,
                                                const float *g, void *w_comm,
                                                mfsdp_dtype_t comm_dtype, int64_t m, int64_t k,
                                                size_t nsplit, const int64_t *split,
                                                const mfsdp_muon_hp_t *hp, void *ws,
                                                size_t ws_bytes);

/**
 * @brief AdamW with bias correction on a contiguous slice, step @p t >= 1, fp32:
 *        m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 *        W = W (1 - lr wd) - lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps);
 *        w_comm = cast(W) when not NULL.
 * @param [in,out] w, m, v  fp32 master, first and second moments, @p n each (device)
 * @param [in]     g        fp32 gradient (device)
 * @param [out]    w_comm   comm-dtype copy or NULL
 * @param [in]     hp       hyper-parameters (host)
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_adamw_update(mfsdp_cuda_ctx_t *ctx, float *w, float *m,
                                                 float *v, const float *g, void *w_comm,
                                                 mfsdp_dtype_t comm_dtype, size_t n, int64_t t,
                                                 const mfsdp_adamw_hp_t *hp);

/**
 * @brief Fixed-order reduction for reduce-to-owner, as mfsdp_cpu_reduce_ordered(): per
 *        element s = x_0 (times @p scalar for PREMULSUM), s = s + x_r (times scalar) for
 *        r = 1..nsrc-1 in order, fp32 without fused multiply-add (bitwise equal to the C
 *        reference); AVG divides by @p nsrc; out = accumulate ? out + s : s.
 * @param [in,out] out     fp32 destination, n floats (device)
 * @param [in]     src     host array of @p nsrc device pointers, in rank order
 * @param [in]     nsrc    1..MFSDP_CUDA_REDUCE_MAX_SRC
 * @param [in]     src_dtype  float32, bfloat16 or float16
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_reduce_ordered(mfsdp_cuda_ctx_t *ctx, float *out,
                                                   const void *const *src, int nsrc,
                                                   mfsdp_dtype_t src_dtype, size_t n,
                                                   mfsdp_redop_t op, float scalar, int accumulate);

/**
 * @brief One step of a reduce pipeline, as the CPU executor's combine (kernels/executor.h):
 *        pout[i] = pin[i] + v (or v when @p pin is NULL: no addition of 0), with
 *        v = x[i] converted to fp32 (times @p scalar for PREMULSUM), fp32 without fused
 *        multiply-add: bitwise equal to the CPU executor.
 * @param [out] pout    n floats (device); may be @p pin (in place), must not overlap @p x
 * @param [in]  pin     n floats (device) or NULL
 * @param [in]  x       n elements of @p dtype (float32, bfloat16, float16)
 * @param [in]  op      MFSDP_OP_SUM, MFSDP_OP_AVG (no scaling here) or MFSDP_OP_PREMULSUM
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_combine(mfsdp_cuda_ctx_t *ctx, float *pout, const float *pin,
                                            const void *x, mfsdp_dtype_t dtype, size_t n,
                                            mfsdp_redop_t op, float scalar);

/**
 * @brief grad[i] += (AVG ? s[i] / world : s[i]) in fp32 (_rn operations, bitwise equal to the
 *        CPU executor's apply). @p grad and @p s must not overlap.
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_apply(mfsdp_cuda_ctx_t *ctx, float *grad, const float *s,
                                          size_t n, mfsdp_redop_t op, int world);

/** @brief x[i] *= a (fp32, bitwise equal to the CPU executor's scale). */
MFSDP_API mfsdp_status_t mfsdp_cuda_scale(mfsdp_cuda_ctx_t *ctx, float *x, size_t n, float a);

/**
 * @brief y[i] += x[i] * a (no fused multiply-add), then x[i] = 0: HSDP moves a replicated
 *        contribution into the gradient. @p y and @p x must not overlap.
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_axpy_clear(mfsdp_cuda_ctx_t *ctx, float *y, float *x, size_t n,
                                               float a);

/**
 * @brief Convert @p n elements between float32, bfloat16 and float16 on the device (same
 *        dtype: a copy). To 16-bit: round to nearest even, NaN stays NaN, +-inf kept,
 *        overflow to inf. @p dst and @p src must not overlap.
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_cast(mfsdp_cuda_ctx_t *ctx, void *dst, mfsdp_dtype_t dst_dtype,
                                         const void *src, mfsdp_dtype_t src_dtype, size_t n);

/**
 * @brief Gather the pieces of one parameter from an FSDP rank-major buffer (device) into a
 *        contiguous N0 x R matrix (device): one cudaMemcpy2DAsync for the full pieces, one
 *        copy for a partial last piece.
 * @param [out] full      N0 * row_bytes bytes
 * @param [in]  fsdp_buf  world * rank_stride bytes
 * @param [in]  geom      geometry (host), see ::mfsdp_strided_geom_t
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_pack(mfsdp_cuda_ctx_t *ctx, void *full, const void *fsdp_buf,
                                         const mfsdp_strided_geom_t *geom);

/**
 * @brief Scatter a contiguous N0 x R matrix into its FSDP pieces and zero the padding rows
 *        [N0, world * c) (cudaMemset2DAsync); bytes of other parameters are not touched.
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_unpack(mfsdp_cuda_ctx_t *ctx, void *fsdp_buf, const void *full,
                                           const mfsdp_strided_geom_t *geom);

/**
 * @brief Add the sum of squares of @p n floats (device) to the double at @p acc (device),
 *        with a fixed-shape two-pass tree (no atomics): bitwise reproducible for a given n.
 * @param [in,out] acc  one double in device memory
 * @param [in]     ws   at least mfsdp_cuda_sqnorm_workspace_bytes() bytes (device), 8-byte
 *                      aligned, as is @p acc
 */
MFSDP_API mfsdp_status_t mfsdp_cuda_sqnorm_accumulate(mfsdp_cuda_ctx_t *ctx, const float *x,
                                                      size_t n, double *acc, void *ws,
                                                      size_t ws_bytes);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_KERNELS_CUDA_H */
