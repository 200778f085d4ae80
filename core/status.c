/* SPDX-License-Identifier: Apache-2.0 */
#include <string.h>
#include <strings.h>

#include "mfsdp/status.h"
#include "mfsdp/types.h"

const char *mfsdp_status_string(mfsdp_status_t status)
{
    switch (status) {
    case MFSDP_OK:
        return "success";
    case MFSDP_ERR_INVALID_ARG:
        return "invalid argument";
    case MFSDP_ERR_NO_MEMORY:
        return "out of memory";
    case MFSDP_ERR_IO:
        return "i/o error";
    case MFSDP_ERR_PARSE:
        return "parse error";
    case MFSDP_ERR_UNSUPPORTED:
        return "unsupported";
    case MFSDP_ERR_OVERFLOW:
        return "size overflow";
    case MFSDP_ERR_MEM_LIMIT:
        return "memory limit exceeded";
    case MFSDP_ERR_MISMATCH:
        return "mismatch with the plan";
    case MFSDP_ERR_INTERNAL:
        return "internal error";
    case MFSDP_ERR_TRANSPORT:
        return "transport (mpi) error";
    case MFSDP_ERR_CUDA:
        return "cuda error";
    case MFSDP_ERR_NCCL:
        return "nccl error";
    case MFSDP_ERR_STATE:
        return "invalid state";
    case MFSDP_ERR_NOT_FOUND:
        return "not found";
    case MFSDP_ERR_CHECKSUM:
        return "checksum mismatch";
    case MFSDP_ERR_CONFIG:
        return "bad configuration variable";
    case MFSDP_ERR_SEQUENCE:
        return "call sequence violation";
    }
    return "unknown status";
}

size_t mfsdp_dtype_size(mfsdp_dtype_t dtype)
{
    switch (dtype) {
    case MFSDP_FLOAT32:
        return 4;
    case MFSDP_BFLOAT16:
        return 2;
    case MFSDP_FLOAT16:
        return 2;
    case MFSDP_UINT8:
        return 1;
    default:
        return 0;
    }
}

static const char *const dtype_names[MFSDP_DTYPE_COUNT] = {
    [MFSDP_FLOAT32] = "float32",
    [MFSDP_BFLOAT16] = "bfloat16",
    [MFSDP_FLOAT16] = "float16",
    [MFSDP_UINT8] = "uint8",
};

const char *mfsdp_dtype_name(mfsdp_dtype_t dtype)
{
    if ((unsigned)dtype >= MFSDP_DTYPE_COUNT) {
        return "invalid";
    }
    return dtype_names[dtype];
}

mfsdp_status_t mfsdp_dtype_parse(const char *name, mfsdp_dtype_t *dtype_p)
{
    if (name == NULL || dtype_p == NULL) {
        return MFSDP_ERR_INVALID_ARG;
    }
    for (int i = 0; i < MFSDP_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_names[i]) == 0) {
            *dtype_p = (mfsdp_dtype_t)i;
            return MFSDP_OK;
        }
    }
    return MFSDP_ERR_INVALID_ARG;
}
