// Verification (DESIGN.md §3 step 4): how many drafted tokens the target
// keeps, and the one token it adds. Greedy keeps the longest prefix equal to
// the target's argmax; sampling accepts x_k with probability min(1, p/q) and
// on rejection draws from norm(max(0, p - q)), which makes every emitted
// token distributed exactly as the target alone would emit it.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/random.h"

namespace dspark {

struct Verdict {
  int accepted = 0;  // drafted tokens kept (a prefix)
  int32_t next = 0;  // the target's token after them: correction, or bonus when all were kept
};

// target_tokens [n + 1]: the target's argmax after the pending token and after each draft.
Verdict accept_greedy(std::span<const int32_t> target_tokens, std::span<const int32_t> draft);

// target_probs [n + 1, V]: the target's processed distribution at each verify
// row; draft_probs [n, V] the drafter's (same processing), or empty when the
// draft is deterministic (q one-hot on the drafted token). Uses one uniform per
// examined token and one more for the emitted one.
Verdict accept_sampled(std::span<const float> target_probs, std::span<const float> draft_probs,
                       std::span<const int32_t> draft, int vocab, Rng& rng);

}  // namespace dspark
