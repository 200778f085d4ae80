/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Error-propagation macros (NCCL checks.h style). Each failure is logged once with
 * file:line, so a failing call prints its chain on the way up.
 */
#ifndef MFSDP_CORE_CHECKS_H
#define MFSDP_CORE_CHECKS_H

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "core/log.h"
#include "mfsdp/status.h"

/* A one-line message into the (char *err, size_t errlen) of the enclosing function, when the
 * caller gave a buffer. */
#define SETERR(...)                                                                                \
    do {                                                                                           \
        if (err != NULL && errlen > 0) {                                                           \
            snprintf(err, errlen, __VA_ARGS__);                                                    \
        }                                                                                          \
    } while (0)

/* Propagate a failing mfsdp_status_t. */
#define MFSDP_CHECK(call)                                                                          \
    do {                                                                                           \
        mfsdp_status_t _st = (call);                                                               \
        if (_st != MFSDP_OK) {                                                                     \
            MFSDP_LOG_CHAIN("%s -> %s", #call, mfsdp_status_string(_st));                          \
            return _st;                                                                            \
        }                                                                                          \
    } while (0)

/* Store the failing status in st and jump to label (for cleanup). */
#define MFSDP_CHECK_GOTO(call, st, label)                                                          \
    do {                                                                                           \
        (st) = (call);                                                                             \
        if ((st) != MFSDP_OK) {                                                                    \
            MFSDP_LOG_CHAIN("%s -> %s", #call, mfsdp_status_string(st));                           \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* Argument validation: log and return MFSDP_ERR_INVALID_ARG when cond is false. */
#define MFSDP_CHECK_ARG(cond)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            MFSDP_WARN("invalid argument: %s", #cond);                                             \
            return MFSDP_ERR_INVALID_ARG;                                                          \
        }                                                                                          \
    } while (0)

/* A system call returning -1 with errno: log with %m and return MFSDP_ERR_IO. */
#define MFSDP_SYS_CHECK(call, name)                                                                \
    do {                                                                                           \
        if ((call) == -1) {                                                                        \
            MFSDP_WARN("%s failed: %m", name);                                                     \
            return MFSDP_ERR_IO;                                                                   \
        }                                                                                          \
    } while (0)

/* MPI: any non-MPI_SUCCESS code becomes MFSDP_ERR_TRANSPORT (only in MPI translation units). */
#define MFSDP_MPI_CHECK(call)                                                                      \
    do {                                                                                           \
        int _rc = (call);                                                                          \
        if (_rc != MPI_SUCCESS) {                                                                  \
            char _msg[MPI_MAX_ERROR_STRING];                                                       \
            int _len = 0;                                                                          \
            MPI_Error_string(_rc, _msg, &_len);                                                    \
            MFSDP_WARN("%s failed: %s", #call, _msg);                                              \
            return MFSDP_ERR_TRANSPORT;                                                            \
        }                                                                                          \
    } while (0)

/* CUDA runtime (only in translation units that include cuda_runtime.h). */
#define MFSDP_CUDA_CHECK(call)                                                                     \
    do {                                                                                           \
        cudaError_t _e = (call);                                                                   \
        if (_e != cudaSuccess) {                                                                   \
            MFSDP_WARN("%s failed: %s", #call, cudaGetErrorString(_e));                            \
            return MFSDP_ERR_CUDA;                                                                 \
        }                                                                                          \
    } while (0)

/* NCCL (only in translation units that include nccl.h). */
#define MFSDP_NCCL_CHECK(call)                                                                     \
    do {                                                                                           \
        ncclResult_t _r = (call);                                                                  \
        if (_r != ncclSuccess && _r != ncclInProgress) {                                           \
            MFSDP_WARN("%s failed: %s", #call, ncclGetErrorString(_r));                            \
            return MFSDP_ERR_NCCL;                                                                 \
        }                                                                                          \
    } while (0)

/* Overflow-checked size arithmetic. */
static inline int mfsdp_mul_overflow(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}
static inline int mfsdp_add_overflow(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

#endif /* MFSDP_CORE_CHECKS_H */
