/* SPDX-License-Identifier: Apache-2.0 */
#include "ld_preload/shim.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/checks.h"
#include "core/config.h"

__thread int shim_inside;

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static mfsdp_status_t shim_status = MFSDP_OK;
static const mfsdp_config_t *shim_cfg;
static mfsdp_manifest_t *shim_manifest;
static double shim_divide = 1.0; /* 0 means "the world size" */
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER;
static shim_comm_t *comms;
static mfsdp_record_t *shim_record_out; /* records of removed comms, written at exit */

static void shim_init_once(void)
{
    shim_status = mfsdp_config_get(&shim_cfg);
    if (shim_status != MFSDP_OK) {
        return; /* logged by the config parser; every remap is refused */
    }
    const char *div = shim_cfg->grad_divide;
    if (div != NULL && strcasecmp(div, "world") == 0) {
        shim_divide = 0.0;
    } else if (div != NULL && *div != '\0') {
        char *end = NULL;
        double d = strtod(div, &end);
        if (end == div || *end != '\0' || !isfinite(d) || d <= 0) {
            MFSDP_WARN("MFSDP_GRAD_DIVIDE=%s: expected 'world' or a positive number", div);
            shim_status = MFSDP_ERR_CONFIG;
            return;
        }
        shim_divide = d;
    }
    if (shim_cfg->record != NULL && shim_cfg->record[0] != '\0') {
        MFSDP_INFO(SHIM, "recording calls to %s (pass-through mode)", shim_cfg->record);
        return;
    }
    if (shim_cfg->manifest == NULL || shim_cfg->manifest[0] == '\0') {
        MFSDP_INFO(SHIM, "MFSDP_MANIFEST not set: every call passes through");
        return;
    }
    char err[1024];
    shim_status = mfsdp_manifest_load(shim_cfg->manifest, err, sizeof(err), &shim_manifest);
    if (shim_status != MFSDP_OK) {
        MFSDP_WARN("%s", err);
        shim_manifest = NULL;
    }
}

mfsdp_status_t shim_init(void)
{
    pthread_once(&shim_once, shim_init_once);
    return shim_status;
}

int shim_recording(void)
{
    return shim_init() == MFSDP_OK && shim_cfg->record != NULL && shim_cfg->record[0] != '\0';
}

shim_comm_t *shim_comm_add(shim_frontend_t fe, const void *handle, MPI_Comm mpi, int owns_mpi,
                           int size, int rank)
{
    mfsdp_status_t st = shim_init();
    shim_comm_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        MFSDP_WARN("out of memory tracking a communicator: its calls pass through");
        return NULL;
    }
    c->fe = fe;
    c->handle = handle;
    c->mpi = mpi;
    c->owns_mpi = owns_mpi;
    c->size = size;
    c->rank = rank;
    pthread_mutex_init(&c->lock, NULL);
    if (st != MFSDP_OK) {
        /* A bad MFSDP_* value or manifest: refuse to remap rather than guess. */
        c->remap = 1;
        c->failed = 1;
        snprintf(c->why, sizeof(c->why), "bad MFSDP_* configuration or manifest (%s)",
                 mfsdp_status_string(st));
    } else if (shim_manifest != NULL &&
               (shim_manifest->world_size == 0 || shim_manifest->world_size == size)) {
        char err[1024] = "";
        st = mfsdp_matcher_create(shim_manifest, size, err, sizeof(err), &c->matcher);
        c->remap = 1;
        if (st != MFSDP_OK) {
            MFSDP_WARN("cannot match calls to the manifest %s: %s", shim_cfg->manifest, err);
            c->failed = 1;
            snprintf(c->why, sizeof(c->why), "%s", err);
        }
    } else if (shim_manifest != NULL) {
        MFSDP_INFO(SHIM, "comm of size %d does not match the manifest's world size %d: "
                         "pass-through", size, shim_manifest->world_size);
    }
    pthread_mutex_lock(&comms_lock);
    c->next = comms;
    comms = c;
    pthread_mutex_unlock(&comms_lock);
    MFSDP_INFO(SHIM, "%s comm %p: rank %d of %d, %s", fe == SHIM_MPI ? "mpi" : "nccl", handle,
               rank, size, c->remap ? "remapped" : "pass-through");
    return c;
}

shim_comm_t *shim_comm_find(shim_frontend_t fe, const void *handle)
{
    pthread_mutex_lock(&comms_lock);
    shim_comm_t *c = comms;
    while (c != NULL && !(c->fe == fe && c->handle == handle)) {
        c = c->next;
    }
    pthread_mutex_unlock(&comms_lock);
    return c;
}

/* ---------------------------------------------------------------- recording */

static void record_call(shim_comm_t *c, const shim_call_t *call)
{
    if (c->rec_done) {
        return;
    }
    /* One iteration: stop at the first all-gather that repeats the first recorded one after
     * a reduce-scatter was seen (the next iteration's first call). */
    if (call->sig.kind == MFSDP_CALL_ALLGATHER && c->rec_seen_rs && c->rec.ncalls > 0) {
        const mfsdp_call_sig_t *f = &c->rec.calls[0].sig;
        if (f->kind == call->sig.kind && f->count == call->sig.count &&
            f->dtype == call->sig.dtype) {
            c->rec_done = 1;
            return;
        }
    }
    c->rec_seen_rs |= call->sig.kind == MFSDP_CALL_REDUCE_SCATTER;
    if (c->rec.ncalls == c->rec_cap) {
        size_t cap = c->rec_cap ? 2 * c->rec_cap : 64;
        mfsdp_record_call_t *n = realloc(c->rec.calls, cap * sizeof(*n));
        if (n == NULL) {
            MFSDP_WARN("out of memory recording calls: the record stops here");
            c->rec_done = 1;
            return;
        }
        c->rec.calls = n;
        c->rec_cap = cap;
    }
    mfsdp_record_call_t *r = &c->rec.calls[c->rec.ncalls++];
    r->sig = call->sig;
    snprintf(r->op, sizeof(r->op), "%s", call->op_name ? call->op_name : "none");
}

/* Keep a removed comm's record until exit (comms may be destroyed before finalize). */
static void record_keep(shim_comm_t *c)
{
    if (!shim_recording() || c->rec.ncalls == 0) {
        free(c->rec.calls);
        return;
    }
    if (shim_record_out == NULL) {
        shim_record_out = calloc(1, sizeof(*shim_record_out));
        if (shim_record_out == NULL) {
            free(c->rec.calls);
            return;
        }
    }
    mfsdp_record_t *r = shim_record_out;
    mfsdp_record_comm_t *n = realloc(r->comms, (r->ncomms + 1) * sizeof(*n));
    if (n == NULL) {
        free(c->rec.calls);
        return;
    }
    r->comms = n;
    c->rec.size = c->size;
    r->comms[r->ncomms++] = c->rec;
}

static void record_write(int rank)
{
    if (shim_record_out == NULL || rank != 0) {
        return;
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", shim_cfg->record, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (f == NULL) {
        MFSDP_WARN("cannot write MFSDP_RECORD file %s: %m", tmp);
        return;
    }
    mfsdp_status_t st = mfsdp_record_write(shim_record_out, f);
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
        st = MFSDP_ERR_IO;
    }
    if (fclose(f) != 0) {
        st = MFSDP_ERR_IO;
    }
    if (st != MFSDP_OK || rename(tmp, shim_cfg->record) != 0) {
        MFSDP_WARN("cannot write MFSDP_RECORD file %s: %m", shim_cfg->record);
        unlink(tmp);
        return;
    }
    MFSDP_INFO(SHIM, "recorded %zu communicator(s) to %s", shim_record_out->ncomms,
               shim_cfg->record);
}

/* ---------------------------------------------------------------- lifetime */

/* MFSDP_REPORT=1: one line per rank and remapped comm (scripts/demo-report.py parses it). */
static void report(const shim_comm_t *c)
{
    mfsdp_ctx_stats_t s;
    if (c->ctx == NULL || mfsdp_ctx_get_stats(c->ctx, &s) != MFSDP_OK) {
        return;
    }
    size_t arena = 0;
    for (int k = 0; k < MFSDP_ARENA_NCAT; k++) {
        arena += s.arena_bytes[k];
    }
    printf("mfsdp report: rank %d world %d steps %llu step_ms %.3f allgathers %llu "
           "reduces %llu arena_mib %.2f staging_mib %.2f peak_mib %.2f mlocked %d\n",
           s.rank, s.world, (unsigned long long)s.steps, s.step_seconds * 1e3,
           (unsigned long long)s.allgathers, (unsigned long long)s.reduces,
           (double)arena / 1048576.0, (double)s.staging_bytes / 1048576.0,
           (double)s.peak_bytes / 1048576.0, s.mlocked);
    fflush(stdout);
}

static void comm_release(shim_comm_t *c)
{
    if (c->ctx != NULL && !c->failed) {
        shim_inside = 1;
        mfsdp_status_t st = mfsdp_ctx_flush(c->ctx);
        shim_inside = 0;
        if (st != MFSDP_OK) {
            MFSDP_WARN("flushing pending optimizer steps failed: %s", mfsdp_status_string(st));
        }
    }
    if (shim_init() == MFSDP_OK && shim_cfg->report) {
        report(c);
    }
    mfsdp_ctx_destroy(&c->ctx);
    mfsdp_matcher_destroy(c->matcher);
    if (c->owns_mpi && c->mpi != MPI_COMM_NULL) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) {
            PMPI_Comm_free(&c->mpi);
        }
    }
    record_keep(c);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

void shim_comm_remove(shim_comm_t *c)
{
    if (c == NULL) {
        return;
    }
    pthread_mutex_lock(&comms_lock);
    for (shim_comm_t **p = &comms; *p != NULL; p = &(*p)->next) {
        if (*p == c) {
            *p = c->next;
            break;
        }
    }
    pthread_mutex_unlock(&comms_lock);
    comm_release(c);
}

void shim_finalize_all(void)
{
    int world_rank = 0;
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) {
        PMPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    }
    /* Release in creation order (the list is newest first) so that every rank frees its
     * communicators in the same order. */
    for (;;) {
        pthread_mutex_lock(&comms_lock);
        shim_comm_t **p = &comms;
        while (*p != NULL && (*p)->next != NULL) {
            p = &(*p)->next;
        }
        shim_comm_t *c = *p;
        if (c != NULL) {
            *p = NULL;
        }
        pthread_mutex_unlock(&comms_lock);
        if (c == NULL) {
            break;
        }
        comm_release(c);
    }
    if (shim_init() == MFSDP_OK && shim_recording()) {
        record_write(world_rank);
    }
    if (shim_record_out != NULL) {
        for (size_t i = 0; i < shim_record_out->ncomms; i++) {
            free(shim_record_out->comms[i].calls);
        }
        free(shim_record_out->comms);
        free(shim_record_out);
        shim_record_out = NULL;
    }
}

/* ---------------------------------------------------------------- dispatch */

/* Fold MFSDP_GRAD_DIVIDE into the op the owner applies. */
static void apply_divide(int world, mfsdp_redop_t *op, double *scalar)
{
    double d = shim_divide == 0.0 ? (double)world : shim_divide;
    if (d == 1.0) {
        return;
    }
    switch (*op) {
    case MFSDP_OP_SUM:
        if (d == (double)world) {
            *op = MFSDP_OP_AVG;
        } else {
            *op = MFSDP_OP_PREMULSUM;
            *scalar = 1.0 / d;
        }
        break;
    case MFSDP_OP_AVG:
        *op = MFSDP_OP_PREMULSUM;
        *scalar = 1.0 / ((double)world * d);
        break;
    case MFSDP_OP_PREMULSUM:
        *scalar /= d;
        break;
    }
}

shim_result_t shim_dispatch(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p)
{
    shim_result_t res = SHIM_PASS;
    char err[1024] = "";
    size_t group = MFSDP_GROUP_NONE;
    mfsdp_status_t st = MFSDP_OK;
    if (c == NULL) {
        return SHIM_PASS;
    }
    pthread_mutex_lock(&c->lock);
    if (!c->remap) {
        if (shim_recording()) {
            record_call(c, call);
        }
        goto out;
    }
    if (c->failed) {
        st = MFSDP_ERR_SEQUENCE;
        MFSDP_WARN("refusing the call: an earlier error stopped the remap: %s", c->why);
        res = SHIM_ERROR;
        goto out;
    }
    mfsdp_match_t match = {.group = MFSDP_GROUP_NONE};
    st = mfsdp_matcher_next(c->matcher, &call->sig, &match, err, sizeof(err));
    group = match.group;
    if (st != MFSDP_OK) {
        MFSDP_WARN("%s", err);
        c->failed = 1;
        snprintf(c->why, sizeof(c->why), "%s", err);
        res = SHIM_ERROR;
        goto out;
    }
    if (group == MFSDP_GROUP_NONE) {
        char sb[96];
        mfsdp_call_sig_format(&call->sig, sb, sizeof(sb));
        MFSDP_INFO(SHIM, "%s matches no group of the manifest: pass-through", sb);
        goto out;
    }
    if (call->sig.kind == MFSDP_CALL_REDUCE_SCATTER && !call->op_supported) {
        MFSDP_WARN("reduce_scatter of group %s uses op %s, which mfsdp cannot apply on owners",
                   shim_manifest->groups[group].name, call->op_name ? call->op_name : "?");
        st = MFSDP_ERR_UNSUPPORTED;
        c->failed = 1;
        snprintf(c->why, sizeof(c->why), "unsupported reduce op %s", call->op_name);
        res = SHIM_ERROR;
        goto out;
    }
    res = SHIM_DONE;
    shim_inside = 1;
    if (c->ctx == NULL) {
        /* Collective over the comm: every rank reaches this on the same call, because the
         * decision above depends only on rank-identical arguments. */
        st = mfsdp_ctx_create_mpi(shim_manifest, NULL, c->mpi, &c->ctx);
        if (st != MFSDP_OK) {
            MFSDP_WARN("creating the mfsdp context failed: %s", mfsdp_status_string(st));
        }
    }
    if (st == MFSDP_OK && call->sig.kind == MFSDP_CALL_ALLGATHER) {
        st = mfsdp_ctx_allgather(c->ctx, group, call->send, call->recv, call->sig.count,
                                 call->sig.dtype);
    } else if (st == MFSDP_OK) {
        mfsdp_redop_t op = call->op;
        double scalar = call->scalar;
        apply_divide(c->size, &op, &scalar);
        st = mfsdp_ctx_reduce(c->ctx, group, call->send, call->recv, call->sig.count,
                              call->sig.dtype, op, scalar);
    }
    shim_inside = 0;
    if (st != MFSDP_OK) {
        MFSDP_WARN("remapped %s of group %s failed: %s",
                   call->sig.kind == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter",
                   shim_manifest->groups[group].name, mfsdp_status_string(st));
        c->failed = 1;
        snprintf(c->why, sizeof(c->why), "remapped call failed: %s", mfsdp_status_string(st));
        res = SHIM_ERROR;
    }
out:
    pthread_mutex_unlock(&c->lock);
    *st_p = st;
    return res;
}
