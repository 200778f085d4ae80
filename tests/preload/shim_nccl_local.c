/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Loads LIB (libshim_nccl_job.so: shim_nccl_job.c built as a library, linked against the test
 * NCCL library) with RTLD_LOCAL and runs its shim_nccl_job_main(ARGS). The NCCL library then
 * sits in that library's local scope only, as libnccl does in a PyTorch process (pip wheels:
 * ctypes.CDLL without RTLD_GLOBAL, then libtorch_cuda's DT_NEEDED under an RTLD_LOCAL import):
 * an LD_PRELOADed shim still catches the job's NCCL calls, but must find the real functions
 * (and the transport's) outside the global scope. MPI is this program's own dependency, in the
 * global scope, as the test NCCL library needs it there.
 * usage: shim_nccl_local LIB ARGS...
 */
#include <dlfcn.h>
#include <mpi.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: shim_nccl_local LIB ARGS...\n");
        return 2;
    }
    /* Keep libmpi a dependency of this program (the global scope). */
    int (*volatile keep)(int *) = MPI_Initialized;
    (void)keep;
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        fprintf(stderr, "shim_nccl_local: %s\n", dlerror());
        return 2;
    }
    if (dlsym(RTLD_DEFAULT, "pncclAllGather") != NULL) {
        fprintf(stderr, "shim_nccl_local: FAIL: the NCCL library is in the global scope\n");
        return 2;
    }
    int (*job)(int, char **) = (int (*)(int, char **))dlsym(h, "shim_nccl_job_main");
    if (job == NULL) {
        fprintf(stderr, "shim_nccl_local: %s\n", dlerror());
        return 2;
    }
    printf("shim_nccl_local: the test NCCL library is loaded RTLD_LOCAL only\n");
    return job(argc - 1, argv + 1);
}
