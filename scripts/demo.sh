#!/usr/bin/env bash
# Fresh clone to the demo: install the packages, build the `dspark` command,
# then run `dspark demo` with the shipped target and DSpark drafter
# (models/): a held-out code prompt continued plainly and speculatively, the
# text printed once, then plain vs speculative tokens/s, the speed-up, tau and
# acceptance by position. Extra arguments go to `dspark demo`
# (e.g. -p "your prompt" -n 64, --device cpu, --plot acceptance.png).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -x build/dspark ] || echo "demo: building dspark (the first build takes a few minutes)" >&2
scripts/build.sh dspark >/dev/null
exec build/dspark demo "$@"
