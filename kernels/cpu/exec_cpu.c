/* SPDX-License-Identifier: Apache-2.0 */
/* The host-memory executor: the CPU kernels, each call complete when it returns. */
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "kernels/cpu/cpu.h"
#include "kernels/executor.h"

static mfsdp_status_t cpu_set_stream(mfsdp_exec_t *e, void *stream)
{
    (void)e;
    (void)stream;
    return MFSDP_OK;
}

static mfsdp_status_t cpu_copy(mfsdp_exec_t *e, void *dst, const void *src, size_t bytes)
{
    (void)e;
    MFSDP_CHECK_ARG(bytes == 0 || (dst != NULL && src != NULL));
    if (bytes != 0 && dst != src) {
        memmove(dst, src, bytes);
    }
    return MFSDP_OK;
}

static mfsdp_status_t cpu_zero(mfsdp_exec_t *e, void *dst, size_t bytes)
{
    (void)e;
    MFSDP_CHECK_ARG(bytes == 0 || dst != NULL);
    if (bytes != 0) {
        memset(dst, 0, bytes);
    }
    return MFSDP_OK;
}

static mfsdp_status_t cpu_mem_alloc(mfsdp_exec_t *e, size_t bytes, void **ptr_p)
{
    (void)e;
    MFSDP_CHECK_ARG(ptr_p != NULL);
    if (bytes == 0) {
        *ptr_p = NULL;
        return MFSDP_OK;
    }
    void *p = calloc(1, bytes);
    if (p == NULL) {
        MFSDP_WARN("cannot allocate %zu bytes of host memory", bytes);
        return MFSDP_ERR_NO_MEMORY;
    }
    *ptr_p = p;
    return MFSDP_OK;
}

static void cpu_mem_free(mfsdp_exec_t *e, void *ptr)
{
    (void)e;
    free(ptr);
}

static mfsdp_status_t cpu_cast(mfsdp_exec_t *e, void *dst, mfsdp_dtype_t dd, const void *src,
                               mfsdp_dtype_t sd, size_t n)
{
    (void)e;
    return mfsdp_cpu_cast(dst, dd, src, sd, n);
}

static mfsdp_status_t cpu_pack(mfsdp_exec_t *e, void *full, const void *buf,
                               const mfsdp_strided_geom_t *geom)
{
    (void)e;
    return mfsdp_cpu_pack(full, buf, geom);
}

static mfsdp_status_t cpu_unpack(mfsdp_exec_t *e, void *buf, const void *full,
                                 const mfsdp_strided_geom_t *geom)
{
    (void)e;
    return mfsdp_cpu_unpack(buf, full, geom);
}

static mfsdp_status_t cpu_combine(mfsdp_exec_t *e, float *pout, const float *pin, const void *x,
                                  mfsdp_dtype_t dtype, size_t n, mfsdp_redop_t op, float scalar)
{
    (void)e;
    MFSDP_CHECK_ARG(pout != NULL && (x != NULL || n == 0));
    MFSDP_CHECK_ARG(dtype == MFSDP_FLOAT32 || dtype == MFSDP_BFLOAT16 || dtype == MFSDP_FLOAT16);
    MFSDP_CHECK_ARG(pin == NULL || pin == pout ||
                    !mfsdp_ranges_overlap(pin, n * sizeof(float), pout, n * sizeof(float)));
    mfsdp_cpu_combine(pout, pin, x, dtype, n, op == MFSDP_OP_PREMULSUM, scalar);
    return MFSDP_OK;
}

static mfsdp_status_t cpu_apply(mfsdp_exec_t *e, float *grad, const float *s, size_t n,
                                mfsdp_redop_t op, int world)
{
    (void)e;
    MFSDP_CHECK_ARG((grad != NULL && s != NULL) || n == 0);
    MFSDP_CHECK_ARG(world >= 1);
    if (op == MFSDP_OP_AVG) {
        float w = (float)world;
        for (size_t i = 0; i < n; i++) {
            grad[i] += s[i] / w;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            grad[i] += s[i];
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t cpu_reduce_ordered(mfsdp_exec_t *e, float *out, const void *const *src,
                                         int nsrc, mfsdp_dtype_t dtype, size_t n, mfsdp_redop_t op,
                                         float scalar, int accumulate)
{
    (void)e;
    return mfsdp_cpu_reduce_ordered(out, src, nsrc, dtype, n, op, scalar, accumulate);
}

static mfsdp_status_t cpu_scale(mfsdp_exec_t *e, float *x, size_t n, float a)
{
    (void)e;
    MFSDP_CHECK_ARG(x != NULL || n == 0);
    for (size_t i = 0; i < n; i++) {
        x[i] *= a;
    }
    return MFSDP_OK;
}

static mfsdp_status_t cpu_axpy_clear(mfsdp_exec_t *e, float *y, float *x, size_t n, float a)
{
    (void)e;
    MFSDP_CHECK_ARG((y != NULL && x != NULL) || n == 0);
    for (size_t i = 0; i < n; i++) {
        y[i] += x[i] * a;
        x[i] = 0.0f;
    }
    return MFSDP_OK;
}

static mfsdp_status_t cpu_sqnorm(mfsdp_exec_t *e, const float *x, size_t n, double *acc)
{
    (void)e;
    return mfsdp_cpu_sqnorm_accumulate(x, n, acc);
}

static mfsdp_status_t cpu_muon(mfsdp_exec_t *e, float *w, float *mom, const float *g, void *w_comm,
                               mfsdp_dtype_t comm_dtype, int64_t m, int64_t k, size_t nsplit,
                               const int64_t *split, const mfsdp_muon_hp_t *hp, float *ws,
                               size_t ws_elems)
{
    (void)e;
    return mfsdp_cpu_muon_update(w, mom, g, w_comm, comm_dtype, m, k, nsplit, split, hp, ws,
                                 ws_elems);
}

static mfsdp_status_t cpu_adamw(mfsdp_exec_t *e, float *w, float *m, float *v, const float *g,
                                void *w_comm, mfsdp_dtype_t comm_dtype, size_t n, int64_t t,
                                const mfsdp_adamw_hp_t *hp)
{
    (void)e;
    return mfsdp_cpu_adamw_update(w, m, v, g, w_comm, comm_dtype, n, t, hp);
}

static size_t cpu_muon_workspace(mfsdp_exec_t *e, int64_t m, int64_t k)
{
    (void)e;
    return mfsdp_muon_workspace_elems(m, k);
}

static mfsdp_status_t cpu_sync(mfsdp_exec_t *e)
{
    (void)e;
    return MFSDP_OK;
}

static void cpu_destroy(mfsdp_exec_t *e)
{
    free(e);
}

static const mfsdp_exec_ops_t cpu_ops = {
    .name = "cpu",
    .device_memory = 0,
    .set_stream = cpu_set_stream,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .upload = cpu_copy,
    .download = cpu_copy,
    .mem_alloc = cpu_mem_alloc,
    .mem_free = cpu_mem_free,
    .cast = cpu_cast,
    .pack = cpu_pack,
    .unpack = cpu_unpack,
    .combine = cpu_combine,
    .apply = cpu_apply,
    .reduce_ordered = cpu_reduce_ordered,
    .scale = cpu_scale,
    .axpy_clear = cpu_axpy_clear,
    .sqnorm = cpu_sqnorm,
    .muon = cpu_muon,
    .adamw = cpu_adamw,
    .muon_workspace = cpu_muon_workspace,
    .sync = cpu_sync,
    .destroy = cpu_destroy,
};

mfsdp_status_t mfsdp_exec_cpu_create(mfsdp_exec_t **e_p)
{
    MFSDP_CHECK_ARG(e_p != NULL);
    mfsdp_exec_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    e->ops = &cpu_ops;
    *e_p = e;
    return MFSDP_OK;
}
