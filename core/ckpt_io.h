/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Checkpoint directories on disk (docs/checkpoints.md): the crash-safe write protocol, the
 * reader and the verifier. Used by the runtime (save and load of a context) and offline by
 * tools/mfsdp-ckpt.
 *
 * Layout: a checkpoint root ROOT holds one directory per checkpoint, ROOT/step-SSSSSSSS
 * (S = optimizer steps; "-K" appended when that name exists), and ROOT/latest, one line
 * "<directory name> <index_sha256>". A save writes everything into ROOT/<name>.partial:
 * each file to "<file>.tmp", fsync, rename; each rank then records its files' sizes and
 * digests in rank-RRRRR.done the same way. The commit (one writer) writes the index the
 * same way, removes the .done records, fsyncs the directory, renames it to ROOT/<name>,
 * fsyncs ROOT, and finally replaces ROOT/latest (tmp, fsync, rename, fsync ROOT). So at any
 * crash point ROOT/latest names a complete, fsynced checkpoint (the previous or the new
 * one), and no complete-looking directory ever holds partial data; a leftover *.partial
 * directory is refused by readers and removed by the next save.
 */
#ifndef MFSDP_CORE_CKPT_IO_H
#define MFSDP_CORE_CKPT_IO_H

#include "core/ckpt_index.h"

#define MFSDP_CKPT_PARTIAL_SUFFIX ".partial"
#define MFSDP_CKPT_NAME_LEN       64

/* Progress points (the safetensors writer's, plus the protocol's own), for crash tests. */
typedef mfsdp_st_point_fn mfsdp_ckpt_point_fn;

typedef struct mfsdp_ckpt_hook {
    mfsdp_ckpt_point_fn fn;
    void *arg;
} mfsdp_ckpt_hook_t;

/* ---- reading ------------------------------------------------------------------------------- */

typedef struct mfsdp_ckpt_reader {
    char *dir; /* the checkpoint directory */
    mfsdp_ckpt_index_t *index;
    mfsdp_st_file_t **files; /* index->nfiles, opened on first use */
    size_t nopen;            /* files open now (bounded: see ckpt_io.c) */
    uint64_t bytes_read;     /* tensor bytes read so far */
} mfsdp_ckpt_reader_t;

/* Open a checkpoint: PATH is a checkpoint directory (it holds the index) or a root (it holds
 * `latest`). The index is parsed and checked, and when reached through `latest`, its digest
 * must be the one `latest` records. Directories named *.partial are refused. */
mfsdp_status_t mfsdp_ckpt_reader_open(const char *path, char *err, size_t errlen,
                                      mfsdp_ckpt_reader_t **reader_p);
void mfsdp_ckpt_reader_close(mfsdp_ckpt_reader_t *r);

/* Rows [a, b) of state s of tensor t, as stored (param dtype for the weight, F32 for the
 * rest; MASTER of a float32 param reads the weight), into dst (contiguous rows). Every
 * stored piece is checked against the layout (key present, dtype, shape) first. */
mfsdp_status_t mfsdp_ckpt_read_rows(mfsdp_ckpt_reader_t *r, size_t t, mfsdp_ckpt_state_t s,
                                    int64_t a, int64_t b, void *dst, char *err, size_t errlen);

/* Bytes [off, off + len) of state s of tensor t (the whole tensor, row-major, as stored). */
mfsdp_status_t mfsdp_ckpt_read_range(mfsdp_ckpt_reader_t *r, size_t t, mfsdp_ckpt_state_t s,
                                     uint64_t off, uint64_t len, void *dst, char *err,
                                     size_t errlen);

/* Check file f: its size and SHA-256 against the index (when check_sha), its header
 * (parsed strictly), its tensors exactly those the layout places there (keys, dtypes,
 * shapes, nothing else) and its metadata. */
mfsdp_status_t mfsdp_ckpt_verify_file(mfsdp_ckpt_reader_t *r, size_t f, int check_sha, char *err,
                                      size_t errlen);

/* ---- writing ------------------------------------------------------------------------------- */

/* Create ROOT (if needed), remove stale *.partial directories, pick a free name for a
 * checkpoint at `step` and create ROOT/<name>.partial. name receives <name>. */
mfsdp_status_t mfsdp_ckpt_begin(const char *root, int64_t step, char *name, size_t namelen,
                                char *err, size_t errlen);

/* ROOT/<name>.partial (malloc'd). */
char *mfsdp_ckpt_partial_path(const char *root, const char *name);

/* Write rank's two files into the partial directory and its .done record. data: one pointer
 * per item (or NULL: fill(fill_arg, item index, offset, buf, len) produces the bytes).
 * files[0..1] receive the model and optim file descriptions. */
mfsdp_status_t mfsdp_ckpt_write_rank(const char *partial, const mfsdp_ckpt_layout_t *lay,
                                     const mfsdp_ckpt_meta_t *meta, int rank,
                                     const mfsdp_ckpt_item_t *items, size_t nitems,
                                     const void *const *data, mfsdp_st_fill_fn fill, void *fill_arg,
                                     const mfsdp_ckpt_hook_t *hook,
                                     mfsdp_ckpt_file_info_t files[2]);

/* Best effort: record in the partial directory that rank's write failed. */
void mfsdp_ckpt_write_failed(const char *partial, int rank, const char *why);

/* State of rank's record in the partial directory: 0 not yet, 1 done (files[0..1] filled
 * and checked against the layout's names), -1 the rank recorded a failure. */
mfsdp_status_t mfsdp_ckpt_poll_rank(const char *partial, const mfsdp_ckpt_layout_t *lay, int rank,
                                    mfsdp_ckpt_file_info_t files[2], int *state_p);

/* Commit: index into the partial directory, records removed, directory renamed to
 * ROOT/<name>, ROOT/latest replaced; each step durable before the next. */
mfsdp_status_t mfsdp_ckpt_commit(const char *root, const char *name, const char *index_text,
                                 size_t index_len, const char *index_sha256, int world,
                                 const mfsdp_ckpt_hook_t *hook);

/* fsync a directory. */
mfsdp_status_t mfsdp_ckpt_fsync_dir(const char *dir);

#endif /* MFSDP_CORE_CKPT_IO_H */
