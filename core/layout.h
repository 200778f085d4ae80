/* SPDX-License-Identifier: Apache-2.0 */
/*
 * FSDP2's byte layout of one param group (docs/design.md, "FSDP2's byte layout"), computed exactly.
 *
 * For param i with shape (N0, rest...) at world size n: R = prod(rest) (1 for 1-D),
 * c = ceil(N0 / n) rows per rank, s = c * R elements per rank, o = sum of earlier s
 * (no alignment padding), S = sum of s. Piece (r, i) = buffer[r*S + o, r*S + o + s) holds
 * rows [r*c, (r+1)*c) of the param; rows >= N0 are zero padding.
 *
 * The all-gather layout covers every param in the param dtype; when dtypes are mixed the
 * collective is uint8 and every size/offset is in bytes. The reduce-scatter layout covers
 * only the params with requires_grad, in the reduce dtype (the group's reduce_dtype, or the
 * common param dtype; mixed param dtypes without reduce_dtype are rejected as FSDP2 does).
 * Only Shard(0) is supported; other placements are MFSDP_ERR_UNSUPPORTED.
 */
#ifndef MFSDP_CORE_LAYOUT_H
#define MFSDP_CORE_LAYOUT_H

#include "mfsdp/manifest.h"

/* One param inside one buffer layout. Element counts are in units of the param's own
 * dtype in that buffer (param dtype for the all-gather, reduce dtype for reduce-scatter);
 * byte fields are exact in every case. */
typedef struct mfsdp_param_layout {
    size_t param;     /* index of the param in its group */
    int64_t rows;     /* N0 */
    int64_t rest;     /* R */
    int64_t c;        /* rows per rank */
    int64_t s;        /* elements per rank (c * R) */
    size_t elt;       /* bytes per element of this param in this buffer */
    size_t row_bytes; /* R * elt */
    size_t s_bytes;   /* s * elt */
    size_t o_bytes;   /* byte offset inside a rank block */
} mfsdp_param_layout_t;

/* The layout of one collective buffer (all-gather or reduce-scatter) of a group. */
typedef struct mfsdp_buffer_layout {
    mfsdp_dtype_t dtype; /* dtype the collective uses (MFSDP_UINT8 when mixed) */
    size_t count;        /* S: per-rank count in units of dtype (what NCCL sees) */
    size_t bytes;        /* S in bytes */
    size_t nentries;     /* params in this buffer, in group order */
    mfsdp_param_layout_t *entries;
} mfsdp_buffer_layout_t;

typedef struct mfsdp_group_layout {
    int world;
    mfsdp_buffer_layout_t ag; /* all params, param dtypes */
    mfsdp_buffer_layout_t rs; /* grad-bearing params, reduce dtype (may have 0 entries) */
    size_t nparams;
    long *rs_entry; /* per group param: index into rs.entries, or -1 */
} mfsdp_group_layout_t;

/* A piece (r, i): where rank r's rows of a param sit in the FSDP buffer and in the param's
 * contiguous full tensor. All values are bytes. valid + pad == s_bytes. */
typedef struct mfsdp_piece {
    size_t buf_offset;  /* r*S_bytes + o_bytes */
    size_t full_offset; /* r*c*row_bytes (only meaningful when valid > 0) */
    size_t valid;       /* bytes of real rows: clamp(N0 - r*c, 0, c) * row_bytes */
    size_t pad;         /* bytes of zero padding that follow */
} mfsdp_piece_t;

/* Compute the layouts of group g at world size world. */
mfsdp_status_t mfsdp_group_layout_create(const mfsdp_group_desc_t *g, int world,
                                         mfsdp_group_layout_t **layout_p);
/* The same, with the reduce-scatter over only the params i with has_grad[i] == 1 (a subset of
 * those with requires_grad: FSDP2 reduces only params that got a gradient in this backward).
 * has_grad holds g->nparams bytes, or is NULL for every requires_grad param. The reduce
 * dtype is that of the full group (reduce_dtype, or the grad-bearing params' common dtype).
 * MFSDP_ERR_INVALID_ARG when a marked param does not require a gradient. */
mfsdp_status_t mfsdp_group_layout_create_masked(const mfsdp_group_desc_t *g, int world,
                                                const unsigned char *has_grad,
                                                mfsdp_group_layout_t **layout_p);
void mfsdp_group_layout_destroy(mfsdp_group_layout_t *layout);

/* Piece (r, entry) of a buffer layout. r in [0, world). */
void mfsdp_layout_piece(const mfsdp_buffer_layout_t *b, int world, size_t entry, int r,
                        mfsdp_piece_t *piece);

#endif /* MFSDP_CORE_LAYOUT_H */
