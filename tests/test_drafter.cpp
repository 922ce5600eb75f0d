// The DSpark drafter: reproducible init, checkpoints, and the forward against
// an independent PyTorch implementation written from DESIGN.md
// (tests/tools/make_drafter_golden.py), plus the properties of drafting:
// retained context == recompute, pruning gives a non-empty prefix, batched
// rows == single rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <span>

#include "core/dtype.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "golden.h"
#include "kernels/cpu/matmul.h"
#include "model/transformer.h"
#include "random_drafter.h"
#include "spec/draft.h"
#include "spec/drafter.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::relative_error;
using testing::TemporaryDirectory;

const std::vector<std::string> kHeads = {"markov", "rnn", "gru"};

DrafterConfig small_config(const std::string& head) {
  DrafterConfig config;
  config.gamma = 5;
  config.d_draft = 32;
  config.num_layers = 2;
  config.num_heads = 4;
  config.markov_rank = 8;
  config.tap_layers = {1, 3, 4};
  config.seq_head = head;
  return config;
}

const Transformer& golden_target() { return testing::golden_transformer("qwen3"); }

TargetDims golden_dims() {
  const ModelConfig& c = golden_target().config;
  return {c.hidden_size, c.vocab_size, c.rms_norm_eps};
}

Drafter random_drafter(const std::string& head, uint64_t seed) {
  Drafter drafter = init_drafter(small_config(head), golden_dims(), "qwen3", 3);
  testing::randomize_parameters(drafter, seed, 1.0f);
  return drafter;
}

// The tapped rows of real target hidden states for `tokens`: [T, m * H].
std::vector<float> target_taps(const std::vector<int32_t>& tokens, const std::vector<int>& taps) {
  KVCache cache(golden_target().config, 128);
  ForwardWorkspace workspace;
  ForwardOutput output;
  ForwardSequence sequence{&cache, tokens, false};
  transformer_forward(golden_target(), {&sequence, 1}, taps, workspace, output);
  return output.taps;
}

TEST(DrafterInit, MatchesTheIndependentImplementation) {
  const Json expected = read_json_file(golden_model("drafter") / "init" / "config.json");
  DrafterConfig config;
  config.gamma = expected["config"]["gamma"];
  config.d_draft = expected["config"]["dDraft"];
  config.num_layers = expected["config"]["nLayers"];
  config.num_heads = expected["config"]["nHeads"];
  config.markov_rank = expected["config"]["markovRank"];
  config.ff_mult = expected["config"]["ffMult"];
  config.tap_layers = expected["config"]["tapLayers"].get<std::vector<int>>();
  const TargetDims dims{expected["dims"]["hiddenSize"], expected["dims"]["vocabSize"], expected["dims"]["eps"]};
  for (const std::string& head : kHeads) {
    config.seq_head = head;
    const Drafter drafter = init_drafter(config, dims, "qwen3", expected["seed"].get<uint32_t>());
    EXPECT_EQ(drafter.names, expected["param_names"][head].get<std::vector<std::string>>());
    const SafetensorsFile reference(golden_model("drafter") / "init" / (head + ".safetensors"));
    for (const std::string& name : drafter.names) {
      const Tensor ours = drafter.parameter(name), theirs = reference.load_f32(name);
      ASSERT_EQ(ours.shape, theirs.shape) << name;
      // Both draw in double through libm; one ulp of f32 leeway for a different libm.
      for (long i = 0; i < ours.numel(); ++i)
        ASSERT_NEAR(ours.data[i], theirs.data[i], 1e-7f * std::max(1.0f, std::fabs(theirs.data[i])))
            << head << " " << name << "[" << i << "]";
    }
  }
}

TEST(DrafterInit, HeadsShareEveryCommonTensorBitForBit) {
  const Drafter markov = init_drafter(small_config("markov"), golden_dims(), "qwen3", 42);
  for (const std::string head : {"rnn", "gru"}) {
    const Drafter other = init_drafter(small_config(head), golden_dims(), "qwen3", 42);
    for (const std::string& name : markov.names)
      EXPECT_EQ(std::memcmp(markov[name], other[name], markov.parameter(name).numel() * 4), 0) << head << " " << name;
    EXPECT_GT(other.names.size(), markov.names.size());
  }
  const Drafter reseeded = init_drafter(small_config("markov"), golden_dims(), "qwen3", 43);
  EXPECT_NE(std::memcmp(markov["bb.0.q"], reseeded["bb.0.q"], 32 * 32 * 4), 0);
}

TEST(DrafterCheckpoint, RoundTripIsBitExact) {
  TemporaryDirectory directory;
  for (const std::string& head : kHeads) {
    Drafter drafter = random_drafter(head, 5);
    drafter.config.sts = StsCalibration{{0.0f, 0.3f, 0.4f, 0.5f, 0.6f}, {}, 0.5f, 1234};
    drafter.metadata["notes"] = "kept across saves";
    save_drafter(drafter, directory.path / head);
    const Drafter loaded = load_drafter(directory.path / head);
    EXPECT_EQ(loaded.names, drafter.names);
    EXPECT_EQ(loaded.config.seq_head, head);
    ASSERT_TRUE(loaded.config.sts.has_value());
    EXPECT_EQ(loaded.config.sts->thresholds, drafter.config.sts->thresholds);
    EXPECT_EQ(loaded.metadata["notes"], "kept across saves");
    for (const std::string& name : drafter.names)
      EXPECT_EQ(std::memcmp(loaded[name], drafter[name], drafter.parameter(name).numel() * 4), 0) << name;
  }
  // bf16 checkpoints load as their rounding.
  const Drafter drafter = random_drafter("markov", 6);
  save_drafter(drafter, directory.path / "bf16", Dtype::BF16);
  const Drafter loaded = load_drafter(directory.path / "bf16");
  EXPECT_EQ(loaded["out_proj"][3], bf16_to_f32(f32_to_bf16(drafter["out_proj"][3])));
}

TEST(DrafterCheckpoint, LegacyVariantLoadsAndMismatchesAreRefused) {
  TemporaryDirectory directory;
  save_drafter(random_drafter("markov", 7), directory.path);
  Json metadata = read_json_file(directory.path / "dspark.json");
  metadata["variant"] = "dflash";
  write_text_file_atomic(directory.path / "dspark.json", metadata.dump());
  const Drafter legacy = load_drafter(directory.path);
  check_drafter_matches_target(legacy, golden_target().config, "qwen3");

  ModelConfig other = golden_target().config;
  other.vocab_size += 1;
  const std::string error = testing::error_of([&] { check_drafter_matches_target(legacy, other, "qwen3"); });
  EXPECT_NE(error.find("vocabulary 1088"), std::string::npos) << error;
  const ModelConfig llama = load_model_config(golden_model("llama"));
  EXPECT_NE(testing::error_of([&] { check_drafter_matches_target(legacy, llama, "llama"); }).find("hidden size"),
            std::string::npos);

  metadata["variant"] = "medusa";
  write_text_file_atomic(directory.path / "dspark.json", metadata.dump());
  EXPECT_NE(testing::error_of([&] { load_drafter(directory.path); }).find("unsupported variant \"medusa\""),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { load_drafter("/no/drafter"); }).find("does not exist"), std::string::npos);
  std::filesystem::resize_file(directory.path / "model.safetensors", 100);
  metadata["variant"] = "dspark";
  write_text_file_atomic(directory.path / "dspark.json", metadata.dump());
  EXPECT_NE(testing::error_of([&] { load_drafter(directory.path); }).find("truncated"), std::string::npos);
}

TEST(DrafterConfig, DefaultTapsAndValidation) {
  EXPECT_EQ(default_tap_layers(42), (std::vector<int>{20, 31, 41, 42}));
  EXPECT_EQ(default_tap_layers(4), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(default_tap_layers(1), (std::vector<int>{0, 1}));
  DrafterConfig config = small_config("markov");
  config.tap_layers = {1, 3};
  EXPECT_NE(testing::error_of([&] { validate_drafter_config(config, 4); }).find("last tap layer must be 4"),
            std::string::npos);
  config = small_config("lstm");
  EXPECT_NE(testing::error_of([&] { validate_drafter_config(config, 4); }).find("unknown sequential head"),
            std::string::npos);
}

class DrafterGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(DrafterGolden, ForwardMatchesPyTorch) {
  const auto directory = golden_model("drafter") / "forward" / GetParam();
  const Drafter drafter = load_drafter(directory);
  check_drafter_matches_target(drafter, golden_target().config, "golden-qwen3");
  const SafetensorsFile reference(directory / "reference.safetensors");
  const Json cases = read_json_file(directory / "reference.json")["cases"];
  const TargetHead head = target_head_of(golden_target());
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string index = std::to_string(i);
    const Tensor hctx = reference.load_f32("hctx." + index);
    DraftContext context;
    extend_draft_context(drafter, context, hctx.data, static_cast<int>(hctx.shape[0]));
    const auto teacher = cases[i]["teacher_tokens"].get<std::vector<int32_t>>();
    const int32_t anchor = cases[i]["anchor"];
    const DraftForward forward = draft_teacher_forced(drafter, head, context, anchor, teacher);
    const Tensor hidden = reference.load_f32("hidden." + index), base = reference.load_f32("base_logits." + index);
    const Tensor logits = reference.load_f32("logits." + index), conf = reference.load_f32("conf." + index);
    EXPECT_LE(relative_error(forward.hidden.data(), hidden.data, hidden.numel()), 1e-5) << "case " << i;
    EXPECT_LE(relative_error(forward.base_logits.data(), base.data, base.numel()), 1e-5) << "case " << i;
    EXPECT_LE(relative_error(forward.logits.data(), logits.data, logits.numel()), 1e-5) << "case " << i;
    EXPECT_LE(relative_error(forward.confidence.data(), conf.data, conf.numel()), 1e-5) << "case " << i;

    DraftWorkspace workspace;
    std::vector<DraftResult> results;
    const DraftRequest request{&context, anchor, nullptr};
    draft(drafter, head, {&request, 1}, DraftOptions{}, workspace, results);
    EXPECT_EQ(results[0].tokens, cases[i]["greedy_tokens"].get<std::vector<int32_t>>()) << "case " << i;
    const auto greedy_conf = cases[i]["greedy_conf"].get<std::vector<float>>();
    EXPECT_LE(relative_error(results[0].confidence.data(), greedy_conf.data(), greedy_conf.size()), 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, DrafterGolden, ::testing::Values("markov", "rnn", "gru"));

class Drafting : public ::testing::TestWithParam<std::string> {
 protected:
  Drafter drafter_ = random_drafter(GetParam(), 11);
  TargetHead head_ = target_head_of(golden_target());
  std::vector<int32_t> tokens_ = {12, 400, 33, 901, 7, 256, 64, 500, 3, 77, 120};
  std::vector<float> taps_ = target_taps(tokens_, drafter_.config.tap_layers);
  int width_ = static_cast<int>(drafter_.config.tap_layers.size()) * golden_target().config.hidden_size;

  DraftResult draft_one(const DraftContext& context, int32_t anchor, const DraftOptions& options = {},
                        Rng* rng = nullptr) {
    DraftWorkspace workspace;
    std::vector<DraftResult> results;
    const DraftRequest request{&context, anchor, rng};
    draft(drafter_, head_, {&request, 1}, options, workspace, results);
    return results[0];
  }
};

TEST_P(Drafting, RetainedContextEqualsRecompute) {
  DraftContext whole, pieces;
  extend_draft_context(drafter_, whole, taps_.data(), 10);
  extend_draft_context(drafter_, pieces, taps_.data(), 3);
  extend_draft_context(drafter_, pieces, taps_.data() + 3L * width_, 1);
  extend_draft_context(drafter_, pieces, taps_.data() + 4L * width_, 6);
  DraftOptions options;
  options.collect_logits = true;
  const DraftResult a = draft_one(whole, tokens_[10], options), b = draft_one(pieces, tokens_[10], options);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_LE(relative_error(b.logits.data(), a.logits.data(), a.logits.size()), 1e-6);

  // Grouped with other contexts in one pass (extend_draft_contexts, as
  // DSparkSource flushes its staged rows), each context gets the same bits.
  DraftContext first, second, third;
  DraftContext* contexts[] = {&first, &second, &third};
  const float* rows[] = {taps_.data(), taps_.data() + 3L * width_, taps_.data() + 1L * width_};
  const int counts[] = {3, 0, 7};
  DraftWorkspace workspace;
  extend_draft_contexts(drafter_, contexts, rows, counts, workspace);
  EXPECT_EQ(second.length, 0);
  DraftContext first_alone, third_alone;
  extend_draft_context(drafter_, first_alone, taps_.data(), 3);
  extend_draft_context(drafter_, third_alone, taps_.data() + 1L * width_, 7);
  for (auto [grouped, alone] : {std::pair{&first, &first_alone}, std::pair{&third, &third_alone}}) {
    ASSERT_EQ(grouped->length, alone->length);
    EXPECT_EQ(grouped->keys, alone->keys);
    EXPECT_EQ(grouped->values, alone->values);
  }
  EXPECT_EQ(first.keys[0], std::vector<float>(pieces.keys[0].begin(), pieces.keys[0].begin() + 3L * drafter_.config.d_draft));

  // Rolled back and regrown, the context drafts as if never extended past the cut.
  DraftContext cut;
  extend_draft_context(drafter_, cut, taps_.data(), 6);
  extend_draft_context(drafter_, pieces, taps_.data() + 10L * width_, 1);
  pieces.truncate(6);
  EXPECT_EQ(draft_one(cut, tokens_[6]).tokens, draft_one(pieces, tokens_[6]).tokens);
}

TEST_P(Drafting, PruningKeepsANonEmptyPrefix) {
  DraftContext context;
  extend_draft_context(drafter_, context, taps_.data(), 8);
  const DraftResult full = draft_one(context, tokens_[8]);
  ASSERT_EQ(full.tokens.size(), size_t(drafter_.config.gamma));
  for (float floor : {0.0f, 0.2f, 0.5f, 0.8f, 1.01f}) {
    DraftOptions options;
    options.min_confidence = floor;
    const DraftResult pruned = draft_one(context, tokens_[8], options);
    ASSERT_GE(pruned.tokens.size(), 1u) << floor;
    EXPECT_TRUE(std::equal(pruned.tokens.begin(), pruned.tokens.end(), full.tokens.begin())) << floor;
    // It stops exactly at the first position k >= 1 below the floor.
    size_t expected = 1;
    while (expected < full.tokens.size() && full.confidence[expected] >= floor) ++expected;
    EXPECT_EQ(pruned.tokens.size(), expected) << floor;
  }
  DraftOptions per_position;
  per_position.thresholds = {0.9f, 0.0f, 0.0f, 2.0f, 0.0f};  // position 0's threshold never applies
  EXPECT_EQ(draft_one(context, tokens_[8], per_position).tokens.size(), 3u);
}

// A draft of at most k tokens (DraftOptions::max_tokens) computes only the
// first k positions' logits, and gives exactly the first k positions of the
// full draft: tokens, confidences and logits, alone and batched.
TEST_P(Drafting, ShorterDraftsArePrefixesOfTheFullDraft) {
  DraftContext context, other;
  extend_draft_context(drafter_, context, taps_.data(), 8);
  extend_draft_context(drafter_, other, taps_.data(), 5);
  const int gamma = drafter_.config.gamma;
  const long V = golden_target().config.vocab_size;
  DraftOptions options;
  options.collect_logits = true;
  const DraftResult full = draft_one(context, tokens_[8], options);
  ASSERT_EQ(full.tokens.size(), size_t(gamma));
  for (int k = 1; k < gamma; ++k) {
    options.max_tokens = k;
    const DraftRequest requests[] = {{&other, tokens_[5], nullptr}, {&context, tokens_[8], nullptr}};
    DraftWorkspace workspace;
    std::vector<DraftResult> results;
    draft(drafter_, head_, requests, options, workspace, results);
    for (const DraftResult& shorter : {draft_one(context, tokens_[8], options), results[1]}) {
      EXPECT_EQ(shorter.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k)) << k;
      EXPECT_EQ(shorter.confidence, std::vector<float>(full.confidence.begin(), full.confidence.begin() + k)) << k;
      EXPECT_EQ(shorter.logits, std::vector<float>(full.logits.begin(), full.logits.begin() + k * V)) << k;
    }
  }
}

TEST_P(Drafting, BatchedRowsEqualSingleRows) {
  DraftContext short_context, long_context, empty_context;
  extend_draft_context(drafter_, short_context, taps_.data(), 2);
  extend_draft_context(drafter_, long_context, taps_.data(), 9);
  const std::vector<const DraftContext*> contexts = {&short_context, &long_context, &empty_context};
  const std::vector<int32_t> anchors = {tokens_[2], tokens_[9], tokens_[0]};
  std::vector<DraftRequest> requests;
  for (size_t i = 0; i < contexts.size(); ++i) requests.push_back({contexts[i], anchors[i], nullptr});
  DraftOptions options;
  options.collect_logits = true;
  DraftWorkspace workspace;
  std::vector<DraftResult> batched;
  draft(drafter_, head_, requests, options, workspace, batched);
  for (size_t i = 0; i < contexts.size(); ++i) {
    const DraftResult alone = draft_one(*contexts[i], anchors[i], options);
    // Bit for bit: every batched product stays in the small-row kernels, whose
    // rows do not depend on each other.
    EXPECT_EQ(batched[i].tokens, alone.tokens) << i;
    EXPECT_EQ(batched[i].confidence, alone.confidence) << i;
    EXPECT_EQ(batched[i].logits, alone.logits) << i;
  }
}

// A drafter whose weights are bf16 values drafts from the bf16 panels once
// it keeps them (keep_bf16_weights, as decoding does): with f32 activations
// its context keys, confidences and logits differ from the f32 tensors' only
// by the order of summation; with bf16 products (cpu::set_bf16_products; the
// CUDA drafter's products are bf16 too) by bf16 rounding. Either way a row
// drafted among others gets the bits it gets alone.
TEST_P(Drafting, Bf16CopiesOfTheWeightsGiveTheSameDrafts) {
  struct RestoreProducts {
    ~RestoreProducts() { cpu::set_bf16_products(false); }
  } restore;
  for (auto& [name, tensor] : drafter_.parameters)
    for (long i = 0; i < tensor.numel(); ++i) tensor.data[i] = bf16_to_f32(f32_to_bf16(tensor.data[i]));
  DraftOptions options;
  options.collect_logits = true;
  auto draft_both_ways = [&] {
    DraftContext context;
    extend_draft_context(drafter_, context, taps_.data(), 9);
    return std::pair{context.keys, draft_one(context, tokens_[9], options)};
  };
  const auto [f32_keys, f32_draft] = draft_both_ways();
  keep_bf16_weights(drafter_);
  ASSERT_FALSE(drafter_.bf16.empty());
  EXPECT_NE(drafter_.bf16_of("out_proj"), nullptr);
  EXPECT_EQ(drafter_.bf16_of("out_norm"), nullptr) << "vectors stay f32";
  using testing::largest_relative_difference;
  for (bool bf16_products : {false, true}) {
    SCOPED_TRACE(bf16_products ? "bf16 products" : "f32 activations");
    cpu::set_bf16_products(bf16_products);
    const double tolerance = bf16_products ? 2e-2 : 1e-5;
    const auto [bf16_keys, bf16_draft] = draft_both_ways();
    ASSERT_EQ(bf16_keys.size(), f32_keys.size());
    for (size_t l = 0; l < f32_keys.size(); ++l)
      EXPECT_LT(largest_relative_difference(bf16_keys[l], f32_keys[l]), tolerance) << "layer " << l;
    if (bf16_products) {
      EXPECT_GT(largest_relative_difference(bf16_keys[0], f32_keys[0]), 1e-4) << "not rounded";
    }
    ASSERT_EQ(bf16_draft.logits.size(), f32_draft.logits.size());
    EXPECT_LT(largest_relative_difference(bf16_draft.logits, f32_draft.logits), tolerance);
    ASSERT_EQ(bf16_draft.confidence.size(), f32_draft.confidence.size());
    for (size_t k = 0; k < f32_draft.confidence.size(); ++k)
      EXPECT_NEAR(bf16_draft.confidence[k], f32_draft.confidence[k], tolerance) << k;
    if (!bf16_products) {
      EXPECT_EQ(bf16_draft.tokens, f32_draft.tokens);
    }

    DraftContext other, context;
    extend_draft_context(drafter_, other, taps_.data(), 4);
    extend_draft_context(drafter_, context, taps_.data(), 9);
    const std::vector<DraftRequest> requests = {{&other, tokens_[4], nullptr}, {&context, tokens_[9], nullptr}};
    DraftWorkspace workspace;
    std::vector<DraftResult> batched;
    draft(drafter_, head_, requests, options, workspace, batched);
    EXPECT_EQ(batched[1].tokens, bf16_draft.tokens);
    EXPECT_EQ(batched[1].confidence, bf16_draft.confidence);
    EXPECT_EQ(batched[1].logits, bf16_draft.logits);
  }
}

TEST_P(Drafting, SamplingIsSeededPerRow) {
  DraftContext context;
  extend_draft_context(drafter_, context, taps_.data(), 5);
  DraftOptions options;
  options.sampling = {1.0f, 0, 1.0f};
  auto sample = [&](uint64_t seed) {
    Rng rng(seed);
    return draft_one(context, tokens_[5], options, &rng).tokens;
  };
  EXPECT_EQ(sample(1), sample(1));
  std::set<std::vector<int32_t>> distinct;
  for (uint64_t seed = 0; seed < 8; ++seed) distinct.insert(sample(seed));
  EXPECT_GT(distinct.size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Heads, Drafting, ::testing::Values("markov", "rnn", "gru"));

}  // namespace
}  // namespace dspark
