/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fsdp_train: a small trainer that behaves like PyTorch FSDP2 (`fully_shard`) on the wire
 * and knows nothing of mfsdp. It is the unmodified job the LD_PRELOAD shim intercepts.
 *
 * Model: h = mean of the sample's token embeddings; per block h += fc2(gelu(fc1(h)));
 * y = lm_head(norm(h)) with RMSNorm gain; loss = MSE against a fixed random teacher.
 * Groups and params in FSDP order (FSDP2's post-order DFS: children, then own params):
 *   --wrap default (fully_shard per block, then on the root, which owns the rest):
 *     "root":     embed.weight [V, D], norm.weight [D], lm_head.weight [C, D], lm_head.bias [C]
 *     "blocks.l": blocks.l.fc1.weight [H, D], blocks.l.fc1.bias [H],
 *                 blocks.l.fc2.weight [D, H], blocks.l.fc2.bias [D]          (l = 0..L-1)
 *   --wrap torchtitan (fully_shard on tok embeddings, each block, [norm, output]; the root
 *     owns no params, so it has no group): "embed" (embed.weight), "blocks.l",
 *     "output" (norm.weight, lm_head.weight, lm_head.bias).
 *   --unused collide: blocks.0 gains blocks.0.gate.weight [4, D] (a child module registered
 *     between fc1 and fc2, so it sits between fc1.bias and fc2.weight) that the forward never
 *     uses: blocks.0's all-gather count is unique, its reduce-scatter count (FSDP2 drops a
 *     param without gradient) equals the other blocks' counts. --unused unique: blocks.0's
 *     fc2 runs without its bias, so blocks.0.fc2.bias gets no gradient and blocks.0's
 *     reduce-scatter count is unique. The job checks these counts at its world size.
 *
 * FSDP2 behaviour reproduced: every parameter is sharded on dim 0 with c = ceil(N0/n) rows
 * per rank (trailing ranks hold zero padding, possibly only padding); a group's local shards
 * are concatenated without alignment padding (S floats per rank). All-gathers are in place
 * (send == recv + rank*S); reduce-scatters cover the params that got a gradient in torch.
 * _chunk_cat's layout (rank r's chunk = rows [r c, (r+1) c) of every grad, zero padded),
 * count S' <= S. Groups reshard after forward except the default root
 * (reshard_after_forward=False for the root, True elsewhere); every group reshards after
 * backward. The backward visits groups in reverse post-forward order; each group's
 * pre-backward unshards it and prefetches the next one (unless --no-prefetch); its
 * post-backward reduce-scatters. Calls of one training pass (L blocks, with prefetch):
 *   default:    AG root, AG blocks.0 .. AG blocks.L-1, AG blocks.L-1,
 *               for l = L-1..1: AG blocks.l-1, RS blocks.l; RS blocks.0, RS root
 *               (3L+2 calls; --no-prefetch: AG blocks.l right before RS blocks.l, l < L-1)
 *   torchtitan: AG embed, AG blocks.0 .. AG blocks.L-1, AG output,
 *               AG output (its pre-backward), AG blocks.L-1 (its prefetch), RS output,
 *               for l = L-1..1: AG blocks.l-1, RS blocks.l;
 *               AG embed (blocks.0's prefetch), RS blocks.0, RS embed  (3L+6 calls: 12 at L=2)
 * Modes (each reproduces a real FSDP2 situation on the wire):
 *   --accum K --accum-mode nosync: set_requires_gradient_sync(False) on micro-batches
 *     0..K-2: those passes issue every all-gather (the root is re-gathered, it reshards
 *     after backward) and no reduce-scatter; the unsharded grads are summed locally and the
 *     last micro-batch reduce-scatters the sum. --accum-mode sync: every micro-batch
 *     reduce-scatters and the reduced shards are summed (manifest micro_steps = K). The loss
 *     gradient is scaled by 1/K (gradient = mean over micro-batches).
 *   --eval-every N: after every N-th optimizer step a no-grad forward on an eval batch: the
 *     forward's all-gathers only (AG root (if resharded), AG blocks.0 .. blocks.L-1; the
 *     torchtitan wrap: AG embed, blocks, output). The default root stays unsharded after a
 *     no-grad forward, so the next training pass starts with AG blocks.0 (the manifest marks
 *     the cycle's first AG root "optional").
 *   --hsdp R: 2-D mesh (R replicas x n/R shard ranks); all-gathers and reduce-scatters run
 *     in the shard group; each reduce-scatter is followed right away by an in-place
 *     all-reduce of its output over the replicate group (FSDP2's HSDP all-reduce: AVG with
 *     the default divide, SUM otherwise).
 *   --divide fp16: FSDP2's fp16 rule in fp32 arithmetic: the reduce-scatter input is divided
 *     by pre = the power of two _get_gradient_divide_factors picks (pre = 1; while
 *     F % pre == 0 and F / pre > pre: pre *= 2; F = the data-parallel size, or
 *     --divide-factor), reduced with SUM (HSDP all-reduce SUM too), then divided by F / pre
 *     (1.0 at n = 2, 1.5 at n = 3, 2 at n = 4). --divide force-sum
 *     (force_sum_reduction_for_comms): SUM, SUM, then a division by F.
 *   --clip MAX: clip_grad_norm_ over every param's reduced gradient after the backward: one
 *     all-reduce (SUM, shard group) of the vector of per-param squared norms of the local
 *     valid rows; total = sqrt(sum); coef = MAX / (total + 1e-6); below 1 every grad is
 *     scaled by coef before the optimizer.
 *   --schedule KIND:...: torchtitan's lr factor f(t) at optimizer step t (docs/manifest.md)
 *     multiplies the AdamW and the Muon learning rate.
 * Per optimizer step on the wire: K training passes (HSDP: RS g then AR g on the replicate
 * group), the clipping all-reduce (--clip), one scalar all-reduce of the loss (world), then
 * an eval pass and its loss all-reduce when due. After training: one all-gather per group
 * (forward order) feeds the final evaluation and the dump.
 *
 * Optimizers on the local shards: --optim adamw (every tensor), --optim muon-gather
 * (FSDP2-Muon as done today: each Muon matrix's momentum-smoothed update is all-gathered
 * out of place on every rank, Newton-Schulz runs redundantly everywhere, each rank keeps its
 * rows; AdamW for the other tensors), --optim muon-dist (DMuon / Dion-style distributed
 * Muon: matrix j, counted over the Muon matrices with a gradient in FSDP parameter order,
 * belongs to shard rank j mod n; momentum stays sharded with the parameter; per chunk of n
 * consecutive matrices (Dion's batches) the momentum update's shards are gathered to the
 * owners (MPI_Gather / grouped ncclSend+ncclRecv), each owner runs Newton-Schulz on its
 * whole matrix, the orthogonalised updates are scattered back (MPI_Scatter / grouped P2P)
 * and each rank applies its rows; the same arithmetic as muon-gather, the same trajectory;
 * AdamW for the other tensors), --optim none (the job under the shim).
 * Muon tensors: the 2-D weights of the blocks (blocks.*.fc1.weight, blocks.*.fc2.weight,
 * blocks.0.gate.weight). AdamW tensors: embed.weight, norm.weight, lm_head.weight,
 * lm_head.bias and every bias (the manifest default rule: >= 2 dims except names matching
 * embed|lm_head|wte|wpe). A param without gradient is skipped by every optimizer (no state
 * update, no weight decay), as torch's optimizers skip a param whose grad is None.
 *
 * --reference runs in one process without MPI at world size 1 and, with --emulate-world N,
 * averages the gradients of the N micro-batches ranks 0..N-1 would see (summed in rank
 * order, then divided as the mode's reduction would: by N for avg) before the same
 * optimizer: with --optim muon-gather (alias --optim muon) that is full-matrix Muon on the
 * block matrices and AdamW on the rest. Every mode above has the same semantics there.
 */
#include "comm.h"
#include "model.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <unistd.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define MAX_PARAMS   5
#define EVAL_BATCHES 8
#define EVAL_STEP    ((uint64_t)1 << 40) /* a step index training never reaches */
#define GATE_ROWS    4                   /* rows of blocks.0.gate.weight (--unused collide) */
#define GATE_STREAM  900                 /* its init stream (the others are 1000 + index) */

typedef enum { OPTIM_NONE, OPTIM_ADAMW, OPTIM_MUON_GATHER, OPTIM_MUON_DIST } optim_t;
typedef enum { UNUSED_NONE, UNUSED_COLLIDE, UNUSED_UNIQUE } unused_t;
typedef enum { WRAP_DEFAULT, WRAP_TORCHTITAN } wrap_t;
typedef enum { DIVIDE_DEFAULT, DIVIDE_FP16, DIVIDE_FORCE_SUM } divide_t;
typedef enum { SCHED_CONSTANT, SCHED_WARMUP_COSINE, SCHED_WARMUP_LINEAR, SCHED_WSD } sched_kind_t;
typedef enum { DECAY_LINEAR, DECAY_COSINE, DECAY_SQRT } decay_t;

static const char *const sched_names[] = {"constant", "warmup-cosine", "warmup-linear", "wsd"};
static const char *const decay_names[] = {"linear", "cosine", "sqrt"};

typedef struct schedule {
    sched_kind_t kind;
    int warmup, stable, decay_steps;
    double min_ratio;
    decay_t decay;
} schedule_t;

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
    divide_t divide;
    ft_dims_t dims;
    const char *model;
    int prefetch;
    unused_t unused;
    wrap_t wrap;
    int accum;      /* micro-batches per optimizer step */
    int accum_sync; /* reduce-scatter every micro-batch */
    int eval_every; /* 0: no eval passes */
    int hsdp;       /* replicas; 0: no mesh */
    schedule_t sched;
    double clip; /* max_norm; 0: off */
    const char *manifest_path;
    const char *dump_path;
    int reference;
    int emulate;
    int quiet;
    int start_step; /* --start-step: the first step run (a resumed job) */
    int die_set;    /* --die-at S:R (tests): rank R kills itself at the start of step S */
    int die_step, die_rank;
} options_t;

/* What a param is in the model (its place in the layer kernels). */
enum {
    R_EMBED,
    R_NORM,
    R_HEAD_W,
    R_HEAD_B,
    R_FC1_W,
    R_FC1_B,
    R_GATE,
    R_FC2_W,
    R_FC2_B,
    R_COUNT,
};

typedef struct param {
    char name[64];
    int role;
    int stream; /* init stream */
    int ndim;
    size_t rows; /* N0 */
    size_t cols; /* product of the other dims (1 for 1-D) */
    int muon;
    int used;     /* gets a gradient (else FSDP2 leaves it out of the reduce-scatter) */
    size_t c;     /* rows per rank */
    size_t s;     /* shard numel c * cols */
    size_t o;     /* offset in the group's per-rank all-gather block */
    size_t ro;    /* offset in the group's per-rank reduce-scatter block (used params) */
    size_t foff;  /* offset in the group's unsharded buffer */
    size_t lrows; /* valid (unpadded) rows on this rank */
    float *m, *v; /* AdamW state over the valid shard */
    float *mom;   /* Muon momentum over the valid shard */
} param_t;

typedef struct group {
    char name[32];
    size_t np;
    param_t p[MAX_PARAMS];
    int idx[R_COUNT]; /* role -> index in p, -1 when absent */
    int reshard_fwd;  /* reshard_after_forward */
    size_t S;         /* per-rank count of the all-gather */
    size_t S_rs;      /* per-rank count of the reduce-scatter (params with a gradient) */
    size_t numel;     /* unsharded elements */
    float *shard;     /* S floats: FSDP's sharded parameters (padding zero) */
    float *gshard;    /* S floats: the reduced gradient shard (all-gather layout) */
    int has_grad;     /* gshard holds this step's gradient */
    int unsharded;    /* gathered (full valid, or the dry run's state) */
    float *full;      /* unsharded parameters while gathered, else NULL */
    float *grad;      /* unsharded gradient during this group's backward */
    float *acc;       /* unsharded gradient summed over no-sync micro-batches */
} group_t;

/* One collective of the manifest's sequence, recorded by the dry run. */
typedef struct call {
    int rs; /* 0 all-gather, 1 reduce-scatter */
    int group;
    int optional;
} call_t;

enum { T_DATA, T_FWD, T_BWD, T_COMM, T_OPTIM, T_OPTIM_COMM, T_OPTIM_NS, T_STEP, T_COUNT };
static const char *const timer_names[T_COUNT] = {
    "data", "fwd", "bwd", "comm", "optim", "optim_comm", "optim_ns", "step",
};

typedef struct trainer {
    options_t o;
    ft_dims_t d;
    ft_comm_t *comm;
    int rank;  /* in the shard group (FSDP's rank) */
    int n;     /* shard group size (FSDP's world size) */
    int wrank; /* in the world: the rank whose micro-batches this process trains on */
    int world;
    int mesh; /* HSDP: the replicate all-reduce follows each reduce-scatter */
    int dp;   /* data-parallel size: world (emulated world for the reference) */
    ft_teacher_t *teacher;
    size_t ngroups; /* in forward order */
    group_t *g;
    group_t *ge;   /* the group holding embed.weight (first in forward) */
    group_t *gh;   /* the group holding norm and lm_head (root or output) */
    group_t **bwd; /* groups in backward (reverse post-forward) order */
    int32_t *tokens;
    float *target;
    float **x; /* blocks + 1 residual states, x[0] = embedding output */
    float **a; /* per block: fc1 output (pre-activation) */
    float **s; /* per block: gelu output */
    float *rinv, *z, *y, *dy, *dz, *dh, *ds, *da;
    /* Reduction, as FSDP2's _get_gradient_divide_factors picks it for dp ranks. */
    ft_op_t rs_op, ar_op;
    float premul; /* scalar of a PREMUL_SUM reduce-scatter */
    double pre;   /* divide the reduce-scatter input by this (1: no) */
    double post;  /* divide the reduced output by this (1: no) */
    int adam_t;
    float *mu_u, *mu_gather, *mu_out, *mu_ws; /* muon-gather scratch (mu_u, mu_out, mu_ws:
                                                 muon-dist too) */
    size_t nmd;     /* muon-dist: Muon matrices with a gradient, in FSDP parameter order */
    param_t **md_p; /* muon-dist: those matrices */
    group_t **md_g; /* muon-dist: their groups */
    float *md_full; /* muon-dist: the gathered matrix this rank owns in the current chunk */
    int dry;        /* dry run: record the calls, compute nothing */
    call_t *rec;
    size_t nrec, caprec;
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
    fprintf(
        f,
        "usage: fsdp_train_{mpi,nccl} [options]   (run under mpirun; --reference runs alone)\n"
        "       fsdp_train_nccl_nompi [options]   (no MPI: a launcher sets RANK, WORLD_SIZE,\n"
        "                         LOCAL_RANK and FSDP_TRAIN_ID_FILE; FSDP_TRAIN_ID_TIMEOUT s)\n"
        "  --steps N              training steps (30)\n"
        "  --seed S               seed of data, teacher and init (1)\n"
        "  --optim O              adamw | muon-gather | muon-dist | none\n"
        "                         (muon = muon-gather)\n"
        "  --lr X                 lr of the main rule: AdamW lr for adamw, Muon lr otherwise\n"
        "  --muon-lr X            Muon lr (0.02)\n"
        "  --adamw-lr X           AdamW lr (0.001)\n"
        "  --adamw-eps X          AdamW eps (1e-8)\n"
        "  --wd X                 decoupled weight decay for Muon and AdamW (0)\n"
        "  --divide-factor F      FSDP2 set_gradient_divide_factor: reduce with\n"
        "                         PREMUL_SUM(1/F) unless F equals the data-parallel size\n"
        "  --divide MODE          fp16: pre-divide by FSDP2's power of two, SUM, post-divide;\n"
        "                         force-sum: SUM then divide (force_sum_reduction_for_comms)\n"
        "  --model small|medium   preset dimensions (medium)\n"
        "  --dims V,D,H,C,L       vocab, dim, hidden, outputs, blocks\n"
        "  --batch B              samples per rank and micro-batch\n"
        "  --tokens T             tokens per sample\n"
        "  --no-prefetch          no backward prefetch (all-gather l right before its bwd)\n"
        "  --wrap default|torchtitan  FSDP wrapping (torchtitan: embed, blocks, output)\n"
        "  --unused collide|unique    a trainable param of blocks.0 gets no gradient\n"
        "  --accum K              micro-batches per optimizer step (1)\n"
        "  --accum-mode nosync|sync   skip the reduce-scatters of micro-batches 0..K-2\n"
        "                         (set_requires_gradient_sync(False), the default) or not\n"
        "  --eval-every N         no-grad forward on an eval batch after every N-th step\n"
        "  --hsdp R               HSDP: R replicas of n/R-rank shard groups\n"
        "  --schedule S           lr schedule: constant | warmup-cosine:W:D[:MIN] |\n"
        "                         warmup-linear:W:D[:MIN] | wsd:W:S:D[:MIN[:linear|cosine|sqrt]]\n"
        "  --clip MAX             clip_grad_norm_(MAX) before the optimizer\n"
        "  --write-manifest PATH  write the mfsdp-manifest/1 JSON of the groups (rank 0)\n"
        "  --dump-weights PATH    after the final all-gather rank 0 writes all weights\n"
        "  --reference            one process, no MPI, world size 1\n"
        "  --emulate-world N      with --reference: average N ranks' micro-batches (1)\n"
        "  --start-step S         run steps S..N-1 (a job resumed from a checkpoint of step S:\n"
        "                         the data and the schedule continue at S)\n"
        "  --die-at S:R           tests: world rank R kills itself (SIGKILL) when step S starts\n"
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

/* KIND[:W[:S]:D[:MIN[:DECAY]]] as the usage says; 0 or -1. */
static int parse_schedule(const char *arg, schedule_t *sc)
{
    char buf[128];
    char *f[7];
    int nf = 0;
    if (strlen(arg) >= sizeof(buf))
        return -1;
    strcpy(buf, arg);
    for (char *s = buf; nf < 7;) {
        f[nf++] = s;
        char *c = strchr(s, ':');
        if (c == NULL)
            break;
        *c = '\0';
        s = c + 1;
    }
    memset(sc, 0, sizeof(*sc));
    int k;
    for (k = 0; k < 4 && strcmp(f[0], sched_names[k]) != 0; k++)
        ;
    if (k == 4)
        return -1;
    sc->kind = (sched_kind_t)k;
    sc->decay = sc->kind == SCHED_WARMUP_COSINE ? DECAY_COSINE : DECAY_LINEAR;
    if (sc->kind == SCHED_CONSTANT)
        return nf == 1 ? 0 : -1;
    int wsd = sc->kind == SCHED_WSD;
    int need = wsd ? 4 : 3, most = wsd ? 6 : 4;
    if (nf < need || nf > most)
        return -1;
    if (parse_int(f[1], 0, 1 << 30, &sc->warmup) != 0)
        return -1;
    if (wsd && parse_int(f[2], 0, 1 << 30, &sc->stable) != 0)
        return -1;
    if (parse_int(f[need - 1], 0, 1 << 30, &sc->decay_steps) != 0)
        return -1;
    if (nf > need && (parse_float(f[need], &sc->min_ratio) != 0 || sc->min_ratio > 1.0))
        return -1;
    if (nf > need + 1) {
        for (k = 0; k < 3 && strcmp(f[need + 1], decay_names[k]) != 0; k++)
            ;
        if (k == 3)
            return -1;
        sc->decay = (decay_t)k;
    }
    return 0;
}

/* torchtitan's lr factor at optimizer step t (docs/manifest.md, "schedule"). */
static double schedule_factor(const schedule_t *sc, int step)
{
    if (sc->kind == SCHED_CONSTANT)
        return 1.0;
    long W = sc->warmup, S = sc->stable, D = sc->decay_steps;
    long t = step < W + S + D ? step : W + S + D;
    if (t < W)
        return (double)(t + 1) / (double)(W + 1);
    if (t < W + S || D == 0)
        return 1.0;
    double p = (double)(t + 1 - W - S) / (double)(D + 1), a;
    if (sc->decay == DECAY_COSINE)
        a = 0.5 * (1.0 + cos(3.14159265358979323846 * p));
    else if (sc->decay == DECAY_SQRT)
        a = 1.0 - sqrt(p);
    else
        a = 1.0 - p;
    return sc->min_ratio + (1.0 - sc->min_ratio) * a;
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
        O_DIVIDE,
        O_MODEL,
        O_DIMS,
        O_BATCH,
        O_TOKENS,
        O_NO_PREFETCH,
        O_WRAP,
        O_UNUSED,
        O_ACCUM,
        O_ACCUM_MODE,
        O_EVAL_EVERY,
        O_HSDP,
        O_SCHEDULE,
        O_CLIP,
        O_MANIFEST,
        O_DUMP,
        O_REFERENCE,
        O_EMULATE,
        O_START_STEP,
        O_DIE_AT,
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
        {"divide", required_argument, NULL, O_DIVIDE},
        {"model", required_argument, NULL, O_MODEL},
        {"dims", required_argument, NULL, O_DIMS},
        {"batch", required_argument, NULL, O_BATCH},
        {"tokens", required_argument, NULL, O_TOKENS},
        {"no-prefetch", no_argument, NULL, O_NO_PREFETCH},
        {"wrap", required_argument, NULL, O_WRAP},
        {"unused", required_argument, NULL, O_UNUSED},
        {"accum", required_argument, NULL, O_ACCUM},
        {"accum-mode", required_argument, NULL, O_ACCUM_MODE},
        {"eval-every", required_argument, NULL, O_EVAL_EVERY},
        {"hsdp", required_argument, NULL, O_HSDP},
        {"schedule", required_argument, NULL, O_SCHEDULE},
        {"clip", required_argument, NULL, O_CLIP},
        {"write-manifest", required_argument, NULL, O_MANIFEST},
        {"dump-weights", required_argument, NULL, O_DUMP},
        {"reference", no_argument, NULL, O_REFERENCE},
        {"emulate-world", required_argument, NULL, O_EMULATE},
        {"start-step", required_argument, NULL, O_START_STEP},
        {"die-at", required_argument, NULL, O_DIE_AT},
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
    o->accum = 1;
    o->sched.kind = SCHED_CONSTANT;
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
            else if (strcmp(optarg, "muon-dist") == 0)
                o->optim = OPTIM_MUON_DIST;
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
        case O_DIVIDE:
            if (strcmp(optarg, "fp16") == 0)
                o->divide = DIVIDE_FP16;
            else if (strcmp(optarg, "force-sum") == 0)
                o->divide = DIVIDE_FORCE_SUM;
            else if (strcmp(optarg, "default") == 0)
                o->divide = DIVIDE_DEFAULT;
            else
                bad = 1;
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
        case O_WRAP:
            if (strcmp(optarg, "default") == 0)
                o->wrap = WRAP_DEFAULT;
            else if (strcmp(optarg, "torchtitan") == 0)
                o->wrap = WRAP_TORCHTITAN;
            else
                bad = 1;
            break;
        case O_UNUSED:
            if (strcmp(optarg, "collide") == 0)
                o->unused = UNUSED_COLLIDE;
            else if (strcmp(optarg, "unique") == 0)
                o->unused = UNUSED_UNIQUE;
            else
                bad = 1;
            break;
        case O_ACCUM:
            bad = parse_int(optarg, 1, 4096, &o->accum);
            break;
        case O_ACCUM_MODE:
            if (strcmp(optarg, "nosync") == 0)
                o->accum_sync = 0;
            else if (strcmp(optarg, "sync") == 0)
                o->accum_sync = 1;
            else
                bad = 1;
            break;
        case O_EVAL_EVERY:
            bad = parse_int(optarg, 1, 1000000, &o->eval_every);
            break;
        case O_HSDP:
            bad = parse_int(optarg, 1, 4096, &o->hsdp);
            break;
        case O_SCHEDULE:
            bad = parse_schedule(optarg, &o->sched);
            break;
        case O_CLIP:
            bad = parse_float(optarg, &o->clip) || o->clip <= 0.0;
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
        case O_START_STEP:
            bad = parse_int(optarg, 0, 1000000, &o->start_step);
            break;
        case O_DIE_AT: {
            char extra;
            bad = sscanf(optarg, "%d:%d%c", &o->die_step, &o->die_rank, &extra) != 2 ||
                  o->die_step < 0 || o->die_rank < 0;
            o->die_set = !bad;
            break;
        }
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
    if (o->hsdp > 0 && o->reference && o->emulate % o->hsdp != 0) {
        fprintf(stderr,
                "fsdp_train: --hsdp %d needs an emulated world size divisible by %d, got %d\n",
                o->hsdp, o->hsdp, o->emulate);
        return -1;
    }
    if (o->unused == UNUSED_COLLIDE && o->dims.blocks < 2) {
        fprintf(stderr,
                "fsdp_train: --unused collide needs at least 2 blocks (blocks.0's "
                "reduce-scatter count is made equal to another block's), got %d\n",
                o->dims.blocks);
        return -1;
    }
    if (o->lr_set) {
        if (o->optim == OPTIM_MUON_GATHER || o->optim == OPTIM_MUON_DIST)
            o->muon_lr = o->lr;
        else
            o->adamw_lr = o->lr;
    }
    return 0;
}

/* ---- groups and sharding ------------------------------------------------------------- */

static param_t *add_param(group_t *g, const char *name, int role, int stream, size_t rows,
                          size_t cols, int ndim, int muon)
{
    param_t *p = &g->p[g->np];
    g->idx[role] = (int)g->np++;
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->role = role;
    p->stream = stream;
    p->rows = rows;
    p->cols = cols;
    p->ndim = ndim;
    p->muon = muon;
    p->used = 1;
    return p;
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
    size_t off = 0, roff = 0, foff = 0;
    for (size_t i = 0; i < g->np; i++) {
        param_t *p = &g->p[i];
        p->c = (p->rows + (size_t)n - 1) / (size_t)n;
        p->s = p->c * p->cols;
        p->o = off;
        p->ro = roff;
        p->foff = foff;
        p->lrows = rows_on(p, rank);
        off += p->s;
        if (p->used)
            roff += p->s;
        foff += p->rows * p->cols;
    }
    g->S = off;
    g->S_rs = roff;
    g->numel = foff;
}

static group_t *new_group(trainer_t *T, size_t gi, const char *name, int reshard_fwd)
{
    group_t *g = &T->g[gi];
    snprintf(g->name, sizeof(g->name), "%s", name);
    for (int r = 0; r < R_COUNT; r++)
        g->idx[r] = -1;
    g->reshard_fwd = reshard_fwd;
    return g;
}

static float init_bound(const trainer_t *T, int role)
{
    switch (role) {
    case R_FC1_W:
    case R_FC1_B:
    case R_GATE:
    case R_HEAD_W:
    case R_HEAD_B:
        return 1.0f / sqrtf((float)T->d.dim);
    case R_FC2_W:
    case R_FC2_B:
        return 1.0f / sqrtf((float)T->d.hidden);
    default:
        return 1.0f;
    }
}

static void build_groups(trainer_t *T)
{
    const ft_dims_t *d = &T->d;
    size_t V = (size_t)d->vocab, D = (size_t)d->dim, H = (size_t)d->hidden, C = (size_t)d->out;
    int L = d->blocks, tt = T->o.wrap == WRAP_TORCHTITAN;
    T->ngroups = (size_t)L + (tt ? 2 : 1);
    T->g = xcalloc(T->ngroups, sizeof(group_t));
    if (tt) {
        /* torchtitan: the root owns no params; every group reshards after forward. */
        T->ge = new_group(T, 0, "embed", 1);
        T->gh = new_group(T, (size_t)L + 1, "output", 1);
    } else {
        /* The root (reshard_after_forward=False) owns what the blocks do not. */
        T->ge = T->gh = new_group(T, 0, "root", 0);
    }
    /* Init streams 1000 + the param's index in the default wrapping, whatever the wrapping:
     * every wrapping starts from the same weights. */
    add_param(T->ge, "embed.weight", R_EMBED, 1000, V, D, 2, 0);
    add_param(T->gh, "norm.weight", R_NORM, 1001, D, 1, 1, 0);
    add_param(T->gh, "lm_head.weight", R_HEAD_W, 1002, C, D, 2, 0);
    add_param(T->gh, "lm_head.bias", R_HEAD_B, 1003, C, 1, 1, 0);
    for (int l = 0; l < L; l++) {
        char gname[32], name[64];
        snprintf(gname, sizeof(gname), "blocks.%d", l);
        group_t *g = new_group(T, 1 + (size_t)l, gname, 1);
        int base = 1000 + 4 + 4 * l;
        snprintf(name, sizeof(name), "blocks.%d.fc1.weight", l);
        add_param(g, name, R_FC1_W, base, H, D, 2, 1);
        snprintf(name, sizeof(name), "blocks.%d.fc1.bias", l);
        add_param(g, name, R_FC1_B, base + 1, H, 1, 1, 0);
        if (l == 0 && T->o.unused == UNUSED_COLLIDE) {
            snprintf(name, sizeof(name), "blocks.%d.gate.weight", l);
            add_param(g, name, R_GATE, GATE_STREAM, GATE_ROWS, D, 2, 1)->used = 0;
        }
        snprintf(name, sizeof(name), "blocks.%d.fc2.weight", l);
        add_param(g, name, R_FC2_W, base + 2, D, H, 2, 1);
        snprintf(name, sizeof(name), "blocks.%d.fc2.bias", l);
        param_t *b2 = add_param(g, name, R_FC2_B, base + 3, D, 1, 1, 0);
        if (l == 0 && T->o.unused == UNUSED_UNIQUE)
            b2->used = 0;
    }
    /* Backward: reverse post-forward order (the root's post-forward comes after the blocks'). */
    size_t bi = 0;
    T->bwd = xcalloc(T->ngroups, sizeof(group_t *));
    T->bwd[bi++] = T->gh;
    for (int l = L - 1; l >= 0; l--)
        T->bwd[bi++] = &T->g[1 + l];
    if (tt)
        T->bwd[bi++] = T->ge;
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        group_layout(g, T->n, T->rank);
        g->shard = xcalloc(g->S, sizeof(float));
        g->gshard = xcalloc(g->S, sizeof(float));
        for (size_t i = 0; i < g->np; i++) {
            param_t *p = &g->p[i];
            size_t nvalid = p->lrows * p->cols;
            p->m = xcalloc(nvalid, sizeof(float));
            p->v = xcalloc(nvalid, sizeof(float));
            if (p->muon)
                p->mom = xcalloc(nvalid, sizeof(float));
            /* Values are a function of the full index, so every world size starts equal. */
            size_t first = (size_t)T->rank * p->c * p->cols;
            float bound = init_bound(T, p->role);
            for (size_t k = 0; k < nvalid; k++) {
                float v;
                if (p->role == R_EMBED)
                    v = ft_rand_normal(T->o.seed, (uint64_t)p->stream, first + k);
                else if (p->role == R_NORM)
                    v = 1.0f;
                else
                    v = bound * ft_rand_uniform(T->o.seed, (uint64_t)p->stream, first + k);
                g->shard[p->o + k] = v;
            }
        }
    }
}

/*
 * The --unused modes promise counts on the wire: collide: blocks.0's all-gather count is
 * unique and its reduce-scatter count equals every other block's; unique: blocks.0's
 * reduce-scatter count is unique. A shape that breaks the promise at this world size is
 * refused (message on rank 0, the same decision on every rank).
 */
static int check_unused_counts(const trainer_t *T)
{
    const group_t *b0 = &T->g[1];
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        const group_t *g = &T->g[gi];
        if (g == b0)
            continue;
        const char *why = NULL;
        if (T->o.unused == UNUSED_COLLIDE && g->S == b0->S)
            why = "all-gather count equals";
        else if (T->o.unused == UNUSED_COLLIDE && strncmp(g->name, "blocks.", 7) == 0 &&
                 g->S_rs != b0->S_rs)
            why = "reduce-scatter count (without the unused param) differs from";
        else if (T->o.unused == UNUSED_UNIQUE && g->S_rs == b0->S_rs)
            why = "reduce-scatter count (without the unused param) equals";
        if (why != NULL) {
            if (T->wrank == 0)
                fprintf(stderr,
                        "fsdp_train: --unused %s: at world size %d blocks.0's %s %s's "
                        "(%zu/%zu vs %zu/%zu all-gather/reduce-scatter floats); choose other "
                        "--dims\n",
                        T->o.unused == UNUSED_COLLIDE ? "collide" : "unique", T->n, why, g->name,
                        b0->S, b0->S_rs, g->S, g->S_rs);
            return -1;
        }
    }
    return 0;
}

static void fatal_comm(trainer_t *T)
{
    fprintf(stderr, "fsdp_train: rank %d: communication failed\n", T->wrank);
    ft_comm_abort(T->comm, 1);
}

static void record(trainer_t *T, int rs, const group_t *g)
{
    if (T->nrec == T->caprec) {
        T->caprec = T->caprec ? 2 * T->caprec : 64;
        T->rec = realloc(T->rec, T->caprec * sizeof(call_t));
        if (T->rec == NULL) {
            fprintf(stderr, "fsdp_train: out of memory\n");
            exit(1);
        }
    }
    T->rec[T->nrec++] = (call_t){.rs = rs, .group = (int)(g - T->g), .optional = 0};
}

/* FSDP2 unshard: copy-in, in-place all-gather, split_with_sizes copy-out. */
static void group_unshard(trainer_t *T, group_t *g)
{
    if (g->unsharded)
        return;
    g->unsharded = 1;
    if (T->dry) {
        record(T, 0, g);
        return;
    }
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
    g->unsharded = 0;
}

/* A reduced gradient (reduce-scatter layout: params with a gradient) becomes this step's
 * shard gradient, or is added to it (FSDP2: grad = new if grad is None else grad += new). */
static void store_grad(group_t *g, const float *src)
{
    for (size_t i = 0; i < g->np; i++) {
        const param_t *p = &g->p[i];
        if (!p->used)
            continue;
        size_t nvalid = p->lrows * p->cols;
        float *dst = g->gshard + p->o;
        if (g->has_grad)
            for (size_t k = 0; k < nvalid; k++)
                dst[k] += src[p->ro + k];
        else
            memcpy(dst, src + p->ro, nvalid * sizeof(float));
    }
    g->has_grad = 1;
}

/*
 * FSDP2 foreach_reduce: _chunk_cat the unsharded grads of the params that have one (zero
 * padded), pre-divide, reduce-scatter, HSDP all-reduce over the replicate group,
 * post-divide.
 */
static void group_reduce(trainer_t *T, group_t *g)
{
    double t0 = now();
    size_t S = g->S_rs, total = (size_t)T->n * S;
    float *send = xcalloc(total, sizeof(float));
    for (size_t i = 0; i < g->np; i++) {
        const param_t *p = &g->p[i];
        if (!p->used)
            continue;
        for (int q = 0; q < T->n; q++)
            memcpy(send + (size_t)q * S + p->ro, g->grad + p->foff + (size_t)q * p->c * p->cols,
                   rows_on(p, q) * p->cols * sizeof(float));
    }
    free(g->grad);
    g->grad = NULL;
    if (T->pre != 1.0)
        for (size_t k = 0; k < total; k++)
            send[k] = send[k] / (float)T->pre;
    float *out = xmalloc(S * sizeof(float));
    if (ft_comm_reduce_scatter(T->comm, send, out, S, T->rs_op, T->premul) != 0)
        fatal_comm(T);
    if (T->mesh && ft_comm_allreduce(T->comm, FT_REPLICATE, out, S, T->ar_op) != 0)
        fatal_comm(T);
    if (T->post != 1.0)
        for (size_t k = 0; k < S; k++)
            out[k] = out[k] / (float)T->post;
    store_grad(g, out);
    free(out);
    free(send);
    T->t[T_COMM] += now() - t0;
}

/* The reference (world size 1) sums every emulated rank's and micro-batch's gradient as the
 * wire would see it (pre-divided, PreMulSum-scaled); reference_finalize divides. */
static void reference_reduce(trainer_t *T, group_t *g)
{
    for (size_t i = 0; i < g->np; i++) {
        const param_t *p = &g->p[i];
        if (!p->used)
            continue;
        size_t numel = p->rows * p->cols;
        const float *src = g->grad + p->foff;
        float *dst = g->gshard + p->o;
        for (size_t k = 0; k < numel; k++) {
            float v = src[k];
            if (T->pre != 1.0)
                v = v / (float)T->pre;
            if (T->rs_op == FT_OP_PREMUL_SUM)
                v = v * T->premul;
            dst[k] = g->has_grad ? dst[k] + v : v;
        }
    }
    g->has_grad = 1;
    free(g->grad);
    g->grad = NULL;
}

static void reference_finalize(trainer_t *T)
{
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        if (!g->has_grad)
            continue;
        for (size_t i = 0; i < g->np; i++) {
            const param_t *p = &g->p[i];
            if (!p->used)
                continue;
            float *x = g->gshard + p->o;
            for (size_t k = 0; k < p->rows * p->cols; k++) {
                if (T->rs_op == FT_OP_AVG) /* the average of the emulated ranks */
                    x[k] = x[k] / (float)T->dp;
                if (T->post != 1.0)
                    x[k] = x[k] / (float)T->post;
            }
        }
    }
}

/* FSDP2 post-backward: reshard, then reduce-scatter unless gradient sync is off for this
 * micro-batch (then autograd accumulates into the unsharded gradient). */
static void post_backward(trainer_t *T, group_t *g, int last)
{
    group_reshard(g);
    int reduce = T->o.accum_sync || last; /* the job's wire (the reference reduces each) */
    if (T->dry) {
        if (reduce)
            record(T, 1, g);
        return;
    }
    if (T->o.reference) {
        reference_reduce(T, g);
        return;
    }
    if (!reduce) {
        if (g->acc == NULL) {
            g->acc = g->grad;
        } else {
            for (size_t k = 0; k < g->numel; k++)
                g->acc[k] += g->grad[k];
            free(g->grad);
        }
        g->grad = NULL;
        return;
    }
    if (g->acc != NULL) {
        for (size_t k = 0; k < g->numel; k++)
            g->grad[k] = g->acc[k] + g->grad[k];
        free(g->acc);
        g->acc = NULL;
    }
    group_reduce(T, g);
}

static float *pw(group_t *g, int role)
{
    return g->full + g->p[g->idx[role]].foff;
}

static float *pg(group_t *g, int role)
{
    return g->grad + g->p[g->idx[role]].foff;
}

static int used(const group_t *g, int role)
{
    return g->idx[role] >= 0 && g->p[g->idx[role]].used;
}

typedef enum {
    FWD_TRAIN, /* training forward, FSDP's all-gathers and reshards */
    FWD_EVAL,  /* no-grad forward, the same all-gathers and reshards */
    FWD_LOCAL, /* every group already gathered: no communication (final evaluation) */
} fwd_t;

/* Forward of one micro-batch; returns its loss (0 in the dry run). */
static float forward(trainer_t *T, fwd_t mode)
{
    const ft_dims_t *d = &T->d;
    int B = d->batch, D = d->dim, H = d->hidden, C = d->out;
    int comm = mode != FWD_LOCAL, live = !T->dry;
    group_t *ge = T->ge, *gh = T->gh;
    if (comm)
        group_unshard(T, ge);
    if (live)
        ft_embed_fwd(d, pw(ge, R_EMBED), T->tokens, T->x[0]);
    if (comm && ge->reshard_fwd)
        group_reshard(ge);
    for (int l = 0; l < d->blocks; l++) {
        group_t *g = &T->g[1 + l];
        if (comm)
            group_unshard(T, g);
        if (live) {
            ft_linear_fwd(B, D, H, T->x[l], pw(g, R_FC1_W), pw(g, R_FC1_B), T->a[l]);
            ft_gelu_fwd((size_t)B * (size_t)H, T->a[l], T->s[l]);
            ft_linear_fwd(B, H, D, T->s[l], pw(g, R_FC2_W),
                          used(g, R_FC2_B) ? pw(g, R_FC2_B) : NULL, T->x[l + 1]);
            for (size_t k = 0; k < (size_t)B * (size_t)D; k++)
                T->x[l + 1][k] += T->x[l][k];
        }
        if (comm)
            group_reshard(g);
    }
    if (comm)
        group_unshard(T, gh);
    float loss = 0.0f;
    if (live) {
        ft_rmsnorm_fwd(B, D, T->x[d->blocks], pw(gh, R_NORM), T->z, T->rinv);
        ft_linear_fwd(B, D, C, T->z, pw(gh, R_HEAD_W), pw(gh, R_HEAD_B), T->y);
        loss = ft_mse(B, C, T->y, T->target, T->dy);
        if (mode == FWD_TRAIN && T->o.accum > 1) /* loss / K: the mean over micro-batches */
            for (size_t k = 0; k < (size_t)B * (size_t)C; k++)
                T->dy[k] = T->dy[k] / (float)T->o.accum;
    }
    if (comm && gh->reshard_fwd)
        group_reshard(gh);
    return loss;
}

/* FSDP2 pre-backward of the i-th group in backward order: unshard it, prefetch the next. */
static void pre_backward(trainer_t *T, size_t i)
{
    group_unshard(T, T->bwd[i]);
    if (T->o.prefetch && i + 1 < T->ngroups)
        group_unshard(T, T->bwd[i + 1]);
}

static void backward(trainer_t *T, int last)
{
    const ft_dims_t *d = &T->d;
    int B = d->batch, D = d->dim, H = d->hidden, C = d->out, L = d->blocks;
    int live = !T->dry;
    group_t *ge = T->ge, *gh = T->gh;
    size_t bi = 0;
    pre_backward(T, bi); /* the root's (or output's) pre-backward prefetches the last block */
    if (live) {
        gh->grad = xcalloc(gh->numel, sizeof(float));
        ft_linear_bwd(B, D, C, T->z, pw(gh, R_HEAD_W), T->dy, pg(gh, R_HEAD_W), pg(gh, R_HEAD_B),
                      T->dz, 0);
        ft_rmsnorm_bwd(B, D, T->x[L], pw(gh, R_NORM), T->rinv, T->dz, pg(gh, R_NORM), T->dh);
    }
    if (gh != ge)
        post_backward(T, gh, last);
    for (int l = L - 1; l >= 0; l--) {
        group_t *g = &T->g[1 + l];
        pre_backward(T, ++bi);
        if (live) {
            g->grad = xcalloc(g->numel, sizeof(float));
            ft_linear_bwd(B, H, D, T->s[l], pw(g, R_FC2_W), T->dh, pg(g, R_FC2_W),
                          used(g, R_FC2_B) ? pg(g, R_FC2_B) : NULL, T->ds, 0);
            ft_gelu_bwd((size_t)B * (size_t)H, T->a[l], T->ds, T->da);
            ft_linear_bwd(B, D, H, T->x[l], pw(g, R_FC1_W), T->da, pg(g, R_FC1_W), pg(g, R_FC1_B),
                          T->dh, 1);
        }
        post_backward(T, g, last);
    }
    if (gh != ge) {
        pre_backward(T, ++bi);
        if (live)
            ge->grad = xcalloc(ge->numel, sizeof(float));
    }
    if (live)
        ft_embed_bwd(d, T->tokens, T->dh, pg(ge, R_EMBED));
    post_backward(T, ge, last);
}

/* ---- optimizers ------------------------------------------------------------------------ */

/* The momentum update of a Muon matrix on this rank's valid rows (momentum is sharded with
 * the parameter); T->mu_u receives the nesterov update, zero over the padding rows. */
static void muon_momentum(trainer_t *T, const group_t *g, param_t *p)
{
    size_t nvalid = p->lrows * p->cols;
    const float *grad = g->gshard + p->o;
    const float beta = FT_MUON_MOMENTUM;
    memset(T->mu_u, 0, p->s * sizeof(float));
    for (size_t k = 0; k < nvalid; k++) {
        p->mom[k] = beta * p->mom[k] + (1.0f - beta) * grad[k];
        T->mu_u[k] = (1.0f - beta) * grad[k] + beta * p->mom[k]; /* nesterov */
    }
}

/* FSDP2-Muon: momentum on the local rows, all-gather the smoothed update, Newton-Schulz on
 * the whole matrix on every rank, keep this rank's rows. */
static void muon_gather_param(trainer_t *T, group_t *g, param_t *p, float lr)
{
    size_t nvalid = p->lrows * p->cols;
    float *w = g->shard + p->o;
    muon_momentum(T, g, p);
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
    float decay = 1.0f - lr * (float)T->o.wd;
    for (size_t k = 0; k < nvalid; k++)
        w[k] = w[k] * decay - lr * u[k];
}

/*
 * DMuon / Dion-style distributed Muon over the shard group. Matrix j (the Muon matrices that
 * got a gradient, in FSDP parameter order) belongs to rank j mod n; the matrices are taken
 * in chunks of n consecutive ones (chunk k: j = k n .. k n + n - 1, rank i owns the i-th),
 * as Dion's Muon batches them, so a rank holds one gathered matrix at a time. Per chunk:
 *   1. per matrix: momentum on the local rows (sharded with the parameter), then a gather of
 *      the padded shards of the nesterov update to the owner (rank-major c-row chunks: the
 *      first N0 rows are the matrix, the padding rows are zero);
 *   2. every owner runs Newton-Schulz on its matrix of the chunk (in parallel), in place in
 *      the gathered buffer (the padding rows stay zero);
 *   3. per matrix: a scatter of the orthogonalised update from the owner; each rank applies
 *      its rows (decoupled weight decay, then -lr * update), as muon-gather does.
 * Same arithmetic as muon-gather on the same matrix, only placed on one rank:
 * optim_comm = the gathers and scatters (a scatter includes waiting for its owner's
 * Newton-Schulz), optim_ns = this rank's Newton-Schulz.
 */
static void muon_dist_step(trainer_t *T, float lr)
{
    size_t n = (size_t)T->n;
    double tc = 0.0, tn = 0.0;
    for (size_t c0 = 0; c0 < T->nmd; c0 += n) {
        size_t c1 = c0 + n < T->nmd ? c0 + n : T->nmd;
        for (size_t j = c0; j < c1; j++) {
            muon_momentum(T, T->md_g[j], T->md_p[j]);
            double t0 = now();
            if (ft_comm_gather(T->comm, T->mu_u, T->md_full, T->md_p[j]->s, (int)(j - c0)) != 0)
                fatal_comm(T);
            tc += now() - t0;
        }
        size_t own = c0 + (size_t)T->rank;
        if (own < c1) {
            const param_t *p = T->md_p[own];
            double t0 = now();
            if (ft_newton_schulz(p->rows, p->cols, T->md_full, T->mu_out, T->mu_ws) != 0) {
                fprintf(stderr, "fsdp_train: matrix %s too large\n", p->name);
                ft_comm_abort(T->comm, 1);
            }
            memcpy(T->md_full, T->mu_out, p->rows * p->cols * sizeof(float));
            tn += now() - t0;
        }
        for (size_t j = c0; j < c1; j++) {
            param_t *p = T->md_p[j];
            double t0 = now();
            if (ft_comm_scatter(T->comm, T->md_full, T->mu_u, p->s, (int)(j - c0)) != 0)
                fatal_comm(T);
            tc += now() - t0;
            float *w = T->md_g[j]->shard + p->o;
            float decay = 1.0f - lr * (float)T->o.wd;
            for (size_t k = 0; k < p->lrows * p->cols; k++)
                w[k] = w[k] * decay - lr * T->mu_u[k];
        }
    }
    T->t[T_OPTIM_COMM] += tc;
    T->t[T_OPTIM_NS] += tn;
}

static void optimizer_step(trainer_t *T)
{
    if (T->o.optim == OPTIM_NONE)
        return;
    T->adam_t++;
    /* The scheduled lr of optimizer step t = adam_t - 1 (a LambdaLR stepped after each step). */
    double f = schedule_factor(&T->o.sched, T->adam_t - 1);
    float muon_lr = (float)(T->o.muon_lr * f), adamw_lr = (float)(T->o.adamw_lr * f);
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        group_t *g = &T->g[gi];
        for (size_t i = 0; i < g->np; i++) {
            param_t *p = &g->p[i];
            if (!p->used) /* no gradient: torch's optimizers skip the param */
                continue;
            if (T->o.optim == OPTIM_MUON_GATHER && p->muon)
                muon_gather_param(T, g, p, muon_lr);
            else if (T->o.optim == OPTIM_MUON_DIST && p->muon)
                continue; /* below, all matrices together */
            else
                ft_adamw_update(p->lrows * p->cols, g->shard + p->o, g->gshard + p->o, p->m, p->v,
                                T->adam_t, adamw_lr, (float)T->o.adamw_eps, (float)T->o.wd);
        }
    }
    if (T->o.optim == OPTIM_MUON_DIST)
        muon_dist_step(T, muon_lr);
}

/*
 * torch.nn.utils.clip_grad_norm_ on FSDP2's sharded gradients: each param's norm is a
 * partial over the shard group (one all-reduce of the vector of local squared norms), the
 * total norm is the 2-norm of the per-param norms, and coef = max / (total + 1e-6) scales
 * every gradient when below 1. Returns the total norm.
 */
static float clip_grads(trainer_t *T)
{
    size_t np = 0, i = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t k = 0; k < T->g[gi].np; k++)
            np += T->g[gi].p[k].used ? 1 : 0;
    float *sq = xcalloc(np, sizeof(float));
    for (size_t gi = 0; gi < T->ngroups; gi++) {
        const group_t *g = &T->g[gi];
        for (size_t k = 0; k < g->np; k++) {
            const param_t *p = &g->p[k];
            if (!p->used)
                continue;
            const float *x = g->gshard + p->o;
            double s = 0.0;
            for (size_t e = 0; e < p->lrows * p->cols; e++)
                s += (double)x[e] * (double)x[e];
            sq[i++] = (float)s;
        }
    }
    double t0 = now();
    if (ft_comm_allreduce(T->comm, FT_SHARD, sq, np, FT_OP_SUM) != 0)
        fatal_comm(T);
    T->t[T_COMM] += now() - t0;
    double total_sq = 0.0;
    for (i = 0; i < np; i++)
        total_sq += (double)sq[i];
    free(sq);
    float total = (float)sqrt(total_sq);
    float coef = (float)T->o.clip / (total + 1e-6f);
    if (coef < 1.0f)
        for (size_t gi = 0; gi < T->ngroups; gi++) {
            group_t *g = &T->g[gi];
            for (size_t k = 0; k < g->np; k++) {
                const param_t *p = &g->p[k];
                if (!p->used)
                    continue;
                float *x = g->gshard + p->o;
                for (size_t e = 0; e < p->lrows * p->cols; e++)
                    x[e] *= coef;
            }
        }
    return total;
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

/* muon-dist: the Muon matrices with a gradient in FSDP parameter order, the shared scratch
 * (momentum update, Newton-Schulz output and workspace) and one gathered buffer (n * s
 * floats, the largest s: the matrix this rank owns in the current chunk). */
static void alloc_muon_dist(trainer_t *T)
{
    size_t max_s = 0, max_numel = 0, max_ws = 0, nmd = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t i = 0; i < T->g[gi].np; i++)
            nmd += T->g[gi].p[i].muon && T->g[gi].p[i].used;
    T->md_p = xcalloc(nmd ? nmd : 1, sizeof(param_t *));
    T->md_g = xcalloc(nmd ? nmd : 1, sizeof(group_t *));
    for (size_t gi = 0; gi < T->ngroups; gi++)
        for (size_t i = 0; i < T->g[gi].np; i++) {
            param_t *p = &T->g[gi].p[i];
            if (!p->muon || !p->used)
                continue;
            T->md_g[T->nmd] = &T->g[gi];
            T->md_p[T->nmd++] = p;
            max_s = p->s > max_s ? p->s : max_s;
            max_numel = p->rows * p->cols > max_numel ? p->rows * p->cols : max_numel;
            size_t ws = ft_ns_workspace(p->rows, p->cols);
            max_ws = ws > max_ws ? ws : max_ws;
        }
    T->mu_u = xcalloc(max_s ? max_s : 1, sizeof(float));
    T->mu_out = xcalloc(max_numel ? max_numel : 1, sizeof(float));
    T->mu_ws = xcalloc(max_ws ? max_ws : 1, sizeof(float));
    T->md_full = xcalloc((size_t)T->n * (max_s ? max_s : 1), sizeof(float));
}

/* ---- reduction ------------------------------------------------------------------------- */

/*
 * FSDP2's _get_gradient_divide_factors for a float32 reduce dtype and dp data-parallel
 * ranks (shard x replicate), with the fp16 rule applied in fp32 arithmetic for --divide
 * fp16 (the wire dtype stays float32).
 */
static void choose_reduction(trainer_t *T)
{
    double factor = T->o.divide_factor > 0.0 ? T->o.divide_factor : (double)T->dp;
    T->pre = 1.0;
    T->post = 1.0;
    T->premul = 0.0f;
    if (T->o.divide == DIVIDE_DEFAULT) {
        if (factor == (double)T->dp) {
            T->rs_op = T->ar_op = T->dp == 1 ? FT_OP_SUM : FT_OP_AVG;
        } else {
            T->rs_op = FT_OP_PREMUL_SUM;
            T->premul = (float)(1.0 / factor);
            T->ar_op = FT_OP_SUM;
        }
        return;
    }
    T->rs_op = T->ar_op = FT_OP_SUM;
    if (T->o.divide == DIVIDE_FP16) {
        double pre = 1.0;
        while (fmod(factor, pre) == 0.0 && factor / pre > pre)
            pre *= 2.0;
        T->pre = pre;
        T->post = factor / pre;
    } else {
        T->post = factor;
    }
}

/* ---- manifest and weights ---------------------------------------------------------------- */

static const char *optim_name(optim_t o)
{
    return o == OPTIM_ADAMW         ? "adamw"
           : o == OPTIM_MUON_GATHER ? "muon-gather"
           : o == OPTIM_MUON_DIST   ? "muon-dist"
                                    : "none";
}

/* A training pass: forward and backward of one micro-batch. */
static float train_pass(trainer_t *T, int last)
{
    double t0 = now(), c0 = T->t[T_COMM];
    float loss = forward(T, FWD_TRAIN);
    double t1 = now(), c1 = T->t[T_COMM];
    T->t[T_FWD] += (t1 - t0) - (c1 - c0);
    backward(T, last);
    T->t[T_BWD] += (now() - t1) - (T->t[T_COMM] - c1);
    return loss;
}

/* The passes of one cycle of the schedule in the dry run: eval_every optimizer steps (one
 * without evaluation), K micro-batches each, then the eval pass. */
static void dry_cycle(trainer_t *T)
{
    int steps = T->o.eval_every > 0 ? T->o.eval_every : 1;
    for (int t = 0; t < steps; t++) {
        for (int k = 0; k < T->o.accum; k++)
            train_pass(T, k == T->o.accum - 1);
        if (T->o.eval_every > 0 && t == steps - 1)
            forward(T, FWD_EVAL);
    }
}

static int same_calls(const call_t *a, const call_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i].rs != b[i].rs || a[i].group != b[i].group || a[i].optional != b[i].optional)
            return 0;
    return 1;
}

/* Whether calls[0, n) is calls[0, p) repeated. */
static int repeats(const call_t *calls, size_t n, size_t p)
{
    if (n % p != 0)
        return 0;
    for (size_t i = p; i < n; i++)
        if (!same_calls(&calls[i], &calls[i % p], 1))
            return 0;
    return 1;
}

/*
 * The manifest's sequence: the calls the training loop issues, recorded by running the
 * same forward/backward code without computing. Two cycles from a cold start; a call of the
 * first cycle that the second lacks (the root's first all-gather, once a no-grad forward
 * left the root unsharded) becomes "optional"; a cycle that repeats a shorter one is cut.
 */
static call_t *build_sequence(trainer_t *T, size_t *len)
{
    T->dry = 1;
    T->nrec = 0;
    dry_cycle(T);
    size_t na = T->nrec;
    dry_cycle(T);
    size_t nb = T->nrec - na;
    T->dry = 0;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        group_reshard(&T->g[gi]);
    memset(T->t, 0, sizeof(T->t));
    call_t *seq = xcalloc(na, sizeof(call_t));
    memcpy(seq, T->rec, na * sizeof(call_t));
    const call_t *b = T->rec + na;
    if (!(na == nb && same_calls(seq, b, na))) {
        if (na == nb + 1 && !seq[0].rs && same_calls(seq + 1, b, nb)) {
            seq[0].optional = 1;
        } else {
            fprintf(stderr,
                    "fsdp_train: internal error: the call cycle does not repeat (%zu "
                    "then %zu calls)\n",
                    na, nb);
            exit(1);
        }
    }
    size_t p = 1;
    while (p < na && !repeats(seq, na, p))
        p++;
    *len = na ? p : 0;
    return seq;
}

/* training.grad_divide: how the reduced gradient relates to the op on the wire. */
static void write_grad_divide(const trainer_t *T, FILE *f)
{
    if (T->o.divide == DIVIDE_FP16) {
        fprintf(f, "%.17g", T->post); /* SUM of pre-divided grads, then / post (= F / pre) */
    } else if (T->o.divide == DIVIDE_FORCE_SUM) {
        if (T->post == (double)T->dp)
            fprintf(f, "\"force_sum\"");
        else
            fprintf(f, "%.17g", T->post); /* a custom divide factor */
    } else if (strcmp(ft_comm_flavour(), "nccl") == 0) {
        fprintf(f, "\"fsdp2\""); /* avg (sum at one rank) or PreMulSum, applied as they are */
    } else if (T->rs_op == FT_OP_PREMUL_SUM) {
        fprintf(f, "1"); /* the MPI flavour scaled its contributions by 1/F before MPI_SUM */
    } else {
        fprintf(f, "\"world\""); /* MPI_SUM, then the job divides by the communicator size */
    }
}

/* mfsdp-manifest/1 (docs/manifest.md), written by hand: the job links nothing of mfsdp. */
static int write_manifest(trainer_t *T, const char *path)
{
    size_t nseq;
    call_t *seq = build_sequence(T, &nseq);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", path, strerror(errno));
        free(seq);
        return -1;
    }
    fprintf(f, "{\n  \"format\": \"mfsdp-manifest/1\",\n  \"world_size\": %d,\n", T->n);
    fprintf(f, "  \"replicate\": %d,\n", T->mesh ? T->world / T->n : 1);
    fprintf(f,
            "  \"optimizer\": {\"lr\": %.15g, \"momentum\": %.7g, \"nesterov\": true, "
            "\"ns_steps\": %d, \"weight_decay\": %.15g, \"scale\": \"keller\",\n"
            "    \"adamw\": {\"lr\": %.15g, \"betas\": [%.7g, %.7g], \"eps\": %.15g, "
            "\"weight_decay\": %.15g}",
            T->o.muon_lr, (double)FT_MUON_MOMENTUM, FT_MUON_NS_STEPS, T->o.wd, T->o.adamw_lr,
            (double)FT_ADAM_BETA1, (double)FT_ADAM_BETA2, T->o.adamw_eps, T->o.wd);
    const schedule_t *sc = &T->o.sched;
    if (sc->kind != SCHED_CONSTANT) {
        fprintf(f, ",\n    \"schedule\": {\"kind\": \"%s\", \"warmup_steps\": %d",
                sched_names[sc->kind], sc->warmup);
        if (sc->kind == SCHED_WSD)
            fprintf(f, ", \"stable_steps\": %d", sc->stable);
        fprintf(f, ", \"decay_steps\": %d", sc->decay_steps);
        if (sc->kind == SCHED_WSD)
            fprintf(f, ", \"decay\": \"%s\"", decay_names[sc->decay]);
        fprintf(f, ", \"min_lr_ratio\": %.17g}", sc->min_ratio);
    }
    if (T->o.clip > 0.0)
        fprintf(f, ",\n    \"max_norm\": %.17g", T->o.clip);
    fprintf(f, "},\n  \"training\": {\"micro_steps\": %d, \"grad_divide\": ",
            T->o.accum_sync ? T->o.accum : 1);
    write_grad_divide(T, f);
    if (T->o.clip > 0.0)
        fprintf(f, ", \"step\": \"lazy\"");
    fprintf(f, "},\n  \"groups\": [\n");
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
    fprintf(f, "  ],\n  \"sequence\": [");
    for (size_t i = 0; i < nseq; i++)
        fprintf(f, "%s\n    [\"%s\", \"%s\"%s]", i ? "," : "",
                seq[i].rs ? "reduce_scatter" : "allgather", T->g[seq[i].group].name,
                seq[i].optional ? ", \"optional\"" : "");
    fprintf(f, "\n  ]\n}\n");
    free(seq);
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
            ft_comm_flavour(), T->o.reference ? T->o.emulate : T->world, optim_name(T->o.optim),
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

/* One optimizer step: K micro-batches, clipping, the loss all-reduce, the optimizer.
 * Micro-batch k of rank r trains on data source k * dp + r of the step: distinct per (step,
 * micro-batch, rank), and K micro-batches at n ranks see the data of n * K ranks. */
static float train_step(trainer_t *T, int step, float *grad_norm)
{
    int micro = T->o.reference ? T->o.emulate : 1, K = T->o.accum;
    float loss_sum = 0.0f;
    for (size_t gi = 0; gi < T->ngroups; gi++)
        T->g[gi].has_grad = 0;
    for (int k = 0; k < K; k++)
        for (int m = 0; m < micro; m++) {
            make_batch(T, (uint64_t)step,
                       (uint64_t)k * (uint64_t)T->dp + (uint64_t)(T->o.reference ? m : T->wrank));
            loss_sum += train_pass(T, k == K - 1);
        }
    if (T->o.reference)
        reference_finalize(T);
    *grad_norm = T->o.clip > 0.0 ? clip_grads(T) : 0.0f;
    /* loss.item() logging: the only other non-FSDP collective of a step */
    double t0 = now();
    if (ft_comm_allreduce(T->comm, FT_WORLD, &loss_sum, 1, FT_OP_SUM) != 0)
        fatal_comm(T);
    T->t[T_COMM] += now() - t0;
    double t1 = now();
    optimizer_step(T);
    T->t[T_OPTIM] += now() - t1;
    return loss_sum / (float)((T->o.reference ? micro : T->world) * K);
}

/* A no-grad forward on the eval batch of step (source: the rank, or each emulated rank). */
static float eval_pass(trainer_t *T, int step)
{
    int micro = T->o.reference ? T->o.emulate : 1;
    float sum = 0.0f;
    for (int m = 0; m < micro; m++) {
        make_batch(T, EVAL_STEP + 1 + (uint64_t)step, (uint64_t)(T->o.reference ? m : T->wrank));
        sum += forward(T, FWD_EVAL);
    }
    if (ft_comm_allreduce(T->comm, FT_WORLD, &sum, 1, FT_OP_SUM) != 0)
        fatal_comm(T);
    return sum / (float)(T->o.reference ? micro : T->world);
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
    double *all = xcalloc((size_t)NV * (size_t)T->world, sizeof(double));
    if (ft_comm_gather_report(T->comm, mine, NV, all) != 0)
        fatal_comm(T);
    if (T->wrank == 0) {
        printf("final eval_loss %.7f last_train_loss %.7f steps %d wall_s %.3f\n",
               (double)eval_loss, (double)last_loss, steps, wall);
        printf("timing_ms_per_step (mean over steps %d..%d, max over ranks):", from,
               steps > 0 ? steps - 1 : 0);
        for (int i = 0; i < T_COUNT; i++) {
            double mx = 0.0;
            for (int r = 0; r < T->world; r++)
                mx = all[(size_t)r * NV + (size_t)i] > mx ? all[(size_t)r * NV + (size_t)i] : mx;
            printf(" %s %.2f", timer_names[i], mx);
        }
        printf("\npeak_rss_mib:");
        for (int r = 0; r < T->world; r++)
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
        free(g->acc);
    }
    free(T->g);
    free(T->bwd);
    free(T->rec);
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
    free(T->md_full);
    free(T->md_p);
    free(T->md_g);
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
    const char *reduce = T->rs_op == FT_OP_PREMUL_SUM    ? "premul_sum"
                         : T->o.divide == DIVIDE_DEFAULT ? "avg"
                                                         : "sum";
    printf("fsdp_train: flavour %s world %d%s optim %s model %s dims %d,%d,%d,%d,%d batch %d "
           "tokens %d params %zu muon_matrices %zu (%zu elements, %.2f GFLOP Newton-Schulz "
           "per step) steps %d seed %" PRIu64 " muon_lr %g adamw_lr %g adamw_eps %g wd %g "
           "prefetch %d reduce %s\n",
           ft_comm_flavour(), T->o.reference ? T->o.emulate : T->world,
           T->o.reference ? " (reference, emulated)" : "", optim_name(T->o.optim), T->o.model,
           d->vocab, d->dim, d->hidden, d->out, d->blocks, d->batch, d->tokens, total, matrices,
           muon, ns * 1e-9, T->o.steps, T->o.seed, T->o.muon_lr, T->o.adamw_lr, T->o.adamw_eps,
           T->o.wd, T->o.prefetch, reduce);
    const options_t *o = &T->o;
    if (o->wrap != WRAP_DEFAULT || o->unused != UNUSED_NONE || o->accum > 1 || o->eval_every > 0 ||
        o->hsdp > 0 || o->divide != DIVIDE_DEFAULT || o->sched.kind != SCHED_CONSTANT ||
        o->clip > 0.0)
        printf("fsdp_train: modes wrap %s unused %s accum %d %s eval_every %d hsdp %d "
               "(shard %d) divide pre %g post %g schedule %s clip %g\n",
               o->wrap == WRAP_TORCHTITAN ? "torchtitan" : "default",
               o->unused == UNUSED_COLLIDE  ? "collide"
               : o->unused == UNUSED_UNIQUE ? "unique"
                                            : "none",
               o->accum, o->accum_sync ? "sync" : "nosync", o->eval_every, o->hsdp, T->n, T->pre,
               T->post, sched_names[o->sched.kind], o->clip);
}

int main(int argc, char **argv)
{
    trainer_t T;
    memset(&T, 0, sizeof(T));
    if (parse_options(argc, argv, &T.o) != 0)
        return 2;
    if (ft_comm_init(&argc, &argv, T.o.reference, &T.comm) != 0)
        return 1;
    T.wrank = ft_comm_rank(T.comm, FT_WORLD);
    T.world = ft_comm_size(T.comm, FT_WORLD);
    if (T.o.hsdp > 0 && !T.o.reference) {
        if (T.world % T.o.hsdp != 0) {
            if (T.wrank == 0)
                fprintf(stderr,
                        "fsdp_train: --hsdp %d needs a world size divisible by %d, got %d\n",
                        T.o.hsdp, T.o.hsdp, T.world);
            ft_comm_finalize(T.comm);
            return 2;
        }
        if (ft_comm_mesh(T.comm, T.o.hsdp) != 0)
            fatal_comm(&T);
        T.mesh = 1;
    }
    T.rank = ft_comm_rank(T.comm, FT_SHARD);
    T.n = ft_comm_size(T.comm, FT_SHARD);
    T.d = T.o.dims;
    T.dp = T.o.reference ? T.o.emulate : T.world;
    choose_reduction(&T);
    T.teacher = ft_teacher_create(&T.d, T.o.seed);
    if (T.teacher == NULL) {
        fprintf(stderr, "fsdp_train: out of memory\n");
        ft_comm_abort(T.comm, 1);
    }
    build_groups(&T);
    if (T.o.unused != UNUSED_NONE && !T.o.reference && check_unused_counts(&T) != 0) {
        trainer_destroy(&T);
        ft_comm_finalize(T.comm);
        return 2;
    }
    alloc_activations(&T);
    if (T.o.optim == OPTIM_MUON_GATHER)
        alloc_muon_scratch(&T);
    else if (T.o.optim == OPTIM_MUON_DIST)
        alloc_muon_dist(&T);
    if (T.wrank == 0) {
        print_header(&T);
        if (T.o.manifest_path != NULL && write_manifest(&T, T.o.manifest_path) != 0)
            ft_comm_abort(T.comm, 1);
    }
    fflush(stdout);

    double w0 = now();
    float loss = 0.0f;
    for (int step = T.o.start_step; step < T.o.steps; step++) {
        if (T.o.die_set && step == T.o.die_step && T.wrank == T.o.die_rank) {
            fflush(stdout);
            kill(getpid(), SIGKILL); /* a crash: no exit handler, no MPI_Finalize */
        }
        double t0 = now();
        float norm;
        loss = train_step(&T, step, &norm);
        T.t[T_STEP] += now() - t0;
        if (step == T.o.start_step)
            memcpy(T.t_first, T.t, sizeof(T.t));
        if (T.wrank == 0 && !T.o.quiet) {
            printf("step %5d loss %.7f time_ms %.2f", step, (double)loss, 1e3 * (now() - t0));
            if (T.o.clip > 0.0)
                printf(" grad_norm %.7f", (double)norm);
            if (T.o.sched.kind != SCHED_CONSTANT)
                printf(" lr_factor %.9g", schedule_factor(&T.o.sched, step));
            printf("\n");
            fflush(stdout);
        }
        if (T.o.eval_every > 0 && (step + 1) % T.o.eval_every == 0) {
            float e = eval_pass(&T, step);
            if (T.wrank == 0 && !T.o.quiet) {
                printf("eval %5d loss %.7f\n", step, (double)e);
                fflush(stdout);
            }
        }
    }
    double wall = now() - w0;

    /* Final all-gather of every group (forward order; a root left unsharded by an eval pass
     * is gathered again), then evaluation on held-out batches and the weight dump on rank 0. */
    for (size_t gi = 0; gi < T.ngroups; gi++)
        group_reshard(&T.g[gi]);
    for (size_t gi = 0; gi < T.ngroups; gi++)
        group_unshard(&T, &T.g[gi]);
    float eval = 0.0f;
    if (T.wrank == 0) {
        for (int e = 0; e < EVAL_BATCHES; e++) {
            make_batch(&T, EVAL_STEP, (uint64_t)e);
            eval += forward(&T, FWD_LOCAL);
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
