// The README's first command, `dspark demo`, and the models it ships with:
// the shipped target and drafter load, belong together and decode losslessly;
// the demo with no flags (pointed at small test-made models through
// DSPARK_MODELS_DIR) prints the text once and a report whose plain text
// equals an independent `dspark generate` run; bad inputs get one error line.
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

#include "cli_runner.h"
#include "core/file.h"
#include "core/json.h"
#include "golden.h"
#include "model/generate.h"
#include "model/prompts.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/draft_sources.h"
#include "spec/drafter.h"
#include "spec/speculative.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::run_dspark;
using testing::TemporaryDirectory;

const std::filesystem::path kSourceTree = DSPARK_SOURCE_DIR;

void expect_one_error_line(const testing::CommandResult& result, const std::string& fragment) {
  EXPECT_EQ(result.exit_code, 1) << "stderr: " << result.err;
  EXPECT_EQ(result.err.rfind("error: ", 0), 0u) << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
}

// The text of prompt line `line` of the held-out code prompts.
std::string heldout_code_prompt(int line) {
  for (const PromptEntry& entry : read_prompt_file(kSourceTree / "data/prompts/heldout_code.jsonl"))
    if (entry.line == line) return entry.prompt;
  ADD_FAILURE() << "heldout_code.jsonl has no usable line " << line;
  return "";
}

// Each shipped drafter (gamma 7, the default, and gamma 10) loads for the
// shipped target, belongs to it and decodes losslessly at its own gamma.
TEST(ShippedModels, LoadBelongTogetherAndDecodeLosslessly) {
  const std::filesystem::path target_directory = kSourceTree / "models/dspark-target";
  if (!std::filesystem::exists(target_directory))
    GTEST_SKIP() << "models/dspark-target is absent from " << kSourceTree
                 << " (the repository ships it; nothing to check without it)";
  const std::unique_ptr<Target> target = load_target(target_directory, "cpu");
  const Tokenizer tokenizer = Tokenizer::load(target_directory);
  for (auto [drafter_name, gamma] : {std::pair{"dspark-drafter", 7}, std::pair{"dspark-drafter-gamma10", 10}}) {
    SCOPED_TRACE(drafter_name);
    const std::filesystem::path drafter_directory = kSourceTree / "models" / drafter_name;
    ASSERT_TRUE(std::filesystem::exists(drafter_directory)) << "the repository ships " << drafter_directory;
    // load_draft_source refuses a drafter whose dimensions or taps do not fit the target
    // (check_drafter_matches_target); a drafter trained for another target only warns there.
    LoadedDraftSource source = load_draft_source(drafter_directory.string(), target_directory, *target, 0.0f);
    ASSERT_TRUE(source.drafter);
    EXPECT_EQ(source.drafter->target_id, target_id_of(target_directory));
    EXPECT_EQ(source.drafter->dims.hidden_size, target->config().hidden_size);
    EXPECT_EQ(source.drafter->dims.vocab_size, target->config().vocab_size);
    EXPECT_EQ(source.default_gamma, gamma);

    for (int line : {2, 3}) {  // held-out prompts (the demo's own default is line 20)
      const std::vector<std::vector<int32_t>> prompts = {tokenizer.encode(heldout_code_prompt(line))};
      GenerateOptions plain_options;
      plain_options.max_new_tokens = 16;
      plain_options.ignore_eos = true;
      const GenerateResult plain = generate(*target, prompts[0], plain_options);
      SpeculativeOptions spec_options;
      spec_options.max_new_tokens = 16;
      spec_options.ignore_eos = true;
      spec_options.gamma = source.default_gamma;
      const SpeculativeResult spec = speculative_generate(*target, *source.source, prompts, spec_options)[0];
      EXPECT_EQ(spec.tokens, plain.tokens) << "held-out prompt line " << line;
      EXPECT_EQ(tokenizer.decode(spec.tokens), tokenizer.decode(plain.tokens));
      EXPECT_GE(spec.stats.tau(), 1.0);
    }
  }
}

// A models directory as the repository's, made from the golden qwen3 model
// and a fresh small drafter for it (the demo's speed is not the point here).
struct TestModels {
  TemporaryDirectory directory;
  std::filesystem::path target, drafter;
  TestModels() {
    target = directory.path / "dspark-target";
    drafter = directory.path / "dspark-drafter";
    std::filesystem::create_directory_symlink(golden_model("qwen3"), target);
    const auto made = run_dspark({"draft-init", "-m", target.string(), "-o", drafter.string(), "--d-draft", "32",
                                  "--layers", "1", "--heads", "4", "--markov-rank", "8", "--gamma", "4"});
    EXPECT_EQ(made.exit_code, 0) << made.err;
  }
  std::string environment() const { return "DSPARK_MODELS_DIR=" + directory.path.string(); }
};

// The value after `label` on the report line that starts with it.
std::string report_value(const std::string& out, const std::string& label) {
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line))
    if (line.rfind(label, 0) == 0 && line.size() > label.size() && line[label.size()] == ' ') {
      const size_t start = line.find_first_not_of(' ', label.size());
      return start == std::string::npos ? "" : line.substr(start);
    }
  return "(no line " + label + ")";
}

TEST(CliDemo, NoFlagsPrintsTheTextOnceAndTheReport) {
  const TestModels models;
  const auto result = run_dspark({"demo"}, {models.environment()});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const std::string& out = result.out;

  // The text: the default held-out prompt, then plain greedy decoding's
  // continuation, which must equal what `dspark generate` makes of the same prompt.
  const std::string prompt = heldout_code_prompt(20);
  const auto generated = run_dspark({"generate", "-m", models.target.string(), "-p", prompt, "-n", "128", "--json"});
  ASSERT_EQ(generated.exit_code, 0) << generated.err;
  const Json reference = Json::parse(generated.out);
  const std::string opening = "--- continuation (plain decoding, greedy) ---\n";
  const std::string closing = "\n--- plain vs speculative decoding";
  const size_t begin = out.find(opening), end = out.find(closing);
  ASSERT_NE(begin, std::string::npos) << out;
  ASSERT_NE(end, std::string::npos) << out;
  EXPECT_EQ(out.substr(begin + opening.size(), end - begin - opening.size()), reference["text"].get<std::string>());
  EXPECT_NE(out.find(prompt), std::string::npos) << "the prompt is shown";
  EXPECT_NE(out.find("heldout_code.jsonl line 20"), std::string::npos) << out;
  const std::string& text = reference["text"].get<std::string>();
  ASSERT_GT(text.size(), 20u);
  size_t copies = 0;
  for (size_t at = out.find(text); at != std::string::npos; at = out.find(text, at + 1)) ++copies;
  EXPECT_EQ(copies, 1u) << "the text appears once: " << out;

  // The report: each mode's passes (5 by default) each made the tokens generate did.
  const size_t tokens = 5 * reference["tokens"].size();
  for (const char* mode : {"plain", "speculative"}) {
    std::istringstream row(report_value(out, mode));
    long count = 0;
    double seconds = 0.0, rate = 0.0;
    row >> count >> seconds >> rate;
    EXPECT_EQ(size_t(count), tokens) << mode << ": " << out;
    EXPECT_GT(seconds, 0.0) << mode;
    EXPECT_GT(rate, 0.0) << mode;
  }
  EXPECT_EQ(report_value(out, "speed-up").back(), 'x') << out;
  EXPECT_NE(report_value(out, "tau").find("tokens per target forward"), std::string::npos) << out;
  std::istringstream acceptance(report_value(out, "acceptance by position"));
  std::vector<double> rates;
  for (double rate; acceptance >> rate;) rates.push_back(rate);
  EXPECT_EQ(rates.size(), 4u) << "one rate per position of gamma 4: " << out;
  for (double rate : rates) EXPECT_TRUE(rate >= 0.0 && rate <= 1.0) << rate;
  EXPECT_EQ(report_value(out, "text identical"), "yes") << out;
}

TEST(CliDemo, JsonAndPlotCarryTheSameMeasurements) {
  const TestModels models;
  TemporaryDirectory directory;
  const auto plot = directory.path / "acceptance.png";
  const auto result = run_dspark({"demo", "-p", "import os\nimport sys\nimport os\nimport", "-n", "40", "--ignore-eos",
                                  "--schedule", "off", "--passes", "2", "--plot", plot.string(), "--json"},
                                 {models.environment()});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const Json out = Json::parse(result.out);
  EXPECT_TRUE(out["text_identical"].get<bool>());
  EXPECT_EQ(out["passes"], 2);
  EXPECT_EQ(out["plain"]["tokens"], 2 * 40);
  EXPECT_EQ(out["speculative"]["tokens"], 2 * 40);
  EXPECT_NEAR(out["speedup"].get<double>(),
              out["speculative"]["tokens_per_s"].get<double>() / out["plain"]["tokens_per_s"].get<double>(), 1e-9);
  for (const char* mode : {"plain", "speculative"}) {  // the rate is the median pass's (upper middle of 2)
    const auto rates = out[mode]["pass_tokens_per_s"].get<std::vector<double>>();
    ASSERT_EQ(rates.size(), 2u) << mode;
    EXPECT_EQ(out[mode]["tokens_per_s"].get<double>(), std::max(rates[0], rates[1])) << mode;
  }
  EXPECT_GE(out["tau"].get<double>(), 1.0);
  EXPECT_EQ(out["acceptance_by_position"].size(), 4u);
  EXPECT_EQ(out["schedule"], "off");
  const std::string png = read_text_file(plot);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(CliDemo, BadInputsGiveOneErrorLine) {
  expect_one_error_line(run_dspark({"demo"}, {"DSPARK_MODELS_DIR=/no/such/models"}),
                        "the target /no/such/models/dspark-target does not exist");
  TemporaryDirectory directory;
  std::filesystem::create_directory_symlink(golden_model("qwen3"), directory.path / "dspark-target");
  expect_one_error_line(run_dspark({"demo"}, {"DSPARK_MODELS_DIR=" + directory.path.string()}),
                        "dspark-drafter does not exist");
  // A drafter made for another target (the golden llama: hidden size 96, not 64).
  const auto made = run_dspark({"draft-init", "-m", golden_model("llama").string(), "-o",
                                (directory.path / "dspark-drafter").string(), "--d-draft", "32", "--heads", "4",
                                "--layers", "1", "--markov-rank", "8"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  expect_one_error_line(run_dspark({"demo"}, {"DSPARK_MODELS_DIR=" + directory.path.string()}),
                        "the drafter was made for a target with hidden size 96");
}

}  // namespace
}  // namespace dspark
