/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The communication of the fsdp_train example, in one of two flavours chosen at compile
 * time (FSDP_TRAIN_NCCL=0|1), each issuing exactly the calls PyTorch FSDP2 issues:
 *  - MPI: MPI_Allgather with MPI_IN_PLACE, MPI_Reduce_scatter_block with MPI_SUM followed by
 *    a division by the world size (FSDP2's sum-then-post-divide mode: MPI has no average),
 *    or, for a divide factor, MPI_SUM of contributions scaled by 1/factor;
 *  - NCCL: ncclAllGather in place (send == recv + rank * count), ncclReduceScatter with
 *    ncclAvg (ncclSum at world size 1, as FSDP2) or with a PreMulSum op created just before
 *    and destroyed just after the call; MPI only bootstraps (unique-id broadcast)
 *    and gathers the final report. Against the test-only NCCL library the buffers are the
 *    host tensors and the stream is NULL; built with FSDP_TRAIN_CUDA=1 (real NCCL) each
 *    call stages its buffers through device memory on a CUDA stream of its own, on device
 *    OMPI_COMM_WORLD_LOCAL_RANK modulo the device count.
 * A third, local mode (no MPI at all, world size 1) serves the single-process reference.
 */
#ifndef FSDP_TRAIN_COMM_H
#define FSDP_TRAIN_COMM_H

#include <stddef.h>

typedef struct ft_comm ft_comm_t;

/** "mpi" or "nccl". */
const char *ft_comm_flavour(void);

/** Initialize MPI (unless local) and the flavour's communicator; 0 or -1 (message printed). */
int ft_comm_init(int *argc, char ***argv, int local, ft_comm_t **comm_p);

/** Destroy the communicator and finalize MPI. */
int ft_comm_finalize(ft_comm_t *comm);

/** Stop every rank after a fatal error (MPI_Abort; exit in local mode). */
void ft_comm_abort(ft_comm_t *comm, int code);

int ft_comm_rank(const ft_comm_t *comm);
int ft_comm_size(const ft_comm_t *comm);

/** FSDP2's in-place all-gather: this rank's count floats already sit at recv + rank*count. */
int ft_comm_allgather_inplace(ft_comm_t *comm, float *recv, size_t count);

/** Out-of-place all-gather (a DTensor full_tensor(), as FSDP2-Muon does per matrix). */
int ft_comm_allgather(ft_comm_t *comm, const float *send, float *recv, size_t count);

/**
 * Reduce-scatter of count floats per rank. premul == 0: FSDP2's default, the average (a sum at
 * one rank); otherwise PREMUL_SUM(premul), FSDP2's op for a custom gradient divide factor F
 * (premul = 1/F). send (size * count) is scratch: the MPI flavour scales it in place.
 */
int ft_comm_reduce_scatter(ft_comm_t *comm, float *send, float *recv, size_t count, float premul);

/** In-place sum all-reduce (loss logging). */
int ft_comm_allreduce_sum(ft_comm_t *comm, float *buf, size_t count);

/** Gather n doubles from every rank to rank 0 (all: n * size values, rank-major). */
int ft_comm_gather_report(ft_comm_t *comm, const double *v, size_t n, double *all);

#endif /* FSDP_TRAIN_COMM_H */
