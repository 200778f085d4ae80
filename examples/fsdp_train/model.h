/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Math of the fsdp_train example: deterministic data, the fixed teacher, the student's
 * layer kernels (forward and backward on full, unsharded tensors), AdamW and the
 * Newton-Schulz orthogonalization of Muon. Nothing here knows about sharding or
 * communication, and nothing includes mfsdp: the example is an unmodified job.
 */
#ifndef FSDP_TRAIN_MODEL_H
#define FSDP_TRAIN_MODEL_H

#include <stddef.h>
#include <stdint.h>

/** Model and batch dimensions. */
typedef struct ft_dims {
    int vocab;  /**< rows of the input embedding table */
    int dim;    /**< width of the residual stream */
    int hidden; /**< width of each block's hidden layer */
    int out;    /**< outputs (rows of the head) */
    int blocks; /**< residual MLP blocks, one FSDP group each */
    int batch;  /**< samples per micro-batch (per rank) */
    int tokens; /**< tokens per sample (bag of embeddings) */
} ft_dims_t;

/** Muon hyper-parameters (docs/design.md, "The optimizer step" defaults). */
#define FT_MUON_MOMENTUM 0.95f
#define FT_MUON_NS_STEPS 5
#define FT_NS_A          3.4445f
#define FT_NS_B          (-4.7750f)
#define FT_NS_C          2.0315f
#define FT_ADAM_BETA1    0.9f
#define FT_ADAM_BETA2    0.95f
#define FT_NORM_EPS      1e-6f

/** A counter-based hash: the same inputs give the same 64 bits on every rank. */
uint64_t ft_hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d);

/** Uniform in [-1, 1) and standard normal deviates keyed by (seed, stream, index). */
float ft_rand_uniform(uint64_t seed, uint64_t stream, uint64_t index);
float ft_rand_normal(uint64_t seed, uint64_t stream, uint64_t index);

/**
 * Tokens of one micro-batch: batch x tokens ids in [0, vocab), a pure function of
 * (seed, step, source); source is the rank that owns the micro-batch (or an eval id).
 */
void ft_make_tokens(const ft_dims_t *d, uint64_t seed, uint64_t step, uint64_t source,
                    int32_t *tokens);

/** The fixed random teacher network that defines the targets. */
typedef struct ft_teacher ft_teacher_t;

/** Build the teacher from the seed; returns NULL when out of memory. */
ft_teacher_t *ft_teacher_create(const ft_dims_t *d, uint64_t seed);
void ft_teacher_destroy(ft_teacher_t *t);

/** Targets (batch x out) of the teacher for the given tokens; 0 or -1 (out of memory). */
int ft_teacher_targets(const ft_teacher_t *t, const int32_t *tokens, float *y);

/* ---- student kernels (row-major, cblas) ------------------------------------------------ */

/** h[b] = mean over the sample's tokens of E[token] (B x D). */
void ft_embed_fwd(const ft_dims_t *d, const float *E, const int32_t *tokens, float *h);

/** dE[token] += dh[b] / tokens (dE must be zeroed first). */
void ft_embed_bwd(const ft_dims_t *d, const int32_t *tokens, const float *dh, float *dE);

/** y = x W^T + b: x is B x in, W is out x in, y is B x out. */
void ft_linear_fwd(int B, int in, int out, const float *x, const float *W, const float *b,
                   float *y);

/** dW = dy^T x, db = sum_b dy (overwritten); dx = dy W, added to dx when accumulate_dx. */
void ft_linear_bwd(int B, int in, int out, const float *x, const float *W, const float *dy,
                   float *dW, float *db, float *dx, int accumulate_dx);

/** GELU (tanh approximation), elementwise, and its backward da = ds * gelu'(a). */
void ft_gelu_fwd(size_t n, const float *a, float *s);
void ft_gelu_bwd(size_t n, const float *a, const float *ds, float *da);

/** RMSNorm with gain g: z = g * h / rms(h); rinv (B) is saved for the backward. */
void ft_rmsnorm_fwd(int B, int D, const float *h, const float *g, float *z, float *rinv);

/** Backward of ft_rmsnorm_fwd: dg (overwritten), dh (overwritten). */
void ft_rmsnorm_bwd(int B, int D, const float *h, const float *g, const float *rinv,
                    const float *dz, float *dg, float *dh);

/** Mean squared error over B x C and its gradient dy = 2 (y - t) / (B C). */
float ft_mse(int B, int C, const float *y, const float *t, float *dy);

/* ---- optimizers ------------------------------------------------------------------------ */

/** One AdamW step (docs/design.md, "The optimizer step") on n elements; t counts from 1. */
void ft_adamw_update(size_t n, float *w, const float *g, float *m, float *v, int t, float lr,
                     float eps, float wd);

/**
 * Newton-Schulz orthogonalization of an m x k matrix U (docs/design.md, "The optimizer step"): the
 * result (m x k, times the "keller" scale max(1, m/k)^0.5) goes to out. ws must hold
 * ft_ns_workspace(m, k) floats. Returns 0, or -1 when the sizes overflow an int.
 */
int ft_newton_schulz(size_t m, size_t k, const float *U, float *out, float *ws);
size_t ft_ns_workspace(size_t m, size_t k);

/** Newton-Schulz FLOPs for an m x k matrix (for the report). */
double ft_ns_flops(size_t m, size_t k);

#endif /* FSDP_TRAIN_MODEL_H */
