#!/usr/bin/env bash
# On the GPU machine: speculative decoding at Qwen3-8B shape (random bf16
# checkpoint, H 4096, V 151936, 36 layers) with a fresh d 1024, 5-layer,
# 8-head, gamma 7 drafter on the GPU beside the target, and with n-grams:
# `bench spec` under the threshold schedule (the default), then off /
# threshold / alg1 (the unpruned GPU source and the prefix scheduler), then
# `calibrate` on the GPU (sampled drafting at T = 1) and `bench spec` again
# with the calibrated thresholds. Expects .device/ from
# tests/tools/device_bundle.sh, carried with the tree (run_draft_checks.sh
# first unpacks it). Logs go to $OUT (or /tmp/spec-checks).
#
#   tests/tools/run_spec_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh || exit 1
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/spec-checks}"
mkdir -p "$out"
model=/tmp/bench/qwen3-8b
python3 bench/decode_vs_hf.py --dspark .device/bin/dspark --shapes qwen3-8b --workdir /tmp/bench \
  --results /dev/null --checkpoints-only || exit 1
cp tests/golden/qwen3/tokenizer*.json "$model/"
prompts=/tmp/spec-checks-prompts.jsonl
head -8 data/prompts/heldout_code.jsonl >"$prompts"
drafter=/tmp/spec-checks-drafter
rm -rf "$drafter"
.device/bin/dspark draft-init -m "$model" -o "$drafter" --gamma 7 --d-draft 1024 --layers 5 --heads 8 || exit 1

status=0
spec() {  # bench spec with the arguments given, at batch 1 and gamma 7, 48 tokens per prompt
  echo "== bench spec $*" | tee -a "$out/spec.log"
  .device/bin/dspark bench spec --device cuda -m "$model" --prompts "$prompts" -n 48 --batch 1 --gamma 7 "$@" 2>&1 |
    tee -a "$out/spec.log" || status=1
}
spec -d "$drafter"
spec -d ngram
spec -d "$drafter" --schedule off,threshold,alg1 --sps-cache /tmp/spec-checks-sps.json
echo "== calibrate on the GPU (sampled drafts, T = 1)" | tee -a "$out/spec.log"
.device/bin/dspark calibrate --device cuda -m "$model" -d "$drafter" --prompts "$prompts" -n 24 --temperature 1 2>&1 |
  tail -n 12 | tee -a "$out/spec.log" || status=1
spec -d "$drafter"
echo "spec checks status: $status"
exit $status
