#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""mfsdp-perf --tune-out (suite `mpi`): the algorithm table it writes says, at every measured
size, the algorithm its own JSON rows show fastest (all-gather in place, reduce-scatter out
of place), covers every size once, keeps the rows of other collectives, refuses to clobber a
file it cannot read, and is what `auto` then runs (MFSDP_ALGO_TABLE).

  tune_check.py --mpirun MPIRUN --exe MFSDP_PERF --dir DIR
"""
import argparse
import json
import os
import subprocess
import sys

FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
SIZES = ["-b", "64K", "-e", "1M", "-f", "4", "-n", "1", "--segments", "4"]


def run(a, args, env_extra=None):
    env = dict(os.environ)
    cmd = [a.mpirun, "-np", "2"] + FLAGS
    for k, v in (env_extra or {}).items():
        env[k] = v
        cmd += ["-x", k]
    cmd += [a.exe] + args
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                       timeout=300)
    sys.stderr.write(p.stderr)
    return p


def rows_of(text):
    return [json.loads(l) for l in text.splitlines() if l.startswith("{")]


def read_table(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("coll,"):
            continue
        coll, nr, lo, hi, algo = [f.strip() for f in line.split(",")]
        rows.append((coll, int(nr), int(lo), int(hi), algo))
    return rows


def pick(rows, coll, n, size):
    for c, nr, lo, hi, algo in rows:
        if c == coll and nr in (-1, n) and size >= lo and (hi < 0 or size <= hi):
            return algo
    return None


def check_coll(rows, coll, out):
    """The table's pick at each measured size is the fastest mfsdp row of that size."""
    key = "ip_time_us" if coll == "allgather" else "time_us"
    best = {}
    for r in out:
        if not r["system"].startswith("mfsdp-"):
            continue
        s = int(r["size"])
        if s not in best or r[key] < best[s][1]:
            best[s] = (r["system"][len("mfsdp-"):], r[key])
    if len(best) < 3:
        sys.exit("FAIL: %s: %d sizes measured, expected 3" % (coll, len(best)))
    for s, (algo, _) in sorted(best.items()):
        got = pick(rows, coll, 2, s)
        if got != algo:
            sys.exit("FAIL: %s at %d bytes: the table says %s, the run measured %s fastest"
                     % (coll, s, got, algo))
    mine = sorted((r for r in rows if r[0] == coll and r[1] == 2), key=lambda r: r[2])
    if mine[0][2] != 0 or mine[-1][3] != -1:
        sys.exit("FAIL: %s rows do not cover 0..unbounded: %r" % (coll, mine))
    for x, y in zip(mine, mine[1:]):
        if y[2] != x[3] + 1 or x[4] == y[4]:
            sys.exit("FAIL: %s rows leave a gap, overlap or repeat an algorithm: %r %r"
                     % (coll, x, y))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--exe", required=True)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    table = os.path.join(a.dir, "tune-check.csv")
    if os.path.exists(table):
        os.unlink(table)
    with open(table, "w") as f:  # a row of another rank count, to be kept
        f.write("allgather,64,0,-1,chain\n")

    p = run(a, ["allgather", "--json", "--tune-out", table] + SIZES)
    if p.returncode != 0:
        sys.exit("FAIL: allgather --tune-out exited %d" % p.returncode)
    ag_out = rows_of(p.stdout)
    best_ag = check_coll(read_table(table), "allgather", ag_out)
    p = run(a, ["reducescatter", "--json", "--tune-out", table] + SIZES)
    if p.returncode != 0:
        sys.exit("FAIL: reducescatter --tune-out exited %d" % p.returncode)
    rows = read_table(table)
    check_coll(rows, "reducescatter", rows_of(p.stdout))
    check_coll(rows, "allgather", ag_out)  # the all-gather rows survived the second write
    if ("allgather", 64, 0, -1, "chain") not in rows or pick(rows, "allgather", 2, 65536) is None:
        sys.exit("FAIL: the other rows were not kept: %r" % rows)

    # auto runs the table's pick for the harness's one group
    p = run(a, ["allgather", "--json", "--algo", "auto"] + SIZES, {"MFSDP_ALGO_TABLE": table})
    if p.returncode != 0:
        sys.exit("FAIL: --algo auto under MFSDP_ALGO_TABLE exited %d" % p.returncode)
    for r in rows_of(p.stdout):
        if r["system"].startswith("mfsdp-"):
            want = "mfsdp-" + pick(rows, "allgather", 2, int(r["size"]))
            if r["system"] != want:
                sys.exit("FAIL: auto ran %s at %d bytes, the table says %s"
                         % (r["system"], int(r["size"]), want))
    if not best_ag:
        sys.exit("FAIL: no all-gather rows")

    # refusals: one algorithm only; a file that is not a table is not overwritten
    before = open(table).read()
    p = run(a, ["allgather", "--tune-out", table, "--algo", "direct"] + SIZES)
    if p.returncode != 2 or open(table).read() != before:
        sys.exit("FAIL: --tune-out with --algo direct: exit %d, file changed %s"
                 % (p.returncode, open(table).read() != before))
    with open(table, "w") as f:
        f.write("not,a,table\n")
    p = run(a, ["allgather", "--tune-out", table] + SIZES)
    if p.returncode == 0 or open(table).read() != "not,a,table\n" or "not overwriting" not in p.stderr:
        sys.exit("FAIL: a file that is not a table: exit %d, content %r"
                 % (p.returncode, open(table).read()))
    os.unlink(table)
    print("ok: tables written, kept, refused and run as measured")


if __name__ == "__main__":
    main()
