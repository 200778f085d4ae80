#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of the mfsdp-sim projection (docs/PERFORMANCE.md).

Usage: scripts/plot-sim.py OUTDIR [mfsdp-sim flags...]
       scripts/plot-sim.py --from-json SIM.json OUTDIR

Runs build/perf/mfsdp-sim --json with the given flags (default: the shipped GPT-2,
Llama-3-8B and Llama-3-70B manifests on the a100 preset, 8..1024 ranks), keeps the
document as OUTDIR/sim.json and writes with gnuplot (pngcairo):
  OUTDIR/sim-speedup.png  optimizer-step speedup of mfsdp over FSDP2-Muon and over
                          DMuon-style, per model, against ranks (the paper's two points
                          on the FSDP2-Muon panel);
  OUTDIR/sim-memory.png   peak memory per rank of the four systems against ranks, one
                          panel per model, with the preset's memory line.
Standard library only; MFSDP_SIM overrides the simulator's path.
"""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = [("mfsdp", "mfsdp (owner plan, ZeRO-3)"), ("fsdp2", "FSDP2-Muon (gather)"),
           ("dmuon", "DMuon-style (round robin)"), ("zero1", "ZeRO-1 owner placement")]
PAPER = [(8, 4.2), (64, 54.6)]  # arXiv 2607.05895, 64x A100; docs/PERFORMANCE.md, "Comparison with the paper"


def die(msg):
    sys.exit("plot-sim: " + msg)


def load(argv):
    if argv and argv[0] == "--from-json":
        if len(argv) != 3:
            die("usage: plot-sim.py --from-json SIM.json OUTDIR")
        with open(argv[1]) as f:
            return json.load(f), argv[2], argv[1]
    if not argv or argv[0].startswith("-"):
        die("usage: plot-sim.py OUTDIR [mfsdp-sim flags...] (see the file's docstring)")
    out, flags = argv[0], argv[1:]
    sim = os.environ.get("MFSDP_SIM", os.path.join(ROOT, "build", "perf", "mfsdp-sim"))
    if not os.access(sim, os.X_OK):
        die(f"{sim} not found: build first (ninja -C build) or set MFSDP_SIM")
    p = subprocess.run([sim, "--json"] + flags, capture_output=True, text=True)
    if p.returncode != 0:
        die(p.stderr.strip() or f"{sim} exited with {p.returncode}")
    doc = json.loads(p.stdout)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sim.json"), "w") as f:
        f.write(p.stdout)
    return doc, out, os.path.join(out, "sim.json")


def model_name(path):
    return os.path.splitext(os.path.basename(path))[0]


def gnuplot(script):
    p = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if p.returncode != 0 or p.stderr.strip():
        die("gnuplot failed: " + (p.stderr.strip() or str(p.returncode)))


def main():
    doc, out, src = load(sys.argv[1:])
    if doc.get("format") != "mfsdp-sim/1":
        die(f"expected an mfsdp-sim/1 document, got format {doc.get('format')!r}")
    if not shutil.which("gnuplot"):
        die("gnuplot not found (scripts/setup-deps.sh installs gnuplot-nox)")
    gpu = doc["gpu"]
    runs = doc["runs"]
    title_gpu = (f"{gpu['preset']}: {gpu['tflops']:g} TFLOP/s x {gpu['ns_eff']:g}, NVLink "
                 f"{gpu['nvlink_gbs']:g} GB/s, network {gpu['ib_gbs']:g} GB/s per GPU, "
                 f"{gpu['gpus_per_node']} GPUs/node")
    os.makedirs(out, exist_ok=True)

    # Data files: one per model, columns ranks, speedups, memory GB.
    for run in runs:
        name = model_name(run["manifest"])
        with open(os.path.join(out, f"sim-{name}.dat"), "w") as f:
            f.write("# ranks x_fsdp2 x_dmuon x_zero1 mem_mfsdp mem_fsdp2 mem_dmuon mem_zero1"
                    " e2e_x_fsdp2\n")
            for c in run["configs"]:
                m = c["memory_bytes"]
                f.write(f"{c['ranks']} {c['speedup']['vs_fsdp2']:.6g} "
                        f"{c['speedup']['vs_dmuon']:.6g} {c['speedup']['vs_zero1']:.6g} "
                        f"{m['mfsdp'] / 1e9:.6g} {m['fsdp2'] / 1e9:.6g} {m['dmuon'] / 1e9:.6g} "
                        f"{m['zero1'] / 1e9:.6g} {c['e2e_speedup']['vs_fsdp2']:.6g}\n")
    with open(os.path.join(out, "sim-paper.dat"), "w") as f:
        f.write("# ranks paper optimizer-step speedup over FSDP2-Muon (64x A100)\n")
        for n, x in PAPER:
            f.write(f"{n} {x}\n")

    colors = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e"]
    common = ("set terminal pngcairo size 1500,620 font 'DejaVu Sans,11'\n"
              "set logscale x 2\nset grid xtics ytics lc rgb '#cccccc'\n"
              "set key top left box opaque Left reverse\nset xlabel 'ranks (GPUs)'\n")

    # Speedups: two panels.
    s = common + f"set output '{os.path.join(out, 'sim-speedup.png')}'\n"
    s += ("set multiplot layout 1,2 title \"mfsdp-sim: projected optimizer-step speedup of "
          f"mfsdp\\n{title_gpu}\" font ',13'\n")
    s += "set logscale y 10\nset format y '%gx'\n"
    for col, label, paper in [(2, "over FSDP2-Muon", True), (3, "over DMuon-style", False)]:
        s += f"set title 'speedup {label}'\nset ylabel 'optimizer step: baseline / mfsdp'\n"
        plots = []
        for i, run in enumerate(runs):
            name = model_name(run["manifest"])
            dat = os.path.join(out, f"sim-{name}.dat")
            plots.append(f"'{dat}' using 1:{col} with linespoints lw 2 pt 7 lc rgb "
                         f"'{colors[i % len(colors)]}' title '{name}'")
        if paper:
            plots.append(f"'{os.path.join(out, 'sim-paper.dat')}' using 1:2 with points pt 9 "
                         "ps 2.5 lc rgb 'black' title 'paper (64x A100, reported)'")
        s += "plot " + ", \\\n     ".join(plots) + "\n"
    s += "unset multiplot\n"
    gnuplot(s)

    # Memory: one panel per model.
    lim = gpu["mem_gb"]
    s = common.replace("size 1500,620", f"size {560 * len(runs)},720")
    s += f"set output '{os.path.join(out, 'sim-memory.png')}'\n"
    s += (f"set multiplot layout 1,{len(runs)} title \"mfsdp-sim: peak memory per rank "
          "(params + grads + optimizer state + staging, no activations)\\n"
          f"{title_gpu}; dashed: {lim:g} GB per GPU\" font ',13'\n")
    s += ("set logscale y 10\nset format y '%g'\nset ylabel 'GB per rank'\n"
          "set key outside below center maxrows 3 box\nset bmargin 10\n")
    for run in runs:
        name = model_name(run["manifest"])
        dat = os.path.join(out, f"sim-{name}.dat")
        s += f"set title '{name}'\n"
        # FSDP2-Muon and DMuon-style have the same peak (the largest gathered matrix):
        # DMuon is drawn dashed on top so that both stay visible.
        style = {"fsdp2": "lw 4", "dmuon": "lw 2 dt 2"}
        plots = [f"'{dat}' using 1:{5 + i} with linespoints {style.get(key, 'lw 2')} "
                 f"pt {5 + 2 * i} lc rgb '{colors[i]}' title '{label}'"
                 for i, (key, label) in enumerate(SYSTEMS)]
        plots.append(f"{lim} with lines dt 2 lw 2 lc rgb 'red' title '{lim:g} GB'")
        s += "plot " + ", \\\n     ".join(plots) + "\n"
    s += "unset multiplot\n"
    gnuplot(s)
    print(f"plot-sim: wrote {out}/sim-speedup.png and {out}/sim-memory.png from {src}")


if __name__ == "__main__":
    main()
