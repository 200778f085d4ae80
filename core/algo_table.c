/* SPDX-License-Identifier: Apache-2.0 */
#include "core/algo_table.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

#define ROW_FIELDS   5
#define LINE_MAX_LEN 512

static const char *const header[ROW_FIELDS] = {"coll", "nranks", "min_bytes", "max_bytes", "algo"};

const char *mfsdp_algo_name(mfsdp_algo_t a)
{
    return a == MFSDP_ALGO_DIRECT   ? "direct"
           : a == MFSDP_ALGO_CHAIN  ? "chain"
           : a == MFSDP_ALGO_NATIVE ? "native"
                                    : "auto";
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r')) {
        s[--n] = '\0';
    }
    return s;
}

/* A decimal integer >= lo that fits in long long, the whole field. */
static int parse_ll(const char *s, long long lo, long long *v)
{
    if (*s == '\0') {
        return -1;
    }
    char *end = NULL;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0' || x < lo) {
        return -1;
    }
    *v = x;
    return 0;
}

/* One non-comment line: 1 row filled, 0 header, -1 error (err set). */
static int parse_line(char *line, const char *name, size_t lineno, mfsdp_algo_row_t *row, char *err,
                      size_t errlen)
{
    char *f[ROW_FIELDS];
    size_t nf = 0;
    for (char *p = line;;) {
        if (nf < ROW_FIELDS) {
            f[nf] = p;
        }
        nf++;
        char *comma = strchr(p, ',');
        if (comma == NULL) {
            break;
        }
        *comma = '\0';
        p = comma + 1;
    }
    if (nf != ROW_FIELDS) {
        SETERR("%s line %zu: expected %d comma-separated fields "
               "(coll,nranks,min_bytes,max_bytes,algo), got %zu",
               name, lineno, ROW_FIELDS, nf);
        return -1;
    }
    int is_header = 1;
    for (size_t i = 0; i < ROW_FIELDS; i++) {
        f[i] = trim(f[i]);
        is_header &= strcmp(f[i], header[i]) == 0;
    }
    if (is_header) {
        return 0;
    }
    if (strcmp(f[0], "allgather") == 0) {
        row->reduce = 0;
    } else if (strcmp(f[0], "reducescatter") == 0) {
        row->reduce = 1;
    } else {
        SETERR("%s line %zu: collective '%s' is not allgather or reducescatter", name, lineno,
               f[0]);
        return -1;
    }
    long long nr, lo, hi;
    if (parse_ll(f[1], -1, &nr) != 0 || nr == 0 || nr > INT32_MAX) {
        SETERR("%s line %zu: nranks '%s' is not a rank count >= 1 or -1 (any)", name, lineno, f[1]);
        return -1;
    }
    if (parse_ll(f[2], 0, &lo) != 0) {
        SETERR("%s line %zu: min_bytes '%s' is not a byte count >= 0", name, lineno, f[2]);
        return -1;
    }
    if (parse_ll(f[3], -1, &hi) != 0 || (hi >= 0 && hi < lo)) {
        SETERR("%s line %zu: max_bytes '%s' is not a byte count >= min_bytes (%lld) or -1 (no "
               "bound)",
               name, lineno, f[3], lo);
        return -1;
    }
    if (strcmp(f[4], "direct") == 0) {
        row->algo = MFSDP_ALGO_DIRECT;
    } else if (strcmp(f[4], "chain") == 0) {
        row->algo = MFSDP_ALGO_CHAIN;
    } else if (strcmp(f[4], "native") == 0) {
        row->algo = MFSDP_ALGO_NATIVE;
    } else {
        SETERR("%s line %zu: algorithm '%s' is not direct, chain or native", name, lineno, f[4]);
        return -1;
    }
    row->nranks = (int)nr;
    row->min_bytes = (size_t)lo;
    row->max_bytes = hi < 0 ? SIZE_MAX : (size_t)hi;
    return 1;
}

mfsdp_status_t mfsdp_algo_table_parse(const char *text, const char *name, mfsdp_algo_table_t *t,
                                      char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(text != NULL && t != NULL);
    memset(t, 0, sizeof(*t));
    if (name == NULL) {
        name = "algorithm table";
    }
    size_t cap = 1;
    for (const char *p = text; *p != '\0'; p++) {
        cap += *p == '\n';
    }
    t->rows = calloc(cap, sizeof(*t->rows));
    if (t->rows == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t lineno = 0;
    for (const char *p = text; *p != '\0';) {
        const char *nl = strchr(p, '\n');
        size_t len = nl != NULL ? (size_t)(nl - p) : strlen(p);
        lineno++;
        char line[LINE_MAX_LEN];
        if (len >= sizeof(line)) {
            SETERR("%s line %zu: longer than %d characters", name, lineno, LINE_MAX_LEN - 1);
            mfsdp_algo_table_free(t);
            return MFSDP_ERR_CONFIG;
        }
        memcpy(line, p, len);
        line[len] = '\0';
        p = nl != NULL ? nl + 1 : p + len;
        char *s = trim(line);
        if (*s == '\0' || *s == '#') {
            continue;
        }
        int r = parse_line(s, name, lineno, &t->rows[t->nrows], err, errlen);
        if (r < 0) {
            mfsdp_algo_table_free(t);
            return MFSDP_ERR_CONFIG;
        }
        if (r == 1) {
            /* The first matching row wins: a row an earlier one covers never applies, and
             * a user who wrote it expects it to. */
            const mfsdp_algo_row_t *j = &t->rows[t->nrows];
            for (size_t i = 0; i < t->nrows; i++) {
                const mfsdp_algo_row_t *e = &t->rows[i];
                if (e->reduce == j->reduce && (e->nranks == -1 || e->nranks == j->nranks) &&
                    e->min_bytes <= j->min_bytes && e->max_bytes >= j->max_bytes) {
                    SETERR("%s line %zu: never used: the table's row %zu, earlier, covers the "
                           "same collective, ranks and sizes (the first matching row wins)",
                           name, lineno, i + 1);
                    mfsdp_algo_table_free(t);
                    return MFSDP_ERR_CONFIG;
                }
            }
        }
        t->nrows += (size_t)r;
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_algo_table_load(const char *path, mfsdp_algo_table_t *t, char *err,
                                     size_t errlen)
{
    MFSDP_CHECK_ARG(path != NULL && t != NULL);
    memset(t, 0, sizeof(*t));
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        SETERR("%s: cannot open: %s", path, strerror(errno));
        return MFSDP_ERR_IO;
    }
    char *text = NULL;
    size_t len = 0, cap = 0;
    mfsdp_status_t st = MFSDP_OK;
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? 2 * cap : 8192;
            char *nt = realloc(text, cap);
            if (nt == NULL) {
                st = MFSDP_ERR_NO_MEMORY;
                break;
            }
            text = nt;
        }
        size_t got = fread(text + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) {
            if (ferror(f)) {
                SETERR("%s: read error", path);
                st = MFSDP_ERR_IO;
            }
            break;
        }
    }
    fclose(f);
    if (st == MFSDP_OK) {
        text[len] = '\0';
        if (memchr(text, '\0', len) != NULL) {
            SETERR("%s: not a text file (NUL byte)", path);
            st = MFSDP_ERR_CONFIG;
        } else {
            st = mfsdp_algo_table_parse(text, path, t, err, errlen);
        }
    }
    free(text);
    return st;
}

int mfsdp_algo_table_pick(const mfsdp_algo_table_t *t, int reduce, int world, size_t bytes,
                          mfsdp_algo_t *algo_p)
{
    for (size_t i = 0; t != NULL && i < t->nrows; i++) {
        const mfsdp_algo_row_t *r = &t->rows[i];
        if (r->reduce == (reduce != 0) && (r->nranks < 0 || r->nranks == world) &&
            bytes >= r->min_bytes && bytes <= r->max_bytes) {
            *algo_p = r->algo;
            return 1;
        }
    }
    return 0;
}

void mfsdp_algo_row_format(const mfsdp_algo_row_t *r, char *buf, size_t len)
{
    char hi[32];
    if (r->max_bytes == SIZE_MAX) {
        snprintf(hi, sizeof(hi), "-1");
    } else {
        snprintf(hi, sizeof(hi), "%zu", r->max_bytes);
    }
    snprintf(buf, len, "%s,%d,%zu,%s,%s", r->reduce ? "reducescatter" : "allgather", r->nranks,
             r->min_bytes, hi, mfsdp_algo_name(r->algo));
}

void mfsdp_algo_table_free(mfsdp_algo_table_t *t)
{
    if (t == NULL) {
        return;
    }
    free(t->rows);
    t->rows = NULL;
    t->nrows = 0;
}
