/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper: fill a manifest param in place (tests build small manifests in C). */
#ifndef MFSDP_TESTS_MANIFEST_UTIL_H
#define MFSDP_TESTS_MANIFEST_UTIL_H

#include <string.h>

#include "mfsdp/manifest.h"

/* A 1-D (ndim 1, cols ignored) or 2-D (rows x cols) param; name is borrowed. */
static inline void test_param_fill(mfsdp_param_desc_t *p, const char *name, int ndim,
                                   int64_t rows, int64_t cols, mfsdp_dtype_t dtype,
                                   mfsdp_role_t role, int requires_grad)
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

#endif /* MFSDP_TESTS_MANIFEST_UTIL_H */
