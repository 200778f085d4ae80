#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The GPU machine's launch path, run here over the test NCCL library (suite `preload`).

  nompi N      fsdp_train_nccl_nompi (no MPI: RANK/WORLD_SIZE, the unique id through the
               file FSDP_TRAIN_ID_FILE) started by scripts/device-launch.sh --fake at N ranks
               is bitwise equal to fsdp_train_nccl (MPI_Init, MPI_Bcast of the id) under
               mpirun: weights and loss traces, muon-gather and adamw (at 4 ranks HSDP 2 x 2
               too, ncclCommSplit); every rank reports exit 0; the id file is gone after the
               run; the job has no MPI symbol (nm -D) and no libmpi among its NEEDED entries.
  bootstrap    the no-MPI bootstrap's refusals, each one error line and a non-zero exit: no
               id file within FSDP_TRAIN_ID_TIMEOUT (within seconds, no hang), an id file
               already there (rank 0; the file is left alone), an id file of another size,
               RANK / WORLD_SIZE / FSDP_TRAIN_ID_FILE missing or out of range.
  launcher     scripts/device-launch.sh on its own: per-rank variables and exit statuses, a
               failing rank stops the others (exit 1), a hung job is stopped at the timeout
               (exit 124), both well before the ranks would have ended.
  fake-check   scripts/device-check.sh --fake (its test-only mode) end to end on the job
               built here: 1 and 4 ranks, the job's muon-gather and its AdamW under the shim
               (also with MFSDP_NCCL_REGISTER=1) against --reference within 1e-5, every
               rank's exit status, the table; with MFSDP_DEVICE_BAND=1e-12 both shim rows fail
               and the script exits 1 (the comparison can fail).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_train_check as ftc  # noqa: E402  (MPIRUN_FLAGS, COMMON, run, compare, losses)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "scripts", "device-launch.sh")
CHECK = os.path.join(ROOT, "scripts", "device-check.sh")


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def proc(cmd, env=None, timeout=150):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, timeout=timeout)


def cmd_nompi(args):
    exe = args.nompi_exe
    undef = proc(["nm", "-D", "--undefined-only", exe]).stdout.split()
    mpi = [s for s in undef if re.match(r"^(P?MPI_|ompi_)", s)]
    needed = re.findall(r"\[([^\]]+)\]", proc(["readelf", "-d", exe]).stdout)
    if mpi or any("libmpi" in n for n in needed):
        fail(f"{exe} uses MPI: symbols {mpi[:5]}, NEEDED {needed}")
    print(f"ok: {os.path.basename(exe)}: no MPI symbol, NEEDED {' '.join(needed)}")
    modes = [["--optim", "muon-gather"], ["--optim", "adamw"]]
    if args.np == 4:
        modes.append(["--optim", "muon-gather", "--hsdp", "2"])
    with tempfile.TemporaryDirectory() as tmp:
        for extra in modes:
            tag = "_".join(x.strip("-") for x in extra)
            a, b = os.path.join(tmp, tag + ".mpi.bin"), os.path.join(tmp, tag + ".nompi.bin")
            flags = ftc.COMMON + ["--steps", "6"] + extra
            text_a = ftc.run([args.mpirun, "-np", str(args.np)] + ftc.MPIRUN_FLAGS +
                             [args.nccl_exe] + flags + ["--dump-weights", a], a + ".log")
            d = os.path.join(tmp, tag + ".launch")
            p = proc([LAUNCH, "-n", str(args.np), "-t", "100", "-d", d, "--fake", args.mpirun,
                      "--", exe] + flags + ["--dump-weights", b])
            if p.returncode != 0:
                sys.stdout.write(p.stdout)
                for r in range(args.np):
                    lp = os.path.join(d, f"rank{r}.log")
                    if os.path.exists(lp):
                        sys.stdout.write(f"--- rank {r}\n" + open(lp).read()[-2000:])
                fail(f"{tag}: the no-MPI job failed at {args.np} ranks")
            for r in range(args.np):
                if f"rank {r}: exit 0" not in p.stdout:
                    fail(f"{tag}: rank {r} did not report exit 0:\n{p.stdout}")
            if os.path.exists(os.path.join(d, "nccl-id")):
                fail(f"{tag}: the unique-id file is still there after the run")
            ftc.compare(b, a, 0.0, f"{tag}: no-MPI bootstrap vs MPI bootstrap at {args.np} ranks")
            la, lb = ftc.losses(text_a), ftc.losses(open(os.path.join(d, "rank0.log")).read())
            if la != lb or len(la) != 6:
                fail(f"{tag}: loss traces differ: {la} vs {lb}")
            print(f"ok: {tag}: loss traces equal ({la[-1]})")


def cmd_bootstrap(args):
    exe = args.nompi_exe
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FSDP_TRAIN_ID_FILE",
                         "FSDP_TRAIN_ID_TIMEOUT")}
    job = [exe] + ftc.COMMON + ["--steps", "1", "--quiet"]
    with tempfile.TemporaryDirectory() as tmp:
        idf = os.path.join(tmp, "id")

        def refuse(what, env, needle, max_s=20):
            t0 = time.monotonic()
            p = proc(job, env=dict(base, **env), timeout=60)
            dt = time.monotonic() - t0
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("fsdp_train:")]
            if p.returncode == 0:
                fail(f"{what}: exit 0\n{p.stdout}")
            if len(lines) != 1 or needle not in lines[0]:
                fail(f"{what}: want one error line with {needle!r}, got:\n{p.stdout}")
            if dt > max_s:
                fail(f"{what}: took {dt:.1f} s")
            print(f"ok: {what}: exit {p.returncode} in {dt:.1f} s: {lines[0]}")

        refuse("no id file within the timeout",
               {"RANK": "1", "WORLD_SIZE": "2", "FSDP_TRAIN_ID_FILE": idf,
                "FSDP_TRAIN_ID_TIMEOUT": "1"}, "no NCCL unique id in", max_s=10)
        with open(idf, "wb") as f:
            f.write(b"x" * 128)
        refuse("a stale id file (rank 0)",
               {"RANK": "0", "WORLD_SIZE": "2", "FSDP_TRAIN_ID_FILE": idf}, "already exists")
        if open(idf, "rb").read() != b"x" * 128:
            fail("rank 0 touched the stale id file")
        with open(idf, "wb") as f:
            f.write(b"x" * 100)
        refuse("an id file of another size",
               {"RANK": "1", "WORLD_SIZE": "2", "FSDP_TRAIN_ID_FILE": idf},
               "does not hold one NCCL unique id")
        refuse("RANK missing", {"WORLD_SIZE": "2", "FSDP_TRAIN_ID_FILE": idf},
               "RANK is not set")
        refuse("WORLD_SIZE missing", {"RANK": "0", "FSDP_TRAIN_ID_FILE": idf},
               "WORLD_SIZE is not set")
        refuse("RANK out of range", {"RANK": "2", "WORLD_SIZE": "2", "FSDP_TRAIN_ID_FILE": idf},
               "RANK=2 is not an integer in [0, 2)")
        refuse("FSDP_TRAIN_ID_FILE missing", {"RANK": "1", "WORLD_SIZE": "2"},
               "FSDP_TRAIN_ID_FILE is not set")


def cmd_launcher(args):
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "ok")
        p = proc([LAUNCH, "-n", "3", "-t", "20", "-d", d, "--", "sh", "-c",
                  'echo "$RANK $WORLD_SIZE $LOCAL_RANK $NCCL_HOSTID $FSDP_TRAIN_ID_FILE"'])
        if p.returncode != 0 or "launch n=3: ok" not in p.stdout:
            fail(f"three ranks that exit 0:\n{p.stdout}")
        hosts = set()
        for r in range(3):
            f = open(os.path.join(d, f"rank{r}.log")).read().split()
            if f[:3] != [str(r), "3", str(r)] or f[4] != os.path.join(os.path.realpath(d),
                                                                         "nccl-id"):
                fail(f"rank {r}'s variables: {f}")
            hosts.add(f[3])
        if len(hosts) != 3:
            fail(f"NCCL_HOSTID not distinct: {hosts}")
        print("ok: 3 ranks: RANK/WORLD_SIZE/LOCAL_RANK, distinct NCCL_HOSTID, the id file path")
        t0 = time.monotonic()
        p = proc([LAUNCH, "-n", "3", "-t", "60", "-d", os.path.join(tmp, "fail"), "--", "sh",
                  "-c", '[ "$RANK" = 1 ] && exit 3; exec sleep 50'])
        dt = time.monotonic() - t0
        if p.returncode != 1 or "rank 1: exit 3" not in p.stdout or \
                "FAILED (rank 1 exit 3)" not in p.stdout or dt > 20:
            fail(f"a rank exiting 3 (exit {p.returncode}, {dt:.1f} s):\n{p.stdout}")
        print(f"ok: rank 1 exits 3: launcher exit 1 in {dt:.1f} s, the others stopped")
        t0 = time.monotonic()
        hang = os.path.join(tmp, "hang")
        p = proc([LAUNCH, "-n", "2", "-t", "2", "-d", hang, "--", "sh", "-c",
                  'echo $$ > "$(dirname "$FSDP_TRAIN_ID_FILE")/pid$RANK"; exec sleep 50'])
        dt = time.monotonic() - t0
        if p.returncode != 124 or "TIMED OUT after 2 s" not in p.stdout or dt > 15:
            fail(f"a hung job (exit {p.returncode}, {dt:.1f} s):\n{p.stdout}")
        for r in range(2):
            pid = int(open(os.path.join(hang, f"pid{r}")).read())
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":  # a zombie has ended (a container's PID 1 may not reap it)
                fail(f"rank {r} (pid {pid}, state {state}) still runs after the timeout")
        print(f"ok: a hung job: exit 124 in {dt:.1f} s, both ranks stopped")


def cmd_fake_check(args):
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MFSDP_DEVICE_MESON_BUILD=args.build_root,
                   MFSDP_DEVICE_BUILD=os.path.join(tmp, "dc"), MFSDP_DEVICE_DEPS="none")
        p = proc([CHECK, "--fake"], env=env, timeout=170)
        tail = p.stdout[p.stdout.find("===== mfsdp device check summary"):]
        if p.returncode != 0:
            sys.stdout.write(p.stdout[-6000:])
            fail(f"device-check.sh --fake exited {p.returncode}")
        rows = [ln for ln in tail.splitlines() if ln.startswith("| m")]
        if len(rows) != 6 or any("FAILED" in r for r in rows):
            fail(f"want 6 passing table rows:\n{tail}")
        if tail.count("mfsdp: summary:") != 4 or "no-MPI check: ok" not in tail:
            fail(f"summary incomplete:\n{tail}")
        sys.stdout.write(tail)
        env["MFSDP_DEVICE_BAND"] = "1e-12"
        env["MFSDP_DEVICE_TRAIN_RANKS"] = "4"
        p = proc([CHECK, "--fake"], env=env, timeout=170)
        tail = p.stdout[p.stdout.find("===== mfsdp device check summary"):]
        bad = [ln for ln in tail.splitlines() if ln.startswith("| mfsdp shim") and "FAILED" in ln]
        if p.returncode != 1 or len(bad) != 2:
            sys.stdout.write(tail)
            fail(f"with a 1e-12 band: exit {p.returncode}, {len(bad)} failing shim rows, want 2")
        print(f"ok: with MFSDP_DEVICE_BAND=1e-12 the shim row fails: {bad[0]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["nompi", "bootstrap", "launcher", "fake-check"])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--nccl-exe")
    ap.add_argument("--nompi-exe")
    ap.add_argument("--build-root")
    args = ap.parse_args()
    {"nompi": cmd_nompi, "bootstrap": cmd_bootstrap, "launcher": cmd_launcher,
     "fake-check": cmd_fake_check}[args.mode](args)


if __name__ == "__main__":
    main()
