#!/usr/bin/env python3
"""Golden files for the DSpark drafter (init and forward), for the C++ tests.

This is an INDEPENDENT PyTorch implementation of the drafter written from
shared/DESIGN.md §2 (the math of reference/module-dflash.ts); it shares no code
with, and was not derived from, the C++ engine. All forward math is float64
on the CPU, from the float32 values that are stored; every stored tensor is
float32.

Usage (repository root; needs torch, safetensors; no GPU):

  python3 tests/tools/make_drafter_golden.py [--target tests/golden/qwen3]
                                             [--out tests/golden/drafter]

Writes under --out:

  init/<head>.safetensors   head in markov|rnn|gru: every parameter of the
                            xorshift32 init (INIT_CONFIG, seed INIT_SEED)
  init/config.json          that config, the dims, the seed, param order per head
  forward/<head>/           a drafter checkpoint (dspark.json + model.safetensors)
                            with non-trivial torch-seeded weights (FWD_CONFIG)
      reference.safetensors per case i: hctx.i [Lc, m*H], base_logits.i [γ, V],
                            logits.i [γ, V] and conf.i [γ] (teacher-forced),
                            hidden.i [γ, d] (h = rms(Hd, out_norm)),
                            greedy_logits.i [γ, V] (along the greedy chain)
      reference.json        per case: context_length, anchor, teacher_tokens,
                            greedy_tokens, greedy_conf, min_top2_gap; and the
                            smallest top-2 gap over all cases
"""
import argparse
import json
import math
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADS = ("markov", "rnn", "gru")
INIT_CONFIG = {"gamma": 4, "dDraft": 32, "nLayers": 2, "nHeads": 4, "markovRank": 8,
               "ffMult": 2, "tapLayers": [1, 2, 4]}
INIT_SEED = 7
FWD_CONFIG = {"gamma": 5, "dDraft": 48, "nLayers": 2, "nHeads": 4, "markovRank": 16,
              "ffMult": 2, "tapLayers": [1, 3, 4]}
FWD_INIT_SEED = 11
WEIGHT_SEED = 1234          # + head index
CASE_SEED = 2026            # same cases for every head
CONTEXT_LENGTHS = (1, 3, 7, 12)
TOKEN_LIMIT = 1000
TARGET_ID = "golden-qwen3"
F64 = torch.float64


# ---------------------------------------------------------------- init (§2)

class XorShift32:
    """xorshift32 with logical shifts on uint32; next() -> [0, 1)."""

    def __init__(self, seed):
        self.s = (seed & 0xFFFFFFFF) or 0x9E3779B9

    def next(self):
        s = self.s
        s ^= (s << 13) & 0xFFFFFFFF
        s ^= s >> 17
        s ^= (s << 5) & 0xFFFFFFFF
        self.s = s
        return s / 2.0 ** 32


def normal(rng, shape, std):
    """Box-Muller in pairs, row-major fill, float64 math, float32 storage."""
    n = math.prod(shape)
    out = [0.0] * n
    for i in range(0, n, 2):
        u1 = max(rng.next(), 1e-12)
        u2 = rng.next()
        rad = math.sqrt(-2.0 * math.log(u1))
        out[i] = rad * math.cos(2.0 * math.pi * u2) * std
        if i + 1 < n:
            out[i + 1] = rad * math.sin(2.0 * math.pi * u2) * std
    return torch.tensor(out, dtype=F64).reshape(shape).to(torch.float32)


def param_specs(cfg, dims, head):
    """[(name, shape, init)] in checkpoint order; init in normal|one|zero."""
    d, r, f, g = cfg["dDraft"], cfg["markovRank"], cfg["ffMult"], cfg["gamma"]
    H, V, m = dims["hiddenSize"], dims["vocabSize"], len(cfg["tapLayers"])
    specs = []
    for i in range(cfg["nLayers"]):
        specs.append((f"bb.{i}.attn_norm", [d], "one"))
        specs += [(f"bb.{i}.{w}", [d, d], "normal") for w in "qkvo"]
        specs += [(f"bb.{i}.ff_norm", [d], "one"), (f"bb.{i}.gate", [d, f * d], "normal"),
                  (f"bb.{i}.up", [d, f * d], "normal"), (f"bb.{i}.down", [f * d, d], "normal")]
    specs += [("W_c", [m * H, d], "normal"), ("ctx_norm", [d], "one"),
              ("tok_proj", [H, d], "normal"), ("mask_emb", [g - 1, d], "normal"),
              ("block_pos", [g, d], "normal"), ("out_norm", [d], "one"),
              ("out_proj", [d, H], "normal"), ("markov.w1", [V, r], "normal"),
              ("markov.w2", [r, V], "zero"), ("conf.w", [d + r, 1], "zero"),
              ("conf.b", [1], "zero")]
    if head == "rnn":
        specs += [("rnn.wH", [r, r], "normal"), ("rnn.bH", [r], "zero"), ("rnn.wO", [r, V], "zero")]
    elif head == "gru":
        specs += [("gru.wJ", [2 * r + d, 3 * r], "normal"), ("gru.bJ", [3 * r], "zero")]
    return specs


def xorshift_init(cfg, dims, head, seed):
    rng = XorShift32(seed)
    params = {}
    for name, shape, init in param_specs(cfg, dims, head):
        if init == "normal":
            params[name] = normal(rng, shape, 0.02)
        else:
            params[name] = torch.full(shape, 1.0 if init == "one" else 0.0, dtype=torch.float32)
    return params


def randomize(params, seed):
    """Non-trivial weights, drawn in parameter order from one torch generator."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, old in params.items():
        noise = torch.randn(old.shape, generator=gen, dtype=F64)
        leaf = name.split(".")[-1]
        if leaf.endswith("norm"):
            value = 1.0 + 0.2 * noise
        elif name in ("conf.b", "rnn.bH", "gru.bJ"):
            value = 0.3 * noise
        elif name in ("markov.w2", "rnn.wO", "conf.w"):
            value = 0.5 * noise
        elif name == "markov.w1":   # a lookup table, not a matmul input: unit scale
            value = noise
        else:                       # [in, out] matrix: N(0, 1/sqrt(fan_in))
            value = noise / math.sqrt(old.shape[0])
        out[name] = value.to(torch.float32)
    return out


# ------------------------------------------------------------- forward (§2)

def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(q, k, v, heads):
    """q [γ, d], k/v [Lc+γ, d]; no RoPE, no mask; heads split d contiguously."""
    hd = q.shape[1] // heads
    qh = q.reshape(q.shape[0], heads, hd).transpose(0, 1)     # [nh, γ, hd]
    kh = k.reshape(k.shape[0], heads, hd).transpose(0, 1)     # [nh, L, hd]
    vh = v.reshape(v.shape[0], heads, hd).transpose(0, 1)
    weights = torch.softmax(qh @ kh.transpose(1, 2) * hd ** -0.5, dim=-1)
    return (weights @ vh).transpose(0, 1).reshape(q.shape[0], -1)


def layer(p, i, hd, hc, heads, eps):
    """One KV-injection layer: block rows attend to context ++ block."""
    nd = rms(hd, p[f"bb.{i}.attn_norm"], eps)
    nc = rms(hc, p[f"bb.{i}.attn_norm"], eps)
    q = nd @ p[f"bb.{i}.q"]
    k = torch.cat([nc @ p[f"bb.{i}.k"], nd @ p[f"bb.{i}.k"]])
    v = torch.cat([nc @ p[f"bb.{i}.v"], nd @ p[f"bb.{i}.v"]])
    hd = hd + attention(q, k, v, heads) @ p[f"bb.{i}.o"]
    n2 = rms(hd, p[f"bb.{i}.ff_norm"], eps)
    return hd + (gelu_tanh(n2 @ p[f"bb.{i}.gate"]) * (n2 @ p[f"bb.{i}.up"])) @ p[f"bb.{i}.down"]


def backbone(p, cfg, target, anchor, hctx):
    """-> h = rms(Hd, out_norm) [γ, d]."""
    eps = target["eps"]
    hc = rms(hctx @ p["W_c"], p["ctx_norm"], eps)
    first = target["embed"][anchor] @ p["tok_proj"] + p["block_pos"][0]
    hd = torch.cat([first[None], p["mask_emb"] + p["block_pos"][1:]])
    for i in range(cfg["nLayers"]):
        hd = layer(p, i, hd, hc, cfg["nHeads"], eps)
    return rms(hd, p["out_norm"], eps)


def base_logits(p, h, target):
    """U = (h @ out_proj) @ LM^T (+ the target's soft-cap, if any)."""
    u = (h @ p["out_proj"]) @ target["lm_head"].T
    cap = target["softcap"]
    return cap * torch.tanh(u / cap) if cap else u


class SeqHead:
    """Sequential head; step(prev_token, h_k) -> (B_k, e_k)."""

    def __init__(self, p, kind):
        self.p, self.kind = p, kind
        self.s = torch.zeros(p["markov.w1"].shape[1], dtype=F64)   # s_{-1} = 0

    def step(self, prev, h_k):
        p, e = self.p, self.p["markov.w1"][prev]
        if self.kind == "markov":
            return e @ p["markov.w2"], e
        if self.kind == "rnn":
            self.s = torch.tanh(self.s @ p["rnn.wH"] + e + p["rnn.bH"])
            return self.s @ p["rnn.wO"], e
        z = torch.cat([self.s, e, h_k]) @ p["gru.wJ"] + p["gru.bJ"]
        g, c, o = z.chunk(3)
        gate = torch.sigmoid(g)
        self.s = gate * self.s + (1.0 - gate) * torch.tanh(c)
        return torch.tanh(o) @ p["markov.w2"], e


def confidence(p, h_k, e_k):
    return torch.sigmoid(torch.cat([h_k, e_k]) @ p["conf.w"] + p["conf.b"])[0]


def draft(p, head, h, u, anchor, teacher=None):
    """Run the head over k = 0..γ-1. teacher=None: greedy (x_k = argmax L_k).
    -> (logits [γ, V], conf [γ], tokens)."""
    seq, prev = SeqHead(p, head), anchor
    logits, confs, tokens = [], [], []
    for k in range(h.shape[0]):
        b, e = seq.step(prev, h[k])
        lk = u[k] + b
        tok = int(torch.argmax(lk)) if teacher is None else teacher[k]
        logits.append(lk)
        confs.append(confidence(p, h[k], e))
        tokens.append(tok)
        prev = tok
    return torch.stack(logits), torch.stack(confs), tokens


def top2_gap(logits):
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


# ------------------------------------------------------------------- files

def load_target(path):
    cfg = json.loads((path / "config.json").read_text())
    want = {"model.embed_tokens.weight": "embed"}
    if not cfg.get("tie_word_embeddings", False):
        want["lm_head.weight"] = "lm_head"
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in want:
                    found[want[key]] = f.get_tensor(key).to(F64)
    found.setdefault("lm_head", found["embed"])
    return {"embed": found["embed"], "lm_head": found["lm_head"], "eps": cfg["rms_norm_eps"],
            "softcap": cfg.get("final_logit_softcapping") or None,
            "dims": {"hiddenSize": cfg["hidden_size"], "vocabSize": cfg["vocab_size"],
                     "eps": cfg["rms_norm_eps"]}}


def write_tensors(path, tensors):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def make_init(out, dims):
    heads = {}
    for head in HEADS:
        params = xorshift_init(INIT_CONFIG, dims, head, INIT_SEED)
        write_tensors(out / "init" / f"{head}.safetensors", params)
        heads[head] = list(params)
    write_json(out / "init" / "config.json",
               {"seed": INIT_SEED, "config": INIT_CONFIG, "dims": dims, "param_names": heads})
    print(f"init: {', '.join(HEADS)} (seed {INIT_SEED}, {len(heads['markov'])} markov params)")


def make_cases(cfg, dims):
    gen = torch.Generator().manual_seed(CASE_SEED)
    width = len(cfg["tapLayers"]) * dims["hiddenSize"]
    cases = []
    for lc in CONTEXT_LENGTHS:
        hctx = torch.randn(lc, width, generator=gen, dtype=F64).to(torch.float32)
        ids = torch.randint(0, TOKEN_LIMIT, (1 + cfg["gamma"],), generator=gen).tolist()
        cases.append({"hctx": hctx, "anchor": ids[0], "teacher": ids[1:]})
    return cases


def make_forward(out, target, index, head, cases):
    cfg = dict(FWD_CONFIG, seqHead=head)
    params = randomize(xorshift_init(cfg, target["dims"], head, FWD_INIT_SEED), WEIGHT_SEED + index)
    directory = out / "forward" / head
    write_tensors(directory / "model.safetensors", params)
    write_json(directory / "dspark.json", {
        "kind": "dspark-drafter", "variant": "dspark", "version": 1, "target_id": TARGET_ID,
        "config": cfg, "dims": target["dims"], "param_names": list(params)})

    p = {k: v.to(F64) for k, v in params.items()}       # compute from stored f32
    tensors, meta, changed = {}, [], 0
    for i, case in enumerate(cases):
        h = backbone(p, cfg, target, case["anchor"], case["hctx"].to(F64))
        u = base_logits(p, h, target)
        logits, conf, _ = draft(p, head, h, u, case["anchor"], case["teacher"])
        glogits, gconf, greedy = draft(p, head, h, u, case["anchor"])
        gap = top2_gap(glogits)
        changed += sum(int(torch.argmax(u[k])) != t for k, t in enumerate(greedy))
        tensors.update({f"hctx.{i}": case["hctx"], f"base_logits.{i}": u, f"logits.{i}": logits,
                        f"conf.{i}": conf, f"hidden.{i}": h, f"greedy_logits.{i}": glogits})
        meta.append({"context_length": case["hctx"].shape[0], "anchor": case["anchor"],
                     "teacher_tokens": case["teacher"], "greedy_tokens": greedy,
                     "greedy_conf": gconf.tolist(), "min_top2_gap": gap})
    write_tensors(directory / "reference.safetensors", tensors)
    min_gap = min(c["min_top2_gap"] for c in meta)
    write_json(directory / "reference.json", {"head": head, "min_top2_gap": min_gap, "cases": meta})
    confs = torch.cat([tensors[f"conf.{i}"] for i in range(len(cases))])
    print(f"forward/{head}: greedy {[c['greedy_tokens'] for c in meta]}  min top-2 gap {min_gap:.4f}  "
          f"head changed {changed}/{len(cases) * cfg['gamma']} argmaxes  "
          f"conf [{float(confs.min()):.3f}, {float(confs.max()):.3f}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=pathlib.Path, default=REPO / "tests/golden/qwen3")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "tests/golden/drafter")
    args = parser.parse_args()
    target = load_target(args.target)
    print(f"target {args.target}: dims {target['dims']}")
    make_init(args.out, target["dims"])
    cases = make_cases(FWD_CONFIG, target["dims"])
    for index, head in enumerate(HEADS):
        make_forward(args.out, target, index, head, cases)


if __name__ == "__main__":
    main()
