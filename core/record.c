/* SPDX-License-Identifier: Apache-2.0 */
#include "core/record.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

mfsdp_status_t mfsdp_record_comm_append(mfsdp_record_comm_t *rc, const mfsdp_call_sig_t *sig,
                                        const char *op, size_t max)
{
    MFSDP_CHECK_ARG(rc != NULL && sig != NULL);
    if (max == 0) {
        max = MFSDP_RECORD_DEFAULT_MAX;
    }
    if (rc->ncalls >= max) {
        return MFSDP_ERR_OVERFLOW;
    }
    if (rc->ncalls >= rc->capacity) {
        size_t cap = rc->capacity ? 2 * rc->capacity : 64;
        if (cap > max) {
            cap = max;
        }
        mfsdp_record_call_t *n = realloc(rc->calls, cap * sizeof(*n));
        if (n == NULL) {
            return MFSDP_ERR_NO_MEMORY;
        }
        rc->calls = n;
        rc->capacity = cap;
    }
    mfsdp_record_call_t *r = &rc->calls[rc->ncalls++];
    r->sig = *sig;
    snprintf(r->op, sizeof(r->op), "%s", op != NULL ? op : "none");
    return MFSDP_OK;
}

static const char *kind_name(mfsdp_call_kind_t k)
{
    return k == MFSDP_CALL_ALLGATHER ? "allgather" : "reduce_scatter";
}

mfsdp_status_t mfsdp_record_write(const mfsdp_record_t *rec, FILE *out)
{
    MFSDP_CHECK_ARG(rec != NULL && out != NULL);
    fprintf(out, "{\"format\": \"mfsdp-record/1\", \"comms\": [");
    for (size_t c = 0; c < rec->ncomms; c++) {
        const mfsdp_record_comm_t *rc = &rec->comms[c];
        fprintf(out, "%s\n  {\"size\": %d, \"calls\": [", c ? "," : "", rc->size);
        for (size_t i = 0; i < rc->ncalls; i++) {
            const mfsdp_record_call_t *k = &rc->calls[i];
            fprintf(out, "%s\n    [\"%s\", %zu, \"%s\", \"%s\"]", i ? "," : "",
                    kind_name(k->sig.kind), k->sig.count, mfsdp_dtype_name(k->sig.dtype), k->op);
        }
        fprintf(out, "]}");
    }
    fprintf(out, "\n]}\n");
    return ferror(out) ? MFSDP_ERR_IO : MFSDP_OK;
}

void mfsdp_record_free(mfsdp_record_t *rec)
{
    if (rec == NULL) {
        return;
    }
    for (size_t c = 0; c < rec->ncomms; c++) {
        free(rec->comms[c].calls);
    }
    free(rec->comms);
    free(rec);
}

static mfsdp_status_t parse_call(json_t *jc, const char *path, size_t c, size_t i,
                                 mfsdp_record_call_t *out, char *err, size_t errlen)
{
    json_t *jk = json_array_get(jc, 0), *jn = json_array_get(jc, 1);
    json_t *jd = json_array_get(jc, 2), *jo = json_array_get(jc, 3);
    if (!json_is_array(jc) || json_array_size(jc) != 4 || !json_is_string(jk) ||
        !json_is_integer(jn) || !json_is_string(jd) || !json_is_string(jo) ||
        json_integer_value(jn) < 0) {
        SETERR("%s: comms[%zu].calls[%zu]: expected [kind, count >= 0, dtype, op]", path, c, i);
        return MFSDP_ERR_PARSE;
    }
    const char *k = json_string_value(jk);
    if (strcmp(k, "allgather") == 0) {
        out->sig.kind = MFSDP_CALL_ALLGATHER;
    } else if (strcmp(k, "reduce_scatter") == 0) {
        out->sig.kind = MFSDP_CALL_REDUCE_SCATTER;
    } else {
        SETERR("%s: comms[%zu].calls[%zu][0]: expected \"allgather\" or \"reduce_scatter\"", path,
               c, i);
        return MFSDP_ERR_PARSE;
    }
    out->sig.count = (size_t)json_integer_value(jn);
    if (mfsdp_dtype_parse(json_string_value(jd), &out->sig.dtype) != MFSDP_OK) {
        SETERR("%s: comms[%zu].calls[%zu][2]: unknown dtype \"%s\"", path, c, i,
               json_string_value(jd));
        return MFSDP_ERR_PARSE;
    }
    snprintf(out->op, sizeof(out->op), "%s", json_string_value(jo));
    return MFSDP_OK;
}

mfsdp_status_t mfsdp_record_load(const char *path, char *err, size_t errlen, mfsdp_record_t **rec_p)
{
    MFSDP_CHECK_ARG(path != NULL && rec_p != NULL);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        SETERR("%s: line %d column %d: %s", path, jerr.line, jerr.column, jerr.text);
        return jerr.line <= 0 && jerr.position == 0 ? MFSDP_ERR_IO : MFSDP_ERR_PARSE;
    }
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_record_t *rec = calloc(1, sizeof(*rec));
    json_t *fmt = json_object_get(root, "format");
    json_t *comms = json_object_get(root, "comms");
    if (rec == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    if (!json_is_string(fmt) || strcmp(json_string_value(fmt), "mfsdp-record/1") != 0) {
        SETERR("%s: format: expected \"mfsdp-record/1\"", path);
        st = MFSDP_ERR_PARSE;
        goto out;
    }
    if (!json_is_array(comms)) {
        SETERR("%s: comms: expected an array", path);
        st = MFSDP_ERR_PARSE;
        goto out;
    }
    rec->ncomms = json_array_size(comms);
    rec->comms = calloc(rec->ncomms + 1, sizeof(*rec->comms));
    if (rec->comms == NULL) {
        st = MFSDP_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t c = 0; c < rec->ncomms; c++) {
        json_t *jc = json_array_get(comms, c);
        json_t *size = json_object_get(jc, "size");
        json_t *calls = json_object_get(jc, "calls");
        if (!json_is_integer(size) || json_integer_value(size) < 1 ||
            json_integer_value(size) > (1 << 24) || !json_is_array(calls)) {
            SETERR("%s: comms[%zu]: expected {\"size\": n >= 1, \"calls\": [...]}", path, c);
            st = MFSDP_ERR_PARSE;
            goto out;
        }
        mfsdp_record_comm_t *rc = &rec->comms[c];
        rc->size = (int)json_integer_value(size);
        rc->ncalls = json_array_size(calls);
        rc->calls = calloc(rc->ncalls + 1, sizeof(*rc->calls));
        if (rc->calls == NULL) {
            st = MFSDP_ERR_NO_MEMORY;
            goto out;
        }
        rc->capacity = rc->ncalls + 1;
        for (size_t i = 0; i < rc->ncalls; i++) {
            st = parse_call(json_array_get(calls, i), path, c, i, &rc->calls[i], err, errlen);
            if (st != MFSDP_OK) {
                goto out;
            }
        }
    }
    *rec_p = rec;
    rec = NULL;
out:
    mfsdp_record_free(rec);
    json_decref(root);
    return st;
}
