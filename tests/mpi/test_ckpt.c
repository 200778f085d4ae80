/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner checkpoints of a running context (runtime/checkpoint.c), run under mpirun. A job
 * trains a fixed model (Muon matrices in bf16 and fp32, a 3-D one, a frozen one; AdamW
 * embeddings, norms, a bias with fewer rows than ranks, a bf16 head) through
 * mfsdp_ctx_allgather/reduce on synthetic FSDP buffers: each step's gradient is a function
 * of the weights the all-gather returned (rank 0 contributes it, the others zeros, so the
 * reduced gradient is the same at every world size).
 *
 * Modes (argv[1]):
 *  basic DIR          save/load round trips in one process and every error path, with the
 *                     same status on every rank (run at 1..4 ranks by meson)
 *  save DIR ...       train --steps N, save, wait; DIR.ref gets the masters and weights
 *  resume DIR ...     load at this world size: bitwise the saved state; then --more K
 *                     steps match an uninterrupted run from scratch at this world size
 *                     (bitwise with --bitwise, else 1e-5 relative per tensor)
 *  loadfull FILE REF  load_full: masters (F32 file) or weights (param-dtype file) bitwise
 *                     those of REF
 *  import ROOT FILE   a checkpoint made by `mfsdp-ckpt import-full` from FILE and a
 *                     load_full of FILE train identically
 *  killfork DIR       (1 rank) a save killed with SIGKILL at every progress point, in a
 *                     forked child: the previous checkpoint always verifies and loads
 *  killmpi DIR        a save where rank --kill-rank is killed at point --point (mpirun
 *                     then ends the job); `check DIR` afterwards loads what latest names
 *  check DIR          latest verifies and loads, equal to DIR.refA or DIR.refB
 *  corrupt DIR        corrupted copies of a checkpoint refused by the collective load
 *  perf DIR --mb X    save and load throughput per rank
 */
#include <dirent.h>
#include <math.h>
#include <mpi.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/ckpt_io.h"
#include "core/log.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/kernels.h"
#include "mfsdp/runtime_mpi.h"
#include "runtime/checkpoint.h"
#include "tests/lib/ckpt_util.h"

#include "tests/lib/mpi_check.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------------------------------
 * The model
 */
static const char model_json[] =
    "{\"format\":\"mfsdp-manifest/1\","
    " \"optimizer\":{\"lr\":0.02,\"weight_decay\":0.01,"
    "  \"adamw\":{\"lr\":0.01,\"weight_decay\":0.02}},"
    " \"groups\":["
    "  {\"name\":\"embed\",\"params\":[{\"name\":\"embed.weight\",\"shape\":[37,12],"
    "\"dtype\":\"float32\"}]},"
    "  {\"name\":\"blocks.0\",\"reduce_dtype\":\"float32\",\"params\":["
    "    {\"name\":\"blocks.0.wq\",\"shape\":[24,16],\"dtype\":\"bfloat16\"},"
    "    {\"name\":\"blocks.0.norm\",\"shape\":[24],\"dtype\":\"bfloat16\"},"
    "    {\"name\":\"blocks.0.bias\",\"shape\":[3],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.0.w3\",\"shape\":[5,3,4],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.0.frozen\",\"shape\":[6,4],\"dtype\":\"bfloat16\","
    "\"requires_grad\":false}]},"
    "  {\"name\":\"blocks.1\",\"params\":["
    "    {\"name\":\"blocks.1.w1\",\"shape\":[20,9],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.1.w2\",\"shape\":[9,20],\"dtype\":\"float32\"},"
    "    {\"name\":\"blocks.1.norm\",\"shape\":[20],\"dtype\":\"float32\"}]},"
    "  {\"name\":\"head\",\"params\":[{\"name\":\"lm_head.weight\",\"shape\":[11,24],"
    "\"dtype\":\"bfloat16\"}]}]}";

static mfsdp_manifest_t *model(const char *json)
{
    mfsdp_manifest_t *m = NULL;
    char err[512] = "";
    if (mfsdp_manifest_parse(json, strlen(json), "model", err, sizeof(err), &m) != MFSDP_OK) {
        fprintf(stderr, "model: %s\n", err);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return m;
}

/* A larger model for the throughput figures: `mb` MiB of fp32 weights in square matrices
 * (half bf16: they carry fp32 masters too) and their norms. */
static mfsdp_manifest_t *perf_model(int mb)
{
    char *json = malloc(1 << 20);
    size_t o = (size_t)sprintf(json, "{\"format\":\"mfsdp-manifest/1\",\"groups\":[");
    int n = 1024, per = n * n * 4 / (1 << 20); /* MiB per matrix */
    int count = mb / per < 2 ? 2 : mb / per;
    for (int i = 0; i < count; i++) {
        o += (size_t)sprintf(json + o,
                             "%s{\"name\":\"l%d\",\"reduce_dtype\":\"float32\",\"params\":[{"
                             "\"name\":\"l%d.w\",\"shape\":[%d,%d],"
                             "\"dtype\":\"%s\"},{\"name\":\"l%d.norm\",\"shape\":[%d],"
                             "\"dtype\":\"float32\"}]}",
                             i ? "," : "", i, i, n, n, i % 2 ? "bfloat16" : "float32", i, n);
    }
    sprintf(json + o, "]}");
    mfsdp_manifest_t *m = model(json);
    free(json);
    return m;
}

static size_t nparams(const mfsdp_manifest_t *m)
{
    size_t n = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        n += m->groups[g].nparams;
    }
    return n;
}

static const mfsdp_param_desc_t *param_at(const mfsdp_manifest_t *m, size_t t)
{
    for (size_t g = 0; g < m->ngroups; g++) {
        if (t < m->groups[g].nparams) {
            return &m->groups[g].params[t];
        }
        t -= m->groups[g].nparams;
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------
 * Deterministic numbers and dtype access
 */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static double urand(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t h = mix(mix(mix(a) ^ b) ^ c);
    return (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* Element e of a buffer of dtype dt; FSDP's mixed-dtype buffers are bytes, so elements may
 * be unaligned: memcpy. */
static void put(void *dst, mfsdp_dtype_t dt, size_t e, double v)
{
    if (dt == MFSDP_FLOAT32) {
        float f = (float)v;
        memcpy((char *)dst + 4 * e, &f, 4);
    } else {
        uint16_t h =
            dt == MFSDP_BFLOAT16 ? mfsdp_f32_to_bf16((float)v) : mfsdp_f32_to_f16((float)v);
        memcpy((char *)dst + 2 * e, &h, 2);
    }
}

static double get(const void *src, mfsdp_dtype_t dt, size_t e)
{
    if (dt == MFSDP_FLOAT32) {
        float f;
        memcpy(&f, (const char *)src + 4 * e, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const char *)src + 2 * e, 2);
    return dt == MFSDP_BFLOAT16 ? mfsdp_bf16_to_f32(h) : mfsdp_f16_to_f32(h);
}

/* ---------------------------------------------------------------------------------------
 * FSDP buffers (docs/design.md, "FSDP2's byte layout"), computed here independently
 */
typedef struct lay {
    size_t n;
    size_t idx[8];
    int64_t rows[8], rest[8], c[8];
    size_t elt[8], o[8]; /* bytes */
    size_t S;            /* bytes per rank */
    mfsdp_dtype_t wire;
    size_t count;
} lay_t;

static void layout_of(const mfsdp_group_desc_t *g, int rs, int n, lay_t *l)
{
    memset(l, 0, sizeof(*l));
    int mixed = 0;
    mfsdp_dtype_t rsd = g->has_reduce_dtype ? g->reduce_dtype : MFSDP_FLOAT32;
    int have = g->has_reduce_dtype;
    for (size_t i = 0; i < g->nparams; i++) {
        mixed |= g->params[i].dtype != g->params[0].dtype;
        if (!have && g->params[i].requires_grad) {
            rsd = g->params[i].dtype;
            have = 1;
        }
    }
    for (size_t i = 0; i < g->nparams; i++) {
        const mfsdp_param_desc_t *p = &g->params[i];
        if (rs && !p->requires_grad) {
            continue;
        }
        size_t k = l->n++;
        l->idx[k] = i;
        l->rows[k] = p->shape[0];
        l->rest[k] = p->numel / p->shape[0];
        l->c[k] = (p->shape[0] + n - 1) / n;
        l->elt[k] = mfsdp_dtype_size(rs ? rsd : p->dtype);
        l->o[k] = l->S;
        l->S += (size_t)(l->c[k] * l->rest[k]) * l->elt[k];
    }
    l->wire = rs ? rsd : (mixed ? MFSDP_UINT8 : g->params[0].dtype);
    l->count = l->S / mfsdp_dtype_size(l->wire);
}

/* Element e of param k of a rank-major buffer of layout l (world n), as a double. */
static double buf_get(const lay_t *l, const char *buf, size_t k, int64_t e, mfsdp_dtype_t dt)
{
    int64_t row = e / l->rest[k], col = e % l->rest[k];
    int64_t q = row / l->c[k];
    size_t off =
        (size_t)q * l->S + l->o[k] + (size_t)((row - q * l->c[k]) * l->rest[k] + col) * l->elt[k];
    return get(buf + off, dt, 0);
}

static void buf_put(const lay_t *l, char *buf, size_t k, int64_t e, mfsdp_dtype_t dt, double v)
{
    int64_t row = e / l->rest[k], col = e % l->rest[k];
    int64_t q = row / l->c[k];
    size_t off =
        (size_t)q * l->S + l->o[k] + (size_t)((row - q * l->c[k]) * l->rest[k] + col) * l->elt[k];
    put(buf + off, dt, 0, v);
}

/* A training job's buffers. */
typedef struct job {
    const mfsdp_manifest_t *m;
    lay_t *ag, *rs;                /* per group */
    char **agbuf, **rsin, **rsout; /* per group */
    size_t *first;                 /* global param index of each group's first param */
} job_t;

static void job_init(job_t *j, const mfsdp_manifest_t *m)
{
    memset(j, 0, sizeof(*j));
    j->m = m;
    size_t ng = m->ngroups;
    j->ag = calloc(ng, sizeof(lay_t));
    j->rs = calloc(ng, sizeof(lay_t));
    j->agbuf = calloc(ng, sizeof(char *));
    j->rsin = calloc(ng, sizeof(char *));
    j->rsout = calloc(ng, sizeof(char *));
    j->first = calloc(ng, sizeof(size_t));
    size_t t = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        layout_of(&m->groups[g], 0, g_world, &j->ag[g]);
        layout_of(&m->groups[g], 1, g_world, &j->rs[g]);
        j->agbuf[g] = calloc((size_t)g_world, j->ag[g].S + 1);
        j->rsin[g] = calloc((size_t)g_world, j->rs[g].S + 1);
        j->rsout[g] = calloc(1, j->rs[g].S + 1);
        j->first[g] = t;
        t += m->groups[g].nparams;
    }
}

static void job_free(job_t *j)
{
    for (size_t g = 0; g < j->m->ngroups; g++) {
        free(j->agbuf[g]);
        free(j->rsin[g]);
        free(j->rsout[g]);
    }
    free(j->ag);
    free(j->rs);
    free(j->agbuf);
    free(j->rsin);
    free(j->rsout);
    free(j->first);
}

static double init_value(size_t t, int64_t e)
{
    return 0.5 * urand(11, t, (uint64_t)e);
}

static double target_value(size_t t, int64_t e)
{
    return 0.3 * urand(23, t, (uint64_t)e);
}

/* One iteration: all-gather every group (forward), then reduce in reverse order with the
 * gradient 0.5 (W - T) + noise(step) from the gathered weights. garbage: the job's own
 * shards hold NaNs (a resumed job must not take them). */
static void train_step(mfsdp_ctx_h ctx, job_t *j, int step, int garbage)
{
    const mfsdp_manifest_t *m = j->m;
    for (size_t g = 0; g < m->ngroups; g++) {
        const lay_t *l = &j->ag[g];
        char *mine = j->agbuf[g] + (size_t)g_rank * l->S;
        memset(mine, garbage ? 0xff : 0, l->S);
        for (size_t k = 0; k < l->n && !garbage; k++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[l->idx[k]];
            int64_t first = g_rank * l->c[k];
            for (int64_t row = first; row < first + l->c[k] && row < l->rows[k]; row++) {
                for (int64_t col = 0; col < l->rest[k]; col++) {
                    int64_t e = row * l->rest[k] + col;
                    put(mine + l->o[k] + (size_t)((row - first) * l->rest[k] + col) * l->elt[k],
                        p->dtype, 0, init_value(j->first[g] + l->idx[k], e));
                }
            }
        }
        mfsdp_status_t st = mfsdp_ctx_allgather(ctx, g, mine, j->agbuf[g], l->count, l->wire);
        CHECK(st == MFSDP_OK, "allgather %zu step %d: %s", g, step, mfsdp_status_string(st));
    }
    for (size_t g = m->ngroups; g-- > 0;) {
        const lay_t *a = &j->ag[g], *r = &j->rs[g];
        if (r->n == 0) {
            continue;
        }
        memset(j->rsin[g], 0, (size_t)g_world * r->S);
        for (size_t k = 0; k < r->n && g_rank == 0; k++) {
            size_t pi = r->idx[k];
            const mfsdp_param_desc_t *p = &m->groups[g].params[pi];
            size_t ka = 0;
            while (a->idx[ka] != pi) {
                ka++;
            }
            size_t t = j->first[g] + pi;
            for (int64_t e = 0; e < p->numel; e++) {
                double w = buf_get(a, j->agbuf[g], ka, e, p->dtype);
                double grad = 0.5 * (w - target_value(t, e)) + 0.05 * urand(step, t, (uint64_t)e);
                buf_put(r, j->rsin[g], k, e, r->wire, grad);
            }
        }
        mfsdp_status_t st =
            mfsdp_ctx_reduce(ctx, g, j->rsin[g], j->rsout[g], r->count, r->wire, MFSDP_OP_SUM, 0.0);
        CHECK(st == MFSDP_OK, "reduce %zu step %d: %s", g, step, mfsdp_status_string(st));
    }
}

static void train(mfsdp_ctx_h ctx, job_t *j, int from, int to, int garbage)
{
    for (int s = from; s < to; s++) {
        train_step(ctx, j, s, garbage && s == from);
    }
    CHECK_OK(mfsdp_ctx_flush(ctx));
}

static mfsdp_ctx_h make_ctx(const mfsdp_manifest_t *m, mfsdp_tail_policy_t tail, mfsdp_algo_t algo,
                            mfsdp_step_mode_t mode, int accum)
{
    mfsdp_ctx_opts_t o;
    memset(&o, 0, sizeof(o));
    o.has_plan_opts = 1;
    o.plan_opts.tail = tail;
    o.gather_algo = algo;
    o.reduce_algo = algo;
    o.chain_chunk = 256;
    o.has_step_mode = 1;
    o.step_mode = mode;
    o.accum_steps = accum;
    o.has_clip = 1;
    o.no_mlock = 1;
    mfsdp_ctx_h ctx = NULL;
    mfsdp_status_t st = mfsdp_ctx_create_mpi(m, &o, MPI_COMM_WORLD, &ctx);
    if (st != MFSDP_OK) {
        fprintf(stderr, "[rank %d] context creation failed: %s\n", g_rank, mfsdp_status_string(st));
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return ctx;
}

/* ---------------------------------------------------------------------------------------
 * Whole tensors of a context, on every rank: for each param, the fp32 master bits, then the
 * weight (comm copy) bits widened to 32-bit words. Pieces are OR-ed together across ranks
 * (a slot nobody holds stays 0), which keeps every bit, signed zeros included.
 */
typedef struct state {
    size_t n;    /* params */
    size_t *off; /* word offset of each param's masters; weights follow */
    size_t words;
    uint32_t *w;
} state_t;

static state_t collect(mfsdp_ctx_h ctx, const mfsdp_manifest_t *m)
{
    state_t s = {.n = nparams(m)};
    s.off = calloc(s.n + 1, sizeof(size_t));
    for (size_t t = 0; t < s.n; t++) {
        s.off[t] = s.words;
        s.words += 2 * (size_t)param_at(m, t)->numel;
    }
    s.w = calloc(s.words + 1, sizeof(uint32_t));
    for (size_t t = 0; t < s.n; t++) {
        const mfsdp_param_desc_t *p = param_at(m, t);
        mfsdp_param_view_t v;
        CHECK_OK(mfsdp_ctx_get_param(ctx, p->name, &v));
        if (!v.local || v.local_valid == 0) {
            continue;
        }
        uint32_t *mw = s.w + s.off[t] + v.local_offset;
        uint32_t *ww = s.w + s.off[t] + (size_t)p->numel + v.local_offset;
        memcpy(mw, v.master, v.local_valid * 4);
        for (size_t e = 0; e < v.local_valid; e++) {
            ww[e] = p->dtype == MFSDP_FLOAT32 ? ((const uint32_t *)v.comm)[e]
                                              : ((const uint16_t *)v.comm)[e];
        }
    }
    MPI_Allreduce(MPI_IN_PLACE, s.w, (int)s.words, MPI_UINT32_T, MPI_BOR, MPI_COMM_WORLD);
    return s;
}

static void state_free(state_t *s)
{
    free(s->off);
    free(s->w);
}

static float as_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* tol 0: bitwise. Otherwise max |a-b| / max |b| per tensor, masters and weights. Returns
 * the largest relative difference seen. */
static double compare(const mfsdp_manifest_t *m, const state_t *a, const state_t *b, double tol,
                      const char *what)
{
    double worst = 0.0;
    for (size_t t = 0; t < a->n; t++) {
        const mfsdp_param_desc_t *p = param_at(m, t);
        for (int part = 0; part < 2; part++) {
            const uint32_t *x = a->w + a->off[t] + (size_t)part * (size_t)p->numel;
            const uint32_t *y = b->w + b->off[t] + (size_t)part * (size_t)p->numel;
            double dmax = 0.0, ymax = 0.0;
            size_t diffbits = 0;
            for (int64_t e = 0; e < p->numel; e++) {
                double xv, yv;
                if (part == 0 || p->dtype == MFSDP_FLOAT32) {
                    xv = as_f32(x[e]);
                    yv = as_f32(y[e]);
                } else {
                    uint16_t hx = (uint16_t)x[e], hy = (uint16_t)y[e];
                    int bf = p->dtype == MFSDP_BFLOAT16;
                    xv = bf ? mfsdp_bf16_to_f32(hx) : mfsdp_f16_to_f32(hx);
                    yv = bf ? mfsdp_bf16_to_f32(hy) : mfsdp_f16_to_f32(hy);
                }
                diffbits += x[e] != y[e];
                dmax = fmax(dmax, fabs(xv - yv));
                ymax = fmax(ymax, fabs(yv));
            }
            double rel = ymax > 0 ? dmax / ymax : dmax;
            worst = fmax(worst, rel);
            if (tol == 0.0) {
                CHECK(diffbits == 0, "%s: %s %s: %zu of %lld elements differ (max rel %.3g)", what,
                      p->name, part ? "weight" : "master", diffbits, (long long)p->numel, rel);
            } else {
                CHECK(rel <= tol, "%s: %s %s: relative difference %.3g > %g", what, p->name,
                      part ? "weight" : "master", rel, tol);
            }
        }
    }
    return worst;
}

/* The reference file of a saved state: the words of collect(), raw. */
static void state_write(const state_t *s, const char *path)
{
    if (g_rank == 0) {
        FILE *f = fopen(path, "wb");
        CHECK(f != NULL && fwrite(s->w, 4, s->words, f) == s->words, "write %s", path);
        if (f != NULL) {
            fclose(f);
        }
    }
}

static int state_read(const mfsdp_manifest_t *m, const char *path, state_t *s)
{
    memset(s, 0, sizeof(*s));
    s->n = nparams(m);
    s->off = calloc(s->n + 1, sizeof(size_t));
    for (size_t t = 0; t < s->n; t++) {
        s->off[t] = s->words;
        s->words += 2 * (size_t)param_at(m, t)->numel;
    }
    s->w = calloc(s->words + 1, 4);
    FILE *f = fopen(path, "rb");
    int ok = f != NULL && fread(s->w, 4, s->words, f) == s->words;
    if (f != NULL) {
        fclose(f);
    }
    return ok ? 0 : -1;
}

/* Same status on every rank. */
static void same_everywhere(mfsdp_status_t st, const char *what)
{
    int mine = (int)st, lo, hi;
    MPI_Allreduce(&mine, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    CHECK(lo == hi, "%s: ranks disagree (%d .. %d)", what, lo, hi);
}

static int file_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

static void rm_rf(const char *p)
{
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", p);
    if (system(cmd) != 0) {
        fprintf(stderr, "rm -rf %s failed\n", p);
    }
}

/* ---------------------------------------------------------------------------------------
 * Options
 */
typedef struct opts {
    const char *a1, *a2, *a3;
    int steps, more, bitwise, point, kill_rank, mb;
    mfsdp_tail_policy_t tail;
    mfsdp_algo_t algo;
    mfsdp_step_mode_t mode;
} opts_t;

static void parse_opts(int argc, char **argv, opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->steps = 6;
    o->more = 4;
    o->tail = MFSDP_TAIL_SHARD;
    o->algo = MFSDP_ALGO_DIRECT;
    o->mode = MFSDP_STEP_EAGER;
    o->kill_rank = -1;
    o->mb = 64;
    int pos = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : "";
        if (strcmp(a, "--steps") == 0) {
            o->steps = atoi(v), i++;
        } else if (strcmp(a, "--more") == 0) {
            o->more = atoi(v), i++;
        } else if (strcmp(a, "--bitwise") == 0) {
            o->bitwise = 1;
        } else if (strcmp(a, "--point") == 0) {
            o->point = atoi(v), i++;
        } else if (strcmp(a, "--kill-rank") == 0) {
            o->kill_rank = atoi(v), i++;
        } else if (strcmp(a, "--mb") == 0) {
            o->mb = atoi(v), i++;
        } else if (strcmp(a, "--tail") == 0) {
            o->tail = strcmp(v, "owner") == 0  ? MFSDP_TAIL_OWNER
                      : strcmp(v, "auto") == 0 ? MFSDP_TAIL_AUTO
                                               : MFSDP_TAIL_SHARD;
            i++;
        } else if (strcmp(a, "--algo") == 0) {
            o->algo = strcmp(v, "chain") == 0    ? MFSDP_ALGO_CHAIN
                      : strcmp(v, "native") == 0 ? MFSDP_ALGO_NATIVE
                                                 : MFSDP_ALGO_DIRECT;
            i++;
        } else if (strcmp(a, "--lazy") == 0) {
            o->mode = MFSDP_STEP_LAZY;
        } else if (pos == 0) {
            o->a1 = a, pos++;
        } else if (pos == 1) {
            o->a2 = a, pos++;
        } else {
            o->a3 = a, pos++;
        }
    }
}

static char *cat(const char *a, const char *b)
{
    char *p = malloc(strlen(a) + strlen(b) + 2);
    sprintf(p, "%s%s", a, b);
    return p;
}

/* ---------------------------------------------------------------------------------------
 * basic: one process, every path
 */
static int g_removed;
static const char *g_remove_root;

/* Test hook: on rank 0, make its model file impossible to create (a directory sits where
 * its temporary file goes) before the writer starts: a deterministic background failure. */
static void block_write(void *arg, const char *what, const char *file, const char *key)
{
    (void)arg;
    (void)key;
    if (strcmp(what, "save:snapshot") == 0 && g_rank == 0) {
        char *p = mfsdp_ckpt_partial_path(g_remove_root, file);
        char f[64];
        mfsdp_ckpt_file_name(f, sizeof(f), MFSDP_CKPT_MODEL, 0, g_world);
        char *t = malloc(strlen(p) + strlen(f) + 8);
        sprintf(t, "%s/%s.tmp", p, f);
        CHECK(mkdir(t, 0755) == 0, "mkdir %s", t);
        free(t);
        free(p);
        g_removed++;
    }
}

static void test_basic(const opts_t *o)
{
    const char *root = o->a1;
    if (g_rank == 0) {
        rm_rf(root);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_manifest_t *m = model(model_json);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    mfsdp_ckpt_stats_t cs;

    /* no weights yet */
    mfsdp_status_t st = mfsdp_ctx_save(ctx, root);
    CHECK(st == MFSDP_ERR_STATE, "save before any all-gather: %s", mfsdp_status_string(st));
    same_everywhere(st, "save before weights");
    char *latest = cat(root, "/latest");
    CHECK(!file_exists(latest), "nothing committed");
    CHECK(mfsdp_ctx_save(ctx, "") == MFSDP_ERR_INVALID_ARG, "empty dir");

    /* save, wait: committed and verified */
    train(ctx, &j, 0, 3, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    CHECK_OK(mfsdp_ctx_save_wait(ctx)); /* nothing pending: fine */
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(ctx, &cs));
    CHECK(cs.saves == 1 && cs.commits == 1 && cs.step == 3, "stats %llu %llu %lld",
          (unsigned long long)cs.saves, (unsigned long long)cs.commits, (long long)cs.step);
    CHECK(cs.snapshot_bytes > 0 && cs.write_bytes > 0, "bytes counted");
    if (g_rank == 0) {
        char err[512] = "";
        CHECK(mfsdp_ckpt_verify(root, err, sizeof(err)) == MFSDP_OK, "verify: %s", err);
    }

    /* two saves back to back: the second waits for the first */
    train(ctx, &j, 3, 4, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    train(ctx, &j, 4, 5, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(ctx, &cs));
    CHECK(cs.commits == 2, "the first of two saves committed when the second started");
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(ctx, &cs));
    CHECK(cs.commits == 3 && cs.step == 5, "commits %llu step %lld", (unsigned long long)cs.commits,
          (long long)cs.step);
    state_t s1 = collect(ctx, m);
    mfsdp_ctx_stats_t st1;
    CHECK_OK(mfsdp_ctx_get_stats(ctx, &st1));

    /* load into a context with another plan and algorithm: the same state, bitwise */
    mfsdp_ctx_h c2 = make_ctx(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_CHAIN, MFSDP_STEP_LAZY, 1);
    CHECK_OK(mfsdp_ctx_load(c2, root));
    state_t s2 = collect(c2, m);
    compare(m, &s2, &s1, 0.0, "basic: load");
    mfsdp_ctx_stats_t st2;
    CHECK_OK(mfsdp_ctx_get_stats(c2, &st2));
    CHECK(st2.steps == st1.steps, "step counter %llu vs %llu", (unsigned long long)st2.steps,
          (unsigned long long)st1.steps);
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(c2, &cs));
    CHECK(cs.loads == 1 && cs.step == 5 && cs.load_bytes > 0, "load stats");
    /* and both train on identically (the loaded one from NaN shards) */
    job_t j2;
    job_init(&j2, m);
    train(ctx, &j, 5, 7, 0);
    train(c2, &j2, 5, 7, 1);
    state_free(&s1);
    state_free(&s2);
    s1 = collect(ctx, m);
    s2 = collect(c2, m);
    compare(m, &s2, &s1, 0.0, "basic: trained after load");
    state_free(&s1);
    state_free(&s2);

    /* a manifest that differs: refused on every rank, the context reset */
    char *bad = strdup(model_json);
    memcpy(strstr(bad, "[20,9]"), "[20,8]", 6);
    mfsdp_manifest_t *mb = model(bad);
    mfsdp_ctx_h c3 = make_ctx(mb, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    job_t j3;
    job_init(&j3, mb);
    train(c3, &j3, 0, 1, 0);
    st = mfsdp_ctx_load(c3, root);
    CHECK(st == MFSDP_ERR_MISMATCH, "mismatched manifest: %s", mfsdp_status_string(st));
    same_everywhere(st, "mismatched manifest");
    mfsdp_param_view_t v;
    CHECK_OK(mfsdp_ctx_get_param(c3, "blocks.1.w1", &v));
    CHECK(!v.initialized, "a failed load resets the context");
    CHECK(mfsdp_ctx_save(c3, root) == MFSDP_ERR_STATE, "a reset context has no weights");
    train(c3, &j3, 0, 1, 0); /* and takes the job's weights again */
    CHECK_OK(mfsdp_ctx_get_param(c3, "blocks.1.w1", &v));
    CHECK(v.initialized, "fresh again");
    mfsdp_ctx_destroy(&c3);
    job_free(&j3);
    mfsdp_manifest_free(mb);
    free(bad);

    /* missing paths and an interrupted save */
    char *none = cat(root, "/nope");
    st = mfsdp_ctx_load(c2, none);
    CHECK(st == MFSDP_ERR_NOT_FOUND, "missing: %s", mfsdp_status_string(st));
    same_everywhere(st, "missing");
    char *part = cat(root, "/step-00000099.partial");
    if (g_rank == 0) {
        mkdir(part, 0755);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    st = mfsdp_ctx_load(c2, part);
    CHECK(st == MFSDP_ERR_STATE, "partial: %s", mfsdp_status_string(st));
    same_everywhere(st, "partial");
    free(none);
    free(part);

    /* an open accumulation window */
    mfsdp_ctx_h c4 = make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 2);
    job_t j4;
    job_init(&j4, m);
    train_step(c4, &j4, 0, 0);
    st = mfsdp_ctx_save(c4, root);
    CHECK(st == MFSDP_ERR_STATE, "mid-accumulation: %s", mfsdp_status_string(st));
    same_everywhere(st, "mid-accumulation");
    mfsdp_ctx_destroy(&c4);
    job_free(&j4);

    /* a background write that fails: reported at save_wait, or at the next save */
    g_remove_root = root;
    mfsdp_ckpt_test_hook = (mfsdp_ckpt_hook_t){block_write, NULL};
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    st = mfsdp_ctx_save_wait(ctx);
    CHECK(st != MFSDP_OK, "a failed background write is reported by save_wait");
    same_everywhere(st, "failed write (wait)");
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    mfsdp_ckpt_test_hook = (mfsdp_ckpt_hook_t){NULL, NULL};
    st = mfsdp_ctx_save(ctx, root);
    CHECK(st != MFSDP_OK, "a failed background write is reported by the next save");
    same_everywhere(st, "failed write (next save)");
    CHECK_OK(mfsdp_ctx_save_wait(ctx)); /* nothing was started */
    CHECK(g_rank != 0 || g_removed == 2, "hook ran %d times", g_removed);
    if (g_rank == 0) {
        char err[512] = "";
        CHECK(mfsdp_ckpt_verify(root, err, sizeof(err)) == MFSDP_OK,
              "the last good checkpoint still verifies: %s", err);
    }

    /* destroy with a save pending: it is committed */
    train(ctx, &j, 7, 8, 0);
    state_t s8 = collect(ctx, m);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    mfsdp_ctx_destroy(&ctx);
    CHECK_OK(mfsdp_ctx_load(c2, root));
    s2 = collect(c2, m);
    compare(m, &s2, &s8, 0.0, "basic: saved at destroy");
    state_free(&s2);

    /* exported full files: load_full and load of a file */
    char *fp = cat(root, ".param.safetensors"), *f32 = cat(root, ".fp32.safetensors");
    if (g_rank == 0) {
        char err[512] = "";
        CHECK(mfsdp_ckpt_export_full(root, fp, 0, err, sizeof(err)) == MFSDP_OK, "%s", err);
        CHECK(mfsdp_ckpt_export_full(root, f32, 1, err, sizeof(err)) == MFSDP_OK, "%s", err);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_ctx_h c5 = make_ctx(m, MFSDP_TAIL_AUTO, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    CHECK_OK(mfsdp_ctx_load_full(c5, f32));
    state_t s5 = collect(c5, m);
    compare(m, &s5, &s8, 0.0, "basic: load_full of the fp32 export");
    state_free(&s5);
    CHECK_OK(mfsdp_ctx_load(c5, fp)); /* a file: as load_full */
    s5 = collect(c5, m);
    for (size_t t = 0; t < s5.n; t++) {
        const mfsdp_param_desc_t *p = param_at(m, t);
        size_t wo = s5.off[t] + (size_t)p->numel;
        CHECK(memcmp(s5.w + wo, s8.w + wo, (size_t)p->numel * 4) == 0, "%s weight", p->name);
    }
    state_free(&s5);
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(c5, &cs));
    CHECK(cs.loads == 2 && cs.step == 0, "a full file carries no step counters");
    st = mfsdp_ctx_load_full(c5, root); /* a directory is not a file */
    CHECK(st != MFSDP_OK, "load_full of a directory");
    same_everywhere(st, "load_full of a directory");
    mfsdp_ctx_destroy(&c5);
    free(fp);
    free(f32);
    state_free(&s8);

    mfsdp_ctx_destroy(&c2);
    CHECK(mfsdp_ctx_save(c2, root) == MFSDP_ERR_STATE, "destroyed context");
    CHECK(mfsdp_ctx_load(c2, root) == MFSDP_ERR_STATE, "destroyed context");
    job_free(&j);
    job_free(&j2);
    free(latest);
    mfsdp_manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * save / resume / loadfull / import
 */
static void test_save(const opts_t *o)
{
    const char *root = o->a1;
    if (g_rank == 0) {
        rm_rf(root);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_manifest_t *m = model(model_json);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, o->tail, o->algo, o->mode, 1);
    train(ctx, &j, 0, o->steps, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    state_t s = collect(ctx, m);
    char *ref = cat(root, ".ref");
    state_write(&s, ref);
    /* and on, uninterrupted: what a resumed job must reach */
    train(ctx, &j, o->steps, o->steps + o->more, 0);
    state_t s2 = collect(ctx, m);
    char *ref2 = cat(root, ".ref-more");
    state_write(&s2, ref2);
    if (g_rank == 0) {
        printf("saved %s at %d ranks after %d steps (and the uninterrupted state %d steps "
               "later)\n",
               root, g_world, o->steps, o->more);
    }
    free(ref);
    free(ref2);
    state_free(&s);
    state_free(&s2);
    mfsdp_ctx_destroy(&ctx);
    job_free(&j);
    mfsdp_manifest_free(m);
}

static void test_resume(const opts_t *o)
{
    const char *root = o->a1;
    const char *refp = o->a2 != NULL ? o->a2 : NULL;
    mfsdp_manifest_t *m = model(model_json);
    char *ref = refp != NULL ? strdup(refp) : cat(root, ".ref");
    state_t saved;
    CHECK(state_read(m, ref, &saved) == 0, "read %s", ref);
    /* resumed */
    job_t ja, jr;
    job_init(&ja, m);
    job_init(&jr, m);
    mfsdp_ctx_h a = make_ctx(m, o->tail, o->algo, o->mode, 1);
    mfsdp_status_t st = mfsdp_ctx_load(a, root);
    CHECK(st == MFSDP_OK, "load %s: %s", root, mfsdp_status_string(st));
    state_t sa = collect(a, m);
    compare(m, &sa, &saved, 0.0, "resume: loaded state vs saved");
    mfsdp_ckpt_stats_t cs;
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(a, &cs));
    CHECK(cs.step == o->steps, "loaded step %lld, expected %d", (long long)cs.step, o->steps);
    /* uninterrupted, from scratch, at this world size */
    mfsdp_ctx_h r = make_ctx(m, o->tail, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    train(r, &jr, 0, o->steps, 0);
    state_t sr = collect(r, m);
    double d0 = compare(m, &sr, &saved, o->bitwise ? 0.0 : 1e-5, "resume: scratch run vs saved");
    train(a, &ja, o->steps, o->steps + o->more, 1);
    train(r, &jr, o->steps, o->steps + o->more, 0);
    state_free(&sa);
    state_free(&sr);
    sa = collect(a, m);
    sr = collect(r, m);
    double d1 = compare(m, &sa, &sr, o->bitwise ? 0.0 : 1e-5, "resume: trained on");
    /* against the saving job's own uninterrupted run (at its world size) */
    char *ref2 = cat(root, ".ref-more");
    state_t su;
    double d2 = -1.0;
    if (refp == NULL && state_read(m, ref2, &su) == 0) {
        d2 = compare(m, &sa, &su, o->bitwise ? 0.0 : 1e-5, "resume: vs the uninterrupted run");
        state_free(&su);
    }
    free(ref2);
    mfsdp_ctx_stats_t xa, xr;
    CHECK_OK(mfsdp_ctx_get_stats(a, &xa));
    CHECK_OK(mfsdp_ctx_get_stats(r, &xr));
    CHECK(xa.steps == xr.steps, "step counters %llu vs %llu", (unsigned long long)xa.steps,
          (unsigned long long)xr.steps);
    if (g_rank == 0) {
        printf("resume %s at %d ranks: loaded bitwise; max relative difference to an "
               "uninterrupted run from scratch here: %.3g after %d steps, %.3g after %d more; "
               "to the saving job's uninterrupted run: %s%.3g (%s)\n",
               root, g_world, d0, o->steps, d1, o->more, d2 < 0 ? "(not run) " : "",
               d2 < 0 ? 0.0 : d2, o->bitwise ? "asserted bitwise" : "asserted <= 1e-5");
    }
    state_free(&sa);
    state_free(&sr);
    state_free(&saved);
    mfsdp_ctx_destroy(&a);
    mfsdp_ctx_destroy(&r);
    job_free(&ja);
    job_free(&jr);
    free(ref);
    mfsdp_manifest_free(m);
}

static void test_loadfull(const opts_t *o)
{
    mfsdp_manifest_t *m = model(model_json);
    state_t saved;
    CHECK(state_read(m, o->a2, &saved) == 0, "read %s", o->a2);
    mfsdp_ctx_h c = make_ctx(m, o->tail, o->algo, o->mode, 1);
    CHECK_OK(mfsdp_ctx_load_full(c, o->a1));
    state_t s = collect(c, m);
    size_t masters_equal = 0, weights_equal = 0;
    for (size_t t = 0; t < s.n; t++) {
        size_t n = (size_t)param_at(m, t)->numel;
        masters_equal += memcmp(s.w + s.off[t], saved.w + saved.off[t], n * 4) == 0;
        weights_equal += memcmp(s.w + s.off[t] + n, saved.w + saved.off[t] + n, n * 4) == 0;
    }
    int fp32 = o->a3 != NULL && strcmp(o->a3, "fp32") == 0;
    CHECK(weights_equal == s.n, "weights of %zu of %zu tensors equal", weights_equal, s.n);
    CHECK(!fp32 || masters_equal == s.n, "fp32 masters of %zu of %zu tensors bitwise equal",
          masters_equal, s.n);
    if (g_rank == 0) {
        printf("load_full %s at %d ranks: weights bitwise equal; fp32 masters bitwise equal "
               "for %zu of %zu tensors%s\n",
               o->a1, g_world, masters_equal, s.n, fp32 ? " (asserted: all)" : "");
    }
    state_free(&s);
    state_free(&saved);
    mfsdp_ctx_destroy(&c);
    mfsdp_manifest_free(m);
}

static void test_import(const opts_t *o)
{
    mfsdp_manifest_t *m = model(model_json);
    job_t ja, jb;
    job_init(&ja, m);
    job_init(&jb, m);
    mfsdp_ctx_h a = make_ctx(m, o->tail, o->algo, o->mode, 1);
    mfsdp_ctx_h b = make_ctx(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    CHECK_OK(mfsdp_ctx_load(a, o->a1));
    CHECK_OK(mfsdp_ctx_load_full(b, o->a2));
    state_t sa = collect(a, m), sb = collect(b, m);
    compare(m, &sa, &sb, 0.0, "import: loaded");
    train(a, &ja, 0, o->more, 1);
    train(b, &jb, 0, o->more, 1);
    state_free(&sa);
    state_free(&sb);
    sa = collect(a, m);
    sb = collect(b, m);
    compare(m, &sa, &sb, 0.0, "import: trained (zero optimizer state, step 0 in both)");
    if (g_rank == 0) {
        printf("import %s at %d ranks: equal to load_full of %s, before and after %d steps\n",
               o->a1, g_world, o->a2, o->more);
    }
    state_free(&sa);
    state_free(&sb);
    mfsdp_ctx_destroy(&a);
    mfsdp_ctx_destroy(&b);
    job_free(&ja);
    job_free(&jb);
    mfsdp_manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * Crash safety
 */
static int g_count, g_kill_at;
static void kill_hook(void *arg, const char *what, const char *file, const char *key)
{
    (void)arg;
    (void)file;
    (void)key;
    (void)what;
    int n = __atomic_add_fetch(&g_count, 1, __ATOMIC_SEQ_CST);
    if (g_kill_at > 0 && n == g_kill_at) {
        raise(SIGKILL);
    }
}

/* What DIR/latest names must be complete and hold one of the two states. Returns 'A', 'B',
 * or 0 after reporting a failure. */
static int check_latest(mfsdp_ctx_h c, const mfsdp_manifest_t *m, const char *root,
                        const state_t *A, const state_t *B, int point)
{
    char err[1024] = "";
    mfsdp_status_t st = g_rank == 0 ? mfsdp_ckpt_verify(root, err, sizeof(err)) : MFSDP_OK;
    CHECK(st == MFSDP_OK, "kill point %d: the latest checkpoint does not verify: %s", point, err);
    st = mfsdp_ctx_load(c, root);
    CHECK(st == MFSDP_OK, "kill point %d: load: %s", point, mfsdp_status_string(st));
    if (st != MFSDP_OK) {
        return 0;
    }
    state_t s = collect(c, m);
    int which = memcmp(s.w, A->w, s.words * 4) == 0   ? 'A'
                : memcmp(s.w, B->w, s.words * 4) == 0 ? 'B'
                                                      : 0;
    CHECK(which != 0, "kill point %d: the loaded state is neither the previous nor the new one",
          point);
    state_free(&s);
    return which;
}

/* Every step-* directory of root: a final name is always complete, a partial one refused. */
static void check_dirs(const char *root, int point)
{
    if (g_rank != 0) {
        return;
    }
    DIR *d = opendir(root);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step-", 5) != 0) {
            continue;
        }
        char *pth = malloc(strlen(root) + strlen(e->d_name) + 2);
        sprintf(pth, "%s/%s", root, e->d_name);
        char err[1024] = "";
        mfsdp_status_t st = mfsdp_ckpt_verify(pth, err, sizeof(err));
        if (strstr(e->d_name, ".partial") != NULL) {
            CHECK(st == MFSDP_ERR_STATE, "point %d: %s: %s", point, e->d_name, err);
        } else {
            CHECK(st == MFSDP_OK, "point %d: %s is not complete: %s", point, e->d_name, err);
        }
        free(pth);
    }
    if (d != NULL) {
        closedir(d);
    }
}

static void test_killfork(const opts_t *o)
{
    const char *root = o->a1;
    CHECK(g_world == 1, "killfork runs at 1 rank (a forked child cannot use MPI)");
    rm_rf(root);
    mfsdp_manifest_t *m = model(model_json);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, o->tail, o->algo, o->mode, 1);
    train(ctx, &j, 0, 3, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    state_t A = collect(ctx, m);
    train(ctx, &j, 3, 5, 0);
    state_t B = collect(ctx, m);
    char *latest = cat(root, "/latest");
    size_t llen = 0;
    char *latest_a = ckpt_slurp(latest, &llen);
    mfsdp_ctx_h c2 = make_ctx(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);

    /* count the points of one save (in a child, so the parent's directory stays as it is) */
    int pfd[2];
    CHECK(pipe(pfd) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) {
        g_count = 0;
        g_kill_at = 0;
        mfsdp_ckpt_test_hook = (mfsdp_ckpt_hook_t){kill_hook, NULL};
        mfsdp_status_t st = mfsdp_ctx_save(ctx, root);
        if (st == MFSDP_OK) {
            st = mfsdp_ctx_save_wait(ctx);
        }
        int n = st == MFSDP_OK ? g_count : -1;
        if (write(pfd[1], &n, sizeof(n)) != sizeof(n)) {
            _exit(3);
        }
        _exit(0);
    }
    int npoints = -1;
    CHECK(read(pfd[0], &npoints, sizeof(npoints)) == sizeof(npoints), "count");
    waitpid(pid, NULL, 0);
    close(pfd[0]);
    close(pfd[1]);
    CHECK(npoints > 20, "a save has %d progress points", npoints);
    /* the counting save committed B: back to A */
    DIR *d;
    struct dirent *e;

#define RESET_TO_A()                                                                               \
    do {                                                                                           \
        d = opendir(root);                                                                         \
        while (d != NULL && (e = readdir(d)) != NULL) {                                            \
            if (strncmp(e->d_name, "step-00000005", 13) == 0 &&                                    \
                strstr(e->d_name, ".partial") == NULL) {                                           \
                char *pth = malloc(strlen(root) + strlen(e->d_name) + 2);                          \
                sprintf(pth, "%s/%s", root, e->d_name);                                            \
                rm_rf(pth);                                                                        \
                free(pth);                                                                         \
            }                                                                                      \
        }                                                                                          \
        if (d != NULL) {                                                                           \
            closedir(d);                                                                           \
        }                                                                                          \
        ckpt_spit(latest, latest_a, llen);                                                         \
    } while (0)

    RESET_TO_A();
    int seen_a = 0, seen_b = 0, killed = 0;
    for (int point = 1; point <= npoints + 1; point++) {
        pid = fork();
        if (pid == 0) {
            g_count = 0;
            g_kill_at = point;
            mfsdp_ckpt_test_hook = (mfsdp_ckpt_hook_t){kill_hook, NULL};
            mfsdp_status_t st = mfsdp_ctx_save(ctx, root);
            if (st == MFSDP_OK) {
                st = mfsdp_ctx_save_wait(ctx);
            }
            _exit(st == MFSDP_OK ? 0 : 4);
        }
        int wst = 0;
        waitpid(pid, &wst, 0);
        if (point <= npoints) {
            CHECK(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL, "point %d: child not killed",
                  point);
            killed++;
        } else {
            CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "the save without a kill succeeds");
        }
        int which = check_latest(c2, m, root, &A, &B, point);
        seen_a += which == 'A';
        seen_b += which == 'B';
        check_dirs(root, point);
        RESET_TO_A();
    }
    CHECK(seen_b >= 1 && seen_a >= 1, "both outcomes seen (A %d, B %d)", seen_a, seen_b);
    printf("killfork: %d kill points (SIGKILL at each progress point of a save), %d killed; the "
           "latest checkpoint verified and loaded every time: the previous one %d times, the "
           "new complete one %d times\n",
           npoints, killed, seen_a, seen_b);
    free(latest_a);
    free(latest);
    state_free(&A);
    state_free(&B);
    mfsdp_ctx_destroy(&c2);
    mfsdp_ctx_destroy(&ctx);
    job_free(&j);
    mfsdp_manifest_free(m);
}

static void test_killmpi(const opts_t *o)
{
    const char *root = o->a1;
    if (g_rank == 0) {
        rm_rf(root);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_manifest_t *m = model(model_json);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, o->tail, o->algo, o->mode, 1);
    train(ctx, &j, 0, 3, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    state_t A = collect(ctx, m);
    char *ra = cat(root, ".refA"), *rb = cat(root, ".refB");
    state_write(&A, ra);
    train(ctx, &j, 3, 5, 0);
    state_t B = collect(ctx, m);
    state_write(&B, rb);
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == o->kill_rank) {
        g_count = 0;
        g_kill_at = o->point;
        mfsdp_ckpt_test_hook = (mfsdp_ckpt_hook_t){kill_hook, NULL};
    }
    mfsdp_status_t st = mfsdp_ctx_save(ctx, root);
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_save_wait(ctx);
    }
    /* only reached when the point lies beyond this save (the driver expects a kill) */
    printf("[rank %d] killmpi: save finished (%s) without reaching point %d (%d points)\n", g_rank,
           mfsdp_status_string(st), o->point, g_count);
    free(ra);
    free(rb);
    state_free(&A);
    state_free(&B);
    mfsdp_ctx_destroy(&ctx);
    job_free(&j);
    mfsdp_manifest_free(m);
}

static void test_check(const opts_t *o)
{
    const char *root = o->a1;
    mfsdp_manifest_t *m = model(model_json);
    char *ra = cat(root, ".refA"), *rb = cat(root, ".refB");
    state_t A, B;
    CHECK(state_read(m, ra, &A) == 0 && state_read(m, rb, &B) == 0, "refs");
    mfsdp_ctx_h c = make_ctx(m, MFSDP_TAIL_AUTO, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    int which = check_latest(c, m, root, &A, &B, o->point);
    check_dirs(root, o->point);
    if (g_rank == 0) {
        printf("check %s: latest verifies and loads: the %s checkpoint\n", root,
               which == 'A'   ? "previous"
               : which == 'B' ? "new"
                              : "(neither!)");
    }
    free(ra);
    free(rb);
    state_free(&A);
    state_free(&B);
    mfsdp_ctx_destroy(&c);
    mfsdp_manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * Corruption: the collective load refuses damaged copies on every rank
 */
typedef struct corruption {
    const char *name;
    const char *file; /* in the checkpoint directory; "latest" is the root's */
    int kind;         /* 0 flip a byte, 1 truncate, 2 remove, 3 header edit + reseal, 4 set a
                         byte to `from[0]` */
    long where;       /* byte (negative: from the end) */
    const char *from, *to;
    mfsdp_status_t expect;
} corruption_t;

static void test_corrupt(const opts_t *o)
{
    const char *root = o->a1;
    if (g_rank == 0) {
        rm_rf(root);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_manifest_t *m = model(model_json);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    train(ctx, &j, 0, 2, 0);
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    char model0[64], optim1[64];
    mfsdp_ckpt_file_name(model0, sizeof(model0), MFSDP_CKPT_MODEL, 0, g_world);
    mfsdp_ckpt_file_name(optim1, sizeof(optim1), MFSDP_CKPT_OPTIM, g_world - 1, g_world);
    const corruption_t cases[] = {
        {"model byte in the data", model0, 0, -3, NULL, NULL, MFSDP_ERR_CHECKSUM},
        {"model length field", model0, 0, 2, NULL, NULL, MFSDP_ERR_CHECKSUM},
        {"optim header byte", optim1, 0, 20, NULL, NULL, MFSDP_ERR_CHECKSUM},
        {"index byte", MFSDP_CKPT_INDEX_NAME, 0, 300, NULL, NULL, MFSDP_ERR_CHECKSUM},
        {"latest: a name byte", "latest", 0, 3, NULL, NULL, MFSDP_ERR_PARSE},
        {"latest: names another step", "latest", 4, 12, "7", NULL, MFSDP_ERR_NOT_FOUND},
        {"latest: a digest digit", "latest", 4, -3, "f", NULL, MFSDP_ERR_CHECKSUM},
        {"optim truncated", optim1, 1, -1, NULL, NULL, MFSDP_ERR_CHECKSUM},
        {"model missing", model0, 2, 0, NULL, NULL, MFSDP_ERR_NOT_FOUND},
        {"index missing", MFSDP_CKPT_INDEX_NAME, 2, 0, NULL, NULL, MFSDP_ERR_NOT_FOUND},
        {"wrong dtype (resealed)", model0, 3, 0, "\"dtype\":\"F32\"", "\"dtype\":\"I32\"",
         MFSDP_ERR_MISMATCH},
        {"wrong shape (resealed)", model0, 3, 0, "\"shape\":[37,12]", "\"shape\":[12,37]",
         MFSDP_ERR_MISMATCH},
        {"not JSON (resealed)", optim1, 3, 0, "{\"__metadata__\"", "[\"__metadata__\"",
         MFSDP_ERR_PARSE},
    };
    int n = (int)(sizeof(cases) / sizeof(cases[0]));
    char *dirname = NULL;
    {
        mfsdp_ckpt_reader_t *r = NULL;
        CHECK_OK(mfsdp_ckpt_reader_open(root, NULL, 0, &r));
        dirname = strdup(strrchr(r->dir, '/') + 1);
        mfsdp_ckpt_reader_close(r);
    }
    int refused = 0;
    for (int k = 0; k < n; k++) {
        const corruption_t *c = &cases[k];
        char *copy = malloc(strlen(root) + 16);
        sprintf(copy, "%s.c%d", root, k);
        if (g_rank == 0) {
            rm_rf(copy);
            char cmd[2048];
            snprintf(cmd, sizeof(cmd), "cp -r '%s' '%s'", root, copy);
            CHECK(system(cmd) == 0, "%s", cmd);
            char dir[1024], path[1200];
            snprintf(dir, sizeof(dir), "%s/%s", copy, dirname);
            snprintf(path, sizeof(path), "%s/%s", strcmp(c->file, "latest") == 0 ? copy : dir,
                     c->file);
            size_t len;
            char *b = ckpt_slurp(path, &len);
            if (c->kind == 0 && b != NULL) {
                size_t at = c->where < 0 ? len - (size_t)(-c->where) : (size_t)c->where;
                b[at] ^= 0x10;
                ckpt_spit(path, b, len);
            } else if (c->kind == 4 && b != NULL) {
                size_t at = c->where < 0 ? len - (size_t)(-c->where) : (size_t)c->where;
                b[at] = b[at] == c->from[0] ? '0' : c->from[0];
                ckpt_spit(path, b, len);
            } else if (c->kind == 1 && b != NULL) {
                ckpt_spit(path, b, len - 1);
            } else if (c->kind == 2) {
                unlink(path);
            } else if (c->kind == 3) {
                CHECK(ckpt_edit_header(path, c->from, c->to) == 0, "edit %s", c->name);
                CHECK(ckpt_reseal(copy, dir, c->file) == 0, "reseal %s", c->name);
            }
            free(b);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        mfsdp_ctx_h c2 = make_ctx(m, MFSDP_TAIL_OWNER, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
        mfsdp_status_t st = mfsdp_ctx_load(c2, copy);
        CHECK(st == c->expect, "%s: load returned %s, expected %s", c->name,
              mfsdp_status_string(st), mfsdp_status_string(c->expect));
        same_everywhere(st, c->name);
        refused += st != MFSDP_OK;
        mfsdp_param_view_t v;
        CHECK_OK(mfsdp_ctx_get_param(c2, "blocks.0.wq", &v));
        CHECK(!v.initialized, "%s: the context is reset", c->name);
        mfsdp_ctx_destroy(&c2);
        if (g_rank == 0) {
            rm_rf(copy);
        }
        free(copy);
    }
    if (g_rank == 0) {
        printf("corrupt: %d of %d damaged copies refused by the collective load at %d ranks\n",
               refused, n, g_world);
    }
    free(dirname);
    mfsdp_ctx_destroy(&ctx);
    job_free(&j);
    mfsdp_manifest_free(m);
}

/* ---------------------------------------------------------------------------------------
 * Throughput
 */
static void test_perf(const opts_t *o)
{
    const char *root = o->a1;
    if (g_rank == 0) {
        rm_rf(root);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_manifest_t *m = perf_model(o->mb);
    job_t j;
    job_init(&j, m);
    mfsdp_ctx_h ctx = make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    /* weights only (no gradient step needed for the figures): one all-gather per group */
    for (size_t g = 0; g < m->ngroups; g++) {
        const lay_t *l = &j.ag[g];
        char *mine = j.agbuf[g] + (size_t)g_rank * l->S;
        memset(mine, 0x3c, l->S);
        CHECK_OK(mfsdp_ctx_allgather(ctx, g, mine, j.agbuf[g], l->count, l->wire));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now();
    CHECK_OK(mfsdp_ctx_save(ctx, root));
    double t1 = now();
    CHECK_OK(mfsdp_ctx_save_wait(ctx));
    double t2 = now();
    mfsdp_ckpt_stats_t s;
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(ctx, &s));
    MPI_Barrier(MPI_COMM_WORLD);
    mfsdp_ctx_h c2 = make_ctx(m, MFSDP_TAIL_SHARD, MFSDP_ALGO_DIRECT, MFSDP_STEP_EAGER, 1);
    MPI_Barrier(MPI_COMM_WORLD);
    double t3 = now();
    CHECK_OK(mfsdp_ctx_load(c2, root));
    double t4 = now();
    mfsdp_ckpt_stats_t l;
    CHECK_OK(mfsdp_ctx_get_ckpt_stats(c2, &l));
    double v[6] = {s.stall_seconds,
                   s.write_seconds,
                   (double)s.write_bytes,
                   l.load_seconds,
                   (double)(l.load_bytes + l.verify_bytes),
                   (double)s.snapshot_bytes};
    double all[6 * 64];
    MPI_Gather(v, 6, MPI_DOUBLE, all, 6, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("perf: %d ranks, %d MiB model; per rank: snapshot MiB, stall s, write MiB, write "
               "s, write GB/s, load read MiB, load s, load GB/s\n",
               g_world, o->mb);
        for (int r = 0; r < g_world && r < 64; r++) {
            double *x = all + 6 * r;
            printf("perf: rank %d  %8.1f %7.3f  %8.1f %7.3f %6.2f  %8.1f %7.3f %6.2f\n", r,
                   x[5] / 1048576.0, x[0], x[2] / 1048576.0, x[1], x[2] / x[1] / 1e9,
                   x[4] / 1048576.0, x[3], x[4] / x[3] / 1e9);
        }
        printf("perf: caller blocked %.3f s in save, %.3f s in save_wait (write + commit); load "
               "%.3f s\n",
               t1 - t0, t2 - t1, t4 - t3);
    }
    mfsdp_ctx_destroy(&c2);
    mfsdp_ctx_destroy(&ctx);
    job_free(&j);
    mfsdp_manifest_free(m);
    if (g_rank == 0) {
        rm_rf(root);
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) {
        if (g_rank == 0) {
            fprintf(stderr, "usage: test_ckpt MODE ARGS... (see the file's header)\n");
        }
        MPI_Finalize();
        return 2;
    }
    opts_t o;
    parse_opts(argc, argv, &o);
    /* Expected failures log warnings; keep the output to what the test prints. */
    if (getenv("MFSDP_DEBUG") == NULL) {
        setenv("MFSDP_DEBUG", "NONE", 1);
        mfsdp_log_reinit();
    }
    const char *mode = argv[1];
    if (strcmp(mode, "basic") == 0) {
        test_basic(&o);
    } else if (strcmp(mode, "save") == 0) {
        test_save(&o);
    } else if (strcmp(mode, "resume") == 0) {
        test_resume(&o);
    } else if (strcmp(mode, "loadfull") == 0) {
        test_loadfull(&o);
    } else if (strcmp(mode, "import") == 0) {
        test_import(&o);
    } else if (strcmp(mode, "killfork") == 0) {
        test_killfork(&o);
    } else if (strcmp(mode, "killmpi") == 0) {
        test_killmpi(&o);
    } else if (strcmp(mode, "check") == 0) {
        test_check(&o);
    } else if (strcmp(mode, "corrupt") == 0) {
        test_corrupt(&o);
    } else if (strcmp(mode, "perf") == 0) {
        test_perf(&o);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        g_failures++;
    }
    int fails = 0;
    MPI_Allreduce(&g_failures, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("test_ckpt %s at %d ranks: %s (%d failed checks)\n", mode, g_world,
               fails ? "FAILED" : "passed", fails);
    }
    MPI_Finalize();
    return fails ? 1 : 0;
}
