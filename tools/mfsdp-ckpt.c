/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mfsdp-ckpt: inspect, verify and convert mfsdp owner checkpoints (docs/checkpoints.md,
 * docs/checkpoints.md) without a communicator.
 *
 * Exit status: 0 success, 1 bad input (a damaged, incomplete or mismatching checkpoint, an
 * unreadable file), 2 usage error. Every failure prints one line on stderr,
 * "mfsdp-ckpt: <message>", naming the file and tensor where there is one. The library's own
 * warnings are silenced unless MFSDP_DEBUG is set.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/checks.h"
#include "core/ckpt_io.h"
#include "core/config.h"
#include "core/log.h"
#include "mfsdp/checkpoint.h"

#define PROG       "mfsdp-ckpt"
#define EXIT_INPUT 1
#define EXIT_USAGE 2
#define ERRLEN     1024

static const char usage_text[] =
    "usage: " PROG " info DIR\n"
    "       " PROG " verify DIR\n"
    "       " PROG " reshard DIR --world-size M OUT [--tail owner|shard|auto] [--mem-limit SIZE]\n"
    "       " PROG " export-full DIR OUT.safetensors [--fp32]\n"
    "       " PROG " import-full IN.safetensors MANIFEST OUT --world-size N [--tail POLICY]\n"
    "                  [--mem-limit SIZE]\n"
    "\n"
    "DIR is a checkpoint root (its 'latest' is used) or one checkpoint directory.\n"
    "  info         format, step counters, hyper-parameters, files, and every tensor's owner\n"
    "  verify       the index's own digest, every file's size and SHA-256, every header,\n"
    "               and that each file holds exactly the tensors the index places there\n"
    "  reshard      re-plan with the stored manifest at M ranks and write a checkpoint for\n"
    "               M ranks under the root OUT (tail policy: --tail, or the stored one)\n"
    "  export-full  every tensor whole in one safetensors file: the weights in the param\n"
    "               dtype, or with --fp32 the fp32 master weights\n"
    "  import-full  a checkpoint for N ranks under the root OUT from ordinary weights (every\n"
    "               param of MANIFEST, whole, F32/BF16/F16): zero optimizer state, step 0\n"
    "\n"
    "Exit status: 0 ok, 1 bad input, 2 usage error.\n";

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try '" PROG " --help')\n");
    return EXIT_USAGE;
}

/* One line per failure: the error text, and the first warning the library logged on the way
 * when the text does not already say it (the planner names the tensor or group at fault). */
static int fail(const char *err, mfsdp_status_t st)
{
    char cause[1024] = "";
    mfsdp_log_capture_end(cause, sizeof(cause));
    const char *what = err != NULL && err[0] != '\0' ? err : mfsdp_status_string(st);
    if (cause[0] != '\0' && strstr(what, cause) == NULL) {
        fprintf(stderr, PROG ": %s (%s)\n", what, cause);
    } else {
        fprintf(stderr, PROG ": %s\n", what);
    }
    return EXIT_INPUT;
}

static int parse_world(const char *s, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < 1 || v > (1L << 20)) {
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_tail(const char *s, mfsdp_tail_policy_t *out)
{
    static const char *const names[] = {"owner", "shard", "auto"};
    for (int i = 0; i < 3; i++) {
        if (strcasecmp(s, names[i]) == 0) {
            *out = (mfsdp_tail_policy_t)i;
            return 0;
        }
    }
    return -1;
}

static int parse_size(const char *s, size_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || s[0] == '-') {
        return -1;
    }
    unsigned shift = 0;
    switch (*end) {
    case '\0':
        break;
    case 'K':
    case 'k':
        shift = 10;
        break;
    case 'M':
    case 'm':
        shift = 20;
        break;
    case 'G':
    case 'g':
        shift = 30;
        break;
    case 'T':
    case 't':
        shift = 40;
        break;
    default:
        return -1;
    }
    if (*end != '\0' && end[1] != '\0') {
        return -1;
    }
    if (shift != 0 && v > (~0ULL >> shift)) {
        return -1;
    }
    *out = (size_t)(v << shift);
    return 0;
}

static const char *role_name(const mfsdp_param_desc_t *p)
{
    return p->optimizer == MFSDP_ROLE_MUON ? "muon" : "adamw";
}

static int cmd_info(const char *dir)
{
    char err[ERRLEN] = "";
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_status_t st = mfsdp_ckpt_reader_open(dir, err, sizeof(err), &r);
    if (st != MFSDP_OK) {
        return fail(err, st);
    }
    const mfsdp_ckpt_index_t *ix = r->index;
    const mfsdp_ckpt_layout_t *lay = ix->layout;
    const mfsdp_hparams_t *hp = &ix->meta.hp;
    static const char *const tails[] = {"owner", "shard", "auto"};
    uint64_t total = 0;
    for (size_t f = 0; f < ix->nfiles; f++) {
        total += ix->files[f].bytes;
    }
    printf("checkpoint   %s\n", r->dir);
    printf("format       %s\n", MFSDP_CKPT_FORMAT);
    printf("index sha256 %s\n", ix->index_sha256);
    printf("world size   %d\n", lay->world);
    printf("step         %" PRId64 " (context steps %" PRIu64 ")\n", ix->meta.step,
           ix->meta.ctx_steps);
    printf("tail policy  %s\n", tails[ix->meta.tail]);
    printf("muon         lr %g, momentum %g, nesterov %d, ns_steps %d, weight_decay %g, "
           "scale %s\n",
           hp->lr, hp->momentum, hp->nesterov, hp->ns_steps, hp->weight_decay,
           hp->scale == MFSDP_SCALE_MOONLIGHT ? "moonlight" : "keller");
    printf("adamw        lr %g, betas (%g, %g), eps %g, weight_decay %g\n", hp->adamw_lr,
           hp->adamw_beta1, hp->adamw_beta2, hp->adamw_eps, hp->adamw_weight_decay);
    printf("files        %zu, %" PRIu64 " bytes\n", ix->nfiles, total);
    for (size_t f = 0; f < ix->nfiles; f++) {
        printf("  %-36s %14" PRIu64 "  %s\n", ix->files[f].name, ix->files[f].bytes,
               ix->files[f].sha256);
    }
    printf("groups       %zu\n", ix->manifest->ngroups);
    for (size_t g = 0; g < ix->manifest->ngroups; g++) {
        printf("  %-36s nsteps %" PRId64 "\n", ix->manifest->groups[g].name,
               ix->meta.group_nsteps[g]);
    }
    printf("tensors      %zu\n", lay->ntensors);
    for (size_t t = 0; t < lay->ntensors; t++) {
        const mfsdp_param_desc_t *p = lay->params[t];
        char shape[160];
        size_t o = (size_t)snprintf(shape, sizeof(shape), "[");
        for (int d = 0; d < p->ndim && o < sizeof(shape); d++) {
            o += (size_t)snprintf(shape + o, sizeof(shape) - o, "%s%lld", d ? ", " : "",
                                  (long long)p->shape[d]);
        }
        if (o < sizeof(shape)) {
            snprintf(shape + o, sizeof(shape) - o, "]");
        }
        char owner[32];
        if (lay->owner[t] == MFSDP_OWNER_SHARDED) {
            snprintf(owner, sizeof(owner), "sharded");
        } else {
            snprintf(owner, sizeof(owner), "rank %d", lay->owner[t]);
        }
        printf("  %-36s %-16s %-9s %-6s owner %-8s weight in model-%05d%s\n", p->name, shape,
               mfsdp_dtype_name(p->dtype), role_name(p), owner, lay->writer[t],
               p->requires_grad ? "" : " (frozen)");
    }
    mfsdp_ckpt_reader_close(r);
    return 0;
}

static int cmd_verify(const char *dir)
{
    char err[ERRLEN] = "";
    /* One opening: the directory verified is the one named below, even when a live job
     * moves the root's latest meanwhile. */
    mfsdp_ckpt_reader_t *r = NULL;
    mfsdp_status_t st = mfsdp_ckpt_reader_open(dir, err, sizeof(err), &r);
    for (size_t f = 0; st == MFSDP_OK && f < r->index->nfiles; f++) {
        st = mfsdp_ckpt_verify_file(r, f, 1, err, sizeof(err));
    }
    if (st != MFSDP_OK) {
        mfsdp_ckpt_reader_close(r);
        return fail(err, st);
    }
    uint64_t total = 0;
    for (size_t f = 0; f < r->index->nfiles; f++) {
        total += r->index->files[f].bytes;
    }
    printf("ok: %s: step %" PRId64 ", %d ranks, %zu files, %" PRIu64
           " bytes, every checksum and header verified\n",
           r->dir, r->index->meta.step, r->index->layout->world, r->index->nfiles, total);
    mfsdp_ckpt_reader_close(r);
    return 0;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"world-size", required_argument, NULL, 'n'},
        {"tail", required_argument, NULL, 't'},
        {"mem-limit", required_argument, NULL, 'm'},
        {"fp32", no_argument, NULL, 'f'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int world = 0, fp32 = 0, have_tail = 0, have_mem = 0;
    mfsdp_tail_policy_t tail = MFSDP_TAIL_AUTO;
    size_t mem_limit = 0;
    int c;
    opterr = 0;
    unsigned given = 0; /* an option given twice is refused, not resolved to its last value */
    while ((c = getopt_long(argc, argv, ":n:t:m:fh", opts, NULL)) != -1) {
        const char *twice = c == 'n'   ? "--world-size"
                            : c == 't' ? "--tail"
                            : c == 'm' ? "--mem-limit"
                                       : NULL;
        if (twice != NULL) {
            unsigned bit = c == 'n' ? 1u : c == 't' ? 2u : 4u;
            if (given & bit) {
                return usage_error("%s is given twice", twice);
            }
            given |= bit;
        }
        switch (c) {
        case 'n':
            if (parse_world(optarg, &world) != 0) {
                return usage_error("bad --world-size '%s' (a positive integer)", optarg);
            }
            break;
        case 't':
            if (parse_tail(optarg, &tail) != 0) {
                return usage_error("bad --tail '%s' (owner, shard or auto)", optarg);
            }
            have_tail = 1;
            break;
        case 'm':
            if (parse_size(optarg, &mem_limit) != 0) {
                return usage_error("bad --mem-limit '%s' (bytes, K/M/G/T suffixes)", optarg);
            }
            have_mem = 1;
            break;
        case 'f':
            fp32 = 1;
            break;
        case 'h':
            fputs(usage_text, stdout);
            return 0;
        case ':':
            return usage_error("option '%s' needs a value", argv[optind - 1]);
        default:
            return usage_error("unknown option '%s'", argv[optind - 1]);
        }
    }
    int npos = argc - optind;
    char **pos = argv + optind;
    if (npos < 1) {
        return usage_error("%s", "missing command");
    }
    if (getenv("MFSDP_DEBUG") == NULL) {
        mfsdp_log_capture_begin(); /* warnings become part of the one line fail() prints */
    }
    const char *cmd = pos[0];
    static const struct {
        const char *name;
        int nargs;
    } cmds[] = {{"info", 1}, {"verify", 1}, {"reshard", 2}, {"export-full", 2}, {"import-full", 3}};
    int known = -1;
    for (int i = 0; i < 5; i++) {
        known = strcmp(cmd, cmds[i].name) == 0 ? i : known;
    }
    if (known < 0) {
        return usage_error("unknown command '%s'", cmd);
    }
    if (npos - 1 != cmds[known].nargs) {
        return usage_error("'%s' takes other arguments", cmd);
    }
    int needs_world = known == 2 || known == 4;
    if (needs_world != (world != 0)) {
        return usage_error(needs_world ? "'%s' needs --world-size" : "'%s' takes no --world-size",
                           cmd);
    }
    if ((have_tail || have_mem) && !needs_world) {
        return usage_error("'%s' takes no --tail or --mem-limit", cmd);
    }
    if (fp32 && known != 3) {
        return usage_error("'%s' takes no --fp32", cmd);
    }
    char err[ERRLEN] = "";
    mfsdp_status_t st = MFSDP_OK;
    mfsdp_plan_opts_t po;
    memset(&po, 0, sizeof(po));
    po.tail = tail;
    po.mem_limit = mem_limit;
    switch (known) {
    case 0:
        return cmd_info(pos[1]);
    case 1:
        return cmd_verify(pos[1]);
    case 2: {
        /* The step directory resolved once (a root's latest can move under a live job): the
         * tail policy kept by --mem-limit alone and the reshard read the same checkpoint. */
        mfsdp_ckpt_reader_t *r = NULL;
        st = mfsdp_ckpt_reader_open(pos[1], err, sizeof(err), &r);
        if (st == MFSDP_OK) {
            if (have_mem && !have_tail) {
                po.tail = r->index->meta.tail; /* --mem-limit alone keeps the stored policy */
            }
            st = mfsdp_ckpt_reshard(r->dir, world, have_tail || have_mem ? &po : NULL, pos[2], err,
                                    sizeof(err));
        }
        mfsdp_ckpt_reader_close(r);
        break;
    }
    case 3:
        st = mfsdp_ckpt_export_full(pos[1], pos[2], fp32, err, sizeof(err));
        break;
    default: {
        mfsdp_manifest_t *m = NULL;
        st = mfsdp_manifest_load(pos[2], err, sizeof(err), &m);
        if (st == MFSDP_OK) {
            if (!have_tail) {
                po.tail = MFSDP_TAIL_AUTO;
            }
            st = mfsdp_ckpt_import_full(pos[1], m, world, &po, pos[3], err, sizeof(err));
        }
        mfsdp_manifest_free(m);
        break;
    }
    }
    if (st != MFSDP_OK) {
        return fail(err, st);
    }
    printf("ok: %s %s\n", cmd, known == 3 ? pos[2] : known == 2 ? pos[2] : pos[3]);
    return 0;
}
