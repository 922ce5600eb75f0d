// dspark calibrate: fits a drafter's confidence calibration (DESIGN.md §5) on
// held-out prompts and stores it in its dspark.json config.sts. Unpruned
// speculative decoding records every round's raw confidences and accepted
// length; sequential temperature scaling and the per-position thresholds are
// fitted on them (train/calibrate.h says exactly how); ECE and AUROC of the
// predicted prefix survival are reported before and after, and --plot draws
// the reliability diagram.
#include <cmath>
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/json.h"
#include "core/plot.h"
#include "model/prompts.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/draft_sources.h"
#include "train/calibrate.h"

namespace dspark::cli {
namespace {

struct CalibrateFlags {
  std::string model = default_model_directory();
  std::string draft;
  std::string prompts;
  std::string plot;
  std::string device = "auto";
  int max_new_tokens = 128;
  int batch = 8;
  int gamma = 0;
  double target_precision = 0.5;
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool chat = false;
  bool json = false;
};

// ECE and AUROC of predicted survival, over all samples or one position's.
Json survival_metrics(const SurvivalSamples& samples, int position = -1) {
  std::vector<double> predicted;
  std::vector<uint8_t> survived;
  for (size_t i = 0; i < samples.predicted.size(); ++i)
    if (position < 0 || samples.position[i] == position)
      predicted.push_back(samples.predicted[i]), survived.push_back(samples.survived[i]);
  const double area = auroc(predicted, survived);
  return {{"ece", expected_calibration_error(predicted, survived)},
          {"auroc", std::isnan(area) ? Json(nullptr) : Json(area)},
          {"samples", predicted.size()}};
}

std::string format_auroc(const Json& value) {
  if (value.is_null()) return "  n/a";
  char text[16];
  std::snprintf(text, sizeof text, "%.3f", value.get<double>());
  return text;
}

void run_calibrate(const CalibrateFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  std::vector<std::vector<int32_t>> prompts;
  for (const PromptEntry& entry : read_prompt_file(flags.prompts))
    prompts.push_back(tokenize_prompt(tokenizer, entry, flags.chat));
  DSPARK_CHECK(!prompts.empty(), flags.prompts, ": no usable prompts");
  DSPARK_CHECK(flags.draft != "ngram", "-d ngram has no confidences to calibrate: give a DSpark drafter directory");
  LoadedDraftSource source = load_draft_source(flags.draft, flags.model, *target, 0.0f);
  Drafter& drafter = *source.drafter;
  const int gamma = drafter.config.gamma;
  DSPARK_CHECK(flags.gamma <= gamma, "--gamma ", flags.gamma, " exceeds the drafter's gamma of ", gamma);
  if (drafter.config.sts && !flags.json)
    std::fprintf(stderr, "note: %s already has config.sts; it is refitted from raw confidences\n",
                 flags.draft.c_str());
  drafter.config.sts.reset();  // the fit needs raw confidences and unpruned drafts
  // A source built now sees the cleared config (the GPU drafter copies it on
  // upload); the one load_draft_source built before goes.
  source.source.reset();
  const std::unique_ptr<DraftSource> raw = make_dspark_source(drafter, *target, source.head.get(), 0.0f, false);

  CalibrationRunOptions options;
  options.max_new_tokens = flags.max_new_tokens;
  options.sampling = {flags.temperature, 0, 1.0f};
  options.seed = flags.seed;
  options.batch = flags.batch;
  options.gamma = flags.gamma;
  const std::vector<CalibrationRound> rounds = collect_calibration_rounds(*target, drafter, *raw, prompts, options);
  DSPARK_CHECK(!rounds.empty(), "no verify rounds were recorded (are -n and the prompts long enough?)");

  const StsCalibration calibration = fit_calibration(rounds, gamma, flags.target_precision);
  const SurvivalSamples before = survival_samples(rounds, {});
  const SurvivalSamples after = survival_samples(rounds, calibration.temperatures);
  write_calibration(flags.draft, calibration);

  Json positions = Json::array();
  for (int k = 0; k < gamma; ++k) {
    long drafted = 0, reached = 0, accepted = 0;
    for (const CalibrationRound& round : rounds) {
      if (int(round.confidence.size()) <= k) continue;
      ++drafted;
      reached += round.accepted >= k;
      accepted += round.accepted > k;
    }
    positions.push_back({{"position", k},
                         {"drafted", drafted},
                         {"reached", reached},
                         {"acceptance", reached ? double(accepted) / reached : 0.0},
                         {"temperature", calibration.temperatures[k]},
                         {"threshold", calibration.thresholds[k]},
                         {"before", survival_metrics(before, k)},
                         {"after", survival_metrics(after, k)}});
  }
  const Json metrics_before = survival_metrics(before), metrics_after = survival_metrics(after);

  if (!flags.plot.empty()) {
    auto curve = [](const SurvivalSamples& samples, const std::string& name, Marker marker) {
      PlotSeries series{name, {}, {}, true, false, marker};
      for (const ReliabilityBin& bin : reliability_bins(samples.predicted, samples.survived))
        series.x.push_back(bin.predicted), series.y.push_back(bin.observed);
      return series;
    };
    char before_name[64], after_name[64];
    std::snprintf(before_name, sizeof before_name, "raw (ECE %.3f)", metrics_before["ece"].get<double>());
    std::snprintf(after_name, sizeof after_name, "STS (ECE %.3f)", metrics_after["ece"].get<double>());
    PlotOptions axes;
    axes.x_range = {0.0, 1.0}, axes.y_range = {0.0, 1.0};
    const std::string title = "Reliability of predicted prefix survival, " + std::to_string(rounds.size()) + " rounds";
    write_line_plot(flags.plot, title, "predicted survival  a(k) = c(0)...c(k)", "observed survival",
                    {PlotSeries{"perfect", {0.0, 1.0}, {0.0, 1.0}, true, true, Marker::none},
                     curve(before, before_name, Marker::circle), curve(after, after_name, Marker::square)},
                    axes);
  }

  Json out = {{"draft", flags.draft},
              {"device", target->device_description()},
              {"prompts", prompts.size()},
              {"rounds", rounds.size()},
              {"target_precision", flags.target_precision},
              {"temperatures", calibration.temperatures},
              {"thresholds", calibration.thresholds},
              {"before", metrics_before},
              {"after", metrics_after},
              {"positions", positions}};
  if (!flags.plot.empty()) out["plot"] = flags.plot;
  if (flags.json) {
    std::cout << out.dump() << std::endl;
    return;
  }
  std::printf("%s: %zu rounds from %zu prompts on %s\n", flags.draft.c_str(), rounds.size(), prompts.size(),
              out["device"].get<std::string>().c_str());
  std::printf("  k  drafted  reached  accept      T  threshold   ECE raw  ECE STS\n");
  for (const Json& position : positions)
    std::printf("%3d  %7ld  %7ld  %6.3f  %5.2f  %9.4f   %7.4f  %7.4f\n", position["position"].get<int>(),
                position["drafted"].get<long>(), position["reached"].get<long>(),
                position["acceptance"].get<double>(), position["temperature"].get<double>(),
                position["threshold"].get<double>(), position["before"]["ece"].get<double>(),
                position["after"]["ece"].get<double>());
  std::printf("prefix survival: ECE %.4f -> %.4f, AUROC %s -> %s\n", metrics_before["ece"].get<double>(),
              metrics_after["ece"].get<double>(), format_auroc(metrics_before["auroc"]).c_str(),
              format_auroc(metrics_after["auroc"]).c_str());
  std::printf("wrote config.sts (target precision %.2f) to %s/dspark.json", flags.target_precision,
              flags.draft.c_str());
  if (!flags.plot.empty()) std::printf(" and the reliability diagram to %s", flags.plot.c_str());
  std::printf("\n");
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto flags = std::make_shared<CalibrateFlags>();
  CLI::App* command = app.add_subcommand("calibrate", "Fit a drafter's confidence calibration (config.sts)");
  command->add_option("-m,--model", flags->model, "the target's HF model directory")->capture_default_str();
  command->add_option("-d,--draft", flags->draft, "the DSpark drafter directory to calibrate")->required();
  command->add_option("--prompts", flags->prompts, "held-out JSONL prompts: {\"prompt\"} or {\"messages\"}")
      ->required();
  command->add_option("-n,--max-tokens", flags->max_new_tokens, "tokens generated per prompt")
      ->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--target-precision", flags->target_precision,
                      "thresholds: smallest with Laplace-smoothed precision >= this")
      ->capture_default_str()->check(CLI::Range(0.01, 1.0));
  command->add_option("--plot", flags->plot, "write the reliability diagram to this PNG");
  command->add_option("--batch", flags->batch, "prompts decoded together")->capture_default_str()
      ->check(CLI::Range(1, 256));
  command->add_option("--gamma", flags->gamma, "positions drafted per round (default: the drafter's)")
      ->check(CLI::Range(1, 64));
  command->add_option("--temperature", flags->temperature, "sampling temperature of the runs (0 = greedy)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--seed", flags->seed, "sampling seed")->capture_default_str();
  command->add_flag("--chat", flags->chat, "wrap text prompts in the chat template");
  command->add_flag("--json", flags->json, "print one JSON object");
  add_device_option(*command, flags->device);
  command->callback([flags] { run_calibrate(*flags); });
}

}  // namespace dspark::cli
