/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Resolution of the NCCL function table (transport/nccl.c) in a process that loads no NCCL:
 * a clear MFSDP_ERR_UNSUPPORTED naming the first missing function, and an ncclX defined in the
 * object mfsdp lives in (an interposer's own override; here this executable, which exports
 * one) is refused rather than called (it would recurse). Each test runs in its own process
 * (Criterion forks), so the once-only resolution starts afresh.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include "transport/nccl.h"

ncclResult_t ncclGroupStart(void); /* nccl.h declares it without a prototype */

/* An interposer's definition of an NCCL entry point, exported from this executable: the
 * table must not take it (there is no pncclGroupStart here). */
__attribute__((visibility("default"))) ncclResult_t ncclGroupStart(void)
{
    cr_assert_fail("mfsdp called the interposable ncclGroupStart");
    return ncclInternalError;
}

static void quiet(void)
{
    cr_redirect_stderr();
}

Test(nccl_api, no_library_and_own_override, .init = quiet)
{
    const mfsdp_nccl_api_t *api = NULL;
    cr_expect_eq(mfsdp_nccl_api_get(&api), MFSDP_ERR_UNSUPPORTED);
    cr_expect_null(api);
    cr_expect_eq(mfsdp_nccl_api_get(&api), MFSDP_ERR_UNSUPPORTED, "resolved once, same answer");
    cr_expect_eq(mfsdp_nccl_api_get(NULL), MFSDP_ERR_INVALID_ARG);
    fflush(stderr);
    FILE *f = cr_get_redirected_stderr();
    char buf[4096] = "";
    size_t nread = fread(buf, 1, sizeof(buf) - 1, f);
    buf[nread] = '\0';
    cr_expect(strstr(buf, "ncclGroupStart resolves to mfsdp's own definition") != NULL,
              "the own override was not refused: '%s'", buf);
    cr_expect(strstr(buf, "the NCCL function ncclGroupStart (or pncclGroupStart) is not loaded") !=
                  NULL,
              "the missing function is not named: '%s'", buf);
}
