/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Call records (MFSDP_RECORD): what the shim saw on each communicator while it passed every
 * call through, written as "mfsdp-record/1" JSON for `mfsdp-plan --record` to join with a
 * manifest (core/join.h). A record holds every all-gather and reduce-scatter of a
 * communicator, in order, up to a cap: several iterations, so that the join sees every kind
 * of pass the job makes (accumulation micro-steps, evaluation passes, warm-up).
 *
 *   {"format": "mfsdp-record/1",
 *    "comms": [{"size": n, "calls": [[kind, count, dtype, op], ...]}, ...]}
 *
 * kind is "allgather" or "reduce_scatter", count the per-rank count NCCL saw, op the
 * reduce op's name ("none" for an all-gather; informational).
 */
#ifndef MFSDP_CORE_RECORD_H
#define MFSDP_CORE_RECORD_H

#include <stdio.h>

#include "core/matcher.h"

/* Calls kept per communicator when the caller states no cap. */
#define MFSDP_RECORD_DEFAULT_MAX 100000

typedef struct mfsdp_record_call {
    mfsdp_call_sig_t sig;
    char op[16]; /* "none", "sum", "avg", "premulsum", ... (informational) */
} mfsdp_record_call_t;

typedef struct mfsdp_record_comm {
    int size;
    size_t ncalls;
    mfsdp_record_call_t *calls;
    size_t capacity; /* allocated entries of calls (mfsdp_record_comm_append) */
} mfsdp_record_comm_t;

typedef struct mfsdp_record {
    size_t ncomms;
    mfsdp_record_comm_t *comms;
} mfsdp_record_t;

/* Append one call to rc (growing its array). MFSDP_ERR_OVERFLOW, with nothing appended,
 * once rc holds max calls (0: MFSDP_RECORD_DEFAULT_MAX); MFSDP_ERR_NO_MEMORY likewise. op
 * may be NULL ("none"). */
mfsdp_status_t mfsdp_record_comm_append(mfsdp_record_comm_t *rc, const mfsdp_call_sig_t *sig,
                                        const char *op, size_t max);

/* Write rec as mfsdp-record/1 JSON. */
mfsdp_status_t mfsdp_record_write(const mfsdp_record_t *rec, FILE *out);
/* Read a record; errors name the file and the JSON path (comms[1].calls[7][2]). */
mfsdp_status_t mfsdp_record_load(const char *path, char *err, size_t errlen,
                                 mfsdp_record_t **rec_p);
/* Release a record from mfsdp_record_load (NULL is allowed). */
void mfsdp_record_free(mfsdp_record_t *rec);

#endif /* MFSDP_CORE_RECORD_H */
