#!/usr/bin/env python3
"""Prompts for drafter training data, drawn from the corpus's TRAIN split only.

`dspark regen` has the target answer these; the held-out prompts
(data/prompts/heldout_*.jsonl) come from held-out files and are never used
here. Each prompt is a stretch of a training document that ends at a line
break: the start of the file for a third of them, a random line elsewhere for
the rest (so the drafter also sees mid-file contexts).

  python3 tools/train_prompts.py [--corpus data/corpus] [--count 4000] [--seed 1]
                                 [--out data/corpus/train_prompts.jsonl]
"""
import argparse
import json
import os
import random
import subprocess

SEPARATOR = "<|endoftext|>"


def read_documents(path):
    text = subprocess.run(["zstd", "-dc", path], check=True, capture_output=True).stdout.decode("utf-8")
    return [document for document in text.split(SEPARATOR) if len(document.strip()) > 200]


def make_prompt(document, rng, minimum=80, maximum=600):
    lines = document.splitlines(keepends=True)
    start = 0 if rng.random() < 1 / 3 else rng.randrange(len(lines))
    prompt = ""
    for line in lines[start:]:
        if len(prompt) + len(line) > maximum and len(prompt) >= minimum:
            break
        prompt += line
    prompt = prompt[:maximum * 2]
    return prompt if len(prompt.strip()) >= minimum // 2 else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="data/corpus/train_prompts.jsonl")
    args = parser.parse_args()
    documents = read_documents(os.path.join(args.corpus, "train.txt.zst"))
    rng = random.Random(args.seed)
    prompts = []
    while len(prompts) < args.count:
        prompt = make_prompt(rng.choice(documents), rng)
        if prompt:
            prompts.append(prompt)
    temporary = args.out + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        for prompt in prompts:
            out.write(json.dumps({"prompt": prompt}) + "\n")
    os.replace(temporary, args.out)
    print(f"{len(prompts)} prompts from {len(documents)} training documents -> {args.out}")


if __name__ == "__main__":
    main()
