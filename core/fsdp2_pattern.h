/* SPDX-License-Identifier: Apache-2.0 */
/*
 * FSDP2's collective call pattern (torch 2.15, measured: notes/fsdp2-internals.md section 8),
 * as a generator of labeled call streams: which all-gathers and reduce-scatters a job issues,
 * for which group and which params, pass after pass. The record join (core/join.h) matches
 * records against it, and the tests generate real streams with it.
 *
 * The model follows FSDP2's hooks. Groups are in FSDP order (the order of their first
 * all-gather in a forward). With a root (fully_shard(model) holding params of its own, group
 * 0), the root is gathered first and reduce-scattered last; its post-forward runs after every
 * other group's. A pass:
 *   forward   each group in order: all-gather it unless it is still unsharded; after its
 *             forward it is resharded if it reshards after forward (the root's reshard waits
 *             for the end of the forward);
 *   backward  (training and no-sync passes) the root's pre-backward first: all-gather the root
 *             if sharded, then prefetch the last group. Then each other group in reverse
 *             order: all-gather it if sharded, prefetch the group before it (backward
 *             prefetch depth 1, FSDP2's default; none with depth 0), reshard it and
 *             reduce-scatter it (training passes, when any of its params has a gradient).
 *             The root's reduce-scatter comes last. At the end every group is sharded.
 * A group that does not reshard after forward stays unsharded after a forward-only pass, so
 * the next pass skips its all-gather (the root after an evaluation forward). FSDP2 clears
 * its post-forward order only at the end of a backward, so in the backward that follows a
 * forward-only pass the first group also prefetches the last group of that earlier forward
 * (the root, a no-op, or with torchtitan's wrapping the output group: an extra all-gather).
 *
 * Measured examples (root r, blocks b0..b2):
 *   default      AG r b0 b1 b2 | AG b2 AG b1 RS b2 AG b0 RS b1 RS b0 RS r
 *   no prefetch  AG r b0 b1 b2 | AG b2 RS b2 AG b1 RS b1 AG b0 RS b0 RS r
 *   torchtitan (no root; emb, b0..b2, out; out kept unsharded):
 *                AG emb b0 b1 b2 out | AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb RS b0 RS emb
 *   the same after an evaluation forward (out still unsharded):
 *                AG emb b0 b1 b2 | AG b2 RS out AG b1 RS b2 AG b0 RS b1 AG emb RS b0 AG out RS emb
 */
#ifndef MFSDP_CORE_FSDP2_PATTERN_H
#define MFSDP_CORE_FSDP2_PATTERN_H

#include <stddef.h>

#include "mfsdp/manifest.h"

/* Kinds of pass. */
typedef enum mfsdp_pass_kind {
    MFSDP_PASS_TRAIN = 0,   /* forward, backward, reduce-scatters */
    MFSDP_PASS_NO_SYNC = 1, /* forward, backward, no reduce-scatter (set_requires_gradient_sync) */
    MFSDP_PASS_FORWARD = 2, /* forward only (evaluation under no_grad) */
} mfsdp_pass_kind_t;

#define MFSDP_PASS_KINDS 3

/* How the job wraps and configures FSDP2. */
typedef struct mfsdp_fsdp2_config {
    int root;     /* 1: group 0 is the root module's own group */
    int prefetch; /* backward prefetch depth: 0 or 1 (FSDP2's default) */
    /* Per group: 1 when it reshards after forward (and is re-gathered in backward). NULL:
     * FSDP2's defaults, every group but the root. */
    const unsigned char *reshard;
} mfsdp_fsdp2_config_t;

/* Where a call sits in its pass. */
typedef enum mfsdp_fsdp2_phase {
    MFSDP_PHASE_FORWARD = 0,  /* a forward all-gather */
    MFSDP_PHASE_BACKWARD = 1, /* a backward all-gather (own or prefetch) or a reduce-scatter */
} mfsdp_fsdp2_phase_t;

/* One labeled call. (phase, kind, group) is unique within a pass. */
typedef struct mfsdp_fsdp2_call {
    mfsdp_call_kind_t kind;
    size_t group;
    mfsdp_fsdp2_phase_t phase;
    int prefetch; /* 1: a backward prefetch issued by the next group's pre-backward */
    /* reduce-scatter: the group's params with a gradient in this pass (the has_grad given to
     * mfsdp_fsdp2_gen_pass, or NULL for every requires_grad param) */
    const unsigned char *has_grad;
} mfsdp_fsdp2_call_t;

typedef struct mfsdp_fsdp2_gen mfsdp_fsdp2_gen_t;

/* A generator for manifest m's groups (m must outlive it; the sequence is not used). It
 * starts as a job starts: every group sharded. MFSDP_ERR_INVALID_ARG for a prefetch depth
 * other than 0 or 1, or a root without groups. */
mfsdp_status_t mfsdp_fsdp2_gen_create(const mfsdp_manifest_t *m, const mfsdp_fsdp2_config_t *cfg,
                                      mfsdp_fsdp2_gen_t **gen_p);
void mfsdp_fsdp2_gen_destroy(mfsdp_fsdp2_gen_t *gen);

/* Back to the start of a job (every group sharded). */
void mfsdp_fsdp2_gen_reset(mfsdp_fsdp2_gen_t *gen);

/* Upper bound of the calls of one pass: 3 per group. */
size_t mfsdp_fsdp2_max_pass_calls(const mfsdp_manifest_t *m);

/*
 * The calls of one pass of kind, continuing from the state the previous passes left. has_grad
 * (may be NULL: every requires_grad param has a gradient) holds one array per group, each
 * NULL (every requires_grad param of that group) or nparams flags; a group whose flags are
 * all 0 is not reduce-scattered (FSDP2 skips a reduce with no gradient). A flag on a param
 * that does not require a gradient is MFSDP_ERR_INVALID_ARG. out gets at most cap calls;
 * MFSDP_ERR_OVERFLOW (state unchanged) when cap is too small.
 */
mfsdp_status_t mfsdp_fsdp2_gen_pass(mfsdp_fsdp2_gen_t *gen, mfsdp_pass_kind_t kind,
                                    const unsigned char *const *has_grad, mfsdp_fsdp2_call_t *out,
                                    size_t cap, size_t *ncalls_p);

/* "training", "no-sync", "forward-only" */
const char *mfsdp_pass_kind_name(mfsdp_pass_kind_t kind);

#endif /* MFSDP_CORE_FSDP2_PATTERN_H */
