#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks of examples/fsdp_train against independent references (suite `preload`).

  flavours N   fsdp_train_mpi and fsdp_train_nccl (test-only NCCL over MPI) at N ranks end
               with bitwise identical weights and loss traces, for adamw and muon-gather;
               two identical runs are bitwise identical; training changed the weights.
  adamw N      the N-rank AdamW run vs the single-process --reference --emulate-world N run:
               every tensor within 1e-5 relative (max |a-b| / max |ref|).
  muon N       the N-rank muon-gather run (FSDP2-Muon) vs the single-process full-matrix Muon
               reference (--reference --optim muon-gather --emulate-world N), same tolerance.
  premul N     with --divide-factor 3 (FSDP2's PREMUL_SUM(1/3) reduce-scatter, created right
               before each call) both flavours are bitwise equal, the wire carries PreMulSum
               ops, and AdamW matches the --reference run (1e-5).
  manifest N   the manifest written at N ranks is valid mfsdp-manifest/1 JSON whose groups,
               shapes, optimizer roles and call sequence match the job's FSDP2 layout, and
               the NCCL flavour's calls on the wire (traced by the test-only NCCL library)
               are exactly that sequence with FSDP2's counts S, in-place all-gathers,
               out-of-place float32 avg reduce-scatters, then the final all-gathers.

Weight files hold a text header ending in a line "end" followed by raw float32 data.
"""
import argparse
import array
import json
import math
import os
import re
import subprocess
import sys
import tempfile

MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
COMMON = ["--model", "small", "--seed", "7"]
TOL = 1e-5


def skip(why):
    print(f"SKIP: {why}")
    raise SystemExit(77)  # meson's exit status for a skipped test


def run(cmd, log, env=None):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=150, env=env)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"FAIL: exit status {proc.returncode}: {' '.join(cmd)}")
    return proc.stdout


def job(args, exe, np, extra, out, tag):
    cmd = [args.mpirun, "-np", str(np)] + MPIRUN_FLAGS + [exe] if np else [exe]
    return run(cmd + COMMON + extra + ["--dump-weights", out], out + "." + tag + ".log")


def reference(args, emulate, extra, out):
    cmd = [args.mpi_exe, "--reference", "--emulate-world", str(emulate)]
    return run(cmd + COMMON + extra + ["--dump-weights", out], out + ".log")


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    end = data.index(b"\nend\n") + len(b"\nend\n")
    lines = data[:end].decode().split("\n")
    if lines[0] != "fsdp-train-weights/1":
        raise SystemExit(f"FAIL: {path}: bad header {lines[0]!r}")
    ntensors = int(lines[2].split()[1])
    specs = []
    for line in lines[3:3 + ntensors]:
        f = line.split()
        specs.append((f[0], [int(x) for x in f[2:2 + int(f[1])]]))
    values = array.array("f")
    values.frombytes(data[end:])
    tensors, off = {}, 0
    for name, shape in specs:
        n = math.prod(shape)
        tensors[name] = values[off:off + n]
        off += n
    if off != len(values):
        raise SystemExit(f"FAIL: {path}: {len(values)} floats, header says {off}")
    return specs, tensors


def compare(path_a, path_b, tol, what):
    specs_a, a = load(path_a)
    specs_b, b = load(path_b)
    if specs_a != specs_b:
        raise SystemExit(f"FAIL: {what}: tensor lists differ")
    worst = (0.0, "")
    for name, _ in specs_a:
        ta, tb = a[name], b[name]
        if tol == 0.0:
            if ta.tobytes() != tb.tobytes():
                bad = sum(1 for x, y in zip(ta, tb) if x != y)
                raise SystemExit(f"FAIL: {what}: {name} differs in {bad} of {len(ta)} elements")
            continue
        if any(math.isnan(x) for x in ta):
            raise SystemExit(f"FAIL: {what}: {name} holds NaN")
        scale = max(abs(x) for x in tb) or 1.0
        rel = max(abs(x - y) for x, y in zip(ta, tb)) / scale
        if rel > worst[0]:
            worst = (rel, name)
        if rel > tol:
            raise SystemExit(f"FAIL: {what}: {name} max|a-b|/max|ref| = {rel:.3e} > {tol:g}")
    print(f"ok: {what}: {len(specs_a)} tensors" +
          (" bitwise equal" if tol == 0.0 else f", worst {worst[0]:.3e} ({worst[1]})"))


def losses(text):
    return [line.split()[3] for line in text.splitlines() if line.startswith("step ")]


def check_changed(path_a, path_b, what):
    """The runs must have trained: weights differ from a zero-step run."""
    _, a = load(path_a)
    _, b = load(path_b)
    if all(a[k].tobytes() == b[k].tobytes() for k in a):
        raise SystemExit(f"FAIL: {what}: weights did not change during training")


def cmd_flavours(args, tmp):
    if not args.nccl_exe:
        skip("fsdp_train_nccl was not built (-Dfake_nccl=true needs nccl.h)")
    for optim in ["adamw", "muon-gather"]:
        extra = ["--steps", "12", "--optim", optim]
        a = os.path.join(tmp, f"mpi-{optim}.bin")
        b = os.path.join(tmp, f"nccl-{optim}.bin")
        out_a = job(args, args.mpi_exe, args.np, extra, a, "mpi")
        out_b = job(args, args.nccl_exe, args.np, extra, b, "nccl")
        compare(a, b, 0.0, f"{optim} mpi vs nccl flavour at {args.np} ranks")
        la, lb = losses(out_a), losses(out_b)
        if la != lb or len(la) != 12:
            raise SystemExit(f"FAIL: {optim}: loss traces differ between flavours")
        if optim == "adamw":  # same flags, same bits: the job is deterministic
            c = os.path.join(tmp, "mpi-again.bin")
            out_c = job(args, args.mpi_exe, args.np, extra, c, "again")
            compare(a, c, 0.0, f"{optim} mpi flavour run twice at {args.np} ranks")
            if losses(out_c) != la:
                raise SystemExit("FAIL: loss traces differ between two identical runs")
        z = os.path.join(tmp, "zero.bin")
        job(args, args.mpi_exe, args.np, ["--steps", "0"], z, "zero")
        check_changed(a, z, optim)


def cmd_vs_reference(args, tmp, optim):
    # eps near the gradients' size makes AdamW sensitive to the gradient scale (with 1e-8
    # it is nearly scale-invariant, and so is Muon: a wrong average would go unseen).
    extra = ["--steps", "15", "--optim", optim, "--adamw-eps", "1e-3"]
    if optim == "adamw":
        extra += ["--lr", "0.01"]  # large enough that 15 steps move every tensor visibly
    a = os.path.join(tmp, "sharded.bin")
    r = os.path.join(tmp, "reference.bin")
    out = job(args, args.mpi_exe, args.np, extra, a, "mpi")
    ref = reference(args, args.np, extra, r)
    compare(a, r, TOL, f"{optim} at {args.np} ranks vs single-process reference")
    z = os.path.join(tmp, "zero.bin")
    job(args, args.mpi_exe, args.np, ["--steps", "0"], z, "zero")
    check_changed(a, z, optim)
    # The loss traces agree too (the logging all-reduce sums in another order: 1e-5).
    for x, y in zip(losses(out), losses(ref)):
        if abs(float(x) - float(y)) > TOL * max(1.0, abs(float(y))):
            raise SystemExit(f"FAIL: loss traces differ: {x} vs {y}")


def cmd_premul(args, tmp):
    if not args.nccl_exe:
        skip("fsdp_train_nccl was not built (-Dfake_nccl=true needs nccl.h)")
    factor = "5" if args.np == 3 else "3"  # a factor equal to the world size means AVG
    extra = ["--steps", "10", "--optim", "adamw", "--lr", "0.01", "--adamw-eps", "1e-3",
             "--divide-factor", factor]
    a = os.path.join(tmp, "mpi.bin")
    b = os.path.join(tmp, "nccl.bin")
    r = os.path.join(tmp, "reference.bin")
    trace = os.path.join(tmp, "trace")
    out = job(args, args.mpi_exe, args.np, extra, a, "mpi")
    if "reduce premul_sum" not in out:
        raise SystemExit("FAIL: the job did not select PREMUL_SUM")
    cmd = [args.mpirun, "-np", str(args.np)] + MPIRUN_FLAGS + [args.nccl_exe]
    run(cmd + COMMON + extra + ["--dump-weights", b], b + ".log",
        dict(os.environ, FAKE_NCCL_TRACE=trace))
    compare(a, b, 0.0, f"premul mpi vs nccl flavour at {args.np} ranks")
    for rk in range(args.np):
        with open(f"{trace}.{rk}") as f:
            ops = [int(line.split()[3]) for line in f if line.startswith("reduce_scatter")]
        if not ops or any(op < 5 for op in ops):  # ncclNumOps: dynamic PreMulSum ops
            raise SystemExit(f"FAIL: rank {rk}: reduce-scatter ops {sorted(set(ops))}")
    reference(args, args.np, extra, r)
    compare(a, r, TOL, f"premul adamw at {args.np} ranks vs single-process reference")


def cmd_manifest(args, tmp):
    if not args.nccl_exe:
        skip("fsdp_train_nccl was not built (-Dfake_nccl=true needs nccl.h)")
    for prefetch in [True, False]:
        check_manifest(args, os.path.join(tmp, "prefetch" if prefetch else "no-prefetch"),
                       prefetch)


def check_manifest(args, tmp, prefetch):
    os.mkdir(tmp)
    n, steps = args.np, 2
    path = os.path.join(tmp, "manifest.json")
    trace = os.path.join(tmp, "trace")
    env = dict(os.environ, FAKE_NCCL_TRACE=trace)
    run([args.mpirun, "-np", str(n)] + MPIRUN_FLAGS + [args.nccl_exe] + COMMON +
        ["--steps", str(steps), "--write-manifest", path] +
        ([] if prefetch else ["--no-prefetch"]), path + ".log", env)
    with open(path) as f:
        m = json.load(f)
    V, D, H, C, L = 37, 30, 50, 5, 3  # --model small
    expect_groups = [("root", [("embed.weight", [V, D], "adamw"), ("norm.weight", [D], "adamw"),
                               ("lm_head.weight", [C, D], "adamw"),
                               ("lm_head.bias", [C], "adamw")])]
    for l in range(L):
        p = f"blocks.{l}."
        expect_groups.append((f"blocks.{l}", [(p + "fc1.weight", [H, D], "muon"),
                                              (p + "fc1.bias", [H], "adamw"),
                                              (p + "fc2.weight", [D, H], "muon"),
                                              (p + "fc2.bias", [D], "adamw")]))
    errors = []
    if m.get("format") != "mfsdp-manifest/1" or m.get("world_size") != n:
        errors.append("format/world_size")
    got = [(g["name"], [(p["name"], p["shape"], p["optimizer"]) for p in g["params"]])
           for g in m["groups"]]
    if got != expect_groups:
        errors.append(f"groups {got}")
    for g in m["groups"]:
        if g.get("reduce_dtype") != "float32" or any(p["dtype"] != "float32" for p in g["params"]):
            errors.append(f"dtypes of {g['name']}")
        # The default rule (>= 2 dims except embed|lm_head|wte|wpe) gives the same roles.
        for p in g["params"]:
            rule = "muon" if len(p["shape"]) >= 2 and not re.search(
                "embed|lm_head|wte|wpe", p["name"]) else "adamw"
            if rule != p["optimizer"]:
                errors.append(f"role of {p['name']}")
    seq = [tuple(c) for c in m["sequence"]]
    want = [("allgather", "root")] + [("allgather", f"blocks.{l}") for l in range(L)]
    # Backward: FSDP2 prefetches block l-1's all-gather before block l's reduce-scatter.
    for l in range(L - 1, -1, -1):
        if l == L - 1 or not prefetch:
            want.append(("allgather", f"blocks.{l}"))
        if prefetch and l > 0:
            want.append(("allgather", f"blocks.{l - 1}"))
        want.append(("reduce_scatter", f"blocks.{l}"))
    want.append(("reduce_scatter", "root"))
    if seq != want:
        errors.append(f"sequence {seq}")
    opt = m["optimizer"]
    if opt["lr"] != 0.02 or opt["adamw"]["lr"] != 0.001 or opt["ns_steps"] != 5:
        errors.append(f"optimizer {opt}")
    if errors:
        raise SystemExit("FAIL: manifest: " + "; ".join(errors))
    # FSDP2's per-rank count S (c = ceil(N0/n) rows per rank, no alignment padding), computed
    # here from the shapes alone, against the calls the job made.
    S = {name: sum(-(-shape[0] // n) * math.prod(shape[1:]) for _, shape, _ in params)
         for name, params in expect_groups}
    f32, avg = 7, (4 if n > 1 else 0)  # ncclFloat32; ncclAvg (ncclSum at one rank, as FSDP2)
    wire = []
    for _ in range(steps):
        for kind, group in seq:
            if kind == "allgather":
                wire.append(f"allgather {S[group]} {f32} 0 1 {n}")
            else:
                wire.append(f"reduce_scatter {S[group]} {f32} {avg} 0 {n}")
        wire.append(f"allreduce 1 {f32} 0 1 {n}")  # the logged loss
    wire += [f"allgather {S[name]} {f32} 0 1 {n}" for name, _ in expect_groups]  # final gather
    for r in range(n):
        with open(f"{trace}.{r}") as f:
            calls = f.read().splitlines()
        if calls != wire:
            for i, (a, b) in enumerate(zip(calls, wire)):
                if a != b:
                    raise SystemExit(f"FAIL: rank {r} call {i}: got '{a}', want '{b}'")
            raise SystemExit(f"FAIL: rank {r}: {len(calls)} calls, want {len(wire)}")
    print(f"ok: manifest and {len(wire)} calls on the wire per rank match FSDP2 at {n} ranks"
          f" ({'' if prefetch else 'no '}prefetch): "
          + ", ".join(f"{k} S={v}" for k, v in S.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["flavours", "adamw", "muon", "premul", "manifest"])
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--mpi-exe", required=True)
    ap.add_argument("--nccl-exe", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp_train_check.") as tmp:
        if args.mode == "flavours":
            cmd_flavours(args, tmp)
        elif args.mode == "adamw":
            cmd_vs_reference(args, tmp, "adamw")
        elif args.mode == "muon":
            cmd_vs_reference(args, tmp, "muon-gather")
        elif args.mode == "premul":
            cmd_premul(args, tmp)
        else:
            cmd_manifest(args, tmp)


if __name__ == "__main__":
    main()
