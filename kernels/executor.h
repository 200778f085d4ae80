/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Executor (floor 3): the runtime's local work — copies, casts, FSDP packing, the owner-side
 * sums of reduce-to-owner, the optimizer steps — on one kind of memory. `cpu` runs the CPU
 * kernels on host memory and completes every call before it returns. `cuda` enqueues the
 * CUDA kernels on a stream (the intercepted call's: set_stream) and returns at once; only
 * sqnorm (a scalar the host needs) and sync wait for the stream.
 *
 * The runtime and the transports (floor 4, for the sums of their reduce pipelines) call only
 * this table, so one driver serves both backends. Buffers are of the executor's memory kind.
 */
#ifndef MFSDP_KERNELS_EXECUTOR_H
#define MFSDP_KERNELS_EXECUTOR_H

#include "mfsdp/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mfsdp_exec mfsdp_exec_t;

typedef struct mfsdp_exec_ops {
    const char *name;
    int device_memory; /* 1: buffers are device memory (the host must not touch them) */
    /* Work of later calls goes on this stream (cuda); ignored by cpu. */
    mfsdp_status_t (*set_stream)(mfsdp_exec_t *e, void *stream);
    mfsdp_status_t (*copy)(mfsdp_exec_t *e, void *dst, const void *src, size_t bytes);
    mfsdp_status_t (*zero)(mfsdp_exec_t *e, void *dst, size_t bytes);
    /* Host bytes to executor memory and back (small control data: tests, checkpoints,
     * a transport's host values). download waits until the bytes are on the host. */
    mfsdp_status_t (*upload)(mfsdp_exec_t *e, void *dst, const void *host, size_t bytes);
    mfsdp_status_t (*download)(mfsdp_exec_t *e, void *host, const void *src, size_t bytes);
    /* Zeroed memory of the executor's kind (the device arena, HSDP staging); bytes == 0 gives
     * NULL. Not for the hot path: the cuda executor allocates and synchronizes. */
    mfsdp_status_t (*mem_alloc)(mfsdp_exec_t *e, size_t bytes, void **ptr_p);
    void (*mem_free)(mfsdp_exec_t *e, void *ptr);
    mfsdp_status_t (*cast)(mfsdp_exec_t *e, void *dst, mfsdp_dtype_t dst_dtype, const void *src,
                           mfsdp_dtype_t src_dtype, size_t n);
    mfsdp_status_t (*pack)(mfsdp_exec_t *e, void *full, const void *fsdp_buf,
                           const mfsdp_strided_geom_t *geom);
    mfsdp_status_t (*unpack)(mfsdp_exec_t *e, void *fsdp_buf, const void *full,
                             const mfsdp_strided_geom_t *geom);
    /* pout[i] = (pin ? pin[i] : nothing) + x[i] (times scalar for premulsum), in fp32; with
     * pin == NULL the first term is absent (not an addition of 0), so that chained sums are
     * bitwise those of reduce_ordered. x has dtype elements. */
    mfsdp_status_t (*combine)(mfsdp_exec_t *e, float *pout, const float *pin, const void *x,
                              mfsdp_dtype_t dtype, size_t n, mfsdp_redop_t op, float scalar);
    /* grad[i] += avg ? s[i] / world : s[i] */
    mfsdp_status_t (*apply)(mfsdp_exec_t *e, float *grad, const float *s, size_t n,
                            mfsdp_redop_t op, int world);
    /* mfsdp_cpu_reduce_ordered's semantics (src: nsrc pointers of executor memory) */
    mfsdp_status_t (*reduce_ordered)(mfsdp_exec_t *e, float *out, const void *const *src, int nsrc,
                                     mfsdp_dtype_t src_dtype, size_t n, mfsdp_redop_t op,
                                     float scalar, int accumulate);
    /* x[i] *= a */
    mfsdp_status_t (*scale)(mfsdp_exec_t *e, float *x, size_t n, float a);
    /* y[i] += a * x[i]; x[i] = 0 (HSDP: a replicated contribution into the gradient) */
    mfsdp_status_t (*axpy_clear)(mfsdp_exec_t *e, float *y, float *x, size_t n, float a);
    /* *acc += sum of x[i]^2 (fixed association, as mfsdp_cpu_sqnorm_accumulate); waits for
     * the result */
    mfsdp_status_t (*sqnorm)(mfsdp_exec_t *e, const float *x, size_t n, double *acc);
    /* mfsdp_cpu_muon_update / mfsdp_cpu_adamw_update semantics */
    mfsdp_status_t (*muon)(mfsdp_exec_t *e, float *w, float *mom, const float *g, void *w_comm,
                           mfsdp_dtype_t comm_dtype, int64_t m, int64_t k, size_t nsplit,
                           const int64_t *split, const mfsdp_muon_hp_t *hp, float *ws,
                           size_t ws_elems);
    mfsdp_status_t (*adamw)(mfsdp_exec_t *e, float *w, float *m, float *v, const float *g,
                            void *w_comm, mfsdp_dtype_t comm_dtype, size_t n, int64_t t,
                            const mfsdp_adamw_hp_t *hp);
    /* Workspace elements (floats) muon needs for an m x k matrix. */
    size_t (*muon_workspace)(mfsdp_exec_t *e, int64_t m, int64_t k);
    /* Wait until everything enqueued so far has completed. */
    mfsdp_status_t (*sync)(mfsdp_exec_t *e);
    void (*destroy)(mfsdp_exec_t *e);
} mfsdp_exec_ops_t;

struct mfsdp_exec {
    const mfsdp_exec_ops_t *ops;
};

/* The host-memory executor (CPU kernels). */
mfsdp_status_t mfsdp_exec_cpu_create(mfsdp_exec_t **e_p);

/* The device executor (kernels/cuda/exec_cuda.cu, built only with CUDA: MFSDP_HAVE_CUDA):
 * makes @p device current, creates a CUDA context (cuBLAS handle, workspace) on the legacy
 * default stream until set_stream, and a small device scratch for sqnorm. Its copies and
 * kernels are enqueued on the current stream; sqnorm, download, mem_alloc and sync wait. */
mfsdp_status_t mfsdp_exec_cuda_create(int device, mfsdp_exec_t **e_p);

#ifdef __cplusplus
}
#endif

#endif /* MFSDP_KERNELS_EXECUTOR_H */
