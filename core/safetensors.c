/* SPDX-License-Identifier: Apache-2.0 */
/*
 * safetensors reader and writer (see core/safetensors.h for the rules it enforces). The
 * JSON is parsed with jansson (JSON_REJECT_DUPLICATES: the format forbids duplicate keys);
 * every number taken from a file is range-checked before it is used in arithmetic, so a
 * hostile header can produce an error, never an out-of-bounds access or an overflow.
 */
#include "core/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/checks.h"

#define IO_CHUNK   ((size_t)1 << 30) /* largest single read/write call */
#define FILL_CHUNK ((size_t)8 << 20) /* staging for fill callbacks */
#define SHOW_LEN   64                /* longest tensor name quoted in a message */
#define MSG_LEN    512

static const struct {
    const char *name;
    size_t size;
} st_dtypes[MFSDP_ST_DTYPE_COUNT] = {
    [MFSDP_ST_BOOL] = {"BOOL", 1},       [MFSDP_ST_U8] = {"U8", 1},
    [MFSDP_ST_I8] = {"I8", 1},           [MFSDP_ST_F8_E5M2] = {"F8_E5M2", 1},
    [MFSDP_ST_F8_E4M3] = {"F8_E4M3", 1}, [MFSDP_ST_I16] = {"I16", 2},
    [MFSDP_ST_U16] = {"U16", 2},         [MFSDP_ST_F16] = {"F16", 2},
    [MFSDP_ST_BF16] = {"BF16", 2},       [MFSDP_ST_I32] = {"I32", 4},
    [MFSDP_ST_U32] = {"U32", 4},         [MFSDP_ST_F32] = {"F32", 4},
    [MFSDP_ST_F64] = {"F64", 8},         [MFSDP_ST_I64] = {"I64", 8},
    [MFSDP_ST_U64] = {"U64", 8},
};

const char *mfsdp_st_dtype_name(mfsdp_st_dtype_t dt)
{
    return (unsigned)dt < MFSDP_ST_DTYPE_COUNT ? st_dtypes[dt].name : "invalid";
}

size_t mfsdp_st_dtype_size(mfsdp_st_dtype_t dt)
{
    return (unsigned)dt < MFSDP_ST_DTYPE_COUNT ? st_dtypes[dt].size : 0;
}

mfsdp_status_t mfsdp_st_dtype_of(mfsdp_dtype_t dt, mfsdp_st_dtype_t *st_p)
{
    switch (dt) {
    case MFSDP_FLOAT32:
        *st_p = MFSDP_ST_F32;
        return MFSDP_OK;
    case MFSDP_BFLOAT16:
        *st_p = MFSDP_ST_BF16;
        return MFSDP_OK;
    case MFSDP_FLOAT16:
        *st_p = MFSDP_ST_F16;
        return MFSDP_OK;
    default:
        return MFSDP_ERR_INVALID_ARG;
    }
}

mfsdp_status_t mfsdp_st_dtype_to(mfsdp_st_dtype_t st, mfsdp_dtype_t *dt_p)
{
    switch (st) {
    case MFSDP_ST_F32:
        *dt_p = MFSDP_FLOAT32;
        return MFSDP_OK;
    case MFSDP_ST_BF16:
        *dt_p = MFSDP_BFLOAT16;
        return MFSDP_OK;
    case MFSDP_ST_F16:
        *dt_p = MFSDP_FLOAT16;
        return MFSDP_OK;
    default:
        return MFSDP_ERR_UNSUPPORTED;
    }
}

/* ---- messages ----------------------------------------------------------------------------- */

/* A name as it may appear in a one-line message: control characters replaced, long names cut
 * on a UTF-8 boundary and marked with "...". */
static const char *show(char out[SHOW_LEN + 4], const char *s)
{
    size_t n = 0;
    for (; s[n] != '\0' && n < SHOW_LEN; n++) {
        unsigned char c = (unsigned char)s[n];
        out[n] = c < 0x20 || c == 0x7f ? '?' : (char)c;
    }
    if (s[n] != '\0') {
        while (n > 0 && ((unsigned char)out[n] & 0xc0) == 0x80) {
            n--; /* do not end inside a multi-byte character */
        }
        memcpy(out + n, "...", 4);
    } else {
        out[n] = '\0';
    }
    return out;
}

/* Messages are one line: control characters (from file contents) become '?'. */
static void oneline(char *msg)
{
    for (char *c = msg; *c != '\0'; c++) {
        if ((unsigned char)*c < 0x20 || *c == 0x7f) {
            *c = '?';
        }
    }
}

static mfsdp_status_t fail(const char *origin, char *err, size_t errlen, mfsdp_status_t st,
                           const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static mfsdp_status_t fail(const char *origin, char *err, size_t errlen, mfsdp_status_t st,
                           const char *fmt, ...)
{
    char msg[MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    char o[SHOW_LEN * 4];
    snprintf(o, sizeof(o), "%s", origin != NULL ? origin : "safetensors");
    oneline(o);
    oneline(msg);
    MFSDP_WARN("%s: %s", o, msg);
    if (err != NULL && errlen > 0) {
        snprintf(err, errlen, "%s: %s", o, msg);
    }
    return st;
}

/* ---- reading ------------------------------------------------------------------------------ */

mfsdp_status_t mfsdp_st_parse_prefix(const unsigned char prefix[8], uint64_t file_size,
                                     const char *origin, char *err, size_t errlen,
                                     uint64_t *header_len_p)
{
    MFSDP_CHECK_ARG(prefix != NULL && header_len_p != NULL);
    if (file_size < 8) {
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "the file has %llu bytes, fewer than the 8-byte header length",
                    (unsigned long long)file_size);
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) {
        n = n << 8 | prefix[i];
    }
    if (n > MFSDP_ST_MAX_HEADER) {
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "header length %llu exceeds the limit of %llu bytes", (unsigned long long)n,
                    (unsigned long long)MFSDP_ST_MAX_HEADER);
    }
    if (n > file_size - 8) {
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "header length %llu runs past the end of the %llu-byte file (truncated?)",
                    (unsigned long long)n, (unsigned long long)file_size);
    }
    *header_len_p = n;
    return MFSDP_OK;
}

void mfsdp_st_header_free(mfsdp_st_header_t *hdr)
{
    if (hdr == NULL) {
        return;
    }
    for (size_t i = 0; i < hdr->ntensors; i++) {
        free(hdr->tensors[i].name);
    }
    for (size_t i = 0; i < hdr->nmeta; i++) {
        free(hdr->meta_keys[i]);
        free(hdr->meta_vals[i]);
    }
    free(hdr->tensors);
    free(hdr->by_name);
    free(hdr->meta_keys);
    free(hdr->meta_vals);
    free(hdr);
}

typedef struct parse {
    const char *origin;
    char *err;
    size_t errlen;
} parse_t;

static int want_u64(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        return 0;
    }
    *out = (uint64_t)json_integer_value(v);
    return 1;
}

static mfsdp_status_t parse_tensor(parse_t *p, const char *key, json_t *v, mfsdp_st_tensor_t *t)
{
    char nm[SHOW_LEN + 4];
    show(nm, key);
    if (key[0] == '\0') {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE, "a tensor has an empty name");
    }
    if (!json_is_object(v)) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': expected an object with dtype, shape and data_offsets", nm);
    }
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x)
    {
        if (strcmp(k, "dtype") != 0 && strcmp(k, "shape") != 0 && strcmp(k, "data_offsets") != 0) {
            char kk[SHOW_LEN + 4];
            return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                        "tensor '%s': unknown key '%s' (expected dtype, shape, data_offsets)", nm,
                        show(kk, k));
        }
    }
    json_t *dt = json_object_get(v, "dtype");
    json_t *shape = json_object_get(v, "shape");
    json_t *offs = json_object_get(v, "data_offsets");
    if (dt == NULL || shape == NULL || offs == NULL) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE, "tensor '%s': missing %s", nm,
                    dt == NULL      ? "dtype"
                    : shape == NULL ? "shape"
                                    : "data_offsets");
    }
    if (!json_is_string(dt)) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': dtype is not a string", nm);
    }
    int found = 0;
    for (int d = 0; d < MFSDP_ST_DTYPE_COUNT; d++) {
        if (strcmp(json_string_value(dt), st_dtypes[d].name) == 0) {
            t->dtype = (mfsdp_st_dtype_t)d;
            found = 1;
        }
    }
    if (!found) {
        char dd[SHOW_LEN + 4];
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': unknown dtype '%s'", nm, show(dd, json_string_value(dt)));
    }
    if (!json_is_array(shape) || json_array_size(shape) > MFSDP_ST_MAX_DIMS) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': shape must be an array of at most %d non-negative integers", nm,
                    MFSDP_ST_MAX_DIMS);
    }
    t->ndim = (int)json_array_size(shape);
    uint64_t numel = 1;
    int over = 0;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim;
        if (!want_u64(json_array_get(shape, (size_t)d), &dim)) {
            return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                        "tensor '%s': shape[%d] is not a non-negative integer", nm, d);
        }
        t->shape[d] = (int64_t)dim;
        over |= __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t nbytes = 0;
    over |= __builtin_mul_overflow(numel, (uint64_t)st_dtypes[t->dtype].size, &nbytes);
    if (over) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': shape x dtype size overflows 64 bits", nm);
    }
    t->numel = numel;
    if (!json_is_array(offs) || json_array_size(offs) != 2 ||
        !want_u64(json_array_get(offs, 0), &t->begin) ||
        !want_u64(json_array_get(offs, 1), &t->end)) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': data_offsets must be [begin, end], two non-negative integers",
                    nm);
    }
    if (t->end < t->begin) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': data_offsets [%llu, %llu] end before they begin", nm,
                    (unsigned long long)t->begin, (unsigned long long)t->end);
    }
    if (t->end - t->begin != nbytes) {
        return fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                    "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes but shape x %s "
                    "needs %llu",
                    nm, (unsigned long long)t->begin, (unsigned long long)t->end,
                    (unsigned long long)(t->end - t->begin), st_dtypes[t->dtype].name,
                    (unsigned long long)nbytes);
    }
    t->name = strdup(key);
    if (t->name == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    return MFSDP_OK;
}

typedef struct order {
    uint64_t begin, end;
    size_t doc; /* document order: ties keep it (zero-size tensors) */
    size_t idx;
} order_t;

static int cmp_order(const void *a, const void *b)
{
    const order_t *x = a, *y = b;
    if (x->begin != y->begin) {
        return x->begin < y->begin ? -1 : 1;
    }
    if (x->end != y->end) {
        return x->end < y->end ? -1 : 1;
    }
    return x->doc < y->doc ? -1 : x->doc > y->doc;
}

typedef struct name_key {
    const char *name;
    size_t idx;
} name_key_t;

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const name_key_t *)a)->name, ((const name_key_t *)b)->name);
}

static mfsdp_status_t validate_ranges(parse_t *p, mfsdp_st_header_t *h)
{
    size_t n = h->ntensors;
    order_t *ord = calloc(n + 1, sizeof(*ord));
    mfsdp_st_tensor_t *sorted = calloc(n + 1, sizeof(*sorted));
    name_key_t *names = calloc(n + 1, sizeof(*names));
    mfsdp_status_t st = MFSDP_OK;
    if (ord == NULL || sorted == NULL || names == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        ord[i] = (order_t){h->tensors[i].begin, h->tensors[i].end, i, i};
    }
    qsort(ord, n, sizeof(*ord), cmp_order);
    for (size_t i = 0; i < n; i++) {
        sorted[i] = h->tensors[ord[i].idx];
    }
    uint64_t expect = 0;
    char a[SHOW_LEN + 4], b[SHOW_LEN + 4];
    for (size_t i = 0; i < n; i++) {
        const mfsdp_st_tensor_t *t = &sorted[i];
        if (t->end > h->data_len) {
            st = fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                      "tensor '%s': data_offsets [%llu, %llu] run past the end of the data "
                      "(%llu bytes; truncated file?)",
                      show(a, t->name), (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)h->data_len);
            goto out;
        }
        if (t->begin < expect) {
            const mfsdp_st_tensor_t *prev = &sorted[i - 1];
            st = fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                      "tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]",
                      show(a, t->name), (unsigned long long)t->begin, (unsigned long long)t->end,
                      show(b, prev->name), (unsigned long long)prev->begin,
                      (unsigned long long)prev->end);
            goto out;
        }
        if (t->begin > expect) {
            st = fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                      "tensor '%s': data_offsets [%llu, %llu] leave a hole of %llu bytes before "
                      "it",
                      show(a, t->name), (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)(t->begin - expect));
            goto out;
        }
        expect = t->end;
    }
    if (expect != h->data_len) {
        st = fail(p->origin, p->err, p->errlen, MFSDP_ERR_PARSE,
                  "the tensors cover %llu bytes of data but the file holds %llu after the header",
                  (unsigned long long)expect, (unsigned long long)h->data_len);
        goto out;
    }
    memcpy(h->tensors, sorted, n * sizeof(*sorted));
    for (size_t i = 0; i < n; i++) {
        names[i] = (name_key_t){h->tensors[i].name, i};
    }
    qsort(names, n, sizeof(*names), cmp_name);
    h->by_name = calloc(n + 1, sizeof(*h->by_name));
    if (h->by_name == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        h->by_name[i] = names[i].idx;
    }
out:
    free(ord);
    free(sorted);
    free(names);
    return st;
}

mfsdp_status_t mfsdp_st_parse_header(const char *json, size_t header_len, uint64_t file_size,
                                     const char *origin, char *err, size_t errlen,
                                     mfsdp_st_header_t **hdr_p)
{
    MFSDP_CHECK_ARG((json != NULL || header_len == 0) && hdr_p != NULL);
    parse_t p = {origin, err, errlen};
    if (file_size < 8 || header_len > file_size - 8) {
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "header length %zu runs past the end of the %llu-byte file", header_len,
                    (unsigned long long)file_size);
    }
    if (header_len == 0 || json[0] != '{') {
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "the header does not start with '{' (not a safetensors file?)");
    }
    json_error_t je;
    json_t *root = json_loadb(json, header_len, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        char t[SHOW_LEN + 4];
        return fail(origin, err, errlen, MFSDP_ERR_PARSE,
                    "the header is not valid JSON (line %d, column %d): %s", je.line, je.column,
                    show(t, je.text));
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_st_header_t *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    h->header_len = header_len;
    h->data_start = 8 + (uint64_t)header_len;
    h->data_len = file_size - h->data_start;
    if (!json_is_object(root)) {
        st = fail(origin, err, errlen, MFSDP_ERR_PARSE, "the header is not a JSON object");
        goto out;
    }
    size_t count = json_object_size(root);
    h->tensors = calloc(count + 1, sizeof(*h->tensors));
    if (h->tensors == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "__metadata__") != 0) {
            MFSDP_CHECK_GOTO(parse_tensor(&p, key, v, &h->tensors[h->ntensors]), st, out);
            h->ntensors++;
            continue;
        }
        if (!json_is_object(v)) {
            st = fail(origin, err, errlen, MFSDP_ERR_PARSE,
                      "__metadata__ is not an object of strings");
            goto out;
        }
        size_t nm = json_object_size(v);
        h->meta_keys = calloc(nm + 1, sizeof(char *));
        h->meta_vals = calloc(nm + 1, sizeof(char *));
        if (h->meta_keys == NULL || h->meta_vals == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        const char *mk;
        json_t *mv;
        json_object_foreach(v, mk, mv)
        {
            if (!json_is_string(mv)) {
                char s[SHOW_LEN + 4];
                st = fail(origin, err, errlen, MFSDP_ERR_PARSE,
                          "__metadata__: the value of '%s' is not a string", show(s, mk));
                goto out;
            }
            h->meta_keys[h->nmeta] = strdup(mk);
            h->meta_vals[h->nmeta] = strdup(json_string_value(mv));
            h->nmeta++;
            if (h->meta_keys[h->nmeta - 1] == NULL || h->meta_vals[h->nmeta - 1] == NULL) {
                st = MFSDP_ERR_NO_MEMORY;
                goto out;
            }
        }
    }
    MFSDP_CHECK_GOTO(validate_ranges(&p, h), st, out);
    *hdr_p = h;
    h = NULL;
out:
    mfsdp_st_header_free(h);
    json_decref(root);
    return st;
}

mfsdp_status_t mfsdp_st_parse_buffer(const void *file, size_t size, const char *origin, char *err,
                                     size_t errlen, mfsdp_st_header_t **hdr_p)
{
    MFSDP_CHECK_ARG((file != NULL || size == 0) && hdr_p != NULL);
    unsigned char pre[8] = {0};
    uint64_t n;
    if (size >= 8) {
        memcpy(pre, file, 8);
    }
    MFSDP_CHECK(mfsdp_st_parse_prefix(pre, size, origin, err, errlen, &n));
    return mfsdp_st_parse_header((const char *)file + 8, (size_t)n, size, origin, err, errlen,
                                 hdr_p);
}

const mfsdp_st_tensor_t *mfsdp_st_find(const mfsdp_st_header_t *hdr, const char *name)
{
    if (hdr == NULL || name == NULL) {
        return NULL;
    }
    size_t lo = 0, hi = hdr->ntensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const mfsdp_st_tensor_t *t = &hdr->tensors[hdr->by_name[mid]];
        int c = strcmp(name, t->name);
        if (c == 0) {
            return t;
        }
        if (c < 0) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return NULL;
}

const char *mfsdp_st_meta(const mfsdp_st_header_t *hdr, const char *key)
{
    for (size_t i = 0; hdr != NULL && key != NULL && i < hdr->nmeta; i++) {
        if (strcmp(hdr->meta_keys[i], key) == 0) {
            return hdr->meta_vals[i];
        }
    }
    return NULL;
}

/* pread exactly len bytes; 0 ok, else the errno (or -1 for a short read: end of file). */
static int pread_all(int fd, void *dst, size_t len, uint64_t off)
{
    char *d = dst;
    while (len > 0) {
        size_t want = len < IO_CHUNK ? len : IO_CHUNK;
        ssize_t got = pread(fd, d, want, (off_t)off);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            return errno;
        }
        if (got == 0) {
            return -1;
        }
        d += got;
        off += (uint64_t)got;
        len -= (size_t)got;
    }
    return 0;
}

void mfsdp_st_close(mfsdp_st_file_t *f)
{
    if (f == NULL) {
        return;
    }
    if (f->fd >= 0) {
        close(f->fd);
    }
    mfsdp_st_header_free(f->hdr);
    free(f->path);
    free(f);
}

mfsdp_status_t mfsdp_st_open(const char *path, char *err, size_t errlen, mfsdp_st_file_t **f_p)
{
    MFSDP_CHECK_ARG(path != NULL && f_p != NULL);
    mfsdp_status_t st = MFSDP_OK;
    char *json = NULL;
    mfsdp_st_file_t *f = calloc(1, sizeof(*f));
    if (f == NULL || (f->path = strdup(path)) == NULL) {
        free(f);
        return MFSDP_ERR_NO_MEMORY;
    }
    /* O_NONBLOCK: a FIFO (or device) under the name must not block the open; fstat refuses it
     * below, and on a regular file the flag changes nothing. */
    f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f->fd < 0) {
        st = fail(path, err, errlen, errno == ENOENT ? MFSDP_ERR_NOT_FOUND : MFSDP_ERR_IO,
                  "cannot open: %s", strerror(errno));
        goto out;
    }
    struct stat sb;
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = fail(path, err, errlen, MFSDP_ERR_IO, "not a regular file");
        goto out;
    }
    f->size = (uint64_t)sb.st_size;
    unsigned char pre[8] = {0};
    uint64_t n;
    if (f->size >= 8 && pread_all(f->fd, pre, 8, 0) != 0) {
        st = fail(path, err, errlen, MFSDP_ERR_IO, "cannot read the header length");
        goto out;
    }
    MFSDP_CHECK_GOTO(mfsdp_st_parse_prefix(pre, f->size, path, err, errlen, &n), st, out);
    json = malloc((size_t)n + 1);
    if (json == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    int rc = pread_all(f->fd, json, (size_t)n, 8);
    if (rc != 0) {
        st = fail(path, err, errlen, MFSDP_ERR_IO, "cannot read the %llu-byte header: %s",
                  (unsigned long long)n, rc < 0 ? "file shortened while reading" : strerror(rc));
        goto out;
    }
    MFSDP_CHECK_GOTO(mfsdp_st_parse_header(json, (size_t)n, f->size, path, err, errlen, &f->hdr),
                     st, out);
    *f_p = f;
    f = NULL;
out:
    free(json);
    mfsdp_st_close(f);
    return st;
}

mfsdp_status_t mfsdp_st_read(const mfsdp_st_file_t *f, const mfsdp_st_tensor_t *t, uint64_t off,
                             size_t len, void *dst, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(f != NULL && t != NULL && (dst != NULL || len == 0));
    char nm[SHOW_LEN + 4];
    uint64_t span = t->end - t->begin;
    if (off > span || len > span - off) {
        return fail(f->path, err, errlen, MFSDP_ERR_INVALID_ARG,
                    "tensor '%s': read of %zu bytes at %llu is outside its %llu bytes",
                    show(nm, t->name), len, (unsigned long long)off, (unsigned long long)span);
    }
    int rc = pread_all(f->fd, dst, len, f->hdr->data_start + t->begin + off);
    if (rc != 0) {
        return fail(f->path, err, errlen, MFSDP_ERR_IO, "tensor '%s': read failed: %s",
                    show(nm, t->name),
                    rc < 0 ? "the file is shorter than its header says (truncated)" : strerror(rc));
    }
    return MFSDP_OK;
}

/* ---- writing ------------------------------------------------------------------------------ */

mfsdp_status_t mfsdp_st_header_build(const mfsdp_st_entry_t *entries, size_t n,
                                     const char *const *meta_keys, const char *const *meta_vals,
                                     size_t nmeta, char **buf_p, size_t *len_p)
{
    MFSDP_CHECK_ARG((entries != NULL || n == 0) && buf_p != NULL && len_p != NULL);
    MFSDP_CHECK_ARG(nmeta == 0 || (meta_keys != NULL && meta_vals != NULL));
    mfsdp_status_t st = MFSDP_OK;
    char *text = NULL;
    json_t *root = json_object();
    json_t *meta = nmeta != 0 ? json_object() : NULL;
    if (root == NULL || (nmeta != 0 && meta == NULL)) {
        json_decref(meta);
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < nmeta; i++) {
        json_t *s = json_string(meta_vals[i]);
        if (s == NULL || json_object_set_new(meta, meta_keys[i], s) != 0) {
            json_decref(meta);
            MFSDP_WARN("safetensors: metadata '%s' is not valid utf-8", meta_keys[i]);
            st = MFSDP_ERR_INVALID_ARG;
            goto out;
        }
    }
    if (meta != NULL && json_object_set_new(root, "__metadata__", meta) != 0) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const mfsdp_st_entry_t *e = &entries[i];
        size_t esz = mfsdp_st_dtype_size(e->dtype);
        if (e->name == NULL || e->name[0] == '\0' || strcmp(e->name, "__metadata__") == 0 ||
            json_object_get(root, e->name) != NULL || esz == 0 || e->ndim < 0 ||
            e->ndim > MFSDP_ST_MAX_DIMS) {
            MFSDP_WARN("safetensors: entry %zu ('%s'): empty, reserved or duplicate name, bad "
                       "dtype or rank",
                       i, e->name != NULL ? e->name : "(null)");
            st = MFSDP_ERR_INVALID_ARG;
            goto out;
        }
        uint64_t numel = 1;
        int over = 0;
        json_t *shape = json_array();
        json_t *t = json_object();
        json_t *offs = json_array();
        if (shape == NULL || t == NULL || offs == NULL ||
            json_object_set_new(root, e->name, t) != 0) {
            json_decref(shape);
            json_decref(offs);
            json_decref(t);
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        int bad = json_object_set_new(t, "dtype", json_string(mfsdp_st_dtype_name(e->dtype)));
        bad |= json_object_set_new(t, "shape", shape);
        for (int d = 0; d < e->ndim; d++) {
            over |= e->shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)e->shape[d], &numel);
            bad |= json_array_append_new(shape, json_integer(e->shape[d]));
        }
        uint64_t nbytes = 0, end = 0;
        over |= __builtin_mul_overflow(numel, (uint64_t)esz, &nbytes);
        over |= __builtin_add_overflow(off, e->bytes, &end) || end > (uint64_t)INT64_MAX;
        if (over || nbytes != e->bytes) {
            json_decref(offs);
            MFSDP_WARN("safetensors: entry '%s': %llu bytes do not match its shape and dtype %s",
                       e->name, (unsigned long long)e->bytes, mfsdp_st_dtype_name(e->dtype));
            st = MFSDP_ERR_INVALID_ARG;
            goto out;
        }
        bad |= json_array_append_new(offs, json_integer((json_int_t)off));
        bad |= json_array_append_new(offs, json_integer((json_int_t)end));
        bad |= json_object_set_new(t, "data_offsets", offs);
        if (bad) {
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        off = end;
    }
    text = json_dumps(root, JSON_COMPACT);
    if (text == NULL) {
        MFSDP_WARN("safetensors: header serialization failed (a name that is not valid utf-8?)");
        st = MFSDP_ERR_INVALID_ARG;
        goto out;
    }
    size_t len = strlen(text);
    size_t padded = (len + 7) & ~(size_t)7;
    if (padded > MFSDP_ST_MAX_HEADER) {
        MFSDP_WARN("safetensors: header of %zu bytes exceeds the format's limit", padded);
        st = MFSDP_ERR_OVERFLOW;
        goto out;
    }
    char *buf = malloc(8 + padded);
    if (buf == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (int i = 0; i < 8; i++) {
        buf[i] = (char)(((uint64_t)padded >> (8 * i)) & 0xff);
    }
    memcpy(buf + 8, text, len);
    memset(buf + 8 + len, ' ', padded - len);
    *buf_p = buf;
    *len_p = 8 + padded;
out:
    free(text);
    json_decref(root);
    return st;
}

/* A write failure: logged, and copied into the caller's buffer when there is one. */
static mfsdp_status_t werr(const mfsdp_st_write_opts_t *o, mfsdp_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static mfsdp_status_t werr(const mfsdp_st_write_opts_t *o, mfsdp_status_t st, const char *fmt, ...)
{
    char msg[MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    oneline(msg);
    MFSDP_WARN("%s", msg);
    if (o != NULL && o->err != NULL && o->errlen > 0) {
        snprintf(o->err, o->errlen, "%s", msg);
    }
    return st;
}

static mfsdp_status_t write_all(int fd, const void *src, size_t len, const char *path,
                                const mfsdp_st_write_opts_t *o)
{
    const char *s = src;
    while (len > 0) {
        size_t want = len < IO_CHUNK ? len : IO_CHUNK;
        ssize_t put = write(fd, s, want);
        if (put < 0 && errno == EINTR) {
            continue;
        }
        if (put <= 0) {
            return werr(o, MFSDP_ERR_IO, "%s: write failed: %s", path,
                        put < 0 ? strerror(errno) : "no progress");
        }
        s += put;
        len -= (size_t)put;
    }
    return MFSDP_OK;
}

static void point(const mfsdp_st_write_opts_t *o, const char *what, const char *file,
                  const char *key)
{
    if (o != NULL && o->point != NULL) {
        o->point(o->point_arg, what, file, key);
    }
}

mfsdp_status_t mfsdp_st_write(const char *path, const mfsdp_st_entry_t *entries, size_t n,
                              const char *const *meta_keys, const char *const *meta_vals,
                              size_t nmeta, const mfsdp_st_write_opts_t *opts,
                              char sha256_hex[MFSDP_SHA256_HEX], uint64_t *bytes_p)
{
    MFSDP_CHECK_ARG(path != NULL && sha256_hex != NULL);
    for (size_t i = 0; i < n; i++) {
        if (entries[i].data == NULL && entries[i].bytes != 0 &&
            (opts == NULL || opts->fill == NULL)) {
            MFSDP_WARN("safetensors: entry '%s' has no data and there is no fill callback",
                       entries[i].name);
            return MFSDP_ERR_INVALID_ARG;
        }
    }
    char *hdr = NULL, *chunk = NULL, *tmp = NULL;
    size_t hlen = 0;
    int fd = -1;
    mfsdp_sha256_t h = {0};
    uint64_t total = 0;
    mfsdp_status_t st;
    MFSDP_CHECK_GOTO(mfsdp_st_header_build(entries, n, meta_keys, meta_vals, nmeta, &hdr, &hlen),
                     st, out);
    size_t plen = strlen(path);
    tmp = malloc(plen + 5);
    if (tmp == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    MFSDP_CHECK_GOTO(mfsdp_sha256_init(&h), st, out);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = werr(opts, MFSDP_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        goto out;
    }
    point(opts, "open", path, NULL);
    MFSDP_CHECK_GOTO(write_all(fd, hdr, hlen, tmp, opts), st, out_unlink);
    MFSDP_CHECK_GOTO(mfsdp_sha256_update(&h, hdr, hlen), st, out_unlink);
    total = hlen;
    point(opts, "header", path, NULL);
    for (size_t i = 0; i < n; i++) {
        const mfsdp_st_entry_t *e = &entries[i];
        if (e->data != NULL) {
            MFSDP_CHECK_GOTO(write_all(fd, e->data, e->bytes, tmp, opts), st, out_unlink);
            MFSDP_CHECK_GOTO(mfsdp_sha256_update(&h, e->data, e->bytes), st, out_unlink);
        } else {
            if (chunk == NULL && e->bytes != 0 && (chunk = malloc(FILL_CHUNK)) == NULL) {
                st = MFSDP_ERR_NO_MEMORY;
                goto out_unlink;
            }
            for (uint64_t off = 0; off < e->bytes;) {
                size_t len = e->bytes - off < FILL_CHUNK ? (size_t)(e->bytes - off) : FILL_CHUNK;
                MFSDP_CHECK_GOTO(opts->fill(opts->fill_arg, i, off, chunk, len), st, out_unlink);
                MFSDP_CHECK_GOTO(write_all(fd, chunk, len, tmp, opts), st, out_unlink);
                MFSDP_CHECK_GOTO(mfsdp_sha256_update(&h, chunk, len), st, out_unlink);
                off += len;
            }
        }
        total += e->bytes;
        point(opts, "tensor", path, e->name);
    }
    point(opts, "data", path, NULL);
    if (fsync(fd) != 0) {
        st = werr(opts, MFSDP_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    point(opts, "fsync", path, NULL);
    int rc = close(fd);
    fd = -1;
    if (rc != 0) {
        st = werr(opts, MFSDP_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    if (rename(tmp, path) != 0) {
        st = werr(opts, MFSDP_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        goto out_unlink;
    }
    point(opts, "rename", path, NULL);
    MFSDP_CHECK_GOTO(mfsdp_sha256_final(&h, sha256_hex), st, out);
    if (bytes_p != NULL) {
        *bytes_p = total;
    }
    goto out;
out_unlink:
    if (fd >= 0) {
        close(fd);
        fd = -1;
    }
    unlink(tmp);
out:
    if (fd >= 0) {
        close(fd);
    }
    mfsdp_sha256_abort(&h);
    free(chunk);
    free(hdr);
    free(tmp);
    return st;
}
