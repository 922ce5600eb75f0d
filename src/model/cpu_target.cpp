#include "model/cpu_target.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dspark {

int CpuTarget::create_sequence(int capacity) {
  caches_.emplace(next_sequence_, KVCache(model_.config, capacity));
  return next_sequence_++;
}

void CpuTarget::release_sequence(int sequence) {
  DSPARK_CHECK(caches_.erase(sequence) == 1, "unknown sequence ", sequence);
}

KVCache& CpuTarget::cache(int sequence) {
  auto found = caches_.find(sequence);
  DSPARK_CHECK(found != caches_.end(), "unknown sequence ", sequence);
  return found->second;
}

int CpuTarget::sequence_length(int sequence) const {
  auto found = caches_.find(sequence);
  DSPARK_CHECK(found != caches_.end(), "unknown sequence ", sequence);
  return found->second.length();
}

void CpuTarget::truncate_sequence(int sequence, int length) { cache(sequence).truncate(length); }

void CpuTarget::forward(std::span<const TargetInput> inputs, const TargetRequest& request,
                        TargetResult& result) {
  std::vector<ForwardSequence> batch;
  for (const TargetInput& input : inputs) batch.push_back({&cache(input.sequence), input.tokens, input.all_rows});
  transformer_forward(model_, batch, request.taps, workspace_, output_);

  const int V = model_.config.vocab_size;
  const size_t rows = output_.logits.size() / V;
  DSPARK_CHECK(request.sampling.greedy() || request.uniforms.size() == rows, "sampling needs ", rows,
               " uniforms, got ", request.uniforms.size());
  DSPARK_CHECK(request.score_tokens.empty() || request.score_tokens.size() == rows, "scoring needs ",
               rows, " tokens, got ", request.score_tokens.size());
  result.tokens.resize(rows);
  result.nll.resize(request.score_tokens.empty() ? 0 : rows);
  for (size_t row = 0; row < rows; ++row) {
    const float* logits = output_.logits.data() + row * V;
    if (request.sampling.greedy()) {
      result.tokens[row] = cpu::argmax(logits, V);
    } else {
      probs_.resize(V);
      cpu::processed_distribution(probs_.data(), logits, V, request.sampling, order_);
      result.tokens[row] = cpu::sample_from_distribution(probs_.data(), V, request.uniforms[row]);
    }
    if (!request.score_tokens.empty()) {
      const float maximum = *std::max_element(logits, logits + V);
      double total = 0.0;
      for (int i = 0; i < V; ++i) total += std::exp(static_cast<double>(logits[i]) - maximum);
      result.nll[row] = static_cast<float>(std::log(total) + maximum - logits[request.score_tokens[row]]);
    }
  }
  if (request.want_logits) result.logits = output_.logits;
  result.taps = request.taps.empty() ? std::vector<float>{} : output_.taps;
  result.device_taps = nullptr;  // host taps even when taps_on_device was asked (target.h)
}

}  // namespace dspark
