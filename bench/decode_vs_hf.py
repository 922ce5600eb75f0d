#!/usr/bin/env python3
"""Decode speed of dspark against Hugging Face transformers, on random-weight Qwen3 checkpoints.

What it measures, per shape (qwen3-8b, qwen3-4b, qwen3-1.7b; --shapes picks them):

  1. It writes a random-weight bf16 checkpoint with the real Qwen3 shapes into
     <workdir>/<shape>/ (once: a `.complete` marker, written last, says it is whole).
     Weights are drawn on the GPU from a seeded torch.Generator: N(0, 0.02) for the
     matrices, 1 + N(0, 0.02) for the norm weights. Shards are <= 4 GB.
  2. dspark: `<dspark> bench decode -m DIR --device cuda --batch B --prompt-len P
     --gen N --json`; its one JSON object is recorded as it is (tokens_per_s,
     ms_per_step, bytes_per_step, copy_gb_per_s, verify_cost, ...).
  3. HF eager: the model in bf16 on the GPU (default attention, normally sdpa), a
     batch of B random prompts of P tokens, prefill (not timed), then N greedy
     decode steps, one token per sequence per step, through a DynamicCache.
  4. HF compiled: the same with a StaticCache of P+N slots and
     torch.compile(model.forward, mode="reduce-overhead") for the decode steps
     (prefill runs uncompiled). Compilation and warm-up are guarded by a 240 s limit.

How a step is timed: dspark times itself (`bench decode`: host clock around each
complete, synchronised step). For HF, every decode step (forward + argmax of the
last logits) is bracketed by two CUDA events on the current stream; the first steps are warm-up
and are dropped (5 for eager; 10 for compiled, which also covers compilation and
CUDA-graph capture, timed separately on the wall clock); the result is the median
of the remaining steps. tokens/s = B / median step time.

Roofline: tokens/s = B * copy bandwidth / bytes read per step, with the copy
bandwidth and bytes per step taken from dspark's JSON when it has them; otherwise
the bandwidth is measured here (a 4 GiB device-to-device copy, 2 * bytes / time,
median of 10) and bytes per step are estimated (weights read per step + the KV
cache at the mean context length). GB means 1e9 bytes.

Output: a table on stdout, a dated section appended to --results (markdown), and
the raw numbers in <out>/decode_vs_hf.json (--out, or $OUT when set).

Usage:
  python3 bench/decode_vs_hf.py --dspark build/dspark --shapes qwen3-8b,qwen3-1.7b \\
      --workdir /tmp/bench --results bench/RESULTS.md [--batch 1] [--prompt-len 128] \\
      [--gen 128] [--skip-compile] [--out DIR]
"""
import argparse
import datetime
import gc
import inspect
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback

SEED = 1234
INIT_STD = 0.02
SHARD_LIMIT_BYTES = 4 * 10**9
DSPARK_TIMEOUT_S = 400
COMPILE_LIMIT_S = 240
EAGER_WARMUP_STEPS = 5
COMPILE_WARMUP_STEPS = 10
VERIFY_KS = (1, 2, 4, 8, 16, 32)

VOCAB_SIZE = 151936
HEAD_DIM = 128

# The real Qwen3 shapes (the rest of the config is shared, see hf_config).
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
}


def log(message=""):
    print(message, flush=True)


def short_error(error):
    """One line for an exception: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def atomic_write_text(path, text):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temp = f"{path}.tmp.{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(temp, path)


# ---------------------------------------------------------------------------
# 1. The random-weight checkpoint
# ---------------------------------------------------------------------------

def hf_config(shape):
    s = SHAPES[shape]
    layers = s["num_hidden_layers"]
    try:
        import transformers
        version = transformers.__version__
    except Exception:
        version = "5.17.0"
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 151645,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": INIT_STD,
        "intermediate_size": s["intermediate_size"],
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": s["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None,
        "tie_word_embeddings": s["tie_word_embeddings"],
        "transformers_version": version,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def tensor_specs(shape):
    """[(name, shape tuple, is_norm)] in HF Qwen3 naming, in file order."""
    s = SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    q_dim = s["num_attention_heads"] * HEAD_DIM
    kv_dim = s["num_key_value_heads"] * HEAD_DIM
    specs = [("model.embed_tokens.weight", (VOCAB_SIZE, hidden), False)]
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,), True),
            (p + "self_attn.q_proj.weight", (q_dim, hidden), False),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden), False),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden), False),
            (p + "self_attn.o_proj.weight", (hidden, q_dim), False),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,), True),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,), True),
            (p + "post_attention_layernorm.weight", (hidden,), True),
            (p + "mlp.gate_proj.weight", (inter, hidden), False),
            (p + "mlp.up_proj.weight", (inter, hidden), False),
            (p + "mlp.down_proj.weight", (hidden, inter), False),
        ]
    specs.append(("model.norm.weight", (hidden,), True))
    if not s["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (VOCAB_SIZE, hidden), False))
    return specs


def spec_bytes(dims):
    count = 1
    for d in dims:
        count *= d
    return 2 * count  # bf16


def plan_shards(specs):
    """Groups the tensors, in order, into shards of at most SHARD_LIMIT_BYTES."""
    shards, current, current_bytes = [], [], 0
    for spec in specs:
        size = spec_bytes(spec[1])
        if current and current_bytes + size > SHARD_LIMIT_BYTES:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def checkpoint_weight_bytes(directory):
    with open(os.path.join(directory, "model.safetensors.index.json"), encoding="utf-8") as file:
        return int(json.load(file)["metadata"]["total_size"])


def write_checkpoint(shape, directory):
    """Writes the checkpoint unless a complete one is there; returns a dict of what was done."""
    import torch
    from safetensors.torch import save_file

    marker = os.path.join(directory, ".complete")
    if os.path.exists(marker):
        weight_bytes = checkpoint_weight_bytes(directory)
        log(f"[{shape}] checkpoint already complete in {directory} ({weight_bytes / 1e9:.2f} GB)")
        return {"written": False, "weight_bytes": weight_bytes}

    os.makedirs(directory, exist_ok=True)
    specs = tensor_specs(shape)
    shards = plan_shards(specs)
    total = sum(spec_bytes(dims) for _, dims, _ in specs)
    log(f"[{shape}] writing a random bf16 checkpoint: {len(specs)} tensors, "
        f"{total / 1e9:.2f} GB in {len(shards)} shards, to {directory}")

    generator = torch.Generator(device="cuda")
    generator.manual_seed(SEED)
    weight_map = {}
    written = 0
    start = time.perf_counter()
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, dims, is_norm in shard:
            values = torch.randn(dims, generator=generator, device="cuda", dtype=torch.float32)
            values.mul_(INIT_STD)
            if is_norm:
                values.add_(1.0)
            tensors[name] = values.to(torch.bfloat16).cpu()
            del values
            weight_map[name] = file_name
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        shard_start = time.perf_counter()
        temp = os.path.join(directory, file_name + ".tmp")
        save_file(tensors, temp, metadata={"format": "pt"})
        os.replace(temp, os.path.join(directory, file_name))
        seconds = time.perf_counter() - shard_start
        written += shard_bytes
        del tensors
        log(f"[{shape}]   {file_name}: {shard_bytes / 1e9:.2f} GB in {seconds:.1f} s "
            f"({shard_bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s); "
            f"{written / 1e9:.2f}/{total / 1e9:.2f} GB")

    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(os.path.join(directory, "model.safetensors.index.json"),
                      json.dumps(index_json, indent=2) + "\n")
    atomic_write_text(os.path.join(directory, "config.json"),
                      json.dumps(hf_config(shape), indent=2) + "\n")
    atomic_write_text(os.path.join(directory, "generation_config.json"),
                      json.dumps({"bos_token_id": None, "eos_token_id": 151645}, indent=2) + "\n")
    seconds = time.perf_counter() - start
    atomic_write_text(marker, json.dumps({"shape": shape, "seed": SEED, "total_size": total}) + "\n")

    del generator
    gc.collect()
    torch.cuda.empty_cache()
    log(f"[{shape}] checkpoint written: {total / 1e9:.2f} GB in {seconds:.1f} s "
        f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s overall)")
    return {"written": True, "weight_bytes": total, "write_s": seconds}


# ---------------------------------------------------------------------------
# 2. dspark
# ---------------------------------------------------------------------------

def parse_json_object(text):
    """The JSON object in dspark's stdout: the whole text, else its last line that parses."""
    text = text.strip()
    try:
        value = json.loads(text)
        if isinstance(value, dict):
            return value
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
            except ValueError:
                continue
    first, last = text.find("{"), text.rfind("}")
    if 0 <= first < last:
        value = json.loads(text[first:last + 1])
        if isinstance(value, dict):
            return value
    raise ValueError("no JSON object in dspark's stdout")


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def run_dspark(shape, dspark, directory, args):
    command = [dspark, "bench", "decode", "-m", directory, "--device", "cuda",
               "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
               "--gen", str(args.gen), "--json"]
    log(f"[{shape}] dspark: {shlex.join(command)}")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DSPARK_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else (error.stderr or "")
        log(f"[{shape}] dspark timed out after {DSPARK_TIMEOUT_S} s\n{tail(stderr)}")
        return {"error": f"timeout after {DSPARK_TIMEOUT_S} s", "stderr_tail": tail(stderr)}
    except OSError as error:
        log(f"[{shape}] dspark could not be started: {error}")
        return {"error": f"could not start {dspark}: {error}"}
    seconds = time.perf_counter() - start
    if done.stderr.strip():
        log(f"[{shape}] dspark stderr (last lines):\n{tail(done.stderr)}")
    if done.returncode != 0:
        message = tail(done.stderr, 3) or tail(done.stdout, 3) or "(no output)"
        log(f"[{shape}] dspark failed with exit status {done.returncode}")
        return {"error": f"exit status {done.returncode}: {message}", "stderr_tail": tail(done.stderr)}
    try:
        result = parse_json_object(done.stdout)
    except ValueError as error:
        log(f"[{shape}] dspark's output could not be parsed: {error}\n{tail(done.stdout)}")
        return {"error": f"unparsable output: {error}", "stdout_tail": tail(done.stdout)}
    result["wall_s"] = seconds
    log(f"[{shape}] dspark: {fmt(result.get('ms_per_step'), 3)} ms/step, "
        f"{fmt(result.get('tokens_per_s'), 1)} tokens/s ({seconds:.1f} s wall)")
    return result


# ---------------------------------------------------------------------------
# 3 and 4. Hugging Face transformers
# ---------------------------------------------------------------------------

class CompileTimeout(BaseException):
    """Raised by SIGALRM while compiling. A BaseException, so that torch's own
    `except Exception` handlers do not swallow it."""


def load_hf_model(directory):
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")
    except Exception as error:
        log(f"  from_pretrained(device_map='cuda') failed ({short_error(error)}); loading on the CPU, then .to('cuda')")
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        except TypeError:
            model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16)
        model = model.to("cuda")
    model.eval()
    log(f"  loaded in {time.perf_counter() - start:.1f} s; attention: "
        f"{getattr(model.config, '_attn_implementation', 'unknown')}")
    return model


def forward_parameters(model):
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def make_dynamic_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def make_static_cache(model, batch, max_len):
    """StaticCache across transformers versions: 5.x and >= 4.56 take (config, max_cache_len)
    and allocate lazily at the first update; 4.4x-4.55 need max_batch_size, device, dtype;
    older ones batch_size."""
    import torch
    from transformers import StaticCache

    attempts = [
        dict(config=model.config, max_cache_len=max_len),
        dict(config=model.config, max_batch_size=batch, max_cache_len=max_len,
             device=torch.device("cuda"), dtype=torch.bfloat16),
        dict(config=model.config, batch_size=batch, max_cache_len=max_len,
             device=torch.device("cuda"), dtype=torch.bfloat16),
    ]
    errors = []
    for kwargs in attempts:
        try:
            return StaticCache(**kwargs)
        except TypeError as error:
            errors.append(f"{sorted(kwargs)}: {error}")
    raise RuntimeError("no known StaticCache constructor fits: " + " | ".join(errors))


def random_prompts(batch, prompt_len):
    import torch
    generator = torch.Generator(device="cpu")
    generator.manual_seed(SEED)
    ids = torch.randint(0, VOCAB_SIZE, (batch, prompt_len), generator=generator, dtype=torch.long)
    return ids.to("cuda")


def prefill(model, prompts, cache, params):
    """Runs the prompt through the uncompiled model; returns the first generated token [B, 1]."""
    import torch
    kwargs = dict(input_ids=prompts, past_key_values=cache, use_cache=True)
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(prompts.shape[1], device=prompts.device)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    return out.logits[:, -1, :].argmax(dim=-1, keepdim=True)


def make_step(forward, cache, positions, mark_step=None):
    """One greedy decode step: feeds token [B, 1] at positions[i] (when given) and returns the next."""
    def step(token, i):
        kwargs = dict(input_ids=token, past_key_values=cache, use_cache=True)
        if positions is not None:
            kwargs["cache_position"] = positions[i:i + 1]
        if mark_step is not None:
            mark_step()
        out = forward(**kwargs)
        return out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
    return step


def timed_decode(step, token, n_steps, warmup, check=None, on_warmup_done=None):
    """Runs n_steps decode steps. The first `warmup` are timed on the wall clock (synchronized)
    and call check(elapsed_s) after each; then on_warmup_done(); the rest are bracketed by
    CUDA events. Returns (list of ms per timed step, list of s per warm-up step)."""
    import torch
    warm_s = []
    for i in range(warmup):
        start = time.perf_counter()
        token = step(token, i)
        torch.cuda.synchronize()
        warm_s.append(time.perf_counter() - start)
        if check is not None:
            check(sum(warm_s))
    if on_warmup_done is not None:
        on_warmup_done()
    events = []
    for i in range(warmup, n_steps):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        token = step(token, i)
        end.record()
        events.append((begin, end))
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) for begin, end in events], warm_s


def summarize(step_ms, batch):
    median = statistics.median(step_ms)
    return {"ms_per_step": median, "tokens_per_s": batch / (median / 1e3),
            "steps_timed": len(step_ms), "ms_min": min(step_ms), "ms_max": max(step_ms)}


def run_hf_eager(model, args):
    import torch
    with torch.no_grad():
        cache = make_dynamic_cache(model)
        token = prefill(model, random_prompts(args.batch, args.prompt_len), cache, forward_parameters(model))
        step = make_step(model, cache, positions=None)
        step_ms, _ = timed_decode(step, token, args.gen, EAGER_WARMUP_STEPS)
    del cache
    result = summarize(step_ms, args.batch)
    result["warmup_steps"] = EAGER_WARMUP_STEPS
    return result


def run_hf_compiled(model, args):
    """Static cache + torch.compile(reduce-overhead). Returns a result dict with 'status'."""
    import torch

    params = forward_parameters(model)
    mark_step = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    state = {"alarm": False}

    def on_alarm(signum, frame):
        state["alarm"] = True
        raise CompileTimeout()

    def check(elapsed):
        if state["alarm"] or elapsed > COMPILE_LIMIT_S:
            raise CompileTimeout()

    result = {"warmup_steps": COMPILE_WARMUP_STEPS}
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with torch.no_grad():
            cache = make_static_cache(model, args.batch, args.prompt_len + args.gen)
            token = prefill(model, random_prompts(args.batch, args.prompt_len), cache, params)
            # Transformers 5 models no longer take cache_position (the StaticCache counts
            # its own length); older ones need it, or the static cache writes at slot 0.
            positions = None
            if "cache_position" in params:
                positions = torch.arange(args.prompt_len, args.prompt_len + args.gen, device="cuda")
            compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
            step = make_step(compiled, cache, positions, mark_step)
            signal.alarm(COMPILE_LIMIT_S)
            try:
                step_ms, warm_s = timed_decode(step, token, args.gen, COMPILE_WARMUP_STEPS, check,
                                               on_warmup_done=lambda: signal.alarm(0))
            finally:
                signal.alarm(0)
        result.update(summarize(step_ms, args.batch))
        result["compile_s"] = warm_s[0]
        result["warmup_s"] = sum(warm_s)
        result["status"] = "ok"
        log(f"  compile (first step) {warm_s[0]:.1f} s; warm-up {sum(warm_s):.1f} s "
            f"over {len(warm_s)} steps; steps: " + ", ".join(f"{s * 1e3:.1f}" for s in warm_s) + " ms")
    except CompileTimeout:
        log(f"  torch.compile abandoned: compilation/warm-up took more than {COMPILE_LIMIT_S} s")
        result = {"status": "timeout", "error": f"compile/warm-up > {COMPILE_LIMIT_S} s"}
    except Exception as error:
        log(f"  torch.compile path failed: {short_error(error)}")
        traceback.print_exc()
        sys.stderr.flush()
        result = {"status": "error", "error": short_error(error)}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous_handler)
    return result


def run_hf(shape, directory, args):
    """Both HF engines on one loaded model; returns (eager result, compiled result, info)."""
    import torch
    eager = {"error": "not run"}
    compiled = {"status": "skipped", "error": "--skip-compile"} if args.skip_compile else {"error": "not run"}
    info = {}
    model = None
    try:
        import transformers
        info["transformers"] = transformers.__version__
        info["torch"] = torch.__version__
        log(f"[{shape}] HF transformers {transformers.__version__}, torch {torch.__version__}: loading")
        model = load_hf_model(directory)
        info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    except Exception as error:
        log(f"[{shape}] HF model could not be loaded: {short_error(error)}")
        traceback.print_exc()
        sys.stderr.flush()
        message = f"load failed: {short_error(error)}"
        if not args.skip_compile:
            compiled = {"status": "skipped", "error": message}
        return {"error": message}, compiled, info

    try:
        log(f"[{shape}] HF eager (DynamicCache): {args.gen} decode steps, {EAGER_WARMUP_STEPS} warm-up")
        eager = run_hf_eager(model, args)
        log(f"[{shape}] HF eager: {eager['ms_per_step']:.3f} ms/step, {eager['tokens_per_s']:.1f} tokens/s")
    except Exception as error:
        log(f"[{shape}] HF eager failed: {short_error(error)}")
        traceback.print_exc()
        sys.stderr.flush()
        eager = {"error": short_error(error)}
    gc.collect()
    torch.cuda.empty_cache()

    if not args.skip_compile:
        log(f"[{shape}] HF static cache + torch.compile(reduce-overhead): {args.gen} decode steps, "
            f"{COMPILE_WARMUP_STEPS} warm-up (limit {COMPILE_LIMIT_S} s)")
        compiled = run_hf_compiled(model, args)
        if compiled.get("status") == "ok":
            log(f"[{shape}] HF compiled: {compiled['ms_per_step']:.3f} ms/step, "
                f"{compiled['tokens_per_s']:.1f} tokens/s")

    del model
    free_gpu()
    return eager, compiled, info


def free_gpu():
    import torch
    try:
        torch._dynamo.reset()
    except Exception as error:
        log(f"  torch._dynamo.reset() failed: {short_error(error)}")
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# 5. Roofline
# ---------------------------------------------------------------------------

def measure_copy_bandwidth(nbytes=4 * 1024**3, repeats=10):
    """Device-to-device copy bandwidth in GB/s: 2 * bytes / time (a read and a write), median."""
    import torch
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(2):
        target.copy_(source)
    times = []
    for _ in range(repeats):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    del source, target
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) / 1e3) / 1e9


def estimate_bytes_per_step(shape, weight_bytes, args):
    """Weights read per step (an untied embedding table is only gathered, not read) plus
    the KV cache at the mean context length P + N/2."""
    s = SHAPES[shape]
    read = weight_bytes
    if not s["tie_word_embeddings"]:
        read -= VOCAB_SIZE * s["hidden_size"] * 2
    kv_per_token = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * HEAD_DIM * 2
    return read + args.batch * kv_per_token * (args.prompt_len + args.gen / 2)


# ---------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------

def run_shape(shape, args, bandwidth_cache):
    start = time.perf_counter()
    directory = os.path.join(args.workdir, shape)
    record = {"shape": shape, "dir": directory, "batch": args.batch,
              "prompt_len": args.prompt_len, "gen": args.gen}
    log(f"\n=== {shape} (batch {args.batch}, prompt {args.prompt_len}, gen {args.gen}) ===")

    try:
        record["checkpoint"] = write_checkpoint(shape, directory)
    except Exception as error:
        log(f"[{shape}] the checkpoint could not be written: {short_error(error)}")
        traceback.print_exc()
        sys.stderr.flush()
        record["error"] = f"checkpoint: {short_error(error)}"
        return record
    record["weight_bytes"] = record["checkpoint"]["weight_bytes"]

    record["dspark"] = run_dspark(shape, args.dspark, directory, args)
    eager, compiled, info = run_hf(shape, directory, args)
    record["hf_eager"], record["hf_compile"], record["hf_info"] = eager, compiled, info

    dspark = record["dspark"]
    if isinstance(dspark.get("copy_gb_per_s"), (int, float)) and dspark["copy_gb_per_s"] > 0:
        record["copy_gb_per_s"], record["copy_source"] = float(dspark["copy_gb_per_s"]), "dspark"
    else:
        if "value" not in bandwidth_cache:
            try:
                log(f"[{shape}] measuring device-to-device copy bandwidth (4 GiB)")
                bandwidth_cache["value"] = measure_copy_bandwidth()
                log(f"[{shape}] copy bandwidth: {bandwidth_cache['value']:.0f} GB/s")
            except Exception as error:
                log(f"[{shape}] copy bandwidth could not be measured: {short_error(error)}")
                bandwidth_cache["value"] = None
        record["copy_gb_per_s"], record["copy_source"] = bandwidth_cache["value"], "torch copy"
    if isinstance(dspark.get("bytes_per_step"), (int, float)) and dspark["bytes_per_step"] > 0:
        record["bytes_per_step"], record["bytes_per_step_source"] = float(dspark["bytes_per_step"]), "dspark"
    else:
        record["bytes_per_step"] = estimate_bytes_per_step(shape, record["weight_bytes"], args)
        record["bytes_per_step_source"] = "estimate"
    if record["copy_gb_per_s"]:
        record["roofline_tokens_per_s"] = args.batch * record["copy_gb_per_s"] * 1e9 / record["bytes_per_step"]
    else:
        record["roofline_tokens_per_s"] = None

    record["wall_s"] = time.perf_counter() - start
    log(f"[{shape}] done in {record['wall_s']:.0f} s")
    return record


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def fmt(value, digits):
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return "n/a"


def engine_rows(record):
    """[(engine, shape, batch, ms, tokens/s, % roofline, x HF eager, note)] for one shape."""
    shape, batch = record["shape"], record["batch"]
    if "error" in record and "dspark" not in record:
        return [("all", shape, batch, None, None, None, None, record["error"])]
    roofline = record.get("roofline_tokens_per_s")
    eager_tps = record["hf_eager"].get("tokens_per_s")
    rows = []
    for engine, key in (("dspark", "dspark"), ("hf-eager", "hf_eager"), ("hf-compile", "hf_compile")):
        result = record.get(key, {})
        tps = result.get("tokens_per_s")
        ms = result.get("ms_per_step")
        if not isinstance(tps, (int, float)):
            note = result.get("error") or result.get("status") or "no result"
            rows.append((engine, shape, batch, None, None, None, None, note))
            continue
        percent = 100.0 * tps / roofline if roofline else None
        speedup = tps / eager_tps if isinstance(eager_tps, (int, float)) and eager_tps > 0 else None
        rows.append((engine, shape, batch, ms, tps, percent, speedup, ""))
    return rows


def table_lines(records):
    lines = ["| engine | shape | batch | ms/step | tokens/s | % of roofline | × HF eager | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for record in records:
        for engine, shape, batch, ms, tps, percent, speedup, note in engine_rows(record):
            lines.append(f"| {engine} | {shape} | {batch} | {fmt(ms, 3)} | {fmt(tps, 1)} | "
                         f"{fmt(percent, 1)} | {fmt(speedup, 2)} | {note.replace('|', '/')} |")
    return lines


def verify_lines(records):
    header = "| shape | t(1) ms | " + " | ".join(f"k={k}" for k in VERIFY_KS) + " |"
    lines = [header, "|---|---:|" + "---:|" * len(VERIFY_KS)]
    for record in records:
        costs = record.get("dspark", {}).get("verify_cost")
        if not isinstance(costs, list) or not costs:
            lines.append(f"| {record['shape']} | n/a |" + " n/a |" * len(VERIFY_KS))
            continue
        by_k = {entry.get("k"): entry for entry in costs if isinstance(entry, dict)}
        t1 = by_k.get(1, {}).get("ms")
        cells = []
        for k in VERIFY_KS:
            entry = by_k.get(k, {})
            ratio = entry.get("ratio")
            if not isinstance(ratio, (int, float)) and isinstance(entry.get("ms"), (int, float)) and t1:
                ratio = entry["ms"] / t1
            cells.append(fmt(ratio, 2))
        lines.append(f"| {record['shape']} | {fmt(t1, 3)} | " + " | ".join(cells) + " |")
    return lines


def roofline_lines(records):
    lines = []
    for record in records:
        if "bytes_per_step" not in record:
            continue
        lines.append(
            f"- {record['shape']}: weights {record['weight_bytes'] / 1e9:.2f} GB; "
            f"bytes/step {record['bytes_per_step'] / 1e9:.3f} GB ({record['bytes_per_step_source']}); "
            f"copy {fmt(record['copy_gb_per_s'], 0)} GB/s ({record['copy_source']}); "
            f"roofline {fmt(record['roofline_tokens_per_s'], 1)} tokens/s")
    return lines


def markdown_section(records, gpu, command, args, versions):
    date = datetime.date.today().isoformat()
    lines = [f"## {date} decode, {gpu}", "", "```sh", command, "```", "",
             f"Random-weight bf16 checkpoints, batch {args.batch}, prompt {args.prompt_len} tokens, "
             f"{args.gen} greedy decode steps; median step time after warm-up. HF: CUDA events around "
             f"each step ({EAGER_WARMUP_STEPS} warm-up steps eager, {COMPILE_WARMUP_STEPS} compiled); dspark: "
             f"host clock around each complete, synchronised step (3 warm-up steps), so its numbers "
             f"include every host overhead of its decode loop. {versions}", ""]
    lines += table_lines(records)
    lines += ["", "Roofline (B × copy bandwidth / bytes per step):", ""]
    lines += roofline_lines(records) or ["- n/a"]
    lines += ["", "dspark verify cost t(k)/t(1):", ""]
    lines += verify_lines(records)
    return "\n".join(lines) + "\n"


def append_results(path, section):
    old = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            old = file.read()
    if old and not old.endswith("\n"):
        old += "\n"
    if old and not old.endswith("\n\n"):
        old += "\n"
    atomic_write_text(path, old + section)


# ---------------------------------------------------------------------------

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dspark", required=True, help="the dspark binary, e.g. build/dspark")
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-1.7b",
                        help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--workdir", required=True, help="where the checkpoints are written (<workdir>/<shape>/)")
    parser.add_argument("--results", required=True, help="markdown file a dated section is appended to")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--skip-compile", action="store_true", help="skip the static cache + torch.compile engine")
    parser.add_argument("--checkpoints-only", action="store_true",
                        help="only write the checkpoints (for benchmarking dspark alone)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="folder for decode_vs_hf.json (default: $OUT if set, else none)")
    args = parser.parse_args()
    if args.batch < 1 or args.prompt_len < 1:
        parser.error("--batch and --prompt-len must be at least 1")
    if args.gen <= COMPILE_WARMUP_STEPS + 1:
        parser.error(f"--gen must be more than {COMPILE_WARMUP_STEPS + 1} (warm-up steps are not timed)")
    return args


def main():
    args = parse_args()
    command = "python3 " + shlex.join(sys.argv)
    try:
        import torch
    except ImportError as error:
        log(f"error: PyTorch is needed ({error})")
        return 2
    if not torch.cuda.is_available():
        log("error: no CUDA device is visible to PyTorch")
        return 2
    gpu = torch.cuda.get_device_name(0)
    try:
        import transformers
        versions = f"torch {torch.__version__}, transformers {transformers.__version__}."
    except Exception:
        versions = f"torch {torch.__version__}, transformers not importable."
    log(f"GPU: {gpu}; {versions}")
    log(f"command: {command}")
    if not os.path.exists(args.dspark):
        log(f"warning: {args.dspark} does not exist; the dspark rows will record the error")

    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    if args.checkpoints_only:
        for shape in shapes:
            write_checkpoint(shape, os.path.join(args.workdir, shape))
            free_gpu()
        return 0
    records = []
    bandwidth_cache = {}
    for shape in shapes:
        if shape not in SHAPES:
            log(f"error: unknown shape {shape!r} (known: {', '.join(SHAPES)}); skipped")
            records.append({"shape": shape, "batch": args.batch, "error": "unknown shape"})
            continue
        try:
            records.append(run_shape(shape, args, bandwidth_cache))
        except Exception as error:
            log(f"[{shape}] failed: {short_error(error)}")
            traceback.print_exc()
            sys.stderr.flush()
            records.append({"shape": shape, "batch": args.batch, "error": short_error(error)})
        try:
            free_gpu()
        except Exception:
            pass

    log("\n" + "\n".join(table_lines(records)))
    log("\n" + "\n".join(roofline_lines(records)))
    log("\ndspark verify cost t(k)/t(1):\n" + "\n".join(verify_lines(records)))

    try:
        append_results(args.results, markdown_section(records, gpu, command, args, versions))
        log(f"\nappended to {args.results}")
    except OSError as error:
        log(f"error: could not write {args.results}: {error}")
    if args.out:
        path = os.path.join(args.out, "decode_vs_hf.json")
        raw = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu,
               "command": command, "versions": versions, "args": vars(args), "seed": SEED,
               "eager_warmup_steps": EAGER_WARMUP_STEPS, "compile_warmup_steps": COMPILE_WARMUP_STEPS,
               "shapes": records}
        try:
            atomic_write_text(path, json.dumps(raw, indent=2, default=str) + "\n")
            log(f"raw numbers in {path}")
        except OSError as error:
            log(f"error: could not write {path}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
