#!/usr/bin/env python3
"""Pretrains the project's small target LM from data/corpus (tools/corpus.py)
in one command on one GPU, within a wall-clock deadline:

  1. trains a byte-level BPE tokenizer (HF `tokenizers`) on a sample of the
     train split: NFC, the Qwen pre-split regex, ByteLevel pre-tokenizer and
     decoder, special tokens <|endoftext|> <|im_start|> <|im_end|> last, and a
     ChatML chat template: exactly the features src/model/tokenizer.cpp and
     src/model/chat_template.cpp implement (the layout of tests/golden/qwen3);
  2. tokenizes both splits (batched, all cores); a fraction of the training
     documents is wrapped as a ChatML exchange (user: the beginning of the
     document, assistant: its continuation, then <|im_end|>) so that the model
     also answers through its chat template;
  3. pretrains a transformers Qwen3ForCausalLM (GQA, head_dim 64, q/k norms,
     tied embeddings) with bf16 autocast, fused AdamW, linear warmup then a
     cosine over the training TIME budget, random windows of the token stream,
     optionally torch.compile'd (falls back to eager if compiling fails);
     the weights with the best held-out subset loss are kept (many epochs);
  4. evaluates held-out perplexity and bits per byte;
  5. saves an HF checkpoint (bf16 safetensors, optionally sharded, config.json,
     generation_config.json, tokenizer.json, tokenizer_config.json), reloads
     it to check logits and the tokenizer, greedy-decodes a few held-out
     prompts, and writes report.json;
  6. with --pack-to DIR, writes DIR/<name>.tar.part-NN (each <= 15 MiB), the
     parts' SHA256SUMS, report.json and train.log: what the device tool can
     bring back (at most 8 files). tools/unpack_target.sh reassembles them.

Runs where torch, transformers (4.5x or 5.x) and tokenizers are installed. Here
(no transformers, no tokenizers) `--dry-run` runs every step on the CPU with a
tiny model of the same architecture written below in plain torch and a byte
tokenizer, so the data path, schedule, evaluation, saving and packing are
exercised; the HF-specific calls are kept in small functions.

Example (the GPU machine, from the repository root):
  python3 tools/pretrain_target.py --corpus data/corpus --out /tmp/target \
      --name dspark-target --deadline-minutes 9.2 --pack-to "$OUT"
"""
import argparse
import ctypes
import ctypes.util
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tarfile
import time
import traceback

START_TIME = time.time()
# No network on the GPU machine: never let the hub client wait on one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
SEPARATOR = "<|endoftext|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_INSTRUCTIONS = [
    "Continue this text.", "Continue the following.", "Write what comes next.",
    "Continue:", "Please continue this document.", "Complete the following.",
]
PART_BYTES = 15 * 1024 * 1024

LOG_LINES = []


def log(*parts):
    line = f"[{time.time() - START_TIME:7.1f}s] " + " ".join(str(p) for p in parts)
    LOG_LINES.append(line)
    print(line, flush=True)


# ================================================================ corpus reading


class _ZstdBuffer(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


def _zstd_ctypes(data):
    """Streaming decompression through libzstd.so.1 (present wherever dpkg or
    apt is): frames written from a pipe carry no content size."""
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    library = ctypes.CDLL(name)
    library.ZSTD_createDStream.restype = ctypes.c_void_p
    library.ZSTD_freeDStream.argtypes = [ctypes.c_void_p]
    library.ZSTD_initDStream.argtypes = [ctypes.c_void_p]
    library.ZSTD_DCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    library.ZSTD_decompressStream.restype = ctypes.c_size_t
    library.ZSTD_decompressStream.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ZstdBuffer),
                                              ctypes.POINTER(_ZstdBuffer)]
    library.ZSTD_isError.argtypes = [ctypes.c_size_t]
    library.ZSTD_getErrorName.restype = ctypes.c_char_p
    library.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
    stream = library.ZSTD_createDStream()
    try:
        library.ZSTD_initDStream(stream)
        library.ZSTD_DCtx_setParameter(stream, 100, 31)  # ZSTD_d_windowLogMax: allow --long windows
        source = ctypes.create_string_buffer(data, len(data))
        input_buffer = _ZstdBuffer(ctypes.cast(source, ctypes.c_void_p), len(data), 0)
        chunk = 1 << 24
        target = ctypes.create_string_buffer(chunk)
        pieces = []
        while True:
            output_buffer = _ZstdBuffer(ctypes.cast(target, ctypes.c_void_p), chunk, 0)
            code = library.ZSTD_decompressStream(stream, ctypes.byref(output_buffer), ctypes.byref(input_buffer))
            if library.ZSTD_isError(code):
                raise RuntimeError("libzstd: " + library.ZSTD_getErrorName(code).decode())
            pieces.append(target.raw[:output_buffer.pos])
            if input_buffer.pos >= input_buffer.size and output_buffer.pos < chunk:
                break
        return b"".join(pieces)
    finally:
        library.ZSTD_freeDStream(stream)


def read_compressed(path):
    """The bytes of a .zst (or plain) file: python zstandard, libzstd through
    ctypes, the zstd command or pyarrow, whichever this machine has."""
    path = pathlib.Path(path)
    if path.suffix != ".zst":
        return path.read_bytes()
    errors = []
    try:
        import zstandard
        with open(path, "rb") as handle:
            return zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(handle).read()
    except Exception as error:  # noqa: BLE001 - try the next decoder
        errors.append(f"zstandard: {error}")
    try:
        return _zstd_ctypes(path.read_bytes())
    except Exception as error:  # noqa: BLE001
        errors.append(f"libzstd: {error}")
    if shutil.which("zstd"):
        done = subprocess.run(["zstd", "-dc", "--long=31", str(path)], capture_output=True)
        if done.returncode == 0:
            return done.stdout
        errors.append(f"zstd command: {done.stderr.decode(errors='replace')}")
    try:
        import pyarrow
        with pyarrow.input_stream(str(path), compression="zstd") as stream:
            return stream.read()
    except Exception as error:  # noqa: BLE001
        errors.append(f"pyarrow: {error}")
    raise SystemExit(f"cannot decompress {path}: " + "; ".join(errors))


def find_split(corpus, split):
    for name in (f"{split}.txt.zst", f"{split}.txt"):
        if (corpus / name).exists():
            return corpus / name
    raise SystemExit(f"{corpus}: no {split}.txt.zst or {split}.txt (run tools/corpus.py, and carry data/corpus)")


def read_documents(path):
    text = read_compressed(path).decode("utf-8")
    documents = [d for d in text.split(SEPARATOR) if d.strip()]
    return documents, len(text.encode("utf-8"))


def stable_unit(text):
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:12], 16) / float(1 << 48)


def chat_wrap(document, index):
    """A ChatML exchange built from a document: the user gives its first lines
    and asks to continue, the assistant continues. None when too short."""
    lines = document.split("\n")
    if len(lines) < 12:
        return None
    rng = random.Random(index)
    cut = rng.randint(4, min(16, len(lines) // 2))
    prefix = "\n".join(lines[:cut]).strip("\n")
    rest_lines, size = [], 0
    for line in lines[cut:]:
        if size + len(line) > 2400 and rest_lines:
            break
        rest_lines.append(line)
        size += len(line) + 1
    continuation = "\n".join(rest_lines).strip("\n")
    if len(prefix) > 1500 or len(continuation) < 100:
        return None
    instruction = rng.choice(CHAT_INSTRUCTIONS)
    user = prefix if rng.random() < 0.3 else instruction + "\n\n" + prefix
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{continuation}<|im_end|>\n")


# ================================================================ tokenizer


class ByteTokenizer:
    """Dry-run stand-in for the BPE tokenizer: bytes, then the special tokens."""

    def __init__(self):
        self.special = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}

    def vocab_size(self):
        return 256 + len(SPECIAL_TOKENS)

    def token_id(self, token):
        return self.special[token]

    def encode_many(self, texts):
        out = []
        for text in texts:
            ids = []
            position = 0
            while position < len(text):
                next_special = min(((text.find(s, position), s) for s in SPECIAL_TOKENS
                                    if text.find(s, position) >= 0), default=(-1, None))
                end = next_special[0] if next_special[0] >= 0 else len(text)
                ids.extend(text[position:end].encode("utf-8"))
                if next_special[0] < 0:
                    break
                ids.append(self.special[next_special[1]])
                position = end + len(next_special[1])
            out.append(ids)
        return out

    def decode(self, ids):
        inverse = {v: k for k, v in self.special.items()}
        data = b"".join(bytes([i]) if i < 256 else inverse[i].encode() for i in ids)
        return data.decode("utf-8", "replace")

    def save(self, directory):
        (directory / "tokenizer.txt").write_text("byte tokenizer (dry run)\n")


class HfTokenizer:
    """The trained tokenizers.Tokenizer with the calls the script needs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def vocab_size(self):
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token):
        return self.tokenizer.token_to_id(token)

    def encode_many(self, texts):
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # skips offsets (tokenizers >= 0.21)
        if fast is not None:
            try:
                return [encoding.ids for encoding in fast(texts, add_special_tokens=False)]
            except TypeError:
                pass
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def save(self, directory):
        self.tokenizer.save(str(directory / "tokenizer.json"))


def train_tokenizer(documents, vocab_size, sample_bytes):
    """Byte-level BPE like tests/golden/qwen3 (see make_golden.py), trained on the
    first documents up to sample_bytes (the split is already in hash order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    options = dict(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False, min_frequency=2,
                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        trainer = trainers.BpeTrainer(max_token_length=24, **options)
    except TypeError:
        trainer = trainers.BpeTrainer(**options)
    sample, size = [], 0
    for document in documents:
        sample.append(document)
        size += len(document)
        if size >= sample_bytes:
            break
    tokenizer.train_from_iterator(sample, trainer=trainer, length=len(sample))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)  # ids vocab_size-3 .. vocab_size-1
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return HfTokenizer(tokenizer), len(sample), size


def tokenizer_config(max_positions):
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "model_max_length": max_positions,
            "add_bos_token": False, "clean_up_tokenization_spaces": False,
            "chat_template": CHATML_TEMPLATE}


def tokenize_stream(tokenizer, documents, end_id, chat_fraction, batch_documents=4096):
    """One uint16/int32 numpy stream: each document's ids then <|endoftext|>;
    a chat_fraction of the documents is followed by its ChatML exchange too."""
    import numpy as np
    dtype = np.uint16 if tokenizer.vocab_size() <= 65535 else np.int32
    pieces, wrapped = [], 0
    for begin in range(0, len(documents), batch_documents):
        batch = []
        for index in range(begin, min(begin + batch_documents, len(documents))):
            document = documents[index]
            if chat_fraction > 0 and stable_unit(f"chat:{index}") < chat_fraction:
                exchange = chat_wrap(document, index)
                if exchange is not None:
                    batch.append(exchange)
                    wrapped += 1
            batch.append(document)
        for ids in tokenizer.encode_many(batch):
            pieces.append(np.asarray(ids + [end_id], dtype=dtype))
    return np.concatenate(pieces), wrapped


# ================================================================ model


def model_settings(args, vocab_size, eos_ids, pad_id):
    return dict(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.head_dim, max_position_embeddings=args.max_positions, rms_norm_eps=1e-6,
                rope_theta=args.rope_theta, tie_word_embeddings=True, eos_token_id=eos_ids, pad_token_id=pad_id)


def build_hf_model(settings):
    """A fresh Qwen3ForCausalLM; transformers 5 keeps rope settings in
    `rope_parameters`, 4.x in `rope_theta`."""
    import transformers
    fields = dict(settings)
    theta = fields.pop("rope_theta")
    if int(transformers.__version__.split(".")[0]) >= 5:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        fields["rope_theta"] = theta
    config = transformers.Qwen3Config(bos_token_id=None, attention_bias=False, use_sliding_window=False,
                                      **fields)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except Exception as error:  # noqa: BLE001 - older/newer signature: plain construction
        log("from_config(attn_implementation='sdpa') refused:", error)
        model = transformers.Qwen3ForCausalLM(config)
    if model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        log("embeddings were not tied by transformers: tying them by hand")
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def make_local_model(settings):
    """The Qwen3 decoder in plain torch, for --dry-run where transformers is
    absent: RMSNorm, q/k RMSNorm per head, rotary (half split), GQA causal
    attention, SwiGLU MLP, tied embedding head."""
    import torch
    from torch import nn

    class RmsNorm(nn.Module):
        def __init__(self, size, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size))
            self.eps = eps

        def forward(self, x):
            variance = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    class Attention(nn.Module):
        def __init__(self, s):
            super().__init__()
            h, hd = s["hidden_size"], s["head_dim"]
            self.heads, self.kv_heads, self.head_dim = s["num_attention_heads"], s["num_key_value_heads"], hd
            self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
            self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
            self.q_norm = RmsNorm(hd, s["rms_norm_eps"])
            self.k_norm = RmsNorm(hd, s["rms_norm_eps"])

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
            k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            attention = scores.float().masked_fill(causal, float("-inf")).softmax(-1).to(v.dtype) @ v
            return self.o_proj(attention.transpose(1, 2).reshape(b, t, -1))

    class Mlp(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.gate_proj = nn.Linear(s["hidden_size"], s["intermediate_size"], bias=False)
            self.up_proj = nn.Linear(s["hidden_size"], s["intermediate_size"], bias=False)
            self.down_proj = nn.Linear(s["intermediate_size"], s["hidden_size"], bias=False)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):  # parameter names as in transformers' Qwen3DecoderLayer
        def __init__(self, s):
            super().__init__()
            self.input_layernorm = RmsNorm(s["hidden_size"], s["rms_norm_eps"])
            self.self_attn = Attention(s)
            self.post_attention_layernorm = RmsNorm(s["hidden_size"], s["rms_norm_eps"])
            self.mlp = Mlp(s)

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Output:
        def __init__(self, logits):
            self.logits = logits

    class Model(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.settings = s
            self.embed_tokens = nn.Embedding(s["vocab_size"], s["hidden_size"])
            self.layers = nn.ModuleList(Layer(s) for _ in range(s["num_hidden_layers"]))
            self.norm = RmsNorm(s["hidden_size"], s["rms_norm_eps"])
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
            hd = s["head_dim"]
            inverse = 1.0 / (s["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
            self.register_buffer("inverse_frequency", inverse, persistent=False)

        def forward(self, input_ids):
            t = input_ids.shape[1]
            angles = torch.outer(torch.arange(t, device=input_ids.device).float(), self.inverse_frequency)
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos().to(self.embed_tokens.weight.dtype), angles.sin().to(self.embed_tokens.weight.dtype)
            x = self.embed_tokens(input_ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return Output(self.norm(x) @ self.embed_tokens.weight.t())

        def __call__(self, input_ids=None, use_cache=False):
            return super().__call__(input_ids)

    return Model(settings)


def count_parameters(model):
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel()
    return total


# ================================================================ training


def learning_rate(step, elapsed_fraction, args):
    """Linear warmup over --warmup-steps, then a cosine over the time budget
    down to --min-lr-ratio of the peak."""
    warmup = min(1.0, (step + 1) / max(1, args.warmup_steps))
    progress = min(1.0, max(0.0, elapsed_fraction))
    cosine = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * warmup * cosine


def evaluate(model, stream, seq_len, batch_size, device, max_windows=None, autocast=True):
    """Mean next-token loss over non-overlapping windows of seq_len+1 tokens
    (each window scores seq_len tokens)."""
    import torch
    windows = (len(stream) - 1) // seq_len
    if max_windows:
        windows = min(windows, max_windows)
    if windows == 0:
        return float("nan"), 0
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for begin in range(0, windows, batch_size):
            indices = torch.arange(begin, min(begin + batch_size, windows), device=device) * seq_len
            rows = stream[indices[:, None] + torch.arange(seq_len + 1, device=device)[None, :]].long()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=rows[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     rows[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += rows[:, 1:].numel()
    model.train()
    return total / count, count


def train(model, train_stream, heldout_stream, args, device, budget_seconds, report):
    import torch
    model.to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                      fused=device.type == "cuda")
    except TypeError:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    autocast = device.type == "cuda"

    def eager_loss(inputs, targets):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=inputs, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    loss_function = eager_loss
    if args.compile and device.type == "cuda":
        try:  # the forward and the loss in one graph: the upcast logits are never stored
            loss_function = torch.compile(eager_loss, dynamic=False)
        except Exception as error:  # noqa: BLE001
            log("torch.compile unavailable, eager:", error)

    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed)
    n, t, b = len(train_stream), args.seq_len, args.batch_size
    positions = torch.arange(t + 1, device=device)[None, :]

    def batch():
        offsets = torch.randint(0, n - t - 1, (b,), device=device, generator=generator)
        rows = train_stream[offsets[:, None] + positions].long()
        return rows[:, :-1], rows[:, 1:]

    def step_once(step, elapsed_fraction):
        lr = learning_rate(step, elapsed_fraction, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        total_loss = 0.0
        for _ in range(args.accumulate):
            inputs, targets = batch()
            loss = loss_function(inputs, targets)
            (loss / args.accumulate).backward()
            total_loss += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total_loss / args.accumulate, norm, lr

    curve, eval_curve = [], []
    best = {"loss": float("inf"), "step": 0, "state": None}
    tokens_per_step = b * t * args.accumulate

    def evaluate_subset():  # the same first 4 batches of held-out windows every time
        return evaluate(model, heldout_stream, t, b, device, max_windows=4 * b, autocast=autocast)[0]
    step = 0
    log(f"training: budget {budget_seconds:.0f} s, {tokens_per_step} tokens/step, stream {n} tokens")
    # The first step compiles; if compiling fails, fall back to eager once.
    compile_started = time.time()
    try:
        loss, norm, lr = step_once(0, 0.0)
        float(loss)
    except Exception as error:  # noqa: BLE001
        if loss_function is eager_loss:
            raise
        log("compiled step failed, continuing eager:", repr(error)[:500])
        report["compile_error"] = repr(error)[:2000]
        loss_function = eager_loss
        optimizer.zero_grad(set_to_none=True)
        loss, norm, lr = step_once(0, 0.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    report["first_step_seconds"] = round(time.time() - compile_started, 1)
    log(f"first step (compile) {report['first_step_seconds']} s, loss {float(loss):.3f}")
    step = 1
    train_started = time.time()
    budget_left = budget_seconds - (train_started - compile_started)
    last_log, window_tokens, window_started = train_started, 0, train_started
    running = None
    while True:
        elapsed = time.time() - train_started
        if elapsed >= budget_left or (args.max_steps and step >= args.max_steps):
            break
        loss, norm, lr = step_once(step, elapsed / budget_left)
        step += 1
        window_tokens += tokens_per_step
        now = time.time()
        if now - last_log >= args.log_seconds or step <= 3 or (args.max_steps and step >= args.max_steps):
            value = float(loss)  # synchronizes
            running = value if running is None else 0.7 * running + 0.3 * value
            rate = window_tokens / max(1e-9, time.time() - window_started)
            curve.append({"step": step, "tokens": step * tokens_per_step, "loss": round(value, 4),
                          "lr": lr, "grad_norm": round(float(norm), 3), "tokens_per_s": round(rate),
                          "seconds": round(now - train_started, 1)})
            log(f"step {step:6d}  loss {value:.4f}  lr {lr:.2e}  |g| {float(norm):.2f}  {rate / 1e3:.0f}k tok/s")
            last_log, window_tokens, window_started = now, 0, time.time()
        if args.eval_seconds and heldout_stream is not None and \
                (not eval_curve or now - eval_curve[-1]["_time"] >= args.eval_seconds):
            value = evaluate_subset()
            eval_curve.append({"step": step, "tokens": step * tokens_per_step, "heldout_loss": round(value, 4),
                               "_time": time.time()})
            if value < best["loss"]:
                best.update(loss=value, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
            log(f"step {step:6d}  held-out loss (subset) {value:.4f}  (best {best['loss']:.4f} at {best['step']})")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - train_started
    if best["state"] is not None:
        final = evaluate_subset()
        eval_curve.append({"step": step, "tokens": step * tokens_per_step, "heldout_loss": round(final, 4)})
        if best["loss"] < final - 0.002:
            model.load_state_dict(best["state"])
            report["restored_best"] = {"step": best["step"], "subset_loss": round(best["loss"], 4),
                                       "last_subset_loss": round(final, 4)}
            log(f"restored the weights of step {best['step']} (subset loss {best['loss']:.4f} < {final:.4f})")
        best["state"] = None
    for entry in eval_curve:
        entry.pop("_time", None)
    report["train"] = {"steps": step, "tokens_seen": step * tokens_per_step, "seconds": round(seconds, 1),
                       "tokens_per_s": round((step - 1) * tokens_per_step / max(1e-9, seconds)),
                       "final_loss_logged": curve[-1]["loss"] if curve else float(loss),
                       "loss_curve": curve, "heldout_curve": eval_curve,
                       "epochs": round(step * tokens_per_step / n, 2)}
    return model


# ================================================================ saving


def save_safetensors(path, tensors):
    """Minimal safetensors writer (dry run only; the real run uses save_pretrained)."""
    import torch
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous().cpu()
        data = tensor.view(torch.int16).numpy().tobytes() if tensor.dtype == torch.bfloat16 \
            else tensor.numpy().tobytes()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * ((8 - len(encoded) % 8) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)


def save_model(model, directory, local, max_shard_size, eos_ids):
    import torch
    model.to(torch.bfloat16)
    if local:
        state = {("model." + k): v for k, v in model.state_dict().items()}
        save_safetensors(directory / "model.safetensors", state)
        config = dict(model.settings, architectures=["Qwen3ForCausalLM"], model_type="qwen3", dtype="bfloat16")
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    else:
        model.save_pretrained(str(directory), safe_serialization=True, max_shard_size=max_shard_size)
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config["dtype"] = "bfloat16"
        if "torch_dtype" in config:
            config["torch_dtype"] = "bfloat16"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": None, "eos_token_id": eos_ids}, indent=2) + "\n")


def verify_checkpoint(model, tokenizer, directory, device, prompts, report):
    """Reloads the saved checkpoint with transformers, compares its logits with
    the in-memory model, greedy-decodes a few held-out prompts (plain and
    through the chat template; recorded in the report), then checks that
    AutoTokenizer reads the tokenizer back identically."""
    import torch
    import transformers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    reloaded.to(device).eval()
    model.to(device).eval()
    ids = tokenizer.encode_many([prompts[0]["prompt"]])[0][:256]
    with torch.no_grad():
        tensor = torch.tensor([ids], device=device)
        difference = (reloaded(input_ids=tensor).logits.float() - model(input_ids=tensor).logits.float()).abs().max()
    report["reload_max_logit_difference"] = float(difference)
    log(f"reloaded checkpoint: max |logit difference| {float(difference):.4g}")

    stops = (tokenizer.token_id("<|endoftext|>"), tokenizer.token_id("<|im_end|>"))
    samples = []
    cases = [(p, False) for p in prompts] + [(p, True) for p in prompts[:2]]
    for prompt, chat in cases:
        text = prompt["prompt"]
        if chat:
            text = f"<|im_start|>user\nContinue this text.\n\n{text}<|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer.encode_many([text])[0]
        generated = []
        with torch.no_grad():
            tensor = torch.tensor([ids], device=device)
            for _ in range(64):  # greedy, no cache: short and simple
                token = int(torch.argmax(reloaded(input_ids=tensor).logits[0, -1]))
                generated.append(token)
                if token in stops:
                    break
                tensor = torch.cat([tensor, torch.tensor([[token]], device=device)], dim=1)
        samples.append({"source": prompt.get("source"), "chat": chat, "prompt_tail": prompt["prompt"][-200:],
                        "greedy": tokenizer.decode(generated)})
    report["greedy_samples"] = samples
    for sample in samples[:4]:
        log(f"sample ({sample['source']}, chat={sample['chat']}): {sample['greedy'][:160]!r}")

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = "def f(x):\n    return x  # naïve café 🙂\n<|im_start|>user\nhi<|im_end|>\n"
    same = hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode_many([text])[0]
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                add_generation_prompt=True)
    report["tokenizer_reload_matches"] = bool(same)
    report["chat_template_render"] = rendered
    log(f"AutoTokenizer matches: {same}; chat render {rendered!r}")


def pack(directory, name, destination, report_path, log_path):
    """<name>.tar split into <= 15 MiB parts, SHA256SUMS, report.json, train.log."""
    destination.mkdir(parents=True, exist_ok=True)
    archive = destination / f"{name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(str(directory), arcname=name)
    data = archive.read_bytes()
    archive.unlink()
    sums = []
    for index in range(0, max(1, math.ceil(len(data) / PART_BYTES))):
        part = destination / f"{name}.tar.part-{index:02d}"
        part.write_bytes(data[index * PART_BYTES:(index + 1) * PART_BYTES])
        sums.append(f"{hashlib.sha256(part.read_bytes()).hexdigest()}  {part.name}")
    sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}.tar")
    (destination / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    if report_path.exists():
        shutil.copy(report_path, destination / "report.json")
    if log_path.exists():
        shutil.copy(log_path, destination / "train.log")
    files = sorted(p.name for p in destination.iterdir())
    assert len(files) <= 8, f"too many files to bring back: {files}"
    log(f"packed {len(data) / 2**20:.1f} MiB into {destination}: {files}")


# ================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="data/corpus", help="folder with train/heldout .txt.zst")
    parser.add_argument("--prompts", default="data/prompts", help="folder with heldout_*.jsonl (samples)")
    parser.add_argument("--out", default="/tmp/dspark-target", help="work folder; the model goes to OUT/NAME")
    parser.add_argument("--name", default="dspark-target", help="model folder name (models/NAME after unpack)")
    parser.add_argument("--pack-to", help="write the tar parts, SHA256SUMS, report and log here (e.g. $OUT)")
    # time
    parser.add_argument("--minutes", type=float, default=7.0, help="training budget (compile included)")
    parser.add_argument("--deadline-minutes", type=float, default=9.2,
                        help="everything must end by then (counted from the start of the script): the "
                             "training budget shrinks to leave --reserve-seconds after it")
    parser.add_argument("--reserve-seconds", type=float, default=75.0, help="time kept for eval, save, pack")
    # tokenizer and data
    parser.add_argument("--vocab", type=int, default=8192, help="tokenizer size, special tokens included")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=48.0)
    parser.add_argument("--chat-fraction", type=float, default=0.08,
                        help="training documents wrapped as a ChatML continue-this exchange")
    # model
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--rope-theta", type=float, default=100000.0)
    # optimisation
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=250)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the forward and loss (a model this small gains little, and "
                             "the compile time comes out of the training budget)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-seconds", type=float, default=10.0)
    parser.add_argument("--eval-seconds", type=float, default=30.0,
                        help="held-out subset loss every N s (0: off); the best weights are kept and restored "
                             "at the end if the last ones are worse (many epochs over a small corpus)")
    parser.add_argument("--max-shard-size", default="50MB", help="save_pretrained shard size (e.g. 15MB)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny model, byte tokenizer where `tokenizers` is absent, 1 MB of corpus, a few "
                             "steps: checks arguments, corpus reading, the loop, saving and packing")
    args = parser.parse_args(argv)
    if args.hidden != args.heads * args.head_dim:
        log(f"note: hidden {args.hidden} != heads {args.heads} x head_dim {args.head_dim} (allowed by Qwen3)")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    if args.seq_len > args.max_positions:
        parser.error("--seq-len exceeds --max-positions")
    if not 0 <= args.chat_fraction < 1:
        parser.error("--chat-fraction must be in [0, 1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    corpus, out = pathlib.Path(args.corpus), pathlib.Path(args.out)
    train_path, heldout_path = find_split(corpus, "train"), find_split(corpus, "heldout")
    model_dir = out / args.name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    report_path, log_path = out / "report.json", out / "train.log"
    report = {"name": args.name, "arguments": vars(args), "errors": []}
    prompts = []
    for name in ("heldout_code.jsonl", "heldout_prose.jsonl"):
        path = pathlib.Path(args.prompts) / name
        if path.exists():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            prompts += lines[:3]

    def write_report():
        report["seconds_total"] = round(time.time() - START_TIME, 1)
        report_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        log_path.write_text("\n".join(LOG_LINES) + "\n")

    try:
        run(args, train_path, heldout_path, model_dir, prompts, report, write_report)
    except BaseException as error:  # noqa: BLE001 - record, still pack what exists
        report["errors"].append(traceback.format_exc())
        log("FAILED:", repr(error))
        write_report()
        if args.pack_to:
            pack(model_dir, args.name, pathlib.Path(args.pack_to), report_path, log_path)
        raise
    write_report()
    if args.pack_to:
        pack(model_dir, args.name, pathlib.Path(args.pack_to), report_path, log_path)
    log("done")


def run(args, train_path, heldout_path, model_dir, prompts, report, write_report):
    import numpy as np
    import torch
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__}
    try:
        import transformers
        versions["transformers"] = transformers.__version__
    except ImportError:
        transformers = None
    try:
        import tokenizers
        versions["tokenizers"] = tokenizers.__version__
    except ImportError:
        tokenizers = None
    report["versions"] = versions
    log("versions", versions)
    if not args.dry_run and (transformers is None or tokenizers is None):
        raise SystemExit("transformers and tokenizers are needed (or use --dry-run)")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        report["gpu"] = torch.cuda.get_device_name(0)
    torch.manual_seed(args.seed)

    # 1. corpus
    train_documents, train_bytes = read_documents(train_path)
    heldout_documents, heldout_bytes = read_documents(heldout_path)
    if args.dry_run:
        train_documents = train_documents[:200]
        heldout_documents = heldout_documents[:20]
        heldout_bytes = sum(len((d + SEPARATOR).encode()) for d in heldout_documents)
    log(f"corpus: {len(train_documents)} train documents ({train_bytes / 1e6:.1f} MB), "
        f"{len(heldout_documents)} held out ({heldout_bytes / 1e6:.2f} MB)")
    report["corpus"] = {"train_documents": len(train_documents), "train_bytes": train_bytes,
                        "heldout_documents": len(heldout_documents), "heldout_bytes": heldout_bytes}

    # 2. tokenizer
    if tokenizers is not None:
        sample_bytes = int(args.tokenizer_sample_mb * 1e6) if not args.dry_run else 300_000
        vocab = args.vocab if not args.dry_run else 600
        tokenizer, sample_documents, sample_size = train_tokenizer(train_documents, vocab, sample_bytes)
        log(f"tokenizer: {tokenizer.vocab_size()} tokens from {sample_documents} documents "
            f"({sample_size / 1e6:.1f} MB)")
    else:
        tokenizer = ByteTokenizer()
        log("tokenizer: bytes (dry run without `tokenizers`)")
    vocab_size = tokenizer.vocab_size()
    end_id, _, im_end_id = (tokenizer.token_id(t) for t in SPECIAL_TOKENS)  # <|im_start|> must exist too
    tokenizer.save(model_dir)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(args.max_positions), indent=2, ensure_ascii=False) + "\n")

    # 3. tokens
    started = time.time()
    train_tokens, wrapped = tokenize_stream(tokenizer, train_documents, end_id, args.chat_fraction)
    heldout_tokens, _ = tokenize_stream(tokenizer, heldout_documents, end_id, 0.0)
    del train_documents
    bytes_per_token = heldout_bytes / len(heldout_tokens)
    log(f"tokens: train {len(train_tokens)} ({wrapped} documents as chat), held out {len(heldout_tokens)}, "
        f"{bytes_per_token:.2f} bytes/token, {time.time() - started:.1f} s")
    report["tokens"] = {"train": int(len(train_tokens)), "heldout": int(len(heldout_tokens)),
                        "chat_documents": wrapped, "heldout_bytes_per_token": round(bytes_per_token, 3),
                        "vocab_size": vocab_size, "seconds": round(time.time() - started, 1)}
    write_report()

    # 4. model
    settings = model_settings(args, vocab_size, [im_end_id, end_id], end_id)
    if args.dry_run:
        settings.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16)
    local = transformers is None
    model = (make_local_model(settings) if local else build_hf_model(settings)).float()
    parameters = count_parameters(model)
    embedding = vocab_size * settings["hidden_size"]
    implementation = "local" if local else "transformers " + getattr(model.config, "_attn_implementation", "?")
    report["model"] = {"settings": settings, "parameters": parameters,
                       "non_embedding_parameters": parameters - embedding,
                       "bf16_megabytes": round(parameters * 2 / 1e6, 1), "implementation": implementation}
    log(f"model: {parameters / 1e6:.2f}M parameters ({(parameters - embedding) / 1e6:.2f}M without the embedding), "
        f"{report['model']['implementation']}")

    # 5. train
    to_device = (lambda array: torch.from_numpy(array.astype(np.int32)).to(device))
    train_stream, heldout_stream = to_device(train_tokens), to_device(heldout_tokens)
    seq_len, batch_size = (args.seq_len, args.batch_size) if not args.dry_run else (64, 4)
    args.seq_len, args.batch_size = seq_len, batch_size
    elapsed = time.time() - START_TIME
    budget = min(args.minutes * 60, args.deadline_minutes * 60 - elapsed - args.reserve_seconds)
    if args.dry_run:
        budget = min(budget, 20.0)
        args.max_steps = args.max_steps or 12
        args.warmup_steps = 3
        args.log_seconds = 0
        args.eval_seconds = 0.5
    if budget < 30 and not args.dry_run:
        raise SystemExit(f"only {budget:.0f} s left for training: raise --deadline-minutes or shorten the rest")
    model = train(model, train_stream, heldout_stream, args, device, budget, report)
    write_report()

    # 6. save first (the checkpoint survives a later failure), then evaluate
    save_model(model, model_dir, local, args.max_shard_size, [im_end_id, end_id])
    model.to(device)
    log("saved", sorted(p.name for p in model_dir.iterdir()))
    started = time.time()
    loss, scored = evaluate(model, heldout_stream, seq_len, batch_size, device, autocast=device.type == "cuda")
    report["heldout"] = {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 3), "tokens_scored": scored,
                         "bits_per_byte": round(loss / math.log(2) / bytes_per_token, 4),
                         "seconds": round(time.time() - started, 1), "weights": "bf16"}
    log(f"held-out: loss {loss:.4f}, perplexity {math.exp(loss):.2f}, "
        f"{report['heldout']['bits_per_byte']} bits/byte over {scored} tokens")
    write_report()
    if not local:
        try:
            verify_checkpoint(model, tokenizer, model_dir, device, prompts or [{"prompt": "def main():\n"}], report)
        except Exception:  # noqa: BLE001 - the checkpoint is saved; record and go on
            report["errors"].append(traceback.format_exc())
            log("verification failed:", traceback.format_exc().splitlines()[-1])
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    report["checkpoint_bytes"] = size
    log(f"checkpoint {model_dir}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
