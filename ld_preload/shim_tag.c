/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Tagged mode (include/mfsdp/shim.h): the API the PyTorch companion calls through ctypes.
 * A registration holds a manifest built from FSDP2's own groups; a thread-local tag names the
 * group and phase of the next collective the thread issues, so that identification is exact.
 * The calls themselves are executed by shim_dispatch() (shim.c).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "ld_preload/shim.h"
#include "mfsdp/shim.h"

#define SHIM_EXPORT __attribute__((visibility("default")))
#define MAX_REGS    64
#define MAX_PARAMS  4096

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static shim_reg_t *regs[MAX_REGS];
static int nregs;
static __thread shim_tag_t tls_tag;
static __thread char tls_err[1024];

void shim_tag_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
}

static int fail(mfsdp_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(mfsdp_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
    return (int)st;
}

shim_reg_t *shim_reg_find(int id)
{
    pthread_mutex_lock(&reg_lock);
    shim_reg_t *r = id >= 0 && id < nregs ? regs[id] : NULL;
    pthread_mutex_unlock(&reg_lock);
    return r;
}

void shim_reg_unbind(shim_comm_t *c)
{
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < nregs; i++) {
        if (regs[i]->comm == c) {
            regs[i]->comm = NULL;
            regs[i]->spent |= c->remapped_ag + c->remapped_rs > 0;
        }
    }
    pthread_mutex_unlock(&reg_lock);
}

int shim_tag_take(shim_tag_t *tag_p)
{
    if (!tls_tag.set) {
        return 0;
    }
    *tag_p = tls_tag;
    tls_tag.set = 0;
    return 1;
}

SHIM_EXPORT int mfsdp_shim_abi_version(void)
{
    return MFSDP_SHIM_ABI_VERSION;
}

SHIM_EXPORT const char *mfsdp_shim_last_error(void)
{
    return tls_err;
}

SHIM_EXPORT int mfsdp_shim_register(const char *json, size_t len)
{
    tls_err[0] = '\0';
    if (json == NULL) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_register: null manifest");
    }
    if (shim_init() != MFSDP_OK || shim_config() == NULL) {
        return fail(MFSDP_ERR_CONFIG, "the shim's MFSDP_* configuration is bad: %s",
                    shim_init_error());
    }
    char err[1024];
    mfsdp_manifest_t *m = NULL;
    mfsdp_status_t st =
        mfsdp_manifest_parse(json, len, "registered manifest", err, sizeof(err), &m);
    if (st != MFSDP_OK) {
        return fail(st, "%s", err);
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        if (m->groups[g].nparams > MAX_PARAMS) {
            fail(MFSDP_ERR_UNSUPPORTED, "group %s has %zu params; tagged mode takes at most %d",
                 m->groups[g].name, m->groups[g].nparams, MAX_PARAMS);
            mfsdp_manifest_free(m);
            return MFSDP_ERR_UNSUPPORTED;
        }
    }
    shim_reg_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        mfsdp_manifest_free(m);
        return fail(MFSDP_ERR_NO_MEMORY, "out of memory");
    }
    st = mfsdp_settings_resolve(m, shim_config(), &r->settings, err, sizeof(err));
    if (st != MFSDP_OK) {
        free(r);
        mfsdp_manifest_free(m);
        return fail(st, "%s", err);
    }
    r->manifest = m;
    pthread_mutex_lock(&reg_lock);
    int id = nregs < MAX_REGS ? nregs : -1;
    if (id >= 0) {
        r->id = id;
        regs[nregs++] = r;
    }
    pthread_mutex_unlock(&reg_lock);
    if (id < 0) {
        free(r);
        mfsdp_manifest_free(m);
        return fail(MFSDP_ERR_UNSUPPORTED, "more than %d manifests registered", MAX_REGS);
    }
    MFSDP_INFO(SHIM, "registered manifest %d: %zu groups", id, m->ngroups);
    return id;
}

SHIM_EXPORT int mfsdp_shim_tag(int id, int kind, size_t group, const unsigned char *has_grad,
                               size_t nparams)
{
    shim_reg_t *r = shim_reg_find(id);
    if (r == NULL) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_tag: no manifest registered as %d", id);
    }
    if (kind < MFSDP_SHIM_TAG_ALLGATHER || kind > MFSDP_SHIM_TAG_LOAD_MOMENTUM) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_tag: unknown kind %d", kind);
    }
    if (group >= r->manifest->ngroups) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_tag: group %zu of a manifest of %zu", group,
                    r->manifest->ngroups);
    }
    const mfsdp_group_desc_t *gd = &r->manifest->groups[group];
    if (nparams != gd->nparams) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_tag: group %s has %zu params, not %zu",
                    gd->name, gd->nparams, nparams);
    }
    shim_tag_t t = {.set = 1, .id = id, .kind = kind, .group = group, .nparams = nparams};
    if (kind == MFSDP_SHIM_TAG_REDUCE_SCATTER && has_grad != NULL) {
        for (size_t i = 0; i < nparams; i++) {
            if (has_grad[i] > 1 || (has_grad[i] && !gd->params[i].requires_grad)) {
                return fail(MFSDP_ERR_INVALID_ARG,
                            "mfsdp_shim_tag: param %s of group %s flagged with a gradient %s",
                            gd->params[i].name, gd->name,
                            has_grad[i] > 1 ? "by a value other than 0 or 1"
                                            : "but the manifest says it requires none");
            }
        }
        memcpy(t.mask, has_grad, nparams);
        t.has_mask = 1;
    }
    tls_tag = t;
    return 0;
}

SHIM_EXPORT int mfsdp_shim_untag(void)
{
    tls_tag.set = 0;
    return 0;
}

SHIM_EXPORT int mfsdp_shim_tag_pending(void)
{
    return tls_tag.set ? 1 : 0;
}

/* The bound context of registration id, locked; NULL (and *rc_p = 0) when not bound yet. */
static shim_comm_t *bound(int id, int *rc_p)
{
    shim_reg_t *r = shim_reg_find(id);
    *rc_p = 0;
    if (r == NULL) {
        *rc_p = fail(MFSDP_ERR_INVALID_ARG, "no manifest registered as %d", id);
        return NULL;
    }
    shim_comm_t *c = r->comm;
    if (c == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    if (c->failed) {
        *rc_p = fail(c->fail_status, "%s", c->why);
    } else if (c->ctx != NULL) {
        return c;
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

SHIM_EXPORT int mfsdp_shim_step(int id, double lr_factor)
{
    int rc;
    shim_comm_t *c = bound(id, &rc);
    if (c == NULL) {
        return rc;
    }
    char msg[1024] = "";
    shim_inside = 1;
    mfsdp_log_capture_begin();
    mfsdp_status_t st = mfsdp_ctx_set_lr_factor(c->ctx, lr_factor);
    if (st == MFSDP_OK) {
        st = mfsdp_ctx_step(c->ctx);
    }
    mfsdp_log_capture_end(msg, sizeof(msg));
    shim_inside = 0;
    if (st != MFSDP_OK) {
        shim_fatal(c, 0, st, "the owners' optimizer step failed: %s",
                   msg[0] ? msg : mfsdp_status_string(st));
        rc = fail(st, "%s", c->why);
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

SHIM_EXPORT int mfsdp_shim_grad_sqnorm(int id, double *sq)
{
    if (sq == NULL) {
        return fail(MFSDP_ERR_INVALID_ARG, "mfsdp_shim_grad_sqnorm: null output");
    }
    int rc;
    shim_comm_t *c = bound(id, &rc);
    if (c == NULL) {
        if (rc == 0) {
            *sq = 0.0;
        }
        return rc;
    }
    mfsdp_status_t st = mfsdp_ctx_grad_sqnorm(c->ctx, sq);
    pthread_mutex_unlock(&c->lock);
    return st == MFSDP_OK ? 0 : fail(st, "mfsdp_shim_grad_sqnorm: %s", mfsdp_status_string(st));
}

SHIM_EXPORT int mfsdp_shim_zero_grads(int id)
{
    int rc;
    shim_comm_t *c = bound(id, &rc);
    if (c == NULL) {
        return rc; /* not bound yet: no gradient held */
    }
    mfsdp_status_t st = mfsdp_ctx_zero_grads(c->ctx);
    pthread_mutex_unlock(&c->lock);
    return st == MFSDP_OK ? 0 : fail(st, "mfsdp_shim_zero_grads: %s", mfsdp_status_string(st));
}

SHIM_EXPORT int mfsdp_shim_reload(int id)
{
    int rc;
    shim_comm_t *c = bound(id, &rc);
    if (c == NULL) {
        return rc; /* not bound yet: the first all-gather takes the weights anyway */
    }
    mfsdp_status_t st = mfsdp_ctx_reload_weights(c->ctx);
    pthread_mutex_unlock(&c->lock);
    return st == MFSDP_OK ? 0 : fail(st, "mfsdp_shim_reload: %s", mfsdp_status_string(st));
}

SHIM_EXPORT int mfsdp_shim_scale_grads(int id, double coef)
{
    int rc;
    shim_comm_t *c = bound(id, &rc);
    if (c == NULL) {
        return rc;
    }
    mfsdp_status_t st = mfsdp_ctx_scale_grads(c->ctx, coef);
    pthread_mutex_unlock(&c->lock);
    return st == MFSDP_OK ? 0 : fail(st, "mfsdp_shim_scale_grads: %s", mfsdp_status_string(st));
}
