/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target for the checkpoint index parser (scripts/fuzz.sh ckpt_index). An index
 * is guarded by its own SHA-256, which random bytes never match; so the input is the
 * digested part of an index and the target seals it (computes the digest and prepends the
 * prefix) before parsing, which lets the fuzzer reach every structural check. Unsealed
 * inputs are parsed too (they must be refused). A rejection must leave the output alone and
 * give one line starting with the origin; an accepted index must be consistent (its layout
 * covers the manifest, 2 x world files) and write back to an identical text.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/ckpt_index.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define POISON ((mfsdp_ckpt_index_t *)(uintptr_t)0x5a5a5a5a)
#define PREFIX "{\"index_sha256\": \""

static void broken(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_ckpt_index: %s: %s\n", what, detail);
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("MFSDP_DEBUG", "NONE", 0);
    return 0;
}

static void parse_one(const char *text, size_t len)
{
    char err[512];
    memset(err, 'x', sizeof(err));
    mfsdp_ckpt_index_t *ix = POISON;
    mfsdp_status_t st = mfsdp_ckpt_index_parse(text, len, "fuzz", err, sizeof(err), &ix);
    if (st != MFSDP_OK) {
        if (ix != POISON) {
            broken("output written on failure", err);
        }
        if (memchr(err, '\0', sizeof(err)) == NULL || strncmp(err, "fuzz: ", 6) != 0 ||
            strchr(err, '\n') != NULL) {
            broken("message form", err);
        }
        return;
    }
    const mfsdp_ckpt_layout_t *lay = ix->layout;
    if (ix->nfiles != 2 * (size_t)lay->world || ix->meta.ngroups != ix->manifest->ngroups) {
        broken("accepted an inconsistent index", "files or groups");
    }
    char *again = NULL;
    size_t alen = 0;
    if (mfsdp_ckpt_index_text(lay, &ix->meta, ix->files, &again, &alen) != MFSDP_OK) {
        broken("an accepted index cannot be written back", "");
    }
    mfsdp_ckpt_index_t *back = NULL;
    if (mfsdp_ckpt_index_parse(again, alen, "again", err, sizeof(err), &back) != MFSDP_OK) {
        broken("the rewritten index does not parse", err);
    }
    char *third = NULL;
    size_t tlen = 0;
    if (mfsdp_ckpt_index_text(back->layout, &back->meta, back->files, &third, &tlen) != MFSDP_OK ||
        tlen != alen || memcmp(third, again, alen) != 0) {
        broken("index text is not canonical", "");
    }
    free(third);
    free(again);
    mfsdp_ckpt_index_free(back);
    mfsdp_ckpt_index_free(ix);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    parse_one((const char *)data, size); /* as is: almost always refused by the digest */
    /* sealed: PREFIX <sha256 of the input> ", then the input */
    size_t pre = strlen(PREFIX);
    char *text = malloc(pre + 66 + size + 1);
    char hex[MFSDP_SHA256_HEX];
    if (mfsdp_sha256_buf(data, size, hex) != MFSDP_OK) {
        broken("sha256", "");
    }
    memcpy(text, PREFIX, pre);
    memcpy(text + pre, hex, 64);
    memcpy(text + pre + 64, "\",", 2);
    memcpy(text + pre + 66, data, size);
    parse_one(text, pre + 66 + size);
    free(text);
    return 0;
}
