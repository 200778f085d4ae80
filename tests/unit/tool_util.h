/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Running a command-line tool from a Criterion test: its exit status, stdout and stderr.
 * The tool runs with the MFSDP_* variables of the test's own environment that could change
 * its output removed, then the test's assignments applied.
 */
#ifndef MFSDP_TESTS_TOOL_UTIL_H
#define MFSDP_TESTS_TOOL_UTIL_H

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct run_result {
    int rc; /* exit status, or 128 + signal */
    char *out;
    size_t outlen;
    char *err;
} run_result_t;

/* A whole file, NUL-terminated (asserts it can be read). */
static inline char *slurp(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (cap - len - 1 == 0) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
    }
    fclose(f);
    buf[len] = '\0';
    if (len_p != NULL) {
        *len_p = len;
    }
    return buf;
}

/* Run tool with args (NULL-terminated, without argv[0]) and env assignments ("K=V",
 * NULL-terminated, may be NULL). */
static inline run_result_t tool_run(const char *tool, const char *const *args,
                                    const char *const *env)
{
    char outp[64], errp[64];
    snprintf(outp, sizeof(outp), "/tmp/mfsdp-tool-%d.out", (int)getpid());
    snprintf(errp, sizeof(errp), "/tmp/mfsdp-tool-%d.err", (int)getpid());
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int fo = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fe = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fo < 0 || fe < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0) {
            _exit(127);
        }
        static const char *const vars[] = {"MFSDP_TAIL",  "MFSDP_MEM_LIMIT",  "MFSDP_SPREAD",
                                           "MFSDP_DEBUG", "MFSDP_DEBUG_FILE", "MFSDP_DEBUG_SUBSYS",
                                           NULL};
        for (const char *const *v = vars; *v != NULL; v++) {
            unsetenv(*v);
        }
        for (const char *const *e = env; e != NULL && *e != NULL; e++) {
            putenv((char *)*e);
        }
        const char *argv[64] = {tool};
        int n = 1;
        for (const char *const *a = args; *a != NULL && n < 63; a++) {
            argv[n++] = *a;
        }
        argv[n] = NULL;
        execv(tool, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    run_result_t r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.out = slurp(outp, &r.outlen);
    r.err = slurp(errp, NULL);
    unlink(outp);
    unlink(errp);
    cr_assert_neq(r.rc, 127, "could not run %s", tool);
    return r;
}

static inline void run_free(run_result_t *r)
{
    free(r->out);
    free(r->err);
}

#endif /* MFSDP_TESTS_TOOL_UTIL_H */
