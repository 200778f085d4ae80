/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Logging in NCCL's format: "host:pid:tid mfsdp INFO <subsys> message". Level from
 * MFSDP_DEBUG (WARN|INFO|TRACE, default WARN; NONE or VERSION silences warnings too),
 * subsystems from MFSDP_DEBUG_SUBSYS (comma list, ^ negates), sink from MFSDP_DEBUG_FILE
 * (%h host, %p pid). Messages are lowercase; use %m after a failed system call.
 */
#ifndef MFSDP_CORE_LOG_H
#define MFSDP_CORE_LOG_H

#include <stdarg.h>
#include <stddef.h>

typedef enum mfsdp_log_level {
    MFSDP_LOG_NONE = 0,
    MFSDP_LOG_WARN = 1,
    MFSDP_LOG_INFO = 2,
    MFSDP_LOG_TRACE = 3,
} mfsdp_log_level_t;

/* Subsystems: bit flags, names as printed and as accepted by MFSDP_DEBUG_SUBSYS. */
#define MFSDP_SUBSYS_TABLE(X)                                                                      \
    X(INIT, 0)                                                                                     \
    X(ENV, 1)                                                                                      \
    X(MANIFEST, 2)                                                                                 \
    X(PLAN, 3)                                                                                     \
    X(KERNEL, 4)                                                                                   \
    X(ALLOC, 5)                                                                                    \
    X(TRANSPORT, 6)                                                                                \
    X(RUNTIME, 7)                                                                                  \
    X(SHIM, 8)                                                                                     \
    X(CKPT, 9)                                                                                     \
    X(TUNER, 10)                                                                                   \
    X(PERF, 11)

/* "INIT|ENV|...|PERF|ALL": the names MFSDP_DEBUG_SUBSYS accepts, for help and errors. */
#define MFSDP_SUBSYS_STR(name, bit) #name "|"
#define MFSDP_SUBSYS_LIST           MFSDP_SUBSYS_TABLE(MFSDP_SUBSYS_STR) "ALL"

typedef enum mfsdp_subsys {
#define MFSDP_SUBSYS_ENUM(name, bit) MFSDP_SUBSYS_##name = 1u << (bit),
    MFSDP_SUBSYS_TABLE(MFSDP_SUBSYS_ENUM)
#undef MFSDP_SUBSYS_ENUM
        MFSDP_SUBSYS_ALL = 0xffffffffu,
} mfsdp_subsys_t;

/* Core entry point; use the macros below. Thread-safe; initialized on first use. */
void mfsdp_log(mfsdp_log_level_t level, unsigned subsys, const char *file, int line,
               const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* 1 when a message of this level and subsystem would be printed (cheap). */
int mfsdp_log_enabled(mfsdp_log_level_t level, unsigned subsys);

/* While a capture is active on the calling thread, WARN messages are not printed: the first
 * one is kept for the caller, which reports the failure itself (the shim prints one fatal
 * line per job instead of one WARN per rank), and every one is logged at INFO. Captures do
 * not nest. */
void mfsdp_log_capture_begin(void);
/* End the capture; the first captured WARN message (or "") goes to buf. */
void mfsdp_log_capture_end(char *buf, size_t len);

/* Re-read MFSDP_DEBUG* (tests and tools that change the environment). */
void mfsdp_log_reinit(void);
/* Parse an MFSDP_DEBUG_SUBSYS value (comma list of the names above or ALL, a leading ^
 * negates): 0 with *mask_p, or -1 with the first unknown name copied to bad. */
int mfsdp_log_subsys_parse(const char *s, unsigned *mask_p, char *bad, size_t badlen);

#define MFSDP_WARN(...) mfsdp_log(MFSDP_LOG_WARN, MFSDP_SUBSYS_ALL, __FILE__, __LINE__, __VA_ARGS__)
#define MFSDP_INFO(subsys, ...)                                                                    \
    mfsdp_log(MFSDP_LOG_INFO, MFSDP_SUBSYS_##subsys, __FILE__, __LINE__, __VA_ARGS__)
#define MFSDP_TRACE(subsys, ...)                                                                   \
    mfsdp_log(MFSDP_LOG_TRACE, MFSDP_SUBSYS_##subsys, __FILE__, __LINE__, __VA_ARGS__)
/* The "call chain" line of a propagated failure: printed at INFO so that one failure
 * shows one WARN (where it started) and, with MFSDP_DEBUG=INFO, the path it took. */
#define MFSDP_LOG_CHAIN(...)                                                                       \
    mfsdp_log(MFSDP_LOG_INFO, MFSDP_SUBSYS_ALL, __FILE__, __LINE__, __VA_ARGS__)

#endif /* MFSDP_CORE_LOG_H */
