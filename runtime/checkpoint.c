/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner checkpoints of a runtime context (docs/checkpoints.md; mfsdp/checkpoint.h).
 *
 * Save: after the pending lazy steps, every rank copies what it owns (weights in the param
 * dtype, fp32 masters of non-fp32 params, Muon momentum, AdamW moments, its sharded-tail
 * slices) into one host buffer, the sharded-tail weights are gathered whole onto their
 * writer ranks (one point-to-point batch), and the call returns: that copy is the whole
 * stall. A background thread per rank writes the rank's two safetensors files and its .done
 * record into DIR/<name>.partial (core/ckpt_io.h). Rank 0's thread then waits for every
 * rank's record (polling the shared directory) and commits: index, rename, `latest`. The
 * next save, save_wait, load or destroy joins the threads and agrees on the outcome over
 * the transport, so a failure on any rank is reported on every rank, and, when the records
 * are not visible to rank 0 through the filesystem, rank 0 commits from the digests the
 * agreement carries.
 *
 * Load: every rank reads the index, checks it against its manifest, verifies the SHA-256 of
 * every world-th file, reads the tensors and slices it owns under its own plan from
 * whichever files hold them, and all ranks agree on the result.
 *
 * No MPI here: all communication goes through the transport table (p2p batches), so
 * nothing is sent at world size 1.
 */
#include "runtime/checkpoint.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/checks.h"
#include "mfsdp/kernels.h"

mfsdp_ckpt_hook_t mfsdp_ckpt_test_hook;

#define TAG_TAIL   0x6d00
#define TAG_GATHER 0x6d01
#define TAG_BCAST  0x6d02
#define MAX_MSG    ((size_t)1 << 30) /* one point-to-point message at most */
#define ALIGN      64

/* One rank's outcome of its background write, as the agreement carries it. */
typedef struct wire_result {
    int32_t status;
    int32_t pad;
    uint64_t bytes[2];
    char sha[2][MFSDP_SHA256_HEX];
    char pad2[6];
} wire_result_t;

typedef struct ckpt_job {
    char *root;
    char *partial;
    char name[MFSDP_CKPT_NAME_LEN];
    int rank;
    int world;
    mfsdp_ckpt_layout_t *lay;
    mfsdp_ckpt_meta_t meta;
    mfsdp_ckpt_item_t *items;
    size_t nitems;
    char *snap; /* snapshot buffer (snap_len bytes) */
    size_t snap_len;
    const void **data;
    pthread_t th;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* shared with the thread, under mu */
    int write_done;
    mfsdp_status_t write_st;
    double write_seconds;
    mfsdp_ckpt_file_info_t files[2];
    int abort;                     /* rank 0: another rank failed, do not commit */
    int supplied;                  /* rank 0: every rank's digests are in `given` */
    mfsdp_ckpt_file_info_t *given; /* rank 0: 2 * world, from the agreement */
    int finished;
    mfsdp_status_t commit_st;
} ckpt_job_t;

struct mfsdp_ckpt_ctx {
    ckpt_job_t *job;
    mfsdp_ckpt_stats_t stats;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void hit(const char *what, const char *file)
{
    if (mfsdp_ckpt_test_hook.fn != NULL) {
        mfsdp_ckpt_test_hook.fn(mfsdp_ckpt_test_hook.arg, what, file, NULL);
    }
}

static mfsdp_status_t ctx_check(const struct mfsdp_ctx *ctx)
{
    if (ctx == NULL || ctx->magic != MFSDP_CTX_MAGIC) {
        MFSDP_WARN("checkpoint: context %p is not a live mfsdp context (destroyed?)",
                   (const void *)ctx);
        return MFSDP_ERR_STATE;
    }
    return MFSDP_OK;
}

/* Tail "job": the job's optimizer holds the AdamW tensors and their state, so a checkpoint
 * of the context would miss them (the same answer on every rank: the plan is shared). */
static mfsdp_status_t tail_check(const struct mfsdp_ctx *ctx)
{
    if (ctx->exec->ops->device_memory) {
        MFSDP_WARN("checkpoint: the context's state is in device memory; checkpoints of "
                   "device-resident contexts are not implemented yet (the save copies and the "
                   "load writes host memory)");
        return MFSDP_ERR_UNSUPPORTED;
    }
    if (ctx->plan->tail == MFSDP_TAIL_JOB) {
        MFSDP_WARN("checkpoint: the plan's tail is \"job\": the AdamW tensors and their state "
                   "are the job's, not the context's; a context checkpoint would miss them "
                   "(checkpoint with the job's own state_dict, or use tail owner or shard)");
        return MFSDP_ERR_UNSUPPORTED;
    }
    return MFSDP_OK;
}

static struct mfsdp_ckpt_ctx *state_of(struct mfsdp_ctx *ctx)
{
    if (ctx->ckpt == NULL) {
        ctx->ckpt = calloc(1, sizeof(*ctx->ckpt));
        if (ctx->ckpt != NULL) {
            ctx->ckpt->stats.step = -1;
        }
    }
    return ctx->ckpt;
}

static mfsdp_arena_cat_t cat_of(mfsdp_ckpt_state_t s)
{
    switch (s) {
    case MFSDP_CKPT_WEIGHT:
        return MFSDP_ARENA_COMM;
    case MFSDP_CKPT_MASTER:
        return MFSDP_ARENA_MASTER;
    case MFSDP_CKPT_MOMENTUM:
        return MFSDP_ARENA_MOMENTUM;
    case MFSDP_CKPT_EXP_AVG:
        return MFSDP_ARENA_ADAM_M;
    default:
        return MFSDP_ARENA_ADAM_V;
    }
}

mfsdp_status_t mfsdp_ckpt_ctx_layout(const struct mfsdp_ctx *ctx, mfsdp_ckpt_layout_t **lay_p)
{
    return mfsdp_ckpt_layout_of_plan(ctx->plan, lay_p);
}

/* ---- agreement over the transport --------------------------------------------------------- */

/* Rank 0 receives one sz-byte record from every other rank (in blocks through a fixed
 * buffer, so that nothing needs to be allocated to take part) and hands each to fn; the
 * others send theirs. */
typedef void (*collect_fn)(void *arg, int rank, const void *rec);

static mfsdp_status_t collect0(struct mfsdp_ctx *ctx, const void *mine, size_t sz, collect_fn fn,
                               void *arg)
{
    enum { BUF = 16384, MAXV = 256 };
    if (ctx->rank != 0) {
        mfsdp_p2p_t v = {1, 0, TAG_GATHER, (void *)mine, sz};
        return ctx->tp->ops->p2p(ctx->tp, &v, 1);
    }
    fn(arg, 0, mine);
    _Alignas(16) char buf[BUF];
    mfsdp_p2p_t v[MAXV];
    int per = (int)(BUF / sz) < MAXV ? (int)(BUF / sz) : MAXV;
    mfsdp_status_t st = MFSDP_OK;
    for (int first = 1; first < ctx->world; first += per) {
        int cnt = ctx->world - first < per ? ctx->world - first : per;
        for (int k = 0; k < cnt; k++) {
            v[k] = (mfsdp_p2p_t){0, first + k, TAG_GATHER, buf + (size_t)k * sz, sz};
        }
        mfsdp_status_t ts = ctx->tp->ops->p2p(ctx->tp, v, (size_t)cnt);
        for (int k = 0; k < cnt && ts == MFSDP_OK; k++) {
            fn(arg, first + k, buf + (size_t)k * sz);
        }
        st = st == MFSDP_OK ? ts : st; /* keep receiving: every sender must be matched */
    }
    return st;
}

/* Rank 0's sz bytes to every rank. */
static mfsdp_status_t bcast0(struct mfsdp_ctx *ctx, void *buf, size_t sz)
{
    enum { MAXV = 256 };
    if (ctx->rank != 0) {
        mfsdp_p2p_t v = {0, 0, TAG_BCAST, buf, sz};
        return ctx->tp->ops->p2p(ctx->tp, &v, 1);
    }
    mfsdp_p2p_t v[MAXV];
    mfsdp_status_t st = MFSDP_OK;
    for (int first = 1; first < ctx->world; first += MAXV) {
        int cnt = ctx->world - first < MAXV ? ctx->world - first : MAXV;
        for (int k = 0; k < cnt; k++) {
            v[k] = (mfsdp_p2p_t){1, first + k, TAG_BCAST, buf, sz};
        }
        mfsdp_status_t ts = ctx->tp->ops->p2p(ctx->tp, v, (size_t)cnt);
        st = st == MFSDP_OK ? ts : st;
    }
    return st;
}

static void min_status(void *arg, int rank, const void *rec)
{
    (void)rank;
    int32_t v;
    memcpy(&v, rec, sizeof(v));
    int32_t *worst = arg;
    *worst = v < *worst ? v : *worst;
}

/* The lowest (worst) status of all ranks, on every rank. */
static mfsdp_status_t agree(struct mfsdp_ctx *ctx, mfsdp_status_t st)
{
    int32_t mine = (int32_t)st;
    int32_t worst = mine;
    if (collect0(ctx, &mine, sizeof(mine), min_status, &worst) != MFSDP_OK) {
        worst = MFSDP_ERR_TRANSPORT;
    }
    if (bcast0(ctx, &worst, sizeof(worst)) != MFSDP_OK) {
        return MFSDP_ERR_TRANSPORT;
    }
    if (worst != MFSDP_OK && st == MFSDP_OK) {
        MFSDP_WARN("checkpoint: failed on another rank (%s)",
                   mfsdp_status_string((mfsdp_status_t)worst));
    }
    return (mfsdp_status_t)worst;
}

/* ---- the background writer --------------------------------------------------------------- */

/* The snapshot buffer. (Transparent huge pages were tried: with the kernel's default
 * "madvise" defrag setting the synchronous compaction made the copy slower, not faster.) */
static mfsdp_status_t snap_alloc(ckpt_job_t *job, size_t bytes)
{
    if (posix_memalign((void **)&job->snap, ALIGN, bytes + ALIGN) != 0) {
        job->snap = NULL;
        return MFSDP_ERR_NO_MEMORY;
    }
    job->snap_len = bytes + ALIGN;
    return MFSDP_OK;
}

static void snap_free(ckpt_job_t *job)
{
    if (job->snap != NULL) {
        free(job->snap);
        job->snap = NULL;
    }
}

static void job_free(ckpt_job_t *job)
{
    if (job == NULL) {
        return;
    }
    pthread_mutex_destroy(&job->mu);
    pthread_cond_destroy(&job->cv);
    mfsdp_ckpt_items_free(job->items, job->nitems);
    mfsdp_ckpt_layout_destroy(job->lay);
    mfsdp_ckpt_meta_clear(&job->meta);
    snap_free(job);
    free(job->data);
    free(job->given);
    free(job->partial);
    free(job->root);
    free(job);
}

/* Rank 0: every rank's digests (from the records or from the agreement), then the commit. */
static mfsdp_status_t commit_phase(ckpt_job_t *job)
{
    int n = job->world;
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_ckpt_file_info_t *all = calloc(2 * (size_t)n, sizeof(*all));
    char *seen = calloc((size_t)n, 1);
    char *text = NULL;
    size_t len = 0;
    if (all == NULL || seen == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    all[mfsdp_ckpt_file_slot(n, MFSDP_CKPT_MODEL, 0)] = job->files[0];
    all[mfsdp_ckpt_file_slot(n, MFSDP_CKPT_OPTIM, 0)] = job->files[1];
    seen[0] = 1;
    int nseen = 1;
    long delay_ms = 2;
    for (;;) {
        pthread_mutex_lock(&job->mu);
        int abort = job->abort, supplied = job->supplied;
        if (supplied) {
            memcpy(all, job->given, 2 * (size_t)n * sizeof(*all));
        }
        pthread_mutex_unlock(&job->mu);
        if (abort) {
            st = MFSDP_ERR_STATE; /* another rank failed: it reports why */
            goto out;
        }
        if (supplied) {
            break;
        }
        for (int q = 1; q < n; q++) {
            if (seen[q]) {
                continue;
            }
            mfsdp_ckpt_file_info_t f[2];
            int state = 0;
            MFSDP_CHECK_GOTO(mfsdp_ckpt_poll_rank(job->partial, job->lay, q, f, &state), st, out);
            if (state < 0) {
                MFSDP_WARN("checkpoint %s: rank %d recorded a failed write", job->partial, q);
                st = MFSDP_ERR_IO;
                goto out;
            }
            if (state > 0) {
                all[mfsdp_ckpt_file_slot(n, MFSDP_CKPT_MODEL, q)] = f[0];
                all[mfsdp_ckpt_file_slot(n, MFSDP_CKPT_OPTIM, q)] = f[1];
                seen[q] = 1;
                nseen++;
            }
        }
        if (nseen == n) {
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += delay_ms * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&job->mu);
        if (!job->abort && !job->supplied) {
            pthread_cond_timedwait(&job->cv, &job->mu, &ts);
        }
        pthread_mutex_unlock(&job->mu);
        delay_ms = delay_ms < 200 ? delay_ms * 2 : 200;
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_index_text(job->lay, &job->meta, all, &text, &len), st, out);
    char hex[MFSDP_SHA256_HEX];
    memcpy(hex, text + strlen("{\"index_sha256\": \""), 64);
    hex[64] = '\0';
    MFSDP_CHECK_GOTO(
        mfsdp_ckpt_commit(job->root, job->name, text, len, hex, n, &mfsdp_ckpt_test_hook), st, out);
    MFSDP_INFO(CKPT, "checkpoint %s/%s committed (step %lld, %d ranks)", job->root, job->name,
               (long long)job->meta.step, n);
out:
    free(text);
    free(all);
    free(seen);
    return st;
}

static void write_part(ckpt_job_t *job)
{
    double t0 = now();
    mfsdp_ckpt_file_info_t files[2];
    memset(files, 0, sizeof(files));
    mfsdp_status_t st =
        mfsdp_ckpt_write_rank(job->partial, job->lay, &job->meta, job->rank, job->items,
                              job->nitems, job->data, NULL, NULL, &mfsdp_ckpt_test_hook, files);
    if (st != MFSDP_OK) {
        mfsdp_ckpt_write_failed(job->partial, job->rank, mfsdp_status_string(st));
    }
    snap_free(job); /* written: the copy is not needed any more */
    pthread_mutex_lock(&job->mu);
    job->write_done = 1;
    job->write_st = st;
    job->write_seconds = now() - t0;
    memcpy(job->files, files, sizeof(files));
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

static void finish(ckpt_job_t *job, mfsdp_status_t st)
{
    pthread_mutex_lock(&job->mu);
    job->finished = 1;
    job->commit_st = st;
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

static void *writer_main(void *arg)
{
    ckpt_job_t *job = arg;
    write_part(job);
    if (job->rank == 0 && job->write_st == MFSDP_OK) {
        finish(job, commit_phase(job));
    } else {
        finish(job, job->write_st);
    }
    return NULL;
}

typedef struct finish_acc {
    ckpt_job_t *job;
    int world;
    int32_t worst;
} finish_acc_t;

/* Rank 0: one rank's write result into the job's `given` digests (under the job's lock, as
 * the writer thread reads them once `supplied` is set). */
static void take_result(void *arg, int r, const void *rec)
{
    finish_acc_t *acc = arg;
    wire_result_t w;
    memcpy(&w, rec, sizeof(w));
    acc->worst = w.status < acc->worst ? w.status : acc->worst;
    pthread_mutex_lock(&acc->job->mu);
    for (int k = 0; k < 2; k++) {
        mfsdp_ckpt_file_info_t *fi = &acc->job->given[(size_t)k * (size_t)acc->world + (size_t)r];
        fi->kind = k == 0 ? MFSDP_CKPT_MODEL : MFSDP_CKPT_OPTIM;
        fi->rank = r;
        mfsdp_ckpt_file_name(fi->name, sizeof(fi->name), fi->kind, r, acc->world);
        fi->bytes = w.bytes[k];
        memcpy(fi->sha256, w.sha[k], MFSDP_SHA256_HEX);
        fi->sha256[64] = '\0';
    }
    pthread_mutex_unlock(&acc->job->mu);
}

/* Join the pending save and agree on its outcome. Collective when a save is pending (that
 * is the same on every rank: saves are collective and agreed). */
static mfsdp_status_t job_finish(struct mfsdp_ctx *ctx)
{
    struct mfsdp_ckpt_ctx *cs = ctx->ckpt;
    ckpt_job_t *job = cs != NULL ? cs->job : NULL;
    if (job == NULL) {
        return MFSDP_OK;
    }
    int n = ctx->world;
    wire_result_t mine;
    memset(&mine, 0, sizeof(mine));
    pthread_mutex_lock(&job->mu);
    while (!job->write_done) {
        pthread_cond_wait(&job->cv, &job->mu);
    }
    mine.status = (int32_t)job->write_st;
    for (int k = 0; k < 2; k++) {
        mine.bytes[k] = job->files[k].bytes;
        memcpy(mine.sha[k], job->files[k].sha256, MFSDP_SHA256_HEX);
    }
    pthread_mutex_unlock(&job->mu);

    finish_acc_t acc = {job, n, MFSDP_OK};
    int32_t final = MFSDP_OK;
    mfsdp_status_t ts = collect0(ctx, &mine, sizeof(mine), take_result, &acc);
    if (ctx->rank == 0) {
        int32_t worst = ts != MFSDP_OK ? (int32_t)MFSDP_ERR_TRANSPORT : acc.worst;
        pthread_mutex_lock(&job->mu);
        if (worst == MFSDP_OK) {
            job->supplied = 1;
        } else {
            job->abort = 1;
        }
        pthread_cond_broadcast(&job->cv);
        pthread_mutex_unlock(&job->mu);
        if (job->started) {
            pthread_join(job->th, NULL);
        } else if (worst == MFSDP_OK) {
            finish(job, commit_phase(job)); /* no thread: commit here */
        } else {
            finish(job, (mfsdp_status_t)worst);
        }
        final = worst != MFSDP_OK ? worst : (int32_t)job->commit_st;
    } else if (job->started) {
        pthread_join(job->th, NULL);
    }
    if (bcast0(ctx, &final, sizeof(final)) != MFSDP_OK) {
        final = MFSDP_ERR_TRANSPORT;
    }
    cs->stats.write_seconds = job->write_seconds;
    cs->stats.write_bytes = job->files[0].bytes + job->files[1].bytes;
    if (final == MFSDP_OK) {
        cs->stats.commits++;
        cs->stats.step = job->meta.step;
    } else if (mine.status == MFSDP_OK) {
        MFSDP_WARN("checkpoint %s/%s: not committed: %s (the failing rank said why)", job->root,
                   job->name, mfsdp_status_string((mfsdp_status_t) final));
    }
    job_free(job);
    cs->job = NULL;
    return (mfsdp_status_t) final;
}

void mfsdp_ckpt_ctx_release(struct mfsdp_ctx *ctx)
{
    if (ctx == NULL || ctx->ckpt == NULL) {
        return;
    }
    mfsdp_status_t st = job_finish(ctx);
    if (st != MFSDP_OK) {
        MFSDP_WARN("checkpoint: the last save failed (%s); reported at context destruction",
                   mfsdp_status_string(st));
    }
    free(ctx->ckpt);
    ctx->ckpt = NULL;
}

/* ---- save ------------------------------------------------------------------------------- */

static mfsdp_status_t precheck(const struct mfsdp_ctx *ctx)
{
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        const mfsdp_group_state_t *gst = &ctx->groups[g];
        const char *name = ctx->manifest->groups[g].name;
        if (!gst->initialized) {
            MFSDP_WARN("checkpoint: group %s has no weights yet (save after its first "
                       "all-gather, or load first)",
                       name);
            return MFSDP_ERR_STATE;
        }
        if (gst->micro != 0) {
            MFSDP_WARN("checkpoint: group %s has %d of %d micro-steps accumulated; save at an "
                       "optimizer-step boundary",
                       name, gst->micro, ctx->accum);
            return MFSDP_ERR_STATE;
        }
    }
    return MFSDP_OK;
}

/* tsteps: every tensor's optimizer step count, the same on every rank (tensor_steps). */
static mfsdp_status_t meta_of(const struct mfsdp_ctx *ctx, const uint64_t *tsteps,
                              mfsdp_ckpt_meta_t *meta)
{
    memset(meta, 0, sizeof(*meta));
    meta->ngroups = ctx->manifest->ngroups;
    meta->group_nsteps = calloc(meta->ngroups + 1, sizeof(int64_t));
    meta->tensor_nsteps = calloc(ctx->plan->nshards + 1, sizeof(int64_t));
    if (meta->group_nsteps == NULL || meta->tensor_nsteps == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        meta->tensor_nsteps[i] = (int64_t)tsteps[i];
    }
    for (size_t g = 0; g < meta->ngroups; g++) {
        meta->group_nsteps[g] = ctx->groups[g].nsteps;
        meta->step = ctx->groups[g].nsteps > meta->step ? ctx->groups[g].nsteps : meta->step;
    }
    meta->ctx_steps = ctx->steps;
    meta->tail = ctx->plan->tail;
    meta->hp = ctx->hp;
    return MFSDP_OK;
}

/* Every tensor's optimizer step count on every rank (collective): only a tensor's owner
 * counts its steps (every rank, for a sharded tail), so the maximum over ranks is it. */
static mfsdp_status_t tensor_steps(struct mfsdp_ctx *ctx, uint64_t *tsteps)
{
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        int own = ctx->plan->shards[i].owner == ctx->rank ||
                  ctx->plan->shards[i].owner == MFSDP_OWNER_SHARDED;
        tsteps[i] = own ? (uint64_t)ctx->shard_steps[i] : 0;
    }
    return ctx->tp->ops->allreduce_u64(ctx->tp, tsteps, ctx->plan->nshards, 1);
}

/* The job of this rank: layout, items, snapshot buffer (allocated, not yet filled). */
static mfsdp_status_t job_prepare(struct mfsdp_ctx *ctx, const char *root, const uint64_t *tsteps,
                                  ckpt_job_t **job_p)
{
    ckpt_job_t *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&job->mu, NULL);
    pthread_cond_init(&job->cv, NULL);
    job->rank = ctx->rank;
    job->world = ctx->world;
    mfsdp_status_t st = MFSDP_OK;
    job->root = strdup(root);
    if (job->root == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    MFSDP_CHECK_GOTO(meta_of(ctx, tsteps, &job->meta), st, err);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_ctx_layout(ctx, &job->lay), st, err);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_rank_items(job->lay, ctx->rank, &job->items, &job->nitems), st,
                     err);
    size_t total = 0;
    for (size_t i = 0; i < job->nitems; i++) {
        size_t start = (total + ALIGN - 1) & ~(size_t)(ALIGN - 1);
        if (start < total || mfsdp_add_overflow(start, (size_t)job->items[i].bytes, &total)) {
            st = MFSDP_ERR_OVERFLOW;
            goto err;
        }
    }
    job->data = calloc(job->nitems + 1, sizeof(*job->data));
    if (job->data == NULL || snap_alloc(job, total) != MFSDP_OK) {
        MFSDP_WARN("checkpoint: cannot allocate the %zu-byte snapshot on rank %d", total,
                   ctx->rank);
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    total = 0;
    for (size_t i = 0; i < job->nitems; i++) {
        total = (total + ALIGN - 1) & ~(size_t)(ALIGN - 1);
        job->data[i] = job->snap + total;
        total += (size_t)job->items[i].bytes;
    }
    job->given = ctx->rank == 0 ? calloc(2 * (size_t)ctx->world, sizeof(*job->given)) : NULL;
    if (ctx->rank == 0 && job->given == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto err;
    }
    *job_p = job;
    return MFSDP_OK;
err:
    job_free(job);
    return st;
}

/* Copy the owned bytes; returns the bytes copied. */
static mfsdp_status_t snapshot(struct mfsdp_ctx *ctx, ckpt_job_t *job, uint64_t *bytes_p)
{
    uint64_t bytes = 0;
    for (size_t i = 0; i < job->nitems; i++) {
        const mfsdp_ckpt_item_t *it = &job->items[i];
        if (it->state == MFSDP_CKPT_WEIGHT && job->lay->owner[it->tensor] < 0) {
            continue; /* a sharded-tail weight: gathered */
        }
        const void *src = mfsdp_ctx_slot(ctx, it->tensor, cat_of(it->state));
        if (src == NULL && it->bytes != 0) {
            MFSDP_WARN("checkpoint: %s has no %s on rank %d (plan and arena disagree)", it->key,
                       mfsdp_ckpt_state_name(it->state), ctx->rank);
            return MFSDP_ERR_INTERNAL;
        }
        memcpy((void *)job->data[i], src, (size_t)it->bytes);
        bytes += it->bytes;
    }
    *bytes_p = bytes;
    return MFSDP_OK;
}

/* Each sharded-tail weight whole onto its writer: one point-to-point batch. */
static mfsdp_status_t gather_tails(struct mfsdp_ctx *ctx, ckpt_job_t *job, uint64_t *bytes_p)
{
    const mfsdp_ckpt_layout_t *lay = job->lay;
    size_t cap = 16, nv = 0;
    mfsdp_p2p_t *v = malloc(cap * sizeof(*v));
    if (v == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mfsdp_status_t st = MFSDP_OK;
    for (size_t t = 0; t < lay->ntensors; t++) {
        if (lay->owner[t] != MFSDP_OWNER_SHARDED) {
            continue;
        }
        int w = lay->writer[t];
        char *dst = NULL;
        for (size_t i = 0; i < job->nitems && w == ctx->rank; i++) {
            if (job->items[i].tensor == t && job->items[i].state == MFSDP_CKPT_WEIGHT) {
                dst = (char *)job->data[i];
            }
        }
        if (w == ctx->rank && dst == NULL) {
            st = MFSDP_ERR_INTERNAL;
            goto out;
        }
        size_t rb = (size_t)lay->rest[t] * mfsdp_dtype_size(lay->params[t]->dtype);
        char *mine = mfsdp_ctx_slot(ctx, t, MFSDP_ARENA_COMM);
        for (int q = 0; q < ctx->world; q++) {
            int64_t a = (int64_t)q * lay->c[t];
            int64_t b = a + lay->c[t] < lay->rows[t] ? a + lay->c[t] : lay->rows[t];
            if (a >= b || (q != ctx->rank && w != ctx->rank)) {
                continue;
            }
            size_t len = (size_t)(b - a) * rb;
            if (q == ctx->rank && w == ctx->rank) {
                memcpy(dst + (size_t)a * rb, mine, len);
                *bytes_p += len;
                continue;
            }
            for (size_t off = 0; off < len; off += MAX_MSG) {
                if (nv == cap) {
                    mfsdp_p2p_t *nvp = realloc(v, 2 * cap * sizeof(*v));
                    if (nvp == NULL) {
                        st = MFSDP_ERR_NO_MEMORY;
                        goto out;
                    }
                    v = nvp;
                    cap *= 2;
                }
                size_t l = len - off < MAX_MSG ? len - off : MAX_MSG;
                if (q == ctx->rank) {
                    v[nv++] = (mfsdp_p2p_t){1, w, TAG_TAIL, mine + off, l};
                } else {
                    v[nv++] = (mfsdp_p2p_t){0, q, TAG_TAIL, dst + (size_t)a * rb + off, l};
                    *bytes_p += l;
                }
            }
        }
    }
    st = ctx->tp->ops->p2p(ctx->tp, v, nv);
out:
    free(v);
    return st;
}

typedef struct begin_msg {
    int32_t status;
    char name[MFSDP_CKPT_NAME_LEN];
} begin_msg_t;

mfsdp_status_t mfsdp_ctx_save(mfsdp_ctx_h ctx, const char *dir)
{
    MFSDP_CHECK(ctx_check(ctx));
    if (dir == NULL || dir[0] == '\0') {
        MFSDP_WARN("checkpoint: no directory given");
        return MFSDP_ERR_INVALID_ARG;
    }
    MFSDP_CHECK(tail_check(ctx));
    struct mfsdp_ckpt_ctx *cs = state_of(ctx);
    uint64_t *tsteps = calloc(ctx->plan->nshards + 1, sizeof(uint64_t));
    mfsdp_status_t st = agree(ctx, cs != NULL && tsteps != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY);
    if (st != MFSDP_OK) {
        free(tsteps);
        return st;
    }
    double tw = now();
    st = job_finish(ctx); /* the previous save: its error is reported here */
    cs->stats.wait_seconds = now() - tw;
    /* The pending lazy step, when it is one: every group that trains has completed its
     * window. Otherwise nothing is stepped (precheck refuses a save inside a window): stepping
     * the complete groups alone would leave a state an uninterrupted run never reaches. */
    if (st == MFSDP_OK && (ctx->mode != MFSDP_STEP_LAZY || mfsdp_ctx_lazy_ready(ctx))) {
        st = mfsdp_ctx_flush(ctx);
    }
    if (st == MFSDP_OK) {
        st = tensor_steps(ctx, tsteps); /* before any rank may stop: it is collective */
    }
    if (st != MFSDP_OK) {
        free(tsteps);
        return st;
    }
    double t0 = now();
    ckpt_job_t *job = NULL;
    st = precheck(ctx);
    if (st == MFSDP_OK) {
        st = job_prepare(ctx, dir, tsteps, &job);
    }
    free(tsteps);
    begin_msg_t msg;
    memset(&msg, 0, sizeof(msg));
    if (ctx->rank == 0 && st == MFSDP_OK) {
        st = mfsdp_ckpt_begin(dir, job->meta.step, msg.name, sizeof(msg.name), NULL, 0);
    }
    /* Agree on the preparation; rank 0 also hands out the checkpoint's name. */
    int32_t mine = (int32_t)st;
    msg.status = mine;
    if (collect0(ctx, &mine, sizeof(mine), min_status, &msg.status) != MFSDP_OK) {
        msg.status = MFSDP_ERR_TRANSPORT;
    }
    if (ctx->rank == 0 && msg.status != MFSDP_OK && st == MFSDP_OK) {
        char *p = mfsdp_ckpt_partial_path(dir, msg.name);
        if (p != NULL) {
            rmdir(p); /* empty: nobody wrote into it */
            free(p);
        }
    }
    if (bcast0(ctx, &msg, sizeof(msg)) != MFSDP_OK) {
        msg.status = MFSDP_ERR_TRANSPORT;
    }
    if (msg.status != MFSDP_OK) {
        if (st == MFSDP_OK) {
            MFSDP_WARN("checkpoint: save to %s failed on another rank (%s)", dir,
                       mfsdp_status_string((mfsdp_status_t)msg.status));
        }
        job_free(job);
        return (mfsdp_status_t)msg.status;
    }
    msg.name[sizeof(msg.name) - 1] = '\0';
    memcpy(job->name, msg.name, sizeof(job->name));
    job->partial = mfsdp_ckpt_partial_path(dir, job->name);
    hit("save:begun", job->name);

    uint64_t bytes = 0;
    st = job->partial != NULL ? snapshot(ctx, job, &bytes) : MFSDP_ERR_NO_MEMORY;
    mfsdp_status_t gs = gather_tails(ctx, job, &bytes); /* collective: always take part */
    st = agree(ctx, st != MFSDP_OK ? st : gs);
    if (st != MFSDP_OK) {
        job_free(job);
        return st;
    }
    hit("save:snapshot", job->name);
    cs->stats.saves++;
    cs->stats.stall_seconds = now() - t0;
    cs->stats.total_stall_seconds += cs->stats.stall_seconds;
    if (cs->stats.stall_seconds > cs->stats.max_stall_seconds) {
        cs->stats.max_stall_seconds = cs->stats.stall_seconds;
    }
    cs->stats.snapshot_bytes = bytes;
    cs->job = job;
    if (pthread_create(&job->th, NULL, writer_main, job) == 0) {
        job->started = 1;
    } else {
        MFSDP_WARN("checkpoint: cannot start the writer thread; writing in the caller");
        write_part(job);
        if (job->rank != 0 || job->write_st != MFSDP_OK) {
            finish(job, job->write_st);
        }
    }
    MFSDP_INFO(CKPT, "rank %d: save of %s/%s started: %llu bytes copied in %.3f s", ctx->rank, dir,
               job->name, (unsigned long long)bytes, cs->stats.stall_seconds);
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ctx_save_wait(mfsdp_ctx_h ctx)
{
    MFSDP_CHECK(ctx_check(ctx));
    return job_finish(ctx);
}

mfsdp_status_t mfsdp_ctx_get_ckpt_stats(mfsdp_ctx_h ctx, mfsdp_ckpt_stats_t *stats_p)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(stats_p != NULL);
    if (ctx->ckpt == NULL) {
        memset(stats_p, 0, sizeof(*stats_p));
        stats_p->step = -1;
    } else {
        *stats_p = ctx->ckpt->stats;
    }
    return MFSDP_OK;
}

/* ---- load ------------------------------------------------------------------------------- */

static void shape_text(char *buf, size_t len, const mfsdp_param_desc_t *p)
{
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < p->ndim && o < len; d++) {
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)p->shape[d]);
    }
    if (o < len) {
        snprintf(buf + o, len - o, "]");
    }
}

/* The checkpoint's groups and params must be this job's (hyper-parameters may differ). */
static mfsdp_status_t match_manifest(const mfsdp_manifest_t *m, const mfsdp_manifest_t *c,
                                     const char *dir)
{
    if (m->ngroups != c->ngroups) {
        MFSDP_WARN("checkpoint %s holds %zu param groups, this job's manifest %zu", dir, c->ngroups,
                   m->ngroups);
        return MFSDP_ERR_MISMATCH;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *a = &m->groups[g], *b = &c->groups[g];
        if (strcmp(a->name, b->name) != 0 || a->nparams != b->nparams) {
            MFSDP_WARN("checkpoint %s: group %zu is '%s' with %zu params, this job's is '%s' with "
                       "%zu",
                       dir, g, b->name, b->nparams, a->name, a->nparams);
            return MFSDP_ERR_MISMATCH;
        }
        for (size_t i = 0; i < a->nparams; i++) {
            const mfsdp_param_desc_t *p = &a->params[i], *q = &b->params[i];
            char sa[128], sb[128];
            shape_text(sa, sizeof(sa), p);
            shape_text(sb, sizeof(sb), q);
            if (strcmp(p->name, q->name) != 0) {
                MFSDP_WARN("checkpoint %s: param %zu of group %s is '%s', this job's is '%s'", dir,
                           i, a->name, q->name, p->name);
                return MFSDP_ERR_MISMATCH;
            }
            if (strcmp(sa, sb) != 0) {
                MFSDP_WARN("checkpoint %s: tensor '%s': shape %s in the checkpoint, %s in this "
                           "job's manifest",
                           dir, p->name, sb, sa);
                return MFSDP_ERR_MISMATCH;
            }
            if (p->dtype != q->dtype || p->optimizer != q->optimizer ||
                p->requires_grad != q->requires_grad) {
                MFSDP_WARN("checkpoint %s: tensor '%s': %s/%s/%s in the checkpoint, %s/%s/%s in "
                           "this job's manifest (dtype/optimizer/requires_grad)",
                           dir, p->name, mfsdp_dtype_name(q->dtype),
                           q->optimizer == MFSDP_ROLE_MUON ? "muon" : "adamw",
                           q->requires_grad ? "true" : "false", mfsdp_dtype_name(p->dtype),
                           p->optimizer == MFSDP_ROLE_MUON ? "muon" : "adamw",
                           p->requires_grad ? "true" : "false");
                return MFSDP_ERR_MISMATCH;
            }
        }
    }
    return MFSDP_OK;
}

/* Rows of tensor shard held here: all for an owner, the slice for a sharded tensor. */
static void local_rows(const struct mfsdp_ctx *ctx, size_t shard, int64_t *a, int64_t *b)
{
    const mfsdp_shard_t *sh = &ctx->plan->shards[shard];
    if (sh->owner != MFSDP_OWNER_SHARDED) {
        *a = 0;
        *b = sh->rows;
        return;
    }
    *a = (int64_t)ctx->rank * sh->fsdp_c;
    *b = *a + sh->fsdp_c < sh->rows ? *a + sh->fsdp_c : sh->rows;
    if (*a > *b) {
        *a = *b;
    }
}

static size_t cat_elt(const struct mfsdp_ctx *ctx, size_t shard, mfsdp_arena_cat_t cat)
{
    const mfsdp_shard_t *sh = &ctx->plan->shards[shard];
    return cat == MFSDP_ARENA_COMM
               ? mfsdp_dtype_size(ctx->manifest->groups[sh->group].params[sh->param].dtype)
               : sizeof(float);
}

/* Zero category cat of shard from element `from` on (the padding rows, or all of it). */
static void zero_from(const struct mfsdp_ctx *ctx, size_t shard, mfsdp_arena_cat_t cat, size_t from)
{
    char *p = mfsdp_ctx_slot(ctx, shard, cat);
    size_t elems = ctx->slots[shard].elems;
    if (p != NULL && from < elems) {
        size_t elt = cat_elt(ctx, shard, cat);
        memset(p + from * elt, 0, (elems - from) * elt);
    }
}

/* Back to a fresh context: no weights, zero state and counters. */
static void reset_ctx(struct mfsdp_ctx *ctx)
{
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        for (int c = 0; c < MFSDP_ARENA_NCAT; c++) {
            zero_from(ctx, i, (mfsdp_arena_cat_t)c, 0);
        }
    }
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        ctx->groups[g].initialized = 0;
        ctx->groups[g].nsteps = 0;
        ctx->groups[g].micro = 0;
    }
    memset(ctx->seen, 0, ctx->plan->nshards);
    memset(ctx->shard_steps, 0, ctx->plan->nshards * sizeof(*ctx->shard_steps));
    ctx->steps = 0;
}

static mfsdp_status_t load_ckpt_local(struct mfsdp_ctx *ctx, mfsdp_ckpt_reader_t *r)
{
    MFSDP_CHECK(mfsdp_ctx_comm_write(ctx));
    const mfsdp_ckpt_layout_t *lay = r->index->layout;
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        if (ctx->slots[i].elems == 0) {
            continue;
        }
        int64_t a, b;
        local_rows(ctx, i, &a, &b);
        size_t valid = (size_t)(b - a) * (size_t)lay->rest[i];
        for (int s = 0; s < MFSDP_CKPT_NSTATES; s++) {
            mfsdp_arena_cat_t cat = cat_of((mfsdp_ckpt_state_t)s);
            void *dst = mfsdp_ctx_slot(ctx, i, cat);
            if (dst == NULL) {
                continue;
            }
            if (s == MFSDP_CKPT_MASTER && !mfsdp_ckpt_has_state(lay, i, MFSDP_CKPT_MASTER)) {
                /* A float32 param: the stored weight is the master, bit for bit. */
                memcpy(dst, mfsdp_ctx_slot(ctx, i, MFSDP_ARENA_COMM), valid * sizeof(float));
            } else if (s == MFSDP_CKPT_WEIGHT || s == MFSDP_CKPT_MASTER ||
                       mfsdp_ckpt_has_state(lay, i, (mfsdp_ckpt_state_t)s)) {
                MFSDP_CHECK(mfsdp_ckpt_read_rows(r, i, (mfsdp_ckpt_state_t)s, a, b, dst, NULL, 0));
            }
            zero_from(ctx, i, cat, valid);
        }
        if (ctx->groups[ctx->plan->shards[i].group].micro != 0) {
            /* gradients of an open window; at a step boundary they are zero already (the
             * step clears them, a fresh arena is zero), and touching them would only fault
             * in pages */
            zero_from(ctx, i, MFSDP_ARENA_GRAD, 0);
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t load_full_local(struct mfsdp_ctx *ctx, mfsdp_st_file_t *f)
{
    MFSDP_CHECK(mfsdp_ctx_comm_write(ctx));
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        if (ctx->slots[i].elems == 0) {
            continue;
        }
        const mfsdp_shard_t *sh = &ctx->plan->shards[i];
        const mfsdp_param_desc_t *p = &ctx->manifest->groups[sh->group].params[sh->param];
        const mfsdp_st_tensor_t *t = mfsdp_st_find(f->hdr, p->name);
        if (t == NULL) {
            MFSDP_WARN("%s: tensor '%s' of this job's manifest is missing", f->path, p->name);
            return MFSDP_ERR_NOT_FOUND;
        }
        int same = t->ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) {
            same = t->shape[d] == p->shape[d];
        }
        if (!same) {
            char s[128];
            shape_text(s, sizeof(s), p);
            MFSDP_WARN("%s: tensor '%s': shape differs from this job's %s", f->path, p->name, s);
            return MFSDP_ERR_MISMATCH;
        }
        mfsdp_dtype_t fdt;
        if (mfsdp_st_dtype_to(t->dtype, &fdt) != MFSDP_OK) {
            MFSDP_WARN("%s: tensor '%s': dtype %s; weights must be F32, BF16 or F16", f->path,
                       p->name, mfsdp_st_dtype_name(t->dtype));
            return MFSDP_ERR_UNSUPPORTED;
        }
        int64_t a, b;
        local_rows(ctx, i, &a, &b);
        size_t rest = (size_t)sh->cols;
        size_t valid = (size_t)(b - a) * rest;
        size_t fel = mfsdp_dtype_size(fdt);
        float *master = mfsdp_ctx_slot(ctx, i, MFSDP_ARENA_MASTER);
        void *comm = mfsdp_ctx_slot(ctx, i, MFSDP_ARENA_COMM);
        uint64_t off = (uint64_t)a * rest * fel;
        if (fdt == MFSDP_FLOAT32) {
            MFSDP_CHECK(mfsdp_st_read(f, t, off, valid * fel, master, NULL, 0));
            MFSDP_CHECK(mfsdp_cpu_cast(comm, p->dtype, master, MFSDP_FLOAT32, valid));
        } else if (fdt == p->dtype) {
            MFSDP_CHECK(mfsdp_st_read(f, t, off, valid * fel, comm, NULL, 0));
            MFSDP_CHECK(mfsdp_cpu_cast(master, MFSDP_FLOAT32, comm, p->dtype, valid));
        } else {
            void *tmp = malloc(valid * fel + 1);
            if (tmp == NULL) {
                return MFSDP_ERR_NO_MEMORY;
            }
            mfsdp_status_t st = mfsdp_st_read(f, t, off, valid * fel, tmp, NULL, 0);
            if (st == MFSDP_OK) {
                st = mfsdp_cpu_cast(master, MFSDP_FLOAT32, tmp, fdt, valid);
            }
            free(tmp);
            MFSDP_CHECK(st);
            MFSDP_CHECK(mfsdp_cpu_cast(comm, p->dtype, master, MFSDP_FLOAT32, valid));
        }
        zero_from(ctx, i, MFSDP_ARENA_MASTER, valid);
        zero_from(ctx, i, MFSDP_ARENA_COMM, valid);
        for (int c = MFSDP_ARENA_GRAD; c < MFSDP_ARENA_NCAT; c++) {
            if (c != MFSDP_ARENA_GRAD || ctx->groups[sh->group].micro != 0) {
                zero_from(ctx, i, (mfsdp_arena_cat_t)c, 0);
            }
        }
    }
    return MFSDP_OK;
}

/* Every rank agrees, then applies the counters or resets. */
static mfsdp_status_t load_finish(struct mfsdp_ctx *ctx, mfsdp_status_t st,
                                  const mfsdp_ckpt_meta_t *meta, const char *path, double t0,
                                  uint64_t bytes, uint64_t verified)
{
    st = agree(ctx, st);
    struct mfsdp_ckpt_ctx *cs = ctx->ckpt;
    if (st != MFSDP_OK) {
        reset_ctx(ctx);
        MFSDP_WARN("checkpoint: load of %s failed (%s); the context is reset to its fresh state",
                   path, mfsdp_status_string(st));
        return st;
    }
    for (size_t g = 0; g < ctx->manifest->ngroups; g++) {
        ctx->groups[g].initialized = 1;
        ctx->groups[g].micro = 0;
        ctx->groups[g].nsteps = meta != NULL ? meta->group_nsteps[g] : 0;
    }
    memset(ctx->seen, 0, ctx->plan->nshards);
    for (size_t i = 0; i < ctx->plan->nshards; i++) {
        const mfsdp_shard_t *sh = &ctx->plan->shards[i];
        ctx->shard_steps[i] = meta == NULL                  ? 0
                              : meta->tensor_nsteps != NULL ? meta->tensor_nsteps[i]
                                                            : meta->group_nsteps[sh->group];
    }
    ctx->steps = meta != NULL ? meta->ctx_steps : 0;
    cs->stats.loads++;
    cs->stats.step = meta != NULL ? meta->step : 0;
    cs->stats.load_seconds = now() - t0;
    cs->stats.load_bytes = bytes;
    cs->stats.verify_bytes = verified;
    MFSDP_INFO(CKPT, "rank %d: loaded %s (step %lld): %llu bytes read, %llu verified in %.3f s",
               ctx->rank, path, (long long)cs->stats.step, (unsigned long long)bytes,
               (unsigned long long)verified, cs->stats.load_seconds);
    return MFSDP_OK;
}

static mfsdp_status_t load_full(struct mfsdp_ctx *ctx, const char *path, double t0)
{
    mfsdp_st_file_t *f = NULL;
    uint64_t bytes = 0;
    mfsdp_status_t st = mfsdp_st_open(path, NULL, 0, &f);
    if (st == MFSDP_OK) {
        st = load_full_local(ctx, f);
        for (size_t i = 0; i < ctx->plan->nshards && st == MFSDP_OK; i++) {
            int64_t a, b;
            local_rows(ctx, i, &a, &b);
            if (ctx->slots[i].elems != 0) {
                const mfsdp_st_tensor_t *t =
                    mfsdp_st_find(f->hdr, ctx->manifest->groups[ctx->plan->shards[i].group]
                                              .params[ctx->plan->shards[i].param]
                                              .name);
                bytes += (uint64_t)(b - a) * (uint64_t)ctx->plan->shards[i].cols *
                         mfsdp_st_dtype_size(t->dtype);
            }
        }
    }
    mfsdp_st_close(f);
    return load_finish(ctx, st, NULL, path, t0, bytes, 0);
}

mfsdp_status_t mfsdp_ctx_load_full(mfsdp_ctx_h ctx, const char *path)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(path != NULL);
    MFSDP_CHECK(tail_check(ctx));
    struct mfsdp_ckpt_ctx *cs = state_of(ctx);
    MFSDP_CHECK(agree(ctx, cs != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY));
    MFSDP_CHECK(job_finish(ctx));
    return load_full(ctx, path, now());
}

mfsdp_status_t mfsdp_ctx_load(mfsdp_ctx_h ctx, const char *path)
{
    MFSDP_CHECK(ctx_check(ctx));
    MFSDP_CHECK_ARG(path != NULL);
    MFSDP_CHECK(tail_check(ctx));
    struct mfsdp_ckpt_ctx *cs = state_of(ctx);
    MFSDP_CHECK(agree(ctx, cs != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY));
    MFSDP_CHECK(job_finish(ctx));
    double t0 = now();
    /* A file is a full export; a directory a checkpoint. Rank 0 decides for everyone, so
     * that a filesystem that answers differently on some rank cannot split the ranks. */
    int32_t is_file = 0;
    if (ctx->rank == 0) {
        struct stat sb;
        is_file = stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
    }
    if (bcast0(ctx, &is_file, sizeof(is_file)) != MFSDP_OK) {
        return MFSDP_ERR_TRANSPORT;
    }
    if (is_file) {
        return load_full(ctx, path, t0);
    }
    mfsdp_ckpt_reader_t *r = NULL;
    uint64_t verified = 0, bytes = 0;
    mfsdp_ckpt_meta_t meta;
    memset(&meta, 0, sizeof(meta));
    mfsdp_status_t st = mfsdp_ckpt_reader_open(path, NULL, 0, &r);
    if (st == MFSDP_OK) {
        st = match_manifest(ctx->manifest, r->index->manifest, r->dir);
    }
    for (size_t f = (size_t)ctx->rank; st == MFSDP_OK && r != NULL && f < r->index->nfiles;
         f += (size_t)ctx->world) {
        st = mfsdp_ckpt_verify_file(r, f, 1, NULL, 0);
        verified += r->index->files[f].bytes;
    }
    if (st == MFSDP_OK) {
        st = load_ckpt_local(ctx, r);
        bytes = r->bytes_read;
    }
    if (st == MFSDP_OK) {
        meta = r->index->meta; /* borrowed until the reader closes */
    }
    st = load_finish(ctx, st, st == MFSDP_OK ? &meta : NULL, path, t0, bytes, verified);
    mfsdp_ckpt_reader_close(r);
    return st;
}

int mfsdp_ckpt_ctx_boundary(const struct mfsdp_ctx *ctx, int equal, int64_t *step_p)
{
    int64_t step = 0, lo = INT64_MAX;
    int ok = ctx != NULL && ctx->magic == MFSDP_CTX_MAGIC;
    for (size_t g = 0; ok && g < ctx->manifest->ngroups; g++) {
        const mfsdp_group_state_t *gst = &ctx->groups[g];
        ok = gst->initialized && gst->micro == 0;
        step = gst->nsteps > step ? gst->nsteps : step;
        if (gst->gs->layout->rs.nentries != 0) {
            lo = gst->nsteps < lo ? gst->nsteps : lo;
        }
    }
    if (ok && equal && lo != INT64_MAX && lo != step) {
        ok = 0;
    }
    if (step_p != NULL) {
        *step_p = step;
    }
    return ok;
}

mfsdp_status_t mfsdp_ckpt_ctx_supported(const struct mfsdp_ctx *ctx)
{
    return tail_check(ctx);
}

int mfsdp_ckpt_ctx_replica(const struct mfsdp_ctx *ctx)
{
    return ctx != NULL && ctx->rtp != NULL ? ctx->rtp->rank : -1;
}
