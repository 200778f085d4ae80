/* SPDX-License-Identifier: Apache-2.0 */
/* Which params a reduce-scatter count covers (core/rs_subset.h), against the layout. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "manifest_util.h"
#include "core/layout.h"
#include "core/rs_subset.h"

static mfsdp_param_desc_t P[48];
static mfsdp_group_desc_t G;
static char names[48][16];

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

Test(rs_subset, medium_group_every_set_is_searched)
{
    /* 16 params with distinct power-of-two sizes: every subset has its own count, and every
     * set of missing params is searched (met in the middle), four missing too */
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
    hg[0] = 0; /* four missing: found, and alone */
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(1, hg), &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 1);
    cr_expect_eq(memcmp(sets[0], hg, 16), 0);
    mfsdp_rs_subset_destroy(sv);
}

Test(rs_subset, four_small_params_against_one_of_their_sum)
{
    /* 13 params (above the enumeration limit): four norms of 4 rows and a bias of 16 rows, at
     * 2 ranks 2 elements each against 8. Without the four norms the count is the bias's
     * absence's too: ambiguous (it was taken for the bias alone) */
    static const int64_t rows[13] = {4, 4, 4, 4, 16, 16, 4, 12, 4, 20, 24, 28, 36};
    static const int64_t cols[13] = {0, 0, 0, 0, 0, 4, 16, 4, 6, 4, 4, 4, 4};
    group(13, rows, cols);
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 2, &sv), MFSDP_OK);
    unsigned char hg[13];
    memset(hg, 1, sizeof(hg));
    hg[0] = hg[1] = hg[2] = hg[3] = 0;
    size_t nsets = 0;
    const unsigned char *sets[2];
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(2, hg), &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 2);
    cr_expect_neq(sets[1], NULL);
    mfsdp_rs_subset_destroy(sv);
}

Test(rs_subset, groups_of_14_against_brute_force)
{
    /* every mask of a 14-param group with colliding small sizes: the solver's answer (one set,
     * the right one, or ambiguous) against counting all 2^14 masks */
    int64_t rows[14], cols[14];
    for (size_t i = 0; i < 14; i++) {
        rows[i] = 2 * (int64_t)(1 + (i * 7) % 5); /* world 2: sizes 1..5, many equal sums */
        cols[i] = 0;
    }
    group(14, rows, cols);
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 2, &sv), MFSDP_OK);
    size_t sz[14], full = mfsdp_rs_subset_full(sv);
    for (size_t i = 0; i < 14; i++) {
        sz[i] = (size_t)rows[i] / 2;
    }
    static unsigned same[1 << 8];
    memset(same, 0, sizeof(same));
    for (unsigned mask = 1; mask < (1u << 14); mask++) {
        size_t c = 0;
        for (size_t i = 0; i < 14; i++) {
            c += (mask >> i) & 1u ? sz[i] : 0;
        }
        same[c]++;
    }
    for (unsigned mask = 1; mask < (1u << 14); mask += 37) {
        unsigned char hg[14];
        size_t c = 0;
        for (size_t i = 0; i < 14; i++) {
            hg[i] = (mask >> i) & 1u;
            c += hg[i] ? sz[i] : 0;
        }
        cr_assert_eq(c, c == full ? full : layout_count(2, hg));
        size_t nsets = 9;
        const unsigned char *sets[2];
        cr_assert_eq(mfsdp_rs_subset_find(sv, c, &nsets, sets), MFSDP_OK);
        cr_assert_eq(nsets, same[c] > 1 ? 2 : 1, "mask %u count %zu: %u masks", mask, c, same[c]);
        if (same[c] == 1) {
            cr_assert_eq(memcmp(sets[0], hg, 14), 0, "mask %u", mask);
        }
    }
    mfsdp_rs_subset_destroy(sv);
}

Test(rs_subset, large_group_one_small_set_is_not_proof)
{
    /* 44 params (above the meet-in-the-middle limit): only sets of up to 3 missing params are
     * searched, so one found there is reported as not proven (sets[1] NULL), never as the set */
    int64_t rows[44], cols[44];
    for (size_t i = 0; i < 44; i++) {
        rows[i] = (int64_t)1 << (i % 20);
        cols[i] = i < 20 ? 0 : 64 + (int64_t)i;
    }
    group(44, rows, cols);
    mfsdp_rs_subset_t *sv = NULL;
    cr_assert_eq(mfsdp_rs_subset_create(&G, 1, &sv), MFSDP_OK);
    unsigned char hg[44];
    memset(hg, 1, sizeof(hg));
    hg[5] = 0;
    size_t nsets = 0;
    const unsigned char *sets[2];
    cr_assert_eq(mfsdp_rs_subset_find(sv, layout_count(1, hg), &nsets, sets), MFSDP_OK);
    cr_assert_eq(nsets, 2);
    cr_expect_eq(sets[1], NULL);
    cr_expect_eq(memcmp(sets[0], hg, 44), 0);
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
