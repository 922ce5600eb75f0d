// Perplexity of a token sequence under the target: every token after the first
// is scored given its prefix. Sequences longer than `context` are scored in
// windows of `context` tokens advancing by context/2; each window scores only
// the tokens no earlier window scored, so each has at least context/2 tokens of
// history (the same windows tests/tools/make_golden.py uses with HF).
#pragma once
#include <cstdint>
#include <functional>
#include <span>

#include "model/target.h"

namespace dspark {

struct PerplexityResult {
  double nll = 0.0;    // total negative log-likelihood, nats
  long tokens = 0;     // tokens scored
  double ppl = 0.0;    // exp(nll / tokens)
};

// `on_window(scored_so_far, total_to_score)` reports progress after each window.
PerplexityResult perplexity(Target& target, std::span<const int32_t> ids, int context,
                            const std::function<void(long, long)>& on_window = {});

}  // namespace dspark
