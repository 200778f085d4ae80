/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libnccl-tuner-mfsdp.so: NCCL's tuner plugin interface, v5 (NCCL 2.28) and v4 (2.27).
 * The two exported structs are the only visible symbols (libnccl-tuner-mfsdp.map).
 *
 * One context per communicator (NCCL calls init once per communicator); it is read-only
 * after init, so getCollInfo may run concurrently on different communicators.
 * getCollInfo never fails and never picks a cell NCCL ruled out (-1): when the preferred
 * cell is ruled out it leaves the table and the channel count to NCCL.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin/tuner.h"

#define TUNER_NAME "mfsdp"

typedef struct tuner_ctx {
    ncclDebugLogger_t logger;
    size_t nranks;
    size_t nnodes;
    int deferred; /* NCCL_ALGO or NCCL_PROTO set: touch nothing */
    mfsdp_tuner_rule_t *rules;
    size_t nrules;
} tuner_ctx_t;

static ncclResult_t tuner_init(const char *abi, size_t nranks, size_t nnodes,
                               ncclDebugLogger_t logger, void **ctx_p)
{
    if (ctx_p == NULL) {
        TUNER_WARN(logger, "mfsdp tuner: %s init called without a context pointer", abi);
        return ncclInvalidArgument;
    }
    tuner_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        TUNER_WARN(logger, "mfsdp tuner: out of memory for the tuner context");
        return ncclSystemError;
    }
    ctx->logger = logger;
    ctx->nranks = nranks;
    ctx->nnodes = nnodes;

    const char *path = getenv("MFSDP_TUNER_CONFIG");
    if (path != NULL && path[0] != '\0') {
        ncclResult_t res = mfsdp_tuner_config_load(path, logger, &ctx->rules, &ctx->nrules);
        if (res != ncclSuccess) {
            free(ctx);
            return res;
        }
    }

    /* Empty counts as unset, as NCCL's own parse of these treats it (every algorithm and
     * protocol stays enabled). */
    const char *algo = getenv("NCCL_ALGO");
    const char *proto = getenv("NCCL_PROTO");
    algo = algo != NULL && algo[0] != '\0' ? algo : NULL;
    proto = proto != NULL && proto[0] != '\0' ? proto : NULL;
    if (algo != NULL || proto != NULL) {
        ctx->deferred = 1;
        if (ctx->nrules > 0) {
            TUNER_WARN(logger,
                       "mfsdp tuner: NCCL_ALGO/NCCL_PROTO set: the %zu rows of %s are not used "
                       "for this communicator",
                       ctx->nrules, path);
        }
        TUNER_INFO(logger,
                   "mfsdp tuner: %s%s%s%s%s set; leaving algorithm, protocol and channels to nccl "
                   "(config rows and cost model off for this communicator)",
                   algo ? "NCCL_ALGO=" : "", algo ? algo : "", algo && proto ? ", " : "",
                   proto ? "NCCL_PROTO=" : "", proto ? proto : "");
    }
    TUNER_INFO(logger, "mfsdp tuner: %s init, %zu ranks on %zu nodes, %zu config rows%s%s", abi,
               nranks, nnodes, ctx->nrules, path && path[0] ? " from " : "",
               path && path[0] ? path : "");
    *ctx_p = ctx;
    return ncclSuccess;
}

static int rule_matches(const mfsdp_tuner_rule_t *r, const tuner_ctx_t *ctx, ncclFunc_t coll,
                        size_t nbytes, int pipe_ops, int reg_buff)
{
    return r->coll == coll && nbytes >= r->min_bytes && nbytes <= r->max_bytes &&
           (r->nnodes == MFSDP_TUNER_ANY || (size_t)r->nnodes == ctx->nnodes) &&
           (r->nranks == MFSDP_TUNER_ANY || (size_t)r->nranks == ctx->nranks) &&
           (r->pipe_ops == MFSDP_TUNER_ANY || r->pipe_ops == pipe_ops) &&
           (r->reg_buff == MFSDP_TUNER_ANY || r->reg_buff == reg_buff);
}

static ncclResult_t tuner_get_coll_info(void *context, ncclFunc_t coll, size_t nbytes, int pipe_ops,
                                        float **cost_table, int num_algo, int num_proto,
                                        int reg_buff, int *nchannels)
{
    const tuner_ctx_t *ctx = context;
    if (ctx == NULL || ctx->deferred || cost_table == NULL || nchannels == NULL || num_algo <= 0 ||
        num_proto <= 0) {
        return ncclSuccess;
    }
    /* A contiguous float[num_algo][num_proto] behind a float** (NCCL casts it so). */
    float *table = (float *)cost_table;

    for (size_t i = 0; i < ctx->nrules; i++) {
        const mfsdp_tuner_rule_t *r = &ctx->rules[i];
        if (!rule_matches(r, ctx, coll, nbytes, pipe_ops, reg_buff)) {
            continue;
        }
        if (r->algo >= num_algo || r->proto >= num_proto ||
            table[r->algo * num_proto + r->proto] < 0.0f) {
            TUNER_TRACE(ctx->logger,
                        "mfsdp tuner: config line %d matches %s %zu bytes but %s/%s is ruled out "
                        "by nccl; trying the next row",
                        r->line, mfsdp_tuner_coll_name(coll), nbytes,
                        mfsdp_tuner_algo_name(r->algo), mfsdp_tuner_proto_name(r->proto));
            continue;
        }
        table[r->algo * num_proto + r->proto] = 0.0f;
        if (r->channels > 0) {
            *nchannels = r->channels;
        }
        TUNER_TRACE(ctx->logger,
                    "mfsdp tuner: %s %zu bytes pipeOps %d regBuff %d: config line %d -> %s/%s, "
                    "channels %d",
                    mfsdp_tuner_coll_name(coll), nbytes, pipe_ops, reg_buff, r->line,
                    mfsdp_tuner_algo_name(r->algo), mfsdp_tuner_proto_name(r->proto),
                    r->channels > 0 ? r->channels : 0);
        return ncclSuccess;
    }

    /* The model: owner segments only, and only where there is a ring to tune. */
    if ((coll != ncclFuncBroadcast && coll != ncclFuncReduce) || ctx->nranks < 2 ||
        num_algo <= NCCL_ALGO_RING || num_proto < NCCL_NUM_PROTOCOLS) {
        return ncclSuccess;
    }
    mfsdp_tuner_choice_t choice;
    mfsdp_tuner_model(nbytes, pipe_ops, ctx->nranks, ctx->nnodes, &choice);
    float *cell = &table[NCCL_ALGO_RING * num_proto + choice.proto];
    if (*cell < 0.0f) {
        TUNER_TRACE(ctx->logger,
                    "mfsdp tuner: %s %zu bytes pipeOps %d: model prefers ring/%s, ruled out by "
                    "nccl; nccl chooses",
                    mfsdp_tuner_coll_name(coll), nbytes, pipe_ops,
                    mfsdp_tuner_proto_name(choice.proto));
        return ncclSuccess;
    }
    *cell = 0.0f;
    *nchannels = choice.channels;
    TUNER_TRACE(ctx->logger, "mfsdp tuner: %s %zu bytes pipeOps %d: model -> ring/%s, channels %d",
                mfsdp_tuner_coll_name(coll), nbytes, pipe_ops, mfsdp_tuner_proto_name(choice.proto),
                choice.channels);
    return ncclSuccess;
}

static ncclResult_t tuner_fini(void *context)
{
    tuner_ctx_t *ctx = context;
    if (ctx != NULL) {
        free(ctx->rules);
        free(ctx);
    }
    return ncclSuccess;
}

static ncclResult_t tuner_init_v5(void **ctx_p, uint64_t comm_id, size_t nranks, size_t nnodes,
                                  ncclDebugLogger_t logger, ncclNvlDomainInfo_v5_t *nvl_domains,
                                  ncclTunerConstants_v5_t *constants)
{
    /* NCCL's constants are left as they are: the model keeps its own (docs/tuner.md). */
    return tuner_init("v5", nranks, nnodes, logger, ctx_p);
}

static ncclResult_t tuner_init_v4(size_t nranks, size_t nnodes, ncclDebugLogger_t logger,
                                  void **ctx_p)
{
    return tuner_init("v4", nranks, nnodes, logger, ctx_p);
}

__attribute__((visibility("default"))) const ncclTuner_v5_t ncclTunerPlugin_v5 = {
    .name = TUNER_NAME,
    .init = tuner_init_v5,
    .getCollInfo = tuner_get_coll_info,
    .finalize = tuner_fini,
};

__attribute__((visibility("default"))) const ncclTuner_v4_t ncclTunerPlugin_v4 = {
    .name = TUNER_NAME,
    .init = tuner_init_v4,
    .getCollInfo = tuner_get_coll_info,
    .destroy = tuner_fini,
};
