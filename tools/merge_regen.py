#!/usr/bin/env python3
"""Joins several `dspark regen` data directories into one that `dspark train` reads.

Regen runs over separate prompt files (on separate GPUs, or in separate device
calls when the prompts do not fit in one carry) each write a complete data
directory. This writes OUT/manifest.json listing every sequence of every part,
in the order given, and links each part's shards into OUT as
shard-NNNNN.safetensors (relative symbolic links: nothing is copied, so the
parts must stay where they are). The parts must come from the same target
with the same taps; each must be complete. The manifest is written last and
atomically: an interrupted merge leaves no manifest, and rerunning it redoes
it.

  python3 tools/merge_regen.py OUT PART [PART ...]
"""
import argparse
import json
import os
import sys

SAME = ["kind", "version", "target_id", "tap_layers", "hidden_size", "vocab_size", "num_layers", "rows_dtype"]


def read_manifest(directory):
    path = os.path.join(directory, "manifest.json")
    try:
        with open(path, encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        sys.exit(f"merge_regen: {path}: {error}")
    if manifest.get("kind") != "dspark-regen":
        sys.exit(f"merge_regen: {path}: not regenerated training data")
    if not manifest.get("complete"):
        sys.exit(f"merge_regen: {path}: incomplete (rerun its `dspark regen` to finish it first)")
    return manifest


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("parts", nargs="+")
    args = parser.parse_args()

    manifests = [read_manifest(part) for part in args.parts]
    first = manifests[0]
    for part, manifest in zip(args.parts, manifests):
        for key in SAME:
            if manifest.get(key) != first.get(key):
                sys.exit(f"merge_regen: {part}: {key} is {manifest.get(key)!r}, "
                         f"{args.parts[0]} has {first.get(key)!r}")

    os.makedirs(args.out, exist_ok=True)
    manifest_path = os.path.join(args.out, "manifest.json")
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # a rerun: no manifest until the shards are in place again
    merged = {key: first[key] for key in SAME if key in first}
    merged.update(generation={"merged": [manifest["generation"] for manifest in manifests]},
                  complete=True, shards=[], sequences=[])
    for part, manifest in zip(args.parts, manifests):
        shard_base = len(merged["shards"])
        for shard in manifest["shards"]:
            name = f"shard-{len(merged['shards']):05d}.safetensors"
            source = os.path.join(part, shard["file"])
            destination = os.path.join(args.out, name)
            if os.path.lexists(destination):
                os.remove(destination)
            os.symlink(os.path.relpath(os.path.abspath(source), os.path.abspath(args.out)), destination)
            merged["shards"].append(dict(shard, file=name))
        for sequence in manifest["sequences"]:
            merged["sequences"].append(dict(sequence, shard=sequence["shard"] + shard_base))

    temporary = manifest_path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(merged, file)
    os.replace(temporary, manifest_path)
    tokens = sum(shard["tokens"] for shard in merged["shards"])
    print(f"merged {len(args.parts)} parts: {len(merged['sequences'])} sequences, {len(merged['shards'])} shards, "
          f"{tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
