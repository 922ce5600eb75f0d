#!/usr/bin/env bash
# On the GPU machine: two or more builds of dspark side by side, in one run,
# where issue 8 is measured: the shipped pair widened x16 (bandwidth-bound,
# bench/widen_checkpoint.py; made once a machine, in /tmp/wide), alg1, the
# first 64 held-out code prompts, 256 tokens, batch 1 and 4, the builds
# alternated ROUNDS times so that drift on a shared machine falls on each
# alike. Prints bench/spec_phases.py's lines (speed-up, tau, the round's
# phases); the JSON goes to $OUT (the device tool's) or /tmp/compare.
#
# --trace instead records each build's kernels (the CUPTI tracer in
# .device/lib, bench/kernel_trace.cpp) at each batch of LIST alone: the first
# 4 prompts, 128 tokens (-n), every round drafting all positions (--schedule
# off, so that the rounds have one shape), and prints bench/trace_rounds.py's
# phases and kernels per plain step and verify ($OUT/trace-BUILD-bB.txt).
#
#   bench/device_compare.sh [--rounds N] [--batch LIST] [-n TOKENS] [--trace] BUILD...
#
# BUILD: a binary's name in .device/bin: tests/tools/device_bundle.sh
# --with-target packs build/dspark (as dspark) and the target's weights; add
# each other build as .device/bin/NAME.xz (xz -c build/dspark). Run
# tests/tools/device_unpack.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2 batch=1,4 tokens='' trace=0
while (($#)); do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    -n) tokens=$2; shift 2 ;;
    --trace) trace=1; shift ;;
    *) break ;;
  esac
done
(($#)) || { sed -n '2,21p' "$0"; exit 2; }
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for build in "$@"; do [ -x ".device/bin/$build" ] || { echo "no build .device/bin/$build" >&2; exit 2; }; done
tracer=$PWD/.device/lib/libdspark_kernel_trace.so
((trace == 0)) || [ -f "$tracer" ] || { echo "no kernel tracer $tracer (device_bundle.sh packs it where CUPTI is installed)" >&2; exit 2; }
out=${OUT:-/tmp/compare}
mkdir -p "$out"
if [ ! -f /tmp/wide/dspark-drafter-x16/dspark.json ]; then
  python3 bench/widen_checkpoint.py --factor 4 --target models/dspark-target --drafter models/dspark-drafter \
    --out /tmp/wide >"$out/widen.log"
fi
failed() {  # failed LOG: a run failed; its stderr's tail, then stop
  tail -5 "$1" >&2
  exit 1
}
spec() {  # spec BUILD PROMPTS [bench spec options]: the x16 pair, continuous batching
  local build=$1 prompts=$2
  shift 2
  ".device/bin/$build" bench spec --device cuda -m /tmp/wide/dspark-target-x16 -d /tmp/wide/dspark-drafter-x16 \
    --prompts "$prompts" --continuous "$@"
}

if ((trace)); then
  head -4 data/prompts/heldout_code.jsonl >/tmp/compare-prompts.jsonl
  for build in "$@"; do
    for size in ${batch//,/ }; do
      label="trace-$build-b$size"
      CUDA_INJECTION64_PATH=$tracer DSPARK_KERNEL_TRACE=/tmp/compare-trace.csv \
        spec "$build" /tmp/compare-prompts.jsonl -n "${tokens:-128}" --batch "$size" --schedule off \
        >"$out/$label.err" 2>&1 || failed "$out/$label.err"
      python3 bench/trace_rounds.py /tmp/compare-trace.csv --top 40 >"$out/$label.txt"
      echo "### $label"
      cat "$out/$label.txt"
    done
  done
  exit
fi

head -64 data/prompts/heldout_code.jsonl >/tmp/compare-prompts.jsonl
for round in $(seq "$rounds"); do
  for build in "$@"; do
    label="$build-$round"
    spec "$build" /tmp/compare-prompts.jsonl -n "${tokens:-256}" --json --batch "$batch" --schedule alg1 \
      >"$out/$label.json" 2>"$out/$label.err" || failed "$out/$label.err"
    python3 bench/spec_phases.py "$out/$label.json" "$label"
  done
done
