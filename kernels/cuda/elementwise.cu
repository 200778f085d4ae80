/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Element-wise CUDA kernels: casts, the fixed-order reduction of reduce-to-owner, AdamW
 * and the deterministic squared norm. 16-byte accesses on aligned data (cuda_common.cuh).
 */
#include "kernels/cuda/cuda_common.cuh"

#include <math.h>

namespace mfsdp_cuda
{

/* ---------------------------------------------------------------- casts */

template <typename S, typename D>
static mfsdp_status_t cast_launch(void *dst, const void *src, size_t n, cudaStream_t s)
{
    const cast_op<S, D> op{(const S *)src, (D *)dst};
    return ew_launch(op, n, aligned16(dst) && aligned16(src), s, "cast");
}

template <typename S>
static mfsdp_status_t cast_from(void *dst, mfsdp_dtype_t dd, const void *src, size_t n,
                                cudaStream_t s)
{
    switch (dd) {
    case MFSDP_FLOAT32:
        return cast_launch<S, float>(dst, src, n, s);
    case MFSDP_BFLOAT16:
        return cast_launch<S, __nv_bfloat16>(dst, src, n, s);
    case MFSDP_FLOAT16:
        return cast_launch<S, __half>(dst, src, n, s);
    default:
        return MFSDP_ERR_INVALID_ARG; /* unreachable: validated */
    }
}

/* ------------------------------------------------------- ordered reduction */

struct src_table {
    const void *p[MFSDP_CUDA_REDUCE_MAX_SRC];
};

/* Explicit _rn intrinsics: no fused multiply-add, so the bits equal the C reference. */
template <typename S> struct reduce_op {
    float *out;
    src_table src;
    int nsrc;
    int premul;
    int avg;
    int accumulate;
    float scalar;

    MFSDP_HD float term(float x) const
    {
        return premul ? mul_rn(x, scalar) : x;
    }
    MFSDP_HD float finish(float s, float prev) const
    {
        if (avg) {
            s = div_rn(s, (float)nsrc);
        }
        return accumulate ? add_rn(prev, s) : s;
    }
    MFSDP_HD void vec(size_t i) const
    {
        float s[8], x[8], o[8];
        load8((const S *)src.p[0] + i, s);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            s[j] = term(s[j]);
        }
        for (int r = 1; r < nsrc; r++) {
            load8((const S *)src.p[r] + i, x);
            MFSDP_UNROLL
            for (int j = 0; j < 8; j++) {
                s[j] = add_rn(s[j], term(x[j]));
            }
        }
        if (accumulate) {
            load8(out + i, o);
        }
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            o[j] = finish(s[j], accumulate ? o[j] : 0.0f);
        }
        store8(out + i, o);
    }
    MFSDP_HD void one(size_t i) const
    {
        float s = term(to_f32(((const S *)src.p[0])[i]));
        for (int r = 1; r < nsrc; r++) {
            s = add_rn(s, term(to_f32(((const S *)src.p[r])[i])));
        }
        out[i] = finish(s, accumulate ? out[i] : 0.0f);
    }
};

template <typename S>
static mfsdp_status_t reduce_launch(float *out, const void *const *src, int nsrc, size_t n,
                                    mfsdp_redop_t op, float scalar, int accumulate, cudaStream_t s)
{
    reduce_op<S> r{}; /* the unused tail of the source table is zero, not stack garbage */
    r.out = out;
    bool vec = aligned16(out);
    for (int i = 0; i < nsrc; i++) {
        r.src.p[i] = src[i];
        vec = vec && aligned16(src[i]);
    }
    r.nsrc = nsrc;
    r.premul = op == MFSDP_OP_PREMULSUM;
    r.avg = op == MFSDP_OP_AVG;
    r.accumulate = accumulate != 0;
    r.scalar = scalar;
    return ew_launch(r, n, vec, s, "reduce_ordered");
}

/* ------------------------------------------- reduce pipelines (executor ops) */

/* pout = (pin ? pin + v : v), v = x (times scalar for premulsum), as the CPU executor's
 * combine: explicit _rn operations, no contraction. pin may be pout (in place). */
template <typename S> struct combine_op {
    float *pout;
    const float *pin; /* NULL: the first term is absent */
    const S *x;
    int premul;
    float scalar;

    MFSDP_HD float term(float v) const
    {
        return premul ? mul_rn(v, scalar) : v;
    }
    MFSDP_HD void vec(size_t i) const
    {
        float v[8], p[8];
        load8(x + i, v);
        if (pin != NULL) {
            load8(pin + i, p);
        }
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            v[j] = pin != NULL ? add_rn(p[j], term(v[j])) : term(v[j]);
        }
        store8(pout + i, v);
    }
    MFSDP_HD void one(size_t i) const
    {
        const float v = term(to_f32(x[i]));
        pout[i] = pin != NULL ? add_rn(pin[i], v) : v;
    }
};

template <typename S>
static mfsdp_status_t combine_launch(float *pout, const float *pin, const void *x, size_t n,
                                     int premul, float scalar, cudaStream_t s)
{
    const combine_op<S> op{pout, pin, (const S *)x, premul, scalar};
    const bool vec = aligned16(pout) && aligned16(x) && (pin == NULL || aligned16(pin));
    return ew_launch(op, n, vec, s, "combine");
}

/* grad += avg ? s / world : s (the owner's accumulation of a reduced chunk). */
struct apply_op {
    float *grad;
    const float *s;
    int avg;
    float world;

    MFSDP_HD float term(float v) const
    {
        return avg ? div_rn(v, world) : v;
    }
    MFSDP_HD void vec(size_t i) const
    {
        float g[8], v[8];
        load8(grad + i, g);
        load8(s + i, v);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            g[j] = add_rn(g[j], term(v[j]));
        }
        store8(grad + i, g);
    }
    MFSDP_HD void one(size_t i) const
    {
        grad[i] = add_rn(grad[i], term(s[i]));
    }
};

/* x *= a */
struct scale_op {
    float *x;
    float a;

    MFSDP_HD void vec(size_t i) const
    {
        float v[8];
        load8(x + i, v);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            v[j] = mul_rn(v[j], a);
        }
        store8(x + i, v);
    }
    MFSDP_HD void one(size_t i) const
    {
        x[i] = mul_rn(x[i], a);
    }
};

/* y += a x; x = 0 (HSDP: a replicated contribution moved into the gradient). */
struct axpy_clear_op {
    float *y;
    float *x;
    float a;

    MFSDP_HD void vec(size_t i) const
    {
        float yv[8], xv[8];
        load8(y + i, yv);
        load8(x + i, xv);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            yv[j] = add_rn(yv[j], mul_rn(xv[j], a));
            xv[j] = 0.0f;
        }
        store8(y + i, yv);
        store8(x + i, xv);
    }
    MFSDP_HD void one(size_t i) const
    {
        y[i] = add_rn(y[i], mul_rn(x[i], a));
        x[i] = 0.0f;
    }
};

/* ------------------------------------------------------------------ AdamW */

template <typename D> struct adamw_op {
    float *w, *m, *v;
    const float *g;
    D *wc;
    /* The factorization of mfsdp_cpu_adamw_update(): lr / bc1 and 1 / sqrt(bc2) hoisted. */
    float b1, omb1, b2, omb2, decay, step, inv_sqrt_bc2, eps;

    MFSDP_HD void update(float &wi, float &mi, float &vi, float gi) const
    {
        mi = b1 * mi + omb1 * gi;
        vi = b2 * vi + omb2 * gi * gi;
        wi = wi * decay - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
    }
    MFSDP_HD void vec(size_t i) const
    {
        float wv[8], mv[8], vv[8], gv[8];
        load8(w + i, wv);
        load8(m + i, mv);
        load8(v + i, vv);
        load8(g + i, gv);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            update(wv[j], mv[j], vv[j], gv[j]);
        }
        store8(w + i, wv);
        store8(m + i, mv);
        store8(v + i, vv);
        store8(wc + i, wv);
    }
    MFSDP_HD void one(size_t i) const
    {
        float wi = w[i], mi = m[i], vi = v[i];
        update(wi, mi, vi, g[i]);
        w[i] = wi;
        m[i] = mi;
        v[i] = vi;
        store1(wc, i, wi);
    }
};

/* The per-call constants of adamw_op, in its member order (bias corrections in double on
 * the host, as the CPU kernel computes them). */
static void adamw_consts(const mfsdp_adamw_hp_t *hp, int64_t t, float (&c)[8])
{
    const float bc1 = (float)(1.0 - pow((double)hp->beta1, (double)t));
    const float bc2 = (float)(1.0 - pow((double)hp->beta2, (double)t));
    c[0] = hp->beta1;
    c[1] = 1.0f - hp->beta1;
    c[2] = hp->beta2;
    c[3] = 1.0f - hp->beta2;
    c[4] = 1.0f - hp->lr * hp->weight_decay;
    c[5] = hp->lr / bc1;
    c[6] = (float)(1.0 / sqrt((double)bc2));
    c[7] = hp->eps;
}

template <typename D>
static mfsdp_status_t adamw_launch(float *w, float *m, float *v, const float *g, void *wc, size_t n,
                                   const float (&c)[8], cudaStream_t s)
{
    const adamw_op<D> op{w, m, v, g, (D *)wc, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]};
    const bool vec = aligned16(w) && aligned16(m) && aligned16(v) && aligned16(g) &&
                     (wc == NULL || aligned16(wc));
    return ew_launch(op, n, vec, s, "adamw");
}

/* ------------------------------------------------------------ squared norm */

struct sq_op {
    const float *x;
    double acc;
    MFSDP_HD void vec(size_t i)
    {
        float v[8];
        load8(x + i, v);
        MFSDP_UNROLL
        for (int j = 0; j < 8; j++) {
            acc = dadd_rn(acc, dmul_rn((double)v[j], (double)v[j]));
        }
    }
    MFSDP_HD void one(size_t i)
    {
        const double d = x[i];
        acc = dadd_rn(acc, dmul_rn(d, d));
    }
};

template <bool VEC> __global__ void sq_partial_kernel(const float *x, size_t n, double *partials)
{
    __shared__ double sh[MFSDP_CUDA_THREADS];
    sq_op op{x, 0.0};
    for_each_chunk<VEC>(op, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x,
                        (size_t)gridDim.x * blockDim.x);
    const double s = block_tree_sum(sh, op.acc);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = s;
    }
}

/* One block of MFSDP_CUDA_SQ_NRED threads: fixed tree over the partials, then *acc += s. */
__global__ void sq_final_kernel(const double *partials, double *acc)
{
    __shared__ double sh[MFSDP_CUDA_SQ_NRED];
    const double s = block_tree_sum(sh, partials[threadIdx.x]);
    if (threadIdx.x == 0) {
        *acc = dadd_rn(*acc, s);
    }
}

} /* namespace mfsdp_cuda */

using namespace mfsdp_cuda;

extern "C" mfsdp_status_t mfsdp_cuda_cast(mfsdp_cuda_ctx_t *ctx, void *dst, mfsdp_dtype_t dst_dtype,
                                          const void *src, mfsdp_dtype_t src_dtype, size_t n)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(dst != NULL);
    MFSDP_CHECK_ARG(src != NULL);
    MFSDP_CHECK_ARG(n > 0);
    const size_t ds = float_dtype_size(dst_dtype), ss = float_dtype_size(src_dtype);
    if (ds == 0 || ss == 0) {
        MFSDP_WARN("cast supports float32, bfloat16 and float16, not %s -> %s",
                   mfsdp_dtype_name(src_dtype), mfsdp_dtype_name(dst_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t bytes;
    if (mfsdp_mul_overflow(n, ds > ss ? ds : ss, &bytes)) {
        MFSDP_WARN("cast of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(dst, n * ds, src, n * ss)) { /* both fit: bytes is the larger */
        MFSDP_WARN("cast: source and destination overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (dst_dtype == src_dtype) {
        MFSDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx->stream));
        return MFSDP_OK;
    }
    switch (src_dtype) {
    case MFSDP_FLOAT32:
        return cast_from<float>(dst, dst_dtype, src, n, ctx->stream);
    case MFSDP_BFLOAT16:
        return cast_from<__nv_bfloat16>(dst, dst_dtype, src, n, ctx->stream);
    default:
        return cast_from<__half>(dst, dst_dtype, src, n, ctx->stream);
    }
}

extern "C" mfsdp_status_t mfsdp_cuda_reduce_ordered(mfsdp_cuda_ctx_t *ctx, float *out,
                                                    const void *const *src, int nsrc,
                                                    mfsdp_dtype_t src_dtype, size_t n,
                                                    mfsdp_redop_t op, float scalar, int accumulate)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(out != NULL);
    MFSDP_CHECK_ARG(src != NULL);
    MFSDP_CHECK_ARG(nsrc > 0);
    MFSDP_CHECK_ARG(n > 0);
    MFSDP_CHECK_ARG(op == MFSDP_OP_SUM || op == MFSDP_OP_AVG || op == MFSDP_OP_PREMULSUM);
    const size_t es = float_dtype_size(src_dtype);
    if (es == 0) {
        MFSDP_WARN("reduce sources must be float32, bfloat16 or float16, not %s",
                   mfsdp_dtype_name(src_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    if (nsrc > MFSDP_CUDA_REDUCE_MAX_SRC) {
        MFSDP_WARN("reduce of %d sources: at most %d in one call", nsrc, MFSDP_CUDA_REDUCE_MAX_SRC);
        return MFSDP_ERR_UNSUPPORTED;
    }
    for (int i = 0; i < nsrc; i++) {
        if (src[i] == NULL) {
            MFSDP_WARN("invalid argument: reduce source %d is null", i);
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    size_t bytes;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("reduce of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    switch (src_dtype) {
    case MFSDP_FLOAT32:
        return reduce_launch<float>(out, src, nsrc, n, op, scalar, accumulate, ctx->stream);
    case MFSDP_BFLOAT16:
        return reduce_launch<__nv_bfloat16>(out, src, nsrc, n, op, scalar, accumulate, ctx->stream);
    default:
        return reduce_launch<__half>(out, src, nsrc, n, op, scalar, accumulate, ctx->stream);
    }
}

extern "C" mfsdp_status_t mfsdp_cuda_adamw_update(mfsdp_cuda_ctx_t *ctx, float *w, float *m,
                                                  float *v, const float *g, void *w_comm,
                                                  mfsdp_dtype_t comm_dtype, size_t n, int64_t t,
                                                  const mfsdp_adamw_hp_t *hp)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(w != NULL && m != NULL && v != NULL && g != NULL);
    MFSDP_CHECK_ARG(n > 0);
    MFSDP_CHECK(mfsdp_kernel_check_adamw_hp(hp, t));
    if (w_comm != NULL && float_dtype_size(comm_dtype) == 0) {
        MFSDP_WARN("adamw comm dtype must be float32, bfloat16 or float16, not %s",
                   mfsdp_dtype_name(comm_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t bytes, cbytes = 0;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes) ||
        (w_comm != NULL && mfsdp_mul_overflow(n, float_dtype_size(comm_dtype), &cbytes))) {
        MFSDP_WARN("adamw of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(w, bytes, m, bytes) || ranges_overlap(w, bytes, v, bytes) ||
        ranges_overlap(m, bytes, v, bytes) || ranges_overlap(w_comm, cbytes, w, bytes) ||
        ranges_overlap(w_comm, cbytes, m, bytes) || ranges_overlap(w_comm, cbytes, v, bytes)) {
        MFSDP_WARN("adamw: weights, moments or comm copy overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    float c[8];
    adamw_consts(hp, t, c);
    if (w_comm == NULL) {
        return adamw_launch<none_t>(w, m, v, g, NULL, n, c, ctx->stream);
    }
    switch (comm_dtype) {
    case MFSDP_FLOAT32:
        return adamw_launch<float>(w, m, v, g, w_comm, n, c, ctx->stream);
    case MFSDP_BFLOAT16:
        return adamw_launch<__nv_bfloat16>(w, m, v, g, w_comm, n, c, ctx->stream);
    default:
        return adamw_launch<__half>(w, m, v, g, w_comm, n, c, ctx->stream);
    }
}

extern "C" mfsdp_status_t mfsdp_cuda_combine(mfsdp_cuda_ctx_t *ctx, float *pout, const float *pin,
                                             const void *x, mfsdp_dtype_t dtype, size_t n,
                                             mfsdp_redop_t op, float scalar)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(pout != NULL);
    MFSDP_CHECK_ARG(x != NULL);
    MFSDP_CHECK_ARG(n > 0);
    MFSDP_CHECK_ARG(op == MFSDP_OP_SUM || op == MFSDP_OP_AVG || op == MFSDP_OP_PREMULSUM);
    const size_t es = float_dtype_size(dtype);
    if (es == 0) {
        MFSDP_WARN("combine: contributions must be float32, bfloat16 or float16, not %s",
                   mfsdp_dtype_name(dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t bytes;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("combine of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(pout, bytes, x, n * es) ||
        (pin != NULL && pin != pout && ranges_overlap(pout, bytes, pin, bytes))) {
        MFSDP_WARN("combine: the output overlaps an input (other than in place)");
        return MFSDP_ERR_INVALID_ARG;
    }
    const int premul = op == MFSDP_OP_PREMULSUM;
    switch (dtype) {
    case MFSDP_FLOAT32:
        return combine_launch<float>(pout, pin, x, n, premul, scalar, ctx->stream);
    case MFSDP_BFLOAT16:
        return combine_launch<__nv_bfloat16>(pout, pin, x, n, premul, scalar, ctx->stream);
    default:
        return combine_launch<__half>(pout, pin, x, n, premul, scalar, ctx->stream);
    }
}

extern "C" mfsdp_status_t mfsdp_cuda_apply(mfsdp_cuda_ctx_t *ctx, float *grad, const float *s,
                                           size_t n, mfsdp_redop_t op, int world)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(grad != NULL && s != NULL);
    MFSDP_CHECK_ARG(n > 0);
    MFSDP_CHECK_ARG(world >= 1);
    size_t bytes;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("apply of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(grad, bytes, s, bytes)) {
        MFSDP_WARN("apply: the gradient overlaps the reduced values");
        return MFSDP_ERR_INVALID_ARG;
    }
    const apply_op a{grad, s, op == MFSDP_OP_AVG, (float)world};
    return ew_launch(a, n, aligned16(grad) && aligned16(s), ctx->stream, "apply");
}

extern "C" mfsdp_status_t mfsdp_cuda_scale(mfsdp_cuda_ctx_t *ctx, float *x, size_t n, float a)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(x != NULL);
    MFSDP_CHECK_ARG(n > 0);
    const scale_op op{x, a};
    return ew_launch(op, n, aligned16(x), ctx->stream, "scale");
}

extern "C" mfsdp_status_t mfsdp_cuda_axpy_clear(mfsdp_cuda_ctx_t *ctx, float *y, float *x, size_t n,
                                                float a)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(y != NULL && x != NULL);
    MFSDP_CHECK_ARG(n > 0);
    size_t bytes;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("axpy_clear of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (ranges_overlap(y, bytes, x, bytes)) {
        MFSDP_WARN("axpy_clear: y and x overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    const axpy_clear_op op{y, x, a};
    return ew_launch(op, n, aligned16(y) && aligned16(x), ctx->stream, "axpy_clear");
}

extern "C" size_t mfsdp_cuda_sqnorm_workspace_bytes(void)
{
    return MFSDP_CUDA_SQ_NRED * sizeof(double);
}

extern "C" mfsdp_status_t mfsdp_cuda_sqnorm_accumulate(mfsdp_cuda_ctx_t *ctx, const float *x,
                                                       size_t n, double *acc, void *ws,
                                                       size_t ws_bytes)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(x != NULL);
    MFSDP_CHECK_ARG(acc != NULL);
    MFSDP_CHECK_ARG(ws != NULL);
    MFSDP_CHECK_ARG(n > 0);
    if (ws_bytes < mfsdp_cuda_sqnorm_workspace_bytes()) {
        MFSDP_WARN("sqnorm workspace too small: %zu bytes, need %zu", ws_bytes,
                   mfsdp_cuda_sqnorm_workspace_bytes());
        return MFSDP_ERR_MISMATCH;
    }
    if (((uintptr_t)ws & 7u) != 0 || ((uintptr_t)acc & 7u) != 0) {
        MFSDP_WARN("sqnorm workspace and accumulator must be 8-byte aligned");
        return MFSDP_ERR_INVALID_ARG;
    }
    size_t bytes;
    if (mfsdp_mul_overflow(n, sizeof(float), &bytes)) {
        MFSDP_WARN("sqnorm of %zu elements overflows size_t", n);
        return MFSDP_ERR_OVERFLOW;
    }
    double *partials = (double *)ws;
    if (aligned16(x)) {
        sq_partial_kernel<true>
            <<<MFSDP_CUDA_SQ_NRED, MFSDP_CUDA_THREADS, 0, ctx->stream>>>(x, n, partials);
    } else {
        sq_partial_kernel<false>
            <<<MFSDP_CUDA_SQ_NRED, MFSDP_CUDA_THREADS, 0, ctx->stream>>>(x, n, partials);
    }
    MFSDP_LAUNCH_CHECK("sqnorm_partial");
    sq_final_kernel<<<1, MFSDP_CUDA_SQ_NRED, 0, ctx->stream>>>(partials, acc);
    MFSDP_LAUNCH_CHECK("sqnorm_final");
    return MFSDP_OK;
}
