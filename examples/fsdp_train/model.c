/* SPDX-License-Identifier: Apache-2.0 */
#include "model.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Stream ids keep the random sequences of different uses apart. */
enum {
    STREAM_TOKENS = 101,
    STREAM_TEACHER = 202,
};

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t ft_hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    uint64_t h = splitmix64(a);
    h = splitmix64(h ^ b);
    h = splitmix64(h ^ c);
    return splitmix64(h ^ d);
}

static double unit_open(uint64_t h)
{
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); /* (0, 1) */
}

float ft_rand_uniform(uint64_t seed, uint64_t stream, uint64_t index)
{
    return (float)(2.0 * unit_open(ft_hash(seed, stream, index, 0)) - 1.0);
}

float ft_rand_normal(uint64_t seed, uint64_t stream, uint64_t index)
{
    double u1 = unit_open(ft_hash(seed, stream, index, 1));
    double u2 = unit_open(ft_hash(seed, stream, index, 2));
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void ft_make_tokens(const ft_dims_t *d, uint64_t seed, uint64_t step, uint64_t source,
                    int32_t *tokens)
{
    size_t n = (size_t)d->batch * (size_t)d->tokens;
    for (size_t i = 0; i < n; i++)
        tokens[i] =
            (int32_t)(ft_hash(seed, STREAM_TOKENS + (step << 8), source, i) % (uint64_t)d->vocab);
}

/* ---- teacher ------------------------------------------------------------------------- */

/*
 * y = W2 tanh(W1 x + b1) with x the mean of the teacher's own embeddings: a smooth, fixed,
 * random function of the token bag that the student has to learn.
 */
struct ft_teacher {
    ft_dims_t d;
    float *E;  /* vocab x dim */
    float *W1; /* hidden x dim */
    float *b1; /* hidden */
    float *W2; /* out x hidden */
};

static void fill_normal(float *x, size_t n, uint64_t seed, uint64_t stream, float scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = scale * ft_rand_normal(seed, stream, i);
}

ft_teacher_t *ft_teacher_create(const ft_dims_t *d, uint64_t seed)
{
    ft_teacher_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->d = *d;
    size_t V = (size_t)d->vocab, D = (size_t)d->dim, H = (size_t)d->hidden, C = (size_t)d->out;
    t->E = malloc(V * D * sizeof(float));
    t->W1 = malloc(H * D * sizeof(float));
    t->b1 = malloc(H * sizeof(float));
    t->W2 = malloc(C * H * sizeof(float));
    if (t->E == NULL || t->W1 == NULL || t->b1 == NULL || t->W2 == NULL) {
        ft_teacher_destroy(t);
        return NULL;
    }
    /* The mean of `tokens` unit-normal rows has variance 1/tokens per coordinate; these
     * scales put W1 x at a standard deviation of about 4/sqrt(tokens) (tanh well inside its
     * curved range) and the targets at O(1). */
    fill_normal(t->E, V * D, seed, STREAM_TEACHER + 1, 1.0f);
    fill_normal(t->W1, H * D, seed, STREAM_TEACHER + 2, 4.0f / sqrtf((float)D));
    fill_normal(t->b1, H, seed, STREAM_TEACHER + 3, 0.5f);
    fill_normal(t->W2, C * H, seed, STREAM_TEACHER + 4, 2.0f / sqrtf((float)H));
    return t;
}

void ft_teacher_destroy(ft_teacher_t *t)
{
    if (t == NULL)
        return;
    free(t->E);
    free(t->W1);
    free(t->b1);
    free(t->W2);
    free(t);
}

int ft_teacher_targets(const ft_teacher_t *t, const int32_t *tokens, float *y)
{
    const ft_dims_t *d = &t->d;
    size_t B = (size_t)d->batch;
    float *x = malloc(B * (size_t)d->dim * sizeof(float));
    float *a = malloc(B * (size_t)d->hidden * sizeof(float));
    if (x == NULL || a == NULL) {
        free(x);
        free(a);
        return -1;
    }
    ft_embed_fwd(d, t->E, tokens, x);
    ft_linear_fwd(d->batch, d->dim, d->hidden, x, t->W1, t->b1, a);
    for (size_t i = 0; i < B * (size_t)d->hidden; i++)
        a[i] = tanhf(a[i]);
    ft_linear_fwd(d->batch, d->hidden, d->out, a, t->W2, NULL, y);
    free(x);
    free(a);
    return 0;
}

/* ---- student kernels -------------------------------------------------------------------- */

void ft_embed_fwd(const ft_dims_t *d, const float *E, const int32_t *tokens, float *h)
{
    size_t D = (size_t)d->dim;
    float inv = 1.0f / (float)d->tokens;
    for (int b = 0; b < d->batch; b++) {
        float *hb = h + (size_t)b * D;
        memset(hb, 0, D * sizeof(float));
        for (int j = 0; j < d->tokens; j++) {
            const float *e = E + (size_t)tokens[(size_t)b * (size_t)d->tokens + (size_t)j] * D;
            for (size_t k = 0; k < D; k++)
                hb[k] += e[k];
        }
        for (size_t k = 0; k < D; k++)
            hb[k] *= inv;
    }
}

void ft_embed_bwd(const ft_dims_t *d, const int32_t *tokens, const float *dh, float *dE)
{
    size_t D = (size_t)d->dim;
    float inv = 1.0f / (float)d->tokens;
    for (int b = 0; b < d->batch; b++) {
        const float *g = dh + (size_t)b * D;
        for (int j = 0; j < d->tokens; j++) {
            float *e = dE + (size_t)tokens[(size_t)b * (size_t)d->tokens + (size_t)j] * D;
            for (size_t k = 0; k < D; k++)
                e[k] += g[k] * inv;
        }
    }
}

void ft_linear_fwd(int B, int in, int out, const float *x, const float *W, const float *b, float *y)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, out, in, 1.0f, x, in, W, in, 0.0f, y,
                out);
    if (b == NULL)
        return;
    for (int i = 0; i < B; i++)
        for (int j = 0; j < out; j++)
            y[(size_t)i * (size_t)out + (size_t)j] += b[j];
}

void ft_linear_bwd(int B, int in, int out, const float *x, const float *W, const float *dy,
                   float *dW, float *db, float *dx, int accumulate_dx)
{
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, B, 1.0f, dy, out, x, in, 0.0f, dW,
                in);
    if (db != NULL) {
        memset(db, 0, (size_t)out * sizeof(float));
        for (int i = 0; i < B; i++)
            for (int j = 0; j < out; j++)
                db[j] += dy[(size_t)i * (size_t)out + (size_t)j];
    }
    if (dx != NULL)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, in, out, 1.0f, dy, out, W, in,
                    accumulate_dx ? 1.0f : 0.0f, dx, in);
}

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_C 0.044715f

void ft_gelu_fwd(size_t n, const float *a, float *s)
{
    for (size_t i = 0; i < n; i++) {
        float x = a[i];
        s[i] = 0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_C * x * x * x)));
    }
}

void ft_gelu_bwd(size_t n, const float *a, const float *ds, float *da)
{
    for (size_t i = 0; i < n; i++) {
        float x = a[i];
        float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        float dt = (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        da[i] = ds[i] * (0.5f * (1.0f + t) + 0.5f * x * dt);
    }
}

void ft_rmsnorm_fwd(int B, int D, const float *h, const float *g, float *z, float *rinv)
{
    for (int b = 0; b < B; b++) {
        const float *hb = h + (size_t)b * (size_t)D;
        float ss = 0.0f;
        for (int k = 0; k < D; k++)
            ss += hb[k] * hb[k];
        float r = 1.0f / sqrtf(ss / (float)D + FT_NORM_EPS);
        rinv[b] = r;
        for (int k = 0; k < D; k++)
            z[(size_t)b * (size_t)D + (size_t)k] = g[k] * hb[k] * r;
    }
}

void ft_rmsnorm_bwd(int B, int D, const float *h, const float *g, const float *rinv,
                    const float *dz, float *dg, float *dh)
{
    memset(dg, 0, (size_t)D * sizeof(float));
    for (int b = 0; b < B; b++) {
        const float *hb = h + (size_t)b * (size_t)D;
        const float *dzb = dz + (size_t)b * (size_t)D;
        float *dhb = dh + (size_t)b * (size_t)D;
        float r = rinv[b];
        float dot = 0.0f; /* sum_k (dz_k g_k) u_k with u = h r */
        for (int k = 0; k < D; k++) {
            float u = hb[k] * r;
            dg[k] += dzb[k] * u;
            dot += dzb[k] * g[k] * u;
        }
        dot /= (float)D;
        for (int k = 0; k < D; k++)
            dhb[k] = r * (dzb[k] * g[k] - hb[k] * r * dot);
    }
}

float ft_mse(int B, int C, const float *y, const float *t, float *dy)
{
    size_t n = (size_t)B * (size_t)C;
    float scale = 2.0f / (float)n;
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        float e = y[i] - t[i];
        sum += (double)e * (double)e;
        if (dy != NULL)
            dy[i] = scale * e;
    }
    return (float)(sum / (double)n);
}

/* ---- optimizers ------------------------------------------------------------------------- */

void ft_adamw_update(size_t n, float *w, const float *g, float *m, float *v, int t, float lr,
                     float eps, float wd)
{
    float bc1 = (float)(1.0 - pow((double)FT_ADAM_BETA1, (double)t));
    float bc2 = (float)(1.0 - pow((double)FT_ADAM_BETA2, (double)t));
    float decay = 1.0f - lr * wd;
    for (size_t i = 0; i < n; i++) {
        m[i] = FT_ADAM_BETA1 * m[i] + (1.0f - FT_ADAM_BETA1) * g[i];
        v[i] = FT_ADAM_BETA2 * v[i] + (1.0f - FT_ADAM_BETA2) * g[i] * g[i];
        w[i] = w[i] * decay - lr * (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps);
    }
}

size_t ft_ns_workspace(size_t m, size_t k)
{
    size_t r = m < k ? m : k, c = m < k ? k : m;
    return 2 * r * c + 2 * r * r;
}

double ft_ns_flops(size_t m, size_t k)
{
    double r = (double)(m < k ? m : k), c = (double)(m < k ? k : m);
    return FT_MUON_NS_STEPS * (4.0 * r * r * c + 2.0 * r * r * r);
}

int ft_newton_schulz(size_t m, size_t k, const float *U, float *out, float *ws)
{
    int transposed = m > k;
    size_t r = transposed ? k : m, c = transposed ? m : k;
    if (r > INT_MAX || c > INT_MAX)
        return -1;
    float *X = ws, *Xn = ws + r * c, *A = ws + 2 * r * c, *Bm = A + r * r;
    /* X is r x c with r <= c, so X X^T is the small Gram matrix. */
    if (transposed) {
        for (size_t i = 0; i < m; i++)
            for (size_t j = 0; j < k; j++)
                X[j * c + i] = U[i * k + j];
    } else {
        memcpy(X, U, r * c * sizeof(float));
    }
    double ss = 0.0;
    for (size_t i = 0; i < r * c; i++)
        ss += (double)X[i] * (double)X[i];
    float inv = (float)(1.0 / (sqrt(ss) + 1e-7));
    for (size_t i = 0; i < r * c; i++)
        X[i] *= inv;
    int ri = (int)r, ci = (int)c;
    for (int it = 0; it < FT_MUON_NS_STEPS; it++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ri, ri, ci, 1.0f, X, ci, X, ci, 0.0f,
                    A, ri);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ri, ri, ri, FT_NS_C, A, ri, A, ri,
                    0.0f, Bm, ri);
        for (size_t i = 0; i < r * r; i++)
            Bm[i] += FT_NS_B * A[i];
        memcpy(Xn, X, r * c * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ri, ci, ri, 1.0f, Bm, ri, X, ci,
                    FT_NS_A, Xn, ci);
        float *tmp = X;
        X = Xn;
        Xn = tmp;
    }
    float scale = m > k ? sqrtf((float)m / (float)k) : 1.0f;
    if (transposed) {
        for (size_t i = 0; i < m; i++)
            for (size_t j = 0; j < k; j++)
                out[i * k + j] = scale * X[j * c + i];
    } else {
        for (size_t i = 0; i < r * c; i++)
            out[i] = scale * X[i];
    }
    return 0;
}
