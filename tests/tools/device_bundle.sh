#!/usr/bin/env bash
# Packs what a GPU machine without our Debian packages needs into .device/
# (git-ignored; pass it to the device tool as a carried path): the dspark and
# dspark_cuda_tests binaries built here, and the shared libraries they load
# that a CUDA image lacks (OpenBLAS, PCRE2, utf8proc and their runtimes),
# each xz-compressed (the device tool carries at most 64 MiB with the tree);
# tests/tools/device_unpack.sh, run there first, restores them.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/build.sh >/dev/null
rm -rf .device && mkdir -p .device/bin .device/lib
cp build/dspark build/dspark_cuda_tests .device/bin/
for library in libopenblas.so.0 libpcre2-8.so.0 libutf8proc.so.2 libgfortran.so.5 libquadmath.so.0; do
  path=$(ldd build/dspark | awk -v name="$library" '$1 == name { print $3 }')
  [ -n "$path" ] && cp -L "$path" ".device/lib/$library"
done
xz -T0 -6 .device/bin/* .device/lib/*
du -sh .device
