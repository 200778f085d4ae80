/* SPDX-License-Identifier: Apache-2.0 */
#include "core/config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/log.h"

enum cfg_type { CFG_BOOL, CFG_INT, CFG_DOUBLE, CFG_SIZE, CFG_STR, CFG_ENUM };

typedef struct cfg_entry {
    enum cfg_type type;
    const char *name;
    const char *def;
    const char *choices;
    const char *help;
    size_t off;     /* offsetof value */
    size_t set_off; /* offsetof field##_set */
} cfg_entry_t;

static const cfg_entry_t cfg_table[] = {
#define MFSDP_CFG_ENTRY(type, NAME, field, def, choices, help)                                     \
    {CFG_##type,                                                                                   \
     #NAME,                                                                                        \
     def,                                                                                          \
     choices,                                                                                      \
     help,                                                                                         \
     offsetof(mfsdp_config_t, field),                                                              \
     offsetof(mfsdp_config_t, field##_set)},
    MFSDP_CONFIG_TABLE(MFSDP_CFG_ENTRY)
#undef MFSDP_CFG_ENTRY
};
#define NCFG (sizeof(cfg_table) / sizeof(cfg_table[0]))

static const char *type_name(enum cfg_type t)
{
    switch (t) {
    case CFG_BOOL:
        return "bool";
    case CFG_INT:
        return "int";
    case CFG_DOUBLE:
        return "float";
    case CFG_SIZE:
        return "size";
    case CFG_STR:
        return "string";
    case CFG_ENUM:
        return "enum";
    }
    return "?";
}

mfsdp_status_t mfsdp_parse_size(const char *s, size_t *out_p)
{
    if (s == NULL || out_p == NULL) {
        return MFSDP_ERR_INVALID_ARG;
    }
    while (isspace((unsigned char)*s)) {
        s++;
    }
    if (!isdigit((unsigned char)*s)) {
        return MFSDP_ERR_INVALID_ARG;
    }
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0) {
        return MFSDP_ERR_OVERFLOW;
    }
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case '\0':
        break;
    case 'K':
        shift = 10;
        end++;
        break;
    case 'M':
        shift = 20;
        end++;
        break;
    case 'G':
        shift = 30;
        end++;
        break;
    case 'T':
        shift = 40;
        end++;
        break;
    default:
        return MFSDP_ERR_INVALID_ARG;
    }
    if (shift != 0 && (*end == 'B' || *end == 'b')) {
        end++; /* accept "4GB" */
    }
    if (*end != '\0') {
        return MFSDP_ERR_INVALID_ARG;
    }
    if (shift != 0 && v > (SIZE_MAX >> shift)) {
        return MFSDP_ERR_OVERFLOW;
    }
    *out_p = (size_t)(v << shift);
    return MFSDP_OK;
}

static int parse_bool(const char *s, int *out)
{
    static const char *yes[] = {"1", "true", "yes", "on"};
    static const char *no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

/* Index of s in a '|' separated list, case-insensitive; -1 if absent. */
static int enum_index(const char *choices, const char *s)
{
    int idx = 0;
    size_t len = strlen(s);
    for (const char *p = choices; *p != '\0'; idx++) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncasecmp(p, s, n) == 0) {
            return idx;
        }
        if (bar == NULL) {
            break;
        }
        p = bar + 1;
    }
    return -1;
}

/* Bounds "min:max" for INT/DOUBLE; either side may be empty. */
static int in_bounds(const char *bounds, double v)
{
    if (bounds == NULL || *bounds == '\0') {
        return 1;
    }
    const char *colon = strchr(bounds, ':');
    if (colon == NULL) {
        return 1;
    }
    if (colon != bounds && v < strtod(bounds, NULL)) {
        return 0;
    }
    if (colon[1] != '\0' && v > strtod(colon + 1, NULL)) {
        return 0;
    }
    return 1;
}

static mfsdp_status_t parse_one(const cfg_entry_t *e, const char *val, mfsdp_config_t *cfg,
                                char *err, size_t errlen)
{
    char *base = (char *)cfg;
    char *end = NULL;
    switch (e->type) {
    case CFG_BOOL: {
        int b;
        if (parse_bool(val, &b) != 0) {
            snprintf(err, errlen, "%s=%s: expected a boolean (0|1|true|false|yes|no|on|off)",
                     e->name, val);
            return MFSDP_ERR_CONFIG;
        }
        *(int *)(base + e->off) = b;
        break;
    }
    case CFG_INT: {
        errno = 0;
        long v = strtol(val, &end, 10);
        if (errno != 0 || end == val || *end != '\0' || !in_bounds(e->choices, (double)v)) {
            snprintf(err, errlen, "%s=%s: expected an integer in [%s]", e->name, val, e->choices);
            return MFSDP_ERR_CONFIG;
        }
        *(long *)(base + e->off) = v;
        break;
    }
    case CFG_DOUBLE: {
        errno = 0;
        double v = strtod(val, &end);
        if (errno != 0 || end == val || *end != '\0' || !isfinite(v) || !in_bounds(e->choices, v)) {
            snprintf(err, errlen, "%s=%s: expected a finite number in [%s]", e->name, val,
                     e->choices);
            return MFSDP_ERR_CONFIG;
        }
        *(double *)(base + e->off) = v;
        break;
    }
    case CFG_SIZE: {
        size_t v;
        if (mfsdp_parse_size(val, &v) != MFSDP_OK) {
            snprintf(err, errlen,
                     "%s=%s: expected a byte count with an optional K, M, G or T suffix", e->name,
                     val);
            return MFSDP_ERR_CONFIG;
        }
        *(size_t *)(base + e->off) = v;
        break;
    }
    case CFG_STR: {
        unsigned mask;
        char bad[64];
        if (strcmp(e->name, "MFSDP_DEBUG_SUBSYS") == 0 &&
            mfsdp_log_subsys_parse(val, &mask, bad, sizeof(bad)) != 0) {
            snprintf(err, errlen,
                     "%s=%s: unknown subsystem '%s' (expected a comma list of " MFSDP_SUBSYS_LIST
                     ", ^ first to negate)",
                     e->name, val, bad);
            return MFSDP_ERR_CONFIG;
        }
        *(const char **)(base + e->off) = val;
        break;
    }
    case CFG_ENUM: {
        int idx = enum_index(e->choices, val);
        if (idx < 0) {
            snprintf(err, errlen, "%s=%s: expected one of %s", e->name, val, e->choices);
            return MFSDP_ERR_CONFIG;
        }
        *(int *)(base + e->off) = idx;
        break;
    }
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_config_parse(mfsdp_getenv_fn lookup, void *arg, mfsdp_config_t *cfg, char *err,
                                  size_t errlen)
{
    char dummy[8];
    if (err == NULL || errlen == 0) {
        err = dummy;
        errlen = sizeof(dummy);
    }
    err[0] = '\0';
    if (lookup == NULL || cfg == NULL) {
        snprintf(err, errlen, "invalid argument");
        return MFSDP_ERR_INVALID_ARG;
    }
    mfsdp_config_t tmp;
    memset(&tmp, 0, sizeof(tmp));
    for (size_t i = 0; i < NCFG; i++) {
        const cfg_entry_t *e = &cfg_table[i];
        if (e->def[0] != '\0') {
            mfsdp_status_t st = parse_one(e, e->def, &tmp, err, errlen);
            if (st != MFSDP_OK) {
                return MFSDP_ERR_INTERNAL; /* a bad default in the table */
            }
        }
        const char *val = lookup(e->name, arg);
        if (val != NULL && *val != '\0') {
            mfsdp_status_t st = parse_one(e, val, &tmp, err, errlen);
            if (st != MFSDP_OK) {
                return st;
            }
            *(int *)((char *)&tmp + e->set_off) = 1;
        }
    }
    *cfg = tmp;
    return MFSDP_OK;
}

static const char *env_lookup(const char *name, void *arg)
{
    (void)arg;
    return getenv(name);
}

static pthread_once_t cfg_once = PTHREAD_ONCE_INIT;
static mfsdp_config_t cfg_global;
static mfsdp_status_t cfg_status;

static char cfg_err[512];

static int config_unknown(char *name, size_t len);
static const char *config_closest(const char *name);

static void cfg_init(void)
{
    cfg_status = mfsdp_config_parse(env_lookup, NULL, &cfg_global, cfg_err, sizeof(cfg_err));
    char name[128];
    if (cfg_status == MFSDP_OK && config_unknown(name, sizeof(name))) {
        /* A misspelt name would leave its setting at the default without a word. */
        const char *near = config_closest(name);
        snprintf(cfg_err, sizeof(cfg_err),
                 "unknown variable %s%s%s%s (mfsdp-plan --env lists them)", name,
                 near ? " (did you mean " : "", near ? near : "", near ? "?)" : "");
        cfg_status = MFSDP_ERR_CONFIG;
    }
    if (cfg_status != MFSDP_OK) {
        MFSDP_WARN("%s", cfg_err);
    }
}

const char *mfsdp_config_error(void)
{
    pthread_once(&cfg_once, cfg_init);
    return cfg_status != MFSDP_OK ? cfg_err : "";
}

mfsdp_status_t mfsdp_config_get(const mfsdp_config_t **cfg_p)
{
    if (cfg_p == NULL) {
        return MFSDP_ERR_INVALID_ARG;
    }
    pthread_once(&cfg_once, cfg_init);
    if (cfg_status != MFSDP_OK) {
        return cfg_status;
    }
    *cfg_p = &cfg_global;
    return MFSDP_OK;
}

size_t mfsdp_config_count(void)
{
    return NCFG;
}

/* The n-th choice of a '|' list into out. */
static void enum_name(const char *choices, int n, char *out, size_t len)
{
    const char *p = choices;
    for (int i = 0; i < n && p != NULL; i++) {
        p = strchr(p, '|');
        p = p != NULL ? p + 1 : NULL;
    }
    size_t k = 0;
    while (p != NULL && p[k] != '\0' && p[k] != '|') {
        k++;
    }
    snprintf(out, len, "%.*s", (int)k, p != NULL ? p : "?");
}

mfsdp_status_t mfsdp_config_value(const mfsdp_config_t *cfg, size_t i, const char **name_p,
                                  char *value, size_t len)
{
    if (i >= NCFG || name_p == NULL || value == NULL || len == 0) {
        return MFSDP_ERR_INVALID_ARG;
    }
    const cfg_entry_t *e = &cfg_table[i];
    *name_p = e->name; /* named even without values (cfg NULL: a configuration that failed) */
    if (cfg == NULL) {
        return MFSDP_ERR_INVALID_ARG;
    }
    const char *base = (const char *)cfg;
    int set = *(const int *)(base + e->set_off);
    if (!set && e->def[0] == '\0') {
        snprintf(value, len, "(unset)");
        return MFSDP_OK;
    }
    switch (e->type) {
    case CFG_BOOL:
        snprintf(value, len, "%d", *(const int *)(base + e->off));
        break;
    case CFG_INT:
        snprintf(value, len, "%ld", *(const long *)(base + e->off));
        break;
    case CFG_DOUBLE:
        snprintf(value, len, "%.17g", *(const double *)(base + e->off));
        break;
    case CFG_SIZE:
        snprintf(value, len, "%zu", *(const size_t *)(base + e->off));
        break;
    case CFG_STR:
        snprintf(value, len, "%s", *(const char *const *)(base + e->off));
        break;
    case CFG_ENUM:
        enum_name(e->choices, *(const int *)(base + e->off), value, len);
        break;
    }
    return MFSDP_OK;
}

/* MFSDP_* names that are not runtime settings: read by mfsdp's own scripts, the PyTorch
 * companion and the tests. */
static int known_other(const char *name, size_t n)
{
    /* Variables of the scripts and tools around the library (scripts/, tests/), which a
     * user's shell may export into a job: not the library's, not typos. */
    static const char *const other[] = {
        "MFSDP_ASAN_BUILD_DIR", "MFSDP_VENV", "MFSDP_PYTHON",      "MFSDP_SIM",
        "MFSDP_FUZZ_BUILD_DIR", "MFSDP_PERF", "MFSDP_PERF_CORRUPT"};
    if ((n > 11 && strncmp(name, "MFSDP_TEST_", 11) == 0) ||
        (n > 13 && strncmp(name, "MFSDP_DEVICE_", 13) == 0)) {
        return 1;
    }
    for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
        if (strlen(other[i]) == n && strncmp(name, other[i], n) == 0) {
            return 1;
        }
    }
    return 0;
}

extern char **environ;

/* 1 when the environment holds an MFSDP_* variable that is neither in the table nor one of
 * the scripts' own (MFSDP_VENV, MFSDP_TEST_*, ...): its name goes to name. */
static int config_unknown(char *name, size_t len)
{
    for (char **e = environ; e != NULL && *e != NULL; e++) {
        if (strncmp(*e, "MFSDP_", 6) != 0) {
            continue;
        }
        const char *eq = strchr(*e, '=');
        size_t n = eq != NULL ? (size_t)(eq - *e) : strlen(*e);
        int known = known_other(*e, n);
        for (size_t i = 0; i < NCFG && !known; i++) {
            known = strlen(cfg_table[i].name) == n && strncmp(cfg_table[i].name, *e, n) == 0;
        }
        if (!known) {
            if (name != NULL && len > 0) {
                snprintf(name, len, "%.*s", (int)n, *e);
            }
            return 1;
        }
    }
    return 0;
}

/* The known name closest to name (edit distance, at most 3), for "did you mean"; NULL. */
static const char *config_closest(const char *name)
{
    const char *best = NULL;
    size_t bestd = (size_t)-1;
    size_t la = strlen(name);
    for (size_t i = 0; i < NCFG; i++) {
        const char *b = cfg_table[i].name;
        size_t lb = strlen(b);
        if (la > 63 || lb > 63) {
            continue;
        }
        size_t d[64], prev[64];
        for (size_t j = 0; j <= lb; j++) {
            prev[j] = j;
        }
        for (size_t a = 1; a <= la; a++) {
            d[0] = a;
            for (size_t j = 1; j <= lb; j++) {
                size_t c = prev[j - 1] + (name[a - 1] != b[j - 1]);
                size_t x = prev[j] + 1, y = d[j - 1] + 1;
                d[j] = c < x ? (c < y ? c : y) : (x < y ? x : y);
            }
            memcpy(prev, d, (lb + 1) * sizeof(size_t));
        }
        if (prev[lb] < bestd) {
            bestd = prev[lb];
            best = b;
        }
    }
    return bestd <= 3 ? best : NULL;
}

void mfsdp_config_print(FILE *out)
{
    for (size_t i = 0; i < NCFG; i++) {
        const cfg_entry_t *e = &cfg_table[i];
        const char *cur = getenv(e->name);
        fprintf(out, "%-26s %-6s default=%s", e->name, type_name(e->type),
                e->def[0] ? e->def : "(unset)");
        if (e->type == CFG_ENUM) {
            fprintf(out, " values=%s", e->choices);
        } else if ((e->type == CFG_INT || e->type == CFG_DOUBLE) && e->choices[0]) {
            fprintf(out, " range=[%s]", e->choices);
        }
        if (cur != NULL && *cur != '\0') {
            fprintf(out, " current=%s", cur);
        }
        fprintf(out, "\n    %s\n", e->help);
    }
}
