#include "spec/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/file.h"
#include "core/progress.h"
#include "core/random.h"

namespace dspark {

double SpsProfile::at(int tokens_in_forward) const {
  DSPARK_CHECK(!tokens.empty() && tokens.size() == steps_per_second.size(), "SPS profile: no measurements");
  const double B = std::max(1, tokens_in_forward);
  auto seconds = [&](size_t i) { return 1.0 / steps_per_second[i]; };
  if (B <= tokens.front()) return steps_per_second.front();
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    if (B > tokens[i + 1]) continue;
    const double fraction = (B - tokens[i]) / double(tokens[i + 1] - tokens[i]);
    return 1.0 / (seconds(i) + fraction * (seconds(i + 1) - seconds(i)));
  }
  const size_t last = tokens.size() - 1;
  double slope = 0.0;  // seconds per extra token past the last measurement
  if (last > 0) slope = std::max(0.0, (seconds(last) - seconds(last - 1)) / double(tokens[last] - tokens[last - 1]));
  return 1.0 / (seconds(last) + slope * (B - tokens[last]));
}

Json SpsProfile::to_json() const { return {{"tokens", tokens}, {"steps_per_second", steps_per_second}}; }

SpsProfile SpsProfile::from_json(const Json& json, const std::string& where) {
  SpsProfile profile;
  profile.tokens = json_get<std::vector<int>>(json, "tokens", where);
  profile.steps_per_second = json_get<std::vector<double>>(json, "steps_per_second", where);
  DSPARK_CHECK(!profile.tokens.empty() && profile.tokens.size() == profile.steps_per_second.size(), where,
               ": tokens and steps_per_second must be non-empty and of one length");
  for (size_t i = 0; i < profile.tokens.size(); ++i) {
    DSPARK_CHECK(profile.tokens[i] >= 1 && (i == 0 || profile.tokens[i] > profile.tokens[i - 1]), where,
                 ": tokens must be positive and ascending");
    DSPARK_CHECK(profile.steps_per_second[i] > 0, where, ": steps_per_second must be positive");
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
  const int sequences = (options.max_tokens + spread - 1) / spread;
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
  SpsProfile profile;
  Progress progress("SPS profile", long(points.size()), "points");
  for (size_t p = 0; p < points.size(); ++p) {
    const int B = points[p], rows = (B + spread - 1) / spread;
    inputs.clear();
    blocks.resize(rows);
    for (int s = 0; s < rows; ++s) {
      blocks[s] = random_tokens(s + 1 < rows ? spread : B - spread * (rows - 1));
      inputs.push_back({ids[s], blocks[s], true});
    }
    std::vector<double> seconds;
    for (int run = 0; run < 2 + options.runs; ++run) {  // 2 warm-ups (GEMM choice, CUDA graph capture)
      const auto start = std::chrono::steady_clock::now();
      target.forward(inputs, verify, result);
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (int s = 0; s < rows; ++s) target.truncate_sequence(ids[s], context);
      if (run >= 2) seconds.push_back(elapsed);
    }
    std::sort(seconds.begin(), seconds.end());
    profile.tokens.push_back(B);
    profile.steps_per_second.push_back(1.0 / std::max(seconds[seconds.size() / 2], 1e-9));
    progress.update(long(p + 1), "B=" + std::to_string(B));
  }
  progress.finish();
  for (int id : ids) target.release_sequence(id);
  for (size_t i = 1; i < profile.steps_per_second.size(); ++i)  // step time never decreasing in B
    profile.steps_per_second[i] = std::min(profile.steps_per_second[i], profile.steps_per_second[i - 1]);
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

SpsProfile cached_sps_profile(Target& target, const std::string& model_key, const SpsProfileOptions& options,
                              const std::filesystem::path& cache_file, bool remeasure, bool* measured) {
  std::string key = target.device_description() + " | " + model_key + " | context " + std::to_string(options.context) +
                    ", " + std::to_string(options.tokens_per_sequence) + " tokens per sequence, taps [";
  for (size_t i = 0; i < options.taps.size(); ++i) key += (i ? "," : "") + std::to_string(options.taps[i]);
  key += "]";
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
  if (measured) *measured = false;
  if (!remeasure && cache["profiles"].contains(key)) {
    try {
      SpsProfile profile = SpsProfile::from_json(cache["profiles"][key], cache_file.string() + " \"" + key + "\"");
      if (profile.tokens.back() >= options.max_tokens) return profile;
    } catch (const Error& error) {
      std::fprintf(stderr, "warning: %s; measuring afresh\n", error.what());
    }
  }
  SpsProfile profile = measure_sps(target, options);
  if (measured) *measured = true;
  Json entry = profile.to_json();
  entry["device"] = target.device_description();
  entry["model"] = model_key;
  cache["version"] = 1;
  cache["profiles"][key] = entry;
  if (!cache_file.parent_path().empty()) std::filesystem::create_directories(cache_file.parent_path());
  write_text_file_atomic(cache_file, cache.dump(2) + "\n");
  return profile;
}

std::vector<int> prefix_schedule(std::span<const std::vector<float>> confidences, const SpsProfile& sps,
                                 int extra_tokens) {
  struct Candidate {
    double survival;  // a_{r,j}
    int position, row;
  };
  std::vector<Candidate> candidates;
  for (size_t r = 0; r < confidences.size(); ++r) {
    double survival = 1.0;
    for (size_t j = 0; j < confidences[r].size(); ++j) {
      // Never increases along a row. A NaN confidence (a broken drafter) counts
      // as 0: std::clamp would pass it through, and NaN breaks the sort's order.
      const double confidence = confidences[r][j];
      survival *= confidence > 0.0 ? std::min(confidence, 1.0) : 0.0;
      candidates.push_back({survival, int(j), int(r)});
    }
  }
  // Descending survival; ties by position, so a row's positions come in order
  // (its prefix stays a prefix), then by row for a fixed order.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.survival != b.survival) return a.survival > b.survival;
    if (a.position != b.position) return a.position < b.position;
    return a.row < b.row;
  });
  const int rows = static_cast<int>(confidences.size());
  std::vector<int> verify(rows, 0);
  int tokens = rows + extra_tokens;  // B: each row's pending token, plus what is verified anyway
  double expected = rows;            // τ*: each row emits at least one token
  double rate = expected * sps.at(tokens);
  for (const Candidate& candidate : candidates) {
    const double admitted_rate = (expected + candidate.survival) * sps.at(tokens + 1);
    if (!(admitted_rate > rate)) break;  // the early stop: never skip a position and go on
    DSPARK_CHECK(verify[candidate.row] == candidate.position, "prefix scheduler: row ", candidate.row,
                 " would verify position ", candidate.position, " after ", verify[candidate.row]);
    verify[candidate.row] = candidate.position + 1;
    tokens += 1, expected += candidate.survival, rate = admitted_rate;
  }
  return verify;
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
  verify = prefix_schedule(confidences_, sps_, whole);
  for (size_t i = 0; i < proposals.size(); ++i)
    if (proposals[i].confidence.size() != proposals[i].tokens.size()) verify[i] = int(proposals[i].tokens.size());
}

}  // namespace dspark
