/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Jobs that use a communicator the shim manages in ways it must not get wrong silently, run by
 * shim_nccl_check.py ("misuse MODE") under mpirun with LD_PRELOAD, over the test NCCL library
 * (the mpi-* modes through libmfsdp_preload_mpi.so). Rank 0 writes a one-group manifest at
 * argv[2] first (lazy steps with gradient clipping when the mode ends in "-lazy": releasing
 * such a communicator is collective). Every mode prints "ok: ..." lines for what the program
 * itself saw; the checker judges the shim's output and the exit status.
 *
 *   mpi-inplace-rs   an in-place MPI_Reduce_scatter_block (MPI_IN_PLACE) on the managed
 *                    communicator (errors returned): refused on every rank, never passed
 *                    through; exits 3 after the refusal.
 *   mpi-typed-ag     an MPI_Allgather that sends MPI_BYTE for a receive of MPI_FLOAT (the same
 *                    bytes: remapped, the result exact), then one receiving MPI_UINT16_T (a
 *                    bfloat16 as MPI jobs spell it: a datatype mfsdp does not handle) of the
 *                    group's size, which a managed communicator must refuse, not pass through.
 *   nccl-mixed-rs    the last rank reduce-scatters in place, the others out of place (legal
 *                    NCCL, per rank): the last rank is refused and must say so itself (the
 *                    others are inside their reduce: it MPI_Aborts them).
 *   nccl-abort[-lazy] an all-gather and a reduce-scatter, then the last rank alone calls
 *                    ncclCommAbort (a job's error path), which must return: nothing
 *                    collective may run on an aborted communicator. Then the others abort too.
 *   nccl-no-release  an all-gather, a reduce-scatter (one owner step) and an all-gather, then
 *                    exit without destroying the communicator.
 *   nccl-plain       the same, destroying it (the baseline of the checks).
 *   nccl-spent       tagged mode (mfsdp_shim_register, MFSDP_COMPANION=tag): a registration
 *                    trains on one communicator, which is destroyed; a tagged call on a new
 *                    communicator must be refused (its owners' state went with the first).
 *   nccl-momentum    tagged mode: after the owners took their weights, a momentum import
 *                    (MFSDP_SHIM_TAG_LOAD_MOMENTUM) of known rows of w (b's rows and w's
 *                    padding rows NaN: not read), then an export (MFSDP_SHIM_TAG_SYNC_MOMENTUM)
 *                    into a sentinel block: w's rows come back bitwise, its padding rows zero,
 *                    b's rows untouched. Then an export of the wrong count must be refused.
 */
#include <dlfcn.h>
#include <math.h>
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mfsdp/shim.h"

#define W_ROWS 7
#define W_COLS 5
#define B_ROWS 6

static int rank, world;

static void die(const char *what, ncclResult_t r)
{
    fprintf(stderr, "shim_misuse: rank %d: %s: %s\n", rank, what, ncclGetErrorString(r));
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static ncclComm_t make_comm(void)
{
    ncclUniqueId id;
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) {
            die("ncclGetUniqueId", r);
        }
    }
    MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    ncclResult_t r = ncclCommInitRank(&comm, world, id, rank);
    if (r != ncclSuccess) {
        die("ncclCommInitRank", r);
    }
    return comm;
}

static const char *manifest_text(int lazy)
{
    static char text[1024];
    snprintf(text, sizeof(text),
             "{\"format\": \"mfsdp-manifest/1\", \"world_size\": %d, %s\"groups\": [{\"name\": "
             "\"g\", \"params\": [{\"name\": \"w\", \"shape\": [%d, %d], \"dtype\": \"float32\"}, "
             "{\"name\": \"b\", \"shape\": [%d], \"dtype\": \"float32\"}]}]}\n",
             world,
             lazy ? "\"optimizer\": {\"max_norm\": 1.0}, \"training\": {\"grad_divide\": "
                    "\"force_sum\", \"step\": \"lazy\"}, "
                  : "\"training\": {\"grad_divide\": \"force_sum\"}, ",
             W_ROWS, W_COLS, B_ROWS);
    return text;
}

/* Element i of rank q's FSDP shard (w's rows, then b's; padding rows zero). */
static float shard_value(int q, size_t i, int cw, int cb)
{
    size_t wn = (size_t)cw * W_COLS;
    int valid = i < wn ? q * cw + (int)(i / W_COLS) < W_ROWS : q * cb + (int)(i - wn) < B_ROWS;
    return valid ? 0.25f + (float)i / 64.0f : 0.0f;
}

/* The shim's tagging entry points (it is preloaded). */
static void *shim_fn(const char *name)
{
    void *f = dlsym(RTLD_DEFAULT, name);
    if (f == NULL) {
        fprintf(stderr, "shim_misuse: %s not found (is the shim preloaded?)\n", name);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return f;
}

/* The shim's tagging entry points and this program's manifest registered (eager, one group). */
typedef struct tagged {
    int (*tag)(int, int, size_t, const unsigned char *, size_t);
    const char *(*last_error)(void);
    int id;
} tagged_t;

static tagged_t register_tagged(void)
{
    int (*reg)(const char *, size_t) =
        (int (*)(const char *, size_t))shim_fn("mfsdp_shim_register");
    tagged_t t;
    t.tag = (int (*)(int, int, size_t, const unsigned char *, size_t))shim_fn("mfsdp_shim_tag");
    t.last_error = (const char *(*)(void))shim_fn("mfsdp_shim_last_error");
    const char *text = manifest_text(0);
    t.id = reg(text, strlen(text));
    if (t.id < 0) {
        fprintf(stderr, "shim_misuse: rank %d: register: %s\n", rank, t.last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return t;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc != 3) {
        if (rank == 0) {
            fprintf(stderr, "usage: shim_misuse MODE MANIFEST\n");
        }
        MPI_Finalize();
        return 2;
    }
    const char *mode = argv[1];
    size_t ml = strlen(mode);
    int lazy = ml > 5 && strcmp(mode + ml - 5, "-lazy") == 0;
    if (rank == 0) {
        FILE *f = fopen(argv[2], "w");
        if (f == NULL) {
            perror(argv[2]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        fputs(manifest_text(lazy), f);
        fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const int cw = (W_ROWS + world - 1) / world, cb = (B_ROWS + world - 1) / world;
    const size_t S = (size_t)cw * W_COLS + (size_t)cb; /* per-rank count */
    float *full = calloc(S * (size_t)world, sizeof(float));
    float *grad = calloc(S * (size_t)world, sizeof(float));
    float *out = calloc(S, sizeof(float));
    for (size_t i = 0; i < S; i++) {
        full[(size_t)rank * S + i] = shard_value(rank, i, cw, cb);
    }
    for (size_t i = 0; i < S * (size_t)world; i++) {
        grad[i] = (float)((i * 7 + (size_t)rank * 3) % 11) / 8.0f - 0.5f;
    }
    int code = 0;

    if (strcmp(mode, "mpi-inplace-rs") == 0) {
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        int rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, (int)S, MPI_FLOAT,
                               MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) {
            fprintf(stderr, "shim_misuse: rank %d: the all-gather failed (%d)\n", rank, rc);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        rc = MPI_Reduce_scatter_block(MPI_IN_PLACE, grad, (int)S, MPI_FLOAT, MPI_SUM,
                                      MPI_COMM_WORLD);
        printf("%s: rank %d: in-place MPI_Reduce_scatter_block returned %d\n",
               rc != MPI_SUCCESS ? "ok" : "FAIL", rank, rc);
        code = 3;
    } else if (strcmp(mode, "mpi-typed-ag") == 0) {
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        float *mine = full + (size_t)rank * S;
        int rc = MPI_Allgather(mine, (int)(S * sizeof(float)), MPI_BYTE, full, (int)S, MPI_FLOAT,
                               MPI_COMM_WORLD);
        long bad = 0;
        for (int q = 0; q < world; q++) {
            for (size_t i = 0; i < S; i++) {
                bad += full[(size_t)q * S + i] != shard_value(q, i, cw, cb);
            }
        }
        printf("%s: rank %d: an all-gather sending MPI_BYTE for MPI_FLOAT: rc %d, #wrong %ld\n",
               rc == MPI_SUCCESS && bad == 0 ? "ok" : "FAIL", rank, rc, bad);
        rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, (int)(2 * S), MPI_UINT16_T,
                           MPI_COMM_WORLD);
        printf("%s: rank %d: an MPI_UINT16_T all-gather of the group's bytes: rc %d\n",
               rc != MPI_SUCCESS ? "ok" : "FAIL", rank, rc);
        code = 3;
    } else if (strcmp(mode, "nccl-mixed-rs") == 0) {
        ncclComm_t comm = make_comm();
        ncclResult_t r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        if (r != ncclSuccess) {
            die("ncclAllGather", r);
        }
        int last = rank == world - 1;
        float *recv = last ? grad + (size_t)rank * S : out;
        r = ncclReduceScatter(grad, recv, S, ncclFloat32, ncclSum, comm, NULL);
        if (last) {
            printf("%s: rank %d: in-place ncclReduceScatter (the others out of place): %s\n",
                   r != ncclSuccess ? "ok" : "FAIL", rank, ncclGetErrorString(r));
            fflush(stdout);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 3); /* the others are inside their reduce */
        }
        code = 2; /* not reached when the last rank was refused */
    } else if (strncmp(mode, "nccl-abort", 10) == 0) {
        ncclComm_t comm = make_comm();
        ncclResult_t r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        if (r == ncclSuccess) {
            r = ncclReduceScatter(grad, out, S, ncclFloat32, ncclSum, comm, NULL);
        }
        if (r != ncclSuccess) {
            die("the step before the abort", r);
        }
        if (rank == world - 1) {
            r = ncclCommAbort(comm);
            printf("%s: rank %d: ncclCommAbort alone returned: %s\n",
                   r == ncclSuccess ? "ok" : "FAIL", rank, ncclGetErrorString(r));
            fflush(stdout);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank != world - 1) {
            r = ncclCommAbort(comm);
            printf("%s: rank %d: ncclCommAbort returned: %s\n", r == ncclSuccess ? "ok" : "FAIL",
                   rank, ncclGetErrorString(r));
        }
    } else if (strcmp(mode, "nccl-no-release") == 0 || strcmp(mode, "nccl-plain") == 0) {
        ncclComm_t comm = make_comm();
        ncclResult_t r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        if (r == ncclSuccess) {
            r = ncclReduceScatter(grad, out, S, ncclFloat32, ncclSum, comm, NULL);
        }
        if (r == ncclSuccess) {
            r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        }
        if (r != ncclSuccess) {
            die("the step", r);
        }
        if (strcmp(mode, "nccl-plain") == 0) {
            r = ncclCommDestroy(comm);
            if (r != ncclSuccess) {
                die("ncclCommDestroy", r);
            }
        }
        printf("ok: rank %d: one step%s\n", rank,
               strcmp(mode, "nccl-plain") == 0 ? ", communicator destroyed"
                                               : "; exiting without destroying the communicator");
    } else if (strcmp(mode, "nccl-spent") == 0) {
        tagged_t t = register_tagged();
        ncclComm_t comm = make_comm();
        ncclResult_t r = ncclSuccess;
        if (t.tag(t.id, MFSDP_SHIM_TAG_ALLGATHER, 0, NULL, 2) == 0) {
            r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        }
        if (r == ncclSuccess && t.tag(t.id, MFSDP_SHIM_TAG_REDUCE_SCATTER, 0, NULL, 2) == 0) {
            r = ncclReduceScatter(grad, out, S, ncclFloat32, ncclSum, comm, NULL);
        }
        if (r != ncclSuccess) {
            die("the tagged step", r);
        }
        r = ncclCommDestroy(comm);
        if (r != ncclSuccess) {
            die("ncclCommDestroy", r);
        }
        printf("ok: rank %d: a tagged step on the first communicator, destroyed\n", rank);
        ncclComm_t again = make_comm();
        if (t.tag(t.id, MFSDP_SHIM_TAG_ALLGATHER, 0, NULL, 2) != 0) {
            fprintf(stderr, "shim_misuse: rank %d: tag: %s\n", rank, t.last_error());
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, again, NULL);
        printf("%s: rank %d: a tagged all-gather on a new communicator: %s\n",
               r != ncclSuccess ? "ok" : "FAIL", rank, ncclGetErrorString(r));
        (void)ncclCommDestroy(again);
        code = 3;
    } else if (strcmp(mode, "nccl-momentum") == 0) {
        tagged_t t = register_tagged();
        ncclComm_t comm = make_comm();
        const size_t wn = (size_t)cw * W_COLS; /* w's rows in a block, then b's */
        float *mine = malloc(S * sizeof(float));
        float *blocks = malloc(S * (size_t)world * sizeof(float));
        for (size_t i = 0; i < S; i++) {
            int w_row = i < wn && rank * cw + (int)(i / W_COLS) < W_ROWS;
            mine[i] = w_row ? 1.0f + 0.5f * (float)rank + (float)i / 128.0f : NAN;
        }
        ncclResult_t r = ncclSuccess;
        if (t.tag(t.id, MFSDP_SHIM_TAG_ALLGATHER, 0, NULL, 2) == 0) {
            r = ncclAllGather(full + (size_t)rank * S, full, S, ncclFloat32, comm, NULL);
        }
        if (r == ncclSuccess && t.tag(t.id, MFSDP_SHIM_TAG_LOAD_MOMENTUM, 0, NULL, 2) == 0) {
            r = ncclAllGather(mine, blocks, S, ncclFloat32, comm, NULL);
        }
        for (size_t i = 0; i < S * (size_t)world; i++) {
            blocks[i] = -7.0f;
        }
        if (r == ncclSuccess && t.tag(t.id, MFSDP_SHIM_TAG_SYNC_MOMENTUM, 0, NULL, 2) == 0) {
            float *at = blocks + (size_t)rank * S;
            r = ncclAllGather(at, blocks, S, ncclFloat32, comm, NULL);
        }
        if (r != ncclSuccess) {
            die("the momentum import and export", r);
        }
        size_t bad = 0;
        for (size_t i = 0; i < S; i++) {
            float got = blocks[(size_t)rank * S + i];
            float want = i >= wn ? -7.0f : isnan(mine[i]) ? 0.0f : mine[i];
            bad += memcmp(&got, &want, sizeof(float)) != 0;
        }
        printf("%s: rank %d: momentum imported and exported: %zu of %zu elements differ\n",
               bad == 0 ? "ok" : "FAIL", rank, bad, S);
        if (t.tag(t.id, MFSDP_SHIM_TAG_SYNC_MOMENTUM, 0, NULL, 2) != 0) {
            fprintf(stderr, "shim_misuse: rank %d: tag: %s\n", rank, t.last_error());
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        r = ncclAllGather(blocks + (size_t)rank * (S - 1), blocks, S - 1, ncclFloat32, comm, NULL);
        printf("%s: rank %d: a momentum export of %zu elements: %s\n",
               r != ncclSuccess ? "ok" : "FAIL", rank, S - 1, ncclGetErrorString(r));
        (void)ncclCommDestroy(comm);
        free(mine);
        free(blocks);
        code = 3;
    } else {
        if (rank == 0) {
            fprintf(stderr, "shim_misuse: unknown mode %s\n", mode);
        }
        code = 2;
    }
    fflush(stdout);
    free(full);
    free(grad);
    free(out);
    MPI_Finalize();
    return code;
}
