#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
head -128 data/prompts/heldout_code.jsonl > /tmp/p128.jsonl
head -80 data/prompts/heldout_code.jsonl > /tmp/p80.jsonl
for i in 1 2; do for b in dspark_old dspark; do
  echo "== sweep $b $i $(date +%T)"
  .device/bin/$b bench spec --device cuda -d models/dspark-drafter --prompts /tmp/p128.jsonl -n 64 --sweep --schedule alg1 --json > $OUT/sweep_${b}_$i.json 2>$OUT/sweep_${b}_$i.err
  python3 -c "
import json
d=json.load(open('$OUT/sweep_${b}_$i.json'))
print(' '.join('B%d:%.3f(tau %.2f)' % (p['batch'], p['schedules']['alg1']['tokens_per_s']/p['plain_tokens_per_s'], p['schedules']['alg1'].get('tau',0)) for p in d['points']))
" || tail -3 $OUT/sweep_${b}_$i.err
done; done
for i in 1 2; do for b in dspark_old dspark; do
  echo "== demo $b $i"; .device/bin/$b demo --device cuda --json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['plain']['tokens_per_s']), round(d['speculative']['tokens_per_s']), round(d['speedup'],3), round(d['tau'],2), d['text_identical'])"
done; done
for b in dspark_old dspark; do
  echo "== bench spec 80 $b"; .device/bin/$b bench spec --device cuda -d models/dspark-drafter --prompts /tmp/p80.jsonl -n 128 2>&1 | tail -4
done
