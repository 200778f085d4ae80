/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Strided pack/unpack between FSDP2's rank-major buffer and a contiguous full matrix
 * (docs/design.md, "FSDP2's byte layout"), and the squared norm used by global-norm clipping.
 */
#include <string.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "mfsdp/kernels.h"

/* Validate a strided geometry: c = ceil(N0 / n), a piece fits inside its rank block and the
 * whole buffer is addressable. */
static mfsdp_status_t geom_check(const void *full, const void *buf, const mfsdp_strided_geom_t *g)
{
    size_t piece;
    size_t end;
    size_t last;
    size_t full_bytes;
    if (full == NULL || buf == NULL || g == NULL) {
        MFSDP_WARN("pack: null %s", g == NULL ? "geometry" : full == NULL ? "matrix" : "buffer");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (g->world < 1 || g->rows < 1 || g->rows_per_rank < 1 || g->row_bytes == 0) {
        MFSDP_WARN("pack: invalid geometry world %d rows %lld rows_per_rank %lld row_bytes %zu",
                   g->world, (long long)g->rows, (long long)g->rows_per_rank, g->row_bytes);
        return MFSDP_ERR_INVALID_ARG;
    }
    const int64_t c = g->rows / g->world + (g->rows % g->world != 0);
    if (g->rows_per_rank != c) {
        MFSDP_WARN("pack: rows_per_rank %lld, ceil(%lld / %d) is %lld", (long long)g->rows_per_rank,
                   (long long)g->rows, g->world, (long long)c);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (mfsdp_mul_overflow((size_t)c, g->row_bytes, &piece) ||
        mfsdp_add_overflow(g->offset, piece, &end) ||
        mfsdp_mul_overflow((size_t)(g->world - 1), g->rank_stride, &last) ||
        mfsdp_add_overflow(last, end, &last) ||
        mfsdp_mul_overflow((size_t)g->rows, g->row_bytes, &full_bytes)) {
        MFSDP_WARN("pack: geometry sizes overflow");
        return MFSDP_ERR_OVERFLOW;
    }
    if (end > g->rank_stride) {
        MFSDP_WARN("pack: piece [%zu, %zu) exceeds the rank stride %zu", g->offset, end,
                   g->rank_stride);
        return MFSDP_ERR_MISMATCH;
    }
    if (mfsdp_ranges_overlap(full, full_bytes, buf, last)) {
        MFSDP_WARN("pack: matrix and buffer overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

/* Real rows of rank r's piece: clamp(N0 - r c, 0, c). */
static size_t piece_rows(const mfsdp_strided_geom_t *g, int r)
{
    const int64_t left = g->rows - (int64_t)r * g->rows_per_rank;
    if (left <= 0) {
        return 0;
    }
    return (size_t)(left < g->rows_per_rank ? left : g->rows_per_rank);
}

mfsdp_status_t mfsdp_cpu_pack(void *full, const void *fsdp_buf, const mfsdp_strided_geom_t *geom)
{
    MFSDP_CHECK(geom_check(full, fsdp_buf, geom));
    const size_t piece = (size_t)geom->rows_per_rank * geom->row_bytes;
    for (int r = 0; r < geom->world; r++) {
        const size_t rows = piece_rows(geom, r);
        if (rows == 0) {
            break;
        }
        memcpy((char *)full + (size_t)r * piece,
               (const char *)fsdp_buf + (size_t)r * geom->rank_stride + geom->offset,
               rows * geom->row_bytes);
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_cpu_unpack(void *fsdp_buf, const void *full, const mfsdp_strided_geom_t *geom)
{
    MFSDP_CHECK(geom_check(full, fsdp_buf, geom));
    const size_t piece = (size_t)geom->rows_per_rank * geom->row_bytes;
    for (int r = 0; r < geom->world; r++) {
        const size_t valid = piece_rows(geom, r) * geom->row_bytes;
        char *dst = (char *)fsdp_buf + (size_t)r * geom->rank_stride + geom->offset;
        if (valid > 0) {
            memcpy(dst, (const char *)full + (size_t)r * piece, valid);
        }
        memset(dst + valid, 0, piece - valid);
    }
    return MFSDP_OK;
}

double mfsdp_sqnorm_f32(const float *x, size_t n)
{
    enum { LANES = 8 };
    double lane[LANES] = {0.0};
    size_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            lane[j] += (double)x[i + j] * (double)x[i + j];
        }
    }
    for (int j = 0; i < n; i++, j++) {
        lane[j] += (double)x[i] * (double)x[i];
    }
    double sum = 0.0;
    for (int j = 0; j < LANES; j++) {
        sum += lane[j];
    }
    return sum;
}

mfsdp_status_t mfsdp_cpu_sqnorm_accumulate(const float *x, size_t n, double *acc_p)
{
    if (x == NULL || acc_p == NULL || n == 0) {
        MFSDP_WARN("sqnorm: %s", n == 0 ? "empty input" : "null pointer");
        return MFSDP_ERR_INVALID_ARG;
    }
    *acc_p += mfsdp_sqnorm_f32(x, n);
    return MFSDP_OK;
}
