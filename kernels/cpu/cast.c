/* SPDX-License-Identifier: Apache-2.0 */
/*
 * float32 <-> bfloat16 / float16 conversions, round to nearest even, done on the bit
 * patterns so that the result never depends on the FPU's rounding mode or on F16C.
 */
#include <string.h>

#include "core/checks.h"
#include "core/log.h"
#include "kernels/cpu/cpu.h"
#include "mfsdp/kernels.h"

static inline uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

uint16_t mfsdp_f32_to_bf16(float x)
{
    const uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        /* NaN: keep sign and top payload, set the quiet bit (a payload only in the low 16
         * bits would otherwise truncate to infinity). */
        return (uint16_t)((u >> 16) | 0x0040u);
    }
    /* Add just under half an ulp, plus one when the kept part is odd: ties go to even, and
     * a carry out of the mantissa rounds up the exponent (to inf past the largest value). */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float mfsdp_bf16_to_f32(uint16_t h)
{
    return mfsdp_bf16_widen(h);
}

uint16_t mfsdp_f32_to_f16(float x)
{
    const uint32_t u = f32_bits(x);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x01ffu)); /* quiet NaN */
    }
    if (a >= 0x477ff000u) {
        /* >= 65520 = largest half (65504) + half an ulp: rounds to inf (inf stays inf). */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a >= 0x38800000u) {
        /* Normal half: rebias the exponent (127 -> 15) and round the 13 dropped bits. */
        const uint32_t r = a - 0x38000000u;
        return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
    }
    if (a <= 0x33000000u) {
        return sign; /* <= 2^-25, half the smallest subnormal: ties to even zero */
    }
    /* Subnormal half: value = mant * 2^(e - 150), in units of 2^-24 that is
     * mant >> (126 - e); 102 < e < 113 so the shift is 14..24. */
    const uint32_t e = a >> 23;
    const uint32_t mant = (a & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126u - e;
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t q = mant >> shift;
    if (rem > half || (rem == half && (q & 1u))) {
        q++; /* may carry into the smallest normal, 0x0400, which is right */
    }
    return (uint16_t)(sign | q);
}

float mfsdp_f16_to_f32(uint16_t h)
{
    return mfsdp_f16_widen(h);
}

int mfsdp_cpu_float_dtype(mfsdp_dtype_t dtype)
{
    return dtype == MFSDP_FLOAT32 || dtype == MFSDP_BFLOAT16 || dtype == MFSDP_FLOAT16;
}

mfsdp_status_t mfsdp_cpu_check_comm(const float *w, const void *w_comm, mfsdp_dtype_t dtype,
                                    size_t n)
{
    if (w_comm == NULL) {
        return MFSDP_OK;
    }
    if (!mfsdp_cpu_float_dtype(dtype)) {
        MFSDP_WARN("comm copy: unsupported dtype %d (%s)", (int)dtype, mfsdp_dtype_name(dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    if (mfsdp_ranges_overlap(w, n * sizeof(float), w_comm, n * mfsdp_dtype_size(dtype))) {
        MFSDP_WARN("comm copy overlaps the master weights");
        return MFSDP_ERR_INVALID_ARG;
    }
    return MFSDP_OK;
}

/* Widen element i of a float-typed array. */
static inline float load_f32(const void *src, mfsdp_dtype_t dtype, size_t i)
{
    switch (dtype) {
    case MFSDP_BFLOAT16:
        return mfsdp_bf16_widen(((const uint16_t *)src)[i]);
    case MFSDP_FLOAT16:
        return mfsdp_f16_widen(((const uint16_t *)src)[i]);
    default:
        return ((const float *)src)[i];
    }
}

mfsdp_status_t mfsdp_cpu_cast(void *dst, mfsdp_dtype_t dst_dtype, const void *src,
                              mfsdp_dtype_t src_dtype, size_t n)
{
    size_t dbytes;
    size_t sbytes;
    if (dst == NULL || src == NULL || n == 0) {
        MFSDP_WARN("cast: %s", n == 0 ? "empty input" : "null pointer");
        return MFSDP_ERR_INVALID_ARG;
    }
    if (!mfsdp_cpu_float_dtype(dst_dtype) || !mfsdp_cpu_float_dtype(src_dtype)) {
        MFSDP_WARN("cast: unsupported dtype %s -> %s", mfsdp_dtype_name(src_dtype),
                   mfsdp_dtype_name(dst_dtype));
        return MFSDP_ERR_INVALID_ARG;
    }
    if (mfsdp_mul_overflow(n, mfsdp_dtype_size(dst_dtype), &dbytes) ||
        mfsdp_mul_overflow(n, mfsdp_dtype_size(src_dtype), &sbytes)) {
        MFSDP_WARN("cast: %zu elements overflow", n);
        return MFSDP_ERR_OVERFLOW;
    }
    if (dst_dtype == src_dtype) {
        memmove(dst, src, dbytes);
        return MFSDP_OK;
    }
    if (mfsdp_ranges_overlap(dst, dbytes, src, sbytes)) {
        MFSDP_WARN("cast: source and destination overlap");
        return MFSDP_ERR_INVALID_ARG;
    }
    switch (dst_dtype) {
    case MFSDP_FLOAT32:
        for (size_t i = 0; i < n; i++) {
            ((float *)dst)[i] = load_f32(src, src_dtype, i);
        }
        break;
    case MFSDP_BFLOAT16:
        for (size_t i = 0; i < n; i++) {
            ((uint16_t *)dst)[i] = mfsdp_f32_to_bf16(load_f32(src, src_dtype, i));
        }
        break;
    default:
        for (size_t i = 0; i < n; i++) {
            ((uint16_t *)dst)[i] = mfsdp_f32_to_f16(load_f32(src, src_dtype, i));
        }
        break;
    }
    return MFSDP_OK;
}
