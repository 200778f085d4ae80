/* SPDX-License-Identifier: Apache-2.0 */
/*
 * SHA-256 of checkpoint files (docs/checkpoints.md), through OpenSSL's libcrypto EVP API.
 * Digests are handled as 64 lowercase hex characters plus a NUL, the form the checkpoint
 * index stores.
 */
#ifndef MFSDP_CORE_SHA256_H
#define MFSDP_CORE_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "mfsdp/status.h"

#define MFSDP_SHA256_HEX 65 /* 64 hex digits and a NUL */

/* A running digest. Zero-initialized means "not started". */
typedef struct mfsdp_sha256 {
    void *md; /* EVP_MD_CTX */
} mfsdp_sha256_t;

mfsdp_status_t mfsdp_sha256_init(mfsdp_sha256_t *h);
mfsdp_status_t mfsdp_sha256_update(mfsdp_sha256_t *h, const void *data, size_t len);
/* Finish into hex and release the digest (also on failure). */
mfsdp_status_t mfsdp_sha256_final(mfsdp_sha256_t *h, char hex[MFSDP_SHA256_HEX]);
/* Release a digest that will not be finished (NULL or unstarted is fine). */
void mfsdp_sha256_abort(mfsdp_sha256_t *h);

/* One-shot digest of a buffer. */
mfsdp_status_t mfsdp_sha256_buf(const void *data, size_t len, char hex[MFSDP_SHA256_HEX]);

/* Digest of a whole file, and its size; MFSDP_ERR_IO (logged with the path) when it cannot
 * be read. */
mfsdp_status_t mfsdp_sha256_file(const char *path, char hex[MFSDP_SHA256_HEX], uint64_t *bytes_p);

/* 1 when s is 64 lowercase hex digits followed by a NUL. */
int mfsdp_sha256_is_hex(const char *s);

#endif /* MFSDP_CORE_SHA256_H */
