/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Front-end-independent state of the LD_PRELOAD shim (DESIGN.md section 6): the manifest,
 * one entry per intercepted communicator (matcher, runtime context, record), the
 * MFSDP_RECORD writer and the re-entrancy guard. The NCCL and MPI front-ends
 * (nccl_front.c, mpi_front.c) translate their calls into shim_call_t and status codes into
 * their own error codes; nothing here knows NCCL or MPI types beyond an MPI_Comm.
 */
#ifndef MFSDP_SHIM_H
#define MFSDP_SHIM_H

#include <mpi.h>
#include <pthread.h>

#include "core/matcher.h"
#include "core/record.h"
#include "mfsdp/runtime_mpi.h"

typedef enum shim_frontend { SHIM_MPI = 0, SHIM_NCCL = 1 } shim_frontend_t;

/* One intercepted communicator. */
typedef struct shim_comm {
    shim_frontend_t fe;
    const void *handle;    /* the job's comm handle (MPI_Comm or ncclComm_t) */
    MPI_Comm mpi;          /* what the runtime runs on (NCCL: a split of MPI_COMM_WORLD) */
    int owns_mpi;          /* 1 when mpi was created by the shim and must be freed */
    int size;
    int rank;
    int remap;             /* 1 when this comm's calls are remapped */
    int failed;            /* an error happened: every later call on the comm fails */
    char why[512];         /* the first error, repeated on every refused call */
    mfsdp_matcher_t *matcher;
    mfsdp_ctx_h ctx;       /* created on the first remapped call */
    pthread_mutex_t lock;  /* PyTorch's watchdog thread calls NCCL concurrently */
    /* MFSDP_RECORD: one iteration of (kind, count, dtype, op) */
    mfsdp_record_comm_t rec;
    size_t rec_cap;
    int rec_done;
    int rec_seen_rs;
    struct shim_comm *next;
} shim_comm_t;

/* One intercepted all-gather or reduce-scatter, in front-end-neutral terms. */
typedef struct shim_call {
    mfsdp_call_sig_t sig;
    const void *send;      /* the rank's shard (all-gather) or the full input (reduce) */
    void *recv;
    mfsdp_redop_t op;      /* reduce-scatter only */
    double scalar;         /* PREMULSUM factor */
    const char *op_name;   /* for records and messages */
    int op_supported;      /* 0: an op mfsdp cannot apply (prod, max, device scalar...) */
} shim_call_t;

/* Outcome of shim_dispatch(). */
typedef enum shim_result {
    SHIM_PASS = 0,     /* not ours: the front-end calls the real function */
    SHIM_DONE = 1,     /* remapped and completed */
    SHIM_ERROR = 2,    /* remapped call failed (status in *st_p, message logged) */
} shim_result_t;

/* Process-wide setup from MFSDP_* (once). Returns MFSDP_OK or the config/manifest error. */
mfsdp_status_t shim_init(void);
/* 1 when MFSDP_RECORD is set (pass-through + record). */
int shim_recording(void);

/* Register a communicator (called when the job creates it, or lazily). mpi must be a
 * communicator with the same ranks in the same order. */
shim_comm_t *shim_comm_add(shim_frontend_t fe, const void *handle, MPI_Comm mpi, int owns_mpi,
                           int size, int rank);
shim_comm_t *shim_comm_find(shim_frontend_t fe, const void *handle);
/* Flush pending steps, write the record, release (comm destroy / finalize). */
void shim_comm_remove(shim_comm_t *c);
void shim_finalize_all(void);

/* Decide and execute one call. Thread-safe per comm. */
shim_result_t shim_dispatch(shim_comm_t *c, const shim_call_t *call, mfsdp_status_t *st_p);

/* Re-entrancy guard: while the runtime runs, intercepted names go straight to the real
 * library (the runtime never calls them today, but a transport might). */
extern __thread int shim_inside;

#endif /* MFSDP_SHIM_H */
