/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The `mfsdp-manifest/1` contract (docs/manifest.md): a strict jansson-based parser and
 * a canonical writer.
 *
 * Keys are read in a fixed order (not document order), so the first error reported does
 * not depend on how a writer ordered its keys, except among unknown keys, which are found in
 * document order. Every message has the form "<origin>: <json.path>: <what>"; user text
 * quoted in a message is shortened and stripped of control characters so that the message
 * stays one line. The manifest under construction is freed on any error, so a failed parse
 * leaves nothing behind.
 */
#include "mfsdp/manifest.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

#define PATH_LEN 192 /* longest JSON path kept in a message */
#define SHOW_LEN 64  /* longest piece of user text quoted in a message */
#define MSG_LEN  512

typedef struct parse_ctx {
    const char *origin;
    char *err;
    size_t errlen;
    json_t *param_names; /* param name -> "groups[g].params[p]" (duplicates across groups) */
    json_t *group_names; /* group name -> group index */
} parse_ctx_t;

/* Names accepted for a dtype in a manifest (uint8 is a wire type, never a param type). */
static const char *const manifest_dtypes[] = {"float32", "bfloat16", "float16"};
#define DTYPE_CHOICES "one of float32|bfloat16|float16"

/* Copy at most SHOW_LEN bytes of s into out, replacing control characters, cutting on a
 * UTF-8 character boundary and marking the cut with "...". */
static void show(char *out, size_t outlen, const char *s)
{
    size_t n = strlen(s);
    size_t keep = n;
    size_t cap = outlen < SHOW_LEN ? outlen : SHOW_LEN;
    int cut = 0;
    if (keep + 1 > cap) {
        keep = cap > 4 ? cap - 4 : 0;
        while (keep > 0 && ((unsigned char)s[keep] & 0xc0) == 0x80) {
            keep--;
        }
        cut = 1;
    }
    for (size_t i = 0; i < keep; i++) {
        unsigned char c = (unsigned char)s[i];
        out[i] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (cut) {
        memcpy(out + keep, "...", 3);
        keep += 3;
    }
    out[keep] = '\0';
}

/* Paths are cut at PATH_LEN - 1 bytes: a message with a shortened path beats no message. */
static void path_fmt(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void path_fmt(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, PATH_LEN, fmt, ap);
    va_end(ap);
}

static void path_key(char *out, const char *base, const char *key)
{
    char k[SHOW_LEN];
    show(k, sizeof(k), key);
    path_fmt(out, "%s%s%s", base, base[0] != '\0' ? "." : "", k);
}

static void path_index(char *out, const char *base, size_t i)
{
    path_fmt(out, "%s[%zu]", base, i);
}

static mfsdp_status_t fail(parse_ctx_t *ctx, mfsdp_status_t st, const char *path, const char *fmt,
                           ...) __attribute__((format(printf, 4, 5)));

static mfsdp_status_t fail(parse_ctx_t *ctx, mfsdp_status_t st, const char *path, const char *fmt,
                           ...)
{
    char msg[MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    for (char *c = msg; *c != '\0'; c++) { /* jansson quotes raw input: keep one line */
        if ((unsigned char)*c < 0x20 || *c == 0x7f) {
            *c = '?';
        }
    }
    if (ctx->err != NULL && ctx->errlen > 0) {
        snprintf(ctx->err, ctx->errlen, "%s: %s: %s", ctx->origin, path, msg);
    }
    MFSDP_WARN("%s: %s: %s", ctx->origin, path, msg);
    return st;
}

static const char *type_word(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a real number";
    case JSON_TRUE:
        return "true";
    case JSON_FALSE:
        return "false";
    case JSON_NULL:
        return "null";
    }
    return "an unknown value";
}

/* Like type_word(), but says when an array is empty. */
static const char *got_word(const json_t *v)
{
    return json_is_array(v) && json_array_size(v) == 0 ? "an empty array" : type_word(v);
}

/* Reject keys of obj that are not in allowed[]. */
static mfsdp_status_t check_keys(parse_ctx_t *ctx, json_t *obj, const char *path,
                                 const char *const *allowed, size_t nallowed)
{
    for (void *it = json_object_iter(obj); it != NULL; it = json_object_iter_next(obj, it)) {
        const char *key = json_object_iter_key(it);
        size_t i = 0;
        while (i < nallowed && strcmp(key, allowed[i]) != 0) {
            i++;
        }
        if (i == nallowed) {
            char list[256] = "";
            size_t used = 0;
            for (size_t j = 0; j < nallowed && used < sizeof(list); j++) {
                int n =
                    snprintf(list + used, sizeof(list) - used, "%s%s", j ? "|" : "", allowed[j]);
                used += n > 0 ? (size_t)n : 0;
            }
            char kp[PATH_LEN];
            path_key(kp, path, key);
            return fail(ctx, MFSDP_ERR_PARSE, kp, "unknown key (expected one of %s)", list);
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t want_object(parse_ctx_t *ctx, const json_t *v, const char *path)
{
    if (!json_is_object(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected an object, got %s", type_word(v));
    }
    return MFSDP_OK;
}

/* A non-empty string. */
static mfsdp_status_t want_name(parse_ctx_t *ctx, const json_t *v, const char *path,
                                const char **s_p)
{
    if (!json_is_string(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected a non-empty string, got %s",
                    type_word(v));
    }
    if (json_string_length(v) == 0) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected a non-empty string, got \"\"");
    }
    *s_p = json_string_value(v);
    return MFSDP_OK;
}

static mfsdp_status_t want_bool(parse_ctx_t *ctx, const json_t *v, const char *path, int *b_p)
{
    if (!json_is_boolean(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected true or false, got %s", type_word(v));
    }
    *b_p = json_is_true(v) ? 1 : 0;
    return MFSDP_OK;
}

/* An integer (reals such as 2.0 are rejected) in [lo, hi]; what describes the range. */
static mfsdp_status_t want_int(parse_ctx_t *ctx, const json_t *v, const char *path, json_int_t lo,
                               json_int_t hi, const char *what, int64_t *i_p)
{
    if (!json_is_integer(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected %s, got %s", what, type_word(v));
    }
    json_int_t i = json_integer_value(v);
    if (i < lo || i > hi) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected %s, got %" JSON_INTEGER_FORMAT, what, i);
    }
    *i_p = (int64_t)i;
    return MFSDP_OK;
}

/* A finite number (integer or real) with lo <(=) x <(=) hi; hi may be INFINITY. */
static mfsdp_status_t want_real(parse_ctx_t *ctx, const json_t *v, const char *path, double lo,
                                int lo_open, double hi, int hi_open, const char *what, double *d_p)
{
    if (!json_is_number(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected %s, got %s", what, type_word(v));
    }
    double d = json_number_value(v);
    int ok = isfinite(d) && (lo_open ? d > lo : d >= lo) && (hi_open ? d < hi : d <= hi);
    if (!ok) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected %s, got %.17g", what, d);
    }
    *d_p = d;
    return MFSDP_OK;
}

static mfsdp_status_t want_dtype(parse_ctx_t *ctx, const json_t *v, const char *path,
                                 mfsdp_dtype_t *dt_p)
{
    if (!json_is_string(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path, "expected " DTYPE_CHOICES ", got %s", type_word(v));
    }
    const char *s = json_string_value(v);
    for (size_t i = 0; i < sizeof(manifest_dtypes) / sizeof(manifest_dtypes[0]); i++) {
        if (strcmp(s, manifest_dtypes[i]) == 0) {
            return mfsdp_dtype_parse(s, dt_p);
        }
    }
    char shown[SHOW_LEN];
    show(shown, sizeof(shown), s);
    return fail(ctx, MFSDP_ERR_PARSE, path, "unknown dtype \"%s\" (expected " DTYPE_CHOICES ")",
                shown);
}

/* A string among choices (n of them); *i_p is its index. */
static mfsdp_status_t want_enum(parse_ctx_t *ctx, const json_t *v, const char *path,
                                const char *const *choices, size_t n, int *i_p)
{
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    for (size_t i = 0; s != NULL && i < n; i++) {
        if (strcmp(s, choices[i]) == 0) {
            *i_p = (int)i;
            return MFSDP_OK;
        }
    }
    char list[256] = "", shown[SHOW_LEN];
    size_t used = 0;
    for (size_t i = 0; i < n && used < sizeof(list); i++) {
        used += (size_t)snprintf(list + used, sizeof(list) - used, "%s\"%s\"", i ? "|" : "",
                                 choices[i]);
    }
    show(shown, sizeof(shown), s != NULL ? s : "");
    return fail(ctx, MFSDP_ERR_PARSE, path, "expected one of %s, got %s%s%s", list,
                s != NULL ? "\"" : type_word(v), shown, s != NULL ? "\"" : "");
}

/* Fetch obj[key] into *v_p; a missing required key is an error naming what was expected. */
static mfsdp_status_t get_key(parse_ctx_t *ctx, json_t *obj, const char *path, const char *key,
                              int required, const char *what, json_t **v_p, char *kpath)
{
    path_key(kpath, path, key);
    *v_p = json_object_get(obj, key);
    if (*v_p == NULL && required) {
        return fail(ctx, MFSDP_ERR_PARSE, kpath, "missing, expected %s", what);
    }
    return MFSDP_OK;
}

void mfsdp_hparams_default(mfsdp_hparams_t *hp)
{
    if (hp == NULL) {
        return;
    }
    hp->lr = 0.02;
    hp->momentum = 0.95;
    hp->nesterov = 1;
    hp->ns_steps = 5;
    hp->weight_decay = 0.0;
    hp->scale = MFSDP_SCALE_KELLER;
    hp->adamw_lr = 0.001;
    hp->adamw_beta1 = 0.9;
    hp->adamw_beta2 = 0.95;
    hp->adamw_eps = 1e-8;
    hp->adamw_weight_decay = 0.0;
    memset(&hp->schedule, 0, sizeof(hp->schedule));
    hp->schedule.kind = MFSDP_SCHEDULE_CONSTANT;
    hp->schedule.decay = MFSDP_DECAY_LINEAR;
    hp->max_norm = 0.0;
}

static const char *const schedule_kinds[] = {"constant", "warmup-cosine", "warmup-linear", "wsd"};
static const char *const decay_kinds[] = {"linear", "cosine", "sqrt"};
static const char *const divide_rules[] = {"fsdp2", "force_sum", "world"};
static const char *const tail_policies[] = {"owner", "shard", "auto", "job"};
static const char *const step_modes[] = {"eager", "lazy"};
#define NCHOICES(a) (sizeof(a) / sizeof((a)[0]))

static mfsdp_status_t parse_schedule(parse_ctx_t *ctx, json_t *o, const char *path,
                                     mfsdp_schedule_t *sc)
{
    static const char *const keys[] = {"kind",        "warmup_steps", "stable_steps",
                                       "decay_steps", "decay",        "min_lr_ratio"};
    static const char *const steps[] = {"warmup_steps", "stable_steps", "decay_steps"};
    int64_t *dst[] = {&sc->warmup_steps, &sc->stable_steps, &sc->decay_steps};
    char kp[PATH_LEN];
    json_t *v;
    int k;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, NCHOICES(keys)));
    MFSDP_CHECK(get_key(ctx, o, path, "kind", 1, "one of constant|warmup-cosine|warmup-linear|wsd",
                        &v, kp));
    MFSDP_CHECK(want_enum(ctx, v, kp, schedule_kinds, NCHOICES(schedule_kinds), &k));
    sc->kind = (mfsdp_schedule_kind_t)k;
    for (size_t i = 0; i < NCHOICES(steps); i++) {
        MFSDP_CHECK(get_key(ctx, o, path, steps[i], 0, NULL, &v, kp));
        if (v != NULL) {
            MFSDP_CHECK(want_int(ctx, v, kp, 0, INT32_MAX, "an integer in [0, 2^31)", dst[i]));
        }
    }
    if (sc->stable_steps != 0 && sc->kind != MFSDP_SCHEDULE_WSD) {
        path_key(kp, path, "stable_steps");
        return fail(ctx, MFSDP_ERR_PARSE, kp, "only a \"wsd\" schedule has stable steps");
    }
    MFSDP_CHECK(get_key(ctx, o, path, "decay", 0, NULL, &v, kp));
    if (v != NULL) {
        if (sc->kind != MFSDP_SCHEDULE_WSD) {
            return fail(ctx, MFSDP_ERR_PARSE, kp,
                        "only a \"wsd\" schedule chooses its decay (the kind names it)");
        }
        MFSDP_CHECK(want_enum(ctx, v, kp, decay_kinds, NCHOICES(decay_kinds), &k));
        sc->decay = (mfsdp_decay_kind_t)k;
    }
    if (sc->kind == MFSDP_SCHEDULE_WARMUP_COSINE) {
        sc->decay = MFSDP_DECAY_COSINE;
    }
    MFSDP_CHECK(get_key(ctx, o, path, "min_lr_ratio", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, 1, 0, "a number in [0, 1]", &sc->min_lr_ratio));
    }
    if (sc->kind == MFSDP_SCHEDULE_CONSTANT &&
        (sc->warmup_steps != 0 || sc->decay_steps != 0 || sc->min_lr_ratio != 0.0)) {
        return fail(ctx, MFSDP_ERR_PARSE, path,
                    "a \"constant\" schedule takes no warmup, decay or min_lr_ratio");
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_adamw(parse_ctx_t *ctx, json_t *o, const char *path,
                                  mfsdp_hparams_t *hp)
{
    static const char *const keys[] = {"lr", "betas", "eps", "weight_decay"};
    char kp[PATH_LEN];
    json_t *v;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, sizeof(keys) / sizeof(keys[0])));
    MFSDP_CHECK(get_key(ctx, o, path, "lr", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &hp->adamw_lr));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "betas", 0, NULL, &v, kp));
    if (v != NULL) {
        if (!json_is_array(v) || json_array_size(v) != 2) {
            return fail(ctx, MFSDP_ERR_PARSE, kp, "expected an array of two numbers in [0, 1)");
        }
        double b[2];
        for (size_t i = 0; i < 2; i++) {
            char ep[PATH_LEN];
            path_index(ep, kp, i);
            MFSDP_CHECK(
                want_real(ctx, json_array_get(v, i), ep, 0, 0, 1, 1, "a number in [0, 1)", &b[i]));
        }
        hp->adamw_beta1 = b[0];
        hp->adamw_beta2 = b[1];
    }
    MFSDP_CHECK(get_key(ctx, o, path, "eps", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 1, INFINITY, 0, "a number > 0", &hp->adamw_eps));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "weight_decay", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(
            want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &hp->adamw_weight_decay));
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_optimizer(parse_ctx_t *ctx, json_t *o, mfsdp_hparams_t *hp)
{
    static const char *const keys[] = {"lr",    "momentum", "nesterov", "ns_steps", "weight_decay",
                                       "scale", "adamw",    "schedule", "max_norm"};
    const char *path = "optimizer";
    char kp[PATH_LEN];
    json_t *v;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, sizeof(keys) / sizeof(keys[0])));
    MFSDP_CHECK(get_key(ctx, o, path, "lr", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &hp->lr));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "momentum", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, 1, 1, "a number in [0, 1)", &hp->momentum));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "nesterov", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_bool(ctx, v, kp, &hp->nesterov));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "ns_steps", 0, NULL, &v, kp));
    if (v != NULL) {
        int64_t n;
        MFSDP_CHECK(want_int(ctx, v, kp, 0, 100, "an integer in [0, 100]", &n));
        hp->ns_steps = (int)n;
    }
    MFSDP_CHECK(get_key(ctx, o, path, "weight_decay", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &hp->weight_decay));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "scale", 0, NULL, &v, kp));
    if (v != NULL) {
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (strcmp(s, "keller") == 0) {
            hp->scale = MFSDP_SCALE_KELLER;
        } else if (strcmp(s, "moonlight") == 0) {
            hp->scale = MFSDP_SCALE_MOONLIGHT;
        } else {
            char shown[SHOW_LEN];
            show(shown, sizeof(shown), s);
            return fail(
                ctx, MFSDP_ERR_PARSE, kp, "expected \"keller\" or \"moonlight\", got %s%s%s",
                json_is_string(v) ? "\"" : type_word(v), shown, json_is_string(v) ? "\"" : "");
        }
    }
    MFSDP_CHECK(get_key(ctx, o, path, "adamw", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_adamw(ctx, v, kp, hp));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "schedule", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_schedule(ctx, v, kp, &hp->schedule));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "max_norm", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &hp->max_norm));
    }
    return MFSDP_OK;
}

void mfsdp_training_default(mfsdp_training_t *t)
{
    if (t == NULL) {
        return;
    }
    memset(t, 0, sizeof(*t));
    t->micro_steps = 1;
    t->divide = MFSDP_DIVIDE_FSDP2;
    t->divide_factor = 1.0;
    t->tail = MFSDP_TAIL_AUTO;
    t->step = MFSDP_STEP_EAGER;
}

static mfsdp_status_t parse_training(parse_ctx_t *ctx, json_t *o, mfsdp_training_t *t)
{
    static const char *const keys[] = {"micro_steps", "grad_divide", "tail", "step"};
    const char *path = "training";
    char kp[PATH_LEN];
    json_t *v;
    int k;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, NCHOICES(keys)));
    MFSDP_CHECK(get_key(ctx, o, path, "micro_steps", 0, NULL, &v, kp));
    if (v != NULL) {
        int64_t n;
        MFSDP_CHECK(want_int(ctx, v, kp, 1, 1000000, "an integer in [1, 1000000]", &n));
        t->micro_steps = (int)n;
    }
    MFSDP_CHECK(get_key(ctx, o, path, "grad_divide", 0, NULL, &v, kp));
    if (v != NULL && json_is_number(v)) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 1, INFINITY, 0,
                              "\"fsdp2\", \"force_sum\", \"world\" or a number > 0",
                              &t->divide_factor));
        t->divide = MFSDP_DIVIDE_FACTOR;
    } else if (v != NULL) {
        MFSDP_CHECK(want_enum(ctx, v, kp, divide_rules, NCHOICES(divide_rules), &k));
        t->divide = (mfsdp_divide_rule_t)k;
    }
    MFSDP_CHECK(get_key(ctx, o, path, "tail", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_enum(ctx, v, kp, tail_policies, NCHOICES(tail_policies), &k));
        t->tail = (mfsdp_tail_policy_t)k;
        t->has_tail = 1;
    }
    MFSDP_CHECK(get_key(ctx, o, path, "step", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_enum(ctx, v, kp, step_modes, NCHOICES(step_modes), &k));
        t->step = (mfsdp_step_mode_t)k;
        t->has_step = 1;
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_iteration(parse_ctx_t *ctx, json_t *o, mfsdp_iteration_t *it)
{
    static const char *const keys[] = {"forward_only", "no_sync"};
    const char *path = "iteration";
    char kp[PATH_LEN];
    json_t *v;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, NCHOICES(keys)));
    MFSDP_CHECK(get_key(ctx, o, path, "forward_only", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_bool(ctx, v, kp, &it->forward_only));
    }
    MFSDP_CHECK(get_key(ctx, o, path, "no_sync", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(want_bool(ctx, v, kp, &it->no_sync));
    }
    return MFSDP_OK;
}

/* Default optimizer rule of docs/manifest.md. */
static mfsdp_role_t default_role(const char *name, int ndim)
{
    static const char *const tail_names[] = {"embed", "lm_head", "wte", "wpe"};
    if (ndim < 2) {
        return MFSDP_ROLE_ADAMW;
    }
    for (size_t i = 0; i < sizeof(tail_names) / sizeof(tail_names[0]); i++) {
        if (strstr(name, tail_names[i]) != NULL) {
            return MFSDP_ROLE_ADAMW;
        }
    }
    return MFSDP_ROLE_MUON;
}

static mfsdp_status_t parse_shape(parse_ctx_t *ctx, json_t *v, const char *kp,
                                  mfsdp_param_desc_t *p)
{
    const char *what = "a non-empty array of positive integers";
    if (!json_is_array(v) || json_array_size(v) == 0) {
        return fail(ctx, MFSDP_ERR_PARSE, kp, "expected %s, got %s", what, got_word(v));
    }
    size_t nd = json_array_size(v);
    if (nd > MFSDP_MAX_DIMS) {
        return fail(ctx, MFSDP_ERR_UNSUPPORTED, kp, "expected at most %d dims, got %zu",
                    MFSDP_MAX_DIMS, nd);
    }
    int64_t numel = 1;
    for (size_t d = 0; d < nd; d++) {
        char ep[PATH_LEN];
        path_index(ep, kp, d);
        MFSDP_CHECK(want_int(ctx, json_array_get(v, d), ep, 1, INT64_MAX, "a positive integer",
                             &p->shape[d]));
        if (__builtin_mul_overflow(numel, p->shape[d], &numel)) {
            return fail(ctx, MFSDP_ERR_OVERFLOW, kp, "the number of elements overflows int64");
        }
    }
    /* Every consumer may need the fp64-sized footprint (8 bytes per element) in int64. */
    if (numel > INT64_MAX / 8) {
        return fail(ctx, MFSDP_ERR_OVERFLOW, kp, "%" PRId64 " elements * 8 bytes overflows int64",
                    numel);
    }
    p->ndim = (int)nd;
    p->numel = numel;
    return MFSDP_OK;
}

static mfsdp_status_t parse_split(parse_ctx_t *ctx, json_t *v, const char *kp,
                                  mfsdp_param_desc_t *p)
{
    if (p->ndim < 2) {
        return fail(ctx, MFSDP_ERR_PARSE, kp,
                    "a split needs a parameter of 2 or more dims (this one has 1)");
    }
    if (p->optimizer != MFSDP_ROLE_MUON) {
        return fail(ctx, MFSDP_ERR_PARSE, kp,
                    "a split only applies to muon params (this one is adamw; set "
                    "\"optimizer\": \"muon\" to split it)");
    }
    if (!json_is_array(v) || json_array_size(v) == 0) {
        return fail(ctx, MFSDP_ERR_PARSE, kp, "expected a non-empty array of positive integers");
    }
    size_t n = json_array_size(v);
    int64_t *split = calloc(n, sizeof(*split));
    if (split == NULL) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, kp, "out of memory");
    }
    int64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        char ep[PATH_LEN];
        path_index(ep, kp, i);
        mfsdp_status_t st =
            want_int(ctx, json_array_get(v, i), ep, 1, INT64_MAX, "a positive integer", &split[i]);
        if (st != MFSDP_OK) {
            free(split);
            return st;
        }
        if (__builtin_add_overflow(sum, split[i], &sum)) {
            sum = INT64_MAX; /* cannot equal shape[0] then: reported below */
        }
    }
    if (sum != p->shape[0]) {
        free(split);
        return fail(ctx, MFSDP_ERR_PARSE, kp,
                    "entries must sum to shape[0] = %" PRId64 ", they sum to %" PRId64 "%s",
                    p->shape[0], sum, sum == INT64_MAX ? " or more" : "");
    }
    p->split = split;
    p->nsplit = n;
    return MFSDP_OK;
}

/* The "name" key of a param or group object: a non-empty string not seen before in table.
 * The name is recorded in table with value (stolen: a param's path string, or a group's
 * index, which the sequence parser looks up) and copied to *name_p. A duplicate names
 * where the first one stands. */
static mfsdp_status_t take_name(parse_ctx_t *ctx, json_t *o, const char *path, const char *what,
                                json_t *table, json_t *value, char *kp, char **name_p)
{
    json_t *v = NULL;
    const char *name = NULL;
    mfsdp_status_t st = get_key(ctx, o, path, "name", 1, "a non-empty string", &v, kp);
    if (st == MFSDP_OK) {
        st = want_name(ctx, v, kp, &name);
    }
    if (st != MFSDP_OK) {
        json_decref(value);
        return st;
    }
    json_t *first = json_object_get(table, name);
    if (first != NULL) {
        char shown[SHOW_LEN], where[PATH_LEN];
        show(shown, sizeof(shown), name);
        if (json_is_integer(first)) {
            snprintf(where, sizeof(where), "groups[%" JSON_INTEGER_FORMAT "]",
                     json_integer_value(first));
        } else {
            snprintf(where, sizeof(where), "%s", json_string_value(first));
        }
        json_decref(value);
        return fail(ctx, MFSDP_ERR_PARSE, kp, "duplicate %s name \"%s\" (first at %s)", what, shown,
                    where);
    }
    if (value == NULL || json_object_set_new(table, name, value) != 0) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, kp, "out of memory");
    }
    *name_p = strdup(name);
    if (*name_p == NULL) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, kp, "out of memory");
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_param(parse_ctx_t *ctx, json_t *o, const char *path,
                                  mfsdp_param_desc_t *p)
{
    static const char *const keys[] = {"name",          "shape", "dtype",    "optimizer",
                                       "requires_grad", "split", "shard_dim"};
    char kp[PATH_LEN];
    json_t *v;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, sizeof(keys) / sizeof(keys[0])));

    MFSDP_CHECK(
        take_name(ctx, o, path, "param", ctx->param_names, json_string(path), kp, &p->name));

    MFSDP_CHECK(
        get_key(ctx, o, path, "shape", 1, "a non-empty array of positive integers", &v, kp));
    MFSDP_CHECK(parse_shape(ctx, v, kp, p));

    MFSDP_CHECK(get_key(ctx, o, path, "dtype", 1, DTYPE_CHOICES, &v, kp));
    MFSDP_CHECK(want_dtype(ctx, v, kp, &p->dtype));

    MFSDP_CHECK(get_key(ctx, o, path, "optimizer", 0, NULL, &v, kp));
    p->optimizer = default_role(p->name, p->ndim);
    if (v != NULL) {
        const char *s = json_is_string(v) ? json_string_value(v) : NULL;
        if (s != NULL && strcmp(s, "muon") == 0) {
            if (p->ndim < 2) {
                return fail(ctx, MFSDP_ERR_PARSE, kp,
                            "muon needs a parameter of 2 or more dims (this one has 1)");
            }
            p->optimizer = MFSDP_ROLE_MUON;
        } else if (s != NULL && strcmp(s, "adamw") == 0) {
            p->optimizer = MFSDP_ROLE_ADAMW;
        } else {
            char shown[SHOW_LEN];
            show(shown, sizeof(shown), s != NULL ? s : "");
            return fail(ctx, MFSDP_ERR_PARSE, kp, "expected \"muon\" or \"adamw\", got %s%s%s",
                        s != NULL ? "\"" : type_word(v), shown, s != NULL ? "\"" : "");
        }
    }

    MFSDP_CHECK(get_key(ctx, o, path, "requires_grad", 0, NULL, &v, kp));
    p->requires_grad = 1;
    if (v != NULL) {
        MFSDP_CHECK(want_bool(ctx, v, kp, &p->requires_grad));
    }

    MFSDP_CHECK(get_key(ctx, o, path, "split", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_split(ctx, v, kp, p));
    }

    MFSDP_CHECK(get_key(ctx, o, path, "shard_dim", 0, NULL, &v, kp));
    p->shard_dim = 0;
    if (v != NULL) {
        char what[48];
        int64_t d;
        snprintf(what, sizeof(what), "an integer in [0, %d]", p->ndim - 1);
        MFSDP_CHECK(want_int(ctx, v, kp, 0, p->ndim - 1, what, &d));
        p->shard_dim = (int)d;
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_group(parse_ctx_t *ctx, json_t *o, const char *path, size_t gi,
                                  mfsdp_group_desc_t *g)
{
    static const char *const keys[] = {"name", "reduce_dtype", "lr_scale", "weight_decay",
                                       "params"};
    char kp[PATH_LEN];
    json_t *v;
    MFSDP_CHECK(want_object(ctx, o, path));
    MFSDP_CHECK(check_keys(ctx, o, path, keys, sizeof(keys) / sizeof(keys[0])));

    MFSDP_CHECK(take_name(ctx, o, path, "group", ctx->group_names, json_integer((json_int_t)gi), kp,
                          &g->name));

    MFSDP_CHECK(get_key(ctx, o, path, "reduce_dtype", 0, NULL, &v, kp));
    g->has_reduce_dtype = v != NULL;
    g->reduce_dtype = MFSDP_FLOAT32;
    if (v != NULL) {
        MFSDP_CHECK(want_dtype(ctx, v, kp, &g->reduce_dtype));
    }

    MFSDP_CHECK(get_key(ctx, o, path, "lr_scale", 0, NULL, &v, kp));
    g->lr_scale = 1.0;
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &g->lr_scale));
    }

    MFSDP_CHECK(get_key(ctx, o, path, "weight_decay", 0, NULL, &v, kp));
    g->has_weight_decay = v != NULL;
    g->weight_decay = 0.0;
    if (v != NULL) {
        MFSDP_CHECK(want_real(ctx, v, kp, 0, 0, INFINITY, 0, "a number >= 0", &g->weight_decay));
    }

    const char *what = "a non-empty array of param objects";
    MFSDP_CHECK(get_key(ctx, o, path, "params", 1, what, &v, kp));
    if (!json_is_array(v) || json_array_size(v) == 0) {
        return fail(ctx, MFSDP_ERR_PARSE, kp, "expected %s, got %s", what, got_word(v));
    }
    size_t n = json_array_size(v);
    g->params = calloc(n, sizeof(*g->params));
    if (g->params == NULL) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, kp, "out of memory");
    }
    g->nparams = n;
    for (size_t i = 0; i < n; i++) {
        char pp[PATH_LEN];
        path_index(pp, kp, i);
        MFSDP_CHECK(parse_param(ctx, json_array_get(v, i), pp, &g->params[i]));
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_sequence(parse_ctx_t *ctx, json_t *v, mfsdp_manifest_t *m)
{
    const char *path = "sequence";
    if (!json_is_array(v)) {
        return fail(ctx, MFSDP_ERR_PARSE, path,
                    "expected an array of [\"allgather\"|\"reduce_scatter\", <group name>], "
                    "got %s",
                    type_word(v));
    }
    size_t n = json_array_size(v);
    if (n == 0) {
        return MFSDP_OK;
    }
    m->sequence = calloc(n, sizeof(*m->sequence));
    if (m->sequence == NULL) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, path, "out of memory");
    }
    m->ncalls = n;
    for (size_t i = 0; i < n; i++) {
        char ep[PATH_LEN], kp[PATH_LEN];
        json_t *e = json_array_get(v, i);
        path_index(ep, path, i);
        if (!json_is_array(e) || json_array_size(e) < 2 || json_array_size(e) > 3) {
            return fail(ctx, MFSDP_ERR_PARSE, ep,
                        "expected [\"allgather\"|\"reduce_scatter\", <group name>] or "
                        "[..., <group name>, \"optional\"]");
        }
        if (json_array_size(e) == 3) {
            json_t *flag = json_array_get(e, 2);
            path_index(kp, ep, 2);
            if (!json_is_string(flag) || strcmp(json_string_value(flag), "optional") != 0) {
                char shown[SHOW_LEN];
                show(shown, sizeof(shown), json_is_string(flag) ? json_string_value(flag) : "");
                return fail(ctx, MFSDP_ERR_PARSE, kp, "expected \"optional\", got %s%s%s",
                            json_is_string(flag) ? "\"" : type_word(flag), shown,
                            json_is_string(flag) ? "\"" : "");
            }
            m->sequence[i].flags = MFSDP_CALL_OPTIONAL;
        }
        json_t *kind = json_array_get(e, 0);
        json_t *group = json_array_get(e, 1);
        path_index(kp, ep, 0);
        const char *k = json_is_string(kind) ? json_string_value(kind) : NULL;
        if (k != NULL && strcmp(k, "allgather") == 0) {
            m->sequence[i].kind = MFSDP_CALL_ALLGATHER;
        } else if (k != NULL && strcmp(k, "reduce_scatter") == 0) {
            m->sequence[i].kind = MFSDP_CALL_REDUCE_SCATTER;
        } else {
            char shown[SHOW_LEN];
            show(shown, sizeof(shown), k != NULL ? k : "");
            return fail(ctx, MFSDP_ERR_PARSE, kp,
                        "expected \"allgather\" or \"reduce_scatter\", got %s%s%s",
                        k != NULL ? "\"" : type_word(kind), shown, k != NULL ? "\"" : "");
        }
        path_index(kp, ep, 1);
        if (!json_is_string(group)) {
            return fail(ctx, MFSDP_ERR_PARSE, kp, "expected a group name, got %s",
                        type_word(group));
        }
        json_t *idx = json_object_get(ctx->group_names, json_string_value(group));
        if (idx == NULL) {
            char shown[SHOW_LEN];
            show(shown, sizeof(shown), json_string_value(group));
            return fail(ctx, MFSDP_ERR_PARSE, kp, "no group named \"%s\"", shown);
        }
        m->sequence[i].group = (size_t)json_integer_value(idx);
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_root(parse_ctx_t *ctx, json_t *root, mfsdp_manifest_t *m)
{
    static const char *const keys[] = {"format",   "world_size", "replicate", "optimizer",
                                       "training", "iteration",  "groups",    "sequence"};
    char kp[PATH_LEN];
    json_t *v;
    if (!json_is_object(root)) {
        return fail(ctx, MFSDP_ERR_PARSE, "top level", "expected an object, got %s",
                    type_word(root));
    }
    /* The version first: another version may legitimately have other keys. */
    MFSDP_CHECK(get_key(ctx, root, "", "format", 1, "\"" MFSDP_MANIFEST_FORMAT "\"", &v, kp));
    if (!json_is_string(v) || strcmp(json_string_value(v), MFSDP_MANIFEST_FORMAT) != 0) {
        const char *s = json_is_string(v) ? json_string_value(v) : NULL;
        char shown[SHOW_LEN];
        show(shown, sizeof(shown), s != NULL ? s : "");
        int other_version = s != NULL && strncmp(s, "mfsdp-manifest/", 15) == 0;
        return fail(ctx, other_version ? MFSDP_ERR_UNSUPPORTED : MFSDP_ERR_PARSE, kp,
                    "expected \"" MFSDP_MANIFEST_FORMAT "\", got %s%s%s%s",
                    s != NULL ? "\"" : type_word(v), shown, s != NULL ? "\"" : "",
                    other_version ? " (unsupported version)" : "");
    }
    MFSDP_CHECK(check_keys(ctx, root, "", keys, sizeof(keys) / sizeof(keys[0])));

    MFSDP_CHECK(get_key(ctx, root, "", "world_size", 0, NULL, &v, kp));
    m->world_size = 0;
    if (v != NULL) {
        int64_t w;
        MFSDP_CHECK(want_int(ctx, v, kp, 1, INT_MAX, "an integer >= 1", &w));
        m->world_size = (int)w;
    }
    MFSDP_CHECK(get_key(ctx, root, "", "replicate", 0, NULL, &v, kp));
    m->replicate = 1;
    if (v != NULL) {
        int64_t r;
        MFSDP_CHECK(want_int(ctx, v, kp, 1, INT_MAX, "an integer >= 1", &r));
        m->replicate = (int)r;
    }

    mfsdp_hparams_default(&m->hp);
    MFSDP_CHECK(get_key(ctx, root, "", "optimizer", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_optimizer(ctx, v, &m->hp));
    }
    mfsdp_training_default(&m->training);
    MFSDP_CHECK(get_key(ctx, root, "", "training", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_training(ctx, v, &m->training));
    }
    MFSDP_CHECK(get_key(ctx, root, "", "iteration", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_iteration(ctx, v, &m->iteration));
    }

    const char *what = "a non-empty array of group objects";
    MFSDP_CHECK(get_key(ctx, root, "", "groups", 1, what, &v, kp));
    if (!json_is_array(v) || json_array_size(v) == 0) {
        return fail(ctx, MFSDP_ERR_PARSE, kp, "expected %s, got %s", what, got_word(v));
    }
    size_t n = json_array_size(v);
    m->groups = calloc(n, sizeof(*m->groups));
    if (m->groups == NULL) {
        return fail(ctx, MFSDP_ERR_NO_MEMORY, kp, "out of memory");
    }
    m->ngroups = n;
    for (size_t i = 0; i < n; i++) {
        char gp[PATH_LEN];
        path_index(gp, kp, i);
        MFSDP_CHECK(parse_group(ctx, json_array_get(v, i), gp, i, &m->groups[i]));
    }

    MFSDP_CHECK(get_key(ctx, root, "", "sequence", 0, NULL, &v, kp));
    if (v != NULL) {
        MFSDP_CHECK(parse_sequence(ctx, v, m));
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_manifest_parse(const char *text, size_t len, const char *origin, char *err,
                                    size_t errlen, mfsdp_manifest_t **manifest_p)
{
    MFSDP_CHECK_ARG(text != NULL || len == 0);
    MFSDP_CHECK_ARG(manifest_p != NULL);
    mfsdp_status_t st = MFSDP_OK;
    parse_ctx_t ctx = {
        .origin = origin != NULL ? origin : "manifest",
        .err = err,
        .errlen = errlen,
    };
    mfsdp_manifest_t *m = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(text != NULL ? text : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        char where[PATH_LEN];
        snprintf(where, sizeof(where), "line %d, column %d", jerr.line, jerr.column);
        return fail(&ctx, MFSDP_ERR_PARSE, where, "not valid JSON: %s", jerr.text);
    }
    ctx.param_names = json_object();
    ctx.group_names = json_object();
    m = calloc(1, sizeof(*m));
    if (ctx.param_names == NULL || ctx.group_names == NULL || m == NULL) {
        st = fail(&ctx, MFSDP_ERR_NO_MEMORY, "top level", "out of memory");
        goto out;
    }
    MFSDP_CHECK_GOTO(parse_root(&ctx, root, m), st, out);
    *manifest_p = m;
    m = NULL;
out:
    mfsdp_manifest_free(m);
    json_decref(ctx.param_names);
    json_decref(ctx.group_names);
    json_decref(root);
    return st;
}

/* An unreadable file: the message names the path, the step and the system's reason. */
static mfsdp_status_t io_fail(const char *path, const char *what, int errnum, char *err,
                              size_t errlen)
{
    char ebuf[128];
    const char *reason = strerror_r(errnum, ebuf, sizeof(ebuf));
    MFSDP_WARN("%s: %s: %s", path, what, reason);
    if (err != NULL && errlen > 0) {
        snprintf(err, errlen, "%s: %s: %s", path, what, reason);
    }
    return MFSDP_ERR_IO;
}

mfsdp_status_t mfsdp_manifest_load(const char *path, char *err, size_t errlen,
                                   mfsdp_manifest_t **manifest_p)
{
    MFSDP_CHECK_ARG(path != NULL && manifest_p != NULL);
    mfsdp_status_t st = MFSDP_OK;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        return io_fail(path, "cannot open", errno, err, errlen);
    }
    for (;;) {
        if (len == cap) {
            size_t ncap;
            if (mfsdp_mul_overflow(cap ? cap : 32768, 2, &ncap)) {
                st = io_fail(path, "cannot read", EFBIG, err, errlen);
                goto out;
            }
            char *nbuf = realloc(buf, ncap);
            if (nbuf == NULL) {
                MFSDP_WARN("%s: out of memory reading the manifest", path);
                if (err != NULL && errlen > 0) {
                    snprintf(err, errlen, "%s: out of memory", path);
                }
                st = MFSDP_ERR_NO_MEMORY;
                goto out;
            }
            buf = nbuf;
            cap = ncap;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) {
            if (ferror(f)) {
                st = io_fail(path, "cannot read", errno, err, errlen);
                goto out;
            }
            break;
        }
    }
    st = mfsdp_manifest_parse(buf, len, path, err, errlen, manifest_p);
out:
    fclose(f);
    free(buf);
    return st;
}

void mfsdp_manifest_free(mfsdp_manifest_t *manifest)
{
    if (manifest == NULL) {
        return;
    }
    for (size_t g = 0; manifest->groups != NULL && g < manifest->ngroups; g++) {
        mfsdp_group_desc_t *gd = &manifest->groups[g];
        for (size_t p = 0; gd->params != NULL && p < gd->nparams; p++) {
            free(gd->params[p].name);
            free(gd->params[p].split);
        }
        free(gd->params);
        free(gd->name);
    }
    free(manifest->groups);
    free(manifest->sequence);
    free(manifest);
}

mfsdp_status_t mfsdp_manifest_find_group(const mfsdp_manifest_t *manifest, const char *name,
                                         size_t *index_p)
{
    MFSDP_CHECK_ARG(manifest != NULL && name != NULL && index_p != NULL);
    for (size_t g = 0; g < manifest->ngroups; g++) {
        if (manifest->groups[g].name != NULL && strcmp(manifest->groups[g].name, name) == 0) {
            *index_p = g;
            return MFSDP_OK;
        }
    }
    return MFSDP_ERR_NOT_FOUND; /* a lookup miss is an answer, not a failure: no warning */
}

/* ---- canonical writer ------------------------------------------------------------------ */

typedef struct strbuf {
    char *s;
    size_t len;
    size_t cap;
    int oom;
} strbuf_t;

static void sb_reserve(strbuf_t *b, size_t extra)
{
    size_t need;
    if (b->oom || mfsdp_add_overflow(b->len, extra + 1, &need)) {
        b->oom = 1;
        return;
    }
    if (need <= b->cap) {
        return;
    }
    size_t ncap = b->cap ? b->cap : 4096;
    while (ncap < need) {
        if (mfsdp_mul_overflow(ncap, 2, &ncap)) {
            b->oom = 1;
            return;
        }
    }
    char *ns = realloc(b->s, ncap);
    if (ns == NULL) {
        b->oom = 1;
        return;
    }
    b->s = ns;
    b->cap = ncap;
}

static void sb_printf(strbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(strbuf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = 1;
        return;
    }
    sb_reserve(b, (size_t)n);
    if (b->oom) {
        return;
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* A JSON string literal; bytes >= 0x80 pass through (names arrive as UTF-8). */
static void sb_string(strbuf_t *b, const char *s)
{
    sb_printf(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\') {
            sb_printf(b, "\\%c", *p);
        } else if (*p < 0x20) {
            sb_printf(b, "\\u%04x", *p);
        } else {
            sb_printf(b, "%c", *p);
        }
    }
    sb_printf(b, "\"");
}

/* The shortest of %.15g/%.16g/%.17g that reads back to the same double. */
static void sb_real(strbuf_t *b, double d)
{
    char txt[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(txt, sizeof(txt), "%.*g", prec, d);
        if (strtod(txt, NULL) == d) {
            break;
        }
    }
    /* JSON wants '.' whatever LC_NUMERIC says. */
    for (char *c = txt; *c != '\0'; c++) {
        if (*c == ',') {
            *c = '.';
        }
    }
    sb_printf(b, "%s", txt);
}

static void emit_param(strbuf_t *b, const mfsdp_param_desc_t *p)
{
    sb_printf(b, "{\"name\": ");
    sb_string(b, p->name);
    sb_printf(b, ", \"shape\": [");
    for (int d = 0; d < p->ndim; d++) {
        sb_printf(b, "%s%" PRId64, d ? ", " : "", p->shape[d]);
    }
    sb_printf(b, "], \"dtype\": \"%s\", \"optimizer\": \"%s\", \"requires_grad\": %s",
              mfsdp_dtype_name(p->dtype), p->optimizer == MFSDP_ROLE_MUON ? "muon" : "adamw",
              p->requires_grad ? "true" : "false");
    if (p->nsplit > 0) {
        sb_printf(b, ", \"split\": [");
        for (size_t i = 0; i < p->nsplit; i++) {
            sb_printf(b, "%s%" PRId64, i ? ", " : "", p->split[i]);
        }
        sb_printf(b, "]");
    }
    sb_printf(b, ", \"shard_dim\": %d}", p->shard_dim);
}

/* A manifest built in C may leave these zero: they mean the defaults. */
static int eff_micro(const mfsdp_training_t *t)
{
    return t->micro_steps > 1 ? t->micro_steps : 1;
}

static int eff_replicate(const mfsdp_manifest_t *m)
{
    return m->replicate > 1 ? m->replicate : 1;
}

static void emit_manifest(strbuf_t *b, const mfsdp_manifest_t *m)
{
    const mfsdp_hparams_t *hp = &m->hp;
    sb_printf(b, "{\n  \"format\": \"%s\",\n", MFSDP_MANIFEST_FORMAT);
    if (m->world_size != 0) {
        sb_printf(b, "  \"world_size\": %d,\n", m->world_size);
    }
    if (eff_replicate(m) > 1) {
        sb_printf(b, "  \"replicate\": %d,\n", eff_replicate(m));
    }
    sb_printf(b, "  \"optimizer\": {\"lr\": ");
    sb_real(b, hp->lr);
    sb_printf(b, ", \"momentum\": ");
    sb_real(b, hp->momentum);
    sb_printf(b, ", \"nesterov\": %s, \"ns_steps\": %d, \"weight_decay\": ",
              hp->nesterov ? "true" : "false", hp->ns_steps);
    sb_real(b, hp->weight_decay);
    sb_printf(b, ", \"scale\": \"%s\",\n    \"adamw\": {\"lr\": ",
              hp->scale == MFSDP_SCALE_MOONLIGHT ? "moonlight" : "keller");
    sb_real(b, hp->adamw_lr);
    sb_printf(b, ", \"betas\": [");
    sb_real(b, hp->adamw_beta1);
    sb_printf(b, ", ");
    sb_real(b, hp->adamw_beta2);
    sb_printf(b, "], \"eps\": ");
    sb_real(b, hp->adamw_eps);
    sb_printf(b, ", \"weight_decay\": ");
    sb_real(b, hp->adamw_weight_decay);
    sb_printf(b, "}");
    const mfsdp_schedule_t *sc = &hp->schedule;
    if (sc->kind != MFSDP_SCHEDULE_CONSTANT) {
        sb_printf(b, ",\n    \"schedule\": {\"kind\": \"%s\", \"warmup_steps\": %" PRId64,
                  schedule_kinds[sc->kind], sc->warmup_steps);
        if (sc->kind == MFSDP_SCHEDULE_WSD) {
            sb_printf(b, ", \"stable_steps\": %" PRId64 ", \"decay\": \"%s\"", sc->stable_steps,
                      decay_kinds[sc->decay]);
        }
        sb_printf(b, ", \"decay_steps\": %" PRId64 ", \"min_lr_ratio\": ", sc->decay_steps);
        sb_real(b, sc->min_lr_ratio);
        sb_printf(b, "}");
    }
    if (hp->max_norm != 0.0) {
        sb_printf(b, ", \"max_norm\": ");
        sb_real(b, hp->max_norm);
    }
    sb_printf(b, "},\n");
    const mfsdp_training_t *t = &m->training;
    mfsdp_training_t td;
    mfsdp_training_default(&td);
    if (eff_micro(t) != td.micro_steps || t->divide != td.divide || t->has_tail || t->has_step) {
        sb_printf(b, "  \"training\": {\"micro_steps\": %d, \"grad_divide\": ", eff_micro(t));
        if (t->divide == MFSDP_DIVIDE_FACTOR) {
            sb_real(b, t->divide_factor);
        } else {
            sb_printf(b, "\"%s\"", divide_rules[t->divide]);
        }
        if (t->has_tail) {
            sb_printf(b, ", \"tail\": \"%s\"", tail_policies[t->tail]);
        }
        if (t->has_step) {
            sb_printf(b, ", \"step\": \"%s\"", step_modes[t->step]);
        }
        sb_printf(b, "},\n");
    }
    if (m->iteration.forward_only || m->iteration.no_sync) {
        sb_printf(b, "  \"iteration\": {\"forward_only\": %s, \"no_sync\": %s},\n",
                  m->iteration.forward_only ? "true" : "false",
                  m->iteration.no_sync ? "true" : "false");
    }
    sb_printf(b, "  \"groups\": [\n");
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        sb_printf(b, "    {\"name\": ");
        sb_string(b, gd->name);
        if (gd->has_reduce_dtype) {
            sb_printf(b, ", \"reduce_dtype\": \"%s\"", mfsdp_dtype_name(gd->reduce_dtype));
        }
        sb_printf(b, ", \"lr_scale\": ");
        sb_real(b, gd->lr_scale);
        if (gd->has_weight_decay) {
            sb_printf(b, ", \"weight_decay\": ");
            sb_real(b, gd->weight_decay);
        }
        sb_printf(b, ", \"params\": [\n");
        for (size_t p = 0; p < gd->nparams; p++) {
            sb_printf(b, "      ");
            emit_param(b, &gd->params[p]);
            sb_printf(b, "%s\n", p + 1 < gd->nparams ? "," : "");
        }
        sb_printf(b, "    ]}%s\n", g + 1 < m->ngroups ? "," : "");
    }
    sb_printf(b, "  ]");
    if (m->ncalls > 0) {
        sb_printf(b, ",\n  \"sequence\": [\n");
        for (size_t i = 0; i < m->ncalls; i++) {
            sb_printf(b, "    [\"%s\", ",
                      m->sequence[i].kind == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter");
            sb_string(b, m->groups[m->sequence[i].group].name);
            sb_printf(b, "%s]%s\n",
                      (m->sequence[i].flags & MFSDP_CALL_OPTIONAL) ? ", \"optional\"" : "",
                      i + 1 < m->ncalls ? "," : "");
        }
        sb_printf(b, "  ]");
    }
    sb_printf(b, "\n}\n");
}

/* The pointers and enums the writer dereferences or indexes with must be sane. */
static int manifest_writable(const mfsdp_manifest_t *m)
{
    if (m->ngroups > 0 && m->groups == NULL) {
        return 0;
    }
    if (m->ncalls > 0 && m->sequence == NULL) {
        return 0;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        const mfsdp_group_desc_t *gd = &m->groups[g];
        if (gd->name == NULL || (gd->nparams > 0 && gd->params == NULL)) {
            return 0;
        }
        for (size_t p = 0; p < gd->nparams; p++) {
            const mfsdp_param_desc_t *pd = &gd->params[p];
            if (pd->name == NULL || pd->ndim < 1 || pd->ndim > MFSDP_MAX_DIMS ||
                (pd->nsplit > 0 && pd->split == NULL)) {
                return 0;
            }
        }
    }
    for (size_t i = 0; i < m->ncalls; i++) {
        if (m->sequence[i].group >= m->ngroups) {
            return 0;
        }
    }
    const mfsdp_training_t *t = &m->training;
    if ((unsigned)m->hp.schedule.kind >= NCHOICES(schedule_kinds) ||
        (unsigned)m->hp.schedule.decay >= NCHOICES(decay_kinds) ||
        (unsigned)t->divide > MFSDP_DIVIDE_FACTOR ||
        (t->has_tail && (unsigned)t->tail >= NCHOICES(tail_policies)) ||
        (t->has_step && (unsigned)t->step >= NCHOICES(step_modes))) {
        return 0;
    }
    return 1;
}

static int params_equal(const mfsdp_param_desc_t *a, const mfsdp_param_desc_t *b)
{
    if (strcmp(a->name, b->name) != 0 || a->ndim != b->ndim || a->numel != b->numel ||
        a->dtype != b->dtype || a->optimizer != b->optimizer ||
        a->requires_grad != b->requires_grad || a->nsplit != b->nsplit ||
        a->shard_dim != b->shard_dim) {
        return 0;
    }
    for (int d = 0; d < a->ndim; d++) {
        if (a->shape[d] != b->shape[d]) {
            return 0;
        }
    }
    for (size_t i = 0; i < a->nsplit; i++) {
        if (a->split[i] != b->split[i]) {
            return 0;
        }
    }
    return 1;
}

/* decay only matters for wsd: the other kinds name theirs */
static int schedules_equal(const mfsdp_schedule_t *a, const mfsdp_schedule_t *b)
{
    return a->kind == b->kind && a->warmup_steps == b->warmup_steps &&
           a->stable_steps == b->stable_steps && a->decay_steps == b->decay_steps &&
           (a->kind != MFSDP_SCHEDULE_WSD || a->decay == b->decay) &&
           a->min_lr_ratio == b->min_lr_ratio;
}

static int manifests_equal(const mfsdp_manifest_t *a, const mfsdp_manifest_t *b)
{
    const mfsdp_hparams_t *x = &a->hp, *y = &b->hp;
    if (a->world_size != b->world_size || a->ngroups != b->ngroups || a->ncalls != b->ncalls ||
        x->lr != y->lr || x->momentum != y->momentum || x->nesterov != y->nesterov ||
        x->ns_steps != y->ns_steps || x->weight_decay != y->weight_decay || x->scale != y->scale ||
        x->adamw_lr != y->adamw_lr || x->adamw_beta1 != y->adamw_beta1 ||
        x->adamw_beta2 != y->adamw_beta2 || x->adamw_eps != y->adamw_eps ||
        x->adamw_weight_decay != y->adamw_weight_decay || eff_replicate(a) != eff_replicate(b) ||
        !schedules_equal(&x->schedule, &y->schedule) || x->max_norm != y->max_norm) {
        return 0;
    }
    const mfsdp_training_t *ta = &a->training, *tb = &b->training;
    if (eff_micro(ta) != eff_micro(tb) || ta->divide != tb->divide ||
        (ta->divide == MFSDP_DIVIDE_FACTOR && ta->divide_factor != tb->divide_factor) ||
        ta->has_tail != tb->has_tail || (ta->has_tail && ta->tail != tb->tail) ||
        ta->has_step != tb->has_step || (ta->has_step && ta->step != tb->step) ||
        a->iteration.forward_only != b->iteration.forward_only ||
        a->iteration.no_sync != b->iteration.no_sync) {
        return 0;
    }
    for (size_t g = 0; g < a->ngroups; g++) {
        const mfsdp_group_desc_t *ga = &a->groups[g], *gb = &b->groups[g];
        if (strcmp(ga->name, gb->name) != 0 || ga->has_reduce_dtype != gb->has_reduce_dtype ||
            (ga->has_reduce_dtype && ga->reduce_dtype != gb->reduce_dtype) ||
            ga->lr_scale != gb->lr_scale || ga->has_weight_decay != gb->has_weight_decay ||
            (ga->has_weight_decay && ga->weight_decay != gb->weight_decay) ||
            ga->nparams != gb->nparams) {
            return 0;
        }
        for (size_t p = 0; p < ga->nparams; p++) {
            if (!params_equal(&ga->params[p], &gb->params[p])) {
                return 0;
            }
        }
    }
    for (size_t i = 0; i < a->ncalls; i++) {
        if (a->sequence[i].kind != b->sequence[i].kind ||
            a->sequence[i].group != b->sequence[i].group ||
            a->sequence[i].flags != b->sequence[i].flags) {
            return 0;
        }
    }
    return 1;
}

mfsdp_status_t mfsdp_manifest_to_json(const mfsdp_manifest_t *manifest, char **json_p)
{
    MFSDP_CHECK_ARG(manifest != NULL && json_p != NULL);
    if (!manifest_writable(manifest)) {
        MFSDP_WARN("manifest to json: a null name/array, a bad ndim or a bad sequence group");
        return MFSDP_ERR_INVALID_ARG;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_manifest_t *back = NULL;
    strbuf_t b = {0};
    emit_manifest(&b, manifest);
    if (b.oom) {
        MFSDP_WARN("manifest to json: out of memory");
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    /* Read the text back: a manifest built by hand that the parser would refuse (or that
     * would not come back identical, e.g. a numel that disagrees with its shape) is an
     * argument error here rather than a file nobody can load later. */
    char perr[MSG_LEN];
    st = mfsdp_manifest_parse(b.s, b.len, "manifest to json", perr, sizeof(perr), &back);
    if (st == MFSDP_ERR_NO_MEMORY) {
        goto out;
    }
    if (st != MFSDP_OK) {
        MFSDP_WARN("manifest to json: the manifest is not valid: %s", perr);
        st = MFSDP_ERR_INVALID_ARG;
        goto out;
    }
    if (!manifests_equal(manifest, back)) {
        MFSDP_WARN("manifest to json: the manifest does not read back identically "
                   "(inconsistent numel, has_* flags or enum values)");
        st = MFSDP_ERR_INVALID_ARG;
        goto out;
    }
    *json_p = b.s;
    b.s = NULL;
out:
    mfsdp_manifest_free(back);
    free(b.s);
    return st;
}
