#!/usr/bin/env python3
"""A Qwen3 target and its DSpark drafter widened with zeros: the same function
at a larger model's cost. The width (hidden size, heads, MLP) grows by
FACTOR^2, so each layer's weights grow by FACTOR^4.

Why: the shipped target (19M parameters) is latency-bound on a GPU: a decode
step reads its 38 MB in ~13 us of a ~140 us step, so every kernel of a drafted
round costs more with more rows while a plain step does not, which caps what
batch 4 can keep of batch 1's speed-up (docs/PERF.md, stop 42). Real targets
are bandwidth-bound. Training one is beyond our device time, so this widens
ours: hidden d -> FACTOR^2 d (heads and KV heads x FACTOR^2, head_dim kept, so
each real query head still reads its own KV head), MLP width x FACTOR^2, every
new weight zero. The new residual dimensions stay exactly zero through every
layer (nothing writes them: their rows of o_proj, down_proj and the
embedding are zero), new heads attend with zero queries to zero values, so
every real dimension computes what it did. Only the RMSNorms see more
dimensions: the mean square over FACTOR^2 d dims of which d are nonzero is
the old one / FACTOR^2, so their weights are divided by FACTOR (exact in bf16
and f32: a power of two) and eps by FACTOR^2 (kept, it would weigh FACTOR^2
times more, and where a small model's residual stream has a mean square of
~1e-3 that moved HF's logits by up to 0.07 at FACTOR 4). The per-head q / k
norms keep head_dim, so their eps is FACTOR^2 smaller, against mean squares
of ~1.
The GPU reads every zero like any weight, so the widened model costs what a
model of its shape costs, and the drafter accepts what it accepted on the
original. Greedy outputs can still differ from the original's where two
logits tie within a rounding (longer sums round differently); a widened
model is compared with itself (speculative against plain decoding).

The drafter (dspark.json + model.safetensors) reads the target's hidden
states (W_c: one row block per tapped layer), its embedding (tok_proj) and
its LM head (out_proj): those blocks are widened with zero rows / columns;
dims.hiddenSize and target_id follow the target (dims.eps, which the
drafter's own norms use, stays).

Standard library only (no numpy, no torch); streams the output. Usage:

  python3 bench/widen_checkpoint.py --factor 4 --target models/dspark-target \
      --drafter models/dspark-drafter --out /tmp/wide
  # -> /tmp/wide/dspark-target-x16 and /tmp/wide/dspark-drafter-x16
"""
import argparse
import json
import os
import shutil
import struct
import sys
import time

SIZES = {"BF16": 2, "F16": 2, "F32": 4}


def read_header(path):
    if not os.path.isfile(path):
        sys.exit(f"{path}: not found (a checkpoint in one model.safetensors is needed)")
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    return header, 8 + length


def read_tensor(path, header, start, name):
    entry = header[name]
    begin, end = entry["data_offsets"]
    with open(path, "rb") as file:
        file.seek(start + begin)
        return entry["dtype"], entry["shape"], file.read(end - begin)


def scaled(dtype, data, factor):
    """data / factor, element by element (factor a power of two: exact)."""
    if dtype == "F32":
        values = struct.unpack(f"<{len(data) // 4}f", data)
        return struct.pack(f"<{len(values)}f", *(v / factor for v in values))
    if dtype == "BF16":
        count = len(data) // 2
        high = struct.unpack(f"<{count}H", data)
        values = struct.unpack(f"<{count}f", struct.pack(f"<{count}I", *(h << 16 for h in high)))
        out = struct.unpack(f"<{count}I", struct.pack(f"<{count}f", *(v / factor for v in values)))
        assert all(o & 0xFFFF == 0 for o in out), "a norm weight that dividing does not keep exact"
        return struct.pack(f"<{count}H", *(o >> 16 for o in out))
    sys.exit(f"norm weights of dtype {dtype} are not supported")


class Widened:
    """A tensor of shape `shape` (1-D: one row) whose row row_of(i) is the
    source's row i padded with zero columns at the end; every other row zero."""

    def __init__(self, dtype, shape, source_rows, row_of=lambda i: i):
        self.dtype, self.shape, self.source_rows, self.row_of = dtype, shape, source_rows, row_of

    def nbytes(self):
        count = 1
        for dim in self.shape:
            count *= dim
        return count * SIZES[self.dtype]

    def write(self, file):
        element = SIZES[self.dtype]
        row_bytes = (self.shape[1] if len(self.shape) == 2 else self.shape[0]) * element
        rows = self.shape[0] if len(self.shape) == 2 else 1
        placed = {self.row_of(i): row for i, row in enumerate(self.source_rows)}
        run = 0  # zero rows not written yet (written in one piece)
        for r in range(rows):
            if r not in placed:
                run += 1
                continue
            if run:
                write_zeros(file, run * row_bytes)
                run = 0
            file.write(placed[r] + bytes(row_bytes - len(placed[r])))
        if run:
            write_zeros(file, run * row_bytes)


def write_zeros(file, count, chunk=1 << 26):
    block = bytes(min(count, chunk))
    while count > 0:
        file.write(block[:min(count, chunk)])
        count -= min(count, chunk)


def split_rows(dtype, shape, data):
    if len(shape) > 2 or dtype not in SIZES:
        sys.exit(f"a {dtype} tensor of shape {shape}: only 1-D and 2-D BF16 / F16 / F32 tensors are widened")
    element = SIZES[dtype]
    width = (shape[1] if len(shape) == 2 else shape[0]) * element
    return [data[i:i + width] for i in range(0, len(data), width)]


def write_checkpoint(path, tensors, metadata):
    """tensors: [(name, Widened)]; streamed, atomically (temp file + rename)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, tensor in tensors:
        header[name] = {"dtype": tensor.dtype, "shape": tensor.shape, "data_offsets": [offset, offset + tensor.nbytes()]}
        offset += tensor.nbytes()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    temporary, start, written = f"{path}.tmp.{os.getpid()}", time.perf_counter(), 0
    with open(temporary, "wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for index, (_, tensor) in enumerate(tensors):
            tensor.write(file)
            written += tensor.nbytes()
            if index % 16 == 15 or index == len(tensors) - 1:
                seconds = time.perf_counter() - start
                print(f"  {os.path.basename(os.path.dirname(path))}: {written / 1e9:.2f} of {offset / 1e9:.2f} GB, "
                      f"{written / 1e9 / max(seconds, 1e-9):.2f} GB/s, ETA {seconds * (offset - written) / written:.0f} s",
                      file=sys.stderr)
    os.replace(temporary, path)


def required(directory, name):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        sys.exit(f"{directory}: no {name}")
    return path


def atomic_write_text(path, text):
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def widen_target(source, out, factor):
    config = json.load(open(required(source, "config.json")))
    if config.get("model_type") != "qwen3":
        sys.exit(f"{source}: model_type {config.get('model_type')!r}; only qwen3 targets are widened")
    if not config.get("tie_word_embeddings", False):
        sys.exit(f"{source}: an untied LM head is not supported")
    grow = factor * factor
    d, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", d // heads)
    wide = dict(config, hidden_size=d * grow, intermediate_size=inner * grow, num_attention_heads=heads * grow,
                num_key_value_heads=kv_heads * grow, head_dim=head_dim, rms_norm_eps=config["rms_norm_eps"] / grow)
    path = os.path.join(source, "model.safetensors")
    header, start = read_header(path)

    # Each returns (name, the widened tensor).
    def matrix(name, rows, columns):
        dtype, shape, data = read_tensor(path, header, start, name)
        return name, Widened(dtype, [rows, columns], split_rows(dtype, shape, data))

    def norm(name, size):
        dtype, shape, data = read_tensor(path, header, start, name)
        return name, Widened(dtype, [size], [scaled(dtype, data, factor)])

    def kept(name):  # the per-head q / k norms: head_dim is kept
        dtype, shape, data = read_tensor(path, header, start, name)
        return name, Widened(dtype, list(shape), [data])

    wide_d, q_rows, kv_rows = d * grow, heads * grow * head_dim, kv_heads * grow * head_dim
    tensors = [matrix("model.embed_tokens.weight", config["vocab_size"], wide_d)]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors += [
            norm(prefix + "input_layernorm.weight", wide_d),
            matrix(prefix + "self_attn.q_proj.weight", q_rows, wide_d),
            matrix(prefix + "self_attn.k_proj.weight", kv_rows, wide_d),
            matrix(prefix + "self_attn.v_proj.weight", kv_rows, wide_d),
            kept(prefix + "self_attn.q_norm.weight"),
            kept(prefix + "self_attn.k_norm.weight"),
            matrix(prefix + "self_attn.o_proj.weight", wide_d, q_rows),
            norm(prefix + "post_attention_layernorm.weight", wide_d),
            matrix(prefix + "mlp.gate_proj.weight", inner * grow, wide_d),
            matrix(prefix + "mlp.up_proj.weight", inner * grow, wide_d),
            matrix(prefix + "mlp.down_proj.weight", wide_d, inner * grow),
        ]
    tensors.append(norm("model.norm.weight", wide_d))
    unknown = set(header) - {"__metadata__"} - {name for name, _ in tensors}
    if unknown:
        sys.exit(f"{path}: tensors this tool does not widen: {sorted(unknown)[:5]}")
    os.makedirs(out, exist_ok=True)
    write_checkpoint(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    atomic_write_text(os.path.join(out, "config.json"), json.dumps(wide, indent=2) + "\n")
    return d


def widen_drafter(source, out, target_out, factor, d):
    """The drafter's target-facing blocks (its [in, out] layout): W_c [taps * d, dd]
    (one row block of d per tapped layer), tok_proj [d, dd], out_proj [dd, d]."""
    grow = factor * factor
    meta = json.load(open(required(source, "dspark.json")))
    if meta["dims"]["hiddenSize"] != d:
        sys.exit(f"{source}: made for hidden size {meta['dims']['hiddenSize']}, the target has {d}")
    path = os.path.join(source, "model.safetensors")
    header, start = read_header(path)
    taps = len(meta["config"]["tapLayers"])
    expected = {"W_c": (0, taps * d), "tok_proj": (0, d), "out_proj": (1, d)}  # the dimension that is the target's
    tensors = []
    for name in sorted(header):
        if name == "__metadata__":
            continue
        dtype, shape, data = read_tensor(path, header, start, name)
        rows = split_rows(dtype, shape, data)
        if name in expected and shape[expected[name][0]] != expected[name][1]:
            sys.exit(f"{path}: {name} has shape {shape}; a drafter for hidden size {d} with {taps} taps has "
                     f"{expected[name][1]} in dimension {expected[name][0]}")
        if name == "W_c":
            tensors.append((name, Widened(dtype, [taps * d * grow, shape[1]], rows,
                                          lambda i: (i // d) * d * grow + i % d)))
        elif name == "tok_proj":
            tensors.append((name, Widened(dtype, [d * grow, shape[1]], rows)))
        elif name == "out_proj":
            tensors.append((name, Widened(dtype, [shape[0], d * grow], rows)))
        else:
            tensors.append((name, Widened(dtype, list(shape), rows)))
    os.makedirs(out, exist_ok=True)
    write_checkpoint(os.path.join(out, "model.safetensors"), tensors, header.get("__metadata__", {}))
    meta["dims"]["hiddenSize"] = d * grow
    meta["target_id"] = os.path.basename(os.path.normpath(target_out))
    atomic_write_text(os.path.join(out, "dspark.json"), json.dumps(meta, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=int, required=True, help="the width grows by factor^2 (a power of two)")
    parser.add_argument("--target", required=True, help="a Qwen3 checkpoint directory (one model.safetensors)")
    parser.add_argument("--drafter", help="its DSpark drafter's directory (optional)")
    parser.add_argument("--out", required=True, help="the directory the widened models go into")
    args = parser.parse_args()
    if args.factor < 2 or args.factor & (args.factor - 1):
        sys.exit("--factor must be a power of two, 2 or more (the norm weights are divided by it exactly)")
    grow = args.factor * args.factor
    target_out = os.path.join(args.out, f"{os.path.basename(os.path.normpath(args.target))}-x{grow}")
    d = widen_target(args.target, target_out, args.factor)
    print(target_out)
    if args.drafter:
        drafter_out = os.path.join(args.out, f"{os.path.basename(os.path.normpath(args.drafter))}-x{grow}")
        widen_drafter(args.drafter, drafter_out, target_out, args.factor, d)
        print(drafter_out)


if __name__ == "__main__":
    main()
