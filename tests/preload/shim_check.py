#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The LD_PRELOAD shim on the unmodified job examples/fsdp_train (suite `preload`).

  muon N         the job's own --optim adamw run under the shim (MPI or NCCL-API flavour,
                 eager or, with --env MFSDP_STEP=lazy, lazy steps; any algorithm)
                 ends with weights equal to the single-process full-matrix Muon + AdamW
                 reference (--reference --optim muon-gather --emulate-world N) within 1e-5
                 relative per tensor, and so do its loss traces.
  passthrough N  with no MFSDP_* variable at all the job under the shim is bitwise identical
                 to the job without it (weights and loss trace), and the summary line says
                 that every call passed through.
  silent N       never silent: a manifest of another world size, MFSDP_* variables without a
                 manifest, a misspelled MFSDP_* name, one rank with another MFSDP_TAIL and
                 (even N) an HSDP job whose manifest declares no "replicate" each stop the
                 job with ONE error line naming the problem and a non-zero exit status on
                 every rank, within the test's timeout (no hang), and no weights written.
  violation N    a manifest whose sequence the job contradicts: non-zero exit, an error
                 naming expected vs received, and no weights written.
  mode N         the job in one of its FSDP2 situations (fsdp_train_check.CASES: unused
                 params, accumulation, eval passes, torchtitan wrapping, divides, HSDP,
                 schedules, clipping), its own manifest, its AdamW run under the shim: equal
                 to the single-process Muon reference of the same mode (1e-5), loss traces
                 too; with --tail job the job's AdamW trains the tail itself.
  resume N       checkpoints under the shim: a rank is killed (SIGKILL) at a random step of
                 a job saving every k steps (MFSDP_CKPT_DIR/EVERY/KEEP); the job restarted
                 with MFSDP_RESUME=auto and --start-step at the latest checkpoint's step ends
                 bitwise equal to the uninterrupted run, loss trace too; old checkpoints are
                 pruned to MFSDP_CKPT_KEEP. --rounds kills per test.
  ckpt-errors N  checkpoint variables that cannot work (MFSDP_CKPT_EVERY or MFSDP_RESUME=auto
                 without MFSDP_CKPT_DIR, MFSDP_RESUME with MFSDP_INIT, tail job, a missing
                 checkpoint or init file, a checkpoint of another manifest) stop the job with
                 one error line; the end of a job saves its last step. Under
                 MFSDP_COMPANION=tag (mfsdp-run) the variables of what the job keeps (tail,
                 schedule, accumulation, clipping, manifest, record) are refused likewise.
  record N       groups with one signature and no sequence are refused with a message that
                 points at MFSDP_RECORD; MFSDP_RECORD runs pass-through (bitwise unchanged),
                 `mfsdp-plan --record` joins the record into the job's exact call sequence,
                 and the joined manifest trains like the reference.
"""
import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_train_check as ftc  # noqa: E402  (run, compare, load, losses)

STEPS = ["--steps", "12"]


def exe_of(args):
    return args.nccl_exe if args.flavour == "nccl" else args.mpi_exe


def shim_env(args, **kv):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in kv.items()})
    return env


def mpirun(args, env_vars):
    """mpirun with -x for each variable the ranks must see."""
    cmd = [args.mpirun, "-np", str(args.np)] + ftc.MPIRUN_FLAGS
    for k in env_vars:
        cmd += ["-x", k]
    return cmd


# A failing run's ranks each report their own exit status (mpirun's alone says only that
# one rank failed), and mpirun lets every rank finish instead of killing the others at the
# first failure: a rank that would exit 0 is seen (one that would hang, by the timeout). A
# rank that is killed with the job (MPI's fatal error handler in the MPI flavour, the job's
# own MPI_Abort on an NCCL error) reports nothing; its exit is not 0 either.
RANK_EXIT = "shim-check: rank exit "
NO_ABORT = ["--mca", "orte_abort_on_non_zero_status", "0"]
WRAP = ["sh", "-c", '"$@"; s=$?; echo "' + RANK_EXIT + '$s"; exit $s', "sh"]


def run_job(args, tmp, tag, extra, env_vars, expect_ok=True, each_rank=False):
    out = os.path.join(tmp, tag + ".bin")
    env = shim_env(args, **env_vars)
    job = [exe_of(args)] + ftc.COMMON + extra + ["--dump-weights", out]
    if expect_ok:
        text = ftc.run(mpirun(args, env_vars) + job, out + ".log", env)
        return out, text
    cmd = mpirun(args, env_vars) + (NO_ABORT + WRAP if each_rank else []) + job
    return out, run_failing(cmd, env, out + ".log")


def run_failing(cmd, env, log):
    """Run a job that is expected to fail. Open MPI 4.1's mpirun itself sometimes dies with
    SIGSEGV in its help-message or log forwarding when several ranks abort at once (seen about
    once in ten runs of HSDP refusals, and in a misspelled-variable refusal at 4 ranks, where
    the crash lost rank 0's error line); that is the launcher, not the job (a job's own failure
    reaches mpirun's exit status as a positive code): run it once more then, saying so, and
    judge the second run."""
    import subprocess
    for attempt in (1, 2):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=150, env=env)
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n" + proc.stdout)
        if proc.returncode >= 0 or attempt == 2:
            return proc
        print(f"note: mpirun died with signal {-proc.returncode} (Open MPI's own error "
              "reporting); running the job once more")
    return proc


def write_manifest(args, tmp):
    path = os.path.join(tmp, "manifest.json")
    cmd = mpirun(args, {}) + [exe_of(args)] + ftc.COMMON + ["--steps", "0", "--optim", "none",
                                                           "--write-manifest", path]
    ftc.run(cmd, path + ".log")
    return path


def preload_vars(args, manifest=None, **extra):
    v = {"LD_PRELOAD": args.preload}
    if manifest is not None:
        v["MFSDP_MANIFEST"] = manifest
    if args.flavour == "mpi":
        # MPI has no avg: the job divides MPI_SUM's output by the world size itself.
        v["MFSDP_GRAD_DIVIDE"] = "world"
    v.update(extra)
    v.update(args.env)
    return v


def check_reference(args, tmp, weights, text):
    ref = os.path.join(tmp, "reference.bin")
    ref_text = ftc.reference(args, args.np, STEPS + ["--optim", "muon-gather"], ref)
    ftc.compare(weights, ref, ftc.TOL,
                f"adamw job under the shim ({args.flavour}, {args.np} ranks) vs full-matrix Muon")
    a, b = ftc.losses(text), ftc.losses(ref_text)
    if len(a) != 12 or len(b) != 12:
        raise SystemExit("FAIL: missing loss lines")
    for x, y in zip(a, b):
        if abs(float(x) - float(y)) > ftc.TOL * max(1.0, abs(float(y))):
            raise SystemExit(f"FAIL: loss traces differ: {x} vs {y}")
    print(f"ok: loss traces agree ({a[-1]} vs {b[-1]})")


def cmd_muon(args, tmp):
    manifest = write_manifest(args, tmp)
    w, text = run_job(args, tmp, "shim", STEPS + ["--optim", "adamw"], preload_vars(args, manifest))
    check_reference(args, tmp, w, text)
    z, _ = run_job(args, tmp, "zero", ["--steps", "0"], {})
    ftc.check_changed(w, z, "shim run")


def cmd_passthrough(args, tmp):
    extra = STEPS + ["--optim", "adamw"]
    base, base_text = run_job(args, tmp, "plain", extra, {})
    w, text = run_job(args, tmp, "nomanifest", extra, {"LD_PRELOAD": args.preload})
    ftc.compare(w, base, 0.0, "pass-through (no MFSDP_* variable) vs no shim")
    if ftc.losses(text) != ftc.losses(base_text):
        raise SystemExit("FAIL: pass-through changed the loss trace")
    if "mfsdp: summary:" not in text or "every call passed through" not in text:
        sys.stdout.write(text[-2000:])
        raise SystemExit("FAIL: no summary line saying that every call passed through")
    print("ok: the summary line says every call passed through")


def expect_one_error(proc, weights, needles, what, ranks=None):
    """Non-zero exit (on each of `ranks` ranks), the needles in the output, exactly one
    'mfsdp: error' line, no weights (the test's subprocess timeout catches a hang)."""
    expect_failure(proc, weights, needles, what, ranks)
    lines = [ln for ln in proc.stdout.splitlines() if "mfsdp: error" in ln]
    if len(lines) != 1:
        sys.stdout.write(proc.stdout[-3000:])
        raise SystemExit(f"FAIL: {what}: {len(lines)} 'mfsdp: error' lines, want exactly one")
    if " WARN " in lines[0]:
        raise SystemExit(f"FAIL: {what}: the error is printed as a WARN line")
    print(f"ok: {what}: one error line: {lines[0][:160]}")


def cmd_silent(args, tmp):
    manifest = write_manifest(args, tmp)
    with open(manifest) as f:
        m = json.load(f)
    m["world_size"] = args.np + 1
    other = os.path.join(tmp, "other-world.json")
    with open(other, "w") as f:
        json.dump(m, f)
    extra = STEPS + ["--optim", "adamw"]
    w, proc = run_job(args, tmp, "worldsize", extra, preload_vars(args, other), expect_ok=False,
                      each_rank=True)
    expect_one_error(proc, w, [f"is for {args.np + 1} ranks", f"communicator of {args.np}",
                               "nothing would be trained"], "manifest of another world size",
                     ranks=args.np)
    w, proc = run_job(args, tmp, "nomanifest", extra,
                      {"LD_PRELOAD": args.preload, "MFSDP_GRAD_DIVIDE": "world"}, expect_ok=False,
                      each_rank=True)
    expect_one_error(proc, w, ["MFSDP_GRAD_DIVIDE is set but MFSDP_MANIFEST is not"],
                     "MFSDP_* variables without a manifest", ranks=args.np)
    w, proc = run_job(args, tmp, "misspelled", extra,
                      {"LD_PRELOAD": args.preload, "MFSDP_MANIFST": manifest}, expect_ok=False,
                      each_rank=True)
    expect_one_error(proc, w, ["unknown variable MFSDP_MANIFST", "did you mean MFSDP_MANIFEST"],
                     "a misspelled variable", ranks=args.np)
    # One rank with another MFSDP_TAIL: mpirun's MPMD form gives the last rank its own value.
    out = os.path.join(tmp, "rankdiff.bin")
    env = shim_env(args, LD_PRELOAD=args.preload, MFSDP_MANIFEST=manifest)
    base = [exe_of(args)] + ftc.COMMON + extra + ["--dump-weights", out]
    base = WRAP + base
    cmd = [args.mpirun] + ftc.MPIRUN_FLAGS + NO_ABORT
    if args.np > 1:
        cmd += ["-np", str(args.np - 1), "-x", "LD_PRELOAD", "-x", "MFSDP_MANIFEST",
                "-x", "MFSDP_TAIL=shard"] + base + [":"]
    cmd += ["-np", "1", "-x", "LD_PRELOAD", "-x", "MFSDP_MANIFEST", "-x", "MFSDP_TAIL=owner"] + base
    proc = run_failing(cmd, env, out + ".log")
    if args.np > 1:
        expect_one_error(proc, out, ["MFSDP_TAIL differs across ranks", "'shard' on rank",
                                     "'owner' on rank"], "one rank with another MFSDP_TAIL",
                         ranks=args.np)
    # HSDP on a mesh the manifest does not declare: the replicas would drift apart.
    if args.np % 2 == 0:
        hsdp = ["--hsdp", "2"]
        path = os.path.join(tmp, "hsdp.json")
        ftc.run(mpirun(args, {}) + [exe_of(args)] + ftc.COMMON + hsdp +
                ["--steps", "0", "--optim", "none", "--write-manifest", path], path + ".log")
        with open(path) as f:
            m = json.load(f)
        if m.get("replicate") != 2:
            raise SystemExit(f"FAIL: the HSDP job's manifest declares replicate "
                             f"{m.get('replicate')}, want 2")
        del m["replicate"]
        undeclared = os.path.join(tmp, "hsdp-undeclared.json")
        with open(undeclared, "w") as f:
            json.dump(m, f)
        w, proc = run_job(args, tmp, "hsdp-undeclared", extra + hsdp,
                          preload_vars(args, undeclared), expect_ok=False, each_rank=True)
        expect_one_error(proc, w, ["this is HSDP, but the manifest declares no \"replicate\"",
                                   "drift apart"], "HSDP on an undeclared mesh", ranks=args.np)


def expect_failure(proc, weights, needles, what, ranks=None):
    """ranks: the number of ranks whose own exit status must be non-zero (run_job's
    failing runs report one line each)."""
    if proc.returncode == 0:
        raise SystemExit(f"FAIL: {what}: the job exited 0")
    if ranks is not None:
        codes = [ln.split(RANK_EXIT, 1)[1].strip() for ln in proc.stdout.splitlines()
                 if RANK_EXIT in ln]
        if len(codes) > ranks or "0" in codes:
            sys.stdout.write(proc.stdout[-3000:])
            raise SystemExit(f"FAIL: {what}: rank exit statuses {codes} of {ranks} ranks, "
                             "want only non-zero ones")
        print(f"ok: {what}: rank exit statuses {codes}"
              f"{f', {ranks - len(codes)} killed with the job' if len(codes) < ranks else ''}")
    for n in needles:
        if n not in proc.stdout:
            sys.stdout.write(proc.stdout[-3000:])
            raise SystemExit(f"FAIL: {what}: output lacks {n!r}")
    if os.path.exists(weights):
        raise SystemExit(f"FAIL: {what}: weights were written despite the error")
    print(f"ok: {what}: exit status {proc.returncode}, clear error")


def cmd_violation(args, tmp):
    manifest = write_manifest(args, tmp)
    with open(manifest) as f:
        m = json.load(f)
    seq = m["sequence"]
    if seq[-1] != ["reduce_scatter", "root"]:
        raise SystemExit(f"FAIL: unexpected last sequence entry {seq[-1]}")
    seq[-1] = ["reduce_scatter", "blocks.0"]  # the job will reduce-scatter root there
    bad = os.path.join(tmp, "violated.json")
    with open(bad, "w") as f:
        json.dump(m, f)
    w, proc = run_job(args, tmp, "violated", STEPS + ["--optim", "adamw"],
                      preload_vars(args, bad), expect_ok=False, each_rank=True)
    expect_one_error(proc, w, ["expected reduce_scatter(count=", "of group blocks.0",
                               "received reduce_scatter(count="], "sequence violation",
                     ranks=args.np)


def cmd_record(args, tmp):
    manifest = write_manifest(args, tmp)
    with open(manifest) as f:
        m = json.load(f)
    job_seq = m.pop("sequence")
    noseq = os.path.join(tmp, "noseq.json")
    with open(noseq, "w") as f:
        json.dump(m, f)
    extra = STEPS + ["--optim", "adamw"]
    w, proc = run_job(args, tmp, "noseq", extra, preload_vars(args, noseq), expect_ok=False)
    expect_failure(proc, w, ["share the call signature", "MFSDP_RECORD"],
                   "identical blocks without a sequence")
    rec = os.path.join(tmp, "record.json")
    base, _ = run_job(args, tmp, "plain", extra, {})
    w, _ = run_job(args, tmp, "recording", extra, preload_vars(args, None, MFSDP_RECORD=rec))
    ftc.compare(w, base, 0.0, "MFSDP_RECORD run vs no shim")
    joined = os.path.join(tmp, "joined.json")
    ftc.run([args.plan, noseq, "--world-size", str(args.np), "--record", rec,
             "--write-manifest", joined], joined + ".log")
    with open(joined) as f:
        got = json.load(f)["sequence"]
    if got != job_seq:
        raise SystemExit(f"FAIL: joined sequence {got} != the job's {job_seq}")
    print(f"ok: record joined into the job's call sequence ({len(got)} calls)")
    w, text = run_job(args, tmp, "joined", extra, preload_vars(args, joined))
    check_reference(args, tmp, w, text)


def cmd_mode(args, tmp):
    nsteps = args.steps or ftc.MODE_STEPS
    flags = ftc.CASES[args.case] + ["--steps", str(nsteps)]
    path = os.path.join(tmp, "manifest.json")
    cmd = mpirun(args, {}) + [exe_of(args)] + ftc.COMMON + ftc.CASES[args.case] + [
        "--steps", "0", "--optim", "none", "--write-manifest", path]
    ftc.run(cmd, path + ".log")
    extra = {"MFSDP_TAIL": "job"} if args.tail_job else {}
    w, text = run_job(args, tmp, "shim", flags + ["--optim", "adamw"],
                      preload_vars(args, path, **extra))
    ref = os.path.join(tmp, "reference.bin")
    ref_text = ftc.reference(args, args.np, flags + ["--optim", "muon-gather"], ref)
    what = (f"{args.case} under the shim ({args.flavour}, {args.np} ranks"
            f"{', tail job' if args.tail_job else ''}) vs full-matrix Muon")
    ftc.compare(w, ref, ftc.TOL, what)
    a, b = ftc.losses(text), ftc.losses(ref_text)
    if len(a) != nsteps or len(a) != len(b):
        raise SystemExit(f"FAIL: {len(a)} and {len(b)} loss lines")
    for x, y in zip(a, b):
        if abs(float(x) - float(y)) > ftc.TOL * max(1.0, abs(float(y))):
            raise SystemExit(f"FAIL: loss traces differ: {x} vs {y}")
    if "mfsdp: summary:" not in text:
        raise SystemExit("FAIL: no summary line")
    summary = [ln for ln in text.splitlines() if "mfsdp: summary:" in ln][0]
    print(f"ok: loss traces agree ({a[-1]} vs {b[-1]}); {summary[15:]}")


def latest_step(root):
    """The step of the checkpoint root/latest names (None when there is none)."""
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().split()[0]
    except FileNotFoundError:
        return None, None
    with open(os.path.join(root, name, "model.safetensors.index.json")) as f:
        return json.load(f)["mfsdp"]["step"], name


def committed(root):
    return sorted(d for d in os.listdir(root) if d.startswith("step-") and ".partial" not in d)


def cmd_resume(args, tmp):
    """Kill a rank at a random step of a checkpointing job, restart it with MFSDP_RESUME=auto
    and --start-step at the step the checkpoint names: the final weights and the loss trace
    from there are bitwise those of the uninterrupted run."""
    import random
    nsteps = 12
    flags = ftc.CASES[args.case] if args.case else []
    manifest = os.path.join(tmp, "manifest.json")
    ftc.run(mpirun(args, {}) + [exe_of(args)] + ftc.COMMON + flags +
            ["--steps", "0", "--optim", "none", "--write-manifest", manifest], manifest + ".log")
    base = preload_vars(args, manifest)
    flags += ["--optim", "adamw"]
    full, full_text = run_job(args, tmp, "full", ["--steps", str(nsteps)] + flags, base)
    full_loss = ftc.losses(full_text)
    rng = random.Random(1000 * args.np + (args.flavour == "nccl"))
    resumed_from = []
    for i in range(args.rounds):
        every, keep = rng.randint(1, 4), rng.choice([0, 1, 2])
        die_step, die_rank = rng.randint(1, nsteps - 1), rng.randrange(args.np)
        root = os.path.join(tmp, f"ckpt-{i}")
        v = dict(base, MFSDP_CKPT_DIR=root, MFSDP_CKPT_EVERY=every, MFSDP_CKPT_KEEP=keep,
                 MFSDP_RESUME="auto")
        what = (f"round {i}: every {every} keep {keep}, rank {die_rank} killed at step "
                f"{die_step}")
        _, proc = run_job(args, tmp, f"die-{i}", ["--steps", str(nsteps), "--die-at",
                                                  f"{die_step}:{die_rank}"] + flags,
                          v, expect_ok=False)
        if proc.returncode == 0:
            raise SystemExit(f"FAIL: {what}: the killed job exited 0")
        # Saves run at steps every, 2*every, ... at the first all-gather of the iteration
        # after that step; one of die_step itself can happen where the dead rank is not in
        # the saving shard group (HSDP). The newest save may not have committed when the job
        # died (one at most is in flight: a save waits for the previous one).
        saves = [None] + list(range(every, die_step + 1, every))
        step, name = latest_step(root) if os.path.isdir(root) else (None, None)
        allowed = saves[-3:] if saves[-1] == die_step else saves[-2:]
        if step not in allowed:
            raise SystemExit(f"FAIL: {what}: latest checkpoint is step {step}, want one of "
                             f"{allowed}")
        start = step or 0
        w, text = run_job(args, tmp, f"resume-{i}",
                          ["--steps", str(nsteps), "--start-step", str(start)] + flags, v)
        if start > 0 and f"mfsdp: resumed from {root} at step {start}" not in text:
            sys.stdout.write(text[-2000:])
            raise SystemExit(f"FAIL: {what}: no 'resumed from' line")
        ftc.compare(w, full, 0.0, f"{what}: resumed at step {start} vs the uninterrupted run")
        loss = ftc.losses(text)
        if loss != full_loss[start:]:
            raise SystemExit(f"FAIL: {what}: loss trace from step {start} differs:\n{loss}\n"
                             f"{full_loss[start:]}")
        end, _ = latest_step(root)
        if end != nsteps:
            raise SystemExit(f"FAIL: {what}: the run's last checkpoint is step {end}, want "
                             f"{nsteps}")
        kept = committed(root)
        if keep and len(kept) > keep:
            raise SystemExit(f"FAIL: {what}: MFSDP_CKPT_KEEP={keep} but {kept} remain")
        resumed_from.append(start)
    print(f"ok: {args.rounds} kills and restarts ({args.flavour}, {args.np} ranks) bitwise "
          f"equal to the uninterrupted run; resumed from steps {resumed_from}")


def cmd_ckpt_errors(args, tmp):
    """Checkpoint variables that cannot do what they say stop the job with one error line."""
    manifest = write_manifest(args, tmp)
    extra = ["--steps", "3", "--optim", "adamw"]
    root = os.path.join(tmp, "ckpt")
    cases = [
        ("every-without-dir", {"MFSDP_CKPT_EVERY": "2"},
         ["MFSDP_CKPT_EVERY is set but MFSDP_CKPT_DIR is not"]),
        ("auto-without-dir", {"MFSDP_RESUME": "auto"}, ["MFSDP_RESUME=auto needs MFSDP_CKPT_DIR"]),
        ("resume-and-init", {"MFSDP_RESUME": root, "MFSDP_INIT": "/x.safetensors"},
         ["are both set"]),
        ("tail-job", {"MFSDP_CKPT_DIR": root, "MFSDP_TAIL": "job"},
         ["tail \"job\"", "would miss them"]),
        ("resume-missing", {"MFSDP_RESUME": os.path.join(tmp, "nothing-here")},
         ["MFSDP_RESUME=", "could not be loaded"]),
        ("init-missing", {"MFSDP_INIT": os.path.join(tmp, "none.safetensors")},
         ["MFSDP_INIT=", "could not be loaded"]),
    ]
    for tag, kv, needles in cases:
        w, proc = run_job(args, tmp, tag, extra, preload_vars(args, manifest, **kv),
                          expect_ok=False, each_rank=True)
        expect_one_error(proc, w, needles, tag, ranks=args.np)
    # Tagged mode (the PyTorch companion, no manifest) keeps the job's own checkpoints.
    companion = {"LD_PRELOAD": args.preload, "MFSDP_COMPANION": "tag", "MFSDP_CKPT_DIR": root}
    w, proc = run_job(args, tmp, "companion", extra, companion, expect_ok=False, each_rank=True)
    expect_one_error(proc, w, ["MFSDP_CKPT_DIR is set, but", "apply to jobs run with "
                               "MFSDP_MANIFEST"], "checkpoint variables in tagged mode",
                     ranks=args.np)
    companion = {"LD_PRELOAD": args.preload, "MFSDP_COMPANION": "tag", "MFSDP_CKPT_EVERY": "5"}
    w, proc = run_job(args, tmp, "companion-every", extra, companion, expect_ok=False,
                      each_rank=True)
    expect_one_error(proc, w, ["MFSDP_CKPT_EVERY is set, but"],
                     "MFSDP_CKPT_EVERY in tagged mode", ranks=args.np)
    # Under mfsdp-run the job keeps its optimizer for the tail, its schedule, accumulation and
    # clipping, and the companion builds the manifest: the variables that would configure
    # those are refused (MFSDP_TAIL=owner used to train the tail again, silently).
    for var, value in (("MFSDP_TAIL", "owner"), ("MFSDP_TAIL", "shard"),
                       ("MFSDP_MANIFEST", manifest), ("MFSDP_RECORD", os.path.join(tmp, "r")),
                       ("MFSDP_LR_SCHEDULE", "warmup-cosine,warmup=2,decay=4"),
                       ("MFSDP_ACCUM_STEPS", "2"), ("MFSDP_STEP", "lazy"), ("MFSDP_CLIP", "1"),
                       ("MFSDP_ADAMW_LR", "0.1"), ("MFSDP_GRAD_DIVIDE", "world")):
        env = {"LD_PRELOAD": args.preload, "MFSDP_COMPANION": "tag", var: value}
        w, proc = run_job(args, tmp, "companion-" + var, extra, env, expect_ok=False,
                          each_rank=True)
        expect_one_error(proc, w, [f"{var}={value} is set under mfsdp-run",
                                   "unset it"], f"{var}={value} under mfsdp-run", ranks=args.np)
    # MFSDP_TAIL=job says what the companion does anyway: not refused (the job then fails
    # only because no companion registered a model).
    env = {"LD_PRELOAD": args.preload, "MFSDP_COMPANION": "tag", "MFSDP_TAIL": "job"}
    w, proc = run_job(args, tmp, "companion-tail-job", extra, env, expect_ok=False,
                      each_rank=True)
    if "is set under mfsdp-run" in proc.stdout:
        raise SystemExit("FAIL: MFSDP_TAIL=job under mfsdp-run was refused")
    print("ok: MFSDP_TAIL=job under mfsdp-run is accepted")
    # The same manifest without tail job: a save at the end, then a resume of it with a
    # manifest of other hyper-parameters is refused (the checkpoint's manifest must match).
    w, text = run_job(args, tmp, "saved", extra, preload_vars(args, manifest,
                                                              MFSDP_CKPT_DIR=root))
    step, _ = latest_step(root)
    if step != 3:
        raise SystemExit(f"FAIL: the job's end saved step {step}, want 3")
    stall = re.search(r"; (\d+) checkpoint saves?, training held ([0-9.]+) ms per save "
                      r"\(max ([0-9.]+) ms\)", text)
    if stall is None or int(stall.group(1)) != 1:
        raise SystemExit("FAIL: the summary line does not report the one save and its stall")
    print(f"ok: a save at the end of the job (step 3), stall {stall.group(2)} ms reported")
    # MFSDP_INIT: the saved weights exported as one safetensors file start a new job, whose
    # final all-gather (no step) returns them bitwise.
    tool = os.path.join(os.path.dirname(args.plan), "mfsdp-ckpt")
    full = os.path.join(tmp, "full.safetensors")
    ftc.run([tool, "export-full", root, full], full + ".log")
    z, _ = run_job(args, tmp, "init", ["--steps", "0", "--optim", "adamw"],
                   preload_vars(args, manifest, MFSDP_INIT=full))
    ftc.compare(z, w, 0.0, "MFSDP_INIT from the exported step-3 weights vs the saving job")
    with open(manifest) as f:
        m = json.load(f)
    p = next(p for g in m["groups"] for p in g["params"] if p["optimizer"] == "muon")
    p["optimizer"] = "adamw"
    other = os.path.join(tmp, "other-roles.json")
    with open(other, "w") as f:
        json.dump(m, f)
    w, proc = run_job(args, tmp, "mismatch", extra,
                      preload_vars(args, other, MFSDP_RESUME=root), expect_ok=False,
                      each_rank=True)
    expect_one_error(proc, w, ["could not be loaded", p["name"]],
                     "resume with a manifest whose roles differ from the checkpoint's",
                     ranks=args.np)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["muon", "passthrough", "silent", "violation", "record",
                                     "mode", "resume", "ckpt-errors"])
    ap.add_argument("--rounds", type=int, default=10, help="resume: kill-and-restart rounds")
    ap.add_argument("--case", dest="mode_case", choices=sorted(ftc.CASES),
                    help="mode: the fsdp_train situation")
    ap.add_argument("--tail-job", action="store_true", help="mode: MFSDP_TAIL=job")
    ap.add_argument("--steps", type=int, default=0,
                    help="mode: optimizer steps (default 6); one that ends the job inside a "
                    "sequence of several passes checks that such an end is accepted")
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--flavour", choices=["mpi", "nccl"], default="mpi")
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--mpi-exe", required=True)
    ap.add_argument("--nccl-exe")
    ap.add_argument("--preload-mpi", required=True, help="libmfsdp_preload_mpi.so")
    ap.add_argument("--preload-nccl", help="libmfsdp_preload.so (the NCCL flavour)")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--env", action="append", default=[],
                    help="K=V passed to the ranks of shim runs (e.g. MFSDP_STEP=lazy)")
    args = ap.parse_args()
    args.env = dict(kv.split("=", 1) for kv in args.env)
    if args.flavour == "nccl" and not (args.nccl_exe and args.preload_nccl):
        raise SystemExit("FAIL: fsdp_train_nccl or libmfsdp_preload.so was not built")
    # Each flavour runs under its front-end's library.
    args.preload = args.preload_nccl if args.flavour == "nccl" else args.preload_mpi
    with tempfile.TemporaryDirectory(prefix="mfsdp-shim-") as tmp:
        args.command = args.case
        args.case = args.mode_case
        {"muon": cmd_muon, "passthrough": cmd_passthrough, "silent": cmd_silent,
         "violation": cmd_violation, "record": cmd_record,
         "mode": cmd_mode, "resume": cmd_resume,
         "ckpt-errors": cmd_ckpt_errors}[args.command](args, tmp)
    print("PASS")


if __name__ == "__main__":
    main()
