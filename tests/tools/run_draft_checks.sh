#!/usr/bin/env bash
# On the GPU machine: the CUDA tests (the drafter's parity tests among them)
# and `dspark bench draft` at Qwen3-8B shape (H 4096, V 151936) with a fresh
# d 1024, 5-layer, gamma 7 drafter. Expects .device/ from
# tests/tools/device_bundle.sh, carried with the tree. Writes its logs and the
# benchmark's JSON lines to $OUT (or /tmp/draft-checks).
#
#   tests/tools/run_draft_checks.sh [gtest filter]   (default: every CUDA test)
set -uo pipefail
cd "$(dirname "$0")/../.."
tests/tools/device_unpack.sh || exit 1
export LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export DSPARK_GOLDEN_DIR="$PWD/tests/golden"
out="${OUT:-/tmp/draft-checks}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

stdbuf -oL .device/bin/dspark_cuda_tests --gtest_color=no --gtest_filter="${1:-*}" 2>&1 | tee "$out/cuda_tests.log"
tests_status=${PIPESTATUS[0]}

# The random bf16 Qwen3-8B checkpoint (written once per machine).
python3 bench/decode_vs_hf.py --dspark .device/bin/dspark --shapes qwen3-8b --workdir /tmp/bench \
  --results /dev/null --checkpoints-only || exit 1
bench_status=0
rm -f "$out/bench_draft.jsonl"
for head in markov rnn gru; do
  for batch in 1 4; do
    [ "$head" != markov ] && [ "$batch" != 1 ] && continue
    args=(-m /tmp/bench/qwen3-8b --d-draft 1024 --layers 5 --heads 8 --gamma 7 --seq-head "$head"
          --batch "$batch" --context 512 --runs 50)
    echo "== bench draft: $head head, batch $batch"
    .device/bin/dspark bench draft "${args[@]}" --json | tee -a "$out/bench_draft.jsonl" || bench_status=1
  done
done
echo "== per-op profile of both steps (eager: slower than the graphs above), markov head, batch 1"
DSPARK_DRAFT_PROFILE=1 DSPARK_PROFILE=1 .device/bin/dspark bench draft -m /tmp/bench/qwen3-8b --d-draft 1024 \
  --layers 5 --heads 8 --gamma 7 --batch 1 --context 512 --runs 20 2>&1 | tee "$out/bench_draft_profile.txt"
python3 - "$out/bench_draft.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['seq_head']:6s} batch {r['batch']}: draft {r['draft_ms']:.3f} ms (device {r['draft_device_ms']:.3f}), "
          f"extend {r['extend_ms']:.3f} ms, target decode {r['target_decode_ms']:.3f} ms: "
          f"{100 * r['ratio']:.1f}% (with the extension {100 * r['ratio_with_extend']:.1f}%)")
PY
echo "CUDA tests exit status: $tests_status; bench status: $bench_status"
exit $(( tests_status || bench_status ))
