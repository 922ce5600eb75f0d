// The vectorised elementwise CPU kernels against scalar references, under
// every instruction set the CPU supports: argmax (exactly the scalar loop's
// answer, ties and NaNs included, for lengths that are and are not whole
// vectors), SwiGLU (double-precision silu(g) u), the drafter's GELU gate
// (double-precision gelu_tanh(g) u) and RMSNorm (double
// precision, widths that are and are not whole vectors of the sum's
// four accumulators).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/random.h"
#include "gradient_check.h"
#include "isa_test.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/sampling.h"

namespace dspark {
namespace {

using cpu::MatmulIsa;
using testing::random_values;

// The definition: the first index no later value exceeds.
int32_t scalar_argmax(const std::vector<float>& logits) {
  int32_t best = 0;
  for (int32_t i = 1; i < int32_t(logits.size()); ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

using ElementwiseTest = testing::IsaTest;  // restores the instruction set and thread count

TEST_F(ElementwiseTest, ArgmaxIsTheScalarLoopsAnswer) {
  Rng rng(31);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (int vocab : {1, 3, 4, 15, 16, 17, 31, 33, 100, 8192, 8197}) {
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<float> logits = random_values(rng, vocab, 4.0f);
        // Quantised values: many exact ties, the maximum among them.
        if (trial % 4 == 1)
          for (float& x : logits) x = std::round(x);
        if (trial % 4 == 2) logits[rng.next() % vocab] = nan;
        if (trial % 4 == 3) logits[0] = nan;
        if (trial == 4) logits.assign(vocab, -inf);
        if (trial == 5) logits.assign(vocab, 0.0f), logits[vocab / 2] = -0.0f;
        if (trial == 6) logits[vocab - 1] = 100.0f;  // the maximum in the tail
        EXPECT_EQ(cpu::argmax(logits.data(), vocab), scalar_argmax(logits)) << "vocab " << vocab << " trial " << trial;
      }
    }
  }
}

// A gated activation kernel, forward(out, gate, up, count), on each
// instruction set of `isas`: against expected(g) * up in double precision within
// tolerance(g, expected) for gates of `scale`, the first two set to `low`
// and `high` (exp overflows at one), and in place (out aliases gate) with
// the same bits.
template <class Forward, class Expected, class Tolerance>
void check_gated_activation(const std::vector<MatmulIsa>& isas, uint64_t seed, std::initializer_list<long> counts, float scale,
                            float low, float high, Forward forward, Expected expected_of, Tolerance tolerance_of) {
  Rng rng(seed);
  for (MatmulIsa isa : isas) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (long count : counts) {
      std::vector<float> gate = random_values(rng, count, scale), up = random_values(rng, count, 2.0f);
      gate[0] = low;
      if (count > 1) gate[1] = high;
      std::vector<float> out(count, std::nanf(""));
      forward(out.data(), gate.data(), up.data(), count);
      for (long i = 0; i < count; ++i) {
        const double g = gate[i], expected = expected_of(g) * up[i];
        EXPECT_NEAR(out[i], expected, tolerance_of(g, expected)) << "count " << count << " at " << i;
      }
      std::vector<float> in_place = gate;
      forward(in_place.data(), in_place.data(), up.data(), count);
      EXPECT_EQ(in_place, out);
    }
  }
}

TEST_F(ElementwiseTest, SwigluMatchesDoubleReference) {
  // exp(100) overflows: silu(-100) -> -0
  check_gated_activation(
      supported(), 32, {1L, 5L, 16L, 37L, 1408L * 3}, 12.0f, -100.0f, 95.0f, cpu::swiglu_forward,
      [](double g) { return g / (1.0 + std::exp(-g)); },
      [](double, double expected) { return 1e-6 * std::fabs(expected) + 1e-30; });
}

TEST_F(ElementwiseTest, GeluTanhGateMatchesDoubleReference) {
  auto u = [](double g) { return 0.7978845608028654 * (g + 0.044715 * g * g * g); };
  // exp overflows at gate -30: gelu -> -0
  check_gated_activation(
      supported(), 34, {1L, 5L, 16L, 37L, 512L * 7}, 6.0f, -30.0f, 30.0f, cpu::gelu_tanh_gate_forward,
      [&](double g) { return 0.5 * g * (1.0 + std::tanh(u(g))); },
      // exp's ~2e-7, plus the float argument 2u's rounding (relative 2^-23 of it) carried into exp(-2u).
      [&](double g, double expected) { return 4e-7 * (1.0 + 2.0 * std::fabs(u(g))) * std::fabs(expected) + 1e-30; });
}

TEST_F(ElementwiseTest, RmsnormMatchesDoubleReference) {
  Rng rng(33);
  const float eps = 1e-6f;
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (int dim : {1, 3, 8, 31, 64, 65, 384, 389})
      for (int rows : {1, 3}) {
        const std::vector<float> x = random_values(rng, size_t(rows) * dim, 3.0f),
                                 weight = random_values(rng, dim, 2.0f);
        std::vector<float> out(x.size(), std::nanf(""));
        cpu::rmsnorm_forward(out.data(), x.data(), weight.data(), rows, dim, eps);
        for (int r = 0; r < rows; ++r) {
          double squares = 0.0;
          for (int i = 0; i < dim; ++i) squares += double(x[size_t(r) * dim + i]) * x[size_t(r) * dim + i];
          const double scale = 1.0 / std::sqrt(squares / dim + eps);
          for (int i = 0; i < dim; ++i) {
            const double expected = x[size_t(r) * dim + i] * scale * weight[i];
            EXPECT_NEAR(out[size_t(r) * dim + i], expected, 3e-7 * std::fabs(expected) + 1e-30)
                << "dim " << dim << " row " << r << " at " << i;
          }
        }
        // In place, as the transformer's q/k norms call it.
        std::vector<float> in_place = x;
        cpu::rmsnorm_forward(in_place.data(), in_place.data(), weight.data(), rows, dim, eps);
        EXPECT_EQ(in_place, out);
      }
  }
}

}  // namespace
}  // namespace dspark
