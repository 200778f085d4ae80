/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Test-only surgery on checkpoint files (tests/unit/test_ckpt_index.c, tests/mpi/test_ckpt.c):
 * read and write whole files, and "re-seal" a checkpoint after editing one of its files:
 * the file's size and SHA-256 in the index, the index's own digest and `latest` are
 * recomputed, so that what refuses the edit is the header and layout checks rather than
 * the checksums. Functions return 0 on success, -1 (with a message on stderr) otherwise.
 */
#ifndef MFSDP_TESTS_CKPT_UTIL_H
#define MFSDP_TESTS_CKPT_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/ckpt_index.h"
#include "core/sha256.h"

static inline char *ckpt_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "ckpt_util: cannot open %s\n", path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b == NULL || fread(b, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(b);
        return NULL;
    }
    b[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return b;
}

static inline int ckpt_spit(const char *path, const char *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(b, 1, n, f) != n) {
        fprintf(stderr, "ckpt_util: cannot write %s\n", path);
        if (f != NULL) {
            fclose(f);
        }
        return -1;
    }
    return fclose(f) == 0 ? 0 : -1;
}

/* Recompute an index text's self digest in place. */
static inline int ckpt_redigest(char *text, size_t len)
{
    const size_t pre = strlen("{\"index_sha256\": \"");
    char hex[MFSDP_SHA256_HEX];
    if (len < pre + 66 || mfsdp_sha256_buf(text + pre + 66, len - pre - 66, hex) != MFSDP_OK) {
        return -1;
    }
    memcpy(text + pre, hex, 64);
    return 0;
}

/* After editing file `name` of checkpoint directory `dir` (under `root`), recompute its size
 * (which must keep its digit count) and digest in the index, the index digest, `latest`. */
static inline int ckpt_reseal(const char *root, const char *dir, const char *name)
{
    char path[4200], ipath[4200], lpath[4200];
    if (strlen(dir) > 4000 || strlen(root) > 4000 || strlen(name) > 150) {
        return -1;
    }
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    snprintf(ipath, sizeof(ipath), "%s/" MFSDP_CKPT_INDEX_NAME, dir);
    snprintf(lpath, sizeof(lpath), "%s/" MFSDP_CKPT_LATEST_NAME, root);
    size_t len;
    char *text = ckpt_slurp(ipath, &len);
    if (text == NULL) {
        return -1;
    }
    int rc = -1;
    char key[160];
    snprintf(key, sizeof(key), "\"name\": \"%s\"", name);
    char *entry = strstr(text, key);
    char *sha = entry != NULL ? strstr(entry, "\"sha256\": \"") : NULL;
    char *b = entry != NULL ? strstr(entry, "\"bytes\": ") : NULL;
    char hex[MFSDP_SHA256_HEX];
    uint64_t bytes = 0;
    if (sha == NULL || b == NULL || b > sha || mfsdp_sha256_file(path, hex, &bytes) != MFSDP_OK) {
        fprintf(stderr, "ckpt_util: %s: no entry for %s\n", ipath, name);
        goto out;
    }
    memcpy(sha + strlen("\"sha256\": \""), hex, 64);
    b += strlen("\"bytes\": ");
    char num[32];
    int nd = snprintf(num, sizeof(num), "%llu", (unsigned long long)bytes);
    if ((size_t)nd != strspn(b, "0123456789")) {
        fprintf(stderr, "ckpt_util: %s changed its size's digit count\n", name);
        goto out;
    }
    memcpy(b, num, (size_t)nd);
    if (ckpt_redigest(text, len) != 0 || ckpt_spit(ipath, text, len) != 0) {
        goto out;
    }
    const char *slash = strrchr(dir, '/');
    char line[200];
    int n = snprintf(line, sizeof(line), "%s %.64s\n", slash != NULL ? slash + 1 : dir,
                     text + strlen("{\"index_sha256\": \""));
    rc = ckpt_spit(lpath, line, (size_t)n);
out:
    free(text);
    return rc;
}

/* Replace the first occurrence of `from` in the header of safetensors file `path` by `to`
 * (same length). */
static inline int ckpt_edit_header(const char *path, const char *from, const char *to)
{
    size_t len;
    char *b = ckpt_slurp(path, &len);
    if (b == NULL || len < 8 || strlen(from) != strlen(to)) {
        free(b);
        return -1;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) {
        n = n << 8 | (unsigned char)b[i];
    }
    int rc = -1;
    if (n <= len - 8) {
        char *hdr = malloc((size_t)n + 1);
        memcpy(hdr, b + 8, (size_t)n);
        hdr[n] = '\0';
        char *at = strstr(hdr, from);
        if (at != NULL) {
            memcpy(b + 8 + (at - hdr), to, strlen(to));
            rc = ckpt_spit(path, b, len);
        } else {
            fprintf(stderr, "ckpt_util: '%s' not in the header of %s\n", from, path);
        }
        free(hdr);
    }
    free(b);
    return rc;
}

#endif /* MFSDP_TESTS_CKPT_UTIL_H */
