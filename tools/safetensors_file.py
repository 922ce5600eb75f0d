"""Writes a safetensors file with the standard library alone: an 8-byte
header length, the JSON header (padded with spaces so the data starts 8-byte
aligned), then each tensor's bytes in order; atomically (temp file + rename).
Shared by tools/to_bf16.py and bench/random_checkpoint.py."""
import json
import os


def write_safetensors(path, tensors, metadata=None):
    """tensors: [(name, dtype, shape, data bytes)] in file order; metadata: the
    "__metadata__" dict, or None for none."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for _, _, _, data in tensors:
            file.write(data)
    os.replace(temporary, path)
