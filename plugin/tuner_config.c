/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The override file (MFSDP_TUNER_CONFIG), in the CSV format of NCCL's example tuner so
 * that existing files carry over:
 *   coll,min_bytes,max_bytes,algo,proto,channels,nNodes,nRanks[,numPipeOps[,regBuff]]
 * -1 is a wildcard, '#' starts a comment line, blank lines are ignored. Unlike the
 * example (which maps unknown names to a default and atoi's garbage to 0), every line
 * that is not exactly right stops the load with a message naming file:line.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "plugin/tuner.h"

#define CONFIG_FIELDS_MIN 8
#define CONFIG_FIELDS_MAX 10
/* NCCL's MAXCHANNELS. */
#define CONFIG_MAX_CHANNELS 64

typedef struct name_entry {
    const char *name;
    int value;
} name_entry_t;

static const name_entry_t coll_names[] = {
    {"broadcast", ncclFuncBroadcast}, {"reduce", ncclFuncReduce},
    {"allgather", ncclFuncAllGather}, {"reducescatter", ncclFuncReduceScatter},
    {"allreduce", ncclFuncAllReduce}, {NULL, 0},
};
static const name_entry_t algo_names[] = {
    {"tree", NCCL_ALGO_TREE},
    {"ring", NCCL_ALGO_RING},
    {"collnet_direct", NCCL_ALGO_COLLNET_DIRECT},
    {"collnet_chain", NCCL_ALGO_COLLNET_CHAIN},
    {"nvls", NCCL_ALGO_NVLS},
    {"nvls_tree", NCCL_ALGO_NVLS_TREE},
    {"pat", NCCL_ALGO_PAT},
    {NULL, 0},
};
static const name_entry_t proto_names[] = {
    {"ll", NCCL_PROTO_LL},
    {"ll128", NCCL_PROTO_LL128},
    {"simple", NCCL_PROTO_SIMPLE},
    {NULL, 0},
};

static const char *name_of(const name_entry_t *table, int value)
{
    for (const name_entry_t *e = table; e->name != NULL; e++) {
        if (e->value == value) {
            return e->name;
        }
    }
    return "unknown";
}

const char *mfsdp_tuner_coll_name(ncclFunc_t coll)
{
    return name_of(coll_names, (int)coll);
}

const char *mfsdp_tuner_algo_name(int algo)
{
    return name_of(algo_names, algo);
}

const char *mfsdp_tuner_proto_name(int proto)
{
    return name_of(proto_names, proto);
}

static int lookup_name(const name_entry_t *table, const char *s, int *value_p)
{
    for (const name_entry_t *e = table; e->name != NULL; e++) {
        if (strcasecmp(e->name, s) == 0) {
            *value_p = e->value;
            return 0;
        }
    }
    return -1;
}

/* Decimal digits only (no sign, no base prefix, no blanks), no overflow. */
static int parse_u64(const char *s, unsigned long long *value_p)
{
    if (*s < '0' || *s > '9') {
        return -1;
    }
    for (const char *c = s; *c != '\0'; c++) {
        if (*c < '0' || *c > '9') {
            return -1;
        }
    }
    errno = 0;
    unsigned long long v = strtoull(s, NULL, 10);
    if (errno == ERANGE) {
        return -1;
    }
    *value_p = v;
    return 0;
}

/* -1 (wildcard) or an integer in [lo, hi]. */
static int parse_int_or_any(const char *s, long long lo, long long hi, int *value_p)
{
    if (strcmp(s, "-1") == 0) {
        *value_p = MFSDP_TUNER_ANY;
        return 0;
    }
    unsigned long long v;
    if (parse_u64(s, &v) != 0 || v < (unsigned long long)lo || v > (unsigned long long)hi) {
        return -1;
    }
    *value_p = (int)v;
    return 0;
}

/* -1 (wildcard) or a byte count. */
static int parse_bytes(const char *s, size_t any, size_t *value_p)
{
    if (strcmp(s, "-1") == 0) {
        *value_p = any;
        return 0;
    }
    unsigned long long v;
    if (parse_u64(s, &v) != 0 || v > SIZE_MAX) {
        return -1;
    }
    *value_p = (size_t)v;
    return 0;
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n')) {
        s[--n] = '\0';
    }
    return s;
}

/* Parses one non-comment, non-blank line (modified in place). 0 or -1 after a WARN. */
static int parse_rule(char *text, const char *path, int line, ncclDebugLogger_t logger,
                      mfsdp_tuner_rule_t *rule)
{
    char *fields[CONFIG_FIELDS_MAX + 1];
    int nfields = 0;
    char *cursor = text;
    for (;;) {
        char *comma = strchr(cursor, ',');
        if (nfields <= CONFIG_FIELDS_MAX) {
            fields[nfields] = cursor;
        }
        nfields++;
        if (comma == NULL) {
            break;
        }
        *comma = '\0';
        cursor = comma + 1;
    }
    if (nfields < CONFIG_FIELDS_MIN || nfields > CONFIG_FIELDS_MAX) {
        TUNER_WARN(logger,
                   "mfsdp tuner: %s:%d: expected 8 to 10 comma-separated fields "
                   "(coll,min_bytes,max_bytes,algo,proto,channels,nNodes,nRanks"
                   "[,numPipeOps[,regBuff]]), found %d",
                   path, line, nfields);
        return -1;
    }
    for (int i = 0; i < nfields; i++) {
        fields[i] = trim(fields[i]);
    }

    int coll;
    if (lookup_name(coll_names, fields[0], &coll) != 0) {
        TUNER_WARN(logger,
                   "mfsdp tuner: %s:%d: unknown collective '%s' "
                   "(expected broadcast|reduce|allgather|reducescatter|allreduce)",
                   path, line, fields[0]);
        return -1;
    }
    rule->coll = (ncclFunc_t)coll;
    if (parse_bytes(fields[1], 0, &rule->min_bytes) != 0) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: min_bytes '%s' is not a byte count or -1", path,
                   line, fields[1]);
        return -1;
    }
    if (parse_bytes(fields[2], SIZE_MAX, &rule->max_bytes) != 0) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: max_bytes '%s' is not a byte count or -1", path,
                   line, fields[2]);
        return -1;
    }
    if (rule->min_bytes > rule->max_bytes) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: min_bytes %zu > max_bytes %zu", path, line,
                   rule->min_bytes, rule->max_bytes);
        return -1;
    }
    if (lookup_name(algo_names, fields[3], &rule->algo) != 0) {
        TUNER_WARN(logger,
                   "mfsdp tuner: %s:%d: unknown algorithm '%s' "
                   "(expected tree|ring|collnet_direct|collnet_chain|nvls|nvls_tree|pat)",
                   path, line, fields[3]);
        return -1;
    }
    if (lookup_name(proto_names, fields[4], &rule->proto) != 0) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: unknown protocol '%s' (expected ll|ll128|simple)",
                   path, line, fields[4]);
        return -1;
    }
    if (parse_int_or_any(fields[5], 0, CONFIG_MAX_CHANNELS, &rule->channels) != 0) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: channels '%s' is not -1 or 0..%d", path, line,
                   fields[5], CONFIG_MAX_CHANNELS);
        return -1;
    }
    static const char *const count_names[] = {"nNodes", "nRanks", "numPipeOps"};
    int *counts[] = {&rule->nnodes, &rule->nranks, &rule->pipe_ops};
    rule->pipe_ops = MFSDP_TUNER_ANY;
    for (int i = 0; i < 3 && 6 + i < nfields; i++) {
        if (parse_int_or_any(fields[6 + i], 1, INT_MAX, counts[i]) != 0) {
            TUNER_WARN(logger, "mfsdp tuner: %s:%d: %s '%s' is not -1 or a positive integer", path,
                       line, count_names[i], fields[6 + i]);
            return -1;
        }
    }
    rule->reg_buff = MFSDP_TUNER_ANY;
    if (nfields == CONFIG_FIELDS_MAX && parse_int_or_any(fields[9], 0, 1, &rule->reg_buff) != 0) {
        TUNER_WARN(logger, "mfsdp tuner: %s:%d: regBuff '%s' is not -1, 0 or 1", path, line,
                   fields[9]);
        return -1;
    }
    rule->line = line;
    return 0;
}

ncclResult_t mfsdp_tuner_config_load(const char *path, ncclDebugLogger_t logger,
                                     mfsdp_tuner_rule_t **rules_p, size_t *count_p)
{
    ncclResult_t res = ncclSuccess;
    mfsdp_tuner_rule_t *rules = NULL;
    size_t count = 0, cap = 0;
    char *buf = NULL;
    size_t buf_cap = 0;
    ssize_t len;
    int line = 0;

    FILE *f = fopen(path, "r");
    if (f == NULL) {
        TUNER_WARN(logger, "mfsdp tuner: cannot open MFSDP_TUNER_CONFIG file '%s': %s", path,
                   strerror(errno));
        return ncclSystemError;
    }
    while ((len = getline(&buf, &buf_cap, f)) != -1) {
        line++;
        if ((size_t)len != strlen(buf)) {
            TUNER_WARN(logger, "mfsdp tuner: %s:%d: line contains a NUL byte", path, line);
            res = ncclInvalidUsage;
            goto out;
        }
        char *text = trim(buf);
        if (*text == '\0' || *text == '#') {
            continue;
        }
        if (count == cap) {
            size_t new_cap = cap ? 2 * cap : 16;
            mfsdp_tuner_rule_t *grown = realloc(rules, new_cap * sizeof(*rules));
            if (grown == NULL) {
                TUNER_WARN(logger, "mfsdp tuner: out of memory reading %s", path);
                res = ncclSystemError;
                goto out;
            }
            rules = grown;
            cap = new_cap;
        }
        if (parse_rule(text, path, line, logger, &rules[count]) != 0) {
            res = ncclInvalidUsage;
            goto out;
        }
        count++;
    }
    if (ferror(f)) {
        TUNER_WARN(logger, "mfsdp tuner: error reading %s after line %d: %s", path, line,
                   strerror(errno));
        res = ncclSystemError;
        goto out;
    }

out:
    free(buf);
    fclose(f);
    if (res != ncclSuccess) {
        free(rules);
        return res;
    }
    *rules_p = rules;
    *count_p = count;
    return ncclSuccess;
}
