#!/usr/bin/env bash
# The device commands that retrain the demo drafter (models/dspark-drafter) on
# one H200, spread over several calls of the device tool: a call carries at
# most 64 MiB with the tree, and the binaries plus every prompt file do not fit
# in one, and one command may run 10 minutes. The machine keeps WORK between
# calls while it stays warm, so the phases follow one another:
#
#   regen PART   .device/ (tests/tools/device_bundle.sh; only bin/dspark is
#                needed) is copied to WORK on the first call; .prompts/PART.jsonl.xz
#                (prompts from tools/train_prompts.py, xz-compressed) is answered by
#                the target into WORK/PART
#   train ITERS [STOP]
#                merges every regenerated part (tools/merge_regen.py) and runs
#                `dspark train` to ITERS steps (cosine schedule over ITERS),
#                stopping after step STOP if given; a later `train` resumes
#   Results ($OUT): train_log.jsonl, best/ (dspark.json, model.safetensors f32),
#   the console log. models/README.md lists the hyper-parameters used.
#   GAMMA (default 7) is the block size trained for; each has its own run folder.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
work=${WORK:-/root/dspark-drafter-work}
mkdir -p "$work"
if [ -d .device/bin ]; then
  tests/tools/device_unpack.sh
  cp -r .device/bin .device/lib "$work/"
fi
[ -x "$work/bin/dspark" ] || { echo "no dspark in $work: carry .device on the first call" >&2; exit 1; }
export LD_LIBRARY_PATH="$work/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
dspark="$work/bin/dspark"
gamma=${GAMMA:-7}
run="$work/draft-gamma$gamma"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h "$work" | tail -1

case "${1:-}" in
  regen)
    part=$2
    python3 -c 'import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      ".prompts/$part.jsonl.xz" "$work/$part.jsonl"
    "$dspark" regen --device cuda -m models/dspark-target --prompts "$work/$part.jsonl" -o "$work/$part" \
      -n 128 --temperature 0 --batch 128 >"$OUT/regen-$part.log" 2>&1 || { tail -20 "$OUT/regen-$part.log"; exit 1; }
    tail -2 "$OUT/regen-$part.log"
    ;;
  train)
    iterations=$2
    stop=()
    [ -n "${3:-}" ] && stop=(--stop-after "$3")
    parts=()
    for manifest in "$work"/part*/manifest.json; do parts+=("$(dirname "$manifest")"); done
    [ -f "$work/data/manifest.json" ] || python3 tools/merge_regen.py "$work/data" "${parts[@]}"
    resume=()
    [ -d "$run" ] && resume=(--resume)
    "$dspark" train --device cuda -m models/dspark-target --data "$work/data" -o "$run" "${resume[@]}" \
      --iters "$iterations" "${stop[@]}" --batch 128 --lr 1.5e-3 --warmup 500 --gamma "$gamma" --d-draft 256 --layers 2 \
      --heads 4 --markov-rank 64 --max-ctx 256 --eval-every 2000 --save-every 10000 --eval-anchors 1024 --seed 1 \
      >"$OUT/train.log" 2>&1 || { tail -30 "$OUT/train.log"; exit 1; }
    tail -12 "$OUT/train.log"
    cp "$run/train_log.jsonl" "$OUT/"
    [ -d "$run/best" ] && cp -r "$run/best" "$OUT/best"
    ;;
  *)
    echo "usage: tools/train_drafter.sh regen PART | train ITERS [STOP]" >&2
    exit 2
    ;;
esac
