#!/usr/bin/env python3
"""Golden models and Hugging Face reference outputs for the CPU tests.

Runs where PyTorch, transformers and tokenizers are installed (the device
machine); needs no GPU. It writes, under --out:

  qwen3/            a random-weight `qwen3` checkpoint (f32, one safetensors file,
                    tied embeddings, q/k norms, head_dim != hidden/heads) with a
                    Qwen-style byte-level BPE tokenizer (NFC, Qwen split regex,
                    ChatML template, non-special added tokens)
  llama/            a random-weight `llama` checkpoint (f32, sharded, untied,
                    GQA, Llama-3 rope scaling) with a Llama-3-style tokenizer
                    (ignore_merges, BOS post-processor, header chat template)
  gpt2-tokenizer/   a GPT-2-style tokenizer only (ByteLevel regex, prefix space)

and in each, reference/:
  tokenization.json  HF token ids / decodes / chat renders for varied text
  forward.json       prompts (ids), taps, greedy continuations, perplexities
  forward.safetensors  logits [T, V] and taps [T, L+1, H] per prompt (f32,
                     computed in float64 by transformers on the CPU)
  weights_bf16.safetensors, weights_f16.safetensors (qwen3 only): the
                     checkpoint cast by torch, to check our dtype conversion
  perplexity.txt     the text the perplexity references score

Every weight is drawn from a seeded generator and scaled so that logits are
far from uniform (a random model with HF's default 0.02 init predicts nearly
uniformly, which would make greedy tokens a coin toss between near-ties).
"""
import argparse
import json
import math
import os
import pathlib
import sys

import torch
import tokenizers
import transformers
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

MULTILINGUAL = """\
Größere Übungen: naïve café, façade, coöperate. Ελληνικά γράμματα και λέξεις.
Русский текст для проверки токенизатора. 日本語のテキストと漢字、カタカナ。
中文分词测试：今天天气很好，我们去公园散步吧。 한국어 문장도 있습니다.
Emoji: 🙂🚀🔥 — dashes – and “quotes” ‘single’ … ellipsis. Ünïcödé ﬁ ligature.
"""

# Text the tokenizer goldens cover: code, prose, Unicode, whitespace runs,
# numbers, contractions, special and added tokens in the text.
TOKENIZATION_TEXTS = [
    "Hello, world!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 2026; they'll say I'M sure you'd've known.",
    "Numbers: 1234567890, 3.14159, -42, 1e-6, 0x1F, 1,000,000.",
    "    leading spaces\t\ttabs\n\n\n\nnewlines   trailing   ",
    " " * 37 + "x" + "\n" * 5 + " \n \n",
    "naïve café — “quotes” 🙂🚀 日本語のテキスト 中文 Русский Ελληνικά",
    "e\u0301 vs \u00e9, A\u030a vs \u00c5, \ufb01 ligature, \u2163 roman",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y <|endoftext|> z",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
    "a  <|reserved_special_token_0|>  b",
    "",
    " ",
    "\n",
    "!!!???...,,,;;;:::",
    "MixedCASE camelCase snake_case kebab-case SCREAMING_CASE",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ and　ideographic　space",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "ab" * 300,
    " ".join(str(i) for i in range(40)),
]

PROMPTS = [
    "def add(a, b):\n    return a + b\n\nprint(add(",
    "The history of the city begins in the early years of the",
    "naïve café 🙂 日本語 — “quotes”",
    "    indented\n\n\tlines   with   spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir(",
]

CHAT_CASES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "  Write a haiku about\n tokens.  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to 3: 1, 2, 3 🙂"}],
]

GREEDY_TOKENS = 24


def corpus_files():
    stdlib = pathlib.Path(os.__file__).parent
    return sorted(p for p in stdlib.glob("*.py"))[:160]


def corpus_text():
    pieces = [MULTILINGUAL] * 20
    for path in corpus_files():
        pieces.append(path.read_text(encoding="utf-8", errors="replace"))
    return pieces


def train_tokenizer(kind, vocab_size):
    """A byte-level BPE tokenizer built like the real family's tokenizer.json."""
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama")))
    if kind == "qwen3":
        tok.normalizer = normalizers.NFC()
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    else:
        pattern = QWEN_PATTERN if kind == "qwen3" else LLAMA_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text(), trainer=trainer)
    if kind == "qwen3":
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                "<|end_header_id|>", "<|eot_id|>"])
        tok.add_special_tokens([AddedToken("<|reserved_special_token_0|>", special=True,
                                           lstrip=True, rstrip=True, normalized=False)])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
    else:
        tok.add_special_tokens(["<|endoftext|>"])
    return tok


def tokenizer_config(kind, max_positions):
    if kind == "qwen3":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "model_max_length": max_positions, "chat_template": CHATML_TEMPLATE}
    if kind == "llama":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "model_max_length": max_positions,
                "chat_template": LLAMA3_TEMPLATE}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "model_max_length": 1024}


def render_chat(directory, messages):
    """transformers' own chat rendering of the directory's template (falling back
    to jinja2 configured as transformers configures it, if the class is refused)."""
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - reported, then the fallback renders
        print(f"AutoTokenizer refused {directory}: {error}; rendering with jinja2", file=sys.stderr)
        import jinja2.sandbox
        config = json.loads((directory / "tokenizer_config.json").read_text())
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return environment.from_string(config["chat_template"]).render(
            messages=messages, add_generation_prompt=True, bos_token=config.get("bos_token") or "",
            eos_token=config.get("eos_token") or "")


def rope_arguments(theta, scaling=None):
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta} if scaling is None
                else {**scaling, "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": scaling}


def tokenization_reference(tok, directory, with_chat):
    cases = []
    for text in TOKENIZATION_TEXTS + [MULTILINGUAL, corpus_files()[3].read_text()[:3000]]:
        plain = tok.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": tok.encode(text).ids, "ids_plain": plain,
                      "decoded": tok.decode(plain, skip_special_tokens=False),
                      "decoded_skip_special": tok.decode(plain, skip_special_tokens=True)})
    reference = {"cases": cases}
    if with_chat:
        reference["chat"] = []
        for messages in CHAT_CASES:
            text = render_chat(directory, messages)
            reference["chat"].append({"messages": messages, "add_generation_prompt": True,
                                      "text": text,
                                      "ids": tok.encode(text, add_special_tokens=False).ids})
    return reference


def init_weights(model, seed, head_std, output_gain):
    """Seeded weights far from uniform: unit-gain projections (o/down scaled by
    output_gain so the layers, not the token's own embedding, dominate the
    residual stream), ~N(1, 0.2) norms, embeddings and head ~N(0, head_std)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            if "norm" in name:
                value = 1.0 + 0.2 * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = head_std * noise
            elif "bias" in name:
                value = 0.1 * noise
            else:  # nn.Linear weight [out, in]
                gain = 1.0
                if any(p in name for p in ("q_proj", "k_proj")):
                    gain = 1.5
                if any(p in name for p in ("o_proj", "down_proj")):
                    gain = output_gain
                value = gain * noise / math.sqrt(parameter.shape[1])
            parameter.copy_(value.to(parameter.dtype))


# Candidate (head_std, output_gain) per family, tried in order: the first whose
# greedy continuations are diverse and free of near-ties is kept. A tied-embedding
# random model tends to predict its own input token forever, which would make
# the greedy golden a weak test.
WEIGHT_SCALES = [(0.5, 1.0), (0.3, 2.0), (0.25, 3.0), (0.2, 4.0), (0.15, 5.0)]


def model_config(kind, vocab_size, tok):
    if kind == "qwen3":
        return transformers.Qwen3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
            bos_token_id=None, **rope_arguments(1000000.0),
            eos_token_id=[tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        **rope_arguments(500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=[tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")])


def build_model(kind, vocab_size, tok):
    config = model_config(kind, vocab_size, tok)
    model_class = transformers.Qwen3ForCausalLM if kind == "qwen3" else transformers.LlamaForCausalLM
    for head_std, output_gain in WEIGHT_SCALES:
        model = model_class(config).float().eval()
        init_weights(model, seed=1234 if kind == "qwen3" else 5678, head_std=head_std,
                     output_gain=output_gain)
        probe = model.double()
        tapper = Tapper(probe)
        cases = [greedy(probe, tapper, tok.encode(PROMPTS[i]).ids, 16) for i in (0, 1, 2)]
        diverse = all(len(set(tokens)) >= 8 for tokens, _ in cases)
        margin = min(m for _, m in cases)
        print(f"{kind}: head_std {head_std}, output_gain {output_gain}: distinct "
              f"{[len(set(t)) for t, _ in cases]}, smallest top-2 margin {margin:.4f}")
        if diverse and margin > 1e-3:
            return probe.float(), (head_std, output_gain)
    raise SystemExit(f"{kind}: no weight scale gives diverse greedy continuations")


class Tapper:
    """Records the output of every decoder layer and the post-final-norm hidden."""

    def __init__(self, model):
        self.rows = {}
        layers = model.model.layers
        for index, layer in enumerate(layers):
            layer.register_forward_hook(self._hook(index))
        model.model.norm.register_forward_hook(self._hook(len(layers)))

    def _hook(self, index):
        def hook(module, inputs, output):
            self.rows[index] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def taps(self):
        return torch.stack([self.rows[i][0] for i in sorted(self.rows)], dim=1)  # [T, L+1, H]


def forward(model, tapper, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0], tapper.taps()


def greedy(model, tapper, ids, count):
    """Greedy continuation and the smallest gap between the top two logits seen."""
    ids = list(ids)
    generated, margin = [], math.inf
    for _ in range(count):
        logits, _ = forward(model, tapper, ids)
        top = torch.topk(logits[-1], 2).values
        margin = min(margin, float(top[0] - top[1]))
        token = int(torch.argmax(logits[-1]))
        generated.append(token)
        ids.append(token)
    return generated, margin


def perplexity(model, tapper, ids, context):
    """Windows of `context` tokens advancing by context/2; each window scores the
    tokens no earlier window scored (all but the first token overall)."""
    total, scored, begin, scored_until = 0.0, 0, 0, 1
    stride = max(1, context // 2)
    while True:
        end = min(begin + context, len(ids))
        logits, _ = forward(model, tapper, ids[begin:end])
        log_probs = torch.log_softmax(logits, dim=-1)
        for position in range(max(scored_until, begin + 1), end):
            total -= float(log_probs[position - 1 - begin, ids[position]])
            scored += 1
        scored_until = end
        if end == len(ids):
            break
        begin += stride
    return {"context": context, "nll": total, "tokens": scored, "ppl": math.exp(total / scored)}


def make_model_golden(kind, out):
    directory = out / kind
    reference = directory / "reference"
    reference.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(kind, vocab_size=1000)
    tok.save(str(directory / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if kind == "qwen3":
        vocab_size = (vocab_size + 63) // 64 * 64 + 64  # padded past the tokenizer, like Qwen
    max_positions = 256 if kind == "qwen3" else 512
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(kind, max_positions), indent=2, ensure_ascii=False))

    model, (head_std, output_gain) = build_model(kind, vocab_size, tok)
    if kind == "llama":
        model.save_pretrained(str(directory), safe_serialization=True, max_shard_size="700KB")
    else:
        model.save_pretrained(str(directory), safe_serialization=True)
    eos = model.config.eos_token_id
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": model.config.bos_token_id, "eos_token_id": eos}, indent=2))

    # Everything below reads the checkpoint back from disk, in float64.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager")
    model = model.double().eval()
    expected_rope = "llama3" if kind == "llama" else "default"
    assert model.model.rotary_emb.rope_type == expected_rope, model.model.rotary_emb.rope_type
    print((directory / "config.json").read_text())
    tapper = Tapper(model)

    (reference / "tokenization.json").write_text(
        json.dumps(tokenization_reference(tok, directory, True), indent=1, ensure_ascii=False))

    tensors, prompts = {}, []
    for index, text in enumerate(PROMPTS):
        ids = tok.encode(text).ids
        logits, taps = forward(model, tapper, ids)
        tensors[f"logits.{index}"] = logits.float().contiguous()
        tensors[f"taps.{index}"] = taps.float().contiguous()
        prompts.append({"text": text, "ids": ids})
    greedy_cases = []
    for index in (0, 1, 2):
        tokens, margin = greedy(model, tapper, prompts[index]["ids"], GREEDY_TOKENS)
        greedy_cases.append({"prompt": index, "tokens": tokens, "smallest_top2_margin": margin})
    ppl_text = corpus_files()[7].read_text(encoding="utf-8")[:2500]
    (reference / "perplexity.txt").write_text(ppl_text, encoding="utf-8")
    ppl_ids = tok.encode(ppl_text).ids
    assert len(ppl_ids) > max_positions, "perplexity text must exceed the context to test windows"
    perplexities = [perplexity(model, tapper, ppl_ids, max_positions), perplexity(model, tapper, ppl_ids, 64)]
    save_file(tensors, str(reference / "forward.safetensors"))
    (reference / "forward.json").write_text(json.dumps({
        "num_layers": model.config.num_hidden_layers, "vocab_size": vocab_size,
        "weight_scale": {"head_std": head_std, "output_gain": output_gain},
        "taps": "every decoder layer's output, then the post-final-norm hidden: [T, L+1, H]",
        "prompts": prompts, "greedy": greedy_cases,
        "perplexity": {"file": "perplexity.txt", "token_count": len(ppl_ids), "cases": perplexities},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }, indent=1, ensure_ascii=False))

    if kind == "qwen3":
        state = {k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(reference / "weights_bf16.safetensors"))
        save_file({k: v.to(torch.float16) for k, v in state.items()}, str(reference / "weights_f16.safetensors"))
    print(f"{kind}: vocab {vocab_size}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"greedy {greedy_cases[0]['tokens'][:8]}..., ppl {[round(c['ppl'], 4) for c in perplexities]}")


def make_tokenizer_golden(out):
    directory = out / "gpt2-tokenizer"
    (directory / "reference").mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer("gpt2", vocab_size=800)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config("gpt2", 1024), indent=2))
    (directory / "reference" / "tokenization.json").write_text(
        json.dumps(tokenization_reference(tok, directory, False), indent=1, ensure_ascii=False))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    for kind in ("qwen3", "llama"):
        make_model_golden(kind, args.out)
    make_tokenizer_golden(args.out)
    print("versions:", torch.__version__, transformers.__version__, tokenizers.__version__, file=sys.stderr)


if __name__ == "__main__":
    main()
