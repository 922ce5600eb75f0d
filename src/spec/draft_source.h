// DraftSource: where speculative decoding gets its proposals, behind one small
// interface (DESIGN.md §3). The engine tells a source about each request's
// tokens as the target accepts them, and asks it for up to n tokens that
// follow the current `pending` token.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/sampling.h"

namespace dspark {

struct Proposal {
  std::vector<int32_t> tokens;    // the proposed continuation (may be empty: then the round is a plain step)
  std::vector<float> confidence;  // [n] per-position confidence, where the source has one
  std::vector<float> probs;       // [n, V] the processed distributions the tokens were sampled from;
                                  // empty: the tokens are deterministic (a one-hot q)
};

class DraftSource {
 public:
  virtual ~DraftSource() = default;

  // Target hidden-state taps the source reads (DESIGN §2), or none.
  virtual std::vector<int> tap_layers() const { return {}; }

  // A new request in batch slot `row`; `seed` fixes its random stream.
  virtual void begin(int row, std::span<const int32_t> prompt, uint64_t seed) = 0;

  // `tokens` entered the target's KV cache for `row` (the prefill, then each
  // round's pending + accepted drafts); `tapped_rows` [count, m*H] are their
  // tapped hidden rows (null when tap_layers() is empty).
  virtual void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) = 0;

  // Proposals for `rows`, each continuing after its `pending` token (the last
  // emitted token, not yet in the target's cache); at most max_tokens[i] each.
  virtual void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
                       const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) = 0;

  virtual void end(int row) = 0;
};

}  // namespace dspark
