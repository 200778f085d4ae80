/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Checkpoints of an unmodified job (sequence mode): MFSDP_CKPT_DIR, MFSDP_CKPT_EVERY,
 * MFSDP_CKPT_KEEP, MFSDP_RESUME and MFSDP_INIT (docs/checkpoints.md "Under the shim").
 *
 *  - start: when the comm's context is created (its first remapped call, every rank in it),
 *    load MFSDP_RESUME (a checkpoint; 'auto': MFSDP_CKPT_DIR's latest if there is one) or
 *    MFSDP_INIT (full weights); the job's own first all-gather shards are then ignored;
 *  - every MFSDP_CKPT_EVERY optimizer steps: after the all-gather that opens an iteration
 *    (the manifest sequence's first call; without a sequence, any all-gather that finds every
 *    trainable group at the same step count: in FSDP2's backward, all-gathers run while some
 *    groups have stepped and others not), when no accumulation window is open and the step
 *    count is a multiple, save (the write runs in the background; the next save or the end
 *    waits for it);
 *  - end: when the communicator is released (MPI_Finalize, ncclCommDestroy) without an
 *    error, save the last step if it is not saved yet, wait for the commit, prune;
 *  - HSDP: the replicas hold the same state; only replica 0 saves.
 * Every decision depends on the calls made and on settings the ranks agreed on, so every
 * rank of the comm takes it alike (a save is collective).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/ckpt_index.h"
#include "core/log.h"
#include "ld_preload/shim.h"
#include "mfsdp/checkpoint.h"
#include "runtime/checkpoint.h"

/* Set when a checkpoint variable is given. */
int shim_ckpt_enabled(const mfsdp_config_t *cfg)
{
    return cfg != NULL &&
           ((cfg->ckpt_dir_set && cfg->ckpt_dir[0] != '\0') ||
            (cfg->resume_set && cfg->resume[0] != '\0') ||
            (cfg->init_set && cfg->init[0] != '\0') || cfg->ckpt_every_set || cfg->ckpt_keep_set);
}

mfsdp_status_t shim_ckpt_check_config(const mfsdp_config_t *cfg, const mfsdp_settings_t *set,
                                      char *err, size_t errlen)
{
    int dir = cfg->ckpt_dir_set && cfg->ckpt_dir[0] != '\0';
    int resume = cfg->resume_set && cfg->resume[0] != '\0';
    int init = cfg->init_set && cfg->init[0] != '\0';
    int is_auto = resume && strcmp(cfg->resume, "auto") == 0;
    if (!shim_ckpt_enabled(cfg)) {
        return MFSDP_OK;
    }
    if ((cfg->ckpt_every_set || cfg->ckpt_keep_set) && !dir) {
        snprintf(err, errlen, "%s is set but MFSDP_CKPT_DIR is not: no checkpoint would be written",
                 cfg->ckpt_every_set ? "MFSDP_CKPT_EVERY" : "MFSDP_CKPT_KEEP");
        return MFSDP_ERR_CONFIG;
    }
    if (is_auto && !dir) {
        snprintf(err, errlen,
                 "MFSDP_RESUME=auto needs MFSDP_CKPT_DIR (the root whose latest "
                 "checkpoint it resumes)");
        return MFSDP_ERR_CONFIG;
    }
    if (resume && !is_auto && init) {
        snprintf(err, errlen,
                 "MFSDP_RESUME=%s and MFSDP_INIT=%s are both set: a resumed job takes its weights "
                 "from the checkpoint (MFSDP_RESUME=auto with MFSDP_INIT starts from MFSDP_INIT "
                 "only when there is no checkpoint yet)",
                 cfg->resume, cfg->init);
        return MFSDP_ERR_CONFIG;
    }
    if (set->tail == MFSDP_TAIL_JOB) {
        snprintf(err, errlen,
                 "checkpoint variables with tail \"job\": the job's optimizer holds the AdamW "
                 "tensors, so an mfsdp checkpoint would miss them (use tail owner, shard or "
                 "auto, or checkpoint in the job)");
        return MFSDP_ERR_CONFIG;
    }
    return MFSDP_OK;
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* The context was just created on every rank of c: load what the variables name. */
mfsdp_status_t shim_ckpt_start(shim_comm_t *c, char *msg, size_t msglen)
{
    const mfsdp_config_t *cfg = shim_config();
    c->ckpt_saved = -1;
    if (!shim_ckpt_enabled(cfg)) {
        return MFSDP_OK;
    }
    const char *resume = cfg->resume_set && cfg->resume[0] ? cfg->resume : NULL;
    const char *init = cfg->init_set && cfg->init[0] ? cfg->init : NULL;
    mfsdp_status_t st = mfsdp_ckpt_ctx_supported(c->ctx); /* the same on every rank */
    if (st != MFSDP_OK) {
        snprintf(msg, msglen, "the checkpoint variables cannot be honoured");
        return st;
    }
    if (resume != NULL && strcmp(resume, "auto") == 0) {
        /* Rank-local filesystem view: the ranks agree on it below (a load is collective). */
        char latest[4096];
        snprintf(latest, sizeof(latest), "%s/" MFSDP_CKPT_LATEST_NAME, cfg->ckpt_dir);
        uint64_t have = exists(latest), lo = have, hi = have;
        if (c->ops->allreduce_u64(c, &lo, 1, 0) != 0 || c->ops->allreduce_u64(c, &hi, 1, 1) != 0) {
            snprintf(msg, msglen, "MFSDP_RESUME=auto: the ranks could not agree on %s", latest);
            return MFSDP_ERR_TRANSPORT;
        }
        if (lo != hi) {
            snprintf(msg, msglen,
                     "MFSDP_RESUME=auto: %s exists on some ranks and not on others (MFSDP_CKPT_DIR "
                     "must be a filesystem every rank sees)",
                     latest);
            return MFSDP_ERR_MISMATCH;
        }
        resume = have ? cfg->ckpt_dir : NULL;
        if (!have) {
            MFSDP_INFO(SHIM, "MFSDP_RESUME=auto: no checkpoint in %s yet, starting fresh%s",
                       cfg->ckpt_dir, init ? " from MFSDP_INIT" : "");
        }
    }
    if (resume != NULL) {
        st = mfsdp_ctx_load(c->ctx, resume);
        if (st == MFSDP_OK) {
            mfsdp_ckpt_stats_t s;
            mfsdp_ctx_get_ckpt_stats(c->ctx, &s);
            c->ckpt_saved = s.step; /* the loaded step needs no save of its own */
            c->ckpt_resumed = s.step;
            if (c->rank == 0 && !shim_quiet()) {
                fprintf(stderr, "mfsdp: resumed from %s at step %lld\n", resume, (long long)s.step);
            }
        } else {
            snprintf(msg + strlen(msg), msglen - strlen(msg),
                     "%sMFSDP_RESUME=%s could not be loaded", msg[0] ? "; " : "", cfg->resume);
        }
    } else if (init != NULL) {
        st = mfsdp_ctx_load_full(c->ctx, init);
        if (st != MFSDP_OK) {
            snprintf(msg + strlen(msg), msglen - strlen(msg), "%sMFSDP_INIT=%s could not be loaded",
                     msg[0] ? "; " : "", init);
        }
    }
    return st;
}

static int is_step_dir(const char *name)
{
    if (strncmp(name, "step-", 5) != 0 || strstr(name, ".partial") != NULL) {
        return 0;
    }
    for (const char *p = name + 5; *p; p++) {
        if ((*p < '0' || *p > '9') && *p != '-') {
            return 0;
        }
    }
    return 1;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Delete committed checkpoints of root beyond the newest `keep` (never the one latest names).
 * Names sort by step: step-SSSSSSSS with zero padding, a "-K" suffix after its base. */
static void prune(const char *root, long keep)
{
    DIR *d = opendir(root);
    if (d == NULL) {
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!is_step_dir(e->d_name)) {
            continue;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nn = realloc(names, cap * sizeof(*names));
            if (nn == NULL) {
                break;
            }
            names = nn;
        }
        names[n] = strdup(e->d_name);
        n += names[n] != NULL;
    }
    closedir(d);
    char latest[4096], cur[256] = "";
    snprintf(latest, sizeof(latest), "%s/" MFSDP_CKPT_LATEST_NAME, root);
    FILE *f = fopen(latest, "r");
    if (f != NULL) {
        if (fgets(cur, sizeof(cur), f) == NULL) {
            cur[0] = '\0';
        }
        fclose(f);
        cur[strcspn(cur, " \t\n")] = '\0';
    }
    if (names != NULL) {
        qsort(names, n, sizeof(*names), cmp_names);
    }
    for (size_t i = 0; i + (size_t)keep < n; i++) {
        if (strcmp(names[i], cur) == 0) {
            continue;
        }
        char dir[4096], path[8192];
        snprintf(dir, sizeof(dir), "%s/%s", root, names[i]);
        DIR *dd = opendir(dir);
        while (dd != NULL && (e = readdir(dd)) != NULL) {
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
                snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
                unlink(path);
            }
        }
        if (dd != NULL) {
            closedir(dd);
        }
        if (rmdir(dir) == 0) {
            MFSDP_INFO(SHIM, "MFSDP_CKPT_KEEP=%ld: removed %s", keep, dir);
        } else {
            MFSDP_WARN("MFSDP_CKPT_KEEP=%ld: cannot remove %s: %s", keep, dir, strerror(errno));
        }
    }
    for (size_t i = 0; i < n; i++) {
        free(names[i]);
    }
    free(names);
}

/* HSDP: 1 when this shard group is replica 0 (and the ranks of c agree on their replica). */
static mfsdp_status_t replica_zero(shim_comm_t *c, int *is_zero, char *msg, size_t msglen)
{
    *is_zero = 1;
    if (c->man->replicate <= 1) {
        return MFSDP_OK;
    }
    int r = mfsdp_ckpt_ctx_replica(c->ctx);
    uint64_t lo = r < 0 ? UINT64_MAX : (uint64_t)r, hi = lo;
    if (c->ops->allreduce_u64(c, &lo, 1, 0) != 0 || c->ops->allreduce_u64(c, &hi, 1, 1) != 0) {
        snprintf(msg, msglen, "the ranks could not agree on their replica");
        return MFSDP_ERR_TRANSPORT;
    }
    if (lo != hi || lo == UINT64_MAX) {
        snprintf(msg, msglen,
                 "HSDP: the ranks of a shard group are not the same replica (%s); cannot pick "
                 "which replica saves",
                 lo == UINT64_MAX ? "no replicate all-reduce seen yet" : "replica indices differ");
        return MFSDP_ERR_STATE;
    }
    *is_zero = lo == 0;
    return MFSDP_OK;
}

/* Save now if due (at_end: the last step, unless saved). c's lock held, c->ctx live.
 * iter_start as for shim_ckpt_after_allgather(). */
static mfsdp_status_t save_if_due(shim_comm_t *c, int at_end, int iter_start, char *msg,
                                  size_t msglen)
{
    const mfsdp_config_t *cfg = shim_config();
    /* Only where a resumed job's fresh matcher can pick the sequence up (iter_start 1: position
     * 0, or a position after optional calls only), or without a sequence (-1). */
    if (!(cfg->ckpt_dir_set && cfg->ckpt_dir[0] != '\0') || iter_start == 0) {
        return MFSDP_OK;
    }
    int64_t step;
    if (!mfsdp_ckpt_ctx_boundary(c->ctx, iter_start != 1, &step) || step <= c->ckpt_saved) {
        if (at_end && step > c->ckpt_saved) {
            MFSDP_WARN("MFSDP_CKPT_DIR: the job ended inside an accumulation window; step %lld is "
                       "not saved (the newest checkpoint is step %lld)",
                       (long long)step, (long long)c->ckpt_saved);
        }
        return MFSDP_OK;
    }
    if (!at_end && (cfg->ckpt_every == 0 || step == 0 || step % cfg->ckpt_every != 0)) {
        return MFSDP_OK;
    }
    int zero = 1;
    mfsdp_status_t st = replica_zero(c, &zero, msg, msglen);
    if (st != MFSDP_OK) {
        return st;
    }
    c->ckpt_saved = step;
    if (!zero) {
        return MFSDP_OK;
    }
    st = mfsdp_ctx_save(c->ctx, cfg->ckpt_dir);
    if (st == MFSDP_OK && at_end) {
        st = mfsdp_ctx_save_wait(c->ctx);
    }
    if (st != MFSDP_OK) {
        snprintf(msg + strlen(msg), msglen - strlen(msg), "%ssaving step %lld to %s failed",
                 msg[0] ? "; " : "", (long long)step, cfg->ckpt_dir);
        return st;
    }
    c->ckpt_saves++;
    if (cfg->ckpt_keep > 0 && c->rank == 0) {
        prune(cfg->ckpt_dir, cfg->ckpt_keep); /* every earlier save has committed */
    }
    return MFSDP_OK;
}

mfsdp_status_t shim_ckpt_after_allgather(shim_comm_t *c, int iter_start, char *msg, size_t msglen)
{
    return save_if_due(c, 0, iter_start, msg, msglen);
}

int64_t shim_ckpt_unsaved(const shim_comm_t *c)
{
    const mfsdp_config_t *cfg = shim_config();
    int64_t step = -1;
    if (cfg == NULL || !(cfg->ckpt_dir_set && cfg->ckpt_dir[0] != '\0') || c->ctx == NULL ||
        c->failed || c->reg != NULL) {
        return -1;
    }
    (void)mfsdp_ckpt_ctx_boundary(c->ctx, 0, &step);
    return step > c->ckpt_saved ? step : -1;
}

void shim_ckpt_fail_unsaved(shim_comm_t *c, const char *why)
{
    int64_t step = shim_ckpt_unsaved(c);
    if (step >= 0) {
        shim_fatal(c, 0, MFSDP_ERR_STATE,
                   "%s: step %lld is not saved to %s (its newest checkpoint is %s%lld)", why,
                   (long long)step, shim_config()->ckpt_dir, c->ckpt_saved < 0 ? "none, " : "step ",
                   (long long)c->ckpt_saved);
    }
}

mfsdp_status_t shim_ckpt_end(shim_comm_t *c, char *msg, size_t msglen)
{
    mfsdp_status_t st = save_if_due(c, 1, -1, msg, msglen);
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_save_wait(c->ctx); /* a periodic save still writing */
        if (st != MFSDP_OK) {
            snprintf(msg + strlen(msg), msglen - strlen(msg),
                     "%sthe background write of the last checkpoint failed", msg[0] ? "; " : "");
        }
    }
    const mfsdp_config_t *cfg = shim_config();
    if (st == MFSDP_OK && c->ckpt_saves > 0 && c->rank == 0 && cfg->ckpt_keep > 0) {
        prune(cfg->ckpt_dir, cfg->ckpt_keep); /* now that the last one has committed */
    }
    return st;
}
