/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fsdp_train: a small trainer that behaves like PyTorch FSDP2 (`fully_shard`) on the wire
 * and knows nothing of mfsdp. It is the unmodified job the LD_PRELOAD shim intercepts.
 *
 * Model (FSDP order of groups and params, as FSDP2's post-order DFS gives them):
 *   group "root":     embed.weight [V, D], norm.weight [D], lm_head.weight [C, D],
 *                     lm_head.bias [C]
 *   group "blocks.l": blocks.l.fc1.weight [H, D], blocks.l.fc1.bias [H],
 *                     blocks.l.fc2.weight [D, H], blocks.l.fc2.bias [D]   (l = 0..L-1)
 *   h = mean of the sample's token embeddings; per block h += fc2(gelu(fc1(h)));
 *   y = lm_head(norm(h)) with RMSNorm gain; loss = MSE against a fixed random teacher.
 *
 * FSDP2 behaviour reproduced: every parameter is sharded on dim 0 with c = ceil(N0/n) rows
 * per rank (trailing ranks hold zero padding, possibly only padding); a group's local shards
 * are concatenated without alignment padding (S floats per rank). One iteration issues:
 *   forward:  all-gather root, then all-gather blocks.0 .. blocks.L-1 (each block is
 *             resharded after its forward; the root stays unsharded until backward ends);
 *   backward: all-gather blocks.L-1, then for l = L-1..0: all-gather blocks.l-1 (backward
 *             prefetch, unless --no-prefetch), reduce-scatter blocks.l; finally
 *             reduce-scatter root.
 * All-gathers are in place (send == recv + rank*S); reduce-scatters use torch._chunk_cat's
 * layout (rank r's chunk = rows [r c, (r+1) c) of every grad, zero padded) and average in
 * fp32. One scalar all-reduce per step averages the loss for logging.
 *
 * Optimizers on the local shards: --optim adamw (every tensor), --optim muon-gather
 * (FSDP2-Muon as done today: each Muon matrix's momentum-smoothed update is all-gathered
 * out of place on every rank, Newton-Schulz runs redundantly everywhere, each rank keeps its
 * rows; AdamW for the other tensors), --optim none (the job under the shim).
 * Muon tensors: the 2-D weights of the blocks (blocks.*.fc1.weight, blocks.*.fc2.weight).
 * AdamW tensors: embed.weight, norm.weight, lm_head.weight, lm_head.bias and every bias
 * (the manifest default rule: >= 2 dims except names matching embed|lm_head|wte|wpe).
 *
 * --reference runs in one process without MPI at world size 1 and, with --emulate-world N,
 * averages the gradients of the N micro-batches ranks 0..N-1 would see (summed in rank
 * order, then divided by N) before the same optimizer: with --optim muon-gather (alias
 * --optim muon) that is full-matrix Muon on the block matrices and AdamW on the rest.
 */
#include "comm.h"
#include "model.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define MAX_PARAMS   4
#define EVAL_BATCHES 8
#define EVAL_STEP    ((uint64_t)1 << 40) /* a step index training never reaches */

typedef enum { OPTIM_NONE, OPTIM_ADAMW, OPTIM_MUON_GATHER } optim_t;

typedef struct options {
    int steps;
    uint64_t seed;
    optim_t optim;
    double lr; /* hyper-parameters as given (floats are used in the arithmetic) */
    int lr_set;
    double muon_lr;
    double adamw_lr;
    double adamw_eps;
    double wd;
    double divide_factor; /* 0: none (FSDP2's default average) */
    ft_dims_t dims;
    const char *model;
    int prefetch;
    const char *manifest_path;
    const char *dump_path;
    int reference;
    int emulate;
    int quiet;
} options_t;

typedef struct param {
    char name[64];
    int ndim;
    size_t rows; /* N0 */
    size_t cols; /* product of the other dims (1 for 1-D) */
    int muon;
    size_t c;     /* rows per rank */
    size_t s;     /* shard numel c * cols */
    size_t o;     /* offset in the group's per-rank block */
    size_t foff;  /* offset in the group's unsharded buffer */
    size_t lrows; /* valid (unpadded) rows on this rank */
    float *m, *v; /* AdamW state over the valid shard */
    float *mom;   /* Muon momentum over the valid shard */
} param_t;

typedef struct group {
    char name[32];
    size_t np;
    param_t p[MAX_PARAMS];
    size_t S;      /* per-rank count of the all-gather and the reduce-scatter */
    size_t numel;  /* unsharded elements */
    float *shard;  /* S floats: FSDP's sharded parameters (padding zero) */
    float *gshard; /* S floats: the reduced gradient shard */
    float *full;   /* unsharded parameters while gathered, else NULL */
    float *grad;   /* unsharded gradient during this group's backward */
} group_t;

enum { T_DATA, T_FWD, T_BWD, T_COMM, T_OPTIM, T_OPTIM_COMM, T_OPTIM_NS, T_STEP, T_COUNT };
static const char *const timer_names[T_COUNT] = {
    "data", "fwd", "bwd", "comm", "optim", "optim_comm", "optim_ns", "step",
};

typedef struct trainer {
    options_t o;
    ft_dims_t d;
    ft_comm_t *comm;
    int rank;
    int n;
    ft_teacher_t *teacher;
    size_t ngroups; /* 1 + blocks: [0] root, [1 + l] blocks.l */
    group_t *g;
    int32_t *tokens;
    float *target;
    float **x; /* blocks + 1 residual states, x[0] = embedding output */
    float **a; /* per block: fc1 output (pre-activation) */
    float **s; /* per block: gelu output */
    float *rinv, *z, *y, *dy, *dz, *dh, *ds, *da;
    float premul; /* 0: reduce with avg; else PREMUL_SUM(1 / divide factor) */
    int adam_t;
    float *mu_u, *mu_gather, *mu_out, *mu_ws; /* muon-gather scratch */
    double t[T_COUNT];
    double t_first[T_COUNT];
} trainer_t;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (p == NULL) {
        fprintf(stderr, "fsdp_train: out of memory (%zu x %zu bytes)\n", n, size);
        exit(1);
    }
    return p;
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "fsdp_train: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ---- command line -------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: fsdp_train_{mpi,nccl} [options]   (run under mpirun; --reference runs alone)\n"
            "  --steps N              training steps (30)\n"
            "  --seed S               seed of data, teacher and init (1)\n"
            "  --optim O              adamw | muon-gather | none   (muon = muon-gather)\n"
            "  --lr X                 lr of the main rule: AdamW lr for adamw, Muon lr otherwise\n"
            "  --muon-lr X            Muon lr (0.02)\n"
            "  --adamw-lr X           AdamW lr (0.001)\n"
            "  --adamw-eps X          AdamW eps (1e-8)\n"
            "  --wd X                 decoupled weight decay for Muon and AdamW (0)\n"
            "  --divide-factor F      FSDP2 set_gradient_divide_factor: reduce with\n"
            "                         PREMUL_SUM(1/F) unless F equals the world size\n"
            "  --model small|medium   preset dimensions (medium)\n"
            "  --dims V,D,H,C,L       vocab, dim, hidden, outputs, blocks\n"
            "  --batch B              samples per rank and step\n"
            "  --tokens T             tokens per sample\n"
            "  --no-prefetch          no backward prefetch (all-gather l right before its bwd)\n"
            "  --write-manifest PATH  write the mfsdp-manifest/1 JSON of the groups (rank 0)\n"
            "  --dump-weights PATH    after the final all-gather rank 0 writes all weights\n"
            "  --reference            one process, no MPI, world size 1\n"
            "  --emulate-world N      with --reference: average N ranks' micro-batches (1)\n"
            "  --quiet                no per-step lines\n");
}

static int parse_float(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !(v >= 0.0) || v > 1e6)
        return -1;
    *out = v;
    return 0;
}

static int parse_int(const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

static int set_model(options_t *o, const char *name)
{
    /* small (tests): shards uneven at 3 and 4 ranks; at 4 ranks rank 3 holds only padding of
     * lm_head (5 rows, c = 2). medium (timing, the default): 2.6M parameters; Newton-Schulz
     * of the 8 block matrices (12 GFLOP per rank and step) dominates muon-gather. */
    if (strcmp(name, "small") == 0) {
        o->dims = (ft_dims_t){
            .vocab = 37, .dim = 30, .hidden = 50, .out = 5, .blocks = 3, .batch = 16, .tokens = 4};
    } else if (strcmp(name, "medium") == 0) {
        o->dims = (ft_dims_t){.vocab = 2000,
                              .dim = 256,
                              .hidden = 1024,
                              .out = 64,
                              .blocks = 4,
                              .batch = 128,
                              .tokens = 8};
    } else {
        return -1;
    }
    o->model = name;
    return 0;
}

static int parse_dims(const char *s, ft_dims_t *d)
{
    int v[5];
    char extra;
    if (sscanf(s, "%d,%d,%d,%d,%d%c", &v[0], &v[1], &v[2], &v[3], &v[4], &extra) != 5)
        return -1;
    for (int i = 0; i < 5; i++)
        if (v[i] < 1 || v[i] > (1 << 20))
            return -1;
    d->vocab = v[0];
    d->dim = v[1];
    d->hidden = v[2];
    d->out = v[3];
    d->blocks = v[4];
    return 0;
}

static int parse_options(int argc, char **argv, options_t *o)
{
    enum {
        O_STEPS = 256,
        O_SEED,
        O_OPTIM,
        O_LR,
        O_MUON_LR,
        O_ADAMW_LR,
        O_ADAMW_EPS,
        O_WD,
        O_DIVIDE_FACTOR,
        O_MODEL,
        O_DIMS,
        O_BATCH,
        O_TOKENS,
        O_NO_PREFETCH,
        O_MANIFEST,
        O_DUMP,
        O_REFERENCE,
        O_EMULATE,
        O_QUIET,
        O_HELP,
    };
    static const struct option longopts[] = {
        {"steps", required_argument, NULL, O_STEPS},
        {"seed", required_argument, NULL, O_SEED},
        {"optim", required_argument, NULL, O_OPTIM},
        {"lr", required_argument, NULL, O_LR},
        {"muon-lr", required_argument, NULL, O_MUON_LR},
        {"adamw-lr", required_argument, NULL, O_ADAMW_LR},
        {"adamw-eps", required_argument, NULL, O_ADAMW_EPS},
        {"wd", required_argument, NULL, O_WD},
        {"divide-factor", required_argument, NULL, O_DIVIDE_FACTOR},
        {"model", required_argument, NULL, O_MODEL},
        {"dims", required_argument, NULL, O_DIMS},
        {"batch", required_argument, NULL, O_BATCH},
        {"tokens", required_argument, NULL, O_TOKENS},
        {"no-prefetch", no_argument, NULL, O_NO_PREFETCH},
        {"write-manifest", required_argument, NULL, O_MANIFEST},
        {"dump-weights", required_argument, NULL, O_DUMP},
        {"reference", no_argument, NULL, O_REFERENCE},
        {"emulate-world", required_argument, NULL, O_EMULATE},
        {"quiet", no_argument, NULL, O_QUIET},
        {"help", no_argument, NULL, O_HELP},
        {NULL, 0, NULL, 0},
    };
    memset(o, 0, sizeof(*o));
    o->steps = 30;
    o->seed = 1;
    o->optim = OPTIM_ADAMW;
    o->muon_lr = 0.02;
    o->adamw_lr = 0.001;
    o->adamw_eps = 1e-8;
    o->prefetch = 1;
    o->emulate = 1;
    set_model(o, "medium");
    int batch = 0, tokens = 0, dims_set = 0;
    ft_dims_t dims = o->dims;
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_STEPS:
            bad = parse_int(optarg, 0, 1000000, &o->steps);
            break;
        case O_SEED: {
            char *end;
            errno = 0;
            o->seed = strtoull(optarg, &end, 10);
            bad = errno != 0 || end == optarg || *end != '\0';
            break;
        }
        case O_OPTIM:
            if (strcmp(optarg, "adamw") == 0)
                o->optim = OPTIM_ADAMW;
            else if (strcmp(optarg, "muon-gather") == 0 || strcmp(optarg, "muon") == 0)
                o->optim = OPTIM_MUON_GATHER;
            else if (strcmp(optarg, "none") == 0)
                o->optim = OPTIM_NONE;
            else
                bad = 1;
            break;
        case O_LR:
            bad = parse_float(optarg, &o->lr);
            o->lr_set = 1;
            break;
        case O_MUON_LR:
            bad = parse_float(optarg, &o->muon_lr);
            break;
        case O_ADAMW_LR:
            bad = parse_float(optarg, &o->adamw_lr);
            break;
        case O_ADAMW_EPS:
            bad = parse_float(optarg, &o->adamw_eps);
            break;
        case O_WD:
            bad = parse_float(optarg, &o->wd);
            break;
        case O_DIVIDE_FACTOR:
            bad = parse_float(optarg, &o->divide_factor) || o->divide_factor <= 0.0;
            break;
        case O_MODEL:
            bad = set_model(o, optarg);
            if (!bad && !dims_set)
                dims = o->dims;
            break;
        case O_DIMS:
            bad = parse_dims(optarg, &dims);
            dims_set = 1;
            break;
        case O_BATCH:
            bad = parse_int(optarg, 1, 1 << 20, &batch);
            break;
        case O_TOKENS:
            bad = parse_int(optarg, 1, 1 << 16, &tokens);
            break;
        case O_NO_PREFETCH:
            o->prefetch = 0;
            break;
        case O_MANIFEST:
            o->manifest_path = optarg;
            break;
        case O_DUMP:
            o->dump_path = optarg;
            break;
        case O_REFERENCE:
            o->reference = 1;
            break;
        case O_EMULATE:
            bad = parse_int(optarg, 1, 4096, &o->emulate);
            break;
        case O_QUIET:
            o->quiet = 1;
            break;
        case O_HELP:
            usage(stdout);
            exit(0);
        default:
            usage(stderr);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "fsdp_train: bad value '%s' for --%s\n", optarg,
                    longopts[c - O_STEPS].name);
            return -1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "fsdp_train: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (dims_set) {
        dims.batch = o->dims.batch;
        dims.tokens = o->dims.tokens;
        o->model = "custom";
    }
    o->dims = dims;
    if (batch > 0)
        o->dims.batch = batch;
    if (tokens > 0)
        o->dims.tokens = tokens;
    if (o->emulate > 1 && !o->reference) {
        fprintf(stderr, "fsdp_train: --emulate-world needs --reference\n");
        return -1;
    }
    if (o->lr_set) {
        if (o->optim == OPTIM_MUON_GATHER)
            o->muon_lr = o->lr;
        else
            o->adamw_lr = o->lr;
    }
    return 0;
}

/* ---- groups and sharding ------------------------------------------------------------- */

static void add_param(group_t *g, const char *name, size_t rows, size_t cols, int ndim, int muon)
{
    param_t *p = &g->p[g->np++];
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->rows = rows;
    p->cols = cols;
    p->ndim = ndim;
    p->muon = muon;
}

/* Rows of p held by rank q (the rest of its c rows are padding). */
static size_t rows_on(const param_t *p, int q)
{
    size_t first = (size_t)q * p->c;
    if (p->rows <= first)
        return 0;
    return p->rows - first < p->c ? p->rows - first : p->c;
}

static void group_layout(group_t *g, int n, int rank)
{
    size_t off = 0, foff = 0;
    for (size_t i = 0; i < g->np; i++) {
        param_t *p = &g->p[i];
        p->c = (p->rows + (size_t)n - 1) / (size_t)n;
        p->s = p->c * p->cols;
        p->o = off;
        p->foff = foff;
        p->lrows = rows_on(p, rank);
        off += p->s;
        foff += p->rows * p->cols;
    }
    g->S = off;
    g->numel = foff;
}

static void build_groups(trainer_t *T)
{
    const ft_dims_t *d = &T->d;
    size_t V = (size_t)d->vocab, D = (size_t)d->dim, H = (size_t)d->hidden, C = (size_t)d->out;
    T->ngroups = 1 + (size_t)d->blocks;
    T->g = xcalloc(T->ngroups, sizeof(group_t));
    group_t *root = &T->g[0];
    snprintf(root->name, sizeof(root->name), "root");
    add_param(root, "embed.weight", V, D, 2, 0);
    add_param(root, "norm.weight", D, 1, 1, 0);
    add_param(root, "lm_head.weight", C, D, 2, 0);
    add_param(root, "lm_head.bias", C, 1, 1, 0);
    for (int l = 0; l < d->blocks; l++) {
        group_t *g = &T->g[1 + l];
        char name[64];
        snprintf(g->name, sizeof(g->name), "blocks.%d", l);
        snprintf(name, sizeof(name), "blocks.%d.fc1.weight", l);
        add_param(g, name, H, D, 2, 1);
        snprintf(name, sizeof(name), "blocks.%d.fc1.bias", l);
        add_param(g, name, H, 1, 1, 0);
        snprintf(name, sizeof(name), "blocks.%d.fc2.weight", l);
        add_param(g, name, D, H, 2, 1);
        snprintf(name, sizeof(name), "blocks.%d.fc2.bias", l);
        add_param(g, name, D, 1, 1, 0);
    }
    size_t pindex = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        group_layout(g, T->n, T->rank);
        g->shard = xcalloc(g->S, sizeof(float));
        g->gshard = xcalloc(g->S, sizeof(float));
        for (size_t i = 0; i < g->np; i++, pindex++) {
            param_t *p = &g->p[i];
            size_t nvalid = p->lrows * p->cols;
            p->m = xcalloc(nvalid, sizeof(float));
            p->v = xcalloc(nvalid, sizeof(float));
            if (p->muon)
                p->mom = xcalloc(nvalid, sizeof(float));
            /* Values are a function of the full index, so every world size starts equal. */
            size_t first = (size_t)T->rank * p->c * p->cols;
            float bound = 1.0f;
            if (strstr(p->name, "fc1") != NULL)
                bound = 1.0f / sqrtf((float)D);
            else if (strstr(p->name, "fc2") != NULL)
                bound = 1.0f / sqrtf((float)H);
            else if (strstr(p->name, "lm_head") != NULL)
                bound = 1.0f / sqrtf((float)D);
            for (size_t k = 0; k < nvalid; k++) {
                float v;
                if (strcmp(p->name, "embed.weight") == 0)
                    v = ft_rand_normal(T->o.seed, 1000 + pindex, first + k);
                else if (strcmp(p->name, "norm.weight") == 0)
                    v = 1.0f;
                else
                    v = bound * ft_rand_uniform(T->o.seed, 1000 + pindex, first + k);
                g->shard[p->o + k] = v;
            }
        }
    }
}

static void fatal_comm(trainer_t *T)
{
    fprintf(stderr, "fsdp_train: rank %d: communication failed\n", T->rank);
    ft_comm_abort(T->comm, 1);
}

/* FSDP2 unshard: copy-in, in-place all-gather, split_with_sizes copy-out. */
static void group_unshard(trainer_t *T, group_t *g)
{
    if (g->full != NULL)
        return;
    double t0 = now();
    size_t S = g->S;
    float *ag = xmalloc((size_t)T->n * S * sizeof(float));
    memcpy(ag + (size_t)T->rank * S, g->shard, S * sizeof(float));
    if (ft_comm_allgather_inplace(T->comm, ag, S) != 0)
        fatal_comm(T);
    g->full = xmalloc(g->numel * sizeof(float));
    for (size_t i = 0; i < g->np; i++) {
        const param_t *p = &g->p[i];
        for (int q = 0; q < T->n; q++)
            memcpy(g->full + p->foff + (size_t)q * p->c * p->cols, ag + (size_t)q * S + p->o,
                   rows_on(p, q) * p->cols * sizeof(float));
    }
    free(ag);
    T->t[T_COMM] += now() - t0;
}

static void group_reshard(group_t *g)
{
    free(g->full);
    g->full = NULL;
}

/* FSDP2 post-backward: _chunk_cat the unsharded grads (zero padded), reduce-scatter with
 * avg; micro-batch m > 0 of the reference adds to the shard gradient of micro-batch 0. */
static void group_reduce(trainer_t *T, group_t *g, int micro)
{
    double t0 = now();
    size_t S = g->S;
    float *send = xcalloc((size_t)T->n * S, sizeof(float));
    for (size_t i = 0; i < g->np; i++) {
        const param_t *p = &g->p[i];
        for (int q = 0; q < T->n; q++)
            memcpy(send + (size_t)q * S + p->o, g->grad + p->foff + (size_t)q * p->c * p->cols,
                   rows_on(p, q) * p->cols * sizeof(float));
    }
    free(g->grad);
    g->grad = NULL;
    float *out = micro == 0 ? g->gshard : xmalloc(S * sizeof(float));
    if (ft_comm_reduce_scatter(T->comm, send, out, S, T->premul) != 0)
        fatal_comm(T);
    if (micro > 0) {
        for (size_t k = 0; k < S; k++)
            g->gshard[k] += out[k];
        free(out);
    }
    free(send);
    T->t[T_COMM] += now() - t0;
}

static float *pw(group_t *g, size_t i)
{
    return g->full + g->p[i].foff;
}

static float *pg(group_t *g, size_t i)
{
    return g->grad + g->p[i].foff;
}

/* Forward of one micro-batch; train = 0 evaluates with every group already gathered. */
static float forward(trainer_t *T, int train)
{
    const ft_dims_t *d = &T->d;
    int B = d->batch, D = d->dim, H = d->hidden, C = d->out;
    group_t *root = &T->g[0];
    if (train)
        group_unshard(T, root);
    ft_embed_fwd(d, pw(root, 0), T->tokens, T->x[0]);
    for (int l = 0; l < d->blocks; l++) {
        group_t *g = &T->g[1 + l];
        if (train)
            group_unshard(T, g);
        ft_linear_fwd(B, D, H, T->x[l], pw(g, 0), pw(g, 1), T->a[l]);
        ft_gelu_fwd((size_t)B * (size_t)H, T->a[l], T->s[l]);
        ft_linear_fwd(B, H, D, T->s[l], pw(g, 2), pw(g, 3), T->x[l + 1]);
        for (size_t k = 0; k < (size_t)B * (size_t)D; k++)
            T->x[l + 1][k] += T->x[l][k];
        if (train)
            group_reshard(g);
    }
    ft_rmsnorm_fwd(B, D, T->x[d->blocks], pw(root, 1), T->z, T->rinv);
    ft_linear_fwd(B, D, C, T->z, pw(root, 2), pw(root, 3), T->y);
    return ft_mse(B, C, T->y, T->target, T->dy);
}

static void backward(trainer_t *T, int micro)
{
    const ft_dims_t *d = &T->d;
    int B = d->batch, D = d->dim, H = d->hidden, C = d->out, L = d->blocks;
    group_t *root = &T->g[0];
    root->grad = xcalloc(root->numel, sizeof(float));
    if (T->o.prefetch && L > 0)
        group_unshard(T, &T->g[L]); /* the root's pre-backward prefetches the last block */
    ft_linear_bwd(B, D, C, T->z, pw(root, 2), T->dy, pg(root, 2), pg(root, 3), T->dz, 0);
    ft_rmsnorm_bwd(B, D, T->x[L], pw(root, 1), T->rinv, T->dz, pg(root, 1), T->dh);
    for (int l = L - 1; l >= 0; l--) {
        group_t *g = &T->g[1 + l];
        group_unshard(T, g);
        if (T->o.prefetch && l > 0)
            group_unshard(T, &T->g[l]);
        g->grad = xmalloc(g->numel * sizeof(float));
        ft_linear_bwd(B, H, D, T->s[l], pw(g, 2), T->dh, pg(g, 2), pg(g, 3), T->ds, 0);
        ft_gelu_bwd((size_t)B * (size_t)H, T->a[l], T->ds, T->da);
        ft_linear_bwd(B, D, H, T->x[l], pw(g, 0), T->da, pg(g, 0), pg(g, 1), T->dh, 1);
        group_reshard(g);
        group_reduce(T, g, micro);
    }
    ft_embed_bwd(d, T->tokens, T->dh, pg(root, 0));
    group_reduce(T, root, micro);
    group_reshard(root);
}

/* ---- optimizers ------------------------------------------------------------------------ */

/* FSDP2-Muon: momentum on the local rows, all-gather the smoothed update, Newton-Schulz on
 * the whole matrix on every rank, keep this rank's rows. */
static void muon_gather_param(trainer_t *T, group_t *g, param_t *p)
{
    size_t nvalid = p->lrows * p->cols;
    const float *grad = g->gshard + p->o;
    float *w = g->shard + p->o;
    const float beta = FT_MUON_MOMENTUM;
    memset(T->mu_u, 0, p->s * sizeof(float));
    for (size_t k = 0; k < nvalid; k++) {
        p->mom[k] = beta * p->mom[k] + (1.0f - beta) * grad[k];
        T->mu_u[k] = (1.0f - beta) * grad[k] + beta * p->mom[k]; /* nesterov */
    }
    double t0 = now();
    if (ft_comm_allgather(T->comm, T->mu_u, T->mu_gather, p->s) != 0)
        fatal_comm(T);
    double t1 = now();
    /* The padded gather is rank-major c-row chunks: its first N0 rows are the matrix. */
    if (ft_newton_schulz(p->rows, p->cols, T->mu_gather, T->mu_out, T->mu_ws) != 0) {
        fprintf(stderr, "fsdp_train: matrix %s too large\n", p->name);
        ft_comm_abort(T->comm, 1);
    }
    double t2 = now();
    T->t[T_OPTIM_COMM] += t1 - t0;
    T->t[T_OPTIM_NS] += t2 - t1;
    const float *u = T->mu_out + (size_t)T->rank * p->c * p->cols;
    float lr = (float)T->o.muon_lr, decay = 1.0f - lr * (float)T->o.wd;
    for (size_t k = 0; k < nvalid; k++)
        w[k] = w[k] * decay - lr * u[k];
}

static void optimizer_step(trainer_t *T)
{
    if (T->o.optim == OPTIM_NONE)
        return;
    T->adam_t++;
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        for (size_t i = 0; i < g->np; i++) {
            param_t *p = &g->p[i];
            if (T->o.optim == OPTIM_MUON_GATHER && p->muon)
                muon_gather_param(T, g, p);
            else
                ft_adamw_update(p->lrows * p->cols, g->shard + p->o, g->gshard + p->o, p->m, p->v,
                                T->adam_t, (float)T->o.adamw_lr, (float)T->o.adamw_eps,
                                (float)T->o.wd);
        }
    }
}

static void alloc_muon_scratch(trainer_t *T)
{
    size_t max_s = 0, max_numel = 0, max_ws = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t i = 0; i < T->g[gi].np; i++) {
            const param_t *p = &T->g[gi].p[i];
            if (!p->muon)
                continue;
            max_s = p->s > max_s ? p->s : max_s;
            max_numel = p->rows * p->cols > max_numel ? p->rows * p->cols : max_numel;
            size_t ws = ft_ns_workspace(p->rows, p->cols);
            max_ws = ws > max_ws ? ws : max_ws;
        }
    T->mu_u = xcalloc(max_s, sizeof(float));
    T->mu_gather = xcalloc((size_t)T->n * max_s, sizeof(float));
    T->mu_out = xcalloc(max_numel, sizeof(float));
    T->mu_ws = xcalloc(max_ws, sizeof(float));
}

/* ---- manifest and weights ---------------------------------------------------------------- */

static const char *optim_name(optim_t o)
{
    return o == OPTIM_ADAMW ? "adamw" : o == OPTIM_MUON_GATHER ? "muon-gather" : "none";
}

/* mfsdp-manifest/1 (DESIGN.md section 4), written by hand: the job links nothing of mfsdp. */
static int write_manifest(const trainer_t *T, const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    fprintf(f, "{\n  \"format\": \"mfsdp-manifest/1\",\n  \"world_size\": %d,\n", T->n);
    fprintf(f,
            "  \"optimizer\": {\"lr\": %.15g, \"momentum\": %.7g, \"nesterov\": true, "
            "\"ns_steps\": %d, \"weight_decay\": %.15g, \"scale\": \"keller\",\n"
            "    \"adamw\": {\"lr\": %.15g, \"betas\": [%.7g, %.7g], \"eps\": %.15g, "
            "\"weight_decay\": %.15g}},\n",
            T->o.muon_lr, (double)FT_MUON_MOMENTUM, FT_MUON_NS_STEPS, T->o.wd, T->o.adamw_lr,
            (double)FT_ADAM_BETA1, (double)FT_ADAM_BETA2, T->o.adamw_eps, T->o.wd);
    fprintf(f, "  \"groups\": [\n");
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        const group_t *g = &T->g[gi];
        fprintf(f, "    {\"name\": \"%s\", \"reduce_dtype\": \"float32\", \"params\": [\n",
                g->name);
        for (size_t i = 0; i < g->np; i++) {
            const param_t *p = &g->p[i];
            fprintf(f, "      {\"name\": \"%s\", \"shape\": ", p->name);
            if (p->ndim == 2)
                fprintf(f, "[%zu, %zu]", p->rows, p->cols);
            else
                fprintf(f, "[%zu]", p->rows);
            fprintf(f, ", \"dtype\": \"float32\", \"optimizer\": \"%s\"}%s\n",
                    p->muon ? "muon" : "adamw", i + 1 < g->np ? "," : "");
        }
        fprintf(f, "    ]}%s\n", gi + 1 < T->ngroups ? "," : "");
    }
    fprintf(f, "  ],\n  \"sequence\": [\n");
    /* One iteration's calls, in the order the training loop issues them. */
    int L = T->d.blocks;
    fprintf(f, "    [\"allgather\", \"root\"]");
    for (int l = 0; l < L; l++)
        fprintf(f, ",\n    [\"allgather\", \"blocks.%d\"]", l);
    if (L > 0)
        fprintf(f, ",\n    [\"allgather\", \"blocks.%d\"]", L - 1);
    for (int l = L - 1; l >= 0; l--) {
        if (!T->o.prefetch && l < L - 1)
            fprintf(f, ",\n    [\"allgather\", \"blocks.%d\"]", l);
        if (T->o.prefetch && l > 0)
            fprintf(f, ",\n    [\"allgather\", \"blocks.%d\"]", l - 1);
        fprintf(f, ",\n    [\"reduce_scatter\", \"blocks.%d\"]", l);
    }
    fprintf(f, ",\n    [\"reduce_scatter\", \"root\"]\n  ]\n}\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* Raw float32 weights after a small text header (names, shapes), in FSDP order. */
static int dump_weights(const trainer_t *T, const char *path)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t ntensors = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        ntensors += T->g[gi].np;
    fprintf(f, "fsdp-train-weights/1\nflavour %s world %d optim %s steps %d seed %" PRIu64 "\n",
            ft_comm_flavour(), T->o.reference ? T->o.emulate : T->n, optim_name(T->o.optim),
            T->o.steps, T->o.seed);
    fprintf(f, "tensors %zu\n", ntensors);
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t i = 0; i < T->g[gi].np; i++) {
            const param_t *p = &T->g[gi].p[i];
            if (p->ndim == 2)
                fprintf(f, "%s 2 %zu %zu\n", p->name, p->rows, p->cols);
            else
                fprintf(f, "%s 1 %zu\n", p->name, p->rows);
        }
    fprintf(f, "end\n");
    int rc = 0;
    for (size_t gi = 0; gi < T->ngroups && rc == 0; gi++)
        if (fwrite(T->g[gi].full, sizeof(float), T->g[gi].numel, f) != T->g[gi].numel)
            rc = -1;
    if (fclose(f) != 0 || rc != 0) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---- driver -------------------------------------------------------------------------- */

static void alloc_activations(trainer_t *T)
{
    const ft_dims_t *d = &T->d;
    size_t B = (size_t)d->batch, D = (size_t)d->dim, H = (size_t)d->hidden;
    size_t C = (size_t)d->out, L = (size_t)d->blocks;
    T->tokens = xcalloc(B * (size_t)d->tokens, sizeof(int32_t));
    T->target = xcalloc(B * C, sizeof(float));
    T->x = xcalloc(L + 1, sizeof(float *));
    T->a = xcalloc(L ? L : 1, sizeof(float *));
    T->s = xcalloc(L ? L : 1, sizeof(float *));
    for (size_t l = 0; l <= L; l++)
        T->x[l] = xcalloc(B * D, sizeof(float));
    for (size_t l = 0; l < L; l++) {
        T->a[l] = xcalloc(B * H, sizeof(float));
        T->s[l] = xcalloc(B * H, sizeof(float));
    }
    T->rinv = xcalloc(B, sizeof(float));
    T->z = xcalloc(B * D, sizeof(float));
    T->y = xcalloc(B * C, sizeof(float));
    T->dy = xcalloc(B * C, sizeof(float));
    T->dz = xcalloc(B * D, sizeof(float));
    T->dh = xcalloc(B * D, sizeof(float));
    T->ds = xcalloc(B * H, sizeof(float));
    T->da = xcalloc(B * H, sizeof(float));
}

static void make_batch(trainer_t *T, uint64_t step, uint64_t source)
{
    double t0 = now();
    ft_make_tokens(&T->d, T->o.seed, step, source, T->tokens);
    if (ft_teacher_targets(T->teacher, T->tokens, T->target) != 0) {
        fprintf(stderr, "fsdp_train: out of memory\n");
        ft_comm_abort(T->comm, 1);
    }
    T->t[T_DATA] += now() - t0;
}

static float train_step(trainer_t *T, int step)
{
    int micro = T->o.reference ? T->o.emulate : 1;
    float loss_sum = 0.0f;
    for (int m = 0; m < micro; m++) {
        make_batch(T, (uint64_t)step, (uint64_t)(T->o.reference ? m : T->rank));
        double t0 = now(), c0 = T->t[T_COMM];
        loss_sum += forward(T, 1);
        double t1 = now(), c1 = T->t[T_COMM];
        T->t[T_FWD] += (t1 - t0) - (c1 - c0);
        backward(T, m);
        T->t[T_BWD] += (now() - t1) - (T->t[T_COMM] - c1);
    }
    if (micro > 1 && T->premul == 0.0f) /* the average of the emulated ranks */
        for (size_t gi = 0; gi < T->ngroups; gi++)
            for (size_t k = 0; k < T->g[gi].S; k++)
                T->g[gi].gshard[k] = T->g[gi].gshard[k] / (float)micro;
    /* loss.item() logging: the only non-FSDP collective of a step */
    double t0 = now();
    if (ft_comm_allreduce_sum(T->comm, &loss_sum, 1) != 0)
        fatal_comm(T);
    T->t[T_COMM] += now() - t0;
    double t1 = now();
    optimizer_step(T);
    T->t[T_OPTIM] += now() - t1;
    return loss_sum / (float)(T->o.reference ? micro : T->n);
}

static double peak_rss_mib(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return -1.0;
    return (double)ru.ru_maxrss / 1024.0; /* Linux: KiB */
}

static void report(trainer_t *T, float eval_loss, float last_loss, double wall)
{
    enum { NV = T_COUNT + 1 };
    double mine[NV];
    int steps = T->o.steps, from = steps > 1 ? 1 : 0;
    int counted = steps - from > 0 ? steps - from : 1;
    for (int i = 0; i < T_COUNT; i++)
        mine[i] = 1e3 * (T->t[i] - (from ? T->t_first[i] : 0.0)) / (double)counted;
    mine[T_COUNT] = peak_rss_mib();
    double *all = xcalloc((size_t)NV * (size_t)T->n, sizeof(double));
    if (ft_comm_gather_report(T->comm, mine, NV, all) != 0)
        fatal_comm(T);
    if (T->rank == 0) {
        printf("final eval_loss %.7f last_train_loss %.7f steps %d wall_s %.3f\n",
               (double)eval_loss, (double)last_loss, steps, wall);
        printf("timing_ms_per_step (mean over steps %d..%d, max over ranks):", from,
               steps > 0 ? steps - 1 : 0);
        for (int i = 0; i < T_COUNT; i++) {
            double mx = 0.0;
            for (int r = 0; r < T->n; r++)
                mx = all[(size_t)r * NV + (size_t)i] > mx ? all[(size_t)r * NV + (size_t)i] : mx;
            printf(" %s %.2f", timer_names[i], mx);
        }
        printf("\npeak_rss_mib:");
        for (int r = 0; r < T->n; r++)
            printf(" %.1f", all[(size_t)r * NV + T_COUNT]);
        printf("\n");
    }
    free(all);
}

static void trainer_destroy(trainer_t *T)
{
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        for (size_t i = 0; i < g->np; i++) {
            free(g->p[i].m);
            free(g->p[i].v);
            free(g->p[i].mom);
        }
        free(g->shard);
        free(g->gshard);
        free(g->full);
        free(g->grad);
    }
    free(T->g);
    for (int l = 0; T->x != NULL && l <= T->d.blocks; l++)
        free(T->x[l]);
    for (int l = 0; T->a != NULL && l < T->d.blocks; l++) {
        free(T->a[l]);
        free(T->s[l]);
    }
    free(T->x);
    free(T->a);
    free(T->s);
    float *bufs[] = {T->target, T->rinv, T->z,    T->y,         T->dy,     T->dz,   T->dh,
                     T->ds,     T->da,   T->mu_u, T->mu_gather, T->mu_out, T->mu_ws};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        free(bufs[i]);
    free(T->tokens);
    ft_teacher_destroy(T->teacher);
}

static void print_header(const trainer_t *T)
{
    size_t total = 0, matrices = 0, muon = 0;
    double ns = 0.0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t i = 0; i < T->g[gi].np; i++) {
            const param_t *p = &T->g[gi].p[i];
            total += p->rows * p->cols;
            if (p->muon) {
                matrices++;
                muon += p->rows * p->cols;
                ns += ft_ns_flops(p->rows, p->cols);
            }
        }
    const ft_dims_t *d = &T->d;
    printf("fsdp_train: flavour %s world %d%s optim %s model %s dims %d,%d,%d,%d,%d batch %d "
           "tokens %d params %zu muon_matrices %zu (%zu elements, %.2f GFLOP Newton-Schulz "
           "per step) steps %d seed %" PRIu64 " muon_lr %g adamw_lr %g adamw_eps %g wd %g "
           "prefetch %d reduce %s\n",
           ft_comm_flavour(), T->o.reference ? T->o.emulate : T->n,
           T->o.reference ? " (reference, emulated)" : "", optim_name(T->o.optim), T->o.model,
           d->vocab, d->dim, d->hidden, d->out, d->blocks, d->batch, d->tokens, total, matrices,
           muon, ns * 1e-9, T->o.steps, T->o.seed, T->o.muon_lr, T->o.adamw_lr, T->o.adamw_eps,
           T->o.wd, T->o.prefetch, T->premul != 0.0f ? "premul_sum" : "avg");
}

int main(int argc, char **argv)
{
    trainer_t T;
    memset(&T, 0, sizeof(T));
    if (parse_options(argc, argv, &T.o) != 0)
        return 2;
    if (ft_comm_init(&argc, &argv, T.o.reference, &T.comm) != 0)
        return 1;
    T.rank = ft_comm_rank(T.comm);
    T.n = ft_comm_size(T.comm);
    T.d = T.o.dims;
    /* FSDP2: AVG when the divide factor equals the group size, else PREMUL_SUM(1/factor). */
    int world = T.o.reference ? T.o.emulate : T.n;
    if (T.o.divide_factor > 0.0 && T.o.divide_factor != (double)world)
        T.premul = (float)(1.0 / T.o.divide_factor);
    T.teacher = ft_teacher_create(&T.d, T.o.seed);
    if (T.teacher == NULL) {
        fprintf(stderr, "fsdp_train: out of memory\n");
        ft_comm_abort(T.comm, 1);
    }
    build_groups(&T);
    alloc_activations(&T);
    if (T.o.optim == OPTIM_MUON_GATHER)
        alloc_muon_scratch(&T);
    if (T.rank == 0) {
        print_header(&T);
        if (T.o.manifest_path != NULL && write_manifest(&T, T.o.manifest_path) != 0)
            ft_comm_abort(T.comm, 1);
    }
    fflush(stdout);

    double w0 = now();
    float loss = 0.0f;
    for (int step = 0; step < T.o.steps; step++) {
        double t0 = now();
        loss = train_step(&T, step);
        T.t[T_STEP] += now() - t0;
        if (step == 0)
            memcpy(T.t_first, T.t, sizeof(T.t));
        if (T.rank == 0 && !T.o.quiet) {
            printf("step %5d loss %.7f time_ms %.2f\n", step, (double)loss, 1e3 * (now() - t0));
            fflush(stdout);
        }
    }
    double wall = now() - w0;

    /* Final all-gather of every group (forward order), then evaluation on held-out batches
     * and the weight dump on rank 0. */
    for (size_t gi = 0; gi < T.ngroups; gi++)
        group_unshard(&T, &T.g[gi]);
    float eval = 0.0f;
    if (T.rank == 0) {
        for (int e = 0; e < EVAL_BATCHES; e++) {
            make_batch(&T, EVAL_STEP, (uint64_t)e);
            eval += forward(&T, 0);
        }
        eval /= (float)EVAL_BATCHES;
        if (T.o.dump_path != NULL && dump_weights(&T, T.o.dump_path) != 0)
            ft_comm_abort(T.comm, 1);
    }
    report(&T, eval, loss, wall);
    fflush(stdout);
    trainer_destroy(&T);
    return ft_comm_finalize(T.comm) == 0 ? 0 : 1;
}
