// Sampling: greedy, temperature, top-k, top-p against hand-computed sets, and
// the sampler's frequencies against its own distribution (chi-square).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "isa_test.h"
#include "kernels/cpu/sampling.h"

namespace dspark::cpu {
namespace {

std::vector<float> softmax(const std::vector<float>& logits, float temperature) {
  std::vector<float> probs(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) total += std::exp(logits[i] / temperature);
  for (size_t i = 0; i < logits.size(); ++i) probs[i] = float(std::exp(logits[i] / temperature) / total);
  return probs;
}

std::vector<float> processed(const std::vector<float>& logits, SamplingParams params) {
  std::vector<float> probs(logits.size());
  std::vector<int32_t> order;
  processed_distribution(probs.data(), logits.data(), int(logits.size()), params, order);
  return probs;
}

const std::vector<float> kLogits = {1.0f, 3.0f, 0.5f, 2.0f, -1.0f, 2.0f};

TEST(Sampling, GreedyIsTheFirstArgmax) {
  EXPECT_EQ(argmax(kLogits.data(), 6), 1);
  const std::vector<float> tie = {0.0f, 5.0f, 5.0f};
  EXPECT_EQ(argmax(tie.data(), 3), 1);
  Rng rng(1);
  std::vector<float> probs;
  std::vector<int32_t> order;
  EXPECT_EQ(sample_token(kLogits.data(), 6, SamplingParams{}, rng, probs, order), 1);
}

TEST(Sampling, TemperatureIsASoftmaxOfScaledLogits) {
  const auto probs = processed(kLogits, {0.7f, 0, 1.0f});
  const auto expected = softmax(kLogits, 0.7f);
  for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(probs[i], expected[i], 1e-6);
}

// The vectorised softmax on every instruction set, for vocabularies with and
// without a partial last vector (and shorter than one), against double
// precision: each probability within the exp polynomial's ~2e-7 relative
// plus what rounding its float argument costs, the whole summing to 1.
class SamplingIsa : public testing::IsaTest {};

TEST_F(SamplingIsa, TemperatureSoftmaxMatchesDoublePrecisionOnEveryInstructionSet) {
  Rng rng(11);
  for (MatmulIsa isa : supported()) {
    set_matmul_isa(isa);
    for (int vocab : {3, 16, 17, 8192, 8203}) {
      std::vector<float> logits(vocab);
      for (float& logit : logits) logit = float(rng.uniform() * 30.0 - 15.0);
      for (float temperature : {1.0f, 0.6f, 1.7f}) {
        const auto probs = processed(logits, {temperature, 0, 1.0f});
        const float largest = *std::max_element(logits.begin(), logits.end());
        double total = 0.0;
        for (float logit : logits) total += std::exp(double(logit - largest) / temperature);
        double sum = 0.0;
        for (int i = 0; i < vocab; ++i) {
          const double argument = double(logits[i] - largest) / temperature;
          const double expected = std::exp(argument) / total;
          // The polynomial's ~2e-7, plus the float argument's rounding (relative 2^-23 of it).
          ASSERT_NEAR(probs[i], expected, expected * 3e-7 * (1.0 + std::abs(argument)) + 1e-37)
              << matmul_isa_name(isa) << " vocab " << vocab << " T " << temperature << " i " << i;
          sum += probs[i];
        }
        EXPECT_NEAR(sum, 1.0, 1e-5) << matmul_isa_name(isa) << " vocab " << vocab;
      }
    }
  }
}

TEST(Sampling, TopKKeepsTheKLargestAndTiesWithTheKth) {
  auto probs = processed(kLogits, {1.0f, 2, 1.0f});
  // Logits 3, 2, 2: the k-th (2.0) is tied, so both 2.0s stay (as in HF).
  std::vector<int> kept;
  for (int i = 0; i < 6; ++i)
    if (probs[i] > 0) kept.push_back(i);
  EXPECT_EQ(kept, (std::vector<int>{1, 3, 5}));
  EXPECT_NEAR(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0, 1e-6);
  const float ratio = std::exp(1.0f);  // p(3.0) / p(2.0)
  EXPECT_NEAR(probs[1] / probs[3], ratio, 1e-4);
}

TEST(Sampling, TopPKeepsTheSmallestHeadReachingP) {
  const auto full = softmax(kLogits, 1.0f);  // sorted: 1 (.507), 3 and 5 (.187 each), 0, 2, 4
  // p = 0.6: token 1 alone has .507 < .6, so the next one is needed too.
  auto probs = processed(kLogits, {1.0f, 0, 0.6f});
  int kept = 0;
  for (float p : probs) kept += p > 0;
  EXPECT_EQ(kept, 2);
  EXPECT_GT(probs[1], 0.0f);
  // p just below token 1's own mass: token 1 alone.
  probs = processed(kLogits, {1.0f, 0, full[1] - 1e-3f});
  EXPECT_EQ(probs[1], 1.0f);
  // top-p after top-k uses the renormalised top-k mass.
  probs = processed(kLogits, {1.0f, 3, 0.6f});
  EXPECT_GT(probs[1], 0.0f);
  EXPECT_NEAR(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0, 1e-6);
}

TEST(Sampling, FrequenciesMatchTheDistribution) {
  // 200k draws over 6 outcomes; chi-square with 5 degrees of freedom. The
  // bound 20.5 is the 0.999 quantile: a correct sampler fails one seed in 1000
  // (this fixed seed passes, so the test is deterministic).
  const SamplingParams params{0.9f, 0, 1.0f};
  const auto probs = processed(kLogits, params);
  Rng rng(20261130);
  std::vector<float> scratch;
  std::vector<int32_t> order;
  std::vector<long> counts(6, 0);
  const long draws = 200000;
  for (long i = 0; i < draws; ++i) ++counts[sample_token(kLogits.data(), 6, params, rng, scratch, order)];
  double chi_square = 0.0;
  for (int i = 0; i < 6; ++i) {
    const double expected = probs[i] * draws;
    chi_square += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  EXPECT_LT(chi_square, 20.5);
}

TEST(Sampling, SameSeedSameStream) {
  const SamplingParams params{1.0f, 0, 0.9f};
  auto run = [&](uint64_t seed) {
    Rng rng(seed);
    std::vector<float> scratch;
    std::vector<int32_t> order, tokens;
    for (int i = 0; i < 50; ++i) tokens.push_back(sample_token(kLogits.data(), 6, params, rng, scratch, order));
    return tokens;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

}  // namespace
}  // namespace dspark::cpu
