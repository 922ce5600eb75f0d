#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/random.h"

namespace dspark {

void check_prompt_fits(const ModelConfig& config, size_t prompt_tokens) {
  DSPARK_CHECK(prompt_tokens > 0, "the prompt is empty (no tokens)");
  DSPARK_CHECK(prompt_tokens < static_cast<size_t>(config.max_positions), "the prompt is ",
               prompt_tokens, " tokens; the model's context is ", config.max_positions,
               " positions, which leaves no room to generate");
}

bool is_eos(const ModelConfig& config, int32_t token) {
  return std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), token) !=
         config.eos_token_ids.end();
}

std::vector<GenerateResult> generate_batch(Target& target, std::span<const std::vector<int32_t>> prompts,
                                           const GenerateOptions& options,
                                           const std::function<void(size_t, int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = target.config();
  DSPARK_CHECK(options.max_active >= 0, "max_active must not be negative");
  for (const std::vector<int32_t>& prompt : prompts) check_prompt_fits(config, prompt.size());
  std::vector<int> sequences(prompts.size(), -1);
  std::vector<Rng> streams;
  std::vector<GenerateResult> results(prompts.size());
  for (size_t r = 0; r < prompts.size(); ++r) {
    streams.emplace_back(r == 0 ? options.seed : options.seed + 0x9e3779b97f4a7c15ull * r);
    results[r].stop_reason = "length";
  }
  const size_t most_active = options.max_active > 0 ? size_t(options.max_active) : prompts.size();
  std::vector<TargetInput> inputs;
  std::vector<size_t> owners;
  // Admission: every prompt token but the last enters the cache in a
  // prefill forward of its group (PrefillGroups, as speculative decoding
  // admits), and the request's first step carries the last one. A prompt's
  // rows go through the same forward in both modes, so that where a row's
  // bits do not depend on the row count (Target::row_invariant_rows), greedy
  // speculative output is plain output bit for bit.
  PrefillGroups groups(prompts.size(), most_active);
  auto prefill_group = [&](size_t first, size_t end) {
    std::vector<TargetInput> prefill;
    for (size_t r = first; r < end; ++r) {
      const std::vector<int32_t>& prompt = prompts[r];
      const int capacity = static_cast<int>(
          std::min<long>(config.max_positions, static_cast<long>(prompt.size()) + options.max_new_tokens));
      sequences[r] = target.create_sequence(capacity);
      if (prompt.size() > 1) prefill.push_back({sequences[r], std::span(prompt).first(prompt.size() - 1), false});
    }
    TargetResult ignored;  // (the prefill's tokens: the step after it gives the first ones)
    if (!prefill.empty()) target.forward(prefill, TargetRequest{}, ignored);
  };
  auto admit = [&] {
    while (inputs.size() < most_active) {
      const std::optional<size_t> r = groups.next(prefill_group);
      if (!r) break;
      inputs.push_back({sequences[*r], std::span(prompts[*r]).last(1), false});
      owners.push_back(*r);
    }
  };
  std::vector<double> uniforms(prompts.size());
  TargetRequest request;
  request.sampling = options.sampling;
  TargetResult step;

  const auto start = Clock::now();
  long forwards = 0;
  // A step runs from its forward's start to the next one's (a prefill
  // between them included); one with every place taken counts in full_batch.
  StepTally full_batch, warm_ups;
  Clock::time_point step_start;
  long step_tokens = -1;   // the step in flight's tokens (-1: none in flight)
  bool step_full = false;  // ... whether every place is taken in it
  long step_warm_ups = 0;  // ... and the target's warm_up_runs() before it
  auto end_step = [&](Clock::time_point now) {
    if (step_tokens < 0) return;
    const double seconds = std::chrono::duration<double>(now - step_start).count();
    if (target.warm_up_runs() != step_warm_ups) warm_ups.add_step(seconds, step_tokens);
    if (step_full) full_batch.add_step(seconds, step_tokens);
  };
  auto forward = [&] {
    ++forwards;
    const auto now = Clock::now();
    end_step(now);
    step_start = now;
    step_warm_ups = target.warm_up_runs();
    step_tokens = long(inputs.size());
    step_full = options.max_active > 0 && inputs.size() == most_active;
    for (size_t i = 0; i < inputs.size(); ++i) uniforms[i] = streams[owners[i]].uniform();
    if (!options.sampling.greedy()) request.uniforms = std::span(uniforms).first(inputs.size());
    target.forward(inputs, request, step);
  };
  admit();
  const auto prefill_done = Clock::now();
  const double prefill_seconds = std::chrono::duration<double>(prefill_done - start).count();
  forward();

  while (!inputs.empty()) {
    std::vector<TargetInput> next_inputs;
    std::vector<size_t> next_owners;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t r = owners[i];
      GenerateResult& result = results[r];
      const int32_t token = step.tokens[i];
      result.tokens.push_back(token);
      if (on_token) on_token(r, token);
      bool done = false;
      if (is_eos(config, token) && !options.ignore_eos) {
        result.stop_reason = "eos";
        done = true;
      } else if (static_cast<int>(result.tokens.size()) == options.max_new_tokens) {
        done = true;
      } else if (target.sequence_length(sequences[r]) == config.max_positions) {
        result.stop_reason = "context";
        done = true;
      }
      if (done) {
        target.release_sequence(sequences[r]);
        continue;
      }
      next_inputs.push_back({sequences[r], {&result.tokens.back(), 1}, false});
      next_owners.push_back(r);
    }
    inputs = std::move(next_inputs);
    owners = std::move(next_owners);
    admit();
    if (!inputs.empty()) forward();
  }
  const auto decode_done = Clock::now();
  end_step(decode_done);
  const double decode_seconds = std::chrono::duration<double>(decode_done - prefill_done).count();
  for (GenerateResult& result : results) {
    result.prefill_seconds = prefill_seconds;
    result.decode_seconds = decode_seconds;
    result.admission_prefill_seconds = groups.later_prefill_seconds();
    result.forwards = forwards;
    result.full_batch = full_batch;
    result.warm_ups = warm_ups;
  }
  return results;
}

GenerateResult generate(Target& target, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  const std::vector<std::vector<int32_t>> prompts = {{prompt.begin(), prompt.end()}};
  return generate_batch(target, prompts, options,
                        on_token ? [&](size_t, int32_t token) { on_token(token); }
                                 : std::function<void(size_t, int32_t)>{})[0];
}

}  // namespace dspark
