/* SPDX-License-Identifier: Apache-2.0 */
/* FSDP2 layout math (docs/design.md, "FSDP2's byte layout") against hand-computed offsets. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"

#define MAXP 8

/* Build a group in static storage (tests create one at a time). */
static mfsdp_param_desc_t params[MAXP];
static mfsdp_group_desc_t group;

static void reset(void)
{
    memset(params, 0, sizeof(params));
    memset(&group, 0, sizeof(group));
    group.name = "g";
    group.params = params;
    group.lr_scale = 1.0;
}

static void add(const char *name, mfsdp_dtype_t dt, int grad, int ndim, int64_t d0, int64_t d1,
                int64_t d2)
{
    mfsdp_param_desc_t *p = &params[group.nparams++];
    p->name = (char *)name;
    p->dtype = dt;
    p->requires_grad = grad;
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    /* numel is not used by the layout; saturate it so huge test shapes stay defined. */
    if (__builtin_mul_overflow(d0, ndim > 1 ? d1 : 1, &p->numel) ||
        __builtin_mul_overflow(p->numel, ndim > 2 ? d2 : 1, &p->numel)) {
        p->numel = INT64_MAX;
    }
}

static mfsdp_group_layout_t *make(int world)
{
    mfsdp_group_layout_t *l = NULL;
    cr_assert_eq(mfsdp_group_layout_create(&group, world, &l), MFSDP_OK);
    cr_assert_not_null(l);
    return l;
}

static void expect_entry(const mfsdp_param_layout_t *e, int64_t c, int64_t s, size_t o_bytes,
                         size_t elt)
{
    cr_expect_eq(e->c, c, "c: got %ld want %ld", (long)e->c, (long)c);
    cr_expect_eq(e->s, s, "s: got %ld want %ld", (long)e->s, (long)s);
    cr_expect_eq(e->o_bytes, o_bytes, "o_bytes: got %zu want %zu", e->o_bytes, o_bytes);
    cr_expect_eq(e->elt, elt);
    cr_expect_eq(e->s_bytes, (size_t)s * elt);
}

static void expect_piece(const mfsdp_group_layout_t *l, size_t entry, int r, size_t buf,
                         size_t full, size_t valid, size_t pad)
{
    mfsdp_piece_t pc;
    mfsdp_layout_piece(&l->ag, l->world, entry, r, &pc);
    cr_expect_eq(pc.buf_offset, buf, "piece(%d,%zu).buf %zu want %zu", r, entry, pc.buf_offset,
                 buf);
    if (valid > 0) {
        cr_expect_eq(pc.full_offset, full, "piece(%d,%zu).full %zu want %zu", r, entry,
                     pc.full_offset, full);
    }
    cr_expect_eq(pc.valid, valid, "piece(%d,%zu).valid %zu want %zu", r, entry, pc.valid, valid);
    cr_expect_eq(pc.pad, pad, "piece(%d,%zu).pad %zu want %zu", r, entry, pc.pad, pad);
}

TestSuite(layout, .init = reset);

/* W (10, 3) and b (5,) float32 at n = 4: c_W = 3, s_W = 9, o_W = 0; c_b = 2, s_b = 2,
 * o_b = 9; S = 11. Rank 3 holds W row 9 + two padding rows, and only padding of b. */
Test(layout, not_divisible)
{
    add("W", MFSDP_FLOAT32, 1, 2, 10, 3, 0);
    add("b", MFSDP_FLOAT32, 1, 1, 5, 0, 0);
    mfsdp_group_layout_t *l = make(4);
    cr_expect_eq(l->ag.dtype, MFSDP_FLOAT32);
    cr_expect_eq(l->ag.count, 11);
    cr_expect_eq(l->ag.bytes, 44);
    expect_entry(&l->ag.entries[0], 3, 9, 0, 4);
    expect_entry(&l->ag.entries[1], 2, 2, 36, 4);
    expect_piece(l, 0, 0, 0, 0, 36, 0);
    expect_piece(l, 0, 1, 44, 36, 36, 0);
    expect_piece(l, 0, 3, 132, 108, 12, 24);      /* row 9 only */
    expect_piece(l, 1, 2, 2 * 44 + 36, 16, 4, 4); /* b row 4 + one padding row */
    expect_piece(l, 1, 3, 3 * 44 + 36, 0, 0, 8);  /* all padding */
    /* reduce-scatter: same layout (all params have gradients, same dtype) */
    cr_expect_eq(l->rs.count, 11);
    cr_expect_eq(l->rs_entry[0], 0);
    cr_expect_eq(l->rs_entry[1], 1);
    mfsdp_group_layout_destroy(l);
}

/* n = 8 > rows = 3: c = 1, ranks 3..7 are all padding. */
Test(layout, world_larger_than_rows)
{
    add("W", MFSDP_FLOAT32, 1, 2, 3, 4, 0);
    mfsdp_group_layout_t *l = make(8);
    expect_entry(&l->ag.entries[0], 1, 4, 0, 4);
    cr_expect_eq(l->ag.count, 4);
    expect_piece(l, 0, 2, 32, 32, 16, 0);
    for (int r = 3; r < 8; r++) {
        expect_piece(l, 0, r, (size_t)r * 16, 0, 0, 16);
    }
    mfsdp_group_layout_destroy(l);
}

/* 1-D (7,) at n = 3: c = 3, s = 3; rank 2 holds element 6 and two padding elements. */
Test(layout, one_dim)
{
    add("norm", MFSDP_BFLOAT16, 1, 1, 7, 0, 0);
    mfsdp_group_layout_t *l = make(3);
    cr_expect_eq(l->ag.dtype, MFSDP_BFLOAT16);
    expect_entry(&l->ag.entries[0], 3, 3, 0, 2);
    expect_piece(l, 0, 2, 12, 12, 2, 4);
    mfsdp_group_layout_destroy(l);
}

/* More than 2 dims: (5, 2, 3) at n = 2 -> R = 6, c = 3, s = 18. */
Test(layout, three_dims)
{
    add("conv", MFSDP_FLOAT32, 1, 3, 5, 2, 3);
    mfsdp_group_layout_t *l = make(2);
    expect_entry(&l->ag.entries[0], 3, 18, 0, 4);
    cr_expect_eq(l->ag.entries[0].rest, 6);
    expect_piece(l, 0, 1, 72, 72, 48, 24);
    mfsdp_group_layout_destroy(l);
}

/* Mixed dtypes: the all-gather is bytes. W bf16 (3, 4): c = 2, s = 8 -> 16 B; b fp32 (3,):
 * c = 2, s = 2 -> 8 B at byte 16; S = 24 B. Reduce in float32 (reduce_dtype). */
Test(layout, mixed_dtypes_bytes)
{
    add("W", MFSDP_BFLOAT16, 1, 2, 3, 4, 0);
    add("b", MFSDP_FLOAT32, 1, 1, 3, 0, 0);
    group.has_reduce_dtype = 1;
    group.reduce_dtype = MFSDP_FLOAT32;
    mfsdp_group_layout_t *l = make(2);
    cr_expect_eq(l->ag.dtype, MFSDP_UINT8);
    cr_expect_eq(l->ag.count, 24);
    cr_expect_eq(l->ag.bytes, 24);
    expect_entry(&l->ag.entries[0], 2, 8, 0, 2);
    expect_entry(&l->ag.entries[1], 2, 2, 16, 4);
    expect_piece(l, 0, 1, 24, 16, 8, 8); /* W row 2 (8 B) + one padding row */
    expect_piece(l, 1, 1, 40, 8, 4, 4);
    /* reduce-scatter in fp32: W s = 8 -> 32 B, b at 32; S' = 10 elements */
    cr_expect_eq(l->rs.dtype, MFSDP_FLOAT32);
    cr_expect_eq(l->rs.count, 10);
    cr_expect_eq(l->rs.entries[0].elt, 4);
    cr_expect_eq(l->rs.entries[1].o_bytes, 32);
    mfsdp_group_layout_destroy(l);
}

/* A param without gradient drops out of the reduce-scatter: S' < S. */
Test(layout, no_grad_params)
{
    add("W1", MFSDP_FLOAT32, 1, 2, 4, 4, 0); /* c 2, s 8 */
    add("W2", MFSDP_FLOAT32, 0, 2, 6, 2, 0); /* c 3, s 6 (frozen) */
    add("b", MFSDP_FLOAT32, 1, 1, 5, 0, 0);  /* c 3, s 3 */
    mfsdp_group_layout_t *l = make(2);
    cr_expect_eq(l->ag.count, 17);
    cr_expect_eq(l->ag.entries[2].o_bytes, 14 * 4);
    cr_expect_eq(l->rs.count, 11);
    cr_expect_eq(l->rs.nentries, 2);
    cr_expect_eq(l->rs_entry[0], 0);
    cr_expect_eq(l->rs_entry[1], -1);
    cr_expect_eq(l->rs_entry[2], 1);
    cr_expect_eq(l->rs.entries[1].param, 2);
    cr_expect_eq(l->rs.entries[1].o_bytes, 8 * 4);
    mfsdp_group_layout_destroy(l);
}

/* FSDP2 reduces only the params that got a gradient in this backward (hand-computed). */
Test(layout, reduce_over_params_with_grad)
{
    add("W1", MFSDP_BFLOAT16, 1, 2, 4, 4, 0); /* c 2, s 8 */
    add("W2", MFSDP_BFLOAT16, 0, 2, 6, 2, 0); /* c 3, s 6 (frozen) */
    add("b1", MFSDP_BFLOAT16, 1, 1, 5, 0, 0); /* c 3, s 3 (unused this step) */
    add("b2", MFSDP_BFLOAT16, 1, 1, 3, 0, 0); /* c 2, s 2 */
    group.has_reduce_dtype = 1;
    group.reduce_dtype = MFSDP_FLOAT32;
    const unsigned char has_grad[4] = {1, 0, 0, 1};
    mfsdp_group_layout_t *l = NULL;
    cr_assert_eq(mfsdp_group_layout_create_masked(&group, 2, has_grad, &l), MFSDP_OK);
    cr_expect_eq(l->ag.count, 19); /* the all-gather is unchanged */
    cr_expect_eq(l->rs.dtype, MFSDP_FLOAT32);
    cr_expect_eq(l->rs.count, 10);
    cr_expect_eq(l->rs.nentries, 2);
    cr_expect_eq(l->rs_entry[0], 0);
    cr_expect_eq(l->rs_entry[1], -1);
    cr_expect_eq(l->rs_entry[2], -1);
    cr_expect_eq(l->rs_entry[3], 1);
    expect_entry(&l->rs.entries[1], 2, 2, 8 * 4, 4);
    mfsdp_group_layout_destroy(l);

    /* Nothing with a gradient: an empty reduce layout, not an error. */
    const unsigned char none[4] = {0, 0, 0, 0};
    cr_assert_eq(mfsdp_group_layout_create_masked(&group, 3, none, &l), MFSDP_OK);
    cr_expect_eq(l->rs.count, 0);
    cr_expect_eq(l->rs.nentries, 0);
    mfsdp_group_layout_destroy(l);

    /* A frozen param cannot have a gradient; a mark must be 0 or 1. */
    setenv("MFSDP_DEBUG", "NONE", 1);
    const unsigned char frozen[4] = {1, 1, 0, 0};
    const unsigned char two[4] = {1, 0, 2, 0};
    l = (mfsdp_group_layout_t *)0x1;
    cr_expect_eq(mfsdp_group_layout_create_masked(&group, 2, frozen, &l), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_group_layout_create_masked(&group, 2, two, &l), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(l, (mfsdp_group_layout_t *)0x1, "output written on failure");
}

Test(layout, bf16_params_reduced_in_fp32)
{
    add("W", MFSDP_BFLOAT16, 1, 2, 5, 3, 0);
    group.has_reduce_dtype = 1;
    group.reduce_dtype = MFSDP_FLOAT32;
    mfsdp_group_layout_t *l = make(2);
    cr_expect_eq(l->ag.bytes, 9 * 2);
    cr_expect_eq(l->rs.bytes, 9 * 4);
    cr_expect_eq(l->rs.count, 9);
    mfsdp_group_layout_destroy(l);
}

Test(layout, mixed_grad_dtypes_without_reduce_dtype_rejected)
{
    add("W", MFSDP_BFLOAT16, 1, 2, 5, 3, 0);
    add("b", MFSDP_FLOAT32, 1, 1, 5, 0, 0);
    mfsdp_group_layout_t *l = (mfsdp_group_layout_t *)0x1;
    cr_expect_eq(mfsdp_group_layout_create(&group, 2, &l), MFSDP_ERR_UNSUPPORTED);
    cr_expect_eq(l, (mfsdp_group_layout_t *)0x1, "output untouched on failure");
}

Test(layout, shard_dim_rejected)
{
    add("W", MFSDP_FLOAT32, 1, 2, 4, 4, 0);
    params[0].shard_dim = 1;
    mfsdp_group_layout_t *l = NULL;
    cr_expect_eq(mfsdp_group_layout_create(&group, 2, &l), MFSDP_ERR_UNSUPPORTED);
    cr_expect_null(l);
}

Test(layout, bad_args_and_overflow)
{
    add("W", MFSDP_FLOAT32, 1, 2, (int64_t)1 << 40, (int64_t)1 << 40, 0);
    mfsdp_group_layout_t *l = NULL;
    cr_expect_eq(mfsdp_group_layout_create(&group, 2, &l), MFSDP_ERR_OVERFLOW);
    params[0].shape[0] = 0;
    cr_expect_eq(mfsdp_group_layout_create(&group, 2, &l), MFSDP_ERR_INVALID_ARG);
    params[0].shape[0] = 4;
    params[0].shape[1] = 4;
    cr_expect_eq(mfsdp_group_layout_create(&group, 0, &l), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_group_layout_create(NULL, 2, &l), MFSDP_ERR_INVALID_ARG);
    cr_expect_eq(mfsdp_group_layout_create(&group, 2, NULL), MFSDP_ERR_INVALID_ARG);
    cr_expect_null(l);
}

/* Independent check on random groups: place every element of every param with the
 * row formula of fsdp2-internals.md (row i of p sits at rank i / c, element offset
 * r*S + o_p + (i - r*c)*R) and check the pieces tile the n*S buffer exactly once, padding
 * included. */
Test(layout, pieces_tile_buffer_random)
{
    unsigned seed = 12345;
    for (int trial = 0; trial < 200; trial++) {
        reset();
        int np = 1 + rand_r(&seed) % 5;
        for (int i = 0; i < np; i++) {
            int ndim = 1 + rand_r(&seed) % 3;
            add("p", (mfsdp_dtype_t)(rand_r(&seed) % 3), 1, ndim, 1 + rand_r(&seed) % 13,
                1 + rand_r(&seed) % 5, 1 + rand_r(&seed) % 3);
        }
        group.has_reduce_dtype = 1;
        group.reduce_dtype = MFSDP_FLOAT32;
        int world = 1 + rand_r(&seed) % 9;
        mfsdp_group_layout_t *l = make(world);
        size_t total = l->ag.bytes * (size_t)world;
        unsigned char *hits = calloc(total, 1);
        for (size_t e = 0; e < l->ag.nentries; e++) {
            const mfsdp_param_layout_t *pl = &l->ag.entries[e];
            for (int r = 0; r < world; r++) {
                mfsdp_piece_t pc;
                mfsdp_layout_piece(&l->ag, world, e, r, &pc);
                cr_assert_leq(pc.buf_offset + pc.valid + pc.pad, total);
                for (size_t b = 0; b < pc.valid + pc.pad; b++) {
                    hits[pc.buf_offset + b]++;
                }
                /* the first valid row of this piece, by the row formula */
                int64_t row = (int64_t)r * pl->c;
                if (row < pl->rows) {
                    size_t want = (size_t)r * l->ag.bytes + pl->o_bytes;
                    cr_assert_eq(pc.buf_offset, want);
                    cr_assert_eq(pc.full_offset, (size_t)row * pl->row_bytes);
                    int64_t nrows = pl->rows - row < pl->c ? pl->rows - row : pl->c;
                    cr_assert_eq(pc.valid, (size_t)nrows * pl->row_bytes);
                } else {
                    cr_assert_eq(pc.valid, 0);
                }
            }
        }
        for (size_t b = 0; b < total; b++) {
            cr_assert_eq(hits[b], 1, "byte %zu covered %d times (trial %d)", b, hits[b], trial);
        }
        free(hits);
        mfsdp_group_layout_destroy(l);
    }
}
