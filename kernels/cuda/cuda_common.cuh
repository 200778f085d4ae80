/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Internal to kernels/cuda/: the context struct, error macros, dtype traits, 8-wide
 * vector loads/stores and the fixed-shape element loop shared by every kernel.
 *
 * The element loop hands each thread chunks of 8 consecutive elements, chunk c going to
 * thread c mod (grid size); a chunk is processed with 16-byte accesses when every pointer
 * is 16-byte aligned and the chunk is whole, element by element otherwise. The order in
 * which a thread visits elements is the same on both paths, so a reduction built on the
 * loop gives the same bits whatever the alignment.
 */
#ifndef MFSDP_KERNELS_CUDA_COMMON_CUH
#define MFSDP_KERNELS_CUDA_COMMON_CUH

/* System headers first, so that their guards skip them inside the extern "C" block. */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "core/checks.h"
#include "core/log.h"
}
#include "kernels/hparams.h"
#include "mfsdp/kernels_cuda.h"

#if !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#error "kernels/cuda needs CUDA >= 12.1 (large kernel parameters for the reduction)"
#endif

struct mfsdp_cuda_ctx {
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws; /* cuBLAS workspace, owned, so cuBLAS never allocates */
    size_t blas_ws_bytes;
    int device;
};

#define MFSDP_CUBLAS_CHECK(call)                                                                   \
    do {                                                                                           \
        cublasStatus_t _s = (call);                                                                \
        if (_s != CUBLAS_STATUS_SUCCESS) {                                                         \
            MFSDP_WARN("%s failed: %s", #call, cublasGetStatusString(_s));                         \
            return MFSDP_ERR_CUDA;                                                                 \
        }                                                                                          \
    } while (0)

/* After a kernel launch: configuration and launch errors. */
#define MFSDP_LAUNCH_CHECK(name)                                                                   \
    do {                                                                                           \
        cudaError_t _e = cudaGetLastError();                                                       \
        if (_e != cudaSuccess) {                                                                   \
            MFSDP_WARN("cuda kernel %s launch failed: %s", name, cudaGetErrorString(_e));          \
            return MFSDP_ERR_CUDA;                                                                 \
        }                                                                                          \
    } while (0)

#define MFSDP_CUDA_THREADS 256
/* Blocks of the fixed-shape reductions (NS Frobenius norm; squared norm). */
#define MFSDP_CUDA_NS_NRED 256
#define MFSDP_CUDA_SQ_NRED 512

namespace mfsdp_cuda
{

/*
 * Element-wise code is __host__ __device__ so that tests/gpu/emulate_kernels.cu can run the
 * very same ops on the host, where no GPU is. Arithmetic whose rounding matters goes through
 * these helpers: the _rn intrinsics on the device (never contracted into an FMA), plain IEEE
 * operations on the host (C++17 ISO mode: no contraction either).
 */
#define MFSDP_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__
#define MFSDP_UNROLL _Pragma("unroll")
#else
#define MFSDP_UNROLL /* the host compiler does not know the pragma */
#endif

MFSDP_HD float add_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
MFSDP_HD float mul_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
MFSDP_HD float div_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
MFSDP_HD float fma_rn(float a, float b, float c)
{
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return fmaf(a, b, c);
#endif
}
MFSDP_HD double dadd_rn(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
MFSDP_HD double dmul_rn(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
MFSDP_HD unsigned f32_bits(float x)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    unsigned u;
    memcpy(&u, &x, sizeof(u));
    return u;
#endif
}
MFSDP_HD float f32_from_bits(unsigned u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

/* Tag for "no output" (w_comm == NULL). */
struct none_t {
};

static inline bool aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* 1 when [a, a + an) and [b, b + bn) overlap (device addresses, compared as integers). */
static inline bool ranges_overlap(const void *a, size_t an, const void *b, size_t bn)
{
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

static inline unsigned ew_blocks(size_t nchunks)
{
    size_t b = (nchunks + MFSDP_CUDA_THREADS - 1) / MFSDP_CUDA_THREADS;
    if (b < 1) {
        b = 1;
    }
    if (b > 4096) { /* grid-stride beyond that */
        b = 4096;
    }
    return (unsigned)b;
}

static inline size_t chunks8(size_t n)
{
    return n / 8 + (n % 8 != 0);
}

/*
 * Conversions. Non-NaN values use the round-to-nearest-even intrinsics (cvt.rn); NaNs are
 * mapped bit for bit as the CPU kernels do (sign and top payload kept, quiet bit set),
 * so a cast is bit-exact against mfsdp_cpu_cast() for every input.
 */
MFSDP_HD __nv_bfloat16 f2bf(float x)
{
    const unsigned u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return __ushort_as_bfloat16((unsigned short)((u >> 16) | 0x0040u));
    }
    return __float2bfloat16_rn(x);
}
MFSDP_HD __half f2h(float x)
{
    const unsigned u = f32_bits(x);
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return __ushort_as_half(
            (unsigned short)(((u >> 16) & 0x8000u) | 0x7e00u | ((a >> 13) & 0x01ffu)));
    }
    return __float2half_rn(x);
}
MFSDP_HD float h2f(__half h)
{
    const unsigned b = __half_as_ushort(h);
    if ((b & 0x7c00u) == 0x7c00u && (b & 0x03ffu) != 0) { /* NaN: keep the payload */
        return f32_from_bits(((b & 0x8000u) << 16) | 0x7f800000u | ((b & 0x03ffu) << 13));
    }
    return __half2float(h);
}

MFSDP_HD float to_f32(float x)
{
    return x;
}
MFSDP_HD float to_f32(__nv_bfloat16 x)
{
    return __bfloat162float(x); /* exact: a shift */
}
MFSDP_HD float to_f32(__half x)
{
    return h2f(x);
}

template <typename T> MFSDP_HD T from_f32(float x);
template <> MFSDP_HD float from_f32<float>(float x)
{
    return x;
}
template <> MFSDP_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float x)
{
    return f2bf(x);
}
template <> MFSDP_HD __half from_f32<__half>(float x)
{
    return f2h(x);
}

/* One 16-byte access (p 16-byte aligned). On the host (emulation) through memcpy, which
 * keeps the type-punning defined; on the device a single 128-bit load/store. */
template <typename T> MFSDP_HD uint4 ld16(const T *p)
{
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const uint4 *>(p);
#else
    uint4 u;
    memcpy(&u, p, sizeof(u));
    return u;
#endif
}
template <typename T> MFSDP_HD void st16(T *p, const uint4 &u)
{
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint4 *>(p) = u;
#else
    memcpy(static_cast<void *>(p), &u, sizeof(u));
#endif
}

/* 8 elements at p (16-byte aligned): two 16-byte accesses for fp32, one for 16-bit types. */
MFSDP_HD void load8(const float *p, float (&v)[8])
{
    const uint4 a = ld16(p), b = ld16(p + 4);
    memcpy(&v[0], &a, sizeof(a));
    memcpy(&v[4], &b, sizeof(b));
}
MFSDP_HD void load8(const __nv_bfloat16 *p, float (&v)[8])
{
    const uint4 u = ld16(p);
    __nv_bfloat162 h[4];
    memcpy(static_cast<void *>(h), &u, sizeof(h));
    MFSDP_UNROLL
    for (int j = 0; j < 4; j++) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
    }
}
MFSDP_HD void load8(const __half *p, float (&v)[8])
{
    const uint4 u = ld16(p);
    __half2 h[4];
    memcpy(static_cast<void *>(h), &u, sizeof(h));
    MFSDP_UNROLL
    for (int j = 0; j < 4; j++) {
        v[2 * j] = h2f(__low2half(h[j]));
        v[2 * j + 1] = h2f(__high2half(h[j]));
    }
}

MFSDP_HD void store8(float *p, const float (&v)[8])
{
    uint4 a, b;
    memcpy(&a, &v[0], sizeof(a));
    memcpy(&b, &v[4], sizeof(b));
    st16(p, a);
    st16(p + 4, b);
}
MFSDP_HD void store8(__nv_bfloat16 *p, const float (&v)[8])
{
    __nv_bfloat162 h[4];
    MFSDP_UNROLL
    for (int j = 0; j < 4; j++) {
        h[j] = __halves2bfloat162(f2bf(v[2 * j]), f2bf(v[2 * j + 1]));
    }
    uint4 u;
    memcpy(&u, h, sizeof(u));
    st16(p, u);
}
MFSDP_HD void store8(__half *p, const float (&v)[8])
{
    __half2 h[4];
    MFSDP_UNROLL
    for (int j = 0; j < 4; j++) {
        h[j] = __halves2half2(f2h(v[2 * j]), f2h(v[2 * j + 1]));
    }
    uint4 u;
    memcpy(&u, h, sizeof(u));
    st16(p, u);
}
MFSDP_HD void store8(none_t *, const float (&)[8]) {}

template <typename T> MFSDP_HD void store1(T *p, size_t i, float x)
{
    p[i] = from_f32<T>(x);
}
template <> MFSDP_HD void store1<none_t>(none_t *, size_t, float) {}

/*
 * The fixed-shape element loop: chunk c = 8 elements [8c, 8c + 8) goes to global thread
 * c mod (gridDim.x * blockDim.x), chunks in increasing order. Op provides
 *   MFSDP_HD void vec(size_t base)            a whole aligned chunk (only when VEC)
 *   MFSDP_HD void one(size_t i)               one element
 * and may accumulate per-thread state between calls (element-wise ops launched through
 * ew_launch() are const: their methods must be const).
 */
template <bool VEC, typename Op>
MFSDP_HD void for_each_chunk(Op &op, size_t n, size_t thread, size_t nthreads)
{
    const size_t nchunks = n / 8 + (n % 8 != 0);
    for (size_t c = thread; c < nchunks; c += nthreads) {
        const size_t base = 8 * c;
        if (VEC && base + 8 <= n) {
            op.vec(base);
        } else {
            const size_t end = base + 8 < n ? base + 8 : n;
            for (size_t i = base; i < end; i++) {
                op.one(i);
            }
        }
    }
}

/* __grid_constant__: ops are used through a reference without a local copy (the
 * reduction's source table is 8 KiB). */
template <bool VEC, typename Op> __global__ void ew_kernel(const __grid_constant__ Op op, size_t n)
{
    for_each_chunk<VEC>(op, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x,
                        (size_t)gridDim.x * blockDim.x);
}

/* Launch an element-wise Op over n elements on stream s. */
template <typename Op>
static mfsdp_status_t ew_launch(const Op &op, size_t n, bool vec, cudaStream_t s, const char *name)
{
    const unsigned blocks = ew_blocks(chunks8(n));
    if (vec) {
        ew_kernel<true, Op><<<blocks, MFSDP_CUDA_THREADS, 0, s>>>(op, n);
    } else {
        ew_kernel<false, Op><<<blocks, MFSDP_CUDA_THREADS, 0, s>>>(op, n);
    }
    MFSDP_LAUNCH_CHECK(name);
    return MFSDP_OK;
}

/* Fixed tree over blockDim.x (a power of two) values in shared memory; result in sh[0]. */
template <typename T> __device__ __forceinline__ T block_tree_sum(T *sh, T v)
{
    const unsigned t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half >>= 1) {
        if (t < half) {
            sh[t] = sh[t] + sh[t + half];
        }
        __syncthreads();
    }
    const T r = sh[0];
    __syncthreads();
    return r;
}

/* dst = cast(src), element-wise; S, D in {float, __nv_bfloat16, __half}. */
template <typename S, typename D> struct cast_op {
    const S *src;
    D *dst;
    MFSDP_HD void vec(size_t i) const
    {
        float v[8];
        load8(src + i, v);
        store8(dst + i, v);
    }
    MFSDP_HD void one(size_t i) const
    {
        dst[i] = from_f32<D>(to_f32(src[i]));
    }
};

/* Size of one element of a float dtype, 0 for others. */
static inline size_t float_dtype_size(mfsdp_dtype_t d)
{
    switch (d) {
    case MFSDP_FLOAT32:
        return 4;
    case MFSDP_BFLOAT16:
        return 2;
    case MFSDP_FLOAT16:
        return 2;
    default:
        return 0;
    }
}

/* Round up to a multiple of 256 bytes (sub-buffers of a workspace); 0 on overflow. */
static inline int align256(size_t x, size_t *out)
{
    size_t r;
    if (mfsdp_add_overflow(x, 255, &r)) {
        return 1;
    }
    *out = r & ~(size_t)255;
    return 0;
}

/* Newton-Schulz core shared by newton_schulz.cu and muon.cu. */
struct ns_layout {
    int64_t s, l;                         /* min and max of (m, k) */
    size_t x_elems;                       /* s * l per matrix */
    size_t a_elems;                       /* s * s per matrix */
    size_t off_x1, off_a, off_b, off_red; /* byte offsets inside the workspace */
    size_t total;                         /* bytes */
};

/* 0 on success; MFSDP_ERR_INVALID_ARG / MFSDP_ERR_OVERFLOW otherwise (not logged). */
mfsdp_status_t ns_layout_compute(size_t batch, int64_t m, int64_t k, ns_layout *lay);

/*
 * Given X0 (bf16, row-major m x k per matrix, in ws) and the per-block sums of squares of
 * X0 in ws + off_red (MFSDP_CUDA_NS_NRED floats per matrix), normalize and run the steps.
 * Returns in *xfinal_p the bf16 buffer holding the result (row-major m x k per matrix).
 */
mfsdp_status_t ns_run(mfsdp_cuda_ctx_t *ctx, size_t batch, int64_t m, int64_t k, int steps,
                      void *ws, const ns_layout &lay, const __nv_bfloat16 **xfinal_p);

} /* namespace mfsdp_cuda */

#endif /* MFSDP_KERNELS_CUDA_COMMON_CUH */
