/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file plan.h
 * @brief Owner plan: which rank owns each matrix, MatrixShard metadata, per-rank loads.
 *
 * A plan is a pure function of (manifest, world size, options): the same input gives a
 * byte-identical plan on every rank and every run, so ranks never disagree about owners.
 */
#ifndef MFSDP_PLAN_H
#define MFSDP_PLAN_H

#include "mfsdp/manifest.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Owner value of a tail tensor kept in FSDP's even slices (tail policy "shard"). */
#define MFSDP_OWNER_SHARDED (-1)

/** MatrixShard: planner metadata of one parameter (docs/design.md, "Owners"). */
typedef struct mfsdp_shard {
    size_t group;      /**< group index in the manifest */
    size_t param;      /**< param index in its group */
    mfsdp_role_t role; /**< MUON or ADAMW */
    int64_t rows;      /**< 2-D view: shape[0] ... */
    int64_t cols;      /**< ... and product of the remaining dims (1 for 1-D params) */
    int64_t numel;     /**< rows * cols */
    /* FSDP geometry of the all-gather layout (docs/design.md, "FSDP2's byte layout"), in elements.
     */
    int64_t fsdp_c;      /**< rows per rank: ceil(shape[0] / n) (1-D: ceil(numel / n)) */
    int64_t fsdp_s;      /**< shard numel c * R */
    int64_t fsdp_o;      /**< offset in the per-rank block, in elements of the param dtype */
    size_t fsdp_o_bytes; /**< same offset in bytes (the uint8 view of mixed-dtype groups) */
    int owner;           /**< owner rank, or MFSDP_OWNER_SHARDED */
    /** Element offset of this tensor inside its owner's MASTER, COMM and GRAD regions (every
     *  owned tensor, ascending shard index); for a sharded tail tensor, the offset of every
     *  rank's slice in that rank's tail region, which follows the owned tensors in each
     *  category (arena_elems[cat] - tail_elems). */
    size_t arena_offset;
    /** Element offset in the optimizer-state regions: MOMENTUM for Muon, ADAM_M and ADAM_V
     *  for AdamW (tensors of that role only, ascending shard index; sharded tail slices after
     *  them, at the same tail offset as arena_offset). */
    size_t state_offset;
    double ns_flops;    /**< Newton-Schulz FLOPs per step (0 for AdamW) */
    size_t arena_bytes; /**< owner-arena bytes this tensor costs its owner (whole tensor) */
} mfsdp_shard_t;

/** What one rank owns and how loaded it is. */
typedef struct mfsdp_rank_plan {
    size_t nowned;      /**< owned tensors (Muon matrices and owner-placed tail) */
    size_t *owned;      /**< indices into mfsdp_plan_t::shards, ascending */
    double ns_flops;    /**< Newton-Schulz FLOPs per step */
    size_t owned_bytes; /**< bytes (in the param dtype) of the tensors it owns whole */
    size_t tail_elems;  /**< elements of sharded-tail slices it keeps */
    size_t arena_elems[MFSDP_ARENA_NCAT]; /**< elements per arena category */
    size_t arena_bytes;                   /**< total arena bytes (all categories) */
} mfsdp_rank_plan_t;

/** Options of mfsdp_plan_create(). Zero-initialized means the defaults. */
typedef struct mfsdp_plan_opts {
    mfsdp_tail_policy_t tail; /**< default MFSDP_TAIL_OWNER if zero; use AUTO explicitly */
    size_t mem_limit;         /**< max arena bytes per rank, 0 = unlimited */
    int no_spread;            /**< 1 disables the per-group spread constraint */
} mfsdp_plan_opts_t;

/** A plan. Read-only for callers; release with mfsdp_plan_destroy(). */
typedef struct mfsdp_plan {
    int world;                        /**< world size n */
    mfsdp_tail_policy_t tail;         /**< policy requested */
    const mfsdp_manifest_t *manifest; /**< borrowed: must outlive the plan */
    size_t nshards;                   /**< one per param, in (group, param) order */
    mfsdp_shard_t *shards;
    size_t *group_first;      /**< ngroups + 1 entries: shards of group g are
                                   [group_first[g], group_first[g+1]) */
    mfsdp_rank_plan_t *ranks; /**< world entries */
    double lb_flops;          /**< lower bound of the max per-rank NS FLOPs */
    double lb_bytes;          /**< lower bound of the max per-rank owned bytes */
    double max_flops;         /**< achieved max per-rank NS FLOPs */
    size_t max_owned_bytes;   /**< achieved max per-rank owned bytes */
    size_t max_arena_bytes;   /**< achieved max per-rank arena bytes */
} mfsdp_plan_t;

/**
 * @brief Plan owners for every parameter of @p manifest at world size @p world.
 * @param [in]  manifest  must outlive the plan
 * @param [in]  world     >= 1; must equal manifest->world_size when that is non-zero
 * @param [in]  opts      may be NULL for defaults
 * @param [out] plan_p    written on success
 * @return MFSDP_OK, MFSDP_ERR_INVALID_ARG, MFSDP_ERR_MISMATCH (world size),
 *         MFSDP_ERR_MEM_LIMIT (a tensor or the plan exceeds opts->mem_limit),
 *         MFSDP_ERR_UNSUPPORTED (Shard(d>0)), MFSDP_ERR_OVERFLOW, MFSDP_ERR_NO_MEMORY
 */
MFSDP_API mfsdp_status_t mfsdp_plan_create(const mfsdp_manifest_t *manifest, int world,
                                           const mfsdp_plan_opts_t *opts, mfsdp_plan_t **plan_p);

/** @brief Release a plan (NULL is allowed). */
MFSDP_API void mfsdp_plan_destroy(mfsdp_plan_t *plan);

/**
 * @brief The plan as JSON (format "mfsdp-plan/1"): per rank owned tensors and loads, per
 *        group owners, bounds. Byte-identical for identical plans.
 * @param [out] json_p malloc'd text, free() it
 */
MFSDP_API mfsdp_status_t mfsdp_plan_to_json(const mfsdp_plan_t *plan, char **json_p);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_PLAN_H */
