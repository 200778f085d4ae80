/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libnccl-tuner-mfsdp.so internals (docs/tuner.md, docs/tuner.md): the cost model
 * for the owner-segment collectives (Broadcast, Reduce), the override rules read from
 * MFSDP_TUNER_CONFIG, and logging through the logger NCCL hands to init. The plugin
 * stands alone inside NCCL: libc only, nothing of libmfsdp.
 */
#ifndef MFSDP_PLUGIN_TUNER_H
#define MFSDP_PLUGIN_TUNER_H

#include <stddef.h>
#include <stdint.h>

#include "plugin/nccl_tuner_abi.h"

/* Wildcard of every integer field of a rule (as in NCCL's example tuner). */
#define MFSDP_TUNER_ANY (-1)

/* One CSV row: coll,min_bytes,max_bytes,algo,proto,channels,nNodes,nRanks[,numPipeOps[,regBuff]].
 */
typedef struct mfsdp_tuner_rule {
    ncclFunc_t coll;
    size_t min_bytes; /* -1 in the file: 0 */
    size_t max_bytes; /* -1 in the file: SIZE_MAX */
    int algo;         /* NCCL_ALGO_* */
    int proto;        /* NCCL_PROTO_* */
    int channels;     /* > 0: applied; -1 or 0: NCCL keeps its own count */
    int nnodes;       /* MFSDP_TUNER_ANY or >= 1 */
    int nranks;       /* MFSDP_TUNER_ANY or >= 1 */
    int pipe_ops;     /* MFSDP_TUNER_ANY or >= 1 */
    int reg_buff;     /* MFSDP_TUNER_ANY, 0 or 1 */
    int line;         /* line number in the file, for the log */
} mfsdp_tuner_rule_t;

/* What the model prefers for one Broadcast/Reduce. */
typedef struct mfsdp_tuner_choice {
    int proto;    /* NCCL_PROTO_* */
    int channels; /* >= 1 */
} mfsdp_tuner_choice_t;

/* Logs through NCCL's logger (subsystem NCCL_TUNING); a NULL logger drops the message.
 * The format goes to NCCL unformatted, so NCCL filters by level before any formatting. */
#define TUNER_LOG(logger, level, ...)                                                              \
    do {                                                                                           \
        if ((logger) != NULL) {                                                                    \
            (logger)((level), NCCL_TUNING, __FILE__, __LINE__, __VA_ARGS__);                       \
        }                                                                                          \
    } while (0)
/* Warnings go to every subsystem (NCCL's own WARN() passes NCCL_ALL): NCCL drops a message
 * whose flags miss NCCL_DEBUG_SUBSYS, which by default lacks TUNING. */
#define TUNER_WARN(logger, ...)                                                                    \
    do {                                                                                           \
        if ((logger) != NULL) {                                                                    \
            (logger)(NCCL_LOG_WARN, ~0UL, __FILE__, __LINE__, __VA_ARGS__);                        \
        }                                                                                          \
    } while (0)
#define TUNER_INFO(logger, ...)  TUNER_LOG(logger, NCCL_LOG_INFO, __VA_ARGS__)
#define TUNER_TRACE(logger, ...) TUNER_LOG(logger, NCCL_LOG_TRACE, __VA_ARGS__)

/* Reads the rules of `path`. Every line is a rule, a comment (first non-blank character
 * '#') or blank; any other line fails the whole load with a WARN naming path:line and
 * what was expected (ncclInvalidUsage); a file that cannot be read fails with
 * ncclSystemError. On success *rules_p (malloc'd, NULL when there are none) and
 * *count_p are written. */
ncclResult_t mfsdp_tuner_config_load(const char *path, ncclDebugLogger_t logger,
                                     mfsdp_tuner_rule_t **rules_p, size_t *count_p);

/* Names as written in the CSV file (NCCL's example tuner spelling). */
const char *mfsdp_tuner_coll_name(ncclFunc_t coll);
const char *mfsdp_tuner_algo_name(int algo);
const char *mfsdp_tuner_proto_name(int proto);

/* The cost model of docs/tuner.md for a ring Broadcast/Reduce of `nbytes` with
 * `pipe_ops` operations per channel in the group, on `nranks` ranks over `nnodes` nodes. */
void mfsdp_tuner_model(size_t nbytes, int pipe_ops, size_t nranks, size_t nnodes,
                       mfsdp_tuner_choice_t *choice_p);

#endif
