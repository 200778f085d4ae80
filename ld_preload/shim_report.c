/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the shim says to the user: fatal errors (once for the job, not once per rank, and not
 * as a WARN line: they stop the job) and the summary line at exit, with the end-of-job checks
 * that keep a misconfigured job from exiting 0 with untrained weights.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/log.h"
#include "ld_preload/shim.h"
#include "mfsdp/checkpoint.h"

static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;
/* Counters of released comms (their context is gone by exit). */
static struct {
    uint64_t calls, ag, rs, ar, passed, steps;
    uint64_t saves;                /* checkpoints this rank took part in */
    double max_stall, total_stall; /* seconds the training stream was held by them */
    size_t comms;
    int comm_size;
    size_t groups;
    int failed;
} kept;

int shim_quiet(void)
{
    const char *lvl = getenv("MFSDP_DEBUG");
    return lvl != NULL && (strcasecmp(lvl, "NONE") == 0 || strcasecmp(lvl, "VERSION") == 0);
}

/* print: 1 when this rank is the one to print an agreed error. */
static void vfatal(shim_comm_t *c, int agreed, int print, mfsdp_status_t st, const char *fmt,
                   va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    MFSDP_INFO(SHIM, "fatal (%s): %s", agreed ? "every rank" : "this rank", msg);
    if (c->failed) {
        return; /* the first error stands: it was printed */
    }
    c->failed = 1;
    c->fail_status = st;
    snprintf(c->why, sizeof(c->why), "%s", msg);
    if (agreed && !print) { /* errors are printed under MFSDP_DEBUG=NONE too */
        return;
    }
    if (agreed) {
        fprintf(stderr, "mfsdp: error: %s [every rank of the %d-rank communicator stopped]\n", msg,
                c->size);
    } else {
        fprintf(stderr, "mfsdp: error on rank %d of %d: %s\n", c->rank, c->size, msg);
    }
    fflush(stderr);
}

void shim_fatal(shim_comm_t *c, int agreed, mfsdp_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfatal(c, agreed, c->rank == 0, st, fmt, ap);
    va_end(ap);
}

void shim_fatal_mesh(shim_comm_t *c, const shim_comm_t *replicate, mfsdp_status_t st,
                     const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfatal(c, 1, c->rank == 0 && replicate->rank == 0, st, fmt, ap);
    va_end(ap);
}

void shim_report_keep(const shim_comm_t *c)
{
    pthread_mutex_lock(&report_lock);
    kept.calls += c->calls;
    kept.ag += c->remapped_ag;
    kept.rs += c->remapped_rs;
    kept.ar += c->remapped_ar;
    kept.passed += c->passed;
    kept.failed |= c->failed;
    if (c->ctx != NULL) {
        mfsdp_ctx_stats_t s;
        if (mfsdp_ctx_get_stats(c->ctx, &s) == MFSDP_OK) {
            kept.steps += s.steps;
        }
        mfsdp_ckpt_stats_t cs;
        if (mfsdp_ctx_get_ckpt_stats(c->ctx, &cs) == MFSDP_OK && cs.saves > 0) {
            kept.saves += cs.saves;
            kept.total_stall += cs.total_stall_seconds;
            if (cs.max_stall_seconds > kept.max_stall) {
                kept.max_stall = cs.max_stall_seconds;
            }
        }
        kept.comms++;
        kept.comm_size = c->size;
        kept.groups = c->man != NULL ? c->man->ngroups : 0;
    }
    pthread_mutex_unlock(&report_lock);
}

int shim_report_exit(int world_rank)
{
    const mfsdp_config_t *cfg = shim_config();
    int manifest = cfg != NULL && cfg->manifest_set;
    int fail = kept.failed;
    uint64_t remapped = kept.ag + kept.rs + kept.ar;
    char what[256];
    if (shim_init_error()[0] != '\0') {
        snprintf(what, sizeof(what), "the MFSDP_* configuration was refused (above)");
    } else if (shim_recording()) {
        snprintf(what, sizeof(what), "recording to %s (pass-through)", cfg->record);
    } else if (manifest) {
        snprintf(what, sizeof(what), "manifest %s", cfg->manifest);
    } else if (kept.comms > 0) {
        snprintf(what, sizeof(what), "tagged by the PyTorch companion");
    } else {
        snprintf(what, sizeof(what), "no MFSDP_MANIFEST: every call passed through");
    }
    char saves[160] = "";
    if (kept.saves > 0) {
        /* A save holds the training stream only for the copy of the owned bytes (the files
         * are written in the background): the user sees what that cost. */
        snprintf(saves, sizeof(saves),
                 "; %llu checkpoint save%s, training held %.1f ms per save (max %.1f ms)",
                 (unsigned long long)kept.saves, kept.saves == 1 ? "" : "s",
                 1e3 * kept.total_stall / (double)kept.saves, 1e3 * kept.max_stall);
    }
    if (world_rank == 0 && !shim_quiet()) {
        fprintf(stderr,
                "mfsdp: summary: %llu all-gathers, %llu reduce-scatters and %llu replicate "
                "all-reduces remapped on %zu communicator%s, %llu calls passed through, "
                "%llu optimizer steps over %zu groups%s; %s\n",
                (unsigned long long)kept.ag, (unsigned long long)kept.rs,
                (unsigned long long)kept.ar, kept.comms, kept.comms == 1 ? "" : "s",
                (unsigned long long)kept.passed, (unsigned long long)kept.steps, kept.groups, saves,
                what);
    }
    /* A manifest that matched nothing trained nothing: the job must not exit 0. */
    if (manifest && !shim_recording() && !fail && kept.calls > 0 && remapped == 0) {
        if (world_rank == 0) {
            fprintf(stderr,
                    "mfsdp: error: none of the job's %llu all-gathers and reduce-scatters "
                    "matched the manifest %s: nothing was trained by mfsdp (check its "
                    "world_size and groups against the job)\n",
                    (unsigned long long)kept.calls, cfg->manifest);
        }
        fail = 1;
    }
    /* Started by mfsdp-run, but the PyTorch companion never registered a model: every call
     * passed through and the job trained with its own optimizer. */
    if (!manifest && !shim_recording() && !fail && cfg != NULL && cfg->companion_set &&
        cfg->companion == MFSDP_CFG_COMPANION_TAG && kept.comms == 0 && kept.calls > 0) {
        if (world_rank == 0) {
            fprintf(stderr,
                    "mfsdp: error: the job ran under mfsdp-run (MFSDP_COMPANION is set) but the "
                    "PyTorch companion registered no model: its %llu all-gathers and "
                    "reduce-scatters passed through and mfsdp trained nothing (was the "
                    "companion's start-up bypassed, e.g. python -I or -S, or a launcher that "
                    "resets PYTHONPATH?)\n",
                    (unsigned long long)kept.calls);
        }
        fail = 1;
    }
    fflush(stderr);
    return fail;
}
