#!/usr/bin/env python3
"""Golden files for the DSpark training loss and its gradients, for the C++ tests.

An INDEPENDENT PyTorch implementation of the drafter forward (teacher forced)
and the training loss, written from shared/DESIGN.md §2 and §4; it shares no
code with, and was not derived from, the C++ engine. All math is float64 on the
CPU from the float32 values that are stored; gradients come from autograd.

The loss (DESIGN §4, Eq 8-12), per trained position (a, k), w_k = exp(-k/γ_decay):
  p_d = softmax(L_k), L_k the drafter's logits with x*_{k-1} fed to the head
        (the anchor at k = 0);  p_t = softmax(target_hidden[a, k] @ lm_head^T);
  CE = -log p_d(x*_k);  L1 = ||p_d - p_t||_1;  c* = 1 - L1/2 (detached);
  BCE = -(c* log c + (1 - c*) log(1 - c)), c clamped to [1e-6, 1 - 1e-6];
  each term a (w_k · mask)-weighted mean; L = ce·CE + l1·L1 + bce·BCE.
  τ̂ = mean over anchors with any trained position of 1 + Σ_j Π_{i<=j} (1 - L1_i/2).

Usage (repository root; needs only torch; no GPU):

  python3 tests/tools/make_train_golden.py [--out tests/golden/train]

Writes under --out (safetensors written by hand: u64 header length, JSON, data):
  inputs.safetensors   embedding [V, H], lm_head [V, H] (the frozen target head),
                       context_rows [C, m*H], target_hidden [A, γ, H]
  <head>.safetensors   head in markov|rnn|gru: param.<name> (the drafter's
                       weights) and grad.<name> (dL/d<name>) for every parameter
  reference.json       config, dims, loss weights, the batch's integers
                       (context_offsets, anchors, targets, mask), and per head
                       the loss terms, τ̂, trained positions and parameter order
"""
import argparse
import json
import math
import os
import pathlib
import struct

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADS = ("markov", "rnn", "gru")
CONFIG = {"gamma": 5, "dDraft": 16, "nLayers": 2, "nHeads": 2, "markovRank": 6, "ffMult": 2,
          "tapLayers": [1, 2, 3]}
DIMS = {"hiddenSize": 12, "vocabSize": 48, "eps": 1e-6}
WEIGHTS = {"ce": 0.1, "l1": 0.9, "bce": 1.0, "gammaDecay": 3.0}
CONTEXT_LENGTHS = (0, 1, 4, 7, 3)
MASKED_SUFFIX = (0, 2, 0, 5, 1)   # masked last positions per anchor; anchor 3 trains nothing
SEED = 4242
F64 = torch.float64


# ------------------------------------------------------------ parameters (§2)

def parameter_shapes(head):
    """[(name, shape)] in checkpoint order."""
    d, r, f, g = CONFIG["dDraft"], CONFIG["markovRank"], CONFIG["ffMult"], CONFIG["gamma"]
    H, V, m = DIMS["hiddenSize"], DIMS["vocabSize"], len(CONFIG["tapLayers"])
    shapes = []
    for i in range(CONFIG["nLayers"]):
        shapes.append((f"bb.{i}.attn_norm", [d]))
        shapes += [(f"bb.{i}.{w}", [d, d]) for w in "qkvo"]
        shapes += [(f"bb.{i}.ff_norm", [d]), (f"bb.{i}.gate", [d, f * d]),
                   (f"bb.{i}.up", [d, f * d]), (f"bb.{i}.down", [f * d, d])]
    shapes += [("W_c", [m * H, d]), ("ctx_norm", [d]), ("tok_proj", [H, d]),
               ("mask_emb", [g - 1, d]), ("block_pos", [g, d]), ("out_norm", [d]),
               ("out_proj", [d, H]), ("markov.w1", [V, r]), ("markov.w2", [r, V]),
               ("conf.w", [d + r, 1]), ("conf.b", [1])]
    if head == "rnn":
        shapes += [("rnn.wH", [r, r]), ("rnn.bH", [r]), ("rnn.wO", [r, V])]
    elif head == "gru":
        shapes += [("gru.wJ", [2 * r + d, 3 * r]), ("gru.bJ", [3 * r])]
    return shapes


def random_parameters(head, gen):
    """Non-trivial float32 weights: norms near 1, matrices N(0, 1/fan_in)."""
    params = {}
    for name, shape in parameter_shapes(head):
        noise = torch.randn(shape, generator=gen, dtype=F64)
        if name.split(".")[-1].endswith("norm"):
            value = 1.0 + 0.2 * noise
        elif name in ("conf.b", "rnn.bH", "gru.bJ"):
            value = 0.3 * noise
        elif name == "markov.w1":          # a lookup table: unit scale
            value = noise
        elif name in ("markov.w2", "rnn.wO", "conf.w"):
            value = 0.5 * noise
        else:                              # [in, out]
            value = noise / math.sqrt(shape[0])
        params[name] = value.to(torch.float32)
    return params


# --------------------------------------------------------------- forward (§2)

def rms(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + DIMS["eps"]) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(q, k, v):
    """Multi-head, heads split d contiguously, scale hd^-0.5, no mask, no RoPE."""
    heads = CONFIG["nHeads"]
    hd = q.shape[1] // heads
    qh = q.reshape(-1, heads, hd).transpose(0, 1)
    kh = k.reshape(-1, heads, hd).transpose(0, 1)
    vh = v.reshape(-1, heads, hd).transpose(0, 1)
    weights = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(hd), dim=-1)
    return (weights @ vh).transpose(0, 1).reshape(q.shape[0], -1)


def block_hidden(p, embedding, anchor, hctx):
    """h = rms(Hd, out_norm) [γ, d] for one anchor; hctx [Lc, m*H] (Lc may be 0)."""
    hc = rms(hctx @ p["W_c"], p["ctx_norm"])
    first = embedding[anchor] @ p["tok_proj"] + p["block_pos"][0]
    x = torch.cat([first[None], p["mask_emb"] + p["block_pos"][1:]])
    for i in range(CONFIG["nLayers"]):
        w = lambda name: p[f"bb.{i}.{name}"]
        nd, nc = rms(x, w("attn_norm")), rms(hc, w("attn_norm"))
        keys = torch.cat([nc @ w("k"), nd @ w("k")])
        values = torch.cat([nc @ w("v"), nd @ w("v")])
        x = x + attention(nd @ w("q"), keys, values) @ w("o")
        n2 = rms(x, w("ff_norm"))
        x = x + (gelu_tanh(n2 @ w("gate")) * (n2 @ w("up"))) @ w("down")
    return rms(x, p["out_norm"])


def teacher_forced(p, head, embedding, lm_head, anchor, hctx, targets):
    """-> logits [γ, V], confidence [γ]: position k's head sees targets[k-1], the anchor at k = 0."""
    h = block_hidden(p, embedding, anchor, hctx)
    base = (h @ p["out_proj"]) @ lm_head.T
    r = CONFIG["markovRank"]
    state = torch.zeros(r, dtype=F64)
    logits, confidence = [], []
    for k in range(CONFIG["gamma"]):
        e = p["markov.w1"][anchor if k == 0 else targets[k - 1]]
        if head == "markov":
            added = e @ p["markov.w2"]
        elif head == "rnn":
            state = torch.tanh(state @ p["rnn.wH"] + e + p["rnn.bH"])
            added = state @ p["rnn.wO"]
        else:
            z = torch.cat([state, e, h[k]]) @ p["gru.wJ"] + p["gru.bJ"]
            g, c, o = z[:r], z[r:2 * r], z[2 * r:]
            keep = torch.sigmoid(g)
            state = keep * state + (1.0 - keep) * torch.tanh(c)
            added = torch.tanh(o) @ p["markov.w2"]
        logits.append(base[k] + added)
        confidence.append(torch.sigmoid(torch.cat([h[k], e]) @ p["conf.w"] + p["conf.b"])[0])
    return torch.stack(logits), torch.stack(confidence)


# ------------------------------------------------------------------ loss (§4)

def loss_terms(p, head, batch, embedding, lm_head):
    gamma, A = CONFIG["gamma"], len(batch["anchors"])
    sums = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    total_weight, positions, taus = 0.0, 0, []
    for a in range(A):
        lo, hi = batch["context_offsets"][a], batch["context_offsets"][a + 1]
        targets = batch["targets"][a]
        logits, confidence = teacher_forced(p, head, embedding, lm_head, batch["anchors"][a],
                                            batch["context_rows"][lo:hi], targets)
        survival, tau, trained = 1.0, 1.0, False
        for k in range(gamma):
            mask = batch["mask"][a][k]
            if mask == 0:
                continue
            log_p = torch.log_softmax(logits[k], dim=-1)
            p_t = torch.softmax(batch["target_hidden"][a, k] @ lm_head.T, dim=-1)
            ce = -log_p[targets[k]]
            l1 = (log_p.exp() - p_t).abs().sum()
            label = (1.0 - 0.5 * l1).detach()
            c = confidence[k].clamp(1e-6, 1.0 - 1e-6)
            bce = -(label * torch.log(c) + (1.0 - label) * torch.log(1.0 - c))
            weight = math.exp(-k / WEIGHTS["gammaDecay"]) * mask
            sums["ce"] = sums["ce"] + weight * ce
            sums["l1"] = sums["l1"] + weight * l1
            sums["bce"] = sums["bce"] + weight * bce
            total_weight += weight
            positions += 1
            survival *= 1.0 - 0.5 * float(l1)
            tau += survival
            trained = True
        if trained:
            taus.append(tau)
    terms = {name: value / total_weight for name, value in sums.items()}
    loss = WEIGHTS["ce"] * terms["ce"] + WEIGHTS["l1"] * terms["l1"] + WEIGHTS["bce"] * terms["bce"]
    return loss, terms, sum(taus) / len(taus), positions


# ------------------------------------------------------------------- files

def write_safetensors(path, tensors):
    """The safetensors format by hand: u64 LE header length, JSON header (padded to 8), raw F32 data."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(tmp, path)


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def make_batch(gen):
    gamma, H, V = CONFIG["gamma"], DIMS["hiddenSize"], DIMS["vocabSize"]
    width = len(CONFIG["tapLayers"]) * H
    offsets = [0]
    for length in CONTEXT_LENGTHS:
        offsets.append(offsets[-1] + length)
    A = len(CONTEXT_LENGTHS)
    return {
        "context_offsets": offsets,
        "context_rows": torch.randn(offsets[-1], width, generator=gen, dtype=F64).to(torch.float32),
        "anchors": torch.randint(0, V, (A,), generator=gen).tolist(),
        "targets": torch.randint(0, V, (A, gamma), generator=gen).tolist(),
        "target_hidden": (1.5 * torch.randn(A, gamma, H, generator=gen, dtype=F64)).to(torch.float32),
        "mask": [[1.0 if k < gamma - masked else 0.0 for k in range(gamma)] for masked in MASKED_SUFFIX],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "tests/golden/train")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(SEED)
    H, V = DIMS["hiddenSize"], DIMS["vocabSize"]
    embedding = torch.randn(V, H, generator=gen, dtype=F64).to(torch.float32)
    lm_head = (torch.randn(V, H, generator=gen, dtype=F64) / math.sqrt(H) * 1.5).to(torch.float32)
    batch = make_batch(gen)
    write_safetensors(args.out / "inputs.safetensors", {
        "embedding": embedding, "lm_head": lm_head, "context_rows": batch["context_rows"],
        "target_hidden": batch["target_hidden"]})

    batch64 = dict(batch, context_rows=batch["context_rows"].to(F64), target_hidden=batch["target_hidden"].to(F64))
    reference = {"config": CONFIG, "dims": DIMS, "weights": WEIGHTS,
                 "batch": {k: batch[k] for k in ("context_offsets", "anchors", "targets", "mask")}, "heads": {}}
    for head in HEADS:
        stored = random_parameters(head, gen)
        params = {name: value.to(F64).requires_grad_(True) for name, value in stored.items()}
        loss, terms, tau, positions = loss_terms(params, head, batch64, embedding.to(F64), lm_head.to(F64))
        loss.backward()
        tensors = {f"param.{name}": value for name, value in stored.items()}
        for name, value in params.items():  # rnn: markov.w2 is unused, its gradient zero
            tensors[f"grad.{name}"] = value.grad if value.grad is not None else torch.zeros_like(value)
        write_safetensors(args.out / f"{head}.safetensors", tensors)
        reference["heads"][head] = {"loss": float(loss), "ce": float(terms["ce"]), "l1": float(terms["l1"]),
                                    "bce": float(terms["bce"]), "tau_estimate": tau, "positions": positions,
                                    "param_names": list(stored)}
        print(f"{head}: loss {float(loss):.6f} ce {float(terms['ce']):.4f} l1 {float(terms['l1']):.4f} "
              f"bce {float(terms['bce']):.4f} tau {tau:.4f} positions {positions}")
    write_json(args.out / "reference.json", reference)


if __name__ == "__main__":
    main()
