/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The shim's core: configuration, the communicator registry, the rank agreement at a
 * communicator's first call, and the decision for each intercepted call — remap it (tagged:
 * the companion names it; sequence: the matcher identifies it), pass it through, or stop the
 * job with one clear error. Rules (docs/manifest.md "Never silent"):
 *  - a call on a managed communicator that matches nothing or is ambiguous stops the job;
 *  - with a manifest, a job whose first iteration's worth of calls remaps nothing stops;
 *  - a rank whose settings differ stops every rank with one message naming the variable;
 *  - MFSDP_* variables without a manifest, an unknown MFSDP_* name, a bad value: stop;
 *  - an HSDP all-reduce that the manifest does not declare stops the job.
 */
#include "ld_preload/shim.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/checks.h"
#include "core/log.h"
#include "mfsdp/shim.h"

__thread int shim_inside;

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static mfsdp_status_t shim_status = MFSDP_OK;
static char shim_err[1024];
static const mfsdp_config_t *shim_cfg;
static mfsdp_manifest_t *shim_manifest; /* sequence mode (MFSDP_MANIFEST) */
static mfsdp_settings_t shim_settings;
static size_t shim_iter_calls; /* calls in one iteration of the manifest */
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER;
static shim_comm_t *comms;
/* Process-wide, for the first-iteration rule and HSDP (under comms_lock). */
static uint64_t calls_total, remapped_total;
static shim_comm_t *pending_comm; /* the comm whose last reduce may await a replicate */
static int first_rank = -1;       /* this process's rank in the first comm registered */

/* Variables that mean nothing without a manifest would be silently ignored: an error. These
 * may be set without one. */
static const char *const no_manifest_ok[] = {
    "MFSDP_DEBUG",     "MFSDP_DEBUG_SUBSYS", "MFSDP_DEBUG_FILE",   "MFSDP_MANIFEST",
    "MFSDP_RECORD",    "MFSDP_RECORD_MAX",   "MFSDP_TUNER_CONFIG", "MFSDP_THREADS",
    "MFSDP_MLOCK",     "MFSDP_NUMA_BIND",    "MFSDP_REPORT",       "MFSDP_PRELOAD_LIB",
    "MFSDP_BUILD_DIR",
};

static void init_error(mfsdp_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void init_error(mfsdp_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(shim_err, sizeof(shim_err), fmt, ap);
    va_end(ap);
    shim_status = st;
}

static void shim_atexit(void);

/* Under mfsdp-run (MFSDP_COMPANION=tag) the job keeps what the companion leaves it: its own
 * optimizer for every param mfsdp does not own, its lr schedule, its accumulation, its clipping
 * and its checkpoints, and FSDP2 states the gradient divide. A variable that configures one of
 * them here would be ignored or would contradict the job (MFSDP_TAIL=owner trained the norms a
 * second time with mfsdp's AdamW, weights the job never saw): each is refused, with why. */
static const struct {
    const char *name;
    const char *allowed; /* the one value that says what the companion does anyway, or NULL */
    const char *why;
} companion_refused[] = {
    {"MFSDP_MANIFEST", NULL,
     "mfsdp-run builds the manifest from the live FSDP2 model; MFSDP_MANIFEST is for jobs run "
     "under the shim without mfsdp-run"},
    {"MFSDP_RECORD", NULL,
     "recording is for jobs run under the shim without mfsdp-run (the companion names each "
     "call's group, so there is nothing to record)"},
    {"MFSDP_TAIL", "job",
     "the job's own optimizer trains every param mfsdp does not own (tail \"job\"); another "
     "policy would train them again with mfsdp's AdamW, in weights the job never sees"},
    {"MFSDP_STEP", NULL, "the job's optimizer.step() runs the owners' step"},
    {"MFSDP_ACCUM_STEPS", NULL,
     "the owners sum every reduce until the job's optimizer.step(), however the job "
     "accumulates"},
    {"MFSDP_LR_SCHEDULE", NULL,
     "the owners follow the job's own lr schedule (its current lr / its initial lr)"},
    {"MFSDP_CLIP", NULL,
     "clip in the job with torch.nn.utils.clip_grad_norm_, which mfsdp-run extends to the "
     "owners' gradients"},
    {"MFSDP_ADAMW_LR", NULL,
     "the job's own optimizer trains the params mfsdp does not own, with its own "
     "hyper-parameters"},
    {"MFSDP_ADAMW_WEIGHT_DECAY", NULL,
     "the job's own optimizer trains the params mfsdp does not own, with its own "
     "hyper-parameters"},
    {"MFSDP_GRAD_DIVIDE", NULL,
     "the companion reads the gradient divide from FSDP2 itself, group by group"},
};

/* 1 and the error set when, under a companion, a variable it leaves to the job is set
 * (companion_refused under MFSDP_COMPANION=tag; the checkpoint variables under either). */
static int companion_config_refused(void)
{
    if (!shim_cfg->companion_set) {
        return 0;
    }
    for (size_t i = 0; shim_cfg->companion == MFSDP_CFG_COMPANION_TAG &&
                       i < sizeof(companion_refused) / sizeof(companion_refused[0]);
         i++) {
        const char *v = getenv(companion_refused[i].name);
        if (v == NULL || *v == '\0' ||
            (companion_refused[i].allowed != NULL &&
             strcasecmp(v, companion_refused[i].allowed) == 0)) {
            continue;
        }
        init_error(MFSDP_ERR_CONFIG, "%s=%s is set under mfsdp-run: %s (unset it)",
                   companion_refused[i].name, v, companion_refused[i].why);
        return 1;
    }
    if (shim_ckpt_enabled(shim_cfg)) {
        static const char *const ckpt_vars[] = {"MFSDP_CKPT_DIR", "MFSDP_CKPT_EVERY",
                                                "MFSDP_CKPT_KEEP", "MFSDP_RESUME", "MFSDP_INIT"};
        const char *set = "?";
        for (size_t i = 0; i < sizeof(ckpt_vars) / sizeof(ckpt_vars[0]); i++) {
            const char *v = getenv(ckpt_vars[i]);
            if (v != NULL && *v != '\0') {
                set = ckpt_vars[i];
                break;
            }
        }
        init_error(MFSDP_ERR_CONFIG,
                   "%s is set, but MFSDP_CKPT_DIR, MFSDP_CKPT_EVERY, MFSDP_CKPT_KEEP, "
                   "MFSDP_RESUME and MFSDP_INIT apply to jobs run with MFSDP_MANIFEST; a PyTorch "
                   "job under mfsdp-run keeps its own checkpoints (its state_dict holds the "
                   "trained weights)",
                   set);
        return 1;
    }
    return 0;
}

static void shim_init_once(void)
{
    atexit(shim_atexit);
    /* A bad value or an unknown MFSDP_* name (a misspelling) is refused by the table. */
    mfsdp_log_capture_begin();
    mfsdp_status_t st = mfsdp_config_get(&shim_cfg);
    mfsdp_log_capture_end(NULL, 0);
    if (st != MFSDP_OK) {
        shim_cfg = NULL;
        const char *why = mfsdp_config_error();
        init_error(st, "%s", why[0] ? why : "bad MFSDP_* configuration");
        return;
    }
    if (companion_config_refused()) {
        return;
    }
    if (shim_cfg->record_set && shim_cfg->manifest_set) {
        init_error(MFSDP_ERR_CONFIG,
                   "MFSDP_RECORD and MFSDP_MANIFEST are both set: recording passes every call "
                   "through, so unset MFSDP_MANIFEST while recording");
        return;
    }
    if (shim_cfg->record_set) {
        MFSDP_INFO(SHIM, "recording calls to %s (pass-through mode)", shim_cfg->record);
        return;
    }
    if (!shim_cfg->manifest_set) {
        if (shim_cfg->companion_set) {
            return; /* tagged mode: the companion registers its manifest */
        }
        for (size_t i = 0; i < mfsdp_config_count(); i++) {
            const char *vname;
            char value[256];
            if (mfsdp_config_value(shim_cfg, i, &vname, value, sizeof(value)) != MFSDP_OK ||
                getenv(vname) == NULL || *getenv(vname) == '\0') {
                continue;
            }
            int ok = 0;
            for (size_t k = 0; k < sizeof(no_manifest_ok) / sizeof(no_manifest_ok[0]); k++) {
                ok |= strcmp(vname, no_manifest_ok[k]) == 0;
            }
            if (!ok) {
                init_error(MFSDP_ERR_CONFIG,
                           "%s is set but MFSDP_MANIFEST is not: without a manifest every call "
                           "passes through and nothing is trained by mfsdp (set MFSDP_MANIFEST, "
                           "or run under mfsdp-run for PyTorch)",
                           vname);
                return;
            }
        }
        MFSDP_INFO(SHIM, "MFSDP_MANIFEST not set: every call passes through");
        return;
    }
    char err[1024];
    st = mfsdp_manifest_load(shim_cfg->manifest, err, sizeof(err), &shim_manifest);
    if (st != MFSDP_OK) {
        shim_manifest = NULL;
        init_error(st, "%s", err);
        return;
    }
    st = mfsdp_settings_resolve(shim_manifest, shim_cfg, &shim_settings, err, sizeof(err));
    if (st == MFSDP_OK) {
        st = shim_ckpt_check_config(shim_cfg, &shim_settings, err, sizeof(err));
    }
    if (st != MFSDP_OK) {
        init_error(st, "%s", err);
        return;
    }
    shim_iter_calls = shim_manifest->ncalls ? shim_manifest->ncalls : 2 * shim_manifest->ngroups;
}

static int finalized_once;

/* This process's rank in the job, for the one summary line and the record: the launcher's
 * (torchrun's RANK, mpirun's OMPI_COMM_WORLD_RANK, PMIx, PMI, Slurm), else its rank in the
 * first communicator the shim saw (communicators are registered at their first call, which
 * may be a sub-group's). */
static int job_rank(void)
{
    static const char *const vars[] = {"RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                                       "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        char *end = NULL;
        long r = v != NULL && *v != '\0' ? strtol(v, &end, 10) : -1;
        if (end != NULL && *end == '\0' && r >= 0 && r <= INT_MAX) {
            return (int)r;
        }
    }
    pthread_mutex_lock(&comms_lock);
    int r = first_rank >= 0 ? first_rank : 0;
    pthread_mutex_unlock(&comms_lock);
    return r;
}

/* A job that never calls MPI_Finalize (PyTorch under torchrun, any job of the NCCL front-end,
 * which does not intercept MPI) still gets its summary and end-of-job checks, its record, and
 * a non-zero exit status when its remap failed or trained nothing. */
static void shim_atexit(void)
{
    if (finalized_once) {
        return;
    }
    int rank = job_rank();
    /* Live comms are not released here (that would be collective at exit); their counters
     * join the summary. One whose release would have saved a checkpoint fails the job. */
    pthread_mutex_lock(&comms_lock);
    for (shim_comm_t *c = comms; c != NULL; c = c->next) {
        if (pthread_mutex_trylock(&c->lock) == 0) {
            shim_ckpt_fail_unsaved(c, c->fe == SHIM_MPI
                                          ? "the job exited without releasing its communicator "
                                            "(MPI_Comm_free or MPI_Finalize; PyTorch: "
                                            "dist.destroy_process_group()), so its final "
                                            "checkpoint was not written"
                                          : "the job exited without releasing its communicator "
                                            "(ncclCommDestroy or ncclCommFinalize; PyTorch: "
                                            "dist.destroy_process_group()), so its final "
                                            "checkpoint was not written");
            pthread_mutex_unlock(&c->lock);
        }
        shim_report_keep(c);
        shim_record_keep(c);
    }
    pthread_mutex_unlock(&comms_lock);
    shim_record_write(rank);
    if (shim_report_exit(rank)) {
        /* The error was printed: the job must not exit 0, whatever status it exits with. */
        fflush(NULL);
        _exit(3);
    }
}

mfsdp_status_t shim_init(void)
{
    pthread_once(&shim_once, shim_init_once);
    return shim_status;
}

const char *shim_init_error(void)
{
    shim_init();
    return shim_status != MFSDP_OK ? shim_err : "";
}

const mfsdp_config_t *shim_config(void)
{
    shim_init();
    return shim_cfg;
}

/* ---------------------------------------------------------------- registry */

shim_comm_t *shim_comm_add(shim_frontend_t fe, const void *handle, const shim_fe_ops_t *ops,
                           void *fe_state, int size, int rank)
{
    shim_init();
    shim_comm_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        /* Never pass through silently: without state the calls cannot be identified. */
        fprintf(stderr, "mfsdp: error: out of memory tracking a communicator\n");
        return NULL;
    }
    c->fe = fe;
    c->handle = handle;
    c->ops = ops;
    c->fe_state = fe_state;
    c->size = size;
    c->rank = rank;
    c->pending_group = -1;
    c->ckpt_saved = -1;
    c->ckpt_resumed = -1;
    pthread_mutex_init(&c->lock, NULL);
    /* A communicator of the manifest's world size (any, when it states none) is managed:
     * its all-gathers and reduce-scatters must all be identified. */
    c->managed = shim_status == MFSDP_OK && shim_manifest != NULL &&
                 (shim_manifest->world_size == 0 || shim_manifest->world_size == size);
    if (c->managed) {
        c->man = shim_manifest;
        c->set = &shim_settings;
    }
    pthread_mutex_lock(&comms_lock);
    c->next = comms;
    comms = c;
    if (first_rank < 0) {
        first_rank = rank;
    }
    pthread_mutex_unlock(&comms_lock);
    MFSDP_INFO(SHIM, "%s comm %p: rank %d of %d%s", fe == SHIM_MPI ? "mpi" : "nccl", handle, rank,
               size, c->managed ? ", managed" : "");
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

/* MFSDP_REPORT=1: one line per rank and remapped comm (scripts/demo-report.py parses it). */
static void report_rank(const shim_comm_t *c)
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

static mfsdp_status_t comm_release(shim_comm_t *c)
{
    pthread_mutex_lock(&c->lock);
    mfsdp_status_t st = c->failed ? c->fail_status : MFSDP_OK;
    if (c->ctx != NULL && !c->failed) {
        char msg[1024] = "";
        shim_inside = 1;
        mfsdp_log_capture_begin();
        mfsdp_status_t fs = mfsdp_ctx_flush(c->ctx);
        mfsdp_log_capture_end(msg, sizeof(msg));
        shim_inside = 0;
        if (fs != MFSDP_OK) {
            shim_fatal(c, 0, fs, "flushing the pending optimizer steps failed: %s",
                       msg[0] ? msg : mfsdp_status_string(fs));
            st = fs;
        } else if (c->reg == NULL) {
            char why[512] = "";
            shim_inside = 1;
            mfsdp_log_capture_begin();
            fs = shim_ckpt_end(c, why, sizeof(why));
            mfsdp_log_capture_end(msg, sizeof(msg));
            shim_inside = 0;
            if (fs != MFSDP_OK) {
                shim_fatal(c, 1, fs, "%s%s%s", why, msg[0] ? ": " : "", msg);
                st = fs;
            }
        }
    }
    if (c->matcher != NULL && !c->failed && c->remapped_ag + c->remapped_rs > 0) {
        char err[1024];
        if (mfsdp_matcher_end(c->matcher, err, sizeof(err)) != MFSDP_OK) {
            shim_fatal(c, 1, MFSDP_ERR_SEQUENCE, "%s", err);
            st = MFSDP_ERR_SEQUENCE;
        }
    }
    if (shim_cfg != NULL && shim_cfg->report) {
        report_rank(c);
    }
    shim_report_keep(c);
    pthread_mutex_lock(&comms_lock);
    if (pending_comm == c) {
        pending_comm = NULL;
    }
    pthread_mutex_unlock(&comms_lock);
    shim_reg_unbind(c);
    mfsdp_ctx_destroy(&c->ctx);
    mfsdp_matcher_destroy(c->matcher);
    c->matcher = NULL;
    if (c->ops->release != NULL) {
        c->ops->release(c);
    }
    shim_record_keep(c);
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_destroy(&c->lock);
    free(c);
    return st;
}

mfsdp_status_t shim_comm_remove(shim_comm_t *c)
{
    if (c == NULL) {
        return MFSDP_OK;
    }
    pthread_mutex_lock(&comms_lock);
    for (shim_comm_t **p = &comms; *p != NULL; p = &(*p)->next) {
        if (*p == c) {
            *p = c->next;
            break;
        }
    }
    pthread_mutex_unlock(&comms_lock);
    return comm_release(c);
}

void shim_comm_abandon(shim_comm_t *c)
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
    if (pending_comm == c) {
        pending_comm = NULL;
    }
    pthread_mutex_unlock(&comms_lock);
    if (pthread_mutex_trylock(&c->lock) != 0) {
        /* A remapped call is in progress on another thread: nothing of c may be touched. */
        if (!shim_quiet()) {
            fprintf(stderr,
                    "mfsdp: warning on rank %d of %d: the communicator was aborted during a "
                    "remapped call; mfsdp drops its state without flushing or saving it\n",
                    c->rank, c->size);
        }
        return;
    }
    shim_ckpt_fail_unsaved(c, "the communicator was aborted (ncclCommAbort) before its final "
                              "checkpoint, and an aborted communicator runs no collective");
    if (!c->failed && c->ctx != NULL && c->remapped_rs > 0 && !shim_quiet()) {
        MFSDP_INFO(SHIM, "comm %p aborted: pending optimizer steps, if any, are dropped",
                   c->handle);
    }
    shim_report_keep(c);
    shim_record_keep(c);
    shim_reg_unbind(c);
    pthread_mutex_unlock(&c->lock);
    /* c and its context stay allocated: destroying the context could join a checkpoint write,
     * which is collective, and a thread that raced the abort may still hold c. */
}

int shim_finalize_all(int world_rank)
{
    finalized_once = 1;
    /* In creation order (the list is newest first): every rank frees alike. */
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
    shim_record_write(world_rank);
    return shim_report_exit(world_rank);
}

/* ---------------------------------------------------------------- agreement */

static int agree_u64(void *arg, uint64_t *buf, size_t n, int is_max)
{
    shim_comm_t *c = arg;
    return c->ops->allreduce_u64(c, buf, n, is_max);
}

static int agree_gather(void *arg, const void *mine, size_t bytes, void *all)
{
    shim_comm_t *c = arg;
    return c->ops->allgather(c, mine, bytes, all);
}

/* Compare this comm's settings across its ranks before deciding anything about its first
 * call: every rank is inside this same collective call, so the exchange cannot hang. Returns
 * 0 and fails the comm on a difference. */
static int comm_agree(shim_comm_t *c, const shim_tag_t *tag, const shim_call_t *call)
{
    c->agreed = 1;
    mfsdp_fp_item_t items[MFSDP_FP_MAX];
    const mfsdp_manifest_t *m = shim_manifest;
    shim_reg_t *reg = tag != NULL ? shim_reg_find(tag->id) : NULL;
    if (reg != NULL) {
        m = reg->manifest;
    }
    size_t n = mfsdp_settings_fingerprint(m, c->size, shim_cfg, items);
    char mode[64];
    snprintf(mode, sizeof(mode), "%s, status %d",
             shim_status != MFSDP_OK ? "misconfigured"
             : tag != NULL           ? "tagged"
             : shim_recording()      ? "recording"
             : shim_manifest         ? "sequence"
                                     : "pass-through",
             (int)shim_status);
    if (n < MFSDP_FP_MAX) {
        mfsdp_fp_item_set(&items[n++], "the shim's mode", mode);
    }
    char first[64];
    snprintf(first, sizeof(first), "%s%s", call->kind == SHIM_ALLGATHER ? "allgather" : "reduce",
             tag != NULL ? " (tagged)" : "");
    if (tag != NULL) {
        snprintf(first, sizeof(first), "tag kind %d group %zu", tag->kind, tag->group);
    }
    if (n < MFSDP_FP_MAX) {
        mfsdp_fp_item_set(&items[n++], "the first call's tag", first);
    }
    mfsdp_agree_ops_t ops = {agree_u64, agree_gather, c, c->rank, c->size};
    char err[1024];
    mfsdp_status_t st = mfsdp_settings_agree(items, n, &ops, err, sizeof(err));
    if (st != MFSDP_OK) {
        if (shim_status != MFSDP_OK) {
            /* This rank's own configuration is bad: its reason, not only that it differs. */
            shim_fatal(c, 0, shim_status, "%s", shim_err);
        } else {
            shim_fatal(c, st == MFSDP_ERR_MISMATCH, st, "%s", err);
        }
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- execution */

static int agreed_status(mfsdp_status_t st)
{
    /* Errors every rank reaches alike (they depend only on rank-identical arguments). Not
     * MFSDP_ERR_INVALID_ARG: the runtime's buffer checks (null, overlapping, in place) depend on
     * each rank's pointers, so that rank says it itself. */
    return st == MFSDP_ERR_MISMATCH || st == MFSDP_ERR_CONFIG || st == MFSDP_ERR_UNSUPPORTED ||
           st == MFSDP_ERR_SEQUENCE || st == MFSDP_ERR_STATE || st == MFSDP_ERR_MEM_LIMIT;
}

static const char *kind_word(shim_kind_t k)
{
    return k == SHIM_ALLGATHER        ? "all-gather"
           : k == SHIM_REDUCE_SCATTER ? "reduce-scatter"
                                      : "all-reduce";
}

/* Whether a job resumed from a checkpoint taken at sequence position pos continues there: a
 * fresh matcher starts at position 0 and can skip optional calls only. */
static int restart_point(size_t pos)
{
    for (size_t k = 0; k < pos && k < shim_manifest->ncalls; k++) {
        if (!(shim_manifest->sequence[k].flags & MFSDP_CALL_OPTIONAL)) {
            return 0;
        }
    }
    return 1;
}

/* What a tagged state exchange is called in messages. */
static const char *sync_word(int kind)
{
    return kind == MFSDP_SHIM_TAG_SYNC            ? "weight write-back"
           : kind == MFSDP_SHIM_TAG_SYNC_MOMENTUM ? "momentum export"
                                                  : "momentum import";
}

/* Remap one identified call on c (its lock held). sync: 0, or the tag kind of a tagged state
 * exchange (MFSDP_SHIM_TAG_SYNC, _SYNC_MOMENTUM, _LOAD_MOMENTUM) that the all-gather stands for.
 * iter_start: the call is the first of an iteration (1), is not (0), unknown (-1). */
static shim_result_t execute(shim_comm_t *c, size_t group, const unsigned char *has_grad,
                             const shim_call_t *call, int tagged, int sync, int iter_start,
                             mfsdp_status_t *st_p)
{
    char msg[1024] = "";
    mfsdp_status_t st = MFSDP_OK;
    const char *gname = c->man->groups[group].name;
    mfsdp_redop_t op = call->op;
    double scalar = call->scalar, post = 1.0;
    if (call->kind == SHIM_REDUCE_SCATTER) {
        if (!call->op_supported) {
            shim_fatal(c, 1, MFSDP_ERR_UNSUPPORTED,
                       "the reduce-scatter of group %s uses op %s, which mfsdp cannot apply on "
                       "owners (sum, avg and a PreMulSum with a host scalar are supported)",
                       gname, call->op_name ? call->op_name : "?");
            *st_p = MFSDP_ERR_UNSUPPORTED;
            return SHIM_ERROR;
        }
        char err[512];
        st = mfsdp_divide_resolve(c->set->divide, c->set->divide_factor, call->dtype,
                                  c->size * (c->man->replicate > 1 ? c->man->replicate : 1),
                                  call->op, call->scalar, &op, &scalar, &post, err, sizeof(err));
        if (st != MFSDP_OK) {
            shim_fatal(c, 1, st, "reduce-scatter of group %s: %s", gname, err);
            *st_p = st;
            return SHIM_ERROR;
        }
    }
    int created = 0;
    shim_inside = 1;
    mfsdp_log_capture_begin();
    if (c->ctx == NULL) {
        /* Collective over the comm: every rank reaches this on the same call, because the
         * decisions above depend only on rank-identical arguments. */
        mfsdp_ctx_opts_t o;
        memset(&o, 0, sizeof(o));
        if (tagged) {
            o.has_step_mode = 1;
            o.step_mode = MFSDP_STEP_MANUAL; /* the job's optimizer.step() runs it */
        }
        st = c->ops->ctx_create(c, c->man, &o, &c->ctx);
        created = st == MFSDP_OK;
    }
    if (st == MFSDP_OK) {
        /* Everything this call enqueues goes on its stream (docs/design.md, "Identification"). */
        st = mfsdp_ctx_set_stream(c->ctx, call->stream);
    }
    char why[512] = ""; /* a checkpoint step's failure */
    int ck = 0;
    if (st == MFSDP_OK && created && !tagged) {
        ck = 1;
        st = shim_ckpt_start(c, why, sizeof(why));
    }
    if (st == MFSDP_OK && sync) {
        /* this rank's block of the output (write-backs), the input (the momentum import) */
        float *mine = (float *)((char *)call->recv + (size_t)c->rank * call->count * sizeof(float));
        st = sync == MFSDP_SHIM_TAG_SYNC
                 ? mfsdp_ctx_scatter_masters(c->ctx, group, mine, call->count)
             : sync == MFSDP_SHIM_TAG_SYNC_MOMENTUM
                 ? mfsdp_ctx_scatter_momentum(c->ctx, group, mine, call->count)
                 : mfsdp_ctx_gather_momentum(c->ctx, group, (const float *)call->send, call->count);
    } else if (st == MFSDP_OK && call->kind == SHIM_ALLGATHER) {
        st = mfsdp_ctx_allgather(c->ctx, group, call->send, call->recv, call->count, call->dtype);
        if (st == MFSDP_OK && !tagged) {
            ck = 1;
            st = shim_ckpt_after_allgather(c, iter_start, why, sizeof(why));
        }
    } else if (st == MFSDP_OK) {
        st = mfsdp_ctx_reduce_params(c->ctx, group, has_grad, call->send, call->recv, call->count,
                                     call->dtype, op, scalar, post);
    }
    mfsdp_log_capture_end(msg, sizeof(msg));
    shim_inside = 0;
    if (st != MFSDP_OK && ck && why[0]) {
        shim_fatal(c, 1, st, "%s: %s", why, msg[0] ? msg : mfsdp_status_string(st));
        *st_p = st;
        return SHIM_ERROR;
    }
    if (st != MFSDP_OK) {
        shim_fatal(c, agreed_status(st), st, "the remapped %s of group %s failed: %s",
                   sync ? sync_word(sync) : kind_word(call->kind), gname,
                   msg[0] ? msg : mfsdp_status_string(st));
        *st_p = st;
        return SHIM_ERROR;
    }
    if (call->kind == SHIM_ALLGATHER) {
        c->remapped_ag++;
    } else {
        c->remapped_rs++;
        /* Its replicate all-reduce (HSDP) may follow on another communicator. */
        c->pending_group = (long)group;
        c->pending_count = call->count;
        c->pending_dtype = call->dtype;
        pthread_mutex_lock(&comms_lock);
        pending_comm = c;
        pthread_mutex_unlock(&comms_lock);
    }
    pthread_mutex_lock(&comms_lock);
    remapped_total++;
    pthread_mutex_unlock(&comms_lock);
    *st_p = MFSDP_OK;
    return SHIM_DONE;
}

/* A call the companion tagged. */
static shim_result_t tagged_call(shim_comm_t *c, const shim_tag_t *tag, const shim_call_t *call,
                                 mfsdp_status_t *st_p)
{
    shim_reg_t *reg = shim_reg_find(tag->id);
    /* the state exchanges are the kinds from SYNC on (mfsdp_shim_tag checked the range) */
    int sync = tag->kind >= MFSDP_SHIM_TAG_SYNC ? tag->kind : 0;
    int want_ag = tag->kind == MFSDP_SHIM_TAG_ALLGATHER || sync;
    char err[1024];
    if (reg == NULL || (want_ag != (call->kind == SHIM_ALLGATHER)) ||
        tag->kind == MFSDP_SHIM_TAG_REPLICATE) {
        shim_fatal(c, 1, MFSDP_ERR_MISMATCH, "a %s was tagged as %s", kind_word(call->kind),
                   reg == NULL                             ? "belonging to an unregistered manifest"
                   : tag->kind == MFSDP_SHIM_TAG_REPLICATE ? "a replicate all-reduce"
                   : want_ag                               ? "an all-gather"
                                                           : "a reduce-scatter");
        *st_p = MFSDP_ERR_MISMATCH;
        return SHIM_ERROR;
    }
    if (c->reg == NULL) {
        if (reg->comm != NULL && reg->comm != c) {
            shim_fatal(c, 1, MFSDP_ERR_MISMATCH,
                       "manifest %d is bound to another communicator; tag each FSDP process "
                       "group with its own registration",
                       tag->id);
            *st_p = MFSDP_ERR_MISMATCH;
            return SHIM_ERROR;
        }
        if (reg->spent) {
            /* Its owners' weights and optimizer state went with that communicator; a new one
             * would start from the job's shards, which do not hold them. */
            shim_fatal(c, 1, MFSDP_ERR_STATE,
                       "manifest %d was bound to a communicator that trained and was then "
                       "destroyed or aborted; the owners' weights and optimizer state went with "
                       "it, so a new communicator cannot take the registration over (register "
                       "the model again, from weights the job holds)",
                       tag->id);
            *st_p = MFSDP_ERR_STATE;
            return SHIM_ERROR;
        }
        if (reg->manifest->world_size != 0 && reg->manifest->world_size != c->size) {
            shim_fatal(c, 1, MFSDP_ERR_MISMATCH,
                       "the registered manifest is for %d ranks; the tagged call runs on %d",
                       reg->manifest->world_size, c->size);
            *st_p = MFSDP_ERR_MISMATCH;
            return SHIM_ERROR;
        }
        mfsdp_matcher_destroy(reg->matcher); /* an earlier binding's, if any */
        reg->matcher = NULL;
        mfsdp_status_t st =
            mfsdp_matcher_create(reg->manifest, c->size, err, sizeof(err), &reg->matcher);
        if (st == MFSDP_ERR_UNSUPPORTED) { /* identical blocks: fine when tagged */
            st = MFSDP_OK;
        }
        if (st != MFSDP_OK) {
            shim_fatal(c, 1, st, "%s", err);
            *st_p = st;
            return SHIM_ERROR;
        }
        reg->comm = c;
        c->reg = reg;
        c->man = reg->manifest;
        c->set = &reg->settings;
    }
    if (c->reg != reg) {
        shim_fatal(c, 1, MFSDP_ERR_MISMATCH,
                   "a call tagged with manifest %d on a communicator bound to manifest %d", tag->id,
                   c->reg->id);
        *st_p = MFSDP_ERR_MISMATCH;
        return SHIM_ERROR;
    }
    const unsigned char *mask = tag->has_mask ? tag->mask : NULL;
    if (sync) {
        size_t elems = 0; /* the group's FSDP shard in fp32 elements */
        const mfsdp_group_desc_t *gd = &reg->manifest->groups[tag->group];
        for (size_t i = 0; i < gd->nparams; i++) {
            int64_t rest = gd->params[i].numel / gd->params[i].shape[0];
            elems += (size_t)(((gd->params[i].shape[0] + c->size - 1) / c->size) * rest);
        }
        if (call->dtype != MFSDP_FLOAT32 || call->count != elems) {
            shim_fatal(c, 1, MFSDP_ERR_MISMATCH,
                       "the %s of group %s must be a float32 all-gather of %zu elements, got "
                       "%zu of %s",
                       sync_word(sync), gd->name, elems, call->count,
                       mfsdp_dtype_name(call->dtype));
            *st_p = MFSDP_ERR_MISMATCH;
            return SHIM_ERROR;
        }
    } else if (reg->matcher != NULL) {
        mfsdp_call_sig_t sig = {call->kind == SHIM_ALLGATHER ? MFSDP_CALL_ALLGATHER
                                                             : MFSDP_CALL_REDUCE_SCATTER,
                                call->count, call->dtype};
        mfsdp_status_t st =
            mfsdp_matcher_check_tag(reg->matcher, &sig, tag->group, mask, err, sizeof(err));
        if (st != MFSDP_OK) {
            shim_fatal(c, 1, st, "%s", err);
            *st_p = st;
            return SHIM_ERROR;
        }
    }
    return execute(c, tag->group, mask, call, 1, sync, 0, st_p);
}

/* A call on a communicator of another size than the manifest's: passed through, unless the
 * job has made an iteration's worth of calls and none was remapped (a wrong world_size, a
 * manifest of another model): then it stops. */
static shim_result_t unmanaged_call(shim_comm_t *c, mfsdp_status_t *st_p)
{
    pthread_mutex_lock(&comms_lock);
    int stop = remapped_total == 0 && calls_total >= shim_iter_calls;
    uint64_t seen = calls_total;
    pthread_mutex_unlock(&comms_lock);
    if (!stop) {
        c->passed++;
        return SHIM_PASS;
    }
    shim_fatal(c, 1, MFSDP_ERR_MISMATCH,
               "the manifest %s is for %d ranks but the job's all-gathers and reduce-scatters "
               "run on a communicator of %d: %llu calls and none remapped, so nothing would be "
               "trained by mfsdp (write the manifest at the job's world size, or drop "
               "\"world_size\")",
               shim_cfg->manifest, shim_manifest->world_size, c->size, (unsigned long long)seen);
    *st_p = MFSDP_ERR_MISMATCH;
    return SHIM_ERROR;
}

/* Stop the job: a call that would be remapped was issued inside a group the job opened. */
static shim_result_t group_refusal(shim_comm_t *c, const shim_call_t *call, const char *gname,
                                   mfsdp_status_t *st_p)
{
    shim_fatal(c, 1, MFSDP_ERR_UNSUPPORTED,
               "a%s %s%s%s (count %zu) that mfsdp would remap was issued inside a group the job "
               "opened (ncclGroupStart/ncclGroupEnd), which defers it to the group's end; "
               "mfsdp's owner collectives need each of their own groups to launch before the "
               "local work that follows it, so they cannot run there: issue FSDP's "
               "all-gathers, reduce-scatters and replicate all-reduces outside NCCL groups (no "
               "coalescing manager, no *_coalesced collectives)",
               call->kind == SHIM_REDUCE_SCATTER ? "" : "n", kind_word(call->kind),
               gname != NULL ? " of group " : "", gname != NULL ? gname : "", call->count);
    *st_p = MFSDP_ERR_UNSUPPORTED;
    return SHIM_ERROR;
}

/* A call inside a group the job keeps open: it runs only at the job's group end, so it cannot
 * be remapped (the runtime's groups and the local work between them would run before it).
 * Decided without the agreement, which is a collective the open group would defer too, from
 * the same rank-identical state as shim_dispatch: a call that would pass through passes (and
 * is recorded), one that would be remapped or refused stops the job. */
static shim_result_t grouped_call(shim_comm_t *c, int tagged, const shim_call_t *call,
                                  mfsdp_status_t *st_p)
{
    if (c->failed) {
        *st_p = c->fail_status;
        return SHIM_ERROR;
    }
    if (shim_status != MFSDP_OK) { /* no agreement ran: this rank says why itself */
        shim_fatal(c, 0, shim_status, "%s", shim_err);
        *st_p = shim_status;
        return SHIM_ERROR;
    }
    if (!tagged && c->reg == NULL) {
        if (shim_recording()) {
            shim_record_call(c, call);
            c->passed++;
            return SHIM_PASS;
        }
        if (shim_manifest == NULL) {
            c->passed++;
            return SHIM_PASS;
        }
        if (!c->managed) {
            return unmanaged_call(c, st_p);
        }
    }
    return group_refusal(c, call, NULL, st_p);
}

shim_result_t shim_dispatch(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p)
{
    *st_p = MFSDP_OK;
    if (c == NULL) {
        return SHIM_PASS;
    }
    shim_result_t res = SHIM_PASS;
    pthread_mutex_lock(&c->lock);
    shim_tag_t tag;
    int tagged = shim_tag_take(&tag);
    c->calls++;
    pthread_mutex_lock(&comms_lock);
    calls_total++;
    if (pending_comm == c) {
        pending_comm = NULL; /* the next call on the shard comm: no replicate came */
    }
    pthread_mutex_unlock(&comms_lock);
    c->stream = call->stream; /* the front-end's exchanges below run on it */
    if (call->in_group) {
        res = grouped_call(c, tagged, call, st_p);
        goto out;
    }
    if (!c->agreed && !comm_agree(c, tagged ? &tag : NULL, call)) {
        res = SHIM_ERROR;
        *st_p = c->fail_status;
        goto out;
    }
    if (c->failed) {
        *st_p = c->fail_status; /* the first error was printed */
        res = SHIM_ERROR;
        goto out;
    }
    if (shim_status != MFSDP_OK) {
        shim_fatal(c, 1, shim_status, "%s", shim_err);
        *st_p = shim_status;
        res = SHIM_ERROR;
        goto out;
    }
    if (tagged) {
        res = tagged_call(c, &tag, call, st_p);
        goto out;
    }
    if (c->reg != NULL) {
        shim_fatal(c, 1, MFSDP_ERR_STATE,
                   "an untagged %s (count %zu, %s) on a communicator the PyTorch companion tags: "
                   "it did not see this collective (an FSDP2 version or code path it does not "
                   "hook?); refusing it rather than guessing its group",
                   kind_word(call->kind), call->count,
                   call->dtype_known ? mfsdp_dtype_name(call->dtype) : "another dtype");
        *st_p = MFSDP_ERR_STATE;
        res = SHIM_ERROR;
        goto out;
    }
    if (shim_recording()) {
        shim_record_call(c, call);
        c->passed++;
        goto out;
    }
    if (shim_manifest == NULL) {
        c->passed++;
        goto out;
    }
    if (!c->managed) {
        res = unmanaged_call(c, st_p);
        goto out;
    }
    if (!call->dtype_known) {
        shim_fatal(c, call->local_why == NULL, MFSDP_ERR_SEQUENCE,
                   "a %s of count %zu %s on the managed communicator (its all-gathers and "
                   "reduce-scatters must all be FSDP's)",
                   kind_word(call->kind), call->count,
                   call->local_why != NULL ? call->local_why
                                           : "in a datatype mfsdp does not handle");
        *st_p = MFSDP_ERR_SEQUENCE;
        res = SHIM_ERROR;
        goto out;
    }
    char err[1024];
    mfsdp_status_t st = MFSDP_OK;
    if (c->matcher == NULL) {
        st = mfsdp_matcher_create(shim_manifest, c->size, err, sizeof(err), &c->matcher);
    }
    mfsdp_match_t match;
    mfsdp_call_sig_t sig = {call->kind == SHIM_ALLGATHER ? MFSDP_CALL_ALLGATHER
                                                         : MFSDP_CALL_REDUCE_SCATTER,
                            call->count, call->dtype};
    if (st == MFSDP_OK) {
        st = mfsdp_matcher_next(c->matcher, &sig, &match, err, sizeof(err));
    }
    if (st != MFSDP_OK) {
        shim_fatal(c, 1, st, "%s", err);
        *st_p = st;
        res = SHIM_ERROR;
        goto out;
    }
    res =
        execute(c, match.group, call->kind == SHIM_REDUCE_SCATTER ? match.has_grad : NULL, call, 0,
                0, match.position == MFSDP_GROUP_NONE ? -1 : restart_point(match.position), st_p);
out:
    pthread_mutex_unlock(&c->lock);
    return res;
}

/* ---------------------------------------------------------------- HSDP all-reduces */

shim_result_t shim_allreduce(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p)
{
    *st_p = MFSDP_OK;
    shim_tag_t tag;
    int tagged = shim_tag_take(&tag);
    shim_comm_t *p = NULL;
    if (tagged) {
        shim_reg_t *reg = shim_reg_find(tag.id);
        if (reg == NULL || tag.kind != MFSDP_SHIM_TAG_REPLICATE || reg->comm == NULL) {
            if (c != NULL) {
                shim_fatal(c, 1, MFSDP_ERR_MISMATCH, "an all-reduce was tagged as %s",
                           tag.kind != MFSDP_SHIM_TAG_REPLICATE ? "something else than the "
                                                                  "replicate all-reduce"
                                                                : "the replicate all-reduce of "
                                                                  "a manifest with no call yet");
            }
            *st_p = MFSDP_ERR_MISMATCH;
            return SHIM_ERROR;
        }
        p = reg->comm;
    } else {
        pthread_mutex_lock(&comms_lock);
        p = pending_comm;
        pthread_mutex_unlock(&comms_lock);
        if (p == NULL || p == c || c == NULL || !call->dtype_known ||
            call->count != p->pending_count || call->dtype != p->pending_dtype) {
            return SHIM_PASS; /* not the all-reduce of a reduce-scatter's output */
        }
    }
    if (c == NULL) {
        return SHIM_PASS;
    }
    pthread_mutex_lock(&p->lock);
    shim_result_t res = SHIM_DONE;
    long group = p->pending_group;
    if (p->failed) {
        *st_p = p->fail_status;
        res = SHIM_ERROR;
        goto out;
    }
    if (p->man->replicate <= 1) {
        if (c->size == 1 && !tagged) {
            res = SHIM_PASS; /* a one-rank replicate group: a no-op, as FSDP2 issues it */
            goto out;
        }
        shim_fatal_mesh(p, c, MFSDP_ERR_UNSUPPORTED,
                        "an all-reduce of group %s's reduce-scatter output (count %zu) over a "
                        "communicator of %d ranks: this is HSDP, but the manifest declares no "
                        "\"replicate\"; replicas would step on different gradients and drift apart "
                        "(declare \"replicate\": %d)",
                        group >= 0 ? p->man->groups[group].name : "?", call->count, c->size,
                        c->size);
        *st_p = MFSDP_ERR_UNSUPPORTED;
        res = SHIM_ERROR;
        goto out;
    }
    if (group < 0 || (tagged && (size_t)group != tag.group)) {
        shim_fatal(p, 1, MFSDP_ERR_SEQUENCE,
                   "a replicate all-reduce of group %s with no reduce-scatter of it before",
                   tagged ? p->man->groups[tag.group].name : "?");
        *st_p = MFSDP_ERR_SEQUENCE;
        res = SHIM_ERROR;
        goto out;
    }
    if (call->in_group) {
        res = group_refusal(p, call, p->man->groups[group].name, st_p);
        goto out;
    }
    char msg[1024] = "";
    shim_inside = 1;
    mfsdp_log_capture_begin();
    /* The replicate all-reduce's own stream (FSDP2's all_reduce_stream): its work goes there. */
    mfsdp_status_t st = mfsdp_ctx_set_stream(p->ctx, call->stream);
    if (st == MFSDP_OK && !p->replicate_attached) {
        /* Collective over the replicate comm: its ranks are all in this all-reduce. */
        st = c->ops->attach_replicate != NULL ? c->ops->attach_replicate(p->ctx, c)
                                              : MFSDP_ERR_UNSUPPORTED;
        p->replicate_attached = st == MFSDP_OK;
    }
    if (!call->op_supported) {
        st = MFSDP_ERR_UNSUPPORTED;
        snprintf(msg, sizeof(msg), "op %s cannot be applied on owners", call->op_name);
    } else if (st == MFSDP_OK) {
        st = mfsdp_ctx_replicate(p->ctx, (size_t)group, call->send, call->recv, call->count,
                                 call->dtype, call->op, call->scalar);
    }
    mfsdp_log_capture_end(msg, sizeof(msg));
    shim_inside = 0;
    if (st != MFSDP_OK) {
        shim_fatal(p, agreed_status(st), st, "the replicate all-reduce of group %s failed: %s",
                   p->man->groups[group].name, msg[0] ? msg : mfsdp_status_string(st));
        *st_p = st;
        res = SHIM_ERROR;
        goto out;
    }
    p->pending_group = -1;
    c->remapped_ar++;
    pthread_mutex_lock(&comms_lock);
    if (pending_comm == p) {
        pending_comm = NULL;
    }
    pthread_mutex_unlock(&comms_lock);
out:
    pthread_mutex_unlock(&p->lock);
    return res;
}
