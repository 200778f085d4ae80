#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Starts an N-rank job without MPI, as torchrun would, for scripts/device-check.sh (a GPU
# machine has no Open MPI): rank r runs COMMAND with RANK=r, WORLD_SIZE=N, LOCAL_RANK=r,
# LOCAL_WORLD_SIZE=N, its own NCCL_HOSTID (so that NCCL treats the ranks sharing the one GPU
# as separate hosts: sockets on loopback) and FSDP_TRAIN_ID_FILE=DIR/nccl-id (rank 0 of
# fsdp_train_nccl_nompi writes its ncclUniqueId there; the file is removed before the start).
# Each rank's output goes to DIR/rank<r>.log and its exit status to DIR/rank<r>.status.
# The launcher waits for every rank; at the first rank that fails it stops the others
# (SIGTERM, then SIGKILL), and after TIMEOUT seconds it stops them all.
#
# It prints one line per rank ("rank r: exit S", or "killed" for a rank that left no status)
# and a last line "launch n=N: ok | FAILED (...) | TIMED OUT after T s", and exits 0 (every
# rank exited 0), 124 (timeout) or 1.
#
# Usage: scripts/device-launch.sh -n N -t TIMEOUT -d DIR [--fake MPIRUN] -- COMMAND [ARGS...]
#   --fake MPIRUN  TEST ONLY (tests/preload/device_launch_check.py, scripts/device-check.sh
#                  --fake): the ranks run under `MPIRUN -np N` (the test-only NCCL library of
#                  tests/lib runs over MPI), each still setting its variables and writing its
#                  status through this script; the monitoring is the same.
set -uo pipefail

self=$(readlink -f "$0")

# ---------------------------------------------------------------- one rank
if [ "${1:-}" = --rank-main ]; then
  # --rank-main DIR N R -- COMMAND...: R "mpi" takes the rank from Open MPI (--fake).
  dir=$2 n=$3 r=$4
  shift 5
  [ "$r" = mpi ] && r=${OMPI_COMM_WORLD_RANK:?--fake: not started by Open MPI\'s mpirun}
  export RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n
  export NCCL_HOSTID=mfsdp-device-rank$r
  export FSDP_TRAIN_ID_FILE=$dir/nccl-id
  # The job as a child that this shell reaps even when the launcher stops the rank.
  "$@" >"$dir/rank$r.log" 2>&1 &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
  wait "$child"
  s=$?
  echo "$s" >"$dir/rank$r.status.tmp" && mv "$dir/rank$r.status.tmp" "$dir/rank$r.status"
  exit "$s"
fi

# ---------------------------------------------------------------- the launcher
usage() {
  echo "usage: $0 -n N -t TIMEOUT -d DIR [--fake MPIRUN] -- COMMAND [ARGS...]" >&2
  exit 2
}
n="" timeout_s="" dir="" fake=""
while [ $# -gt 0 ]; do
  case $1 in
    -n) n=${2:-}; shift 2 ;;
    -t) timeout_s=${2:-}; shift 2 ;;
    -d) dir=${2:-}; shift 2 ;;
    --fake) fake=${2:-}; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
if ! [[ "$n" =~ ^[1-9][0-9]*$ && "$timeout_s" =~ ^[1-9][0-9]*$ ]] || [ -z "$dir" ] || [ $# = 0 ]; then
  usage
fi
mkdir -p "$dir" || exit 1
dir=$(readlink -f "$dir")
rm -f "$dir"/nccl-id "$dir"/nccl-id.tmp.* "$dir"/rank*.status "$dir"/rank*.status.tmp \
  "$dir"/rank*.log

# Every rank (or mpirun) in a process group of its own, so that stopping it stops its job.
set -m
pids=()
if [ -n "$fake" ]; then
  "$fake" -np "$n" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
    bash "$self" --rank-main "$dir" "$n" mpi -- "$@" >"$dir/mpirun.log" 2>&1 &
  pids+=($!)
else
  for ((r = 0; r < n; r++)); do
    bash "$self" --rank-main "$dir" "$n" "$r" -- "$@" </dev/null >/dev/null 2>&1 &
    pids+=($!)
  done
fi
set +m

alive() {
  local p
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null && return 0
  done
  return 1
}
stop_all() {
  local p i
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  for ((i = 0; i < 30; i++)); do
    alive || break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
}

start=$SECONDS
result="" failed=""
while :; do
  done_n=0
  for ((r = 0; r < n; r++)); do
    f=$dir/rank$r.status
    [ -f "$f" ] || continue
    done_n=$((done_n + 1))
    s=$(cat "$f")
    if [ "$s" != 0 ] && [ -z "$failed" ]; then
      failed="rank $r exit $s"
    fi
  done
  if [ "$done_n" = "$n" ]; then
    break
  fi
  if [ -n "$failed" ]; then
    stop_all
    break
  fi
  if ! alive; then
    failed=${failed:-"the ranks ended without a status"}
    break
  fi
  if [ $((SECONDS - start)) -gt "$timeout_s" ]; then
    result="TIMED OUT after ${timeout_s} s"
    stop_all
    break
  fi
  sleep 0.1
done
for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done

for ((r = 0; r < n; r++)); do
  f=$dir/rank$r.status
  if [ -f "$f" ]; then
    s=$(cat "$f")
    echo "rank $r: exit $s"
    [ "$s" = 0 ] || failed=${failed:-"rank $r exit $s"}
  else
    echo "rank $r: killed (no exit status: stopped by the launcher or by its job)"
    [ -n "$result" ] || failed=${failed:-"rank $r left no exit status"}
  fi
done
if [ -n "$result" ]; then
  echo "launch n=$n: $result${failed:+ ($failed)}"
  exit 124
elif [ -n "$failed" ]; then
  echo "launch n=$n: FAILED ($failed) in $((SECONDS - start)) s"
  exit 1
fi
echo "launch n=$n: ok in $((SECONDS - start)) s"
exit 0
