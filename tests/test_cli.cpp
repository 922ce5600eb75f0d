// End to end through the `dspark` binary: greedy text reproduces HF, the
// perplexity verb agrees with HF, and bad input gets one clear error line.
#include <gtest/gtest.h>

#include "cli_runner.h"
#include "core/file.h"
#include "core/json.h"
#include "golden.h"
#include "model/tokenizer.h"
#include "spec/drafter.h"

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

namespace dspark {
namespace {

TEST(CliDraftInit, WritesALoadableDrafterForTheTarget) {
  TemporaryDirectory directory;
  const auto output = directory.path / "drafter";
  const auto result = run_dspark({"draft-init", "-m", testing::golden_model("qwen3").string(), "-o", output.string(),
                                  "--gamma", "4", "--d-draft", "32", "--layers", "2", "--heads", "4", "--markov-rank",
                                  "8", "--seq-head", "rnn", "--seed", "9"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const Drafter drafter = load_drafter(output);
  EXPECT_EQ(drafter.config.seq_head, "rnn");
  EXPECT_EQ(drafter.config.tap_layers, default_tap_layers(4));
  EXPECT_EQ(drafter.target_id, "qwen3");
  check_drafter_matches_target(drafter, load_model_config(testing::golden_model("qwen3")), "qwen3");
  // Same flags, same seed: the same weights.
  const auto again = run_dspark({"draft-init", "-m", testing::golden_model("qwen3").string(), "-o",
                                 (directory.path / "again").string(), "--gamma", "4", "--d-draft", "32", "--layers",
                                 "2", "--heads", "4", "--markov-rank", "8", "--seq-head", "rnn", "--seed", "9"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(read_text_file(output / "model.safetensors"), read_text_file(directory.path / "again" / "model.safetensors"));
}

TEST(CliDraftInit, BadTapLayersAreRefused) {
  TemporaryDirectory directory;
  expect_one_error_line(run_dspark({"draft-init", "-m", testing::golden_model("qwen3").string(), "-o",
                                    directory.path.string(), "--tap-layers", "1,2", "--d-draft", "32", "--heads", "4"}),
                        "last tap layer must be 4");
  expect_one_error_line(run_dspark({"draft-init", "-m", testing::golden_model("qwen3").string(), "-o",
                                    directory.path.string(), "--d-draft", "30", "--heads", "4"}),
                        "not a multiple");
}

}  // namespace
}  // namespace dspark

namespace dspark {
namespace {

TEST(CliSpeculative, GreedyTextIsTheSameWithAndWithoutADraft) {
  TemporaryDirectory directory;
  const std::string target = testing::golden_model("qwen3").string();
  ASSERT_EQ(run_dspark({"draft-init", "-m", target, "-o", (directory.path / "d").string(), "--d-draft", "32",
                        "--layers", "1", "--heads", "4", "--markov-rank", "8", "--gamma", "4"})
                .exit_code,
            0);
  const std::string prompt = "import os\nimport sys\nimport os\nimport";
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> arguments = {"generate", "-m", target, "-p", prompt, "-n", "30", "--ignore-eos", "--json"};
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    const auto result = run_dspark(arguments);
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return Json::parse(result.out);
  };
  const Json plain = run({});
  for (const std::vector<std::string>& draft :
       {std::vector<std::string>{"-d", "ngram"}, {"-d", (directory.path / "d").string(), "--min-conf", "0.4"}}) {
    const Json spec = run({draft[0], draft[1], "--trace"});
    EXPECT_EQ(spec["text"], plain["text"]);
    EXPECT_EQ(spec["tokens"], plain["tokens"]);
    const Json& stats = spec["stats"];
    for (const char* key : {"rounds", "drafted", "accepted", "acceptance_by_position", "tau"})
      EXPECT_TRUE(stats.contains(key)) << key;
    ASSERT_EQ(spec["trace"].size(), stats["rounds"].get<size_t>());
    size_t emitted = 0;
    for (const Json& round : spec["trace"]) {
      EXPECT_LE(round["accepted"].get<size_t>(), round["draft"].size());
      emitted += round["emitted"].size();
    }
    EXPECT_EQ(emitted, spec["tokens"].size());
  }
  // A drafter drafts at most the block it was trained for: more is an error, not a silent cut.
  const auto too_long = run_dspark(
      {"generate", "-m", target, "-p", prompt, "-n", "8", "-d", (directory.path / "d").string(), "--gamma", "5"});
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.err.find("exceeds the drafter's gamma of 4"), std::string::npos) << too_long.err;
}

TEST(CliSpeculative, BenchSpecRunsBothAndReportsAMatch) {
  TemporaryDirectory directory;
  const auto prompts = directory.path / "prompts.jsonl";
  write_text_file_atomic(prompts, "{\"prompt\": \"def f(x):\\n    return x\\n\\ndef f(x):\"}\nnot json\n"
                                  "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}\n");
  const auto result = run_dspark({"bench", "spec", "-m", testing::golden_model("qwen3").string(), "-d", "ngram",
                                  "--prompts", prompts.string(), "-n", "16", "--batch", "2", "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.err.find("prompts.jsonl:2 skipped"), std::string::npos) << result.err;
  const Json out = Json::parse(result.out);
  EXPECT_EQ(out["prompts"], 2);
  EXPECT_TRUE(out["all_outputs_match"].get<bool>());
  EXPECT_GE(out["tau"].get<double>(), 1.0);
}

TEST(CliSpeculative, AWidenedPairDecodesAsTheOriginalPair) {
  // bench/widen_checkpoint.py widens a target and its drafter with zeros (the
  // bench's stand-in for a bandwidth-bound target): the golden qwen3 (hidden
  // 64 -> 256, heads 4 -> 16) and a fresh drafter for it compute what they
  // did, so the perplexity agrees, greedy tokens are the same, and the widened
  // drafter accepts what the original accepted, round for round.
  TemporaryDirectory directory;
  const std::string target = testing::golden_model("qwen3").string(), drafter = (directory.path / "d").string();
  ASSERT_EQ(run_dspark({"draft-init", "-m", target, "-o", drafter, "--d-draft", "32", "--layers", "1", "--heads", "4",
                        "--markov-rank", "8", "--gamma", "4", "--seed", "3"})
                .exit_code,
            0);
  const auto tool = testing::golden_directory() / ".." / ".." / "bench" / "widen_checkpoint.py";
  const auto wide = directory.path / "wide";
  const std::string command = "python3 " + testing::shell_quote(tool.string()) + " --factor 2 --target " +
                              testing::shell_quote(target) + " --drafter " + testing::shell_quote(drafter) + " --out " +
                              testing::shell_quote(wide.string()) + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const std::string wide_target = (wide / "qwen3-x4").string(), wide_drafter = (wide / "d-x4").string();
  const ModelConfig config = load_model_config(wide_target);
  EXPECT_EQ(config.hidden_size, 256);
  EXPECT_EQ(config.num_heads, 16);

  auto json_of = [](const std::vector<std::string>& arguments) {
    const auto result = run_dspark(arguments);
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return result.exit_code == 0 ? Json::parse(result.out) : Json::object();
  };
  const std::string text = (testing::golden_model("qwen3") / "reference" / "perplexity.txt").string();
  const Json perplexity = json_of({"perplexity", "-m", target, "-f", text, "--json"});
  const Json wide_perplexity = json_of({"perplexity", "-m", wide_target, "-f", text, "--json"});
  EXPECT_NEAR(wide_perplexity["nll"].get<double>() / perplexity["nll"].get<double>(), 1.0, 1e-5);
  const std::string prompt = "import os\nimport sys\nimport os\nimport";
  for (const bool speculative : {false, true}) {
    std::vector<std::string> arguments = {"generate", "-p", prompt, "-n", "24", "--ignore-eos", "--json"};
    auto with = [&](const std::string& model, const std::string& draft) {
      std::vector<std::string> all = arguments;
      all.insert(all.end(), {"-m", model});
      if (speculative) all.insert(all.end(), {"-d", draft});
      return json_of(all);
    };
    const Json original = with(target, drafter), widened = with(wide_target, wide_drafter);
    EXPECT_EQ(widened["tokens"], original["tokens"]) << "speculative " << speculative;
    if (speculative) {
      EXPECT_EQ(widened["stats"]["accepted"], original["stats"]["accepted"]);
      EXPECT_EQ(widened["stats"]["rounds"], original["stats"]["rounds"]);
    }
  }
}

TEST(CliSpeculative, ADrafterForAnotherTargetIsRefused) {
  TemporaryDirectory directory;
  ASSERT_EQ(run_dspark({"draft-init", "-m", testing::golden_model("llama").string(), "-o", directory.path.string(),
                        "--d-draft", "32", "--heads", "4", "--layers", "1", "--markov-rank", "8"})
                .exit_code,
            0);
  expect_one_error_line(run_dspark({"generate", "-m", testing::golden_model("qwen3").string(), "-d",
                                    directory.path.string(), "-n", "4"}),
                        "the drafter was made for a target with hidden size 96");
  expect_one_error_line(run_dspark({"generate", "-m", testing::golden_model("qwen3").string(), "-d", "/no/drafter"}),
                        "not a drafter directory");
}

}  // namespace
}  // namespace dspark
