// End to end through the `dspark` binary: greedy text reproduces HF, the
// perplexity verb agrees with HF, and bad input gets one clear error line.
#include <gtest/gtest.h>

#include "cli_runner.h"
#include "core/json.h"
#include "golden.h"
#include "model/tokenizer.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::golden_reference;
using testing::run_dspark;
using testing::TemporaryDirectory;

void expect_one_error_line(const testing::CommandResult& result, const std::string& fragment) {
  EXPECT_EQ(result.exit_code, 1) << "stderr: " << result.err;
  EXPECT_EQ(result.err.rfind("error: ", 0), 0u) << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
}

class CliGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CliGolden, GreedyGenerateReproducesTransformers) {
  const Json forward = golden_reference(GetParam(), "forward.json");
  const Tokenizer tokenizer = Tokenizer::load(golden_model(GetParam()));
  for (const auto& expected : forward["greedy"]) {
    const auto& prompt = forward["prompts"][expected["prompt"].get<size_t>()];
    const auto tokens = expected["tokens"].get<std::vector<int>>();
    const auto result = run_dspark({"generate", "-m", golden_model(GetParam()).string(), "-p",
                                    prompt["text"].get<std::string>(), "-n", std::to_string(tokens.size()),
                                    "--temperature", "0", "--ignore-eos", "--json"});
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const Json out = Json::parse(result.out);
    EXPECT_EQ(out["prompt_tokens"].get<size_t>(), prompt["ids"].size());
    EXPECT_EQ(out["tokens"].get<std::vector<int>>(), tokens);
    EXPECT_EQ(out["text"].get<std::string>(), tokenizer.decode(tokens));
    EXPECT_GT(out["stats"]["tokens_per_s"].get<double>(), 0.0);
  }
}

TEST_P(CliGolden, PerplexityAgreesWithTransformers) {
  const Json forward = golden_reference(GetParam(), "forward.json");
  for (const auto& expected : forward["perplexity"]["cases"]) {
    const auto result = run_dspark({"perplexity", "-m", golden_model(GetParam()).string(), "-f",
                                    (golden_model(GetParam()) / "reference" / "perplexity.txt").string(),
                                    "--ctx", std::to_string(expected["context"].get<int>()), "--json"});
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const Json out = Json::parse(result.out);
    EXPECT_NEAR(out["ppl"].get<double>() / expected["ppl"].get<double>(), 1.0, 1e-4);
    EXPECT_NEAR(out["nll"].get<double>() / expected["nll"].get<double>(), 1.0, 1e-4);
    EXPECT_EQ(out["tokens"].get<long>(), expected["tokens"].get<long>());
  }
}

TEST_P(CliGolden, SamplingIsSeededAndReproducible) {
  auto sample = [&](const std::string& seed) {
    const auto result = run_dspark({"generate", "-m", golden_model(GetParam()).string(), "-p", "Once upon",
                                    "-n", "16", "--temperature", "1.0", "--top-p", "0.95", "--top-k", "50",
                                    "--seed", seed, "--ignore-eos", "--json"});
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return Json::parse(result.out)["tokens"].get<std::vector<int>>();
  };
  EXPECT_EQ(sample("3"), sample("3"));
  EXPECT_NE(sample("3"), sample("4"));
}

TEST_P(CliGolden, ChatWrapsThePromptInTheTemplate) {
  const Tokenizer tokenizer = Tokenizer::load(golden_model(GetParam()));
  const auto result = run_dspark({"generate", "-m", golden_model(GetParam()).string(), "-p", "Hi there",
                                  "-n", "2", "--chat", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto expected = tokenizer.encode(tokenizer.apply_chat_template({{"user", "Hi there"}}, true), false);
  EXPECT_EQ(Json::parse(result.out)["prompt_tokens"].get<size_t>(), expected.size());
}

INSTANTIATE_TEST_SUITE_P(Golden, CliGolden, ::testing::Values("qwen3", "llama"));

TEST(CliErrors, MissingModelDirectory) {
  expect_one_error_line(run_dspark({"generate", "-m", "/no/such/dir", "-p", "x"}), "does not exist");
}

TEST(CliErrors, CorruptSafetensors) {
  TemporaryDirectory directory;
  for (const auto& entry : std::filesystem::directory_iterator(golden_model("qwen3")))
    if (entry.is_regular_file()) std::filesystem::copy(entry.path(), directory.path);
  const auto weights = directory.path / "model.safetensors";
  std::filesystem::resize_file(weights, std::filesystem::file_size(weights) / 2);
  expect_one_error_line(run_dspark({"generate", "-m", directory.path.string(), "-p", "x"}), "truncated");
}

TEST(CliErrors, UnknownModelType) {
  TemporaryDirectory directory;
  for (const auto& entry : std::filesystem::directory_iterator(golden_model("qwen3")))
    if (entry.is_regular_file()) std::filesystem::copy(entry.path(), directory.path);
  Json config = read_json_file(directory.path / "config.json");
  config["model_type"] = "mamba";
  write_text_file_atomic(directory.path / "config.json", config.dump());
  expect_one_error_line(run_dspark({"generate", "-m", directory.path.string(), "-p", "x"}),
                        "unsupported model_type \"mamba\"");
}

TEST(CliErrors, PromptLongerThanTheContext) {
  std::string prompt;
  for (int i = 0; i < 400; ++i) prompt += "word" + std::to_string(i) + " ";
  expect_one_error_line(run_dspark({"generate", "-m", golden_model("qwen3").string(), "-p", prompt}),
                        "context is 256 positions");
}

TEST(CliErrors, MissingPerplexityFile) {
  expect_one_error_line(run_dspark({"perplexity", "-m", golden_model("qwen3").string(), "-f", "/no/file.txt"}),
                        "cannot read text file");
}

TEST(CliErrors, BadFlagsExitNonZero) {
  const auto result = run_dspark({"generate", "--temperature", "-1"});
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.exit_code, -1);
}

}  // namespace
}  // namespace dspark
