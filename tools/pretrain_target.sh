#!/usr/bin/env bash
# The device command that pretrains the project's target LM (one H200, within
# the 10-minute limit of one command) and leaves in $OUT what tools/unpack_target.sh
# turns back into models/<name>/: <name>.tar.part-NN (<= 15 MiB each),
# SHA256SUMS, report.json, train.log. Needs data/corpus (tools/corpus.py)
# carried along; extra arguments go to tools/pretrain_target.py.
#   on the device:  bash tools/pretrain_target.sh [--name dspark-target] [--minutes 7]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 tools/pretrain_target.py --corpus data/corpus --prompts data/prompts \
  --out /tmp/dspark-target-work --pack-to "$OUT" "$@"
ls -la "$OUT"
