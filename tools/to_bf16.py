#!/usr/bin/env python3
"""Converts the F32 tensors of a safetensors file to BF16 (round to nearest
even), keeping every other tensor and the metadata; written atomically.
  python3 tools/to_bf16.py IN.safetensors OUT.safetensors
Used to ship models/dspark-drafter from the f32 checkpoint `dspark train`
writes (models/README.md)."""
import json
import os
import struct
import sys

import numpy as np


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, destination = sys.argv[1], sys.argv[2]
    with open(source, "rb") as file:
        header_length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(header_length))
        data = file.read()
    out_header, chunks, offset = {}, [], 0
    for name, entry in header.items():
        if name == "__metadata__":
            out_header[name] = entry
            continue
        begin, end = entry["data_offsets"]
        raw = data[begin:end]
        if entry["dtype"] == "F32":
            bits = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
            raw = rounded.astype("<u2").tobytes()
            entry = dict(entry, dtype="BF16")
        out_header[name] = dict(entry, data_offsets=[offset, offset + len(raw)])
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(out_header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    temporary = destination + ".tmp"
    with open(temporary, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for chunk in chunks:
            file.write(chunk)
    os.replace(temporary, destination)


if __name__ == "__main__":
    main()
