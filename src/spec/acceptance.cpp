#include "spec/acceptance.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/sampling.h"

namespace dspark {

Verdict accept_greedy(std::span<const int32_t> target_tokens, std::span<const int32_t> draft) {
  DSPARK_CHECK(target_tokens.size() == draft.size() + 1, "greedy verification needs n + 1 target tokens");
  Verdict verdict;
  while (verdict.accepted < int(draft.size()) && draft[verdict.accepted] == target_tokens[verdict.accepted])
    ++verdict.accepted;
  verdict.next = target_tokens[verdict.accepted];
  return verdict;
}

Verdict accept_sampled(std::span<const float> target_probs, std::span<const float> draft_probs,
                       std::span<const int32_t> draft, int vocab, Rng& rng) {
  const size_t n = draft.size();
  DSPARK_CHECK(target_probs.size() == (n + 1) * vocab, "sampled verification needs n + 1 target distributions");
  DSPARK_CHECK(draft_probs.empty() || draft_probs.size() == n * vocab, "one draft distribution per drafted token");
  Verdict verdict;
  std::vector<float> residual(vocab);
  for (size_t k = 0; k < n; ++k) {
    const float* p = target_probs.data() + k * vocab;
    const int32_t token = draft[k];
    const float q_token = draft_probs.empty() ? 1.0f : draft_probs[k * vocab + token];
    if (rng.uniform() * q_token < p[token]) {  // u < min(1, p/q), without dividing by q
      ++verdict.accepted;
      continue;
    }
    // Rejected: a sample of norm(max(0, p - q)), or of p when that mass vanishes.
    double mass = 0.0;
    for (int i = 0; i < vocab; ++i) {
      const float q = draft_probs.empty() ? (i == token ? 1.0f : 0.0f) : draft_probs[k * vocab + i];
      residual[i] = std::max(0.0f, p[i] - q);
      mass += residual[i];
    }
    if (mass <= 1e-12) {
      verdict.next = cpu::sample_from_distribution(p, vocab, rng.uniform());
    } else {
      for (float& value : residual) value = static_cast<float>(value / mass);
      verdict.next = cpu::sample_from_distribution(residual.data(), vocab, rng.uniform());
    }
    return verdict;
  }
  verdict.next = cpu::sample_from_distribution(target_probs.data() + n * vocab, vocab, rng.uniform());
  return verdict;
}

}  // namespace dspark
