/* SPDX-License-Identifier: Apache-2.0 */
/* Which params a reduce-scatter count covers (core/rs_subset.h), against the layout. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "manifest_util.h"
#include "core/layout.h"
#include "core/rs_subset.h"

static mfsdp_param_desc_t P[20];
static mfsdp_group_desc_t G;
static char names[20][16];

/* A group of n params; param i has shape (rows[i], 3) (or 1-D when cols[i] == 0). */
static void group(size_t n, const int64_t *rows, const int64_t *cols)
{
    memset(&G, 0, sizeof(G));
    for (size_t i = 0; i < n; i++) {
        snprintf(names[i], sizeof(names[i]), "p%zu", i);
        test_param_fill(&P[i], names[i], cols[i] ? 2 : 1, rows[i], cols[i], MFSDP_FLOAT32,
                        MFSDP_ROLE_ADAMW, 1);
    }
    G.name = "g";
    G.lr_scale = 1;
    G.nparams = n;
    G.params = P;
}

/* The count the layout gives for has_grad. */
static size_t layout_count(int world, const unsigned char *has_grad)
{
    mfsdp_group_layout_t *l = NULL;
    cr_assert_eq(mfsdp_group_layout_create_masked(&G, world, has_grad, &l), MFSDP_OK);
    size_t c = l->rs.count;
    mfsdp_group_layout_destroy(l);
    return c;
}

Test(rs_subset, every_subset_of_a_small_group_is_found_or_ambiguous)
{
    /* sizes at world 2: 3*3=9, 2*3=6, 4, 1, 5*3=15, 6 (p1 and p5 equal) */
    static const int64_t rows[] = {6, 4, 8, 2, 10, 12};
    static const int64_t cols[] = {3, 3, 0, 0, 3, 0};
    group(6, rows, cols);
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 2, &sv), MFSDP_OK);
    cr_expect_eq(mfsdp_rs_subset_full(sv), layout_count(2, NULL));
    for (unsigned mask = 1; mask < 64; mask++) {
        unsigned char hg[6];
        for (size_t i = 0; i < 6; i++) {
            hg[i] = (mask >> i) & 1u;
        }
        size_t count = layout_count(2, hg);
        /* brute force: how many masks give this count */
        unsigned same = 0;
        for (unsigned o = 1; o < 64; o++) {
            unsigned char h2[6];
            for (size_t i = 0; i < 6; i++) {
                h2[i] = (o >> i) & 1u;
            }
            same += layout_count(2, h2) == count;
        }
        size_t nsets = 9;
        const unsigned char *sets[2] = {NULL, NULL};
        cr_assert_eq(mfsdp_rs_subset_find(sv, count, &nsets, sets), MFSDP_OK);
        cr_assert_eq(nsets, same > 1 ? 2 : 1, "mask %u count %zu", mask, count);
        if (same == 1) {
            cr_assert_eq(memcmp(sets[0], hg, 6), 0, "mask %u", mask);
        } else {
            cr_assert_neq(memcmp(sets[0], sets[1], 6), 0);
            cr_assert_eq(layout_count(2, sets[0]), count);
            cr_assert_eq(layout_count(2, sets[1]), count);
        }
    }
    size_t nsets = 9;
    const unsigned char *sets[2];
    cr_expect_eq(mfsdp_rs_subset_find(sv, 0, &nsets, sets), MFSDP_OK);
    cr_expect_eq(nsets, 0);
    cr_expect_eq(mfsdp_rs_subset_find(sv, layout_count(2, NULL) + 1, &nsets, sets), MFSDP_OK);
    cr_expect_eq(nsets, 0);
    /* missing p1 or p5: the same count */
    static const unsigned char no_p1[6] = {1, 0, 1, 1, 1, 1};
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(2, no_p1), &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 2);
    char a[64], b[64];
    mfsdp_rs_subset_format_missing(sv, sets[0], a, sizeof(a));
    mfsdp_rs_subset_format_missing(sv, sets[1], b, sizeof(b));
    cr_expect((strcmp(a, "{p1}") == 0 && strcmp(b, "{p5}") == 0) ||
                  (strcmp(a, "{p5}") == 0 && strcmp(b, "{p1}") == 0),
              "%s %s", a, b);
    mfsdp_rs_subset_destroy(sv);
}

Test(rs_subset, large_group_up_to_three_missing)
{
    /* 16 params with distinct power-of-two sizes: every subset has its own count, but only
     * sets of up to 3 missing params are looked for */
    int64_t rows[16], cols[16];
    for (size_t i = 0; i < 16; i++) {
        rows[i] = (int64_t)1 << (i % 12); /* world 1: size = rows * cols */
        cols[i] = i < 12 ? 0 : 8192;      /* 1-D for i < 12; p12..p15 = 8192 * 2^k */
    }
    group(16, rows, cols);
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 1, &sv), MFSDP_OK);
    unsigned char hg[16];
    memset(hg, 1, sizeof(hg));
    hg[3] = hg[7] = hg[14] = 0;
    size_t nsets = 0;
    const unsigned char *sets[2];
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(1, hg), &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 1);
    cr_expect_eq(memcmp(sets[0], hg, 16), 0);
    hg[0] = 0; /* four missing: not looked for */
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(1, hg), &nsets, sets), MFSDP_OK);
    cr_expect_eq(nsets, 0);
    mfsdp_rs_subset_destroy(sv);
}

Test(rs_subset, frozen_params_never_count)
{
    static const int64_t rows[] = {6, 4};
    static const int64_t cols[] = {3, 0};
    group(2, rows, cols);
    P[1].requires_grad = 0;
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 2, &sv), MFSDP_OK);
    cr_expect_eq(mfsdp_rs_subset_full(sv), 9);
    size_t nsets = 0;
    const unsigned char *sets[2];
    cr_assert_eq(mfsdp_rs_subset_find(sv, 9, &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 1);
    cr_expect(sets[0][0] == 1 && sets[0][1] == 0);
    char a[32];
    mfsdp_rs_subset_format_missing(sv, sets[0], a, sizeof(a));
    cr_expect_str_eq(a, "{}", "a frozen param is not 'missing'");
    mfsdp_rs_subset_destroy(sv);
    P[0].requires_grad = 0;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 2, &sv), MFSDP_OK);
    cr_expect_eq(mfsdp_rs_subset_full(sv), 0);
    cr_assert_eq(mfsdp_rs_subset_find(sv, 9, &nsets, sets), MFSDP_OK);
    cr_expect_eq(nsets, 0);
    mfsdp_rs_subset_destroy(sv);
}
