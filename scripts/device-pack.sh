#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Packs the build and run dependencies that a lent GPU machine's image lacks (docs/gpu.md,
# "Device check") into .device-deps/, which the device tool carries next to the working tree
# (it is git-ignored): jansson and OpenSSL's libcrypto (the shim), OpenBLAS with its
# libgfortran/libquadmath (examples/fsdp_train's GEMMs) and pkgconf (meson finds the three
# through pkg-config), headers, pkg-config files and shared libraries, taken from this
# machine's installed Debian packages (dpkg -L; no static libraries, no documentation).
# scripts/device-check.sh unpacks it into its build directory, rewrites the pkg-config files
# to that place and points PKG_CONFIG_LIBDIR, CPATH, LIBRARY_PATH and LD_LIBRARY_PATH at it.
#
# Output: .device-deps/deps.tar.xz and .device-deps/MANIFEST (packages, versions, sizes).
# Usage: scripts/device-pack.sh [--max-mib N]   (default 24: a pack above it is refused, the
#        device tool carries 64 MiB in all)
set -euo pipefail
cd "$(dirname "$0")/.."

max_mib=24
if [ "${1:-}" = --max-mib ] && [[ "${2:-}" =~ ^[0-9]+$ ]]; then
  max_mib=$2
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--max-mib N]" >&2
  exit 2
fi

pkgs=(libjansson4 libjansson-dev libssl3 libssl-dev libopenblas0-pthread
      libopenblas-pthread-dev libgfortran5 libquadmath0 pkgconf-bin libpkgconf3)
out=.device-deps
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/root" "$out"

{
  echo "# mfsdp device deps, packed $(date -u '+%Y-%m-%d %H:%M UTC') on $(sed -n 's/^PRETTY_NAME="*\([^"]*\)"*$/\1/p' /etc/os-release)"
  echo "# package version"
} >"$stage/MANIFEST"
for p in "${pkgs[@]}"; do
  v=$(dpkg-query -W -f='${Status} ${Version}' "$p" 2>/dev/null || true)
  case $v in
    "install ok installed "*) ;;
    *) echo "device-pack: $p is not installed here (apt-get install $p)" >&2; exit 1 ;;
  esac
  echo "$p ${v##* }" >>"$stage/MANIFEST"
  while IFS= read -r f; do
    case $f in
      /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/* | *.a) continue ;;
    esac
    # Regular files and symbolic links only (directories come with them).
    if [ -L "$f" ] || [ -f "$f" ]; then
      echo "${f#/}" >>"$stage/files"
    fi
  done < <(dpkg -L "$p")
done
tar -C / --no-recursion -cf - -T "$stage/files" | tar -C "$stage/root" -xf -

# A link to an absolute path (Debian's alternatives) would point off the pack: refuse it
# unless it is one of the alternatives links the check does not use.
while IFS= read -r l; do
  t=$(readlink "$l")
  case $t in
    /etc/alternatives/*) rm -f "$l" ;; # the openblas-pthread directory is used directly
    *) echo "device-pack: $l links to the absolute path $t" >&2; exit 1 ;;
  esac
done < <(find "$stage/root" -type l -lname '/*')
# Every library the check names must be there.
for f in usr/include/jansson.h usr/include/openssl/evp.h \
         usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h \
         usr/lib/x86_64-linux-gnu/pkgconfig/jansson.pc \
         usr/lib/x86_64-linux-gnu/pkgconfig/libcrypto.pc \
         usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig/openblas.pc \
         usr/lib/x86_64-linux-gnu/libjansson.so usr/lib/x86_64-linux-gnu/libcrypto.so \
         usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so \
         usr/lib/x86_64-linux-gnu/libgfortran.so.5 usr/bin/pkgconf; do
  if [ ! -e "$stage/root/$f" ]; then
    echo "device-pack: $f is missing from the pack" >&2
    exit 1
  fi
done

raw=$(du -sb "$stage/root" | cut -f1)
tar -C "$stage/root" -cf - . | xz -T0 -6 >"$stage/deps.tar.xz"
packed=$(stat -c %s "$stage/deps.tar.xz")
echo "# unpacked $raw bytes, packed $packed bytes" >>"$stage/MANIFEST"
if [ "$packed" -gt $((max_mib * 1024 * 1024)) ]; then
  echo "device-pack: the pack is $packed bytes, above --max-mib $max_mib" >&2
  exit 1
fi
mv "$stage/deps.tar.xz" "$stage/MANIFEST" "$out/"
cat "$out/MANIFEST"
echo "device-pack: $out/deps.tar.xz, $((packed / 1024)) KiB ($((raw / 1024)) KiB unpacked)"
