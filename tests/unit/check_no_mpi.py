#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The NCCL path makes no MPI call of its own: no object of the MPI-free archives
(libmfsdp_nompi.a: the internal library without transport/mpi.c and runtime/runtime_mpi.c;
with CUDA also libmfsdp_cuda.a, which holds runtime_nccl.c then) references an MPI symbol,
while the full internal library does (so the check can fail), and the archives hold the NCCL
transport and runtime_nccl (so it cannot pass empty).

usage: check_no_mpi.py NM FULL_ARCHIVE NOMPI_ARCHIVE..."""
import re
import subprocess
import sys

MPI = re.compile(r"^(P?MPI_|ompi_|mpi_|MPIX_)")


def undefined(nm, archive):
    """{object: [undefined symbols]} of an archive (thin or not)."""
    out = subprocess.run([nm, "-u", archive], capture_output=True, text=True, check=True).stdout
    objs, cur = {}, None
    for line in out.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.endswith(":"):
            cur = line[:-1]
            objs.setdefault(cur, [])
            continue
        objs.setdefault(cur, []).append(line.split()[-1])
    return objs


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    nm, full, nompi = sys.argv[1], sys.argv[2], sys.argv[3:]
    objs = {}
    for a in nompi:
        objs.update(undefined(nm, a))
    names = " ".join(objs)
    for needed in ("transport_nccl.c.o", "runtime_runtime_nccl.c.o", "runtime_ctx.c.o"):
        if needed not in names:
            sys.exit(f"FAIL: {' '.join(nompi)} lack {needed} (objects: {names})")
    bad = [f"{o}: {s}" for o, syms in objs.items() for s in syms if MPI.match(s)]
    if bad:
        sys.exit("FAIL: MPI symbols referenced by the NCCL path:\n  " + "\n  ".join(bad))
    full_mpi = sum(1 for syms in undefined(nm, full).values() for s in syms if MPI.match(s))
    if full_mpi == 0:
        sys.exit(f"FAIL: {full} references no MPI symbol either: the check sees nothing")
    print(f"ok: {len(objs)} objects of {' '.join(nompi)} reference no MPI symbol "
          f"({full_mpi} MPI references in the full library)")


if __name__ == "__main__":
    main()
