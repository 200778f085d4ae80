/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Every MFSDP_* environment variable, declared once (X-macro table: type, name, field,
 * default, accepted values, help), parsed once into mfsdp_config_t. `mfsdp-plan --env`
 * and the README's variable list are generated from this table.
 *
 * Types: BOOL (0/1, true/false, yes/no, on/off), INT (decimal, with bounds), DOUBLE (with
 * bounds), SIZE (bytes with an optional K/M/G/T suffix, powers of 1024), STR (free text),
 * ENUM (one of a '|' separated list, case-insensitive; stored as the index in that list).
 */
#ifndef MFSDP_CORE_CONFIG_H
#define MFSDP_CORE_CONFIG_H

#include <stddef.h>
#include <stdio.h>

#include "core/log.h"
#include "mfsdp/status.h"

/* X(type, NAME, field, default, choices-or-bounds, help)
 * For INT/DOUBLE, "choices" is "min:max" (either side may be empty). For ENUM the list. */
#define MFSDP_CONFIG_TABLE(X)                                                                      \
    X(ENUM, MFSDP_DEBUG, debug, "WARN", "NONE|VERSION|WARN|INFO|TRACE",                            \
      "log level (NCCL_DEBUG semantics; NONE and VERSION silence warnings and the summary, "       \
      "not the errors that stop a job)")                                                           \
    X(STR, MFSDP_DEBUG_SUBSYS, debug_subsys, "ALL", "",                                            \
      "comma list of subsystems to log at INFO/TRACE, of " MFSDP_SUBSYS_LIST "; a leading ^ "      \
      "negates")                                                                                   \
    X(STR, MFSDP_DEBUG_FILE, debug_file, "", "",                                                   \
      "write logs to this file instead of stderr (%h host, %p pid)")                               \
    X(STR, MFSDP_MANIFEST, manifest, "", "", "manifest (mfsdp-manifest/1 JSON) for the shim")      \
    X(STR, MFSDP_RECORD, record, "", "",                                                           \
      "record every all-gather and reduce-scatter per comm to this path (pass-through mode; "      \
      "record several iterations, then join with mfsdp-plan --record)")                            \
    X(INT, MFSDP_RECORD_MAX, record_max, "100000", "1:100000000",                                  \
      "most calls recorded per communicator")                                                      \
    X(ENUM, MFSDP_STEP, step, "", "eager|lazy",                                                    \
      "run the owner step when a group's reduce lands (eager) or before the next "                 \
      "iteration's first all-gather (lazy; required with clipping); unset: the manifest's "        \
      "training.step, else eager (lazy with clipping)")                                            \
    X(INT, MFSDP_ACCUM_STEPS, accum_steps, "", "1:1000000",                                        \
      "reduce-scatters summed per optimizer step; unset: the manifest's training.micro_steps")     \
    X(DOUBLE, MFSDP_CLIP, clip, "",                                                                \
      "0:", "global gradient-norm clipping threshold, 0 = off; unset: the manifest's max_norm")    \
    X(STR, MFSDP_LR_SCHEDULE, lr_schedule, "", "",                                                 \
      "lr schedule overriding the manifest's: KIND[,warmup=W][,stable=S][,decay=D][,min=M]"        \
      "[,shape=linear|cosine|sqrt] with KIND constant|warmup-cosine|warmup-linear|wsd")            \
    X(ENUM, MFSDP_TAIL, tail, "", "owner|shard|auto|job",                                          \
      "where AdamW tensors live: whole on an owner, FSDP's even slices, auto, or job (the "        \
      "job's own optimizer trains them); unset: the manifest's training.tail, else auto")          \
    X(SIZE, MFSDP_MEM_LIMIT, mem_limit, "0", "",                                                   \
      "owner-arena bytes allowed per rank (K/M/G/T suffixes); 0 = unlimited")                      \
    X(ENUM, MFSDP_GATHER_ALGO, gather_algo, "auto", "auto|direct|chain|native",                    \
      "owner-broadcast algorithm for the all-gather")                                              \
    X(ENUM, MFSDP_REDUCE_ALGO, reduce_algo, "auto", "auto|direct|chain|native",                    \
      "reduce-to-owner algorithm for the reduce-scatter")                                          \
    X(STR, MFSDP_ALGO_TABLE, algo_table, "", "",                                                   \
      "measured algorithm table (CSV, written by mfsdp-perf --tune-out): 'auto' takes each "       \
      "group's algorithm from its first row matching (collective, ranks, buffer bytes); "          \
      "unset or no match: the built-in rule (docs/PERFORMANCE.md)")                                \
    X(SIZE, MFSDP_CHAIN_CHUNK, chain_chunk, "1M", "", "chunk bytes of the chain pipeline")         \
    X(SIZE, MFSDP_STAGING_BYTES, staging_bytes, "64M", "",                                         \
      "communication staging per rank: the reduce-to-owner's chunks (every algorithm) and the "    \
      "chain all-gather's are sized so that their rings and the sharded-tail reduce fit "          \
      "(docs/PERFORMANCE.md)")                                                                     \
    X(STR, MFSDP_GRAD_DIVIDE, grad_divide, "", "",                                                 \
      "how owners turn a sum on the wire into the job's gradient, overriding the manifest's "      \
      "training.grad_divide: fsdp2 (FSDP2's rules), force_sum, world (divide by the world "        \
      "size: an MPI job emulating avg with MPI_SUM) or a number")                                  \
    X(BOOL, MFSDP_SPREAD, spread, "1", "",                                                         \
      "spread each group's matrices over ranks (avoid reduce incast on one owner)")                \
    X(DOUBLE, MFSDP_LR, lr, "", "0:", "override the manifest's Muon learning rate")                \
    X(DOUBLE, MFSDP_MOMENTUM, momentum, "", "0:1", "override the Muon momentum (beta, below 1)")   \
    X(INT, MFSDP_NS_STEPS, ns_steps, "", "0:100", "override the Newton-Schulz iteration count")    \
    X(DOUBLE, MFSDP_WEIGHT_DECAY, weight_decay, "", "0:", "override the Muon weight decay")        \
    X(BOOL, MFSDP_NESTEROV, nesterov, "", "", "override Nesterov momentum (0/1)")                  \
    X(ENUM, MFSDP_SCALE, scale, "", "keller|moonlight", "override the Muon scale rule")            \
    X(DOUBLE, MFSDP_ADAMW_LR, adamw_lr, "", "0:", "override the AdamW learning rate")              \
    X(DOUBLE, MFSDP_ADAMW_WEIGHT_DECAY, adamw_weight_decay, "",                                    \
      "0:", "override the AdamW weight decay")                                                     \
    X(ENUM, MFSDP_TRANSPORT, transport, "auto", "auto|mpi|nccl",                                   \
      "what moves owner collectives: auto = nccl on NCCL communicators (the job's own, on the "    \
      "intercepted call's stream; no MPI needed) and mpi on MPI ones; mpi on an NCCL "             \
      "communicator = the MPI transport over host memory (the test NCCL library only)")            \
    X(BOOL, MFSDP_NCCL_REGISTER, nccl_register, "0", "",                                           \
      "NCCL path: allocate the owner arena with ncclMemAlloc and register it once with the "       \
      "communicator (ncclCommRegister, zero-copy transfers); 0 = cudaMalloc, unregistered. "       \
      "Every rank must agree")                                                                     \
    X(BOOL, MFSDP_MLOCK, mlock, "1", "",                                                           \
      "page-lock CPU owner arenas (falls back with a warning when RLIMIT_MEMLOCK forbids)")        \
    X(BOOL, MFSDP_NUMA_BIND, numa_bind, "1", "", "bind CPU owner arenas to the rank's NUMA node")  \
    X(BOOL, MFSDP_SHM, shm, "1", "",                                                               \
      "MPI transport: owner arenas in POSIX shared memory, so that a direct all-gather copies "    \
      "the tensors of owners on the same node from their arenas instead of receiving messages "    \
      "(falls back to messages, with a warning, when /dev/shm is too small); 0 = messages")        \
    X(BOOL, MFSDP_REPORT, report, "0", "",                                                         \
      "the shim prints one 'mfsdp report:' line per rank and communicator at exit (owner "         \
      "step time, call counts, arena memory)")                                                     \
    X(STR, MFSDP_CKPT_DIR, ckpt_dir, "", "",                                                       \
      "the shim checkpoints the context into this root (DIR/step-S, DIR/latest): every "           \
      "MFSDP_CKPT_EVERY steps and when the communicator is released (docs/checkpoints.md)")        \
    X(INT, MFSDP_CKPT_EVERY, ckpt_every, "0", "0:1000000000",                                      \
      "with MFSDP_CKPT_DIR: save after every this many optimizer steps; 0 = only at the end")      \
    X(INT, MFSDP_CKPT_KEEP, ckpt_keep, "0", "0:1000000",                                           \
      "with MFSDP_CKPT_DIR: keep the newest this many checkpoints, delete older ones; 0 = all")    \
    X(STR, MFSDP_RESUME, resume, "", "",                                                           \
      "the shim loads this checkpoint (a root, its latest; or a step directory) when it creates "  \
      "the context; 'auto' = MFSDP_CKPT_DIR's latest when there is one, else a fresh start")       \
    X(STR, MFSDP_INIT, init, "", "",                                                               \
      "the shim loads these full weights (one safetensors file) when it creates the context, "     \
      "instead of taking the job's first all-gather (not with a checkpoint to resume)")            \
    X(ENUM, MFSDP_COMPANION, companion, "", "tag|manifest",                                        \
      "set by the PyTorch companion (mfsdp-run: tag; python -m mfsdp.manifest: manifest): the "    \
      "companion registers the manifest and tags every FSDP2 collective (docs/pytorch.md)")        \
    X(STR, MFSDP_PRELOAD_LIB, preload_lib, "", "",                                                 \
      "mfsdp-run: path of libmfsdp_preload.so (skips its search)")                                 \
    X(STR, MFSDP_BUILD_DIR, build_dir, "", "",                                                     \
      "mfsdp-run: build directory of the repository searched for the shim (default build)")        \
    X(STR, MFSDP_PY_ADAMW, py_adamw, "", "",                                                       \
      "PyTorch companion: regular expression on param names; matching params stay with the "       \
      "job's optimizer")                                                                           \
    X(STR, MFSDP_WRITE_MANIFEST, write_manifest, "", "",                                           \
      "PyTorch companion: rank 0 writes the job's manifest to this path at the first forward")     \
    X(STR, MFSDP_TUNER_CONFIG, tuner_config, "", "",                                               \
      "CSV of overrides for the NCCL tuner plugin libnccl-tuner-mfsdp.so (read by the plugin, "    \
      "NCCL's example-tuner format; docs/tuner.md)")                                               \
    X(INT, MFSDP_THREADS, threads, "", "1:1024",                                                   \
      "BLAS threads of the process, set when a context is created (unset: leave OpenBLAS's "       \
      "own setting, e.g. OPENBLAS_NUM_THREADS=1 with one rank per core)")

#define MFSDP_CFG_CTYPE_BOOL   int
#define MFSDP_CFG_CTYPE_INT    long
#define MFSDP_CFG_CTYPE_DOUBLE double
#define MFSDP_CFG_CTYPE_SIZE   size_t
#define MFSDP_CFG_CTYPE_STR    const char *
#define MFSDP_CFG_CTYPE_ENUM   int

typedef struct mfsdp_config {
#define MFSDP_CFG_FIELD(type, NAME, field, def, choices, help)                                     \
    MFSDP_CFG_CTYPE_##type field;                                                                  \
    int field##_set; /* 1 when the value came from the environment */
    MFSDP_CONFIG_TABLE(MFSDP_CFG_FIELD)
#undef MFSDP_CFG_FIELD
} mfsdp_config_t;

/* ENUM indices, in the order of their choice lists. */
enum { MFSDP_CFG_COMPANION_TAG = 0, MFSDP_CFG_COMPANION_MANIFEST = 1 };
enum { MFSDP_CFG_STEP_EAGER = 0, MFSDP_CFG_STEP_LAZY = 1 };
enum {
    MFSDP_CFG_TAIL_OWNER = 0,
    MFSDP_CFG_TAIL_SHARD = 1,
    MFSDP_CFG_TAIL_AUTO = 2,
    MFSDP_CFG_TAIL_JOB = 3
};
enum { MFSDP_CFG_TRANSPORT_AUTO = 0, MFSDP_CFG_TRANSPORT_MPI = 1, MFSDP_CFG_TRANSPORT_NCCL = 2 };
enum {
    MFSDP_CFG_ALGO_AUTO = 0,
    MFSDP_CFG_ALGO_DIRECT = 1,
    MFSDP_CFG_ALGO_CHAIN = 2,
    MFSDP_CFG_ALGO_NATIVE = 3
};

/* Environment lookup; getenv by default, replaceable in tests. */
typedef const char *(*mfsdp_getenv_fn)(const char *name, void *arg);

/*
 * Parse every variable through lookup into *cfg. On a bad value returns MFSDP_ERR_CONFIG
 * and writes "MFSDP_X=value: expected ..." to err. Variables with an empty default and no
 * value are left unset (field##_set == 0, field zero).
 */
mfsdp_status_t mfsdp_config_parse(mfsdp_getenv_fn lookup, void *arg, mfsdp_config_t *cfg, char *err,
                                  size_t errlen);

/* The process-wide configuration, parsed from the environment once (thread-safe). On a
 * bad value every call returns MFSDP_ERR_CONFIG (the error was logged once). */
mfsdp_status_t mfsdp_config_get(const mfsdp_config_t **cfg_p);

/* Print the table: name, type, default, accepted values, help (and the current value when
 * set in the environment). */
void mfsdp_config_print(FILE *out);

/* Number of variables in the table, and the i-th one's name and canonical value (parsed and
 * printed back; "(unset)" when unset without a default). */
size_t mfsdp_config_count(void);
mfsdp_status_t mfsdp_config_value(const mfsdp_config_t *cfg, size_t i, const char **name_p,
                                  char *value, size_t len);

/* Why mfsdp_config_get() failed (a bad value, or an unknown MFSDP_* name, with the closest
 * known one), or "" when it did not. */
const char *mfsdp_config_error(void);

/* Parse a size with optional K/M/G/T suffix. */
mfsdp_status_t mfsdp_parse_size(const char *s, size_t *out_p);

#endif /* MFSDP_CORE_CONFIG_H */
