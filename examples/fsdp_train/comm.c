/* SPDX-License-Identifier: Apache-2.0 */
#include "comm.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FSDP_TRAIN_NCCL
#error "compile with -DFSDP_TRAIN_NCCL=0 (MPI flavour) or -DFSDP_TRAIN_NCCL=1 (NCCL flavour)"
#endif
#ifndef FSDP_TRAIN_NOMPI
#define FSDP_TRAIN_NOMPI 0
#endif
#if FSDP_TRAIN_NOMPI && !FSDP_TRAIN_NCCL
#error "-DFSDP_TRAIN_NOMPI=1 is a bootstrap of the NCCL flavour: add -DFSDP_TRAIN_NCCL=1"
#endif
#if FSDP_TRAIN_NOMPI
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#else
#include <mpi.h>
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

#define NSCOPES 3

struct ft_comm {
    int local;
    int rank[NSCOPES];
    int size[NSCOPES];
    int mesh; /* the shard and replicate communicators were split off the world */
#if FSDP_TRAIN_NCCL
    ncclComm_t nccl[NSCOPES]; /* [FT_SHARD] is [FT_WORLD] without a mesh */
    cudaStream_t stream;      /* NULL on host (test library): every call completes on return */
#else
    MPI_Comm mpi[NSCOPES];
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

#if !FSDP_TRAIN_NOMPI
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
#endif

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

#if !FSDP_TRAIN_NOMPI
static int count_ok(size_t count, size_t factor, const char *what)
{
    if (count > (size_t)INT_MAX / (factor ? factor : 1)) {
        fprintf(stderr, "fsdp_train: %s: count %zu does not fit an MPI count\n", what, count);
        return -1;
    }
    return 0;
}
#endif

#if FSDP_TRAIN_NOMPI
/* ---- bootstrap without MPI: torchrun's variables and a unique-id file ----------------- */

/* A non-negative integer from the environment variable name (below limit); -1 and a
 * message when it is missing or malformed. */
static int env_int(const char *name, long limit)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        fprintf(stderr,
                "fsdp_train: %s is not set (the no-MPI NCCL flavour takes RANK, WORLD_SIZE and "
                "LOCAL_RANK from its launcher, as under torchrun)\n",
                name);
        return -1;
    }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || x < 0 || x >= limit) {
        fprintf(stderr, "fsdp_train: %s=%s is not an integer in [0, %ld)\n", name, v, limit);
        return -1;
    }
    return (int)x;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Rank 0: the id goes to path through a temporary file and a rename, so a reader sees the
 * whole id or no file. A file already there is refused (another run's id would make the
 * ranks join different communicators). */
static int id_write(const char *path, const ncclUniqueId *id)
{
    struct stat st;
    if (stat(path, &st) == 0) {
        fprintf(stderr,
                "fsdp_train: the unique-id file %s already exists (left by an earlier run?); "
                "remove it or name a new one in FSDP_TRAIN_ID_FILE\n",
                path);
        return -1;
    }
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof(tmp)) {
        fprintf(stderr, "fsdp_train: FSDP_TRAIN_ID_FILE is too long\n");
        return -1;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        fprintf(stderr, "fsdp_train: cannot create %s: %s\n", tmp, strerror(errno));
        return -1;
    }
    int rc = write(fd, id, sizeof(*id)) == (ssize_t)sizeof(*id) && fsync(fd) == 0 ? 0 : -1;
    if (rc != 0)
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0) {
        fprintf(stderr, "fsdp_train: cannot write %s: %s\n", tmp, strerror(errno));
        rc = -1;
    }
    if (rc == 0 && rename(tmp, path) != 0) {
        fprintf(stderr, "fsdp_train: cannot rename %s to %s: %s\n", tmp, path, strerror(errno));
        rc = -1;
    }
    if (rc != 0)
        unlink(tmp);
    return rc;
}

/* Other ranks: wait up to timeout_s seconds for rank 0's file, then read exactly one id. */
static int id_read(const char *path, int rank, int timeout_s, ncclUniqueId *id)
{
    double t0 = mono_s();
    int fd;
    while ((fd = open(path, O_RDONLY)) < 0) {
        if (errno != ENOENT) {
            fprintf(stderr, "fsdp_train: rank %d: cannot open %s: %s\n", rank, path,
                    strerror(errno));
            return -1;
        }
        if (mono_s() - t0 >= (double)timeout_s) {
            fprintf(stderr,
                    "fsdp_train: rank %d: no NCCL unique id in %s after %d s (rank 0 writes it "
                    "at its start: did rank 0 start, with the same FSDP_TRAIN_ID_FILE? "
                    "FSDP_TRAIN_ID_TIMEOUT sets the wait)\n",
                    rank, path, timeout_s);
            return -1;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    char extra;
    ssize_t n = read(fd, id, sizeof(*id));
    ssize_t more = n == (ssize_t)sizeof(*id) ? read(fd, &extra, 1) : 0;
    close(fd);
    if (n != (ssize_t)sizeof(*id) || more != 0) {
        fprintf(stderr, "fsdp_train: rank %d: %s does not hold one NCCL unique id (%zd bytes)\n",
                rank, path, n);
        return -1;
    }
    return 0;
}

/* RANK, WORLD_SIZE and the unique id shared through FSDP_TRAIN_ID_FILE. */
static int bootstrap(int *rank_p, int *size_p, ncclUniqueId *id)
{
    int size = env_int("WORLD_SIZE", 1 << 20);
    if (size < 1) {
        if (size == 0)
            fprintf(stderr, "fsdp_train: WORLD_SIZE=0\n");
        return -1;
    }
    int rank = env_int("RANK", size);
    if (rank < 0)
        return -1;
    const char *path = getenv("FSDP_TRAIN_ID_FILE");
    if (path == NULL || *path == '\0') {
        fprintf(stderr, "fsdp_train: FSDP_TRAIN_ID_FILE is not set (the no-MPI NCCL flavour "
                        "shares rank 0's ncclUniqueId through that file)\n");
        return -1;
    }
    int timeout_s = 120;
    if (getenv("FSDP_TRAIN_ID_TIMEOUT") != NULL &&
        (timeout_s = env_int("FSDP_TRAIN_ID_TIMEOUT", 86400)) < 0)
        return -1;
    if (rank == 0) {
        if (nccl_ok(ncclGetUniqueId(id), "ncclGetUniqueId") != 0 || id_write(path, id) != 0)
            return -1;
    } else if (id_read(path, rank, timeout_s, id) != 0) {
        return -1;
    }
    *rank_p = rank;
    *size_p = size;
    return 0;
}
#endif

int ft_comm_init(int *argc, char ***argv, int local, ft_comm_t **comm_p)
{
    ft_comm_t *comm = calloc(1, sizeof(*comm));
    if (comm == NULL) {
        fprintf(stderr, "fsdp_train: out of memory\n");
        return -1;
    }
    comm->local = local;
    for (int s = 0; s < NSCOPES; s++)
        comm->size[s] = 1;
    if (local) {
        *comm_p = comm;
        return 0;
    }
    int rank, size;
#if FSDP_TRAIN_NOMPI
    (void)argc;
    (void)argv;
    ncclUniqueId id;
    if (bootstrap(&rank, &size, &id) != 0)
        goto err_free;
#else
    if (mpi_ok(MPI_Init(argc, argv), "MPI_Init") != 0)
        goto err_free;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
#endif
    comm->rank[FT_WORLD] = comm->rank[FT_SHARD] = rank;
    comm->size[FT_WORLD] = comm->size[FT_SHARD] = size;
#if FSDP_TRAIN_NCCL
#if !FSDP_TRAIN_NOMPI
    ncclUniqueId id;
    if (rank == 0 && nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId") != 0)
        goto err_abort;
    if (mpi_ok(MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast") != 0)
        goto err_abort;
#endif
    comm->stream = NULL;
#if FSDP_TRAIN_CUDA
    {
        int ndev = 0;
#if FSDP_TRAIN_NOMPI
        const char *lr = getenv("LOCAL_RANK");
#else
        const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
#endif
        if (cuda_ok(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount") != 0 || ndev < 1 ||
            cuda_ok(cudaSetDevice((lr != NULL ? atoi(lr) : rank) % ndev), "cudaSetDevice") != 0 ||
            cuda_ok(cudaStreamCreate(&comm->stream), "cudaStreamCreate") != 0)
            goto err_abort;
    }
#endif
    if (nccl_ok(ncclCommInitRank(&comm->nccl[FT_WORLD], size, id, rank), "ncclCommInitRank") != 0)
        goto err_abort;
    comm->nccl[FT_SHARD] = comm->nccl[FT_WORLD];
#if FSDP_TRAIN_NOMPI
    /* Every rank has joined (ncclCommInitRank is collective): the id file has done its job,
     * and a rerun with the same path starts clean. */
    if (rank == 0 && unlink(getenv("FSDP_TRAIN_ID_FILE")) != 0)
        fprintf(stderr, "fsdp_train: warning: cannot remove %s: %s\n", getenv("FSDP_TRAIN_ID_FILE"),
                strerror(errno));
#endif
#else
    comm->mpi[FT_WORLD] = comm->mpi[FT_SHARD] = MPI_COMM_WORLD;
    comm->mpi[FT_REPLICATE] = MPI_COMM_SELF;
#endif
    *comm_p = comm;
    return 0;
#if FSDP_TRAIN_NCCL
err_abort:
    ft_comm_abort(comm, 1);
#endif
err_free:
    free(comm);
    return -1;
}

int ft_comm_mesh(ft_comm_t *comm, int replicate)
{
    if (comm->local)
        return 0;
    int size = comm->size[FT_WORLD], rank = comm->rank[FT_WORLD];
    if (replicate < 1 || size % replicate != 0 || comm->mesh) {
        fprintf(stderr, "fsdp_train: cannot build a mesh of %d replicas over %d ranks\n", replicate,
                size);
        return -1;
    }
    int shard = size / replicate;
    /* torch's DeviceMesh(arange(n).view(R, n/R)): rows are shard groups, columns replicate
     * groups; the key keeps the world order inside each. */
    int color[NSCOPES] = {0, rank / shard, rank % shard};
#if FSDP_TRAIN_NCCL
    for (int s = FT_SHARD; s <= FT_REPLICATE; s++)
        if (nccl_ok(ncclCommSplit(comm->nccl[FT_WORLD], color[s], rank, &comm->nccl[s], NULL),
                    "ncclCommSplit") != 0)
            return -1;
#else
    for (int s = FT_SHARD; s <= FT_REPLICATE; s++)
        if (mpi_ok(MPI_Comm_split(MPI_COMM_WORLD, color[s], rank, &comm->mpi[s]),
                   "MPI_Comm_split") != 0)
            return -1;
#endif
    comm->mesh = 1;
    comm->size[FT_SHARD] = shard;
    comm->rank[FT_SHARD] = rank % shard;
    comm->size[FT_REPLICATE] = replicate;
    comm->rank[FT_REPLICATE] = rank / shard;
    return 0;
}

int ft_comm_finalize(ft_comm_t *comm)
{
    int rc = 0;
    if (!comm->local) {
#if FSDP_TRAIN_NCCL
        if (comm->mesh)
            for (int s = FT_SHARD; s <= FT_REPLICATE; s++)
                rc |= nccl_ok(ncclCommDestroy(comm->nccl[s]), "ncclCommDestroy");
        rc |= nccl_ok(ncclCommDestroy(comm->nccl[FT_WORLD]), "ncclCommDestroy");
#else
        if (comm->mesh)
            for (int s = FT_SHARD; s <= FT_REPLICATE; s++)
                rc |= mpi_ok(MPI_Comm_free(&comm->mpi[s]), "MPI_Comm_free");
#endif
#if FSDP_TRAIN_CUDA
        for (int i = 0; i < 2; i++)
            if (comm->dev[i] != NULL)
                cudaFree(comm->dev[i]);
        cudaStreamDestroy(comm->stream);
#endif
#if !FSDP_TRAIN_NOMPI
        rc |= mpi_ok(MPI_Finalize(), "MPI_Finalize");
#endif
    }
    free(comm);
    return rc;
}

void ft_comm_abort(ft_comm_t *comm, int code)
{
#if FSDP_TRAIN_NOMPI
    /* No MPI_Abort: this rank leaves at once (no exit handlers, which could wait on peers);
     * its launcher sees the status and stops the other ranks, as torchrun does. */
    (void)comm;
    fflush(NULL);
    _exit(code);
#else
    if (comm != NULL && !comm->local)
        MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
#endif
}

int ft_comm_rank(const ft_comm_t *comm, ft_scope_t scope)
{
    return comm->rank[scope];
}

int ft_comm_size(const ft_comm_t *comm, ft_scope_t scope)
{
    return comm->size[scope];
}

int ft_comm_allgather_inplace(ft_comm_t *comm, float *recv, size_t count)
{
    if (comm->local)
        return 0; /* the one block is already in place */
    int rank = comm->rank[FT_SHARD], size = comm->size[FT_SHARD];
#if FSDP_TRAIN_NCCL && FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float), off = (size_t)rank * bytes;
    char *d = dev_buf(comm, 0, bytes * (size_t)size);
    if (d == NULL || stage(d + off, (char *)recv + off, bytes, cudaMemcpyHostToDevice, comm))
        return -1;
    if (nccl_ok(ncclAllGather(d + off, d, count, ncclFloat32, comm->nccl[FT_SHARD], comm->stream),
                "ncclAllGather") != 0)
        return -1;
    return stage(recv, d, bytes * (size_t)size, cudaMemcpyDeviceToHost, comm);
#elif FSDP_TRAIN_NCCL
    (void)size;
    return nccl_ok(ncclAllGather(recv + (size_t)rank * count, recv, count, ncclFloat32,
                                 comm->nccl[FT_SHARD], comm->stream),
                   "ncclAllGather");
#else
    (void)rank;
    (void)size;
    if (count_ok(count, 1, "MPI_Allgather") != 0)
        return -1;
    return mpi_ok(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, (int)count, MPI_FLOAT,
                                comm->mpi[FT_SHARD]),
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
    size_t total = bytes * (size_t)comm->size[FT_SHARD];
    char *ds = dev_buf(comm, 1, bytes), *dr = dev_buf(comm, 0, total);
    if (ds == NULL || dr == NULL || stage(ds, send, bytes, cudaMemcpyHostToDevice, comm))
        return -1;
    if (nccl_ok(ncclAllGather(ds, dr, count, ncclFloat32, comm->nccl[FT_SHARD], comm->stream),
                "ncclAllGather") != 0)
        return -1;
    return stage(recv, dr, total, cudaMemcpyDeviceToHost, comm);
#elif FSDP_TRAIN_NCCL
    return nccl_ok(
        ncclAllGather(send, recv, count, ncclFloat32, comm->nccl[FT_SHARD], comm->stream),
        "ncclAllGather");
#else
    if (count_ok(count, 1, "MPI_Allgather") != 0)
        return -1;
    return mpi_ok(MPI_Allgather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT,
                                comm->mpi[FT_SHARD]),
                  "MPI_Allgather");
#endif
}

#if FSDP_TRAIN_NCCL
/* One group of point-to-point calls between root and every other rank of nc (rank, size:
 * this rank's place in it; elements of dt, esize bytes each): to_root: each non-root sends
 * its block, root receives one block per peer (a gather); otherwise root sends block r to
 * rank r, which receives it (a scatter). The group is ended even when a call inside it
 * failed. */
static int p2p_rooted_on(ft_comm_t *comm, ncclComm_t nc, int rank, int size, const char *sb,
                         char *rb, size_t count, ncclDataType_t dt, size_t esize, int root,
                         int to_root)
{
    size_t bytes = count * esize;
    int rc = nccl_ok(ncclGroupStart(), "ncclGroupStart");
    if (rc != 0)
        return -1;
    if (rank != root) {
        rc = to_root ? nccl_ok(ncclSend(sb, count, dt, root, nc, comm->stream), "ncclSend")
                     : nccl_ok(ncclRecv(rb, count, dt, root, nc, comm->stream), "ncclRecv");
    } else {
        for (int r = 0; r < size && rc == 0; r++) {
            if (r == root)
                continue;
            size_t off = (size_t)r * bytes;
            rc = to_root ? nccl_ok(ncclRecv(rb + off, count, dt, r, nc, comm->stream), "ncclRecv")
                         : nccl_ok(ncclSend(sb + off, count, dt, r, nc, comm->stream), "ncclSend");
        }
    }
    rc |= nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
    return rc == 0 ? 0 : -1;
}

/* p2p_rooted_on for float32 blocks on the shard group. */
static int p2p_rooted(ft_comm_t *comm, const char *sb, char *rb, size_t count, int root,
                      int to_root)
{
    return p2p_rooted_on(comm, comm->nccl[FT_SHARD], comm->rank[FT_SHARD], comm->size[FT_SHARD], sb,
                         rb, count, ncclFloat32, sizeof(float), root, to_root);
}
#endif

int ft_comm_gather(ft_comm_t *comm, const float *send, float *recv, size_t count, int root)
{
    if (comm->local) {
        memcpy(recv, send, count * sizeof(float));
        return 0;
    }
    int rank = comm->rank[FT_SHARD], size = comm->size[FT_SHARD];
    if (root < 0 || root >= size) {
        fprintf(stderr, "fsdp_train: gather to rank %d of a shard group of %d ranks\n", root, size);
        return -1;
    }
#if FSDP_TRAIN_NCCL
    size_t bytes = count * sizeof(float);
#if FSDP_TRAIN_CUDA
    char *ds = dev_buf(comm, 1, bytes);
    char *dr = rank == root ? dev_buf(comm, 0, bytes * (size_t)size) : NULL;
    if (ds == NULL || (rank == root && dr == NULL) ||
        stage(ds, send, bytes, cudaMemcpyHostToDevice, comm) != 0)
        return -1;
    if (p2p_rooted(comm, ds, dr, count, root, 1) != 0)
        return -1;
    if (rank == root && stage(recv, dr, bytes * (size_t)size, cudaMemcpyDeviceToHost, comm) != 0)
        return -1;
#else
    if (p2p_rooted(comm, (const char *)send, (char *)recv, count, root, 1) != 0)
        return -1;
#endif
    if (rank == root) /* root's own block never travels */
        memcpy((char *)recv + (size_t)root * bytes, send, bytes);
    return 0;
#else
    (void)rank;
    if (count_ok(count, (size_t)size, "MPI_Gather") != 0)
        return -1;
    return mpi_ok(MPI_Gather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, root,
                             comm->mpi[FT_SHARD]),
                  "MPI_Gather");
#endif
}

int ft_comm_scatter(ft_comm_t *comm, const float *send, float *recv, size_t count, int root)
{
    if (comm->local) {
        memcpy(recv, send, count * sizeof(float));
        return 0;
    }
    int rank = comm->rank[FT_SHARD], size = comm->size[FT_SHARD];
    if (root < 0 || root >= size) {
        fprintf(stderr, "fsdp_train: scatter from rank %d of a shard group of %d ranks\n", root,
                size);
        return -1;
    }
#if FSDP_TRAIN_NCCL
    size_t bytes = count * sizeof(float);
#if FSDP_TRAIN_CUDA
    char *ds = rank == root ? dev_buf(comm, 0, bytes * (size_t)size) : NULL;
    char *dr = rank == root ? NULL : dev_buf(comm, 1, bytes);
    if (rank == root
            ? ds == NULL || stage(ds, send, bytes * (size_t)size, cudaMemcpyHostToDevice, comm) != 0
            : dr == NULL)
        return -1;
    if (p2p_rooted(comm, ds, dr, count, root, 0) != 0)
        return -1;
    if (rank != root && stage(recv, dr, bytes, cudaMemcpyDeviceToHost, comm) != 0)
        return -1;
#else
    if (p2p_rooted(comm, (const char *)send, (char *)recv, count, root, 0) != 0)
        return -1;
#endif
    if (rank == root) /* root's own block never travels */
        memcpy(recv, (const char *)send + (size_t)root * bytes, bytes);
    return 0;
#else
    (void)rank;
    if (count_ok(count, (size_t)size, "MPI_Scatter") != 0)
        return -1;
    return mpi_ok(MPI_Scatter(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, root,
                              comm->mpi[FT_SHARD]),
                  "MPI_Scatter");
#endif
}

#if !FSDP_TRAIN_NCCL
/* MPI has no average: sum, then divide by the communicator size (FSDP2's sum-then-divide). */
static void divide_by(float *buf, size_t count, int size)
{
    if (size > 1)
        for (size_t i = 0; i < count; i++)
            buf[i] = buf[i] / (float)size;
}
#endif

int ft_comm_reduce_scatter(ft_comm_t *comm, float *send, float *recv, size_t count, ft_op_t op,
                           float premul)
{
    if (comm->local) {
        if (op == FT_OP_PREMUL_SUM)
            for (size_t i = 0; i < count; i++)
                recv[i] = send[i] * premul;
        else
            memcpy(recv, send, count * sizeof(float));
        return 0;
    }
#if FSDP_TRAIN_NCCL
    /* A PreMulSum op is created right before the call and destroyed right after, as
     * ProcessGroupNCCL does. */
    ncclRedOp_t nop = op == FT_OP_AVG ? ncclAvg : ncclSum;
    ncclComm_t nc = comm->nccl[FT_SHARD];
    if (op == FT_OP_PREMUL_SUM &&
        nccl_ok(ncclRedOpCreatePreMulSum(&nop, &premul, ncclFloat32, ncclScalarHostImmediate, nc),
                "ncclRedOpCreatePreMulSum") != 0)
        return -1;
    int rc;
#if FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float), total = bytes * (size_t)comm->size[FT_SHARD];
    char *ds = dev_buf(comm, 0, total), *dr = dev_buf(comm, 1, bytes);
    rc = ds == NULL || dr == NULL || stage(ds, send, total, cudaMemcpyHostToDevice, comm) != 0;
    if (rc == 0)
        rc = nccl_ok(ncclReduceScatter(ds, dr, count, ncclFloat32, nop, nc, comm->stream),
                     "ncclReduceScatter");
    if (rc == 0)
        rc = stage(recv, dr, bytes, cudaMemcpyDeviceToHost, comm);
#else
    rc = nccl_ok(ncclReduceScatter(send, recv, count, ncclFloat32, nop, nc, comm->stream),
                 "ncclReduceScatter");
#endif
    if (op == FT_OP_PREMUL_SUM)
        rc |= nccl_ok(ncclRedOpDestroy(nop, nc), "ncclRedOpDestroy");
    return rc == 0 ? 0 : -1;
#else
    int size = comm->size[FT_SHARD];
    if (count_ok(count, (size_t)size, "MPI_Reduce_scatter_block") != 0)
        return -1;
    if (op == FT_OP_PREMUL_SUM) /* MPI has no PreMulSum: scale the contribution, then sum */
        for (size_t i = 0; i < count * (size_t)size; i++)
            send[i] *= premul;
    if (mpi_ok(MPI_Reduce_scatter_block(send, recv, (int)count, MPI_FLOAT, MPI_SUM,
                                        comm->mpi[FT_SHARD]),
               "MPI_Reduce_scatter_block") != 0)
        return -1;
    if (op == FT_OP_AVG)
        divide_by(recv, count, size);
    return 0;
#endif
}

int ft_comm_allreduce(ft_comm_t *comm, ft_scope_t scope, float *buf, size_t count, ft_op_t op)
{
    if (comm->local)
        return 0;
    if (op == FT_OP_PREMUL_SUM) {
        fprintf(stderr, "fsdp_train: all-reduce with a PreMulSum op is not used by FSDP2\n");
        return -1;
    }
#if FSDP_TRAIN_NCCL
    ncclComm_t nc = comm->nccl[scope];
    if (nc == NULL) {
        fprintf(stderr, "fsdp_train: all-reduce on a replicate group without an HSDP mesh\n");
        return -1;
    }
    ncclRedOp_t nop = op == FT_OP_AVG ? ncclAvg : ncclSum;
#if FSDP_TRAIN_CUDA
    size_t bytes = count * sizeof(float);
    void *d = dev_buf(comm, 1, bytes);
    if (d == NULL || stage(d, buf, bytes, cudaMemcpyHostToDevice, comm) != 0)
        return -1;
    if (nccl_ok(ncclAllReduce(d, d, count, ncclFloat32, nop, nc, comm->stream), "ncclAllReduce") !=
        0)
        return -1;
    return stage(buf, d, bytes, cudaMemcpyDeviceToHost, comm);
#else
    return nccl_ok(ncclAllReduce(buf, buf, count, ncclFloat32, nop, nc, comm->stream),
                   "ncclAllReduce");
#endif
#else
    if (count_ok(count, 1, "MPI_Allreduce") != 0)
        return -1;
    if (mpi_ok(MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, comm->mpi[scope]),
               "MPI_Allreduce") != 0)
        return -1;
    if (op == FT_OP_AVG)
        divide_by(buf, count, comm->size[scope]);
    return 0;
#endif
}

int ft_comm_gather_report(ft_comm_t *comm, const double *v, size_t n, double *all)
{
    if (comm->local) {
        memcpy(all, v, n * sizeof(double));
        return 0;
    }
#if FSDP_TRAIN_NOMPI
    /* Grouped ncclSend/ncclRecv of float64 to world rank 0: calls an interposer of FSDP's
     * collectives does not see. */
    int rank = comm->rank[FT_WORLD], size = comm->size[FT_WORLD];
    size_t bytes = n * sizeof(double);
#if FSDP_TRAIN_CUDA
    char *ds = dev_buf(comm, 1, bytes);
    char *dr = rank == 0 ? dev_buf(comm, 0, bytes * (size_t)size) : NULL;
    if (ds == NULL || (rank == 0 && dr == NULL) ||
        stage(ds, v, bytes, cudaMemcpyHostToDevice, comm) != 0)
        return -1;
    if (p2p_rooted_on(comm, comm->nccl[FT_WORLD], rank, size, ds, dr, n, ncclFloat64,
                      sizeof(double), 0, 1) != 0)
        return -1;
    if (rank == 0 && stage(all, dr, bytes * (size_t)size, cudaMemcpyDeviceToHost, comm) != 0)
        return -1;
#else
    if (p2p_rooted_on(comm, comm->nccl[FT_WORLD], rank, size, (const char *)v, (char *)all, n,
                      ncclFloat64, sizeof(double), 0, 1) != 0)
        return -1;
#endif
    if (rank == 0)
        memcpy(all, v, bytes);
    return 0;
#else
    if (count_ok(n, 1, "MPI_Gather") != 0)
        return -1;
    return mpi_ok(MPI_Gather(v, (int)n, MPI_DOUBLE, all, (int)n, MPI_DOUBLE, 0, MPI_COMM_WORLD),
                  "MPI_Gather");
#endif
}
