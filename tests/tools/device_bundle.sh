#!/usr/bin/env bash
# Packs what a GPU machine without our Debian packages needs into .device/
# (git-ignored; pass it to the device tool as a carried path): the dspark,
# dspark_cuda_tests and dspark_product_benchmark binaries built here, and the
# shared libraries they load that a CUDA image lacks (OpenBLAS, PCRE2,
# utf8proc, PLplot, Google Benchmark and their runtimes; the cairo driver and
# its libraries for PNG plots, packed), the binaries and libraries
# xz-compressed (the device tool carries at most 64 MiB with the tree);
# tests/tools/device_unpack.sh, run there first, restores them.
# The tree (~66 MB) and all of .device (~19 MB) exceed that together: carry
# .device without what a call does not need (plot-runtime.tar.gz, one of the
# binaries), and move models/dspark-drafter-gamma10 out of the checkout for
# the call when it is not used there (a tracked file missing from the working
# tree does not travel), then back.
#
# --with-target also packs the shipped target's weights (38.6 MB, 27.3 MB
# compressed) as .device/model/model.safetensors.xz, for a call that carries
# the tree without models/dspark-target/model.safetensors (moved out for it):
# device_unpack.sh puts them back in place there. That leaves ~20 MB of the
# 64 MiB for .device: the widened pair's measurements (bench/device_compare.sh)
# travel that way with two or three builds of dspark.
set -euo pipefail
cd "$(dirname "$0")/../.."
with_target=0
case "${1:-}" in
  '') ;;
  --with-target) with_target=1 ;;
  *) echo "usage: $0 [--with-target]" >&2; exit 2 ;;
esac
scripts/build.sh >/dev/null
rm -rf .device && mkdir -p .device/bin .device/lib
cp build/dspark build/dspark_cuda_tests .device/bin/
for library in libopenblas.so.0 libpcre2-8.so.0 libutf8proc.so.2 libgfortran.so.5 libquadmath.so.0; do
  path=$(ldd build/dspark | awk -v name="$library" '$1 == name { print $3 }')
  [ -n "$path" ] && cp -L "$path" ".device/lib/$library"
done

# The kernel tracer (README: Layout) and the CUPTI it loads, where CUPTI is installed here.
if [ -e build/libdspark_kernel_trace.so ]; then
  cp build/libdspark_kernel_trace.so .device/lib/
  cp -L "$(ldd build/libdspark_kernel_trace.so | awk '$1 ~ /^libcupti/ { print $3 }')" .device/lib/
fi

# Copies every library `binary` loads into directory $2, except the C/C++
# runtime and CUDA (the image has its own) and what .device/lib holds.
copy_libraries() {
  ldd "$1" | awk '$3 ~ /^\// { print $1, $3 }' | while read -r name path; do
    case "$name" in
      libc.so.* | libm.so.* | libstdc++.so.* | libgcc_s.so.* | ld-linux* | libpthread.so.* | libdl.so.* | \
        librt.so.* | libcu* | libnv*) continue ;;  # CUDA: the image has its own
    esac
    [ -e ".device/lib/$name" ] || [ -e "$2/$name" ] || cp -L "$path" "$2/$name"
  done
}
# PLplot and what it links (the binaries need them to start).
copy_libraries build/dspark .device/lib
copy_libraries build/dspark_cuda_tests .device/lib
# The products alone (bench/product_benchmark.cpp, 0.9 MB packed), where Google Benchmark built it.
if [ -e build/dspark_product_benchmark ]; then
  cp build/dspark_product_benchmark .device/bin/
  copy_libraries build/dspark_product_benchmark .device/lib
fi
# PNG plots: PLplot's cairo driver (loaded at run time through PLPLOT_DRV_DIR)
# with the cairo / pango / X11 libraries it loads, PLplot's data files
# (PLPLOT_LIB) and one font (FONTCONFIG_FILE), packed into
# .device/plot-runtime.tar.gz (14 MB unpacked); run_cuda_checks.sh unpacks it.
# Without it the binaries run and only --plot fails, with an error that says why.
staging=$(mktemp -d)
mkdir -p "$staging/lib" "$staging/plplot/drivers" "$staging/plplot/data" "$staging/fonts"
drivers=$(pkg-config --variable=drvdir plplot)
cp "$drivers/cairo.so" "$drivers/cairo.driver_info" "$staging/plplot/drivers/"
cp /usr/share/plplot5*/*.fnt /usr/share/plplot5*/*.pal "$staging/plplot/data/"
cp "$(fc-match -f '%{file}' 'DejaVu Sans')" "$staging/fonts/"
printf '<?xml version="1.0"?>\n<fontconfig><dir prefix="relative">.</dir><cachedir>/tmp/dspark-fontconfig</cachedir></fontconfig>\n' \
  >"$staging/fonts/fonts.conf"
copy_libraries "$drivers/cairo.so" "$staging/lib"
tar -C "$staging" -czf .device/plot-runtime.tar.gz .
rm -rf "$staging"
if ((with_target)); then
  mkdir -p .device/model
  cp models/dspark-target/model.safetensors .device/model/
fi
xz -T0 -6 .device/*/*
du -sh .device
