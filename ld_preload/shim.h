/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Front-end-independent state of the LD_PRELOAD shim (docs/design.md, "Identification",
 * docs/design.md): the configuration and manifest, one entry per intercepted communicator,
 * the two identification modes (sequence: core/matcher.c; tagged: shim_tag.c), the
 * never-silent rules (shim_report.c) and MFSDP_RECORD (shim_record.c). The NCCL and MPI
 * front-ends (nccl_front.c, mpi_front.c) translate their calls into shim_call_t and mfsdp
 * statuses into their own error codes; nothing here knows NCCL types.
 */
#ifndef MFSDP_LD_PRELOAD_SHIM_H
#define MFSDP_LD_PRELOAD_SHIM_H

#include <pthread.h>
#include <stdint.h>

#include "core/config.h"
#include "core/matcher.h"
#include "core/record.h"
#include "core/settings.h"
#include "mfsdp/runtime.h"

typedef enum shim_frontend { SHIM_MPI = 0, SHIM_NCCL = 1 } shim_frontend_t;

struct shim_comm;

/* What the core needs of a front-end for one communicator: the settings exchange, creating a
 * context on it, attaching it as HSDP's replicate communicator, and releasing the front-end's
 * own state. The MPI front-end runs them on the MPI communicator (mpi_ops.c); the NCCL
 * front-end on the NCCL communicator itself, through the NCCL transport (nccl_ops.c, no MPI).
 * The exchanges run inside an intercepted call that every rank of the comm is in, on that
 * call's stream (shim_comm_t.stream). */
typedef struct shim_fe_ops {
    /* element-wise min (is_max 0) or max (1) of n uint64 over the comm's ranks; 0 on success */
    int (*allreduce_u64)(struct shim_comm *c, uint64_t *buf, size_t n, int is_max);
    /* bytes from every rank, rank-major; 0 on success */
    int (*allgather)(struct shim_comm *c, const void *mine, size_t bytes, void *all);
    mfsdp_status_t (*ctx_create)(struct shim_comm *c, const mfsdp_manifest_t *m,
                                 const mfsdp_ctx_opts_t *opts, mfsdp_ctx_h *ctx_p);
    mfsdp_status_t (*attach_replicate)(mfsdp_ctx_h ctx, struct shim_comm *replicate);
    void (*release)(struct shim_comm *c);
} shim_fe_ops_t;

/* A tagged-mode registration (mfsdp_shim_register): a manifest the companion built, bound to
 * the communicator of its first tagged call. */
typedef struct shim_reg {
    int id;
    mfsdp_manifest_t *manifest;
    mfsdp_settings_t settings;
    mfsdp_matcher_t *matcher; /* signatures for checking tags (built at binding) */
    struct shim_comm *comm;   /* NULL until the first tagged call */
    int spent; /* its communicator remapped calls and is gone (the owners' state with it) */
} shim_reg_t;

/* One intercepted communicator. */
typedef struct shim_comm {
    shim_frontend_t fe;
    const void *handle;       /* the job's comm handle (MPI_Comm or ncclComm_t) */
    const shim_fe_ops_t *ops; /* the front-end's operations on this comm */
    void *fe_state;           /* the front-end's own state of the comm */
    void *stream;             /* the stream of the call in progress (its lock held) */
    int size;
    int rank;
    int agreed;                  /* settings compared across the comm's ranks */
    int managed;                 /* sequence mode: this comm's calls are identified */
    shim_reg_t *reg;             /* tagged mode: the registration bound to this comm */
    const mfsdp_manifest_t *man; /* the manifest this comm's context runs */
    const mfsdp_settings_t *set;
    int failed; /* an error stopped the remap: every later call fails */
    mfsdp_status_t fail_status;
    char why[1024];
    mfsdp_matcher_t *matcher; /* sequence mode */
    mfsdp_ctx_h ctx;          /* created on the first remapped call */
    pthread_mutex_t lock;     /* PyTorch's watchdog thread calls NCCL concurrently */
    /* HSDP: the group whose reduce is waiting for its replicate all-reduce (-1: none) */
    long pending_group;
    size_t pending_count;
    mfsdp_dtype_t pending_dtype;
    int replicate_attached;
    /* checkpoints (shim_ckpt.c) */
    int64_t ckpt_saved;   /* step of the newest save (or of the resumed checkpoint); -1 */
    int64_t ckpt_resumed; /* step resumed from; -1 */
    uint64_t ckpt_saves;
    /* counters (summary) */
    uint64_t calls, remapped_ag, remapped_rs, remapped_ar, passed;
    mfsdp_record_comm_t rec; /* MFSDP_RECORD */
    int rec_full;            /* the record stopped (cap or memory), said once */
    struct shim_comm *next;
} shim_comm_t;

/* One intercepted collective, in front-end-neutral terms. */
typedef enum shim_kind {
    SHIM_ALLGATHER = 0,
    SHIM_REDUCE_SCATTER = 1,
    SHIM_ALLREDUCE = 2,
} shim_kind_t;

typedef struct shim_call {
    shim_kind_t kind;
    size_t count;    /* per-rank count (all-gather, reduce-scatter); all-reduce: count */
    int dtype_known; /* 0: a dtype mfsdp does not handle (never remapped) */
    /* With dtype_known 0: why, when it is this rank's own choice (refused on this rank alone,
     * which says so); NULL: the datatype, the same on every rank of a correct job. */
    const char *local_why;
    mfsdp_dtype_t dtype;
    const void *send; /* the rank's shard (all-gather) or the full input (reduce) */
    void *recv;
    mfsdp_redop_t op;    /* reductions */
    double scalar;       /* PREMULSUM factor */
    const char *op_name; /* for records and messages */
    int op_supported;    /* 0: an op mfsdp cannot apply (prod, max, device scalar...) */
    void *stream;        /* the call's stream (an NCCL call's cudaStream_t; NULL for MPI):
                            everything a remapped call enqueues goes on it */
    int in_group;        /* 1: issued inside a group the job keeps open (ncclGroupStart), so
                            it runs only at the job's group end: it cannot be remapped */
} shim_call_t;

/* Outcome of shim_dispatch(). */
typedef enum shim_result {
    SHIM_PASS = 0,  /* not ours: the front-end calls the real function */
    SHIM_DONE = 1,  /* remapped and completed */
    SHIM_ERROR = 2, /* refused (status in *st_p, the message printed once for the job) */
} shim_result_t;

/* ---- shim.c ---- */

/* Process-wide setup from MFSDP_* (once). MFSDP_OK, or the first configuration error (its
 * message is reported at the first call it refuses). */
mfsdp_status_t shim_init(void);
const mfsdp_config_t *shim_config(void);
/* The configuration error's one-line message ("" when none). */
const char *shim_init_error(void);

/* Register a communicator (when the job creates it, or on first sight) with the front-end's
 * operations and state for it. */
shim_comm_t *shim_comm_add(shim_frontend_t fe, const void *handle, const shim_fe_ops_t *ops,
                           void *fe_state, int size, int rank);
shim_comm_t *shim_comm_find(shim_frontend_t fe, const void *handle);
/* Flush pending steps, keep the record, release (comm destroy / finalize). Returns the first
 * error the comm ended with (MFSDP_OK when none), for the front-end's return code. */
mfsdp_status_t shim_comm_remove(shim_comm_t *c);
/* The job aborted the comm (ncclCommAbort): forget it without anything collective (no flush,
 * no checkpoint) and without waiting for its lock (another thread may be inside a remapped
 * call on it); its state is kept, not freed. Says so when that loses trained steps (an error
 * when MFSDP_CKPT_DIR was to hold them). */
void shim_comm_abandon(shim_comm_t *c);
/* At MPI_Finalize: release every comm, write the record, print the summary (on world rank 0).
 * Returns non-zero when the job must not exit 0 (an error, or a manifest that remapped
 * nothing). A job that never calls it (the NCCL front-end's jobs: torchrun, or MPI_Finalize
 * not intercepted) gets the summary, the record and the exit status at exit instead. */
int shim_finalize_all(int world_rank);

/* Decide and execute one all-gather or reduce-scatter. Thread-safe per comm. */
shim_result_t shim_dispatch(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p);
/* An all-reduce on c: HSDP's replicate all-reduce of the reduce-scatter just remapped (or one
 * the companion tagged) is remapped; an undeclared one stops the job; others pass. */
shim_result_t shim_allreduce(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p);

/* Re-entrancy guard: while the runtime runs, intercepted names go straight to the real
 * library. */
extern __thread int shim_inside;

/* ---- shim_report.c ---- */

/* Stop the remap on c: c fails every later call with st. The message is printed once for the
 * job: by the comm's rank 0 when every rank reaches the same decision (agreed), else by this
 * rank, as "mfsdp: error: ..." (not a WARN line), under MFSDP_DEBUG=NONE too. */
void shim_fatal(shim_comm_t *c, int agreed, mfsdp_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* shim_fatal of an error that every shard group of an HSDP mesh reaches alike (on c, a shard
 * communicator, at a call on its replicate communicator): printed once for the job, by the
 * rank that is rank 0 of both. */
void shim_fatal_mesh(shim_comm_t *c, const shim_comm_t *replicate, mfsdp_status_t st,
                     const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* The summary line of the job at exit (unless MFSDP_DEBUG=NONE), on world rank 0; also the
 * end-of-job checks. Returns non-zero when the job must fail. */
int shim_report_exit(int world_rank);
/* Counters of released comms, kept for the summary. */
void shim_report_keep(const shim_comm_t *c);
/* 1 when warnings and the summary are silenced (MFSDP_DEBUG=NONE or VERSION). */
int shim_quiet(void);

/* ---- shim_record.c ---- */

/* 1 when MFSDP_RECORD is set (pass-through + record). */
int shim_recording(void);
void shim_record_call(shim_comm_t *c, const shim_call_t *call);
/* Keep a released comm's record until exit; write every record (world rank 0). */
void shim_record_keep(shim_comm_t *c);
void shim_record_write(int world_rank);

/* ---- shim_ckpt.c ---- */

/* 1 when any checkpoint variable (MFSDP_CKPT_*, MFSDP_RESUME, MFSDP_INIT) is given. */
int shim_ckpt_enabled(const mfsdp_config_t *cfg);
/* Refuse combinations that cannot do what they say (one-line message in err). */
mfsdp_status_t shim_ckpt_check_config(const mfsdp_config_t *cfg, const mfsdp_settings_t *set,
                                      char *err, size_t errlen);
/* Collective over c, right after its context is created: resume or initialize. */
mfsdp_status_t shim_ckpt_start(shim_comm_t *c, char *msg, size_t msglen);
/* Collective over c, after each remapped all-gather: the periodic save when due.
 * iter_start: 1 when the call opens an iteration where a resumed job's matcher can pick the
 * sequence up (position 0, or a position after optional calls only: an eval forward's), 0
 * when it does not, -1 when unknown (no sequence: then every trainable group must have the
 * same step count). */
mfsdp_status_t shim_ckpt_after_allgather(shim_comm_t *c, int iter_start, char *msg, size_t msglen);
/* Collective over c, at its release (no error before): the last save, its commit. */
mfsdp_status_t shim_ckpt_end(shim_comm_t *c, char *msg, size_t msglen);
/* With MFSDP_CKPT_DIR set, the owners' step that no checkpoint of it holds yet (what the
 * comm's release would have saved; c->ckpt_saved is the newest saved), else -1. */
int64_t shim_ckpt_unsaved(const shim_comm_t *c);
/* When shim_ckpt_unsaved() has a step, fail c (this rank's error) with why followed by which
 * step is not saved where; c's lock held. */
void shim_ckpt_fail_unsaved(shim_comm_t *c, const char *why);

/* ---- shim_tag.c ---- */

/* This thread's pending tag, taken (cleared) by the call it describes. */
typedef struct shim_tag {
    int set;
    int id;
    int kind; /* mfsdp_shim_tag_kind_t */
    size_t group;
    size_t nparams;
    int has_mask;
    unsigned char mask[4096]; /* MFSDP_SHIM_MAX_PARAMS */
} shim_tag_t;
int shim_tag_take(shim_tag_t *tag_p);
shim_reg_t *shim_reg_find(int id);
/* Registrations bound to comm c are unbound when c is released. */
void shim_reg_unbind(shim_comm_t *c);
/* Record a tagged-mode API error for mfsdp_shim_last_error() on this thread. */
void shim_tag_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* MFSDP_LD_PRELOAD_SHIM_H */
