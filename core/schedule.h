/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner-collective schedules (docs/design.md, "Owners"): for each param group, the owner
 * segments (one per owned tensor), the packed sharded-tail part, and for each rank a
 * deterministic op list for owner-broadcast (all-gather) and reduce-to-owner
 * (reduce-scatter) under one algorithm. Everything here is a pure function of the plan,
 * the rank and the algorithm, and every rank builds its list the same way (rank-symmetric):
 * matching sends and receives appear in the same order on both sides, so no rank can wait
 * for a message its peer will not send.
 *
 * Units: gather ops count bytes of the param dtype (the owner's comm copy, contiguous
 * N0 x R); reduce ops count elements (of the reduce dtype for contributions, fp32 for
 * partial sums). Ops are executed by transport/ on buffers the runtime binds per segment:
 *
 *   buffer  gather                         reduce
 *   SRC     owner's comm copy              direct: own packed contribution (reduce dtype);
 *                                          chain/native read FSDP's input in place
 *   STAGE   received full tensor           direct: ring of chunk slots, each a sub-slot per
 *                                          source rank (reduce dtype)
 *   PIN     -                              chain: partial sum from the previous rank (fp32)
 *   POUT    -                              chain/native: partial sum sent on (fp32)
 *   FINAL   -                              chain/native: the full sum on the owner (fp32)
 *   RSIN    -                              direct: a contribution chunk read in place from
 *                                          FSDP's reduce-scatter input (op->boff: its element
 *                                          offset there; chunks never cross a rank block)
 */
#ifndef MFSDP_CORE_SCHEDULE_H
#define MFSDP_CORE_SCHEDULE_H

#include "core/layout.h"
#include "mfsdp/plan.h"

/* Largest single message (bytes): longer transfers are split so MPI's int counts hold. */
#define MFSDP_SCHED_MAX_MSG ((size_t)1 << 30)
/* Chunks of one segment a chain keeps in flight per rank: its staging is a ring of this
 * many chunks (chunk k reuses the slot of chunk k - WINDOW once that chunk was sent on). */
#define MFSDP_SCHED_WINDOW 4

typedef enum mfsdp_sched_dir {
    MFSDP_SCHED_DIR_GATHER = 0, /* owner-broadcast */
    MFSDP_SCHED_DIR_REDUCE = 1, /* reduce-to-owner */
} mfsdp_sched_dir_t;

typedef enum mfsdp_sched_kind {
    MFSDP_SCHED_SEND = 0,    /* Isend [off, off+len) of buf to peer */
    MFSDP_SCHED_RECV = 1,    /* Irecv [off, off+len) of buf (slot) from peer */
    MFSDP_SCHED_BCAST = 2,   /* native broadcast of [off, off+len) from root = peer */
    MFSDP_SCHED_REDUCE = 3,  /* native fp32 sum of POUT into FINAL on root = peer */
    MFSDP_SCHED_APPLY = 4,   /* owner: accumulate the reduced chunk into the fp32 gradient */
    MFSDP_SCHED_TAIL = 5,    /* the group's packed sharded tail: native all-gather or
                                reduce-scatter (buffers bound by the runtime) */
    MFSDP_SCHED_COPYOUT = 6, /* chain gather: copy a received chunk into FSDP's output */
} mfsdp_sched_kind_t;

typedef enum mfsdp_sched_buf {
    MFSDP_BUF_SRC = 0,
    MFSDP_BUF_STAGE = 1,
    MFSDP_BUF_PIN = 2,
    MFSDP_BUF_POUT = 3,
    MFSDP_BUF_FINAL = 4,
    MFSDP_BUF_RSIN = 5, /* reduce: FSDP's reduce-scatter input, read in place */
} mfsdp_sched_buf_t;

/* How an APPLY op forms the reduced value before applying the op (avg / premulsum). */
typedef enum mfsdp_sched_apply {
    MFSDP_APPLY_ORDERED = 0, /* direct: SRC (own) + STAGE slots, summed in rank order */
    MFSDP_APPLY_FINAL = 1,   /* chain/native: FINAL holds the sum */
    MFSDP_APPLY_LAST = 2,    /* chain, owner is last: PIN (if any) + own contribution */
} mfsdp_sched_apply_t;

/* Dependency of an op that may start only when all other ops have completed. */
#define MFSDP_SCHED_DEP_ALL (-2L)

typedef struct mfsdp_sched_op {
    mfsdp_sched_kind_t kind;
    uint32_t seg;          /* segment index in the group schedule */
    int peer;              /* peer rank, or the root of BCAST/REDUCE */
    mfsdp_sched_buf_t buf; /* buffer SEND reads / RECV writes */
    int slot;              /* STAGE slot (direct reduce: the source rank), else 0 */
    size_t off;            /* offset in the tensor (bytes for gather, elements for reduce) */
    size_t len;            /* length in the same unit */
    size_t boff;           /* offset in the op's buffer: off, or the ring slot of a chain */
    int tag;
    long dep;                  /* op index to wait for before posting, -1, or DEP_ALL */
    int ndep;                  /* > 1: wait for ops dep .. dep + ndep - 1 (all of them) */
    size_t stride;             /* direct reduce APPLY: elements per source rank in a slot */
    int combine;               /* reduce SEND/REDUCE: first POUT = (dep ? PIN : 0) + own */
    int has_in;                /* combine/APPLY_LAST: a PIN chunk was received */
    mfsdp_sched_apply_t apply; /* APPLY variant */
    /* Wave: a transport without a completion loop (NCCL: one ncclGroupStart/End per wave, in
     * stream order) runs wave 0, 1, ... in turn on every rank. The communication ops of one
     * wave are matched by the ops of the same wave on their peers, in list order per peer
     * pair (NCCL has no tags), and a communication op is in a later wave than every op it
     * depends on. A local op (APPLY, COPYOUT) runs after the communication of its wave, in
     * list order; DEP_ALL ops run after the last wave. */
    int wave;
} mfsdp_sched_op_t;

/* One owner segment: an owned tensor of the group. */
typedef struct mfsdp_sched_seg {
    size_t shard; /* index into plan->shards */
    size_t param; /* param index in the group (= its all-gather layout entry) */
    int owner;
    size_t numel;    /* N0 * R */
    size_t ag_bytes; /* numel * param dtype size */
    long rs_entry;   /* reduce-scatter layout entry, -1 without gradient */
} mfsdp_sched_seg_t;

typedef struct mfsdp_group_sched {
    size_t group;
    int world;
    mfsdp_group_layout_t *layout; /* owned */
    size_t nsegs;
    mfsdp_sched_seg_t *segs; /* owned tensors in param order */
    size_t ntail;
    size_t *tail;         /* group param indices of sharded-tail tensors */
    size_t tail_ag_bytes; /* per rank: sum of all-gather s_bytes of the tail */
    size_t tail_rs_elems; /* per rank: sum of reduce-scatter s of the tail (grad) */
} mfsdp_group_sched_t;

typedef struct mfsdp_sched_ops {
    size_t nops;
    mfsdp_sched_op_t *ops;
    /* What a transport derives from this op list once and reuses on every call (request and
     * dependency arrays, wave order), built on the first run and released by
     * tp_state_free(tp_state) in mfsdp_sched_ops_free(): its lifetime is the op list's. NULL
     * until then; tp_owner names the transport kind that built it. Accessed through
     * mfsdp_sched_ops_state() and mfsdp_sched_ops_keep(). */
    void *tp_state;
    const void *tp_owner;
    void (*tp_state_free)(void *state);
} mfsdp_sched_ops_t;

/* The state transport kind owner keeps with ops (mfsdp_sched_ops_keep), or NULL; a state
 * another kind built is released first (not ours to reuse). */
void *mfsdp_sched_ops_state(mfsdp_sched_ops_t *ops, const void *owner);
/* Keep state with ops for kind owner, released by free_fn with the op list. */
void mfsdp_sched_ops_keep(mfsdp_sched_ops_t *ops, const void *owner, void *state,
                          void (*free_fn)(void *state));

/* A local op: run by the caller between transfers (APPLY, COPYOUT). */
static inline int mfsdp_sched_op_is_local(const mfsdp_sched_op_t *op)
{
    return op->kind == MFSDP_SCHED_APPLY || op->kind == MFSDP_SCHED_COPYOUT;
}

/* A collective op (BCAST, REDUCE, TAIL): every rank posts it, in the same order. */
static inline int mfsdp_sched_op_is_collective(const mfsdp_sched_op_t *op)
{
    return op->kind == MFSDP_SCHED_BCAST || op->kind == MFSDP_SCHED_REDUCE ||
           op->kind == MFSDP_SCHED_TAIL;
}

/* The ops of l that keep() selects, by wave and in list order within a wave (a counting
 * sort): *order_p their indices (*count_p of them) and, unless first_p is NULL, *first_p
 * (*nw_p + 1 entries: wave w is order[first[w], first[w+1])), nw = the largest selected wave
 * + 1. Both allocated, free() them. A selected op with a negative wave is an internal error. */
mfsdp_status_t mfsdp_sched_wave_order(const mfsdp_sched_ops_t *l,
                                      int (*keep)(const mfsdp_sched_op_t *op), long **order_p,
                                      size_t *count_p, size_t **first_p, size_t *nw_p);

/* Units of a chain's ring buffer for a tensor of total units: min(total, WINDOW chunks). */
static inline size_t mfsdp_sched_ring(size_t total, size_t chunk_units)
{
    size_t ring = chunk_units * MFSDP_SCHED_WINDOW;
    return ring / MFSDP_SCHED_WINDOW != chunk_units || ring > total ? total : ring;
}

/* The direct reduce's pipeline on a segment's owner, for chunks of at most chunk_elems
 * elements (cut at FSDP's rank blocks): *stride_p elements per source rank in a ring slot
 * (the longest chunk), *nslots_p slots (min(WINDOW, chunks)). The owner's STAGE is nslots x
 * world x stride elements of the reduce dtype. */
void mfsdp_sched_direct_ring(const mfsdp_group_sched_t *gs, const mfsdp_sched_seg_t *s,
                             size_t chunk_elems, size_t *stride_p, size_t *nslots_p);

/* Segments and tail of group g of the plan. */
mfsdp_status_t mfsdp_group_sched_create(const mfsdp_plan_t *plan, size_t g,
                                        mfsdp_group_sched_t **gs_p);
/* The same with the reduce-scatter layout over the params flagged in has_grad (nparams bytes,
 * NULL = every requires_grad param; see mfsdp_group_layout_create_masked()). */
mfsdp_status_t mfsdp_group_sched_create_masked(const mfsdp_plan_t *plan, size_t g,
                                               const unsigned char *has_grad,
                                               mfsdp_group_sched_t **gs_p);
void mfsdp_group_sched_destroy(mfsdp_group_sched_t *gs);

/*
 * Op list of rank for one direction and algorithm (DIRECT, CHAIN or NATIVE; AUTO is
 * rejected: resolve it first). chunk: pipeline chunk of CHAIN in bytes (>= 4).
 *  - DIRECT gather: the owner sends its copy to each rank in rank order; others receive.
 *    Cut at FSDP's rank blocks (and MFSDP_SCHED_MAX_MSG): every run is contiguous in the
 *    all-gather output, where a receiver lands it in place as plain bytes.
 *    DIRECT reduce: a pipeline of chunks of at most chunk / 4 elements, cut at FSDP's rank
 *    blocks: every rank sends each chunk of its contribution straight from FSDP's input
 *    (RSIN) to the owner; the owner receives chunk k from every other rank into ring slot
 *    k % WINDOW (one tag per slot) and, once all have arrived (ndep), sums rank 0..n-1 in
 *    fp32 (its own chunk read in place) into the gradient; chunk k + WINDOW's receives wait
 *    for that sum. Chunk k is wave k / WINDOW.
 *  - CHAIN gather: owner -> owner+1 -> ... (mod n), chunked; each rank copies a chunk out
 *    and forwards it as soon as it arrived. CHAIN reduce: an fp32 partial sum flows
 *    0 -> 1 -> ... -> n-1 (each adds its contribution, so the sum is in rank order) and then
 *    to the owner. Chains stage a ring of MFSDP_SCHED_WINDOW chunks per segment, not the
 *    whole tensor.
 *  - NATIVE: one broadcast per rank-block run (cut as the direct gather) / one fp32 reduce
 *    per chunk of at most chunk / 4 elements (and MFSDP_SCHED_MAX_MSG): the partial sums
 *    (POUT, every rank) and the owner's sum (FINAL) are rings of MFSDP_SCHED_WINDOW chunks;
 *    chunk k is wave k / WINDOW and its reduce waits for chunk k - WINDOW's (and, on the
 *    owner, for its APPLY).
 * A group with a sharded tail gets one TAIL op first. All ops of a group are meant to be
 * in flight together (one completion loop), or run wave by wave (op->wave). Collectives
 * (BCAST, REDUCE, TAIL) must be posted in the same order on every rank: a transport posts
 * them in (wave, list) order, which the op lists of all ranks share. The direct gather and
 * the native gather are one wave; a chain hop h (rank h-1 to h in the reduce, position h-1 to h
 * from the owner in the gather; the reduce's last hop to the owner is h = n) of the chunks of
 * window w (chunk index / MFSDP_SCHED_WINDOW) is wave h - 1 + 2w, so a ring slot is sent on (wave
 * h + 2(w-1)) before its next chunk arrives (wave h - 1 + 2w).
 */
mfsdp_status_t mfsdp_sched_build(const mfsdp_group_sched_t *gs, int rank, mfsdp_sched_dir_t dir,
                                 mfsdp_algo_t algo, size_t chunk, mfsdp_sched_ops_t *ops_p);
void mfsdp_sched_ops_free(mfsdp_sched_ops_t *ops);
/* An op list of one TAIL op: the sharded-tail reduce's later passes when its fp32 staging is
 * cut to fit the staging budget. */
mfsdp_status_t mfsdp_sched_build_tail(mfsdp_sched_ops_t *ops_p);

#endif /* MFSDP_CORE_SCHEDULE_H */
