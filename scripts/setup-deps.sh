#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the Debian packages mfsdp needs, only those that are missing. Idempotent; works as
# root or through sudo. CUDA/cuBLAS/NCCL come from /usr/local/cuda (the machine image), not
# from here.
set -euo pipefail

pkgs=(
  clang
  gnuplot-nox
  libclang-rt-14-dev
  libcriterion-dev
  libhwloc-dev
  libjansson-dev
  libopenblas-dev
  libopenmpi-dev
  libssl-dev
  meson
  ninja-build
  openmpi-bin
  pkg-config
  python3
)

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#pkgs[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "setup-deps: missing ${missing[*]} and not root (no sudo): install them first" >&2
    exit 1
  fi
fi

echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Another apt (unattended upgrades, a second shell) may hold a lock: wait for it rather than
# fail. apt waits for the dpkg lock itself (DPkg::Lock::Timeout) but not for the package
# lists' lock, which `update` takes: retry that while apt says a lock is held.
apt_wait=(-o DPkg::Lock::Timeout=600)
apt_retry() { # command...
  local out rc tries=0
  while :; do
    out=$("$@" 2>&1) && { printf '%s' "$out" | grep -v '^$' >&2 || true; return 0; }
    rc=$?
    if printf '%s' "$out" | grep -q 'Could not get lock' && [ $tries -lt 120 ]; then
      tries=$((tries + 1))
      [ $tries -eq 1 ] && echo "setup-deps: waiting for another apt to release its lock" >&2
      sleep 5
      continue
    fi
    printf '%s\n' "$out" >&2
    return $rc
  done
}
apt_retry $SUDO apt-get "${apt_wait[@]}" update -qq
apt_retry $SUDO apt-get "${apt_wait[@]}" install -y -qq "${missing[@]}" >/dev/null
echo "setup-deps: done"
