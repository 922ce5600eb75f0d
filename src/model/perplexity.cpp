#include "model/perplexity.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dspark {

PerplexityResult perplexity(const Transformer& model, std::span<const int32_t> ids, int context,
                            const std::function<void(long, long)>& on_window) {
  const ModelConfig& config = model.config;
  DSPARK_CHECK(ids.size() >= 2, "perplexity needs at least 2 tokens, got ", ids.size());
  DSPARK_CHECK(context >= 2 && context <= config.max_positions, "--ctx ", context,
               " must be between 2 and the model's context of ", config.max_positions);
  const long count = static_cast<long>(ids.size());
  const long stride = std::max(1, context / 2);
  const int V = config.vocab_size;
  ForwardWorkspace workspace;
  ForwardOutput output;
  KVCache cache(config, static_cast<int>(std::min<long>(context, count)));
  PerplexityResult result;
  long scored_until = 1;  // token 0 has no prefix
  for (long begin = 0;; begin += stride) {
    const long end = std::min(begin + context, count);
    cache.truncate(0);
    ForwardSequence window{&cache, ids.subspan(begin, end - begin), true};
    transformer_forward(model, {&window, 1}, {}, workspace, output);
    for (long position = std::max(scored_until, begin + 1); position < end; ++position) {
      const float* logits = output.logits.data() + (position - 1 - begin) * V;
      const float maximum = *std::max_element(logits, logits + V);
      double total = 0.0;
      for (int i = 0; i < V; ++i) total += std::exp(static_cast<double>(logits[i]) - maximum);
      result.nll += std::log(total) + maximum - logits[ids[position]];
      ++result.tokens;
    }
    scored_until = end;
    if (on_window) on_window(result.tokens, count - 1);
    if (end == count) break;
  }
  result.ppl = std::exp(result.nll / static_cast<double>(result.tokens));
  return result;
}

}  // namespace dspark
