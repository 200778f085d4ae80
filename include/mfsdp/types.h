/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file types.h
 * @brief Enumerations shared by the whole public API.
 */
#ifndef MFSDP_TYPES_H
#define MFSDP_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "mfsdp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Most dimensions a parameter may have. */
#define MFSDP_MAX_DIMS 8

/** Element types seen on the wire and in manifests. */
typedef enum mfsdp_dtype {
    MFSDP_FLOAT32 = 0,  /**< IEEE binary32 */
    MFSDP_BFLOAT16 = 1, /**< bfloat16 */
    MFSDP_FLOAT16 = 2,  /**< IEEE binary16 */
    MFSDP_UINT8 = 3,    /**< bytes: FSDP2 all-gathers mixed-dtype groups as uint8 */
    MFSDP_DTYPE_COUNT
} mfsdp_dtype_t;

/** Optimizer that owns a parameter. */
typedef enum mfsdp_role {
    MFSDP_ROLE_MUON = 0,  /**< 2-D view, Newton-Schulz on its owner */
    MFSDP_ROLE_ADAMW = 1, /**< element-wise AdamW (the "tail") */
} mfsdp_role_t;

/** Reduction semantics of a reduce-scatter, as NCCL defines them. */
typedef enum mfsdp_redop {
    MFSDP_OP_SUM = 0,       /**< sum of contributions */
    MFSDP_OP_AVG = 1,       /**< sum divided by the number of ranks */
    MFSDP_OP_PREMULSUM = 2, /**< sum of (scalar * contribution) */
} mfsdp_redop_t;

/** Where AdamW ("tail") tensors live. */
typedef enum mfsdp_tail_policy {
    MFSDP_TAIL_OWNER = 0, /**< packed whole onto an owner rank */
    MFSDP_TAIL_SHARD = 1, /**< kept in FSDP's even slices */
    MFSDP_TAIL_AUTO = 2,  /**< shard when owners would unbalance memory */
    /** the tail bytes travel with the native collective untouched and the job's own
     *  optimizer trains them; mfsdp keeps no state for them */
    MFSDP_TAIL_JOB = 3,
} mfsdp_tail_policy_t;

/** Muon update scaling rule. */
typedef enum mfsdp_scale {
    MFSDP_SCALE_KELLER = 0,    /**< max(1, m/k)^(1/2) */
    MFSDP_SCALE_MOONLIGHT = 1, /**< 0.2 * sqrt(max(m, k)) */
} mfsdp_scale_t;

/** Owner-segment collective algorithm (docs/design.md, "Owners"). */
typedef enum mfsdp_algo {
    MFSDP_ALGO_AUTO = 0,   /**< chosen from measurements and world size */
    MFSDP_ALGO_DIRECT = 1, /**< point-to-point to/from the owner, fixed-order sum */
    MFSDP_ALGO_CHAIN = 2,  /**< pipelined chunked chain, fixed order */
    MFSDP_ALGO_NATIVE = 3, /**< MPI_Ibcast/MPI_Ireduce or ncclBroadcast/ncclReduce */
} mfsdp_algo_t;

/** When the owner step runs. */
typedef enum mfsdp_step_mode {
    MFSDP_STEP_EAGER = 0, /**< as soon as a group's last micro-step reduce landed */
    MFSDP_STEP_LAZY = 1,  /**< before the next iteration's first all-gather */
    /** only when mfsdp_ctx_step() is called (the PyTorch companion: at the job's
     *  optimizer.step()) */
    MFSDP_STEP_MANUAL = 2,
} mfsdp_step_mode_t;

/** Categories of owner-arena memory (docs/design.md). */
typedef enum mfsdp_arena_cat {
    MFSDP_ARENA_MASTER = 0,   /**< fp32 master weights */
    MFSDP_ARENA_COMM = 1,     /**< communication-dtype copy of the weights */
    MFSDP_ARENA_GRAD = 2,     /**< fp32 gradient accumulator */
    MFSDP_ARENA_MOMENTUM = 3, /**< Muon momentum (fp32) */
    MFSDP_ARENA_ADAM_M = 4,   /**< AdamW first moment (fp32) */
    MFSDP_ARENA_ADAM_V = 5,   /**< AdamW second moment (fp32) */
    MFSDP_ARENA_NCAT
} mfsdp_arena_cat_t;

/**
 * @brief Bytes per element of a dtype.
 * @return 0 for an invalid dtype
 */
MFSDP_API size_t mfsdp_dtype_size(mfsdp_dtype_t dtype);

/**
 * @brief Manifest spelling of a dtype ("float32", "bfloat16", "float16", "uint8").
 * @return a static string; "invalid" for an unknown value
 */
MFSDP_API const char *mfsdp_dtype_name(mfsdp_dtype_t dtype);

/**
 * @brief Parse a manifest dtype name.
 * @param [in]  name     e.g. "bfloat16"
 * @param [out] dtype_p  written on success
 * @return MFSDP_OK, or MFSDP_ERR_INVALID_ARG for an unknown name
 */
MFSDP_API mfsdp_status_t mfsdp_dtype_parse(const char *name, mfsdp_dtype_t *dtype_p);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_TYPES_H */
