/* SPDX-License-Identifier: Apache-2.0 */
#include "core/fsdp2_pattern.h"

#include <stdlib.h>
#include <string.h>

#include "core/checks.h"

struct mfsdp_fsdp2_gen {
    const mfsdp_manifest_t *m;
    size_t ngroups;
    int root;
    int prefetch;
    unsigned char *reshard;   /* per group */
    unsigned char *unsharded; /* per group, between passes */
    unsigned char *work;      /* per group, during a pass */
    int after_forward;        /* the last pass was forward-only */
};

static const char *const kind_names[MFSDP_PASS_KINDS] = {"training", "no-sync", "forward-only"};

const char *mfsdp_pass_kind_name(mfsdp_pass_kind_t kind)
{
    return (unsigned)kind < MFSDP_PASS_KINDS ? kind_names[kind] : "?";
}

size_t mfsdp_fsdp2_max_pass_calls(const mfsdp_manifest_t *m)
{
    return m == NULL ? 0 : 3 * m->ngroups;
}

void mfsdp_fsdp2_gen_destroy(mfsdp_fsdp2_gen_t *gen)
{
    if (gen == NULL) {
        return;
    }
    free(gen->reshard);
    free(gen->unsharded);
    free(gen->work);
    free(gen);
}

void mfsdp_fsdp2_gen_reset(mfsdp_fsdp2_gen_t *gen)
{
    if (gen != NULL) {
        memset(gen->unsharded, 0, gen->ngroups + 1);
        gen->after_forward = 0;
    }
}

mfsdp_status_t mfsdp_fsdp2_gen_create(const mfsdp_manifest_t *m, const mfsdp_fsdp2_config_t *cfg,
                                      mfsdp_fsdp2_gen_t **gen_p)
{
    MFSDP_CHECK_ARG(m != NULL && cfg != NULL && gen_p != NULL);
    MFSDP_CHECK_ARG(m->ngroups == 0 || m->groups != NULL);
    MFSDP_CHECK_ARG(cfg->prefetch == 0 || cfg->prefetch == 1);
    MFSDP_CHECK_ARG(!cfg->root || m->ngroups > 0);
    mfsdp_fsdp2_gen_t *gen = calloc(1, sizeof(*gen));
    if (gen == NULL) {
        return MFSDP_ERR_NO_MEMORY;
    }
    gen->m = m;
    gen->ngroups = m->ngroups;
    gen->root = cfg->root != 0;
    gen->prefetch = cfg->prefetch;
    gen->reshard = calloc(m->ngroups + 1, 1);
    gen->unsharded = calloc(m->ngroups + 1, 1);
    gen->work = calloc(m->ngroups + 1, 1);
    if (gen->reshard == NULL || gen->unsharded == NULL || gen->work == NULL) {
        mfsdp_fsdp2_gen_destroy(gen);
        return MFSDP_ERR_NO_MEMORY;
    }
    for (size_t g = 0; g < m->ngroups; g++) {
        gen->reshard[g] = cfg->reshard != NULL ? cfg->reshard[g] != 0 : !(gen->root && g == 0);
    }
    *gen_p = gen;
    return MFSDP_OK;
}

typedef struct emitter {
    mfsdp_fsdp2_call_t *out;
    size_t cap;
    size_t n;
    int overflow;
} emitter_t;

static void emit(emitter_t *e, mfsdp_call_kind_t kind, size_t group, mfsdp_fsdp2_phase_t phase,
                 int prefetch, const unsigned char *has_grad)
{
    if (e->n == e->cap) {
        e->overflow = 1;
        return;
    }
    e->out[e->n++] = (mfsdp_fsdp2_call_t){kind, group, phase, prefetch, has_grad};
}

/* All-gather g in backward unless it is unsharded already. */
static void unshard_bwd(mfsdp_fsdp2_gen_t *gen, emitter_t *e, size_t g, int prefetch)
{
    if (!gen->work[g]) {
        emit(e, MFSDP_CALL_ALLGATHER, g, MFSDP_PHASE_BACKWARD, prefetch, NULL);
        gen->work[g] = 1;
    }
}

static int any_grad(const mfsdp_group_desc_t *gd, const unsigned char *flags)
{
    for (size_t i = 0; i < gd->nparams; i++) {
        if (flags != NULL ? flags[i] != 0 : gd->params[i].requires_grad != 0) {
            return 1;
        }
    }
    return 0;
}

mfsdp_status_t mfsdp_fsdp2_gen_pass(mfsdp_fsdp2_gen_t *gen, mfsdp_pass_kind_t kind,
                                    const unsigned char *const *has_grad, mfsdp_fsdp2_call_t *out,
                                    size_t cap, size_t *ncalls_p)
{
    MFSDP_CHECK_ARG(gen != NULL && ncalls_p != NULL && (out != NULL || cap == 0));
    MFSDP_CHECK_ARG((unsigned)kind < MFSDP_PASS_KINDS);
    const mfsdp_manifest_t *m = gen->m;
    size_t G = gen->ngroups;
    for (size_t g = 0; has_grad != NULL && g < G; g++) {
        const unsigned char *f = has_grad[g];
        for (size_t i = 0; f != NULL && i < m->groups[g].nparams; i++) {
            if (f[i] > 1 || (f[i] && !m->groups[g].params[i].requires_grad)) {
                MFSDP_WARN("group %s: param %s is marked as having a gradient but %s",
                           m->groups[g].name, m->groups[g].params[i].name,
                           f[i] > 1 ? "the mark is not 0 or 1" : "it does not require one");
                return MFSDP_ERR_INVALID_ARG;
            }
        }
    }
    emitter_t e = {out, cap, 0, 0};
    memcpy(gen->work, gen->unsharded, G);
    size_t first = gen->root ? 1 : 0; /* first group that is not the root */

    for (size_t g = 0; g < G; g++) {
        if (!gen->work[g]) {
            emit(&e, MFSDP_CALL_ALLGATHER, g, MFSDP_PHASE_FORWARD, 0, NULL);
            gen->work[g] = 1;
        }
        if (g >= first && gen->reshard[g]) {
            gen->work[g] = 0;
        }
    }
    if (gen->root && gen->reshard[0]) {
        gen->work[0] = 0; /* the root's post-forward runs after every other group's */
    }

    if (kind != MFSDP_PASS_FORWARD) {
        int sync = kind == MFSDP_PASS_TRAIN;
        /* Backward runs the post-forward order in reverse: the root first (it finished its
         * forward last), then the other groups from the last to the first. */
        if (gen->root) {
            unshard_bwd(gen, &e, 0, 0);
            if (gen->prefetch && G > first) {
                unshard_bwd(gen, &e, G - 1, 1);
            }
        }
        for (size_t g = G; g-- > first;) {
            unshard_bwd(gen, &e, g, 0);
            if (gen->prefetch && g > first) {
                unshard_bwd(gen, &e, g - 1, 1);
            }
            if (gen->prefetch && g == first && gen->after_forward) {
                /* FSDP2 keeps the post-forward order of a forward without backward: the first
                 * group's prefetch target is then the last group of that earlier forward
                 * (measured: torchtitan wrapping re-gathers its output group here). */
                unshard_bwd(gen, &e, gen->root ? 0 : G - 1, 1);
            }
            gen->work[g] = 0;
            const unsigned char *f = has_grad != NULL ? has_grad[g] : NULL;
            if (sync && any_grad(&m->groups[g], f)) {
                emit(&e, MFSDP_CALL_REDUCE_SCATTER, g, MFSDP_PHASE_BACKWARD, 0, f);
            }
        }
        if (gen->root) {
            const unsigned char *f = has_grad != NULL ? has_grad[0] : NULL;
            if (sync && any_grad(&m->groups[0], f)) {
                emit(&e, MFSDP_CALL_REDUCE_SCATTER, 0, MFSDP_PHASE_BACKWARD, 0, f);
            }
        }
        memset(gen->work, 0, G); /* the end-of-backward callback reshards everything */
    }
    if (e.overflow) {
        return MFSDP_ERR_OVERFLOW;
    }
    memcpy(gen->unsharded, gen->work, G);
    gen->after_forward = kind == MFSDP_PASS_FORWARD;
    *ncalls_p = e.n;
    return MFSDP_OK;
}
