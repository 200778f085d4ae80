/* SPDX-License-Identifier: Apache-2.0 */
#include "core/rs_subset.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/layout.h"

/* Counts a solver remembers before it starts over (a job uses a handful). */
#define CACHE_MAX 256

typedef struct cache_entry {
    size_t count;
    size_t nsets;
    unsigned char *sets[2];
    int unproven; /* one set found among the small ones only (solve_few) */
} cache_entry_t;

typedef struct trainable {
    size_t param; /* index in the group */
    size_t s;     /* per-rank shard size in the reduce dtype */
} trainable_t;

struct mfsdp_rs_subset {
    const mfsdp_group_desc_t *g;
    size_t nparams;
    size_t ntrain;
    trainable_t *train; /* sorted by s ascending (ties by param index) */
    size_t full;
    size_t ncache;
    cache_entry_t cache[CACHE_MAX];
};

static int cmp_trainable(const void *a, const void *b)
{
    const trainable_t *x = a, *y = b;
    if (x->s != y->s) {
        return x->s < y->s ? -1 : 1;
    }
    return x->param < y->param ? -1 : x->param > y->param;
}

static void cache_clear(mfsdp_rs_subset_t *sv)
{
    for (size_t i = 0; i < sv->ncache; i++) {
        free(sv->cache[i].sets[0]);
        free(sv->cache[i].sets[1]);
    }
    sv->ncache = 0;
}

void mfsdp_rs_subset_destroy(mfsdp_rs_subset_t *sv)
{
    if (sv == NULL) {
        return;
    }
    cache_clear(sv);
    free(sv->train);
    free(sv);
}

mfsdp_status_t mfsdp_rs_subset_create(const mfsdp_group_desc_t *g, int world,
                                      mfsdp_rs_subset_t **solver_p)
{
    MFSDP_CHECK_ARG(g != NULL && solver_p != NULL && world >= 1);
    mfsdp_group_layout_t *l = NULL;
    mfsdp_status_t st = mfsdp_group_layout_create(g, world, &l);
    if (st != MFSDP_OK) {
        return st;
    }
    mfsdp_rs_subset_t *sv = calloc(1, sizeof(*sv));
    if (sv == NULL) {
        mfsdp_group_layout_destroy(l);
        return MFSDP_ERR_NO_MEMORY;
    }
    sv->g = g;
    sv->nparams = g->nparams;
    sv->ntrain = l->rs.nentries;
    sv->train = calloc(sv->ntrain + 1, sizeof(*sv->train));
    if (sv->train == NULL) {
        mfsdp_group_layout_destroy(l);
        mfsdp_rs_subset_destroy(sv);
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t k = 0; k < sv->ntrain; k++) {
        sv->train[k].param = l->rs.entries[k].param;
        sv->train[k].s = (size_t)l->rs.entries[k].s;
        sv->full += sv->train[k].s;
    }
    /* The layout's count is in the reduce dtype, as the shard sizes are. */
    if (sv->ntrain > 0 && sv->full != l->rs.count) {
        mfsdp_group_layout_destroy(l);
        mfsdp_rs_subset_destroy(sv);
        return MFSDP_ERR_INTERNAL;
    }
    mfsdp_group_layout_destroy(l);
    qsort(sv->train, sv->ntrain, sizeof(*sv->train), cmp_trainable);
    *solver_p = sv;
    return MFSDP_OK;
}

size_t mfsdp_rs_subset_full(const mfsdp_rs_subset_t *sv)
{
    return sv == NULL ? 0 : sv->full;
}

/* Record one more set of missing params (indices into train[]) that explains the count. */
static mfsdp_status_t add_set(mfsdp_rs_subset_t *sv, cache_entry_t *e, const size_t *missing,
                              size_t nmissing)
{
    if (e->nsets >= 2) {
        e->nsets = 3;
        return MFSDP_OK;
    }
    unsigned char *set = calloc(sv->nparams + 1, 1);
    if (set == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t k = 0; k < sv->ntrain; k++) {
        set[sv->train[k].param] = 1;
    }
    for (size_t k = 0; k < nmissing; k++) {
        set[sv->train[missing[k]].param] = 0;
    }
    e->sets[e->nsets++] = set;
    return MFSDP_OK;
}

/* Every set of missing params (any size): at most 2^MFSDP_RS_ENUM_PARAMS sums. */
static mfsdp_status_t solve_all(mfsdp_rs_subset_t *sv, cache_entry_t *e, size_t deficit)
{
    size_t missing[MFSDP_RS_ENUM_PARAMS];
    unsigned long nmask = 1ul << sv->ntrain;
    for (unsigned long mask = 1; mask < nmask && e->nsets < 3; mask++) {
        size_t sum = 0, n = 0;
        for (size_t k = 0; k < sv->ntrain && sum <= deficit; k++) {
            if (mask & (1ul << k)) {
                sum += sv->train[k].s;
                missing[n++] = k;
            }
        }
        if (sum == deficit) {
            MFSDP_CHECK(add_set(sv, e, missing, n));
        }
    }
    return MFSDP_OK;
}

/* A sum of a half's params and the mask of them. */
typedef struct half_sum {
    size_t sum;
    uint32_t mask;
} half_sum_t;

static int cmp_half(const void *a, const void *b)
{
    const half_sum_t *x = a, *y = b;
    return x->sum < y->sum ? -1 : x->sum > y->sum;
}

/* Every set of missing params of up to MFSDP_RS_SPLIT_PARAMS trainable params, meeting in the
 * middle: the sums of every subset of the second half, sorted, looked up for each subset of
 * the first (2 x 2^20 sums at most). */
static mfsdp_status_t solve_split(mfsdp_rs_subset_t *sv, cache_entry_t *e, size_t deficit)
{
    size_t h1 = sv->ntrain / 2, h2 = sv->ntrain - h1;
    size_t n2 = (size_t)1 << h2;
    half_sum_t *right = malloc(n2 * sizeof(*right));
    if (right == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t mask = 0; mask < n2; mask++) {
        size_t sum = 0;
        for (size_t k = 0; k < h2; k++) {
            sum += mask & ((size_t)1 << k) ? sv->train[h1 + k].s : 0;
        }
        right[mask] = (half_sum_t){sum, (uint32_t)mask};
    }
    qsort(right, n2, sizeof(*right), cmp_half);
    mfsdp_status_t st = MFSDP_OK;
    size_t missing[MFSDP_RS_SPLIT_PARAMS];
    for (size_t left = 0; left < ((size_t)1 << h1) && e->nsets < 3 && st == MFSDP_OK; left++) {
        size_t sum = 0;
        for (size_t k = 0; k < h1; k++) {
            sum += left & ((size_t)1 << k) ? sv->train[k].s : 0;
        }
        if (sum > deficit) {
            continue;
        }
        size_t want = deficit - sum, lo = 0, hi = n2; /* first right sum >= want */
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (right[mid].sum < want) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        for (size_t r = lo; r < n2 && right[r].sum == want && e->nsets < 3; r++) {
            size_t n = 0;
            for (size_t k = 0; k < h1; k++) {
                if (left & ((size_t)1 << k)) {
                    missing[n++] = k;
                }
            }
            for (size_t k = 0; k < h2; k++) {
                if (right[r].mask & ((uint32_t)1 << k)) {
                    missing[n++] = h1 + k;
                }
            }
            if (n > 0) {
                st = add_set(sv, e, missing, n);
            }
        }
    }
    free(right);
    return st;
}

/* Sets of 1..MFSDP_RS_MAX_MISSING missing params; sizes ascend, so a partial sum above the
 * deficit ends its loop. */
static mfsdp_status_t solve_few(mfsdp_rs_subset_t *sv, cache_entry_t *e, size_t deficit)
{
    const trainable_t *t = sv->train;
    size_t n = sv->ntrain;
    for (size_t a = 0; a < n && t[a].s <= deficit && e->nsets < 3; a++) {
        if (t[a].s == deficit) {
            size_t m1[1] = {a};
            MFSDP_CHECK(add_set(sv, e, m1, 1));
        }
        for (size_t b = a + 1; b < n && t[a].s + t[b].s <= deficit && e->nsets < 3; b++) {
            if (t[a].s + t[b].s == deficit) {
                size_t m2[2] = {a, b};
                MFSDP_CHECK(add_set(sv, e, m2, 2));
            }
            for (size_t c = b + 1; c < n && t[a].s + t[b].s + t[c].s <= deficit && e->nsets < 3;
                 c++) {
                if (t[a].s + t[b].s + t[c].s == deficit) {
                    size_t m3[3] = {a, b, c};
                    MFSDP_CHECK(add_set(sv, e, m3, 3));
                }
            }
        }
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_rs_subset_find(mfsdp_rs_subset_t *sv, size_t count, size_t *nsets_p,
                                    const unsigned char *sets_p[2])
{
    MFSDP_CHECK_ARG(sv != NULL && nsets_p != NULL && sets_p != NULL);
    cache_entry_t *e = NULL;
    for (size_t i = 0; i < sv->ncache; i++) {
        if (sv->cache[i].count == count) {
            e = &sv->cache[i];
            break;
        }
    }
    if (e == NULL) {
        if (sv->ncache == CACHE_MAX) {
            cache_clear(sv);
        }
        e = &sv->cache[sv->ncache++];
        memset(e, 0, sizeof(*e));
        e->count = count;
        mfsdp_status_t st = MFSDP_OK;
        if (count == sv->full && count > 0) {
            st = add_set(sv, e, NULL, 0);
        } else if (count > 0 && count < sv->full) {
            size_t d = sv->full - count;
            st = sv->ntrain <= MFSDP_RS_ENUM_PARAMS    ? solve_all(sv, e, d)
                 : sv->ntrain <= MFSDP_RS_SPLIT_PARAMS ? solve_split(sv, e, d)
                                                       : solve_few(sv, e, d);
            if (st == MFSDP_OK && sv->ntrain > MFSDP_RS_SPLIT_PARAMS && e->nsets == 1) {
                /* Only small sets were searched: a larger one may give the same count. */
                e->unproven = 1;
            }
        }
        if (st != MFSDP_OK) {
            free(e->sets[0]);
            free(e->sets[1]);
            sv->ncache--;
            return st;
        }
    }
    *nsets_p = e->unproven ? 2 : e->nsets > 2 ? 2 : e->nsets;
    sets_p[0] = e->sets[0];
    sets_p[1] = e->unproven ? NULL : e->sets[1];
    return MFSDP_OK;
}

void mfsdp_rs_subset_format_missing(const mfsdp_rs_subset_t *sv, const unsigned char *set,
                                    char *buf, size_t len)
{
    size_t off = 0, shown = 0, more = 0;
    if (len == 0) {
        return;
    }
    buf[0] = '\0';
    off += (size_t)snprintf(buf, len, "{");
    for (size_t i = 0; sv != NULL && set != NULL && i < sv->nparams; i++) {
        if (!sv->g->params[i].requires_grad || set[i]) {
            continue;
        }
        if (shown == 4) {
            more++;
            continue;
        }
        if (off < len) {
            off += (size_t)snprintf(buf + off, len - off, "%s%s", shown ? ", " : "",
                                    sv->g->params[i].name ? sv->g->params[i].name : "?");
        }
        shown++;
    }
    if (more > 0 && off < len) {
        off += (size_t)snprintf(buf + off, len - off, ", %zu more", more);
    }
    if (off < len) {
        snprintf(buf + off, len - off, "}");
    }
}
