#!/usr/bin/env bash
# Fresh machine to generated text: install the packages, build, then run
# `dspark generate` on the embedded default model. Extra arguments go to
# `dspark generate` (e.g. -p "your prompt" -n 64).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh >/dev/null
exec build/dspark generate "$@"
