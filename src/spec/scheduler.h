// How many of each row's drafted tokens one verify forward checks
// (DESIGN.md §5). The draft source proposes up to γ tokens per row with their
// (calibrated) confidences; a VerifyScheduler then keeps a prefix of each.
//
// PrefixScheduler is the paper's hardware-aware prefix scheduler (Alg 1) for
// a batch of R rows. With SPS(B) the target's verify steps per second at B
// tokens in one forward and a_{r,j} = Π_{i≤j} c_{r,i} the predicted survival
// of row r's draft prefix through position j, it starts from B = R (every
// row's pending token) and τ* = R (every row emits at least one token), walks
// the draft positions in descending a_{r,j}, and admits each one (B += 1,
// τ* += a_{r,j}) while that raises τ*·SPS(B), the expected tokens per second;
// at the first admission that does not, it STOPS. It never skips a position
// and goes on: whether position j of a row is verified then depends only on
// candidates that come before it in the walk, and those carry confidences
// computed before token j was drawn (a_{r,j'} for j' ≤ j reads tokens < j;
// later positions of the row come after it, other rows are independent).
// That is what keeps sampling lossless (spec/speculative.cpp has the whole
// argument); tests/test_speculative.cpp shows a variant without the early
// stop biasing the output.
#pragma once
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "core/json.h"
#include "model/target.h"
#include "spec/draft_source.h"

namespace dspark {

// SPS(B): measured verify steps per second at B tokens per forward.
struct SpsProfile {
  std::vector<int> tokens;               // B of each measurement, ascending, tokens[0] = 1
  std::vector<double> steps_per_second;  // [points] SPS(B)
  // SPS at any B >= 1: the step time 1/SPS is interpolated linearly between
  // measured points and extrapolated linearly (never decreasing) past the last.
  double at(int tokens) const;
  Json to_json() const;
  static SpsProfile from_json(const Json& json, const std::string& where);
};

struct SpsProfileOptions {
  int max_tokens = 512;         // the largest B measured
  int context = 64;             // tokens already in each sequence's cache
  int tokens_per_sequence = 8;  // B is spread over ceil(B / this) sequences, like verify blocks
  std::vector<int> taps;        // tapped layers returned with the forward, as the draft source needs
  int runs = 5;                 // timed runs per point (median), after 2 warm-ups
};

// The B values measured: 1, 2, 3, 4, 6, 8, 12, ... (powers of 2 and 1.5x
// between) up to max_tokens, which is always included.
std::vector<int> sps_profile_points(int max_tokens);

// Times greedy verify forwards of B tokens on `target` (rolled back after
// each). Step times are made non-decreasing in B (more tokens never cost
// less; what remains is timing noise).
SpsProfile measure_sps(Target& target, const SpsProfileOptions& options);

// The cache of measured profiles: $DSPARK_CACHE_DIR/sps.json, else
// $XDG_CACHE_HOME/dspark/sps.json, else ~/.cache/dspark/sps.json.
std::filesystem::path default_sps_cache_path();

// The profile of this target (device description + `model_key` + the
// options' context, spread and taps) from `cache_file`, measured and stored
// (atomically, other entries kept) when absent, when it stops short of
// max_tokens, or when `remeasure`. An unreadable cache file is replaced.
SpsProfile cached_sps_profile(Target& target, const std::string& model_key, const SpsProfileOptions& options,
                              const std::filesystem::path& cache_file, bool remeasure = false,
                              bool* measured = nullptr);

class VerifyScheduler {
 public:
  virtual ~VerifyScheduler() = default;
  // verify[i] = how many of proposals[i].tokens the round verifies (a prefix).
  // proposals[i].confidence is empty when the source has no confidences.
  virtual void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) = 0;
};

// Alg 1 on plain confidences: confidences[r] = row r's c_{r,0..n_r-1}
// (values outside [0, 1] are clamped). Returns each row's verified prefix
// length. `extra_tokens`: tokens in the forward beyond the R pending ones and
// the candidates (rows verified whole because they have no confidences).
std::vector<int> prefix_schedule(std::span<const std::vector<float>> confidences, const SpsProfile& sps,
                                 int extra_tokens = 0);

class PrefixScheduler final : public VerifyScheduler {
 public:
  explicit PrefixScheduler(SpsProfile sps) : sps_(std::move(sps)) {}
  // Rows whose proposal has no confidences are verified whole (their tokens count in B).
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override;
  const SpsProfile& sps() const { return sps_; }

 private:
  SpsProfile sps_;
  std::vector<std::vector<float>> confidences_;
};

}  // namespace dspark
