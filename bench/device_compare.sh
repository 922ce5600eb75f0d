#!/usr/bin/env bash
# On the GPU machine: two or more builds of dspark side by side, in one run,
# where issue 8 is measured: the shipped pair widened x16 (bandwidth-bound,
# bench/widen_checkpoint.py; made once a machine, in /tmp/wide), alg1, the
# first 64 held-out code prompts, 256 tokens, batch 1 and 4, the builds
# alternated ROUNDS times so that drift on a shared machine falls on each
# alike. Prints bench/spec_phases.py's lines (speed-up, tau, the round's
# phases); the JSON goes to $OUT (the device tool's) or /tmp/compare.
#
#   bench/device_compare.sh [--rounds N] [--batch LIST] [-n TOKENS] BUILD...
#
# BUILD: a binary's name in .device/bin: tests/tools/device_bundle.sh
# --with-target packs build/dspark (as dspark) and the target's weights; add
# each other build as .device/bin/NAME.xz (xz -c build/dspark). Run
# tests/tools/device_unpack.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2 batch=1,4 tokens=256
while (($#)); do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    -n) tokens=$2; shift 2 ;;
    *) break ;;
  esac
done
(($#)) || { sed -n '2,15p' "$0"; exit 2; }
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for build in "$@"; do [ -x ".device/bin/$build" ] || { echo "no build .device/bin/$build" >&2; exit 2; }; done
out=${OUT:-/tmp/compare}
mkdir -p "$out"
if [ ! -f /tmp/wide/dspark-drafter-x16/dspark.json ]; then
  python3 bench/widen_checkpoint.py --factor 4 --target models/dspark-target --drafter models/dspark-drafter \
    --out /tmp/wide >"$out/widen.log"
fi
head -64 data/prompts/heldout_code.jsonl >/tmp/compare-prompts.jsonl
for round in $(seq "$rounds"); do
  for build in "$@"; do
    label="$build-$round"
    ".device/bin/$build" bench spec --device cuda -m /tmp/wide/dspark-target-x16 -d /tmp/wide/dspark-drafter-x16 \
      --prompts /tmp/compare-prompts.jsonl -n "$tokens" --continuous --json --batch "$batch" --schedule alg1 \
      >"$out/$label.json" 2>"$out/$label.err"
    python3 bench/spec_phases.py "$out/$label.json" "$label"
  done
done
