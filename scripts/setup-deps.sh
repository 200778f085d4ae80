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
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
echo "setup-deps: done"
