#!/usr/bin/env bash
# On the GPU machine: decompresses the .xz files tests/tools/device_bundle.sh
# left in .device/ (compressed so that the tree the device tool carries stays
# under its 64 MiB), in place, and puts the target's weights back where they
# travelled there. Uses Python's lzma: no xz binary needed there.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 - <<'PY'
import lzma, os, pathlib, shutil
for packed in sorted(pathlib.Path(".device").glob("*/*.xz")):
    target = packed.with_suffix("")
    with lzma.open(packed) as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out)
    os.chmod(target, 0o755)
    packed.unlink()
PY
# The shipped target's weights, where device_bundle.sh --with-target packed
# them (the tree came without them).
if [ -f .device/model/model.safetensors ] && [ ! -f models/dspark-target/model.safetensors ]; then
  mv .device/model/model.safetensors models/dspark-target/model.safetensors
  chmod 644 models/dspark-target/model.safetensors
fi
