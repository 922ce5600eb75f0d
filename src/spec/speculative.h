// Lossless speculative decoding (DESIGN.md §3) for a batch of requests with
// different prompt lengths, draft lengths and accepted lengths. Each round:
// the source drafts for every active request, one batched target forward
// verifies each request's [pending, drafts...], the verdict keeps a prefix
// and adds the target's own token, the target's KV cache is rolled back past
// the rejected drafts, and the source learns the accepted tokens (with their
// tapped hidden rows).
#pragma once
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "model/generate.h"
#include "model/target.h"
#include "spec/draft_source.h"

namespace dspark {

class VerifyScheduler;  // spec/scheduler.h

struct SpeculativeOptions {
  int max_new_tokens = 128;
  cpu::SamplingParams sampling;  // greedy at temperature 0
  uint64_t seed = 0;
  bool ignore_eos = false;
  int gamma = 8;                 // most tokens drafted per round
  bool trace = false;            // keep every round's draft, verdict and emitted tokens
  // Decides how much of each proposal one round verifies (e.g. Alg 1,
  // spec/scheduler.h); null: all of it. Not owned.
  VerifyScheduler* scheduler = nullptr;
  // At most this many requests decode together (0: all of them); a waiting
  // request joins as soon as one finishes (continuous batching), its prompt
  // prefilled in one forward with those of the next max_active waiting
  // requests, which then wait with their caches kept (speculative.cpp:
  // admission). A request's output does not depend on it at temperature 0,
  // nor at any temperature unless the scheduler's decisions do (alg1 weighs
  // the whole batch's confidences).
  int max_active = 0;
};

struct RoundTrace {
  std::vector<int32_t> draft;
  std::vector<float> confidence;
  int accepted = 0;
  std::vector<int32_t> emitted;
};

struct SpeculativeStats {
  long rounds = 0, drafted = 0, accepted = 0;  // drafted: tokens verified
  long proposed = 0;                           // tokens the source proposed (>= drafted with a scheduler)
  long undrafted = 0;                          // rounds the scheduler left undrafted for the row (plain steps)
  std::vector<long> drafted_at, accepted_at;  // [γ] rounds that drafted / accepted position k
  // Tokens emitted per target verify forward: sum(accepted + 1) / rounds (plain decoding: 1).
  double tau() const { return rounds ? double(accepted + rounds) / rounds : 0.0; }
  std::vector<double> acceptance_by_position() const;  // accepted_at[k] / drafted_at[k]
  void add(const SpeculativeStats& other);
};

struct SpeculativeResult {
  std::vector<int32_t> tokens;  // generated ids, the stopping EOS included
  std::string stop_reason;      // "eos" | "length" | "context"
  SpeculativeStats stats;
  std::vector<RoundTrace> trace;
};

struct SpeculativeTiming {
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  // Where the decode time went, on the host's clock (each phase ends when its
  // results are on the host, so GPU work counts in the phase that waits for it).
  long rounds = 0;              // rounds of the whole batch (a row's rounds are in its stats)
  double draft_seconds = 0.0;   // propose (extending the drafter's context first) and the schedule
  double verify_seconds = 0.0;  // the target's verify forwards
  double accept_seconds = 0.0;  // verdicts, rollbacks, accepts and finish_accepts
  double admission_prefill_seconds = 0.0;  // prefills of every group admitted after the first (PrefillGroups)
  // Rounds where no row drafted (each row's pending token alone, as a plain
  // step), and their time: what such a round costs beside a plain step.
  long undrafted_rounds = 0;
  double undrafted_seconds = 0.0;
  StepTally full_batch;  // under continuous batching, the rounds with every place taken (GenerateResult)
  // Rounds where the target or the source ran a shape for one of its first
  // times (warm_up_runs moved: run eagerly, captured), a prefill before the
  // round included.
  StepTally warm_ups;
  void add(const SpeculativeTiming& other);
};

std::vector<SpeculativeResult> speculative_generate(Target& target, DraftSource& source,
                                                    std::span<const std::vector<int32_t>> prompts,
                                                    const SpeculativeOptions& options,
                                                    SpeculativeTiming* timing = nullptr);

// The seed of request `row`'s stream for `purpose` (0: acceptance, 1: drafting).
uint64_t stream_seed(uint64_t seed, int row, int purpose);

}  // namespace dspark
