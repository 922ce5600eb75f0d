#!/usr/bin/env python3
"""Drafter training speed: dspark's CUDA training step against the same step in PyTorch eager.

What it measures, per shape (small: target H 384, V 8192, 4 taps, drafter d 256, 2 layers,
gamma 7, 64 anchors of 256 context rows; 8b: Qwen3-8B's H 4096 and V 151936, 4 taps, drafter
d 1024, 5 layers, gamma 7, 16 anchors of 512 context rows):

  1. dspark: `<dspark> bench train <shape flags> --json` (src/cli/bench_train.cpp): the step
     `dspark train --device cuda` runs, on random data, its one JSON object recorded as it is.
  2. PyTorch eager: the same drafter and loss written here from shared/DESIGN.md §2 and §4
     (the independent implementation of tests/tools/make_train_golden.py, batched over
     anchors and put on the GPU), the same optimizer step: loss.backward(),
     clip_grad_norm_(1.0), torch.optim.AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.01 on
     the matrices, PyTorch's default implementation), zero_grad.

Same precision on both sides: f32 master weights, gradients and activations; the drafter's
f32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32 = True; dspark
GemmMath::TF32); the target's embedding and LM head held in bf16 and multiplied as bf16
operands with f32 accumulation (PyTorch: the activations cast to bf16 for those matmuls, the
logits cast back to f32); the context rows travel in bf16 and are widened to f32 on the GPU.
PyTorch's attention is F.scaled_dot_product_attention (all anchors share one context length,
so no mask is needed).

Timing (both engines alike): "step" is one training step with the batch already on the
device, CUDA events on the stream around it, median of --steps after --warmup; "upload"
moves a batch from pinned host memory (host clock); "step + upload" is both with the loss
read back (host clock). Throughput is trained block positions per second (anchors x gamma:
every position of the random batches trains), the trainer's tokens/s. The issue's target:
dspark >= 1.5x PyTorch eager on the step.

End to end (dspark only; its JSON's serial_ms and pipelined_ms): the mean wall clock per step of
consecutive steps on data in the regen format read through a Dataset, as `dspark train --device
cuda` runs them: "serial" draws the anchors, builds the batch, uploads it and steps (the trainer
with --no-prefetch); "pipelined" packs the next batch from the data into pinned memory and copies
it while the step runs (the trainer's default). Its "x torch" is against PyTorch's step + upload
(PyTorch's batch comes ready from pinned memory: the reference is not charged for building it).
The issue's end-to-end target: >= 1.5x.

Output: a table on stdout; a dated markdown section added to --results (newest first) and
also written to <out>/train_vs_torch.md, with the raw numbers in <out>/train_vs_torch.json
(--out, or $OUT when set).

  python3 bench/train_vs_torch.py --dspark .device/bin/dspark --shapes small,8b \\
      --results bench/RESULTS.md [--steps 20] [--seq-head markov] [--out DIR]

--check-golden runs the PyTorch model on the CPU in float64 on tests/golden/train and
compares its loss terms with the goldens (which the C++ tests also match): the benchmark's
model computes the same loss.
"""
import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "small": dict(hidden=384, vocab=8192, taps=4, d_draft=256, layers=2, heads=4, markov_rank=64, ff_mult=2,
                  gamma=7, batch=64, context=256),
    "8b": dict(hidden=4096, vocab=151936, taps=4, d_draft=1024, layers=5, heads=8, markov_rank=256, ff_mult=2,
               gamma=7, batch=16, context=512),
}
EPS = 1e-6
LOSS = dict(ce=0.1, l1=0.9, bce=1.0, gamma_decay=7.0)
DSPARK_TIMEOUT_S = 400


def log(message=""):
    print(message, flush=True)


# ------------------------------------------------------------------ the drafter (DESIGN §2)

def parameter_shapes(s, head):
    """[(name, shape, init)] in checkpoint order; init in {'normal', 'ones', 'zeros'}."""
    d, r, f, g, H, V, m = s["d_draft"], s["markov_rank"], s["ff_mult"], s["gamma"], s["hidden"], s["vocab"], s["taps"]
    shapes = []
    for i in range(s["layers"]):
        shapes.append((f"bb.{i}.attn_norm", [d], "ones"))
        shapes += [(f"bb.{i}.{w}", [d, d], "normal") for w in "qkvo"]
        shapes += [(f"bb.{i}.ff_norm", [d], "ones"), (f"bb.{i}.gate", [d, f * d], "normal"),
                   (f"bb.{i}.up", [d, f * d], "normal"), (f"bb.{i}.down", [f * d, d], "normal")]
    shapes += [("W_c", [m * H, d], "normal"), ("ctx_norm", [d], "ones"), ("tok_proj", [H, d], "normal"),
               ("mask_emb", [g - 1, d], "normal"), ("block_pos", [g, d], "normal"), ("out_norm", [d], "ones"),
               ("out_proj", [d, H], "normal"), ("markov.w1", [V, r], "normal"), ("markov.w2", [r, V], "zeros"),
               ("conf.w", [d + r, 1], "zeros"), ("conf.b", [1], "zeros")]
    if head == "rnn":
        shapes += [("rnn.wH", [r, r], "normal"), ("rnn.bH", [r], "zeros"), ("rnn.wO", [r, V], "zeros")]
    elif head == "gru":
        shapes += [("gru.wJ", [2 * r + d, 3 * r], "normal"), ("gru.bJ", [3 * r], "zeros")]
    return shapes


def decays(name, shape):
    """dspark's drafter_parameter_decays: matrices that multiply activations."""
    return len(shape) >= 2 and name not in ("markov.w1", "mask_emb", "block_pos")


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def attention(q, k, v, mask):
    """q [A, nh, γ, hd], k/v [A, nh, L, hd]; mask [A, 1, 1, L] (True: attend) or None."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def drafter_loss(P, s, head, embedding, lm_head, batch, head_dtype):
    """The loss of `batch` (DESIGN §4): weighted CE, L1 and BCE; returns (loss, terms dict, tau).

    batch: context [A, Lmax, m·H] (any float dtype), context_lengths [A] (None: all Lmax),
    anchors [A], targets [A, γ], target_hidden [A, γ, H], mask [A, γ].
    head_dtype: the dtype of the LM head matmuls (bf16 in the benchmark; None: the head's own).
    """
    A, G, d, nh = batch["anchors"].shape[0], s["gamma"], s["d_draft"], s["heads"]
    hd, r = d // nh, s["markov_rank"]
    context = batch["context"].to(P["W_c"].dtype)
    Lc = context.shape[1]
    Hc = rms(context @ P["W_c"], P["ctx_norm"])  # [A, Lc, d]
    first = embedding[batch["anchors"]].to(P["W_c"].dtype) @ P["tok_proj"] + P["block_pos"][0]
    x = torch.cat([first[:, None], (P["mask_emb"] + P["block_pos"][1:])[None].expand(A, G - 1, d)], 1)
    mask = None
    if batch.get("context_lengths") is not None:
        columns = torch.arange(Lc + G, device=context.device)
        lengths = batch["context_lengths"]
        mask = ((columns[None] < lengths[:, None]) | (columns[None] >= Lc))[:, None, None, :]
    for i in range(s["layers"]):
        w = lambda name: P[f"bb.{i}.{name}"]
        nd, nc = rms(x, w("attn_norm")), rms(Hc, w("attn_norm"))
        q = (nd @ w("q")).view(A, G, nh, hd).transpose(1, 2)
        k = torch.cat([nc @ w("k"), nd @ w("k")], 1).view(A, Lc + G, nh, hd).transpose(1, 2)
        v = torch.cat([nc @ w("v"), nd @ w("v")], 1).view(A, Lc + G, nh, hd).transpose(1, 2)
        att = attention(q, k, v, mask).transpose(1, 2).reshape(A, G, d)
        x = x + att @ w("o")
        n2 = rms(x, w("ff_norm"))
        x = x + (F.gelu(n2 @ w("gate"), approximate="tanh") * (n2 @ w("up"))) @ w("down")
    h = rms(x, P["out_norm"])  # [A, γ, d]
    head_input = h @ P["out_proj"]
    if head_dtype is not None:
        U = (head_input.to(head_dtype) @ lm_head.T).to(h.dtype)
    else:
        U = head_input @ lm_head.T
    previous = torch.cat([batch["anchors"][:, None], batch["targets"][:, :-1]], 1)
    e = P["markov.w1"][previous]  # [A, γ, r]
    if head == "markov":
        B = e @ P["markov.w2"]
    elif head == "rnn":
        state, states = torch.zeros(A, r, dtype=h.dtype, device=h.device), []
        for k_ in range(G):
            state = torch.tanh(state @ P["rnn.wH"] + e[:, k_] + P["rnn.bH"])
            states.append(state)
        B = torch.stack(states, 1) @ P["rnn.wO"]
    else:
        state, outputs = torch.zeros(A, r, dtype=h.dtype, device=h.device), []
        for k_ in range(G):
            z = torch.cat([state, e[:, k_], h[:, k_]], -1) @ P["gru.wJ"] + P["gru.bJ"]
            g, c, o = z[:, :r], z[:, r:2 * r], z[:, 2 * r:]
            keep = torch.sigmoid(g)
            state = keep * state + (1.0 - keep) * torch.tanh(c)
            outputs.append(torch.tanh(o))
        B = torch.stack(outputs, 1) @ P["markov.w2"]
    logits = U + B
    confidence = torch.sigmoid(torch.cat([h, e], -1) @ P["conf.w"] + P["conf.b"])[..., 0]
    with torch.no_grad():
        target_hidden = batch["target_hidden"]
        if head_dtype is not None:
            T = (target_hidden.to(head_dtype) @ lm_head.T).to(h.dtype)
        else:
            T = target_hidden.to(h.dtype) @ lm_head.T
        p_t = torch.softmax(T, -1)
    log_p = torch.log_softmax(logits, -1)
    ce = -log_p.gather(-1, batch["targets"][..., None])[..., 0]
    l1 = (log_p.exp() - p_t).abs().sum(-1)
    label = (1.0 - 0.5 * l1).detach()
    c = confidence.clamp(1e-6, 1.0 - 1e-6)
    bce = -(label * torch.log(c) + (1.0 - label) * torch.log(1.0 - c))
    positions = torch.arange(G, device=h.device, dtype=h.dtype)
    weight = torch.exp(-positions / LOSS["gamma_decay"])[None] * batch["mask"]
    weight = weight / weight.sum()
    terms = {"ce": (weight * ce).sum(), "l1": (weight * l1).sum(), "bce": (weight * bce).sum()}
    loss = LOSS["ce"] * terms["ce"] + LOSS["l1"] * terms["l1"] + LOSS["bce"] * terms["bce"]
    with torch.no_grad():  # τ̂ = mean over anchors of 1 + Σ_j Π_{i<=j} (1 - L1_i / 2), trained positions only
        survival = torch.where(batch["mask"] > 0, 1.0 - 0.5 * l1, torch.ones_like(l1)).cumprod(-1)
        tau = 1.0 + (survival * (batch["mask"] > 0)).sum(-1)
        trained = batch["mask"].sum(-1) > 0
        tau = tau[trained].mean()
    return loss, terms, tau


# ------------------------------------------------------------------ PyTorch on the GPU

def torch_engine(s, head, steps, warmup, seed):
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    gen = torch.Generator(device=device).manual_seed(seed)
    P = {}
    for name, shape, init in parameter_shapes(s, head):
        if init == "normal":
            value = 0.02 * torch.randn(shape, generator=gen, device=device)
        elif init == "ones":
            value = torch.ones(shape, device=device)
        else:
            value = torch.zeros(shape, device=device)
        P[name] = value.requires_grad_(True)
    H, V, A, G, Lc = s["hidden"], s["vocab"], s["batch"], s["gamma"], s["context"]
    embedding = (2 * torch.rand(V, H, generator=gen, device=device) - 1).to(torch.bfloat16)
    lm_head = (0.05 * (2 * torch.rand(V, H, generator=gen, device=device) - 1)).to(torch.bfloat16)
    # The batch in pinned host memory (context rows in bf16, as regenerated data are stored).
    cpu = torch.Generator().manual_seed(seed + 1)
    host = {
        "context": (2 * torch.rand(A, Lc, s["taps"] * H, generator=cpu) - 1).to(torch.bfloat16).pin_memory(),
        "anchors": torch.randint(0, V, (A,), generator=cpu).pin_memory(),
        "targets": torch.randint(0, V, (A, G), generator=cpu).pin_memory(),
        "target_hidden": (2 * torch.rand(A, G, H, generator=cpu) - 1).pin_memory(),
        "mask": torch.ones(A, G).pin_memory(),
    }
    upload = lambda: {k: v.to(device, non_blocking=True) for k, v in host.items()}
    groups = [{"params": [P[n] for n, sh, _ in parameter_shapes(s, head) if decays(n, sh)], "weight_decay": 0.01},
              {"params": [P[n] for n, sh, _ in parameter_shapes(s, head) if not decays(n, sh)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    parameters = list(P.values())

    def step(batch):
        loss, _, _ = drafter_loss(P, s, head, embedding, lm_head, batch, torch.bfloat16)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    batch = upload()
    torch.cuda.synchronize()
    step_ms, upload_ms, full_ms = [], [], []
    for run in range(warmup + steps):
        start.record()
        step(batch)
        stop.record()
        stop.synchronize()
        if run >= warmup:
            step_ms.append(start.elapsed_time(stop))
    for run in range(warmup + steps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        batch = upload()
        torch.cuda.synchronize()
        if run >= warmup:
            upload_ms.append(1e3 * (time.perf_counter() - begin))
    last = 0.0
    for run in range(warmup + steps):
        begin = time.perf_counter()
        last = step(upload()).item()
        if run >= warmup:
            full_ms.append(1e3 * (time.perf_counter() - begin))
    positions = A * G
    result = dict(engine="torch-eager", torch=torch.__version__, step_ms=statistics.median(step_ms),
                  upload_ms=statistics.median(upload_ms), step_with_upload_ms=statistics.median(full_ms),
                  loss=last, peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9)
    result["positions_per_s"] = positions / (result["step_ms"] * 1e-3)
    result["positions_per_s_with_upload"] = positions / (result["step_with_upload_ms"] * 1e-3)
    del P, optimizer, embedding, lm_head, batch
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def dspark_engine(binary, s, head, steps, warmup):
    command = [binary, "bench", "train", "--json", "--seq-head", head, "--steps", str(steps), "--warmup", str(warmup)]
    for key in ("hidden", "vocab", "taps", "gamma", "layers", "heads", "batch", "context"):
        command += [f"--{key}", str(s[key])]
    command += ["--d-draft", str(s["d_draft"]), "--markov-rank", str(s["markov_rank"]), "--ff-mult", str(s["ff_mult"])]
    log("  $ " + shlex.join(command))
    done = subprocess.run(command, capture_output=True, text=True, timeout=DSPARK_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"dspark bench train failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the golden check (CPU, float64)

def read_safetensors(path):
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(length))
        data = file.read()
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", name
        begin, end = entry["data_offsets"]
        values = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
        tensors[name] = torch.tensor(values, dtype=torch.float64).reshape(entry["shape"])
    return tensors


def check_golden():
    directory = os.path.join(REPO, "tests", "golden", "train")
    with open(os.path.join(directory, "reference.json")) as file:
        reference = json.load(file)
    inputs = read_safetensors(os.path.join(directory, "inputs.safetensors"))
    c, dims, batch_json = reference["config"], reference["dims"], reference["batch"]
    global EPS
    EPS = dims["eps"]
    LOSS.update(ce=reference["weights"]["ce"], l1=reference["weights"]["l1"], bce=reference["weights"]["bce"],
                gamma_decay=reference["weights"]["gammaDecay"])
    s = dict(hidden=dims["hiddenSize"], vocab=dims["vocabSize"], taps=len(c["tapLayers"]), d_draft=c["dDraft"],
             layers=c["nLayers"], heads=c["nHeads"], markov_rank=c["markovRank"], ff_mult=c["ffMult"],
             gamma=c["gamma"])
    offsets = batch_json["context_offsets"]
    lengths = [offsets[a + 1] - offsets[a] for a in range(len(offsets) - 1)]
    A, Lmax, width = len(lengths), max(lengths), s["taps"] * s["hidden"]
    context = torch.zeros(A, Lmax, width, dtype=torch.float64)
    for a in range(A):
        context[a, :lengths[a]] = inputs["context_rows"][offsets[a]:offsets[a + 1]]
    batch = {"context": context, "context_lengths": torch.tensor(lengths),
             "anchors": torch.tensor(batch_json["anchors"]), "targets": torch.tensor(batch_json["targets"]),
             "target_hidden": inputs["target_hidden"], "mask": torch.tensor(batch_json["mask"], dtype=torch.float64)}
    worst = 0.0
    for head, want in reference["heads"].items():
        stored = read_safetensors(os.path.join(directory, f"{head}.safetensors"))
        P = {name[len("param."):]: value.clone().requires_grad_(True) for name, value in stored.items()
             if name.startswith("param.")}
        loss, terms, tau = drafter_loss(P, s, head, inputs["embedding"], inputs["lm_head"], batch, None)
        loss.backward()
        got = {"loss": float(loss), "ce": float(terms["ce"]), "l1": float(terms["l1"]), "bce": float(terms["bce"]),
               "tau_estimate": float(tau)}
        for key, value in got.items():
            error = abs(value - want[key]) / abs(want[key])
            worst = max(worst, error)
            assert error < 1e-9, f"{head} {key}: {value} vs golden {want[key]}"
        for name, value in P.items():
            expected = stored[f"grad.{name}"]
            gradient = value.grad if value.grad is not None else torch.zeros_like(value)
            error = float((gradient - expected).norm() / max(float(expected.norm()), 1e-30))
            assert error < 1e-5 or float(expected.norm()) == 0.0, f"{head} grad {name}: {error}"
        log(f"golden {head}: loss {got['loss']:.9f} (golden {want['loss']:.9f}), tau {got['tau_estimate']:.6f}")
    log(f"the benchmark's PyTorch model matches tests/golden/train (worst relative term error {worst:.1e})")


# ------------------------------------------------------------------ report

def atomic_write_text(path, text):
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(temporary, path)


def add_section(path, section):
    """Newest first: the section goes before the file's first '## ' heading."""
    old = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            old = file.read()
    at = old.find("\n## ")
    if at < 0:
        text = (old.rstrip("\n") + "\n\n" if old else "") + section
    else:
        text = old[:at + 1] + section + "\n" + old[at + 1:]
    atomic_write_text(path, text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dspark", help="the dspark binary, e.g. .device/bin/dspark")
    parser.add_argument("--shapes", default="small,8b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--seq-head", default="markov", choices=("markov", "rnn", "gru"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--results", help="markdown file the dated section is added to (newest first)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON and the section")
    parser.add_argument("--check-golden", action="store_true", help="only check the PyTorch model on the goldens")
    args = parser.parse_args()
    if args.check_golden:
        torch.set_default_dtype(torch.float64)
        check_golden()
        return
    if not args.dspark:
        parser.error("--dspark is required")
    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name}")
    gpu = torch.cuda.get_device_name(0)
    rows, raw = [], []
    for name in shapes:
        s = SHAPES[name]
        log(f"== {name}: " + ", ".join(f"{k} {v}" for k, v in s.items()) + f", {args.seq_head} head")
        ours = dspark_engine(args.dspark, s, args.seq_head, args.steps, args.warmup)
        log(f"  dspark: step {ours['step_ms']:.3f} ms ({ours['positions_per_s']:.0f} positions/s), "
            f"upload {ours['upload_ms']:.3f} ms, step + upload {ours['step_with_upload_ms']:.3f} ms")
        if "pipelined_ms" in ours:
            log(f"  dspark from the data: serial {ours['serial_ms']:.3f} ms, pipelined {ours['pipelined_ms']:.3f} ms "
                f"({ours['positions_per_s_pipelined']:.0f} positions/s, {ours['pack_threads']} packing threads)")
        try:
            theirs = torch_engine(s, args.seq_head, args.steps, args.warmup, args.seed)
            log(f"  torch:  step {theirs['step_ms']:.3f} ms ({theirs['positions_per_s']:.0f} positions/s), "
                f"upload {theirs['upload_ms']:.3f} ms, step + upload {theirs['step_with_upload_ms']:.3f} ms")
        except torch.cuda.OutOfMemoryError as error:  # report what ran
            theirs = {"engine": "torch-eager", "error": f"out of memory: {str(error)[:200]}"}
            log(f"  torch: {theirs['error']}")
        raw.append({"shape": name, "config": s, "seq_head": args.seq_head, "dspark": ours, "torch": theirs})
        rows.append((name, ours, theirs))

    date = datetime.date.today().isoformat()
    command = "python3 bench/train_vs_torch.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [f"## {date} drafter training step, {gpu}", "", "```sh", command, "```", "",
             f"One training step of a fresh drafter ({args.seq_head} head) on random data: loss + backward + global-norm "
             "clip + AdamW, the batch already on the GPU (CUDA events, median of "
             f"{args.steps} steps after {args.warmup}); upload = the batch from pinned host memory; step + upload on "
             "the host clock. Same precision both sides: f32 weights and activations, TF32 matmuls, the target's "
             f"embedding and LM head in bf16 (bf16 operands, f32 accumulation). torch {torch.__version__} eager. "
             "End to end: dspark's mean wall clock per step of consecutive steps on data read as `dspark train` "
             "reads it, serial (build, upload, step) and pipelined (the next batch packed and copied during the "
             "step, as `dspark train --device cuda` runs); torch's end to end is its step + upload from pinned "
             "memory (its batch is not built from data).",
             "",
             "| shape | engine | step ms | positions/s | × torch | upload ms | step + upload ms | positions/s | × torch "
             "| serial ms | end to end ms (dspark: pipelined) | positions/s | × torch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ours, theirs in rows:
        for engine, result in (("dspark", ours), ("torch-eager", theirs)):
            if "error" in result:
                lines.append(f"| {name} | {engine} | {result['error']} |  |  |  |  |  |  |  |  |  |  |")
                continue
            ratio = ratio_upload = ratio_pipelined = ""
            if "error" not in theirs:
                ratio = f"{theirs['step_ms'] / result['step_ms']:.2f}"
                ratio_upload = f"{theirs['step_with_upload_ms'] / result['step_with_upload_ms']:.2f}"
            if engine == "dspark" and "pipelined_ms" in result:
                serial, end_to_end = f"{result['serial_ms']:.3f}", result["pipelined_ms"]
                if "error" not in theirs:
                    ratio_pipelined = f"**{theirs['step_with_upload_ms'] / end_to_end:.2f}**"
            else:  # torch: its step + upload is its end to end
                serial, end_to_end = "", result["step_with_upload_ms"]
                ratio_pipelined = "1.00" if engine == "torch-eager" else ""
            positions = SHAPES[name]["batch"] * SHAPES[name]["gamma"] / (end_to_end * 1e-3)
            lines.append(f"| {name} | {engine} | {result['step_ms']:.3f} | {result['positions_per_s']:.0f} | {ratio} | "
                         f"{result['upload_ms']:.3f} | {result['step_with_upload_ms']:.3f} | "
                         f"{result['positions_per_s_with_upload']:.0f} | {ratio_upload} | "
                         f"{serial} | {end_to_end:.3f} | {positions:.0f} | {ratio_pipelined} |")
    lines.append("")
    for name, ours, theirs in rows:
        s = SHAPES[name]
        lines.append(f"- {name}: target H {s['hidden']}, V {s['vocab']}, {s['taps']} taps; drafter d {s['d_draft']}, "
                     f"{s['layers']} layers, {s['heads']} heads, r {s['markov_rank']}, gamma {s['gamma']} "
                     f"({ours['parameters'] / 1e6:.1f} M parameters); {s['batch']} anchors x {s['context']} context "
                     f"rows ({s['batch'] * s['gamma']} positions per step)"
                     + (f"; end to end over {ours['data_mb']:.0f} MB of data, {ours['batch_mb']:.0f} MB of context "
                        f"rows per batch, {ours['pack_threads']} packing threads" if "pipelined_ms" in ours else "")
                     + (f"; torch peak memory {theirs['peak_memory_gb']:.1f} GB" if "error" not in theirs else ""))
    section = "\n".join(lines) + "\n"
    log()
    log(section)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        atomic_write_text(os.path.join(args.out, "train_vs_torch.json"), json.dumps(raw, indent=1) + "\n")
        atomic_write_text(os.path.join(args.out, "train_vs_torch.md"), section)
    if args.results:
        add_section(args.results, section)


if __name__ == "__main__":
    main()
