// N-gram prompt lookup: no model. The longest suffix of the request's text
// (prompt + everything emitted, ending with `pending`) that occurred earlier
// proposes the tokens that followed that earlier occurrence.
#pragma once
#include <map>

#include "spec/draft_source.h"

namespace dspark {

class NgramSource final : public DraftSource {
 public:
  explicit NgramSource(int max_ngram = 8) : max_ngram_(max_ngram) {}
  void begin(int row, std::span<const int32_t> prompt, uint64_t seed) override;
  void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) override;
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) override;
  void end(int row) override { history_.erase(row); }

  // The lookup itself: what followed the longest earlier match of text's
  // suffix (most recent occurrence), at most `count` tokens.
  static std::vector<int32_t> lookup(std::span<const int32_t> text, int max_ngram, int count);

 private:
  int max_ngram_;
  std::map<int, std::vector<int32_t>> history_;  // row -> tokens in the target's cache
};

}  // namespace dspark
