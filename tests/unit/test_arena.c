/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner arenas: layout accounting by category (hand-computed on a small plan), allocation
 * (zeroed, aligned, page-locked or a clean fallback), device arenas through allocator and
 * registration callbacks (their accounting, registration once, errors), and the peak bound
 * on the Llama-3-8B
 * manifest planned at 64 ranks: max per-rank arena bytes <= 1.1 x (total / n + largest
 * tensor), computed from the plan without MPI.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "alloc/arena.h"
#include "tests/unit/manifest_util.h"
#include "core/log.h"
#include "mfsdp/plan.h"

static mfsdp_manifest_t *small_manifest(void)
{
    mfsdp_manifest_t *m = calloc(1, sizeof(*m));
    mfsdp_hparams_default(&m->hp);
    m->ngroups = 1;
    m->groups = calloc(1, sizeof(*m->groups));
    mfsdp_group_desc_t *g = &m->groups[0];
    g->name = "g";
    g->lr_scale = 1.0;
    g->has_reduce_dtype = 1;
    g->reduce_dtype = MFSDP_FLOAT32;
    g->nparams = 3;
    g->params = calloc(3, sizeof(*g->params));
    static const struct {
        const char *name;
        int ndim;
        int64_t r, c;
        mfsdp_dtype_t dt;
        mfsdp_role_t role;
        int rg;
    } spec[] = {
        {"w", 2, 10, 6, MFSDP_BFLOAT16, MFSDP_ROLE_MUON, 1},
        {"frozen", 2, 3, 5, MFSDP_FLOAT32, MFSDP_ROLE_MUON, 0},
        {"norm", 1, 7, 1, MFSDP_FLOAT32, MFSDP_ROLE_ADAMW, 1},
    };
    for (int i = 0; i < 3; i++) {
        mfsdp_param_desc_t *p = &g->params[i];
        test_param_fill(p, spec[i].name, spec[i].ndim, spec[i].r, spec[i].c, spec[i].dt,
                        spec[i].role, spec[i].rg);
    }
    return m;
}

static void small_free(mfsdp_manifest_t *m)
{
    free(m->groups[0].params);
    free(m->groups);
    free(m);
}

static size_t al(size_t x)
{
    return (x + MFSDP_ARENA_ALIGN - 1) / MFSDP_ARENA_ALIGN * MFSDP_ARENA_ALIGN;
}

Test(arena, layout_by_category)
{
    mfsdp_manifest_t *m = small_manifest();
    mfsdp_plan_opts_t po = {.tail = MFSDP_TAIL_SHARD};
    mfsdp_plan_t *plan = NULL;
    cr_assert_eq(mfsdp_plan_create(m, 2, &po, &plan), MFSDP_OK);
    size_t want[2][MFSDP_ARENA_NCAT];
    memset(want, 0, sizeof(want));
    /* Sharded norm: 7 rows at n = 2 -> c = 4 elements on every rank. */
    for (int r = 0; r < 2; r++) {
        want[r][MFSDP_ARENA_MASTER] += al(4 * 4);
        want[r][MFSDP_ARENA_COMM] += al(4 * 4);
        want[r][MFSDP_ARENA_GRAD] += al(4 * 4);
        want[r][MFSDP_ARENA_ADAM_M] += al(4 * 4);
        want[r][MFSDP_ARENA_ADAM_V] += al(4 * 4);
    }
    for (size_t i = 0; i < plan->nshards; i++) {
        const mfsdp_shard_t *sh = &plan->shards[i];
        if (sh->owner < 0) {
            cr_assert_eq(sh->param, 2);
            continue;
        }
        size_t *w = want[sh->owner];
        if (sh->param == 0) { /* bf16 Muon 10x6 with grad */
            w[MFSDP_ARENA_MASTER] += al(60 * 4);
            w[MFSDP_ARENA_COMM] += al(60 * 2);
            w[MFSDP_ARENA_GRAD] += al(60 * 4);
            w[MFSDP_ARENA_MOMENTUM] += al(60 * 4);
        } else { /* frozen fp32 3x5: weights only */
            w[MFSDP_ARENA_MASTER] += al(15 * 4);
            w[MFSDP_ARENA_COMM] += al(15 * 4);
        }
    }
    for (int r = 0; r < 2; r++) {
        mfsdp_arena_slot_t slots[3];
        mfsdp_arena_sizes_t s;
        cr_assert_eq(mfsdp_arena_layout(plan, r, slots, &s), MFSDP_OK);
        size_t tot = 0;
        for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
            cr_expect_eq(s.cat[c], want[r][c], "rank %d %s: %zu != %zu", r, mfsdp_arena_cat_name(c),
                         s.cat[c], want[r][c]);
            tot += want[r][c];
        }
        cr_expect_eq(s.total, tot);
        cr_expect_eq(slots[2].elems, 4);
        cr_expect_eq(slots[1].off[MFSDP_ARENA_GRAD], MFSDP_ARENA_NONE, "frozen has no grad");
        cr_expect_eq(slots[2].off[MFSDP_ARENA_MOMENTUM], MFSDP_ARENA_NONE);
    }
    mfsdp_plan_destroy(plan);
    small_free(m);
}

Test(arena, create_zeroed_aligned)
{
    mfsdp_arena_sizes_t s;
    memset(&s, 0, sizeof(s));
    s.cat[MFSDP_ARENA_MASTER] = 1000;
    s.cat[MFSDP_ARENA_GRAD] = 64;
    s.cat[MFSDP_ARENA_ADAM_V] = 3;
    s.total = 1067;
    mfsdp_arena_opts_t o = {.mlock = 1, .numa_bind = 1};
    mfsdp_arena_t *a = NULL;
    cr_assert_eq(mfsdp_arena_create(&s, 4096, &o, &a), MFSDP_OK);
    for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
        unsigned char *p = mfsdp_arena_base(a, c);
        if (s.cat[c] == 0) {
            cr_expect_null(p);
            continue;
        }
        cr_assert_not_null(p);
        cr_expect_eq((uintptr_t)p % MFSDP_ARENA_ALIGN, 0);
        for (size_t i = 0; i < s.cat[c]; i++) {
            cr_assert_eq(p[i], 0);
        }
        memset(p, 0xff, s.cat[c]); /* writable over its whole size */
    }
    unsigned char *sc = mfsdp_arena_scratch(a);
    cr_assert_not_null(sc);
    cr_expect_eq(mfsdp_arena_scratch_bytes(a), 4096);
    memset(sc, 1, 4096);
    mfsdp_arena_sizes_t got;
    mfsdp_arena_sizes(a, &got);
    cr_expect_eq(got.total, 1067);
    cr_expect_geq(mfsdp_arena_peak_bytes(a), 1067 + 4096);
    cr_expect_leq(mfsdp_arena_peak_bytes(a), 1067 + 4096 + 7 * MFSDP_ARENA_ALIGN);
    mfsdp_arena_destroy(a);
}

Test(arena, no_mlock_and_empty)
{
    mfsdp_arena_sizes_t s;
    memset(&s, 0, sizeof(s));
    mfsdp_arena_opts_t o = {.mlock = 0, .numa_bind = 0};
    mfsdp_arena_t *a = NULL;
    cr_assert_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_OK);
    cr_expect_eq(mfsdp_arena_locked(a), 0);
    cr_expect_null(mfsdp_arena_scratch(a));
    cr_expect_eq(mfsdp_arena_peak_bytes(a), 0);
    mfsdp_arena_destroy(a);
    cr_expect_eq(mfsdp_arena_create(NULL, 0, &o, &a), MFSDP_ERR_INVALID_ARG);
}

/* RLIMIT_MEMLOCK at 0 (and, as root, CAP_IPC_LOCK dropped): mlock fails, the arena still
 * works, unpinned, and a warning says why and how to fix it. Criterion runs this in its own
 * process, so the lowered limits do not leak into other tests. */
static void redirect_stderr_init(void)
{
    cr_redirect_stderr();
}

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

Test(arena, mlock_refused_falls_back, .init = redirect_stderr_init)
{
#ifdef UNDER_ASAN
    cr_skip_test("AddressSanitizer intercepts mlock as a no-op that always succeeds");
#endif
    struct rlimit rl = {0, 0};
    cr_assert_eq(setrlimit(RLIMIT_MEMLOCK, &rl), 0);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct caps[2];
    if (syscall(SYS_capget, &hdr, caps) == 0) {
        caps[CAP_TO_INDEX(CAP_IPC_LOCK)].effective &= ~CAP_TO_MASK(CAP_IPC_LOCK);
        caps[CAP_TO_INDEX(CAP_IPC_LOCK)].permitted &= ~CAP_TO_MASK(CAP_IPC_LOCK);
        cr_assert_eq(syscall(SYS_capset, &hdr, caps), 0);
    }
    setenv("MFSDP_DEBUG", "WARN", 1);
    mfsdp_log_reinit();
    mfsdp_arena_sizes_t s;
    memset(&s, 0, sizeof(s));
    s.cat[MFSDP_ARENA_MASTER] = 1 << 20;
    s.total = s.cat[MFSDP_ARENA_MASTER];
    mfsdp_arena_opts_t o = {.mlock = 1, .numa_bind = 0};
    mfsdp_arena_t *a = NULL;
    cr_assert_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_OK);
    cr_expect_eq(mfsdp_arena_locked(a), 0);
    float *p = mfsdp_arena_base(a, MFSDP_ARENA_MASTER);
    cr_assert_not_null(p);
    p[0] = 1.0f;
    p[(1 << 18) - 1] = 2.0f;
    mfsdp_arena_destroy(a);
    fflush(stderr);
    FILE *f = cr_get_redirected_stderr();
    char buf[4096] = "";
    size_t nread = fread(buf, 1, sizeof(buf) - 1, f);
    buf[nread] = '\0';
    cr_expect(strstr(buf, "mlock of the") != NULL && strstr(buf, "RLIMIT_MEMLOCK") != NULL &&
                  strstr(buf, "MFSDP_MLOCK=0") != NULL,
              "warning missing or unclear: '%s'", buf);
}

/* Peak bound at Llama-3-8B scale, for every tail policy. */
static void llama_bound(mfsdp_tail_policy_t tail, const char *name)
{
    const int n = 64;
    char err[512] = "";
    mfsdp_manifest_t *m = NULL;
    mfsdp_status_t st = mfsdp_manifest_load(MFSDP_SOURCE_ROOT "/examples/models/llama3-8b.json",
                                            err, sizeof(err), &m);
    cr_assert_eq(st, MFSDP_OK, "load: %s", err);
    mfsdp_plan_opts_t po = {.tail = tail};
    mfsdp_plan_t *plan = NULL;
    cr_assert_eq(mfsdp_plan_create(m, n, &po, &plan), MFSDP_OK);
    mfsdp_arena_slot_t *slots = calloc(plan->nshards, sizeof(*slots));
    double total = 0, peak = 0, largest = 0;
    int peak_rank = 0;
    for (int r = 0; r < n; r++) {
        mfsdp_arena_sizes_t s;
        cr_assert_eq(mfsdp_arena_layout(plan, r, slots, &s), MFSDP_OK);
        total += (double)s.total;
        if ((double)s.total > peak) {
            peak = (double)s.total;
            peak_rank = r;
        }
        /* Categories agree with the planner's element counts up to alignment. */
        size_t nloc = 0;
        for (size_t i = 0; i < plan->nshards; i++) {
            nloc += slots[i].elems != 0;
            if (plan->shards[i].owner == r) {
                size_t b = 0;
                for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
                    size_t e = slots[i].off[c] == MFSDP_ARENA_NONE ? 0 : slots[i].elems;
                    b += e * (c == MFSDP_ARENA_COMM ? 2 : 4);
                }
                largest = (double)b > largest ? (double)b : largest;
            }
        }
        size_t pm = plan->ranks[r].arena_elems[MFSDP_ARENA_MASTER] * 4;
        cr_expect_geq(s.cat[MFSDP_ARENA_MASTER], pm, "rank %d master", r);
        cr_expect_leq(s.cat[MFSDP_ARENA_MASTER], pm + nloc * MFSDP_ARENA_ALIGN, "rank %d", r);
    }
    double bound = 1.1 * (total / n + largest);
    printf("arena llama3-8b n=%d tail=%s: peak %.3f GiB (rank %d), total/n %.3f GiB, largest "
           "tensor %.3f GiB, bound %.3f GiB, peak/bound %.3f\n",
           n, name, peak / 1073741824.0, peak_rank, total / n / 1073741824.0,
           largest / 1073741824.0, bound / 1073741824.0, peak / bound);
    cr_expect_leq(peak, bound, "tail %s: peak %.0f > 1.1 x (total/n + largest) = %.0f", name, peak,
                  bound);
    free(slots);
    mfsdp_plan_destroy(plan);
    mfsdp_manifest_free(m);
}

Test(arena, llama3_8b_64_ranks_owner)
{
    llama_bound(MFSDP_TAIL_OWNER, "owner");
}

Test(arena, llama3_8b_64_ranks_shard)
{
    llama_bound(MFSDP_TAIL_SHARD, "shard");
}

Test(arena, llama3_8b_64_ranks_auto)
{
    llama_bound(MFSDP_TAIL_AUTO, "auto");
}

/* ---- device arenas: memory and registration through callbacks (host memory here, standing
 * in for cudaMalloc / ncclMemAlloc + ncclCommRegister, which need a GPU) ---- */

typedef struct fake_dev {
    int allocs, frees, regs, deregs;
    size_t bytes;
    void *ptr, *handle;
    mfsdp_status_t fail_alloc, fail_reg, fail_dereg;
} fake_dev_t;

static mfsdp_status_t fd_alloc(void *arg, size_t bytes, void **ptr_p)
{
    fake_dev_t *f = arg;
    if (f->fail_alloc != MFSDP_OK) {
        return f->fail_alloc;
    }
    f->allocs++;
    f->bytes = bytes;
    f->ptr = calloc(1, bytes);
    *ptr_p = f->ptr;
    return f->ptr != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY;
}

static void fd_free(void *arg, void *ptr)
{
    fake_dev_t *f = arg;
    cr_expect_eq(ptr, f->ptr, "freed a pointer the allocator did not return");
    cr_expect_eq(f->regs, f->deregs, "freed while still registered");
    f->frees++;
    free(ptr);
}

static mfsdp_status_t fd_reg(void *arg, void *ptr, size_t bytes, void **handle_p)
{
    fake_dev_t *f = arg;
    if (f->allocs == 0) { /* a host arena: the mapping is not ours to know in advance */
        f->ptr = ptr;
        f->bytes = bytes;
    }
    cr_expect_eq(ptr, f->ptr);
    cr_expect_eq(bytes, f->bytes, "registered %zu bytes of %zu", bytes, f->bytes);
    if (f->fail_reg != MFSDP_OK) {
        return f->fail_reg;
    }
    f->regs++;
    f->handle = &f->handle;
    *handle_p = f->handle;
    return MFSDP_OK;
}

static mfsdp_status_t fd_dereg(void *arg, void *handle)
{
    fake_dev_t *f = arg;
    cr_expect_eq(handle, f->handle);
    f->deregs++;
    return f->fail_dereg;
}

static mfsdp_arena_sizes_t some_sizes(void)
{
    mfsdp_arena_sizes_t s;
    memset(&s, 0, sizeof(s));
    s.cat[MFSDP_ARENA_MASTER] = 1000;
    s.cat[MFSDP_ARENA_COMM] = 500;
    s.cat[MFSDP_ARENA_GRAD] = 1000;
    s.total = 2500;
    return s;
}

/* One allocation of the host layout's size, zeroed, registered once, then deregistered and
 * freed at destroy; the accounting is the host arena's. */
Test(arena, device_kind_accounting_and_registration)
{
    mfsdp_arena_sizes_t s = some_sizes();
    fake_dev_t f = {0};
    mfsdp_arena_opts_t o = {.mlock = 1,
                            .numa_bind = 1,
                            .kind = MFSDP_ARENA_DEVICE,
                            .mem = {&f, fd_alloc, fd_free, fd_reg, fd_dereg}};
    mfsdp_arena_t *a = NULL, *h = NULL;
    cr_assert_eq(mfsdp_arena_create(&s, 3000, &o, &a), MFSDP_OK);
    mfsdp_arena_opts_t ho = {.mlock = 0, .numa_bind = 0};
    cr_assert_eq(mfsdp_arena_create(&s, 3000, &ho, &h), MFSDP_OK);
    cr_expect_eq(f.allocs, 1);
    cr_expect_eq(f.regs, 1);
    cr_expect_eq(mfsdp_arena_kind(a), MFSDP_ARENA_DEVICE);
    cr_expect_eq(mfsdp_arena_kind(h), MFSDP_ARENA_HOST);
    cr_expect_eq(mfsdp_arena_registered(a), 1);
    cr_expect_eq(mfsdp_arena_registered(h), 0);
    cr_expect_eq(mfsdp_arena_locked(a), 0, "device memory is never mlocked");
    cr_expect_eq(mfsdp_arena_numa_node(a), -1);
    cr_expect_eq(mfsdp_arena_peak_bytes(a), mfsdp_arena_peak_bytes(h));
    cr_expect_eq(f.bytes, mfsdp_arena_peak_bytes(a));
    mfsdp_arena_sizes_t ga, gh;
    mfsdp_arena_sizes(a, &ga);
    mfsdp_arena_sizes(h, &gh);
    cr_expect_eq(memcmp(&ga, &gh, sizeof(ga)), 0, "per-category accounting differs");
    for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
        unsigned char *pa = mfsdp_arena_base(a, c), *ph = mfsdp_arena_base(h, c);
        cr_expect_eq(pa == NULL, ph == NULL);
        if (pa != NULL) {
            cr_expect_eq(pa - (unsigned char *)f.ptr,
                         ph - (unsigned char *)mfsdp_arena_base(h, MFSDP_ARENA_MASTER));
            cr_expect_eq((uintptr_t)(pa - (unsigned char *)f.ptr) % MFSDP_ARENA_ALIGN, 0);
        }
    }
    unsigned char *sc = mfsdp_arena_scratch(a);
    cr_assert_not_null(sc);
    cr_expect_leq(sc + 3000, (unsigned char *)f.ptr + f.bytes);
    mfsdp_arena_destroy(a);
    mfsdp_arena_destroy(h);
    cr_expect_eq(f.deregs, 1);
    cr_expect_eq(f.frees, 1);
}

/* A host arena can be registered too (the test NCCL library works on host memory). */
Test(arena, host_kind_registered)
{
    mfsdp_arena_sizes_t s = some_sizes();
    fake_dev_t f = {0};
    mfsdp_arena_opts_t o = {
        .mlock = 0, .kind = MFSDP_ARENA_HOST, .mem = {&f, NULL, NULL, fd_reg, fd_dereg}};
    mfsdp_arena_t *a = NULL;
    cr_assert_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_OK);
    cr_expect_eq(mfsdp_arena_registered(a), 1);
    cr_expect_eq(f.regs, 1);
    cr_expect_eq(f.ptr, mfsdp_arena_base(a, MFSDP_ARENA_MASTER), "not the whole arena");
    cr_expect_eq(f.bytes, mfsdp_arena_peak_bytes(a));
    mfsdp_arena_destroy(a);
    cr_expect_eq(f.deregs, 1);
}

static void arena_quiet(void)
{
    cr_redirect_stderr();
}

/* Failures: allocation and registration fail the creation with their status, free what was
 * taken and say what failed; a failed deregistration at destroy is reported, the memory is
 * still freed; incomplete callback sets are refused. */
Test(arena, device_kind_errors, .init = arena_quiet)
{
    mfsdp_arena_sizes_t s = some_sizes();
    fake_dev_t f = {0};
    mfsdp_arena_opts_t o = {.kind = MFSDP_ARENA_DEVICE,
                            .mem = {&f, fd_alloc, fd_free, fd_reg, fd_dereg}};
    mfsdp_arena_t *a = NULL;
    f.fail_alloc = MFSDP_ERR_NO_MEMORY;
    cr_expect_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_ERR_NO_MEMORY);
    cr_expect_null(a);
    f.fail_alloc = MFSDP_OK;
    f.fail_reg = MFSDP_ERR_TRANSPORT;
    cr_expect_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_ERR_TRANSPORT);
    cr_expect_null(a);
    cr_expect_eq(f.allocs, 1);
    cr_expect_eq(f.frees, 1, "memory of a failed registration not freed");
    cr_expect_eq(f.deregs, 0, "deregistered what was never registered");
    f.fail_reg = MFSDP_OK;
    f.fail_dereg = MFSDP_ERR_TRANSPORT;
    cr_assert_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_OK);
    mfsdp_arena_destroy(a);
    cr_expect_eq(f.deregs, 1);
    cr_expect_eq(f.frees, 2);
    o.mem.alloc = NULL;
    cr_expect_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_ERR_INVALID_ARG);
    o.mem.alloc = fd_alloc;
    o.mem.dereg = NULL;
    cr_expect_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_ERR_INVALID_ARG);
    o.mem.dereg = fd_dereg;
    o.kind = (mfsdp_arena_kind_t)7;
    cr_expect_eq(mfsdp_arena_create(&s, 0, &o, &a), MFSDP_ERR_INVALID_ARG);
    fflush(stderr);
    cr_expect_stderr_neq_str(""); /* the failures were explained */
}
