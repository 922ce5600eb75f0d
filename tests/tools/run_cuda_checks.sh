#!/usr/bin/env bash
# On the GPU machine: the CUDA tests (CUDA vs the CPU reference on every op and
# on the golden models; with programmatic dependent launch and without) and
# the CLI on --device cuda. Expects .device/ from
# tests/tools/device_bundle.sh, carried with the tree. PNG plots go to
# $DSPARK_PLOT_DIR (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export DSPARK_GOLDEN_DIR="$PWD/tests/golden"
if [ -f .device/plot-runtime.tar.gz ]; then  # PNG plots: PLplot's cairo driver and what it loads
  plot_runtime=$(mktemp -d)
  tar -C "$plot_runtime" -xzf .device/plot-runtime.tar.gz
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$plot_runtime/lib" PLPLOT_DRV_DIR="$plot_runtime/plplot/drivers"
  export PLPLOT_LIB="$plot_runtime/plplot/data" FONTCONFIG_FILE="$plot_runtime/fonts/fonts.conf"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# (stdbuf -oL: gtest's lines as they come, so a run cut off by a timeout still shows where it was.)
stdbuf -oL .device/bin/dspark_cuda_tests --gtest_color=no "$@"
# Again with ordinary launches: the kernels' programmatic-dependent-launch
# waits must give the same results either way.
DSPARK_PDL=0 stdbuf -oL .device/bin/dspark_cuda_tests --gtest_color=no --gtest_brief=1 "$@"
# The attention tests with decode and verify steps on the scalar kernel (the
# tensor-core kernel's comparison switch), which prefill chunks always run.
DSPARK_ATTENTION_SCALAR=1 stdbuf -oL .device/bin/dspark_cuda_tests --gtest_color=no --gtest_brief=1 \
  --gtest_filter='CudaOps.*ttention*'
for model in qwen3 llama; do
  .device/bin/dspark generate --device cuda -m "tests/golden/$model" -p "def add(a, b):" -n 16 --ignore-eos --json
  .device/bin/dspark perplexity --device cuda -m "tests/golden/$model" -f "tests/golden/$model/reference/perplexity.txt" --json
done
# Calibration and the verify schedules on the GPU: a fresh drafter for the
# golden qwen3, calibrated (reliability diagram), then a batch sweep of plain
# vs off / threshold / alg1 (SPS(B) profiled on the GPU; throughput plot).
work=$(mktemp -d)
plots=${DSPARK_PLOT_DIR:-$work}
.device/bin/dspark draft-init -m tests/golden/qwen3 -o "$work/drafter" --gamma 6 --d-draft 64 --heads 4 --layers 1 \
  --markov-rank 16
printf '{"prompt": "def fib(n):"}\n{"prompt": "import os\\nimport sys\\nimport"}\n' >"$work/prompts.jsonl"
.device/bin/dspark calibrate --device cuda -m tests/golden/qwen3 -d "$work/drafter" --prompts "$work/prompts.jsonl" \
  -n 32 --temperature 1 --plot "$plots/reliability.png"
.device/bin/dspark bench spec --device cuda -m tests/golden/qwen3 -d "$work/drafter" --prompts "$work/prompts.jsonl" \
  -n 32 --sweep --sps-cache "$work/sps.json" --plot "$plots/throughput.png"
