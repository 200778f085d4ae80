/* SPDX-License-Identifier: Apache-2.0 */
#include "alloc/arena.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include "core/checks.h"
#include "mfsdp_config.h"

#if MFSDP_HAVE_HWLOC
#include <hwloc.h>
#endif

struct mfsdp_arena {
    void *base;    /* one mapping (HOST: anonymous, or from mem.alloc) or allocation (DEVICE) */
    size_t mapped; /* bytes mapped or allocated */
    mfsdp_arena_kind_t kind;
    mfsdp_arena_mem_t mem;
    void *reg_handle;
    int registered;
    mfsdp_arena_sizes_t sizes;
    size_t cat_off[MFSDP_ARENA_NCAT];
    size_t scratch_off;
    size_t scratch_bytes;
    int locked;
    int numa_node;
};

static const char *const cat_names[MFSDP_ARENA_NCAT] = {
    [MFSDP_ARENA_MASTER] = "master", [MFSDP_ARENA_COMM] = "comm",
    [MFSDP_ARENA_GRAD] = "grad",     [MFSDP_ARENA_MOMENTUM] = "momentum",
    [MFSDP_ARENA_ADAM_M] = "adam_m", [MFSDP_ARENA_ADAM_V] = "adam_v",
};

const char *mfsdp_arena_cat_name(mfsdp_arena_cat_t cat)
{
    if ((unsigned)cat >= MFSDP_ARENA_NCAT) {
        return "invalid";
    }
    return cat_names[cat];
}

/* Round up to the arena alignment; 1 on overflow. */
static int align_up(size_t x, size_t *out)
{
    size_t y;
    if (mfsdp_add_overflow(x, MFSDP_ARENA_ALIGN - 1, &y)) {
        return 1;
    }
    *out = y & ~(size_t)(MFSDP_ARENA_ALIGN - 1);
    return 0;
}

/* Reserve bytes in category cat: offset written to *off_p. */
static mfsdp_status_t reserve(mfsdp_arena_sizes_t *s, mfsdp_arena_cat_t cat, size_t elems,
                              size_t elt, size_t *off_p)
{
    size_t bytes, aligned, end;
    if (mfsdp_mul_overflow(elems, elt, &bytes) || align_up(bytes, &aligned) ||
        mfsdp_add_overflow(s->cat[cat], aligned, &end)) {
        MFSDP_WARN("arena category %s overflows size_t", cat_names[cat]);
        return MFSDP_ERR_OVERFLOW;
    }
    *off_p = s->cat[cat];
    s->cat[cat] = end;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_arena_layout(const mfsdp_plan_t *plan, int rank, mfsdp_arena_slot_t *slots,
                                  mfsdp_arena_sizes_t *sizes_p)
{
    MFSDP_CHECK_ARG(plan != NULL && plan->manifest != NULL && sizes_p != NULL);
    MFSDP_CHECK_ARG(rank >= 0 && rank < plan->world);
    mfsdp_arena_sizes_t s;
    memset(&s, 0, sizeof(s));
    for (size_t i = 0; i < plan->nshards; i++) {
        const mfsdp_shard_t *sh = &plan->shards[i];
        const mfsdp_param_desc_t *p = &plan->manifest->groups[sh->group].params[sh->param];
        mfsdp_arena_slot_t slot;
        for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
            slot.off[c] = MFSDP_ARENA_NONE;
        }
        slot.elems = 0;
        if (sh->owner == rank) {
            slot.elems = (size_t)sh->numel;
        } else if (sh->owner == MFSDP_OWNER_SHARDED && plan->tail != MFSDP_TAIL_JOB) {
            slot.elems = (size_t)sh->fsdp_s; /* tail "job": the job keeps its slices */
        }
        if (slot.elems != 0) {
            size_t elt = mfsdp_dtype_size(p->dtype);
            MFSDP_CHECK(reserve(&s, MFSDP_ARENA_MASTER, slot.elems, sizeof(float),
                                &slot.off[MFSDP_ARENA_MASTER]));
            MFSDP_CHECK(
                reserve(&s, MFSDP_ARENA_COMM, slot.elems, elt, &slot.off[MFSDP_ARENA_COMM]));
            if (p->requires_grad) {
                MFSDP_CHECK(reserve(&s, MFSDP_ARENA_GRAD, slot.elems, sizeof(float),
                                    &slot.off[MFSDP_ARENA_GRAD]));
                if (sh->role == MFSDP_ROLE_MUON) {
                    MFSDP_CHECK(reserve(&s, MFSDP_ARENA_MOMENTUM, slot.elems, sizeof(float),
                                        &slot.off[MFSDP_ARENA_MOMENTUM]));
                } else {
                    MFSDP_CHECK(reserve(&s, MFSDP_ARENA_ADAM_M, slot.elems, sizeof(float),
                                        &slot.off[MFSDP_ARENA_ADAM_M]));
                    MFSDP_CHECK(reserve(&s, MFSDP_ARENA_ADAM_V, slot.elems, sizeof(float),
                                        &slot.off[MFSDP_ARENA_ADAM_V]));
                }
            }
        }
        if (slots != NULL) {
            slots[i] = slot;
        }
    }
    for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
        if (mfsdp_add_overflow(s.total, s.cat[c], &s.total)) {
            return MFSDP_ERR_OVERFLOW;
        }
    }
    *sizes_p = s;
    return MFSDP_OK;
}

/* Page-lock the mapping; a refusal is not fatal (the arena still works, only unpinned). */
static int lock_pages(void *base, size_t bytes)
{
    if (mlock(base, bytes) == 0) {
        return 1;
    }
    int err = errno;
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        MFSDP_WARN("mlock of the %zu-byte owner arena failed (%s); RLIMIT_MEMLOCK is %llu "
                   "bytes: continuing with pageable memory (raise `ulimit -l` or set "
                   "MFSDP_MLOCK=0 to silence this)",
                   bytes, strerror(err), (unsigned long long)rl.rlim_cur);
    } else {
        MFSDP_WARN("mlock of the %zu-byte owner arena failed (%s): continuing with pageable "
                   "memory (MFSDP_MLOCK=0 silences this)",
                   bytes, strerror(err));
    }
    return 0;
}

/* Bind the mapping to the NUMA node of the CPU this thread last ran on. Returns the node
 * index, or -1 when there is no hwloc, a single node, or binding failed (logged at INFO:
 * binding is an optimization, never an error). */
static int bind_numa(void *base, size_t bytes)
{
#if MFSDP_HAVE_HWLOC
    int node = -1;
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) != 0) {
        return -1;
    }
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
    hwloc_bitmap_t nodes = hwloc_bitmap_alloc();
    if (cpus == NULL || nodes == NULL || hwloc_topology_load(topo) != 0) {
        goto out;
    }
    if (hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE) <= 1) {
        /* One node: nothing to choose, but report it so the stats say where memory is. */
        node = 0;
        goto out;
    }
    if (hwloc_get_last_cpu_location(topo, cpus, HWLOC_CPUBIND_THREAD) != 0) {
        MFSDP_INFO(ALLOC, "cannot find the cpu of this thread (%m): arena not numa-bound");
        goto out;
    }
    hwloc_cpuset_to_nodeset(topo, cpus, nodes);
    if (hwloc_bitmap_weight(nodes) != 1) {
        goto out;
    }
    if (hwloc_set_area_membind(topo, base, bytes, nodes, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_MIGRATE) != 0) {
        MFSDP_INFO(ALLOC, "numa binding of the owner arena failed (%m)");
        goto out;
    }
    node = hwloc_bitmap_first(nodes);
out:
    hwloc_bitmap_free(cpus);
    hwloc_bitmap_free(nodes);
    hwloc_topology_destroy(topo);
    return node;
#else
    (void)base;
    (void)bytes;
    return -1;
#endif
}

/* Free the arena's memory (deregistered first) and the arena. */
static void arena_release(mfsdp_arena_t *a)
{
    if (a->registered && a->mem.dereg != NULL) {
        mfsdp_status_t st = a->mem.dereg(a->mem.arg, a->reg_handle);
        if (st != MFSDP_OK) {
            MFSDP_WARN("deregistering the %zu-byte owner arena failed (%s)", a->mapped,
                       mfsdp_status_string(st));
        }
    }
    if (a->base != NULL) {
        if (a->kind == MFSDP_ARENA_DEVICE) {
            a->mem.free(a->mem.arg, a->base);
        } else {
            if (a->locked) {
                munlock(a->base, a->mapped);
            }
            if (a->mem.alloc != NULL) {
                a->mem.free(a->mem.arg, a->base);
            } else {
                munmap(a->base, a->mapped);
            }
        }
    }
    free(a);
}

/* Offsets of the categories and of the scratch region, and the bytes mapped in all. */
static mfsdp_status_t offsets(const mfsdp_arena_sizes_t *sizes, size_t scratch_bytes,
                              size_t cat_off[MFSDP_ARENA_NCAT], size_t *scratch_off_p,
                              size_t *mapped_p)
{
    size_t off = 0;
    for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
        size_t aligned;
        cat_off[c] = off;
        if (align_up(sizes->cat[c], &aligned) || mfsdp_add_overflow(off, aligned, &off)) {
            return MFSDP_ERR_OVERFLOW;
        }
    }
    size_t scratch_aligned;
    *scratch_off_p = off;
    if (align_up(scratch_bytes, &scratch_aligned) ||
        mfsdp_add_overflow(off, scratch_aligned, &off)) {
        return MFSDP_ERR_OVERFLOW;
    }
    *mapped_p = off;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_arena_cat_offset(const mfsdp_arena_sizes_t *sizes, mfsdp_arena_cat_t cat,
                                      size_t *off_p)
{
    MFSDP_CHECK_ARG(sizes != NULL && off_p != NULL && (unsigned)cat < MFSDP_ARENA_NCAT);
    size_t cat_off[MFSDP_ARENA_NCAT], scratch_off, mapped;
    MFSDP_CHECK(offsets(sizes, 0, cat_off, &scratch_off, &mapped));
    *off_p = cat_off[cat];
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_arena_create(const mfsdp_arena_sizes_t *sizes, size_t scratch_bytes,
                                  const mfsdp_arena_opts_t *opts, mfsdp_arena_t **arena_p)
{
    MFSDP_CHECK_ARG(sizes != NULL && arena_p != NULL);
    mfsdp_arena_kind_t kind = opts != NULL ? opts->kind : MFSDP_ARENA_HOST;
    if (kind != MFSDP_ARENA_HOST && kind != MFSDP_ARENA_DEVICE) {
        MFSDP_WARN("unknown arena kind %d", (int)kind);
        return MFSDP_ERR_INVALID_ARG;
    }
    if (kind == MFSDP_ARENA_DEVICE && (opts->mem.alloc == NULL || opts->mem.free == NULL)) {
        MFSDP_WARN("a device arena needs an allocator (alloc and free callbacks)");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (opts != NULL && (opts->mem.alloc == NULL) != (opts->mem.free == NULL)) {
        MFSDP_WARN("an arena allocator needs both alloc and free callbacks");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (opts != NULL && (opts->mem.reg == NULL) != (opts->mem.dereg == NULL)) {
        MFSDP_WARN("arena registration needs both reg and dereg callbacks");
        return MFSDP_ERR_INVALID_ARG;
    }
    mfsdp_arena_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    a->numa_node = -1;
    a->kind = kind;
    if (opts != NULL) {
        a->mem = opts->mem;
    }
    a->sizes = *sizes;
    a->sizes.total = 0;
    size_t off = 0;
    int overflow = offsets(sizes, scratch_bytes, a->cat_off, &a->scratch_off, &off) != MFSDP_OK;
    for (int c = 0; c < MFSDP_ARENA_NCAT && !overflow; c++) {
        overflow = mfsdp_add_overflow(a->sizes.total, sizes->cat[c], &a->sizes.total);
    }
    if (overflow) {
        free(a);
        return MFSDP_ERR_OVERFLOW;
    }
    a->scratch_bytes = scratch_bytes;
    a->mapped = off;
    if (off != 0 && kind == MFSDP_ARENA_DEVICE) {
        /* One allocation, never returned before destroy; the callee zeroes it. */
        void *p = NULL;
        mfsdp_status_t st = a->mem.alloc(a->mem.arg, off, &p);
        if (st != MFSDP_OK || p == NULL) {
            MFSDP_WARN("cannot allocate the %zu-byte device owner arena (%s)", off,
                       mfsdp_status_string(st != MFSDP_OK ? st : MFSDP_ERR_NO_MEMORY));
            free(a);
            return st != MFSDP_OK ? st : MFSDP_ERR_NO_MEMORY;
        }
        a->base = p;
    } else if (off != 0) {
        /* An anonymous mapping is page-aligned, zeroed and never returned to a caching
         * allocator: the "pinned owner buffer" of docs/design.md, "Layers" (owner arenas).
         * The MPI backend brings a shared mapping of its own instead (same properties, so that
         * ranks on its node can read the owners' weights from it). */
        void *p = MAP_FAILED;
        if (a->mem.alloc != NULL) {
            if (a->mem.alloc(a->mem.arg, off, &p) != MFSDP_OK || p == NULL) {
                p = MAP_FAILED; /* the callback logged why */
            }
        } else {
            p = mmap(NULL, off, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) {
                MFSDP_WARN("cannot map the %zu-byte owner arena: %m", off);
            }
        }
        if (p == MAP_FAILED) {
            free(a);
            return MFSDP_ERR_NO_MEMORY;
        }
        a->base = p;
        /* Bind before touching the pages: mlock faults them in. */
        if (opts == NULL || opts->numa_bind) {
            a->numa_node = bind_numa(p, off);
        }
        if (opts == NULL || opts->mlock) {
            a->locked = lock_pages(p, off);
        }
    }
    if (a->base != NULL && a->mem.reg != NULL) {
        mfsdp_status_t st = a->mem.reg(a->mem.arg, a->base, a->mapped, &a->reg_handle);
        if (st != MFSDP_OK) {
            MFSDP_WARN("registering the %zu-byte owner arena with the communicator failed (%s)",
                       a->mapped, mfsdp_status_string(st));
            arena_release(a);
            return st;
        }
        a->registered = 1;
    }
    MFSDP_INFO(ALLOC, "owner arena: %zu bytes (%zu in tensors, %zu scratch), %s%s, numa node %d",
               a->mapped, a->sizes.total, scratch_bytes,
               kind == MFSDP_ARENA_DEVICE ? "device memory"
               : a->locked                ? "page-locked"
                                          : "pageable",
               a->registered ? ", registered" : "", a->numa_node);
    *arena_p = a;
    return MFSDP_OK;
}

void mfsdp_arena_destroy(mfsdp_arena_t *arena)
{
    if (arena != NULL) {
        arena_release(arena);
    }
}

void *mfsdp_arena_base(const mfsdp_arena_t *arena, mfsdp_arena_cat_t cat)
{
    if (arena == NULL || (unsigned)cat >= MFSDP_ARENA_NCAT || arena->sizes.cat[cat] == 0) {
        return NULL;
    }
    return (char *)arena->base + arena->cat_off[cat];
}

void *mfsdp_arena_scratch(const mfsdp_arena_t *arena)
{
    if (arena == NULL || arena->scratch_bytes == 0) {
        return NULL;
    }
    return (char *)arena->base + arena->scratch_off;
}

size_t mfsdp_arena_scratch_bytes(const mfsdp_arena_t *arena)
{
    return arena == NULL ? 0 : arena->scratch_bytes;
}

void mfsdp_arena_sizes(const mfsdp_arena_t *arena, mfsdp_arena_sizes_t *sizes_p)
{
    if (arena != NULL && sizes_p != NULL) {
        *sizes_p = arena->sizes;
    }
}

size_t mfsdp_arena_peak_bytes(const mfsdp_arena_t *arena)
{
    return arena == NULL ? 0 : arena->mapped;
}

int mfsdp_arena_locked(const mfsdp_arena_t *arena)
{
    return arena != NULL && arena->locked;
}

mfsdp_arena_kind_t mfsdp_arena_kind(const mfsdp_arena_t *arena)
{
    return arena == NULL ? MFSDP_ARENA_HOST : arena->kind;
}

int mfsdp_arena_registered(const mfsdp_arena_t *arena)
{
    return arena != NULL && arena->registered;
}

int mfsdp_arena_numa_node(const mfsdp_arena_t *arena)
{
    return arena == NULL ? -1 : arena->numa_node;
}

void mfsdp_arena_report(const mfsdp_arena_t *arena, int rank)
{
    if (arena == NULL || !mfsdp_log_enabled(MFSDP_LOG_INFO, MFSDP_SUBSYS_ALLOC)) {
        return;
    }
    for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
        MFSDP_INFO(ALLOC, "rank %d arena %-8s %zu bytes", rank, cat_names[c], arena->sizes.cat[c]);
    }
    MFSDP_INFO(ALLOC, "rank %d arena scratch  %zu bytes; peak %zu bytes (%s memory)", rank,
               arena->scratch_bytes, arena->mapped,
               arena->kind == MFSDP_ARENA_DEVICE ? "device" : "host");
}
