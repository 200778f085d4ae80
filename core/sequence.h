/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Call matching for the shim (DESIGN.md section 6): which intercepted collective belongs to
 * which param group. The decision is a pure function of (kind, count, dtype) and call order,
 * which are identical on every rank, so all ranks decide the same way and none hangs.
 *
 * - With a manifest "sequence": the next expected call must match; a call whose signature
 *   belongs to the manifest but not to the expected entry is a contradiction
 *   (MFSDP_ERR_SEQUENCE, message naming expected vs received); a call whose signature belongs
 *   to no group is passed through.
 * - Without one: every group must have a unique (kind, count, dtype) signature; groups that
 *   share one (identical blocks) need a recorded sequence (MFSDP_RECORD + mfsdp-plan
 *   --record), which mfsdp_record_join() turns into a manifest sequence.
 */
#ifndef MFSDP_CORE_SEQUENCE_H
#define MFSDP_CORE_SEQUENCE_H

#include <stdio.h>

#include "mfsdp/manifest.h"

/* "No group": the call is passed through untouched. */
#define MFSDP_GROUP_NONE ((size_t)-1)

/* What identifies an intercepted call. count is the per-rank count NCCL sees (sendcount of
 * an all-gather, recvcount of a reduce-scatter), in units of dtype. */
typedef struct mfsdp_call_sig {
    mfsdp_call_kind_t kind;
    size_t count;
    mfsdp_dtype_t dtype;
} mfsdp_call_sig_t;

typedef struct mfsdp_matcher mfsdp_matcher_t;

/* Build a matcher for the manifest at world size world. Fails with MFSDP_ERR_UNSUPPORTED
 * (message in err) when groups share a signature and the manifest has no sequence. */
mfsdp_status_t mfsdp_matcher_create(const mfsdp_manifest_t *m, int world, char *err,
                                    size_t errlen, mfsdp_matcher_t **matcher_p);
void mfsdp_matcher_destroy(mfsdp_matcher_t *matcher);

/* Decide one call: *group_p = the group index, or MFSDP_GROUP_NONE to pass it through.
 * MFSDP_ERR_SEQUENCE when it contradicts the expected call (err says both). */
mfsdp_status_t mfsdp_matcher_next(mfsdp_matcher_t *matcher, const mfsdp_call_sig_t *call,
                                  char *err, size_t errlen, size_t *group_p);

/* Signature of (group, kind) in this matcher's layout; count 0 when the group has no call of
 * that kind (a reduce-scatter of a group without gradients). */
mfsdp_status_t mfsdp_matcher_signature(const mfsdp_matcher_t *matcher, size_t group,
                                       mfsdp_call_kind_t kind, mfsdp_call_sig_t *sig_p);

/* Text form of a call for messages: "allgather(count=1234, bfloat16)". */
void mfsdp_call_sig_format(const mfsdp_call_sig_t *sig, char *buf, size_t len);

/* ---- recording (MFSDP_RECORD) ---- */

typedef struct mfsdp_record_call {
    mfsdp_call_sig_t sig;
    char op[16]; /* "none", "sum", "avg", "premulsum", ... (informational) */
} mfsdp_record_call_t;

typedef struct mfsdp_record_comm {
    int size;
    size_t ncalls;
    mfsdp_record_call_t *calls;
} mfsdp_record_comm_t;

typedef struct mfsdp_record {
    size_t ncomms;
    mfsdp_record_comm_t *comms;
} mfsdp_record_t;

/* "mfsdp-record/1" JSON: {"format": ..., "comms": [{"size": n, "calls": [[kind, count,
 * dtype, op], ...]}]}. */
mfsdp_status_t mfsdp_record_write(const mfsdp_record_t *rec, FILE *out);
mfsdp_status_t mfsdp_record_load(const char *path, char *err, size_t errlen,
                                 mfsdp_record_t **rec_p);
void mfsdp_record_free(mfsdp_record_t *rec);

/*
 * Join a record with a manifest into a call sequence (manifest->sequence form). Uses the
 * first comm of size world whose calls match the manifest's signatures. Calls whose
 * signature is unique map to their group. Calls of a signature shared by k groups follow
 * FSDP2's order: the first k all-gathers are the forward pass (those groups in manifest
 * order); later all-gathers and all reduce-scatters are the backward pass (reverse manifest
 * order; with B < k backward all-gathers, the B lowest groups are taken to be re-gathered).
 * Calls matching no group are left out (they stay pass-through).
 */
mfsdp_status_t mfsdp_record_join(const mfsdp_manifest_t *m, int world,
                                 const mfsdp_record_t *rec, char *err, size_t errlen,
                                 mfsdp_call_t **seq_p, size_t *ncalls_p);

#endif /* MFSDP_CORE_SEQUENCE_H */
