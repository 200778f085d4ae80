/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target for the safetensors header parser (scripts/fuzz.sh safetensors). The
 * input is a whole file. Beyond "no crash, no leak, no UB" it checks the parser's contract:
 *  - a rejection leaves the output alone and gives one line that starts with the origin;
 *  - an accepted header describes tensors that tile the data exactly (sorted, contiguous,
 *    each byte range = numel x dtype size), every name is found by lookup;
 *  - the writer, given the parsed tensors and metadata, produces a header that parses back
 *    to the same tensors (names, dtypes, shapes, sizes) and metadata.
 * A broken property aborts, which libFuzzer records as a crash with its input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define POISON ((mfsdp_st_header_t *)(uintptr_t)0x5a5a5a5a)

static void broken(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_safetensors: %s: %s\n", what, detail);
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("MFSDP_DEBUG", "NONE", 0); /* every rejection would print a warning otherwise */
    return 0;
}

static void check_accepted(const mfsdp_st_header_t *h, size_t size)
{
    if (h->data_start > size || h->data_len != size - h->data_start) {
        broken("data section", "start/length do not match the file");
    }
    uint64_t expect = 0;
    for (size_t i = 0; i < h->ntensors; i++) {
        const mfsdp_st_tensor_t *t = &h->tensors[i];
        if (t->begin != expect || t->end < t->begin || t->end > h->data_len) {
            broken("tiling", t->name);
        }
        if (t->end - t->begin != t->numel * mfsdp_st_dtype_size(t->dtype)) {
            broken("size", t->name);
        }
        if (mfsdp_st_find(h, t->name) != t) {
            broken("lookup", t->name);
        }
        expect = t->end;
    }
    if (expect != h->data_len) {
        broken("tiling", "the tensors do not cover the data");
    }
    for (size_t i = 0; i < h->nmeta; i++) {
        if (mfsdp_st_meta(h, h->meta_keys[i]) == NULL) {
            broken("metadata lookup", h->meta_keys[i]);
        }
    }
}

static void round_trip(const mfsdp_st_header_t *h)
{
    mfsdp_st_entry_t *e = calloc(h->ntensors + 1, sizeof(*e));
    for (size_t i = 0; i < h->ntensors; i++) {
        const mfsdp_st_tensor_t *t = &h->tensors[i];
        e[i].name = t->name;
        e[i].dtype = t->dtype;
        e[i].ndim = t->ndim;
        memcpy(e[i].shape, t->shape, sizeof(t->shape));
        e[i].bytes = t->end - t->begin;
    }
    char *buf = NULL;
    size_t len = 0;
    mfsdp_status_t st =
        mfsdp_st_header_build(e, h->ntensors, (const char *const *)h->meta_keys,
                              (const char *const *)h->meta_vals, h->nmeta, &buf, &len);
    if (st != MFSDP_OK) {
        broken("the writer refused a header the reader accepted", mfsdp_status_string(st));
    }
    /* the rebuilt header and a zero data section of the same length */
    size_t total = len + (size_t)h->data_len;
    char *file = calloc(1, total + 1);
    memcpy(file, buf, len);
    mfsdp_st_header_t *back = NULL;
    char err[256];
    if (mfsdp_st_parse_buffer(file, total, "rt", err, sizeof(err), &back) != MFSDP_OK) {
        broken("the writer's header does not parse", err);
    }
    if (back->ntensors != h->ntensors || back->nmeta != h->nmeta || (len - 8) % 8 != 0) {
        broken("round trip", "counts or padding differ");
    }
    for (size_t i = 0; i < h->ntensors; i++) {
        const mfsdp_st_tensor_t *a = &h->tensors[i], *b = mfsdp_st_find(back, a->name);
        if (b == NULL || b->dtype != a->dtype || b->ndim != a->ndim ||
            b->end - b->begin != a->end - a->begin ||
            memcmp(b->shape, a->shape, sizeof(a->shape)) != 0) {
            broken("round trip changed a tensor", a->name);
        }
    }
    for (size_t i = 0; i < h->nmeta; i++) {
        const char *v = mfsdp_st_meta(back, h->meta_keys[i]);
        if (v == NULL || strcmp(v, h->meta_vals[i]) != 0) {
            broken("round trip changed metadata", h->meta_keys[i]);
        }
    }
    mfsdp_st_header_free(back);
    free(file);
    free(buf);
    free(e);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    memset(err, 'x', sizeof(err));
    mfsdp_st_header_t *h = POISON;
    mfsdp_status_t st = mfsdp_st_parse_buffer(data, size, "fuzz", err, sizeof(err), &h);
    if (st != MFSDP_OK) {
        if (h != POISON) {
            broken("output written on failure", err);
        }
        if (memchr(err, '\0', sizeof(err)) == NULL) {
            broken("message not terminated", "");
        }
        if (strncmp(err, "fuzz: ", 6) != 0 || strchr(err, '\n') != NULL) {
            broken("message form", err);
        }
        return 0;
    }
    check_accepted(h, size);
    round_trip(h);
    mfsdp_st_header_free(h);
    return 0;
}
