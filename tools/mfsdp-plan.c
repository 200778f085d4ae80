/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mfsdp-plan: plan owners for a manifest at a world size and print the plan as a table
 * (per rank: owned tensors, Newton-Schulz GFLOP, owned and arena MiB, imbalance against
 * the lower bounds; per group: owners) or as JSON. `--env` lists every MFSDP_* variable.
 *
 * Exit status: 0 success, 1 bad input (manifest, plan, environment), 2 usage error. Every
 * failure prints one line on stderr, "mfsdp-plan: <message>". The library reports details
 * through its WARN log on stderr; while the log would go there at the default level, the
 * tool captures it and folds the first warning into its one-line message.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/config.h"
#include "core/join.h"
#include "core/log.h"
#include "core/record.h"
#include "core/settings.h"
#include "mfsdp/manifest.h"
#include "mfsdp/plan.h"

#define PROG       "mfsdp-plan"
#define EXIT_INPUT 1
#define EXIT_USAGE 2
#define MIB        (1024.0 * 1024.0)

static const char usage_text[] =
    "usage: " PROG " MANIFEST --world-size N [--json] [--tail owner|shard|auto|job]\n"
    "                  [--mem-limit SIZE] [--record FILE] [--write-manifest OUT]\n"
    "       " PROG " --env\n"
    "\n"
    "Plan whole-matrix owners for the FSDP param groups of MANIFEST (mfsdp-manifest/1) at\n"
    "world size N and print, per rank, the owned tensors, Newton-Schulz GFLOP per step,\n"
    "owned and owner-arena MiB and the imbalance against the lower bounds, then the owners\n"
    "of every group's params ('sh' = kept in FSDP's even slices).\n"
    "\n"
    "  -n, --world-size N   number of ranks (must match the manifest's world_size if set)\n"
    "  -j, --json           print the plan as JSON (mfsdp-plan/1) instead of a table\n"
    "  -t, --tail POLICY    AdamW tensors: owner, shard, auto or job (default: MFSDP_TAIL, then\n"
    "                       the manifest's training.tail, then auto)\n"
    "  -m, --mem-limit SIZE owner-arena bytes per rank, K/M/G/T suffixes, 0 = unlimited\n"
    "                       (default: MFSDP_MEM_LIMIT)\n"
    "  -r, --record FILE    join a call record (written by the shim with MFSDP_RECORD=FILE)\n"
    "                       with MANIFEST: its calls become the manifest's \"sequence\" and\n"
    "                       \"iteration\" variants (refused when the record is ambiguous)\n"
    "  -w, --write-manifest OUT  write the manifest (with the joined sequence) to OUT\n"
    "      --env            list every MFSDP_* variable with its default and help\n"
    "  -h, --help           this text\n"
    "\n"
    "Exit status: 0 ok, 1 bad input, 2 usage error.\n";

/* ---- stderr capture: folds library warnings into one line ------------------------------ */

typedef struct capture {
    int active;
    int saved_fd;
    FILE *tmp;
} capture_t;

static void capture_begin(capture_t *c)
{
    memset(c, 0, sizeof(*c));
    const char *lvl = getenv("MFSDP_DEBUG");
    const char *file = getenv("MFSDP_DEBUG_FILE");
    if ((file != NULL && *file != '\0') ||
        (lvl != NULL && *lvl != '\0' && strcasecmp(lvl, "WARN") != 0)) {
        return; /* the user asked for the log elsewhere or at another level */
    }
    fflush(stderr);
    c->tmp = tmpfile();
    c->saved_fd = c->tmp != NULL ? dup(STDERR_FILENO) : -1;
    if (c->saved_fd < 0 || dup2(fileno(c->tmp), STDERR_FILENO) < 0) {
        if (c->saved_fd >= 0) {
            close(c->saved_fd);
        }
        if (c->tmp != NULL) {
            fclose(c->tmp);
        }
        memset(c, 0, sizeof(*c));
        return;
    }
    c->active = 1;
}

/* Restore stderr. With keep, the captured text is copied to stderr; otherwise the message
 * of the first warning (without the "host:pid:tid mfsdp WARN file:line " prefix) is put in
 * msg (empty when there was none). */
static void capture_end(capture_t *c, int keep, char *msg, size_t msglen)
{
    if (msglen > 0) {
        msg[0] = '\0';
    }
    if (!c->active) {
        return;
    }
    fflush(stderr);
    dup2(c->saved_fd, STDERR_FILENO);
    close(c->saved_fd);
    rewind(c->tmp);
    char line[4096];
    while (fgets(line, sizeof(line), c->tmp) != NULL) {
        if (keep) {
            fputs(line, stderr);
            continue;
        }
        char *w = strstr(line, " mfsdp WARN ");
        if (w == NULL || msg[0] != '\0') {
            continue;
        }
        w += strlen(" mfsdp WARN ");
        char *sp = strchr(w, ' '); /* skip "file:line " */
        w = sp != NULL ? sp + 1 : w;
        w[strcspn(w, "\n")] = '\0';
        snprintf(msg, msglen, "%s", w);
    }
    fclose(c->tmp);
    c->active = 0;
}

/* ---- argument parsing ----------------------------------------------------------------- */

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, PROG ": ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try '" PROG " --help')\n");
    return EXIT_USAGE;
}

static int parse_world(const char *s, int *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < 1 || v > (1L << 24)) {
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_tail(const char *s, mfsdp_tail_policy_t *out)
{
    static const struct {
        const char *name;
        mfsdp_tail_policy_t tail;
    } names[] = {
        {"owner", MFSDP_TAIL_OWNER},
        {"shard", MFSDP_TAIL_SHARD},
        {"auto", MFSDP_TAIL_AUTO},
        {"job", MFSDP_TAIL_JOB},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcasecmp(s, names[i].name) == 0) {
            *out = names[i].tail;
            return 0;
        }
    }
    return -1;
}

static const char *tail_name(mfsdp_tail_policy_t t)
{
    return t == MFSDP_TAIL_OWNER   ? "owner"
           : t == MFSDP_TAIL_SHARD ? "shard"
           : t == MFSDP_TAIL_JOB   ? "job"
                                   : "auto";
}

/* ---- table ---------------------------------------------------------------------------- */

static double ratio(double v, double lb)
{
    return lb > 0.0 ? v / lb : 0.0;
}

static void print_table(FILE *out, const char *path, const mfsdp_plan_t *p, size_t mem_limit)
{
    const mfsdp_manifest_t *m = p->manifest;
    size_t nmuon = 0, nowned_tail = 0, nsharded = 0;
    for (size_t k = 0; k < p->nshards; k++) {
        const mfsdp_shard_t *sh = &p->shards[k];
        if (sh->role == MFSDP_ROLE_MUON) {
            nmuon++;
        } else if (sh->owner == MFSDP_OWNER_SHARDED) {
            nsharded++;
        } else {
            nowned_tail++;
        }
    }
    size_t tail_bytes = 0;
    if (p->world > 0) {
        /* Every rank keeps the same sharded-tail slices: arena bytes minus owned costs. */
        const mfsdp_rank_plan_t *r0 = &p->ranks[0];
        size_t owned_cost = 0;
        for (size_t i = 0; i < r0->nowned; i++) {
            owned_cost += p->shards[r0->owned[i]].arena_bytes;
        }
        tail_bytes = r0->arena_bytes - owned_cost;
    }
    fprintf(out, "# manifest %s, world size %d, tail %s, mem limit ", path, p->world,
            tail_name(p->tail));
    if (mem_limit == 0) {
        fprintf(out, "unlimited\n");
    } else {
        fprintf(out, "%.1f MiB\n", (double)mem_limit / MIB);
    }
    fprintf(out,
            "# %zu groups, %zu tensors: %zu muon, %zu adamw owned whole, %zu adamw "
            "sharded (%.1f MiB tail arena per rank)\n",
            m->ngroups, p->nshards, nmuon, nowned_tail, nsharded, (double)tail_bytes / MIB);
    fprintf(out, "# NS FLOPs   LB %12.2f GFLOP  max %12.2f GFLOP  max/LB %.4f\n", p->lb_flops / 1e9,
            p->max_flops / 1e9, ratio(p->max_flops, p->lb_flops));
    fprintf(out, "# owned      LB %12.2f MiB    max %12.2f MiB    max/LB %.4f\n", p->lb_bytes / MIB,
            (double)p->max_owned_bytes / MIB, ratio((double)p->max_owned_bytes, p->lb_bytes));
    fprintf(out, "# arena                           max %12.2f MiB\n",
            (double)p->max_arena_bytes / MIB);
    fprintf(out, "#\n# %6s %6s %14s %12s %12s %9s %9s\n", "rank", "owned", "NS GFLOP", "owned MiB",
            "arena MiB", "flops/LB", "bytes/LB");
    for (int r = 0; r < p->world; r++) {
        const mfsdp_rank_plan_t *rp = &p->ranks[r];
        fprintf(out, "  %6d %6zu %14.2f %12.2f %12.2f %9.4f %9.4f\n", r, rp->nowned,
                rp->ns_flops / 1e9, (double)rp->owned_bytes / MIB, (double)rp->arena_bytes / MIB,
                ratio(rp->ns_flops, p->lb_flops), ratio((double)rp->owned_bytes, p->lb_bytes));
    }
    fprintf(out, "#\n# %-24s owners (param order; sh = sharded tail)\n", "group");
    for (size_t g = 0; g < m->ngroups; g++) {
        fprintf(out, "  %-24s", m->groups[g].name != NULL ? m->groups[g].name : "?");
        for (size_t k = p->group_first[g]; k < p->group_first[g + 1]; k++) {
            if (p->shards[k].owner == MFSDP_OWNER_SHARDED) {
                fprintf(out, " sh");
            } else {
                fprintf(out, " %d", p->shards[k].owner);
            }
        }
        fprintf(out, "\n");
    }
}

/* ---- record join ---------------------------------------------------------------------- */

/* Replace m's sequence and iteration variants with the join of the record at path
 * (core/join.h). */
static mfsdp_status_t join_record(mfsdp_manifest_t *m, int world, const char *path, char *err,
                                  size_t errlen)
{
    mfsdp_record_t *rec = NULL;
    mfsdp_join_t *j = NULL;
    mfsdp_status_t st = mfsdp_record_load(path, err, errlen, &rec);
    if (st == MFSDP_OK) {
        st = mfsdp_record_join(m, world, rec, err, errlen, &j);
    }
    mfsdp_record_free(rec);
    if (st != MFSDP_OK) {
        return st;
    }
    free(m->sequence);
    m->sequence = j->sequence;
    m->ncalls = j->ncalls;
    m->iteration = j->iteration;
    j->sequence = NULL;
    mfsdp_join_free(j);
    return MFSDP_OK;
}

/* Write the canonical manifest to out: temporary file, fsync, rename. */
static mfsdp_status_t write_manifest(const mfsdp_manifest_t *m, const char *out, char *err,
                                     size_t errlen)
{
    char *text = NULL;
    char tmp[4096];
    mfsdp_status_t st = mfsdp_manifest_to_json(m, &text);
    if (st != MFSDP_OK) {
        return st;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", out, (int)getpid());
    FILE *f = fopen(tmp, "w");
    int ok = f != NULL && fputs(text, f) >= 0 && fputc('\n', f) != EOF && fflush(f) == 0 &&
             fsync(fileno(f)) == 0;
    if (f != NULL && fclose(f) != 0) {
        ok = 0;
    }
    if (!ok || rename(tmp, out) != 0) {
        snprintf(err, errlen, "cannot write %s: %s", out, strerror(errno));
        unlink(tmp);
        st = MFSDP_ERR_IO;
    }
    free(text);
    return st;
}

/* ---- main ----------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"world-size", required_argument, NULL, 'n'},
        {"json", no_argument, NULL, 'j'},
        {"tail", required_argument, NULL, 't'},
        {"mem-limit", required_argument, NULL, 'm'},
        {"record", required_argument, NULL, 'r'},
        {"write-manifest", required_argument, NULL, 'w'},
        {"env", no_argument, NULL, 'E'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int world = 0, json = 0, env = 0, have_tail = 0, have_mem = 0;
    const char *record_path = NULL, *out_manifest = NULL;
    mfsdp_tail_policy_t tail = MFSDP_TAIL_AUTO;
    size_t mem_limit = 0;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":n:jt:m:r:w:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'n':
            if (parse_world(optarg, &world) != 0) {
                return usage_error("--world-size '%s': expected an integer >= 1", optarg);
            }
            break;
        case 'j':
            json = 1;
            break;
        case 't':
            if (parse_tail(optarg, &tail) != 0) {
                return usage_error("--tail '%s': expected owner, shard, auto or job", optarg);
            }
            have_tail = 1;
            break;
        case 'm':
            if (mfsdp_parse_size(optarg, &mem_limit) != MFSDP_OK) {
                return usage_error("--mem-limit '%s': expected bytes with an optional "
                                   "K/M/G/T suffix",
                                   optarg);
            }
            have_mem = 1;
            break;
        case 'r':
            record_path = optarg;
            break;
        case 'w':
            out_manifest = optarg;
            break;
        case 'E':
            env = 1;
            break;
        case 'h':
            fputs(usage_text, stdout);
            return 0;
        case ':':
        default: {
            /* A long option is the word getopt just read; a short one is optopt. */
            char opt[3] = {'-', (char)optopt, '\0'};
            const char *word = argv[optind - 1];
            const char *name = strncmp(word, "--", 2) == 0 || optopt == 0 ? word : opt;
            return usage_error(c == ':' ? "option '%s' needs a value" : "unknown option '%s'",
                               name);
        }
        }
    }
    if (env) {
        if (optind != argc) {
            return usage_error("--env takes no manifest ('%s')", argv[optind]);
        }
        mfsdp_config_print(stdout);
        return 0;
    }
    if (optind == argc) {
        return usage_error("%s", "missing MANIFEST");
    }
    if (argc - optind > 1) {
        return usage_error("one MANIFEST expected, got also '%s'", argv[optind + 1]);
    }
    if (world == 0) {
        return usage_error("%s", "missing --world-size N");
    }
    const char *path = argv[optind];

    int rc = EXIT_INPUT;
    mfsdp_manifest_t *m = NULL;
    mfsdp_plan_t *p = NULL;
    char *text = NULL;
    char err[1024] = "";
    char warn[1024];
    capture_t cap;
    capture_begin(&cap);

    /* Defaults from the environment; a bad variable is bad input. */
    const mfsdp_config_t *cfg = NULL;
    mfsdp_status_t st = mfsdp_config_get(&cfg);
    if (st != MFSDP_OK) {
        capture_end(&cap, 0, warn, sizeof(warn));
        fprintf(stderr, PROG ": %s\n", warn[0] ? warn : mfsdp_status_string(st));
        goto out;
    }
    if (!have_mem) {
        mem_limit = cfg->mem_limit;
    }

    st = mfsdp_manifest_load(path, err, sizeof(err), &m);
    if (st != MFSDP_OK) {
        capture_end(&cap, 0, warn, sizeof(warn));
        fprintf(stderr, PROG ": %s\n", err[0] ? err : (warn[0] ? warn : mfsdp_status_string(st)));
        goto out;
    }
    if (!have_tail) { /* MFSDP_TAIL, else the manifest's training.tail, else auto */
        mfsdp_settings_t set;
        st = mfsdp_settings_resolve(m, cfg, &set, err, sizeof(err));
        if (st != MFSDP_OK) {
            capture_end(&cap, 0, warn, sizeof(warn));
            fprintf(stderr, PROG ": %s\n", err);
            goto out;
        }
        tail = set.tail;
    }
    if (record_path != NULL) {
        st = join_record(m, world, record_path, err, sizeof(err));
        if (st != MFSDP_OK) {
            capture_end(&cap, 0, warn, sizeof(warn));
            fprintf(stderr, PROG ": %s\n",
                    err[0] ? err : (warn[0] ? warn : mfsdp_status_string(st)));
            goto out;
        }
    }
    if (out_manifest != NULL) {
        st = write_manifest(m, out_manifest, err, sizeof(err));
        if (st != MFSDP_OK) {
            capture_end(&cap, 0, warn, sizeof(warn));
            fprintf(stderr, PROG ": %s\n", err[0] ? err : mfsdp_status_string(st));
            goto out;
        }
    }
    mfsdp_plan_opts_t opts = {.tail = tail, .mem_limit = mem_limit, .no_spread = !cfg->spread};
    st = mfsdp_plan_create(m, world, &opts, &p);
    if (st == MFSDP_OK && json) {
        st = mfsdp_plan_to_json(p, &text);
    }
    if (st != MFSDP_OK) {
        capture_end(&cap, 0, warn, sizeof(warn));
        fprintf(stderr, PROG ": %s: %s\n", path, warn[0] ? warn : mfsdp_status_string(st));
        goto out;
    }
    capture_end(&cap, 1, warn, sizeof(warn));
    if (json) {
        fputs(text, stdout);
        fputc('\n', stdout);
    } else {
        print_table(stdout, path, p, mem_limit);
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, PROG ": writing the output failed: %s\n", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    free(text);
    mfsdp_plan_destroy(p);
    mfsdp_manifest_free(m);
    return rc;
}
