/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Which params of a group a reduce-scatter covers, from its count alone.
 *
 * FSDP2 reduce-scatters only the params that got a gradient in this backward (frozen and
 * unused params drop out), so a count may be the group's full S' or the sum of the
 * per-rank shard sizes of a subset of its requires_grad params (docs/design.md, "FSDP2's byte
 * layout"; there is no padding between params, and every shard size is at least 1, so the full set
 * is the only set giving S'). A count is explained by a set of *missing* params: every set is
 * searched for groups of at most MFSDP_RS_SPLIT_PARAMS trainable params (enumerated up to
 * MFSDP_RS_ENUM_PARAMS, met in the middle above); for larger groups only sets of at most
 * MFSDP_RS_MAX_MISSING, so one found there does not prove that no larger set gives the same
 * count. A count that two sets explain, or whose one set is not proven alone, is ambiguous:
 * callers must not pick one.
 *
 * Results are cached per count, so a solver answers a job's few distinct counts once.
 */
#ifndef MFSDP_CORE_RS_SUBSET_H
#define MFSDP_CORE_RS_SUBSET_H

#include <stddef.h>

#include "mfsdp/manifest.h"

#define MFSDP_RS_ENUM_PARAMS  12
#define MFSDP_RS_SPLIT_PARAMS 40
#define MFSDP_RS_MAX_MISSING  3

typedef struct mfsdp_rs_subset mfsdp_rs_subset_t;

/* A solver for group g at world size world. A group without requires_grad params gets a
 * solver that explains no count. */
mfsdp_status_t mfsdp_rs_subset_create(const mfsdp_group_desc_t *g, int world,
                                      mfsdp_rs_subset_t **solver_p);
void mfsdp_rs_subset_destroy(mfsdp_rs_subset_t *solver);

/* The sets of params with a gradient whose reduce-scatter count (in the group's reduce
 * dtype) is count. *nsets_p: 0 (no set), 1 (sets_p[0] is the one set) or 2 (two or more:
 * sets_p[0] and sets_p[1] are two of them; sets_p[1] NULL when sets_p[0] is the only one
 * found but the search could not rule out others). Each set is g->nparams flags (1: the param is in
 * the reduce), owned by the solver and valid until it is destroyed. */
mfsdp_status_t mfsdp_rs_subset_find(mfsdp_rs_subset_t *solver, size_t count, size_t *nsets_p,
                                    const unsigned char *sets_p[2]);

/* The full reduce-scatter count S' (0 when the group has no requires_grad param). */
size_t mfsdp_rs_subset_full(const mfsdp_rs_subset_t *solver);

/* Text of the params missing from set (those with requires_grad and a 0 flag), as
 * "{a, b}" with at most a few names, for messages. */
void mfsdp_rs_subset_format_missing(const mfsdp_rs_subset_t *solver, const unsigned char *set,
                                    char *buf, size_t len);

#endif /* MFSDP_CORE_RS_SUBSET_H */
