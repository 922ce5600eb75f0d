#!/usr/bin/env bash
# scratch: GPU sweep with the round breakdown (delete after use)
set -uo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh || exit 1
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
w=/tmp/sweep; mkdir -p $w
.device/bin/dspark bench spec --device cuda -d models/dspark-drafter --prompts data/prompts/heldout_code.jsonl -n 64 \
  --sweep --schedule off,threshold,alg1 --sps-cache $w/sps.json --json > $w/sweep_cuda.json 2> $w/sweep_cuda.log
python3 bench/plot_sweep.py $w/sweep_cuda.json $w/sweep_cuda.png
python3 - $w/sweep_cuda.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for p in r["points"]:
    print(p["batch"], "plain", round(p["plain_tokens_per_s"]), "prefill", round(p["plain_prefill_ms"], 1), "steps", p["plain_steps"], "ms/step", round(p["plain_ms_per_step"], 3))
    for n, s in sorted(p["schedules"].items()):
        print("   ", n, f"{s['speedup']:.2f}x prefill {s['prefill_ms']:.1f} rounds {s['batch_rounds']} undrafted {s['undrafted_rounds']}/{s['rounds']} ms/round",
              "/".join(f"{s['ms_per_batch_round'][k]:.3f}" for k in ("draft", "verify", "accept", "total")))
PY
tar -C $w -czf $OUT/sweep.tgz .
python3 - /tmp/sweep/sps.json <<'PY'
import json, sys
for key, e in json.load(open(sys.argv[1]))["profiles"].items():
    if "D(R)" in key: print("D(R) ms", [(r, round(1e3 * s, 3)) for r, s in zip(e["rows"], e["seconds"])]); continue
    print("plain ms", [(r, round(1e3 / s, 3)) for r, s in zip(e["plain_rows"], e["plain_steps_per_second"])])
    n = len(e["round_drafts"])
    for i, r in enumerate(e["plain_rows"]):
        print("  R", r, "round ms by k", e["round_drafts"], [round(1e3 / v, 3) for v in e["round_steps_per_second"][i*n:(i+1)*n]])
PY
