/* SPDX-License-Identifier: Apache-2.0 */
/*
 * MFSDP_RECORD: pass every call through and record each communicator's all-gathers and
 * reduce-scatters (kind, count, dtype, op), up to MFSDP_RECORD_MAX calls each, for
 * `mfsdp-plan --record` to join with a manifest (core/join.c). Several iterations are
 * recorded, so that the join sees every kind of pass the job makes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "ld_preload/shim.h"

static pthread_mutex_t rec_lock = PTHREAD_MUTEX_INITIALIZER;
static mfsdp_record_t *kept; /* records of released comms, written at exit */

int shim_recording(void)
{
    const mfsdp_config_t *cfg = shim_config();
    return cfg != NULL && cfg->record_set;
}

void shim_record_call(shim_comm_t *c, const shim_call_t *call)
{
    if (call->kind == SHIM_ALLREDUCE || !call->dtype_known) {
        return;
    }
    mfsdp_call_sig_t sig = {call->kind == SHIM_ALLGATHER ? MFSDP_CALL_ALLGATHER
                                                         : MFSDP_CALL_REDUCE_SCATTER,
                            call->count, call->dtype};
    size_t max = (size_t)shim_config()->record_max;
    mfsdp_status_t st =
        mfsdp_record_comm_append(&c->rec, &sig, call->op_name ? call->op_name : "none", max);
    if (st == MFSDP_ERR_OVERFLOW && c->rec.ncalls == max && !c->rec_full) {
        c->rec_full = 1;
        MFSDP_WARN("MFSDP_RECORD: %zu calls recorded on a communicator of %d ranks; later ones "
                   "are not (raise MFSDP_RECORD_MAX to record more)",
                   max, c->size);
    } else if (st == MFSDP_ERR_NO_MEMORY && !c->rec_full) {
        c->rec_full = 1;
        MFSDP_WARN("out of memory recording calls: the record stops here");
    }
}

void shim_record_keep(shim_comm_t *c)
{
    if (!shim_recording() || c->rec.ncalls == 0) {
        free(c->rec.calls);
        memset(&c->rec, 0, sizeof(c->rec));
        return;
    }
    pthread_mutex_lock(&rec_lock);
    if (kept == NULL) {
        kept = calloc(1, sizeof(*kept));
    }
    mfsdp_record_comm_t *n =
        kept != NULL ? realloc(kept->comms, (kept->ncomms + 1) * sizeof(*n)) : NULL;
    if (n == NULL) {
        MFSDP_WARN("out of memory keeping a record: this communicator's calls are lost");
        free(c->rec.calls);
    } else {
        kept->comms = n;
        c->rec.size = c->size;
        kept->comms[kept->ncomms++] = c->rec;
    }
    memset(&c->rec, 0, sizeof(c->rec));
    pthread_mutex_unlock(&rec_lock);
}

void shim_record_write(int world_rank)
{
    pthread_mutex_lock(&rec_lock);
    const char *path = shim_recording() ? shim_config()->record : NULL;
    if (kept != NULL && path != NULL && world_rank == 0) {
        char tmp[4096];
        snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
        FILE *f = fopen(tmp, "w");
        mfsdp_status_t st = f != NULL ? mfsdp_record_write(kept, f) : MFSDP_ERR_IO;
        if (f != NULL && (fflush(f) != 0 || fsync(fileno(f)) != 0)) {
            st = MFSDP_ERR_IO;
        }
        if (f != NULL && fclose(f) != 0) {
            st = MFSDP_ERR_IO;
        }
        if (st != MFSDP_OK || rename(tmp, path) != 0) {
            fprintf(stderr, "mfsdp: error: cannot write the MFSDP_RECORD file %s: %m\n", path);
            unlink(tmp);
        } else {
            MFSDP_INFO(SHIM, "recorded %zu communicator(s) to %s", kept->ncomms, path);
        }
    }
    if (kept != NULL) {
        for (size_t i = 0; i < kept->ncomms; i++) {
            free(kept->comms[i].calls);
        }
        free(kept->comms);
        free(kept);
        kept = NULL;
    }
    pthread_mutex_unlock(&rec_lock);
}
