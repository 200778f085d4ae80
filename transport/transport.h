/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Transport interface (floor 4): moves the bytes of one group's schedule (core/schedule.h)
 * between ranks and performs the fixed-order sums and casts that the reduce pipelines need
 * (through kernels/). Every buffer is handed in by the runtime, which allocates them once
 * in the owner arena. Besides its communicator, a transport keeps only what it derives from
 * an op list (mfsdp_sched_ops_t.tp_state: requests, dependency lists, MPI datatypes), built
 * on the list's first run and freed with the list, so later runs allocate nothing.
 *
 * Implementations: MPI (transport/mpi.c, MPI_Isend/Irecv, MPI_Ibcast/Ireduce,
 * MPI_Iallgather/Ireduce_scatter_block; one completion loop) and NCCL (transport/nccl.c,
 * the library's pncclX functions, wave by wave in ncclGroupStart/End on one stream).
 *
 * Memory: buffers of run, p2p and allreduce_f32 are of the executor's kind (device memory
 * under NCCL + CUDA); allreduce_sum, allreduce_u64 and allgather_bytes take host values (a
 * device transport stages them and waits: they serve context creation and the one clipping
 * scalar, never the per-call hot path).
 * Ordering: point-to-point transfers between two ranks are matched in the order both post
 * them (NCCL has no tags; MPI tags are used but never relied on for reordering).
 */
#ifndef MFSDP_TRANSPORT_TRANSPORT_H
#define MFSDP_TRANSPORT_TRANSPORT_H

#include "core/schedule.h"
#include "kernels/executor.h"

/* Buffers of one owner segment (see the table in core/schedule.h). Unused ones are NULL. */
typedef struct mfsdp_xfer_bufs {
    void *src;    /* gather: owner's comm copy; reduce: NULL (every algorithm reads the own
                     contribution in place from x->rs_in) */
    void *stage;  /* gather (chain): received tensor, NULL to receive into x->ag_out;
                     direct reduce (owner): the chunk ring (ring slots of world sub-slots,
                     op->boff and op->stride address them) */
    float *pin;   /* chain reduce: partial sum received */
    float *pout;  /* chain/native reduce: partial sum sent (own contribution added) */
    float *final; /* chain/native reduce (owner): the full fp32 sum */
    float *grad;  /* reduce (owner): fp32 gradient accumulator */
} mfsdp_xfer_bufs_t;

/* One execution of a group's op list. */
typedef struct mfsdp_xfer {
    mfsdp_exec_t *exec; /* does the local work (sums, copies) on the buffers' memory */
    mfsdp_sched_dir_t dir;
    const mfsdp_group_sched_t *gs;
    mfsdp_sched_ops_t *ops;  /* its tp_state is the transport's cache for this op list */
    mfsdp_xfer_bufs_t *bufs; /* gs->nsegs entries */
    mfsdp_dtype_t dtype;     /* reduce: dtype of contributions (the reduce dtype) */
    mfsdp_redop_t op;        /* reduce: sum, avg or premulsum */
    float scalar;            /* premulsum factor */
    /* reduce: FSDP's reduce-scatter input; chain/native read contributions from it in place
     * (segments whose bufs.src is NULL) */
    const void *rs_in;
    /* gather: FSDP's all-gather output; direct/native receive non-owned tensors straight
     * into it (segments whose bufs.stage is NULL) */
    void *ag_out;
    /* The sharded tail (TAIL op). Gather: tail_count bytes per rank, gathered in place in
     * the tail pieces of ag_out (this rank's already in its rank block); tail_send and
     * tail_recv must be NULL. Reduce (an all-to-all: every rank sums its own slices'
     * contributions itself, in rank order): send world blocks of tail_count bytes (block r
     * for rank r) and receive world blocks of tail_count bytes into tail_recv (block r from
     * rank r; block rank, the caller's own, may be left unwritten). */
    const void *tail_send;
    void *tail_recv;
    size_t tail_count;
    /* Local work of the caller that touches none of the op list's buffers (the owner's copy
     * of its own tensors into FSDP's all-gather output), run while the transfers are in
     * flight: the MPI transport calls it once every op without a dependency is posted, the
     * NCCL transport before its first wave. NULL: none. */
    mfsdp_status_t (*overlap)(void *arg);
    void *overlap_arg;
    /* gather, direct, MPI transport with shared arenas (mfsdp_transport_mpi_share), on every
     * rank alike or on none (the owners' writes to their comm copies are then preceded by
     * quiesce): gs->nsegs entries, the owner's comm copy of each segment mapped in
     * this process, NULL where the owner is not a node peer (or is this rank). NULL: none. */
    const char *const *peer_src;
} mfsdp_xfer_t;

/* One point-to-point transfer of a batch (all posted at once, one completion). */
typedef struct mfsdp_p2p {
    int send; /* 1: send, 0: receive */
    int peer;
    int tag;
    void *buf;
    size_t bytes;
} mfsdp_p2p_t;

typedef struct mfsdp_transport mfsdp_transport_t;

typedef struct mfsdp_transport_ops {
    const char *name;
    /* Execute a group's op list; returns when every op of this rank has completed. */
    mfsdp_status_t (*run)(mfsdp_transport_t *t, const mfsdp_xfer_t *x);
    /* Post a batch of point-to-point transfers and wait for all of them (NCCL: one group,
     * complete in stream order). Two ranks list their transfers to each other in the same
     * order. */
    mfsdp_status_t (*p2p)(mfsdp_transport_t *t, const mfsdp_p2p_t *v, size_t n);
    /* Sum one double over all ranks in place (the clipping norm). */
    mfsdp_status_t (*allreduce_sum)(mfsdp_transport_t *t, double *value);
    /* Sum n floats over all ranks in place (HSDP: owners' gradients over the replicas). */
    mfsdp_status_t (*allreduce_f32)(mfsdp_transport_t *t, float *buf, size_t n);
    /* Element-wise minimum (is_max 0) or maximum (1) of n uint64 over all ranks, in place
     * (settings agreement). */
    mfsdp_status_t (*allreduce_u64)(mfsdp_transport_t *t, uint64_t *buf, size_t n, int is_max);
    /* Gather bytes from every rank, rank-major into all (world * bytes). */
    mfsdp_status_t (*allgather_bytes)(mfsdp_transport_t *t, const void *mine, size_t bytes,
                                      void *all);
    /* The stream of the intercepted call (a cudaStream_t; NULL: the legacy default stream):
     * every operation of later calls is enqueued on it, in call order, and "completed" in
     * run/p2p means completed in stream order (the host does not wait). MPI: ignored. */
    mfsdp_status_t (*set_stream)(mfsdp_transport_t *t, void *stream);
    /* Optional (NULL: nothing to wait for). The caller is about to write the comm copies of
     * its owned tensors (its optimizer step, new weights, a load): returns once no rank still
     * reads them from a gather that this rank has completed (MPI: node peers copying from a
     * shared arena). Not collective. */
    mfsdp_status_t (*quiesce)(mfsdp_transport_t *t);
    void (*destroy)(mfsdp_transport_t *t);
} mfsdp_transport_ops_t;

struct mfsdp_transport {
    const mfsdp_transport_ops_t *ops;
    int rank;
    int world;
};

/*
 * Helpers shared by implementations (transport/reduce.c): the owner-side arithmetic of a
 * reduce op list, identical whatever moves the bytes, done by x->exec (combine, apply and
 * reduce_ordered of kernels/executor.h).
 */
/* The buffer an op reads or writes (before op->boff) and its element size: bytes for the
 * gather, the reduce dtype for SRC/STAGE (STAGE at the op's slot) and fp32 for PIN, POUT
 * and FINAL in the reduce. NULL when the runtime bound none. */
void *mfsdp_xfer_buf(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op, size_t *elt_p);
/* Where byte pos of segment seg's tensor lies in FSDP's all-gather output (x->ag_out), and in
 * *run_p how many bytes from there are contiguous (to the end of its rank block). NULL (and
 * 0) without an output or for pos outside the tensor. */
char *mfsdp_xfer_ag_at(const mfsdp_xfer_t *x, uint32_t seg, size_t pos, size_t *run_p);
/* The sharded tail's buffers (TAIL op): the all-gather needs ag_out and no tail staging (it
 * runs in place), the reduce both staging blocks. MFSDP_ERR_INTERNAL, logged, otherwise. */
mfsdp_status_t mfsdp_xfer_check_tail(const mfsdp_xfer_t *x);
/* Run the local (APPLY, COPYOUT) op of an op list. srcv: world entries of scratch for a
 * direct reduce's ordered sum (the transport's, kept with the op list). */
mfsdp_status_t mfsdp_xfer_local(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op, int rank,
                                int world, const void **srcv);
/* Fill POUT for a SEND/REDUCE op with combine set. */
mfsdp_status_t mfsdp_xfer_prepare(const mfsdp_xfer_t *x, const mfsdp_sched_op_t *op);

#endif /* MFSDP_TRANSPORT_TRANSPORT_H */
