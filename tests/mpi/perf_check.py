#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""mfsdp-perf's MPI subcommands as tests (suite `mpi`): run one under mpirun with `-c 1 --json`
and assert from its output that every result row was checked and found right (#wrong = 0,
in-place too), or, with --corrupt, that the harness catches a result flipped after the
collective (MFSDP_PERF_CORRUPT=1: some #wrong > 0 and a non-zero exit). Timings are printed
by the harness but never asserted.

  perf_check.py --mpirun MPIRUN --exe MFSDP_PERF --np N [--corrupt] SUBCOMMAND [ARGS...]
"""
import argparse
import json
import math
import os
import subprocess
import sys

MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]

# Rows every subcommand must print per size (allgather/reducescatter: native + mfsdp per
# algorithm; optstep: three systems; ckpt: one row; trainstep: four systems).
ROW_KEYS = {
    "allgather": ["wrong", "ip_wrong"],
    "reducescatter": ["wrong"],
    "optstep": ["wrong"],
    "ckpt": ["wrong"],
    "trainstep": ["wrong"],
    "ns": ["wrong"],  # no MPI: run directly, rows carry no ranks or system
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--exe", required=True)
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--min-rows", type=int, default=1)
    ap.add_argument("sub")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    env = dict(os.environ)
    cmd = [a.mpirun, "-np", str(a.np)] + MPIRUN_FLAGS if a.sub != "ns" else []
    if a.corrupt:
        env["MFSDP_PERF_CORRUPT"] = "1"
        cmd += ["-x", "MFSDP_PERF_CORRUPT"] if a.sub != "ns" else []
    cmd += [a.exe, a.sub, "-c", "1", "--json"] + a.args
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, timeout=300)
    sys.stderr.write(proc.stderr)
    rows = []
    for line in proc.stdout.splitlines():
        print(line)
        if not line.startswith("{"):
            sys.exit("FAIL: a non-JSON line on stdout under --json: %r" % line)
        rows.append(json.loads(line))
    keys = ROW_KEYS[a.sub]
    bad = []
    for r in rows:
        if r.get("subcommand") != a.sub or (a.sub != "ns" and r.get("ranks") != a.np):
            sys.exit("FAIL: row of another run: %r" % r)
        if a.sub == "ns":
            r["system"] = "mfsdp-ns"  # the one system of its rows
        for k in keys:
            if k == "ip_wrong" and k not in r and r["system"] != "native":
                continue  # no in-place form
            if k not in r:
                sys.exit("FAIL: row without %s: %r" % (k, r))
            if r[k] != 0:
                bad.append((r["system"], r.get("size"), k, r[k]))
    if a.corrupt:
        if proc.returncode == 0:
            sys.exit("FAIL: corrupted run exited 0")
        if not any(s.startswith("mfsdp") for s, _, _, _ in bad):
            sys.exit("FAIL: corrupted run reported no #wrong on an mfsdp row: %r" % bad)
        # optstep and trainstep compare the baselines against mfsdp's result: one #wrong
        # for the whole run, on every row.
        if any(not s.startswith("mfsdp") for s, _, _, n in bad
               if a.sub not in ("optstep", "trainstep")):
            sys.exit("FAIL: corruption of mfsdp's result showed on a native row: %r" % bad)
        print("ok: corruption caught: %r, exit %d" % (bad, proc.returncode))
        return
    # optstep / trainstep: the paired-runs sign test on each baseline's row, recomputed here.
    for r in rows:
        if a.sub in ("optstep", "trainstep") and r["system"] in ("fsdp2-muon", "dmuon"):
            for k in ("mfsdp_faster_runs", "runs", "sign_test_p"):
                if k not in r:
                    sys.exit("FAIL: %s row without %s: %r" % (r["system"], k, r))
            n, w = r["runs"], r["mfsdp_faster_runs"]
            if not 0 <= w <= n:
                sys.exit("FAIL: %d faster runs of %d: %r" % (w, n, r))
            p = sum(math.comb(n, j) for j in range(w, n + 1)) / 2.0 ** n
            if abs(r["sign_test_p"] - p) > 1e-3 * p:
                sys.exit("FAIL: sign test p %g, expected %g for %d of %d: %r"
                         % (r["sign_test_p"], p, w, n, r))
    if proc.returncode != 0:
        sys.exit("FAIL: exit %d" % proc.returncode)
    if len(rows) < a.min_rows:
        sys.exit("FAIL: %d rows, expected at least %d" % (len(rows), a.min_rows))
    if bad:
        sys.exit("FAIL: #wrong > 0: %r" % bad)
    print("ok: %d rows, #wrong = 0 in every one" % len(rows))


if __name__ == "__main__":
    main()
