#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fuzz a parser with libFuzzer: scripts/fuzz.sh [SECONDS] [TARGET]   (default 60, manifest)
#
# TARGET: manifest (the mfsdp-manifest/1 parser), safetensors (the safetensors header
# parser, inputs are whole files) or ckpt_index (the checkpoint index parser; inputs are
# sealed with their digest by the target).
# Configures build-fuzz (clang, -Dfuzz=true, ASan + UBSan), seeds the corpus (manifest:
# examples/models/*.json and tests/fuzz/corpus/*; others: tests/fuzz/corpus-TARGET/*), runs
# tests/fuzz/fuzz_TARGET for SECONDS and ends with "N execs, N crashes". Inputs that crashed,
# leaked or timed out are kept in build-fuzz/fuzz-artifacts/; the grown corpus in
# build-fuzz/fuzz-corpus/TARGET is reused next time. jansson and libcrypto are not
# instrumented: coverage guidance comes from mfsdp's own code.
set -uo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
case $secs in
  '' | *[!0-9]*) echo "usage: $0 [seconds] [manifest|safetensors|ckpt_index]" >&2; exit 2 ;;
esac
which=${2:-manifest}
case $which in
  manifest | safetensors | ckpt_index) ;;
  *) echo "usage: $0 [seconds] [manifest|safetensors|ckpt_index]" >&2; exit 2 ;;
esac
build=${MFSDP_FUZZ_BUILD_DIR:-build-fuzz}
target=fuzz_$which

setup_args=(-Dfuzz=true -Dcuda=disabled -Db_sanitize=address,undefined -Db_lundef=false)
if [ -f "$build/build.ninja" ]; then
  CC=clang meson setup --reconfigure "$build" "${setup_args[@]}" >"$build.setup.log" 2>&1
else
  CC=clang meson setup "$build" "${setup_args[@]}" >"$build.setup.log" 2>&1
fi || { cat "$build.setup.log"; echo "fuzz: configure failed"; exit 1; }
ninja -C "$build" "tests/fuzz/$target" || { echo "fuzz: build failed"; exit 1; }

corpus=$build/fuzz-corpus/$which
artifacts=$build/fuzz-artifacts
mkdir -p "$corpus" "$artifacts"
if [ "$which" = manifest ]; then
  cp examples/models/*.json tests/fuzz/corpus/* "$corpus/"
else
  cp tests/fuzz/corpus-"$which"/* "$corpus/"
fi
before=$(find "$artifacts" -type f | wc -l)

log=$build/fuzz-$which.log
echo "fuzz: $target for ${secs}s, corpus $corpus, log $log"
MFSDP_DEBUG=NONE \
ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$build/tests/fuzz/$target" "$corpus" \
    -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
    -dict=tests/fuzz/"$which".dict -artifact_prefix="$artifacts/$which-" -print_final_stats=1 \
    >"$log" 2>&1
rc=$?

execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
after=$(find "$artifacts" -type f | wc -l)
crashes=$((after - before))
if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
  crashes=1 # libFuzzer stopped on a failure it wrote no input for
fi
if [ "$crashes" -ne 0 ]; then
  tail -n 40 "$log"
  find "$artifacts" -type f -newer "$build.setup.log" | sed 's/^/fuzz: kept /'
fi
echo "${execs:-0} execs, $crashes crashes"
[ "$crashes" -eq 0 ]
