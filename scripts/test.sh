#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: install what is missing, configure, build, run every CPU suite
# (unit, mpi, preload, python), rebuild with AddressSanitizer + UBSan and run the unit suite
# under it, then print the closing line "N passed, N failed".
# Suite `python` needs torch: scripts/python-venv.sh reuses ~/.cache/mfsdp/venv or creates it
# (about 5 GB from PyPI, about 3 minutes); when that fails the suite counts as failed, loudly.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

bash scripts/setup-deps.sh || exit 1
export OPENBLAS_NUM_THREADS=1
# Open MPI as root (CI and these machines run as root) and with more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

build=${MFSDP_BUILD_DIR:-build}
asan=${MFSDP_ASAN_BUILD_DIR:-build-asan}
logs=()

configure() { # dir, extra args...
  local dir=$1; shift
  if [ -f "$dir/build.ninja" ]; then
    meson setup --reconfigure "$dir" "$@" >"$dir.setup.log" 2>&1
  else
    meson setup "$dir" "$@" >"$dir.setup.log" 2>&1
  fi || { cat "$dir.setup.log"; return 1; }
}

status=0
echo "== python venv (suite python)"
no_python=()
if py=$(bash scripts/python-venv.sh | tail -n 1) && [ -x "$py" ]; then
  export MFSDP_TEST_PYTHON=$py
  echo "python: $py"
else
  echo "FAILED: scripts/python-venv.sh could not provide torch 2.15; suite python not run" >&2
  no_python=(--no-suite python)
  logs+=("python-venv.failed")  # counted as a failure by count-tests.py
  status=1
fi

echo "== build ($build)"
if configure "$build" -Dcuda=auto && ninja -C "$build"; then
  echo "== tests: unit mpi preload python"
  meson test -C "$build" --print-errorlogs --num-processes 1 --no-suite gpu --no-suite perf \
    --no-suite python-full \
    "${no_python[@]}" || status=1
  logs+=("$build/meson-logs/testlog.json")
else
  echo "build failed"; status=1
  logs+=("$build/meson-logs/testlog.json.missing")
fi

echo "== sanitized build ($asan): address,undefined"
if configure "$asan" -Dcuda=disabled -Db_sanitize=address,undefined -Db_lundef=false \
     -Dbuildtype=debug && ninja -C "$asan"; then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C "$asan" --print-errorlogs --num-processes 1 --suite unit || status=1
  logs+=("$asan/meson-logs/testlog.json")
else
  echo "sanitized build failed"; status=1
  logs+=("$asan/meson-logs/testlog.json.missing")
fi

python3 "$root/scripts/count-tests.py" "${logs[@]}" || status=1
exit $status
