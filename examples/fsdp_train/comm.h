/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The communication of the fsdp_train example, in one of two flavours chosen at compile
 * time (FSDP_TRAIN_NCCL=0|1), each issuing exactly the calls PyTorch FSDP2 issues:
 *  - MPI: MPI_Allgather with MPI_IN_PLACE, MPI_Reduce_scatter_block with MPI_SUM (FSDP2's
 *    avg is emulated by a division by the communicator size afterwards: MPI has no average;
 *    a PreMulSum by scaling the contributions first), MPI_Allreduce for HSDP's replicate
 *    reduction (same emulation of avg), MPI_Gather / MPI_Scatter for muon-dist;
 *  - NCCL: ncclAllGather in place (send == recv + rank * count), ncclReduceScatter with
 *    ncclAvg, ncclSum or a PreMulSum op created just before and destroyed just after the
 *    call, ncclAllReduce in place for HSDP, grouped ncclSend/ncclRecv for muon-dist's
 *    gathers and scatters (NCCL has neither); MPI only bootstraps (unique-id broadcast) and
 *    gathers the final report. Against the test-only NCCL library the buffers are the host
 *    tensors and the stream is NULL; built with FSDP_TRAIN_CUDA=1 (real NCCL) each call
 *    stages its buffers through device memory on a CUDA stream of its own, on device
 *    OMPI_COMM_WORLD_LOCAL_RANK modulo the device count.
 *    With FSDP_TRAIN_NOMPI=1 too (fsdp_train_nccl_nompi) the NCCL flavour uses no MPI at all:
 *    ranks come from torchrun's RANK, WORLD_SIZE and LOCAL_RANK (the device), rank 0 writes
 *    its ncclUniqueId to the file FSDP_TRAIN_ID_FILE (a temporary file renamed into place;
 *    an existing file is refused; removed once every rank joined) and the others wait for it
 *    up to FSDP_TRAIN_ID_TIMEOUT seconds (default 120); the final report travels by grouped
 *    ncclSend/ncclRecv and a fatal error ends the rank alone (_exit), its launcher stopping
 *    the others.
 * Three communicators: the world (loss logging), the FSDP shard group (all-gathers,
 * reduce-scatters, the norm all-reduce of gradient clipping, muon-gather's all-gathers,
 * muon-dist's gathers and scatters) and the
 * HSDP replicate group. Without a mesh the shard group is the world and the replicate group
 * holds one rank; ft_comm_mesh() splits the world into a 2-D (replicate, shard) mesh as
 * torch's DeviceMesh does: shard groups of size/replicate consecutive ranks, replicate groups
 * of the ranks at the same position in every shard group (ncclCommSplit / MPI_Comm_split).
 * A third, local mode (no MPI at all, world size 1) serves the single-process reference.
 */
#ifndef FSDP_TRAIN_COMM_H
#define FSDP_TRAIN_COMM_H

#include <stddef.h>

typedef struct ft_comm ft_comm_t;

/** The communicators of a rank. */
typedef enum {
    FT_WORLD = 0,     /**< every rank */
    FT_SHARD = 1,     /**< the FSDP shard group (the world without a mesh) */
    FT_REPLICATE = 2, /**< the HSDP replicate group (this rank alone without a mesh) */
} ft_scope_t;

/** Reduction ops, as FSDP2 picks them (_get_gradient_divide_factors). */
typedef enum {
    FT_OP_SUM,        /**< ncclSum / MPI_SUM */
    FT_OP_AVG,        /**< ncclAvg / MPI_SUM then a division by the communicator size */
    FT_OP_PREMUL_SUM, /**< ncclRedOpCreatePreMulSum(scalar) / contributions scaled, MPI_SUM */
} ft_op_t;

/** "mpi" or "nccl". */
const char *ft_comm_flavour(void);

/** Initialize MPI or, without MPI, read the launcher's variables and the id file (unless
 * local), then the flavour's communicator; 0 or -1 (message printed). */
int ft_comm_init(int *argc, char ***argv, int local, ft_comm_t **comm_p);

/**
 * Collective over the world: split it into the HSDP mesh of replicate x (size / replicate)
 * ranks. replicate must divide the world size. 0 or -1 (message printed). No-op when local.
 */
int ft_comm_mesh(ft_comm_t *comm, int replicate);

/** Destroy the communicators and finalize MPI (when used). */
int ft_comm_finalize(ft_comm_t *comm);

/** Stop every rank after a fatal error (MPI_Abort; exit in local mode; without MPI this
 * rank's _exit, the launcher stopping the others). */
void ft_comm_abort(ft_comm_t *comm, int code);

/** Rank and size in one of the communicators. */
int ft_comm_rank(const ft_comm_t *comm, ft_scope_t scope);
int ft_comm_size(const ft_comm_t *comm, ft_scope_t scope);

/** FSDP2's in-place all-gather on the shard group: count floats already sit at
 * recv + rank*count. */
int ft_comm_allgather_inplace(ft_comm_t *comm, float *recv, size_t count);

/** Out-of-place all-gather on the shard group (a DTensor full_tensor(), as FSDP2-Muon does
 * per matrix). */
int ft_comm_allgather(ft_comm_t *comm, const float *send, float *recv, size_t count);

/**
 * Gather count floats from every rank of the shard group to root (muon-dist: a matrix's
 * shards to its designated rank). recv (size * count floats, rank-major) is written on root
 * only. MPI: MPI_Gather. NCCL: one group of ncclSend (non-roots) and ncclRecv (root, one per
 * peer), as ProcessGroupNCCL's gather does; root copies its own block.
 */
int ft_comm_gather(ft_comm_t *comm, const float *send, float *recv, size_t count, int root);

/**
 * Scatter from root of the shard group: block r (count floats) of root's send (size * count
 * floats, rank-major) lands in rank r's recv (muon-dist: the orthogonalised update back to
 * the shards). MPI: MPI_Scatter. NCCL: one group of ncclSend (root) and ncclRecv (others).
 */
int ft_comm_scatter(ft_comm_t *comm, const float *send, float *recv, size_t count, int root);

/**
 * Reduce-scatter of count floats per rank on the shard group with op (premul: the scalar of
 * FT_OP_PREMUL_SUM). send (size * count) is scratch: the MPI flavour scales it in place.
 */
int ft_comm_reduce_scatter(ft_comm_t *comm, float *send, float *recv, size_t count, ft_op_t op,
                           float premul);

/** In-place all-reduce of count floats over scope with FT_OP_SUM or FT_OP_AVG. */
int ft_comm_allreduce(ft_comm_t *comm, ft_scope_t scope, float *buf, size_t count, ft_op_t op);

/** Gather n doubles from every rank of the world to rank 0 (all: n * size values). */
int ft_comm_gather_report(ft_comm_t *comm, const double *v, size_t n, double *all);

#endif /* FSDP_TRAIN_COMM_H */
