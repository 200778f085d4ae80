#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Table and plot for scripts/demo.sh: reads OUT/{adamw,muon-gather,muon-dist,mfsdp}.log."""
import os
import re
import shutil
import subprocess
import sys

out, np_ = sys.argv[1], int(sys.argv[2])
RUNS = [("adamw", "FSDP + AdamW"), ("muon-gather", "FSDP2-Muon (gather)"),
        ("muon-dist", "DMuon-style (dist)"), ("mfsdp", "MatrixFSDP Muon (shim)")]
MUON_BASELINES = [("muon-gather", "FSDP2-Muon"), ("muon-dist", "DMuon-style Muon")]


def parse(name):
    text = open(os.path.join(out, name + ".log")).read()
    steps = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in
             re.finditer(r"^step\s+(\d+) loss (\S+) time_ms (\S+)", text, re.M)]
    final = re.search(r"^final eval_loss (\S+)", text, re.M)
    timing = re.search(r"^timing_ms_per_step.*$", text, re.M)
    rss = re.search(r"^peak_rss_mib:(.*)$", text, re.M)
    if not (steps and final and timing and rss):
        sys.exit(f"demo: {name}.log is incomplete; see {out}/{name}.log")
    t = dict(re.findall(r"(\w+) ([0-9.]+)", timing.group(0).split(":", 1)[1]))
    r = {"steps": steps, "loss": float(final.group(1)), "step_ms": float(t["step"]),
         "optim_ms": float(t["optim"]), "rss": [float(x) for x in rss.group(1).split()],
         "optim_comm_ms": float(t["optim_comm"]), "optim_ns_ms": float(t["optim_ns"])}
    # The shim's per-rank report (MFSDP_REPORT=1): owner-step time is the optimizer.
    rep = re.findall(r"mfsdp report: rank (\d+) .*?steps (\d+) .*?step_ms ([0-9.]+)", text)
    if name == "mfsdp":
        if len(rep) != np_:
            sys.exit(f"demo: expected {np_} 'mfsdp report' lines in {name}.log, got {len(rep)}")
        nsteps = len(steps)
        r["owner_step_ms"] = max(float(ms) for _, _, ms in rep) / nsteps
        r["job_optim_ms"] = r["optim_ms"]
        r["optim_ms"] = r["owner_step_ms"]
    return r


res = {name: parse(name) for name, _ in RUNS}
print()
print(f"{'run':26} {'final loss':>10} {'optimizer ms':>13} {'of it: comm':>12} {'NS':>9} "
      f"{'step ms':>9}  peak RSS MiB per rank")
for name, label in RUNS:
    r = res[name]
    rss = " ".join(f"{x:.0f}" for x in r["rss"])
    # The job's optim_comm / optim_ns timers mean something for the job's own Muon only.
    split = (f"{r['optim_comm_ms']:12.2f} {r['optim_ns_ms']:9.2f}" if name.startswith("muon")
             else f"{'-':>12} {'-':>9}")
    print(f"{label:26} {r['loss']:10.4f} {r['optim_ms']:13.2f} {split} {r['step_ms']:9.2f}  {rss}")
m, a = res["mfsdp"], res["adamw"]
print()


def speedup(base, ours, digits):
    """'N.Nx faster' (or 'N.Nx slower' when ours took longer)."""
    if ours <= base:
        return f"{base / ours:5.{digits}f}x faster"
    return f"{ours / base:5.{digits}f}x SLOWER"


for name, label in MUON_BASELINES:
    b = res[name]
    print(f"optimizer step: MatrixFSDP {speedup(b['optim_ms'], m['optim_ms'], 1)} than {label} "
          f"({m['optim_ms']:.1f} vs {b['optim_ms']:.1f} ms; owner Newton-Schulz, no collective)")
for name, label in MUON_BASELINES:
    b = res[name]
    print(f"whole step:     MatrixFSDP {speedup(b['step_ms'], m['step_ms'], 2)} than {label} "
          f"({m['step_ms']:.1f} vs {b['step_ms']:.1f} ms)")
g, d = res["muon-gather"], res["muon-dist"]
# Same math, other placement: the two baselines' loss traces should coincide.
dev = max(abs(x[1] - y[1]) for x, y in zip(g["steps"], d["steps"]))
print(f"muon-dist vs muon-gather: max |loss difference| over {len(d['steps'])} steps {dev:.2e} "
      f"(same Muon, Newton-Schulz on one rank per matrix instead of all)")
print(f"loss after {len(m['steps'])} steps: Muon (MatrixFSDP) {m['loss']:.4f}, FSDP2-Muon "
      f"{g['loss']:.4f}, DMuon-style {d['loss']:.4f}, AdamW {a['loss']:.4f} -> Muon is "
      f"{'lower' if m['loss'] < a['loss'] else 'NOT lower'} than AdamW")
print(f"(the job's own AdamW under the shim took {m['job_optim_ms']:.2f} ms/step; its updates are"
      f" ignored, run it with a no-op optimizer)")

# Plot: loss and step time per step.
for name, _ in RUNS:
    with open(os.path.join(out, name + ".dat"), "w") as f:
        for s, loss, ms in res[name]["steps"]:
            f.write(f"{s} {loss} {ms}\n")
png = os.path.join(out, "demo.png")
if shutil.which("gnuplot"):
    script = f"""
set terminal pngcairo size 1100,450 noenhanced
set output '{png}'
set multiplot layout 1,2
set xlabel 'step'; set ylabel 'training loss'; set grid; set key top right
set title 'loss ({np_} ranks)'
plot '{out}/adamw.dat' u 1:2 w l lw 2 t 'FSDP + AdamW', \\
     '{out}/muon-gather.dat' u 1:2 w l lw 2 t 'FSDP2-Muon (gather)', \\
     '{out}/muon-dist.dat' u 1:2 w l lw 2 dt 3 t 'DMuon-style (dist)', \\
     '{out}/mfsdp.dat' u 1:2 w l lw 2 dt 2 t 'MatrixFSDP Muon'
set ylabel 'step time (ms)'; set title 'step time'; set logscale y
plot '{out}/adamw.dat' u 1:3 w l lw 2 t 'FSDP + AdamW', \\
     '{out}/muon-gather.dat' u 1:3 w l lw 2 t 'FSDP2-Muon (gather)', \\
     '{out}/muon-dist.dat' u 1:3 w l lw 2 t 'DMuon-style (dist)', \\
     '{out}/mfsdp.dat' u 1:3 w l lw 2 t 'MatrixFSDP Muon'
unset multiplot
"""
    p = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if p.returncode == 0:
        print(f"plot: {png}")
    else:
        print(f"plot failed: {p.stderr.strip()}")
else:
    print("plot skipped: gnuplot not found")
