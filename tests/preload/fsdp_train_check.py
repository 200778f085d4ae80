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
  muon-dist N  --optim muon-dist (DMuon-style: matrix j's momentum update gathered to rank
               j mod N, Newton-Schulz there, the update scattered back, in chunks of N
               matrices) against --optim
               muon-gather at N ranks, also with an unused Muon matrix (--unused collide):
               every tensor and every loss within DIST_TOL relative (same arithmetic, another
               placement; in practice bitwise); the NCCL flavour is bitwise equal to the MPI
               flavour and its wire is the AdamW run's FSDP calls plus, per step, exactly the
               gathers and scatters that round-robin placement gives (ncclSend/ncclRecv of
               each matrix's padded shard count S; per chunk of N matrices the gathers, then
               the scatters) and no optimizer all-gather.
  manifest N   the manifest written at N ranks is valid mfsdp-manifest/1 JSON whose groups,
               shapes, optimizer roles and call sequence match the job's FSDP2 layout, and
               the NCCL flavour's calls on the wire (traced by the test-only NCCL library)
               are exactly that sequence with FSDP2's counts S, in-place all-gathers,
               out-of-place float32 avg reduce-scatters, then the final all-gathers.

  mode CASE N  one FSDP2 situation of the job (--unused, --accum/--accum-mode, --eval-every,
               --wrap torchtitan, --divide, --hsdp, --schedule, --clip, and combinations;
               CASES below) at N ranks: the AdamW and the muon-gather runs match the
               single-process --reference with the same flags (1e-5 relative per tensor, loss,
               eval-loss and grad-norm traces too) and, where the mode does not change the
               math, the plain reference (accumulation over K micro-batches = K*N emulated
               ranks, torchtitan wrapping = default wrapping, eval passes = none, HSDP and
               the divide modes = the plain average, an unused param = its absence); both
               flavours are bitwise equal; a param without gradient never changes (no
               optimizer state, no weight decay); the manifests of both flavours are valid
               (groups, world_size, replicate, training, optimizer.schedule/max_norm; with
               --plan, mfsdp-plan accepts them) and the
               NCCL flavour's wire (FAKE_NCCL_TRACE) is exactly what FSDP2's rules, derived
               here independently, give (counts, ops, HSDP all-reduces on the replicate group
               after each reduce-scatter, clip and loss all-reduces, final gathers), and the
               manifest's `sequence`, repeated with its optional entries, is that wire.
  unused-counts  at 1..4 ranks: --unused collide gives blocks.0 a unique all-gather count and
               a reduce-scatter count equal to the other blocks' on the wire, --unused unique a
               unique reduce-scatter count, each explained by exactly one set of missing
               params.
  errors       every refused flag value and mode combination stops the job with its message.

Weight files hold a text header ending in a line "end" followed by raw float32 data.
"""
import argparse
import array
import itertools
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
# muon-dist vs muon-gather: the same float32 operations on the same values (NS on the
# same gathered matrix); only a BLAS whose results depended on buffer placement could differ.
DIST_TOL = 1e-6


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


def dist_p2p_expected(shapes, n, rank, steps):
    """The P2P calls of --optim muon-dist on one rank, in issue order, as trace lines
    without the stream: per step, per chunk of n consecutive Muon matrices, a gather of each
    to its owner (j mod n), then a scatter of each from its owner. The owner's own block does
    not travel."""
    one = []
    for c0 in range(0, len(shapes), n):
        chunk = list(enumerate(shapes))[c0:c0 + n]
        for phase in ("gather", "scatter"):
            for j, shape in chunk:
                owner, s = j % n, shard_numel(shape, n)
                to_owner = phase == "gather"
                if rank != owner:
                    one.append(f"{'send' if to_owner else 'recv'} {s} 7 0 0 {n}")
                else:
                    kind = "recv" if to_owner else "send"
                    one += [f"{kind} {s} 7 0 0 {n}"] * (n - 1)
    return one * steps


def cmd_muon_dist(args, tmp):
    steps = 12
    for flags in ([], ["--unused", "collide"]):
        tag = " ".join(flags) or "plain"
        extra = ["--steps", str(steps), "--adamw-eps", "1e-3"] + flags
        g = os.path.join(tmp, "gather.bin")
        d = os.path.join(tmp, "dist.bin")
        out_g = job(args, args.mpi_exe, args.np, extra + ["--optim", "muon-gather"], g, "gather")
        out_d = job(args, args.mpi_exe, args.np, extra + ["--optim", "muon-dist"], d, "dist")
        if "optim muon-dist" not in out_d:
            raise SystemExit("FAIL: the job did not report optim muon-dist")
        compare(d, g, DIST_TOL, f"muon-dist vs muon-gather ({tag}) at {args.np} ranks")
        close_traces([float(x) for x in losses(out_d)], [float(x) for x in losses(out_g)],
                     f"muon-dist vs muon-gather losses ({tag})", DIST_TOL)
        if len(losses(out_d)) != steps:
            raise SystemExit(f"FAIL: {len(losses(out_d))} step lines, want {steps}")
        fd, fg = (float(re.search(r"^final eval_loss (\S+)", o, re.M).group(1))
                  for o in (out_d, out_g))
        if abs(fd - fg) > DIST_TOL * max(1.0, abs(fg)):
            raise SystemExit(f"FAIL: final eval loss {fd} (muon-dist) vs {fg} (muon-gather)")
        z = os.path.join(tmp, "zero.bin")
        job(args, args.mpi_exe, args.np, ["--steps", "0"] + flags, z, "zero")
        check_changed(d, z, f"muon-dist ({tag})")
        print(f"ok: muon-dist ({tag}) at {args.np} ranks: {steps} losses, final eval loss "
              f"{fd:.7f} vs {fg:.7f}")
        if not args.nccl_exe:
            print("note: fsdp_train_nccl was not built: the NCCL flavour's wire is not checked")
            continue
        nd = os.path.join(tmp, "nccl-dist.bin")
        na = os.path.join(tmp, "nccl-adamw.bin")
        cmd = [args.mpirun, "-np", str(args.np)] + MPIRUN_FLAGS + [args.nccl_exe] + COMMON
        tr_d, tr_a = os.path.join(tmp, "trace-dist"), os.path.join(tmp, "trace-adamw")
        for path in [f"{t}.{rk}" for t in (tr_d, tr_a) for rk in range(args.np)]:
            if os.path.exists(path):
                os.remove(path)  # the library appends
        run(cmd + extra + ["--optim", "muon-dist", "--dump-weights", nd], nd + ".log",
            dict(os.environ, FAKE_NCCL_TRACE=tr_d))
        run(cmd + extra + ["--optim", "adamw", "--dump-weights", na], na + ".log",
            dict(os.environ, FAKE_NCCL_TRACE=tr_a))
        compare(d, nd, 0.0, f"muon-dist mpi vs nccl flavour ({tag}) at {args.np} ranks")
        specs, _ = load(d)
        unused = {"blocks.0.gate.weight"} if "collide" in flags else set()
        mats = [shape for name, shape in specs
                if re.fullmatch(r"blocks\.\d+\.(fc1|fc2|gate)\.weight", name)
                and name not in unused]
        for rk in range(args.np):
            wd, wa = wire_lines(f"{tr_d}.{rk}"), wire_lines(f"{tr_a}.{rk}")
            p2p = [x for x in wd if x.split()[0] in ("send", "recv")]
            rest = [x for x in wd if x.split()[0] not in ("send", "recv")]
            if rest != wa:
                raise SystemExit(f"FAIL: rank {rk}: muon-dist's collectives are not exactly the "
                                 f"AdamW run's ({len(rest)} vs {len(wa)} calls)")
            want = dist_p2p_expected(mats, args.np, rk, steps)
            if p2p != want:
                raise SystemExit(f"FAIL: rank {rk}: muon-dist's P2P calls ({len(p2p)}) are not "
                                 f"the round-robin gathers and scatters ({len(want)})")
        print(f"ok: muon-dist ({tag}) NCCL wire at {args.np} ranks: {len(mats)} matrices, "
              f"round-robin gathers then scatters per chunk, no optimizer all-gather")


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
        calls = wire_lines(f"{trace}.{r}")
        if calls != wire:
            for i, (a, b) in enumerate(zip(calls, wire)):
                if a != b:
                    raise SystemExit(f"FAIL: rank {r} call {i}: got '{a}', want '{b}'")
            raise SystemExit(f"FAIL: rank {r}: {len(calls)} calls, want {len(wire)}")
    print(f"ok: manifest and {len(wire)} calls on the wire per rank match FSDP2 at {n} ranks"
          f" ({'' if prefetch else 'no '}prefetch): "
          + ", ".join(f"{k} S={v}" for k, v in S.items()))



# ---- modes: the FSDP2 situations of examples/fsdp_train ---------------------------------

SMALL = (37, 30, 50, 5, 3)  # --model small: V, D, H, C, L
GATE_ROWS = 4  # blocks.0.gate.weight [4, D] of --unused collide
MODE_STEPS = 6
F32, NCCL_SUM, NCCL_AVG = 7, 0, 4  # ncclFloat32, ncclSum, ncclAvg

# case -> job flags (the np comes from meson). Steps, seed, model and the AdamW settings
# that make AdamW sensitive to the gradient scale are added by cmd_mode.
CASES = {
    "unused-collide": ["--unused", "collide", "--wd", "0.1"],
    "unused-unique": ["--unused", "unique", "--wd", "0.1"],
    "accum-nosync-2": ["--accum", "2", "--accum-mode", "nosync"],
    "accum-nosync-4": ["--accum", "4"],  # nosync is the default
    "accum-sync-2": ["--accum", "2", "--accum-mode", "sync"],
    "accum-sync-4": ["--accum", "4", "--accum-mode", "sync"],
    "eval": ["--eval-every", "2"],
    "torchtitan": ["--wrap", "torchtitan"],
    "torchtitan-eval-noprefetch": ["--wrap", "torchtitan", "--eval-every", "3", "--no-prefetch"],
    "divide-fp16": ["--divide", "fp16"],
    "divide-force-sum": ["--divide", "force-sum"],
    "divide-fp16-factor": ["--divide", "fp16", "--divide-factor", "6"],  # pre 4, post 1.5
    "hsdp-premul": ["--hsdp", "2", "--divide-factor", "3"],  # PREMUL_SUM(1/3), then SUM
    "hsdp-1": ["--hsdp", "1"],
    "hsdp-2": ["--hsdp", "2"],
    "hsdp-4": ["--hsdp", "4"],
    "schedule-cosine": ["--schedule", "warmup-cosine:2:3:0.1"],
    "schedule-linear": ["--schedule", "warmup-linear:1:3"],
    "schedule-wsd": ["--schedule", "wsd:1:2:2:0.1:sqrt"],
    "clip": ["--clip", "0.5"],
    "combo-titan": ["--wrap", "torchtitan", "--unused", "collide", "--accum", "2",
                    "--eval-every", "2", "--schedule", "warmup-linear:2:6", "--clip", "0.5",
                    "--hsdp", "2"],
    "combo-default": ["--unused", "unique", "--accum", "2", "--accum-mode", "sync",
                      "--eval-every", "1", "--divide", "fp16", "--no-prefetch"],
}


def mode_config(flags, np_):
    """The job's flags as a config (parsed here, independently of the job)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--unused", default="")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--accum-mode", default="nosync")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--wrap", default="default")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--divide", default="")
    ap.add_argument("--divide-factor", type=float, default=0.0)
    ap.add_argument("--hsdp", type=int, default=0)
    ap.add_argument("--schedule", default="")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--wd", type=float, default=0.0)
    cfg, _ = ap.parse_known_args(flags)
    cfg.n = np_
    cfg.R = cfg.hsdp or 1
    cfg.s = np_ // cfg.R  # shard group size
    cfg.sync = cfg.accum_mode == "sync"
    cfg.titan = cfg.wrap == "torchtitan"
    cfg.factor = cfg.divide_factor or float(np_)  # FSDP2's divide factor (default: dp size)
    cfg.premul = cfg.divide == "" and cfg.factor != np_
    return cfg


def mode_groups(cfg):
    """Groups in forward order with their params (name, shape), as FSDP2 builds them."""
    V, D, H, C, L = SMALL
    blocks = []
    for l in range(L):
        p = f"blocks.{l}."
        ps = [(p + "fc1.weight", [H, D]), (p + "fc1.bias", [H])]
        if l == 0 and cfg.unused == "collide":  # child module gate, registered between fc1/fc2
            ps.append((p + "gate.weight", [GATE_ROWS, D]))
        ps += [(p + "fc2.weight", [D, H]), (p + "fc2.bias", [D])]
        blocks.append((f"blocks.{l}", ps))
    embed = ("embed.weight", [V, D])
    head = [("norm.weight", [D]), ("lm_head.weight", [C, D]), ("lm_head.bias", [C])]
    if cfg.titan:
        return [("embed", [embed])] + blocks + [("output", head)]
    return [("root", [embed] + head)] + blocks


def mode_unused(cfg):
    return {"collide": {"blocks.0.gate.weight"}, "unique": {"blocks.0.fc2.bias"}}.get(
        cfg.unused, set())


def shard_numel(shape, n):
    return -(-shape[0] // n) * math.prod(shape[1:])


def mode_counts(cfg, groups, n):
    unused = mode_unused(cfg)
    S = {g: sum(shard_numel(sh, n) for _, sh in ps) for g, ps in groups}
    S_rs = {g: sum(shard_numel(sh, n) for name, sh in ps if name not in unused)
            for g, ps in groups}
    return S, S_rs


class Fsdp2Model:
    """FSDP2's all-gather/reduce-scatter order (notes/fsdp2-internals.md section 8): groups
    unshard when not unsharded; every group but the default root reshards after forward; the
    backward visits groups in reverse post-forward order (the default root's post-forward
    comes after the blocks'), each pre-backward unshards its group and prefetches the next;
    each post-backward reduce-scatters (when gradients sync) and reshards."""

    def __init__(self, cfg, names):
        self.cfg = cfg
        self.fwd = names
        self.keep = set() if cfg.titan else {"root"}  # reshard_after_forward=False
        self.unsharded = set()
        self.post_fwd = names[1:] + ["root"] if not cfg.titan else names

    def unshard(self, g, out):
        if g not in self.unsharded:
            self.unsharded.add(g)
            out.append(("allgather", g))

    def forward(self, out):
        for g in self.fwd:
            self.unshard(g, out)
            if g not in self.keep:
                self.unsharded.discard(g)

    def train(self, sync, out):
        self.forward(out)
        order = list(reversed(self.post_fwd))

        def pre(i):
            self.unshard(order[i], out)
            if not self.cfg.no_prefetch and i + 1 < len(order):
                self.unshard(order[i + 1], out)

        def post(g):
            if sync:
                out.append(("reduce_scatter", g))
            self.unsharded.discard(g)

        if self.cfg.titan:
            for i, g in enumerate(order):
                pre(i)
                post(g)
        else:  # the root's backward brackets the blocks'; its post-backward comes last
            pre(0)
            for i in range(1, len(order)):
                pre(i)
                post(order[i])
            post("root")


def mode_expected(cfg, steps):
    """Every call of a run on the NCCL wire of one rank (trace lines) and the labels of its
    all-gathers and reduce-scatters before the final gathers."""
    groups = mode_groups(cfg)
    names = [g for g, _ in groups]
    S, S_rs = mode_counts(cfg, groups, cfg.s)
    # _get_gradient_divide_factors: avg (sum at one rank) for both, or PreMulSum then sum,
    # or sum for both (fp16, force_sum). A PreMulSum op is a dynamic op id >= ncclNumOps.
    op = NCCL_AVG if (cfg.divide == "" and cfg.n > 1) else NCCL_SUM
    rs_op, ar_op = ("premul", NCCL_SUM) if cfg.premul else (op, op)
    nused = sum(1 for _, ps in groups for name, _ in ps if name not in mode_unused(cfg))
    m = Fsdp2Model(cfg, names)
    labels, lines = [], []

    def emit(calls):
        labels.extend(calls)
        for kind, g in calls:
            if kind == "allgather":
                lines.append(f"allgather {S[g]} {F32} 0 1 {cfg.s}")
            else:
                lines.append(f"reduce_scatter {S_rs[g]} {F32} {rs_op} 0 {cfg.s}")
                if cfg.hsdp:  # HSDP: all-reduce of the output over the replicate group
                    lines.append(f"allreduce {S_rs[g]} {F32} {ar_op} 1 {cfg.R}")

    for t in range(steps):
        for k in range(cfg.accum):
            calls = []
            m.train(cfg.sync or k == cfg.accum - 1, calls)
            emit(calls)
        if cfg.clip:
            lines.append(f"allreduce {nused} {F32} {NCCL_SUM} 1 {cfg.s}")
        lines.append(f"allreduce 1 {F32} {NCCL_SUM} 1 {cfg.n}")  # the logged loss
        if cfg.eval_every and (t + 1) % cfg.eval_every == 0:
            calls = []
            m.forward(calls)
            emit(calls)
            lines.append(f"allreduce 1 {F32} {NCCL_SUM} 1 {cfg.n}")  # the eval loss
    lines += [f"allgather {S[g]} {F32} 0 1 {cfg.s}" for g in names]  # final gather
    return labels, lines, S, S_rs


def wire_lines(path):
    """A rank's trace lines without their last column, the stream: the job passes the NULL
    stream (host memory), checked here."""
    lines = []
    with open(path) as f:
        for line in f.read().splitlines():
            w = line.split()
            if len(w) != 7 or w[6] != "0x0":
                raise SystemExit(f"FAIL: {path}: '{line}' is not a call on the NULL stream")
            lines.append(" ".join(w[:6]))
    return lines


def premul_op(line):
    """A trace line with a reduce-scatter's dynamic PreMulSum op id written as "premul"."""
    f = line.split()
    if f[0] == "reduce_scatter" and int(f[3]) >= 5:  # ncclNumOps
        f[3] = "premul"
    return " ".join(f)


def match_sequence(seq, stream, what):
    """stream must be seq repeated, an "optional" entry possibly absent. Returns the number
    of sequence entries consumed."""
    if not seq:
        raise SystemExit(f"FAIL: {what}: empty sequence")
    i = 0
    for pos, call in enumerate(stream):
        skipped = 0
        while True:
            e = seq[i % len(seq)]
            if (e[0], e[1]) == call:
                i += 1
                break
            if len(e) == 3 and e[2] == "optional" and skipped < len(seq):
                i += 1
                skipped += 1
                continue
            raise SystemExit(f"FAIL: {what}: call {pos} is {call}, the sequence expects "
                             f"{e} (entry {i % len(seq)})")
    return i


def lr_factor(spec, t):
    """torchtitan's schedule (docs/manifest.md), from the --schedule spec."""
    f = spec.split(":")
    kind = f[0]
    W = int(f[1])
    S = int(f[2]) if kind == "wsd" else 0
    rest = f[3:] if kind == "wsd" else f[2:]
    D = int(rest[0])
    m = float(rest[1]) if len(rest) > 1 else 0.0
    decay = rest[2] if len(rest) > 2 else ("cosine" if kind == "warmup-cosine" else "linear")
    t = min(t, W + S + D)
    if t < W:
        return (t + 1) / (W + 1)
    if t < W + S or D == 0:
        return 1.0
    p = (t + 1 - W - S) / (D + 1)
    a = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "sqrt": 1 - math.sqrt(p)}
    return m + (1 - m) * a[decay]


def schedule_json(spec):
    f = spec.split(":")
    kind = f[0]
    d = {"kind": kind, "warmup_steps": int(f[1])}
    rest = f[2:]
    if kind == "wsd":
        d["stable_steps"] = int(f[2])
        rest = f[3:]
    d["decay_steps"] = int(rest[0])
    if kind == "wsd":
        d["decay"] = rest[2] if len(rest) > 2 else "linear"
    d["min_lr_ratio"] = float(rest[1]) if len(rest) > 1 else 0.0
    return d


def fp16_post(factor):
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return factor / pre


def field(text, key):
    """Values of ' key X' in the step lines (or the eval lines for key 'eval')."""
    if key == "eval":
        return [float(l.split()[3]) for l in text.splitlines() if l.startswith("eval ")]
    out = []
    for l in text.splitlines():
        if l.startswith("step "):
            f = l.split()
            out.append(float(f[f.index(key) + 1]) if key in f else None)
    return out


def close_traces(a, b, what, tol=TOL):
    if len(a) != len(b) or not a:
        raise SystemExit(f"FAIL: {what}: {len(a)} vs {len(b)} values")
    for x, y in zip(a, b):
        if x is None or y is None or abs(x - y) > tol * max(1.0, abs(y)):
            raise SystemExit(f"FAIL: {what}: {a} vs {b}")


def compare_named(path_a, path_b, tol, what):
    """Tensors of b by name in a (a may hold more), max |a-b| / max |b| each; the worst."""
    _, a = load(path_a)
    specs_b, b = load(path_b)
    worst = (-1.0, "")
    for name, _ in specs_b:
        if name not in a or len(a[name]) != len(b[name]):
            raise SystemExit(f"FAIL: {what}: {name} missing or of another size")
        scale = max(abs(x) for x in b[name]) or 1.0
        rel = max(abs(x - y) for x, y in zip(a[name], b[name])) / scale
        if rel > worst[0]:
            worst = (rel, name)
    if worst[0] > tol:
        raise SystemExit(f"FAIL: {what}: {worst[1]} max|a-b|/max|ref| = {worst[0]:.3e} > {tol:g}")
    print(f"ok: {what}: {len(specs_b)} tensors, worst {worst[0]:.3e} ({worst[1]})")
    return worst[0]


def check_mode_manifest(cfg, m, flavour, what):
    groups = mode_groups(cfg)
    errors = []
    if m.get("format") != "mfsdp-manifest/1" or m.get("world_size") != cfg.s:
        errors.append(f"format/world_size {m.get('world_size')}")
    if m.get("replicate") != cfg.R:
        errors.append(f"replicate {m.get('replicate')}")
    got = [(g["name"], [(p["name"], p["shape"]) for p in g["params"]]) for g in m["groups"]]
    if got != groups:
        errors.append(f"groups {got}")
    for g in m["groups"]:
        for p in g["params"]:
            rule = "muon" if len(p["shape"]) >= 2 and not re.search(
                "embed|lm_head|wte|wpe", p["name"]) else "adamw"
            if p.get("optimizer") != rule or p.get("dtype") != "float32":
                errors.append(f"role/dtype of {p['name']}")
    tr = m.get("training", {})
    if tr.get("micro_steps") != (cfg.accum if cfg.sync else 1):
        errors.append(f"training.micro_steps {tr.get('micro_steps')}")
    if cfg.divide == "fp16":
        want = fp16_post(cfg.factor)
    elif cfg.divide == "force-sum":
        want = "force_sum" if cfg.factor == cfg.n else cfg.factor
    elif flavour == "nccl":
        want = "fsdp2"  # avg, sum at one rank, PreMulSum: applied as they are
    else:
        want = 1 if cfg.premul else "world"  # MPI: scaled contributions, or SUM then / n
    if tr.get("grad_divide") != want:
        errors.append(f"training.grad_divide {tr.get('grad_divide')!r}, want {want!r}")
    if tr.get("step") != ("lazy" if cfg.clip else None):
        errors.append(f"training.step {tr.get('step')}")
    opt = m["optimizer"]
    if opt.get("max_norm") != (cfg.clip or None):
        errors.append(f"optimizer.max_norm {opt.get('max_norm')}")
    if opt.get("schedule") != (schedule_json(cfg.schedule) if cfg.schedule else None):
        errors.append(f"optimizer.schedule {opt.get('schedule')}")
    if opt["lr"] != 0.02 or opt["adamw"]["lr"] != 0.01 or opt["adamw"]["eps"] != 1e-3:
        errors.append(f"optimizer {opt}")
    # "optional" only where a call is absent in some iterations: the root's first
    # all-gather of a cycle that follows an eval pass (the root stays unsharded).
    optional = [i for i, e in enumerate(m["sequence"]) if len(e) == 3]
    want_opt = [0] if (cfg.eval_every and not cfg.titan) else []
    if optional != want_opt or (optional and m["sequence"][0][:2] != ["allgather", "root"]):
        errors.append(f"optional entries {optional}")
    if errors:
        raise SystemExit(f"FAIL: {what}: manifest: " + "; ".join(errors))


def cmd_mode(args, tmp, case):
    if not args.nccl_exe:
        skip("fsdp_train_nccl was not built (-Dfake_nccl=true needs nccl.h)")
    n = args.np
    flags = CASES[case]
    cfg = mode_config(flags, n)
    base = ["--steps", str(MODE_STEPS), "--adamw-eps", "1e-3", "--adamw-lr", "0.01"]
    worst = 0.0
    outs = {}
    for optim in ["adamw", "muon-gather"]:
        extra = base + ["--optim", optim] + flags
        a = os.path.join(tmp, f"mpi-{optim}.bin")
        b = os.path.join(tmp, f"nccl-{optim}.bin")
        r = os.path.join(tmp, f"ref-{optim}.bin")
        man = {fl: os.path.join(tmp, f"{fl}-{optim}.json") for fl in ["mpi", "nccl"]}
        trace = os.path.join(tmp, f"trace-{optim}")
        out_a = job(args, args.mpi_exe, n, extra + ["--write-manifest", man["mpi"]], a, "mpi")
        cmd = [args.mpirun, "-np", str(n)] + MPIRUN_FLAGS + [args.nccl_exe]
        env = dict(os.environ, FAKE_NCCL_TRACE=trace) if optim == "adamw" else None
        out_b = run(cmd + COMMON + extra + ["--write-manifest", man["nccl"], "--dump-weights", b],
                    b + ".log", env)
        out_r = reference(args, n, extra, r)
        outs[optim] = out_a
        # Both flavours: bitwise the same weights and traces.
        compare(a, b, 0.0, f"{case} {optim} mpi vs nccl flavour at {n} ranks")
        if losses(out_a) != losses(out_b) or field(out_a, "eval") != field(out_b, "eval"):
            raise SystemExit(f"FAIL: {optim}: loss traces differ between flavours")
        # The reference with the same mode.
        worst = max(worst, compare_named(a, r, TOL, f"{case} {optim} at {n} ranks vs reference"))
        close_traces(field(out_a, "loss"), field(out_r, "loss"), "loss trace vs reference")
        if cfg.eval_every:
            ev = field(out_a, "eval")
            if len(ev) != MODE_STEPS // cfg.eval_every:
                raise SystemExit(f"FAIL: {len(ev)} eval lines")
            close_traces(ev, field(out_r, "eval"), "eval-loss trace vs reference")
        if cfg.clip:
            norms = field(out_a, "grad_norm")
            close_traces(norms, field(out_r, "grad_norm"), "grad-norm trace vs reference")
            if not any(x > cfg.clip for x in norms):
                raise SystemExit(f"FAIL: clipping never engaged (norms {norms})")
        if cfg.schedule:
            got = field(out_a, "lr_factor")
            want = [lr_factor(cfg.schedule, t) for t in range(MODE_STEPS)]
            close_traces(got, want, "lr factors vs torchtitan's formula", 1e-8)
        # Where the mode does not change the math, the plain reference gives the same.
        alt = [x for x in flags]
        alt_n = n
        for drop in ["--eval-every", "--wrap", "--divide", "--hsdp", "--accum"]:
            if drop in alt:
                i = alt.index(drop)
                del alt[i:i + 2]
        if "--accum-mode" in alt:
            i = alt.index("--accum-mode")
            del alt[i:i + 2]
        if cfg.unused == "collide":  # the gate changes nothing else
            i = alt.index("--unused")
            del alt[i:i + 2]
        if cfg.accum > 1:  # K micro-batches at n ranks train on the data of K*n ranks
            alt_n = n * cfg.accum
        if alt != flags or alt_n != n:
            r2 = os.path.join(tmp, f"alt-{optim}.bin")
            out_r2 = reference(args, alt_n, base + ["--optim", optim] + alt, r2)
            worst = max(worst, compare_named(a, r2, TOL, f"{case} {optim} vs reference "
                                             f"{' '.join(alt) or '(plain)'} at {alt_n}"))
            close_traces(field(out_a, "loss"), field(out_r2, "loss"), "loss vs plain reference")
        if cfg.schedule or cfg.clip:  # the schedule / the clipping changed the result
            plain = [x for x in flags]
            for drop in ["--schedule", "--clip"]:
                if drop in plain:
                    i = plain.index(drop)
                    del plain[i:i + 2]
            r3 = os.path.join(tmp, f"noop-{optim}.bin")
            reference(args, n, base + ["--optim", optim] + plain, r3)
            _, x = load(a)
            _, y = load(r3)
            if all(max(abs(p - q) for p, q in zip(x[k], y[k])) <= 1e-4 * (max(map(abs, y[k])) or 1)
                   for k in y):
                raise SystemExit(f"FAIL: {optim}: --schedule/--clip changed nothing")
        # A param without gradient keeps its initial value (no state, no weight decay).
        z = os.path.join(tmp, "zero.bin")
        reference(args, n, ["--steps", "0"] + flags, z)
        check_changed(a, z, f"{case} {optim}")
        _, w0 = load(z)
        for path in [a, r]:
            _, w = load(path)
            for name in mode_unused(cfg):
                if w[name].tobytes() != w0[name].tobytes():
                    raise SystemExit(f"FAIL: {optim}: {name} (no gradient) changed in {path}")
        if mode_unused(cfg):
            print(f"ok: {optim}: {', '.join(sorted(mode_unused(cfg)))} unchanged "
                  f"(wd {cfg.wd}) in the job and the reference")
        # Manifests of both flavours, and the wire.
        for fl in ["mpi", "nccl"]:
            with open(man[fl]) as f:
                check_mode_manifest(cfg, json.load(f), fl, f"{case} {fl} {optim}")
            if args.plan:  # the project's strict parser and planner accept it
                run([args.plan, man[fl], "--world-size", str(cfg.s)], man[fl] + ".plan.log")
        with open(man["mpi"]) as f:
            seq_mpi = json.load(f)["sequence"]
        with open(man["nccl"]) as f:
            seq = json.load(f)["sequence"]
        if seq != seq_mpi:
            raise SystemExit("FAIL: the flavours' manifests give different sequences")
    labels, want, S, S_rs = mode_expected(cfg, MODE_STEPS)
    for rk in range(n):
        calls = [premul_op(l) for l in wire_lines(f"{os.path.join(tmp, 'trace-adamw')}.{rk}")]
        if calls != want:
            for i, (x, y) in enumerate(zip(calls, want)):
                if x != y:
                    raise SystemExit(f"FAIL: rank {rk} call {i}: got '{x}', FSDP2 gives '{y}'")
            raise SystemExit(f"FAIL: rank {rk}: {len(calls)} calls, FSDP2 gives {len(want)}")
    # The manifest's sequence, repeated, is the wire: by label and, independently of the
    # labels, by the (kind, count) of each all-gather and reduce-scatter on the wire.
    used = match_sequence(seq, labels, "sequence vs FSDP2's calls")
    with open(f"{os.path.join(tmp, 'trace-adamw')}.0") as f:
        wire = [l.split() for l in f.read().splitlines()]
    wire = [(w[0], int(w[1])) for w in wire if w[0] in ("allgather", "reduce_scatter")]
    wire = wire[:len(wire) - len(S)]  # the final gathers follow training
    by_count = [(e[0], S[e[1]] if e[0] == "allgather" else S_rs[e[1]]) + tuple(e[2:])
                for e in seq]
    match_sequence(by_count, wire, "sequence vs the wire's counts")
    cycles = used / len(seq)
    print(f"ok: {case} at {n} ranks: {len(want)} calls per rank on the wire are FSDP2's; the "
          f"manifest's {len(seq)}-call sequence ({sum(len(e) == 3 for e in seq)} optional) "
          f"repeats {cycles:.2f} times over them; worst error vs references {worst:.3e}")
    short = [("RS " if e[0] == "reduce_scatter" else "AG ") + e[1] + ("?" if len(e) == 3 else "")
             for e in seq]
    print("sequence: " + ", ".join(short))


def cmd_unused_counts(args, tmp):
    """The collision of --unused collide and the uniqueness of --unused unique, on the wire at
    1..4 ranks; the missing params are the only set of blocks.0's params whose shard sizes
    explain the shrunken count."""
    if not args.nccl_exe:
        skip("fsdp_train_nccl was not built (-Dfake_nccl=true needs nccl.h)")
    for n in range(1, 5):
        for kind in ["collide", "unique"]:
            flags = ["--unused", kind]
            cfg = mode_config(flags, n)
            trace = os.path.join(tmp, f"trace-{kind}-{n}")
            man = os.path.join(tmp, f"{kind}-{n}.json")
            cmd = [args.mpirun, "-np", str(n)] + MPIRUN_FLAGS + [args.nccl_exe]
            run(cmd + COMMON + ["--steps", "1", "--optim", "none", "--write-manifest", man] + flags,
                man + ".log", dict(os.environ, FAKE_NCCL_TRACE=trace))
            labels, _, _, _ = mode_expected(cfg, 1)
            with open(f"{trace}.0") as f:
                wire = [l.split() for l in f.read().splitlines()]
            wire = [(w[0], int(w[1])) for w in wire if w[0] in ("allgather", "reduce_scatter")]
            ag, rs = {}, {}
            for (kind_l, g), (kind_w, cnt) in zip(labels, wire):
                if kind_l != kind_w:
                    raise SystemExit(f"FAIL: {kind} at {n}: {kind_l} {g} vs {kind_w} on the wire")
                d = ag if kind_w == "allgather" else rs
                if d.setdefault(g, cnt) != cnt:
                    raise SystemExit(f"FAIL: {kind} at {n}: {g} has two {kind_w} counts")
            others_ag = [c for g, c in ag.items() if g != "blocks.0"]
            others_rs = [c for g, c in rs.items() if g != "blocks.0"]
            blocks_rs = [c for g, c in rs.items() if g.startswith("blocks.") and g != "blocks.0"]
            if kind == "collide":
                ok = ag["blocks.0"] not in others_ag and all(c == rs["blocks.0"] for c in blocks_rs)
            else:
                ok = rs["blocks.0"] not in others_rs
            if not ok:
                raise SystemExit(f"FAIL: --unused {kind} at {n} ranks: all-gather counts {ag}, "
                                 f"reduce-scatter counts {rs}")
            with open(man) as f:
                b0 = json.load(f)["groups"][1]
            sizes = {p["name"]: shard_numel(p["shape"], n) for p in b0["params"]}
            missing = ag["blocks.0"] - rs["blocks.0"]
            sets = [set(c) for r in range(1, len(sizes) + 1)
                    for c in itertools.combinations(sizes, r)
                    if sum(sizes[x] for x in c) == missing]
            if sets != [mode_unused(cfg)]:
                raise SystemExit(f"FAIL: --unused {kind} at {n}: {missing} missing floats are "
                                 f"explained by {sets}")
            print(f"ok: --unused {kind} at {n} ranks: blocks.0 AG {ag['blocks.0']} RS "
                  f"{rs['blocks.0']} (blocks.1 {ag['blocks.1']}/{rs['blocks.1']}, root "
                  f"{ag['root']}/{rs['root']}); missing = {sorted(sets[0])} only")


def cmd_errors(args, tmp):
    """Refused values and combinations: exit status != 0 and the message."""
    plain = [args.mpi_exe] + COMMON + ["--steps", "1"]
    ref = [args.mpi_exe, "--reference"] + COMMON + ["--steps", "1"]
    mpi = lambda n: [args.mpirun, "-np", str(n)] + MPIRUN_FLAGS + [args.mpi_exe] + COMMON + [
        "--steps", "1"]
    cases = [
        (plain + ["--unused", "some"], "bad value 'some' for --unused"),
        (plain + ["--accum", "0"], "bad value '0' for --accum"),
        (plain + ["--accum-mode", "later"], "bad value 'later' for --accum-mode"),
        (plain + ["--eval-every", "0"], "bad value '0' for --eval-every"),
        (plain + ["--hsdp", "0"], "bad value '0' for --hsdp"),
        (plain + ["--wrap", "fsdp1"], "bad value 'fsdp1' for --wrap"),
        (plain + ["--divide", "fp8"], "bad value 'fp8' for --divide"),
        (plain + ["--clip", "0"], "bad value '0' for --clip"),
        (plain + ["--schedule", "warmup-cosine:3"], "bad value 'warmup-cosine:3' for --schedule"),
        (plain + ["--schedule", "wsd:1:2:3:0.1:cubic"], "bad value 'wsd:1:2:3:0.1:cubic' for --schedule"),
        (plain + ["--schedule", "warmup-linear:1:2:1.5"], "bad value 'warmup-linear:1:2:1.5' for --schedule"),
        (plain + ["--schedule", "constant:1"], "bad value 'constant:1' for --schedule"),
        (plain + ["--schedule", "cosine:1:2"], "bad value 'cosine:1:2' for --schedule"),
        (ref + ["--emulate-world", "4", "--hsdp", "3"],
         "--hsdp 3 needs an emulated world size divisible by 3, got 4"),
        (mpi(4) + ["--hsdp", "3"], "--hsdp 3 needs a world size divisible by 3, got 4"),
        (ref + ["--unused", "collide", "--dims", "37,30,50,5,1"],
         "--unused collide needs at least 2 blocks"),
        # blocks.0 + gate (5*2*2 + 2 + 2 + 4*2 = 20 floats) = root (3*2 + 2 + 4*2 + 4 = 20)
        (mpi(1) + ["--unused", "collide", "--dims", "3,2,2,4,2"],
         "--unused collide: at world size 1 blocks.0's all-gather count equals root's"),
        # blocks.0 without fc2.bias: 10 floats = root's 10
        (mpi(1) + ["--unused", "unique", "--dims", "1,2,2,2,2"],
         "--unused unique: at world size 1 blocks.0's reduce-scatter count (without the "
         "unused param) equals root's"),
    ]
    for cmd, needle in cases:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        if proc.returncode == 0 or needle not in proc.stdout:
            sys.stdout.write(proc.stdout[-2000:])
            raise SystemExit(f"FAIL: {' '.join(cmd[-6:])}: exit {proc.returncode}, "
                             f"want an error with {needle!r}")
        print(f"ok: refused ({proc.returncode}): {needle}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["flavours", "adamw", "muon", "muon-dist", "premul", "manifest",
                                     "mode",
                                     "unused-counts", "errors"])
    ap.add_argument("--case", choices=sorted(CASES), help="with mode: the FSDP2 situation")
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--mpi-exe", required=True)
    ap.add_argument("--nccl-exe", default="")
    ap.add_argument("--plan", default="", help="mfsdp-plan: mode also checks its manifests")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp_train_check.") as tmp:
        if args.mode == "flavours":
            cmd_flavours(args, tmp)
        elif args.mode == "adamw":
            cmd_vs_reference(args, tmp, "adamw")
        elif args.mode == "muon":
            cmd_vs_reference(args, tmp, "muon-gather")
        elif args.mode == "muon-dist":
            cmd_muon_dist(args, tmp)
        elif args.mode == "premul":
            cmd_premul(args, tmp)
        elif args.mode == "manifest":
            cmd_manifest(args, tmp)
        elif args.mode == "mode":
            if args.case is None:
                raise SystemExit("FAIL: mode needs --case")
            cmd_mode(args, tmp, args.case)
        elif args.mode == "unused-counts":
            cmd_unused_counts(args, tmp)
        else:
            cmd_errors(args, tmp)


if __name__ == "__main__":
    main()
