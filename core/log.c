/* SPDX-License-Identifier: Apache-2.0 */
#include "core/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_ready;
static mfsdp_log_level_t log_level = MFSDP_LOG_WARN;
static unsigned log_mask = MFSDP_SUBSYS_ALL;
static FILE *log_file;
static char log_host[64];

static const struct {
    const char *name;
    unsigned bit;
} subsys_names[] = {
#define MFSDP_SUBSYS_NAME(name, bit) {#name, 1u << (bit)},
    MFSDP_SUBSYS_TABLE(MFSDP_SUBSYS_NAME)
#undef MFSDP_SUBSYS_NAME
};
#define NSUBSYS (sizeof(subsys_names) / sizeof(subsys_names[0]))

/* MFSDP_DEBUG_SUBSYS: a comma list of subsystem names (or ALL), a leading ^ negating it.
 * 0 and *mask_p, or -1 with the first unknown name in bad. */
int mfsdp_log_subsys_parse(const char *s, unsigned *mask_p, char *bad, size_t badlen)
{
    if (s == NULL || *s == '\0') {
        *mask_p = MFSDP_SUBSYS_ALL;
        return 0;
    }
    int negate = (*s == '^');
    if (negate) {
        s++;
    }
    unsigned mask = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (strcasecmp(tok, "ALL") == 0) {
            mask = MFSDP_SUBSYS_ALL;
            continue;
        }
        size_t i = 0;
        while (i < NSUBSYS && strcasecmp(tok, subsys_names[i].name) != 0) {
            i++;
        }
        if (i == NSUBSYS) {
            if (bad != NULL && badlen != 0) {
                snprintf(bad, badlen, "%s", tok);
            }
            return -1;
        }
        mask |= subsys_names[i].bit;
    }
    *mask_p = negate ? ~mask : mask;
    return 0;
}

static unsigned parse_subsys(const char *s)
{
    unsigned mask;
    /* An unknown name is refused by the config table (mfsdp_config_get); until then log
     * everything rather than nothing. */
    return mfsdp_log_subsys_parse(s, &mask, NULL, 0) == 0 ? mask : MFSDP_SUBSYS_ALL;
}

/* Expand %h (host) and %p (pid) as NCCL_DEBUG_FILE does. */
static void expand_path(const char *in, char *out, size_t outlen)
{
    size_t o = 0;
    for (const char *p = in; *p != '\0' && o + 1 < outlen; p++) {
        if (p[0] == '%' && (p[1] == 'h' || p[1] == 'p')) {
            int n = (p[1] == 'h') ? snprintf(out + o, outlen - o, "%s", log_host)
                                  : snprintf(out + o, outlen - o, "%d", (int)getpid());
            if (n < 0) {
                break;
            }
            o += (size_t)n < outlen - o ? (size_t)n : outlen - o - 1;
            p++;
        } else {
            out[o++] = *p;
        }
    }
    out[o] = '\0';
}

static void log_init_locked(void)
{
    if (gethostname(log_host, sizeof(log_host)) != 0) {
        snprintf(log_host, sizeof(log_host), "unknown");
    }
    log_host[sizeof(log_host) - 1] = '\0';
    char *dot = strchr(log_host, '.');
    if (dot != NULL) {
        *dot = '\0';
    }
    const char *lvl = getenv("MFSDP_DEBUG");
    log_level = MFSDP_LOG_WARN;
    if (lvl != NULL) {
        if (strcasecmp(lvl, "NONE") == 0 || strcasecmp(lvl, "VERSION") == 0) {
            log_level = MFSDP_LOG_NONE;
        } else if (strcasecmp(lvl, "INFO") == 0) {
            log_level = MFSDP_LOG_INFO;
        } else if (strcasecmp(lvl, "TRACE") == 0) {
            log_level = MFSDP_LOG_TRACE;
        }
        /* WARN and invalid values keep WARN; the config table rejects invalid ones. */
    }
    log_mask = parse_subsys(getenv("MFSDP_DEBUG_SUBSYS"));
    if (log_file != NULL && log_file != stderr) {
        fclose(log_file);
    }
    log_file = stderr;
    const char *path = getenv("MFSDP_DEBUG_FILE");
    if (path != NULL && *path != '\0') {
        char buf[4096];
        expand_path(path, buf, sizeof(buf));
        FILE *f = fopen(buf, "a");
        if (f != NULL) {
            setvbuf(f, NULL, _IOLBF, 0);
            log_file = f;
        } else {
            fprintf(stderr, "%s:%d mfsdp WARN cannot open MFSDP_DEBUG_FILE %s: %s\n", log_host,
                    (int)getpid(), buf, strerror(errno));
        }
    }
    log_ready = 1;
}

void mfsdp_log_reinit(void)
{
    pthread_mutex_lock(&log_lock);
    log_init_locked();
    pthread_mutex_unlock(&log_lock);
}

int mfsdp_log_enabled(mfsdp_log_level_t level, unsigned subsys)
{
    if (!__atomic_load_n(&log_ready, __ATOMIC_ACQUIRE)) {
        mfsdp_log_reinit();
    }
    return level <= log_level && (level == MFSDP_LOG_WARN || (subsys & log_mask) != 0);
}

static const char *subsys_name(unsigned subsys)
{
    for (size_t i = 0; i < NSUBSYS; i++) {
        if (subsys == subsys_names[i].bit) {
            return subsys_names[i].name;
        }
    }
    return NULL;
}

static __thread int capture_on;
static __thread char capture_msg[1024];

void mfsdp_log_capture_begin(void)
{
    capture_on = 1;
    capture_msg[0] = '\0';
}

void mfsdp_log_capture_end(char *buf, size_t len)
{
    capture_on = 0;
    if (buf != NULL && len > 0) {
        snprintf(buf, len, "%s", capture_msg);
    }
    capture_msg[0] = '\0';
}

void mfsdp_log(mfsdp_log_level_t level, unsigned subsys, const char *file, int line,
               const char *fmt, ...)
{
    int saved_errno = errno; /* keep %m meaningful */
    if (level == MFSDP_LOG_WARN && capture_on) {
        va_list ap;
        va_start(ap, fmt);
        char msg[1024];
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        if (capture_msg[0] == '\0') {
            snprintf(capture_msg, sizeof(capture_msg), "%s", msg);
        }
        errno = saved_errno;
        mfsdp_log(MFSDP_LOG_INFO, MFSDP_SUBSYS_ALL, file, line, "(reported by the caller) %s", msg);
        return;
    }
    if (!mfsdp_log_enabled(level, subsys)) {
        errno = saved_errno;
        return;
    }
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    errno = saved_errno;
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);

    const char *lname = level == MFSDP_LOG_WARN   ? "WARN"
                        : level == MFSDP_LOG_INFO ? "INFO"
                                                  : "TRACE";
    const char *sname = subsys_name(subsys);
    pthread_mutex_lock(&log_lock);
    if (level == MFSDP_LOG_WARN) {
        const char *base = strrchr(file, '/');
        fprintf(log_file, "%s:%d:%ld mfsdp WARN %s:%d %s\n", log_host, (int)getpid(),
                (long)syscall(SYS_gettid), base ? base + 1 : file, line, msg);
    } else {
        fprintf(log_file, "%s:%d:%ld mfsdp %s %s%s%s\n", log_host, (int)getpid(),
                (long)syscall(SYS_gettid), lname, sname ? sname : "", sname ? " " : "", msg);
    }
    fflush(log_file);
    pthread_mutex_unlock(&log_lock);
    errno = saved_errno;
}
