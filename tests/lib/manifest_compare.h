/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Field-by-field comparison of two manifests for tests and the fuzz target, written apart
 * from the library (which has its own check inside mfsdp_manifest_to_json) so that a bug in
 * one is not mirrored in the other. Returns NULL when equal, else the first differing field.
 */
#ifndef MFSDP_TESTS_MANIFEST_COMPARE_H
#define MFSDP_TESTS_MANIFEST_COMPARE_H

#include <string.h>

#include "mfsdp/manifest.h"

static inline const char *test_param_diff(const mfsdp_param_desc_t *a, const mfsdp_param_desc_t *b)
{
    if (strcmp(a->name, b->name) != 0) {
        return "param name";
    }
    if (a->ndim != b->ndim) {
        return "param ndim";
    }
    for (int d = 0; d < a->ndim; d++) {
        if (a->shape[d] != b->shape[d]) {
            return "param shape";
        }
    }
    if (a->numel != b->numel) {
        return "param numel";
    }
    if (a->dtype != b->dtype) {
        return "param dtype";
    }
    if (a->optimizer != b->optimizer) {
        return "param optimizer";
    }
    if (a->requires_grad != b->requires_grad) {
        return "param requires_grad";
    }
    if (a->nsplit != b->nsplit) {
        return "param nsplit";
    }
    if (a->nsplit > 0 && memcmp(a->split, b->split, a->nsplit * sizeof(*a->split)) != 0) {
        return "param split";
    }
    if (a->shard_dim != b->shard_dim) {
        return "param shard_dim";
    }
    return NULL;
}

static inline const char *test_manifest_diff(const mfsdp_manifest_t *a, const mfsdp_manifest_t *b)
{
    if (a->world_size != b->world_size) {
        return "world_size";
    }
    /* Compared as values, not bytes: padding inside the struct is not part of it. */
    const mfsdp_hparams_t *x = &a->hp, *y = &b->hp;
    if (x->lr != y->lr || x->momentum != y->momentum || x->nesterov != y->nesterov ||
        x->ns_steps != y->ns_steps || x->weight_decay != y->weight_decay || x->scale != y->scale) {
        return "muon hyper-parameters";
    }
    if (x->adamw_lr != y->adamw_lr || x->adamw_beta1 != y->adamw_beta1 ||
        x->adamw_beta2 != y->adamw_beta2 || x->adamw_eps != y->adamw_eps ||
        x->adamw_weight_decay != y->adamw_weight_decay) {
        return "adamw hyper-parameters";
    }
    const mfsdp_schedule_t *sa = &x->schedule, *sb = &y->schedule;
    if (sa->kind != sb->kind || sa->warmup_steps != sb->warmup_steps ||
        sa->stable_steps != sb->stable_steps || sa->decay_steps != sb->decay_steps ||
        sa->min_lr_ratio != sb->min_lr_ratio ||
        (sa->kind == MFSDP_SCHEDULE_WSD && sa->decay != sb->decay)) {
        return "schedule";
    }
    if (x->max_norm != y->max_norm) {
        return "max_norm";
    }
    if ((a->replicate > 1 ? a->replicate : 1) != (b->replicate > 1 ? b->replicate : 1)) {
        return "replicate";
    }
    const mfsdp_training_t *ta = &a->training, *tb = &b->training;
    if ((ta->micro_steps > 1 ? ta->micro_steps : 1) !=
            (tb->micro_steps > 1 ? tb->micro_steps : 1) ||
        ta->divide != tb->divide ||
        (ta->divide == MFSDP_DIVIDE_FACTOR && ta->divide_factor != tb->divide_factor) ||
        ta->has_tail != tb->has_tail || (ta->has_tail && ta->tail != tb->tail) ||
        ta->has_step != tb->has_step || (ta->has_step && ta->step != tb->step)) {
        return "training";
    }
    if (a->iteration.forward_only != b->iteration.forward_only ||
        a->iteration.no_sync != b->iteration.no_sync) {
        return "iteration";
    }
    if (a->ngroups != b->ngroups) {
        return "ngroups";
    }
    for (size_t g = 0; g < a->ngroups; g++) {
        const mfsdp_group_desc_t *ga = &a->groups[g], *gb = &b->groups[g];
        if (strcmp(ga->name, gb->name) != 0) {
            return "group name";
        }
        if (ga->has_reduce_dtype != gb->has_reduce_dtype ||
            (ga->has_reduce_dtype && ga->reduce_dtype != gb->reduce_dtype)) {
            return "group reduce_dtype";
        }
        if (ga->lr_scale != gb->lr_scale) {
            return "group lr_scale";
        }
        if (ga->has_weight_decay != gb->has_weight_decay ||
            (ga->has_weight_decay && ga->weight_decay != gb->weight_decay)) {
            return "group weight_decay";
        }
        if (ga->nparams != gb->nparams) {
            return "group nparams";
        }
        for (size_t p = 0; p < ga->nparams; p++) {
            const char *d = test_param_diff(&ga->params[p], &gb->params[p]);
            if (d != NULL) {
                return d;
            }
        }
    }
    if (a->ncalls != b->ncalls) {
        return "ncalls";
    }
    for (size_t i = 0; i < a->ncalls; i++) {
        if (a->sequence[i].kind != b->sequence[i].kind ||
            a->sequence[i].group != b->sequence[i].group ||
            a->sequence[i].flags != b->sequence[i].flags) {
            return "sequence";
        }
    }
    return NULL;
}

#endif /* MFSDP_TESTS_MANIFEST_COMPARE_H */
