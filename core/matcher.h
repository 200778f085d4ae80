/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Call identification for the shim (docs/design.md, "Identification", docs/manifest.md
 * "Identification rules"): which param group (and, for a reduce-scatter, which of its params) an
 * intercepted collective belongs to. Every decision is a pure function of (kind, count, dtype) and
 * call order, which are identical on every rank, so all ranks decide the same way and none hangs.
 *
 * Sequence mode (the manifest has a "sequence"): the calls follow the cycle, with the
 * manifest's "iteration" variants (forward-only passes, no-sync passes) and optional entries.
 * The matcher keeps the set of every interpretation (position in a pass of some kind)
 * consistent with the calls so far. A call is identified only when every live interpretation
 * gives it the same group and, for a reduce-scatter, the same set of params with gradient;
 * when none does, or they disagree, it is an error naming the candidates and the way out.
 *
 * Signature mode (no "sequence"): a call's (kind, count, dtype) must belong to exactly one
 * (group, param set); otherwise an error.
 *
 * Reduce-scatters cover only the params that got a gradient in this backward (FSDP2 drops
 * frozen and unused params), so a count may be the group's full S' or that of a subset with
 * some params missing. A subset is recognised when exactly one set of missing params gives the
 * count: any subset for groups of at most MFSDP_MATCH_ENUM_PARAMS params, otherwise up to
 * MFSDP_MATCH_MAX_MISSING missing params. Two sets giving the same count are an error.
 *
 * After an error the matcher is failed: every later call returns the same error.
 *
 * Messages are one line, start lowercase, name groups by name and calls by
 * mfsdp_call_sig_format(); "call N" counts this matcher's calls from 0.
 */
#ifndef MFSDP_CORE_MATCHER_H
#define MFSDP_CORE_MATCHER_H

#include <stdio.h>

#include "mfsdp/manifest.h"

#define MFSDP_GROUP_NONE        ((size_t)-1)
#define MFSDP_MATCH_ENUM_PARAMS 12
#define MFSDP_MATCH_MAX_MISSING 3

/* What identifies an intercepted call. count is the per-rank count NCCL sees (sendcount of
 * an all-gather, recvcount of a reduce-scatter), in units of dtype. */
typedef struct mfsdp_call_sig {
    mfsdp_call_kind_t kind;
    size_t count;
    mfsdp_dtype_t dtype;
} mfsdp_call_sig_t;

/* The identification of one call. */
typedef struct mfsdp_match {
    size_t group; /* group index in the manifest */
    /* reduce-scatter: nparams flags, 1 for each param of the group in this reduce (it has a
     * gradient now); NULL for an all-gather. Owned by the matcher; valid until the next
     * mfsdp_matcher_next() or destroy. */
    const unsigned char *has_grad;
    size_t nparams;  /* params of the group */
    size_t position; /* sequence index matched, MFSDP_GROUP_NONE in signature mode */
} mfsdp_match_t;

typedef struct mfsdp_matcher mfsdp_matcher_t;

/* Build a matcher for manifest m at world size world (m must outlive it). Fails with
 * MFSDP_ERR_UNSUPPORTED (message in err) when the manifest has no sequence and two groups
 * share a signature (identical blocks: record a sequence), MFSDP_ERR_INVALID_ARG when a
 * sequence entry names a reduce-scatter of a group that has no gradients. */
mfsdp_status_t mfsdp_matcher_create(const mfsdp_manifest_t *m, int world, char *err, size_t errlen,
                                    mfsdp_matcher_t **matcher_p);
void mfsdp_matcher_destroy(mfsdp_matcher_t *matcher);

/* Identify one call. MFSDP_OK with *match_p written; MFSDP_ERR_SEQUENCE when the call matches
 * nothing (err: what was expected at this point vs what was received) or is ambiguous (err:
 * the candidate groups / param sets, and the way out: record the job's pattern with
 * MFSDP_RECORD, declare or remove an "iteration" variant, or use the PyTorch companion). */
mfsdp_status_t mfsdp_matcher_next(mfsdp_matcher_t *matcher, const mfsdp_call_sig_t *call,
                                  mfsdp_match_t *match_p, char *err, size_t errlen);

/* The job is ending (communicator destroy, finalize). MFSDP_OK when the calls so far may end
 * here: at a pass boundary, or right after a complete forward prefix (the final all-gathers
 * of a job that evaluates or saves its weights). MFSDP_ERR_SEQUENCE otherwise (err says where
 * the job stopped), so that a shifted stream cannot end unnoticed. */
mfsdp_status_t mfsdp_matcher_end(const mfsdp_matcher_t *matcher, char *err, size_t errlen);

/* Tagged mode (the PyTorch companion names the group): check that call is the all-gather or
 * reduce-scatter of group over exactly the params flagged in has_grad (NULL: every
 * requires_grad param). MFSDP_ERR_MISMATCH with err naming both when count or dtype differ. */
mfsdp_status_t mfsdp_matcher_check_tag(const mfsdp_matcher_t *matcher, const mfsdp_call_sig_t *call,
                                       size_t group, const unsigned char *has_grad, char *err,
                                       size_t errlen);

/* Calls in one iteration: the sequence's length, or in signature mode one all-gather per
 * group plus one reduce-scatter per group that has gradients. The shim's "nothing was
 * remapped in the first iteration" rule counts up to this. */
size_t mfsdp_matcher_iteration_calls(const mfsdp_matcher_t *matcher);

/* Signature of the full (every requires_grad param) call of (group, kind); count 0 when the
 * group has no call of that kind (a reduce-scatter of a group without gradients). */
mfsdp_status_t mfsdp_matcher_signature(const mfsdp_matcher_t *matcher, size_t group,
                                       mfsdp_call_kind_t kind, mfsdp_call_sig_t *sig_p);

/* Text form of a call for messages: "allgather(count=1234, bfloat16)". */
void mfsdp_call_sig_format(const mfsdp_call_sig_t *sig, char *buf, size_t len);

#endif /* MFSDP_CORE_MATCHER_H */
