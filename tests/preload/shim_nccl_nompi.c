/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NCCL shim (libmfsdp_preload.so, LD_PRELOADed) in a process that has no MPI, over
 * libnccl_incomplete.so (one rank, most of the API missing). Run by shim_nccl_check.py:
 *   api      no libmpi is mapped in the process (the shim brought none); ncclGroupStart/End
 *            reach the library; an all-gather is refused, because the library lacks functions
 *            the NCCL transport needs: one error line naming one, and the shim makes the exit
 *            status non-zero
 *   count    ncclCommCount fails on the communicator: the all-gather fails (one error line)
 *   forward  ncclCommFinalize, which the shim overrides and the library lacks: refused with
 *            one error line, never forwarded into nothing
 * Prints "ok: ..." per check and "shim_nccl_nompi: checks passed"; exits 2 when one fails.
 */
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

extern int nccl_incomplete_bad_comm;
int nccl_incomplete_group_depth(void);

static int mapped(const char *needle)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4096];
    int found = 0;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        found |= strstr(line, needle) != NULL;
    }
    if (f != NULL) {
        fclose(f);
    }
    return found;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    int dummy = 0, wrong = 0;
    float send[4] = {1, 2, 3, 4}, recv[4] = {0};
    if (strcmp(mode, "api") == 0) {
        if (!mapped("libmfsdp_preload.so")) {
            printf("FAIL: libmfsdp_preload.so is not loaded (LD_PRELOAD it)\n");
            return 2;
        }
        if (mapped("libmpi")) {
            printf("FAIL: a libmpi is mapped in a process that uses no MPI\n");
            wrong++;
        } else {
            printf("ok: the shim is loaded and no libmpi is mapped\n");
        }
        ncclGroupStart();
        ncclGroupStart();
        int in = nccl_incomplete_group_depth();
        ncclGroupEnd();
        ncclGroupEnd();
        if (in != 2 || nccl_incomplete_group_depth() != 0) {
            printf("FAIL: group depth in the library %d then %d, want 2 then 0\n", in,
                   nccl_incomplete_group_depth());
            wrong++;
        } else {
            printf("ok: ncclGroupStart/End reach the library\n");
        }
        ncclResult_t r = ncclAllGather(send, recv, 4, ncclFloat32, (ncclComm_t)&dummy, NULL);
        printf("%s: an all-gather over a library without ncclSend or ncclAllReduce: %s\n",
               r != ncclSuccess ? "ok" : "FAIL", ncclGetErrorString(r));
        wrong += r == ncclSuccess;
    } else if (strcmp(mode, "count") == 0) {
        ncclResult_t r =
            ncclAllGather(send, recv, 4, ncclFloat32, (ncclComm_t)&nccl_incomplete_bad_comm, NULL);
        printf("%s: an all-gather on a communicator whose ncclCommCount fails: %s\n",
               r != ncclSuccess ? "ok" : "FAIL", ncclGetErrorString(r));
        wrong += r == ncclSuccess;
    } else if (strcmp(mode, "forward") == 0) {
        ncclResult_t (*fin)(ncclComm_t) =
            (ncclResult_t(*)(ncclComm_t))dlsym(RTLD_DEFAULT, "ncclCommFinalize");
        ncclResult_t r = fin != NULL ? fin((ncclComm_t)&dummy) : ncclSuccess;
        printf("%s: ncclCommFinalize, which the library lacks: %s\n",
               fin != NULL && r == ncclInvalidUsage ? "ok" : "FAIL",
               fin != NULL ? ncclGetErrorString(r) : "not found (is the shim preloaded?)");
        wrong += fin == NULL || r != ncclInvalidUsage;
    } else {
        fprintf(stderr, "usage: shim_nccl_nompi api|count|forward\n");
        return 2;
    }
    if (wrong == 0) {
        printf("shim_nccl_nompi: checks passed\n");
    }
    fflush(stdout);
    return wrong == 0 ? 0 : 2;
}
