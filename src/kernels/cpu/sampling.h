// Turning logits into tokens. The processed distribution (temperature, then
// top-k, then top-p, as HF's generate applies them) is exposed on its own
// because speculative sampling must compare the target's and the drafter's
// distributions after identical processing.
#pragma once
#include <cstdint>
#include <vector>

#include "core/random.h"

namespace dspark::cpu {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax)
  int top_k = 0;             // 0: off; else keep the k largest (and ties with the k-th)
  float top_p = 1.0f;        // 1: off; else the smallest head of the sorted distribution
                             // whose mass reaches top_p
  bool greedy() const { return temperature <= 0.0f; }
};

// Index of the largest logit (the first one on ties, like torch.argmax).
int32_t argmax(const float* logits, int vocab);

// probs [vocab] = the distribution sampling draws from: softmax(logits / T)
// restricted to top-k and top-p and renormalised. Greedy params give a one-hot
// at the argmax. `order` is scratch (resized as needed).
void processed_distribution(float* probs, const float* logits, int vocab,
                            const SamplingParams& params, std::vector<int32_t>& order);

// The token whose cumulative probability interval holds `uniform` in [0, 1).
int32_t sample_from_distribution(const float* probs, int vocab, double uniform);

// One token from logits: argmax when greedy, else a draw from the processed
// distribution using one uniform from `rng`. `probs`/`order` are scratch.
int32_t sample_token(const float* logits, int vocab, const SamplingParams& params, Rng& rng,
                     std::vector<float>& probs, std::vector<int32_t>& order);

}  // namespace dspark::cpu
