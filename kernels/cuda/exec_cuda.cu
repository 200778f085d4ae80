/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The device executor (kernels/executor.h): every op of the runtime's local work enqueued on
 * one CUDA stream — the intercepted call's (set_stream) — with the kernels of kernels/cuda/
 * and cudaMemcpyAsync / cudaMemsetAsync for device-to-device copies. Nothing waits for the
 * device except what must hand a value to the host: sqnorm (the clipping norm), download,
 * mem_alloc (creation) and sync. Buffers are device memory.
 *
 * Semantics are the CPU executor's (kernels/cpu/exec_cpu.c): combine, apply, scale,
 * axpy_clear, casts and the ordered reduction are bitwise equal to it; Newton-Schulz runs in
 * bf16 on cuBLAS (kernels_cuda.h), so muon is not.
 */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/executor.h"

#include <stdlib.h>

namespace
{

struct exec_cuda {
    mfsdp_exec_t base;
    mfsdp_cuda_ctx_t *cu;
    int device;
    double *acc; /* device: the sqnorm accumulator, then its workspace */
    void *sq_ws;
    size_t sq_ws_bytes;
    cudaEvent_t join; /* orders a new stream after the work queued on the previous one */
};

exec_cuda *of(mfsdp_exec_t *e)
{
    return reinterpret_cast<exec_cuda *>(e);
}

cudaStream_t stream_of(mfsdp_exec_t *e)
{
    void *s = NULL;
    mfsdp_cuda_ctx_get_stream(of(e)->cu, &s);
    return (cudaStream_t)s;
}

/* Workspace alignment the cuBLAS Newton-Schulz needs; the arena aligns to 64 bytes only, so
 * muon_workspace asks for this much slack and muon aligns the pointer up. */
constexpr size_t WS_ALIGN = 256;

/* The context's buffers (arena, staging) are shared by every stream it is handed (a shard
 * group's and, under HSDP, its replicate all-reduce's; the step's): a new stream first waits
 * for what was queued on the previous one. A stream being captured into a CUDA graph is
 * refused: the owners' step decisions (triggers, step counts, the schedule) are taken on the
 * host at each call, and a replayed graph would repeat them wrongly. */
mfsdp_status_t cu_set_stream(mfsdp_exec_t *e, void *stream)
{
    exec_cuda *c = of(e);
    cudaStream_t next = (cudaStream_t)stream, prev = stream_of(e);
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    MFSDP_CUDA_CHECK(cudaStreamIsCapturing(next, &cap));
    if (cap != cudaStreamCaptureStatusNone) {
        MFSDP_WARN("a call on a stream that is being captured into a CUDA graph: mfsdp's owner "
                   "collectives and steps cannot be captured (their decisions are taken on the "
                   "host at each call); run FSDP's collectives outside the capture");
        return MFSDP_ERR_UNSUPPORTED;
    }
    if (next != prev) {
        if (c->join == NULL) {
            MFSDP_CUDA_CHECK(cudaEventCreateWithFlags(&c->join, cudaEventDisableTiming));
        }
        MFSDP_CUDA_CHECK(cudaEventRecord(c->join, prev));
        MFSDP_CUDA_CHECK(cudaStreamWaitEvent(next, c->join, 0));
    }
    return mfsdp_cuda_ctx_set_stream(c->cu, stream);
}

mfsdp_status_t cu_copy(mfsdp_exec_t *e, void *dst, const void *src, size_t bytes)
{
    MFSDP_CHECK_ARG(bytes == 0 || (dst != NULL && src != NULL));
    if (bytes == 0 || dst == src) {
        return MFSDP_OK;
    }
    if (mfsdp_cuda::ranges_overlap(dst, bytes, src, bytes)) {
        /* cudaMemcpyAsync does not define overlapping copies; the runtime never makes one */
        MFSDP_WARN("device copy of %zu bytes: source and destination overlap", bytes);
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(e)));
    return MFSDP_OK;
}

mfsdp_status_t cu_zero(mfsdp_exec_t *e, void *dst, size_t bytes)
{
    MFSDP_CHECK_ARG(bytes == 0 || dst != NULL);
    if (bytes != 0) {
        MFSDP_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_of(e)));
    }
    return MFSDP_OK;
}

mfsdp_status_t cu_upload(mfsdp_exec_t *e, void *dst, const void *host, size_t bytes)
{
    MFSDP_CHECK_ARG(bytes == 0 || (dst != NULL && host != NULL));
    if (bytes != 0) {
        /* From pageable memory the bytes are staged before the call returns: the caller may
         * reuse its buffer at once. */
        MFSDP_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_of(e)));
    }
    return MFSDP_OK;
}

mfsdp_status_t cu_download(mfsdp_exec_t *e, void *host, const void *src, size_t bytes)
{
    MFSDP_CHECK_ARG(bytes == 0 || (host != NULL && src != NULL));
    if (bytes != 0) {
        cudaStream_t s = stream_of(e);
        MFSDP_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, s));
        MFSDP_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    return MFSDP_OK;
}

mfsdp_status_t cu_mem_alloc(mfsdp_exec_t *e, size_t bytes, void **ptr_p)
{
    MFSDP_CHECK_ARG(ptr_p != NULL);
    if (bytes == 0) {
        *ptr_p = NULL;
        return MFSDP_OK;
    }
    void *p = NULL;
    cudaError_t ce = cudaMalloc(&p, bytes);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaMalloc of %zu bytes on device %d failed: %s", bytes, of(e)->device,
                   cudaGetErrorString(ce));
        return ce == cudaErrorMemoryAllocation ? MFSDP_ERR_NO_MEMORY : MFSDP_ERR_CUDA;
    }
    cudaStream_t s = stream_of(e);
    ce = cudaMemsetAsync(p, 0, bytes, s);
    if (ce == cudaSuccess) {
        ce = cudaStreamSynchronize(s);
    }
    if (ce != cudaSuccess) {
        MFSDP_WARN("zeroing %zu bytes of new device memory failed: %s", bytes,
                   cudaGetErrorString(ce));
        cudaFree(p);
        return MFSDP_ERR_CUDA;
    }
    *ptr_p = p;
    return MFSDP_OK;
}

void cu_mem_free(mfsdp_exec_t *e, void *ptr)
{
    (void)e;
    if (ptr != NULL) {
        cudaError_t ce = cudaFree(ptr);
        if (ce != cudaSuccess) {
            MFSDP_WARN("cudaFree failed: %s", cudaGetErrorString(ce));
        }
    }
}

mfsdp_status_t cu_cast(mfsdp_exec_t *e, void *dst, mfsdp_dtype_t dd, const void *src,
                       mfsdp_dtype_t sd, size_t n)
{
    return mfsdp_cuda_cast(of(e)->cu, dst, dd, src, sd, n);
}

mfsdp_status_t cu_pack(mfsdp_exec_t *e, void *full, const void *buf,
                       const mfsdp_strided_geom_t *geom)
{
    return mfsdp_cuda_pack(of(e)->cu, full, buf, geom);
}

mfsdp_status_t cu_unpack(mfsdp_exec_t *e, void *buf, const void *full,
                         const mfsdp_strided_geom_t *geom)
{
    return mfsdp_cuda_unpack(of(e)->cu, buf, full, geom);
}

/* The element-wise ops below accept n == 0 as the CPU executor does. */
mfsdp_status_t cu_combine(mfsdp_exec_t *e, float *pout, const float *pin, const void *x,
                          mfsdp_dtype_t dtype, size_t n, mfsdp_redop_t op, float scalar)
{
    MFSDP_CHECK_ARG(pout != NULL && (x != NULL || n == 0));
    MFSDP_CHECK_ARG(dtype == MFSDP_FLOAT32 || dtype == MFSDP_BFLOAT16 || dtype == MFSDP_FLOAT16);
    if (n == 0) {
        return MFSDP_OK;
    }
    return mfsdp_cuda_combine(of(e)->cu, pout, pin, x, dtype, n, op, scalar);
}

mfsdp_status_t cu_apply(mfsdp_exec_t *e, float *grad, const float *s, size_t n, mfsdp_redop_t op,
                        int world)
{
    MFSDP_CHECK_ARG((grad != NULL && s != NULL) || n == 0);
    MFSDP_CHECK_ARG(world >= 1);
    if (n == 0) {
        return MFSDP_OK;
    }
    return mfsdp_cuda_apply(of(e)->cu, grad, s, n, op, world);
}

mfsdp_status_t cu_reduce_ordered(mfsdp_exec_t *e, float *out, const void *const *src, int nsrc,
                                 mfsdp_dtype_t dtype, size_t n, mfsdp_redop_t op, float scalar,
                                 int accumulate)
{
    return mfsdp_cuda_reduce_ordered(of(e)->cu, out, src, nsrc, dtype, n, op, scalar, accumulate);
}

mfsdp_status_t cu_scale(mfsdp_exec_t *e, float *x, size_t n, float a)
{
    MFSDP_CHECK_ARG(x != NULL || n == 0);
    if (n == 0) {
        return MFSDP_OK;
    }
    return mfsdp_cuda_scale(of(e)->cu, x, n, a);
}

mfsdp_status_t cu_axpy_clear(mfsdp_exec_t *e, float *y, float *x, size_t n, float a)
{
    MFSDP_CHECK_ARG((y != NULL && x != NULL) || n == 0);
    if (n == 0) {
        return MFSDP_OK;
    }
    return mfsdp_cuda_axpy_clear(of(e)->cu, y, x, n, a);
}

/* The one value the host needs from the device in the step (clipping): wait for it. */
mfsdp_status_t cu_sqnorm(mfsdp_exec_t *e, const float *x, size_t n, double *acc)
{
    exec_cuda *c = of(e);
    MFSDP_CHECK_ARG(x != NULL && acc != NULL && n > 0);
    cudaStream_t s = stream_of(e);
    MFSDP_CUDA_CHECK(cudaMemcpyAsync(c->acc, acc, sizeof(double), cudaMemcpyHostToDevice, s));
    MFSDP_CHECK(mfsdp_cuda_sqnorm_accumulate(c->cu, x, n, c->acc, c->sq_ws, c->sq_ws_bytes));
    double v = 0.0;
    MFSDP_CUDA_CHECK(cudaMemcpyAsync(&v, c->acc, sizeof(double), cudaMemcpyDeviceToHost, s));
    MFSDP_CUDA_CHECK(cudaStreamSynchronize(s));
    *acc = v;
    return MFSDP_OK;
}

size_t cu_muon_workspace(mfsdp_exec_t *e, int64_t m, int64_t k)
{
    (void)e;
    size_t bytes = mfsdp_cuda_muon_workspace_bytes(m, k), total;
    if (bytes == 0 || mfsdp_add_overflow(bytes, WS_ALIGN + sizeof(float) - 1, &total)) {
        return 0;
    }
    return total / sizeof(float);
}

mfsdp_status_t cu_muon(mfsdp_exec_t *e, float *w, float *mom, const float *g, void *w_comm,
                       mfsdp_dtype_t comm_dtype, int64_t m, int64_t k, size_t nsplit,
                       const int64_t *split, const mfsdp_muon_hp_t *hp, float *ws, size_t ws_elems)
{
    MFSDP_CHECK_ARG(ws != NULL);
    size_t bytes;
    if (mfsdp_mul_overflow(ws_elems, sizeof(float), &bytes)) {
        return MFSDP_ERR_OVERFLOW;
    }
    size_t pad = (WS_ALIGN - ((uintptr_t)ws & (WS_ALIGN - 1))) & (WS_ALIGN - 1);
    if (bytes < pad) {
        MFSDP_WARN("muon workspace of %zu bytes cannot be aligned to %zu", bytes, WS_ALIGN);
        return MFSDP_ERR_MISMATCH;
    }
    return mfsdp_cuda_muon_update(of(e)->cu, w, mom, g, w_comm, comm_dtype, m, k, nsplit, split, hp,
                                  (char *)ws + pad, bytes - pad);
}

mfsdp_status_t cu_adamw(mfsdp_exec_t *e, float *w, float *m, float *v, const float *g, void *w_comm,
                        mfsdp_dtype_t comm_dtype, size_t n, int64_t t, const mfsdp_adamw_hp_t *hp)
{
    return mfsdp_cuda_adamw_update(of(e)->cu, w, m, v, g, w_comm, comm_dtype, n, t, hp);
}

mfsdp_status_t cu_sync(mfsdp_exec_t *e)
{
    MFSDP_CUDA_CHECK(cudaStreamSynchronize(stream_of(e)));
    return MFSDP_OK;
}

void cu_destroy(mfsdp_exec_t *e)
{
    exec_cuda *c = of(e);
    if (c == NULL) {
        return;
    }
    mfsdp_cuda_ctx_destroy(c->cu); /* waits for the stream first */
    if (c->acc != NULL) {
        cudaFree(c->acc);
    }
    if (c->join != NULL) {
        cudaEventDestroy(c->join);
    }
    free(c);
}

const mfsdp_exec_ops_t cuda_ops = {
    "cuda",            /* name */
    1,                 /* device_memory */
    cu_set_stream,     /* set_stream */
    cu_copy,           /* copy */
    cu_zero,           /* zero */
    cu_upload,         /* upload */
    cu_download,       /* download */
    cu_mem_alloc,      /* mem_alloc */
    cu_mem_free,       /* mem_free */
    cu_cast,           /* cast */
    cu_pack,           /* pack */
    cu_unpack,         /* unpack */
    cu_combine,        /* combine */
    cu_apply,          /* apply */
    cu_reduce_ordered, /* reduce_ordered */
    cu_scale,          /* scale */
    cu_axpy_clear,     /* axpy_clear */
    cu_sqnorm,         /* sqnorm */
    cu_muon,           /* muon */
    cu_adamw,          /* adamw */
    cu_muon_workspace, /* muon_workspace */
    cu_sync,           /* sync */
    cu_destroy,        /* destroy */
};

} /* namespace */

extern "C" mfsdp_status_t mfsdp_exec_cuda_create(int device, mfsdp_exec_t **e_p)
{
    MFSDP_CHECK_ARG(e_p != NULL && device >= 0);
    MFSDP_CUDA_CHECK(cudaSetDevice(device));
    exec_cuda *c = (exec_cuda *)calloc(1, sizeof(*c));
    if (c == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    c->base.ops = &cuda_ops;
    c->device = device;
    mfsdp_status_t st = mfsdp_cuda_ctx_create(NULL, &c->cu);
    if (st != MFSDP_OK) {
        free(c);
        return st;
    }
    /* One allocation: the accumulator (8 bytes, padded to 256) then the sqnorm workspace. */
    c->sq_ws_bytes = mfsdp_cuda_sqnorm_workspace_bytes();
    void *p = NULL;
    cudaError_t ce = cudaMalloc(&p, WS_ALIGN + c->sq_ws_bytes);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaMalloc of the executor's %zu-byte scratch failed: %s",
                   WS_ALIGN + c->sq_ws_bytes, cudaGetErrorString(ce));
        mfsdp_cuda_ctx_destroy(c->cu);
        free(c);
        return MFSDP_ERR_CUDA;
    }
    c->acc = (double *)p;
    c->sq_ws = (char *)p + WS_ALIGN;
    *e_p = &c->base;
    return MFSDP_OK;
}
