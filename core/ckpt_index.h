/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Owner checkpoints (docs/checkpoints.md): what goes into which file, and the index.
 *
 * A checkpoint of a plan at world size N is 2N safetensors files plus an index:
 *  - model-RRRRR-of-NNNNN.safetensors (RRRRR = rank, from 0): the whole weights, in the
 *    param dtype, of every tensor rank R owns, plus the sharded-tail tensors it was given to
 *    write (each gathered whole onto one writer, largest first onto the rank with the fewest
 *    model bytes, ties to the lowest rank). Keys are the param names, so every model file is
 *    an ordinary state-dict shard;
 *  - optim-RRRRR-of-NNNNN.safetensors: fp32 optimizer state of rank R, keys
 *    "<name>.master" (fp32 master weights; only when the param dtype is not float32: an
 *    fp32 master is bit-identical to its weight), "<name>.momentum" (Muon),
 *    "<name>.exp_avg" and "<name>.exp_avg_sq" (AdamW m and v). Owned tensors are whole; a
 *    sharded-tail tensor contributes rank R's real rows [R*c, min((R+1)*c, N0)) with
 *    c = ceil(N0 / N) (no padding rows), shape [rows, dims 1..]. The file's
 *    "mfsdp.rows" metadata maps each key to its [first, end) rows of the whole tensor.
 *  - model.safetensors.index.json: Hugging Face's index ({"metadata": {"total_size"},
 *    "weight_map": {name: file}}) plus "mfsdp": format version, world size, step counters,
 *    resolved hyper-parameters, tail policy, owners, writers and per-tensor optimizer step
 *    counts, each file's size and
 *    SHA-256, and the manifest (canonical mfsdp-manifest/1). The text starts with
 *    {"index_sha256": "<64 hex>", and that digest covers every byte after that prefix, so
 *    any change to the index itself is detected.
 * Where everything is is a pure function of (manifest, world size, owners, writers): the
 * layout below, used identically by writers and readers.
 */
#ifndef MFSDP_CORE_CKPT_INDEX_H
#define MFSDP_CORE_CKPT_INDEX_H

#include "core/safetensors.h"
#include "mfsdp/plan.h"

#define MFSDP_CKPT_FORMAT      "mfsdp-ckpt/1"
#define MFSDP_CKPT_FULL_FORMAT "mfsdp-full/1"
#define MFSDP_CKPT_INDEX_NAME  "model.safetensors.index.json"
#define MFSDP_CKPT_LATEST_NAME "latest"
#define MFSDP_CKPT_FILE_LEN    64 /* room for "optim-RRRRR-of-NNNNN.safetensors" and more */

typedef enum mfsdp_ckpt_state {
    MFSDP_CKPT_WEIGHT = 0,     /* param dtype, model file */
    MFSDP_CKPT_MASTER = 1,     /* fp32 master, only for params that are not float32 */
    MFSDP_CKPT_MOMENTUM = 2,   /* Muon momentum (trainable Muon params) */
    MFSDP_CKPT_EXP_AVG = 3,    /* AdamW m (trainable AdamW params) */
    MFSDP_CKPT_EXP_AVG_SQ = 4, /* AdamW v */
    MFSDP_CKPT_NSTATES
} mfsdp_ckpt_state_t;

typedef enum mfsdp_ckpt_kind {
    MFSDP_CKPT_MODEL = 0,
    MFSDP_CKPT_OPTIM = 1,
} mfsdp_ckpt_kind_t;

const char *mfsdp_ckpt_state_name(mfsdp_ckpt_state_t s); /* "weight", "master", ... */
const char *mfsdp_ckpt_kind_name(mfsdp_ckpt_kind_t k);   /* "model", "optim" */
/* "model-00003-of-00008.safetensors" */
void mfsdp_ckpt_file_name(char *buf, size_t len, mfsdp_ckpt_kind_t kind, int rank, int world);

/* Where every tensor of a manifest lives in a checkpoint at world size `world`. */
typedef struct mfsdp_ckpt_layout {
    const mfsdp_manifest_t *manifest; /* borrowed */
    int world;
    size_t ntensors;                   /* params, in (group, param) order */
    const mfsdp_param_desc_t **params; /* ntensors */
    size_t *group;                     /* group index of each */
    int *owner;                        /* rank, or MFSDP_OWNER_SHARDED */
    int *writer;                       /* rank whose model file holds the weight */
    int64_t *rows;                     /* shape[0] */
    int64_t *rest;                     /* product of the other dims (1 for 1-D) */
    int64_t *c;                        /* ceil(rows / world): sharded rows per rank */
} mfsdp_ckpt_layout_t;

/* owner: one entry per param (e.g. from a plan); writer: NULL to compute the balanced
 * assignment, or one entry per param (must equal the owner for owned tensors). */
mfsdp_status_t mfsdp_ckpt_layout_create(const mfsdp_manifest_t *manifest, int world,
                                        const int *owner, const int *writer,
                                        mfsdp_ckpt_layout_t **layout_p);
/* The layout of a plan (its owners, balanced writers). */
mfsdp_status_t mfsdp_ckpt_layout_of_plan(const mfsdp_plan_t *plan, mfsdp_ckpt_layout_t **layout_p);
void mfsdp_ckpt_layout_destroy(mfsdp_ckpt_layout_t *layout);

/* 1 when tensor t has state s in a checkpoint (by its dtype, role and requires_grad). */
int mfsdp_ckpt_has_state(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s);
/* Safetensors dtype of a stored state (the param dtype for the weight, F32 otherwise). */
mfsdp_st_dtype_t mfsdp_ckpt_state_dtype(const mfsdp_ckpt_layout_t *lay, size_t t,
                                        mfsdp_ckpt_state_t s);
/* Key of a state in its file: the name, or name + ".master" etc. (malloc'd). */
char *mfsdp_ckpt_key(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s);

/* One tensor in one rank's file. */
typedef struct mfsdp_ckpt_item {
    size_t tensor;
    mfsdp_ckpt_state_t state;
    mfsdp_ckpt_kind_t kind;
    int64_t row_begin; /* rows of the whole tensor this item holds */
    int64_t row_end;
    mfsdp_st_dtype_t dtype;
    int ndim;
    int64_t shape[MFSDP_MAX_DIMS]; /* [row_end - row_begin, dims 1..] */
    uint64_t bytes;
    char *key;
} mfsdp_ckpt_item_t;

/* Items of rank's two files: the model file's first, then the optim file's, each in
 * tensor order and, per tensor, state order. */
mfsdp_status_t mfsdp_ckpt_rank_items(const mfsdp_ckpt_layout_t *lay, int rank,
                                     mfsdp_ckpt_item_t **items_p, size_t *n_p);
void mfsdp_ckpt_items_free(mfsdp_ckpt_item_t *items, size_t n);

/* A stored tensor that holds rows [row_begin, row_end) of one state. */
typedef struct mfsdp_ckpt_piece {
    int rank;
    mfsdp_ckpt_kind_t kind;
    mfsdp_ckpt_state_t state; /* as stored: WEIGHT for the master of a float32 param */
    int64_t row_begin;
    int64_t row_end;
} mfsdp_ckpt_piece_t;

/* The pieces covering rows [a, b) of state s of tensor t (s must exist, or be MASTER:
 * then the weight of a float32 param); writes at most cap pieces, returns how many exist. */
size_t mfsdp_ckpt_pieces(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s, int64_t a,
                         int64_t b, mfsdp_ckpt_piece_t *out, size_t cap);

/* ---- the index ----------------------------------------------------------------------------- */

typedef struct mfsdp_ckpt_file_info {
    char name[MFSDP_CKPT_FILE_LEN];
    int rank;
    mfsdp_ckpt_kind_t kind;
    uint64_t bytes;
    char sha256[MFSDP_SHA256_HEX];
} mfsdp_ckpt_file_info_t;

/* Counters and settings a checkpoint records besides tensors. */
typedef struct mfsdp_ckpt_meta {
    int64_t step;             /* max over groups of nsteps (the name of the checkpoint) */
    uint64_t ctx_steps;       /* the context's group-step counter */
    mfsdp_tail_policy_t tail; /* tail policy the plan was made with */
    mfsdp_hparams_t hp;       /* resolved hyper-parameters (environment overrides applied) */
    size_t ngroups;
    int64_t *group_nsteps; /* per manifest group: optimizer steps run (the schedule's t) */
    /* Per tensor, in (group, param) order: optimizer steps that tensor took (AdamW's t; torch
     * counts per param and skips a param without gradient, so it may be below its group's).
     * NULL when writing means "its group's count" for every tensor. */
    int64_t *tensor_nsteps;
} mfsdp_ckpt_meta_t;

typedef struct mfsdp_ckpt_index {
    char index_sha256[MFSDP_SHA256_HEX];
    mfsdp_ckpt_meta_t meta;
    mfsdp_manifest_t *manifest;  /* owned */
    mfsdp_ckpt_layout_t *layout; /* over manifest, at the checkpoint's world size */
    size_t nfiles;               /* 2 * world: model files then optim files, by rank */
    mfsdp_ckpt_file_info_t *files;
} mfsdp_ckpt_index_t;

/* Index of file (kind, rank) in mfsdp_ckpt_index_t::files. */
static inline size_t mfsdp_ckpt_file_slot(int world, mfsdp_ckpt_kind_t kind, int rank)
{
    return (size_t)kind * (size_t)world + (size_t)rank;
}

/* The index text for a layout (files: 2 * world entries in file-slot order). */
mfsdp_status_t mfsdp_ckpt_index_text(const mfsdp_ckpt_layout_t *lay, const mfsdp_ckpt_meta_t *meta,
                                     const mfsdp_ckpt_file_info_t *files, char **text_p,
                                     size_t *len_p);
/* Parse and check an index (its self digest, its structure, its agreement with the layout
 * the stored manifest and owners imply). Errors name origin and the JSON path. */
mfsdp_status_t mfsdp_ckpt_index_parse(const char *text, size_t len, const char *origin, char *err,
                                      size_t errlen, mfsdp_ckpt_index_t **index_p);
void mfsdp_ckpt_index_free(mfsdp_ckpt_index_t *index);
void mfsdp_ckpt_meta_clear(mfsdp_ckpt_meta_t *meta);

/* Metadata written into every checkpoint file (keys and values malloc'd; free with
 * mfsdp_ckpt_file_meta_free). items: that file's items. */
mfsdp_status_t mfsdp_ckpt_file_meta(const mfsdp_ckpt_layout_t *lay, const mfsdp_ckpt_meta_t *meta,
                                    mfsdp_ckpt_kind_t kind, int rank,
                                    const mfsdp_ckpt_item_t *items, size_t nitems, char ***keys_p,
                                    char ***vals_p, size_t *n_p);
void mfsdp_ckpt_file_meta_free(char **keys, char **vals, size_t n);

#endif /* MFSDP_CORE_CKPT_INDEX_H */
