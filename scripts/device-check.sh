#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The one prepared check for a lent GPU machine (docs/gpu.md, "Device check"). Such a
# machine has CUDA, nvcc, PyTorch (with its NCCL wheel) and pip's meson and ninja, but no Open
# MPI, no network, and maybe no jansson/libcrypto/OpenBLAS headers: those come from
# .device-deps/deps.tar.xz (scripts/device-pack.sh, carried by the device tool), which this
# script unpacks into its build directory and points the build at. Stages, each under its own
# timeout:
#   build     plain nvcc/gcc command lines (no meson): the CUDA kernels, the CPU kernels they
#             are compared with, core/status.c, core/log.c and three test programs;
#   meson     the repository's meson build with -Dcuda=enabled and the real NCCL (no MPI):
#             the shim libmfsdp_preload.so and the job examples/fsdp_train_nccl_nompi, then
#             readelf -d / ldd: no libmpi in either;
#   kernels   tests/gpu/test_cuda_kernels: every CUDA kernel against the CPU kernels and
#             float64 references, then cuBLAS Newton-Schulz TFLOP/s against raw bf16 GEMMs;
#   executor  tests/gpu/test_exec_cuda: the runtime's CUDA executor against its CPU executor;
#   train     fsdp_train_nccl_nompi at 1 and 4 ranks on the one GPU, started by
#             scripts/device-launch.sh (RANK/WORLD_SIZE, one NCCL_HOSTID per rank, the unique
#             id through a file, every rank's exit status): its own muon-gather (fp32 Newton-
#             Schulz on the CPU) against the single-process --reference within 1e-5, and its
#             AdamW run under LD_PRELOAD=libmfsdp_preload.so (mfsdp's Muon on the GPU, bf16
#             Newton-Schulz) against the same reference within the bf16 band, once more with
#             registered arenas (MFSDP_NCCL_REGISTER=1); step times (after a launch that
#             timed out, the rest of the stage is skipped);
#   torch     examples/pytorch/train_fsdp2.py --device cuda under `mfsdp-run torchrun` at 4 and
#             1 ranks (the PyTorch companion, PyTorch's own NCCL): the saved state_dict() against
#             tests/python/reference.py's float64 Muon within the band (not with --fake);
#   nccl      tests/gpu/nccl_ranks -n 2, 3, 4: forked ranks on the one GPU (distinct
#             NCCL_HOSTID, sockets on loopback): all-gather, reduce-scatter, broadcast, reduce.
# It ends with a summary block and a table (also $BUILD/device-check-summary.txt, copied
# with the logs into $OUT when that is set).
#
# Usage: scripts/device-check.sh [--build-only] [--no-perf] [--no-nccl] [--no-train]
#                                [--train-only] [--fake]
#   --build-only  build every stage's programs, run nothing (works without a GPU)
#   --no-train    no meson build, no train stage;  --train-only: only the meson build and the
#                 train stage (a rerun of them)
#   --fake        TEST ONLY (tests/preload/meson.build, device_check_fake): no GPU; the meson
#                 build of the test-only NCCL-over-MPI library (tests/lib, host memory, CPU
#                 executor) and the train stage with its ranks under mpirun (device-launch.sh
#                 --fake), tolerance 1e-5 for the shim too, model small. It proves the launch,
#                 the comparisons and the table, never anything about a GPU.
# Environment: MFSDP_DEVICE_BUILD (build dir, default build-device), CUDA_HOME, NCCL_HOME,
#   MFSDP_DEVICE_ARCH (e.g. "90"; default: the GPU's compute capability, else 80 and 90),
#   MFSDP_DEVICE_DEPS (the pack, default .device-deps/deps.tar.xz; "none": the system's),
#   MFSDP_DEVICE_MESON_BUILD (an already built meson build directory to take the shim and the
#   job from instead of configuring one; used by the --fake test),
#   MFSDP_DEVICE_TIMEOUT_BUILD / _MESON / _KERNELS / _NCCL / _TRAIN (seconds; defaults
#   240 / 240 / 150 / 60 / 90; _TRAIN is per launch),
#   MFSDP_DEVICE_BUDGET (seconds after which no further stage starts; default 420),
#   MFSDP_DEVICE_LIMIT (no stage runs past this many seconds; default 470),
#   MFSDP_DEVICE_TRAIN_RANKS (default "1 4"), MFSDP_DEVICE_NCCL_RANKS (default "2 3 4"),
#   MFSDP_DEVICE_TORCH_RANKS (default "4 1"), MFSDP_DEVICE_TORCH_STEPS (6),
#   MFSDP_DEVICE_TIMEOUT_TORCH (seconds per launch, default 150),
#   MFSDP_DEVICE_TRAIN_MODEL (medium; small with --fake), MFSDP_DEVICE_TRAIN_STEPS (12),
#   MFSDP_DEVICE_BAND (the shim's tolerance; default 2e-2 on a GPU, the executor test's bf16
#   Newton-Schulz band, and 1e-5 with --fake).
# Exit: 0 everything passed, 77 no GPU (the builds still ran), 1 a build or check failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$(pwd)

build_only=0 perf=1 nccl=1 plain=1 train=1 fake=0
usage() {
  echo "usage: $0 [--build-only] [--no-perf] [--no-nccl] [--no-train] [--train-only] [--fake]" >&2
  exit 2
}
for a in "$@"; do
  case $a in
    --build-only) build_only=1 ;;
    --no-perf) perf=0 ;;
    --no-nccl) nccl=0 ;;
    --no-train) train=0 ;;
    --train-only) plain=0 ;;
    --fake) fake=1 plain=0 ;;
    *) usage ;;
  esac
done
[ $train = 1 ] || [ $plain = 1 ] || usage

b=${MFSDP_DEVICE_BUILD:-build-device}
mkdir -p "$b/obj" || exit 1
b=$(readlink -f "$b")
t_build=${MFSDP_DEVICE_TIMEOUT_BUILD:-240}
t_meson=${MFSDP_DEVICE_TIMEOUT_MESON:-240}
t_kernels=${MFSDP_DEVICE_TIMEOUT_KERNELS:-150}
t_nccl=${MFSDP_DEVICE_TIMEOUT_NCCL:-60}
t_train=${MFSDP_DEVICE_TIMEOUT_TRAIN:-90}
# The whole check stays under 8 minutes: a stage that would start after `budget` seconds is
# skipped, and no stage runs past `limit` (its timeout is cut to what is left); both say so
# in the summary.
budget=${MFSDP_DEVICE_BUDGET:-420}
limit=${MFSDP_DEVICE_LIMIT:-470}
over_budget() { [ "$SECONDS" -ge "$budget" ]; }
# The timeout for a stage of nominal length $1: what is left before the limit, at most $1.
stage_timeout() {
  local left=$((limit - SECONDS))
  [ "$left" -lt 1 ] && left=1
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
summary=()
table=()
status=0
note() { summary+=("$*"); echo "-- $*"; }

echo "== mfsdp device check, $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"

# ---------------------------------------------------------------- environment
gpu=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
        --format=csv,noheader 2>/dev/null | head -1)
have_gpu=0
[ -n "$gpu" ] && have_gpu=1
note "gpu: ${gpu:-none found (nvidia-smi absent or no device)}"
[ $fake = 1 ] && note "mode: --fake (TEST ONLY: the test NCCL library over MPI on host memory; nothing runs on a GPU)"

cuda=${CUDA_HOME:-}
if [ -z "$cuda" ] && command -v nvcc >/dev/null 2>&1; then
  cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
cuda=${cuda:-/usr/local/cuda}
nvcc=$cuda/bin/nvcc
cudalib=$cuda/lib64
[ -d "$cudalib" ] || cudalib=$cuda/lib
nccl_inc="" nccl_lib=""
if [ $fake = 0 ]; then
  if [ ! -x "$nvcc" ]; then
    note "build: FAILED, no nvcc under $cuda (set CUDA_HOME)"
    printf '%s\n' "${summary[@]}"
    exit 1
  fi
  note "cuda: $cuda, $("$nvcc" --version | grep -o 'release [0-9.]*' | head -1)"
  # NCCL: NCCL_HOME, the toolkit, the system, or the nvidia-nccl wheel PyTorch ships with.
  for d in "${NCCL_HOME:-/nonexistent}" "$cuda" /usr /usr/local \
           "$(timeout 60 python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"; do
    if [ -z "$d" ] || [ ! -f "$d/include/nccl.h" ]; then
      continue
    fi
    for l in "$d/lib64" "$d/lib" "$d/lib/x86_64-linux-gnu" /usr/lib/x86_64-linux-gnu; do
      if [ -e "$l/libnccl.so" ] || [ -e "$l/libnccl.so.2" ]; then
        nccl_inc=$d/include nccl_lib=$l
        break 2
      fi
    done
  done
  if [ -n "$nccl_lib" ]; then
    note "nccl: headers $nccl_inc, library $nccl_lib"
  else
    note "nccl: not found (set NCCL_HOME); the multi-rank and train stages are skipped"
    nccl=0 train=0
  fi
fi

# The carried dependencies (scripts/device-pack.sh): unpacked under the build directory, their
# pkg-config files rewritten to that place, every search path pointed at them.
deps_pack=${MFSDP_DEVICE_DEPS:-.device-deps/deps.tar.xz}
deps="" run_ld=""
if [ "$deps_pack" != none ] && [ -f "$deps_pack" ]; then
  deps=$b/deps
  stamp=$(stat -c '%s %Y' "$deps_pack")
  if [ "$(cat "$deps/.stamp" 2>/dev/null)" != "$stamp" ]; then
    # tar needs the xz program for the pack; an image without it has python3's lzma.
    untar() {
      if command -v xz >/dev/null 2>&1; then
        tar -C "$deps" -xJf "$deps_pack"
      else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
          "$deps_pack" "$deps"
      fi
    }
    if ! { rm -rf "$deps" && mkdir -p "$deps" && untar; }; then
      note "deps: FAILED to unpack $deps_pack"
      printf '%s\n' "${summary[@]}"
      exit 1
    fi
    find "$deps" -name '*.pc' -exec sed -i -e "s#^prefix=/usr\$#prefix=$deps/usr#" \
      -e "s#=/usr/#=$deps/usr/#g" {} +
    echo "$stamp" >"$deps/.stamp"
  fi
  dl=$deps/usr/lib/x86_64-linux-gnu
  # Debian's multiarch directory too: OpenSSL's configuration.h and opensslconf.h live there.
  export CPATH=$deps/usr/include:$deps/usr/include/x86_64-linux-gnu:$deps/usr/include/x86_64-linux-gnu/openblas-pthread${CPATH:+:$CPATH}
  export LIBRARY_PATH=$dl:$dl/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
  # -L: before the compiler's own directories (LIBRARY_PATH comes after them). The linker
  # looks for a library's own dependencies (OpenBLAS's libgfortran) on the rpath-link path.
  # Meson takes LDFLAGS at setup.
  export LDFLAGS="-L$dl -L$dl/openblas-pthread -Wl,-rpath-link,$dl:$dl/openblas-pthread${LDFLAGS:+ $LDFLAGS}"
  # The pack's libraries are on the loader's path for the runs only (below), not for the
  # image's own tools (python3, nvcc); pkgconf gets them through a wrapper.
  run_ld=$dl:$dl/openblas-pthread
  # shellcheck disable=SC2016
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
    "$dl" "$deps/usr/bin/pkgconf" >"$b/pkgconf"
  chmod +x "$b/pkgconf"
  export PKG_CONFIG=$b/pkgconf
  if [ $fake = 1 ]; then
    # The test build needs this machine's Criterion and Open MPI too: searched after the pack.
    export PKG_CONFIG_PATH=$dl/pkgconfig:$dl/openblas-pthread/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    where="searched first"
  else
    # Only the pack: the build must not depend on what this machine happens to hold.
    export PKG_CONFIG_LIBDIR=$dl/pkgconfig:$dl/openblas-pthread/pkgconfig
    unset PKG_CONFIG_PATH
    where="the only pkg-config path"
  fi
  note "deps: $deps_pack unpacked in $deps ($(du -sm "$deps" | cut -f1) MiB), $where"
else
  note "deps: no pack at $deps_pack (scripts/device-pack.sh makes one): this machine's own"
fi

# OpenBLAS is optional for the plain build (the CPU kernels have a portable GEMM).
blas=0
cat >"$b/obj/blas_probe.c" <<'EOF'
#include <cblas.h>
int main(void)
{
    float a = 1.0f, c = 0.0f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, 1, 1, 1.0f, &a, 1, &a, 1, 0.0f, &c, 1);
    return c != 1.0f;
}
EOF
read -ra ldflags <<<"${LDFLAGS:-}"
if gcc "$b/obj/blas_probe.c" -o "$b/obj/blas_probe" "${ldflags[@]}" -lopenblas >/dev/null 2>&1; then
  blas=1
fi
[ $plain = 1 ] && note "cpu reference gemm: $([ $blas = 1 ] && echo openblas || echo portable C loop)"

arch=${MFSDP_DEVICE_ARCH:-}
if [ -z "$arch" ] && [ -n "$gpu" ]; then
  arch=$(echo "$gpu" | awk -F', ' '{print $4}' | tr -d '.' | tr -d ' ')
fi
gencode=()
for a in ${arch:-80 90}; do
  gencode+=("-gencode=arch=compute_$a,code=sm_$a")
done

finish() {
  echo
  echo "===== mfsdp device check summary ====="
  {
    printf '%s\n' "${summary[@]}"
    if [ ${#table[@]} -gt 0 ]; then
      echo
      echo "| run | ranks | final weights vs --reference: worst tensor's max abs diff / max abs ref (tolerance) | step ms | optim ms | comm ms |"
      echo "|---|---|---|---|---|---|"
      printf '%s\n' "${table[@]}"
    fi
  } | tee "$b/device-check-summary.txt"
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    # Two files: the device tool returns at most 8. The logs, the train and torch stages'
    # logs and manifests, not their weight files (10 MiB each for medium).
    cp "$b/device-check-summary.txt" "$OUT/"
    (cd "$b" && find . -maxdepth 1 -name '*.log' -print0 &&
       find train torch -type f ! -name '*.bin' ! -name '*.pt' -print0 2>/dev/null) |
      tar -C "$b" -czf "$OUT/device-check-logs.tar.gz" --null -T - 2>/dev/null
  fi
  exit "$1"
}

# ---------------------------------------------------------------- build (plain nvcc/gcc)
if [ $plain = 1 ]; then
cat >"$b/mfsdp_config.h" <<EOF
/* generated by scripts/device-check.sh */
#define MFSDP_HAVE_BLAS $blas
#define MFSDP_HAVE_MPI 0
#define MFSDP_HAVE_HWLOC 0
#define MFSDP_HAVE_CUDA 1
#define MFSDP_VERSION_STRING "device-check"
EOF

# Runs in a child bash under timeout (which kills the whole process group on expiry).
# shellcheck disable=SC2317,SC2054
build() {
  local pids=() f o rc=0
  local nvflags=(--std=c++17 -O3 "${gencode[@]}" -Xcompiler=-fPIC,-fvisibility=hidden,-Wall
                 -I"$root" -I"$root/include" -I"$b")
  local cflags=(-std=c11 -O2 -D_GNU_SOURCE -fPIC -Wall -Wextra -Wno-unused-parameter
                -I"$root" -I"$root/include" -I"$b" -I"$cuda/include")
  for f in kernels/cuda/*.cu; do
    o=$b/obj/$(basename "$f" .cu).cu.o
    "$nvcc" "${nvflags[@]}" -c "$f" -o "$o" >"$o.log" 2>&1 &
    pids+=($!)
  done
  for f in core/status.c core/log.c kernels/hparams.c kernels/cpu/*.c tests/gpu/test_cuda_kernels.c; do
    o=$b/obj/$(basename "$f" .c).o
    gcc "${cflags[@]}" -c "$f" -o "$o" >"$o.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do
    wait "$p" || rc=1
  done
  cat "$b"/obj/*.log
  [ "$rc" = 0 ] || return 1
  local ldflags
  read -ra ldflags <<<"${LDFLAGS:-}"
  local libs=("${ldflags[@]}" -L"$cudalib" -Wl,-rpath,"$cudalib" -lcublas -lcublasLt -lcudart -lstdc++ -lm
              -lpthread -ldl)
  [ "$blas" = 1 ] && libs+=(-lopenblas)
  gcc -o "$b/test_cuda_kernels" "$b"/obj/*.o "${libs[@]}" || return 1
  # The executor test has a main of its own: built apart, linked with every object but
  # test_cuda_kernels'.
  mkdir -p "$b/exec"
  gcc "${cflags[@]}" -c tests/gpu/test_exec_cuda.c -o "$b/exec/test_exec_cuda.o" || return 1
  local objs=()
  for o in "$b"/obj/*.o; do
    [ "$(basename "$o")" = test_cuda_kernels.o ] || objs+=("$o")
  done
  gcc -o "$b/test_exec_cuda" "$b/exec/test_exec_cuda.o" "${objs[@]}" "${libs[@]}" || return 1
  if [ "$nccl" = 1 ]; then
    local ln=-lnccl
    [ -e "$nccl_lib/libnccl.so" ] || ln=-l:libnccl.so.2
    gcc "${cflags[@]}" -I"$nccl_inc" -o "$b/nccl_ranks" tests/gpu/nccl_ranks.c \
      -L"$nccl_lib" -Wl,-rpath,"$nccl_lib" "$ln" -L"$cudalib" -Wl,-rpath,"$cudalib" -lcudart \
      -lm || return 1
  fi
}
echo "== build in $b (nvcc ${gencode[*]})"
rm -f "$b"/obj/*.o "$b"/obj/*.log "$b/test_cuda_kernels" "$b/test_exec_cuda" "$b/nccl_ranks"
t0=$(date +%s)
export -f build
export root b cuda cudalib nvcc blas nccl nccl_inc nccl_lib
export gencode_str="${gencode[*]}"
# shellcheck disable=SC2016
if timeout "$(stage_timeout "$t_build")" bash -c 'gencode=($gencode_str); build' >"$b/build.log" 2>&1; then
  note "build: ok in $(( $(date +%s) - t0 )) s, warnings: $(grep -c -i 'warning' "$b/build.log")"
else
  cat "$b/build.log"
  note "build: FAILED or timed out after $(( $(date +%s) - t0 )) s (log: $b/build.log)"
  status=1 plain=0
fi
grep -i 'warning' "$b/build.log" | head -20
fi

# ---------------------------------------------------------------- meson: shim and no-MPI job
# The repository's own build: pip's meson and ninja on the GPU machine (python3 -m mesonbuild
# or the ninja wheel's binary when they are not on the PATH). The toolkit root handed to meson
# is a tree of links to the CUDA toolkit plus NCCL's header and library (PyTorch's NCCL wheel
# is not under the toolkit), so meson.build's -Dcudatoolkit lookups find both.
meson_b="" preload="" job=""
find_meson() {
  meson_cmd=() ninja_dir=""
  if command -v meson >/dev/null 2>&1; then
    meson_cmd=(meson)
  elif python3 -c 'import mesonbuild' >/dev/null 2>&1; then
    meson_cmd=(python3 -m mesonbuild.mesonmain)
  fi
  if ! command -v ninja >/dev/null 2>&1; then
    ninja_dir=$(python3 -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null)
    [ -n "$ninja_dir" ] && [ -x "$ninja_dir/ninja" ] && export PATH=$ninja_dir:$PATH
  fi
  [ ${#meson_cmd[@]} -gt 0 ] && command -v ninja >/dev/null 2>&1
}
cuda_tree() {
  # Outside the source tree: meson refuses include directories inside it.
  local t e
  t=${TMPDIR:-/tmp}/mfsdp-cuda-root.$(echo "$b" | md5sum | cut -c1-8)
  rm -rf "$t" && mkdir -p "$t/include" "$t/lib64" || return 1
  for e in "$cuda"/*; do
    case ${e##*/} in include | lib64) ;; *) ln -s "$e" "$t/" ;; esac
  done
  for e in "$cuda"/include/*; do ln -s "$e" "$t/include/"; done
  for e in "$cudalib"/*; do ln -s "$e" "$t/lib64/"; done
  for e in "$nccl_inc"/nccl*; do [ -e "$t/include/${e##*/}" ] || ln -s "$e" "$t/include/"; done
  for e in "$nccl_lib"/libnccl*; do [ -e "$t/lib64/${e##*/}" ] || ln -s "$e" "$t/lib64/"; done
  # The NCCL wheel has no development link: the linker needs libnccl.so.
  [ -e "$t/lib64/libnccl.so" ] || ln -s "$nccl_lib/libnccl.so.2" "$t/lib64/libnccl.so"
  echo "$t"
}
if [ $train = 1 ]; then
  t0=$SECONDS
  to=$(stage_timeout "$t_meson")
  if [ -n "${MFSDP_DEVICE_MESON_BUILD:-}" ]; then
    meson_b=$(readlink -f "$MFSDP_DEVICE_MESON_BUILD")
    note "meson: the prebuilt $meson_b (MFSDP_DEVICE_MESON_BUILD)"
    : >"$b/meson.log"
  elif [ $((limit - SECONDS)) -lt 20 ]; then
    note "meson: skipped, past the ${limit}s limit"
    train=0
  elif ! find_meson; then
    note "meson: FAILED, no meson or ninja (neither on the PATH nor as python3 modules)"
    status=1 train=0
  else
    meson_b=$b/meson
    opts=(-Dtests=false -Dmpi=disabled -Dhwloc=disabled -Dblas=enabled -Dcuda=enabled
          -Dfake_nccl=false)
    if [ $fake = 1 ]; then
      opts=(-Dtests=true -Dmpi=enabled -Dhwloc=disabled -Dblas=enabled -Dcuda=disabled
            -Dfake_nccl=true)
    else
      tree=$(cuda_tree) || tree=""
      opts+=("-Dcudatoolkit=$tree")
    fi
    echo "== meson build in $meson_b (timeout ${to}s): ${opts[*]}"
    targets=(ld_preload/libmfsdp_preload.so examples/fsdp_train_nccl_nompi)
    [ $fake = 1 ] && targets+=(tests/lib/libnccl_mpi_fake.so)
    export meson_b
    if { [ -f "$meson_b/build.ninja" ] || timeout "$to" "${meson_cmd[@]}" setup "$meson_b" "${opts[@]}"; } \
         >"$b/meson.log" 2>&1 &&
       timeout "$(( to - (SECONDS - t0) > 1 ? to - (SECONDS - t0) : 1 ))" \
         ninja -C "$meson_b" "${targets[@]}" >>"$b/meson.log" 2>&1; then
      note "meson: ok in $((SECONDS - t0)) s, warnings: $(grep -c -i 'warning:' "$b/meson.log")"
    else
      tail -40 "$b/meson.log"
      note "meson: FAILED or timed out after $((SECONDS - t0)) s (log: $b/meson.log)"
      status=1 train=0
    fi
  fi
  if [ $train = 1 ]; then
    preload=$meson_b/ld_preload/libmfsdp_preload.so
    job=$meson_b/examples/fsdp_train_nccl_nompi
    # Neither the shim nor the job may need MPI (with --fake the job's NCCL is the test
    # library, which does: only the job's own NEEDED entries are checked then).
    # ldd with the loader path of the runs.
    ldd_run() { LD_LIBRARY_PATH=$run_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ldd "$@"; }
    bad=""
    for f in "$preload" "$job"; do
      if [ ! -f "$f" ]; then
        bad+=" ${f##*/} missing;"
        continue
      fi
      needed=$(readlink -f "$f" | xargs readelf -d 2>/dev/null | grep NEEDED | sed 's/.*\[\(.*\)\]/\1/' | tr '\n' ' ')
      echo "${f##*/}: NEEDED $needed" >>"$b/meson.log"
      case $needed in *libmpi*) bad+=" ${f##*/} needs libmpi;" ;; esac
      if [ $fake = 0 ] || [ "$f" = "$preload" ]; then
        ldd_run "$f" >>"$b/meson.log" 2>&1
        if ldd_run "$f" 2>/dev/null | grep -q libmpi; then
          bad+=" ${f##*/} loads libmpi (ldd);"
        fi
        if ldd_run "$f" 2>/dev/null | grep -q 'not found'; then
          bad+=" ${f##*/}: $(ldd_run "$f" | grep 'not found' | head -2 | tr -s ' \t\n' ' ');"
        fi
      fi
    done
    if [ -n "$bad" ]; then
      note "no-MPI check: FAILED:$bad"
      status=1 train=0
    else
      job_needs=$(readelf -d "$job" | grep NEEDED | sed 's/.*\[\(.*\)\]/\1/' | xargs)
      note "no-MPI check: ok (no libmpi in readelf -d$([ $fake = 0 ] && echo ' or ldd') of the" \
        "shim and the job; the job needs: $job_needs)"
      if [ -n "$deps" ] && [ $fake = 0 ]; then
        from=$(ldd_run "$preload" | grep -E 'jansson|crypto|openblas' | awk '{print $3}' |
               xargs -n1 dirname | sort -u | xargs)
        note "  shim's jansson/libcrypto/openblas from: $from"
        # Every jansson, OpenSSL and OpenBLAS header the build read (ninja's dependency
        # records) must come from the pack: the GPU machine has no others.
        hdrs=$(ninja -C "$meson_b" -t deps 2>/dev/null | sed 's/^ *//' |
               grep -E '(^|/)(jansson[a-z_]*|cblas|openblas_config|openssl/[a-z_0-9]+)\.h$' | sort -u)
        outside=$(grep -v "^$deps/" <<<"$hdrs" | grep -v '^$')
        if [ -z "$hdrs" ]; then
          note "  headers: FAILED, ninja recorded no jansson/OpenSSL/OpenBLAS header"
          status=1 train=0
        elif [ -n "$outside" ]; then
          note "  headers: FAILED, $(wc -l <<<"$outside") from outside the pack: $(head -3 <<<"$outside" | xargs)"
          status=1 train=0
        else
          note "  headers: all $(wc -l <<<"$hdrs") jansson/OpenSSL/OpenBLAS headers the build read are the pack's"
        fi
      fi
    fi
  fi
fi

# A failed build stops only the stages that need what it builds.
if [ $plain = 0 ] && [ $train = 0 ]; then
  note "runs: none left to run"
  finish 1
fi
if [ $build_only = 1 ]; then
  note "runs: skipped (--build-only)"
  finish $status
fi
[ -n "$run_ld" ] && export LD_LIBRARY_PATH=$run_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ $fake = 0 ] && [ $have_gpu = 0 ]; then
  if [ $plain = 1 ]; then
    echo "-- nvidia-smi saw no GPU; the kernel test decides (exit 77: none)"
  else
    note "runs: skipped, no GPU on this machine (nothing was run on a device)"
    finish "$([ $status = 0 ] && echo 77 || echo 1)" # a failed build is not hidden by "no GPU"
  fi
fi

if [ $plain = 1 ]; then
# ---------------------------------------------------------------- kernels vs CPU
echo "== test_cuda_kernels (timeout ${t_kernels}s)"
args=()
[ $perf = 0 ] && args+=(--no-perf)
OPENBLAS_NUM_THREADS=4 timeout "$(stage_timeout "$t_kernels")" "$b/test_cuda_kernels" "${args[@]}" 2>&1 \
  | tee "$b/kernels.log"
rc=${PIPESTATUS[0]}
counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$b/kernels.log" | tail -1)
note "kernels: ${counts:-no count line} (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
while read -r l; do note "$l"; done < <(grep '^device 0:' "$b/kernels.log" | head -1)
while read -r l; do note "  $l"; done < <(grep '^FAIL' "$b/kernels.log" | head -20)
while read -r l; do note "  $l"; done < <(grep -E 'aggregate rel err' "$b/kernels.log")
while read -r l; do note "  $l"; done < <(grep '^perf ' "$b/kernels.log")
if [ "$rc" = 77 ]; then
  note "runs: skipped, no GPU on this machine (nothing was run on a device)"
  finish "$([ $status = 0 ] && echo 77 || echo 1)" # a failed build is not hidden by "no GPU"
fi
[ "$rc" = 0 ] || status=1

# ---------------------------------------------------------------- executor vs CPU executor
if over_budget; then
  note "executor: skipped, past the ${budget}s budget"
else
  echo "== test_exec_cuda (timeout ${t_kernels}s)"
  timeout "$(stage_timeout "$t_kernels")" "$b/test_exec_cuda" 2>&1 | tee "$b/exec.log"
  rc=${PIPESTATUS[0]}
  counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$b/exec.log" | tail -1)
  note "executor: ${counts:-no count line} (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
  while read -r l; do note "  $l"; done < <(grep '^FAIL' "$b/exec.log" | head -20)
  [ "$rc" = 0 ] || status=1
fi

fi

# ---------------------------------------------------------------- train: fsdp_train on NCCL
# fsdp_train_nccl_nompi at each rank count, its ranks started by scripts/device-launch.sh on
# the one GPU (one NCCL_HOSTID per rank: NCCL treats them as hosts and connects them through
# sockets on loopback). Per rank count: the manifest the shim needs (written by the job),
# the single-process reference (--reference --emulate-world n --optim muon-gather), then
#   muon-gather   the job's own FSDP2-Muon (all-gathers, fp32 Newton-Schulz on the CPU):
#                 within 1e-5 of the reference, as in tests/preload;
#   mfsdp shim    the job's AdamW run under LD_PRELOAD=libmfsdp_preload.so with the manifest
#                 (mfsdp's owner Muon on the GPU, bf16 Newton-Schulz): within the band.
# Step times are the job's own (mean over steps 1.., max over ranks).
if [ $train = 1 ]; then
  model=${MFSDP_DEVICE_TRAIN_MODEL:-$([ $fake = 1 ] && echo small || echo medium)}
  steps=${MFSDP_DEVICE_TRAIN_STEPS:-12}
  # With --fake the shim runs the CPU executor (fp32): 1e-5, as tests/preload/shim_check.py.
  band=${MFSDP_DEVICE_BAND:-$([ $fake = 1 ] && echo 1e-5 || echo 2e-2)}
  td=$b/train
  rm -rf "$td" && mkdir -p "$td"
  ncpu=$(nproc 2>/dev/null || echo 4)
  launch=(scripts/device-launch.sh)
  if [ $fake = 1 ]; then
    mpirun_bin=$(command -v mpirun) || mpirun_bin=mpirun
    launch+=(--fake "$mpirun_bin")
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1
  fi
  # NCCL over sockets on loopback between the ranks sharing the GPU (as tests/gpu/nccl_ranks).
  export NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket
  common=(--model "$model" --seed 7 --steps "$steps" --quiet)
  note "train: fsdp_train_nccl_nompi --model $model --steps $steps; shim band $band"

  # One launch: $1 tag, $2 ranks, rest the command. Sets rc and leaves $td/$tag/.
  run_launch() {
    local tag=$1 n=$2 to
    shift 2
    to=$(stage_timeout "$t_train")
    if [ "$to" -lt 10 ]; then
      note "  $tag: skipped, past the ${limit}s limit"
      rc=125
      return
    fi
    OPENBLAS_NUM_THREADS=$(( ncpu / n > 0 ? ncpu / n : 1 )) \
      "${launch[@]}" -n "$n" -t "$to" -d "$td/$tag" -- "$@" >"$td/$tag.launch" 2>&1
    rc=$?
    cat "$td/$tag.launch"
    [ "$rc" = 124 ] && hung=1
    if [ "$rc" != 0 ]; then
      note "  $tag: $(tail -1 "$td/$tag.launch")"
      for f in "$td/$tag"/rank*.log; do
        [ -f "$f" ] || continue
        while read -r l; do note "    ${f##*/}: $l"; done < <(grep -iE 'error|fail|warn' "$f" | head -4)
      done
    fi
  }
  # Compares weight files: prints the worst relative difference; exit 1 beyond tol.
  compare() {
    # The image's python3 with its own libraries, not the pack's (its ssl, hashlib).
    env -u LD_LIBRARY_PATH python3 - "$1" "$2" "$3" <<'EOF'
import math, sys
sys.path.insert(0, "tests/preload")
import fsdp_train_check as ftc
ref, got, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
specs_r, r = ftc.load(ref)
specs_g, g = ftc.load(got)
if specs_r != specs_g:
    print("tensor lists differ")
    sys.exit(1)
worst, name = 0.0, "all equal"
for n, _ in specs_r:
    a, b = g[n], r[n]
    if any(math.isnan(x) for x in a):
        print(f"NaN in {n}")
        sys.exit(1)
    rel = max(abs(x - y) for x, y in zip(a, b)) / (max(abs(y) for y in b) or 1.0)
    if rel > worst:
        worst, name = rel, n
print(f"{worst:.2e} ({name})")
sys.exit(0 if worst <= tol else 1)
EOF
  }
  timing() { # $1: rank 0's log; "step optim comm" in ms
    sed -n 's/^timing_ms_per_step[^:]*:\(.*\)$/\1/p' "$1" | awk '{
      for (i = 1; i < NF; i += 2) v[$i] = $(i + 1)
      printf "%s %s %s", v["step"], v["optim"], v["comm"] }'
  }

  hung=0 # a launch that timed out: the rest of the stage would likely hang too
  for n in ${MFSDP_DEVICE_TRAIN_RANKS:-1 4}; do
    if over_budget; then
      note "train n=$n: skipped, past the ${budget}s budget"
      continue
    fi
    if [ $hung = 1 ]; then
      note "train n=$n: skipped, an earlier launch timed out"
      continue
    fi
    echo "== train n=$n"
    man=$td/manifest$n.json ref=$td/reference$n.bin
    run_launch "manifest$n" "$n" "$job" --model "$model" --seed 7 --steps 0 --optim none \
      --write-manifest "$man"
    if [ "$rc" != 0 ]; then
      note "train n=$n: FAILED, the job could not write its manifest (launch exit $rc)"
      status=1
      continue
    fi
    to=$(stage_timeout "$t_train")
    OPENBLAS_NUM_THREADS=$ncpu timeout "$to" "$job" --reference --emulate-world "$n" \
      --optim muon-gather "${common[@]}" --dump-weights "$ref" >"$td/reference$n.log" 2>&1
    rc=$?
    if [ "$rc" != 0 ]; then
      tail -5 "$td/reference$n.log"
      note "train n=$n: FAILED, the --reference run exited $rc"
      status=1
      continue
    fi
    steps_ms=()
    for run in muon-gather shim shim-register; do
      [ $hung = 1 ] && break
      w=$td/$run$n.bin
      case $run in
        muon-gather)
          tol=1e-5 label="muon-gather (the job's own)"
          run_launch "$run$n" "$n" "$job" --optim muon-gather "${common[@]}" --dump-weights "$w"
          ;;
        shim)
          tol=$band label="mfsdp shim (job's adamw + LD_PRELOAD)"
          run_launch "$run$n" "$n" env LD_PRELOAD="$preload" MFSDP_MANIFEST="$man" \
            "$job" --optim adamw "${common[@]}" --dump-weights "$w"
          ;;
        shim-register)
          # Registered arenas: ncclMemAlloc + ncclCommRegister (docs/gpu.md, "Settings").
          tol=$band label="mfsdp shim, MFSDP_NCCL_REGISTER=1"
          run_launch "$run$n" "$n" env LD_PRELOAD="$preload" MFSDP_MANIFEST="$man" \
            MFSDP_NCCL_REGISTER=1 "$job" --optim adamw "${common[@]}" --dump-weights "$w"
          ;;
      esac
      if [ "$rc" != 0 ]; then
        table+=("| $label | $n | FAILED: $(tail -1 "$td/$run$n.launch") | | | |")
        status=1
        continue
      fi
      cmp_out=$(compare "$ref" "$w" "$tol")
      crc=$?
      read -r t_step t_optim t_comm <<<"$(timing "$td/$run$n/rank0.log")"
      verdict=$([ $crc = 0 ] && echo "$cmp_out ($tol)" || echo "FAILED: $cmp_out > $tol")
      table+=("| $label | $n | $verdict | ${t_step:-?} | ${t_optim:-?} | ${t_comm:-?} |")
      [ $run = shim-register ] || steps_ms+=("${t_step:-}")
      note "train n=$n $run: weights vs reference $verdict; step ${t_step:-?} ms"
      [ $crc = 0 ] || status=1
      if [ $run != muon-gather ]; then
        s=$(grep -h 'mfsdp: summary' "$td/$run$n"/rank*.log | head -1)
        note "  ${s:-no mfsdp summary line from the shim}"
        [ -n "$s" ] || status=1
      fi
    done
    if [ ${#steps_ms[@]} = 2 ] && [ -n "${steps_ms[0]}" ] && [ -n "${steps_ms[1]}" ]; then
      note "train n=$n: step time, mfsdp shim vs muon-gather: ${steps_ms[1]} ms vs ${steps_ms[0]} ms ($(awk -v a="${steps_ms[1]}" -v b="${steps_ms[0]}" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }'))"
    fi
  done
fi
# ---------------------------------------------------------------- torch: the PyTorch companion
# examples/pytorch/train_fsdp2.py (an ordinary FSDP2 script, no mfsdp code) with --device cuda
# under `mfsdp-run torchrun`, the shim from the meson build: the companion tags FSDP2's
# collectives and the shim runs the owner collectives on PyTorch's own NCCL communicators
# (PyTorch's NCCL wheel), Newton-Schulz on the GPU (bf16). Each rank gets its own NCCL_HOSTID
# (torchrun --no-python through bash), as the ranks share the GPU. The job's saved
# state_dict() (after the companion's write-back) against tests/python/reference.py's float64
# Muon on the CPU, within the band; at 1 rank FSDP2 issues no collective and the companion
# issues them (docs/pytorch.md, "Limits").
if [ $train = 1 ] && [ $fake = 0 ]; then
  t_torch=${MFSDP_DEVICE_TIMEOUT_TORCH:-150}
  tband=${MFSDP_DEVICE_BAND:-2e-2}
  tflags=(--steps "${MFSDP_DEVICE_TORCH_STEPS:-6}")
  tt=$b/torch
  rm -rf "$tt" && mkdir -p "$tt"
  # python3 sees the pack's libraries (LD_LIBRARY_PATH) only in the job, where the
  # preloaded shim needs them.
  if ! env -u LD_LIBRARY_PATH python3 -c \
       'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
       >"$tt/python.log" 2>&1; then
    note "torch: skipped, python3 has no torch that sees the GPU ($(tail -1 "$tt/python.log"))"
  else
    note "torch: $(env -u LD_LIBRARY_PATH python3 -c 'import torch; print("torch", torch.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())))' 2>&1 | tail -1); band $tband"
    for n in ${MFSDP_DEVICE_TORCH_RANKS:-4 1}; do
      if over_budget; then
        note "torch n=$n: skipped, past the ${budget}s budget"
        continue
      fi
      to=$(stage_timeout "$t_torch")
      echo "== torch n=$n: mfsdp-run torchrun --nproc-per-node $n train_fsdp2.py --device cuda (timeout ${to}s)"
      t0=$SECONDS
      # shellcheck disable=SC2016
      PYTHONPATH=$root/python MFSDP_PRELOAD_LIB=$preload timeout "$to" \
        python3 -m mfsdp.run python3 -m torch.distributed.run --standalone \
        --nproc-per-node "$n" --no-python bash -c \
        'NCCL_HOSTID=mfsdp-torch-$LOCAL_RANK exec python3 "$@"' bash \
        "$root/examples/pytorch/train_fsdp2.py" --device cuda "${tflags[@]}" \
        --save "$tt/mfsdp$n.pt" >"$tt/run$n.log" 2>&1
      rc=$?
      secs=$((SECONDS - t0))
      s=$(grep -h 'mfsdp: summary' "$tt/run$n.log" | head -1)
      if [ $rc != 0 ]; then
        tail -30 "$tt/run$n.log"
        note "torch n=$n: FAILED, exit $rc$([ $rc = 124 ] && echo ' (timed out)') after ${secs}s"
        while read -r l; do note "  $l"; done \
          < <(grep -E 'Error|error:|mfsdp: ' "$tt/run$n.log" | grep -v '^\s*File' | head -4)
        table+=("| mfsdp-run torchrun train_fsdp2.py | $n | FAILED: exit $rc | | | |")
        status=1
        continue
      fi
      if ! env -u LD_LIBRARY_PATH python3 "$root/tests/python/reference.py" --world "$n" --optim muon64 \
           --out "$tt/ref$n.pt" "${tflags[@]}" >"$tt/ref$n.log" 2>&1; then
        tail -5 "$tt/ref$n.log"
        note "torch n=$n: FAILED, the reference run failed"
        status=1
        continue
      fi
      cmp_out=$(env -u LD_LIBRARY_PATH python3 - "$tt/mfsdp$n.pt" "$tt/ref$n.pt" "$tband" <<'PY'
import sys
import torch
a, b, tol = torch.load(sys.argv[1]), torch.load(sys.argv[2]), float(sys.argv[3])
if sorted(a) != sorted(b):
    print("tensor names differ")
    sys.exit(1)
worst, name = 0.0, ""
for k in sorted(a):
    x, y = a[k].double().cpu(), b[k].double().cpu()
    rel = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30)
    if not bool(x.isfinite().all()):
        rel = float("inf")
    if rel >= worst:
        worst, name = rel, k
print(f"{worst:.2e} ({name})")
sys.exit(0 if worst <= tol else 1)
PY
)
      crc=$?
      verdict=$([ $crc = 0 ] && echo "$cmp_out ($tband)" || echo "FAILED: $cmp_out > $tband")
      note "torch n=$n: weights vs float64 Muon $verdict; ${secs}s"
      note "  ${s:-no mfsdp summary line from the shim}"
      table+=("| mfsdp-run torchrun train_fsdp2.py | $n | $verdict | | | |")
      [ $crc = 0 ] && [ -n "$s" ] || status=1
    done
  fi
fi
# ---------------------------------------------------------------- NCCL ranks (after train:
# the train stage is the one most worth its device time)
if [ $plain = 1 ]; then
if [ $nccl = 1 ]; then
  for n in ${MFSDP_DEVICE_NCCL_RANKS:-2 3 4}; do
    if over_budget; then
      note "nccl n=$n: skipped, past the ${budget}s budget"
      continue
    fi
    echo "== nccl_ranks -n $n (timeout ${t_nccl}s)"
    to=$(stage_timeout "$t_nccl")
    timeout "$to" "$b/nccl_ranks" -n "$n" -t $(( to > 30 ? to - 20 : 10 )) 2>&1 | tee "$b/nccl_ranks_$n.log"
    rc=${PIPESTATUS[0]}
    line=$(grep -E "^nccl_ranks n=$n: " "$b/nccl_ranks_$n.log" | tail -1)
    note "nccl n=$n: ${line:-no summary line} (exit $rc$([ "$rc" = 124 ] && echo ', timed out'))"
    while read -r l; do note "  $l"; done \
      < <(grep -E '^nccl_ranks: [0-9]+ CUDA' "$b/nccl_ranks_$n.log" | head -1)
    [ "$rc" = 0 ] || status=1
  done
else
  note "nccl: skipped"
fi
fi

finish $status
