#include "spec/compare.h"

#include <algorithm>
#include <optional>

#include "core/error.h"

namespace dspark {

void timed_plain_decoding(Target& target, std::span<const std::vector<int32_t>> prompts, const GenerateOptions& options,
                          TimedDecoding* record, const std::function<void(size_t, int32_t)>& on_token) {
  std::vector<GenerateResult> results = generate_batch(target, prompts, options, on_token);
  if (!record || results.empty()) return;
  record->seconds += results[0].prefill_seconds + results[0].decode_seconds;  // one clock for the whole batch
  record->prefill_seconds += results[0].prefill_seconds;
  record->admission_prefill_seconds += results[0].admission_prefill_seconds;
  record->steps += results[0].forwards;
  record->full_batch.add(results[0].full_batch);
  record->warm_ups.add(results[0].warm_ups);
  for (GenerateResult& result : results) {
    record->tokens += long(result.tokens.size());
    record->outputs.push_back(std::move(result.tokens));
    record->stop_reasons.push_back(result.stop_reason);
  }
}

void timed_speculative_decoding(Target& target, DraftSource& source, std::span<const std::vector<int32_t>> prompts,
                                const SpeculativeOptions& options, TimedDecoding* record,
                                std::span<const std::vector<int32_t>> reference) {
  SpeculativeTiming timing;
  std::vector<SpeculativeResult> results = speculative_generate(target, source, prompts, options, &timing);
  if (!record) return;
  record->seconds += timing.prefill_seconds + timing.decode_seconds;
  record->prefill_seconds += timing.prefill_seconds;
  record->timing.add(timing);
  record->full_batch.add(timing.full_batch);
  record->warm_ups.add(timing.warm_ups);
  for (size_t i = 0; i < results.size(); ++i) {
    SpeculativeResult& result = results[i];
    record->tokens += long(result.tokens.size());
    if (i < reference.size()) record->matched += result.tokens == reference[i];
    record->stats.add(result.stats);
    record->outputs.push_back(std::move(result.tokens));
    record->stop_reasons.push_back(result.stop_reason);
  }
}

VerifySchedules::VerifySchedules(Target& target, const LoadedDraftSource& loaded,
                                 const std::filesystem::path& model_directory, const std::string& draft_name,
                                 const std::vector<std::string>& schedules, int max_batch, int gamma,
                                 const std::filesystem::path& sps_cache, bool reprofile)
    : loaded_(loaded) {
  auto wanted = [&](const char* name) {
    return std::find(schedules.begin(), schedules.end(), name) != schedules.end();
  };
  for (const std::string& schedule : schedules)
    DSPARK_CHECK(schedule == "off" || schedule == "threshold" || schedule == "alg1", "unknown verify schedule \"",
                 schedule, "\" (off, threshold or alg1)");
  if (wanted("off") || wanted("alg1")) unpruned_ = unpruned_draft_source(loaded, target);
  if (wanted("alg1")) {
    SpsProfileOptions options;
    options.max_tokens = max_batch * (gamma + 1);
    options.taps = loaded.source->tap_layers();
    options.taps_on_device = unpruned_->accepts_device_taps();  // as the rounds will run
    options.max_rows = max_batch;
    options.max_drafts = gamma;
    bool measured = false;
    SpsProfile sps = cached_sps_profile(target, std::filesystem::weakly_canonical(model_directory).string(), options,
                                        sps_cache, reprofile, &measured);
    std::optional<DraftCostProfile> draft_cost;
    if (loaded.drafter && gamma > 0)  // a source without confidences gives the gate nothing to weigh
      draft_cost = cached_draft_cost(target, *unpruned_, std::filesystem::weakly_canonical(draft_name).string(), gamma,
                                     max_batch, sps_cache, reprofile);
    alg1_ = std::make_unique<PrefixScheduler>(std::move(sps), std::move(draft_cost), target.pads_verify_rows());
    sps_note_ = std::string(measured ? "measured, stored in " : "read from ") + sps_cache.string();
  }
}

DraftSource& VerifySchedules::source(const std::string& schedule) {
  return schedule == "threshold" || !unpruned_ ? *loaded_.source : *unpruned_;
}

VerifyScheduler* VerifySchedules::scheduler(const std::string& schedule) {
  return schedule == "alg1" ? alg1_.get() : nullptr;
}

long first_difference(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t common = std::min(a.size(), b.size());
  for (size_t i = 0; i < common; ++i)
    if (a[i] != b[i]) return long(i);
  return a.size() == b.size() ? -1 : long(common);
}

}  // namespace dspark
