#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of suite `python`: the PyTorch companion (python/mfsdp), the test-only NCCL adapter
and examples/pytorch/train_fsdp2.py. One test per invocation:

  layout CONFIG --np N     the job under mpirun with the NCCL adapter and a recording
                           stand-in for the shim: the manifest the companion builds equals
                           FSDP2's real layout (every FSDPParam's padded shard numel, padded
                           and local sharded sizes), every FSDP2 all-gather / reduce-scatter
                           / HSDP all-reduce on the wire is tagged right before it with its
                           group, and the counts, dtypes, ops and in-place flags on the wire
                           are the ones the manifest's layout gives (docs/design.md, "FSDP2's byte layout")
                           over exactly the params the tag flags; lr factors follow LambdaLR.
  adapter --np N           the job through the adapter (FSDP2 collectives on the test NCCL
                           library over MPI) ends with the same weights as on plain gloo.
  reference CONFIG --np N  the job on plain gloo (AdamW) vs the single-process reference
                           trainer (tests/python/reference.py --optim adamw).
  muon-refs                the reference's Muon variants agree: float32 vs float64 Muon
                           (docs/design.md, "The optimizer step") and torch.optim.Muon (bf16 Newton-Schulz).
  units                    tests/python/units.py: shim binding, version guard, shim search,
                           path hook chaining (no FSDP2 job).
  errors --np 4|1          tests/python/errors_job.py: every refusal of the companion inside
                           a real FSDP2 job (Shard(1), reshard_after_forward=int, two meshes,
                           bad MFSDP_PY_ADAMW, divide rule changed, clip norm_type, two lr
                           schedules, bad MFSDP_COMPANION, a collective that never reached
                           the shim, HSDP on one-rank shard groups, matrices split over two
                           optimizers, torch.optim.Muon created after the first forward, its
                           momentum changed, its unsupported adjust_lr_fn, its groups
                           differing, MFSDP_LR beside it, another optimizer stepping its
                           matrices; at 1 rank: a divide factor at world size 1), and what
                           is accepted: an optimizer of the other params beside the matrices'
                           one, torch.optim.Muon's hyper-parameters registered.
  package                  pip builds a pure-Python wheel whose mfsdp-run console script runs.
  refusals                 mfsdp-run refuses clearly: shim not found, MFSDP_PRELOAD_LIB
                           missing, unknown torch version, unknown FSDP2 source; the
                           companion refuses without the preloaded shim.
  manifest-cli --np N      `python -m mfsdp.manifest OUT -- job` writes the manifest, equal to
                           the one the companion registers, and the C parser (mfsdp-plan)
                           accepts it.
  e2e CONFIG --np N        PHASE 2 (needs the shim's tagged mode): mfsdp-run on the job
                           through the adapter trains to the float64 Muon reference's weights,
                           and the job's own saved state (state_dict after the write-back)
                           holds them; at 1 rank too (the companion issues the reduce-scatter
                           FSDP2 elides there and writes the weights back after each step).
                           torch_muon: the job's torch.optim.Muon (non-default hyper-
                           parameters) beside AdamW, against the float64 Muon with the same.
  untagged --np N          PHASE 2: an untagged all-gather on a tagged communicator stops
                           the job with a clear error.
Exit 77 (meson: skipped) only for the phase-2 tests when the shim lacks the tagged mode.
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
JOB = os.path.join(REPO, "examples", "pytorch", "train_fsdp2.py")
REFERENCE = os.path.join(HERE, "reference.py")
LAUNCH = os.path.join(HERE, "launch")
PYPKG = os.path.join(REPO, "python")
MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]

CONFIGS = {
    "default": [],
    "bf16": ["--bf16"],
    "frozen_unused": ["--frozen", "--unused"],
    "accum2": ["--accum", "2"],
    "titan": ["--wrap", "titan"],
    "eval": ["--eval-every", "1"],
    "accum2_eval": ["--accum", "2", "--eval-every", "1"],
    "tied": ["--tied"],
    "clip": ["--clip", "0.05"],
    "cosine": ["--warmup", "2", "--steps", "7", "--min-lr-ratio", "0.0"],
    "hsdp": ["--hsdp", "2"],
    "reshard_root": ["--reshard-root"],
    "manual_lr": ["--manual-lr"],
    "tied_manual_lr": ["--tied", "--manual-lr"],
    # a block never run: never gathered, so the owners have no weights to write back for it
    "idle_block": ["--idle-block"],
    # activation checkpointing: each block's forward runs again inside its backward
    "checkpoint": ["--checkpoint"],
    # torch.optim.Muon for the matrices (hyper-parameters other than mfsdp's defaults), AdamW
    # for the rest, each with its LambdaLR; AdamW's zero_grad() runs before Muon's step.
    "torch_muon": ["--optimizer", "muon", "--muon-lr", "0.03", "--muon-momentum", "0.9",
                   "--muon-wd", "0.1", "--muon-adjust", "match_rms_adamw"],
    # weights put back mid-run (saved after step 0, loaded before step 2): all of them by
    # load_state_dict, blocks.0's only (strict=False), and by DCP in place into
    # model.state_dict() with no load_state_dict after it (all, blocks.0's only)
    "revert_load": ["--revert", "load"],
    "revert_partial": ["--revert", "partial"],
    "revert_dcp": ["--revert", "dcp"],
    "revert_dcp_partial": ["--revert", "dcp-partial"],
    "revert_titan": ["--revert", "titan"],
    "revert_sub": ["--revert", "sub"],
    "revert_bcast": ["--revert", "bcast"],
    # stopped after step 2 and resumed in a new job from its checkpoint (model, optimizers,
    # step): torch.optim.Muon through DCP's get/set_optimizer_state_dict, and the job's AdamW
    # alone through torch.save of each rank's state dicts; the owners' momentum must come
    # back (the resumed run bitwise equal to the uninterrupted one)
    # every optimizer's state_dict() loaded back before step 2 (saved after step 0: a
    # rollback) or new optimizers from step 2: the owners' momentum follows (constant lr: the
    # reference replays the optimizers' state, not a schedule rolled back with it)
    "optim_load": ["--optimizer", "muon", "--constant-lr", "--optim-revert", "load"],
    "optim_load_adamw": ["--constant-lr", "--optim-revert", "load"],
    "optim_new": ["--optimizer", "muon", "--constant-lr", "--optim-revert", "new"],
    "resume_dcp": ["--optimizer", "muon", "--resume-via", "dcp"],
    "resume_torch": ["--resume-via", "torch"],
    "resume_dcp_adamw": ["--resume-via", "dcp"],
    "resume_hsdp": ["--hsdp", "2", "--optimizer", "muon", "--resume-via", "dcp"],
    "resume_frozen": ["--frozen-matrix", "--unused", "--resume-via", "torch"],
}
RESUME_AT = 2
STEPS = ["--steps", "4"]
NCCL_DT = {"float32": 7, "bfloat16": 9, "float16": 6}
ELT = {"float32": 4, "bfloat16": 2, "float16": 2}
NCCL_AVG, NCCL_SUM = 4, 0


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def skip(msg):
    print(f"SKIP: {msg}")
    raise SystemExit(77)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, args, tmp):
        self.a, self.tmp = args, tmp

    def env(self):
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join([LAUNCH, PYPKG])
        for k in ("MFSDP_TEST_NCCL_LIB", "MFSDP_TEST_FAKE_SHIM",
                  "FAKE_NCCL_TRACE", "RANK",
                  "WORLD_SIZE", "LOCAL_RANK", "MFSDP_COMPANION", "LD_PRELOAD"):
            env.pop(k, None)
        return env

    def mpirun(self, np, cmd, extra_env=None, log="run", expect_ok=True, timeout=240):
        for attempt in range(3):
            env = self.env()
            extra = dict(extra_env or {})
            # torch's TCPStore rendezvous port; another job on the machine may take it
            # between free_port() and the bind: only that failure is retried.
            extra["MASTER_PORT"] = str(free_port())
            env.update(extra)
            full = [self.a.mpirun, "-np", str(np)] + MPIRUN_FLAGS
            for k in sorted(set(extra) | {"PYTHONPATH", "OMP_NUM_THREADS"}):
                full += ["-x", k]
            full += cmd
            proc = self.run(full, env, log, False, timeout)
            if proc.returncode != 0 and "address already in use" in proc.stdout.lower():
                print(f"note: rendezvous port {extra['MASTER_PORT']} was taken, retrying")
                continue
            break
        if expect_ok and proc.returncode != 0:
            sys.stdout.write(proc.stdout[-6000:])
            fail(f"exit status {proc.returncode}: {' '.join(full)}")
        return proc

    def run(self, cmd, env, log, expect_ok=True, timeout=240):
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        with open(os.path.join(self.tmp, log + ".log"), "w") as f:
            f.write(" ".join(cmd) + "\n" + proc.stdout)
        if expect_ok and proc.returncode != 0:
            sys.stdout.write(proc.stdout[-6000:])
            fail(f"exit status {proc.returncode}: {' '.join(cmd)}")
        return proc

    def job(self, np, flags, out=None, adapter=False, fake_shim=None, log="job",
            wrap=None, extra_env=None, expect_ok=True):
        env = dict(extra_env or {})
        if adapter:
            env["MFSDP_TEST_NCCL_LIB"] = self.a.fake_nccl
        if fake_shim:
            env["MFSDP_TEST_FAKE_SHIM"] = fake_shim
            env["FAKE_NCCL_TRACE"] = fake_shim
        cmd = (wrap or []) + [self.a.python, JOB] + flags
        if out:
            cmd += ["--save", out]
        return self.mpirun(np, cmd, env, log, expect_ok)

    def reference(self, np, flags, out, optim="adamw"):
        cmd = [self.a.python, REFERENCE, "--world", str(np), "--optim", optim, "--out", out]
        env = self.env()
        return self.run(cmd + flags, env, f"ref-{optim}")


def load(path):
    import torch
    return torch.load(path)


def compare(a_path, b_path, tol, what):
    a, b = load(a_path), load(b_path)
    if sorted(a) != sorted(b):
        fail(f"{what}: tensor names differ: {sorted(set(a) ^ set(b))}")
    worst, wname = 0.0, ""
    for k in sorted(a):
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            fail(f"{what}: {k} shape {tuple(x.shape)} vs {tuple(y.shape)}")
        if not bool(x.isfinite().all()):
            fail(f"{what}: {k} holds non-finite values")
        if tol == 0.0:
            if not bool((a[k] == b[k]).all()) or a[k].dtype != b[k].dtype:
                bad = int((a[k] != b[k]).sum())
                fail(f"{what}: {k} differs in {bad} of {x.numel()} elements (bitwise expected)")
            continue
        rel = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30)
        if rel > worst:
            worst, wname = rel, k
        if rel > tol:
            fail(f"{what}: {k} max|a-b|/max|ref| = {rel:.3e} > {tol:g}")
    print(f"ok: {what}: {len(a)} tensors " +
          ("bitwise equal" if tol == 0.0 else f"within {tol:g} (worst {worst:.3e}, {wname})"))
    return worst


def check_trained(path, np, flags, runner, what):
    """The weights moved away from the init (a zero-step run)."""
    z = os.path.join(runner.tmp, "zero.pt")
    runner.reference(np, flags + ["--steps", "0"], z)
    a, b = load(path), load(z)
    moved = [k for k in a if not bool((a[k] == b[k]).all())]
    if len(moved) < len(a) // 2:
        fail(f"{what}: only {len(moved)} of {len(a)} tensors changed during training")


def job_flags(config):
    flags = list(STEPS)
    for f in CONFIGS[config]:
        flags.append(f)
    if "--steps" in CONFIGS[config]:
        flags = flags[2:]
    return flags


# ---- layout ---------------------------------------------------------------------------------

def parse_trace(path):
    events = []
    with open(path) as f:
        for line in f:
            w = line.split()
            if not w:
                continue
            if w[0] in ("allgather", "reduce_scatter", "allreduce", "broadcast", "reduce",
                        "send", "recv"):
                events.append(("wire", w[0], int(w[1]), int(w[2]), int(w[3]), int(w[4]),
                               int(w[5])))
            elif w[0] == "tag":
                events.append(("tag", int(w[1]), int(w[2]), int(w[3]), w[4], int(w[5])))
            elif w[0] == "register":
                events.append(("register", int(w[1])))
            elif w[0] == "step":
                events.append(("step", int(w[1]), float(w[2])))
            else:
                events.append((w[0],) + tuple(w[1:]))
    return events


def layout_of(group, ws):
    """docs/design.md, "FSDP2's byte layout" for one manifest group: [(c_i, s_i, o_i)]."""
    out, off = [], 0
    for p in group["params"]:
        n0, rest = p["shape"][0], math.prod(p["shape"][1:])
        c = -(-n0 // ws)
        out.append((c, c * rest, off))
        off += c * rest
    return out


def cmd_layout(args, r):
    import torch  # noqa: F401  (torch.load below)
    sys.path.insert(0, os.path.join(REPO, "examples", "pytorch"))
    import train_fsdp2 as job
    np = args.np
    flags = job_flags(args.config)
    prefix = os.path.join(r.tmp, "trace")
    # --save: the job's state_dict() triggers the companion's write-back (SYNC tags).
    proc = r.job(np, flags, out=os.path.join(r.tmp, "saved.pt"), adapter=True,
                 fake_shim=prefix, log="layout")
    norms = [float(x) for x in re.findall(r" norm ([0-9.eE+-]+)", proc.stdout)]
    jargs = job.parse_args(flags)
    lam = job.lr_lambda(jargs)
    manifests = []
    for rank in range(np):
        mpath = f"{prefix}.{rank}.manifest0.json"
        if not os.path.exists(mpath):
            fail(f"rank {rank} registered no manifest")
        with open(mpath) as f:
            m = json.load(f)
        with open(f"{prefix}.{rank}.fsdp0.json") as f:
            facts = json.load(f)
        manifests.append(m)
        if glob.glob(f"{prefix}.{rank}.manifest1.json"):
            fail("a second manifest was registered for one FSDP2 root")
        check_manifest(m, facts, rank, np, args.config)
        events = parse_trace(f"{prefix}.{rank}")
        check_wire(m, events, rank, np, args.config, jargs, lam)
        check_clip(events, rank, jargs, norms)
    if any(m != manifests[0] for m in manifests):
        fail("ranks registered different manifests")
    check_handover(r, np, flags, manifests[0], os.path.join(r.tmp, "saved.pt"), args.config)
    ngroups = len(manifests[0]["groups"])
    nparams = sum(len(g["params"]) for g in manifests[0]["groups"])
    print(f"ok: layout {args.config} at {np} ranks: {ngroups} groups, {nparams} params match "
          "FSDP2's FSDPParams and every collective on the wire")


def check_manifest(m, facts, rank, np, config):
    rep = 2 if config == "hsdp" else 1
    ws = np // rep
    if m["format"] != "mfsdp-manifest/1" or m["world_size"] != ws or m["replicate"] != rep:
        fail(f"manifest header {m['format']} world {m['world_size']} replicate {m['replicate']}"
             f", expected world {ws} replicate {rep}")
    if m["training"]["tail"] != "job":
        fail("manifest training.tail is not job")
    if len(facts) != len(m["groups"]):
        fail(f"{len(m['groups'])} manifest groups for {len(facts)} FSDP2 groups")
    names = set()
    for g, fg in zip(m["groups"], facts):
        if fg["world"] != ws:
            fail(f"group {g['name']}: FSDP2 shards over {fg['world']} ranks")
        if len(g["params"]) != len(fg["params"]):
            fail(f"group {g['name']}: {len(g['params'])} params vs FSDP2's {len(fg['params'])}")
        for p, (c, s, o), fp in zip(g["params"], layout_of(g, ws), fg["params"]):
            where = f"rank {rank} {p['name']}"
            names.add(p["name"])
            if p["name"] != fp["fqn"] or p["shape"] != fp["orig_size"]:
                fail(f"{where}: manifest {p['name']} {p['shape']} vs FSDP2 {fp['fqn']} "
                     f"{fp['orig_size']} (param order)")
            if fp["padded_shard_numel"] != s or fp["padded_sharded_size"][0] != c:
                fail(f"{where}: FSDP2 pads to {fp['padded_sharded_size']} "
                     f"({fp['padded_shard_numel']} elements), layout says c={c} s={s}")
            rows = max(0, min(c, p["shape"][0] - fg["rank"] * c))
            if fp["sharded_size"][0] != rows:
                fail(f"{where}: FSDP2 holds {fp['sharded_size'][0]} rows, layout says {rows}")
            if p["requires_grad"] != fp["requires_grad"]:
                fail(f"{where}: requires_grad differs")
            want_role = "muon"
            if (len(p["shape"]) < 2 or not p["requires_grad"] or "embed" in p["name"]
                    or "lm_head" in p["name"]):
                want_role = "adamw"
            if p["optimizer"] != want_role:
                fail(f"{where}: role {p['optimizer']}, expected {want_role}")
    if config == "tied" and "lm_head.weight" in names:
        fail("tied lm_head.weight appears as its own param")
    if config == "frozen_unused":
        for g in m["groups"]:
            for p in g["params"]:
                if p["name"] == "blocks.0.mlp.fc1.bias" and (
                        p["dtype"] != "bfloat16" or p["requires_grad"]):
                    fail("the frozen bf16 bias is not described as frozen bfloat16")
    if config == "bf16":
        for g in m["groups"]:
            if g.get("reduce_dtype") != "float32" or any(p["dtype"] != "bfloat16"
                                                         for p in g["params"]):
                fail(f"group {g['name']}: bf16 params / fp32 reduce not described")


def check_handover(r, np, flags, manifest, saved, config):
    """With a shim that moves no data, owner-managed params must (a) never be touched by the
    job's optimizer (their .grad is None after the reduce), so the job's tail trains exactly
    as the frozen-muon reference's, and (b) be replaced in the saved state_dict by what the
    write-back all-gather delivered (zeros here)."""
    owned = {p["name"] for g in manifest["groups"] for p in g["params"]
             if p["optimizer"] == "muon" and p["requires_grad"]}
    if not owned:
        fail("no owner-managed params in the manifest")
    if np == 1:
        # On one rank the write-back runs after every owner step (FSDP2's next unshard copies
        # the shards), so with a shim that moves no data the owner-managed weights are zero
        # from the first step on and the tail trains on another model than the reference's:
        # only (b) holds. e2e_*_np1 checks one-rank training against the float64 reference.
        a = load(saved)
        if any(bool(a[k].any()) for k in owned):
            fail("the saved state does not hold the write-back's data")
        print(f"ok: {len(owned)} owner-managed params written back (the tail is checked by "
              "e2e at 1 rank)")
        return
    ref = os.path.join(r.tmp, "frozen-muon.pt")
    r.reference(np, flags, ref, "frozen-muon")
    a, b = load(saved), load(ref)
    tol = REFERENCE_TOL.get(config, REFERENCE_TOL["default"])
    worst = 0.0
    for k in sorted(b):
        if k in owned:
            if bool(a[k].any()):
                fail(f"{k}: the saved state does not hold the write-back's data")
            continue
        x, y = a[k].double(), b[k].double()
        rel = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30)
        worst = max(worst, rel)
        if rel > tol:
            fail(f"{k}: the job's tail vs the frozen-muon reference {rel:.3e} > {tol:g} (did "
                 "the job's optimizer touch an owner-managed param?)")
    print(f"ok: {len(owned)} owner-managed params skipped by the job's optimizer and written "
          f"back at save; tail within {tol:g} of the reference (worst {worst:.3e})")


def check_clip(events, rank, jargs, norms):
    """clip_grad_norm_ asks the shim for the owners' squared norm and scales the owners'
    gradients by the coefficient torch uses: min(max_norm / (norm + 1e-6), 1)."""
    sq = [e for e in events if e[0] == "sqnorm"]
    sc = [float(e[2]) for e in events if e[0] == "scale"]
    if jargs.clip <= 0:
        if sq or sc:
            fail(f"rank {rank}: owners' norm queried without clip_grad_norm_")
        return
    if len(sq) != jargs.steps or len(sc) != jargs.steps or len(norms) != jargs.steps:
        fail(f"rank {rank}: {len(sq)} norm queries, {len(sc)} scalings, {len(norms)} norms "
             f"printed for {jargs.steps} steps")
    for coef, norm in zip(sc, norms):
        want = min(jargs.clip / (norm + 1e-6), 1.0)
        if abs(coef - want) > 1e-5 * want:
            fail(f"rank {rank}: owners' gradients scaled by {coef}, torch's rule gives {want}")
    if min(sc) >= 1.0:
        fail(f"rank {rank}: the clip test never clipped (coefficients {sc})")


def check_wire(m, events, rank, np, config, jargs, lam):
    rep = m["replicate"]
    ws = m["world_size"]
    groups = m["groups"]
    counts = {"allgather": 0, "reduce_scatter": 0, "allreduce": 0}
    steps = []
    syncs = []
    i = 0
    if not events or events[0] != ("register", 0):
        fail(f"rank {rank}: the trace does not start with the registration")
    pending = None
    for ev in events[1:]:
        if ev[0] == "tag":
            if pending is not None:
                fail(f"rank {rank}: two tags without a collective between them: {pending}, {ev}")
            pending = ev
            continue
        if ev[0] == "step":
            steps.append(ev[2])
            continue
        if ev[0] != "wire":
            continue
        _, kind, count, dtype, op, inplace, nranks = ev
        if pending is None:
            fail(f"rank {rank}: untagged {kind} {count} on the wire (call {i})")
        _, handle, tkind, gi, flags, nparams = pending
        pending = None
        i += 1
        g = groups[gi]
        if nparams != len(g["params"]):
            fail(f"rank {rank}: tag of group {gi} says {nparams} params")
        lay = layout_of(g, ws)
        counts[kind] = counts.get(kind, 0) + 1
        if tkind == 0:  # all-gather
            if kind != "allgather":
                fail(f"rank {rank}: all-gather tag of {g['name']} before a {kind}")
            dts = {p["dtype"] for p in g["params"]}
            if len(dts) == 1:
                want_n, want_dt = sum(s for _, s, _ in lay), NCCL_DT[dts.pop()]
            else:
                want_n = sum(s * ELT[p["dtype"]] for (_, s, _), p in zip(lay, g["params"]))
                want_dt = 1  # ncclUint8
            if (count, dtype, inplace, nranks) != (want_n, want_dt, 1, ws):
                fail(f"rank {rank}: all-gather of {g['name']}: wire count {count} dtype {dtype} "
                     f"inplace {inplace} nranks {nranks}, layout says {want_n} dtype {want_dt} "
                     f"in place over {ws}")
        elif tkind in (1, 2):
            want_kind = "reduce_scatter" if tkind == 1 else "allreduce"
            if kind != want_kind:
                fail(f"rank {rank}: tag kind {tkind} of {g['name']} before a {kind}")
            expect_flags = "".join(
                "1" if p["requires_grad"] and not p["name"].endswith(".unused") else "0"
                for p in g["params"])
            if flags != expect_flags:
                fail(f"rank {rank}: {kind} of {g['name']} flags {flags}, expected {expect_flags}")
            want_n = sum(s for (_, s, _), f in zip(lay, flags) if f == "1")
            want_dt = NCCL_DT[g["reduce_dtype"]]
            want_ranks = ws if tkind == 1 else rep
            # FSDP2's op: avg, but sum on one rank (the reduce-scatter the companion issues
            # there in place of FSDP2's copy uses FSDP2's own one-rank op)
            want_op = NCCL_SUM if ws * rep == 1 else NCCL_AVG
            want_inplace = 0 if tkind == 1 else 1
            if (count, dtype, op, inplace, nranks) != (want_n, want_dt, want_op, want_inplace,
                                                       want_ranks):
                fail(f"rank {rank}: {kind} of {g['name']}: wire count {count} dtype {dtype} op "
                     f"{op} inplace {inplace} nranks {nranks}, layout says {want_n} dtype "
                     f"{want_dt} op {want_op} inplace {want_inplace} over {want_ranks}")
        elif tkind == 3:  # weight write-back before state_dict()
            if kind != "allgather":
                fail(f"rank {rank}: sync tag of {g['name']} before a {kind}")
            want_n = sum(s for _, s, _ in lay)
            if (count, dtype, inplace, nranks) != (want_n, NCCL_DT["float32"], 1, ws):
                fail(f"rank {rank}: write-back of {g['name']}: wire count {count} dtype {dtype}"
                     f" inplace {inplace} nranks {nranks}, expected float32 {want_n} in place")
            syncs.append((gi, len(steps)))
        else:
            fail(f"rank {rank}: unexpected tag kind {tkind}")
    owner_groups = [gi for gi, g in enumerate(groups)
                    if any(p["optimizer"] == "muon" and p["requires_grad"] for p in g["params"])]
    # One write-back per group with owner-managed params before the job's save; on one rank
    # one after every owner step instead (FSDP2's next unshard copies the local shards).
    want_syncs = ([(gi, t) for t in range(1, jargs.steps + 1) for gi in owner_groups]
                  if ws == 1 else [(gi, jargs.steps) for gi in owner_groups])
    if syncs != want_syncs:
        fail(f"rank {rank}: write-backs {syncs} (group, steps before), expected {want_syncs}")
    if pending is not None:
        fail(f"rank {rank}: tag {pending} was never followed by its collective")
    if np // rep > 1 and (counts["allgather"] == 0 or counts["reduce_scatter"] == 0):
        fail(f"rank {rank}: no FSDP2 collectives seen: {counts}")
    if rep > 1 and counts["allreduce"] != counts["reduce_scatter"]:
        fail(f"rank {rank}: {counts['allreduce']} replicate all-reduces for "
             f"{counts['reduce_scatter']} reduce-scatters")
    want = [1.0 if jargs.constant_lr else lam(t) for t in range(jargs.steps)]
    if len(steps) != len(want) or any(abs(a - b) > 1e-12 for a, b in zip(steps, want)):
        fail(f"rank {rank}: owner steps with lr factors {steps}, the job's LambdaLR gives {want}")


# ---- adapter and reference -------------------------------------------------------------------

def cmd_adapter(args, r):
    flags = job_flags(args.config)
    a = os.path.join(r.tmp, "gloo.pt")
    b = os.path.join(r.tmp, "adapter.pt")
    r.job(args.np, flags, out=a, log="gloo")
    trace = os.path.join(r.tmp, "wire")
    r.job(args.np, flags, out=b, adapter=True, log="adapter",
          extra_env={"FAKE_NCCL_TRACE": trace})
    if args.np > 1:
        n = sum(1 for _ in open(f"{trace}.0"))
        if n == 0:
            fail("the adapter run put nothing on the test NCCL library")
        print(f"ok: {n} FSDP2 collectives of rank 0 went through the test NCCL library")
    # Up to 2 ranks a sum of two values does not depend on its order: bitwise equal.
    compare(b, a, 0.0 if args.np <= 2 else ADAPTER_TOL,
            f"adapter vs gloo, {args.config} at {args.np} ranks")


# Summation order inside an avg reduce-scatter differs between gloo and MPI from 3 ranks on,
# and AdamW turns that rounding into a relative weight change of at most ~lr*1e-3.
ADAPTER_TOL = 1e-5
REFERENCE_TOL = {"default": 1e-5, "bf16": 2e-3}


def cmd_reference(args, r):
    flags = job_flags(args.config)
    a = os.path.join(r.tmp, "job.pt")
    b = os.path.join(r.tmp, "ref.pt")
    p = r.job(args.np, flags, out=a, log="job")
    r.reference(args.np, flags, b)
    if "--clip" in flags:  # the test must really clip
        clip = float(flags[flags.index("--clip") + 1])
        norms = [float(x) for x in re.findall(r" norm ([0-9.eE+-]+)", p.stdout)]
        if not norms or max(norms) <= clip:
            fail(f"clip_grad_norm_ never clipped (norms {norms}, max_norm {clip})")
        print(f"ok: clip_grad_norm_ clipped (norms {', '.join(f'{x:.3f}' for x in norms)})")
    tol = REFERENCE_TOL.get(args.config, REFERENCE_TOL["default"])
    compare(a, b, tol, f"job (AdamW, gloo) vs reference, {args.config} at {args.np} ranks")
    if args.config == "default":
        check_trained(a, args.np, flags, r, "job")


def cmd_muon_refs(args, r):
    flags = ["--steps", "6"]
    out = {}
    for optim in ("muon64", "muon32", "torch-muon", "adamw"):
        out[optim] = os.path.join(r.tmp, f"{optim}.pt")
        r.reference(2, flags, out[optim], optim)
    compare(out["muon32"], out["muon64"], 1e-5, "float32 vs float64 Muon reference")
    compare(out["torch-muon"], out["muon64"], TORCH_MUON_TOL,
            "torch.optim.Muon (bf16 NS) vs float64 Muon")
    a, b = load(out["muon64"]), load(out["adamw"])
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if "blocks" in k and a[k].ndim == 2)
    if diff < 1e-3:
        fail("the Muon reference trained the block matrices like AdamW")


# ---- mfsdp-run refusals ------------------------------------------------------------------

def cmd_refusals(args, r):
    env = r.env()
    run_cmd = [args.python, "-m", "mfsdp.run"]
    # 1. the shim cannot be found
    e = dict(env, MFSDP_PRELOAD_LIB=os.path.join(r.tmp, "nope", "libmfsdp_preload.so"))
    p = r.run(run_cmd + ["true"], e, "no-shim-env", expect_ok=False)
    expect_refusal(p, "MFSDP_PRELOAD_LIB=", "no such file")
    e = dict(env, MFSDP_BUILD_DIR="no-such-build-dir")
    e.pop("MFSDP_PRELOAD_LIB", None)
    p = r.run(run_cmd + ["true"], e, "no-shim", expect_ok=False)
    expect_refusal(p, "cannot find the mfsdp shim", "MFSDP_PRELOAD_LIB")
    # 2. unknown torch / FSDP2: a fake torch package first on the path
    fake = os.path.join(r.tmp, "faketorch")
    fsdp = os.path.join(fake, "torch", "distributed", "fsdp", "_fully_shard")
    os.makedirs(fsdp)
    with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
        f.write("raise ImportError('fake torch is never imported')\n")
    with open(os.path.join(fake, "torch", "version.py"), "w") as f:
        f.write("__version__ = '2.3.1'\n")
    e = dict(env, PYTHONPATH=os.pathsep.join([fake, PYPKG]),
             MFSDP_PRELOAD_LIB=args.python)  # any existing file: the torch check comes first
    p = r.run(run_cmd + ["true"], e, "old-torch", expect_ok=False)
    expect_refusal(p, "torch 2.3.1", "not a version mfsdp knows")
    # a known version number whose FSDP2 source is not the one the hooks expect
    with open(os.path.join(fake, "torch", "version.py"), "w") as f:
        f.write("__version__ = '2.15.0'\n")
    for fname in ("_fsdp_collectives.py", "_fsdp_param_group.py", "_fsdp_state.py"):
        with open(os.path.join(fsdp, fname), "w") as f:
            f.write("# refactored\n")
    p = r.run(run_cmd + ["true"], e, "changed-fsdp", expect_ok=False)
    expect_refusal(p, "torch 2.15.0", "lacks")
    # 3. the real torch with a shim that exists: mfsdp-run execs the command
    e = dict(env, MFSDP_PRELOAD_LIB=args.preload or args.python)
    if args.preload:
        p = r.run(run_cmd + [args.python, "-c",
                             "import os; print('LD_PRELOAD=' + os.environ['LD_PRELOAD']); "
                             "print('COMPANION=' + os.environ['MFSDP_COMPANION'])"],
                  e, "exec")
        if f"LD_PRELOAD={os.path.abspath(args.preload)}" not in p.stdout or \
                "COMPANION=tag" not in p.stdout:
            fail(f"mfsdp-run did not set LD_PRELOAD/MFSDP_COMPANION: {p.stdout}")
        print("ok: mfsdp-run sets LD_PRELOAD to the shim and execs the command")
    # 4. the companion in a job without the preloaded shim (the path hook set by hand)
    boot = os.path.join(PYPKG, "mfsdp", "_boot")
    e = dict(env, PYTHONPATH=os.pathsep.join([boot, PYPKG]), MFSDP_COMPANION="tag")
    p = r.run([args.python, "-c", "import torch.distributed.fsdp"], e, "no-preload",
              expect_ok=False)
    expect_refusal(p, "the mfsdp shim is not preloaded", "mfsdp_shim_abi_version")
    # 5. usage
    p = r.run(run_cmd, env, "usage", expect_ok=False)
    expect_refusal(p, "usage: mfsdp-run")
    p = r.run([args.python, "-m", "mfsdp.manifest", "out.json", "python"], env, "usage-manifest",
              expect_ok=False)
    expect_refusal(p, "usage: python -m mfsdp.manifest OUT.json -- COMMAND")
    p = r.run(run_cmd + [os.path.join(r.tmp, "no-such-command")],
              dict(env, MFSDP_PRELOAD_LIB=args.python), "no-command", expect_ok=False)
    expect_refusal(p, "mfsdp-run: cannot run")


def expect_refusal(p, *needles):
    if p.returncode == 0:
        fail(f"expected a refusal, got exit 0: {p.args}\n{p.stdout}")
    for n in needles:
        if n not in p.stdout:
            fail(f"refusal lacks {n!r}: {p.stdout[-2000:]}")
    lines = [ln for ln in p.stdout.splitlines() if needles[0] in ln] or [""]
    print(f"ok: refused ({p.returncode}): {lines[0].strip()[:150]}")


def cmd_package(args, r):
    """pip builds the package (pure Python) and its mfsdp-run console script works."""
    env = r.env()
    whl = os.path.join(r.tmp, "wheel")
    target = os.path.join(r.tmp, "site")
    r.run([args.python, "-m", "pip", "wheel", PYPKG, "--no-deps", "--no-build-isolation", "-q",
           "-w", whl], env, "pip-wheel")
    wheels = glob.glob(os.path.join(whl, "mfsdp-*-py3-none-any.whl"))
    if len(wheels) != 1:
        fail(f"expected one pure-Python wheel, got {os.listdir(whl)}")
    r.run([args.python, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
           wheels[0]], env, "pip-install")
    for rel in ("mfsdp/_boot/sitecustomize.py", "mfsdp/companion.py", "bin/mfsdp-run"):
        if not os.path.exists(os.path.join(target, rel)):
            fail(f"the installed package lacks {rel}")
    e = dict(env, PYTHONPATH=target,
             MFSDP_PRELOAD_LIB=os.path.join(r.tmp, "missing", "libmfsdp_preload.so"))
    p = r.run([args.python, os.path.join(target, "bin", "mfsdp-run"), "true"], e,
              "console-script", expect_ok=False)
    expect_refusal(p, "MFSDP_PRELOAD_LIB=", "no such file")
    for junk in glob.glob(os.path.join(PYPKG, "*.egg-info")) + [os.path.join(PYPKG, "build")]:
        shutil.rmtree(junk, ignore_errors=True)
    print(f"ok: {os.path.basename(wheels[0])} installs mfsdp and a working mfsdp-run")


def cmd_units(args, r):
    p = r.run([args.python, os.path.join(HERE, "units.py")], r.env(), "units", expect_ok=False)
    sys.stdout.write(p.stdout)
    if p.returncode != 0 or "units:" not in p.stdout:
        fail(f"units.py exit status {p.returncode}")


def cmd_errors(args, r):
    p = r.mpirun(args.np, [args.python, os.path.join(HERE, "errors_job.py")], log="errors",
                 expect_ok=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("ok:", "errors:", "FAIL"))]
    print("\n".join(lines))
    want = 41 if args.np == 4 else 2
    if p.returncode != 0 or f"errors: {want} cases ok" not in p.stdout:
        sys.stdout.write(p.stdout[-4000:])
        fail(f"errors_job.py at {args.np} ranks: exit status {p.returncode}")


# ---- manifest CLI ------------------------------------------------------------------------

def cmd_manifest_cli(args, r):
    flags = job_flags(args.config)
    out = os.path.join(r.tmp, "manifest.json")
    r.mpirun(args.np, [args.python, "-m", "mfsdp.manifest", out, "--", args.python, JOB] + flags,
             log="manifest-cli")
    if not os.path.exists(out):
        fail("python -m mfsdp.manifest wrote no manifest")
    with open(out) as f:
        written = json.load(f)
    if written["world_size"] != args.np:
        fail(f"manifest world_size {written['world_size']} at {args.np} ranks")
    prefix = os.path.join(r.tmp, "trace")
    r.job(args.np, flags, adapter=True, fake_shim=prefix, log="registered")
    with open(f"{prefix}.0.manifest0.json") as f:
        registered = json.load(f)
    if written != registered:
        fail("the written manifest differs from the registered one")
    if args.plan:
        p = r.run([args.plan, out, "--world-size", str(written["world_size"])], r.env(),
                  "mfsdp-plan", expect_ok=False)
        if p.returncode != 0:
            fail(f"mfsdp-plan rejects the companion's manifest:\n{p.stdout[-3000:]}")
        print("ok: mfsdp-plan accepts the manifest")
    print(f"ok: python -m mfsdp.manifest at {args.np} ranks wrote the registered manifest "
          f"({len(written['groups'])} groups)")


# ---- phase 2: the real shim --------------------------------------------------------------

def need_shim(args):
    if not args.preload or not os.path.exists(args.preload):
        skip("the shim libmfsdp_preload.so was not built")
    nm = shutil.which("nm")
    if nm is None:
        skip("nm is not installed (needed to look for mfsdp_shim_abi_version)")
    syms = subprocess.run([nm, "-D", "--defined-only", args.preload], stdout=subprocess.PIPE,
                          text=True).stdout
    if "mfsdp_shim_abi_version" not in syms:
        skip("the shim has no tagged mode yet (no mfsdp_shim_abi_version symbol)")


# torch.optim.Muon runs Newton-Schulz in bfloat16: 4.1e-3 after 6 steps at 2 ranks (measured).
TORCH_MUON_TOL = 2e-2
# mfsdp's CPU Newton-Schulz is float32 (float32 vs float64 Muon: 3.1e-7 after 6 steps), and
# owners sum gradients in another order than FSDP's avg: 1e-4 leaves two orders of margin.
E2E_TOL = {"default": 1e-4, "bf16": 3e-2}


def shim_mode(args):
    """(wrapper, environment) of a job under mfsdp: mfsdp-run with the real shim."""
    need_shim(args)
    return [args.python, "-m", "mfsdp.run"], {"MFSDP_PRELOAD_LIB": args.preload}


def cmd_e2e(args, r):
    flags = job_flags(args.config)
    wrap, env = shim_mode(args)
    out = os.path.join(r.tmp, "mfsdp.pt")
    dcp_dir = os.path.join(r.tmp, "dcp")
    # default: a torch.distributed.checkpoint save first (its state_dict() runs the
    # write-back), then the plain state_dict save.
    dcp_flags = ["--dcp", dcp_dir] if args.config == "default" else []
    resume = []
    if args.config.startswith("resume"):  # the first job stops at RESUME_AT and saves
        ckpt = os.path.join(r.tmp, "resume")
        r.job(args.np, flags + ["--stop-after", str(RESUME_AT), "--ckpt-dir", ckpt],
              adapter=True, wrap=wrap, extra_env=env, log="e2e-stop")
        resume = ["--resume-from", ckpt]
    p = r.job(args.np, flags + dcp_flags + resume, out=out, adapter=True, wrap=wrap,
              extra_env=env, log="e2e")
    # The shim itself says that it remapped the reduce-scatters and ran the owners' steps
    # (at 1 rank: the reduce-scatters the companion issues in place of FSDP2's copy).
    m = re.search(r"mfsdp: summary: (\d+) all-gathers, (\d+) reduce-scatters .* (\d+) "
                  r"optimizer steps", p.stdout)
    if m is None or int(m.group(2)) == 0 or int(m.group(3)) == 0:
        fail(f"the shim's summary shows no remapped reduce-scatter or no owner step: "
             f"{m.group(0) if m else 'no summary line'}")
    print(f"ok: {m.group(0)}")
    ref = os.path.join(r.tmp, "ref64.pt")
    r.reference(args.np, flags, ref, "muon64")
    tol = E2E_TOL.get(args.config, E2E_TOL["default"])
    if dcp_flags:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        flat = os.path.join(r.tmp, "dcp.pt")
        dcp_to_torch_save(dcp_dir, flat)
        model = torch.load(flat)["model"]
        torch.save({k: v for k, v in model.items()}, flat)
        compare(flat, ref, tol, f"the job's DCP checkpoint at {args.np} ranks vs float64 Muon")
    # The saved state is the job's own state_dict() after the companion's write-back, so
    # this compares the owners' weights (Muon matrices) and the job's AdamW tail alike.
    what = "mfsdp-run"
    compare(out, ref, tol, f"{what} {args.config} at {args.np} ranks vs float64 Muon")
    if resume:  # the same job run through: bitwise the same weights
        whole = os.path.join(r.tmp, "whole.pt")
        r.job(args.np, flags, out=whole, adapter=True, wrap=wrap, extra_env=env,
              log="e2e-whole")
        compare(out, whole, 0.0, f"{what} {args.config} at {args.np} ranks: resumed after "
                f"step {RESUME_AT} vs run through")
    if args.config in ("default", "torch_muon"):  # torch's own Muon, at bf16 accuracy
        tref = os.path.join(r.tmp, "reftorch.pt")
        r.reference(args.np, flags, tref, "torch-muon")
        compare(out, tref, TORCH_MUON_TOL,
                f"{what} {args.config} at {args.np} ranks vs torch.optim.Muon")


def cmd_untagged(args, r):
    wrap, env = shim_mode(args)
    script = os.path.join(HERE, "untagged_job.py")
    env["MFSDP_TEST_NCCL_LIB"] = args.fake_nccl
    p = r.mpirun(args.np, wrap + [args.python, script], env, "untagged", expect_ok=False)
    if "UNTAGGED CALL RETURNED" in p.stdout:
        fail("the untagged all-gather on a tagged communicator was accepted")
    if p.returncode == 0 or "untagged" not in p.stdout.lower().replace("untagged all-gather "
                                                                      "refused", ""):
        fail(f"the job did not stop with an error naming the untagged call:\n{p.stdout[-3000:]}")
    print("ok: the untagged all-gather on a tagged communicator stopped the job")


def test_python():
    """The venv Python with torch: MFSDP_TEST_PYTHON (scripts/test.sh sets it), else the one
    scripts/python-venv.sh finds or creates. No torch is a failure, never a skip."""
    py = os.environ.get("MFSDP_TEST_PYTHON", "")
    if not py:
        p = subprocess.run(["bash", os.path.join(REPO, "scripts", "python-venv.sh")],
                           stdout=subprocess.PIPE, text=True)
        lines = p.stdout.strip().splitlines()
        if p.returncode != 0 or not lines:
            fail("no Python with torch 2.15: scripts/python-venv.sh failed (see above)")
        py = lines[-1]
    if not os.access(py, os.X_OK):
        fail(f"MFSDP_TEST_PYTHON={py} is not an executable")
    return py


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("test", choices=["layout", "adapter", "reference", "muon-refs", "refusals",
                                     "package", "units", "errors",
                                     "manifest-cli", "e2e", "untagged"])
    ap.add_argument("config", nargs="?", default="default", choices=sorted(CONFIGS))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--python", default="", help="Python with torch (default: test_python())")
    ap.add_argument("--mpirun", default=shutil.which("mpirun") or "mpirun")
    ap.add_argument("--fake-nccl", default=os.path.join(REPO, "build", "tests", "lib",
                                                        "libnccl_mpi_fake.so"))
    ap.add_argument("--preload", default=os.path.join(REPO, "build", "ld_preload",
                                                      "libmfsdp_preload.so"))
    ap.add_argument("--plan", default=os.path.join(REPO, "build", "tools", "mfsdp-plan"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    if not args.python:
        args.python = test_python()
    import importlib.util
    if (importlib.util.find_spec("torch") is None or
            os.path.abspath(sys.executable) != os.path.abspath(args.python)) and \
            not os.environ.get("MFSDP_TEST_CHECK_REEXEC"):
        # The checks load torch tensors: run them under the venv's Python.
        os.environ["MFSDP_TEST_CHECK_REEXEC"] = "1"
        os.execv(args.python, [args.python] + sys.argv + ["--python", args.python])
    if args.test in ("layout", "adapter", "manifest-cli", "untagged", "e2e") and \
            not os.path.exists(args.fake_nccl):
        fail(f"the test NCCL library {args.fake_nccl} was not built")
    if args.plan and not os.path.exists(args.plan):
        args.plan = None
    tmp = tempfile.mkdtemp(prefix=f"mfsdp-py-{args.test}-")
    try:
        r = Runner(args, tmp)
        {"layout": cmd_layout, "adapter": cmd_adapter, "reference": cmd_reference,
         "muon-refs": cmd_muon_refs, "refusals": cmd_refusals, "package": cmd_package,
         "units": cmd_units, "errors": cmd_errors,
         "manifest-cli": cmd_manifest_cli, "e2e": cmd_e2e, "untagged": cmd_untagged}[
            args.test](args, r)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
