// The CPU target forward against transformers (float64) on the golden models:
// logits and taps of full prompts, incremental decoding through the KV cache,
// rollback, batching, greedy continuations and perplexity.
#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "golden.h"
#include "kernels/cpu/matmul.h"
#include "model/cpu_target.h"
#include "model/generate.h"
#include "model/perplexity.h"
#include "model/tokenizer.h"
#include "model/transformer.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::golden_reference;
using testing::relative_error;

constexpr double kTolerance = 1e-4;

class GoldenModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    model_ = load_transformer(golden_model(GetParam()));
    forward_ = golden_reference(GetParam(), "forward.json");
    reference_ = std::make_unique<SafetensorsFile>(golden_model(GetParam()) / "reference" / "forward.safetensors");
  }
  std::vector<int32_t> prompt(size_t index) const {
    return forward_["prompts"][index]["ids"].get<std::vector<int32_t>>();
  }
  Tensor reference(const std::string& name) const { return reference_->load_f32(name); }
  std::vector<int> all_taps() const {
    std::vector<int> taps;
    for (int j = 0; j <= model_.config.num_layers; ++j) taps.push_back(j);
    return taps;
  }

  Transformer model_;
  Json forward_;
  std::unique_ptr<SafetensorsFile> reference_;
};

TEST_P(GoldenModel, LogitsAndTapsMatchTransformers) {
  const int V = model_.config.vocab_size;
  for (size_t index = 0; index < forward_["prompts"].size(); ++index) {
    const auto ids = prompt(index);
    KVCache cache(model_.config, model_.config.max_positions);
    ForwardWorkspace workspace;
    ForwardOutput output;
    ForwardSequence sequence{&cache, ids, true};
    const auto taps = all_taps();
    transformer_forward(model_, {&sequence, 1}, taps, workspace, output);
    const Tensor logits = reference("logits." + std::to_string(index));
    const Tensor expected_taps = reference("taps." + std::to_string(index));
    ASSERT_EQ(logits.numel(), long(ids.size()) * V);
    ASSERT_EQ(expected_taps.numel(), long(output.taps.size()));
    EXPECT_LE(relative_error(output.logits.data(), logits.data, logits.numel()), kTolerance)
        << "prompt " << index;
    // Each tap on its own, so a wrong layer cannot hide behind the others.
    const int H = model_.config.hidden_size, m = static_cast<int>(taps.size());
    for (int slot = 0; slot < m; ++slot) {
      std::vector<float> ours, theirs;
      for (size_t row = 0; row < ids.size(); ++row)
        for (int i = 0; i < H; ++i) {
          ours.push_back(output.taps[(row * m + slot) * H + i]);
          theirs.push_back(expected_taps.data[(row * m + slot) * H + i]);
        }
      EXPECT_LE(relative_error(ours.data(), theirs.data(), ours.size()), kTolerance)
          << "prompt " << index << " tap " << taps[slot];
    }
  }
}

TEST_P(GoldenModel, IncrementalDecodeMatchesFullForward) {
  const int V = model_.config.vocab_size;
  const auto ids = prompt(1);
  const Tensor logits = reference("logits.1");
  KVCache cache(model_.config, 64);
  ForwardWorkspace workspace;
  ForwardOutput output;
  const size_t split = ids.size() / 2;
  ForwardSequence head{&cache, std::span(ids).first(split), false};
  transformer_forward(model_, {&head, 1}, {}, workspace, output);
  EXPECT_LE(relative_error(output.logits.data(), logits.data + (split - 1) * V, V), kTolerance);
  for (size_t position = split; position < ids.size(); ++position) {
    ForwardSequence step{&cache, std::span(ids).subspan(position, 1), false};
    transformer_forward(model_, {&step, 1}, {}, workspace, output);
    EXPECT_LE(relative_error(output.logits.data(), logits.data + position * V, V), kTolerance)
        << "position " << position;
  }
  EXPECT_EQ(cache.length(), int(ids.size()));
}

TEST_P(GoldenModel, RollbackLeavesNoTrace) {
  const int V = model_.config.vocab_size;
  const auto ids = prompt(0);
  const Tensor logits = reference("logits.0");
  KVCache cache(model_.config, 64);
  ForwardWorkspace workspace;
  ForwardOutput output;
  // Fill the cache with a wrong continuation, roll back, then feed the real one.
  const size_t keep = 5;
  ForwardSequence head{&cache, std::span(ids).first(keep), false};
  transformer_forward(model_, {&head, 1}, {}, workspace, output);
  std::vector<int32_t> wrong(6, 7);
  ForwardSequence detour{&cache, wrong, true};
  transformer_forward(model_, {&detour, 1}, {}, workspace, output);
  cache.truncate(keep);
  ForwardSequence rest{&cache, std::span(ids).subspan(keep), true};
  transformer_forward(model_, {&rest, 1}, {}, workspace, output);
  EXPECT_LE(relative_error(output.logits.data(), logits.data + keep * V, (ids.size() - keep) * V), kTolerance);
}

TEST_P(GoldenModel, BatchedSequencesMatchSeparateOnes) {
  const int V = model_.config.vocab_size;
  const auto first = prompt(0), second = prompt(2), third = prompt(3);
  KVCache cache_a(model_.config, 64), cache_b(model_.config, 64), cache_c(model_.config, 64);
  ForwardWorkspace workspace;
  ForwardOutput output;
  // Ragged batch: a prefill with all logits, a prefill with the last logit, and
  // a sequence that already has 3 tokens cached decoding its 4th.
  ForwardSequence warmup{&cache_c, std::span(third).first(3), false};
  transformer_forward(model_, {&warmup, 1}, {}, workspace, output);
  std::vector<ForwardSequence> batch = {{&cache_a, first, true}, {&cache_b, second, false},
                                        {&cache_c, std::span(third).subspan(3, 1), false}};
  const std::vector<int> taps = {model_.config.num_layers};
  transformer_forward(model_, batch, taps, workspace, output);
  ASSERT_EQ(output.logits.size(), (first.size() + 2) * V);
  const Tensor logits_a = reference("logits.0"), logits_b = reference("logits.2"), logits_c = reference("logits.3");
  EXPECT_LE(relative_error(output.logits.data(), logits_a.data, first.size() * V), kTolerance);
  EXPECT_LE(relative_error(output.logits.data() + first.size() * V, logits_b.data + (second.size() - 1) * V, V), kTolerance);
  EXPECT_LE(relative_error(output.logits.data() + (first.size() + 1) * V, logits_c.data + 3 * V, V), kTolerance);
  EXPECT_EQ(output.taps.size(), (first.size() + second.size() + 1) * model_.config.hidden_size);
}

TEST_P(GoldenModel, GreedyContinuationsMatchTransformers) {
  for (const auto& expected : forward_["greedy"]) {
    const auto ids = prompt(expected["prompt"].get<size_t>());
    const auto tokens = expected["tokens"].get<std::vector<int32_t>>();
    GenerateOptions options;
    options.max_new_tokens = static_cast<int>(tokens.size());
    options.ignore_eos = true;
    CpuTarget target(model_);
    EXPECT_EQ(generate(target, ids, options).tokens, tokens) << "prompt " << expected["prompt"];
  }
}

TEST_P(GoldenModel, PerplexityMatchesTransformers) {
  const Tokenizer tokenizer = Tokenizer::load(golden_model(GetParam()));
  const std::string text = read_text_file(golden_model(GetParam()) / "reference" / "perplexity.txt");
  const auto ids = tokenizer.encode(text);
  ASSERT_EQ(long(ids.size()), forward_["perplexity"]["token_count"].get<long>());
  for (const auto& expected : forward_["perplexity"]["cases"]) {
    CpuTarget target(model_);
    const PerplexityResult result = perplexity(target, ids, expected["context"].get<int>());
    EXPECT_EQ(result.tokens, expected["tokens"].get<long>());
    EXPECT_NEAR(result.nll / expected["nll"].get<double>(), 1.0, kTolerance) << "context " << expected["context"];
    EXPECT_NEAR(result.ppl / expected["ppl"].get<double>(), 1.0, kTolerance);
  }
}

TEST_P(GoldenModel, PromptThatFillsTheContextIsRefused) {
  std::vector<int32_t> ids(model_.config.max_positions, 5);
  CpuTarget target(model_);
  EXPECT_THROW(generate(target, ids, GenerateOptions{}), Error);
  EXPECT_THROW(generate(target, std::vector<int32_t>{}, GenerateOptions{}), Error);
}

TEST_P(GoldenModel, GenerationStopsAtTheContextEnd) {
  std::vector<int32_t> ids(model_.config.max_positions - 3, 5);
  GenerateOptions options;
  options.max_new_tokens = 10;
  options.ignore_eos = true;
  CpuTarget target(model_);
  const GenerateResult result = generate(target, ids, options);
  EXPECT_EQ(result.tokens.size(), 4u);  // 3 fed back, and the 4th sampled from the full cache
  EXPECT_EQ(result.stop_reason, "context");
}

INSTANTIATE_TEST_SUITE_P(Golden, GoldenModel, ::testing::Values("qwen3", "llama"));

// The weight's values rounded to bf16, in an owned copy (a loaded tensor maps the file read-only).
void round_to_bf16(Tensor& weight) {
  Tensor rounded = Tensor::zeros(weight.shape);
  for (long i = 0; i < weight.numel(); ++i) rounded.data[i] = bf16_to_f32(f32_to_bf16(weight.data[i]));
  weight = rounded;
}

// The golden qwen3 with its weights rounded to bf16 (a bf16 checkpoint's),
// without its packed bf16 copies yet.
Transformer golden_qwen3_in_bf16() {
  Transformer model = load_transformer(golden_model("qwen3"));
  EXPECT_TRUE(model.lm_head_bf16.empty()) << "the golden checkpoint is f32";
  for (LayerWeights& layer : model.layers)
    for (Tensor* weight : {&layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj, &layer.gate_proj, &layer.up_proj,
                           &layer.down_proj})
      round_to_bf16(*weight);
  round_to_bf16(model.embed_tokens);
  model.lm_head = model.embed_tokens;  // tied
  return model;
}

struct RestoreBf16Products {
  ~RestoreBf16Products() { cpu::set_bf16_products(false); }
};

// A model whose weights are bf16 values (a bf16 checkpoint) keeps packed
// bf16 copies for its few-row products (keep_bf16_weights). With f32
// activations its logits differ from the f32 tensors' only by the order of
// summation; with bf16 products (cpu::set_bf16_products, as HF transformers
// and the CUDA path run a bf16 model) by bf16 rounding. Either way a token
// verified inside an 8-token block gets the bits it gets decoded alone,
// which lossless speculative decoding needs. A prompt, decode steps, a block.
TEST(TransformerLoad, Bf16CopiesOfTheWeightsGiveTheSameLogits) {
  RestoreBf16Products restore;
  Transformer model = golden_qwen3_in_bf16();
  const std::vector<int32_t> prompt = {5, 99, 310, 42, 7, 1000, 64}, block = {3, 8, 12, 250, 9, 77, 31, 500};
  // The logits of the prompt's last token and of every block token, the block
  // as one forward after its first token (verify) or one token at a time.
  auto logits = [&](bool verify) {
    KVCache cache(model.config, 64);
    ForwardWorkspace workspace;
    ForwardOutput output;
    std::vector<float> all;
    auto forward = [&](std::span<const int32_t> tokens) {
      ForwardSequence sequence{&cache, tokens, true};
      transformer_forward(model, {&sequence, 1}, {}, workspace, output);
      all.insert(all.end(), output.logits.end() - long(tokens.size()) * model.config.vocab_size, output.logits.end());
    };
    forward(std::span(prompt));
    all.erase(all.begin(), all.end() - model.config.vocab_size);
    forward(std::span(block).first(1));
    if (verify)
      forward(std::span(block).subspan(1));
    else
      for (size_t i = 1; i < block.size(); ++i) forward(std::span(block).subspan(i, 1));
    return all;
  };
  const std::vector<float> from_f32 = logits(true);
  keep_bf16_weights(model);
  ASSERT_FALSE(model.lm_head_bf16.empty());
  ASSERT_FALSE(model.layers[0].bf16.gate_proj.empty());
  for (bool bf16_products : {false, true}) {
    SCOPED_TRACE(bf16_products ? "bf16 products" : "f32 activations");
    cpu::set_bf16_products(bf16_products);
    const std::vector<float> verified = logits(true);
    EXPECT_EQ(verified, logits(false));
    ASSERT_EQ(verified.size(), from_f32.size());
    // Measured: 0.067 of 7.8 (0.9%) with bf16 products, through 2 layers of rounding.
    const double difference = testing::largest_relative_difference(verified, from_f32);
    EXPECT_LT(difference, bf16_products ? 3e-2 : 1e-5);
    if (bf16_products) {
      EXPECT_GT(difference, 1e-4) << "the activations were not rounded";
    }
  }
}

// With bf16 copies a prompt's rows get the same bits whether they are
// prefilled in one forward of more rows than the few-row limit (where f32
// weights go to sgemm) or in pieces and steps: plain and speculative
// decoding prefill differently (the latter holds the last prompt token back,
// and batches group prompts their own way), and with bf16 products a
// last-bit difference flips an activation's rounding (a batch-4 plain decode
// differed from speculative decoding's until prefill left sgemm).
TEST(TransformerLoad, Bf16PrefillInPiecesGivesTheSameBits) {
  RestoreBf16Products restore;
  Transformer model = golden_qwen3_in_bf16();
  keep_bf16_weights(model);
  std::vector<int32_t> prompt(cpu::kSmallRowsMax + 20);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 37 + 11) % model.config.vocab_size);
  // The last token's logits after feeding the prompt in pieces of these sizes.
  auto last_logits = [&](std::vector<int> pieces) {
    KVCache cache(model.config, int(prompt.size()));
    ForwardWorkspace workspace;
    ForwardOutput output;
    size_t at = 0;
    for (int piece : pieces) {
      ForwardSequence sequence{&cache, std::span(prompt).subspan(at, size_t(piece)), false};
      transformer_forward(model, {&sequence, 1}, {}, workspace, output);
      at += size_t(piece);
    }
    EXPECT_EQ(at, prompt.size());
    return output.logits;
  };
  for (bool bf16_products : {false, true}) {
    SCOPED_TRACE(bf16_products ? "bf16 products" : "f32 activations");
    cpu::set_bf16_products(bf16_products);
    const std::vector<float> whole = last_logits({int(prompt.size())});
    EXPECT_EQ(last_logits({50, int(prompt.size()) - 51, 1}), whole);
    EXPECT_EQ(last_logits({int(prompt.size()) - 1, 1}), whole);
  }
}

TEST(TransformerLoad, TiedEmbeddingsShareTheHead) {
  const Transformer qwen = load_transformer(golden_model("qwen3"));
  EXPECT_TRUE(qwen.config.tie_word_embeddings);
  EXPECT_EQ(qwen.lm_head.data, qwen.embed_tokens.data);
  const Transformer llama = load_transformer(golden_model("llama"));
  EXPECT_NE(llama.lm_head.data, llama.embed_tokens.data);
}

// A bf16 checkpoint's projections are read only through their bf16 bits, so
// loading frees their f32 tensors (the layers and an untied head; the
// embedding, whose rows are gathered, stays). The golden llama (untied)
// written as bf16 gives the logits of the same model whose f32 tensors stay,
// and keeping the bits again after the release leaves them.
TEST(TransformerLoad, Bf16CheckpointKeepsOnlyTheBitsOfItsProjections) {
  const std::filesystem::path golden = golden_model("llama");
  testing::TemporaryDirectory directory;
  {
    const SafetensorsCheckpoint checkpoint(golden);
    std::vector<std::vector<uint16_t>> storage;
    std::vector<SafetensorsWriteEntry> entries;
    for (const std::string& name : checkpoint.names()) {
      const Tensor tensor = checkpoint.file_of(name).load_f32(name);
      std::vector<uint16_t>& bits = storage.emplace_back(size_t(tensor.numel()));
      for (long i = 0; i < tensor.numel(); ++i) bits[size_t(i)] = f32_to_bf16(tensor.data[i]);
      entries.push_back({name, Dtype::BF16, tensor.shape, bits.data()});
    }
    write_safetensors(directory.path / "model.safetensors", entries);
    std::filesystem::copy_file(golden / "config.json", directory.path / "config.json");
  }
  Transformer loaded = load_transformer(directory.path);
  ASSERT_FALSE(loaded.config.tie_word_embeddings);
  for (const LayerWeights& layer : loaded.layers) {
    for (const Tensor* weight : {&layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj, &layer.gate_proj,
                                 &layer.up_proj, &layer.down_proj})
      EXPECT_EQ(weight->data, nullptr);
    EXPECT_FALSE(layer.bf16.down_proj.empty());
  }
  EXPECT_EQ(loaded.lm_head.data, nullptr);
  ASSERT_NE(loaded.embed_tokens.data, nullptr);
  const std::vector<uint16_t> head_bits = loaded.lm_head_bf16;
  keep_bf16_weights(loaded);
  EXPECT_EQ(loaded.lm_head_bf16, head_bits);

  // The same bf16 values with their f32 tensors kept (the bits packed from them).
  Transformer kept = load_transformer(golden);
  for (LayerWeights& layer : kept.layers)
    for (Tensor* weight : {&layer.input_norm, &layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj,
                           &layer.post_attention_norm, &layer.gate_proj, &layer.up_proj, &layer.down_proj})
      round_to_bf16(*weight);
  for (Tensor* weight : {&kept.embed_tokens, &kept.lm_head, &kept.final_norm}) round_to_bf16(*weight);
  keep_bf16_weights(kept);
  ASSERT_NE(kept.layers[0].q_proj.data, nullptr);

  const std::vector<int32_t> prompt = {5, 99, 310, 42, 7, 100, 64};
  auto logits = [&](const Transformer& model) {
    KVCache cache(model.config, 16);
    ForwardWorkspace workspace;
    ForwardOutput output;
    ForwardSequence sequence{&cache, prompt, true};
    transformer_forward(model, {&sequence, 1}, {}, workspace, output);
    return output.logits;
  };
  EXPECT_EQ(logits(loaded), logits(kept));
}

}  // namespace
}  // namespace dspark
