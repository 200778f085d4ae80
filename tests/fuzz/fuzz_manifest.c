/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target for the manifest parser (scripts/fuzz.sh runs it). Beyond "no crash, no
 * leak, no UB" it checks the parser's contract on every input:
 *  - a rejection leaves the output alone and gives a one-line message that starts with the
 *    origin;
 *  - an accepted manifest is written by mfsdp_manifest_to_json, the text parses back to an
 *    identical manifest, and writing that again gives the same bytes (canonical form).
 * A broken property aborts, which libFuzzer records as a crash with its input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mfsdp/manifest.h"
#include "tests/lib/manifest_compare.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define POISON ((mfsdp_manifest_t *)(uintptr_t)0x5a5a5a5a)

static void broken(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_manifest: %s: %s\n", what, detail);
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("MFSDP_DEBUG", "NONE", 0); /* every rejection would print a warning otherwise */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    mfsdp_manifest_t *m = POISON;
    memset(err, 'x', sizeof(err));
    mfsdp_status_t st =
        mfsdp_manifest_parse((const char *)data, size, "fuzz", err, sizeof(err), &m);
    if (st != MFSDP_OK) {
        if (m != POISON) {
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

    char *json = NULL, *again = NULL;
    mfsdp_manifest_t *back = NULL;
    if (mfsdp_manifest_to_json(m, &json) != MFSDP_OK) {
        broken("to_json refused a parsed manifest", "");
    }
    if (mfsdp_manifest_parse(json, strlen(json), "fuzz-rt", err, sizeof(err), &back) != MFSDP_OK) {
        broken("canonical text does not parse", err);
    }
    const char *diff = test_manifest_diff(m, back);
    if (diff != NULL) {
        broken("round trip changed a field", diff);
    }
    if (mfsdp_manifest_to_json(back, &again) != MFSDP_OK || strcmp(json, again) != 0) {
        broken("to_json is not canonical", json);
    }
    free(again);
    free(json);
    mfsdp_manifest_free(back);
    mfsdp_manifest_free(m);
    return 0;
}
