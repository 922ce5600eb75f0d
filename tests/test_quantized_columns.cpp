// markov.w2 at 8 bits for the GPU's tokens-only greedy head
// (spec/quantized_columns.h): the bound holds against exact arithmetic for
// every column and many inputs, it is tight enough to be worth having, and
// the stored layout is the documented one. (The GPU's tokens against the full
// product: tests/cuda/test_cuda_drafter.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/random.h"
#include "spec/quantized_columns.h"

namespace dspark {
namespace {

float bf16_round(float value) { return bf16_to_f32(f32_to_bf16(value)); }

std::vector<float> gaussian_bf16(size_t count, float scale, Rng& rng) {
  std::vector<float> values(count);
  for (float& value : values) {  // Box-Muller: a bell-shaped column, as trained weights are
    const double u1 = std::max(rng.uniform(), 1e-12), u2 = rng.uniform();
    value = bf16_round(scale * float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2)));
  }
  return values;
}

TEST(QuantizedColumns, TheBoundHoldsAndIsTight) {
  const int rank = 64, vocab = 301;
  Rng rng(7);
  std::vector<float> w = gaussian_bf16(size_t(rank) * vocab, 0.05f, rng);
  for (int i = 0; i < rank; ++i) {
    w[size_t(i) * vocab + 3] = 0.0f;                                   // a zero column
    w[size_t(i) * vocab + 4] = i == 5 ? 3.0f : bf16_round(1e-3f * i);  // one weight far above the rest
    w[size_t(i) * vocab + 5] = bf16_round(1e30f * (i % 2 ? 1 : -1));   // huge values
  }
  const QuantizedColumns q = quantize_columns(w.data(), rank, vocab);
  ASSERT_EQ(q.stride, 304);
  double worst_ratio = 0.0;  // |error| / (bound ||e||) over all columns and inputs
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<float> e = gaussian_bf16(rank, trial % 2 ? 1.0f : 0.01f, rng);
    double e_norm = 0.0;
    for (float x : e) e_norm += double(x) * x;
    e_norm = std::sqrt(e_norm);
    for (int v = 0; v < vocab; ++v) {
      long double exact = 0.0L, approximate = 0.0L;
      for (int i = 0; i < rank; ++i) {
        exact += (long double)e[i] * w[size_t(i) * vocab + v];
        approximate += (long double)e[i] * (int(q.values[size_t(i) * q.stride + v]) - 128);
      }
      approximate *= q.scales[v];
      const double error = double(std::fabs(exact - approximate)), allowed = double(q.bounds[v]) * e_norm;
      ASSERT_LE(error, allowed) << "column " << v << " trial " << trial;
      if (allowed > 0) worst_ratio = std::max(worst_ratio, error / allowed);
    }
  }
  EXPECT_GT(worst_ratio, 0.05) << "the bound is far looser than the errors it covers";
  EXPECT_EQ(q.bounds[3], 0.0f) << "a zero column is exact";
  EXPECT_EQ(q.scales[3], 0.0f);

  // Tight enough to pay: for a bell-shaped column the bound is under 1% of the column's norm (the logit
  // interval a fraction of the Cauchy-Schwarz one), where a quarter of that would be int8's ideal.
  double norm = 0.0;
  for (int i = 0; i < rank; ++i) norm += double(w[size_t(i) * vocab]) * w[size_t(i) * vocab];
  EXPECT_LT(q.bounds[0], 0.01 * std::sqrt(norm));
}

TEST(QuantizedColumns, LayoutAndEdges) {
  const int rank = 16, vocab = 5;
  std::vector<float> w(size_t(rank) * vocab);
  for (int i = 0; i < rank; ++i)
    for (int v = 0; v < vocab; ++v) w[size_t(i) * vocab + v] = bf16_round(0.01f * (i + 1) * (v + 1) - 0.05f);
  w[size_t(2) * vocab + 4] = std::numeric_limits<float>::quiet_NaN();  // column 4 not finite
  const QuantizedColumns q = quantize_columns(w.data(), rank, vocab);
  ASSERT_EQ(q.stride, 16);
  for (int i = 0; i < rank; ++i) {
    for (int v = 0; v < vocab; ++v) {
      // exact: column-major, features of slice s (i % 8) together, in order
      EXPECT_EQ(q.exact[size_t(v) * rank + (i % 8) * (rank / 8) + i / 8], f32_to_bf16(w[size_t(i) * vocab + v]))
          << i << "," << v;
      const int value = int(q.values[size_t(i) * q.stride + v]) - 128;
      EXPECT_GE(value, -127);
      EXPECT_LE(value, 127);
      if (v < 4) {
        EXPECT_LE(std::fabs(q.scales[v] * value - w[size_t(i) * vocab + v]), 0.5001f * q.scales[v]);
      }
    }
    for (int v = vocab; v < q.stride; ++v) EXPECT_EQ(q.values[size_t(i) * q.stride + v], 128) << "padding is q = 0";
  }
  EXPECT_EQ(q.bounds[4], std::numeric_limits<float>::infinity()) << "a non-finite column always gets the exact sum";
  EXPECT_THROW(quantize_columns(w.data(), 12, vocab), std::exception) << "rank not a multiple of 8";
}

}  // namespace
}  // namespace dspark
