/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Offline checkpoint operations (mfsdp/checkpoint.h; tools/mfsdp-ckpt): verify, export to
 * one full file, reshard to another world size, import full weights. Single process, no
 * communicator. Every conversion first verifies the source (checksums and headers), so that
 * damaged data is never carried into a new file.
 */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"
#include "core/ckpt_io.h"
#include "mfsdp/checkpoint.h"
#include "mfsdp/kernels.h"

/* Make sure err holds a message after a failure whose callee logged but wrote none. */
static mfsdp_status_t note(char *err, size_t errlen, mfsdp_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static mfsdp_status_t note(char *err, size_t errlen, mfsdp_status_t st, const char *fmt, ...)
{
    if (st != MFSDP_OK && err != NULL && errlen > 0 && err[0] == '\0') {
        char msg[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        snprintf(err, errlen, "%s: %s", msg, mfsdp_status_string(st));
    }
    return st;
}

static void clear(char *err, size_t errlen)
{
    if (err != NULL && errlen > 0) {
        err[0] = '\0';
    }
}

static mfsdp_status_t verify_all(mfsdp_ckpt_reader_t *r, char *err, size_t errlen)
{
    for (size_t f = 0; f < r->index->nfiles; f++) {
        MFSDP_CHECK(mfsdp_ckpt_verify_file(r, f, 1, err, errlen));
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ckpt_verify(const char *path, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(path != NULL);
    clear(err, errlen);
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_status_t st = mfsdp_ckpt_reader_open(path, err, errlen, &r);
    if (st == MFSDP_OK) {
        st = verify_all(r, err, errlen);
    }
    mfsdp_ckpt_reader_close(r);
    return note(err, errlen, st, "%s: verification failed", path);
}

/* fsync the directory holding path. */
static mfsdp_status_t sync_parent(const char *path)
{
    char *d = strdup(path);
    if (d == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    char *slash = strrchr(d, '/');
    if (slash == NULL) {
        strcpy(d, ".");
    } else if (slash == d) {
        d[1] = '\0';
    } else {
        *slash = '\0';
    }
    mfsdp_status_t st = mfsdp_ckpt_fsync_dir(d);
    free(d);
    return st;
}

/* ---- export ------------------------------------------------------------------------------ */

typedef struct export_src {
    mfsdp_ckpt_reader_t *r;
    mfsdp_ckpt_state_t state;
} export_src_t;

static mfsdp_status_t export_fill(void *arg, size_t entry, uint64_t off, void *buf, size_t len)
{
    export_src_t *s = arg;
    return mfsdp_ckpt_read_range(s->r, entry, s->state, off, len, buf, NULL, 0);
}

/* Whether file path would lie in directory dir (both resolved: links, "..", "."). */
static int inside_dir(const char *path, const char *dir)
{
    char *copy = strdup(path);
    if (copy == NULL) {
        return 0;
    }
    char *slash = strrchr(copy, '/');
    const char *parent = slash == NULL ? "." : slash == copy ? "/" : (*slash = '\0', copy);
    char a[PATH_MAX], b[PATH_MAX];
    int in = realpath(parent, a) != NULL && realpath(dir, b) != NULL && strcmp(a, b) == 0;
    free(copy);
    return in;
}

mfsdp_status_t mfsdp_ckpt_export_full(const char *path, const char *out, int fp32, char *err,
                                      size_t errlen)
{
    MFSDP_CHECK_ARG(path != NULL && out != NULL);
    clear(err, errlen);
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_st_entry_t *e = NULL;
    mfsdp_status_t st;
    MFSDP_CHECK_GOTO(mfsdp_ckpt_reader_open(path, err, errlen, &r), st, out);
    MFSDP_CHECK_GOTO(verify_all(r, err, errlen), st, out);
    if (inside_dir(out, r->dir)) {
        /* Its rename would replace a file of the checkpoint being read (a rank's optimizer
         * state, the index): the source would be lost. */
        st = MFSDP_ERR_INVALID_ARG;
        note(err, errlen, st, "%s is inside the checkpoint %s it exports", out, r->dir);
        goto out;
    }
    const mfsdp_ckpt_layout_t *lay = r->index->layout;
    e = calloc(lay->ntensors + 1, sizeof(*e));
    if (e == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t t = 0; t < lay->ntensors; t++) {
        const mfsdp_param_desc_t *p = lay->params[t];
        e[t].name = p->name;
        e[t].dtype = fp32 ? MFSDP_ST_F32 : mfsdp_ckpt_state_dtype(lay, t, MFSDP_CKPT_WEIGHT);
        e[t].ndim = p->ndim;
        memcpy(e[t].shape, p->shape, sizeof(p->shape));
        e[t].bytes = (uint64_t)p->numel * mfsdp_st_dtype_size(e[t].dtype);
    }
    char step[32];
    snprintf(step, sizeof(step), "%lld", (long long)r->index->meta.step);
    const char *mk[] = {"format", "mfsdp.format", "mfsdp.dtype", "mfsdp.step", "mfsdp.source"};
    const char *mv[] = {"pt", MFSDP_CKPT_FULL_FORMAT, fp32 ? "float32" : "param", step,
                        r->index->index_sha256};
    export_src_t src = {r, fp32 ? MFSDP_CKPT_MASTER : MFSDP_CKPT_WEIGHT};
    mfsdp_st_write_opts_t wo = {
        .fill = export_fill, .fill_arg = &src, .err = err, .errlen = errlen};
    char hex[MFSDP_SHA256_HEX];
    uint64_t bytes = 0;
    MFSDP_CHECK_GOTO(mfsdp_st_write(out, e, lay->ntensors, mk, mv, 5, &wo, hex, &bytes), st, out);
    MFSDP_CHECK_GOTO(sync_parent(out), st, out);
    MFSDP_INFO(CKPT, "exported %s to %s (%zu tensors, %llu bytes, %s)", r->dir, out, lay->ntensors,
               (unsigned long long)bytes, fp32 ? "fp32 masters" : "param dtype");
out:
    free(e);
    mfsdp_ckpt_reader_close(r);
    return note(err, errlen, st, "export of %s to %s failed", path, out);
}

/* ---- writing a whole checkpoint offline --------------------------------------------------- */

typedef struct rank_src {
    const mfsdp_ckpt_item_t *items;
    /* reshard: the old checkpoint */
    mfsdp_ckpt_reader_t *r;
    /* import: a full file */
    mfsdp_st_file_t *f;
    const mfsdp_ckpt_layout_t *lay;
} rank_src_t;

static uint64_t row_bytes(const mfsdp_ckpt_item_t *it, int64_t rest)
{
    return (uint64_t)rest * mfsdp_st_dtype_size(it->dtype);
}

static mfsdp_status_t reshard_fill(void *arg, size_t item, uint64_t off, void *buf, size_t len)
{
    rank_src_t *s = arg;
    const mfsdp_ckpt_item_t *it = &s->items[item];
    uint64_t base = (uint64_t)it->row_begin * row_bytes(it, s->lay->rest[it->tensor]);
    return mfsdp_ckpt_read_range(s->r, it->tensor, it->state, base + off, len, buf, NULL, 0);
}

static mfsdp_status_t import_fill(void *arg, size_t item, uint64_t off, void *buf, size_t len)
{
    rank_src_t *s = arg;
    const mfsdp_ckpt_item_t *it = &s->items[item];
    if (it->state != MFSDP_CKPT_WEIGHT && it->state != MFSDP_CKPT_MASTER) {
        memset(buf, 0, len); /* optimizer state starts at zero */
        return MFSDP_OK;
    }
    const mfsdp_param_desc_t *p = s->lay->params[it->tensor];
    const mfsdp_st_tensor_t *t = mfsdp_st_find(s->f->hdr, p->name);
    mfsdp_dtype_t in, outd;
    if (t == NULL || mfsdp_st_dtype_to(t->dtype, &in) != MFSDP_OK ||
        mfsdp_st_dtype_to(it->dtype, &outd) != MFSDP_OK) {
        return MFSDP_ERR_INTERNAL; /* checked before writing */
    }
    size_t oes = mfsdp_dtype_size(outd), ies = mfsdp_dtype_size(in);
    uint64_t e0 = (uint64_t)it->row_begin * (uint64_t)s->lay->rest[it->tensor] + off / oes;
    size_t n = len / oes;
    if (in == outd) {
        return mfsdp_st_read(s->f, t, e0 * ies, n * ies, buf, NULL, 0);
    }
    void *tmp = malloc(n * ies + 1);
    if (tmp == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mfsdp_status_t st = mfsdp_st_read(s->f, t, e0 * ies, n * ies, tmp, NULL, 0);
    if (st == MFSDP_OK) {
        st = mfsdp_cpu_cast(buf, outd, tmp, in, n);
    }
    free(tmp);
    return st;
}

/* Write a checkpoint of lay under root, every rank's files from fill. */
static mfsdp_status_t write_all_ranks(const char *root, const mfsdp_ckpt_layout_t *lay,
                                      const mfsdp_ckpt_meta_t *meta, mfsdp_st_fill_fn fill,
                                      rank_src_t *src, char *err, size_t errlen)
{
    char name[MFSDP_CKPT_NAME_LEN];
    MFSDP_CHECK(mfsdp_ckpt_begin(root, meta->step, name, sizeof(name), err, errlen));
    mfsdp_status_t st = MFSDP_OK;
    char *partial = mfsdp_ckpt_partial_path(root, name);
    mfsdp_ckpt_file_info_t *files = calloc(2 * (size_t)lay->world, sizeof(*files));
    char *text = NULL;
    size_t len = 0;
    if (partial == NULL || files == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (int q = 0; q < lay->world; q++) {
        mfsdp_ckpt_item_t *items = NULL;
        size_t n = 0;
        mfsdp_ckpt_file_info_t f2[2];
        MFSDP_CHECK_GOTO(mfsdp_ckpt_rank_items(lay, q, &items, &n), st, out);
        src->items = items;
        st = mfsdp_ckpt_write_rank(partial, lay, meta, q, items, n, NULL, fill, src, NULL, f2);
        mfsdp_ckpt_items_free(items, n);
        src->items = NULL;
        if (st != MFSDP_OK) {
            note(err, errlen, st, "%s: writing the files of rank %d failed", partial, q);
            goto out;
        }
        files[mfsdp_ckpt_file_slot(lay->world, MFSDP_CKPT_MODEL, q)] = f2[0];
        files[mfsdp_ckpt_file_slot(lay->world, MFSDP_CKPT_OPTIM, q)] = f2[1];
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_index_text(lay, meta, files, &text, &len), st, out);
    char hex[MFSDP_SHA256_HEX];
    memcpy(hex, text + strlen("{\"index_sha256\": \""), 64);
    hex[64] = '\0';
    MFSDP_CHECK_GOTO(mfsdp_ckpt_commit(root, name, text, len, hex, lay->world, NULL), st, out);
    MFSDP_INFO(CKPT, "wrote %s/%s for %d ranks", root, name, lay->world);
out:
    free(text);
    free(files);
    free(partial);
    return st;
}

mfsdp_status_t mfsdp_ckpt_reshard(const char *path, int world, const mfsdp_plan_opts_t *opts,
                                  const char *out_root, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(path != NULL && out_root != NULL && world >= 1);
    clear(err, errlen);
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_plan_t *plan = NULL;
    mfsdp_ckpt_layout_t *lay = NULL;
    mfsdp_ckpt_meta_t meta;
    memset(&meta, 0, sizeof(meta));
    mfsdp_status_t st;
    MFSDP_CHECK_GOTO(mfsdp_ckpt_reader_open(path, err, errlen, &r), st, out);
    MFSDP_CHECK_GOTO(verify_all(r, err, errlen), st, out);
    /* The stored manifest, re-planned: its world size no longer applies. */
    r->index->manifest->world_size = 0;
    mfsdp_plan_opts_t po;
    memset(&po, 0, sizeof(po));
    po.tail = r->index->meta.tail;
    if (opts != NULL) {
        po = *opts;
    }
    st = mfsdp_plan_create(r->index->manifest, world, &po, &plan);
    if (st != MFSDP_OK) {
        note(err, errlen, st, "planning %s at world size %d failed", path, world);
        goto out;
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_layout_of_plan(plan, &lay), st, out);
    meta = r->index->meta;
    meta.tensor_nsteps = NULL; /* both copied below: meta owns what it frees */
    meta.tail = plan->tail;
    meta.group_nsteps = calloc(meta.ngroups + 1, sizeof(int64_t));
    if (meta.group_nsteps == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    memcpy(meta.group_nsteps, r->index->meta.group_nsteps, meta.ngroups * sizeof(int64_t));
    meta.tensor_nsteps = calloc(lay->ntensors + 1, sizeof(int64_t));
    if (meta.tensor_nsteps == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    memcpy(meta.tensor_nsteps, r->index->meta.tensor_nsteps, lay->ntensors * sizeof(int64_t));
    rank_src_t src = {.r = r, .lay = lay};
    MFSDP_CHECK_GOTO(write_all_ranks(out_root, lay, &meta, reshard_fill, &src, err, errlen), st,
                     out);
out:
    mfsdp_ckpt_meta_clear(&meta);
    mfsdp_ckpt_layout_destroy(lay);
    mfsdp_plan_destroy(plan);
    mfsdp_ckpt_reader_close(r);
    return note(err, errlen, st, "reshard of %s to %d ranks in %s failed", path, world, out_root);
}

mfsdp_status_t mfsdp_ckpt_import_full(const char *in, const mfsdp_manifest_t *manifest, int world,
                                      const mfsdp_plan_opts_t *opts, const char *out_root,
                                      char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(in != NULL && manifest != NULL && out_root != NULL && world >= 1);
    clear(err, errlen);
    if (manifest->world_size != 0 && manifest->world_size != world) {
        /* The checkpoint is for the job this manifest describes: a job at another world size
         * would not accept the manifest either. */
        return note(err, errlen, MFSDP_ERR_MISMATCH,
                    "the manifest is for world size %d, not %d: import at --world-size %d, or "
                    "set (or remove) the manifest's world_size for the job you will run",
                    manifest->world_size, world, manifest->world_size);
    }
    mfsdp_st_file_t *f = NULL;
    mfsdp_plan_t *plan = NULL;
    mfsdp_ckpt_layout_t *lay = NULL;
    mfsdp_ckpt_meta_t meta;
    memset(&meta, 0, sizeof(meta));
    mfsdp_status_t st;
    MFSDP_CHECK_GOTO(mfsdp_st_open(in, err, errlen, &f), st, out);
    for (size_t g = 0; g < manifest->ngroups; g++) {
        for (size_t i = 0; i < manifest->groups[g].nparams; i++) {
            const mfsdp_param_desc_t *p = &manifest->groups[g].params[i];
            const mfsdp_st_tensor_t *t = mfsdp_st_find(f->hdr, p->name);
            mfsdp_dtype_t dt;
            int same = t != NULL && t->ndim == p->ndim;
            for (int d = 0; same && d < p->ndim; d++) {
                same = t->shape[d] == p->shape[d];
            }
            if (t == NULL || !same || mfsdp_st_dtype_to(t->dtype, &dt) != MFSDP_OK) {
                st = t == NULL ? MFSDP_ERR_NOT_FOUND
                     : !same   ? MFSDP_ERR_MISMATCH
                               : MFSDP_ERR_UNSUPPORTED;
                char msg[512];
                snprintf(msg, sizeof(msg), "%s: tensor '%s' of the manifest is %s", in, p->name,
                         t == NULL ? "missing"
                         : !same   ? "there with another shape"
                                   : "not F32, BF16 or F16");
                MFSDP_WARN("%s", msg);
                if (err != NULL && errlen > 0) {
                    snprintf(err, errlen, "%s", msg);
                }
                goto out;
            }
        }
    }
    st = mfsdp_plan_create(manifest, world, opts, &plan);
    if (st != MFSDP_OK) {
        note(err, errlen, st, "planning the manifest at world size %d failed", world);
        goto out;
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_layout_of_plan(plan, &lay), st, out);
    meta.tail = plan->tail;
    meta.hp = manifest->hp;
    meta.ngroups = manifest->ngroups;
    meta.group_nsteps = calloc(meta.ngroups + 1, sizeof(int64_t));
    if (meta.group_nsteps == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    rank_src_t src = {.f = f, .lay = lay};
    MFSDP_CHECK_GOTO(write_all_ranks(out_root, lay, &meta, import_fill, &src, err, errlen), st,
                     out);
out:
    mfsdp_ckpt_meta_clear(&meta);
    mfsdp_ckpt_layout_destroy(lay);
    mfsdp_plan_destroy(plan);
    mfsdp_st_close(f);
    return note(err, errlen, st, "import of %s into %s failed", in, out_root);
}
