/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mfsdp-sim: the scale simulator (docs/PERFORMANCE.md). It runs the real owner planner
 * (mfsdp_plan_create) on a manifest at 8...1024 ranks and projects, per configuration, the
 * optimizer step of four systems that train the same Muon + AdamW model:
 *
 *   mfsdp   owner plan from the planner; ZeRO-3 memory (owner arenas + FSDP staging);
 *           Newton-Schulz on owners, no collective in the step;
 *   fsdp2   FSDP2-Muon as done today: every Muon matrix's update all-gathered on every rank
 *           (one ring all-gather per matrix), Newton-Schulz run redundantly on every rank;
 *   dmuon   DMuon/Dion-style distributed Muon: matrices in manifest order go round-robin to
 *           owners in chunks of n; per chunk an all-to-all gathers each matrix to its owner,
 *           the owners run Newton-Schulz, an all-to-all scatters the updates back;
 *   zero1   ZeRO-1 owner placement: the same owners as mfsdp, but full parameters and
 *           gradients resident on every rank; after the step the owners' updated weights
 *           are broadcast to every rank.
 *
 * The model (every formula and constant) is written out in docs/PERFORMANCE.md; the code
 * below follows it term by term, and the comments name the terms. Constants come from
 * public hardware specifications and are never fitted to a measurement or to the paper.
 *
 * Exit status: 0 success, 1 bad input (manifest, plan), 2 usage error. Every failure prints
 * one line on stderr, "mfsdp-sim: <message>" (library warnings are folded into it).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <jansson.h>

#include "mfsdp/kernels.h"
#include "mfsdp/manifest.h"
#include "mfsdp/plan.h"

#define PROG          "mfsdp-sim"
#define EXIT_INPUT    1
#define EXIT_USAGE    2
#define GB            1e9 /* memory and bandwidth are in decimal GB, as the datasheets */
#define MAX_WORLD     65536
#define MAX_RANK_LIST 64
#define MAX_MANIFESTS 16

#ifndef MFSDP_MODELS_DIR
#define MFSDP_MODELS_DIR "examples/models"
#endif

/* The paper's headline figures (arXiv 2607.05895, 64x A100; docs/PERFORMANCE.md, "Comparison with
 * the paper"). Printed next to the projection by --paper; they never enter the model. */
#define PAPER_OPT_X_1NODE  4.2
#define PAPER_OPT_X_8NODES 54.6
#define PAPER_E2E_X_MAX    2.15

/* ---- constants ------------------------------------------------------------------------- */

/* One GPU type. Sources (docs/PERFORMANCE.md "Constants"): NVIDIA A100/H100/H200 SXM
 * datasheets (dense bf16 peak, memory, NVLink), DGX A100/H100 datasheets (one 200 / 400 Gb/s
 * InfiniBand adapter per GPU), the "maximum achievable matmul FLOPS" table of Stas Bekman's
 * ml-engineering book (bf16 matmul efficiency: A100 SXM 267.9/312, H100 SXM 792.1/989;
 * H200 has the H100's GH100 die and clocks), NCCL's ring/Simple latency model
 * (src/graph/tuning.cc hwLat: 3.4 us per NVLink step, 14 us per network step). */
typedef struct gpu_consts {
    char name[16];
    double tflops;      /* dense bf16 peak, TFLOP/s */
    double ns_eff;      /* fraction of the peak that Newton-Schulz's GEMMs reach */
    double mem_gb;      /* memory per GPU, GB */
    double nvlink_gbs;  /* NVLink per GPU and direction, GB/s */
    double ib_gbs;      /* inter-node network per GPU and direction, GB/s */
    double alpha_us;    /* latency of one collective step inside a node, us */
    double alpha_ib_us; /* latency of one collective step that crosses nodes, us */
    int gpus_per_node;
} gpu_consts_t;

static const gpu_consts_t presets[] = {
    {"a100", 312.0, 0.859, 80.0, 300.0, 25.0, 3.4, 14.0, 8},
    {"h100", 989.0, 0.801, 80.0, 450.0, 50.0, 3.4, 14.0, 8},
    {"h200", 989.0, 0.801, 141.0, 450.0, 50.0, 3.4, 14.0, 8},
};
#define NPRESETS (sizeof(presets) / sizeof(presets[0]))

/* Defaults of the end-to-end projection: MFU of the Llama 3 paper (38-43% bf16 MFU on
 * H100, arXiv 2407.21783 table 4), one Llama 3 pre-training sequence per rank. */
#define DEFAULT_MFU    0.40
#define DEFAULT_TOKENS 8192

typedef struct sim_opts {
    gpu_consts_t gpu;
    double mfu;
    double tokens;     /* per rank per training step */
    double gather_elt; /* bytes per element that fsdp2/dmuon move in the step */
    mfsdp_tail_policy_t tail;
    int ranks[MAX_RANK_LIST];
    int nranks;
    const char *manifests[MAX_MANIFESTS];
    int nmanifests;
    int json;
    int paper;
} sim_opts_t;

/* ---- results --------------------------------------------------------------------------- */

/* Manifest-level totals (independent of n). */
typedef struct model_summary {
    double params; /* every tensor */
    double muon_params;
    size_t nmuon;
    size_t nadamw;
    size_t nfrozen;       /* requires_grad false: counted as trained, as the planner does */
    double ns_total;      /* sum of the Newton-Schulz FLOPs of every Muon matrix */
    double fwd_bwd_flops; /* 6 * params * tokens */
} model_summary_t;

/* One configuration (one rank count). Bytes, FLOPs and seconds. */
typedef struct sim_row {
    int n;
    int nodes;
    int inter; /* 1 when the ranks span nodes (the network is the slowest link) */
    double f_fsdp2, f_dmuon_max, f_mfsdp_max, f_mfsdp_lb;
    double owned_max, owned_lb;
    double staging, shard_state;
    double mem_mfsdp, mem_fsdp2, mem_dmuon, mem_zero1;
    double t_mfsdp;
    double t_fsdp2_ns, t_fsdp2_comm;
    double t_dmuon_ns, t_dmuon_comm;
    double t_zero1_ns, t_zero1_comm;
    double t_fb;
} sim_row_t;

static double row_t_fsdp2(const sim_row_t *r)
{
    return r->t_fsdp2_ns + r->t_fsdp2_comm;
}

static double row_t_dmuon(const sim_row_t *r)
{
    return r->t_dmuon_ns + r->t_dmuon_comm;
}

static double row_t_zero1(const sim_row_t *r)
{
    return r->t_zero1_ns + r->t_zero1_comm;
}

static int row_zero1_over(const sim_row_t *r, const sim_opts_t *o)
{
    return r->mem_zero1 > o->gpu.mem_gb * GB;
}

static int row_mfsdp_fits(const sim_row_t *r, const sim_opts_t *o)
{
    return r->mem_mfsdp <= o->gpu.mem_gb * GB;
}

static double ratio(double num, double den)
{
    return den > 0.0 ? num / den : 0.0;
}

static double dmax(double a, double b)
{
    return a > b ? a : b;
}

/* ---- stderr capture: folds library warnings into the tool's one error line ------------ */

typedef struct capture {
    int active;
    int saved_fd;
    FILE *tmp;
} capture_t;

static void capture_begin(capture_t *c)
{
    memset(c, 0, sizeof(*c));
    const char *lvl = getenv("MFSDP_DEBUG");
    const char *file = getenv("MFSDP_DEBUG_FILE");
    if ((file != NULL && *file != '\0') ||
        (lvl != NULL && *lvl != '\0' && strcasecmp(lvl, "WARN") != 0)) {
        return; /* the user wants the log elsewhere or at another level: leave it alone */
    }
    fflush(stderr);
    c->tmp = tmpfile();
    c->saved_fd = c->tmp != NULL ? dup(STDERR_FILENO) : -1;
    if (c->saved_fd < 0 || dup2(fileno(c->tmp), STDERR_FILENO) < 0) {
        if (c->saved_fd >= 0) {
            close(c->saved_fd);
        }
        if (c->tmp != NULL) {
            fclose(c->tmp);
        }
        memset(c, 0, sizeof(*c));
        return;
    }
    c->active = 1;
}

/* Restore stderr. With keep the captured text goes to stderr; otherwise the first warning's
 * message (without the "host:pid:tid mfsdp WARN file:line " prefix) lands in msg. */
static void capture_end(capture_t *c, int keep, char *msg, size_t msglen)
{
    msg[0] = '\0';
    if (!c->active) {
        return;
    }
    fflush(stderr);
    dup2(c->saved_fd, STDERR_FILENO);
    close(c->saved_fd);
    rewind(c->tmp);
    char line[4096];
    while (fgets(line, sizeof(line), c->tmp) != NULL) {
        if (keep) {
            fputs(line, stderr);
            continue;
        }
        char *w = strstr(line, " mfsdp WARN ");
        if (w == NULL || msg[0] != '\0') {
            continue;
        }
        w += strlen(" mfsdp WARN ");
        char *sp = strchr(w, ' ');
        w = sp != NULL ? sp + 1 : w;
        w[strcspn(w, "\n")] = '\0';
        snprintf(msg, msglen, "%s", w);
    }
    fclose(c->tmp);
    c->active = 0;
}

/* ---- the model ------------------------------------------------------------------------- */

/* Link parameters of a ring over n ranks on nodes of g GPUs: the slowest link's bandwidth
 * (NVLink inside one node, the network once n > g) and the latency of its n - 1 steps, of
 * which nodes - 1 cross nodes (NCCL's ring latency model). */
static double ring_latency(const gpu_consts_t *c, int n, int nodes)
{
    if (n <= 1) {
        return 0.0;
    }
    return ((double)(n - nodes) * c->alpha_us + (double)(nodes - 1) * c->alpha_ib_us) * 1e-6;
}

static double ring_beta(const gpu_consts_t *c, int n)
{
    return (n <= c->gpus_per_node ? c->nvlink_gbs : c->ib_gbs) * GB;
}

/* Ring all-gather (or reduce-scatter) of a buffer of n pieces of piece bytes:
 * (n-1) alpha + (n-1)/n * T / beta with T = n * piece. */
static double ring_allgather_s(const gpu_consts_t *c, int n, int nodes, double piece)
{
    if (n <= 1) {
        return 0.0;
    }
    return ring_latency(c, n, nodes) + (double)(n - 1) * piece / ring_beta(c, n);
}

/* Everything the simulator needs about one tensor at one world size. */
typedef struct tensor_info {
    int muon;
    size_t group;
    int owner; /* plan owner, or MFSDP_OWNER_SHARDED */
    double numel;
    double elt;      /* param (communication) dtype bytes */
    double gelt;     /* gradient dtype bytes: the group's reduce dtype, else elt */
    double shard;    /* FSDP shard elements per rank (padded): fsdp_s */
    double flops;    /* Newton-Schulz FLOPs per step (plan) */
    double ws_owner; /* fp32 bytes of one owner-side Muon update: U + NS workspace */
    double ws_ns;    /* fp32 bytes of the Newton-Schulz workspace alone */
} tensor_info_t;

static mfsdp_status_t describe_tensors(const mfsdp_plan_t *p, tensor_info_t *t, char *err,
                                       size_t errlen)
{
    const mfsdp_manifest_t *m = p->manifest;
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_shard_t *sh = &p->shards[k];
        const mfsdp_group_desc_t *g = &m->groups[sh->group];
        const mfsdp_param_desc_t *pd = &g->params[sh->param];
        tensor_info_t *ti = &t[k];
        memset(ti, 0, sizeof(*ti));
        ti->muon = sh->role == MFSDP_ROLE_MUON;
        ti->group = sh->group;
        ti->owner = sh->owner;
        ti->numel = (double)sh->numel;
        ti->elt = (double)mfsdp_dtype_size(pd->dtype);
        ti->gelt = g->has_reduce_dtype ? (double)mfsdp_dtype_size(g->reduce_dtype) : ti->elt;
        ti->shard = (double)sh->fsdp_s;
        ti->flops = sh->ns_flops;
        if (!ti->muon) {
            continue;
        }
        /* The CPU kernels' own sizes: U (rows x cols) + the Newton-Schulz workspace
         * 2 s^2 + rows cols of the whole matrix (which also covers any row split). */
        size_t ns = mfsdp_ns_workspace_elems(sh->rows, sh->cols);
        size_t mu = mfsdp_muon_workspace_elems(sh->rows, sh->cols);
        if (ns == 0 || mu == 0) {
            snprintf(err, errlen,
                     "%s: %lld x %lld is too large for the Newton-Schulz kernels' workspace",
                     pd->name != NULL ? pd->name : "?", (long long)sh->rows, (long long)sh->cols);
            return MFSDP_ERR_UNSUPPORTED;
        }
        ti->ws_ns = 4.0 * (double)ns;
        ti->ws_owner = 4.0 * (double)mu;
    }
    return MFSDP_OK;
}

static void summarize(const mfsdp_manifest_t *m, const mfsdp_plan_t *p, const sim_opts_t *o,
                      model_summary_t *s)
{
    memset(s, 0, sizeof(*s));
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_shard_t *sh = &p->shards[k];
        const mfsdp_param_desc_t *pd = &m->groups[sh->group].params[sh->param];
        s->params += (double)sh->numel;
        if (sh->role == MFSDP_ROLE_MUON) {
            s->nmuon++;
            s->muon_params += (double)sh->numel;
            s->ns_total += sh->ns_flops;
        } else {
            s->nadamw++;
        }
        s->nfrozen += pd->requires_grad == 0;
    }
    s->fwd_bwd_flops = 6.0 * s->params * o->tokens;
}

/* DMuon's step: chunks of n Muon matrices in manifest order, matrix i of a chunk owned by
 * rank i. Per chunk: all-to-all gather to the owners, Newton-Schulz on the owners (the
 * chunk waits for its slowest owner), all-to-all scatter back (the mirror image, same cost).
 * An all-to-all is n - 1 pairwise steps (alpha each: NVLink to the rank's own node, network
 * to the others); its bytes move concurrently over NVLink (same node) and the network
 * (other nodes), full duplex, so a rank takes the largest of its four byte/bandwidth terms.
 * Also fills f_rr[r], the Newton-Schulz FLOPs rank r runs in all, and big_rr[r], the largest
 * transient (gathered matrix + NS workspace) it holds. */
static mfsdp_status_t dmuon_model(const gpu_consts_t *c, int n, const tensor_info_t *t, size_t nt,
                                  double gather_elt, double *t_ns, double *t_comm, double *f_rr,
                                  double *big_rr)
{
    int g = c->gpus_per_node;
    int nnodes = (n + g - 1) / g;
    size_t nm = 0;
    for (size_t k = 0; k < nt; k++) {
        nm += t[k].muon;
    }
    const tensor_info_t **mu = calloc(nm + 1, sizeof(*mu));
    double *nodesum = calloc((size_t)nnodes, sizeof(*nodesum));
    if (mu == NULL || nodesum == NULL) {
        free(mu);
        free(nodesum);
        return MFSDP_ERR_NO_MEMORY;
    }
    nm = 0;
    for (size_t k = 0; k < nt; k++) {
        if (t[k].muon) {
            mu[nm++] = &t[k];
        }
    }
    const double bn = c->nvlink_gbs * GB, bi = c->ib_gbs * GB;
    const double R = c->tflops * 1e12 * c->ns_eff;
    *t_ns = 0.0;
    *t_comm = 0.0;
    for (int r = 0; r < n; r++) {
        f_rr[r] = 0.0;
        big_rr[r] = 0.0;
    }
    for (size_t c0 = 0; c0 < nm; c0 += (size_t)n) {
        size_t cnt = nm - c0 < (size_t)n ? nm - c0 : (size_t)n;
        double total = 0.0, nsmax = 0.0, a2a = 0.0;
        memset(nodesum, 0, (size_t)nnodes * sizeof(*nodesum));
        for (size_t i = 0; i < cnt; i++) {
            const tensor_info_t *x = mu[c0 + i];
            double piece = x->shard * gather_elt;
            total += piece;
            nodesum[i / (size_t)g] += piece;
            f_rr[i] += x->flops;
            big_rr[i] = dmax(big_rr[i], x->numel * gather_elt + x->ws_ns);
            nsmax = dmax(nsmax, x->flops);
        }
        if (n > 1) {
            for (int r = 0; r < n; r++) {
                int node = r / g;
                int nsize = n - node * g < g ? n - node * g : g;
                double own = (size_t)r < cnt ? mu[c0 + (size_t)r]->shard * gather_elt : 0.0;
                double recv_on = (double)(nsize - 1) * own;
                double recv_off = (double)(n - nsize) * own;
                double send_on = nodesum[node] - own;
                double send_off = total - nodesum[node];
                double bw =
                    dmax(dmax(recv_on / bn, send_on / bn), dmax(recv_off / bi, send_off / bi));
                double lat =
                    ((double)(nsize - 1) * c->alpha_us + (double)(n - nsize) * c->alpha_ib_us) *
                    1e-6;
                a2a = dmax(a2a, lat + bw);
            }
        }
        *t_comm += 2.0 * a2a;
        *t_ns += nsmax / R;
    }
    free(mu);
    free(nodesum);
    return MFSDP_OK;
}

/* One configuration: plan at n, then the four systems. */
static mfsdp_status_t simulate(const mfsdp_manifest_t *m, int n, const sim_opts_t *o,
                               sim_row_t *row, model_summary_t *sum, char *err, size_t errlen)
{
    const gpu_consts_t *c = &o->gpu;
    mfsdp_plan_opts_t popts = {.tail = o->tail};
    mfsdp_plan_t *p = NULL;
    tensor_info_t *t = NULL;
    double *f_rr = NULL, *big_rr = NULL, *w_own = NULL, *comm_own = NULL;
    double *group_u = NULL, *group_v = NULL;
    mfsdp_status_t st = mfsdp_plan_create(m, n, &popts, &p);
    if (st != MFSDP_OK) {
        return st;
    }
    memset(row, 0, sizeof(*row));
    row->n = n;
    row->nodes = (n + c->gpus_per_node - 1) / c->gpus_per_node;
    row->inter = n > c->gpus_per_node;
    summarize(m, p, o, sum);

    t = calloc(p->nshards + 1, sizeof(*t));
    f_rr = calloc((size_t)n, sizeof(*f_rr));
    big_rr = calloc((size_t)n, sizeof(*big_rr));
    w_own = calloc((size_t)n, sizeof(*w_own));
    comm_own = calloc((size_t)n, sizeof(*comm_own));
    group_u = calloc(m->ngroups + 1, sizeof(*group_u));
    group_v = calloc(m->ngroups + 1, sizeof(*group_v));
    if (t == NULL || f_rr == NULL || big_rr == NULL || w_own == NULL || comm_own == NULL ||
        group_u == NULL || group_v == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    st = describe_tensors(p, t, err, errlen);
    if (st != MFSDP_OK) {
        goto out;
    }

    /* Newton-Schulz FLOPs per rank. */
    row->f_mfsdp_max = p->max_flops;
    row->f_mfsdp_lb = p->lb_flops;
    row->f_fsdp2 = sum->ns_total;
    row->owned_max = (double)p->max_owned_bytes;
    row->owned_lb = p->lb_bytes;

    /* Memory terms shared by the ZeRO-3 systems.
     * staging = 2 max_g U_g + max_g V_g: two groups' unsharded parameters in flight (the
     * current one and the prefetched next one), U_g = n sum s_k elt_k; one group's
     * unsharded gradients in the reduce dtype, V_g = n sum s_k gelt_k.
     * shard_state = sum_k s_k (4 + 4 + state_k): FSDP2's fp32 sharded parameter and
     * gradient, fp32 momentum (Muon, 4) or Adam m and v (8). */
    double param_bytes = 0.0, big_all = 0.0;
    for (size_t k = 0; k < p->nshards; k++) {
        const tensor_info_t *x = &t[k];
        group_u[x->group] += (double)n * x->shard * x->elt;
        group_v[x->group] += (double)n * x->shard * x->gelt;
        row->shard_state += x->shard * (8.0 + (x->muon ? 4.0 : 8.0));
        param_bytes += x->numel * x->elt;
        if (x->muon) {
            big_all = dmax(big_all, x->numel * o->gather_elt + x->ws_ns);
        }
        if (x->owner >= 0) {
            comm_own[x->owner] += x->numel * x->elt;
            if (x->muon) {
                w_own[x->owner] = dmax(w_own[x->owner], x->ws_owner);
            }
        } else {
            for (int r = 0; r < n; r++) {
                comm_own[r] += x->shard * x->elt; /* the sharded tail's comm copy */
            }
        }
    }
    double umax = 0.0, vmax = 0.0;
    for (size_t g = 0; g < m->ngroups; g++) {
        umax = dmax(umax, group_u[g]);
        vmax = dmax(vmax, group_v[g]);
    }
    row->staging = 2.0 * umax + vmax;

    /* Peak memory per rank (max over ranks).
     * mfsdp_r = arena_r + staging + W_r, W_r the largest owner-side Muon working set of r.
     * fsdp2   = shard_state + staging + max_k (numel_k * gather_elt + NS workspace_k).
     * dmuon_r = shard_state + staging + the same for the largest matrix r owns.
     * zero1_r = params + grads (both full, param dtype) + arena_r - comm copy_r + W_r. */
    row->mem_fsdp2 = row->shard_state + row->staging + big_all;
    st = dmuon_model(c, n, t, p->nshards, o->gather_elt, &row->t_dmuon_ns, &row->t_dmuon_comm, f_rr,
                     big_rr);
    if (st != MFSDP_OK) {
        goto out;
    }
    for (int r = 0; r < n; r++) {
        double arena = (double)p->ranks[r].arena_bytes;
        row->mem_mfsdp = dmax(row->mem_mfsdp, arena + row->staging + w_own[r]);
        row->mem_dmuon = dmax(row->mem_dmuon, row->shard_state + row->staging + big_rr[r]);
        row->mem_zero1 = dmax(row->mem_zero1, 2.0 * param_bytes + arena - comm_own[r] + w_own[r]);
        row->f_dmuon_max = dmax(row->f_dmuon_max, f_rr[r]);
    }

    /* Optimizer-step time. R = peak * ns_eff.
     * mfsdp: max_r F_r / R (no collective).
     * fsdp2: sum_k F_k / R + sum_k ring all-gather of the matrix (pieces s_k * gather_elt).
     * zero1: max_r F_r / R + per group a ring all-gather of the group's parameters (pieces
     *        S_g = sum s_k elt_k): the owners' broadcasts of updated weights, pipelined,
     *        move the group's bytes once through every rank. */
    const double R = c->tflops * 1e12 * c->ns_eff;
    row->t_mfsdp = p->max_flops / R;
    row->t_fsdp2_ns = sum->ns_total / R;
    row->t_zero1_ns = p->max_flops / R;
    for (size_t k = 0; k < p->nshards; k++) {
        if (t[k].muon) {
            row->t_fsdp2_comm += ring_allgather_s(c, n, row->nodes, t[k].shard * o->gather_elt);
        }
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        row->t_zero1_comm += ring_allgather_s(c, n, row->nodes, group_u[g] / (double)n);
    }
    /* Forward + backward: 6 * params * tokens at MFU of the dense bf16 peak. */
    row->t_fb = sum->fwd_bwd_flops / (o->mfu * c->tflops * 1e12);
out:
    free(t);
    free(f_rr);
    free(big_rr);
    free(w_own);
    free(comm_own);
    free(group_u);
    free(group_v);
    mfsdp_plan_destroy(p);
    return st;
}

/* ---- output ---------------------------------------------------------------------------- */

static const char *tail_name(mfsdp_tail_policy_t t)
{
    return t == MFSDP_TAIL_OWNER ? "owner" : t == MFSDP_TAIL_SHARD ? "shard" : "auto";
}

static void print_header(FILE *f, const sim_opts_t *o)
{
    const gpu_consts_t *c = &o->gpu;
    fprintf(f,
            "# gpu %s: %.1f TFLOP/s dense bf16 x NS efficiency %.3f, %.0f GB, NVLink %.0f GB/s,"
            " network %.1f GB/s per GPU, alpha %.2f us (NVLink step) / %.2f us (network step),"
            " %d GPUs per node\n",
            c->name, c->tflops, c->ns_eff, c->mem_gb, c->nvlink_gbs, c->ib_gbs, c->alpha_us,
            c->alpha_ib_us, c->gpus_per_node);
    fprintf(f,
            "# end to end: 6 x params x %.0f tokens per rank at MFU %.2f; fsdp2/dmuon move "
            "%s in the step; tail policy %s\n",
            o->tokens, o->mfu, o->gather_elt == 2.0 ? "bfloat16" : "float32", tail_name(o->tail));
}

static void print_model(FILE *f, const char *path, const model_summary_t *s)
{
    fprintf(f,
            "#\n# manifest %s: %.3f B params, %zu muon matrices (%.3f B params), %zu adamw "
            "tensors; Newton-Schulz %.1f TFLOP per step in all\n",
            path, s->params / 1e9, s->nmuon, s->muon_params / 1e9, s->nadamw, s->ns_total / 1e12);
    if (s->nfrozen != 0) {
        fprintf(f,
                "# note: %zu params have requires_grad false; like the planner, the model "
                "counts them as trained\n",
                s->nfrozen);
    }
}

static void print_table(FILE *f, const sim_opts_t *o, const sim_row_t *rows, int nrows)
{
    fprintf(f, "#\n# Newton-Schulz TFLOP per rank per step, mfsdp owned GB per rank\n");
    fprintf(f, "# %6s %5s %5s %10s %10s %10s %10s %7s %9s %9s %7s\n", "ranks", "nodes", "link",
            "fsdp2", "dmuon-max", "mfsdp-max", "mfsdp-LB", "max/LB", "owned-max", "owned-LB",
            "max/LB");
    for (int i = 0; i < nrows; i++) {
        const sim_row_t *r = &rows[i];
        fprintf(f, "  %6d %5d %5s %10.2f %10.2f %10.2f %10.2f %7.3f %9.3f %9.3f %7.3f\n", r->n,
                r->nodes, r->inter ? "net" : "nvl", r->f_fsdp2 / 1e12, r->f_dmuon_max / 1e12,
                r->f_mfsdp_max / 1e12, r->f_mfsdp_lb / 1e12, ratio(r->f_mfsdp_max, r->f_mfsdp_lb),
                r->owned_max / GB, r->owned_lb / GB, ratio(r->owned_max, r->owned_lb));
    }
    fprintf(f,
            "#\n# peak memory GB per rank (max over ranks; params + grads + optimizer state + "
            "staging, activations excluded), limit %.0f GB\n",
            o->gpu.mem_gb);
    fprintf(f, "# %6s %9s %9s %9s %9s %9s  %s\n", "ranks", "staging", "mfsdp", "fsdp2", "dmuon",
            "zero1", "flag");
    for (int i = 0; i < nrows; i++) {
        const sim_row_t *r = &rows[i];
        const char *flag = "";
        if (row_zero1_over(r, o) && row_mfsdp_fits(r, o)) {
            flag = "ZERO1-OOM mfsdp-fits";
        } else if (!row_mfsdp_fits(r, o)) {
            flag = "mfsdp-OOM";
        }
        fprintf(f, "  %6d %9.2f %9.2f %9.2f %9.2f %9.2f  %s\n", r->n, r->staging / GB,
                r->mem_mfsdp / GB, r->mem_fsdp2 / GB, r->mem_dmuon / GB, r->mem_zero1 / GB, flag);
    }
    fprintf(f, "#\n# optimizer step ms (NS + communication) and mfsdp speedup; end-to-end "
               "training step ms and speedup\n");
    fprintf(f, "# %6s %9s %9s %9s %9s %9s %9s %8s %8s %8s %9s %9s %9s %7s %7s\n", "ranks", "mfsdp",
            "fsdp2", "f2-comm", "dmuon", "dm-comm", "zero1", "x-fsdp2", "x-dmuon", "x-zero1",
            "e2e-mfsdp", "e2e-fsdp2", "e2e-dmuon", "e2e-xf2", "e2e-xdm");
    for (int i = 0; i < nrows; i++) {
        const sim_row_t *r = &rows[i];
        double tm = r->t_mfsdp, tf = row_t_fsdp2(r), td = row_t_dmuon(r), tz = row_t_zero1(r);
        fprintf(f,
                "  %6d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f %9.1f %9.1f %9.1f "
                "%7.3f %7.3f\n",
                r->n, tm * 1e3, tf * 1e3, r->t_fsdp2_comm * 1e3, td * 1e3, r->t_dmuon_comm * 1e3,
                tz * 1e3, ratio(tf, tm), ratio(td, tm), ratio(tz, tm), (r->t_fb + tm) * 1e3,
                (r->t_fb + tf) * 1e3, (r->t_fb + td) * 1e3, ratio(r->t_fb + tf, r->t_fb + tm),
                ratio(r->t_fb + td, r->t_fb + tm));
    }
}

static void print_paper(FILE *f, const sim_row_t *rows, int nrows)
{
    fprintf(f, "#\n# next to the paper (arXiv 2607.05895, 64x A100): optimizer-step speedup of "
               "mfsdp over FSDP2-Muon, and end to end\n");
    fprintf(f, "# %6s %5s %9s %9s %9s %11s %11s %9s %11s\n", "ranks", "nodes", "mfsdp-ms",
            "fsdp2-ms", "dmuon-ms", "model-x-f2", "paper-x-f2", "model-e2e", "paper-e2e");
    for (int i = 0; i < nrows; i++) {
        const sim_row_t *r = &rows[i];
        double tm = r->t_mfsdp, tf = row_t_fsdp2(r);
        double paper = r->n == 8 ? PAPER_OPT_X_1NODE : r->n == 64 ? PAPER_OPT_X_8NODES : 0.0;
        fprintf(f, "  %6d %5d %9.1f %9.1f %9.1f %11.2f %11.1f %9.3f %11s\n", r->n, r->nodes,
                tm * 1e3, tf * 1e3, row_t_dmuon(r) * 1e3, ratio(tf, tm), paper,
                ratio(r->t_fb + tf, r->t_fb + tm), "<=2.15");
    }
    fprintf(f,
            "# paper: %.1fx at 8 GPUs (one node), %.1fx at 64 GPUs (eight nodes), up to "
            "%.2fx end to end (configuration not stated in the paper's summary)\n",
            PAPER_OPT_X_1NODE, PAPER_OPT_X_8NODES, PAPER_E2E_X_MAX);
}

/* Sets key to value and reports failure (the value is always consumed). */
static int jset(json_t *obj, const char *key, json_t *value)
{
    return value == NULL || json_object_set_new(obj, key, value) != 0;
}

static json_t *gpu_json(const sim_opts_t *o)
{
    const gpu_consts_t *c = &o->gpu;
    json_t *g = json_object();
    int bad = g == NULL;
    if (!bad) {
        bad |= jset(g, "preset", json_string(c->name));
        bad |= jset(g, "tflops", json_real(c->tflops));
        bad |= jset(g, "ns_eff", json_real(c->ns_eff));
        bad |= jset(g, "mem_gb", json_real(c->mem_gb));
        bad |= jset(g, "nvlink_gbs", json_real(c->nvlink_gbs));
        bad |= jset(g, "ib_gbs", json_real(c->ib_gbs));
        bad |= jset(g, "alpha_us", json_real(c->alpha_us));
        bad |= jset(g, "alpha_ib_us", json_real(c->alpha_ib_us));
        bad |= jset(g, "gpus_per_node", json_integer(c->gpus_per_node));
    }
    if (bad) {
        json_decref(g);
        return NULL;
    }
    return g;
}

/* The paper's figures, as --paper prints them. */
static json_t *paper_json(void)
{
    json_t *x = json_object();
    json_t *opt = json_object();
    int bad = x == NULL || opt == NULL;
    if (bad) {
        json_decref(x);
        json_decref(opt);
        return NULL;
    }
    bad |= jset(x, "source", json_string("arXiv 2607.05895, 64x A100"));
    bad |= jset(x, "opt_speedup_vs_fsdp2", opt);
    bad |= jset(opt, "8", json_real(PAPER_OPT_X_1NODE));
    bad |= jset(opt, "64", json_real(PAPER_OPT_X_8NODES));
    bad |= jset(x, "e2e_speedup_max", json_real(PAPER_E2E_X_MAX));
    if (bad) {
        json_decref(x);
        return NULL;
    }
    return x;
}

static json_t *row_json(const sim_row_t *r, const sim_opts_t *o)
{
    json_t *x = json_object();
    json_t *fl = json_object(), *ob = json_object(), *mem = json_object();
    json_t *ts = json_object(), *sp = json_object(), *e2e = json_object(), *esp = json_object();
    int bad = x == NULL || fl == NULL || ob == NULL || mem == NULL || ts == NULL || sp == NULL ||
              e2e == NULL || esp == NULL;
    if (bad) {
        json_decref(x);
        json_decref(fl);
        json_decref(ob);
        json_decref(mem);
        json_decref(ts);
        json_decref(sp);
        json_decref(e2e);
        json_decref(esp);
        return NULL;
    }
    /* Children attach first (x owns them), then fill: a failure frees everything once. */
    bad |= jset(x, "ranks", json_integer(r->n));
    bad |= jset(x, "nodes", json_integer(r->nodes));
    bad |= jset(x, "link", json_string(r->inter ? "network" : "nvlink"));
    bad |= jset(x, "ns_flops", fl);
    bad |= jset(x, "owned_bytes", ob);
    bad |= jset(x, "memory_bytes", mem);
    bad |= jset(x, "opt_step_s", ts);
    bad |= jset(x, "speedup", sp);
    bad |= jset(x, "e2e_s", e2e);
    bad |= jset(x, "e2e_speedup", esp);
    if (bad) {
        json_decref(x);
        return NULL;
    }
    double tm = r->t_mfsdp, tf = row_t_fsdp2(r), td = row_t_dmuon(r), tz = row_t_zero1(r);
    bad |= jset(fl, "fsdp2", json_real(r->f_fsdp2));
    bad |= jset(fl, "dmuon_max", json_real(r->f_dmuon_max));
    bad |= jset(fl, "mfsdp_max", json_real(r->f_mfsdp_max));
    bad |= jset(fl, "mfsdp_lb", json_real(r->f_mfsdp_lb));
    bad |= jset(ob, "mfsdp_max", json_real(r->owned_max));
    bad |= jset(ob, "mfsdp_lb", json_real(r->owned_lb));
    bad |= jset(mem, "staging", json_real(r->staging));
    bad |= jset(mem, "shard_state", json_real(r->shard_state));
    bad |= jset(mem, "mfsdp", json_real(r->mem_mfsdp));
    bad |= jset(mem, "fsdp2", json_real(r->mem_fsdp2));
    bad |= jset(mem, "dmuon", json_real(r->mem_dmuon));
    bad |= jset(mem, "zero1", json_real(r->mem_zero1));
    bad |= jset(mem, "limit", json_real(o->gpu.mem_gb * GB));
    bad |= jset(x, "mfsdp_fits", json_boolean(row_mfsdp_fits(r, o)));
    bad |= jset(x, "zero1_exceeds", json_boolean(row_zero1_over(r, o)));
    bad |=
        jset(x, "zero1_oom_mfsdp_fits", json_boolean(row_zero1_over(r, o) && row_mfsdp_fits(r, o)));
    bad |= jset(ts, "mfsdp", json_real(tm));
    bad |= jset(ts, "fsdp2", json_real(tf));
    bad |= jset(ts, "fsdp2_ns", json_real(r->t_fsdp2_ns));
    bad |= jset(ts, "fsdp2_comm", json_real(r->t_fsdp2_comm));
    bad |= jset(ts, "dmuon", json_real(td));
    bad |= jset(ts, "dmuon_ns", json_real(r->t_dmuon_ns));
    bad |= jset(ts, "dmuon_comm", json_real(r->t_dmuon_comm));
    bad |= jset(ts, "zero1", json_real(tz));
    bad |= jset(ts, "zero1_ns", json_real(r->t_zero1_ns));
    bad |= jset(ts, "zero1_comm", json_real(r->t_zero1_comm));
    bad |= jset(sp, "vs_fsdp2", json_real(ratio(tf, tm)));
    bad |= jset(sp, "vs_dmuon", json_real(ratio(td, tm)));
    bad |= jset(sp, "vs_zero1", json_real(ratio(tz, tm)));
    bad |= jset(e2e, "fwd_bwd", json_real(r->t_fb));
    bad |= jset(e2e, "mfsdp", json_real(r->t_fb + tm));
    bad |= jset(e2e, "fsdp2", json_real(r->t_fb + tf));
    bad |= jset(e2e, "dmuon", json_real(r->t_fb + td));
    bad |= jset(e2e, "zero1", json_real(r->t_fb + tz));
    bad |= jset(esp, "vs_fsdp2", json_real(ratio(r->t_fb + tf, r->t_fb + tm)));
    bad |= jset(esp, "vs_dmuon", json_real(ratio(r->t_fb + td, r->t_fb + tm)));
    bad |= jset(esp, "vs_zero1", json_real(ratio(r->t_fb + tz, r->t_fb + tm)));
    if (bad) {
        json_decref(x);
        return NULL;
    }
    return x;
}

static json_t *run_json(const char *path, const model_summary_t *s, const sim_row_t *rows,
                        int nrows, const sim_opts_t *o)
{
    json_t *x = json_object();
    json_t *cfgs = json_array();
    int bad = x == NULL || cfgs == NULL;
    if (bad) {
        json_decref(x);
        json_decref(cfgs);
        return NULL;
    }
    bad |= jset(x, "manifest", json_string(path));
    bad |= jset(x, "configs", cfgs);
    bad |= jset(x, "params", json_real(s->params));
    bad |= jset(x, "muon_tensors", json_integer((json_int_t)s->nmuon));
    bad |= jset(x, "muon_params", json_real(s->muon_params));
    bad |= jset(x, "adamw_tensors", json_integer((json_int_t)s->nadamw));
    bad |= jset(x, "frozen_tensors", json_integer((json_int_t)s->nfrozen));
    bad |= jset(x, "ns_flops_total", json_real(s->ns_total));
    bad |= jset(x, "fwd_bwd_flops", json_real(s->fwd_bwd_flops));
    for (int i = 0; i < nrows && !bad; i++) {
        json_t *r = row_json(&rows[i], o);
        bad |= r == NULL || json_array_append_new(cfgs, r) != 0;
    }
    if (bad) {
        json_decref(x);
        return NULL;
    }
    return x;
}

/* ---- argument parsing ------------------------------------------------------------------ */

static const char usage_text[] =
    "usage: " PROG " [--manifest PATH]... [--ranks N,N,...] [--gpu a100|h100|h200] [--json]\n"
    "                 [--tflops X] [--ns-eff X] [--mem-gb X] [--nvlink-gbs X] [--ib-gbs X]\n"
    "                 [--alpha-us X] [--alpha-ib-us X] [--gpus-per-node N] [--mfu X]\n"
    "                 [--tokens N] [--gather-dtype float32|bfloat16] [--tail owner|shard|auto]\n"
    "       " PROG " --paper [--manifest PATH] [constant overrides]\n"
    "\n"
    "Run the owner planner on each manifest at each rank count and project, per rank, the\n"
    "Newton-Schulz FLOPs, owned bytes, peak memory and optimizer-step time of four systems:\n"
    "mfsdp (owner plan, ZeRO-3 memory), fsdp2 (FSDP2-Muon: gather every matrix, redundant\n"
    "Newton-Schulz), dmuon (round-robin owners, all-to-all gather and scatter) and zero1\n"
    "(ZeRO-1 owner placement: full params and grads on every rank), plus an end-to-end\n"
    "training-step projection. The model is documented in docs/PERFORMANCE.md.\n"
    "\n"
    "  -m, --manifest PATH    mfsdp-manifest/1 file; repeatable (default: the shipped\n"
    "                         gpt2-124m, llama3-8b and llama3-70b of " MFSDP_MODELS_DIR ")\n"
    "  -r, --ranks LIST       comma-separated world sizes, 1.."
    "65536 (default\n"
    "                         8,16,32,64,128,256,512,1024)\n"
    "  -g, --gpu PRESET       a100, h100 or h200 (default a100); the flags below override\n"
    "                         single constants of the preset\n"
    "      --tflops X         dense bf16 peak per GPU, TFLOP/s\n"
    "      --ns-eff X         fraction of the peak Newton-Schulz reaches, (0, 1]\n"
    "      --mem-gb X         memory per GPU, GB (1e9 bytes)\n"
    "      --nvlink-gbs X     NVLink bandwidth per GPU and direction, GB/s\n"
    "      --ib-gbs X         inter-node bandwidth per GPU and direction, GB/s\n"
    "      --alpha-us X       latency of one collective step inside a node, us\n"
    "      --alpha-ib-us X    latency of one collective step across nodes, us\n"
    "      --gpus-per-node N  GPUs per node (default 8)\n"
    "      --mfu X            model FLOPs utilization of forward + backward, (0, 1] (0.40)\n"
    "      --tokens N         tokens per rank per training step (8192)\n"
    "      --gather-dtype T   what fsdp2 and dmuon move in the step: float32 (default) or\n"
    "                         bfloat16\n"
    "      --tail POLICY      planner tail policy: owner, shard or auto (default auto)\n"
    "  -j, --json             one JSON document (mfsdp-sim/1) instead of tables\n"
    "      --paper            Llama-3-8B on the a100 preset at 8 and 64 ranks next to the\n"
    "                         paper's figures (arXiv 2607.05895)\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit status: 0 ok, 1 bad input, 2 usage error.\n";

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try '" PROG " --help')\n");
    return EXIT_USAGE;
}

/* A finite number in (lo, hi] (lo_open) or [lo, hi]. */
static int parse_double(const char *s, double lo, int lo_open, double hi, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v) || v > hi ||
        (lo_open ? v <= lo : v < lo)) {
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        return -1;
    }
    *out = v;
    return 0;
}

/* "8,16,..." into o->ranks; no empty items, no duplicates. */
static int parse_ranks(const char *s, sim_opts_t *o, char *why, size_t whylen)
{
    char buf[1024];
    if (strlen(s) >= sizeof(buf)) {
        snprintf(why, whylen, "list too long");
        return -1;
    }
    snprintf(buf, sizeof(buf), "%s", s);
    o->nranks = 0;
    char *p = buf;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma != NULL) {
            *comma = '\0';
        }
        long v;
        if (parse_int(p, 1, MAX_WORLD, &v) != 0) {
            snprintf(why, whylen, "'%.32s' is not an integer in 1..%d", p, MAX_WORLD);
            return -1;
        }
        if (o->nranks == MAX_RANK_LIST) {
            snprintf(why, whylen, "more than %d rank counts", MAX_RANK_LIST);
            return -1;
        }
        for (int i = 0; i < o->nranks; i++) {
            if (o->ranks[i] == (int)v) {
                snprintf(why, whylen, "%ld appears twice", v);
                return -1;
            }
        }
        o->ranks[o->nranks++] = (int)v;
        if (comma == NULL) {
            break;
        }
        p = comma + 1;
    }
    return 0;
}

enum {
    OPT_TFLOPS = 1000,
    OPT_NS_EFF,
    OPT_MEM_GB,
    OPT_NVLINK,
    OPT_IB,
    OPT_ALPHA,
    OPT_ALPHA_IB,
    OPT_GPN,
    OPT_MFU,
    OPT_TOKENS,
    OPT_GATHER,
    OPT_TAIL,
    OPT_PAPER,
};

/* Overrides are applied after the preset, in any argument order. */
typedef struct overrides {
    int have[OPT_PAPER - OPT_TFLOPS];
    double val[OPT_PAPER - OPT_TFLOPS];
} overrides_t;

static int parse_args(int argc, char **argv, sim_opts_t *o)
{
    static const struct option longopts[] = {
        {"manifest", required_argument, NULL, 'm'},
        {"ranks", required_argument, NULL, 'r'},
        {"gpu", required_argument, NULL, 'g'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {"tflops", required_argument, NULL, OPT_TFLOPS},
        {"ns-eff", required_argument, NULL, OPT_NS_EFF},
        {"mem-gb", required_argument, NULL, OPT_MEM_GB},
        {"nvlink-gbs", required_argument, NULL, OPT_NVLINK},
        {"ib-gbs", required_argument, NULL, OPT_IB},
        {"alpha-us", required_argument, NULL, OPT_ALPHA},
        {"alpha-ib-us", required_argument, NULL, OPT_ALPHA_IB},
        {"gpus-per-node", required_argument, NULL, OPT_GPN},
        {"mfu", required_argument, NULL, OPT_MFU},
        {"tokens", required_argument, NULL, OPT_TOKENS},
        {"gather-dtype", required_argument, NULL, OPT_GATHER},
        {"tail", required_argument, NULL, OPT_TAIL},
        {"paper", no_argument, NULL, OPT_PAPER},
        {NULL, 0, NULL, 0},
    };
    /* What each numeric override accepts: (lo, open, hi), and its words for errors. */
    static const struct {
        double lo;
        int open;
        double hi;
        const char *flag;
        const char *expect;
    } range[OPT_PAPER - OPT_TFLOPS] = {
        [OPT_TFLOPS - OPT_TFLOPS] = {0.0, 1, 1e6, "--tflops", "a number of TFLOP/s > 0"},
        [OPT_NS_EFF - OPT_TFLOPS] = {0.0, 1, 1.0, "--ns-eff", "a fraction in (0, 1]"},
        [OPT_MEM_GB - OPT_TFLOPS] = {0.0, 1, 1e6, "--mem-gb", "a number of GB > 0"},
        [OPT_NVLINK - OPT_TFLOPS] = {0.0, 1, 1e6, "--nvlink-gbs", "a bandwidth in GB/s > 0"},
        [OPT_IB - OPT_TFLOPS] = {0.0, 1, 1e6, "--ib-gbs", "a bandwidth in GB/s > 0"},
        [OPT_ALPHA - OPT_TFLOPS] = {0.0, 0, 1e6, "--alpha-us", "a latency in us >= 0"},
        [OPT_ALPHA_IB - OPT_TFLOPS] = {0.0, 0, 1e6, "--alpha-ib-us", "a latency in us >= 0"},
        [OPT_GPN - OPT_TFLOPS] = {1.0, 0, 1024.0, "--gpus-per-node", "an integer in 1..1024"},
        [OPT_MFU - OPT_TFLOPS] = {0.0, 1, 1.0, "--mfu", "a fraction in (0, 1]"},
        [OPT_TOKENS - OPT_TFLOPS] = {1.0, 0, 1e9, "--tokens", "an integer in 1..1000000000"},
    };
    overrides_t ov;
    memset(&ov, 0, sizeof(ov));
    const char *preset = NULL;
    const char *ranks_arg = NULL;
    o->json = 0;
    o->paper = 0;
    o->nmanifests = 0;
    o->nranks = 0;
    o->tail = MFSDP_TAIL_AUTO;
    o->gather_elt = 4.0;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":m:r:g:jh", longopts, NULL)) != -1) {
        switch (c) {
        case 'm':
            if (o->nmanifests == MAX_MANIFESTS) {
                return usage_error("more than %s manifests", "16");
            }
            o->manifests[o->nmanifests++] = optarg;
            break;
        case 'r':
            ranks_arg = optarg;
            break;
        case 'g':
            preset = optarg;
            break;
        case 'j':
            o->json = 1;
            break;
        case 'h':
            fputs(usage_text, stdout);
            return -1;
        case OPT_GATHER:
            if (strcasecmp(optarg, "float32") == 0) {
                o->gather_elt = 4.0;
            } else if (strcasecmp(optarg, "bfloat16") == 0) {
                o->gather_elt = 2.0;
            } else {
                return usage_error("--gather-dtype '%s': expected float32 or bfloat16", optarg);
            }
            break;
        case OPT_TAIL:
            if (strcasecmp(optarg, "owner") == 0) {
                o->tail = MFSDP_TAIL_OWNER;
            } else if (strcasecmp(optarg, "shard") == 0) {
                o->tail = MFSDP_TAIL_SHARD;
            } else if (strcasecmp(optarg, "auto") == 0) {
                o->tail = MFSDP_TAIL_AUTO;
            } else {
                return usage_error("--tail '%s': expected owner, shard or auto", optarg);
            }
            break;
        case OPT_PAPER:
            o->paper = 1;
            break;
        case ':':
        case '?': {
            /* A long option is the word getopt just read; a short one is optopt. */
            char opt[3] = {'-', (char)optopt, '\0'};
            const char *word = argv[optind - 1];
            const char *name = strncmp(word, "--", 2) == 0 || optopt == 0 ? word : opt;
            return usage_error(c == ':' ? "option '%s' needs a value" : "unknown option '%s'",
                               name);
        }
        default: {
            int i = c - OPT_TFLOPS;
            if (i < 0 || i >= OPT_PAPER - OPT_TFLOPS) {
                return usage_error("unknown option '%s'", argv[optind - 1]);
            }
            double v = 0.0;
            long lv = 0;
            int integer = c == OPT_GPN || c == OPT_TOKENS;
            if ((integer && parse_int(optarg, (long)range[i].lo, (long)range[i].hi, &lv) != 0) ||
                (!integer &&
                 parse_double(optarg, range[i].lo, range[i].open, range[i].hi, &v) != 0)) {
                char msg[160];
                snprintf(msg, sizeof(msg), "%s '%%s': expected %s", range[i].flag, range[i].expect);
                return usage_error(msg, optarg);
            }
            ov.have[i] = 1;
            ov.val[i] = integer ? (double)lv : v;
            break;
        }
        }
    }
    if (optind != argc) {
        return usage_error("unexpected argument '%s' (manifests go after --manifest)",
                           argv[optind]);
    }
    if (o->paper && preset != NULL) {
        return usage_error("%s", "--paper uses the a100 preset (the paper's GPUs); drop --gpu "
                                 "and override single constants instead");
    }
    if (o->paper && ranks_arg != NULL) {
        return usage_error("%s", "--paper runs 8 and 64 ranks (the paper's configurations); "
                                 "drop --ranks");
    }
    if (o->paper && o->nmanifests > 1) {
        return usage_error("%s", "--paper takes at most one --manifest (Llama-3-8B by default)");
    }
    const gpu_consts_t *base = &presets[0];
    if (preset != NULL) {
        base = NULL;
        for (size_t i = 0; i < NPRESETS; i++) {
            if (strcasecmp(preset, presets[i].name) == 0) {
                base = &presets[i];
            }
        }
        if (base == NULL) {
            return usage_error("--gpu '%s': expected a100, h100 or h200", preset);
        }
    }
    o->gpu = *base;
    o->mfu = DEFAULT_MFU;
    o->tokens = DEFAULT_TOKENS;
    double *fields[OPT_PAPER - OPT_TFLOPS] = {
        [OPT_TFLOPS - OPT_TFLOPS] = &o->gpu.tflops,
        [OPT_NS_EFF - OPT_TFLOPS] = &o->gpu.ns_eff,
        [OPT_MEM_GB - OPT_TFLOPS] = &o->gpu.mem_gb,
        [OPT_NVLINK - OPT_TFLOPS] = &o->gpu.nvlink_gbs,
        [OPT_IB - OPT_TFLOPS] = &o->gpu.ib_gbs,
        [OPT_ALPHA - OPT_TFLOPS] = &o->gpu.alpha_us,
        [OPT_ALPHA_IB - OPT_TFLOPS] = &o->gpu.alpha_ib_us,
        [OPT_MFU - OPT_TFLOPS] = &o->mfu,
        [OPT_TOKENS - OPT_TFLOPS] = &o->tokens,
    };
    for (int i = 0; i < OPT_PAPER - OPT_TFLOPS; i++) {
        if (!ov.have[i]) {
            continue;
        }
        if (i == OPT_GPN - OPT_TFLOPS) {
            o->gpu.gpus_per_node = (int)ov.val[i];
        } else {
            *fields[i] = ov.val[i];
        }
    }
    int any_override = 0;
    for (int i = 0; i < OPT_MFU - OPT_TFLOPS; i++) {
        any_override |= ov.have[i];
    }
    if (any_override) {
        /* The table header must not claim a preset's name for other constants. */
        char name[sizeof(o->gpu.name)];
        snprintf(name, sizeof(name), "%.8s+", o->gpu.name);
        memcpy(o->gpu.name, name, sizeof(name));
    }
    if (o->paper) {
        o->ranks[0] = 8;
        o->ranks[1] = 64;
        o->nranks = 2;
    } else if (ranks_arg != NULL) {
        char why[160];
        if (parse_ranks(ranks_arg, o, why, sizeof(why)) != 0) {
            char msg[256];
            snprintf(msg, sizeof(msg), "--ranks '%%s': %s", why);
            return usage_error(msg, ranks_arg);
        }
    } else {
        static const int def[] = {8, 16, 32, 64, 128, 256, 512, 1024};
        for (size_t i = 0; i < sizeof(def) / sizeof(def[0]); i++) {
            o->ranks[o->nranks++] = def[i];
        }
    }
    if (o->nmanifests == 0) {
        static const char *const shipped[] = {
            MFSDP_MODELS_DIR "/gpt2-124m.json",
            MFSDP_MODELS_DIR "/llama3-8b.json",
            MFSDP_MODELS_DIR "/llama3-70b.json",
        };
        if (o->paper) {
            o->manifests[o->nmanifests++] = shipped[1];
        } else {
            for (size_t i = 0; i < sizeof(shipped) / sizeof(shipped[0]); i++) {
                o->manifests[o->nmanifests++] = shipped[i];
            }
        }
    }
    return 0;
}

/* ---- main ------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    sim_opts_t o;
    memset(&o, 0, sizeof(o));
    int rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        return rc < 0 ? 0 : rc;
    }
    rc = EXIT_INPUT;
    json_t *root = NULL, *runs = NULL;
    sim_row_t *rows = calloc((size_t)o.nranks, sizeof(*rows));
    mfsdp_manifest_t *m = NULL;
    char err[1024] = "";
    char warn[1024];
    /* Tables are written to memory and printed only when every run succeeded: a failure
     * leaves stdout empty and stderr one line. */
    char *tab_text = NULL;
    size_t tab_len = 0;
    FILE *tab = o.json ? NULL : open_memstream(&tab_text, &tab_len);
    if (rows == NULL || (!o.json && tab == NULL)) {
        fprintf(stderr, PROG ": out of memory\n");
        goto out;
    }
    if (o.json) {
        root = json_object();
        runs = json_array();
        json_t *g = gpu_json(&o);
        int bad = root == NULL || runs == NULL || g == NULL;
        if (bad) {
            json_decref(runs);
            json_decref(g);
        } else {
            bad |= jset(root, "format", json_string("mfsdp-sim/1"));
            bad |= jset(root, "gpu", g);
            bad |= jset(root, "runs", runs);
            bad |= jset(root, "mfu", json_real(o.mfu));
            bad |= jset(root, "tokens", json_real(o.tokens));
            bad |= jset(root, "gather_dtype",
                        json_string(o.gather_elt == 2.0 ? "bfloat16" : "float32"));
            bad |= jset(root, "tail", json_string(tail_name(o.tail)));
            if (o.paper) {
                bad |= jset(root, "paper", paper_json());
            }
        }
        if (bad) {
            fprintf(stderr, PROG ": out of memory\n");
            goto out;
        }
    } else {
        print_header(tab, &o);
    }
    for (int i = 0; i < o.nmanifests; i++) {
        const char *path = o.manifests[i];
        model_summary_t sum;
        capture_t cap;
        capture_begin(&cap);
        mfsdp_status_t st = mfsdp_manifest_load(path, err, sizeof(err), &m);
        if (st != MFSDP_OK) {
            capture_end(&cap, 0, warn, sizeof(warn));
            fprintf(stderr, PROG ": %s\n",
                    err[0] ? err : (warn[0] ? warn : mfsdp_status_string(st)));
            goto out;
        }
        for (int k = 0; k < o.nranks; k++) {
            err[0] = '\0';
            st = simulate(m, o.ranks[k], &o, &rows[k], &sum, err, sizeof(err));
            if (st != MFSDP_OK) {
                capture_end(&cap, 0, warn, sizeof(warn));
                fprintf(stderr, PROG ": %s at %d ranks: %s\n", path, o.ranks[k],
                        err[0] ? err : (warn[0] ? warn : mfsdp_status_string(st)));
                goto out;
            }
        }
        capture_end(&cap, 1, warn, sizeof(warn));
        if (o.json) {
            json_t *r = run_json(path, &sum, rows, o.nranks, &o);
            if (r == NULL || json_array_append_new(runs, r) != 0) {
                fprintf(stderr, PROG ": out of memory\n");
                goto out;
            }
        } else {
            print_model(tab, path, &sum);
            if (o.paper) {
                print_paper(tab, rows, o.nranks);
            }
            print_table(tab, &o, rows, o.nranks);
        }
        mfsdp_manifest_free(m);
        m = NULL;
    }
    if (o.json) {
        char *text = json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(17));
        if (text == NULL) {
            fprintf(stderr, PROG ": out of memory\n");
            goto out;
        }
        fputs(text, stdout);
        fputc('\n', stdout);
        free(text);
    } else {
        if (fclose(tab) != 0) {
            tab = NULL;
            fprintf(stderr, PROG ": out of memory\n");
            goto out;
        }
        tab = NULL;
        fwrite(tab_text, 1, tab_len, stdout);
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, PROG ": writing the output failed: %s\n", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    if (tab != NULL) {
        fclose(tab);
    }
    free(tab_text);
    mfsdp_manifest_free(m);
    json_decref(root);
    free(rows);
    return rc;
}
