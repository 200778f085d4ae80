/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper: fill a manifest param in place (tests build small manifests in C). */
#ifndef MFSDP_TESTS_MANIFEST_UTIL_H
#define MFSDP_TESTS_MANIFEST_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "mfsdp/manifest.h"

/* A 1-D (ndim 1, cols ignored) or 2-D (rows x cols) param; name is borrowed. */
static inline void test_param_fill(mfsdp_param_desc_t *p, const char *name, int ndim, int64_t rows,
                                   int64_t cols, mfsdp_dtype_t dtype, mfsdp_role_t role,
                                   int requires_grad)
{
    memset(p, 0, sizeof(*p));
    p->name = (char *)name;
    p->ndim = ndim;
    p->shape[0] = rows;
    p->shape[1] = ndim > 1 ? cols : 0;
    p->numel = rows * (ndim > 1 ? cols : 1);
    p->dtype = dtype;
    p->optimizer = role;
    p->requires_grad = requires_grad;
}

/* Free a manifest built in C whose group and param names were strdup'ed (not one from
 * mfsdp_manifest_parse(): that one goes to mfsdp_manifest_free()). */
static inline void test_manifest_free_owned(mfsdp_manifest_t *m)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++) {
            free(m->groups[g].params[i].name);
        }
        free(m->groups[g].params);
        free(m->groups[g].name);
    }
    free(m->groups);
    free(m);
}

/* The schedule tests' manifest: three groups mixing bf16 and fp32, Muon and AdamW params, a
 * frozen matrix, a no-grad bias and a 1-row matrix; with_w2 adds a second fp32 matrix to
 * group b (33 x 9, so that segments of one group differ in size). Free with
 * test_sched_manifest_free(). */
static inline mfsdp_manifest_t *test_sched_manifest(int with_w2)
{
    static const struct {
        size_t group;
        const char *name;
        int ndim;
        int64_t r, c;
        mfsdp_dtype_t dt;
        mfsdp_role_t role;
        int rg;
        int w2;
    } spec[] = {
        {0, "a.w0", 2, 37, 20, MFSDP_BFLOAT16, MFSDP_ROLE_MUON, 1, 0},
        {0, "a.w1", 2, 3, 50, MFSDP_BFLOAT16, MFSDP_ROLE_MUON, 1, 0},
        {0, "a.norm", 1, 9, 1, MFSDP_BFLOAT16, MFSDP_ROLE_ADAMW, 1, 0},
        {0, "a.frozen", 2, 5, 5, MFSDP_BFLOAT16, MFSDP_ROLE_MUON, 0, 0},
        {1, "b.embed", 2, 11, 7, MFSDP_FLOAT32, MFSDP_ROLE_ADAMW, 1, 0},
        {1, "b.w", 2, 64, 16, MFSDP_FLOAT32, MFSDP_ROLE_MUON, 1, 0},
        {1, "b.w2", 2, 33, 9, MFSDP_FLOAT32, MFSDP_ROLE_MUON, 1, 1},
        {1, "b.bias", 1, 2, 1, MFSDP_FLOAT32, MFSDP_ROLE_ADAMW, 0, 0},
        {2, "c.w", 2, 1, 300, MFSDP_FLOAT32, MFSDP_ROLE_MUON, 1, 0},
    };
    static const char *gn[] = {"a", "b", "c"};
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    mfsdp_hparams_default(&m->hp);
    m->ngroups = 3;
    m->groups = calloc(3, sizeof(*m->groups));
    for (size_t g = 0; g < 3; g++) {
        m->groups[g].name = (char *)gn[g];
        m->groups[g].lr_scale = 1.0;
        m->groups[g].params = calloc(8, sizeof(mfsdp_param_desc_t));
    }
    for (size_t i = 0; i < sizeof(spec) / sizeof(spec[0]); i++) {
        if (spec[i].w2 && !with_w2) {
            continue;
        }
        mfsdp_group_desc_t *g = &m->groups[spec[i].group];
        mfsdp_param_desc_t *p = &g->params[g->nparams++];
        test_param_fill(p, spec[i].name, spec[i].ndim, spec[i].r, spec[i].c, spec[i].dt,
                        spec[i].role, spec[i].rg);
    }
    return m;
}

static inline void test_sched_manifest_free(mfsdp_manifest_t *m)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        free(m->groups[g].params);
    }
    free(m->groups);
    free(m);
}

#endif /* MFSDP_TESTS_MANIFEST_UTIL_H */
