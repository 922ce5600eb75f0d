#!/usr/bin/env bash
# On the GPU machine: decompresses the .xz files tests/tools/device_bundle.sh
# left in .device/ (compressed so that the tree the device tool carries stays
# under its 64 MiB), in place. Uses Python's lzma: no xz binary needed there.
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
