#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

// The scalar loop's answer (the first index whose value no later one
// exceeds; NaNs never win unless logits[0] is one) in two vector passes: the
// largest value, then its first index. Instruction sets as in matmul.cpp.
template <int W>
[[gnu::always_inline]] inline int32_t argmax(const float* logits, int vocab) {
  using V = typename simd::Floats<W>::Vector;
  if (vocab < W || std::isnan(logits[0])) {
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return best;
  }
  V maximum = V{} + logits[0];  // x > maximum is false for NaN, so NaNs never enter
  int i = 0;
  for (; i + W <= vocab; i += W) {
    const V x = simd::load<V>(logits + i);
    maximum = x > maximum ? x : maximum;
  }
  float largest = maximum[0];
  for (int lane = 1; lane < W; ++lane) largest = std::max(largest, float(maximum[lane]));
  for (; i < vocab; ++i) largest = logits[i] > largest ? logits[i] : largest;
  for (i = 0; i + W <= vocab; i += W) {
    const auto equal = simd::load<V>(logits + i) == largest;
    for (int lane = 0; lane < W; ++lane)
      if (equal[lane]) return i + lane;
  }
  for (; i < vocab; ++i)
    if (logits[i] == largest) return i;
  return 0;  // unreachable: largest is one of the values
}
__attribute__((target("arch=x86-64-v4"))) int32_t argmax_avx512(const float* logits, int vocab) {
  return argmax<16>(logits, vocab);
}
__attribute__((target("arch=x86-64-v3"))) int32_t argmax_avx2(const float* logits, int vocab) {
  return argmax<8>(logits, vocab);
}
int32_t argmax_baseline(const float* logits, int vocab) { return argmax<4>(logits, vocab); }

// probs = softmax(logits / temperature): the maximum, exp((x - max) / T)
// (simd::exp) over vectors of W (the tail in one vector padded with -inf,
// whose exp is 0), their sum per lane in double, then one multiply by the
// inverse. A vocabulary of exps is most of what
// sampling costs per row (8192 of them for the demo target).
template <int W>
[[gnu::always_inline]] inline void tempered_softmax(float* probs, const float* logits, int vocab, float temperature) {
  using V = typename simd::Floats<W>::Vector;
  const float negative_infinity = -__builtin_inff();
  V maximum = V{} + negative_infinity;
  int i = 0;
  for (; i + W <= vocab; i += W) {
    const V x = simd::load<V>(logits + i);
    maximum = x > maximum ? x : maximum;
  }
  float largest = negative_infinity;
  for (int lane = 0; lane < W; ++lane) largest = std::max(largest, float(maximum[lane]));
  for (int j = i; j < vocab; ++j) largest = std::max(largest, logits[j]);
  const float scale = 1.0f / temperature;
  double sums[W] = {};  // per lane, in double: float sums of thousands of terms lose ~1e-6
  for (i = 0; i + W <= vocab; i += W) {
    const V e = simd::exp<W>((simd::load<V>(logits + i) - largest) * scale);
    simd::store(probs + i, e);
    for (int lane = 0; lane < W; ++lane) sums[lane] += e[lane];
  }
  if (i < vocab) {
    V tail = V{} + negative_infinity;
    for (int lane = 0; i + lane < vocab; ++lane) tail[lane] = logits[i + lane];
    const V e = simd::exp<W>((tail - largest) * scale);
    for (int lane = 0; i + lane < vocab; ++lane) probs[i + lane] = e[lane], sums[lane] += e[lane];
  }
  double total = 0.0;
  for (int lane = 0; lane < W; ++lane) total += sums[lane];
  const float inverse = static_cast<float>(1.0 / total);
  for (i = 0; i + W <= vocab; i += W) simd::store(probs + i, simd::load<V>(probs + i) * inverse);
  for (; i < vocab; ++i) probs[i] *= inverse;
}
__attribute__((target("arch=x86-64-v4"))) void tempered_softmax_avx512(float* probs, const float* logits, int vocab,
                                                                      float temperature) {
  tempered_softmax<16>(probs, logits, vocab, temperature);
}
__attribute__((target("arch=x86-64-v3"))) void tempered_softmax_avx2(float* probs, const float* logits, int vocab,
                                                                    float temperature) {
  tempered_softmax<8>(probs, logits, vocab, temperature);
}
void tempered_softmax_baseline(float* probs, const float* logits, int vocab, float temperature) {
  tempered_softmax<4>(probs, logits, vocab, temperature);
}

}  // namespace

int32_t argmax(const float* logits, int vocab) {
  return for_matmul_isa(argmax_avx512, argmax_avx2, argmax_baseline)(logits, vocab);
}

void processed_distribution(float* probs, const float* logits, int vocab, const SamplingParams& params,
                            std::vector<int32_t>& order) {
  if (params.greedy()) {
    std::fill(probs, probs + vocab, 0.0f);
    probs[argmax(logits, vocab)] = 1.0f;
    return;
  }
  for_matmul_isa(tempered_softmax_avx512, tempered_softmax_avx2, tempered_softmax_baseline)(probs, logits, vocab,
                                                                                           params.temperature);
  const bool use_top_k = params.top_k > 0 && params.top_k < vocab;
  const bool use_top_p = params.top_p < 1.0f;
  if (!use_top_k && !use_top_p) return;

  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  // Descending probability; ties broken by index so the result is deterministic.
  auto descending = [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
  int kept = vocab;
  if (use_top_k) {
    std::partial_sort(order.begin(), order.begin() + params.top_k, order.end(), descending);
    const float kth = probs[order[params.top_k - 1]];
    kept = params.top_k;  // HF keeps every token tied with the k-th
    std::sort(order.begin() + kept, order.end(), descending);
    while (kept < vocab && probs[order[kept]] == kth) ++kept;
  } else {
    std::sort(order.begin(), order.end(), descending);
  }
  if (use_top_p) {
    // Mass of the kept set, renormalised as HF renormalises after top-k.
    double kept_mass = 0.0;
    for (int i = 0; i < kept; ++i) kept_mass += probs[order[i]];
    // Keep token i while the mass strictly before it is below top_p (HF's
    // "remove where ascending cumulative <= 1 - top_p"); at least one token.
    double before = 0.0;
    int head = 0;
    while (head < kept && before / kept_mass < params.top_p) before += probs[order[head++]];
    kept = std::max(head, 1);
  }
  double kept_mass = 0.0;
  for (int i = 0; i < kept; ++i) kept_mass += probs[order[i]];
  for (int i = kept; i < vocab; ++i) probs[order[i]] = 0.0f;
  for (int i = 0; i < kept; ++i) probs[order[i]] = static_cast<float>(probs[order[i]] / kept_mass);
}

int32_t sample_from_distribution(const float* probs, int vocab, double uniform) {
  double cumulative = 0.0;
  int32_t last_nonzero = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    if (probs[i] <= 0.0f) continue;
    cumulative += probs[i];
    last_nonzero = i;
    if (uniform < cumulative) return i;
  }
  return last_nonzero;  // rounding left the total a hair under 1
}

int32_t sample_token(const float* logits, int vocab, const SamplingParams& params, Rng& rng, std::vector<float>& probs,
                     std::vector<int32_t>& order) {
  if (params.greedy()) return argmax(logits, vocab);
  probs.resize(vocab);
  processed_distribution(probs.data(), logits, vocab, params, order);
  return sample_from_distribution(probs.data(), vocab, rng.uniform());
}

}  // namespace dspark::cpu
