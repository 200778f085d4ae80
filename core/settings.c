/* SPDX-License-Identifier: Apache-2.0 */
#include "core/settings.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/algo_table.h"
#include "core/checks.h"

uint64_t mfsdp_hash_bytes(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ b[i]) * 1099511628211ull;
    }
    return h;
}

/* ---- learning-rate schedule ---------------------------------------------------------- */

double mfsdp_schedule_factor(const mfsdp_schedule_t *s, int64_t t)
{
    if (s == NULL || s->kind == MFSDP_SCHEDULE_CONSTANT) {
        return 1.0;
    }
    int64_t w = s->warmup_steps, st = s->kind == MFSDP_SCHEDULE_WSD ? s->stable_steps : 0;
    int64_t d = s->decay_steps;
    if (t < 0) {
        t = 0;
    }
    if (t > w + st + d) {
        t = w + st + d; /* past the end: the last step's factor */
    }
    if (t < w) {
        return (double)(t + 1) / (double)(w + 1);
    }
    if (t < w + st || d == 0) {
        return 1.0;
    }
    double p = (double)(t + 1 - w - st) / (double)(d + 1);
    double a;
    mfsdp_decay_kind_t shape = s->kind == MFSDP_SCHEDULE_WARMUP_COSINE   ? MFSDP_DECAY_COSINE
                               : s->kind == MFSDP_SCHEDULE_WARMUP_LINEAR ? MFSDP_DECAY_LINEAR
                                                                         : s->decay;
    switch (shape) {
    case MFSDP_DECAY_COSINE:
        a = 0.5 * (1.0 + cos(M_PI * p));
        break;
    case MFSDP_DECAY_SQRT:
        a = 1.0 - sqrt(p);
        break;
    default:
        a = 1.0 - p;
        break;
    }
    return s->min_lr_ratio + (1.0 - s->min_lr_ratio) * a;
}

static int parse_i64(const char *v, int64_t *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || x < 0 || x > INT32_MAX) {
        return -1;
    }
    *out = x;
    return 0;
}

mfsdp_status_t mfsdp_schedule_parse(const char *text, mfsdp_schedule_t *out, char *err,
                                    size_t errlen)
{
    static const char *const kinds[] = {"constant", "warmup-cosine", "warmup-linear", "wsd"};
    static const char *const shapes[] = {"linear", "cosine", "sqrt"};
    MFSDP_CHECK_ARG(text != NULL && out != NULL);
    char buf[256];
    if (strlen(text) >= sizeof(buf)) {
        SETERR("MFSDP_LR_SCHEDULE: too long");
        return MFSDP_ERR_CONFIG;
    }
    strcpy(buf, text);
    mfsdp_schedule_t s;
    memset(&s, 0, sizeof(s));
    char *save = NULL;
    char *tok = strtok_r(buf, ",", &save);
    int kind = -1;
    for (int i = 0; tok != NULL && i < 4; i++) {
        if (strcmp(tok, kinds[i]) == 0) {
            kind = i;
        }
    }
    if (kind < 0) {
        SETERR("MFSDP_LR_SCHEDULE=%s: expected KIND[,warmup=W][,stable=S][,decay=D][,min=M]"
               "[,shape=linear|cosine|sqrt] with KIND constant|warmup-cosine|warmup-linear|wsd",
               text);
        return MFSDP_ERR_CONFIG;
    }
    s.kind = (mfsdp_schedule_kind_t)kind;
    s.decay = kind == MFSDP_SCHEDULE_WARMUP_COSINE ? MFSDP_DECAY_COSINE : MFSDP_DECAY_LINEAR;
    unsigned seen = 0; /* items given, as in the manifest a key given twice is refused */
    while ((tok = strtok_r(NULL, ",", &save)) != NULL) {
        char *eq = strchr(tok, '=');
        int bad = eq == NULL;
        if (!bad) {
            *eq = '\0';
            static const char *const items[] = {"warmup", "stable", "decay", "min", "shape"};
            for (unsigned i = 0; i < 5; i++) {
                if (strcmp(tok, items[i]) == 0) {
                    if (seen & (1u << i)) {
                        *eq = '=';
                        SETERR("MFSDP_LR_SCHEDULE=%s: '%s' is given twice", text, items[i]);
                        return MFSDP_ERR_CONFIG;
                    }
                    seen |= 1u << i;
                }
            }
            const char *v = eq + 1;
            if (strcmp(tok, "warmup") == 0) {
                bad = parse_i64(v, &s.warmup_steps);
            } else if (strcmp(tok, "stable") == 0 && kind == MFSDP_SCHEDULE_WSD) {
                bad = parse_i64(v, &s.stable_steps);
            } else if (strcmp(tok, "decay") == 0) {
                bad = parse_i64(v, &s.decay_steps);
            } else if (strcmp(tok, "min") == 0) {
                char *end;
                errno = 0;
                s.min_lr_ratio = strtod(v, &end);
                bad = errno != 0 || end == v || *end != '\0' || !(s.min_lr_ratio >= 0.0) ||
                      s.min_lr_ratio > 1.0;
            } else if (strcmp(tok, "shape") == 0 && kind == MFSDP_SCHEDULE_WSD) {
                bad = 1;
                for (int i = 0; i < 3; i++) {
                    if (strcmp(v, shapes[i]) == 0) {
                        s.decay = (mfsdp_decay_kind_t)i;
                        bad = 0;
                    }
                }
            } else {
                bad = 1;
            }
            if (bad) {
                *eq = '=';
            }
        }
        if (bad) {
            SETERR("MFSDP_LR_SCHEDULE=%s: bad item '%s' (warmup, decay: integers >= 0; min in "
                   "[0, 1]; stable and shape=linear|cosine|sqrt only with wsd)",
                   text, tok);
            return MFSDP_ERR_CONFIG;
        }
    }
    if (kind == MFSDP_SCHEDULE_CONSTANT &&
        (s.warmup_steps != 0 || s.decay_steps != 0 || s.min_lr_ratio != 0.0)) {
        SETERR("MFSDP_LR_SCHEDULE=%s: a constant schedule takes no warmup, decay or min", text);
        return MFSDP_ERR_CONFIG;
    }
    *out = s;
    return MFSDP_OK;
}

/* ---- gradient divide ----------------------------------------------------------------- */

double mfsdp_fsdp2_predivide(double f)
{
    double pre = 1.0;
    while (fmod(f, pre) == 0.0 && f / pre > pre) {
        pre *= 2.0;
    }
    return pre;
}

static const char *op_word(mfsdp_redop_t op)
{
    return op == MFSDP_OP_SUM ? "sum" : op == MFSDP_OP_AVG ? "avg" : "premulsum";
}

mfsdp_status_t mfsdp_divide_resolve(mfsdp_divide_rule_t rule, double factor, mfsdp_dtype_t dtype,
                                    int dp, mfsdp_redop_t wire_op, double wire_scalar,
                                    mfsdp_redop_t *op_p, double *scalar_p, double *post_p,
                                    char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(op_p != NULL && scalar_p != NULL && post_p != NULL && dp >= 1);
    double post = 1.0;
    int fp16 = dtype == MFSDP_FLOAT16;
    switch (rule) {
    case MFSDP_DIVIDE_FSDP2:
        /* FSDP2: avg / premulsum for fp32 and bf16; sum only at dp 1 or in fp16. */
        if (wire_op == MFSDP_OP_SUM && fp16) {
            post = (double)dp / mfsdp_fsdp2_predivide((double)dp);
        } else if (wire_op == MFSDP_OP_SUM && dp > 1) {
            SETERR("a %s reduce-scatter with op sum on %d data-parallel ranks: FSDP2 uses avg "
                   "here unless force_sum_reduction_for_comms is set (then it post-divides by "
                   "%d); declare training.grad_divide (\"force_sum\", \"world\" or a number) "
                   "or MFSDP_GRAD_DIVIDE",
                   mfsdp_dtype_name(dtype), dp, dp);
            return MFSDP_ERR_UNSUPPORTED;
        }
        break;
    case MFSDP_DIVIDE_FORCE_SUM:
    case MFSDP_DIVIDE_WORLD:
        if (wire_op != MFSDP_OP_SUM) {
            SETERR("grad_divide \"%s\" expects reduce-scatters with op sum, the job uses %s",
                   rule == MFSDP_DIVIDE_WORLD ? "world" : "force_sum", op_word(wire_op));
            return MFSDP_ERR_UNSUPPORTED;
        }
        post = rule == MFSDP_DIVIDE_FORCE_SUM && fp16
                   ? (double)dp / mfsdp_fsdp2_predivide((double)dp)
                   : (double)dp;
        break;
    case MFSDP_DIVIDE_FACTOR:
        if (!(factor > 0.0) || !isfinite(factor)) {
            SETERR("grad_divide factor %g: expected a finite number > 0", factor);
            return MFSDP_ERR_UNSUPPORTED;
        }
        post = factor;
        break;
    default:
        SETERR("unknown grad_divide rule %d", (int)rule);
        return MFSDP_ERR_UNSUPPORTED;
    }
    *op_p = wire_op;
    *scalar_p = wire_op == MFSDP_OP_PREMULSUM ? wire_scalar : 1.0;
    *post_p = post;
    return MFSDP_OK;
}

void mfsdp_divide_fold(int world, double post, mfsdp_redop_t *op, double *scalar)
{
    if (post == 1.0) {
        return;
    }
    switch (*op) {
    case MFSDP_OP_SUM:
        if (post == (double)world) {
            *op = MFSDP_OP_AVG;
        } else {
            *op = MFSDP_OP_PREMULSUM;
            *scalar = 1.0 / post;
        }
        break;
    case MFSDP_OP_AVG:
        *op = MFSDP_OP_PREMULSUM;
        *scalar = 1.0 / ((double)world * post);
        break;
    case MFSDP_OP_PREMULSUM:
        *scalar /= post;
        break;
    }
}

/* ---- resolution ---------------------------------------------------------------------- */

mfsdp_status_t mfsdp_settings_resolve(const mfsdp_manifest_t *m, const mfsdp_config_t *cfg,
                                      mfsdp_settings_t *out, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(m != NULL && cfg != NULL && out != NULL);
    mfsdp_settings_t s;
    memset(&s, 0, sizeof(s));
    s.hp = m->hp;
    if (cfg->lr_set)
        s.hp.lr = cfg->lr;
    if (cfg->momentum_set) {
        if (!(cfg->momentum < 1.0)) { /* the manifest's rule: a β of 1 never forgets */
            SETERR("MFSDP_MOMENTUM=%.17g: expected a number in [0, 1)", cfg->momentum);
            return MFSDP_ERR_CONFIG;
        }
        s.hp.momentum = cfg->momentum;
    }
    if (cfg->ns_steps_set)
        s.hp.ns_steps = (int)cfg->ns_steps;
    if (cfg->weight_decay_set)
        s.hp.weight_decay = cfg->weight_decay;
    if (cfg->nesterov_set)
        s.hp.nesterov = cfg->nesterov;
    if (cfg->scale_set)
        s.hp.scale = cfg->scale == 1 ? MFSDP_SCALE_MOONLIGHT : MFSDP_SCALE_KELLER;
    if (cfg->adamw_lr_set)
        s.hp.adamw_lr = cfg->adamw_lr;
    if (cfg->adamw_weight_decay_set)
        s.hp.adamw_weight_decay = cfg->adamw_weight_decay;
    if (cfg->lr_schedule_set) {
        MFSDP_CHECK(mfsdp_schedule_parse(cfg->lr_schedule, &s.hp.schedule, err, errlen));
    }
    s.tail = cfg->tail_set          ? (mfsdp_tail_policy_t)cfg->tail
             : m->training.has_tail ? m->training.tail
                                    : MFSDP_TAIL_AUTO;
    s.mem_limit = cfg->mem_limit;
    s.spread = cfg->spread;
    s.micro_steps = cfg->accum_steps_set          ? (int)cfg->accum_steps
                    : m->training.micro_steps > 1 ? m->training.micro_steps
                                                  : 1;
    s.clip = cfg->clip_set ? cfg->clip : m->hp.max_norm;
    s.hp.max_norm = s.clip;
    if (cfg->step_set) {
        s.has_step = 1;
        s.step = cfg->step == MFSDP_CFG_STEP_LAZY ? MFSDP_STEP_LAZY : MFSDP_STEP_EAGER;
    } else if (m->training.has_step) {
        s.has_step = 1;
        s.step = m->training.step;
    }
    s.divide = m->training.divide;
    s.divide_factor = m->training.divide_factor;
    if (cfg->grad_divide_set) {
        const char *v = cfg->grad_divide;
        if (strcasecmp(v, "fsdp2") == 0) {
            s.divide = MFSDP_DIVIDE_FSDP2;
        } else if (strcasecmp(v, "force_sum") == 0) {
            s.divide = MFSDP_DIVIDE_FORCE_SUM;
        } else if (strcasecmp(v, "world") == 0) {
            s.divide = MFSDP_DIVIDE_WORLD;
        } else {
            char *end;
            errno = 0;
            double d = strtod(v, &end);
            if (errno != 0 || end == v || *end != '\0' || !isfinite(d) || !(d > 0.0)) {
                SETERR("MFSDP_GRAD_DIVIDE=%s: expected fsdp2, force_sum, world or a number > 0", v);
                return MFSDP_ERR_CONFIG;
            }
            s.divide = MFSDP_DIVIDE_FACTOR;
            s.divide_factor = d;
        }
    }
    *out = s;
    return MFSDP_OK;
}

/* ---- fingerprint --------------------------------------------------------------------- */

/* Variables each rank may set as it likes: logging, local memory and threading. */
static const char *const local_vars[] = {
    "MFSDP_DEBUG",     "MFSDP_DEBUG_SUBSYS", "MFSDP_DEBUG_FILE", "MFSDP_MLOCK",
    "MFSDP_NUMA_BIND", "MFSDP_REPORT",       "MFSDP_THREADS",    "MFSDP_MANIFEST",
    "MFSDP_RECORD",    "MFSDP_TUNER_CONFIG", "MFSDP_ALGO_TABLE", /* a path: compared by content
                                                                    below */
};

void mfsdp_fp_item_set(mfsdp_fp_item_t *it, const char *name, const char *value)
{
    it->name = name;
    it->hash = mfsdp_hash_bytes(MFSDP_HASH_INIT, value, strlen(value));
    snprintf(it->value, sizeof(it->value), "%s", value);
    if (strlen(value) >= sizeof(it->value)) {
        strcpy(it->value + sizeof(it->value) - 4, "...");
    }
}

size_t mfsdp_settings_fingerprint(const mfsdp_manifest_t *m, int world, const mfsdp_config_t *cfg,
                                  mfsdp_fp_item_t *items)
{
    size_t n = 0;
    char v[64];
    /* The same items on every rank, whatever each one's configuration (a count that differed
     * would truncate the exchange). First whether the MFSDP_* values parsed at all: a rank
     * with a bad one has no values to compare. */
    mfsdp_fp_item_set(&items[n++], "the MFSDP_* configuration",
                      cfg != NULL ? "valid" : "invalid (see that rank's error)");
    /* The manifest by content (its path may differ per rank), then whether records are on. */
    char *json = NULL;
    if (m != NULL && mfsdp_manifest_to_json(m, &json) == MFSDP_OK) {
        uint64_t h = mfsdp_hash_bytes(MFSDP_HASH_INIT, json, strlen(json));
        snprintf(v, sizeof(v), "%zu groups, hash %016llx", m->ngroups, (unsigned long long)h);
        free(json);
    } else {
        snprintf(v, sizeof(v), "%s", m != NULL ? "(unwritable)" : "(none)");
    }
    mfsdp_fp_item_set(&items[n++], "the manifest", v);
    snprintf(v, sizeof(v), "%d", world);
    mfsdp_fp_item_set(&items[n++], "the communicator size", v);
    mfsdp_fp_item_set(&items[n++], "MFSDP_RECORD (set or not)",
                      cfg != NULL && cfg->record_set ? "set" : "unset");
    char value[4096]; /* a path whole: two that differ only past 255 bytes differ */
    for (size_t i = 0; i < mfsdp_config_count() && n < MFSDP_FP_MAX; i++) {
        const char *name = NULL;
        if (mfsdp_config_value(cfg, i, &name, value, sizeof(value)) != MFSDP_OK) { /* cfg NULL */
            if (name == NULL) {
                continue; /* no entry i: the same on every rank (one table) */
            }
            snprintf(value, sizeof(value), "(no value)");
        }
        int local = 0;
        for (size_t k = 0; k < sizeof(local_vars) / sizeof(local_vars[0]); k++) {
            local |= strcmp(name, local_vars[k]) == 0;
        }
        if (!local) {
            mfsdp_fp_item_set(&items[n++], name, value);
        }
    }
    if (cfg == NULL || cfg->algo_table == NULL || cfg->algo_table[0] == '\0') {
        snprintf(v, sizeof(v), "(unset)");
    } else {
        /* The table by its rows (the path may differ per node): ranks that would pick other
         * algorithms would post messages their peers never match. */
        mfsdp_algo_table_t t;
        if (mfsdp_algo_table_load(cfg->algo_table, &t, NULL, 0) == MFSDP_OK) {
            uint64_t h = MFSDP_HASH_INIT;
            for (size_t i = 0; i < t.nrows; i++) {
                char row[160];
                mfsdp_algo_row_format(&t.rows[i], row, sizeof(row));
                h = mfsdp_hash_bytes(h, row, strlen(row) + 1);
            }
            snprintf(v, sizeof(v), "%zu rows, hash %016llx", t.nrows, (unsigned long long)h);
            mfsdp_algo_table_free(&t);
        } else {
            snprintf(v, sizeof(v), "(unreadable)");
        }
    }
    if (n < MFSDP_FP_MAX) {
        mfsdp_fp_item_set(&items[n++], "MFSDP_ALGO_TABLE (its rows)", v);
    }
    return n;
}

mfsdp_status_t mfsdp_settings_agree(const mfsdp_fp_item_t *items, size_t n,
                                    const mfsdp_agree_ops_t *ops, char *err, size_t errlen)
{
    MFSDP_CHECK_ARG(items != NULL && ops != NULL && n <= MFSDP_FP_MAX && ops->world >= 1);
    uint64_t lo[MFSDP_FP_MAX], hi[MFSDP_FP_MAX];
    /* The count first: exchanging lists of different lengths would truncate or hang (an
     * mfsdp of another version on one rank). */
    lo[0] = hi[0] = (uint64_t)n;
    if (ops->allreduce_u64(ops->arg, lo, 1, 0) != 0 ||
        ops->allreduce_u64(ops->arg, hi, 1, 1) != 0) {
        SETERR("exchanging settings with the other ranks failed");
        return MFSDP_ERR_TRANSPORT;
    }
    if (lo[0] != hi[0]) {
        SETERR("the ranks compare %llu to %llu settings: they run different versions of mfsdp",
               (unsigned long long)lo[0], (unsigned long long)hi[0]);
        return MFSDP_ERR_MISMATCH;
    }
    for (size_t i = 0; i < n; i++) {
        lo[i] = hi[i] = items[i].hash;
    }
    if (ops->allreduce_u64(ops->arg, lo, n, 0) != 0 ||
        ops->allreduce_u64(ops->arg, hi, n, 1) != 0) {
        SETERR("exchanging settings with the other ranks failed");
        return MFSDP_ERR_TRANSPORT;
    }
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++) {
        if (lo[i] != hi[i]) {
            bad = i;
        }
    }
    if (bad == n) {
        return MFSDP_OK;
    }
    /* Every rank takes part in the same gather (the decision above is the same everywhere). */
    size_t w = (size_t)ops->world;
    char *all = calloc(w, MFSDP_FP_VALUE_LEN);
    char *mine = calloc(1, MFSDP_FP_VALUE_LEN);
    if (all == NULL || mine == NULL ||
        ops->allgather(ops->arg, memcpy(mine, items[bad].value, MFSDP_FP_VALUE_LEN),
                       MFSDP_FP_VALUE_LEN, all) != 0) {
        SETERR("%s differs across ranks (and gathering the values failed)", items[bad].name);
        free(all);
        free(mine);
        return MFSDP_ERR_MISMATCH;
    }
    /* "NAME differs across ranks: 'a' on ranks 0-1,3, 'b' on rank 2" (at most 4 values). */
    char msg[1024];
    size_t used = (size_t)snprintf(msg, sizeof(msg), "%s differs across ranks:", items[bad].name);
    unsigned char *done = calloc(w, 1);
    size_t shown = 0;
    for (size_t r = 0; done != NULL && r < w && used < sizeof(msg); r++) {
        if (done[r]) {
            continue;
        }
        const char *v = all + r * MFSDP_FP_VALUE_LEN;
        if (shown == 4) {
            used += (size_t)snprintf(msg + used, sizeof(msg) - used, " ...");
            break;
        }
        size_t count = 0;
        for (size_t q = r; q < w; q++) {
            count += !done[q] && strncmp(v, all + q * MFSDP_FP_VALUE_LEN, MFSDP_FP_VALUE_LEN) == 0;
        }
        used += (size_t)snprintf(msg + used, sizeof(msg) - used, "%s '%.*s' on rank%s",
                                 shown ? "," : "", MFSDP_FP_VALUE_LEN, v, count > 1 ? "s" : "");
        size_t runs = 0;
        for (size_t q = r; q < w && used < sizeof(msg); q++) {
            if (done[q] || strncmp(v, all + q * MFSDP_FP_VALUE_LEN, MFSDP_FP_VALUE_LEN) != 0) {
                continue;
            }
            size_t e = q; /* a run q..e of ranks with this value */
            while (e + 1 < w && !done[e + 1] &&
                   strncmp(v, all + (e + 1) * MFSDP_FP_VALUE_LEN, MFSDP_FP_VALUE_LEN) == 0) {
                e++;
            }
            used += (size_t)snprintf(msg + used, sizeof(msg) - used, e > q ? "%s%zu-%zu" : "%s%zu",
                                     runs ? "," : " ", q, e);
            for (size_t k = q; k <= e; k++) {
                done[k] = 1;
            }
            runs++;
            q = e;
        }
        shown++;
    }
    SETERR("%s" MFSDP_AGREE_HINT, msg);
    free(done);
    free(all);
    free(mine);
    return MFSDP_ERR_MISMATCH;
}
