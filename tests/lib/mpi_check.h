/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The harness of the multi-rank tests (tests/mpi: plain executables under mpirun; Criterion
 * forks, which MPI does not survive): failure counting per rank, CHECK / CHECK_OK, and
 * stderr capture for checking what the library logs. Included by one file per program.
 */
#ifndef MFSDP_TESTS_MPI_CHECK_H
#define MFSDP_TESTS_MPI_CHECK_H

#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include "mfsdp/status.h"

static int g_rank, g_world;
static int g_failures;

/* Count and print a failed condition (the program's exit status comes from g_failures). */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            g_failures++;                                                                          \
            fprintf(stderr, "[rank %d] FAIL %s:%d: %s: ", g_rank, __FILE__, __LINE__, #cond);      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        mfsdp_status_t _s = (call);                                                                \
        CHECK(_s == MFSDP_OK, "%s returned %s", #call, mfsdp_status_string(_s));                   \
    } while (0)

/* stderr into an unlinked temporary file between capture_begin() and capture_end(), which
 * returns the text (valid until the next capture). */
static char g_captured[65536];
static int capture_fd = -1, saved_fd = -1;

static inline void capture_begin(void)
{
    char path[96];
    snprintf(path, sizeof(path), "/tmp/mfsdp-test-capture-%d-%d.log", (int)getpid(), g_rank);
    fflush(stderr);
    FILE *f = fopen(path, "w+");
    unlink(path);
    capture_fd = dup(fileno(f));
    fclose(f);
    saved_fd = dup(2);
    dup2(capture_fd, 2);
}

static inline const char *capture_end(void)
{
    fflush(stderr);
    dup2(saved_fd, 2);
    close(saved_fd);
    lseek(capture_fd, 0, SEEK_SET);
    ssize_t n = read(capture_fd, g_captured, sizeof(g_captured) - 1);
    g_captured[n > 0 ? n : 0] = '\0';
    close(capture_fd);
    return g_captured;
}

#endif /* MFSDP_TESTS_MPI_CHECK_H */
