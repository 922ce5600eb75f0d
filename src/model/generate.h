// Plain autoregressive generation with the target alone: prefill the prompt,
// then one forward per new token. The reference the speculative engine must
// reproduce exactly at temperature 0.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "model/target.h"

namespace dspark {

struct GenerateOptions {
  int max_new_tokens = 128;
  cpu::SamplingParams sampling;  // temperature 0: greedy
  uint64_t seed = 0;             // one uniform per generated token is drawn from Rng(seed)
  bool ignore_eos = false;
  // At most this many requests decode together (0: all of them); a waiting
  // request joins the next step as soon as one finishes (continuous
  // batching, as a server runs) with its last prompt token, the others
  // having entered the cache in one prefill forward with those of the next
  // max_active waiting requests (generate.cpp: admission).
  int max_active = 0;
};

// Some of a decode loop's steps (plain) or rounds (speculative), each timed
// from its start to the next one's (its admissions and bookkeeping
// included), and the tokens they generated.
struct StepTally {
  long forwards = 0;
  double seconds = 0.0;
  long tokens = 0;
  double tokens_per_s() const { return seconds > 0 ? tokens / seconds : 0.0; }
  void add_step(double step_seconds, long step_tokens) { ++forwards, seconds += step_seconds, tokens += step_tokens; }
  void add(const StepTally& other) { forwards += other.forwards, seconds += other.seconds, tokens += other.tokens; }
};

// The order in which requests take a place under continuous batching, the
// same in both decode loops: they are prefilled in groups of `group`
// (max_active), in order, the next group when a place frees up and no
// prefilled request is waiting for one, so that a prompt's rows go through
// the same prefill forward in plain and speculative decoding.
class PrefillGroups {
 public:
  PrefillGroups(size_t requests, size_t group) : requests_(requests), group_(group) {}
  // The next request to take a place, after prefill(first, end) prefilled
  // requests [first, end) where none was waiting; nothing once all have one.
  template <class Prefill>
  std::optional<size_t> next(Prefill&& prefill) {
    if (taken_ == prefilled_) {
      if (prefilled_ == requests_) return std::nullopt;
      const size_t end = std::min(requests_, prefilled_ + group_);
      const auto start = std::chrono::steady_clock::now();
      prefill(prefilled_, end);
      if (prefilled_ > 0)
        later_prefill_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      prefilled_ = end;
    }
    return taken_++;
  }
  size_t waiting() const { return requests_ - taken_; }  // requests without a place, prefilled or not
  // Seconds in prefill() for every group but the first (the one admitted at
  // the start): what later admissions add to the decode loop.
  double later_prefill_seconds() const { return later_prefill_seconds_; }

 private:
  size_t requests_, group_;
  size_t prefilled_ = 0, taken_ = 0;  // requests [taken_, prefilled_) are prefilled and wait
  double later_prefill_seconds_ = 0.0;
};

struct GenerateResult {
  std::vector<int32_t> tokens;   // generated ids, the stopping EOS included
  std::string stop_reason;       // "eos" | "length" | "context"
  double prefill_seconds = 0.0;  // the prefill of the prompts admitted at once (all their tokens but the last)
  double decode_seconds = 0.0;   // everything after it, later admissions' prompts included
  // The part of decode_seconds spent prefilling the requests admitted later
  // (continuous batching), which a step's time would otherwise hide.
  double admission_prefill_seconds = 0.0;
  long forwards = 0;             // decode steps the whole batch ran (the prefill not counted)
  // The whole batch's steps, under continuous batching (max_active > 0),
  // with every place taken (max_active requests in flight): what a server
  // sustains at that batch size while requests wait. The rest is the tail,
  // where the last requests finish with places left empty; its length is set
  // by how far apart the last requests end (plain decoding's requests of one
  // length end together, speculative decoding's spread out with their
  // acceptance), not by a step's speed.
  StepTally full_batch;
  // The whole batch's steps that ran a shape for one of its first times
  // (Target::warm_up_runs moved: run eagerly, captured).
  StepTally warm_ups;
};

// Throws if the prompt is empty or does not leave room for one new token in
// the model's context. `on_token` sees each id as it is generated.
GenerateResult generate(Target& target, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

// A batch of prompts decoded together, one forward per step for all of them
// (or for max_active of them at a time). Request r samples with its own
// stream (Rng(seed) for the first request), so its output does not depend on
// which others share its steps.
// `on_token(r, id)` sees each id as it is generated.
std::vector<GenerateResult> generate_batch(Target& target, std::span<const std::vector<int32_t>> prompts,
                                           const GenerateOptions& options,
                                           const std::function<void(size_t, int32_t)>& on_token = {});

// The error a prompt that leaves no room in the context gets; shared by every
// entry point that accepts prompts.
void check_prompt_fits(const ModelConfig& config, size_t prompt_tokens);

bool is_eos(const ModelConfig& config, int32_t token);

}  // namespace dspark
