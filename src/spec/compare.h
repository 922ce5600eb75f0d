// Plain against speculative decoding of the same prompts, timed alike: what
// `dspark bench spec` and `dspark demo` measure. A pass is timed from the
// start of its prefill to its last token (prompt processing included, since
// each mode does it its own way), so tokens/s is generated tokens over that.
//
// Verify schedules name how much of each draft one round verifies:
//   off        every drafted position (no pruning);
//   threshold  the drafter's calibrated thresholds (config.sts), if it has them;
//   alg1       the hardware-aware prefix scheduler (spec/scheduler.h) cuts
//              unpruned drafts, from a measured and cached SPS(B) profile.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/generate.h"
#include "model/target.h"
#include "spec/draft_sources.h"
#include "spec/scheduler.h"
#include "spec/speculative.h"

namespace dspark {

// One decoding mode's timed passes, accumulated over chunks of requests.
struct TimedDecoding {
  double seconds = 0.0;                       // prefill + decode, summed over passes
  double prefill_seconds = 0.0;               // the prompts' forwards, summed over passes
  double admission_prefill_seconds = 0.0;     // plain: the part of `seconds` prefilling later admissions
  long steps = 0;                             // plain: decoding steps (the prefill not counted)
  long tokens = 0;                            // generated tokens (stopping EOS included)
  long matched = 0;                           // speculative: outputs identical to the reference
  SpeculativeStats stats;                     // speculative: rounds, drafts, acceptance
  SpeculativeTiming timing;                   // speculative: summed over passes
  StepTally full_batch;                       // continuous batching: the forwards with every place taken
  StepTally warm_ups;                         // steps or rounds that ran a shape for one of its first times
  std::vector<std::vector<int32_t>> outputs;  // [requests] generated ids, in order
  std::vector<std::string> stop_reasons;      // [requests]
  double tokens_per_s() const { return seconds > 0 ? tokens / seconds : 0.0; }
};

// Decodes `prompts` together with the target alone and adds the pass to
// `record` (when null, the pass is an untimed warm-up and nothing is kept).
void timed_plain_decoding(Target& target, std::span<const std::vector<int32_t>> prompts, const GenerateOptions& options,
                          TimedDecoding* record, const std::function<void(size_t, int32_t)>& on_token = {});

// Decodes `prompts` speculatively and adds the pass to `record` (null: a
// warm-up). Output i counts in `matched` when it equals reference[i]
// (`reference` may be empty: then nothing is compared).
void timed_speculative_decoding(Target& target, DraftSource& source, std::span<const std::vector<int32_t>> prompts,
                                const SpeculativeOptions& options, TimedDecoding* record,
                                std::span<const std::vector<int32_t>> reference = {});

// The draft source and scheduler of each verify schedule over one loaded source.
class VerifySchedules {
 public:
  // `schedules` the ones that will be asked for. alg1 measures SPS(B) up to
  // max_batch * (gamma + 1) tokens and, for a DSpark drafter (`draft_name` its
  // directory), the draft cost D(R) up to max_batch rows, so that it can also
  // leave rounds undrafted (spec/scheduler.h); both are read from `sps_cache`
  // when there (keyed by the target's device, `model_directory`, the source's
  // taps, the drafter and gamma; `reprofile` measures again).
  VerifySchedules(Target& target, const LoadedDraftSource& loaded, const std::filesystem::path& model_directory,
                  const std::string& draft_name, const std::vector<std::string>& schedules, int max_batch, int gamma,
                  const std::filesystem::path& sps_cache, bool reprofile);
  DraftSource& source(const std::string& schedule);
  VerifyScheduler* scheduler(const std::string& schedule);  // null: verify what the source proposes
  // Whether alg1's profile was "measured, stored in ..." or "read from ..."; empty without alg1.
  const std::string& sps_note() const { return sps_note_; }

 private:
  const LoadedDraftSource& loaded_;
  std::unique_ptr<DraftSource> unpruned_;  // null for ngram (it has no thresholds)
  std::unique_ptr<PrefixScheduler> alg1_;
  std::string sps_note_;
};

// Index of the first token where the two outputs differ (the shorter one's
// length when one is a prefix of the other), or -1 when they are equal.
long first_difference(std::span<const int32_t> a, std::span<const int32_t> b);

}  // namespace dspark
