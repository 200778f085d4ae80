/* SPDX-License-Identifier: Apache-2.0 */
/*
 * One Muon step on the GPU (docs/design.md, "The optimizer step"), per row block:
 *   1. momentum kernel: M = beta M + (1-beta) G, U = nesterov ? (1-beta) G + beta M : M,
 *      written straight to the bf16 Newton-Schulz buffer, with the fixed-shape partial
 *      sums of squares of the rounded U (no fp32 copy of U);
 *   2. Newton-Schulz in bf16 (newton_schulz.cu);
 *   3. apply kernel: W = W (1 - lr wd) - (lr scale) X, and the comm-dtype copy of W.
 * Momentum and master weights stay fp32; the block's scale is mfsdp_muon_scale() of its
 * own shape, as in mfsdp_cpu_muon_update().
 */
#include "kernels/cuda/cuda_common.cuh"

#include <math.h>

namespace mfsdp_cuda
{

struct muon_mom_op {
    float *mom;
    const float *g;
    __nv_bfloat16 *u;
    float beta, omb;
    int nesterov;
    float acc;

    MFSDP_HD float update(float &mi, float gi) const
    {
        mi = beta * mi + omb * gi;
        return nesterov ? omb * gi + beta * mi : mi;
    }
    MFSDP_HD void vec(size_t i)
    {
        float mv[8], gv[8], uv[8];
        load8(mom + i, mv);
        load8(g + i, gv);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            uv[j] = __bfloat162float(f2bf(update(mv[j], gv[j])));
            acc = fma_rn(uv[j], uv[j], acc);
        }
        store8(mom + i, mv);
        store8(u + i, uv);
    }
    MFSDP_HD void one(size_t i)
    {
        float mi = mom[i];
        const __nv_bfloat16 h = f2bf(update(mi, g[i]));
        const float r = __bfloat162float(h);
        acc = fma_rn(r, r, acc);
        mom[i] = mi;
        u[i] = h;
    }
};

template <bool VEC>
__global__ void muon_mom_kernel(float *mom, const float *g, __nv_bfloat16 *u, size_t n, float beta,
                                int nesterov, float *partials)
{
    __shared__ float sh[MFSDP_CUDA_THREADS];
    muon_mom_op op{mom, g, u, beta, 1.0f - beta, nesterov, 0.0f};
    for_each_chunk<VEC>(op, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x,
                        (size_t)gridDim.x * blockDim.x);
    const float s = block_tree_sum(sh, op.acc);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = s;
    }
}

template <typename D> struct muon_apply_op {
    float *w;
    const __nv_bfloat16 *x;
    D *wc;
    float decay, step; /* 1 - lr wd; lr * scale */

    MFSDP_HD void vec(size_t i) const
    {
        float wv[8], xv[8];
        load8(w + i, wv);
        load8(x + i, xv);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            wv[j] = wv[j] * decay - step * xv[j];
        }
        store8(w + i, wv);
        store8(wc + i, wv);
    }
    MFSDP_HD void one(size_t i) const
    {
        const float wi = w[i] * decay - step * __bfloat162float(x[i]);
        w[i] = wi;
        store1(wc, i, wi);
    }
};

template <typename D>
static mfsdp_status_t apply_launch(float *w, const __nv_bfloat16 *x, void *wc, size_t n,
                                   float decay, float step, cudaStream_t s)
{
    const muon_apply_op<D> op{w, x, (D *)wc, decay, step};
    /* x is the start of the 256-aligned workspace. */
    const bool vec = aligned16(w) && (wc == NULL || aligned16(wc));
    return ew_launch(op, n, vec, s, "muon_apply");
}

static mfsdp_status_t muon_check(mfsdp_cuda_ctx_t *ctx, float *w, float *mom, const float *g,
                                 void *w_comm, mfsdp_dtype_t comm_dtype, int64_t m, int64_t k,
                                 size_t nsplit, const int64_t *split, const mfsdp_muon_hp_t *hp,
                                 void *ws, size_t ws_bytes)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(w != NULL && mom != NULL && g != NULL);
    MFSDP_CHECK_ARG(ws != NULL);
    MFSDP_CHECK_ARG(m > 0 && k > 0);
    MFSDP_CHECK_ARG(nsplit == 0 || split != NULL);
    MFSDP_CHECK(mfsdp_kernel_check_muon_hp(hp));
    if (w_comm != NULL && float_dtype_size(comm_dtype) == 0) {
        MFSDP_WARN("muon: comm dtype must be float32, bfloat16 or float16, not %s",
                   mfsdp_dtype_name(comm_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    int64_t hmax = m;
    if (nsplit > 0) {
        int64_t sum = 0;
        hmax = 0;
        for (size_t i = 0; i < nsplit; i++) {
            if (split[i] <= 0 || split[i] > m - sum) {
                MFSDP_WARN("muon: row split %zu is %lld: blocks must be positive and sum to "
                           "m = %lld",
                           i, (long long)split[i], (long long)m);
                return MFSDP_ERR_INVALID_ARG;
            }
            sum += split[i];
            hmax = split[i] > hmax ? split[i] : hmax;
        }
        if (sum != m) {
            MFSDP_WARN("muon: row split sums to %lld, not m = %lld", (long long)sum, (long long)m);
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    ns_layout lay;
    mfsdp_status_t st = ns_layout_compute(1, hmax, k, &lay);
    if (st != MFSDP_OK) {
        MFSDP_WARN("muon: workspace size overflows for %lld x %lld", (long long)m, (long long)k);
        return st;
    }
    if (ws_bytes < lay.total) {
        MFSDP_WARN("muon: workspace too small: %zu bytes, need %zu", ws_bytes, lay.total);
        return MFSDP_ERR_MISMATCH;
    }
    if (((uintptr_t)ws & 255u) != 0) {
        MFSDP_WARN("muon: workspace must be 256-byte aligned (cudaMalloc is)");
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t bytes, cbytes = 0;
    if (mfsdp_mul_overflow((size_t)m * (size_t)k, sizeof(float), &bytes) ||
        (w_comm != NULL &&
         mfsdp_mul_overflow((size_t)m * (size_t)k, float_dtype_size(comm_dtype), &cbytes))) {
        MFSDP_WARN("muon: %lld x %lld floats overflow size_t", (long long)m, (long long)k);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(ws, ws_bytes, w, bytes) || ranges_overlap(ws, ws_bytes, mom, bytes) ||
        ranges_overlap(ws, ws_bytes, g, bytes) || ranges_overlap(w, bytes, mom, bytes) ||
        ranges_overlap(w_comm, cbytes, w, bytes) || ranges_overlap(w_comm, cbytes, mom, bytes)) {
        MFSDP_WARN("muon: workspace, weights, momentum, gradient or comm copy overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

} /* namespace mfsdp_cuda */

using namespace mfsdp_cuda;

extern "C" size_t mfsdp_cuda_muon_workspace_bytes(int64_t m, int64_t k)
{
    return mfsdp_cuda_ns_workspace_bytes(m, k);
}

extern "C" mfsdp_status_t
mfsdp_cuda_muon_update(mfsdp_cuda_ctx_t *ctx, float *w, float *mom, const float *g, void *w_comm,
                       mfsdp_dtype_t comm_dtype, int64_t m, int64_t k, size_t nsplit,
                       const int64_t *split, const mfsdp_muon_hp_t *hp, void *ws, size_t ws_bytes)
{
    MFSDP_CHECK(
        muon_check(ctx, w, mom, g, w_comm, comm_dtype, m, k, nsplit, split, hp, ws, ws_bytes));
    const size_t esz = w_comm != NULL ? float_dtype_size(comm_dtype) : 0;
    const float decay = 1.0f - hp->lr * hp->weight_decay;
    __nv_bfloat16 *u = (__nv_bfloat16 *)ws;
    size_t row0 = 0;
    for (size_t b = 0; b < (nsplit == 0 ? 1 : nsplit); b++) {
        const int64_t rows = nsplit == 0 ? m : split[b];
        const size_t off = row0 * (size_t)k;
        const size_t n = (size_t)rows * (size_t)k;
        ns_layout lay;
        MFSDP_CHECK(ns_layout_compute(1, rows, k, &lay));
        float *red = (float *)((char *)ws + lay.off_red);

        const bool vec = aligned16(mom + off) && aligned16(g + off);
        if (vec) {
            muon_mom_kernel<true><<<MFSDP_CUDA_NS_NRED, MFSDP_CUDA_THREADS, 0, ctx->stream>>>(
                mom + off, g + off, u, n, hp->momentum, hp->nesterov != 0, red);
        } else {
            muon_mom_kernel<false><<<MFSDP_CUDA_NS_NRED, MFSDP_CUDA_THREADS, 0, ctx->stream>>>(
                mom + off, g + off, u, n, hp->momentum, hp->nesterov != 0, red);
        }
        MFSDP_LAUNCH_CHECK("muon_momentum");

        const __nv_bfloat16 *xf = NULL;
        MFSDP_CHECK(ns_run(ctx, 1, rows, k, hp->ns_steps, ws, lay, &xf));

        const float step = hp->lr * mfsdp_muon_scale(rows, k, hp->scale);
        void *wc = w_comm != NULL ? (void *)((char *)w_comm + off * esz) : NULL;
        mfsdp_status_t st;
        if (wc == NULL) {
            st = apply_launch<none_t>(w + off, xf, NULL, n, decay, step, ctx->stream);
        } else if (comm_dtype == MFSDP_FLOAT32) {
            st = apply_launch<float>(w + off, xf, wc, n, decay, step, ctx->stream);
        } else if (comm_dtype == MFSDP_BFLOAT16) {
            st = apply_launch<__nv_bfloat16>(w + off, xf, wc, n, decay, step, ctx->stream);
        } else {
            st = apply_launch<__half>(w + off, xf, wc, n, decay, step, ctx->stream);
        }
        MFSDP_CHECK(st);
        row0 += (size_t)rows;
    }
    return MFSDP_OK;
}
