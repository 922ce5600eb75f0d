// Confidence calibration (DESIGN.md §5, paper §3.2.1), fitted on the verify
// outcomes of unpruned speculative decoding over held-out prompts.
//
// The confidence head predicts c_k, the probability that draft position k is
// accepted given that positions 0..k-1 were; the product a_k = Π_{i≤k} c_i then
// predicts the survival of the prefix 0..k, which is what the schedulers
// (thresholds, Alg 1) act on. Two fits, stored in dspark.json config.sts:
//
// - Sequential temperature scaling (STS): for k = 0, 1, ..., γ-1 in order,
//   with T_0..T_{k-1} already fixed, T_k is the grid temperature that makes
//   Π_{i≤k} σ(logit(c_i) / T_i) best match the observed survival 1[accepted > k]
//   over every round that drafted position k (minimum ECE).
// - Thresholds: for k ≥ 1, over the rounds that reached position k (all of
//   0..k-1 accepted), threshold[k] is the smallest t whose Laplace-smoothed
//   precision (acc(t) + 1) / (n(t) + 2) reaches the target, where n(t) counts
//   those rounds with calibrated c_k ≥ t and acc(t) the ones among them that
//   accepted position k. The candidates are 0 and the observed confidences;
//   when none qualifies the threshold is kNeverVerify (2: above every
//   confidence, the position is not worth verifying; 1 would still keep a
//   calibrated confidence that rounds to 1.0f). Position 0 is never pruned
//   (0), nor is a position with fewer
//   than `min_samples` rounds.
//
// Thresholds compare against the CALIBRATED confidence, exactly as the draft
// loop does (spec/draft.cpp divides the confidence logit by T_k, then
// compares with threshold[k]).
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "model/target.h"
#include "spec/draft.h"
#include "spec/draft_source.h"
#include "spec/drafter.h"

namespace dspark {

// One verify round of unpruned speculative decoding, as calibration sees it.
struct CalibrationRound {
  std::vector<float> confidence;  // [n] raw (uncalibrated) c_k of the drafted positions
  int accepted = 0;               // drafted tokens the target kept: positions 0..accepted-1
};

constexpr int kCalibrationMinSamples = 50;  // fewer rounds at a position: T = 1, no pruning
constexpr int kCalibrationBins = 10;        // equal-width bins of ECE and the reliability diagram
constexpr float kNeverVerify = 2.0f;        // the threshold of a position no confidence makes worth verifying

// σ(logit(raw) / T), the raw confidence clamped to [1e-7, 1 - 1e-7] first
// (a float confidence can round to exactly 0 or 1).
double calibrated_confidence(double raw, double temperature);

// Expected calibration error over `bins` equal-width bins of [0, 1]:
// Σ_b |Σ_{i∈b} (predicted_i - outcome_i)| / N. 0 for no samples.
double expected_calibration_error(std::span<const double> predicted, std::span<const uint8_t> outcome,
                                  int bins = kCalibrationBins);

// Area under the ROC curve: the probability that a random positive scores
// above a random negative, ties counting one half. NaN without both classes.
double auroc(std::span<const double> predicted, std::span<const uint8_t> outcome);

// Every (round, position) sample of prefix survival: predicted a_k under the
// given temperatures (empty: raw), survived = 1[accepted > k].
struct SurvivalSamples {
  std::vector<double> predicted;
  std::vector<uint8_t> survived;
  std::vector<int> position;
};
SurvivalSamples survival_samples(std::span<const CalibrationRound> rounds, std::span<const float> temperatures);

// Per-bin means for a reliability diagram; empty bins are left out.
struct ReliabilityBin {
  double predicted = 0.0, observed = 0.0;
  long count = 0;
};
std::vector<ReliabilityBin> reliability_bins(std::span<const double> predicted, std::span<const uint8_t> outcome,
                                             int bins = kCalibrationBins);

// The STS temperature grid: 241 values log-spaced over [0.05, 20] (2.5% apart), and 1.
std::vector<double> sts_temperature_grid();

std::vector<float> fit_sts_temperatures(std::span<const CalibrationRound> rounds, int gamma,
                                        int min_samples = kCalibrationMinSamples);

std::vector<float> fit_thresholds(std::span<const CalibrationRound> rounds, std::span<const float> temperatures,
                                  int gamma, double target_precision, int min_samples = kCalibrationMinSamples);

// Both fits: temperatures first, then thresholds on the calibrated confidences.
StsCalibration fit_calibration(std::span<const CalibrationRound> rounds, int gamma, double target_precision);

// Replaces config.sts in <directory>/dspark.json (atomically), leaving every
// other field as it was; the weights are not touched.
void write_calibration(const std::filesystem::path& drafter_directory, const StsCalibration& calibration);

struct CalibrationRunOptions {
  int max_new_tokens = 128;      // per prompt
  cpu::SamplingParams sampling;  // greedy at temperature 0
  uint64_t seed = 0;
  int batch = 8;         // prompts decoded together
  int gamma = 0;         // 0: the drafter's
  bool progress = true;  // a Progress line on stderr
};

// Unpruned speculative decoding of `prompts` with `drafter` (which must carry
// no config.sts: the fit needs raw confidences), every round recorded.
// `source` drafts with it: a DSpark source built after config.sts was cleared,
// with no confidence floor (spec/draft_sources.h: make_dspark_source, on the
// CPU or beside a CUDA target).
std::vector<CalibrationRound> collect_calibration_rounds(Target& target, const Drafter& drafter, DraftSource& source,
                                                         std::span<const std::vector<int32_t>> prompts,
                                                         const CalibrationRunOptions& options);

}  // namespace dspark
