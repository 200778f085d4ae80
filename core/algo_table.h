/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The measured algorithm table (MFSDP_ALGO_TABLE): which owner-collective algorithm `auto`
 * picks for a group, by collective, world size and buffer size. Written by
 * `mfsdp-perf allgather|reducescatter --tune-out FILE` from its own measurements; read by the
 * runtime at context creation (docs/PERFORMANCE.md, "Algorithm choice").
 *
 * Format: CSV, one rule per line, '#' starts a comment line, blank lines are skipped, and an
 * optional header line `coll,nranks,min_bytes,max_bytes,algo`:
 *
 *   coll       allgather | reducescatter
 *   nranks     the world size the row is for, or -1 for any
 *   min_bytes  smallest buffer (the whole gathered buffer / reduce-scatter input: n blocks)
 *   max_bytes  largest buffer (inclusive), or -1 for no bound
 *   algo       direct | chain | native
 *
 * The first row that matches (coll, world, bytes) wins; no match leaves the built-in rule.
 */
#ifndef MFSDP_CORE_ALGO_TABLE_H
#define MFSDP_CORE_ALGO_TABLE_H

#include <stddef.h>

#include "mfsdp/status.h"
#include "mfsdp/types.h"

typedef struct mfsdp_algo_row {
    int reduce;       /* 0 allgather, 1 reducescatter */
    int nranks;       /* -1: any */
    size_t min_bytes; /* inclusive */
    size_t max_bytes; /* inclusive; SIZE_MAX: no bound */
    mfsdp_algo_t algo;
} mfsdp_algo_row_t;

typedef struct mfsdp_algo_table {
    size_t nrows;
    mfsdp_algo_row_t *rows;
} mfsdp_algo_table_t;

/* Parse a table's text; name is what messages call it (a path). On error, *t is empty and
 * err holds one line naming the line number and what is wrong (MFSDP_ERR_CONFIG). */
mfsdp_status_t mfsdp_algo_table_parse(const char *text, const char *name, mfsdp_algo_table_t *t,
                                      char *err, size_t errlen);
/* Read and parse a file (MFSDP_ERR_IO when it cannot be read). */
mfsdp_status_t mfsdp_algo_table_load(const char *path, mfsdp_algo_table_t *t, char *err,
                                     size_t errlen);
/* The algorithm of the first row matching (reduce, world, bytes): 1, or 0 without one. */
int mfsdp_algo_table_pick(const mfsdp_algo_table_t *t, int reduce, int world, size_t bytes,
                          mfsdp_algo_t *algo_p);
/* One row as a table line (no newline), as the parser reads it back. */
void mfsdp_algo_row_format(const mfsdp_algo_row_t *r, char *buf, size_t len);
void mfsdp_algo_table_free(mfsdp_algo_table_t *t);

/* "direct", "chain", "native" ("auto" for MFSDP_ALGO_AUTO). */
const char *mfsdp_algo_name(mfsdp_algo_t a);

#endif /* MFSDP_CORE_ALGO_TABLE_H */
