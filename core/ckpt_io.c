/* SPDX-License-Identifier: Apache-2.0 */
/* Checkpoint directories: write protocol, reader, verifier (see core/ckpt_io.h). */
#include "core/ckpt_io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/checks.h"

#define MSG_LEN        768
#define MAX_INDEX_LEN  ((size_t)1 << 30) /* an index larger than this is not ours */
#define MAX_SMALL_FILE ((size_t)1 << 20) /* latest, .done records */
#define MAX_OPEN       64                /* files a reader keeps open at once */

/* Messages are one line: control characters (from file contents) become '?'. */
static void oneline(char *msg)
{
    for (char *c = msg; *c != '\0'; c++) {
        if ((unsigned char)*c < 0x20 || *c == 0x7f) {
            *c = '?';
        }
    }
}

static mfsdp_status_t cfail(char *err, size_t errlen, mfsdp_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static mfsdp_status_t cfail(char *err, size_t errlen, mfsdp_status_t st, const char *fmt, ...)
{
    char msg[MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    oneline(msg);
    MFSDP_WARN("%s", msg);
    if (err != NULL && errlen > 0) {
        snprintf(err, errlen, "%s", msg);
    }
    return st;
}

static char *path_join(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    char *p = malloc(la + lb + 2);
    if (p != NULL) {
        memcpy(p, a, la);
        size_t o = la;
        if (la == 0 || a[la - 1] != '/') {
            p[o++] = '/';
        }
        memcpy(p + o, b, lb + 1);
    }
    return p;
}

static void point(const mfsdp_ckpt_hook_t *h, const char *what, const char *file, const char *key)
{
    if (h != NULL && h->fn != NULL) {
        h->fn(h->arg, what, file, key);
    }
}

/* Whole small file into a NUL-terminated buffer. A missing file is MFSDP_ERR_NOT_FOUND,
 * said only when err is given: the callers without err expect it (a rank's record not written
 * yet, no `latest`) and say what it means themselves. */
static mfsdp_status_t read_small(const char *path, size_t max, char **buf_p, size_t *len_p,
                                 char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block: refused
                                                               below, as any non-regular file */
    if (fd < 0 && errno == ENOENT && err == NULL) {
        return MFSDP_ERR_NOT_FOUND;
    }
    if (fd < 0) {
        return cfail(err, errlen, errno == ENOENT ? MFSDP_ERR_NOT_FOUND : MFSDP_ERR_IO,
                     "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size > max) {
        close(fd);
        return cfail(err, errlen, MFSDP_ERR_PARSE, "%s: not a regular file of at most %zu bytes",
                     path, max);
    }
    size_t len = (size_t)sb.st_size;
    char *buf = malloc(len + 1);
    if (buf == NULL) {
        close(fd);
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            free(buf);
            close(fd);
            return cfail(err, errlen, MFSDP_ERR_IO, "%s: read failed: %s", path,
                         n < 0 ? strerror(errno) : "file shortened while reading");
        }
        got += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    *buf_p = buf;
    *len_p = len;
    return MFSDP_OK;
}

/* Write a small file durably: tmp, fsync, rename. */
static mfsdp_status_t write_small(const char *path, const char *text, size_t len,
                                  const mfsdp_ckpt_hook_t *hook, const char *what)
{
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 5);
    if (tmp == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".tmp", 5);
    mfsdp_status_t st = MFSDP_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        MFSDP_WARN("%s: cannot create: %m", tmp);
        free(tmp);
        return MFSDP_ERR_IO;
    }
    size_t put = 0;
    while (put < len) {
        ssize_t n = write(fd, text + put, len - put);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            MFSDP_WARN("%s: write failed: %m", tmp);
            st = MFSDP_ERR_IO;
            goto fail;
        }
        put += (size_t)n;
    }
    point(hook, what, path, "written");
    if (fsync(fd) != 0) {
        MFSDP_WARN("%s: fsync failed: %m", tmp);
        st = MFSDP_ERR_IO;
        goto fail;
    }
    point(hook, what, path, "fsync");
    if (close(fd) != 0) {
        fd = -1;
        MFSDP_WARN("%s: close failed: %m", tmp);
        st = MFSDP_ERR_IO;
        goto fail;
    }
    fd = -1;
    if (rename(tmp, path) != 0) {
        MFSDP_WARN("cannot rename %s to %s: %m", tmp, path);
        st = MFSDP_ERR_IO;
        goto fail;
    }
    point(hook, what, path, "rename");
    free(tmp);
    return MFSDP_OK;
fail:
    if (fd >= 0) {
        close(fd);
    }
    unlink(tmp);
    free(tmp);
    return st;
}

mfsdp_status_t mfsdp_ckpt_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        MFSDP_WARN("%s: cannot open directory: %m", dir);
        return MFSDP_ERR_IO;
    }
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0 && e != EINVAL) { /* some filesystems do not sync directories: nothing to do */
        errno = e;
        MFSDP_WARN("%s: fsync of the directory failed: %m", dir);
        return MFSDP_ERR_IO;
    }
    return MFSDP_OK;
}

/* ---- names -------------------------------------------------------------------------------- */

static int ends_with(const char *s, const char *suf)
{
    size_t ls = strlen(s), lf = strlen(suf);
    return ls >= lf && strcmp(s + ls - lf, suf) == 0;
}

static int starts_with(const char *s, const char *pre)
{
    return strncmp(s, pre, strlen(pre)) == 0;
}

/* A checkpoint directory name as `latest` may hold it: no path separators, not . or .. */
static int valid_name(const char *s, size_t len)
{
    if (len == 0 || len >= MFSDP_CKPT_NAME_LEN || (len == 1 && s[0] == '.') ||
        (len == 2 && s[0] == '.' && s[1] == '.')) {
        return 0;
    }
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.')) {
            return 0;
        }
    }
    return 1;
}

/* Files a save may leave in a partial directory. */
static int ours(const char *f)
{
    static const char *const sufs[] = {".safetensors", ".safetensors.tmp", ".done",
                                       ".done.tmp",    ".failed",          ".failed.tmp"};
    if (strcmp(f, MFSDP_CKPT_INDEX_NAME) == 0 || strcmp(f, MFSDP_CKPT_INDEX_NAME ".tmp") == 0) {
        return 1;
    }
    if (!starts_with(f, "model-") && !starts_with(f, "optim-") && !starts_with(f, "rank-")) {
        return 0;
    }
    for (size_t i = 0; i < sizeof(sufs) / sizeof(sufs[0]); i++) {
        if (ends_with(f, sufs[i])) {
            return 1;
        }
    }
    return 0;
}

char *mfsdp_ckpt_partial_path(const char *root, const char *name)
{
    size_t ln = strlen(name);
    char *pn = malloc(ln + sizeof(MFSDP_CKPT_PARTIAL_SUFFIX));
    if (pn == NULL) {
        return NULL;
    }
    memcpy(pn, name, ln);
    memcpy(pn + ln, MFSDP_CKPT_PARTIAL_SUFFIX, sizeof(MFSDP_CKPT_PARTIAL_SUFFIX));
    char *p = path_join(root, pn);
    free(pn);
    return p;
}

/* Remove a partial directory left by an interrupted save: only files a save writes. */
static void remove_partial(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL) {
        return;
    }
    int foreign = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) {
            continue;
        }
        if (!ours(e->d_name)) {
            foreign = 1;
            continue;
        }
        char *p = path_join(dir, e->d_name);
        if (p != NULL) {
            unlink(p);
            free(p);
        }
    }
    closedir(d);
    if (foreign || rmdir(dir) != 0) {
        MFSDP_WARN("%s: left by an interrupted save; not removed (it holds files mfsdp does "
                   "not write)",
                   dir);
    } else {
        MFSDP_INFO(CKPT, "removed %s, left by an interrupted save", dir);
    }
}

static mfsdp_status_t mkdir_p(const char *path)
{
    char *p = strdup(path);
    if (p == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (char *s = p + 1; *s != '\0'; s++) {
        if (*s == '/') {
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                MFSDP_WARN("%s: cannot create directory: %m", p);
                free(p);
                return MFSDP_ERR_IO;
            }
            *s = '/';
        }
    }
    int rc = mkdir(p, 0755);
    free(p);
    if (rc != 0 && errno != EEXIST) {
        MFSDP_WARN("%s: cannot create directory: %m", path);
        return MFSDP_ERR_IO;
    }
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        MFSDP_WARN("%s: not a directory", path);
        return MFSDP_ERR_IO;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ckpt_begin(const char *root, int64_t step, char *name, size_t namelen,
                                char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(root != NULL && root[0] != '\0' && name != NULL && step >= 0);
    MFSDP_CHECK_ARG(namelen >= MFSDP_CKPT_NAME_LEN);
    if (mkdir_p(root) != MFSDP_OK) {
        return cfail(err, errlen, MFSDP_ERR_IO, "%s: cannot create the checkpoint directory", root);
    }
    DIR *d = opendir(root);
    if (d == NULL) {
        return cfail(err, errlen, MFSDP_ERR_IO, "%s: cannot list: %s", root, strerror(errno));
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (ends_with(e->d_name, MFSDP_CKPT_PARTIAL_SUFFIX) && starts_with(e->d_name, "step-")) {
            char *p = path_join(root, e->d_name);
            if (p != NULL) {
                remove_partial(p);
                free(p);
            }
        }
    }
    closedir(d);
    char cand[MFSDP_CKPT_NAME_LEN];
    for (int k = 0; k < 10000; k++) {
        if (k == 0) {
            snprintf(cand, sizeof(cand), "step-%08" PRId64, step);
        } else {
            snprintf(cand, sizeof(cand), "step-%08" PRId64 "-%d", step, k);
        }
        char *fin = path_join(root, cand);
        char *part = mfsdp_ckpt_partial_path(root, cand);
        if (fin == NULL || part == NULL) {
            free(fin);
            free(part);
            return MFSDP_ERR_NO_MEMORY;
        }
        struct stat sb;
        int taken = lstat(fin, &sb) == 0 || lstat(part, &sb) == 0;
        mfsdp_status_t st = MFSDP_OK;
        if (!taken && mkdir(part, 0755) != 0) {
            st = cfail(err, errlen, MFSDP_ERR_IO, "%s: cannot create: %s", part, strerror(errno));
        }
        free(fin);
        free(part);
        if (st != MFSDP_OK) {
            return st;
        }
        if (!taken) {
            /* No fsync here: losing an empty partial directory in a crash loses nothing, and
             * this runs while the caller is held. */
            snprintf(name, namelen, "%s", cand);
            return MFSDP_OK;
        }
    }
    return cfail(err, errlen, MFSDP_ERR_IO, "%s: no free checkpoint name for step %" PRId64, root,
                 step);
}

/* ---- per-rank files ----------------------------------------------------------------------- */

typedef struct fill_tramp {
    mfsdp_st_fill_fn fill;
    void *arg;
    size_t first; /* item index of the file's entry 0 */
} fill_tramp_t;

static mfsdp_status_t tramp(void *arg, size_t entry, uint64_t off, void *buf, size_t len)
{
    fill_tramp_t *t = arg;
    return t->fill(t->arg, t->first + entry, off, buf, len);
}

static mfsdp_status_t write_one(const char *partial, const mfsdp_ckpt_layout_t *lay,
                                const mfsdp_ckpt_meta_t *meta, int rank, mfsdp_ckpt_kind_t kind,
                                const mfsdp_ckpt_item_t *items, size_t first, size_t n,
                                const void *const *data, mfsdp_st_fill_fn fill, void *fill_arg,
                                const mfsdp_ckpt_hook_t *hook, mfsdp_ckpt_file_info_t *fi)
{
    mfsdp_status_t st = MFSDP_OK;
    char **mk = NULL, **mv = NULL;
    size_t nm = 0;
    char *path = NULL;
    mfsdp_st_entry_t *e = calloc(n + 1, sizeof(*e));
    if (e == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < n; i++) {
        const mfsdp_ckpt_item_t *it = &items[first + i];
        e[i].name = it->key;
        e[i].dtype = it->dtype;
        e[i].ndim = it->ndim;
        memcpy(e[i].shape, it->shape, sizeof(it->shape));
        e[i].bytes = it->bytes;
        e[i].data = data != NULL ? data[first + i] : NULL;
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_file_meta(lay, meta, kind, rank, items + first, n, &mk, &mv, &nm),
                     st, out);
    memset(fi, 0, sizeof(*fi));
    fi->kind = kind;
    fi->rank = rank;
    mfsdp_ckpt_file_name(fi->name, sizeof(fi->name), kind, rank, lay->world);
    path = path_join(partial, fi->name);
    if (path == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    fill_tramp_t tr = {fill, fill_arg, first};
    mfsdp_st_write_opts_t wo = {
        .fill = fill != NULL ? tramp : NULL,
        .fill_arg = &tr,
        .point = hook != NULL ? hook->fn : NULL,
        .point_arg = hook != NULL ? hook->arg : NULL,
    };
    MFSDP_CHECK_GOTO(mfsdp_st_write(path, e, n, (const char *const *)mk, (const char *const *)mv,
                                    nm, &wo, fi->sha256, &fi->bytes),
                     st, out);
out:
    free(path);
    mfsdp_ckpt_file_meta_free(mk, mv, nm);
    free(e);
    return st;
}

static char *rank_record(const char *partial, int rank, const char *suffix)
{
    char f[64];
    snprintf(f, sizeof(f), "rank-%05d%s", rank, suffix);
    return path_join(partial, f);
}

mfsdp_status_t mfsdp_ckpt_write_rank(const char *partial, const mfsdp_ckpt_layout_t *lay,
                                     const mfsdp_ckpt_meta_t *meta, int rank,
                                     const mfsdp_ckpt_item_t *items, size_t nitems,
                                     const void *const *data, mfsdp_st_fill_fn fill, void *fill_arg,
                                     const mfsdp_ckpt_hook_t *hook, mfsdp_ckpt_file_info_t files[2])
{
    MFSDP_CHECK_ARG(partial != NULL && lay != NULL && meta != NULL && files != NULL);
    MFSDP_CHECK_ARG(items != NULL || nitems == 0);
    size_t nmodel = 0;
    while (nmodel < nitems && items[nmodel].kind == MFSDP_CKPT_MODEL) {
        nmodel++;
    }
    MFSDP_CHECK(write_one(partial, lay, meta, rank, MFSDP_CKPT_MODEL, items, 0, nmodel, data, fill,
                          fill_arg, hook, &files[0]));
    MFSDP_CHECK(write_one(partial, lay, meta, rank, MFSDP_CKPT_OPTIM, items, nmodel,
                          nitems - nmodel, data, fill, fill_arg, hook, &files[1]));
    json_t *rec =
        json_pack("{s:i, s:i, s:[{s:s, s:I, s:s}, {s:s, s:I, s:s}]}", "rank", rank, "world_size",
                  lay->world, "files", "name", files[0].name, "bytes", (json_int_t)files[0].bytes,
                  "sha256", files[0].sha256, "name", files[1].name, "bytes",
                  (json_int_t)files[1].bytes, "sha256", files[1].sha256);
    char *text = rec != NULL ? json_dumps(rec, JSON_COMPACT) : NULL;
    json_decref(rec);
    char *path = rank_record(partial, rank, ".done");
    mfsdp_status_t st = text == NULL || path == NULL ? MFSDP_ERR_NO_MEMORY : MFSDP_OK;
    if (st == MFSDP_OK) {
        st = write_small(path, text, strlen(text), hook, "done");
    }
    free(text);
    free(path);
    MFSDP_CHECK(st);
    MFSDP_CHECK(mfsdp_ckpt_fsync_dir(partial));
    point(hook, "partial-fsync", partial, NULL);
    return MFSDP_OK;
}

void mfsdp_ckpt_write_failed(const char *partial, int rank, const char *why)
{
    char *path = rank_record(partial, rank, ".failed");
    if (path != NULL) {
        (void)write_small(path, why, strlen(why), NULL, "failed");
        free(path);
    }
}

mfsdp_status_t mfsdp_ckpt_poll_rank(const char *partial, const mfsdp_ckpt_layout_t *lay, int rank,
                                    mfsdp_ckpt_file_info_t files[2], int *state_p)
{
    MFSDP_CHECK_ARG(partial != NULL && lay != NULL && files != NULL && state_p != NULL);
    char *fpath = rank_record(partial, rank, ".failed");
    char *dpath = rank_record(partial, rank, ".done");
    mfsdp_status_t st = MFSDP_OK;
    char *text = NULL;
    size_t len;
    json_t *rec = NULL;
    struct stat sb;
    if (fpath == NULL || dpath == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    *state_p = 0;
    if (stat(fpath, &sb) == 0) {
        *state_p = -1;
        goto out;
    }
    st = read_small(dpath, MAX_SMALL_FILE, &text, &len, NULL, 0);
    if (st == MFSDP_ERR_NOT_FOUND) {
        st = MFSDP_OK; /* not there yet */
        goto out;
    }
    MFSDP_CHECK_GOTO(st, st, out);
    json_error_t je;
    rec = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    json_int_t r = -1, w = -1, b0 = -1, b1 = -1;
    const char *n0 = NULL, *n1 = NULL, *s0 = NULL, *s1 = NULL;
    if (rec == NULL ||
        json_unpack(rec, "{s:I, s:I, s:[{s:s, s:I, s:s}, {s:s, s:I, s:s}]}", "rank", &r,
                    "world_size", &w, "files", "name", &n0, "bytes", &b0, "sha256", &s0, "name",
                    &n1, "bytes", &b1, "sha256", &s1) != 0 ||
        r != rank || w != lay->world || b0 < 8 || b1 < 8 || !mfsdp_sha256_is_hex(s0) ||
        !mfsdp_sha256_is_hex(s1)) {
        MFSDP_WARN("%s: not a valid record of rank %d", dpath, rank);
        st = MFSDP_ERR_PARSE;
        goto out;
    }
    for (int k = 0; k < 2; k++) {
        mfsdp_ckpt_file_info_t *fi = &files[k];
        memset(fi, 0, sizeof(*fi));
        fi->kind = k == 0 ? MFSDP_CKPT_MODEL : MFSDP_CKPT_OPTIM;
        fi->rank = rank;
        mfsdp_ckpt_file_name(fi->name, sizeof(fi->name), fi->kind, rank, lay->world);
        fi->bytes = (uint64_t)(k == 0 ? b0 : b1);
        memcpy(fi->sha256, k == 0 ? s0 : s1, MFSDP_SHA256_HEX);
        if (strcmp(fi->name, k == 0 ? n0 : n1) != 0) {
            MFSDP_WARN("%s: names file %s, expected %s", dpath, k == 0 ? n0 : n1, fi->name);
            st = MFSDP_ERR_PARSE;
            goto out;
        }
    }
    *state_p = 1;
out:
    json_decref(rec);
    free(text);
    free(fpath);
    free(dpath);
    return st;
}

mfsdp_status_t mfsdp_ckpt_commit(const char *root, const char *name, const char *index_text,
                                 size_t index_len, const char *index_sha256, int world,
                                 const mfsdp_ckpt_hook_t *hook)
{
    MFSDP_CHECK_ARG(root != NULL && name != NULL && index_text != NULL && world >= 1);
    MFSDP_CHECK_ARG(mfsdp_sha256_is_hex(index_sha256));
    mfsdp_status_t st = MFSDP_OK;
    char *partial = mfsdp_ckpt_partial_path(root, name);
    char *final = path_join(root, name);
    char *ipath = partial != NULL ? path_join(partial, MFSDP_CKPT_INDEX_NAME) : NULL;
    char *latest = path_join(root, MFSDP_CKPT_LATEST_NAME);
    char line[MFSDP_CKPT_NAME_LEN + MFSDP_SHA256_HEX + 4];
    if (partial == NULL || final == NULL || ipath == NULL || latest == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    MFSDP_CHECK_GOTO(write_small(ipath, index_text, index_len, hook, "index"), st, out);
    for (int r = 0; r < world; r++) {
        char *d = rank_record(partial, r, ".done");
        if (d == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        unlink(d);
        free(d);
    }
    point(hook, "records-removed", partial, NULL);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_fsync_dir(partial), st, out);
    point(hook, "partial-fsync", partial, NULL);
    struct stat sb;
    if (lstat(final, &sb) == 0) {
        MFSDP_WARN("%s exists already; the checkpoint stays in %s", final, partial);
        st = MFSDP_ERR_IO;
        goto out;
    }
    if (rename(partial, final) != 0) {
        MFSDP_WARN("cannot rename %s to %s: %m", partial, final);
        st = MFSDP_ERR_IO;
        goto out;
    }
    point(hook, "rename-dir", final, NULL);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_fsync_dir(root), st, out);
    point(hook, "root-fsync", root, NULL);
    int n = snprintf(line, sizeof(line), "%s %s\n", name, index_sha256);
    MFSDP_CHECK_GOTO(write_small(latest, line, (size_t)n, hook, "latest"), st, out);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_fsync_dir(root), st, out);
    point(hook, "committed", final, NULL);
out:
    free(partial);
    free(final);
    free(ipath);
    free(latest);
    return st;
}

/* ---- reading ------------------------------------------------------------------------------ */

void mfsdp_ckpt_reader_close(mfsdp_ckpt_reader_t *r)
{
    if (r == NULL) {
        return;
    }
    for (size_t f = 0; r->files != NULL && r->index != NULL && f < r->index->nfiles; f++) {
        mfsdp_st_close(r->files[f]);
    }
    free(r->files);
    mfsdp_ckpt_index_free(r->index);
    free(r->dir);
    free(r);
}

/* PATH -> checkpoint directory (malloc'd) and, through `latest`, the expected digest. */
static mfsdp_status_t resolve(const char *path, char **dir_p, char want[MFSDP_SHA256_HEX],
                              char *err, size_t errlen)
{
    want[0] = '\0';
    struct stat sb;
    if (stat(path, &sb) != 0) {
        return cfail(err, errlen, errno == ENOENT ? MFSDP_ERR_NOT_FOUND : MFSDP_ERR_IO, "%s: %s",
                     path, strerror(errno));
    }
    if (!S_ISDIR(sb.st_mode)) {
        return cfail(err, errlen, MFSDP_ERR_INVALID_ARG, "%s: not a directory", path);
    }
    char *copy = strdup(path);
    if (copy == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    while (strlen(copy) > 1 && copy[strlen(copy) - 1] == '/') {
        copy[strlen(copy) - 1] = '\0';
    }
    if (ends_with(copy, MFSDP_CKPT_PARTIAL_SUFFIX)) {
        free(copy);
        return cfail(err, errlen, MFSDP_ERR_STATE,
                     "%s: an interrupted save (*" MFSDP_CKPT_PARTIAL_SUFFIX
                     "), not a checkpoint: load its root to get the latest complete one",
                     path);
    }
    char *idx = path_join(copy, MFSDP_CKPT_INDEX_NAME);
    if (idx == NULL) {
        free(copy);
        return MFSDP_ERR_NO_MEMORY;
    }
    int has_index = stat(idx, &sb) == 0;
    free(idx);
    if (has_index) {
        *dir_p = copy;
        return MFSDP_OK;
    }
    char *lpath = path_join(copy, MFSDP_CKPT_LATEST_NAME);
    char *text = NULL;
    size_t len = 0;
    mfsdp_status_t st = lpath != NULL ? read_small(lpath, MAX_SMALL_FILE, &text, &len, NULL, 0)
                                      : MFSDP_ERR_NO_MEMORY;
    if (st == MFSDP_ERR_NOT_FOUND) {
        st = cfail(err, errlen, MFSDP_ERR_NOT_FOUND,
                   "%s: no checkpoint here (neither " MFSDP_CKPT_INDEX_NAME
                   " nor " MFSDP_CKPT_LATEST_NAME ")",
                   copy);
    } else if (st != MFSDP_OK) {
        st = cfail(err, errlen, st, "%s: cannot read", lpath != NULL ? lpath : copy);
    } else {
        /* "<name> <64 hex>\n" */
        const char *sp = memchr(text, ' ', len);
        size_t nl = sp != NULL ? (size_t)(sp - text) : 0;
        if (sp == NULL || !valid_name(text, nl) || len != nl + 1 + 64 + 1 ||
            text[len - 1] != '\n') {
            st = cfail(err, errlen, MFSDP_ERR_PARSE,
                       "%s: damaged (expected one line '<checkpoint name> <index sha256>')", lpath);
        } else {
            memcpy(want, sp + 1, 64);
            want[64] = '\0';
            char name[MFSDP_CKPT_NAME_LEN];
            memcpy(name, text, nl);
            name[nl] = '\0';
            if (!mfsdp_sha256_is_hex(want)) {
                st = cfail(err, errlen, MFSDP_ERR_PARSE, "%s: damaged (bad digest)", lpath);
            } else if ((*dir_p = path_join(copy, name)) == NULL) {
                st = MFSDP_ERR_NO_MEMORY;
            }
        }
    }
    free(text);
    free(lpath);
    free(copy);
    return st;
}

mfsdp_status_t mfsdp_ckpt_reader_open(const char *path, char *err, size_t errlen,
                                      mfsdp_ckpt_reader_t **reader_p)
{
    MFSDP_CHECK_ARG(path != NULL && reader_p != NULL);
    char want[MFSDP_SHA256_HEX];
    char *dir = NULL, *ipath = NULL, *text = NULL;
    size_t len = 0;
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_status_t st;
    MFSDP_CHECK_GOTO(resolve(path, &dir, want, err, errlen), st, out);
    ipath = path_join(dir, MFSDP_CKPT_INDEX_NAME);
    if (ipath == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    st = read_small(ipath, MAX_INDEX_LEN, &text, &len, err, errlen);
    if (st == MFSDP_ERR_NOT_FOUND) {
        st = cfail(err, errlen, st, "%s: missing (the checkpoint named by %s/latest is gone)",
                   ipath, path);
    }
    MFSDP_CHECK_GOTO(st, st, out);
    r = calloc(1, sizeof(*r));
    if (r == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    r->dir = dir;
    dir = NULL;
    MFSDP_CHECK_GOTO(mfsdp_ckpt_index_parse(text, len, ipath, err, errlen, &r->index), st, out);
    if (want[0] != '\0' && strcmp(want, r->index->index_sha256) != 0) {
        st = cfail(err, errlen, MFSDP_ERR_CHECKSUM,
                   "%s/latest records index digest %.16s..., but %s has %.16s...", path, want,
                   ipath, r->index->index_sha256);
        goto out;
    }
    r->files = calloc(r->index->nfiles, sizeof(*r->files));
    if (r->files == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    *reader_p = r;
    r = NULL;
out:
    mfsdp_ckpt_reader_close(r);
    free(text);
    free(ipath);
    free(dir);
    return st;
}

static mfsdp_status_t reader_file(mfsdp_ckpt_reader_t *r, size_t f, char *err, size_t errlen,
                                  mfsdp_st_file_t **file_p)
{
    if (r->files[f] == NULL) {
        if (r->nopen >= MAX_OPEN) {
            /* thousands of ranks' files: keep the descriptors bounded */
            for (size_t k = 0; k < r->index->nfiles; k++) {
                mfsdp_st_close(r->files[k]);
                r->files[k] = NULL;
            }
            r->nopen = 0;
        }
        char *p = path_join(r->dir, r->index->files[f].name);
        if (p == NULL) {
            return MFSDP_ERR_NO_MEMORY;
        }
        mfsdp_status_t st = mfsdp_st_open(p, err, errlen, &r->files[f]);
        free(p);
        if (st == MFSDP_ERR_NOT_FOUND) {
            return cfail(err, errlen, st, "%s/%s: missing (the checkpoint is incomplete)", r->dir,
                         r->index->files[f].name);
        }
        MFSDP_CHECK(st);
        r->nopen++;
    }
    *file_p = r->files[f];
    return MFSDP_OK;
}

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && o < len; d++) {
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    }
    if (o < len) {
        snprintf(buf + o, len - o, "]");
    }
}

/* The stored tensor `key` of file f, checked against dtype and shape. */
static mfsdp_status_t check_entry(mfsdp_ckpt_reader_t *r, size_t f, const char *key,
                                  mfsdp_st_dtype_t dtype, int ndim, const int64_t *shape, char *err,
                                  size_t errlen, const mfsdp_st_tensor_t **t_p)
{
    mfsdp_st_file_t *file;
    MFSDP_CHECK(reader_file(r, f, err, errlen, &file));
    const mfsdp_st_tensor_t *t = mfsdp_st_find(file->hdr, key);
    if (t == NULL) {
        return cfail(err, errlen, MFSDP_ERR_NOT_FOUND,
                     "%s: tensor '%.80s' is missing (the index places it in this file)", file->path,
                     key);
    }
    if (t->dtype != dtype) {
        return cfail(err, errlen, MFSDP_ERR_MISMATCH, "%s: tensor '%.80s': dtype %s, expected %s",
                     file->path, key, mfsdp_st_dtype_name(t->dtype), mfsdp_st_dtype_name(dtype));
    }
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) {
        same = t->shape[d] == shape[d];
    }
    if (!same) {
        char got[160], exp[160];
        shape_str(got, sizeof(got), t->ndim, t->shape);
        shape_str(exp, sizeof(exp), ndim, shape);
        return cfail(err, errlen, MFSDP_ERR_MISMATCH, "%s: tensor '%.80s': shape %s, expected %s",
                     file->path, key, got, exp);
    }
    *t_p = t;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ckpt_read_range(mfsdp_ckpt_reader_t *r, size_t t, mfsdp_ckpt_state_t s,
                                     uint64_t off, uint64_t len, void *dst, char *err,
                                     size_t errlen)
{
    MFSDP_CHECK_ARG(r != NULL && t < r->index->layout->ntensors &&
                    (unsigned)s < MFSDP_CKPT_NSTATES);
    const mfsdp_ckpt_layout_t *lay = r->index->layout;
    MFSDP_CHECK_ARG(s == MFSDP_CKPT_MASTER || mfsdp_ckpt_has_state(lay, t, s));
    mfsdp_ckpt_state_t stored = s;
    if (s == MFSDP_CKPT_MASTER && !mfsdp_ckpt_has_state(lay, t, s)) {
        stored = MFSDP_CKPT_WEIGHT;
    }
    uint64_t rb =
        (uint64_t)lay->rest[t] * mfsdp_st_dtype_size(mfsdp_ckpt_state_dtype(lay, t, stored));
    uint64_t total = (uint64_t)lay->rows[t] * rb;
    MFSDP_CHECK_ARG(off <= total && len <= total - off && (dst != NULL || len == 0));
    if (len == 0) {
        return MFSDP_OK;
    }
    int64_t a = (int64_t)(off / rb), b = (int64_t)((off + len + rb - 1) / rb);
    size_t np = mfsdp_ckpt_pieces(lay, t, s, a, b, NULL, 0);
    mfsdp_ckpt_piece_t *pc = calloc(np + 1, sizeof(*pc));
    if (pc == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mfsdp_ckpt_pieces(lay, t, s, a, b, pc, np);
    mfsdp_status_t st = MFSDP_OK;
    for (size_t i = 0; i < np && st == MFSDP_OK; i++) {
        const mfsdp_ckpt_piece_t *p = &pc[i];
        mfsdp_st_dtype_t dt = mfsdp_ckpt_state_dtype(lay, t, p->state);
        int64_t shape[MFSDP_MAX_DIMS];
        memcpy(shape, lay->params[t]->shape, sizeof(shape));
        shape[0] = p->row_end - p->row_begin;
        char *key = mfsdp_ckpt_key(lay, t, p->state);
        if (key == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            break;
        }
        const mfsdp_st_tensor_t *e;
        size_t f = mfsdp_ckpt_file_slot(lay->world, p->kind, p->rank);
        st = check_entry(r, f, key, dt, lay->params[t]->ndim, shape, err, errlen, &e);
        free(key);
        if (st != MFSDP_OK) {
            break;
        }
        /* The piece covers bytes [pb, pe) of the whole tensor. */
        uint64_t pb = (uint64_t)p->row_begin * rb, pe = (uint64_t)p->row_end * rb;
        uint64_t x = off > pb ? off : pb;
        uint64_t y = off + len < pe ? off + len : pe;
        if (x >= y) {
            continue;
        }
        st = mfsdp_st_read(r->files[f], e, x - pb, (size_t)(y - x), (char *)dst + (x - off), err,
                           errlen);
        r->bytes_read += y - x;
    }
    free(pc);
    return st;
}

mfsdp_status_t mfsdp_ckpt_read_rows(mfsdp_ckpt_reader_t *r, size_t t, mfsdp_ckpt_state_t s,
                                    int64_t a, int64_t b, void *dst, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(r != NULL && t < r->index->layout->ntensors &&
                    (unsigned)s < MFSDP_CKPT_NSTATES);
    const mfsdp_ckpt_layout_t *lay = r->index->layout;
    MFSDP_CHECK_ARG(a >= 0 && a <= b && b <= lay->rows[t]);
    mfsdp_ckpt_state_t stored = s;
    if (s == MFSDP_CKPT_MASTER && !mfsdp_ckpt_has_state(lay, t, s)) {
        stored = MFSDP_CKPT_WEIGHT;
    }
    uint64_t rb =
        (uint64_t)lay->rest[t] * mfsdp_st_dtype_size(mfsdp_ckpt_state_dtype(lay, t, stored));
    return mfsdp_ckpt_read_range(r, t, s, (uint64_t)a * rb, (uint64_t)(b - a) * rb, dst, err,
                                 errlen);
}

mfsdp_status_t mfsdp_ckpt_verify_file(mfsdp_ckpt_reader_t *r, size_t f, int check_sha, char *err,
                                      size_t errlen)
{
    MFSDP_CHECK_ARG(r != NULL && f < r->index->nfiles);
    const mfsdp_ckpt_file_info_t *fi = &r->index->files[f];
    const mfsdp_ckpt_layout_t *lay = r->index->layout;
    char *path = path_join(r->dir, fi->name);
    if (path == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_ckpt_item_t *items = NULL;
    size_t nitems = 0;
    char **mk = NULL, **mv = NULL;
    size_t nm = 0;
    if (check_sha) {
        char hex[MFSDP_SHA256_HEX];
        uint64_t bytes = 0;
        struct stat sb;
        if (stat(path, &sb) != 0) {
            st = cfail(err, errlen, errno == ENOENT ? MFSDP_ERR_NOT_FOUND : MFSDP_ERR_IO,
                       "%s: %s (the checkpoint is incomplete)", path, strerror(errno));
            goto out;
        }
        MFSDP_CHECK_GOTO(mfsdp_sha256_file(path, hex, &bytes), st, out);
        if (bytes != fi->bytes) {
            st = cfail(err, errlen, MFSDP_ERR_CHECKSUM,
                       "%s: %llu bytes, the index says %llu (truncated or extended)", path,
                       (unsigned long long)bytes, (unsigned long long)fi->bytes);
            goto out;
        }
        if (strcmp(hex, fi->sha256) != 0) {
            st = cfail(err, errlen, MFSDP_ERR_CHECKSUM,
                       "%s: sha256 %.16s... does not match the index (%.16s...): the file was "
                       "modified or damaged",
                       path, hex, fi->sha256);
            goto out;
        }
    }
    mfsdp_st_file_t *file;
    MFSDP_CHECK_GOTO(reader_file(r, f, err, errlen, &file), st, out);
    MFSDP_CHECK_GOTO(mfsdp_ckpt_rank_items(lay, fi->rank, &items, &nitems), st, out);
    size_t first = 0, n = 0;
    for (size_t i = 0; i < nitems; i++) {
        if (items[i].kind == fi->kind) {
            first = n == 0 ? i : first;
            n++;
        }
    }
    for (size_t i = first; i < first + n; i++) {
        const mfsdp_st_tensor_t *e;
        MFSDP_CHECK_GOTO(check_entry(r, f, items[i].key, items[i].dtype, items[i].ndim,
                                     items[i].shape, err, errlen, &e),
                         st, out);
    }
    if (file->hdr->ntensors != n) {
        for (size_t k = 0; k < file->hdr->ntensors; k++) {
            int known = 0;
            for (size_t i = first; i < first + n && !known; i++) {
                known = strcmp(items[i].key, file->hdr->tensors[k].name) == 0;
            }
            if (!known) {
                st = cfail(err, errlen, MFSDP_ERR_MISMATCH,
                           "%s: tensor '%.80s' does not belong in this file", path,
                           file->hdr->tensors[k].name);
                goto out;
            }
        }
    }
    MFSDP_CHECK_GOTO(mfsdp_ckpt_file_meta(lay, &r->index->meta, fi->kind, fi->rank, items + first,
                                          n, &mk, &mv, &nm),
                     st, out);
    for (size_t i = 0; i < nm; i++) {
        const char *v = mfsdp_st_meta(file->hdr, mk[i]);
        if (v == NULL || strcmp(v, mv[i]) != 0) {
            st =
                cfail(err, errlen, MFSDP_ERR_MISMATCH,
                      "%s: metadata '%s' is %s%.60s%s, expected '%.60s'", path, mk[i],
                      v != NULL ? "'" : "", v != NULL ? v : "missing", v != NULL ? "'" : "", mv[i]);
            goto out;
        }
    }
    if (file->hdr->nmeta != nm) {
        st = cfail(err, errlen, MFSDP_ERR_MISMATCH, "%s: %zu metadata entries, expected %zu", path,
                   file->hdr->nmeta, nm);
    }
out:
    mfsdp_ckpt_file_meta_free(mk, mv, nm);
    mfsdp_ckpt_items_free(items, nitems);
    free(path);
    return st;
}
