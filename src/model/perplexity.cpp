#include "model/perplexity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace dspark {

PerplexityResult perplexity(Target& target, std::span<const int32_t> ids, int context,
                            const std::function<void(long, long)>& on_window) {
  const ModelConfig& config = target.config();
  DSPARK_CHECK(ids.size() >= 2, "perplexity needs at least 2 tokens, got ", ids.size());
  DSPARK_CHECK(context >= 2 && context <= config.max_positions, "--ctx ", context,
               " must be between 2 and the model's context of ", config.max_positions);
  const long count = static_cast<long>(ids.size());
  const long stride = std::max(1, context / 2);
  const int sequence = target.create_sequence(static_cast<int>(std::min<long>(context, count)));
  std::vector<int32_t> next_tokens;
  TargetResult scored;
  PerplexityResult result;
  long scored_until = 1;  // token 0 has no prefix
  for (long begin = 0;; begin += stride) {
    const long end = std::min(begin + context, count);
    // Row r predicts token begin + r + 1; the window's last row has nothing to score.
    next_tokens.assign(ids.begin() + begin + 1, ids.begin() + end);
    next_tokens.push_back(0);
    target.truncate_sequence(sequence, 0);
    TargetInput window{sequence, ids.subspan(begin, end - begin), true};
    TargetRequest request;
    request.score_tokens = next_tokens;
    target.forward({&window, 1}, request, scored);
    for (long position = std::max(scored_until, begin + 1); position < end; ++position) {
      result.nll += scored.nll[position - 1 - begin];
      ++result.tokens;
    }
    scored_until = end;
    if (on_window) on_window(result.tokens, count - 1);
    if (end == count) break;
  }
  target.release_sequence(sequence);
  result.ppl = std::exp(result.nll / static_cast<double>(result.tokens));
  return result;
}

}  // namespace dspark
