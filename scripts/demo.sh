#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's main command. Installs what is missing, builds, then trains the unmodified
# FSDP-style job examples/fsdp_train (MPI flavour) at 4 ranks four ways:
#   1. FSDP + AdamW                         (--optim adamw)
#   2. FSDP2-Muon as done today             (--optim muon-gather: all-gather every matrix,
#                                            Newton-Schulz redundantly on every rank)
#   3. DMuon / Dion-style distributed Muon  (--optim muon-dist: each matrix gathered to one
#                                            round-robin rank, Newton-Schulz there, the
#                                            update scattered back)
#   4. the same AdamW job under LD_PRELOAD  (MatrixFSDP Muon: owners, reduce-to-owner,
#                                            local Newton-Schulz, no collective in the step)
# and prints final loss, optimizer-step time, step time, peak RSS per rank and the speedups,
# and writes demo-out/demo.png (loss and step-time curves).
#   DEMO_STEPS (30), DEMO_NP (4), DEMO_MODEL (medium), DEMO_OUT (demo-out)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
steps=${DEMO_STEPS:-30}
np=${DEMO_NP:-4}
model=${DEMO_MODEL:-medium}
out=${DEMO_OUT:-demo-out}
build=${MFSDP_BUILD_DIR:-build}

bash scripts/setup-deps.sh
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" >/dev/null
fi
ninja -C "$build" >/dev/null

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
mkdir -p "$out"
job="$root/$build/examples/fsdp_train_mpi"
shim="$root/$build/ld_preload/libmfsdp_preload_mpi.so"
mpirun=(mpirun -np "$np" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
common=(--model "$model" --steps "$steps" --seed 1)
# Each optimizer at its tuned learning rates (single-process sweep of the reference, see
# examples/fsdp_train/README.md): AdamW 3e-3; Muon 0.05 with its AdamW tail at 3e-3.
adamw_lr=(--adamw-lr 0.003)
muon_lr=(--muon-lr 0.05 --adamw-lr 0.003)

echo "== fsdp_train (${model}) at ${np} ranks, ${steps} steps; logs in ${out}/"
"${mpirun[@]}" "$job" "${common[@]}" "${muon_lr[@]}" --steps 0 --optim none \
  --write-manifest "$out/manifest.json" >/dev/null
"$root/$build/tools/mfsdp-plan" "$out/manifest.json" --world-size "$np" >"$out/plan.txt"

echo "-- 1/4 FSDP + AdamW"
"${mpirun[@]}" "$job" "${common[@]}" "${adamw_lr[@]}" --optim adamw >"$out/adamw.log"
echo "-- 2/4 FSDP2-Muon (muon-gather)"
"${mpirun[@]}" "$job" "${common[@]}" "${muon_lr[@]}" --optim muon-gather >"$out/muon-gather.log"
echo "-- 3/4 DMuon-style distributed Muon (muon-dist)"
"${mpirun[@]}" "$job" "${common[@]}" "${muon_lr[@]}" --optim muon-dist >"$out/muon-dist.log"
echo "-- 4/4 MatrixFSDP Muon: the AdamW job under LD_PRELOAD=libmfsdp_preload_mpi.so"
"${mpirun[@]}" -x LD_PRELOAD="$shim" -x MFSDP_MANIFEST="$out/manifest.json" \
  -x MFSDP_GRAD_DIVIDE=world -x MFSDP_REPORT=1 \
  "$job" "${common[@]}" "${adamw_lr[@]}" --optim adamw >"$out/mfsdp.log" 2>&1

python3 "$root/scripts/demo-report.py" "$out" "$np"
