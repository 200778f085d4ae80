/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The effective settings of a job: what the manifest says, overridden by MFSDP_* variables
 * (docs/manifest.md, docs/variables.md). Pure functions, shared by the runtime, the shim and
 * the tools, so that each rule lives in one place:
 *  - the learning-rate schedule factor (torchtitan's lr_scheduler) and its variable syntax;
 *  - the gradient divide rules (FSDP2's _get_gradient_divide_factors): which op an owner
 *    applies for the op it sees on the wire;
 *  - the settings fingerprint that every rank compares at start, so that a different
 *    MFSDP_* value or manifest on one rank is one clear error, never a hang or a truncation.
 */
#ifndef MFSDP_CORE_SETTINGS_H
#define MFSDP_CORE_SETTINGS_H

#include <stdint.h>

#include "core/config.h"
#include "mfsdp/manifest.h"

/* Everything that shapes a plan or a step, resolved. */
typedef struct mfsdp_settings {
    mfsdp_hparams_t hp;         /* manifest optimizer + MFSDP_LR... overrides + schedule */
    mfsdp_tail_policy_t tail;   /* MFSDP_TAIL, else training.tail, else auto */
    size_t mem_limit;           /* MFSDP_MEM_LIMIT */
    int spread;                 /* MFSDP_SPREAD */
    int micro_steps;            /* MFSDP_ACCUM_STEPS, else training.micro_steps */
    double clip;                /* MFSDP_CLIP, else optimizer.max_norm */
    int has_step;               /* 1 when the step mode was given (variable or manifest) */
    mfsdp_step_mode_t step;     /* MFSDP_STEP, else training.step */
    mfsdp_divide_rule_t divide; /* MFSDP_GRAD_DIVIDE, else training.grad_divide */
    double divide_factor;       /* MFSDP_DIVIDE_FACTOR only */
} mfsdp_settings_t;

/* Resolve the settings of manifest m under configuration cfg. MFSDP_ERR_CONFIG with a one-line
 * message naming the variable for a value that parses as a variable but is invalid here (a
 * bad MFSDP_LR_SCHEDULE or MFSDP_GRAD_DIVIDE). */
mfsdp_status_t mfsdp_settings_resolve(const mfsdp_manifest_t *m, const mfsdp_config_t *cfg,
                                      mfsdp_settings_t *out, char *err, size_t errlen);

/* Parse MFSDP_LR_SCHEDULE: KIND[,warmup=W][,stable=S][,decay=D][,min=M][,shape=linear|cosine|
 * sqrt], with the manifest's rules (docs/manifest.md "schedule"). */
mfsdp_status_t mfsdp_schedule_parse(const char *text, mfsdp_schedule_t *out, char *err,
                                    size_t errlen);

/* The lr factor at optimizer step t (0 for the first step): torchtitan's
 * linear_warmup_stable_decay. Always in [0, 1]. */
double mfsdp_schedule_factor(const mfsdp_schedule_t *s, int64_t t);

/* FSDP2's fp16 pre-divide factor for a divide factor f (a power of two near sqrt(f)). */
double mfsdp_fsdp2_predivide(double f);

/*
 * The op an owner applies to the contributions of a reduce, so that its gradient equals the
 * one the job would have: wire_op and wire_scalar are what the job's reduce-scatter carries;
 * dtype its reduce dtype; dp the data-parallel size (shard ranks x replicas). On success
 * *op_p / *scalar_p (premulsum factor) are the op to apply over the shard group, and
 * *post_p the divide to apply after every reduction (1 when none). MFSDP_ERR_UNSUPPORTED
 * with a message when the rule does not determine the gradient (a float32/bfloat16 sum under
 * the fsdp2 rule on more than one rank) or contradicts the op.
 */
mfsdp_status_t mfsdp_divide_resolve(mfsdp_divide_rule_t rule, double factor, mfsdp_dtype_t dtype,
                                    int dp, mfsdp_redop_t wire_op, double wire_scalar,
                                    mfsdp_redop_t *op_p, double *scalar_p, double *post_p,
                                    char *err, size_t errlen);

/* Fold a post-divide into the op the owners apply over a reduce of world ranks: sum/post (avg
 * when post == world, else premulsum 1/post), avg/post, premulsum scalar/post. */
void mfsdp_divide_fold(int world, double post, mfsdp_redop_t *op, double *scalar);

/* One entry of a settings fingerprint: what every rank must agree on. */
#define MFSDP_FP_VALUE_LEN 40
typedef struct mfsdp_fp_item {
    const char *name;               /* "MFSDP_TAIL", "manifest", ... (static) */
    uint64_t hash;                  /* of the value */
    char value[MFSDP_FP_VALUE_LEN]; /* the value, shortened, for messages */
} mfsdp_fp_item_t;

/* Set one entry: name (static) and value (hashed whole, kept shortened for messages). */
void mfsdp_fp_item_set(mfsdp_fp_item_t *it, const char *name, const char *value);

/* Most entries a fingerprint has. */
#define MFSDP_FP_MAX 48

/* Fill items (MFSDP_FP_MAX entries) with the fingerprint of (manifest, world, every MFSDP_*
 * variable that shapes the plan, the identification or the step); manifest may be NULL (a
 * rank without one). Returns the number of entries. */
size_t mfsdp_settings_fingerprint(const mfsdp_manifest_t *m, int world, const mfsdp_config_t *cfg,
                                  mfsdp_fp_item_t *items);

/* How mfsdp_settings_agree() talks to the other ranks (a transport, or the shim's PMPI). Each
 * returns 0 on success. */
typedef struct mfsdp_agree_ops {
    /* element-wise min (is_max 0) or max (1) of n uint64 over every rank, in place */
    int (*allreduce_u64)(void *arg, uint64_t *buf, size_t n, int is_max);
    /* bytes from every rank, rank-major into all */
    int (*allgather)(void *arg, const void *mine, size_t bytes, void *all);
    void *arg;
    int rank;
    int world;
} mfsdp_agree_ops_t;

/*
 * Compare a fingerprint across ranks (collective: every rank calls it with the same number of
 * items). MFSDP_OK when every rank has the same value of every item; MFSDP_ERR_MISMATCH with a
 * one-line message, identical on every rank, naming the first item that differs and the value
 * on each distinct rank group ("MFSDP_TAIL differs across ranks: 'auto' on ranks 0-2, 'owner'
 * on rank 3", followed by MFSDP_AGREE_HINT); MFSDP_ERR_TRANSPORT when the exchange itself
 * fails.
 */
#define MFSDP_AGREE_HINT "; every rank must run with the same MFSDP_* settings and manifest"
mfsdp_status_t mfsdp_settings_agree(const mfsdp_fp_item_t *items, size_t n,
                                    const mfsdp_agree_ops_t *ops, char *err, size_t errlen);

/* FNV-1a over bytes, for fingerprints. */
uint64_t mfsdp_hash_bytes(uint64_t h, const void *p, size_t n);
#define MFSDP_HASH_INIT 1469598103934665603ull

#endif /* MFSDP_CORE_SETTINGS_H */
