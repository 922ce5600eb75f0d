#!/usr/bin/env python3
"""A random-weight bf16 Qwen3 checkpoint with a real shape, written with the
standard library alone (no torch, no numpy): for measuring speed where
PyTorch is not installed, such as the CPU machines.

The tensors, their names, the shards and config.json are bench/decode_vs_hf.py's
(the same SHAPES); only the values differ. They are drawn from bytes, not from
a Gaussian, because drawing billions of Gaussians in pure Python takes hours:
each weight is a bf16 with a random sign, a random mantissa and an exponent of
2^-9 .. 2^-6, so |w| lies in [0.002, 0.031) (standard deviation ~0.014, near
decode_vs_hf.py's N(0, 0.02)); norm weights are 1. A speed measurement reads
the same bytes either way; the text such a model writes is noise in both.

The tokenizer files come from --tokenizer (default: the golden Qwen3 tokenizer,
tests/golden/qwen3), so `dspark bench spec` can read text prompts.

Usage:
  python3 bench/random_checkpoint.py --shape qwen3-4b --out /tmp/qwen3-4b
"""
import argparse
import hashlib
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tools")]
from decode_vs_hf import (SEED, SHAPES, atomic_write_text, hf_config, log, plan_shards,  # noqa: E402
                          spec_bytes, tensor_specs)
from safetensors_file import write_safetensors  # noqa: E402

# The high byte of a weight: the sign and the exponent's upper 7 bits (59 or 60,
# so the exponent with the low byte's top bit is 118..121, i.e. 2^-9 .. 2^-6).
HIGH_BYTE = bytes((r & 0x80) | (59 + (r & 1)) for r in range(256))
ONE_BF16 = bytes((0x80, 0x3F))  # 1.0, little-endian


def random_bf16(name, count):
    """`count` bf16 weights (little-endian bytes) as the module docstring describes,
    drawn from SHAKE-256 of the seed and the tensor's name (fast, and the same
    values whatever the order of writing)."""
    values = bytearray(hashlib.shake_256(f"{SEED}:{name}".encode()).digest(2 * count))
    values[1::2] = values[1::2].translate(HIGH_BYTE)  # the low bytes stay: exponent's low bit, mantissa
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, help="the checkpoint directory")
    parser.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden",
                                                            "qwen3"),
                        help="a directory whose tokenizer.json and tokenizer_config.json are copied in")
    args = parser.parse_args()

    marker = os.path.join(args.out, ".complete")
    if os.path.exists(marker):
        log(f"{args.out} already holds a complete checkpoint")
        return
    os.makedirs(args.out, exist_ok=True)
    specs = tensor_specs(args.shape)
    shards = plan_shards(specs)
    total = sum(spec_bytes(dims) for _, dims, _ in specs)
    weight_map, written, start = {}, 0, time.perf_counter()
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = []
        for name, dims, is_norm in shard:
            count = spec_bytes(dims) // 2
            data = ONE_BF16 * count if is_norm else random_bf16(name, count)
            tensors.append((name, "BF16", dims, data))
            weight_map[name] = file_name
        write_safetensors(os.path.join(args.out, file_name), tensors, {"format": "pt"})
        written += sum(len(data) for _, _, _, data in tensors)
        seconds = time.perf_counter() - start
        log(f"{file_name}: {written / 1e9:.2f} of {total / 1e9:.2f} GB, {written / 1e9 / seconds:.2f} GB/s, "
            f"ETA {seconds * (total - written) / written:.0f} s")
    atomic_write_text(os.path.join(args.out, "model.safetensors.index.json"),
                      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    atomic_write_text(os.path.join(args.out, "config.json"), json.dumps(hf_config(args.shape), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    atomic_write_text(marker, json.dumps({"shape": args.shape, "seed": SEED, "total_size": total,
                                          "values": "random bytes"}) + "\n")
    log(f"{args.shape}: {total / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s, in {args.out}")


if __name__ == "__main__":
    main()
