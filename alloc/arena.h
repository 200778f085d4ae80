/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Per-rank owner arenas (docs/design.md, "Layers" (owner arenas)).
 *
 * One arena per context and rank, sized from the plan, allocated once and kept: fp32
 * master weights, comm-dtype copies, fp32 gradient accumulators, Muon momentum and AdamW
 * moments of the tensors the rank owns whole and of its sharded-tail slices, plus one
 * scratch region (communication staging and optimizer workspace) handed to transport/.
 * The CPU arena is page-locked with mlock (a warning and an unlocked fallback when
 * RLIMIT_MEMLOCK forbids it; MFSDP_MLOCK=0 disables) and bound to the NUMA node the rank
 * runs on through hwloc when it is available (MFSDP_NUMA_BIND=0 disables).
 * A device arena (the NCCL + CUDA backend) is one allocation made through callbacks that the
 * caller provides (runtime/: cudaMalloc through the cuda executor, or ncclMemAlloc), so this
 * floor stays free of CUDA and NCCL; the same byte accounting applies. Either kind may be
 * registered once with a communicator (ncclCommRegister) and is deregistered at destroy.
 *
 * Layout: categories follow each other in mfsdp_arena_cat_t order, then the scratch
 * region; every sub-allocation starts on MFSDP_ARENA_ALIGN bytes. Inside a category,
 * tensors sit in plan shard order. mfsdp_arena_layout() is a pure function of the plan, so
 * the byte accounting of any rank can be computed without allocating (planning tools,
 * tests at 64 ranks).
 */
#ifndef MFSDP_ALLOC_ARENA_H
#define MFSDP_ALLOC_ARENA_H

#include <stddef.h>

#include "mfsdp/plan.h"

/* Alignment of every tensor inside the arena (cache line, and 16-byte vector accesses). */
#define MFSDP_ARENA_ALIGN 64
/* Offset value of a category a tensor does not use. */
#define MFSDP_ARENA_NONE ((size_t)-1)

/* Where one tensor lives in its rank's arena. */
typedef struct mfsdp_arena_slot {
    size_t elems;                 /* local elements (0: not on this rank) */
    size_t off[MFSDP_ARENA_NCAT]; /* byte offset inside each category, or MFSDP_ARENA_NONE */
} mfsdp_arena_slot_t;

/* Byte accounting of one rank's arena. */
typedef struct mfsdp_arena_sizes {
    size_t cat[MFSDP_ARENA_NCAT]; /* bytes per category (aligned sub-allocations included) */
    size_t total;                 /* sum of cat[] */
} mfsdp_arena_sizes_t;

/*
 * Lay out rank's arena for plan: slots (plan->nshards entries, may be NULL) and sizes.
 * Owned tensors (owner == rank) take numel elements; sharded-tail tensors take the rank's
 * FSDP slice (fsdp_s elements, padding rows included) on every rank. MASTER and COMM for
 * every local tensor, GRAD when it has a gradient, MOMENTUM for Muon and ADAM_M/ADAM_V for
 * AdamW tensors with a gradient.
 */
mfsdp_status_t mfsdp_arena_layout(const mfsdp_plan_t *plan, int rank, mfsdp_arena_slot_t *slots,
                                  mfsdp_arena_sizes_t *sizes_p);

typedef enum mfsdp_arena_kind {
    MFSDP_ARENA_HOST = 0,   /* an anonymous mapping (mlock, NUMA binding) */
    MFSDP_ARENA_DEVICE = 1, /* memory from mfsdp_arena_mem_t.alloc (device memory) */
} mfsdp_arena_kind_t;

/* Where an arena's memory comes from, and its registration with a communicator. */
typedef struct mfsdp_arena_mem {
    void *arg; /* passed to every callback */
    /* DEVICE: bytes of zeroed memory (bytes > 0) into *ptr_p; logs its own failure.
     * HOST (optional; NULL: an anonymous mapping): a zeroed, page-aligned mapping of bytes
     * (the MPI backend's shared memory), NUMA-bound and page-locked here like the anonymous
     * one. alloc and free come together. */
    mfsdp_status_t (*alloc)(void *arg, size_t bytes, void **ptr_p);
    void (*free)(void *arg, void *ptr);
    /* Optional, either kind: register the whole arena once after allocation (a handle for
     * dereg), deregister before it is freed. NULL: no registration. */
    mfsdp_status_t (*reg)(void *arg, void *ptr, size_t bytes, void **handle_p);
    mfsdp_status_t (*dereg)(void *arg, void *handle);
} mfsdp_arena_mem_t;

typedef struct mfsdp_arena_opts {
    int mlock;     /* HOST, 1: page-lock (fallback with a warning when the limit forbids) */
    int numa_bind; /* HOST, 1: bind to the NUMA node of the calling thread's CPU (hwloc) */
    mfsdp_arena_kind_t kind; /* zero: HOST, as before kinds existed */
    mfsdp_arena_mem_t mem;   /* DEVICE: alloc and free required; reg/dereg: either kind */
} mfsdp_arena_opts_t;

typedef struct mfsdp_arena mfsdp_arena_t;

/* Allocate an arena of the given category sizes plus scratch_bytes of scratch. Memory is
 * zeroed. opts NULL: a host arena, page-locked and NUMA-bound. A registration failure fails
 * the creation (the memory is released). */
mfsdp_status_t mfsdp_arena_create(const mfsdp_arena_sizes_t *sizes, size_t scratch_bytes,
                                  const mfsdp_arena_opts_t *opts, mfsdp_arena_t **arena_p);
void mfsdp_arena_destroy(mfsdp_arena_t *arena);

/* Base of a category (NULL when it is empty) and of the scratch region. */
void *mfsdp_arena_base(const mfsdp_arena_t *arena, mfsdp_arena_cat_t cat);
void *mfsdp_arena_scratch(const mfsdp_arena_t *arena);
size_t mfsdp_arena_scratch_bytes(const mfsdp_arena_t *arena);

/* Accounting: bytes per category, total mapped bytes (the peak: nothing grows later). */
void mfsdp_arena_sizes(const mfsdp_arena_t *arena, mfsdp_arena_sizes_t *sizes_p);
size_t mfsdp_arena_peak_bytes(const mfsdp_arena_t *arena);
int mfsdp_arena_locked(const mfsdp_arena_t *arena);
mfsdp_arena_kind_t mfsdp_arena_kind(const mfsdp_arena_t *arena);
/* 1 when the arena is registered with a communicator (mfsdp_arena_mem_t.reg). */
int mfsdp_arena_registered(const mfsdp_arena_t *arena);
int mfsdp_arena_numa_node(const mfsdp_arena_t *arena);

/* Byte offset of category cat from the base of an arena of the given category sizes (as
 * mfsdp_arena_layout() gives them for any rank): with the slot offsets of that rank's layout,
 * where a tensor lies in another rank's arena. */
mfsdp_status_t mfsdp_arena_cat_offset(const mfsdp_arena_sizes_t *sizes, mfsdp_arena_cat_t cat,
                                      size_t *off_p);

/* Name of a category ("master", "comm", ...). */
const char *mfsdp_arena_cat_name(mfsdp_arena_cat_t cat);

/* Log the per-category accounting and peak at INFO (ALLOC subsystem). */
void mfsdp_arena_report(const mfsdp_arena_t *arena, int rank);

#endif /* MFSDP_ALLOC_ARENA_H */
