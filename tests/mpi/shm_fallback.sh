#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The owner arenas cannot be put in shared memory: test_runtime under a read-only /dev/shm
# (a private mount namespace) must warn on every rank, fall back to messages for its direct
# all-gathers (TEST_SHM_EXPECT=0: the stats say so) and pass all its checks.
#   shm_fallback.sh MPIRUN NP EXE [mpirun flags...]
# Exit 77 (skipped) where this user cannot make a mount namespace.
set -u
mpirun=$1 np=$2 exe=$3
shift 3
if ! unshare -m true 2>/dev/null; then
  echo "shm_fallback: no mount namespace here (unshare -m needs CAP_SYS_ADMIN): skipped" >&2
  exit 77
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
TEST_SHM_EXPECT=0 unshare -m sh -c 'mount -t tmpfs -o size=4k,ro tmpfs /dev/shm && exec "$@"' \
  sh "$mpirun" -np "$np" "$@" "$exe" 1 >"$log" 2>&1
rc=$?
tail -n 3 "$log"
if [ $rc -ne 0 ]; then
  cat "$log" >&2
  echo "shm_fallback: test_runtime failed (rc $rc)" >&2
  exit 1
fi
warned=$(grep -c "cannot be put in shared memory (shm_open /mfsdp\.[0-9.]*: Read-only file system)" "$log")
if [ "$warned" -lt "$np" ]; then
  echo "shm_fallback: $warned warnings about the arena, expected at least one per rank ($np)" >&2
  exit 1
fi
echo "shm_fallback: $warned warnings, every check passed over messages"
