/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The safetensors file format (github.com/huggingface/safetensors, "Format"): an 8-byte
 * little-endian header length N, N bytes of UTF-8 JSON, then the byte buffer. The JSON
 * object maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte
 * offsets relative to the start of the buffer, end exclusive); the optional key
 * "__metadata__" holds a string-to-string map. Data is little-endian, row-major, packed.
 *
 * The reader is strict and treats every file as hostile: the header length is bounded
 * (100,000,000 bytes, as the reference implementation) and must fit the file, the JSON
 * must be an object without duplicate keys, every tensor must have exactly those three
 * keys, a known dtype, non-negative integer dims and offsets, and shape x dtype size equal
 * to its byte range; the ranges, sorted, must tile the buffer from 0 to its end exactly
 * (no overlap, no hole, nothing after the last tensor). Every error is one line naming the
 * file (origin) and, where there is one, the tensor.
 *
 * The writer emits the header compactly, padded with spaces to a multiple of 8 bytes (so
 * the buffer starts 8-byte aligned), tensors in the order given, and writes a file through
 * a temporary name, fsync and rename, hashing (SHA-256) exactly the bytes written.
 */
#ifndef MFSDP_CORE_SAFETENSORS_H
#define MFSDP_CORE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/sha256.h"
#include "mfsdp/types.h"

#define MFSDP_ST_MAX_HEADER 100000000ULL /* largest header accepted (bytes) */
#define MFSDP_ST_MAX_DIMS   16           /* most dimensions a tensor may have here */

/* The dtypes of the format. */
typedef enum mfsdp_st_dtype {
    MFSDP_ST_BOOL,
    MFSDP_ST_U8,
    MFSDP_ST_I8,
    MFSDP_ST_F8_E5M2,
    MFSDP_ST_F8_E4M3,
    MFSDP_ST_I16,
    MFSDP_ST_U16,
    MFSDP_ST_F16,
    MFSDP_ST_BF16,
    MFSDP_ST_I32,
    MFSDP_ST_U32,
    MFSDP_ST_F32,
    MFSDP_ST_F64,
    MFSDP_ST_I64,
    MFSDP_ST_U64,
    MFSDP_ST_DTYPE_COUNT
} mfsdp_st_dtype_t;

const char *mfsdp_st_dtype_name(mfsdp_st_dtype_t dt); /* "F32"...; "invalid" */
size_t mfsdp_st_dtype_size(mfsdp_st_dtype_t dt);      /* bytes per element; 0 if invalid */
/* mfsdp's param dtypes (float32/bfloat16/float16) and the format's F32/BF16/F16. */
mfsdp_status_t mfsdp_st_dtype_of(mfsdp_dtype_t dt, mfsdp_st_dtype_t *st_p);
mfsdp_status_t mfsdp_st_dtype_to(mfsdp_st_dtype_t st, mfsdp_dtype_t *dt_p);

/* One tensor of a parsed header. */
typedef struct mfsdp_st_tensor {
    char *name;
    mfsdp_st_dtype_t dtype;
    int ndim;
    int64_t shape[MFSDP_ST_MAX_DIMS];
    uint64_t numel;
    uint64_t begin; /* bytes, relative to the start of the buffer */
    uint64_t end;   /* exclusive */
} mfsdp_st_tensor_t;

/* A parsed, validated header. */
typedef struct mfsdp_st_header {
    uint64_t header_len; /* N */
    uint64_t data_start; /* 8 + N: file offset of the buffer */
    uint64_t data_len;   /* bytes of the buffer */
    size_t ntensors;
    mfsdp_st_tensor_t *tensors; /* in buffer order (ascending begin) */
    size_t *by_name;            /* indices into tensors, sorted by name */
    size_t nmeta;
    char **meta_keys; /* __metadata__, in document order */
    char **meta_vals;
} mfsdp_st_header_t;

/* The header length N from a file's first 8 bytes, checked against the bound and the file
 * size. */
mfsdp_status_t mfsdp_st_parse_prefix(const unsigned char prefix[8], uint64_t file_size,
                                     const char *origin, char *err, size_t errlen,
                                     uint64_t *header_len_p);
/* Parse and validate the N header bytes of a file of file_size bytes. */
mfsdp_status_t mfsdp_st_parse_header(const char *json, size_t header_len, uint64_t file_size,
                                     const char *origin, char *err, size_t errlen,
                                     mfsdp_st_header_t **hdr_p);
/* Both, on a whole file held in memory. */
mfsdp_status_t mfsdp_st_parse_buffer(const void *file, size_t size, const char *origin, char *err,
                                     size_t errlen, mfsdp_st_header_t **hdr_p);
void mfsdp_st_header_free(mfsdp_st_header_t *hdr);

/* Lookups; NULL when absent. */
const mfsdp_st_tensor_t *mfsdp_st_find(const mfsdp_st_header_t *hdr, const char *name);
const char *mfsdp_st_meta(const mfsdp_st_header_t *hdr, const char *key);

/* An open file: its header parsed, its data read with positioned reads. */
typedef struct mfsdp_st_file {
    char *path;
    int fd;
    uint64_t size;
    mfsdp_st_header_t *hdr;
} mfsdp_st_file_t;

mfsdp_status_t mfsdp_st_open(const char *path, char *err, size_t errlen, mfsdp_st_file_t **f_p);
/* Read len bytes at offset off of tensor t's data into dst. */
mfsdp_status_t mfsdp_st_read(const mfsdp_st_file_t *f, const mfsdp_st_tensor_t *t, uint64_t off,
                             size_t len, void *dst, char *err, size_t errlen);
void mfsdp_st_close(mfsdp_st_file_t *f);

/* ---- writing ---------------------------------------------------------------------------- */

/* One tensor to write: its bytes come from data, or from the writer's fill callback when
 * data is NULL. */
typedef struct mfsdp_st_entry {
    const char *name;
    mfsdp_st_dtype_t dtype;
    int ndim;
    int64_t shape[MFSDP_ST_MAX_DIMS];
    uint64_t bytes; /* must equal prod(shape) * dtype size */
    const void *data;
} mfsdp_st_entry_t;

/* Produce len bytes of entry's data starting at byte off into buf. */
typedef mfsdp_status_t (*mfsdp_st_fill_fn)(void *arg, size_t entry, uint64_t off, void *buf,
                                           size_t len);
/* Progress points of a write, for tests that kill the writer at each of them: what is
 * "open", "header", "tensor" (after each tensor's bytes; key = its name), "data", "fsync",
 * "rename"; file is the final path. */
typedef void (*mfsdp_st_point_fn)(void *arg, const char *what, const char *file, const char *key);

typedef struct mfsdp_st_write_opts {
    mfsdp_st_fill_fn fill;
    void *fill_arg;
    mfsdp_st_point_fn point;
    void *point_arg;
    char *err; /* may be NULL: receives a one-line message on failure */
    size_t errlen;
} mfsdp_st_write_opts_t;

/* The 8-byte length and the padded JSON header of a file holding entries (malloc'd). */
mfsdp_status_t mfsdp_st_header_build(const mfsdp_st_entry_t *entries, size_t n,
                                     const char *const *meta_keys, const char *const *meta_vals,
                                     size_t nmeta, char **buf_p, size_t *len_p);

/* Write path through path + ".tmp": header, data, fsync, rename (the caller fsyncs the
 * directory). sha256_hex and bytes_p (may be NULL) receive the digest and size of exactly
 * what was written. On failure the temporary file is removed. */
mfsdp_status_t mfsdp_st_write(const char *path, const mfsdp_st_entry_t *entries, size_t n,
                              const char *const *meta_keys, const char *const *meta_vals,
                              size_t nmeta, const mfsdp_st_write_opts_t *opts,
                              char sha256_hex[MFSDP_SHA256_HEX], uint64_t *bytes_p);

#endif /* MFSDP_CORE_SAFETENSORS_H */
