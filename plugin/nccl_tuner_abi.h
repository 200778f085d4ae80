/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NCCL tuner-plugin ABI, declared by this project from NCCL's documented interface
 * (NVIDIA/nccl v2.28.9-1: src/include/plugin/nccl_tuner.h, tuner/tuner_v4.h,
 * tuner/tuner_v5.h, src/include/nccl_common.h). NCCL ships no installed tuner header, so
 * the plugin cannot include one; every member order, type and constant here must match
 * those files exactly (docs/tuner.md lists what was checked).
 *
 * v5 is the interface of NCCL 2.28 (and is still loaded by 2.30); v4 is NCCL 2.27's.
 * Both take the same getCollInfo; they differ in init's arguments and in the name of
 * the last member (finalize vs destroy).
 */
#ifndef MFSDP_PLUGIN_NCCL_TUNER_ABI_H
#define MFSDP_PLUGIN_NCCL_TUNER_ABI_H

#include <stddef.h>
#include <stdint.h>

/* nccl.h: ncclResult_t (an int-sized enum; only the values the plugin returns). */
typedef enum {
    ncclSuccess = 0,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
} ncclResult_t;

/* nccl_common.h: log levels and subsystem flags of the logger NCCL passes to init. */
typedef enum {
    NCCL_LOG_NONE = 0,
    NCCL_LOG_VERSION = 1,
    NCCL_LOG_WARN = 2,
    NCCL_LOG_INFO = 3,
    NCCL_LOG_ABORT = 4,
    NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

#define NCCL_TUNING 0x40

/* printf-checked here (NCCL's typedef has no attribute; the ABI is the same). */
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file,
                                  int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* nccl_common.h: the collective passed to getCollInfo. Only the first five reach a tuner
 * (NCCL_NUM_FUNCTIONS == 5): send/recv are P2P, and 2.28 runs AlltoAll/Gather/Scatter as
 * P2P tasks, none of which goes through getCollInfo. */
typedef enum {
    ncclFuncBroadcast = 0,
    ncclFuncReduce = 1,
    ncclFuncAllGather = 2,
    ncclFuncReduceScatter = 3,
    ncclFuncAllReduce = 4,
    ncclFuncSendRecv = 5,
    ncclFuncSend = 6,
    ncclFuncRecv = 7,
    ncclFuncAlltoAll = 8,
    ncclFuncScatter = 9,
    ncclFuncGather = 10,
    ncclNumFuncs = 11,
} ncclFunc_t;

/* Cost-table indices (nccl_tuner.h). The table is a contiguous float[numAlgo][numProto]
 * passed as float**; a cell of -1.0 is ruled out, the lowest non-negative cost wins. */
#define NCCL_ALGO_TREE           0
#define NCCL_ALGO_RING           1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN  3
#define NCCL_ALGO_NVLS           4
#define NCCL_ALGO_NVLS_TREE      5
#define NCCL_ALGO_PAT            6
#define NCCL_NUM_ALGORITHMS      7

#define NCCL_PROTO_LL      0
#define NCCL_PROTO_LL128   1
#define NCCL_PROTO_SIMPLE  2
#define NCCL_NUM_PROTOCOLS 3

#define NCCL_ALGO_PROTO_IGNORE -1.0f

/* tuner_v5.h */
typedef struct {
    int nNvlDomains;
    int minRanksPerNvlDomain;
    int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

#define NCCL_NUM_HW_LINKS_V5      3
#define NCCL_NUM_COMPCAPS_V5      4
#define NCCL_NUM_TUNING_SCALES_V5 3

typedef struct {
    double baseLatencies[NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];
    double hwLatencies[NCCL_NUM_HW_LINKS_V5][NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS];
    double llMaxBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
    double perChMaxRingLL128Bws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
    double perChMaxTreeLL128Bws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
    double perChMaxTreeBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
    double perChMaxNVLSTreeBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
} ncclTunerConstants_v5_t;

typedef struct {
    const char *name;
    ncclResult_t (*init)(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                         ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                         ncclTunerConstants_v5_t *constants);
    ncclResult_t (*getCollInfo)(void *ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                float **collCostTable, int numAlgo, int numProto, int regBuff,
                                int *nChannels);
    ncclResult_t (*finalize)(void *ctx);
} ncclTuner_v5_t;

/* tuner_v4.h */
typedef struct {
    const char *name;
    ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **ctx);
    ncclResult_t (*getCollInfo)(void *ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                float **collCostTable, int numAlgo, int numProto, int regBuff,
                                int *nChannels);
    ncclResult_t (*destroy)(void *ctx);
} ncclTuner_v4_t;

/* Layout facts from the headers: a mismatch here is an ABI break, caught at compile time. */
_Static_assert(sizeof(ncclResult_t) == sizeof(int), "ncclResult_t is int-sized");
_Static_assert(sizeof(ncclFunc_t) == sizeof(int), "ncclFunc_t is int-sized");
_Static_assert(sizeof(ncclTunerConstants_v5_t) == sizeof(double) * (7 * 3 + 3 * 7 * 3 + 5 * 4 * 3),
               "ncclTunerConstants_v5_t: 2 latency tables and 5 bandwidth tables of doubles");
_Static_assert(offsetof(ncclTuner_v5_t, finalize) == 3 * sizeof(void *),
               "ncclTuner_v5_t: name, init, getCollInfo, finalize");
_Static_assert(offsetof(ncclTuner_v4_t, destroy) == 3 * sizeof(void *),
               "ncclTuner_v4_t: name, init, getCollInfo, destroy");

#endif
