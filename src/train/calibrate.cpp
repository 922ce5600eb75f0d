#include "train/calibrate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/file.h"
#include "core/json.h"
#include "core/progress.h"
#include "spec/speculative.h"

namespace dspark {

double calibrated_confidence(double raw, double temperature) {
  const double clamped = std::clamp(raw, 1e-7, 1.0 - 1e-7);
  const double logit = std::log(clamped / (1.0 - clamped));
  return 1.0 / (1.0 + std::exp(-logit / temperature));
}

double expected_calibration_error(std::span<const double> predicted, std::span<const uint8_t> outcome, int bins) {
  DSPARK_CHECK(predicted.size() == outcome.size(), "ECE: ", predicted.size(), " predictions for ", outcome.size(),
               " outcomes");
  DSPARK_CHECK(bins >= 1, "ECE needs at least one bin");
  if (predicted.empty()) return 0.0;
  std::vector<double> gap(bins, 0.0);  // Σ (predicted - outcome) per bin
  for (size_t i = 0; i < predicted.size(); ++i) {
    const double p = std::clamp(predicted[i], 0.0, 1.0);
    const int bin = std::min(bins - 1, static_cast<int>(p * bins));
    gap[bin] += p - (outcome[i] ? 1.0 : 0.0);
  }
  double total = 0.0;
  for (double g : gap) total += std::abs(g);
  return total / double(predicted.size());
}

double auroc(std::span<const double> predicted, std::span<const uint8_t> outcome) {
  DSPARK_CHECK(predicted.size() == outcome.size(), "AUROC: ", predicted.size(), " predictions for ", outcome.size(),
               " outcomes");
  std::vector<size_t> order(predicted.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return predicted[a] < predicted[b]; });
  // Mann-Whitney: the rank sum of the positives, tied scores sharing their mean rank.
  double positive_rank_sum = 0.0;
  long positives = 0;
  for (size_t begin = 0; begin < order.size();) {
    size_t end = begin;
    while (end < order.size() && predicted[order[end]] == predicted[order[begin]]) ++end;
    const double mean_rank = 0.5 * double(begin + 1 + end);  // ranks begin+1 .. end
    for (size_t i = begin; i < end; ++i)
      if (outcome[order[i]]) positive_rank_sum += mean_rank, ++positives;
    begin = end;
  }
  const long negatives = long(predicted.size()) - positives;
  if (positives == 0 || negatives == 0) return std::numeric_limits<double>::quiet_NaN();
  return (positive_rank_sum - 0.5 * double(positives) * double(positives + 1)) / (double(positives) * negatives);
}

SurvivalSamples survival_samples(std::span<const CalibrationRound> rounds, std::span<const float> temperatures) {
  SurvivalSamples samples;
  for (const CalibrationRound& round : rounds) {
    double survival = 1.0;
    for (size_t k = 0; k < round.confidence.size(); ++k) {
      const double temperature = k < temperatures.size() ? temperatures[k] : 1.0;
      survival *=
          temperatures.empty() ? double(round.confidence[k]) : calibrated_confidence(round.confidence[k], temperature);
      samples.predicted.push_back(survival);
      samples.survived.push_back(round.accepted > int(k));
      samples.position.push_back(int(k));
    }
  }
  return samples;
}

std::vector<ReliabilityBin> reliability_bins(std::span<const double> predicted, std::span<const uint8_t> outcome,
                                             int bins) {
  std::vector<ReliabilityBin> all(bins);
  for (size_t i = 0; i < predicted.size(); ++i) {
    const double p = std::clamp(predicted[i], 0.0, 1.0);
    ReliabilityBin& bin = all[std::min(bins - 1, static_cast<int>(p * bins))];
    bin.predicted += p, bin.observed += outcome[i] ? 1.0 : 0.0, ++bin.count;
  }
  std::vector<ReliabilityBin> filled;
  for (ReliabilityBin& bin : all)
    if (bin.count > 0) filled.push_back({bin.predicted / bin.count, bin.observed / bin.count, bin.count});
  return filled;
}

std::vector<double> sts_temperature_grid() {
  std::vector<double> grid;
  for (int i = 0; i <= 240; ++i) grid.push_back(std::pow(20.0, (i - 120) / 120.0));  // 20^-1 .. 20^1; i = 120 is 1
  return grid;
}

std::vector<float> fit_sts_temperatures(std::span<const CalibrationRound> rounds, int gamma, int min_samples) {
  DSPARK_CHECK(gamma >= 1, "calibration needs gamma >= 1");
  const std::vector<double> grid = sts_temperature_grid();
  std::vector<float> temperatures(gamma, 1.0f);
  std::vector<double> prefix(rounds.size(), 1.0);  // Π_{i<k} calibrated c_i of each round
  std::vector<size_t> drafted;                     // rounds that drafted position k
  std::vector<double> logits, predicted;
  std::vector<uint8_t> survived;
  for (int k = 0; k < gamma; ++k) {
    drafted.clear(), logits.clear(), survived.clear();
    for (size_t r = 0; r < rounds.size(); ++r) {
      if (int(rounds[r].confidence.size()) <= k) continue;
      drafted.push_back(r);
      const double c = std::clamp(double(rounds[r].confidence[k]), 1e-7, 1.0 - 1e-7);
      logits.push_back(std::log(c / (1.0 - c)));
      survived.push_back(rounds[r].accepted > k);
    }
    if (int(drafted.size()) >= min_samples) {
      double best_error = std::numeric_limits<double>::infinity(), best = 1.0;
      predicted.resize(drafted.size());
      for (double temperature : grid) {
        for (size_t i = 0; i < drafted.size(); ++i)
          predicted[i] = prefix[drafted[i]] / (1.0 + std::exp(-logits[i] / temperature));
        const double error = expected_calibration_error(predicted, survived);
        // Exact ties (flat stretches of the binned error) go to the temperature nearest 1.
        if (error < best_error - 1e-15 ||
            (error <= best_error + 1e-15 && std::abs(std::log(temperature)) < std::abs(std::log(best)))) {
          best_error = error, best = temperature;
        }
      }
      temperatures[k] = float(best);
    }
    for (size_t i = 0; i < drafted.size(); ++i)
      prefix[drafted[i]] /= 1.0 + std::exp(-logits[i] / double(temperatures[k]));
  }
  return temperatures;
}

std::vector<float> fit_thresholds(std::span<const CalibrationRound> rounds, std::span<const float> temperatures,
                                  int gamma, double target_precision, int min_samples) {
  DSPARK_CHECK(target_precision > 0.0 && target_precision <= 1.0, "target precision ", target_precision,
               " is outside (0, 1]");
  std::vector<float> thresholds(gamma, 0.0f);      // position 0 is never pruned
  std::vector<std::pair<float, uint8_t>> reached;  // (calibrated c_k, accepted k) of the rounds that reached k
  for (int k = 1; k < gamma; ++k) {
    reached.clear();
    const double temperature = size_t(k) < temperatures.size() ? temperatures[k] : 1.0;
    for (const CalibrationRound& round : rounds)
      if (int(round.confidence.size()) > k && round.accepted >= k)
        reached.push_back({float(calibrated_confidence(round.confidence[k], temperature)), round.accepted > k});
    if (int(reached.size()) < min_samples) continue;
    // Walk the distinct confidences from the highest down: after each group,
    // (accepted, count) describe the rounds with c >= that value.
    std::sort(reached.begin(), reached.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    long accepted = 0, count = 0;
    float smallest = kNeverVerify;  // unless some threshold reaches the target
    for (size_t begin = 0; begin < reached.size();) {
      size_t end = begin;
      for (; end < reached.size() && reached[end].first == reached[begin].first; ++end)
        accepted += reached[end].second, ++count;
      if ((accepted + 1.0) / (count + 2.0) >= target_precision) smallest = reached[begin].first;
      begin = end;
    }
    // Every round passes the lowest observed confidence: the same set as 0, and 0 never prunes.
    thresholds[k] = (accepted + 1.0) / (count + 2.0) >= target_precision ? 0.0f : smallest;
  }
  return thresholds;
}

StsCalibration fit_calibration(std::span<const CalibrationRound> rounds, int gamma, double target_precision) {
  StsCalibration calibration;
  calibration.temperatures = fit_sts_temperatures(rounds, gamma);
  calibration.thresholds = fit_thresholds(rounds, calibration.temperatures, gamma, target_precision);
  calibration.target = float(target_precision);
  calibration.samples = long(rounds.size());
  return calibration;
}

void write_calibration(const std::filesystem::path& drafter_directory, const StsCalibration& calibration) {
  const std::filesystem::path path = drafter_directory / "dspark.json";
  // Parsed keeping the file's key order, so that only config.sts changes.
  nlohmann::ordered_json metadata;
  try {
    metadata = nlohmann::ordered_json::parse(read_text_file(path));
  } catch (const nlohmann::json::exception& error) {
    fail(path.string(), ": not valid JSON (", error.what(), ")");
  }
  DSPARK_CHECK(metadata.is_object() && metadata.contains("config") && metadata["config"].is_object(), path.string(),
               ": no \"config\" object");
  const auto& gamma_field = metadata["config"]["gamma"];
  DSPARK_CHECK(gamma_field.is_number_integer(), path.string(), ": config has no integer \"gamma\"");
  const int gamma = gamma_field.get<int>();
  DSPARK_CHECK(calibration.thresholds.size() == size_t(gamma) && calibration.temperatures.size() == size_t(gamma),
               path.string(), ": a calibration of ", calibration.thresholds.size(), " positions for gamma ", gamma);
  // The same fields spec/drafter.cpp reads back into StsCalibration.
  metadata["config"]["sts"] = {{"thresholds", calibration.thresholds},
                               {"temperatures", calibration.temperatures},
                               {"target", calibration.target},
                               {"samples", calibration.samples}};
  write_text_file_atomic(path, metadata.dump(2) + "\n");
}

std::vector<CalibrationRound> collect_calibration_rounds(Target& target, const Drafter& drafter, DraftSource& source,
                                                         std::span<const std::vector<int32_t>> prompts,
                                                         const CalibrationRunOptions& options) {
  DSPARK_CHECK(!drafter.config.sts, "calibration needs the drafter's raw confidences: clear config.sts first");
  DSPARK_CHECK(options.batch >= 1, "calibration batch must be at least 1");
  const int gamma = options.gamma > 0 ? options.gamma : drafter.config.gamma;
  DSPARK_CHECK(gamma <= drafter.config.gamma, "calibration gamma ", gamma, " exceeds the drafter's ",
               drafter.config.gamma);
  SpeculativeOptions spec;
  spec.max_new_tokens = options.max_new_tokens;
  spec.sampling = options.sampling;
  spec.gamma = gamma;
  spec.trace = true;
  std::vector<CalibrationRound> rounds;
  Progress progress("calibrate", long(prompts.size()), "prompts");
  for (size_t begin = 0; begin < prompts.size(); begin += options.batch) {
    const size_t count = std::min<size_t>(options.batch, prompts.size() - begin);
    spec.seed = options.seed + begin;  // each chunk its own streams
    for (const SpeculativeResult& result : speculative_generate(target, source, prompts.subspan(begin, count), spec))
      for (const RoundTrace& round : result.trace)
        if (!round.draft.empty()) rounds.push_back({round.confidence, round.accepted});
    if (options.progress) progress.update(long(begin + count), std::to_string(rounds.size()) + " rounds");
  }
  if (options.progress) progress.finish(std::to_string(rounds.size()) + " rounds");
  return rounds;
}

}  // namespace dspark
