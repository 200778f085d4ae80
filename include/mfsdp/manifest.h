/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file manifest.h
 * @brief The `mfsdp-manifest/1` JSON contract (docs/design.md, "Owners").
 *
 * A manifest describes the FSDP param groups of a job (params in FSDP order, shapes,
 * dtypes, which have a gradient), the optimizer hyper-parameters and, optionally, one
 * iteration's collective call sequence. Parsing is strict: unknown keys, wrong types,
 * bad sizes and duplicate names are errors whose message names the file, the JSON path
 * (for example `groups[3].params[2].shape`) and what was expected.
 */
#ifndef MFSDP_MANIFEST_H
#define MFSDP_MANIFEST_H

#include "mfsdp/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Version string a manifest's "format" key must hold. */
#define MFSDP_MANIFEST_FORMAT "mfsdp-manifest/1"

/** One parameter of a group. */
typedef struct mfsdp_param_desc {
    char *name;                    /**< fully-qualified name, unique in the manifest */
    int ndim;                      /**< 1..MFSDP_MAX_DIMS */
    int64_t shape[MFSDP_MAX_DIMS]; /**< all > 0 */
    int64_t numel;                 /**< product of shape (checked for overflow) */
    mfsdp_dtype_t dtype;           /**< param dtype on the wire (float32/bfloat16/float16) */
    mfsdp_role_t optimizer;        /**< explicit or by the default rule */
    int requires_grad;             /**< 0 or 1 */
    size_t nsplit;                 /**< 0, or number of row blocks for Newton-Schulz */
    int64_t *split;                /**< row counts summing to shape[0] (NULL if nsplit == 0) */
    int shard_dim;                 /**< FSDP Shard(d) placement; only 0 is supported */
} mfsdp_param_desc_t;

/** One FSDP param group (one `fully_shard` unit). */
typedef struct mfsdp_group_desc {
    char *name;                 /**< unique in the manifest */
    int has_reduce_dtype;       /**< 1 when "reduce_dtype" was given */
    mfsdp_dtype_t reduce_dtype; /**< valid when has_reduce_dtype */
    double lr_scale;            /**< "lr_scale": multiplies Muon and AdamW lr (default 1) */
    int has_weight_decay;       /**< 1 when "weight_decay" was given for the group */
    double weight_decay;        /**< overrides Muon and AdamW weight decay for this group */
    size_t nparams;             /**< >= 1 */
    mfsdp_param_desc_t *params; /**< in FSDP order */
} mfsdp_group_desc_t;

/** Learning-rate schedule kinds (torchtitan's lr_scheduler, docs/manifest.md). */
typedef enum mfsdp_schedule_kind {
    MFSDP_SCHEDULE_CONSTANT = 0,      /**< factor 1 */
    MFSDP_SCHEDULE_WARMUP_COSINE = 1, /**< linear warmup, cosine decay */
    MFSDP_SCHEDULE_WARMUP_LINEAR = 2, /**< linear warmup, linear decay */
    MFSDP_SCHEDULE_WSD = 3,           /**< warmup, stable, then linear/cosine/sqrt decay */
} mfsdp_schedule_kind_t;

/** Shape of the decay phase. */
typedef enum mfsdp_decay_kind {
    MFSDP_DECAY_LINEAR = 0,
    MFSDP_DECAY_COSINE = 1,
    MFSDP_DECAY_SQRT = 2,
} mfsdp_decay_kind_t;

/** A learning-rate schedule: factor(t) multiplies Muon's and AdamW's lr at step t. */
typedef struct mfsdp_schedule {
    mfsdp_schedule_kind_t kind;
    int64_t warmup_steps; /**< W >= 0 */
    int64_t stable_steps; /**< S >= 0 (wsd only) */
    int64_t decay_steps;  /**< D >= 0 */
    mfsdp_decay_kind_t decay;
    double min_lr_ratio; /**< m in [0, 1] */
} mfsdp_schedule_t;

/** Optimizer hyper-parameters (docs/design.md, "The optimizer step"); defaults by
 * mfsdp_hparams_default(). */
typedef struct mfsdp_hparams {
    double lr;                 /**< Muon learning rate (0.02) */
    double momentum;           /**< Muon beta (0.95) */
    int nesterov;              /**< 1 (default) or 0 */
    int ns_steps;              /**< Newton-Schulz iterations (5) */
    double weight_decay;       /**< Muon decoupled weight decay (0) */
    mfsdp_scale_t scale;       /**< keller (default) or moonlight */
    double adamw_lr;           /**< 0.001 */
    double adamw_beta1;        /**< 0.9 */
    double adamw_beta2;        /**< 0.95 */
    double adamw_eps;          /**< 1e-8 */
    double adamw_weight_decay; /**< 0 */
    mfsdp_schedule_t schedule; /**< constant */
    double max_norm;           /**< global gradient-norm clipping threshold, 0 = off */
} mfsdp_hparams_t;

/** How the owners turn the op on the wire into the job's reduced gradient. */
typedef enum mfsdp_divide_rule {
    /** FSDP2's rules: avg / premulsum as they are; float16 sum = the fp16 pre/post divide;
     *  float32/bfloat16 sum on more than one rank refused as ambiguous */
    MFSDP_DIVIDE_FSDP2 = 0,
    /** FSDP2's force_sum_reduction_for_comms: sum, then the job's post-divide */
    MFSDP_DIVIDE_FORCE_SUM = 1,
    /** the owners divide a sum by the world size (MPI jobs emulating avg) */
    MFSDP_DIVIDE_WORLD = 2,
    /** the owners divide by a given factor */
    MFSDP_DIVIDE_FACTOR = 3,
} mfsdp_divide_rule_t;

/** The manifest's "training" object. */
typedef struct mfsdp_training {
    int micro_steps;            /**< reduce-scatters per group per optimizer step (1) */
    mfsdp_divide_rule_t divide; /**< fsdp2 */
    double divide_factor;       /**< MFSDP_DIVIDE_FACTOR only */
    int has_tail;               /**< 1 when "tail" was given */
    mfsdp_tail_policy_t tail;   /**< valid when has_tail */
    int has_step;               /**< 1 when "step" was given */
    mfsdp_step_mode_t step;     /**< eager or lazy, valid when has_step */
} mfsdp_training_t;

/** The manifest's "iteration" object: call-pattern variants that may occur. */
typedef struct mfsdp_iteration {
    int forward_only; /**< forward-only passes (eval) between iterations */
    int no_sync;      /**< passes without reduce-scatters (accumulation without sync) */
} mfsdp_iteration_t;

/** Kind of an FSDP collective call. */
typedef enum mfsdp_call_kind {
    MFSDP_CALL_ALLGATHER = 0,
    MFSDP_CALL_REDUCE_SCATTER = 1,
} mfsdp_call_kind_t;

/** Flag of a sequence entry: the job may skip this call. */
#define MFSDP_CALL_OPTIONAL 1u

/** One entry of a manifest's "sequence". */
typedef struct mfsdp_call {
    mfsdp_call_kind_t kind;
    size_t group;   /**< index into mfsdp_manifest_t::groups */
    unsigned flags; /**< MFSDP_CALL_OPTIONAL or 0 */
} mfsdp_call_t;

/** A parsed manifest. Owned by the caller; release with mfsdp_manifest_free(). */
typedef struct mfsdp_manifest {
    int world_size; /**< 0 when the manifest does not state it */
    int replicate;  /**< HSDP replicas (1: plain FSDP) */
    mfsdp_hparams_t hp;
    mfsdp_training_t training;
    mfsdp_iteration_t iteration;
    size_t ngroups; /**< >= 1 */
    mfsdp_group_desc_t *groups;
    size_t ncalls; /**< 0 when there is no "sequence" */
    mfsdp_call_t *sequence;
} mfsdp_manifest_t;

/** @brief Fill @p hp with the defaults of docs/design.md, "The optimizer step". */
MFSDP_API void mfsdp_hparams_default(mfsdp_hparams_t *hp);

/** @brief Fill @p t with the defaults of docs/manifest.md ("training"). */
MFSDP_API void mfsdp_training_default(mfsdp_training_t *t);

/**
 * @brief Parse a manifest from memory.
 * @param [in]  text    JSON text (need not be NUL-terminated)
 * @param [in]  len     bytes in @p text
 * @param [in]  origin  name used in error messages (a file name), may be NULL
 * @param [out] err     buffer for a one-line error message, may be NULL
 * @param [in]  errlen  size of @p err
 * @param [out] manifest_p  the manifest, written on success
 * @return MFSDP_OK, MFSDP_ERR_PARSE (bad content), MFSDP_ERR_OVERFLOW, MFSDP_ERR_UNSUPPORTED,
 *         MFSDP_ERR_INVALID_ARG or MFSDP_ERR_NO_MEMORY
 */
MFSDP_API mfsdp_status_t mfsdp_manifest_parse(const char *text, size_t len, const char *origin,
                                              char *err, size_t errlen,
                                              mfsdp_manifest_t **manifest_p);

/**
 * @brief Read and parse a manifest file; see mfsdp_manifest_parse().
 * @return additionally MFSDP_ERR_IO when the file cannot be read
 */
MFSDP_API mfsdp_status_t mfsdp_manifest_load(const char *path, char *err, size_t errlen,
                                             mfsdp_manifest_t **manifest_p);

/**
 * @brief Serialize a manifest as `mfsdp-manifest/1` JSON (parses back to an equal manifest).
 * @param [out] json_p  malloc'd NUL-terminated text, written on success; free() it
 */
MFSDP_API mfsdp_status_t mfsdp_manifest_to_json(const mfsdp_manifest_t *manifest, char **json_p);

/** @brief Release a manifest (NULL is allowed). */
MFSDP_API void mfsdp_manifest_free(mfsdp_manifest_t *manifest);

/** @brief Index of the group named @p name, or MFSDP_ERR_NOT_FOUND. */
MFSDP_API mfsdp_status_t mfsdp_manifest_find_group(const mfsdp_manifest_t *manifest,
                                                   const char *name, size_t *index_p);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_MANIFEST_H */
