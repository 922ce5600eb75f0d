#!/usr/bin/env python3
"""Converts the F32 tensors of a safetensors file to BF16 (round to nearest
even), keeping every other tensor and the metadata; written atomically.
  python3 tools/to_bf16.py IN.safetensors OUT.safetensors
Used to ship models/dspark-drafter from the f32 checkpoint `dspark train`
writes (models/README.md)."""
import json
import struct
import sys

from safetensors_file import write_safetensors


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, destination = sys.argv[1], sys.argv[2]
    with open(source, "rb") as file:
        header_length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(header_length))
        data = file.read()
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw, dtype = data[begin:end], entry["dtype"]
        if dtype == "F32":
            import numpy as np  # (only here: a BF16-only file needs no numpy)

            bits = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
            raw, dtype = rounded.astype("<u2").tobytes(), "BF16"
        tensors.append((name, dtype, entry["shape"], raw))
    write_safetensors(destination, tensors, header.get("__metadata__"))


if __name__ == "__main__":
    main()
