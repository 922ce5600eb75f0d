#!/usr/bin/env python3
"""HF transformers' check of bench/widen_checkpoint.py: a widened target is the
original's function. Loads the original and each widened checkpoint with
transformers (float32 on the GPU, or the CPU), runs the same prompts through
each, and prints one JSON line per widened model: the largest |logit
difference| from the original over every position, the logits' scale, and
the share of positions whose argmax agrees.

    python3 tests/tools/widened_vs_hf.py --prompts data/prompts/heldout_code.jsonl --count 8 \
        models/dspark-target /tmp/wide/dspark-target-x4 /tmp/wide/dspark-target-x16
"""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def logits_of(directory, prompts, device):
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        out = [model(torch.tensor([ids], device=device)).logits[0].float().cpu() for ids in prompts]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL of {\"prompt\"}")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("original")
    parser.add_argument("widened", nargs="+")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{args.original}/tokenizer.json")
    with open(args.prompts) as file:
        texts = [json.loads(line)["prompt"] for line in file][:args.count]
    prompts = [tokenizer.encode(text)[:256] for text in texts]
    reference = logits_of(args.original, prompts, device)
    for directory in args.widened:
        widened = logits_of(directory, prompts, device)
        difference = max(float((a - b).abs().max()) for a, b in zip(reference, widened))
        scale = max(float(a.abs().max()) for a in reference)
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(reference, widened))
        positions = sum(a.shape[0] for a in reference)
        print(json.dumps({"widened": directory, "prompts": len(prompts), "positions": positions,
                          "max_abs_logit_difference": difference, "max_abs_logit": scale,
                          "argmax_agreement": agree / positions}))


if __name__ == "__main__":
    main()
