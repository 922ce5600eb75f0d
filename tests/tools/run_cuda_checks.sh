#!/usr/bin/env bash
# On the GPU machine: the CUDA tests (CUDA vs the CPU reference on every op and
# on the golden models) and the CLI on --device cuda. Expects .device/ from
# tests/tools/device_bundle.sh, carried with the tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export DSPARK_GOLDEN_DIR="$PWD/tests/golden"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
.device/bin/dspark_cuda_tests --gtest_color=no "$@"
for model in qwen3 llama; do
  .device/bin/dspark generate --device cuda -m "tests/golden/$model" -p "def add(a, b):" -n 16 --ignore-eos --json
  .device/bin/dspark perplexity --device cuda -m "tests/golden/$model" -f "tests/golden/$model/reference/perplexity.txt" --json
done
