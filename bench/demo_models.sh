#!/usr/bin/env bash
# The shipped demo models (models/dspark-target + models/dspark-drafter) on
# one device: tau, acceptance by position and plain vs speculative tokens/s on
# the held-out prompts (first 80 code and prose prompts: lines 81-160 calibrated
# the drafter) at temperature 0 and 1 for gamma 4 and 7 (models/dspark-drafter,
# trained for blocks of 7) and 10 (models/dspark-drafter-gamma10, trained for
# blocks of 10); then the batch sweep 1..64 of plain decoding vs the three
# verify schedules (issue 8), with its plot. JSON per run, the sweep's JSON and
# its plot (bench/plot_sweep.py) go to $OUT (default /tmp/demo-models).
#   [GAMMAS="4 7 10"] [SWEEP=1] bench/demo_models.sh [cuda|cpu] [BINARY]
# On the GPU machine run tests/tools/device_unpack.sh first and pass
# .device/bin/dspark (LD_LIBRARY_PATH must include .device/lib).
set -uo pipefail
cd "$(dirname "$0")/.."
device=${1:-cuda}
dspark=${2:-build/dspark}
out=${OUT:-/tmp/demo-models}
mkdir -p "$out"
prompts=$(mktemp -d)
for kind in code prose; do head -80 "data/prompts/heldout_$kind.jsonl" >"$prompts/$kind.jsonl"; done
status=0
for kind in code prose; do
  for temperature in 0 1; do
    for gamma in ${GAMMAS:-4 7 10}; do
      drafter=models/dspark-drafter
      [ "$gamma" -gt 7 ] && drafter=models/dspark-drafter-gamma10
      name="spec_${device}_${kind}_g${gamma}_t${temperature}"
      "$dspark" bench spec --device "$device" -d "$drafter" --prompts "$prompts/$kind.jsonl" -n 128 \
        --gamma "$gamma" --temperature "$temperature" --json >"$out/$name.json" 2>"$out/$name.log" || status=1
      python3 - "$out/$name.json" "$name" <<'PY' || status=1
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:26s} tau {r['tau']:.2f}  plain {r['plain_tokens_per_s']:7.1f} tok/s  spec "
      f"{r['spec_tokens_per_s']:7.1f} tok/s  x{r['speedup']:.2f}  verify t(g+1)/t(1) {r['verify_cost_ratio']:.2f}  "
      f"efficiency {r['efficiency']:.2f}  matched {r['outputs_matched']}/{r['prompts']}  acceptance "
      + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
PY
    done
  done
done
[ "${SWEEP:-1}" = 1 ] || exit $status
# Batch sweep, greedy, code prompts (160 so that batch 64 has whole batches).
"$dspark" bench spec --device "$device" -d models/dspark-drafter --prompts data/prompts/heldout_code.jsonl -n 64 \
  --sweep --schedule off,threshold,alg1 --sps-cache "$out/sps.json" --json >"$out/sweep_$device.json" \
  2>"$out/sweep_$device.log" || status=1
python3 - "$out/sweep_$device.json" <<'PY' || status=1
import json, sys
r = json.load(open(sys.argv[1]))
print(f"sweep on {r['device']}, gamma {r['gamma']}: tokens/s (speculative / plain)")
for p in r["points"]:
    print(f"  batch {p['batch']:3d}  plain {p['plain_tokens_per_s']:9.1f}  " + "  ".join(
        f"{name} {s['tokens_per_s']:9.1f} ({s['speedup']:.2f}x, tau {s['tau']:.2f}, verified {s['verified_per_round']:.2f}, "
        f"matched {s['outputs_matched']})" for name, s in sorted(p["schedules"].items())))
PY
python3 bench/plot_sweep.py "$out/sweep_$device.json" "$out/sweep_$device.png" || status=1
exit $status
