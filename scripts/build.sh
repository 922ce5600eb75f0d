#!/usr/bin/env bash
# Configures and builds dspark into build/ (Release). CUDA sources are compiled
# when nvcc is on the PATH or in /usr/local/cuda. Arguments name the targets to
# build (default: all of them, the tests included); `scripts/build.sh dspark`
# builds only the command.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
targets=()
if (($#)); then targets=(--target "$@"); fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" ${targets[@]+"${targets[@]}"}
