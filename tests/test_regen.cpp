// Regeneration of training data on the golden qwen3 target: the stored
// responses are what plain generation answers for each prompt on its own, the
// stored rows are a fresh tapped forward of the stored ids, an interrupted run
// resumes to exactly the bytes of one straight run, and bad prompts are
// reported and skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "cli_runner.h"
#include "core/dtype.h"
#include "core/file.h"
#include "golden.h"
#include "model/cpu_target.h"
#include "model/generate.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "spec/drafter.h"
#include "train/dataset.h"
#include "train/regen.h"

namespace dspark {
namespace {

using testing::error_of;
using testing::golden_model;
using testing::run_dspark;
using testing::TemporaryDirectory;

const Transformer& golden_target() { return testing::golden_transformer("qwen3"); }

std::vector<RegenPrompt> golden_prompts(bool chat = false) {
  const Tokenizer tokenizer = Tokenizer::load(golden_model("qwen3"));
  std::vector<PromptEntry> entries;
  const char* texts[] = {"def fibonacci(n):", "The cat sat",     "hello world, hello",
                         "1 2 3 4 5",         "import numpy as", "Once upon a time there was"};
  for (int i = 0; i < 6; ++i) entries.push_back({i + 1, texts[i], {}});
  return tokenize_regen_prompts(tokenizer, entries, chat, golden_target().config, "prompts");
}

RegenOptions small_options() {
  RegenOptions options;
  options.tap_layers = default_tap_layers(golden_target().config.num_layers);
  options.max_new_tokens = 7;
  options.batch = 4;
  options.shard_bytes = 1;  // every batch closes its shard: two shards for six prompts
  options.show_progress = false;
  return options;
}

RegenSummary regen(const std::vector<RegenPrompt>& prompts, const RegenOptions& options,
                   const std::filesystem::path& output) {
  CpuTarget target(golden_target());
  return regenerate(target, "qwen3", prompts, options, output);
}

// The rows of one sequence, [length, m·H], by a single-sequence tapped forward.
std::vector<float> fresh_rows(const int32_t* ids, int length, const std::vector<int>& taps) {
  KVCache cache(golden_target().config, length);
  ForwardWorkspace workspace;
  ForwardOutput output;
  ForwardSequence sequence{&cache, {ids, size_t(length)}, false};
  transformer_forward(golden_target(), {&sequence, 1}, taps, workspace, output);
  return output.taps;
}

void expect_data_matches_fresh_generation(const std::vector<RegenPrompt>& prompts, const RegenOptions& options,
                                          const std::filesystem::path& output) {
  const Dataset data(output);
  ASSERT_EQ(data.size(), int(prompts.size()));
  EXPECT_TRUE(data.manifest().complete);
  EXPECT_EQ(data.manifest().tap_layers, options.tap_layers);
  EXPECT_EQ(data.tap_width(), int(options.tap_layers.size()) * golden_target().config.hidden_size);
  CpuTarget target(golden_target());
  for (int s = 0; s < data.size(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    const SequenceRecord& record = data.sequence(s);
    ASSERT_EQ(record.prompt_length, int(prompts[s].tokens.size()));
    EXPECT_EQ(record.line, prompts[s].line);
    const int32_t* ids = data.ids(s);
    EXPECT_EQ(std::vector<int32_t>(ids, ids + record.prompt_length), prompts[s].tokens);
    // The response: what generate() answers for this prompt alone, with prompt s's own stream.
    GenerateOptions generate_options;
    generate_options.max_new_tokens = options.max_new_tokens;
    generate_options.sampling = options.sampling;
    generate_options.seed = options.seed + 0x9e3779b97f4a7c15ull * s;
    const GenerateResult alone = generate(target, prompts[s].tokens, generate_options);
    EXPECT_EQ(std::vector<int32_t>(ids + record.prompt_length, ids + record.length), alone.tokens);
    EXPECT_EQ(record.stop, alone.stop_reason);
    // The rows: a fresh tapped forward of the stored ids, to bf16 precision.
    const std::vector<float> fresh = fresh_rows(ids, record.length, options.tap_layers);
    ASSERT_EQ(fresh.size(), size_t(record.length) * data.tap_width());
    // bf16 rounding (2^-9 relative) plus f32 rounding that differs between
    // the batched and the single-sequence forward (other kernels, other
    // summation orders): relative to the row's largest element, since an
    // element near zero is a cancellation of terms of that size.
    const uint16_t* stored = data.rows(s);
    const size_t width = data.tap_width();
    for (size_t start = 0; start < fresh.size(); start += width) {
      float row_scale = 0.0f;
      for (size_t i = start; i < start + width; ++i) row_scale = std::max(row_scale, std::fabs(fresh[i]));
      for (size_t i = start; i < start + width; ++i)
        ASSERT_LE(std::fabs(bf16_to_f32(stored[i]) - fresh[i]), std::fabs(fresh[i]) * 0x1p-8f + row_scale * 1e-5f)
            << "element " << i;
    }
  }
}

TEST(Regen, StoresWhatTheTargetAnswersAndAFreshTappedForward) {
  const std::vector<RegenPrompt> prompts = golden_prompts();
  ASSERT_EQ(prompts.size(), 6u);
  TemporaryDirectory output;
  const RegenOptions options = small_options();
  const RegenSummary summary = regen(prompts, options, output.path);
  EXPECT_EQ(summary.sequences, 6);
  EXPECT_EQ(summary.new_sequences, 6);
  EXPECT_EQ(summary.shards, 2);
  EXPECT_TRUE(summary.complete);
  expect_data_matches_fresh_generation(prompts, options, output.path);
}

TEST(Regen, SampledResponsesUseEachPromptsOwnStream) {
  const std::vector<RegenPrompt> prompts = golden_prompts(true);
  TemporaryDirectory output;
  RegenOptions options = small_options();
  options.sampling = {0.9f, 0, 0.95f};
  options.seed = 11;
  options.tap_layers = {0, 4};
  options.batch = 5;
  options.shard_bytes = 1L << 30;  // one shard
  regen(prompts, options, output.path);
  expect_data_matches_fresh_generation(prompts, options, output.path);
}

std::string file_bytes(const std::filesystem::path& path) { return read_text_file(path); }

void expect_same_data(const std::filesystem::path& a, const std::filesystem::path& b) {
  EXPECT_EQ(file_bytes(a / "manifest.json"), file_bytes(b / "manifest.json"));
  const RegenManifest manifest = read_manifest(a);
  for (const ShardRecord& shard : manifest.shards)
    EXPECT_TRUE(file_bytes(a / shard.file) == file_bytes(b / shard.file)) << shard.file << " differs";
}

TEST(Regen, AnInterruptedRunResumesToTheStraightRunsBytes) {
  const std::vector<RegenPrompt> prompts = golden_prompts();
  RegenOptions options = small_options();
  options.batch = 2;  // three shards
  options.sampling = {0.8f, 0, 1.0f};
  TemporaryDirectory straight, interrupted;
  regen(prompts, options, straight.path);

  RegenOptions stopping = options;
  stopping.stop_after_shards = 1;
  RegenSummary first = regen(prompts, stopping, interrupted.path);
  EXPECT_EQ(first.sequences, 2);
  EXPECT_FALSE(first.complete);
  EXPECT_FALSE(read_manifest(interrupted.path).complete);
  first = regen(prompts, stopping, interrupted.path);
  EXPECT_EQ(first.sequences, 4);
  EXPECT_EQ(first.new_sequences, 2);
  const RegenSummary rest = regen(prompts, options, interrupted.path);
  EXPECT_EQ(rest.new_sequences, 2);
  EXPECT_TRUE(rest.complete);
  expect_same_data(straight.path, interrupted.path);

  // A lost shard (here the last one) is regenerated by a rerun; a complete run is left alone.
  std::filesystem::remove(interrupted.path / "shard-00002.safetensors");
  EXPECT_EQ(regen(prompts, options, interrupted.path).new_sequences, 2);
  expect_same_data(straight.path, interrupted.path);
  EXPECT_EQ(regen(prompts, options, interrupted.path).new_sequences, 0);
  expect_same_data(straight.path, interrupted.path);
  // A truncated shard in the middle: it and everything after it are redone.
  write_text_file_atomic(interrupted.path / "shard-00001.safetensors", "truncated");
  EXPECT_EQ(regen(prompts, options, interrupted.path).new_sequences, 4);
  expect_same_data(straight.path, interrupted.path);
}

TEST(Regen, RefusesToMixDataMadeWithOtherSettings) {
  const std::vector<RegenPrompt> prompts = golden_prompts();
  TemporaryDirectory output;
  RegenOptions options = small_options();
  options.stop_after_shards = 1;
  regen(prompts, options, output.path);
  RegenOptions longer = options;
  longer.max_new_tokens = 9;
  EXPECT_NE(error_of([&] { regen(prompts, longer, output.path); }).find("max_tokens"), std::string::npos);
  RegenOptions other_taps = options;
  other_taps.tap_layers = {2, 4};
  EXPECT_NE(error_of([&] { regen(prompts, other_taps, output.path); }).find("tap"), std::string::npos);
  std::vector<RegenPrompt> fewer(prompts.begin(), prompts.end() - 1);
  EXPECT_NE(error_of([&] { regen(fewer, options, output.path); }).find("prompts"), std::string::npos);
  RegenOptions bad_taps = options;
  bad_taps.tap_layers = {1, 3};
  TemporaryDirectory fresh;
  EXPECT_NE(error_of([&] { regen(prompts, bad_taps, fresh.path); }).find("last tap layer must be 4"),
            std::string::npos);
}

TEST(CliRegen, BadPromptLinesAreReportedAndSkipped) {
  TemporaryDirectory directory;
  const std::filesystem::path prompts = directory.path / "prompts.jsonl";
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += "word" + std::to_string(i) + " ";
  {
    std::ofstream out(prompts);
    out << R"({"prompt": "The cat sat"})"
        << "\n"
        << "this is not json\n"
        << R"({"text": "no prompt field"})"
        << "\n"
        << R"({"prompt": ")" << long_prompt << R"("})"
        << "\n"
        << "\n"
        << R"({"messages": [{"role": "user", "content": "hello"}]})"
        << "\n";
  }
  const std::filesystem::path data = directory.path / "data";
  const auto result = run_dspark({"regen", "-m", golden_model("qwen3").string(), "--prompts", prompts.string(), "-o",
                                  data.string(), "-n", "4", "--device", "cpu", "--tap-layers", "2,4"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  for (const char* line : {"prompts.jsonl:2 skipped", "prompts.jsonl:3 skipped", "prompts.jsonl:4 skipped"})
    EXPECT_NE(result.err.find(line), std::string::npos) << line << " not in: " << result.err;
  const Dataset dataset(data);
  ASSERT_EQ(dataset.size(), 2);
  EXPECT_EQ(dataset.sequence(0).line, 1);
  EXPECT_EQ(dataset.sequence(1).line, 6);
  EXPECT_EQ(dataset.manifest().tap_layers, (std::vector<int>{2, 4}));
  EXPECT_EQ(dataset.manifest().target_id, "qwen3");
  // Rerunning a complete run does nothing and says so.
  const auto again = run_dspark({"regen", "-m", golden_model("qwen3").string(), "--prompts", prompts.string(), "-o",
                                 data.string(), "-n", "4", "--device", "cpu", "--tap-layers", "2,4"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("already complete"), std::string::npos) << again.out;
}

}  // namespace
}  // namespace dspark
