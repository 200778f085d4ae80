/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Run under the shim (LD_PRELOAD) with MFSDP_MANIFEST=argv[1]: rank 0 writes a one-group
 * manifest there first (the shim reads it lazily, at the first intercepted call).
 * Twice: dup MPI_COMM_WORLD, in-place MPI_Allgather of FSDP shards of a round-specific
 * weight, compare every element with the FSDP2 layout, free the comm. The second round's
 * weights must come from its own shards: state kept for a freed (and possibly reused)
 * handle would return the first round's weights. Prints "#wrong N"; exits 1 if N > 0.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define W_ROWS 5
#define W_COLS 3
#define B_ROWS 4

static float weight(int round, int param, int row, int col)
{
    return (float)(round * 1000 + param * 100 + row * 10 + col + 1);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc != 2) {
        if (rank == 0) {
            fprintf(stderr, "usage: shim_comm_reuse MANIFEST_PATH\n");
        }
        MPI_Finalize();
        return 2;
    }
    if (rank == 0) {
        FILE *f = fopen(argv[1], "w");
        if (f == NULL) {
            perror(argv[1]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        fprintf(f,
                "{\"format\": \"mfsdp-manifest/1\", \"world_size\": %d, \"groups\": [{\"name\": "
                "\"g\", \"params\": [{\"name\": \"w\", \"shape\": [%d, %d], \"dtype\": "
                "\"float32\"}, {\"name\": \"b\", \"shape\": [%d], \"dtype\": \"float32\"}]}]}\n",
                n, W_ROWS, W_COLS, B_ROWS);
        fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    const int cw = (W_ROWS + n - 1) / n, cb = (B_ROWS + n - 1) / n;
    const int S = cw * W_COLS + cb; /* per-rank count: no padding between params */
    float *buf = malloc((size_t)n * (size_t)S * sizeof(float));
    long wrong = 0;
    for (int round = 0; round < 2; round++) {
        MPI_Comm c;
        MPI_Comm_dup(MPI_COMM_WORLD, &c);
        /* this rank's FSDP shard, in place in its block; other blocks poisoned */
        for (int i = 0; i < n * S; i++) {
            buf[i] = -12345.0f;
        }
        float *mine = buf + (size_t)rank * (size_t)S;
        for (int r = 0; r < cw; r++) {
            int row = rank * cw + r;
            for (int j = 0; j < W_COLS; j++) {
                mine[r * W_COLS + j] = row < W_ROWS ? weight(round, 0, row, j) : 0.0f;
            }
        }
        for (int r = 0; r < cb; r++) {
            int row = rank * cb + r;
            mine[cw * W_COLS + r] = row < B_ROWS ? weight(round, 1, row, 0) : 0.0f;
        }
        if (MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, S, MPI_FLOAT, c) !=
            MPI_SUCCESS) {
            wrong++;
        }
        for (int q = 0; q < n; q++) {
            const float *blk = buf + (size_t)q * (size_t)S;
            for (int r = 0; r < cw; r++) {
                int row = q * cw + r;
                for (int j = 0; j < W_COLS; j++) {
                    float want = row < W_ROWS ? weight(round, 0, row, j) : 0.0f;
                    wrong += blk[r * W_COLS + j] != want;
                }
            }
            for (int r = 0; r < cb; r++) {
                int row = q * cb + r;
                float want = row < B_ROWS ? weight(round, 1, row, 0) : 0.0f;
                wrong += blk[cw * W_COLS + r] != want;
            }
        }
        MPI_Comm_free(&c);
    }
    long total = 0;
    MPI_Allreduce(&wrong, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("shim_comm_reuse: %d ranks, #wrong %ld\n", n, total);
    }
    free(buf);
    MPI_Finalize();
    return total == 0 ? 0 : 1;
}
