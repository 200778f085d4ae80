#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The LD_PRELOAD shim on the unmodified job examples/fsdp_train (suite `preload`).

  muon N         the job's own --optim adamw run under the shim (MPI or NCCL-API flavour,
                 eager or, with --env MFSDP_STEP=lazy, lazy steps; any algorithm)
                 ends with weights equal to the single-process full-matrix Muon + AdamW
                 reference (--reference --optim muon-gather --emulate-world N) within 1e-5
                 relative per tensor, and so do its loss traces.
  passthrough N  with a manifest that does not match (world size N+1), and with no
                 manifest at all, the job under the shim is bitwise identical to the job
                 without it (weights and loss trace).
  violation N    a manifest whose sequence the job contradicts: non-zero exit, an error
                 naming expected vs received, and no weights written.
  record N       groups with one signature and no sequence are refused with a message that
                 points at MFSDP_RECORD; MFSDP_RECORD runs pass-through (bitwise unchanged),
                 `mfsdp-plan --record` joins the record into the job's exact call sequence,
                 and the joined manifest trains like the reference.
"""
import argparse
import json
import os
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


def run_job(args, tmp, tag, extra, env_vars, expect_ok=True):
    out = os.path.join(tmp, tag + ".bin")
    env = shim_env(args, **env_vars)
    cmd = mpirun(args, env_vars) + [exe_of(args)] + ftc.COMMON + extra + ["--dump-weights", out]
    if expect_ok:
        text = ftc.run(cmd, out + ".log", env)
        return out, text
    import subprocess
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=150, env=env)
    with open(out + ".log", "w") as f:
        f.write(" ".join(cmd) + "\n" + proc.stdout)
    return out, proc


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
    manifest = write_manifest(args, tmp)
    with open(manifest) as f:
        m = json.load(f)
    m["world_size"] = args.np + 1
    other = os.path.join(tmp, "other-world.json")
    with open(other, "w") as f:
        json.dump(m, f)
    extra = STEPS + ["--optim", "adamw"]
    base, base_text = run_job(args, tmp, "plain", extra, {})
    for tag, vars_ in [("mismatch", preload_vars(args, other)), ("nomanifest", preload_vars(args))]:
        w, text = run_job(args, tmp, tag, extra, vars_)
        ftc.compare(w, base, 0.0, f"pass-through ({tag}) vs no shim")
        if ftc.losses(text) != ftc.losses(base_text):
            raise SystemExit(f"FAIL: pass-through ({tag}) changed the loss trace")


def expect_failure(proc, weights, needles, what):
    if proc.returncode == 0:
        raise SystemExit(f"FAIL: {what}: the job exited 0")
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
                      preload_vars(args, bad), expect_ok=False)
    expect_failure(proc, w, ["call sequence violated", "expected reduce_scatter(count=",
                             "of group blocks.0, received reduce_scatter(count="],
                   "sequence violation")


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["muon", "passthrough", "violation", "record"])
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--flavour", choices=["mpi", "nccl"], default="mpi")
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--mpi-exe", required=True)
    ap.add_argument("--nccl-exe")
    ap.add_argument("--preload", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--env", action="append", default=[],
                    help="K=V passed to the ranks of shim runs (e.g. MFSDP_STEP=lazy)")
    args = ap.parse_args()
    args.env = dict(kv.split("=", 1) for kv in args.env)
    if args.flavour == "nccl" and not args.nccl_exe:
        raise SystemExit("FAIL: fsdp_train_nccl was not built")
    with tempfile.TemporaryDirectory(prefix="mfsdp-shim-") as tmp:
        {"muon": cmd_muon, "passthrough": cmd_passthrough, "violation": cmd_violation,
         "record": cmd_record}[args.case](args, tmp)
    print("PASS")


if __name__ == "__main__":
    main()
