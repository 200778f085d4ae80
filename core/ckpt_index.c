/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Checkpoint layout and index (see core/ckpt_index.h). The index parser trusts nothing: it
 * checks the self digest first, then every member against what the stored manifest and
 * owners imply, so a reader never follows an index into a file or key that the layout
 * would not have written.
 */
#include "core/ckpt_index.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

#define MSG_LEN  512
#define PATH_LEN 160
/* The fixed start of an index: {"index_sha256": "<64 hex>", then the digested rest. */
#define IDX_PREFIX     "{\"index_sha256\": \""
#define IDX_PREFIX_LEN (sizeof(IDX_PREFIX) - 1)
#define IDX_HEAD_LEN   (IDX_PREFIX_LEN + 64 + 2)

static const char *const state_names[MFSDP_CKPT_NSTATES] = {
    [MFSDP_CKPT_WEIGHT] = "weight",         [MFSDP_CKPT_MASTER] = "master",
    [MFSDP_CKPT_MOMENTUM] = "momentum",     [MFSDP_CKPT_EXP_AVG] = "exp_avg",
    [MFSDP_CKPT_EXP_AVG_SQ] = "exp_avg_sq",
};
static const char *const tail_names[] = {"owner", "shard", "auto"};

const char *mfsdp_ckpt_state_name(mfsdp_ckpt_state_t s)
{
    return (unsigned)s < MFSDP_CKPT_NSTATES ? state_names[s] : "invalid";
}

const char *mfsdp_ckpt_kind_name(mfsdp_ckpt_kind_t k)
{
    return k == MFSDP_CKPT_MODEL ? "model" : k == MFSDP_CKPT_OPTIM ? "optim" : "invalid";
}

void mfsdp_ckpt_file_name(char *buf, size_t len, mfsdp_ckpt_kind_t kind, int rank, int world)
{
    snprintf(buf, len, "%s-%05d-of-%05d.safetensors", mfsdp_ckpt_kind_name(kind), rank, world);
}

/* ---- layout ------------------------------------------------------------------------------- */

void mfsdp_ckpt_layout_destroy(mfsdp_ckpt_layout_t *lay)
{
    if (lay == NULL) {
        return;
    }
    free(lay->params);
    free(lay->group);
    free(lay->owner);
    free(lay->writer);
    free(lay->rows);
    free(lay->rest);
    free(lay->c);
    free(lay);
}

typedef struct by_bytes {
    uint64_t bytes;
    size_t t;
} by_bytes_t;

static int cmp_bytes_desc(const void *a, const void *b)
{
    const by_bytes_t *x = a, *y = b;
    if (x->bytes != y->bytes) {
        return x->bytes > y->bytes ? -1 : 1;
    }
    return x->t < y->t ? -1 : x->t > y->t;
}

/* Sharded-tail weights: largest first onto the rank with the fewest model bytes so far. */
static mfsdp_status_t balance_writers(mfsdp_ckpt_layout_t *lay)
{
    uint64_t *load = calloc((size_t)lay->world, sizeof(*load));
    by_bytes_t *tails = calloc(lay->ntensors + 1, sizeof(*tails));
    if (load == NULL || tails == NULL) {
        free(load);
        free(tails);
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t nt = 0;
    for (size_t t = 0; t < lay->ntensors; t++) {
        uint64_t b = (uint64_t)lay->params[t]->numel * mfsdp_dtype_size(lay->params[t]->dtype);
        if (lay->owner[t] >= 0) {
            lay->writer[t] = lay->owner[t];
            load[lay->owner[t]] += b;
        } else {
            tails[nt++] = (by_bytes_t){b, t};
        }
    }
    qsort(tails, nt, sizeof(*tails), cmp_bytes_desc);
    for (size_t k = 0; k < nt; k++) {
        int best = 0;
        for (int r = 1; r < lay->world; r++) {
            if (load[r] < load[best]) {
                best = r;
            }
        }
        lay->writer[tails[k].t] = best;
        load[best] += tails[k].bytes;
    }
    free(load);
    free(tails);
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ckpt_layout_create(const mfsdp_manifest_t *m, int world, const int *owner,
                                        const int *writer, mfsdp_ckpt_layout_t **layout_p)
{
    MFSDP_CHECK_ARG(m != NULL && owner != NULL && layout_p != NULL && world >= 1);
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_ckpt_layout_t *lay = calloc(1, sizeof(*lay));
    if (lay == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    lay->manifest = m;
    lay->world = world;
    for (size_t g = 0; g < m->ngroups; g++) {
        lay->ntensors += m->groups[g].nparams;
    }
    size_t n = lay->ntensors + 1;
    lay->params = calloc(n, sizeof(*lay->params));
    lay->group = calloc(n, sizeof(*lay->group));
    lay->owner = calloc(n, sizeof(*lay->owner));
    lay->writer = calloc(n, sizeof(*lay->writer));
    lay->rows = calloc(n, sizeof(*lay->rows));
    lay->rest = calloc(n, sizeof(*lay->rest));
    lay->c = calloc(n, sizeof(*lay->c));
    if (lay->params == NULL || lay->group == NULL || lay->owner == NULL || lay->writer == NULL ||
        lay->rows == NULL || lay->rest == NULL || lay->c == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    size_t t = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++, t++) {
            const mfsdp_param_desc_t *p = &m->groups[g].params[i];
            lay->params[t] = p;
            lay->group[t] = g;
            lay->rows[t] = p->shape[0];
            lay->rest[t] = p->shape[0] > 0 ? p->numel / p->shape[0] : 0;
            lay->c[t] = (p->shape[0] + world - 1) / world;
            if (p->shape[0] <= 0 || p->numel <= 0 || p->ndim < 1 || p->ndim > MFSDP_MAX_DIMS ||
                mfsdp_dtype_size(p->dtype) == 0 || p->dtype == MFSDP_UINT8) {
                MFSDP_WARN("checkpoint layout: param %s has a bad shape or dtype", p->name);
                st = MFSDP_ERR_INVALID_ARG;
                goto out;
            }
            int o = owner[t];
            if (!(o == MFSDP_OWNER_SHARDED ? p->optimizer == MFSDP_ROLE_ADAMW
                                           : o >= 0 && o < world)) {
                MFSDP_WARN("checkpoint layout: param %s: owner %d is not a rank of %d (or "
                           "'sharded' for an adamw tensor)",
                           p->name, o, world);
                st = MFSDP_ERR_INVALID_ARG;
                goto out;
            }
            lay->owner[t] = o;
        }
    }
    if (writer == NULL) {
        MFSDP_CHECK_GOTO(balance_writers(lay), st, out);
    } else {
        for (t = 0; t < lay->ntensors; t++) {
            int w = writer[t];
            if (w < 0 || w >= world || (lay->owner[t] >= 0 && w != lay->owner[t])) {
                MFSDP_WARN("checkpoint layout: param %s: writer %d is not its owner %d or a "
                           "rank of %d",
                           lay->params[t]->name, w, lay->owner[t], world);
                st = MFSDP_ERR_INVALID_ARG;
                goto out;
            }
            lay->writer[t] = w;
        }
    }
    *layout_p = lay;
    lay = NULL;
out:
    mfsdp_ckpt_layout_destroy(lay);
    return st;
}

mfsdp_status_t mfsdp_ckpt_layout_of_plan(const mfsdp_plan_t *plan, mfsdp_ckpt_layout_t **layout_p)
{
    MFSDP_CHECK_ARG(plan != NULL && plan->manifest != NULL && layout_p != NULL);
    int *owner = calloc(plan->nshards + 1, sizeof(*owner));
    if (owner == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < plan->nshards; i++) {
        owner[i] = plan->shards[i].owner;
    }
    mfsdp_status_t st =
        mfsdp_ckpt_layout_create(plan->manifest, plan->world, owner, NULL, layout_p);
    free(owner);
    return st;
}

int mfsdp_ckpt_has_state(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s)
{
    const mfsdp_param_desc_t *p = lay->params[t];
    switch (s) {
    case MFSDP_CKPT_WEIGHT:
        return 1;
    case MFSDP_CKPT_MASTER:
        return p->dtype != MFSDP_FLOAT32;
    case MFSDP_CKPT_MOMENTUM:
        return p->requires_grad && p->optimizer == MFSDP_ROLE_MUON;
    case MFSDP_CKPT_EXP_AVG:
    case MFSDP_CKPT_EXP_AVG_SQ:
        return p->requires_grad && p->optimizer == MFSDP_ROLE_ADAMW;
    default:
        return 0;
    }
}

mfsdp_st_dtype_t mfsdp_ckpt_state_dtype(const mfsdp_ckpt_layout_t *lay, size_t t,
                                        mfsdp_ckpt_state_t s)
{
    mfsdp_st_dtype_t d = MFSDP_ST_F32;
    if (s == MFSDP_CKPT_WEIGHT) {
        (void)mfsdp_st_dtype_of(lay->params[t]->dtype, &d);
    }
    return d;
}

char *mfsdp_ckpt_key(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s)
{
    const char *name = lay->params[t]->name;
    if (s == MFSDP_CKPT_WEIGHT) {
        return strdup(name);
    }
    size_t len = strlen(name) + strlen(state_names[s]) + 2;
    char *k = malloc(len);
    if (k != NULL) {
        snprintf(k, len, "%s.%s", name, state_names[s]);
    }
    return k;
}

void mfsdp_ckpt_items_free(mfsdp_ckpt_item_t *items, size_t n)
{
    for (size_t i = 0; items != NULL && i < n; i++) {
        free(items[i].key);
    }
    free(items);
}

static mfsdp_status_t push_item(const mfsdp_ckpt_layout_t *lay, mfsdp_ckpt_item_t *items, size_t *n,
                                size_t t, mfsdp_ckpt_state_t s, mfsdp_ckpt_kind_t k, int64_t a,
                                int64_t b)
{
    const mfsdp_param_desc_t *p = lay->params[t];
    mfsdp_ckpt_item_t *it = &items[(*n)++];
    memset(it, 0, sizeof(*it));
    it->tensor = t;
    it->state = s;
    it->kind = k;
    it->row_begin = a;
    it->row_end = b;
    it->dtype = mfsdp_ckpt_state_dtype(lay, t, s);
    it->ndim = p->ndim;
    memcpy(it->shape, p->shape, sizeof(it->shape));
    it->shape[0] = b - a;
    it->bytes = (uint64_t)(b - a) * (uint64_t)lay->rest[t] * mfsdp_st_dtype_size(it->dtype);
    it->key = mfsdp_ckpt_key(lay, t, s);
    return it->key != NULL ? MFSDP_OK : MFSDP_ERR_NO_MEMORY;
}

mfsdp_status_t mfsdp_ckpt_rank_items(const mfsdp_ckpt_layout_t *lay, int rank,
                                     mfsdp_ckpt_item_t **items_p, size_t *n_p)
{
    MFSDP_CHECK_ARG(lay != NULL && items_p != NULL && n_p != NULL);
    MFSDP_CHECK_ARG(rank >= 0 && rank < lay->world);
    size_t cap = lay->ntensors * MFSDP_CKPT_NSTATES + 1;
    mfsdp_ckpt_item_t *items = calloc(cap, sizeof(*items));
    if (items == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    size_t n = 0;
    mfsdp_status_t st = MFSDP_OK;
    for (size_t t = 0; t < lay->ntensors; t++) {
        if (lay->writer[t] == rank) {
            MFSDP_CHECK_GOTO(
                push_item(lay, items, &n, t, MFSDP_CKPT_WEIGHT, MFSDP_CKPT_MODEL, 0, lay->rows[t]),
                st, err);
        }
    }
    for (size_t t = 0; t < lay->ntensors; t++) {
        int64_t a = 0, b = lay->rows[t];
        if (lay->owner[t] == MFSDP_OWNER_SHARDED) {
            a = (int64_t)rank * lay->c[t];
            b = a + lay->c[t] < lay->rows[t] ? a + lay->c[t] : lay->rows[t];
        } else if (lay->owner[t] != rank) {
            continue;
        }
        if (a >= b) {
            continue; /* a rank past the last real row holds only padding: nothing stored */
        }
        for (int s = MFSDP_CKPT_MASTER; s < MFSDP_CKPT_NSTATES; s++) {
            if (mfsdp_ckpt_has_state(lay, t, (mfsdp_ckpt_state_t)s)) {
                MFSDP_CHECK_GOTO(
                    push_item(lay, items, &n, t, (mfsdp_ckpt_state_t)s, MFSDP_CKPT_OPTIM, a, b), st,
                    err);
            }
        }
    }
    *items_p = items;
    *n_p = n;
    return MFSDP_OK;
err:
    mfsdp_ckpt_items_free(items, n);
    return st;
}

size_t mfsdp_ckpt_pieces(const mfsdp_ckpt_layout_t *lay, size_t t, mfsdp_ckpt_state_t s, int64_t a,
                         int64_t b, mfsdp_ckpt_piece_t *out, size_t cap)
{
    if (a >= b) {
        return 0;
    }
    if (s == MFSDP_CKPT_MASTER && !mfsdp_ckpt_has_state(lay, t, s)) {
        s = MFSDP_CKPT_WEIGHT; /* a float32 param: the weight is the master, bit for bit */
    }
    if (s == MFSDP_CKPT_WEIGHT || lay->owner[t] >= 0) {
        if (cap > 0) {
            out[0] = (mfsdp_ckpt_piece_t){
                .rank = s == MFSDP_CKPT_WEIGHT ? lay->writer[t] : lay->owner[t],
                .kind = s == MFSDP_CKPT_WEIGHT ? MFSDP_CKPT_MODEL : MFSDP_CKPT_OPTIM,
                .state = s,
                .row_begin = 0,
                .row_end = lay->rows[t],
            };
        }
        return 1;
    }
    int64_t c = lay->c[t];
    size_t n = 0;
    for (int64_t q = a / c; q <= (b - 1) / c; q++) {
        if (n < cap) {
            int64_t e = (q + 1) * c;
            out[n] = (mfsdp_ckpt_piece_t){
                .rank = (int)q,
                .kind = MFSDP_CKPT_OPTIM,
                .state = s,
                .row_begin = q * c,
                .row_end = e < lay->rows[t] ? e : lay->rows[t],
            };
        }
        n++;
    }
    return n;
}

/* ---- per-file metadata -------------------------------------------------------------------- */

void mfsdp_ckpt_file_meta_free(char **keys, char **vals, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(keys != NULL ? keys[i] : NULL);
        free(vals != NULL ? vals[i] : NULL);
    }
    free(keys);
    free(vals);
}

mfsdp_status_t mfsdp_ckpt_file_meta(const mfsdp_ckpt_layout_t *lay, const mfsdp_ckpt_meta_t *meta,
                                    mfsdp_ckpt_kind_t kind, int rank,
                                    const mfsdp_ckpt_item_t *items, size_t nitems, char ***keys_p,
                                    char ***vals_p, size_t *n_p)
{
    enum { NMETA = 7 };
    char **keys = calloc(NMETA, sizeof(char *));
    char **vals = calloc(NMETA, sizeof(char *));
    char *rows = NULL;
    json_t *r = NULL;
    size_t n = 0;
    if (keys == NULL || vals == NULL) {
        goto oom;
    }
    char buf[64];
#define META(k, v)                                                                                 \
    do {                                                                                           \
        keys[n] = strdup(k);                                                                       \
        vals[n] = strdup(v);                                                                       \
        n++;                                                                                       \
        if (keys[n - 1] == NULL || vals[n - 1] == NULL) {                                          \
            goto oom;                                                                              \
        }                                                                                          \
    } while (0)
    META("format", "pt"); /* what transformers expects of a PyTorch state-dict shard */
    META("mfsdp.format", MFSDP_CKPT_FORMAT);
    META("mfsdp.kind", mfsdp_ckpt_kind_name(kind));
    snprintf(buf, sizeof(buf), "%d", rank);
    META("mfsdp.rank", buf);
    snprintf(buf, sizeof(buf), "%d", lay->world);
    META("mfsdp.world_size", buf);
    snprintf(buf, sizeof(buf), "%" PRId64, meta->step);
    META("mfsdp.step", buf);
    if (kind == MFSDP_CKPT_OPTIM) {
        r = json_object();
        if (r == NULL) {
            goto oom;
        }
        for (size_t i = 0; i < nitems; i++) {
            json_t *a =
                json_pack("[II]", (json_int_t)items[i].row_begin, (json_int_t)items[i].row_end);
            if (a == NULL || json_object_set_new(r, items[i].key, a) != 0) {
                goto oom;
            }
        }
        rows = json_dumps(r, JSON_COMPACT);
        if (rows == NULL) {
            goto oom;
        }
        META("mfsdp.rows", rows);
    }
#undef META
    free(rows);
    json_decref(r);
    *keys_p = keys;
    *vals_p = vals;
    *n_p = n;
    return MFSDP_OK;
oom:
    free(rows);
    json_decref(r);
    mfsdp_ckpt_file_meta_free(keys, vals, n);
    return MFSDP_ERR_NO_MEMORY;
}

/* ---- index: writing ------------------------------------------------------------------------ */

static json_t *hparams_json(const mfsdp_hparams_t *hp)
{
    return json_pack("{s:f, s:f, s:b, s:i, s:f, s:s, s:f, s:f, s:f, s:f, s:f}", "lr", hp->lr,
                     "momentum", hp->momentum, "nesterov", hp->nesterov, "ns_steps", hp->ns_steps,
                     "weight_decay", hp->weight_decay, "scale",
                     hp->scale == MFSDP_SCALE_MOONLIGHT ? "moonlight" : "keller", "adamw_lr",
                     hp->adamw_lr, "adamw_beta1", hp->adamw_beta1, "adamw_beta2", hp->adamw_beta2,
                     "adamw_eps", hp->adamw_eps, "adamw_weight_decay", hp->adamw_weight_decay);
}

mfsdp_status_t mfsdp_ckpt_index_text(const mfsdp_ckpt_layout_t *lay, const mfsdp_ckpt_meta_t *meta,
                                     const mfsdp_ckpt_file_info_t *files, char **text_p,
                                     size_t *len_p)
{
    MFSDP_CHECK_ARG(lay != NULL && meta != NULL && files != NULL && text_p != NULL);
    MFSDP_CHECK_ARG(meta->ngroups == lay->manifest->ngroups && (unsigned)meta->tail <= 2);
    mfsdp_status_t st = MFSDP_ERR_NO_MEMORY;
    char *mtext = NULL, *rest = NULL, *text = NULL;
    json_t *root = json_object();
    json_t *wmap = json_object();
    json_t *mf = json_object();
    json_t *groups = json_array();
    json_t *tensors = json_array();
    json_t *jfiles = json_array();
    json_t *man = NULL;
    int bad = root == NULL || wmap == NULL || mf == NULL || groups == NULL || tensors == NULL ||
              jfiles == NULL;
    if (bad) {
        json_decref(wmap);
        json_decref(mf);
        json_decref(groups);
        json_decref(tensors);
        json_decref(jfiles);
        goto out;
    }
    st = mfsdp_manifest_to_json(lay->manifest, &mtext);
    if (st != MFSDP_OK) {
        json_decref(wmap);
        json_decref(mf);
        json_decref(groups);
        json_decref(tensors);
        json_decref(jfiles);
        goto out;
    }
    st = MFSDP_ERR_NO_MEMORY;
    json_error_t je;
    man = json_loads(mtext, JSON_REJECT_DUPLICATES, &je);
    uint64_t total = 0;
    char fname[MFSDP_CKPT_FILE_LEN];
    for (size_t t = 0; t < lay->ntensors; t++) {
        const mfsdp_param_desc_t *p = lay->params[t];
        total += (uint64_t)p->numel * mfsdp_dtype_size(p->dtype);
        mfsdp_ckpt_file_name(fname, sizeof(fname), MFSDP_CKPT_MODEL, lay->writer[t], lay->world);
        bad |= json_object_set_new(wmap, p->name, json_string(fname));
        json_t *owner = lay->owner[t] == MFSDP_OWNER_SHARDED ? json_string("sharded")
                                                             : json_integer(lay->owner[t]);
        int64_t ns = meta->tensor_nsteps != NULL ? meta->tensor_nsteps[t]
                                                 : meta->group_nsteps[lay->group[t]];
        bad |= json_array_append_new(tensors, json_pack("{s:s, s:o, s:i, s:I}", "name", p->name,
                                                        "owner", owner, "writer", lay->writer[t],
                                                        "nsteps", (json_int_t)ns));
    }
    for (size_t g = 0; g < meta->ngroups; g++) {
        bad |= json_array_append_new(groups,
                                     json_pack("{s:s, s:I}", "name", lay->manifest->groups[g].name,
                                               "nsteps", (json_int_t)meta->group_nsteps[g]));
    }
    for (size_t f = 0; f < 2 * (size_t)lay->world; f++) {
        bad |= json_array_append_new(
            jfiles, json_pack("{s:s, s:i, s:s, s:I, s:s}", "name", files[f].name, "rank",
                              files[f].rank, "kind", mfsdp_ckpt_kind_name(files[f].kind), "bytes",
                              (json_int_t)files[f].bytes, "sha256", files[f].sha256));
    }
    bad |= man == NULL;
    bad |= json_object_set_new(mf, "format", json_string(MFSDP_CKPT_FORMAT));
    bad |= json_object_set_new(mf, "world_size", json_integer(lay->world));
    bad |= json_object_set_new(mf, "step", json_integer((json_int_t)meta->step));
    bad |= json_object_set_new(mf, "ctx_steps", json_integer((json_int_t)meta->ctx_steps));
    bad |= json_object_set_new(mf, "tail", json_string(tail_names[meta->tail]));
    bad |= json_object_set_new(mf, "hparams", hparams_json(&meta->hp));
    bad |= json_object_set_new(mf, "groups", groups);
    bad |= json_object_set_new(mf, "tensors", tensors);
    bad |= json_object_set_new(mf, "files", jfiles);
    bad |= json_object_set_new(mf, "manifest", man);
    bad |= json_object_set_new(
        root, "metadata",
        json_pack("{s:I, s:s}", "total_size", (json_int_t)total, "format", MFSDP_CKPT_FORMAT));
    bad |= json_object_set_new(root, "weight_map", wmap);
    bad |= json_object_set_new(root, "mfsdp", mf);
    if (bad) {
        goto out;
    }
    rest = json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(17));
    if (rest == NULL || rest[0] != '{') {
        goto out;
    }
    /* {"index_sha256": "<hex>", then everything after the first '{' of rest and a newline;
     * the digest covers exactly that tail. */
    size_t rlen = strlen(rest) - 1;
    text = malloc(IDX_HEAD_LEN + rlen + 2);
    if (text == NULL) {
        goto out;
    }
    memcpy(text + IDX_HEAD_LEN, rest + 1, rlen);
    text[IDX_HEAD_LEN + rlen] = '\n';
    text[IDX_HEAD_LEN + rlen + 1] = '\0';
    char hex[MFSDP_SHA256_HEX];
    MFSDP_CHECK_GOTO(mfsdp_sha256_buf(text + IDX_HEAD_LEN, rlen + 1, hex), st, out);
    st = MFSDP_ERR_NO_MEMORY;
    memcpy(text, IDX_PREFIX, IDX_PREFIX_LEN);
    memcpy(text + IDX_PREFIX_LEN, hex, 64);
    memcpy(text + IDX_PREFIX_LEN + 64, "\",", 2);
    *text_p = text;
    if (len_p != NULL) {
        *len_p = IDX_HEAD_LEN + rlen + 1;
    }
    text = NULL;
    st = MFSDP_OK;
out:
    free(text);
    free(rest);
    free(mtext);
    json_decref(root);
    return st;
}

/* ---- index: reading ------------------------------------------------------------------------ */

typedef struct iparse {
    const char *origin;
    char *err;
    size_t errlen;
} iparse_t;

/* Messages are one line: control characters (from file contents) become '?'. */
static void oneline(char *msg)
{
    for (char *c = msg; *c != '\0'; c++) {
        if ((unsigned char)*c < 0x20 || *c == 0x7f) {
            *c = '?';
        }
    }
}

static mfsdp_status_t ifail(const iparse_t *p, mfsdp_status_t st, const char *path, const char *fmt,
                            ...) __attribute__((format(printf, 4, 5)));

static mfsdp_status_t ifail(const iparse_t *p, mfsdp_status_t st, const char *path, const char *fmt,
                            ...)
{
    char msg[MSG_LEN], line[MSG_LEN + PATH_LEN + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    snprintf(line, sizeof(line), "%.255s: %s%s%s", p->origin, path, path[0] != '\0' ? ": " : "",
             msg);
    oneline(line);
    MFSDP_WARN("%s", line);
    if (p->err != NULL && p->errlen > 0) {
        snprintf(p->err, p->errlen, "%s", line);
    }
    return st;
}

/* Exactly the keys in `keys` (NULL-terminated), all present. */
static mfsdp_status_t want_keys(const iparse_t *p, json_t *o, const char *path,
                                const char *const *keys)
{
    if (!json_is_object(o)) {
        return ifail(p, MFSDP_ERR_PARSE, path, "expected an object");
    }
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v)
    {
        int known = 0;
        for (size_t i = 0; keys[i] != NULL; i++) {
            known |= strcmp(k, keys[i]) == 0;
        }
        if (!known) {
            char kk[48];
            snprintf(kk, sizeof(kk), "%s", k);
            return ifail(p, MFSDP_ERR_PARSE, path, "unknown key '%s'", kk);
        }
    }
    for (size_t i = 0; keys[i] != NULL; i++) {
        if (json_object_get(o, keys[i]) == NULL) {
            return ifail(p, MFSDP_ERR_PARSE, path, "missing key '%s'", keys[i]);
        }
    }
    return MFSDP_OK;
}

static mfsdp_status_t want_int(const iparse_t *p, json_t *v, const char *path, json_int_t lo,
                               json_int_t hi, json_int_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        return ifail(p, MFSDP_ERR_PARSE, path, "expected an integer in [%lld, %lld]", (long long)lo,
                     (long long)hi);
    }
    *out = json_integer_value(v);
    return MFSDP_OK;
}

static mfsdp_status_t want_str(const iparse_t *p, json_t *v, const char *path, const char **out)
{
    if (!json_is_string(v)) {
        return ifail(p, MFSDP_ERR_PARSE, path, "expected a string");
    }
    *out = json_string_value(v);
    return MFSDP_OK;
}

static mfsdp_status_t want_num(const iparse_t *p, json_t *v, const char *path, double *out)
{
    if (!json_is_number(v)) {
        return ifail(p, MFSDP_ERR_PARSE, path, "expected a number");
    }
    *out = json_number_value(v);
    return MFSDP_OK;
}

static mfsdp_status_t parse_hparams(const iparse_t *p, json_t *o, mfsdp_hparams_t *hp)
{
    static const char *const keys[] = {
        "lr",       "momentum",    "nesterov",    "ns_steps",  "weight_decay",       "scale",
        "adamw_lr", "adamw_beta1", "adamw_beta2", "adamw_eps", "adamw_weight_decay", NULL};
    MFSDP_CHECK(want_keys(p, o, "mfsdp.hparams", keys));
    const char *scale = "";
    json_int_t ns;
    json_t *nest = json_object_get(o, "nesterov");
    if (!json_is_boolean(nest)) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.hparams.nesterov", "expected true or false");
    }
    hp->nesterov = json_is_true(nest);
    MFSDP_CHECK(want_num(p, json_object_get(o, "lr"), "mfsdp.hparams.lr", &hp->lr));
    MFSDP_CHECK(
        want_num(p, json_object_get(o, "momentum"), "mfsdp.hparams.momentum", &hp->momentum));
    MFSDP_CHECK(
        want_int(p, json_object_get(o, "ns_steps"), "mfsdp.hparams.ns_steps", 0, 1000, &ns));
    hp->ns_steps = (int)ns;
    MFSDP_CHECK(want_num(p, json_object_get(o, "weight_decay"), "mfsdp.hparams.weight_decay",
                         &hp->weight_decay));
    MFSDP_CHECK(want_str(p, json_object_get(o, "scale"), "mfsdp.hparams.scale", &scale));
    if (strcmp(scale, "keller") != 0 && strcmp(scale, "moonlight") != 0) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.hparams.scale", "expected keller or moonlight");
    }
    hp->scale = scale[0] == 'm' ? MFSDP_SCALE_MOONLIGHT : MFSDP_SCALE_KELLER;
    MFSDP_CHECK(
        want_num(p, json_object_get(o, "adamw_lr"), "mfsdp.hparams.adamw_lr", &hp->adamw_lr));
    MFSDP_CHECK(want_num(p, json_object_get(o, "adamw_beta1"), "mfsdp.hparams.adamw_beta1",
                         &hp->adamw_beta1));
    MFSDP_CHECK(want_num(p, json_object_get(o, "adamw_beta2"), "mfsdp.hparams.adamw_beta2",
                         &hp->adamw_beta2));
    MFSDP_CHECK(
        want_num(p, json_object_get(o, "adamw_eps"), "mfsdp.hparams.adamw_eps", &hp->adamw_eps));
    MFSDP_CHECK(want_num(p, json_object_get(o, "adamw_weight_decay"),
                         "mfsdp.hparams.adamw_weight_decay", &hp->adamw_weight_decay));
    return MFSDP_OK;
}

void mfsdp_ckpt_meta_clear(mfsdp_ckpt_meta_t *meta)
{
    if (meta != NULL) {
        free(meta->group_nsteps);
        meta->group_nsteps = NULL;
        free(meta->tensor_nsteps);
        meta->tensor_nsteps = NULL;
        meta->ngroups = 0;
    }
}

void mfsdp_ckpt_index_free(mfsdp_ckpt_index_t *idx)
{
    if (idx == NULL) {
        return;
    }
    mfsdp_ckpt_layout_destroy(idx->layout);
    mfsdp_manifest_free(idx->manifest);
    mfsdp_ckpt_meta_clear(&idx->meta);
    free(idx->files);
    free(idx);
}

static mfsdp_status_t parse_self_digest(const iparse_t *p, const char *text, size_t len,
                                        char hex[MFSDP_SHA256_HEX])
{
    if (len < IDX_HEAD_LEN || memcmp(text, IDX_PREFIX, IDX_PREFIX_LEN) != 0 ||
        memcmp(text + IDX_PREFIX_LEN + 64, "\",", 2) != 0) {
        return ifail(p, MFSDP_ERR_PARSE, "",
                     "not an mfsdp checkpoint index (it must start with "
                     "{\"index_sha256\": \"<64 hex digits>\",)");
    }
    memcpy(hex, text + IDX_PREFIX_LEN, 64);
    hex[64] = '\0';
    if (!mfsdp_sha256_is_hex(hex)) {
        return ifail(p, MFSDP_ERR_PARSE, "index_sha256", "not 64 lowercase hex digits");
    }
    char got[MFSDP_SHA256_HEX];
    MFSDP_CHECK(mfsdp_sha256_buf(text + IDX_HEAD_LEN, len - IDX_HEAD_LEN, got));
    if (strcmp(got, hex) != 0) {
        return ifail(p, MFSDP_ERR_CHECKSUM, "index_sha256",
                     "the index was modified or damaged: its content hashes to %.16s..., the "
                     "index says %.16s...",
                     got, hex);
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_tensors(const iparse_t *p, json_t *arr, const mfsdp_manifest_t *m,
                                    int world, const int64_t *group_nsteps, int *owner, int *writer,
                                    int64_t *nsteps)
{
    char path[PATH_LEN];
    size_t t = 0;
    if (!json_is_array(arr)) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.tensors", "expected an array");
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        for (size_t i = 0; i < m->groups[g].nparams; i++, t++) {
            const mfsdp_param_desc_t *pd = &m->groups[g].params[i];
            static const char *const keys[] = {"name", "owner", "writer", "nsteps", NULL};
            snprintf(path, sizeof(path), "mfsdp.tensors[%zu]", t);
            json_t *o = json_array_get(arr, t);
            if (o == NULL) {
                return ifail(p, MFSDP_ERR_PARSE, "mfsdp.tensors",
                             "has %zu entries, the manifest has more params (next: %s)",
                             json_array_size(arr), pd->name);
            }
            MFSDP_CHECK(want_keys(p, o, path, keys));
            const char *name = "";
            MFSDP_CHECK(want_str(p, json_object_get(o, "name"), path, &name));
            if (strcmp(name, pd->name) != 0) {
                return ifail(p, MFSDP_ERR_PARSE, path,
                             "names tensor '%.64s' where the manifest has '%.64s'", name, pd->name);
            }
            json_t *ow = json_object_get(o, "owner");
            json_int_t v;
            if (json_is_string(ow) && strcmp(json_string_value(ow), "sharded") == 0) {
                owner[t] = MFSDP_OWNER_SHARDED;
            } else {
                snprintf(path, sizeof(path), "mfsdp.tensors[%zu].owner", t);
                MFSDP_CHECK(want_int(p, ow, path, 0, world - 1, &v));
                owner[t] = (int)v;
            }
            snprintf(path, sizeof(path), "mfsdp.tensors[%zu].writer", t);
            MFSDP_CHECK(want_int(p, json_object_get(o, "writer"), path, 0, world - 1, &v));
            writer[t] = (int)v;
            snprintf(path, sizeof(path), "mfsdp.tensors[%zu].nsteps", t);
            MFSDP_CHECK(want_int(p, json_object_get(o, "nsteps"), path, 0, group_nsteps[g], &v));
            nsteps[t] = (int64_t)v;
            if ((owner[t] >= 0 && writer[t] != owner[t]) ||
                (owner[t] < 0 && pd->optimizer != MFSDP_ROLE_ADAMW)) {
                return ifail(p, MFSDP_ERR_PARSE, path,
                             "tensor '%.64s': owner and writer disagree, or a muon tensor is "
                             "'sharded'",
                             pd->name);
            }
        }
    }
    if (json_array_size(arr) != t) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.tensors",
                     "has %zu entries, the manifest has %zu params", json_array_size(arr), t);
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_files(const iparse_t *p, json_t *arr, mfsdp_ckpt_index_t *idx)
{
    int world = idx->layout->world;
    char path[PATH_LEN];
    if (!json_is_array(arr) || json_array_size(arr) != 2 * (size_t)world) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.files",
                     "expected an array of %d entries (a model and an optim file per rank)",
                     2 * world);
    }
    idx->nfiles = 2 * (size_t)world;
    idx->files = calloc(idx->nfiles, sizeof(*idx->files));
    if (idx->files == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t f = 0; f < idx->nfiles; f++) {
        static const char *const keys[] = {"name", "rank", "kind", "bytes", "sha256", NULL};
        mfsdp_ckpt_file_info_t *fi = &idx->files[f];
        fi->kind = f < (size_t)world ? MFSDP_CKPT_MODEL : MFSDP_CKPT_OPTIM;
        fi->rank = (int)(f % (size_t)world);
        mfsdp_ckpt_file_name(fi->name, sizeof(fi->name), fi->kind, fi->rank, world);
        snprintf(path, sizeof(path), "mfsdp.files[%zu]", f);
        json_t *o = json_array_get(arr, f);
        MFSDP_CHECK(want_keys(p, o, path, keys));
        const char *name = "", *kind = "", *sha = "";
        json_int_t rank, bytes;
        MFSDP_CHECK(want_str(p, json_object_get(o, "name"), path, &name));
        MFSDP_CHECK(want_str(p, json_object_get(o, "kind"), path, &kind));
        MFSDP_CHECK(want_str(p, json_object_get(o, "sha256"), path, &sha));
        MFSDP_CHECK(want_int(p, json_object_get(o, "rank"), path, 0, world - 1, &rank));
        MFSDP_CHECK(want_int(p, json_object_get(o, "bytes"), path, 8, INT64_MAX, &bytes));
        if (strcmp(name, fi->name) != 0 || (int)rank != fi->rank ||
            strcmp(kind, mfsdp_ckpt_kind_name(fi->kind)) != 0) {
            return ifail(p, MFSDP_ERR_PARSE, path,
                         "expected %s (rank %d, kind %s), found '%.64s' (rank %lld, kind %.16s)",
                         fi->name, fi->rank, mfsdp_ckpt_kind_name(fi->kind), name, (long long)rank,
                         kind);
        }
        if (!mfsdp_sha256_is_hex(sha)) {
            return ifail(p, MFSDP_ERR_PARSE, path, "sha256 is not 64 lowercase hex digits");
        }
        memcpy(fi->sha256, sha, MFSDP_SHA256_HEX);
        fi->bytes = (uint64_t)bytes;
    }
    return MFSDP_OK;
}

static mfsdp_status_t parse_root(const iparse_t *p, json_t *root, const char *hex,
                                 mfsdp_ckpt_index_t *idx)
{
    static const char *const top[] = {"index_sha256", "metadata", "weight_map", "mfsdp", NULL};
    static const char *const mkeys[] = {"format", "world_size", "step",   "ctx_steps",
                                        "tail",   "hparams",    "groups", "tensors",
                                        "files",  "manifest",   NULL};
    static const char *const meta_keys[] = {"total_size", "format", NULL};
    MFSDP_CHECK(want_keys(p, root, "", top));
    if (!json_is_string(json_object_get(root, "index_sha256")) ||
        strcmp(json_string_value(json_object_get(root, "index_sha256")), hex) != 0) {
        return ifail(p, MFSDP_ERR_PARSE, "index_sha256", "does not match the text's prefix");
    }
    json_t *mf = json_object_get(root, "mfsdp");
    MFSDP_CHECK(want_keys(p, mf, "mfsdp", mkeys));
    const char *s = "";
    MFSDP_CHECK(want_str(p, json_object_get(mf, "format"), "mfsdp.format", &s));
    if (strcmp(s, MFSDP_CKPT_FORMAT) != 0) {
        return ifail(p, MFSDP_ERR_UNSUPPORTED, "mfsdp.format",
                     "format '%.32s' is not the one this version reads (" MFSDP_CKPT_FORMAT ")", s);
    }
    json_int_t world, step, ctx_steps;
    MFSDP_CHECK(
        want_int(p, json_object_get(mf, "world_size"), "mfsdp.world_size", 1, 1 << 20, &world));
    MFSDP_CHECK(want_int(p, json_object_get(mf, "step"), "mfsdp.step", 0, INT64_MAX, &step));
    MFSDP_CHECK(
        want_int(p, json_object_get(mf, "ctx_steps"), "mfsdp.ctx_steps", 0, INT64_MAX, &ctx_steps));
    idx->meta.step = step;
    idx->meta.ctx_steps = (uint64_t)ctx_steps;
    MFSDP_CHECK(want_str(p, json_object_get(mf, "tail"), "mfsdp.tail", &s));
    int tail = -1;
    for (int i = 0; i < 3; i++) {
        tail = strcmp(s, tail_names[i]) == 0 ? i : tail;
    }
    if (tail < 0) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.tail", "expected owner, shard or auto");
    }
    idx->meta.tail = (mfsdp_tail_policy_t)tail;
    MFSDP_CHECK(parse_hparams(p, json_object_get(mf, "hparams"), &idx->meta.hp));

    /* The manifest, through its own strict parser. */
    char *mtext = json_dumps(json_object_get(mf, "manifest"), JSON_COMPACT);
    if (mtext == NULL || !json_is_object(json_object_get(mf, "manifest"))) {
        free(mtext);
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.manifest", "expected an mfsdp-manifest/1 object");
    }
    char merr[MSG_LEN];
    mfsdp_status_t st =
        mfsdp_manifest_parse(mtext, strlen(mtext), "manifest", merr, sizeof(merr), &idx->manifest);
    free(mtext);
    if (st != MFSDP_OK) {
        return ifail(p, st, "mfsdp.manifest", "%s", merr);
    }
    const mfsdp_manifest_t *m = idx->manifest;
    if (m->world_size != 0 && m->world_size != world) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.manifest.world_size",
                     "%d, but the checkpoint's world size is %lld", m->world_size,
                     (long long)world);
    }

    /* Groups and their step counters. */
    json_t *groups = json_object_get(mf, "groups");
    if (!json_is_array(groups) || json_array_size(groups) != m->ngroups) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.groups", "expected an array of %zu groups",
                     m->ngroups);
    }
    idx->meta.ngroups = m->ngroups;
    idx->meta.group_nsteps = calloc(m->ngroups + 1, sizeof(int64_t));
    if (idx->meta.group_nsteps == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    int64_t max_steps = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        static const char *const gkeys[] = {"name", "nsteps", NULL};
        char path[PATH_LEN];
        snprintf(path, sizeof(path), "mfsdp.groups[%zu]", g);
        json_t *o = json_array_get(groups, g);
        MFSDP_CHECK(want_keys(p, o, path, gkeys));
        MFSDP_CHECK(want_str(p, json_object_get(o, "name"), path, &s));
        if (strcmp(s, m->groups[g].name) != 0) {
            return ifail(p, MFSDP_ERR_PARSE, path, "group '%.64s', the manifest has '%.64s'", s,
                         m->groups[g].name);
        }
        json_int_t ns;
        MFSDP_CHECK(want_int(p, json_object_get(o, "nsteps"), path, 0, INT64_MAX, &ns));
        idx->meta.group_nsteps[g] = ns;
        max_steps = ns > max_steps ? ns : max_steps;
    }
    if (max_steps != idx->meta.step) {
        return ifail(p, MFSDP_ERR_PARSE, "mfsdp.step",
                     "%lld, but the largest group step count is %lld", (long long)step,
                     (long long)max_steps);
    }

    /* Owners and writers, then the layout they imply. */
    size_t nt = 0;
    for (size_t g = 0; g < m->ngroups; g++) {
        nt += m->groups[g].nparams;
    }
    int *owner = calloc(nt + 1, sizeof(int));
    int *writer = calloc(nt + 1, sizeof(int));
    idx->meta.tensor_nsteps = calloc(nt + 1, sizeof(int64_t));
    if (owner == NULL || writer == NULL || idx->meta.tensor_nsteps == NULL) {
        free(owner);
        free(writer);
        return MFSDP_ERR_NO_MEMORY;
    }
    st = parse_tensors(p, json_object_get(mf, "tensors"), m, (int)world, idx->meta.group_nsteps,
                       owner, writer, idx->meta.tensor_nsteps);
    if (st == MFSDP_OK) {
        st = mfsdp_ckpt_layout_create(m, (int)world, owner, writer, &idx->layout);
    }
    free(owner);
    free(writer);
    MFSDP_CHECK(st);
    MFSDP_CHECK(parse_files(p, json_object_get(mf, "files"), idx));

    /* The Hugging Face view must say the same. */
    json_t *hm = json_object_get(root, "metadata");
    MFSDP_CHECK(want_keys(p, hm, "metadata", meta_keys));
    json_t *wmap = json_object_get(root, "weight_map");
    if (!json_is_object(wmap) || json_object_size(wmap) != nt) {
        return ifail(p, MFSDP_ERR_PARSE, "weight_map", "expected an object of %zu names", nt);
    }
    uint64_t total = 0;
    for (size_t t = 0; t < nt; t++) {
        const mfsdp_param_desc_t *pd = idx->layout->params[t];
        total += (uint64_t)pd->numel * mfsdp_dtype_size(pd->dtype);
        json_t *f = json_object_get(wmap, pd->name);
        const char *want =
            idx->files[mfsdp_ckpt_file_slot((int)world, MFSDP_CKPT_MODEL, idx->layout->writer[t])]
                .name;
        if (!json_is_string(f) || strcmp(json_string_value(f), want) != 0) {
            return ifail(p, MFSDP_ERR_PARSE, "weight_map",
                         "tensor '%.64s' must map to %s (its writer's model file)", pd->name, want);
        }
    }
    json_int_t ts;
    MFSDP_CHECK(
        want_int(p, json_object_get(hm, "total_size"), "metadata.total_size", 0, INT64_MAX, &ts));
    MFSDP_CHECK(want_str(p, json_object_get(hm, "format"), "metadata.format", &s));
    if ((uint64_t)ts != total || strcmp(s, MFSDP_CKPT_FORMAT) != 0) {
        return ifail(p, MFSDP_ERR_PARSE, "metadata",
                     "total_size %lld / format '%.32s' disagree with the tensors (%llu "
                     "bytes, " MFSDP_CKPT_FORMAT ")",
                     (long long)ts, s, (unsigned long long)total);
    }
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_ckpt_index_parse(const char *text, size_t len, const char *origin, char *err,
                                      size_t errlen, mfsdp_ckpt_index_t **index_p)
{
    MFSDP_CHECK_ARG((text != NULL || len == 0) && index_p != NULL);
    iparse_t p = {origin != NULL ? origin : "checkpoint index", err, errlen};
    char hex[MFSDP_SHA256_HEX];
    MFSDP_CHECK(parse_self_digest(&p, text, len, hex));
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        char where[64];
        snprintf(where, sizeof(where), "line %d, column %d", je.line, je.column);
        return ifail(&p, MFSDP_ERR_PARSE, where, "not valid JSON: %s", je.text);
    }
    mfsdp_ckpt_index_t *idx = calloc(1, sizeof(*idx));
    mfsdp_status_t st = MFSDP_ERR_NO_MEMORY;
    if (idx != NULL) {
        memcpy(idx->index_sha256, hex, MFSDP_SHA256_HEX);
        st = parse_root(&p, root, hex, idx);
    }
    json_decref(root);
    if (st != MFSDP_OK) {
        mfsdp_ckpt_index_free(idx);
        return st;
    }
    *index_p = idx;
    return MFSDP_OK;
}
