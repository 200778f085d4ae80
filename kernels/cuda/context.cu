/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA context: a stream, a cuBLAS handle bound to it and cuBLAS' own workspace. */
#include "kernels/cuda/cuda_common.cuh"

#include <stdlib.h>

/* cuBLAS recommends 32 MiB of workspace on Hopper (4 MiB is enough before it). */
#define MFSDP_CUBLAS_WS_BYTES ((size_t)32 << 20)

extern "C" mfsdp_status_t mfsdp_cuda_ctx_create(void *stream, mfsdp_cuda_ctx_t **ctx_p)
{
    MFSDP_CHECK_ARG(ctx_p != NULL);
    mfsdp_status_t st = MFSDP_OK;
    cudaError_t ce;
    cublasStatus_t bs;
    mfsdp_cuda_ctx_t *ctx = (mfsdp_cuda_ctx_t *)calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        MFSDP_WARN("cannot allocate a cuda context");
        return MFSDP_ERR_NO_MEMORY;
    }
    ctx->stream = (cudaStream_t)stream;
    ce = cudaGetDevice(&ctx->device);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaGetDevice failed: %s", cudaGetErrorString(ce));
        st = MFSDP_ERR_CUDA;
        goto out_free;
    }
    bs = cublasCreate(&ctx->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        MFSDP_WARN("cublasCreate failed: %s", cublasGetStatusString(bs));
        st = MFSDP_ERR_CUDA;
        goto out_free;
    }
    ce = cudaMalloc(&ctx->blas_ws, MFSDP_CUBLAS_WS_BYTES);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaMalloc of %zu bytes of cublas workspace failed: %s", MFSDP_CUBLAS_WS_BYTES,
                   cudaGetErrorString(ce));
        st = MFSDP_ERR_CUDA;
        goto out_blas;
    }
    ctx->blas_ws_bytes = MFSDP_CUBLAS_WS_BYTES;
    bs = cublasSetStream(ctx->blas, ctx->stream);
    if (bs == CUBLAS_STATUS_SUCCESS) {
        /* After cublasSetStream, which resets the workspace to cuBLAS' default pool. */
        bs = cublasSetWorkspace(ctx->blas, ctx->blas_ws, ctx->blas_ws_bytes);
    }
    if (bs == CUBLAS_STATUS_SUCCESS) {
        bs = cublasSetMathMode(ctx->blas, CUBLAS_DEFAULT_MATH);
    }
    if (bs != CUBLAS_STATUS_SUCCESS) {
        MFSDP_WARN("cublas stream/workspace setup failed: %s", cublasGetStatusString(bs));
        st = MFSDP_ERR_CUDA;
        goto out_ws;
    }
    *ctx_p = ctx;
    return MFSDP_OK;

out_ws:
    cudaFree(ctx->blas_ws);
out_blas:
    cublasDestroy(ctx->blas);
out_free:
    free(ctx);
    return st;
}

extern "C" mfsdp_status_t mfsdp_cuda_ctx_destroy(mfsdp_cuda_ctx_t *ctx)
{
    if (ctx == NULL) {
        return MFSDP_OK;
    }
    mfsdp_status_t st = MFSDP_OK;
    cudaError_t ce = cudaStreamSynchronize(ctx->stream);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaStreamSynchronize failed: %s", cudaGetErrorString(ce));
        st = MFSDP_ERR_CUDA;
    }
    cublasStatus_t bs = cublasDestroy(ctx->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        MFSDP_WARN("cublasDestroy failed: %s", cublasGetStatusString(bs));
        st = MFSDP_ERR_CUDA;
    }
    ce = cudaFree(ctx->blas_ws);
    if (ce != cudaSuccess) {
        MFSDP_WARN("cudaFree of the cublas workspace failed: %s", cudaGetErrorString(ce));
        st = MFSDP_ERR_CUDA;
    }
    free(ctx);
    return st;
}

extern "C" mfsdp_status_t mfsdp_cuda_ctx_set_stream(mfsdp_cuda_ctx_t *ctx, void *stream)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    if ((cudaStream_t)stream == ctx->stream) {
        return MFSDP_OK;
    }
    MFSDP_CUBLAS_CHECK(cublasSetStream(ctx->blas, (cudaStream_t)stream));
    /* cublasSetStream drops a user workspace: hand ours back. */
    MFSDP_CUBLAS_CHECK(cublasSetWorkspace(ctx->blas, ctx->blas_ws, ctx->blas_ws_bytes));
    ctx->stream = (cudaStream_t)stream;
    return MFSDP_OK;
}

extern "C" mfsdp_status_t mfsdp_cuda_ctx_get_stream(const mfsdp_cuda_ctx_t *ctx, void **stream_p)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(stream_p != NULL);
    *stream_p = (void *)ctx->stream;
    return MFSDP_OK;
}
