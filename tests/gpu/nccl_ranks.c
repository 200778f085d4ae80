/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Multi-rank NCCL correctness on ONE GPU (docs/gpu.md): fork N ranks that all use
 * device 0, each with its own NCCL_HOSTID so that NCCL treats them as separate hosts and
 * connects them through the socket transport on loopback (NCCL_IB_DISABLE=1,
 * NCCL_SOCKET_IFNAME=lo, NCCL_NET=Socket). Rank 0 creates the ncclUniqueId and the parent
 * relays it through pipes. Each rank runs, on device buffers:
 *   ncclAllGather (out of place and in place, FSDP's form), ncclReduceScatter (avg, fp32),
 *   ncclReduceScatter (sum, bf16), ncclBroadcast (root n-1), ncclReduce (sum, root 1 % n)
 * and checks every element against a host reference (#wrong must be 0; avg within 1e-6
 * relative, everything else exact: inputs are small integers).
 * Correctness only: socket transport on loopback says nothing about performance.
 *
 * Usage: nccl_ranks [-n ranks (2..8)] [-c count per rank] [-t timeout seconds]
 * Exit: 0 all ranks passed, 1 a wrong element or an error, 77 no GPU (meson: SKIP).
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <nccl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { NCHECK = 6, MAX_RANKS = 8 };
static const char *const check_names[NCHECK] = {
    "allgather f32",           "allgather f32 in-place", "reduce_scatter f32 avg",
    "reduce_scatter bf16 sum", "broadcast f32",          "reduce f32 sum",
};

/* One rank's report, written to the parent in one write() (< PIPE_BUF: atomic). */
struct rank_result {
    int rank;
    int status; /* 0 ran every check, 1 a CUDA/NCCL error */
    long long wrong[NCHECK];
    double ms[NCHECK];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Read exactly len bytes within timeout_s; -1 on EOF, error or timeout. */
static int read_all(int fd, void *buf, size_t len, double timeout_s)
{
    char *p = buf;
    const double end = now_s() + timeout_s;
    while (len > 0) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        const int left_ms = (int)((end - now_s()) * 1000.0);
        if (left_ms <= 0) {
            return -1;
        }
        const int pr = poll(&pfd, 1, left_ms);
        if (pr < 0 && errno == EINTR) {
            continue;
        }
        if (pr <= 0) {
            return -1;
        }
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

#define RCU(call)                                                                                  \
    do {                                                                                           \
        cudaError_t _e = (call);                                                                   \
        if (_e != cudaSuccess) {                                                                   \
            printf("rank %d: %s failed: %s\n", rank, #call, cudaGetErrorString(_e));               \
            goto out_err;                                                                          \
        }                                                                                          \
    } while (0)

#define RNC(call)                                                                                  \
    do {                                                                                           \
        ncclResult_t _r = (call);                                                                  \
        if (_r != ncclSuccess) {                                                                   \
            printf("rank %d: %s failed: %s\n", rank, #call, ncclGetErrorString(_r));               \
            goto out_err;                                                                          \
        }                                                                                          \
    } while (0)

/* Wait for the stream with a deadline; abort the communicator when it passes. */
static int wait_stream(cudaStream_t s, ncclComm_t comm, double deadline, int rank)
{
    for (;;) {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) {
            return 0;
        }
        if (e != cudaErrorNotReady) {
            printf("rank %d: stream error: %s\n", rank, cudaGetErrorString(e));
            return -1;
        }
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
            printf("rank %d: nccl async error: %s\n", rank, ncclGetErrorString(async));
            ncclCommAbort(comm);
            return -1;
        }
        if (now_s() > deadline) {
            printf("rank %d: timeout waiting for a collective; aborting the communicator\n", rank);
            ncclCommAbort(comm);
            return -1;
        }
        usleep(200);
    }
}

static uint16_t f32_to_bf16_exact(float f) /* for small integers: exact truncation */
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static int rank_main(int rank, int n, size_t count, int id_fd_out, int id_fd_in, int res_fd,
                     double timeout_s)
{
    struct rank_result res;
    memset(&res, 0, sizeof(res));
    res.rank = rank;
    res.status = 1;
    ncclComm_t comm = NULL;
    cudaStream_t s = NULL;
    float *d_send = NULL, *d_recv = NULL, *h = NULL, *h2 = NULL;
    uint16_t *hb = NULL;
    const double deadline = now_s() + timeout_s;
    char hostid[64];

    snprintf(hostid, sizeof(hostid), "mfsdp-nccl-rank-%d", rank);
    setenv("NCCL_HOSTID", hostid, 1);
    setenv("NCCL_IB_DISABLE", "1", 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 1);
    setenv("NCCL_NET", "Socket", 1);

    ncclUniqueId id;
    if (rank == 0) {
        RNC(ncclGetUniqueId(&id));
        if (write_all(id_fd_out, &id, sizeof(id)) != 0) {
            printf("rank 0: cannot send the unique id to the parent\n");
            goto out_err;
        }
    } else if (read_all(id_fd_in, &id, sizeof(id), timeout_s) != 0) {
        printf("rank %d: no unique id from the parent\n", rank);
        goto out_err;
    }
    RCU(cudaSetDevice(0));
    /* A blocking stream: it orders after the synchronous cudaMemcpy/cudaMemset calls below,
     * which run on the legacy default stream (a pageable H2D copy may return before its
     * DMA has landed). */
    RCU(cudaStreamCreate(&s));
    RNC(ncclCommInitRank(&comm, n, id, rank));

    const size_t total = count * (size_t)n;
    RCU(cudaMalloc((void **)&d_send, total * sizeof(float)));
    RCU(cudaMalloc((void **)&d_recv, total * sizeof(float)));
    h = malloc(total * sizeof(float));
    h2 = malloc(total * sizeof(float));
    hb = malloc(total * sizeof(uint16_t));
    if (h == NULL || h2 == NULL || hb == NULL) {
        printf("rank %d: host malloc failed\n", rank);
        goto out_err;
    }
    const size_t fb = count * sizeof(float);
    double t0;

    /* 0: all-gather out of place. */
    for (size_t i = 0; i < count; i++) {
        h[i] = (float)(rank * 1000 + (int)(i % 997));
    }
    RCU(cudaMemcpy(d_send, h, fb, cudaMemcpyHostToDevice));
    RCU(cudaMemset(d_recv, 0xff, total * sizeof(float)));
    t0 = now_s();
    RNC(ncclAllGather(d_send, d_recv, count, ncclFloat32, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL; /* aborted */
        goto out_err;
    }
    res.ms[0] = (now_s() - t0) * 1e3;
    RCU(cudaMemcpy(h2, d_recv, total * sizeof(float), cudaMemcpyDeviceToHost));
    for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++) {
            res.wrong[0] += h2[(size_t)r * count + i] != (float)(r * 1000 + (int)(i % 997));
        }
    }

    /* 1: all-gather in place (FSDP: send = recv + rank * count). */
    RCU(cudaMemset(d_recv, 0xff, total * sizeof(float)));
    RCU(cudaMemcpy(d_recv + (size_t)rank * count, h, fb, cudaMemcpyHostToDevice));
    t0 = now_s();
    RNC(ncclAllGather(d_recv + (size_t)rank * count, d_recv, count, ncclFloat32, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL;
        goto out_err;
    }
    res.ms[1] = (now_s() - t0) * 1e3;
    RCU(cudaMemcpy(h2, d_recv, total * sizeof(float), cudaMemcpyDeviceToHost));
    for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++) {
            res.wrong[1] += h2[(size_t)r * count + i] != (float)(r * 1000 + (int)(i % 997));
        }
    }

    /* 2: reduce-scatter avg, fp32: sum_r (r+1) v / n = v (n+1) / 2, exact in float. */
    for (size_t j = 0; j < total; j++) {
        h[j] = (float)((rank + 1) * (int)(j % 251 + 1));
    }
    RCU(cudaMemcpy(d_send, h, total * sizeof(float), cudaMemcpyHostToDevice));
    RCU(cudaMemset(d_recv, 0xff, fb));
    t0 = now_s();
    RNC(ncclReduceScatter(d_send, d_recv, count, ncclFloat32, ncclAvg, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL;
        goto out_err;
    }
    res.ms[2] = (now_s() - t0) * 1e3;
    RCU(cudaMemcpy(h2, d_recv, fb, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) {
        const size_t j = (size_t)rank * count + i;
        const double want = (double)(j % 251 + 1) * (double)(n + 1) / 2.0;
        res.wrong[2] += !(fabs((double)h2[i] - want) <= 1e-6 * want);
    }

    /* 3: reduce-scatter sum, bf16: small integers, exact in bf16. */
    for (size_t j = 0; j < total; j++) {
        hb[j] = f32_to_bf16_exact((float)((rank + 1) * (int)(j % 7 + 1)));
    }
    RCU(cudaMemcpy(d_send, hb, total * sizeof(uint16_t), cudaMemcpyHostToDevice));
    RCU(cudaMemset(d_recv, 0xff, count * sizeof(uint16_t)));
    t0 = now_s();
    RNC(ncclReduceScatter(d_send, d_recv, count, ncclBfloat16, ncclSum, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL;
        goto out_err;
    }
    res.ms[3] = (now_s() - t0) * 1e3;
    RCU(cudaMemcpy(hb, d_recv, count * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) {
        const size_t j = (size_t)rank * count + i;
        const float want = (float)((int)(j % 7 + 1) * n * (n + 1) / 2);
        res.wrong[3] += bf16_to_f32(hb[i]) != want;
    }

    /* 4: broadcast from the last rank. */
    const int root_b = n - 1;
    for (size_t i = 0; i < count; i++) {
        h[i] = rank == root_b ? (float)(root_b * 7 + (int)(i % 1009)) : NAN;
    }
    RCU(cudaMemcpy(d_recv, h, fb, cudaMemcpyHostToDevice));
    t0 = now_s();
    RNC(ncclBroadcast(d_recv, d_recv, count, ncclFloat32, root_b, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL;
        goto out_err;
    }
    res.ms[4] = (now_s() - t0) * 1e3;
    RCU(cudaMemcpy(h2, d_recv, fb, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) {
        res.wrong[4] += h2[i] != (float)(root_b * 7 + (int)(i % 1009));
    }

    /* 5: reduce (sum) to rank 1 % n. */
    const int root_r = 1 % n;
    for (size_t i = 0; i < count; i++) {
        h[i] = (float)((rank + 1) * (int)(i % 113));
    }
    RCU(cudaMemcpy(d_send, h, fb, cudaMemcpyHostToDevice));
    RCU(cudaMemset(d_recv, 0xff, fb));
    t0 = now_s();
    RNC(ncclReduce(d_send, d_recv, count, ncclFloat32, ncclSum, root_r, comm, s));
    if (wait_stream(s, comm, deadline, rank) != 0) {
        comm = NULL;
        goto out_err;
    }
    res.ms[5] = (now_s() - t0) * 1e3;
    if (rank == root_r) {
        RCU(cudaMemcpy(h2, d_recv, fb, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < count; i++) {
            res.wrong[5] += h2[i] != (float)((int)(i % 113) * n * (n + 1) / 2);
        }
    }
    res.status = 0;

out_err:
    if (comm != NULL) {
        if (res.status == 0) {
            ncclCommDestroy(comm);
        } else {
            ncclCommAbort(comm);
        }
    }
    if (s != NULL) {
        cudaStreamDestroy(s);
    }
    cudaFree(d_send);
    cudaFree(d_recv);
    free(h);
    free(h2);
    free(hb);
    write_all(res_fd, &res, sizeof(res));
    return res.status;
}

/* In a child, so that the parent never initializes CUDA before forking the ranks. */
static int probe_gpu(double timeout_s)
{
    const pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        int ndev = 0;
        const cudaError_t e = cudaGetDeviceCount(&ndev);
        if (e != cudaSuccess || ndev == 0) {
            printf("nccl_ranks: no CUDA device (cudaGetDeviceCount: %s, %d devices): skipped\n",
                   e != cudaSuccess ? cudaGetErrorString(e) : "ok", ndev);
            fflush(stdout);
            _exit(77);
        }
        int nv = 0;
        ncclGetVersion(&nv);
        printf("nccl_ranks: %d CUDA device(s), NCCL %d\n", ndev, nv);
        fflush(stdout);
        _exit(0);
    }
    const double end = now_s() + timeout_s;
    int st = 0;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (now_s() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            printf("nccl_ranks: the GPU probe timed out\n");
            return 1;
        }
        usleep(10000);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}

int main(int argc, char **argv)
{
    int n = 2;
    size_t count = (1u << 20) + 3; /* odd: no size is a multiple of anything nice */
    double timeout_s = 120.0;
    int opt;
    while ((opt = getopt(argc, argv, "n:c:t:")) != -1) {
        switch (opt) {
        case 'n':
            n = atoi(optarg);
            break;
        case 'c':
            count = (size_t)strtoull(optarg, NULL, 10);
            break;
        case 't':
            timeout_s = atof(optarg);
            break;
        default:
            fprintf(stderr, "usage: %s [-n ranks] [-c count] [-t timeout_s]\n", argv[0]);
            return 2;
        }
    }
    if (n < 1 || n > MAX_RANKS || count == 0 || !(timeout_s > 0.0)) {
        fprintf(stderr, "nccl_ranks: need 1 <= n <= %d, count > 0, timeout > 0\n", MAX_RANKS);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const int pr = probe_gpu(30.0);
    if (pr != 0) {
        return pr == 77 ? 77 : 1;
    }

    int up[2], res_pipe[2], down[MAX_RANKS][2];
    if (pipe(up) != 0 || pipe(res_pipe) != 0) {
        perror("pipe");
        return 1;
    }
    for (int r = 0; r < n; r++) {
        if (pipe(down[r]) != 0) {
            perror("pipe");
            return 1;
        }
    }
    pid_t pids[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            for (int q = 0; q < r; q++) {
                kill(pids[q], SIGKILL);
            }
            return 1;
        }
        if (pids[r] == 0) {
            close(up[0]);
            close(res_pipe[0]);
            if (r != 0) {
                close(up[1]); /* so that the parent sees EOF if rank 0 dies */
            }
            for (int q = 0; q < n; q++) {
                close(down[q][1]);
                if (q != r) {
                    close(down[q][0]);
                }
            }
            alarm((unsigned)timeout_s + 10); /* last resort if a CUDA call itself hangs */
            const int st = rank_main(r, n, count, up[1], down[r][0], res_pipe[1], timeout_s);
            fflush(stdout);
            _exit(st);
        }
    }
    close(up[1]);
    close(res_pipe[1]);
    for (int r = 0; r < n; r++) {
        close(down[r][0]);
    }

    int failed = 0;
    ncclUniqueId id;
    if (read_all(up[0], &id, sizeof(id), timeout_s) != 0) {
        printf("nccl_ranks: rank 0 sent no unique id\n");
        failed = 1;
    } else {
        for (int r = 1; r < n; r++) {
            if (write_all(down[r][1], &id, sizeof(id)) != 0) {
                printf("nccl_ranks: cannot send the unique id to rank %d\n", r);
                failed = 1;
            }
        }
    }
    for (int r = 0; r < n; r++) {
        close(down[r][1]);
    }

    /* Reap with a deadline; kill (by pid) what is left. */
    const double end = now_s() + timeout_s + 15.0;
    int alive = n, timed_out = 0;
    int codes[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        codes[r] = -1;
    }
    while (alive > 0) {
        for (int r = 0; r < n; r++) {
            int st;
            if (codes[r] == -1 && waitpid(pids[r], &st, WNOHANG) == pids[r]) {
                codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                alive--;
            }
        }
        if (alive > 0 && now_s() > end) {
            for (int r = 0; r < n; r++) {
                if (codes[r] == -1) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    codes[r] = 128 + SIGKILL;
                    alive--;
                }
            }
            timed_out = 1;
        }
        usleep(20000);
    }

    long long wrong[NCHECK] = {0};
    double ms_max[NCHECK] = {0};
    int reported = 0;
    struct rank_result res;
    while (read_all(res_pipe[0], &res, sizeof(res), 1.0) == 0) {
        reported++;
        failed |= res.status != 0;
        for (int c = 0; c < NCHECK; c++) {
            wrong[c] += res.wrong[c];
            ms_max[c] = res.ms[c] > ms_max[c] ? res.ms[c] : ms_max[c];
        }
    }
    for (int r = 0; r < n; r++) {
        if (codes[r] != 0) {
            printf("nccl_ranks: rank %d exited with %d%s\n", r, codes[r],
                   timed_out && codes[r] == 128 + SIGKILL ? " (killed at the deadline)" : "");
            failed = 1;
        }
    }
    if (reported != n) {
        printf("nccl_ranks: %d of %d ranks reported\n", reported, n);
        failed = 1;
    }
    long long total_wrong = 0;
    for (int c = 0; c < NCHECK; c++) {
        printf("nccl_ranks n=%d %-24s count=%zu #wrong=%lld (max rank time %.2f ms)\n", n,
               check_names[c], count, wrong[c], ms_max[c]);
        total_wrong += wrong[c];
    }
    failed |= total_wrong != 0;
    printf("nccl_ranks n=%d: %s (%lld wrong elements over all ranks and checks)\n", n,
           failed ? "FAIL" : "PASS", total_wrong);
    return failed ? 1 : 0;
}
