// Confidence calibration: the metrics against hand-computed values, STS
// recovering a known miscalibration, the threshold rule case by case, the
// checkpoint write that touches only config.sts, the draft loop applying the
// fit the way it was fitted, and `dspark calibrate` end to end.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_runner.h"
#include "core/file.h"
#include "core/random.h"
#include "golden.h"
#include "model/transformer.h"
#include "random_drafter.h"
#include "train/calibrate.h"

namespace dspark {
namespace {

using testing::TemporaryDirectory;

TEST(CalibrationMetrics, EceMatchesAHandComputedValue) {
  // Bins of width 0.1: bin 0 {0.05: 0}, bin 1 {0.15: 1, 0.12: 0}, bin 5 {0.55: 1}, bin 9 {0.95: 1}.
  // |0.05| + |0.15 + 0.12 - 1| + |0.55 - 1| + |0.95 - 1| = 0.05 + 0.73 + 0.45 + 0.05 = 1.28, over 5.
  const std::vector<double> predicted = {0.05, 0.15, 0.12, 0.95, 0.55};
  const std::vector<uint8_t> outcome = {0, 1, 0, 1, 1};
  EXPECT_NEAR(expected_calibration_error(predicted, outcome), 1.28 / 5, 1e-12);
  // Two bins: [0, 0.5) holds 0.05, 0.15, 0.12 (gap 0.32 - 1); [0.5, 1] holds 0.95, 0.55 (gap 1.5 - 2).
  EXPECT_NEAR(expected_calibration_error(predicted, outcome, 2), (0.68 + 0.5) / 5, 1e-12);
  // 1.0 falls in the last bin, not past it.
  EXPECT_NEAR(expected_calibration_error(std::vector<double>{1.0}, std::vector<uint8_t>{0}), 1.0, 1e-12);
  EXPECT_EQ(expected_calibration_error({}, {}), 0.0);
}

TEST(CalibrationMetrics, AurocMatchesAHandComputedValue) {
  // Positives score 0.35, 0.8, 0.4; negatives 0.1, 0.4. Pairs won: 0.35>0.1, 0.8>0.1, 0.8>0.4,
  // 0.4>0.1, and 0.4 = 0.4 counts one half: 4.5 of 6.
  const std::vector<double> predicted = {0.1, 0.4, 0.35, 0.8, 0.4};
  const std::vector<uint8_t> outcome = {0, 0, 1, 1, 1};
  EXPECT_NEAR(auroc(predicted, outcome), 4.5 / 6, 1e-12);
  EXPECT_NEAR(auroc(std::vector<double>{0.2, 0.9}, std::vector<uint8_t>{1, 0}), 0.0, 1e-12);
  EXPECT_TRUE(std::isnan(auroc(std::vector<double>{0.2, 0.9}, std::vector<uint8_t>{1, 1})));
}

TEST(CalibrationMetrics, ReliabilityBinsAndSurvivalSamples) {
  const auto bins = reliability_bins(std::vector<double>{0.05, 0.15, 0.12, 0.95}, std::vector<uint8_t>{0, 1, 0, 1});
  ASSERT_EQ(bins.size(), 3u);
  EXPECT_NEAR(bins[1].predicted, 0.135, 1e-12);
  EXPECT_NEAR(bins[1].observed, 0.5, 1e-12);
  EXPECT_EQ(bins[1].count, 2);
  // One round, confidences 0.8, 0.5, 0.9, two accepted: survival 0.8, 0.4, 0.36 against 1, 1, 0.
  const std::vector<CalibrationRound> rounds = {{{0.8f, 0.5f, 0.9f}, 2}};
  const SurvivalSamples raw = survival_samples(rounds, {});
  ASSERT_EQ(raw.predicted.size(), 3u);
  EXPECT_NEAR(raw.predicted[2], 0.8 * 0.5 * 0.9, 1e-6);
  EXPECT_EQ(raw.survived, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(raw.position, (std::vector<int>{0, 1, 2}));
  // T = 2 on position 1: σ(logit(0.5) / 2) = 0.5; T = 0.5 on position 2: σ(2·logit(0.9)) = 81/82.
  const std::vector<float> temperatures = {1.0f, 2.0f, 0.5f};
  EXPECT_NEAR(survival_samples(rounds, temperatures).predicted[2], 0.8 * 0.5 * (81.0 / 82.0), 1e-6);
}

// Rounds whose true per-position acceptance is σ(z_k / T_k) while the drafter
// reports σ(z_k): raw logits z_k ~ N(1, 2²), acceptance sequential.
std::vector<CalibrationRound> miscalibrated_rounds(const std::vector<double>& true_temperatures, int count,
                                                   uint64_t seed) {
  Rng rng(seed);
  auto normal = [&] {
    const double u1 = std::max(rng.uniform(), 1e-12), u2 = rng.uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  };
  std::vector<CalibrationRound> rounds(count);
  for (CalibrationRound& round : rounds) {
    bool alive = true;
    for (double temperature : true_temperatures) {
      const double z = 1.0 + 2.0 * normal();
      round.confidence.push_back(float(1.0 / (1.0 + std::exp(-z))));
      const bool accepted = rng.uniform() < 1.0 / (1.0 + std::exp(-z / temperature));
      if (alive && accepted) ++round.accepted;
      alive = alive && accepted;
    }
  }
  return rounds;
}

TEST(CalibrationSts, RecoversAKnownMiscalibration) {
  const std::vector<double> truth = {3.0, 0.4, 2.0, 0.5};
  const auto rounds = miscalibrated_rounds(truth, 40000, 11);
  const std::vector<float> fitted = fit_sts_temperatures(rounds, 4);
  ASSERT_EQ(fitted.size(), 4u);
  // Fewer rounds survive to inform the deeper positions, and their survival
  // probabilities crowd the lowest ECE bin: over seeds 1..10 positions 0 and 1
  // landed within 15% of the truth, 2 and 3 within 23%.
  for (size_t k = 0; k < truth.size(); ++k)
    EXPECT_LT(std::abs(std::log(fitted[k] / truth[k])), std::log(k < 2 ? 1.15 : 1.25))
        << "position " << k << ": T " << fitted[k] << " for a true " << truth[k];
  const SurvivalSamples before = survival_samples(rounds, {});
  const SurvivalSamples after = survival_samples(rounds, fitted);
  const std::vector<float> true_as_float(truth.begin(), truth.end());
  const SurvivalSamples ideal = survival_samples(rounds, true_as_float);
  const double ece_before = expected_calibration_error(before.predicted, before.survived);
  const double ece_after = expected_calibration_error(after.predicted, after.survived);
  EXPECT_GT(ece_before, 0.04) << ece_before;  // 0.062 here
  EXPECT_LT(ece_after, 0.01) << ece_after;    // 0.0020 to 0.0035 over seeds 1..10
  // No worse than the true temperatures by more than sampling noise.
  EXPECT_LT(ece_after, expected_calibration_error(ideal.predicted, ideal.survived) + 0.003);
}

TEST(CalibrationSts, AlreadyCalibratedConfidencesKeepTemperatureNearOne) {
  const auto rounds = miscalibrated_rounds({1.0, 1.0, 1.0}, 40000, 5);
  for (float temperature : fit_sts_temperatures(rounds, 3)) EXPECT_NEAR(temperature, 1.0f, 0.12f);
}

TEST(CalibrationSts, TooFewSamplesKeepTemperatureOne) {
  auto rounds = miscalibrated_rounds({3.0, 3.0}, 49, 2);
  EXPECT_EQ(fit_sts_temperatures(rounds, 2), (std::vector<float>{1.0f, 1.0f}));
  // Position 1 missing from most rounds: position 0 is fitted, position 1 is not.
  rounds = miscalibrated_rounds({3.0, 3.0}, 2000, 2);
  for (size_t r = 40; r < rounds.size(); ++r) rounds[r].confidence.resize(1);
  const auto fitted = fit_sts_temperatures(rounds, 2);
  EXPECT_NE(fitted[0], 1.0f);
  EXPECT_EQ(fitted[1], 1.0f);
}

// `count` rounds that drafted two positions with c_1 = confidence: accepted 2
// (position 1 accepted), 1 (reached and rejected) or 0 (never reached).
void add_rounds(std::vector<CalibrationRound>& rounds, int count, float confidence, int accepted) {
  for (int i = 0; i < count; ++i) rounds.push_back({{0.1f, confidence}, accepted});
}

TEST(CalibrationThresholds, FollowTheLaplaceRuleExactly) {
  const std::vector<float> unit = {1.0f, 1.0f};
  std::vector<CalibrationRound> rounds;
  add_rounds(rounds, 30, 0.9f, 2);
  add_rounds(rounds, 30, 0.3f, 1);
  add_rounds(rounds, 40, 0.3f, 0);  // never reached position 1: not evidence about it
  // t = 0 (or 0.3): (30 + 1) / (60 + 2) = 0.5; t = 0.9: 31 / 32 = 0.969.
  auto fit = [&](double target) { return fit_thresholds(rounds, unit, 2, target); };
  EXPECT_EQ(fit(0.5)[1], 0.0f);
  EXPECT_NEAR(fit(0.8)[1], 0.9f, 1e-6);
  EXPECT_NEAR(fit(0.96)[1], 0.9f, 1e-6);
  EXPECT_EQ(fit(0.97)[1], kNeverVerify);  // nothing reaches it: never verify position 1
  for (double target : {0.5, 0.8, 0.97}) EXPECT_EQ(fit(target)[0], 0.0f);  // position 0 is never pruned

  // The smallest qualifying threshold, where precision is not monotone in t:
  // t = 0: 26/57 = 0.456; t = 0.5: 26/27 = 0.963; t = 0.8: 6/7 = 0.857.
  rounds.clear();
  add_rounds(rounds, 30, 0.2f, 1);
  add_rounds(rounds, 20, 0.5f, 2);
  add_rounds(rounds, 5, 0.8f, 2);
  EXPECT_NEAR(fit(0.85)[1], 0.5f, 1e-6);
  EXPECT_NEAR(fit(0.9)[1], 0.5f, 1e-6);
  EXPECT_EQ(fit(0.97)[1], kNeverVerify);
  EXPECT_EQ(fit(0.45)[1], 0.0f);
}

TEST(CalibrationThresholds, UnderFiftySamplesNoPruning) {
  const std::vector<float> unit = {1.0f, 1.0f};
  std::vector<CalibrationRound> rounds;
  add_rounds(rounds, 49, 0.3f, 1);   // 49 rejections: precision 1/51
  add_rounds(rounds, 500, 0.3f, 0);  // many rounds, but none reached position 1
  EXPECT_EQ(fit_thresholds(rounds, unit, 2, 0.5)[1], 0.0f);
  add_rounds(rounds, 1, 0.3f, 1);  // the 50th reached round: the rule applies
  EXPECT_EQ(fit_thresholds(rounds, unit, 2, 0.5)[1], kNeverVerify);
}

TEST(CalibrationThresholds, AreFittedOnTheCalibratedConfidence) {
  // T = 2 on position 1: 0.9 calibrates to σ(logit(0.9) / 2) = 0.75, 0.3 to 0.3956.
  const std::vector<float> temperatures = {1.0f, 2.0f};
  std::vector<CalibrationRound> rounds;
  add_rounds(rounds, 30, 0.9f, 2);
  add_rounds(rounds, 30, 0.3f, 1);
  EXPECT_NEAR(fit_thresholds(rounds, temperatures, 2, 0.8)[1], 0.75f, 1e-6);
  EXPECT_NEAR(calibrated_confidence(0.9, 2.0), 0.75, 1e-12);
}

Drafter small_random_drafter(const ModelConfig& target, int gamma) {
  DrafterConfig config;
  config.gamma = gamma, config.d_draft = 32, config.num_layers = 1, config.num_heads = 4, config.markov_rank = 8;
  config.tap_layers = default_tap_layers(target.num_layers);
  Drafter drafter = init_drafter(config, {target.hidden_size, target.vocab_size, target.rms_norm_eps}, "qwen3", 3);
  testing::randomize_parameters(drafter, 29, 3.0f);
  return drafter;
}

TEST(CalibrationCheckpoint, WritesOnlyConfigSts) {
  TemporaryDirectory directory;
  const ModelConfig target = load_model_config(testing::golden_model("qwen3"));
  Drafter drafter = small_random_drafter(target, 3);
  drafter.metadata = {{"training", {{"steps", 1200}, {"note", "kept"}}}, {"config", {{"custom", Json::array({1, 2})}}}};
  save_drafter(drafter, directory.path);
  const Json before = read_json_file(directory.path / "dspark.json");
  const std::string weights = read_text_file(directory.path / "model.safetensors");
  StsCalibration calibration{{0.0f, 0.25f, 1.0f}, {1.5f, 0.75f, 1.0f}, 0.6f, 321};
  write_calibration(directory.path, calibration);
  Json after = read_json_file(directory.path / "dspark.json");
  EXPECT_EQ(after["config"]["sts"]["samples"], 321);
  after["config"].erase("sts");
  EXPECT_EQ(after, before);  // every other field exactly as it was
  EXPECT_EQ(read_text_file(directory.path / "model.safetensors"), weights);
  const Drafter loaded = load_drafter(directory.path);
  ASSERT_TRUE(loaded.config.sts.has_value());
  EXPECT_EQ(loaded.config.sts->thresholds, calibration.thresholds);
  EXPECT_EQ(loaded.config.sts->temperatures, calibration.temperatures);
  EXPECT_FLOAT_EQ(loaded.config.sts->target, 0.6f);
  // A file written elsewhere keeps its own key order: only the calibration is added.
  const std::string foreign =
      "{\"variant\": \"dspark\", \"kind\": \"dspark-drafter\", \"config\": {\"gamma\": 1, \"dDraft\": 8}, "
      "\"zeta\": [1, 2], \"alpha\": {\"b\": 1, \"a\": 2}}";
  std::filesystem::create_directories(directory.path / "foreign");
  write_text_file_atomic(directory.path / "foreign" / "dspark.json", foreign);
  write_calibration(directory.path / "foreign", {{0.0f}, {2.0f}, 0.5f, 9});
  const std::string rewritten = read_text_file(directory.path / "foreign" / "dspark.json");
  EXPECT_LT(rewritten.find("\"variant\""), rewritten.find("\"kind\""));
  EXPECT_LT(rewritten.find("\"zeta\""), rewritten.find("\"alpha\""));
  EXPECT_LT(rewritten.find("\"b\""), rewritten.find("\"a\""));
  EXPECT_LT(rewritten.find("\"dDraft\""), rewritten.find("\"sts\""));
  Json reread = Json::parse(rewritten);
  EXPECT_EQ(reread["config"]["sts"]["temperatures"], Json::array({2.0}));
  reread["config"].erase("sts");
  EXPECT_EQ(reread, Json::parse(foreign));
  EXPECT_NE(testing::error_of([&] {
              write_calibration(directory.path, {{0.0f}, {1.0f}, 0.5f, 1});
            }).find("1 positions for gamma 3"),
            std::string::npos);
}

// The draft loop applies a fitted calibration the way it was fitted: reported
// confidences are σ(logit(raw) / T_k), and a row stops at the first k >= 1
// whose calibrated confidence is below threshold[k].
TEST(CalibrationDraftLoop, TemperaturesScaleTheLogitAndThresholdsReadTheCalibratedValue) {
  const Transformer model = load_transformer(testing::golden_model("qwen3"));
  const int gamma = 5;
  Drafter drafter = small_random_drafter(model.config, gamma);
  DraftContext context;
  Rng rows(8);
  std::vector<float> tapped(size_t(6) * drafter.config.tap_layers.size() * model.config.hidden_size);
  for (float& value : tapped) value = float(rows.uniform() * 2.0 - 1.0);
  extend_draft_context(drafter, context, tapped.data(), 6);
  const DraftRequest request{&context, 17, nullptr};
  DraftWorkspace workspace;
  std::vector<DraftResult> raw, calibrated;
  draft(drafter, target_head_of(model), {&request, 1}, DraftOptions{}, workspace, raw);
  ASSERT_EQ(raw[0].confidence.size(), size_t(gamma));

  const std::vector<float> temperatures = {0.5f, 2.0f, 1.0f, 3.0f, 0.25f};
  std::vector<double> expected;
  for (int k = 0; k < gamma; ++k) expected.push_back(calibrated_confidence(raw[0].confidence[k], temperatures[k]));
  // Thresholds that cut at position 3: just above its calibrated value, below the others'.
  std::vector<float> thresholds(gamma, 0.0f);
  thresholds[3] = float(expected[3]) + 1e-4f;
  thresholds[0] = 2.0f;  // position 0 is kept whatever its threshold
  drafter.config.sts = StsCalibration{thresholds, temperatures, 0.5f, 100};
  draft(drafter, target_head_of(model), {&request, 1}, DraftOptions{}, workspace, calibrated);
  ASSERT_EQ(calibrated[0].tokens.size(), 3u);
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(calibrated[0].confidence[k], expected[k], 1e-5) << k;
  EXPECT_EQ(std::vector<int32_t>(raw[0].tokens.begin(), raw[0].tokens.begin() + 3), calibrated[0].tokens);
  // Without threshold pruning (a scheduler decides instead) the calibrated confidences remain.
  DraftOptions unpruned;
  unpruned.calibrated_thresholds = false;
  draft(drafter, target_head_of(model), {&request, 1}, unpruned, workspace, calibrated);
  ASSERT_EQ(calibrated[0].confidence.size(), size_t(gamma));
  for (int k = 0; k < gamma; ++k) EXPECT_NEAR(calibrated[0].confidence[k], expected[k], 1e-5) << k;
}

// The prompts the CLI tests decode.
std::filesystem::path write_prompts(const std::filesystem::path& directory) {
  const auto path = directory / "prompts.jsonl";
  write_text_file_atomic(path,
                         "{\"prompt\": \"def f(x):\\n    return x\\n\\ndef f(x):\"}\n"
                         "{\"prompt\": \"import os\\nimport sys\\nimport os\\nimport\"}\n"
                         "{\"prompt\": \"hello world hello world hello\"}\n"
                         "{\"messages\": [{\"role\": \"user\", \"content\": \"Count to ten.\"}]}\n");
  return path;
}

bool is_png(const std::string& bytes) { return bytes.size() > 5000 && bytes.substr(0, 8) == "\x89PNG\r\n\x1a\n"; }

TEST(CliCalibrate, WritesConfigStsPreservingEveryOtherFieldAndAPlot) {
  TemporaryDirectory directory;
  const auto drafter_directory = directory.path / "drafter";
  const ModelConfig target = load_model_config(testing::golden_model("qwen3"));
  Drafter drafter = small_random_drafter(target, 4);
  drafter.metadata = {{"training", {{"steps", 77}}}, {"config", {{"note", "survives"}}}};
  save_drafter(drafter, drafter_directory, Dtype::BF16);
  const Json before = read_json_file(drafter_directory / "dspark.json");
  const std::string weights = read_text_file(drafter_directory / "model.safetensors");
  const auto plot = directory.path / "reliability.png";
  const auto result =
      testing::run_dspark({"calibrate", "-m", testing::golden_model("qwen3").string(), "-d", drafter_directory.string(),
                           "--prompts", write_prompts(directory.path).string(), "-n", "24", "--temperature", "1",
                           "--target-precision", "0.6", "--plot", plot.string(), "--json"});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const Json out = Json::parse(result.out);
  EXPECT_GT(out["rounds"].get<long>(), 50);
  for (const char* when : {"before", "after"}) {
    EXPECT_GE(out[when]["ece"].get<double>(), 0.0);
    EXPECT_TRUE(out[when].contains("auroc"));
  }
  ASSERT_EQ(out["positions"].size(), 4u);

  Json after = read_json_file(drafter_directory / "dspark.json");
  const Json sts = after["config"]["sts"];
  EXPECT_EQ(sts["thresholds"].size(), 4u);
  EXPECT_EQ(sts["thresholds"][0], 0.0);  // position 0 is never pruned
  EXPECT_EQ(sts["temperatures"], out["temperatures"]);
  EXPECT_EQ(sts["thresholds"], out["thresholds"]);
  EXPECT_NEAR(sts["target"].get<double>(), 0.6, 1e-6);
  EXPECT_EQ(sts["samples"], out["rounds"]);
  after["config"].erase("sts");
  EXPECT_EQ(after, before);
  EXPECT_EQ(read_text_file(drafter_directory / "model.safetensors"), weights);
  const Drafter loaded = load_drafter(drafter_directory);
  ASSERT_TRUE(loaded.config.sts.has_value());
  EXPECT_EQ(loaded.config.sts->temperatures.size(), 4u);
  EXPECT_TRUE(is_png(read_text_file(plot)));

  // Calibrating again refits from raw confidences: the same data, the same fit.
  const auto again =
      testing::run_dspark({"calibrate", "-m", testing::golden_model("qwen3").string(), "-d", drafter_directory.string(),
                           "--prompts", write_prompts(directory.path).string(), "-n", "24", "--temperature", "1",
                           "--target-precision", "0.6", "--json"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(Json::parse(again.out)["temperatures"], out["temperatures"]);
}

TEST(CliCalibrate, RefusesWhatItCannotCalibrate) {
  TemporaryDirectory directory;
  const auto prompts = write_prompts(directory.path);
  for (const auto& [arguments, fragment] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"-d", "ngram", "--prompts", prompts.string()}, "no confidences"},
           {{"-d", (directory.path / "none").string(), "--prompts", prompts.string()}, "not a drafter directory"},
           {{"-d", directory.path.string(), "--prompts", (directory.path / "none.jsonl").string()}, "cannot read"}}) {
    std::vector<std::string> command = {"calibrate", "-m", testing::golden_model("qwen3").string()};
    command.insert(command.end(), arguments.begin(), arguments.end());
    const auto result = testing::run_dspark(command);
    EXPECT_EQ(result.exit_code, 1) << result.err;
    EXPECT_EQ(result.err.rfind("error: ", 0), 0u) << result.err;
    EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
  }
}

}  // namespace
}  // namespace dspark
