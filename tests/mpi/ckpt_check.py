#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Owner checkpoints across processes (suite `mpi`), driving tests/mpi/test_ckpt and
tools/mfsdp-ckpt.

  resume    train 10 steps at 4 ranks and save; resume at 1, 2, 3 and 4 ranks (other tail
            policies and algorithms): the loaded state is bitwise the saved one, and 10 more
            steps match 20 uninterrupted steps at 4 ranks (bitwise at 4 ranks with `direct`,
            1e-5 relative otherwise); the lazy step mode too (6 + 4 steps).
  tools     mfsdp-ckpt info/verify; reshard 4 -> 3 and 4 -> 2 (and back to 5), each resumed
            and loaded bitwise; export-full (param dtype, --fp32) loaded with load_full
            (fp32 masters bitwise); import-full of the fp32 export trains like load_full; every
            error path of the tool (usage: exit 2; bad input: exit 1, one line naming what).
  kill      a save killed with SIGKILL at every progress point (forked writer, 1 rank), and
            rank 0 or 1 of 3 killed at points across the save, the files and the commit:
            each time the latest checkpoint verifies and loads (at 2 ranks) as the previous
            or the new complete one, and nothing partial is ever named by `latest`.
  corrupt   damaged copies of a 2-rank checkpoint refused by the collective load.
  python    Python's `safetensors` reads the exported file and the per-rank model files (via
            the index's weight_map) and finds exactly the trained weights and fp32 masters
            (the venv's python: MFSDP_TEST_PYTHON, as scripts/test.sh sets it, else
            ~/.cache/mfsdp/venv; skipped, exit 77, only when neither is set up).
  perf      save/load throughput per rank (figures printed, not asserted).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
VENV_PY = os.environ.get("MFSDP_TEST_PYTHON") or os.path.expanduser(
    "~/.cache/mfsdp/venv/bin/python")


def run(cmd, expect=0, timeout=120, quiet=False):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if expect is not None and proc.returncode != expect:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"FAIL: exit status {proc.returncode} (expected {expect}): "
                         f"{' '.join(cmd)}")
    if not quiet:
        for line in proc.stdout.splitlines():
            if not line.startswith("test_ckpt") and line.strip():
                print("   ", line)
    return proc


def mpi(args, np, *rest, expect=0, timeout=120, quiet=False):
    return run([args.mpirun, "-np", str(np)] + MPIRUN_FLAGS + [args.exe] + list(rest),
               expect=expect, timeout=timeout, quiet=quiet)


def tool(args, *rest, expect=0):
    return run([args.tool] + list(rest), expect=expect, quiet=True)


def save(args, tmp, name, np=4, extra=(), steps=6):
    root = os.path.join(tmp, name)
    mpi(args, np, "save", root, "--steps", str(steps), *extra)
    return root


def case_resume(args, tmp):
    # 10 steps at 4 ranks, saved; resumed elsewhere for 10 more: against 20 uninterrupted
    # steps at 4 ranks (the saving run goes on: root.ref-more).
    root = save(args, tmp, "r", extra=["--more", "10"], steps=10)
    tool(args, "verify", root)
    for np, extra in [(4, ["--bitwise"]), (4, ["--tail", "owner", "--bitwise"]),
                      (3, ["--tail", "owner", "--algo", "chain"]), (2, ["--tail", "auto"]),
                      (1, ["--algo", "native"])]:
        print(f"resume at {np} ranks {' '.join(extra)}")
        mpi(args, np, "resume", root, "--steps", "10", "--more", "10", *extra)
    lazy = save(args, tmp, "lazy", np=3, extra=["--lazy", "--algo", "chain"])
    print("resume a lazy-step job at 2 ranks")
    mpi(args, 2, "resume", lazy, "--steps", "6", "--more", "4", "--lazy")


def expect_fail(args, cmdargs, code, *needles):
    proc = tool(args, *cmdargs, expect=code)
    out = proc.stdout.strip()
    lines = out.splitlines()
    if len(lines) != 1 or not lines[0].startswith("mfsdp-ckpt: "):
        raise SystemExit(f"FAIL: {' '.join(cmdargs)}: expected one 'mfsdp-ckpt: ' line, got:\n"
                         f"{out}")
    for n in needles:
        if n not in out:
            raise SystemExit(f"FAIL: {' '.join(cmdargs)}: '{n}' not in: {out}")
    print(f"    exit {code}: {out}")


def case_tools(args, tmp):
    root = save(args, tmp, "t")
    ref = root + ".ref"
    info = tool(args, "info", root).stdout
    for needle in ["world size   4", "step         6", "blocks.0.wq", "sharded",
                   "model-00000-of-00004.safetensors"]:
        if needle not in info:
            raise SystemExit(f"FAIL: info lacks '{needle}':\n{info}")
    print(tool(args, "verify", root).stdout.strip())
    # reshard to 3 and 2 ranks, and chained 3 -> 5
    for m, extra in [(3, []), (2, ["--tail", "owner"])]:
        out = os.path.join(tmp, f"t{m}")
        tool(args, "reshard", root, "--world-size", str(m), out, *extra)
        tool(args, "verify", out)
        print(f"reshard 4 -> {m} {' '.join(extra)}: resumed at {m} ranks")
        mpi(args, m, "resume", out, ref, "--steps", "6", "--more", "3")
    out5 = os.path.join(tmp, "t5")
    tool(args, "reshard", os.path.join(tmp, "t3"), "--world-size", "5", out5, "--tail", "auto",
         "--mem-limit", "1G")
    print("reshard 3 -> 5: resumed at 5 ranks")
    mpi(args, 5, "resume", out5, ref, "--steps", "6", "--more", "2")
    # export, load_full, import
    fp = os.path.join(tmp, "full-param.safetensors")
    f32 = os.path.join(tmp, "full-fp32.safetensors")
    tool(args, "export-full", root, fp)
    tool(args, "export-full", root, f32, "--fp32")
    mpi(args, 3, "loadfull", f32, ref, "fp32")
    mpi(args, 2, "loadfull", fp, ref, "param")
    with open(os.path.join(root, open(os.path.join(root, "latest")).read().split()[0],
                           "model.safetensors.index.json")) as f:
        manifest = json.load(f)["mfsdp"]["manifest"]
    mpath = os.path.join(tmp, "manifest.json")
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    imp = os.path.join(tmp, "imported")
    tool(args, "import-full", f32, mpath, imp, "--world-size", "2")
    tool(args, "verify", imp)
    mpi(args, 2, "import", imp, f32, "--more", "3")

    # the tool's error paths
    print("tool errors:")
    expect_fail(args, [], 2, "missing command")
    expect_fail(args, ["frobnicate", root], 2, "unknown command 'frobnicate'")
    expect_fail(args, ["verify"], 2, "'verify' takes other arguments")
    expect_fail(args, ["reshard", root, os.path.join(tmp, "x")], 2, "needs --world-size")
    expect_fail(args, ["reshard", root, os.path.join(tmp, "x"), "--world-size", "0"], 2,
                "bad --world-size '0'")
    expect_fail(args, ["reshard", root, os.path.join(tmp, "x"), "--world-size", "2", "--tail",
                       "both"], 2, "bad --tail 'both'")
    expect_fail(args, ["verify", root, "--fp32"], 2, "takes no --fp32")
    expect_fail(args, ["verify", root, "--world-size", "2"], 2, "takes no --world-size")
    expect_fail(args, ["info", root, "--bogus"], 2, "unknown option")
    expect_fail(args, ["verify", os.path.join(tmp, "nowhere")], 1, "nowhere")
    expect_fail(args, ["verify", tmp], 1, "no checkpoint here")
    # a damaged copy: verify, export and reshard refuse it, naming the file
    bad = os.path.join(tmp, "bad")
    shutil.copytree(root, bad)
    d = open(os.path.join(bad, "latest")).read().split()[0]
    victim = os.path.join(bad, d, "optim-00002-of-00004.safetensors")
    with open(victim, "r+b") as f:
        f.seek(-5, 2)
        b = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([b[0] ^ 1]))
    for cmd in (["verify", bad], ["export-full", bad, os.path.join(tmp, "x.safetensors")],
                ["reshard", bad, "--world-size", "2", os.path.join(tmp, "x")]):
        expect_fail(args, cmd, 1, "optim-00002-of-00004.safetensors", "does not match the index")
    os.remove(victim)
    expect_fail(args, ["verify", bad], 1, "optim-00002-of-00004.safetensors", "incomplete")
    for p in (os.path.join(tmp, "x.safetensors"), os.path.join(tmp, "x")):
        if os.path.exists(p):
            raise SystemExit(f"FAIL: {p} written from a damaged checkpoint")
    # import-full: a manifest that does not fit the file; a file that is not safetensors
    m2 = json.loads(json.dumps(manifest))
    m2["groups"][0]["params"][0]["shape"] = [12, 37]
    m2path = os.path.join(tmp, "manifest2.json")
    with open(m2path, "w") as f:
        json.dump(m2, f)
    expect_fail(args, ["import-full", f32, m2path, os.path.join(tmp, "i2"), "--world-size", "2"],
                1, "tensor 'embed.weight' of the manifest is there with another shape")
    expect_fail(args, ["import-full", mpath, mpath, os.path.join(tmp, "i3"), "--world-size", "2"],
                1, "manifest.json")
    expect_fail(args, ["import-full", f32, os.path.join(tmp, "nomanifest.json"),
                       os.path.join(tmp, "i4"), "--world-size", "2"], 1, "nomanifest.json")
    expect_fail(args, ["export-full", root, "/nonexistent-dir/x.safetensors"], 1,
                "/nonexistent-dir/x.safetensors.tmp: cannot create: No such file or directory")
    # an export over a file of the checkpoint it reads (its rename would replace that file)
    with open(os.path.join(root, "latest")) as f:
        step_dir = os.path.join(root, f.read().split()[0])
    victim = os.path.join(step_dir, sorted(n for n in os.listdir(step_dir)
                                           if n.startswith("optim-"))[0])
    with open(victim, "rb") as f:
        before = f.read()
    expect_fail(args, ["export-full", root, victim], 1, "is inside the checkpoint",
                "it exports")
    with open(victim, "rb") as f:
        if f.read() != before:
            raise SystemExit(f"FAIL: {victim} changed by a refused export")
    tool(args, "verify", root)
    # a FIFO where a file is read: refused at once, not a blocked open
    fifo = os.path.join(tmp, "fifo.safetensors")
    os.mkfifo(fifo)
    expect_fail(args, ["import-full", fifo, mpath, os.path.join(tmp, "i5"), "--world-size", "2"],
                1, "not a regular file")
    fdir = os.path.join(tmp, "fifo-ckpt")
    os.mkdir(fdir)
    os.mkfifo(os.path.join(fdir, "model.safetensors.index.json"))
    expect_fail(args, ["verify", fdir], 1, "not a regular file")
    # a plan that fails names its cause (the planner's warning), not only a status word
    expect_fail(args, ["reshard", root, "--world-size", "2", os.path.join(tmp, "x"),
                       "--mem-limit", "1K"], 1, "memory limit exceeded (tensor ",
                "over the memory limit of 1024 bytes)")
    expect_fail(args, ["reshard", root, os.path.join(tmp, "x"), "--world-size", "3",
                       "--world-size", "5"], 2, "--world-size is given twice")
    # an option without its value
    expect_fail(args, ["reshard", root, os.path.join(tmp, "x"), "--world-size"], 2,
                "option '--world-size' needs a value")


def case_kill(args, tmp):
    env_fork = dict(os.environ, OMPI_MCA_mpi_warn_on_fork="0")
    proc = subprocess.run([args.mpirun, "-np", "1"] + MPIRUN_FLAGS +
                          [args.exe, "killfork", os.path.join(tmp, "kf")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240, env=env_fork)
    print(proc.stdout.strip())
    if proc.returncode != 0:
        raise SystemExit("FAIL: killfork")
    # Rank 1 (a writer) and rank 0 (writer and committer) of 3 killed across the save: rank
    # 1 after the snapshot, inside its model file, inside its optim file, after its record;
    # rank 0 inside its model file, with the index written but not synced, with the
    # directory renamed but `latest` old, with `latest` replaced.
    tried = 0
    for rank, points in [(1, [2, 9, 24, 33]), (0, [12, 33, 38, 42])]:
        for pt in points:
            root = os.path.join(tmp, f"km-{rank}-{pt}")
            proc = mpi(args, 3, "killmpi", root, "--point", str(pt), "--kill-rank", str(rank),
                       expect=None, quiet=True)
            killed = proc.returncode != 0
            if not killed:
                raise SystemExit(f"FAIL: rank {rank} point {pt}: the save ended without the "
                                 f"kill (fewer points than expected?)\n{proc.stdout}")
            out = mpi(args, 2, "check", root, quiet=True).stdout
            tried += 1
            which = "previous" if "the previous checkpoint" in out else "new"
            print(f"    rank {rank} killed at point {pt}: latest loads ({which})")
    print(f"kill: {tried} multi-rank kill points, every one recovered")


def case_corrupt(args, tmp):
    mpi(args, 2, "corrupt", os.path.join(tmp, "c"))


def case_python(args, tmp):
    if not os.path.exists(VENV_PY):
        if os.environ.get("MFSDP_TEST_PYTHON"):
            raise SystemExit(f"FAIL: MFSDP_TEST_PYTHON={VENV_PY} does not exist")
        print(f"SKIP: {VENV_PY} is absent: the check with Python's safetensors needs it")
        raise SystemExit(77)
    root = save(args, tmp, "p", np=3)
    fp = os.path.join(tmp, "full-param.safetensors")
    f32 = os.path.join(tmp, "full-fp32.safetensors")
    tool(args, "export-full", root, fp)
    tool(args, "export-full", root, f32, "--fp32")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_python.py")
    proc = subprocess.run([VENV_PY, script, root, root + ".ref", fp, f32],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    print(proc.stdout.strip())
    if proc.returncode != 0:
        raise SystemExit("FAIL: python safetensors check")


def case_perf(args, tmp):
    for np in (1, 2, 4):
        mpi(args, np, "perf", os.path.join(tmp, "perf"), "--mb", str(args.mb), timeout=300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["resume", "tools", "kill", "corrupt", "python", "perf"])
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--exe", required=True)
    ap.add_argument("--tool", required=True)
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix=f"mfsdp-ckpt-{args.case}-")
    try:
        globals()["case_" + args.case](args, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"ckpt_check {args.case}: passed")


if __name__ == "__main__":
    main()
