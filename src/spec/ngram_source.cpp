#include "spec/ngram_source.h"

#include <algorithm>

namespace dspark {

std::vector<int32_t> NgramSource::lookup(std::span<const int32_t> text, int max_ngram, int count) {
  const long length = static_cast<long>(text.size());
  for (long n = std::min<long>(max_ngram, length - 1); n >= 1; --n) {  // longest suffix first
    const auto suffix = text.subspan(length - n);
    for (long start = length - n - 1; start >= 0; --start) {  // the most recent earlier occurrence
      if (!std::equal(suffix.begin(), suffix.end(), text.begin() + start)) continue;
      const long follow = start + n;
      const long available = std::min<long>(count, length - follow);
      return {text.begin() + follow, text.begin() + follow + available};
    }
  }
  return {};
}

void NgramSource::begin(int row, std::span<const int32_t> prompt, uint64_t) { history_[row].clear(); }

void NgramSource::accept(int row, std::span<const int32_t> tokens, const float*) {
  auto& history = history_[row];
  history.insert(history.end(), tokens.begin(), tokens.end());
}

void NgramSource::propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
                          const cpu::SamplingParams&, std::vector<Proposal>& proposals) {
  proposals.assign(rows.size(), Proposal{});
  std::vector<int32_t> text;
  for (size_t i = 0; i < rows.size(); ++i) {
    text = history_[rows[i]];
    text.push_back(pending[i]);
    proposals[i].tokens = lookup(text, max_ngram_, max_tokens[i]);
  }
}

}  // namespace dspark
