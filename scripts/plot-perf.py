#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""All the performance plots of docs/PERFORMANCE.md in one command.

Usage: scripts/plot-perf.py OUTDIR [--np 2,4] [--no-sim] [-- mfsdp-perf collective flags]
       scripts/plot-perf.py OUTDIR --from-json FILE [FILE...] [--no-sim]

Runs build/perf/mfsdp-perf allgather and reducescatter --json under mpirun at each --np
(default 2; flags after `--` replace the default `-b 1M -e 64M -f 4 -n 3 -w 1 --manifest
examples/models/llama3-8b.json`; every algorithm unless --algo is given), keeps each run's
rows as OUTDIR/perf-SUBCOMMAND-npN.json, and writes with gnuplot (pngcairo):
  OUTDIR/busbw-npN.png   bus bandwidth against buffer size, one panel per
                         collective: native MPI against each mfsdp algorithm;
then, unless --no-sim, runs scripts/plot-sim.py OUTDIR (the simulator's sim-speedup.png and
sim-memory.png). --from-json plots saved rows (mfsdp-perf --json output, any number of
subcommands and rank counts) instead of running the harness.
Standard library only; MFSDP_PERF overrides the harness's path, MPIRUN mpirun's.
"""
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FLAGS = ["-b", "1M", "-e", "64M", "-f", "4", "-n", "3", "-w", "1", "--manifest",
                 os.path.join(ROOT, "examples", "models", "llama3-8b.json")]
MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
TITLES = {"allgather": "all-gather, out of place: MPI_Allgather vs owner-broadcast",
          "allgather-ip": "all-gather, in place (as FSDP2 calls it)",
          "reducescatter": "reduce-scatter: MPI_Reduce_scatter_block vs reduce-to-owner"}
SUBCOMMANDS = ("allgather", "reducescatter")
COLORS = {"native": "#000000", "mfsdp-direct": "#1b9e77", "mfsdp-chain": "#d95f02",
          "mfsdp-native": "#7570b3"}


def die(msg):
    sys.exit("plot-perf: " + msg)


def parse_args(argv):
    if not argv or argv[0].startswith("-"):
        die("usage: plot-perf.py OUTDIR [--np 2,4] [--no-sim] [-- flags] | "
            "OUTDIR --from-json FILE... [--no-sim] (see the file's docstring)")
    a = {"out": argv[0], "np": [2], "sim": True, "json": [], "flags": None}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            a["flags"] = argv[i + 1:]
            break
        if arg == "--no-sim":
            a["sim"] = False
        elif arg == "--np" and i + 1 < len(argv):
            try:
                a["np"] = [int(x) for x in argv[i + 1].split(",")]
            except ValueError:
                die(f"bad --np {argv[i + 1]!r}")
            if any(n < 2 for n in a["np"]):
                die("--np needs rank counts >= 2")
            i += 1
        elif arg == "--from-json":
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                a["json"].append(argv[i])
                i += 1
            if not a["json"]:
                die("--from-json needs at least one file")
            continue
        else:
            die(f"unknown argument {arg!r}")
        i += 1
    return a


def run_harness(out, nps, flags):
    exe = os.environ.get("MFSDP_PERF", os.path.join(ROOT, "build", "perf", "mfsdp-perf"))
    if not os.access(exe, os.X_OK):
        die(f"{exe} not found: build first (ninja -C build) or set MFSDP_PERF")
    mpirun = os.environ.get("MPIRUN", "mpirun")
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("MFSDP_MLOCK", "0")
    files = []
    for n in nps:
        for sub in SUBCOMMANDS:
            cmd = [mpirun, "-np", str(n)] + MPIRUN_FLAGS + [exe, sub, "--json"] + flags
            print("+", " ".join(cmd), flush=True)
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                die(f"{sub} at {n} ranks exited with {p.returncode}: {p.stderr.strip()}")
            path = os.path.join(out, f"perf-{sub}-np{n}.json")
            with open(path, "w") as f:
                f.write(p.stdout)
            files.append(path)
    return files


def load_rows(files):
    rows = []
    for path in files:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    r = json.loads(line)
                    if r.get("subcommand") in SUBCOMMANDS:
                        rows.append(r)
    if not rows:
        die("no allgather/reducescatter rows in " + ", ".join(files))
    bad = [r for r in rows if r.get("wrong", 0) != 0]
    if bad:
        die(f"{len(bad)} row(s) with #wrong > 0: the harness's check failed, not plotting")
    return rows


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def gnuplot(script):
    p = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if p.returncode != 0 or p.stderr.strip():
        die("gnuplot failed: " + (p.stderr.strip() or str(p.returncode)))


def plot_busbw(rows, out):
    # (ranks, subcommand, system) -> size -> busbw samples. A native row is printed next to
    # every mfsdp algorithm's (measured interleaved with it): its median is plotted.
    # A direct all-gather that copied from shared arenas ("shared": 1) is a system of its own.
    data = defaultdict(lambda: defaultdict(list))
    for r in rows:
        system = r["system"] + ("+shm" if r.get("shared") else "")
        data[(r["ranks"], r["subcommand"], system)][r["size"]].append(r["busbw"])
        if "ip_busbw" in r:  # the all-gather's in-place column: a panel of its own
            data[(r["ranks"], r["subcommand"] + "-ip", system)][r["size"]].append(
                r["ip_busbw"])
    written = []
    for n in sorted({k[0] for k in data}):
        subs = [s for s in TITLES if any(k[0] == n and k[1] == s for k in data)]
        types = "/".join(sorted({r["type"] for r in rows if r["ranks"] == n}))
        png = os.path.join(out, f"busbw-np{n}.png")
        s = (f"set terminal pngcairo noenhanced size {760 * len(subs)},600 "
             "font 'DejaVu Sans,11'\n"
             f"set output '{png}'\n"
             f"set multiplot layout 1,{len(subs)} title \"mfsdp-perf: bus bandwidth, {n} "
             f"ranks, {types} (median over runs; busbw = algbw (n-1)/n)\" "
             "font ',13'\n"
             "set logscale x 2\nset grid xtics ytics mxtics lc rgb '#cccccc'\n"
             "set xlabel 'buffer size (whole gathered buffer, bytes)'\n"
             "set format x '%.0b%BB'\nset autoscale xfix\nset offsets graph 0.04, graph 0.04\n"
             "set ylabel 'busbw (GB/s)'\nset yrange [0:*]\n"
             "set key outside below center horizontal box\nset bmargin 7\n")
        for sub in subs:
            systems = sorted((k[2] for k in data if k[0] == n and k[1] == sub),
                             key=lambda x: (x != "native", x))
            s += f"set title '{TITLES[sub]}'\n"
            plots = []
            for sysname in systems:
                dat = os.path.join(out, f"busbw-np{n}-{sub}-{sysname}.dat")
                with open(dat, "w") as f:
                    f.write("# size_bytes busbw_GBps\n")
                    for size, v in sorted(data[(n, sub, sysname)].items()):
                        f.write(f"{size:.0f} {median(v):.6g}\n")
                color = COLORS.get(sysname.split("+")[0], "#e7298a")
                style = "lw 3 dt 2 pt 6" if sysname == "native" else "lw 2 pt 7"
                label = ("native MPI" if sysname == "native"
                         else sysname.replace("+shm", " (shared arenas)"))
                plots.append(f"'{dat}' using 1:2 with linespoints {style} lc rgb '{color}' "
                             f"title '{label}'")
            s += "plot " + ", \\\n     ".join(plots) + "\n"
        s += "unset multiplot\n"
        gnuplot(s)
        written.append(png)
    return written


def main():
    a = parse_args(sys.argv[1:])
    if not shutil.which("gnuplot"):
        die("gnuplot not found (scripts/setup-deps.sh installs gnuplot-nox)")
    os.makedirs(a["out"], exist_ok=True)
    if a["json"]:
        files = a["json"]
    else:
        flags = a["flags"] if a["flags"] is not None else DEFAULT_FLAGS
        files = run_harness(a["out"], a["np"], flags)
    written = plot_busbw(load_rows(files), a["out"])
    print("plot-perf: wrote " + ", ".join(written), flush=True)
    if a["sim"]:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot-sim.py"),
                            a["out"]])
        if p.returncode != 0:
            die(f"plot-sim.py exited with {p.returncode}")


if __name__ == "__main__":
    main()
