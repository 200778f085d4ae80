/* SPDX-License-Identifier: Apache-2.0 */
#include "core/sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/checks.h"

#define FILE_CHUNK ((size_t)4 << 20)

mfsdp_status_t mfsdp_sha256_init(mfsdp_sha256_t *h)
{
    MFSDP_CHECK_ARG(h != NULL);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (md == NULL) {
        MFSDP_WARN("sha256: cannot allocate a digest context");
        return MFSDP_ERR_NO_MEMORY;
    }
    if (EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        MFSDP_WARN("sha256: EVP_DigestInit_ex failed");
        return MFSDP_ERR_INTERNAL;
    }
    h->md = md;
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_sha256_update(mfsdp_sha256_t *h, const void *data, size_t len)
{
    MFSDP_CHECK_ARG(h != NULL && h->md != NULL && (data != NULL || len == 0));
    if (len != 0 && EVP_DigestUpdate(h->md, data, len) != 1) {
        MFSDP_WARN("sha256: EVP_DigestUpdate failed");
        return MFSDP_ERR_INTERNAL;
    }
    return MFSDP_OK;
}

static void to_hex(const unsigned char *d, unsigned n, char *hex)
{
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < n; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[2 * n] = '\0';
}

mfsdp_status_t mfsdp_sha256_final(mfsdp_sha256_t *h, char hex[MFSDP_SHA256_HEX])
{
    MFSDP_CHECK_ARG(h != NULL && h->md != NULL && hex != NULL);
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned n = 0;
    int ok = EVP_DigestFinal_ex(h->md, d, &n) == 1 && n == 32;
    EVP_MD_CTX_free(h->md);
    h->md = NULL;
    if (!ok) {
        MFSDP_WARN("sha256: EVP_DigestFinal_ex failed");
        return MFSDP_ERR_INTERNAL;
    }
    to_hex(d, n, hex);
    return MFSDP_OK;
}

void mfsdp_sha256_abort(mfsdp_sha256_t *h)
{
    if (h != NULL && h->md != NULL) {
        EVP_MD_CTX_free(h->md);
        h->md = NULL;
    }
}

mfsdp_status_t mfsdp_sha256_buf(const void *data, size_t len, char hex[MFSDP_SHA256_HEX])
{
    mfsdp_sha256_t h = {0};
    MFSDP_CHECK(mfsdp_sha256_init(&h));
    mfsdp_status_t st = mfsdp_sha256_update(&h, data, len);
    if (st != MFSDP_OK) {
        mfsdp_sha256_abort(&h);
        return st;
    }
    return mfsdp_sha256_final(&h, hex);
}

mfsdp_status_t mfsdp_sha256_file(const char *path, char hex[MFSDP_SHA256_HEX], uint64_t *bytes_p)
{
    MFSDP_CHECK_ARG(path != NULL && hex != NULL);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        MFSDP_WARN("%s: cannot open: %m", path);
        return MFSDP_ERR_IO;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_sha256_t h = {0};
    char *buf = malloc(FILE_CHUNK);
    uint64_t total = 0;
    if (buf == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    MFSDP_CHECK_GOTO(mfsdp_sha256_init(&h), st, out);
    for (;;) {
        ssize_t got = read(fd, buf, FILE_CHUNK);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            MFSDP_WARN("%s: read failed: %m", path);
            st = MFSDP_ERR_IO;
            goto out;
        }
        if (got == 0) {
            break;
        }
        MFSDP_CHECK_GOTO(mfsdp_sha256_update(&h, buf, (size_t)got), st, out);
        total += (uint64_t)got;
    }
    MFSDP_CHECK_GOTO(mfsdp_sha256_final(&h, hex), st, out);
    if (bytes_p != NULL) {
        *bytes_p = total;
    }
out:
    mfsdp_sha256_abort(&h);
    free(buf);
    close(fd);
    return st;
}

int mfsdp_sha256_is_hex(const char *s)
{
    if (s == NULL) {
        return 0;
    }
    for (int i = 0; i < 64; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) {
            return 0;
        }
    }
    return s[64] == '\0';
}
