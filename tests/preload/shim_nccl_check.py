#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The NCCL shim, libmfsdp_preload.so, on its own (suite `preload`).

  libs             libmfsdp_preload.so needs no MPI: no undefined MPI symbol (nm -D), no
                   libmpi among its NEEDED entries (readelf -d) or its resolved dependencies
                   (ldd), while libmfsdp_preload_mpi.so has all three (so the check can fail);
                   each library exports exactly the names of its version script.
  stream           shim_nccl_job.c stream under mpirun (--replicate R: HSDP): every NCCL call
                   a remapped call makes is on that call's stream (the test NCCL library
                   records the stream argument); the first all-gather returns FSDP's layout.
                   With --loader, the job is a library loaded with RTLD_LOCAL, so the NCCL
                   library is in no global scope (as PyTorch's wheels load libnccl).
  group, group-ar  shim_nccl_job.c: a call the shim would remap (an all-gather; HSDP's
                   replicate all-reduce) inside a group the job opened stops the job with ONE
                   error line (under HSDP one per shard group, identical) and a non-zero
                   exit, after the job's own checks passed (a call that passes through works
                   inside a group; ncclGroupSimulateEnd ends one).
  group-pass       the same job under a shim that remaps nothing (no manifest; MFSDP_RECORD):
                   the grouped calls pass through, counted and recorded.
  misuse MODE      shim_misuse.c MODE: a job that misuses a managed communicator is told,
                   on the rank that did it, and never exits 0 where it lost or mistrained
                   anything (mpi-inplace-rs: an MPI_IN_PLACE reduce-scatter is refused on every
                   rank; mpi-typed-ag: an all-gather whose send type is the receive block's
                   bytes is remapped, one in a datatype mfsdp does not handle is refused; nccl-mixed-rs: one rank's in-place reduce-scatter is refused with an
                   error line of that rank; nccl-abort: ncclCommAbort called by one rank alone
                   returns although releasing a lazy-clipped context would be collective, and
                   with MFSDP_CKPT_DIR the unsaved step is an error; nccl-no-release: a job
                   that exits without destroying its communicator while MFSDP_CKPT_DIR waits
                   for the final save fails, nccl-plain is the same job destroying it;
                   nccl-unregistered: a job under MFSDP_COMPANION=tag whose companion never
                   registered a model fails at exit; nccl-spent: a registration whose
                   communicator trained and was destroyed cannot be taken over by another;
                   nccl-momentum: a tagged momentum import and export round trip bitwise, a
                   wrong count refused).
  nompi MODE       shim_nccl_nompi.c in a process without MPI, over an NCCL that lacks most of
                   the API: one error line naming what is missing (api: a pncclX the NCCL
                   transport needs, the exit status non-zero; count: ncclCommCount failed;
                   forward: ncclCommFinalize).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

MPI = re.compile(r"^(P?MPI_|ompi_|mpi_|MPIX_)")
MPIRUN_FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]


def fail(msg):
    raise SystemExit(f"FAIL: {msg}")


def out(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def map_names(path):
    """The global names of a version script."""
    text = open(path).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    glob = text.split("global:")[1].split("local:")[0]
    return {n.strip() for n in glob.split(";") if n.strip()}


def lib_facts(lib):
    undef = [ln.split()[-1] for ln in out(["nm", "-D", "--undefined-only", lib]).splitlines()
             if ln.strip()]
    defined = set()
    for ln in out(["nm", "-D", "--defined-only", lib]).splitlines():
        f = ln.split()
        if len(f) == 3 and f[1] in "TWDBRV":
            defined.add(f[2])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out(["readelf", "-d", lib]))
    ldd = out(["ldd", lib])
    return [s for s in undef if MPI.match(s)], defined, needed, ldd


def cmd_libs(args):
    mpi_syms, defined, needed, ldd = lib_facts(args.preload)
    if mpi_syms:
        fail(f"{args.preload} references MPI symbols: {' '.join(mpi_syms[:10])}")
    if any("libmpi" in n for n in needed) or "libmpi" in ldd:
        fail(f"{args.preload} depends on libmpi: NEEDED {needed}\n{ldd}")
    want = map_names(args.map)
    if defined != want:
        fail(f"{args.preload} exports {sorted(defined - want)} beyond its version script and "
             f"lacks {sorted(want - defined)}")
    print(f"ok: {os.path.basename(args.preload)}: no MPI symbol, no libmpi (NEEDED: "
          f"{' '.join(needed)}); exports exactly its {len(want)} names")
    mpi_syms, defined, needed, ldd = lib_facts(args.preload_mpi)
    if not mpi_syms or not any("libmpi" in n for n in needed) or "libmpi" not in ldd:
        fail(f"{args.preload_mpi} shows no MPI dependency: the check above sees nothing")
    want = map_names(args.map_mpi)
    if defined != want:
        fail(f"{args.preload_mpi} exports {sorted(defined - want)} beyond its version script "
             f"and lacks {sorted(want - defined)}")
    print(f"ok: {os.path.basename(args.preload_mpi)}: {len(mpi_syms)} MPI symbols, needs "
          f"{[n for n in needed if 'libmpi' in n][0]}; exports exactly its {len(want)} names")


def run(cmd, env, what):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, env=env)
    print(f"$ {' '.join(cmd)}  -> exit {proc.returncode}")
    return proc


def job(args, tmp, mode, shim_env=None):
    """The job under the shim; shim_env: its MFSDP_* variables (default: the manifest)."""
    manifest = os.path.join(tmp, "manifest.json")
    env = dict(os.environ, FAKE_NCCL_TRACE=os.path.join(tmp, "trace"))
    shim_env = {"MFSDP_MANIFEST": manifest} if shim_env is None else shim_env
    exe = [args.loader, args.job_lib] if args.loader else [args.job]
    cmd = [args.mpirun, "-np", str(args.np)] + MPIRUN_FLAGS + [
        "-x", f"LD_PRELOAD={args.preload}", "-x", "FAKE_NCCL_TRACE"]
    for k, v in shim_env.items():
        cmd += ["-x", f"{k}={v}"]
    return run(cmd + exe + [mode, manifest, str(args.replicate)], env, mode)


def one_error(proc, needles, what, copies=1):
    """Non-zero exit, exactly one 'mfsdp: error' line (one per shard group under HSDP: copies),
    holding the needles."""
    lines = [ln for ln in proc.stdout.splitlines() if "mfsdp: error" in ln]
    if proc.returncode == 0:
        sys.stdout.write(proc.stdout[-3000:])
        fail(f"{what}: the job exited 0")
    if len(lines) != copies or len(set(lines)) != 1:
        sys.stdout.write(proc.stdout[-3000:])
        fail(f"{what}: {len(lines)} 'mfsdp: error' lines, want {copies} identical")
    for n in needles:
        if n not in lines[0]:
            fail(f"{what}: the error line lacks {n!r}: {lines[0]}")
    print(f"ok: {what}: exit {proc.returncode}, one error line: {lines[0][:200]}")


def cmd_stream(args):
    with tempfile.TemporaryDirectory(prefix="mfsdp-nccl-") as tmp:
        proc = job(args, tmp, "stream")
    sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines()
                               if ln.startswith(("ok:", "shim_nccl_job", "mfsdp: summary"))) + "\n")
    if proc.returncode != 0 or "shim_nccl_job: checks passed" not in proc.stdout:
        sys.stdout.write(proc.stdout[-4000:])
        fail(f"the stream checks failed at {args.np} ranks, replicate {args.replicate}")
    if args.loader and "loaded RTLD_LOCAL only" not in proc.stdout:
        fail("the job library was not run through the RTLD_LOCAL loader")
    if "mfsdp: error" in proc.stdout:
        fail("an error line in a run that must succeed")
    m = re.search(r"mfsdp: summary: (\d+) all-gathers, (\d+) reduce-scatters and (\d+) "
                  r"replicate all-reduces remapped", proc.stdout)
    # The summary is rank 0's (its counters).
    if not m or (int(m.group(1)), int(m.group(2)), int(m.group(3))) != (
            2, 1, 1 if args.replicate > 1 else 0):
        fail(f"the summary does not count 2 all-gathers, 1 reduce-scatter"
             f"{' and 1 replicate all-reduce' if args.replicate > 1 else ''}: "
             f"{m.group(0) if m else 'no summary'}")
    print(f"ok: {m.group(0)}")
    print("PASS")


def cmd_group(args):
    with tempfile.TemporaryDirectory(prefix="mfsdp-nccl-") as tmp:
        proc = job(args, tmp, args.command)
    sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines()
                               if ln.startswith(("ok:", "FAIL", "shim_nccl_job"))) + "\n")
    if "shim_nccl_job: checks passed" not in proc.stdout:
        sys.stdout.write(proc.stdout[-4000:])
        fail("the job's own checks failed")
    kind = "an all-gather (count" if args.command == "group" else "an all-reduce of group g"
    # Each shard group's rank 0 says it (its replicas stop alike).
    one_error(proc, [kind, "ncclGroupStart", "outside NCCL groups"],
              f"{kind.split(' (')[0]} the shim would remap, inside the job's group",
              copies=args.replicate)
    print("PASS")


def cmd_group_pass(args):
    """Under a shim that remaps nothing (no manifest; MFSDP_RECORD), calls inside a group pass
    through, counted (and recorded)."""
    with tempfile.TemporaryDirectory(prefix="mfsdp-nccl-") as tmp:
        record = os.path.join(tmp, "record.json")
        for what, env in [("no manifest", {}), ("MFSDP_RECORD", {"MFSDP_RECORD": record})]:
            proc = job(args, tmp, "group-pass", env)
            sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines()
                                       if ln.startswith(("ok:", "FAIL", "shim_nccl_job"))) + "\n")
            if (proc.returncode != 0 or "shim_nccl_job: checks passed" not in proc.stdout
                    or "mfsdp: error" in proc.stdout):
                sys.stdout.write(proc.stdout[-4000:])
                fail(f"{what}: the job failed")
            # rank 0: 3 all-gathers on the world communicator, 1 on its own (one in a group each)
            if not re.search(r"remapped on 0 communicators, 4 calls passed through", proc.stdout):
                sys.stdout.write(proc.stdout[-2000:])
                fail(f"{what}: the summary does not count 4 calls passed through")
            print(f"ok: {what}: every call passed through, the grouped ones too (4 on rank 0)")
        with open(record) as f:
            rec = json.load(f)
        sizes = sorted((c["size"], len(c["calls"])) for c in rec["comms"])
        if sizes != [(1, 1), (args.np, 3)]:
            fail(f"the record holds (size, calls) {sizes}, want [(1, 1), ({args.np}, 3)]")
        print(f"ok: MFSDP_RECORD recorded the grouped calls too: (size, calls) {sizes}")
    print("PASS")


def error_lines(proc):
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("mfsdp: error")]


def expect(cond, what, proc):
    if not cond:
        sys.stdout.write(proc.stdout[-4000:])
        fail(what)


def cmd_misuse(args):
    n = args.np
    with tempfile.TemporaryDirectory(prefix="mfsdp-misuse-") as tmp:
        manifest = os.path.join(tmp, "manifest.json")
        ckpt = os.path.join(tmp, "ck")

        def go(mode, shim_env, preload=None, timeout=60):
            cmd = [args.mpirun, "-np", str(n)] + MPIRUN_FLAGS + [
                "-x", f"LD_PRELOAD={preload or args.preload}"]
            for k, v in shim_env.items():
                cmd += ["-x", f"{k}={v}"]
            cmd += [args.job, mode, manifest]
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                sys.stdout.write(out[-4000:])
                fail(f"{mode}: the job hung ({timeout} s)")
            print(f"$ {' '.join(cmd)}  -> exit {proc.returncode}")
            return proc

        m = args.mode
        man = {"MFSDP_MANIFEST": manifest}
        if m == "mpi-inplace-rs":
            proc = go(m, man, preload=args.preload_mpi)
            lines = error_lines(proc)
            expect(proc.returncode != 0, "the job exited 0", proc)
            want = {f"mfsdp: error on rank {r} of {n}" for r in range(n)}
            got = {ln.split(":")[0] + ":" + ln.split(":")[1] for ln in lines}
            expect(all(ln.split(": the")[0] in want for ln in lines) and len(lines) == n,
                   f"want one error line per rank, got {lines}", proc)
            expect(all("in-place reduce-scatter is not supported" in ln for ln in lines),
                   f"the error lines do not say why: {lines}", proc)
            expect(proc.stdout.count("ok: rank") == n, "not every rank saw its call refused",
                   proc)
            print(f"ok: every rank refused its MPI_IN_PLACE reduce-scatter ({sorted(got)})")
        elif m == "mpi-typed-ag":
            proc = go(m, man, preload=args.preload_mpi)
            lines = error_lines(proc)
            expect(proc.returncode != 0, "the job exited 0", proc)
            expect(proc.stdout.count("ok: rank") == 2 * n and "FAIL" not in proc.stdout,
                   "the typed all-gather was not exact, or the MPI_UINT16_T one not refused",
                   proc)
            expect(len(lines) == 1 and "in a datatype mfsdp does not handle" in lines[0],
                   f"want one error line, got {lines}", proc)
            expect("mfsdp: summary: 1 all-gathers" in proc.stdout,
                   "the all-gather sending MPI_BYTE was not remapped", proc)
            print(f"ok: a same-bytes send type is remapped; an MPI_UINT16_T all-gather is "
                  f"refused: {lines[0][:160]}")
        elif m == "nccl-mixed-rs":
            proc = go(m, man)
            lines = error_lines(proc)
            expect(proc.returncode != 0, "the job exited 0", proc)
            expect(len(lines) == 1 and lines[0].startswith(f"mfsdp: error on rank {n - 1} of {n}:")
                   and "in-place reduce-scatter is not supported" in lines[0],
                   f"want one error line of rank {n - 1}, got {lines}", proc)
            expect(f"ok: rank {n - 1}: in-place ncclReduceScatter" in proc.stdout,
                   "the last rank's call was not refused", proc)
            print(f"ok: rank {n - 1} said why its in-place reduce-scatter was refused: "
                  f"{lines[0][:160]}")
        elif m == "nccl-abort":
            proc = go("nccl-abort-lazy", man)
            expect(proc.returncode == 0 and not error_lines(proc),
                   "an abort with nothing to save failed the job", proc)
            expect(proc.stdout.count("ok: rank") == n and "FAIL" not in proc.stdout,
                   "not every rank's ncclCommAbort returned", proc)
            print("ok: ncclCommAbort alone returned on a lazy, clipped context; exit 0")
            proc = go("nccl-abort", dict(man, MFSDP_CKPT_DIR=ckpt))
            lines = error_lines(proc)
            expect(proc.returncode != 0, "aborting before the final checkpoint exited 0", proc)
            expect(len(lines) == n and all("aborted (ncclCommAbort) before its final checkpoint"
                                           in ln and "step 1 is not saved" in ln for ln in lines),
                   f"want an error line per rank naming the unsaved step, got {lines}", proc)
            print(f"ok: the aborted, unsaved step is an error on every rank: {lines[0][:160]}")
        elif m == "nccl-no-release":
            proc = go("nccl-plain", dict(man, MFSDP_CKPT_DIR=ckpt))
            expect(proc.returncode == 0 and not error_lines(proc), "the baseline failed", proc)
            expect(os.path.isdir(ckpt) and os.listdir(ckpt), "the baseline saved nothing", proc)
            shutil.rmtree(ckpt)
            proc = go(m, dict(man, MFSDP_CKPT_DIR=ckpt))
            lines = error_lines(proc)
            expect(proc.returncode != 0, "exiting without the final checkpoint exited 0", proc)
            expect(len(lines) == n and all("exited without releasing its communicator" in ln
                                           and "step 1 is not saved" in ln for ln in lines),
                   f"want an error line per rank naming the unsaved step, got {lines}", proc)
            print(f"ok: exiting without the final checkpoint fails the job: {lines[0][:160]}")
        elif m == "nccl-unregistered":
            proc = go("nccl-plain", {"MFSDP_COMPANION": "tag"})
            lines = error_lines(proc)
            expect(proc.returncode != 0, "a companion job that registered nothing exited 0",
                   proc)
            expect(len(lines) == 1 and "the PyTorch companion registered no model" in lines[0]
                   and "3 all-gathers and reduce-scatters passed through" in lines[0],
                   f"want one error line, got {lines}", proc)
            proc = go("nccl-plain", {})
            expect(proc.returncode == 0 and not error_lines(proc),
                   "without MFSDP_COMPANION the same pass-through job failed", proc)
            print(f"ok: MFSDP_COMPANION=tag with nothing registered fails: {lines[0][:160]}")
        elif m == "nccl-spent":
            proc = go(m, {})
            lines = error_lines(proc)
            expect(proc.returncode != 0, "the job exited 0", proc)
            expect(proc.stdout.count("ok: rank") == 2 * n and "FAIL" not in proc.stdout,
                   "the tagged all-gather on the new communicator was not refused", proc)
            expect(len(lines) == 1 and "was bound to a communicator that trained" in lines[0],
                   f"want one error line, got {lines}", proc)
            print(f"ok: a spent registration is refused on a new communicator: {lines[0][:160]}")
        elif m == "nccl-momentum":
            proc = go(m, {})
            lines = error_lines(proc)
            expect(proc.returncode != 0, "the job exited 0", proc)
            expect(proc.stdout.count("ok: rank") == 2 * n and "FAIL" not in proc.stdout,
                   "the momentum did not come back bitwise, or the wrong count was accepted",
                   proc)
            expect(len(lines) == 1 and "the momentum export of group g must be a float32 "
                   "all-gather of" in lines[0],
                   f"want one error line, got {lines}", proc)
            print(f"ok: the momentum round trip is exact; a wrong count is refused: "
                  f"{lines[0][:160]}")
    print("PASS")


def cmd_nompi(args):
    env = dict(os.environ, LD_PRELOAD=args.preload)
    for k in [k for k in env if k.startswith("MFSDP_")]:
        del env[k]
    proc = run([args.nompi, args.mode], env, args.mode)
    sys.stdout.write("\n".join(ln for ln in proc.stdout.splitlines()
                               if ln.startswith(("ok:", "FAIL", "shim_nccl_nompi"))) + "\n")
    if "shim_nccl_nompi: checks passed" not in proc.stdout:
        sys.stdout.write(proc.stdout[-3000:])
        fail(f"{args.mode}: the program's checks failed")
    needles = {"api": ["cannot carry mfsdp's owner collectives", "exports no pnccl"],
               "count": ["ncclCommCount", "cannot track it"],
               "forward": ["ncclCommFinalize", "defines neither"]}[args.mode]
    lines = [ln for ln in proc.stdout.splitlines() if "mfsdp: error" in ln]
    if len(lines) != 1 or not all(n in lines[0] for n in needles):
        sys.stdout.write(proc.stdout[-3000:])
        fail(f"{args.mode}: want one error line with {needles}, got {lines}")
    if args.mode == "api" and proc.returncode == 0:
        fail("api: the job exited 0 although its all-gather was refused")
    if args.mode != "api" and proc.returncode != 0:
        fail(f"{args.mode}: exit {proc.returncode} (no communicator failed)")
    print(f"ok: {args.mode}: exit {proc.returncode}, one error line: {lines[0][:200]}")
    print("PASS")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["libs", "stream", "group", "group-ar", "group-pass",
                                        "misuse", "nompi"])
    ap.add_argument("mode", nargs="?", choices=["api", "count", "forward", "mpi-inplace-rs",
                                                "mpi-typed-ag",
                                                "nccl-mixed-rs", "nccl-abort", "nccl-no-release",
                                                "nccl-unregistered", "nccl-spent",
                                                "nccl-momentum"])
    ap.add_argument("--preload", required=True, help="libmfsdp_preload.so")
    ap.add_argument("--preload-mpi", help="libmfsdp_preload_mpi.so (libs)")
    ap.add_argument("--map", help="libmfsdp_preload.map (libs)")
    ap.add_argument("--map-mpi", help="libmfsdp_preload_mpi.map (libs)")
    ap.add_argument("--mpirun")
    ap.add_argument("--job", help="shim_nccl_job")
    ap.add_argument("--loader", help="shim_nccl_local: run --job-lib loaded with RTLD_LOCAL")
    ap.add_argument("--job-lib", help="libshim_nccl_job.so")
    ap.add_argument("--nompi", help="shim_nccl_nompi")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--replicate", type=int, default=1)
    args = ap.parse_args()
    if args.command == "libs":
        cmd_libs(args)
    elif args.command == "stream":
        cmd_stream(args)
    elif args.command in ("group", "group-ar"):
        cmd_group(args)
    elif args.command == "group-pass":
        cmd_group_pass(args)
    elif args.command == "misuse":
        cmd_misuse(args)
    else:
        cmd_nompi(args)


if __name__ == "__main__":
    main()
