/* SPDX-License-Identifier: Apache-2.0 */
#include "comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FSDP_TRAIN_NCCL
#error "compile with -DFSDP_TRAIN_NCCL=0 (MPI flavour) or -DFSDP_TRAIN_NCCL=1 (NCCL flavour)"
#endif

#if FSDP_TRAIN_NCCL
#include <nccl.h>
#endif
#ifndef FSDP_TRAIN_CUDA
#define FSDP_TRAIN_CUDA 0
#endif
#if FSDP_TRAIN_CUDA
#include <cuda_runtime.h>
#endif

struct ft_comm {
    int local;
    int rank;
    int size;
#if FSDP_TRAIN_NCCL
    ncclComm_t nccl;
    cudaStream_t stream; /* NULL on host (test library): every call completes on return */
#endif
#if FSDP_TRAIN_CUDA
    /* With the real NCCL the job's host tensors are staged through device buffers, so
     * NCCL (and an interposer) sees device pointers as in a PyTorch job. */
    void *dev[2];
    size_t dev_bytes[2];
#endif
};

const char *ft_comm_flavour(void)
{
    return FSDP_TRAIN_NCCL ? "nccl" : "mpi";
}

static int mpi_ok(int rc, const char *what)
{
    if (rc == MPI_SUCCESS)
        return 0;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fprintf(stderr, "fsdp_train: %s failed: %s\n", what, msg);
    return -1;
}

#if FSDP_TRAIN_NCCL
static int nccl_ok(ncclResult_t rc, const char *what)
{
    if (rc == ncclSuccess)
        return 0;
    fprintf(stderr, "fsdp_train: %s failed: %s\n", what, ncclGetErrorString(rc));
    return -1;
}
#endif

#if FSDP_TRAIN_CUDA
static int cuda_ok(cudaError_t rc, const char *what)
{
    if (rc == cudaSuccess)
        return 0;
    fprintf(stderr, "fsdp_train: %s failed: %s\n", what, cudaGetErrorString(rc));
    return -1;
}

/* Device buffer i of at least bytes (grown, never shrunk). */
static void *dev_buf(ft_comm_t *comm, int i, size_t bytes)
{
    if (comm->dev_bytes[i] < bytes) {
        if (comm->dev[i] != NULL)
            cudaFree(comm->dev[i]);
        comm->dev[i] = NULL;
        comm->dev_bytes[i] = 0;
        if (cuda_ok(cudaMalloc(&comm->dev[i], bytes), "cudaMalloc") != 0)
            return NULL;
        comm->dev_bytes[i] = bytes;
    }
    return comm->dev[i];
}

static int stage(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                 ft_comm_t *comm)
{
    if (cuda_ok(cudaMemcpyAsync(dst, src, bytes, kind, comm->stream), "cudaMemcpyAsync") != 0)
        return -1;
    return cuda_ok(cudaStreamSynchronize(comm->stream), "cudaStreamSynchronize");
}
#endif

static int count_ok(size_t count, size_t factor, const char *what)
{
    if (count > (size_t)INT_MAX / (factor ? factor : 1)) {
        fprintf(stderr, "fsdp_train: %s: count %zu does not fit an MPI count\n", what, count);
        return -1;
    }
    return 0;
}

int ft_comm_init(int *argc, char ***argv, int local, ft_comm_t **comm_p)
{
    ft_comm_t *comm = calloc(1, sizeof(*comm));
    if (comm == NULL) {
        fprintf(stderr, "fsdp_train: out of memory\n");
        return -1;
    }
    comm->local = local;
    comm->size = 1;
    if (local) {
        *comm_p = comm;
        return 0;
    }
    if (mpi_ok(MPI_Init(argc, argv), "MPI_Init") != 0)
        goto err_free;
    MPI_Comm_rank(MPI_COMM_WORLD, &comm->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &comm->size);
#if FSDP_TRAIN_NCCL
    ncclUniqueId id;
    if (comm->rank == 0 && nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId") != 0)
        goto err_abort;
    if (mpi_ok(MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast") != 0)
        goto err_abort;
    comm->stream = NULL;
#if FSDP_TRAIN_CUDA
    {
        int ndev = 0;
        const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (cuda_ok(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount") != 0 || ndev < 1 ||
            cuda_ok(cudaSetDevice((lr != NULL ? atoi(lr) : comm->rank) % ndev), "cudaSetDevice") !=
                0 ||
            cuda_ok(cudaStreamCreate(&comm->stream), "cudaStreamCreate") != 0)
            goto err_abort;
    }
#endif
    if (nccl_ok(ncclCommInitRank(&comm->nccl, comm->size, id, comm->rank), "ncclCommInitRank") != 0)
        goto err_abort;
#endif
    *comm_p = comm;
    return 0;
#if FSDP_TRAIN_NCCL
err_abort:
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
err_free:
    free(comm);
    return -1;
}

int ft_comm_finalize(ft_comm_t *comm)
{
    int rc = 0;
    if (!comm->local) {
#if FSDP_TRAIN_NCCL
        rc |= nccl_ok(ncclCommDestroy(comm->nccl), "ncclCommDestroy");
#endif
#if FSDP_TRAIN_CUDA
        for (int i = 0; i < 2; i++)
            if (comm->dev[i] != NULL)
                cudaFree(comm->dev[i]);
        cudaStreamDestroy(comm->stream);
#endif
        rc |= mpi_ok(MPI_Finalize(), "MPI_Finalize");
    }
    free(comm);
    return rc;
}

void ft_comm_abort(ft_comm_t *comm, int code)
{
    if (comm != NULL && !comm->local)
        MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

int ft_comm_rank(const ft_comm_t *comm)
{
    return comm->rank;
}

int ft_comm_size(const ft_comm_t *comm)
{
    return comm->size;
}

int ft_comm_allgather_inplace(ft_comm_t *comm, float *recv, size_t count)
{
    if (comm->local)
        return 0; /* the one block is already in place */
#if FSDP_TRAIN_NCCL && FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float), off = (size_t)comm->rank * bytes;
    char *d = dev_buf(comm, 0, bytes * (size_t)comm->size);
    if (d == NULL || stage(d + off, (char *)recv + off, bytes, cudaMemcpyHostToDevice, comm))
        return -1;
    if (nccl_ok(ncclAllGather(d + off, d, count, ncclFloat32, comm->nccl, comm->stream),
                "ncclAllGather") != 0)
        return -1;
    return stage(recv, d, bytes * (size_t)comm->size, cudaMemcpyDeviceToHost, comm);
#elif FSDP_TRAIN_NCCL
    return nccl_ok(ncclAllGather(recv + (size_t)comm->rank * count, recv, count, ncclFloat32,
                                 comm->nccl, comm->stream),
                   "ncclAllGather");
#else
    if (count_ok(count, 1, "MPI_Allgather") != 0)
        return -1;
    return mpi_ok(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, (int)count, MPI_FLOAT,
                                MPI_COMM_WORLD),
                  "MPI_Allgather");
#endif
}

int ft_comm_allgather(ft_comm_t *comm, const float *send, float *recv, size_t count)
{
    if (comm->local) {
        memcpy(recv, send, count * sizeof(float));
        return 0;
    }
#if FSDP_TRAIN_NCCL && FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float);
    char *ds = dev_buf(comm, 1, bytes), *dr = dev_buf(comm, 0, bytes * (size_t)comm->size);
    if (ds == NULL || dr == NULL || stage(ds, send, bytes, cudaMemcpyHostToDevice, comm))
        return -1;
    if (nccl_ok(ncclAllGather(ds, dr, count, ncclFloat32, comm->nccl, comm->stream),
                "ncclAllGather") != 0)
        return -1;
    return stage(recv, dr, bytes * (size_t)comm->size, cudaMemcpyDeviceToHost, comm);
#elif FSDP_TRAIN_NCCL
    return nccl_ok(ncclAllGather(send, recv, count, ncclFloat32, comm->nccl, comm->stream),
                   "ncclAllGather");
#else
    if (count_ok(count, 1, "MPI_Allgather") != 0)
        return -1;
    return mpi_ok(
        MPI_Allgather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, MPI_COMM_WORLD),
        "MPI_Allgather");
#endif
}

int ft_comm_reduce_scatter(ft_comm_t *comm, float *send, float *recv, size_t count, float premul)
{
    if (comm->local) {
        if (premul != 0.0f)
            for (size_t i = 0; i < count; i++)
                recv[i] = send[i] * premul;
        else
            memcpy(recv, send, count * sizeof(float));
        return 0;
    }
#if FSDP_TRAIN_NCCL
    /* FSDP2 reduces with AVG (SUM when the data-parallel size is 1), or with a PreMulSum op
     * that ProcessGroupNCCL creates right before the call and destroys right after. */
    ncclRedOp_t op = comm->size == 1 ? ncclSum : ncclAvg;
    if (premul != 0.0f && nccl_ok(ncclRedOpCreatePreMulSum(&op, &premul, ncclFloat32,
                                                           ncclScalarHostImmediate, comm->nccl),
                                  "ncclRedOpCreatePreMulSum") != 0)
        return -1;
    int rc;
#if FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float);
    char *ds = dev_buf(comm, 0, bytes * (size_t)comm->size), *dr = dev_buf(comm, 1, bytes);
    rc = ds == NULL || dr == NULL ||
         stage(ds, send, bytes * (size_t)comm->size, cudaMemcpyHostToDevice, comm) != 0;
    if (rc == 0)
        rc = nccl_ok(ncclReduceScatter(ds, dr, count, ncclFloat32, op, comm->nccl, comm->stream),
                     "ncclReduceScatter");
    if (rc == 0)
        rc = stage(recv, dr, bytes, cudaMemcpyDeviceToHost, comm);
#else
    rc = nccl_ok(ncclReduceScatter(send, recv, count, ncclFloat32, op, comm->nccl, comm->stream),
                 "ncclReduceScatter");
#endif
    if (premul != 0.0f)
        rc |= nccl_ok(ncclRedOpDestroy(op, comm->nccl), "ncclRedOpDestroy");
    return rc == 0 ? 0 : -1;
#else
    if (count_ok(count, (size_t)comm->size, "MPI_Reduce_scatter_block") != 0)
        return -1;
    if (premul != 0.0f) /* MPI has no PreMulSum: scale the contribution, then sum */
        for (size_t i = 0; i < count * (size_t)comm->size; i++)
            send[i] *= premul;
    if (mpi_ok(MPI_Reduce_scatter_block(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
               "MPI_Reduce_scatter_block") != 0)
        return -1;
    if (premul == 0.0f && comm->size > 1)
        for (size_t i = 0; i < count; i++)
            recv[i] = recv[i] / (float)comm->size;
    return 0;
#endif
}

int ft_comm_allreduce_sum(ft_comm_t *comm, float *buf, size_t count)
{
    if (comm->local)
        return 0;
#if FSDP_TRAIN_NCCL && FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float);
    void *d = dev_buf(comm, 1, bytes);
    if (d == NULL || stage(d, buf, bytes, cudaMemcpyHostToDevice, comm) != 0)
        return -1;
    if (nccl_ok(ncclAllReduce(d, d, count, ncclFloat32, ncclSum, comm->nccl, comm->stream),
                "ncclAllReduce") != 0)
        return -1;
    return stage(buf, d, bytes, cudaMemcpyDeviceToHost, comm);
#elif FSDP_TRAIN_NCCL
    return nccl_ok(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm->nccl, comm->stream),
                   "ncclAllReduce");
#else
    if (count_ok(count, 1, "MPI_Allreduce") != 0)
        return -1;
    return mpi_ok(MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Allreduce");
#endif
}

int ft_comm_gather_report(ft_comm_t *comm, const double *v, size_t n, double *all)
{
    if (comm->local) {
        memcpy(all, v, n * sizeof(double));
        return 0;
    }
    if (count_ok(n, 1, "MPI_Gather") != 0)
        return -1;
    return mpi_ok(MPI_Gather(v, (int)n, MPI_DOUBLE, all, (int)n, MPI_DOUBLE, 0, MPI_COMM_WORLD),
                  "MPI_Gather");
}
