#include "spec/scheduler.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <utility>

#include "core/environment.h"
#include "core/error.h"
#include "core/file.h"
#include "core/progress.h"
#include "core/random.h"

namespace dspark {

// The longest run of plain rounds between two drafted ones while drafting
// does not pay. A probe at one row verifies its drafts, so it costs only
// what drafting loses on one round; at more rows it verifies none (its
// draft is pure cost, with its row's staged context rows projected first:
// 0.3-0.5 ms on the H200 at batch 4, two to three plain steps), so it looks
// less often (once in 128 rounds cost that batch 3% of its time).
constexpr int kMaxUndraftedRoundsAlone = 32;
constexpr int kMaxUndraftedRounds = 512;
// A gate shut by a near miss (its estimate at least this) looks again after
// at most kMaxUndraftedRoundsNear plain rounds (scheduler.h).
constexpr double kNearMiss = 0.9;
constexpr int kMaxUndraftedRoundsNear = 128;
constexpr double kGainWeight = 1.0 / 8;        // each round's estimate moves the gain an eighth of the way
constexpr double kSurvivalWeight = 1.0 / 16;   // each drafted round moves a position's mean survival this far
constexpr long kFullDraftEvery = 16;           // draft_length(): one drafted round in this many drafts γ
constexpr double kOneOffRatio = 4.0;  // observe_round ignores rounds that took longer than this x their prediction
// The rates delivered (scheduler.h): the sums decay by 1/kDeliveredMemory a
// row (a round of R rows, R times); a kind of round is known after
// kKnownRounds, drafted ones also after kKnownDraftedRows rows; a trial runs
// kTrialRounds once the kind not in use has not run for kTrialRounds x |1 -
// the rates' ratio| / kTrialCost rounds, within [kMinTrialEvery, kMaxTrialEvery].
constexpr double kDeliveredMemory = 512;
constexpr long kKnownRounds = 12;
constexpr double kKnownDraftedRows = 64;
constexpr int kTrialRounds = 16;
constexpr double kTrialCost = 1.0 / 128;
constexpr int kMinTrialEvery = 256, kMaxTrialEvery = 2048;

namespace {

// A confidence as a survival factor in [0, 1]. A NaN confidence (a broken
// drafter) counts as 0: std::clamp would pass it through, and NaN breaks the
// walk's sort order.
double survival_factor(double confidence) { return confidence > 0.0 ? std::min(confidence, 1.0) : 0.0; }

// a_j = Π_{i≤j} c_i, the survival of one row's draft through each position
// (never increasing along it), into `survivals` (its storage reused).
void survivals_of(std::span<const float> confidences, std::vector<double>& survivals) {
  survivals.clear();
  double survival = 1.0;
  for (float confidence : confidences) survivals.push_back(survival *= survival_factor(confidence));
}

// DSPARK_GATE_LOG=1: the gate's estimates and timed rounds on stderr.
bool gate_log() {
  static const bool on = environment_switch_on("DSPARK_GATE_LOG");
  return on;
}

// Steps per second at `count` from measured points (rate(i) at points[i]):
// the step time interpolated linearly, extrapolated linearly (never
// decreasing) past the last. Only the points around `count` are evaluated.
template <typename Rate>
double interpolate_rate(const std::vector<int>& points, int count, Rate rate) {
  const double x = std::max(1, count);
  auto seconds = [&](size_t i) { return 1.0 / rate(i); };
  if (x <= points.front()) return rate(0);
  for (size_t i = 0; i + 1 < points.size(); ++i) {
    if (x > points[i + 1]) continue;
    const double fraction = (x - points[i]) / double(points[i + 1] - points[i]);
    return 1.0 / (seconds(i) + fraction * (seconds(i + 1) - seconds(i)));
  }
  const size_t last = points.size() - 1;
  double slope = 0.0;  // seconds per extra unit past the last measurement
  if (last > 0) slope = std::max(0.0, (seconds(last) - seconds(last - 1)) / double(points[last] - points[last - 1]));
  return 1.0 / (seconds(last) + slope * (x - points[last]));
}

// The value at x of a quantity measured at ascending points (value(i) at
// points[i]): linear between points, clamped to the first and the last.
template <typename Value>
double interpolate_clamped(const std::vector<int>& points, double x, Value value) {
  const size_t n = points.size();
  if (n == 1) return value(0);
  x = std::clamp<double>(x, points.front(), points.back());
  size_t i = 0;
  while (i + 2 < n && x > points[i + 1]) ++i;
  const double fraction = (x - points[i]) / double(points[i + 1] - points[i]);
  return value(i) + fraction * (value(i + 1) - value(i));
}

// Reads a (points, rates) pair: non-empty, of one length, points positive
// and ascending, rates positive.
void read_rates(const Json& json, const char* points_key, const char* rates_key, const std::string& where,
                std::vector<int>& points, std::vector<double>& rates) {
  points = json_get<std::vector<int>>(json, points_key, where);
  rates = json_get<std::vector<double>>(json, rates_key, where);
  DSPARK_CHECK(!points.empty() && points.size() == rates.size(), where, ": ", points_key, " and ", rates_key,
               " must be non-empty and of one length");
  for (size_t i = 0; i < points.size(); ++i) {
    DSPARK_CHECK(points[i] >= 1 && (i == 0 || points[i] > points[i - 1]), where, ": ", points_key,
                 " must be positive and ascending");
    DSPARK_CHECK(rates[i] > 0, where, ": ", rates_key, " must be positive");
  }
}

}  // namespace

double SpsProfile::at(int tokens_in_forward) const {
  DSPARK_CHECK(!tokens.empty() && tokens.size() == steps_per_second.size(), "SPS profile: no measurements");
  return interpolate_rate(tokens, tokens_in_forward, [&](size_t i) { return steps_per_second[i]; });
}

double SpsProfile::plain_at(int rows) const {
  if (plain_rows.empty() || plain_rows.size() != plain_steps_per_second.size()) return at(rows);
  return interpolate_rate(plain_rows, rows, [&](size_t i) { return plain_steps_per_second[i]; });
}

double SpsProfile::round_at(int rows, double drafts_per_row) const {
  const size_t K = round_drafts.size();
  if (K == 0 || plain_rows.empty() || round_steps_per_second.size() != plain_rows.size() * K)
    return at(static_cast<int>(std::lround(rows * (1.0 + drafts_per_row))));
  // Each measured R's rate at k drafts (step time linear in k, clamped to the
  // measured range), then across R; computed for the R points used only (no
  // allocation: Alg 1 and the draft length ask several times a round).
  return interpolate_rate(plain_rows, rows, [&](size_t r) {
    const double* row = round_steps_per_second.data() + r * K;
    return 1.0 / interpolate_clamped(round_drafts, drafts_per_row, [&](size_t i) { return 1.0 / row[i]; });
  });
}

Json SpsProfile::to_json() const {
  Json json = {{"tokens", tokens}, {"steps_per_second", steps_per_second}};
  if (!plain_rows.empty()) json["plain_rows"] = plain_rows, json["plain_steps_per_second"] = plain_steps_per_second;
  if (!round_drafts.empty())
    json["round_drafts"] = round_drafts, json["round_steps_per_second"] = round_steps_per_second;
  return json;
}

SpsProfile SpsProfile::from_json(const Json& json, const std::string& where) {
  SpsProfile profile;
  read_rates(json, "tokens", "steps_per_second", where, profile.tokens, profile.steps_per_second);
  if (json.contains("plain_rows"))
    read_rates(json, "plain_rows", "plain_steps_per_second", where, profile.plain_rows,
               profile.plain_steps_per_second);
  if (json.contains("round_drafts")) {
    profile.round_drafts = json_get<std::vector<int>>(json, "round_drafts", where);
    profile.round_steps_per_second = json_get<std::vector<double>>(json, "round_steps_per_second", where);
    DSPARK_CHECK(!profile.round_drafts.empty() && profile.round_drafts[0] == 0 &&
                     profile.round_steps_per_second.size() == profile.plain_rows.size() * profile.round_drafts.size(),
                 where, ": round_drafts must start at 0 and round_steps_per_second hold plain_rows x round_drafts");
    for (size_t i = 1; i < profile.round_drafts.size(); ++i)
      DSPARK_CHECK(profile.round_drafts[i] > profile.round_drafts[i - 1], where, ": round_drafts must ascend");
    for (double rate : profile.round_steps_per_second)
      DSPARK_CHECK(rate > 0, where, ": round_steps_per_second must be positive");
  }
  return profile;
}

std::vector<int> sps_profile_points(int max_tokens) {
  DSPARK_CHECK(max_tokens >= 1, "SPS profile: max_tokens must be at least 1");
  std::vector<int> points;
  for (int power = 1; power <= max_tokens; power *= 2) {
    points.push_back(power);
    if (power >= 2 && power * 3 / 2 <= max_tokens) points.push_back(power * 3 / 2);
  }
  if (points.back() != max_tokens) points.push_back(max_tokens);
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  return points;
}

SpsProfile measure_sps(Target& target, const SpsProfileOptions& options) {
  const ModelConfig& config = target.config();
  const int spread = options.tokens_per_sequence;
  DSPARK_CHECK(spread >= 1 && options.runs >= 1, "SPS profile: tokens_per_sequence and runs must be positive");
  const int context = std::min(options.context, config.max_positions - spread);
  DSPARK_CHECK(context >= 1, "SPS profile: the model's context of ", config.max_positions,
               " leaves no room for a verify block of ", spread);
  const std::vector<int> points = sps_profile_points(options.max_tokens);
  const int sequences = std::max((options.max_tokens + spread - 1) / spread, options.max_rows);
  Rng rng(20240601);
  auto random_tokens = [&](int count) {
    std::vector<int32_t> tokens(count);
    for (int32_t& token : tokens) token = int32_t(rng.next() % uint64_t(config.vocab_size));
    return tokens;
  };
  std::vector<int> ids;
  std::vector<std::vector<int32_t>> blocks;
  std::vector<TargetInput> inputs;
  TargetResult result;
  for (int s = 0; s < sequences; ++s) {
    ids.push_back(target.create_sequence(context + spread));
    blocks.push_back(random_tokens(context));
  }
  for (int s = 0; s < sequences; s += 8) {  // the shared context, prefilled a few sequences at a time
    inputs.clear();
    for (int i = s; i < std::min(sequences, s + 8); ++i) inputs.push_back({ids[i], blocks[i], false});
    target.forward(inputs, TargetRequest{}, result);
  }
  TargetRequest verify;
  verify.taps = options.taps;
  verify.taps_on_device = options.taps_on_device;
  SpsProfile profile;
  std::vector<int> plain_points;  // R = 1, 2, 4, ... sequences
  for (int R = 1; R < sequences; R *= 2) plain_points.push_back(R);
  plain_points.push_back(sequences);
  const int max_drafts = std::min(options.max_drafts, spread - 1);  // sequences have room for `spread` tokens
  for (int k = 0; k <= max_drafts; k = k < 2 ? k + 1 : 2 * k) profile.round_drafts.push_back(k);
  if (profile.round_drafts.back() != max_drafts) profile.round_drafts.push_back(max_drafts);
  // Median seconds of one forward of `inputs` after 2 warm-ups (GEMM choice,
  // CUDA graph capture), each rolled back to the shared context.
  auto median_seconds = [&](const TargetRequest& request) {
    std::vector<double> seconds;
    for (int run = 0; run < 2 + options.runs; ++run) {
      const auto start = std::chrono::steady_clock::now();
      target.forward(inputs, request, result);
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (const TargetInput& input : inputs) target.truncate_sequence(input.sequence, context);
      if (run >= 2) seconds.push_back(elapsed);
    }
    std::sort(seconds.begin(), seconds.end());
    return std::max(seconds[seconds.size() / 2], 1e-9);
  };
  Progress progress("SPS profile", long(points.size() + plain_points.size()), "points");
  for (size_t p = 0; p < points.size(); ++p) {
    const int B = points[p], rows = (B + spread - 1) / spread;
    inputs.clear();
    blocks.resize(rows);
    for (int s = 0; s < rows; ++s) {
      blocks[s] = random_tokens(s + 1 < rows ? spread : B - spread * (rows - 1));
      inputs.push_back({ids[s], blocks[s], true});
    }
    profile.tokens.push_back(B);
    profile.steps_per_second.push_back(1.0 / median_seconds(verify));
    progress.update(long(p + 1), "B=" + std::to_string(B));
  }
  for (size_t p = 0; p < plain_points.size(); ++p) {  // plain decoding: R sequences, one token each, no taps
    const int R = plain_points[p];
    inputs.clear();
    blocks.resize(R);
    for (int s = 0; s < R; ++s) {
      blocks[s] = random_tokens(1);
      inputs.push_back({ids[s], blocks[s], false});
    }
    profile.plain_rows.push_back(R);
    profile.plain_steps_per_second.push_back(1.0 / median_seconds(TargetRequest{}));
    // Rounds: R sequences of 1 + k tokens, with the taps. Alg 1 cuts each
    // row's draft apart, so a drafted round's rows verify different lengths:
    // one row is one token short here, as in such a round (a target may run
    // those differently: the CUDA target pads them to the longest row).
    for (int k : profile.round_drafts) {
      for (int s = 0; s < R; ++s) {
        blocks[s] = random_tokens(1 + k - (s == 0 && k > 0 && R > 1));
        inputs[s] = {ids[s], blocks[s], true};
      }
      profile.round_steps_per_second.push_back(1.0 / median_seconds(verify));
    }
    progress.update(long(points.size() + p + 1), "R=" + std::to_string(R));
  }
  progress.finish();
  for (int id : ids) target.release_sequence(id);
  for (auto* rates : {&profile.steps_per_second, &profile.plain_steps_per_second})  // never faster with more
    for (size_t i = 1; i < rates->size(); ++i) (*rates)[i] = std::min((*rates)[i], (*rates)[i - 1]);
  return profile;
}

double DraftCostProfile::at(int count, int length) const {
  const size_t L = std::max<size_t>(lengths.size(), 1);
  DSPARK_CHECK(!rows.empty() && rows.size() * L == seconds.size(), "draft cost profile: no measurements");
  // Each measured R's time at this length ...
  auto at_length = [&](size_t point) {
    const double* times = seconds.data() + point * L;
    return lengths.empty() ? times[0] : interpolate_clamped(lengths, length, [&](size_t i) { return times[i]; });
  };
  // ... then across R.
  const double R = std::max(1, count);
  if (R <= rows.front()) return at_length(0);
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    if (R > rows[i + 1]) continue;
    const double fraction = (R - rows[i]) / double(rows[i + 1] - rows[i]);
    return at_length(i) + fraction * (at_length(i + 1) - at_length(i));
  }
  return at_length(rows.size() - 1) * R / rows.back();
}

Json DraftCostProfile::to_json() const {
  Json json = {{"rows", rows}, {"seconds", seconds}};
  if (!lengths.empty()) json["lengths"] = lengths;
  return json;
}

DraftCostProfile DraftCostProfile::from_json(const Json& json, const std::string& where) {
  DraftCostProfile profile;
  profile.rows = json_get<std::vector<int>>(json, "rows", where);
  profile.seconds = json_get<std::vector<double>>(json, "seconds", where);
  if (json.contains("lengths")) profile.lengths = json_get<std::vector<int>>(json, "lengths", where);
  const size_t L = std::max<size_t>(profile.lengths.size(), 1);
  DSPARK_CHECK(!profile.rows.empty() && profile.rows.size() * L == profile.seconds.size(), where,
               ": rows must be non-empty and seconds hold one time for each row count and length");
  for (size_t i = 0; i < profile.rows.size(); ++i)
    DSPARK_CHECK(profile.rows[i] >= 1 && (i == 0 || profile.rows[i] > profile.rows[i - 1]), where,
                 ": rows must be positive and ascending");
  for (size_t i = 0; i < profile.lengths.size(); ++i)
    DSPARK_CHECK(profile.lengths[i] >= 1 && (i == 0 || profile.lengths[i] > profile.lengths[i - 1]), where,
                 ": lengths must be positive and ascending");
  for (double time : profile.seconds) DSPARK_CHECK(time >= 0, where, ": seconds must not be negative");
  return profile;
}

DraftCostProfile measure_draft_cost(Target& target, DraftSource& source, int gamma, int max_rows, int context,
                                    int runs) {
  const ModelConfig& config = target.config();
  DSPARK_CHECK(gamma >= 1 && max_rows >= 1 && runs >= 1, "draft cost profile: gamma, rows and runs must be positive");
  std::vector<int> points;
  for (int R = 1; R < max_rows; R *= 2) points.push_back(R);
  points.push_back(max_rows);
  // Each timed run is a round's worth of drafting work: the rows a round
  // accepts (kRoundRows per row, about what a trained drafter's rounds keep)
  // enter the source's context, then the source drafts. Row r takes part in
  // every point with R > r, so it grows by at most this much.
  constexpr int kRoundRows = 3;
  const int growth = int(points.size()) * (2 + runs) * kRoundRows;
  context = std::min(context, config.max_positions - growth - gamma - 1);
  DSPARK_CHECK(context >= 2, "draft cost profile: the model's context of ", config.max_positions,
               " leaves no room for ", growth, " rounds' tokens and a draft of ", gamma);
  const std::vector<int> taps = source.tap_layers();
  const size_t tap_width = taps.size() * size_t(config.hidden_size);
  const bool taps_on_device = !taps.empty() && source.accepts_device_taps();
  Rng rng(20240602);
  auto random_tokens = [&](int count) {
    std::vector<int32_t> tokens(count);
    for (int32_t& token : tokens) token = int32_t(rng.next() % uint64_t(config.vocab_size));
    return tokens;
  };
  std::vector<std::vector<int32_t>> prompts(max_rows);
  std::vector<int> ids;
  for (int r = 0; r < max_rows; ++r) {
    prompts[r] = random_tokens(context);
    ids.push_back(target.create_sequence(context + growth + gamma + 1));
    source.begin(r, prompts[r], rng.next());
  }
  TargetResult result;
  auto accept = [&](int row, std::span<const int32_t> tokens, size_t first_row) {
    accept_tapped_rows(source, row, tokens, result, first_row, tap_width);
  };
  // As speculative decoding starts: every prompt token but the last enters
  // the cache and the source's context, with its tapped rows.
  TargetRequest request;
  request.taps = taps;
  request.taps_on_device = taps_on_device;
  std::vector<TargetInput> inputs;
  for (int first = 0; first < max_rows; first += 8) {
    const int last = std::min(max_rows, first + 8);
    inputs.clear();
    for (int r = first; r < last; ++r) inputs.push_back({ids[r], std::span(prompts[r]).first(context - 1), false});
    target.forward(inputs, request, result);
    for (int r = first; r < last; ++r)
      accept(r, std::span(prompts[r]).first(context - 1), size_t(r - first) * (context - 1));
    source.finish_accepts(result);
  }
  // A round's drafting at γ positions, then at each shorter length L the
  // propose() alone, added to it: D(R, L) = D(R, γ) - P(R, γ) + P(R, L) (the
  // context extension does not depend on L, and a propose() without one does
  // not grow the context).
  DraftCostProfile profile;
  profile.lengths = sps_profile_points(gamma);
  const size_t L = profile.lengths.size();
  std::vector<Proposal> proposals;
  std::vector<std::vector<int32_t>> blocks(max_rows);
  auto median = [](std::vector<double>& times) {
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  Progress progress("draft cost profile", long(points.size()), "points");
  for (size_t p = 0; p < points.size(); ++p) {
    const int R = points[p];
    std::vector<int> rows(R), limits(R);
    std::vector<int32_t> pending(R);
    for (int r = 0; r < R; ++r) rows[r] = r;
    std::vector<double> round_seconds;
    std::vector<std::vector<double>> propose_seconds(L);
    auto timed_propose = [&](int length) {
      std::fill(limits.begin(), limits.end(), length);
      const auto start = std::chrono::steady_clock::now();
      source.propose(rows, pending, limits, cpu::SamplingParams{}, proposals);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (int run = 0; run < 2 + runs; ++run) {  // 2 warm-ups (CUDA graph capture)
      // A verify forward (untimed: the round profile has it) of R rows.
      inputs.clear();
      for (int r = 0; r < R; ++r) {
        blocks[r] = random_tokens(kRoundRows);
        inputs.push_back({ids[r], blocks[r], false});
      }
      target.forward(inputs, request, result);
      const auto start = std::chrono::steady_clock::now();
      for (int r = 0; r < R; ++r) {
        accept(r, blocks[r], size_t(r) * kRoundRows);
        pending[r] = blocks[r].back();
      }
      source.finish_accepts(result);
      std::fill(limits.begin(), limits.end(), gamma);
      source.propose(rows, pending, limits, cpu::SamplingParams{}, proposals);
      const double round = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (run < 2) continue;
      round_seconds.push_back(round);
      for (size_t l = 0; l < L; ++l) propose_seconds[l].push_back(timed_propose(profile.lengths[l]));
    }
    const double round = median(round_seconds), full = median(propose_seconds[L - 1]);
    profile.rows.push_back(R);
    for (size_t l = 0; l < L; ++l)
      profile.seconds.push_back(std::max(0.0, round - full + (l + 1 < L ? median(propose_seconds[l]) : full)));
    progress.update(long(p + 1), "R=" + std::to_string(R));
  }
  progress.finish();
  for (int r = 0; r < max_rows; ++r) {
    source.end(r);
    target.release_sequence(ids[r]);
  }
  return profile;
}

std::filesystem::path default_sps_cache_path() {
  if (const char* directory = std::getenv("DSPARK_CACHE_DIR"); directory && *directory)
    return std::filesystem::path(directory) / "sps.json";
  if (const char* directory = std::getenv("XDG_CACHE_HOME"); directory && *directory)
    return std::filesystem::path(directory) / "dspark" / "sps.json";
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home && *home ? home : ".") / ".cache" / "dspark" / "sps.json";
}

namespace {

// This binary's identity: an FNV-1a hash of its own file. Profiles are timed
// by the kernels of the build that measured them; a build whose kernels run
// faster or slower would otherwise steer Alg 1 by stale times (a CPU profile
// cached before the bf16 pairs kernels predicted verifies twice too slow).
const std::string& build_identity() {
  static const std::string identity = [] {
    std::ifstream file("/proc/self/exe", std::ios::binary);
    if (!file) return std::string("unknown build");
    uint64_t hash = 14695981039346656037ull;
    std::vector<char> chunk(1 << 20);
    while (file.read(chunk.data(), std::streamsize(chunk.size())) || file.gcount() > 0) {
      for (std::streamsize i = 0; i < file.gcount(); ++i) hash = (hash ^ uint8_t(chunk[size_t(i)])) * 1099511628211ull;
      if (!file) break;
    }
    char text[32];
    std::snprintf(text, sizeof text, "build %016llx", static_cast<unsigned long long>(hash));
    return std::string(text);
  }();
  return identity;
}

// The profiles cache (a JSON object {"version": 1, "profiles": {key: entry}}):
// an unreadable file counts as empty, so it is measured afresh and replaced.
Json read_profile_cache(const std::filesystem::path& cache_file) {
  Json cache = Json::object();
  if (std::filesystem::exists(cache_file)) {
    try {
      cache = read_json_file(cache_file);
    } catch (const Error& error) {
      std::fprintf(stderr, "warning: %s; measuring afresh\n", error.what());
    }
    if (!cache.is_object()) cache = Json::object();
  }
  if (!cache.contains("profiles") || !cache["profiles"].is_object()) cache["profiles"] = Json::object();
  return cache;
}

// Adds `entry` under `key`, atomically, keeping the other entries of this
// build (those of other builds are dropped: nothing reads them again).
void store_profile(const std::filesystem::path& cache_file, const std::string& key, Json entry) {
  Json cache = read_profile_cache(cache_file);
  cache["version"] = 1;
  Json kept = Json::object();
  for (const auto& [name, value] : cache["profiles"].items())
    if (value.is_object() && value.value("build", std::string()) == build_identity()) kept[name] = value;
  entry["build"] = build_identity();
  kept[key] = std::move(entry);
  cache["profiles"] = std::move(kept);
  if (!cache_file.parent_path().empty()) std::filesystem::create_directories(cache_file.parent_path());
  write_text_file_atomic(cache_file, cache.dump(2) + "\n");
}

// The cached entry `key` parsed by `parse` when present, parseable and
// `complete`; else nothing (a broken entry is reported).
template <typename Profile, typename Parse, typename Complete>
std::optional<Profile> cached_profile(const std::filesystem::path& cache_file, const std::string& key, Parse parse,
                                      Complete complete) {
  const Json cache = read_profile_cache(cache_file);
  if (!cache["profiles"].contains(key)) return std::nullopt;
  try {
    Profile profile = parse(cache["profiles"][key], cache_file.string() + " \"" + key + "\"");
    if (complete(profile)) return profile;
  } catch (const Error& error) {
    std::fprintf(stderr, "warning: %s; measuring afresh\n", error.what());
  }
  return std::nullopt;
}

}  // namespace

SpsProfile cached_sps_profile(Target& target, const std::string& model_key, const SpsProfileOptions& options,
                              const std::filesystem::path& cache_file, bool remeasure, bool* measured) {
  std::string key = target.device_description() + " | " + build_identity() + " | " + model_key + " | context " +
                    std::to_string(options.context) + ", " + std::to_string(options.tokens_per_sequence) +
                    " tokens per sequence, taps [";
  for (size_t i = 0; i < options.taps.size(); ++i) key += (i ? "," : "") + std::to_string(options.taps[i]);
  key += options.taps_on_device ? "] on the device" : "]";
  key += ", ragged rounds";
  if (measured) *measured = false;
  if (!remeasure) {
    std::optional<SpsProfile> cached = cached_profile<SpsProfile>(
        cache_file, key, SpsProfile::from_json,
        [&](const SpsProfile& profile) {
          return profile.tokens.back() >= options.max_tokens && !profile.plain_rows.empty() &&
                 !profile.round_drafts.empty() && profile.plain_rows.back() >= options.max_rows;
        });
    if (cached) return *cached;
  }
  SpsProfile profile = measure_sps(target, options);
  if (measured) *measured = true;
  Json entry = profile.to_json();
  entry["device"] = target.device_description();
  entry["model"] = model_key;
  store_profile(cache_file, key, entry);
  return profile;
}

DraftCostProfile cached_draft_cost(Target& target, DraftSource& source, const std::string& draft_key, int gamma,
                                   int max_rows, const std::filesystem::path& cache_file, bool remeasure) {
  const std::string key = target.device_description() + " | " + build_identity() + " | draft " + draft_key +
                          " | gamma " + std::to_string(gamma) + " | D(R), context extension included";
  if (!remeasure) {
    std::optional<DraftCostProfile> cached = cached_profile<DraftCostProfile>(
        cache_file, key, DraftCostProfile::from_json, [&](const DraftCostProfile& profile) {
          return profile.rows.back() >= max_rows && !profile.lengths.empty() && profile.lengths.back() == gamma;
        });
    if (cached) return *cached;
  }
  DraftCostProfile profile = measure_draft_cost(target, source, gamma, max_rows);
  Json entry = profile.to_json();
  entry["device"] = target.device_description();
  entry["draft"] = draft_key;
  store_profile(cache_file, key, entry);
  return profile;
}

std::vector<int> prefix_schedule(std::span<const std::vector<float>> confidences, const SpsProfile& sps,
                                 int extra_tokens, int* forward_tokens, const RoundPricing& pricing) {
  const int rows = static_cast<int>(confidences.size());
  std::vector<std::vector<double>> survivals(rows);  // a_{r,j}
  for (int r = 0; r < rows; ++r) survivals_of(confidences[r], survivals[r]);
  std::vector<int> verify(rows, 0);
  int tokens = rows + extra_tokens;  // B: each row's pending token, plus what is verified anyway
  double expected = rows;            // τ*: each row emits at least one token
  // The round's tokens per second with B tokens in its forward, L drafts in its longest row.
  auto rate_of = [&](double expected_tokens, int forward, int most) {
    const double verify_seconds = pricing.padded_rows
                                      ? 1.0 / sps.round_at(rows, most + double(extra_tokens) / std::max(rows, 1))
                                      : 1.0 / sps.at(forward);
    return expected_tokens / (pricing.draft_seconds + verify_seconds);
  };
  if (pricing.padded_rows) {
    // The forward costs a whole level at a time (every row as long as the
    // longest), so the candidates are the levels: level j is every row's
    // position j, of survival Σ_r a_{r,j} (descending in j, as each row's
    // a_{r,j} is), admitted while the round's rate rises, stopping at the
    // first that does not. (Walking single positions, one row's a_{r,j} had
    // to pay for the whole level: at batch 4 on the H100 the walk verified
    // one draft a row where every row's second position paid together.)
    int longest = 0;  // L: the levels admitted
    double rate = rate_of(expected, tokens, 0);
    for (;; ++longest) {
      double level = 0.0;
      bool drafted = false;
      for (int r = 0; r < rows; ++r)
        if (longest < int(survivals[r].size())) level += survivals[r][longest], drafted = true;
      if (!drafted) break;
      const double admitted_rate = rate_of(expected + level, 0, longest + 1);
      if (!(admitted_rate > rate)) break;  // the early stop: never skip a level and go on
      expected += level, rate = admitted_rate;
    }
    for (int r = 0; r < rows; ++r) verify[r] = std::min(longest, int(survivals[r].size()));
    tokens = rows * (1 + longest) + extra_tokens;
  } else {
    struct Candidate {
      double survival;  // a_{r,j}
      int position, row;
    };
    std::vector<Candidate> candidates;
    for (int r = 0; r < rows; ++r)
      for (size_t j = 0; j < survivals[r].size(); ++j) candidates.push_back({survivals[r][j], int(j), r});
    // Descending survival; ties by position, so a row's positions come in order
    // (its prefix stays a prefix), then by row for a fixed order.
    std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
      if (a.survival != b.survival) return a.survival > b.survival;
      if (a.position != b.position) return a.position < b.position;
      return a.row < b.row;
    });
    double rate = rate_of(expected, tokens, 0);
    for (const Candidate& candidate : candidates) {
      const double admitted_rate = rate_of(expected + candidate.survival, tokens + 1, 0);
      if (!(admitted_rate > rate)) break;  // the early stop: never skip a position and go on
      DSPARK_CHECK(verify[candidate.row] == candidate.position, "prefix scheduler: row ", candidate.row,
                   " would verify position ", candidate.position, " after ", verify[candidate.row]);
      verify[candidate.row] = candidate.position + 1;
      tokens += 1, expected += candidate.survival, rate = admitted_rate;
    }
  }
  if (forward_tokens) *forward_tokens = tokens;
  return verify;
}

int PrefixScheduler::rows_to_draft(const RoundOutlook& outlook) {
  DSPARK_CHECK(outlook.rows.size() == outlook.remaining.size(), "prefix scheduler: ", outlook.rows.size(),
               " rows with ", outlook.remaining.size(), " remaining lengths");
  rows_.assign(outlook.rows.begin(), outlook.rows.end());
  remaining_.assign(outlook.remaining.begin(), outlook.remaining.end());
  waiting_ = outlook.waiting;
  // Paces of requests no longer running go (a server's ids never come back).
  if (paces_.size() > 2 * rows_.size() + 16) {
    std::unordered_map<int, RowPace> kept;
    for (int row : rows_)
      if (auto found = paces_.find(row); found != paces_.end()) kept.insert(*found);
    paces_ = std::move(kept);
  }
  probing_ = false;
  draft_length_ = 0;
  const int rows = static_cast<int>(remaining_.size());
  // An undrafted round is predicted to cost a plain step; a drafted one's
  // prediction is set by schedule().
  after_drafted_round_ = drafting_round_;
  drafting_round_ = false;
  timed_ = rows > 0 ? &undrafted_cost_ : nullptr;
  predicted_seconds_ = rows > 0 ? 1.0 / sps_.plain_at(rows) : 0.0;
  enter_gate(rows);
  const bool after_all_drafted = std::exchange(all_drafted_, false);
  if (!draft_cost_) return rows;
  int drafting = 0;
  if (std::optional<int> delivered = counts_tokens_ && rows > 0 ? delivered_decision(rows) : std::nullopt) {
    drafting = *delivered;
  } else if (gate_->gain.value >= 1.0) {
    drafting = rows;
  } else if (gate_->undrafted_left > 0) {
    --gate_->undrafted_left;
  } else {
    probing_ = rows > 1;
    drafting = std::min(rows, 1);  // the probe: one row drafts, to look again
  }
  // What the round counts to (scheduler.h: the rates delivered).
  all_drafted_ = rows > 0 && drafting == rows;
  delivered_ = rows == 0 || probing_               ? nullptr
               : drafting == 0                     ? &gate_->undrafted
               : all_drafted_ && after_all_drafted ? &gate_->drafted
                                                   : nullptr;
  return drafting;
}

std::optional<int> PrefixScheduler::delivered_decision(int rows) {
  Gate& gate = *gate_;
  ++gate.rounds;
  if (gate.trial_left > 0) return --gate.trial_left, gate.trial_drafts ? rows : 0;
  const auto trial = [&](bool drafts) {
    gate.trial_left = kTrialRounds - 1, gate.trial_drafts = drafts, gate.last_trial = gate.rounds;
    if (gate_log())
      std::fprintf(stderr, "gate R %d: a trial of %d %s rounds (delivered %.1f / %.1f tokens/ms, estimate %.3f)\n",
                   gate_key_.first, kTrialRounds, drafts ? "drafted" : "undrafted", 1e-3 * gate.drafted.rate(),
                   gate.undrafted.count ? 1e-3 * gate.undrafted.rate() : 0.0, gate.gain.value);
    return drafts ? rows : 0;
  };
  // Drafting is first measured where the estimate drafts.
  if (gate.drafted.count < kKnownRounds || gate.drafted.rows < kKnownDraftedRows) return std::nullopt;
  // Undrafted rounds not yet measured are priced as the estimate prices them:
  // R tokens a plain step (the profile, scaled by the timed undrafted rounds).
  // A real one adds its admissions and host work, so that rate is their best;
  // where drafted rounds deliver clearly more, a trial could not change the
  // decision now, and the undrafted kind is first tried as a periodic trial.
  // (Tried at once, on the H100 with the x16 pair the trials left 16 of 865
  // rows undrafted at batch 1 and 80-89 of 968-982 at batch 4, where drafted
  // rounds delivered 2-4x: batch 4's speed-up 2.85-2.91, now 3.05-3.07.)
  const bool undrafted_known = gate.undrafted.count >= kKnownRounds;
  const double undrafted_rate = undrafted_known ? gate.undrafted.rate() : undrafted_tokens_per_second(rows);
  const double ratio = gate.drafted.rate() / undrafted_rate;
  if (!undrafted_known && ratio < 1.0 / kNearMiss) return trial(false);
  const bool draft = ratio >= 1.0;
  const long every = std::clamp(std::lround(kTrialRounds * std::abs(ratio - 1.0) / kTrialCost), long(kMinTrialEvery),
                                long(kMaxTrialEvery));
  const long unused_since = std::max((draft ? gate.undrafted : gate.drafted).last_round, gate.last_trial);
  if (gate.rounds - unused_since <= every) return draft ? rows : 0;
  if (draft || gate.gain.value >= kNearMiss) return trial(!draft);
  // Where the estimate rules drafting out, a probe in its place brings the estimate up to date.
  gate.last_trial = gate.rounds;
  probing_ = rows > 1;
  return std::min(rows, 1);
}

int PrefixScheduler::draft_length(int gamma) {
  draft_length_ = gamma;
  if (!draft_cost_ || draft_cost_->lengths.size() < 2 || rows_.empty() || gamma <= 1) return gamma;
  // The lengths priced: up to the last position some row has drafted (rows
  // near their end draft fewer; a full round sees the others again).
  int known = 0;
  while (known < gamma && known < int(survival_.size()) && survival_[known].measured) ++known;
  if (known == 0 || drafted_rounds_++ % kFullDraftEvery == 0) return gamma;
  const int R = static_cast<int>(rows_.size());
  double expected = 1.0, best_rate = 0.0;  // a row's tokens: 1 + Σ_{j<L} ā_j
  for (int length = 1; length <= known; ++length) {
    expected += survival_[length - 1].value;
    const double verify_seconds = padded_rows_ ? 1.0 / sps_.round_at(R, length) : 1.0 / sps_.at(R * (1 + length));
    const double rate = R * expected / (draft_cost_->at(R, length) + verify_seconds);
    if (rate > best_rate) best_rate = rate, draft_length_ = length;
  }
  return draft_length_;
}

double PrefixScheduler::round_draft_seconds(int rows) const {
  return draft_length_ > 0 ? draft_cost_->at(rows, draft_length_) : draft_cost_->at(rows);
}

// What an undrafted round delivers as the estimate sees it (the gain's
// denominator, and the gate's price for undrafted rounds not yet measured).
double PrefixScheduler::undrafted_tokens_per_second(int rows) const {
  return rows * sps_.plain_at(rows) / undrafted_cost_.value;
}

void PrefixScheduler::enter_gate(int rows) {
  gate_key_ = {static_cast<int>(std::bit_ceil(unsigned(std::max(rows, 1)))), waiting_ == 0};
  auto [gate, first] = gates_.try_emplace(gate_key_);
  // A batch size not seen before starts from the gain of the one the batch
  // comes from, and looks at once: a probe if that gate is shut.
  if (first && gate_) gate->second.gain = gate_->gain;
  gate_ = &gate->second;
}

double PrefixScheduler::slowest_share() const {
  // Measured at this batch's power of two, else at the largest smaller one:
  // the slowest of more rows is slower still, so that is an upper bound.
  // (Only a batch that no request waits for measures it.)
  for (auto gate = gates_.upper_bound({gate_key_.first, true}); gate != gates_.begin();)
    if ((--gate)->second.slowest_share.measured) return gate->second.slowest_share.value;
  return 1.0;
}

void PrefixScheduler::SmoothedRatio::add(double ratio, double weight) {
  value = measured ? value + weight * (ratio - value) : ratio;
  measured = true;
}

void PrefixScheduler::Delivered::add(long round_tokens, double round_seconds, int round_rows, long round) {
  const double keep = std::pow(1.0 - 1.0 / kDeliveredMemory, round_rows);
  tokens = keep * tokens + double(round_tokens);
  seconds = keep * seconds + round_seconds;
  rows = keep * rows + round_rows;
  ++count;
  last_round = round;
}

void PrefixScheduler::RecentMedian::add(double ratio) {
  recent[count++ % kRecent] = ratio;
  const int n = std::min(count, kRecent);
  double sorted[kRecent];
  for (int i = 0; i < n; ++i) {  // (insertion: five values at most)
    int j = i;
    for (; j > 0 && sorted[j - 1] > recent[i]; --j) sorted[j] = sorted[j - 1];
    sorted[j] = recent[i];
  }
  if (n >= kTrusted) value = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}

void PrefixScheduler::observe_round(double seconds, bool warming_up, long tokens) {
  RecentMedian* timed = std::exchange(timed_, nullptr);
  Delivered* delivered = std::exchange(delivered_, nullptr);
  if (!draft_cost_ || seconds <= 0.0) return;
  if (tokens >= 0) {
    counts_tokens_ = true;
    if (delivered && !warming_up) delivered->add(tokens, seconds, int(rows_.size()), gate_->rounds);
  }
  if (!timed || warming_up) {  // (what the rounds the gate leaves out cost, for the log)
    const char* kind = !drafting_round_ ? "undrafted" : probing_ ? "probe" : "drafted";
    if (gate_log())
      std::fprintf(stderr, "gate untimed %s round: %.4f ms (%s%s)\n", kind, 1e3 * seconds,
                   warming_up ? "warming up" : "",
                   drafting_round_ && !after_drafted_round_ ? "after an undrafted round" : "");
    return;
  }
  // A round that warmed a shape up, or far off its prediction for another
  // reason, is a one-off, not what the next rounds will cost (scheduler.h).
  const double ratio = seconds / predicted_seconds_;
  if (ratio <= kOneOffRatio) timed->add(ratio);
  if (gate_log())
    std::fprintf(stderr, "gate timed %s round: %.4f ms, predicted %.4f, ratio %.3f -> %.3f\n",
                 timed == &drafted_cost_ ? "drafted" : "undrafted", 1e3 * seconds, 1e3 * predicted_seconds_, ratio,
                 timed->value);
}

void PrefixScheduler::schedule(std::span<const Proposal> proposals, std::vector<int>& verify) {
  confidences_.resize(proposals.size());
  int whole = 0;  // tokens of rows without confidences, verified whole
  for (size_t i = 0; i < proposals.size(); ++i) {
    const Proposal& proposal = proposals[i];
    const bool scored = proposal.confidence.size() == proposal.tokens.size();
    confidences_[i].assign(scored ? proposal.confidence.begin() : proposal.confidence.end(), proposal.confidence.end());
    if (!scored) whole += int(proposal.tokens.size());
  }
  int tokens = 0;
  RoundPricing pricing{.draft_seconds = draft_cost_ ? round_draft_seconds(int(proposals.size())) : 0.0,
                       .padded_rows = padded_rows_};
  verify = prefix_schedule(confidences_, sps_, whole, &tokens, pricing);
  for (size_t i = 0; i < proposals.size(); ++i)
    if (proposals[i].confidence.size() != proposals[i].tokens.size()) verify[i] = int(proposals[i].tokens.size());
  if (!draft_cost_) return;
  if (!gate_) enter_gate(static_cast<int>(proposals.size()));  // (schedule() without rows_to_draft())
  // This round's prediction for a round where every row drafts, from the
  // rows that drafted (a probe round drafts one): the batch's progress per
  // round τ_b (see scheduler.h) over the round's time, against plain
  // decoding's tokens/s, smoothed over the drafted rounds (one round's
  // confidences are noisy). Without remaining lengths every row counts alike.
  const int R = static_cast<int>(proposals.size());
  // (Rows past the outlook's, where schedule() is called with more, draft nothing.)
  const bool lengths = !remaining_.empty() && remaining_.size() <= proposals.size();
  const auto drafted = [&](int r) { return !proposals[r].tokens.empty() && (!lengths || r < int(remaining_.size())); };
  int drafting = 0;
  for (int r = 0; r < R; ++r) drafting += drafted(r);
  if (drafting == 0) return;
  // Each row's a_{r,j}, once a round (for ā_j and the rows' e_r below).
  survivals_.resize(R);
  size_t drafted_positions = 0;
  for (int r = 0; r < R; ++r) {
    survivals_of(confidences_[r], survivals_[r]);
    if (drafted(r)) drafted_positions = std::max(drafted_positions, survivals_[r].size());
  }
  // ā_j, for draft_length(): the mean over the rows that drafted position j.
  if (survival_.size() < drafted_positions) survival_.resize(drafted_positions);
  for (size_t j = 0; j < drafted_positions; ++j) {
    double sum = 0.0;
    int count = 0;
    for (int r = 0; r < R; ++r)
      if (drafted(r) && j < survivals_[r].size()) sum += survivals_[r][j], ++count;
    survival_[j].add(sum / count, kSurvivalWeight);
  }
  const auto expected_of = [&](int r, int verified) {  // e_r = 1 + Σ_{j < verified} a_{r,j}
    double expected = 1.0;
    for (int j = 0; j < verified && j < int(survivals_[r].size()); ++j) expected += survivals_[r][j];
    return expected;
  };
  // A probe's row stands for all R: its e_r and the round's B are those of
  // Alg 1 over R copies of its confidences, as a round where every row
  // drafted would schedule them. (Its own schedule, beside R - 1 pending
  // tokens alone, admits fewer: on the H100 at batch 4 one draft where whole
  // rounds verified 3-4 a row, which held the gate shut.)
  double probe_expected = 0.0;
  int probe_tokens = 0;
  if (probing_) {
    int probe_row = 0;
    while (!drafted(probe_row)) ++probe_row;  // (drafting > 0)
    copies_.assign(R, confidences_[probe_row]);
    const std::vector<int> copies_verify = prefix_schedule(copies_, sps_, 0, &probe_tokens, pricing);
    for (int k = 0; k < R; ++k) probe_expected += expected_of(probe_row, copies_verify[k]) / R;
  }
  double total_expected = 0.0, total_paced = 0.0;  // Σ_r e_r, and of the e_r the slowest row is found by
  double most_left = 0.0, most_rounds = 0.0;       // max_r n_r and max_r n_r / e_r
  for (int r = 0; r < R; ++r) {
    if (!drafted(r)) continue;
    double row_expected = probing_ ? probe_expected : expected_of(r, verify[r]);
    total_expected += row_expected;
    // The slowest of several rows, from each row's e_r smoothed over the
    // rounds it drafted (scheduler.h). One row's estimate, and a sum, are
    // unbiased as they are (the gain is smoothed below).
    if (lengths && drafting > 1) {
      auto [pace, first] = paces_.try_emplace(rows_[r], RowPace{remaining_[r], row_expected});
      if (!first) {  // (a longer remaining length than before: a new request under the same id)
        const bool same_request = remaining_[r] <= pace->second.remaining;
        pace->second = {remaining_[r], same_request ? 0.5 * pace->second.expected + 0.5 * row_expected : row_expected};
      }
      row_expected = pace->second.expected;
    }
    total_paced += row_expected;
    const double left = lengths ? std::max(remaining_[r], 1) : 1.0;
    most_left = std::max(most_left, left);
    most_rounds = std::max(most_rounds, left / row_expected);
  }
  // τ_b of a round where all R rows draft (scheduler.h), from those that did.
  // Rows replaced as they finish: their total. Otherwise the slowest row's
  // pace; where only some rows drafted (a probe's one), their mean pace
  // scaled by the slowest row's share of the mean in the last rounds where
  // all rows drafted (one row alone says nothing of the slowest of R: on the
  // H200 at batch 64 each probe's row, standing for all, opened the gate for
  // a round that then verified nothing).
  double expected_all = 0.0;
  if (lengths && waiting_ > 0) {
    expected_all = R * total_expected / drafting;
  } else if (drafting == R) {
    expected_all = R * most_left / most_rounds;
    if (R > 1) gate_->slowest_share.add(std::min(1.0, most_left / most_rounds / (total_paced / R)));
  } else {
    expected_all = R * total_expected / drafting * slowest_share();
  }
  // (Padded, every row already counts as long as the longest.)
  const double tokens_all = probing_ ? probe_tokens : padded_rows_ ? tokens : R + double(tokens - R) * R / drafting;
  // This round as the profiles see it, for observe_round: a round where every
  // row drafts (a probe's cost says nothing about one: its one drafting row
  // makes the verify ragged), right after another drafted round (the first
  // after undrafted ones also projects all the rows they staged into the
  // drafter's context); then such a round's predicted time, scaled by what
  // timed ones have cost against their predictions.
  drafting_round_ = true;
  const int drafting_rows = lengths ? int(remaining_.size()) : R;
  timed_ = drafting == drafting_rows && after_drafted_round_ ? &drafted_cost_ : nullptr;
  predicted_seconds_ = 1.0 / sps_.round_at(R, double(tokens - R) / R) + round_draft_seconds(R);
  const double all_drafting =
      (1.0 / sps_.round_at(R, (tokens_all - R) / R) + round_draft_seconds(R)) * drafted_cost_.value;
  const double speculative = expected_all / all_drafting;
  const double gain = speculative / undrafted_tokens_per_second(R);
  gate_->gain.add(gain, kGainWeight);
  if (gate_log())
    std::fprintf(stderr,
                 "gate R %d drafting %d%s, length %d: tokens %d (all %.1f), expected %.3f, round %.4f ms (verify %.4f, "
                 "draft %.4f) x %.3f, plain %.4f ms x %.3f; gain %.3f -> %.3f\n",
                 R, drafting, probing_ ? " (probe)" : "", draft_length_, tokens, tokens_all, expected_all,
                 1e3 * all_drafting, 1e3 / sps_.round_at(R, (tokens_all - R) / R), 1e3 * round_draft_seconds(R),
                 drafted_cost_.value, 1e3 / sps_.plain_at(R), undrafted_cost_.value, gain, gate_->gain.value);
  // A probe looks and does not verify: its one row's drafts beside R - 1
  // pending tokens would make the forward ragged, a shape the CUDA target's
  // captured graphs do not cover (at batch 8 on the H200 the demo target's
  // eager verify took 0.24-0.29 ms against 0.14 for a replayed step), for at
  // most a few tokens of one row.
  if (probing_) std::fill(verify.begin(), verify.end(), 0);
  if (gate_->gain.value >= 1.0) {
    gate_->backoff = 1;
  } else {  // plain rounds for a while, then one row drafts again to look
    // (A near miss at one row keeps the shorter cap of one row.)
    const int longest = std::min(gate_->gain.value >= kNearMiss ? kMaxUndraftedRoundsNear : kMaxUndraftedRounds,
                                 R > 1 ? kMaxUndraftedRounds : kMaxUndraftedRoundsAlone);
    gate_->undrafted_left = std::min(gate_->backoff, longest);
    gate_->backoff = std::min(2 * gate_->backoff, longest);
  }
}

}  // namespace dspark
