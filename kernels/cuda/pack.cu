/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Strided pack/unpack between FSDP's rank-major pieces and a contiguous matrix
 * (docs/design.md, "FSDP2's byte layout"): pieces (r, i) sit at stride S, so the whole parameter is
 * one 2-D copy (cudaMemcpy2DAsync) plus one copy for a partial last piece, and the padding rows are
 * zeroed with cudaMemset2DAsync. No kernel.
 */
#include "kernels/cuda/cuda_common.cuh"

#include <limits.h>

namespace mfsdp_cuda
{

/* Pitches above this go through one copy per rank (cudaDevAttrMaxPitch is 2^31 - 1 on
 * the GPUs we target; staying below it avoids a device query per call). */
#define MFSDP_CUDA_MAX_PITCH ((size_t)INT_MAX)

struct pack_plan {
    size_t piece; /* c * row_bytes */
    size_t nfull; /* ranks whose piece is all real rows */
    size_t rem;   /* real bytes of the partial piece (rank nfull), 0 if none */
    size_t world;
    size_t stride;
    size_t offset;
};

static mfsdp_status_t pack_check(mfsdp_cuda_ctx_t *ctx, const void *a, const void *b,
                                 const mfsdp_strided_geom_t *g, pack_plan *p)
{
    MFSDP_CHECK_ARG(ctx != NULL);
    MFSDP_CHECK_ARG(a != NULL);
    MFSDP_CHECK_ARG(b != NULL);
    MFSDP_CHECK_ARG(g != NULL);
    MFSDP_CHECK_ARG(g->world > 0);
    MFSDP_CHECK_ARG(g->rows > 0);
    MFSDP_CHECK_ARG(g->rows_per_rank > 0);
    MFSDP_CHECK_ARG(g->row_bytes > 0);
    const size_t world = (size_t)g->world, c = (size_t)g->rows_per_rank;
    const size_t rows = (size_t)g->rows;
    size_t cw, piece, end, total, full_bytes;
    if (mfsdp_mul_overflow(c, world, &cw) || mfsdp_mul_overflow(c, g->row_bytes, &piece) ||
        mfsdp_add_overflow(g->offset, piece, &end) ||
        mfsdp_mul_overflow(world, g->rank_stride, &total) ||
        mfsdp_mul_overflow(rows, g->row_bytes, &full_bytes)) {
        MFSDP_WARN("pack geometry overflows size_t (world %d, rows %lld, c %lld, row %zu bytes)",
                   g->world, (long long)g->rows, (long long)g->rows_per_rank, g->row_bytes);
        return MFSDP_ERR_OVERFLOW;
    }
    if (cw < rows || cw - rows >= world) { /* c must be ceil(rows / world) */
        MFSDP_WARN("pack geometry: rows_per_rank %lld is not ceil(%lld / %d)",
                   (long long)g->rows_per_rank, (long long)g->rows, g->world);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (end > g->rank_stride) {
        MFSDP_WARN("pack geometry: piece [%zu, %zu) exceeds the rank stride %zu", g->offset, end,
                   g->rank_stride);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (ranges_overlap(a, full_bytes, b, total)) {
        MFSDP_WARN("pack: the full matrix and the fsdp buffer overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    p->piece = piece;
    p->nfull = rows / c;
    p->rem = (rows - p->nfull * c) * g->row_bytes;
    p->world = world;
    p->stride = g->rank_stride;
    p->offset = g->offset;
    return MFSDP_OK;
}

/* dst[i * dpitch] <- src[i * spitch], width bytes, h rows. */
static mfsdp_status_t copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                             size_t h, cudaStream_t s)
{
    if (h == 0) {
        return MFSDP_OK;
    }
    if (dpitch <= MFSDP_CUDA_MAX_PITCH && spitch <= MFSDP_CUDA_MAX_PITCH) {
        MFSDP_CUDA_CHECK(
            cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, h, cudaMemcpyDeviceToDevice, s));
        return MFSDP_OK;
    }
    for (size_t i = 0; i < h; i++) {
        MFSDP_CUDA_CHECK(cudaMemcpyAsync((char *)dst + i * dpitch, (const char *)src + i * spitch,
                                         width, cudaMemcpyDeviceToDevice, s));
    }
    return MFSDP_OK;
}

static mfsdp_status_t zero2d(void *dst, size_t pitch, size_t width, size_t h, cudaStream_t s)
{
    if (h == 0 || width == 0) {
        return MFSDP_OK;
    }
    if (pitch <= MFSDP_CUDA_MAX_PITCH) {
        MFSDP_CUDA_CHECK(cudaMemset2DAsync(dst, pitch, 0, width, h, s));
        return MFSDP_OK;
    }
    for (size_t i = 0; i < h; i++) {
        MFSDP_CUDA_CHECK(cudaMemsetAsync((char *)dst + i * pitch, 0, width, s));
    }
    return MFSDP_OK;
}

} /* namespace mfsdp_cuda */

using namespace mfsdp_cuda;

extern "C" mfsdp_status_t mfsdp_cuda_pack(mfsdp_cuda_ctx_t *ctx, void *full, const void *fsdp_buf,
                                          const mfsdp_strided_geom_t *geom)
{
    pack_plan p;
    MFSDP_CHECK(pack_check(ctx, full, fsdp_buf, geom, &p));
    const char *src = (const char *)fsdp_buf + p.offset;
    char *dst = (char *)full;
    MFSDP_CHECK(copy2d(dst, p.piece, src, p.stride, p.piece, p.nfull, ctx->stream));
    if (p.rem > 0) {
        MFSDP_CUDA_CHECK(cudaMemcpyAsync(dst + p.nfull * p.piece, src + p.nfull * p.stride, p.rem,
                                         cudaMemcpyDeviceToDevice, ctx->stream));
    }
    return MFSDP_OK;
}

extern "C" mfsdp_status_t mfsdp_cuda_unpack(mfsdp_cuda_ctx_t *ctx, void *fsdp_buf, const void *full,
                                            const mfsdp_strided_geom_t *geom)
{
    pack_plan p;
    MFSDP_CHECK(pack_check(ctx, fsdp_buf, full, geom, &p));
    char *dst = (char *)fsdp_buf + p.offset;
    const char *src = (const char *)full;
    MFSDP_CHECK(copy2d(dst, p.stride, src, p.piece, p.piece, p.nfull, ctx->stream));
    size_t first_empty = p.nfull;
    if (p.rem > 0) {
        char *piece = dst + p.nfull * p.stride;
        MFSDP_CUDA_CHECK(cudaMemcpyAsync(piece, src + p.nfull * p.piece, p.rem,
                                         cudaMemcpyDeviceToDevice, ctx->stream));
        MFSDP_CUDA_CHECK(cudaMemsetAsync(piece + p.rem, 0, p.piece - p.rem, ctx->stream));
        first_empty++;
    }
    /* Ranks past the last real row hold only padding. */
    return zero2d(dst + first_empty * p.stride, p.stride, p.piece, p.world - first_empty,
                  ctx->stream);
}
