/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file status.h
 * @brief Status codes returned by every mfsdp library function.
 *
 * Zero is success, negative values are errors. Outputs of a function are written
 * only when it returns ::MFSDP_OK.
 */
#ifndef MFSDP_STATUS_H
#define MFSDP_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/** Marks a symbol exported from libmfsdp.so (the build uses -fvisibility=hidden). */
#if defined(__GNUC__)
#define MFSDP_API __attribute__((visibility("default")))
#else
#define MFSDP_API
#endif

/** Result of an mfsdp call. */
typedef enum mfsdp_status {
    MFSDP_OK = 0,               /**< success */
    MFSDP_ERR_INVALID_ARG = -1, /**< a null pointer, zero/negative dimension, bad enum */
    MFSDP_ERR_NO_MEMORY = -2,   /**< an allocation failed */
    MFSDP_ERR_IO = -3,          /**< a file could not be read or written */
    MFSDP_ERR_PARSE = -4,       /**< malformed manifest, record or checkpoint index */
    MFSDP_ERR_UNSUPPORTED = -5, /**< valid input that this version does not handle */
    MFSDP_ERR_OVERFLOW = -6,    /**< a size does not fit the integer type it must fit */
    MFSDP_ERR_MEM_LIMIT = -7,   /**< the plan cannot respect MFSDP_MEM_LIMIT */
    MFSDP_ERR_MISMATCH = -8,    /**< arguments disagree with the plan (count, dtype, size) */
    MFSDP_ERR_INTERNAL = -9,    /**< a broken invariant: a bug in mfsdp */
    MFSDP_ERR_TRANSPORT = -10,  /**< MPI reported an error */
    MFSDP_ERR_CUDA = -11,       /**< CUDA or cuBLAS reported an error */
    MFSDP_ERR_NCCL = -12,       /**< NCCL reported an error */
    MFSDP_ERR_STATE = -13,      /**< call not valid in the object's current state */
    MFSDP_ERR_NOT_FOUND = -14,  /**< a named object does not exist */
    MFSDP_ERR_CHECKSUM = -15,   /**< data failed verification */
    MFSDP_ERR_CONFIG = -16,     /**< an MFSDP_* environment variable has a bad value */
    MFSDP_ERR_SEQUENCE = -17,   /**< a call contradicts the expected call sequence */
} mfsdp_status_t;

/**
 * @brief Human-readable name of a status.
 * @param [in] status any value, including unknown ones
 * @return a static string, never NULL
 */
MFSDP_API const char *mfsdp_status_string(mfsdp_status_t status);

#ifdef __cplusplus
}
#endif
#endif /* MFSDP_STATUS_H */
