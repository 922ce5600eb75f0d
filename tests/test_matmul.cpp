// The CPU matmul forwards against a plain double-precision reference, on odd
// shapes: every row count the small-row kernel's tiles split differently
// (1-17, and either side of the dispatch limit), in/out features that are not
// multiples of any vector width or tile, with and without bias, under every
// instruction set this CPU supports, and from two threads at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/random.h"
#include "gradient_check.h"
#include "isa_test.h"
#include "kernels/cpu/matmul.h"

namespace dspark {
namespace {

using cpu::MatmulIsa;
using testing::random_values;

enum class Layout { OutIn, InOut };  // weight [out, in] (matmul_forward) or [in, out]

struct Case {
  int rows, in, out;
  std::vector<float> x, weight, bias;  // bias empty: none
};

Case make_case(Rng& rng, int rows, int in, int out, bool with_bias) {
  Case c{rows, in, out, random_values(rng, size_t(rows) * in, 1.0f), random_values(rng, size_t(in) * out, 1.0f), {}};
  if (with_bias) c.bias = random_values(rng, out, 1.0f);
  return c;
}

// Compares `result` element by element with the double-precision product. The
// allowed error scales with Σ|x_i w_i| (f32 rounding of the partial sums in any
// order); dropping or repeating one term is ~1/in of that, far above the bound.
void expect_matches_reference(const Case& c, Layout layout, const std::vector<float>& result, const char* what) {
  ASSERT_EQ(result.size(), size_t(c.rows) * c.out);
  int reported = 0;
  for (int r = 0; r < c.rows; ++r)
    for (int o = 0; o < c.out; ++o) {
      double sum = c.bias.empty() ? 0.0 : c.bias[o], magnitude = std::fabs(sum);
      for (int i = 0; i < c.in; ++i) {
        const double w = layout == Layout::OutIn ? c.weight[size_t(o) * c.in + i] : c.weight[size_t(i) * c.out + o];
        const double term = double(c.x[size_t(r) * c.in + i]) * w;
        sum += term;
        magnitude += std::fabs(term);
      }
      const double got = result[size_t(r) * c.out + o];
      const bool close = std::fabs(got - sum) <= 1e-5 * magnitude + 1e-30;
      if (!close && reported++ < 3)
        ADD_FAILURE() << what << ": rows " << c.rows << " in " << c.in << " out " << c.out
                      << (c.bias.empty() ? "" : " +bias") << " at [" << r << ", " << o << "]: " << got << ", reference "
                      << sum;
    }
}

// Runs one of the forwards on `c` into a buffer pre-filled with NaN (so an
// element left unwritten fails).
using Forward = void (*)(float* out, const Case& c);

std::vector<float> run(Forward forward, const Case& c) {
  std::vector<float> result(size_t(c.rows) * c.out, std::nanf(""));
  forward(result.data(), c);
  return result;
}

void small_rows_out_in(float* out, const Case& c) {
  cpu::matmul_forward_small_rows(out, c.x.data(), c.weight.data(), c.bias.empty() ? nullptr : c.bias.data(), c.rows,
                                 c.in, c.out);
}
void small_rows_in_out(float* out, const Case& c) {
  cpu::matmul_in_out_forward_small_rows(out, c.x.data(), c.weight.data(), c.rows, c.in, c.out);
}
void dispatch_out_in(float* out, const Case& c) {
  cpu::matmul_forward(out, c.x.data(), c.weight.data(), c.bias.empty() ? nullptr : c.bias.data(), c.rows, c.in, c.out);
}
void dispatch_in_out(float* out, const Case& c) {
  cpu::matmul_in_out_forward(out, c.x.data(), c.weight.data(), c.rows, c.in, c.out);
}

using MatmulTest = testing::IsaTest;  // restores the instruction set and thread count

// in/out: below, at and just past the vector widths (4, 8, 16) and tile sizes;
// 389 x 203 is large enough to be split over the pool's threads.
const int kIns[] = {1, 7, 16, 17, 45, 389};
const int kOuts[] = {1, 5, 16, 23, 70, 203};

TEST_F(MatmulTest, SmallRowsMatchReferenceOnOddShapes) {
  Rng rng(11);
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (int rows = 1; rows <= 17; ++rows)
      for (int in : kIns)
        for (int out : kOuts) {
          const Case with_bias = make_case(rng, rows, in, out, true);
          expect_matches_reference(with_bias, Layout::OutIn, run(small_rows_out_in, with_bias), "small-row [out, in]");
          const Case plain = make_case(rng, rows, in, out, false);
          expect_matches_reference(plain, Layout::OutIn, run(small_rows_out_in, plain), "small-row [out, in]");
          expect_matches_reference(plain, Layout::InOut, run(small_rows_in_out, plain), "small-row [in, out]");
        }
  }
}

// The model's own shapes (hidden 384, intermediate 1408) and a row count the
// tiles split unevenly, on every instruction set.
TEST_F(MatmulTest, SmallRowsMatchReferenceOnModelShapes) {
  Rng rng(12);
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (const auto& [in, out] : {std::pair{384, 1408}, std::pair{1408, 384}, std::pair{1536, 256}})
      for (int rows : {1, 9, 16}) {
        const Case c = make_case(rng, rows, in, out, rows == 9);
        expect_matches_reference(c, Layout::OutIn, run(small_rows_out_in, c), "small-row [out, in]");
        Case unbiased = c;  // the [in, out] forward has no bias
        unbiased.bias.clear();
        expect_matches_reference(unbiased, Layout::InOut, run(small_rows_in_out, unbiased), "small-row [in, out]");
      }
  }
}

// Either side of the row count where the forwards switch to OpenBLAS.
TEST_F(MatmulTest, DispatchMatchesReferenceAroundTheRowLimit) {
  Rng rng(13);
  for (int rows : {1, 2, cpu::kSmallRowsMax - 1, cpu::kSmallRowsMax, cpu::kSmallRowsMax + 1, 2 * cpu::kSmallRowsMax})
    for (const auto& [in, out] : {std::pair{45, 70}, std::pair{389, 203}}) {
      const Case with_bias = make_case(rng, rows, in, out, true);
      expect_matches_reference(with_bias, Layout::OutIn, run(dispatch_out_in, with_bias), "matmul_forward");
      const Case plain = make_case(rng, rows, in, out, false);
      expect_matches_reference(plain, Layout::InOut, run(dispatch_in_out, plain), "matmul_in_out_forward");
    }
}

// A bf16 weight read as bf16 bits (half the bytes), in pack_bf16_rows' panels
// ([out, in]) or pack_bf16_columns' (the same panels from [in, out]): each
// output is the f32 sum of the products in the order of `in`, an FMA per
// input, then the bias, bit for bit on every instruction set with FMA (the
// baseline's separate multiply and add: within rounding). With bf16 products
// the activations are rounded to bf16 first, every product is exact, and the
// bits are the same on every instruction set (AVX-512 BF16: its dot-product
// instruction), for any row count (the 65 rows sgemm would take for an f32
// weight included). Odd and even `in`, features that fill no panel, one panel,
// and several; row counts the tiles split differently. exact_bf16 and the
// packing take a weight apart only when it is bf16.
TEST_F(MatmulTest, Bf16WeightsSumTheirProductsInOrder) {
  Rng rng(15);
  auto bf16_case = [&](int rows, int in, int out, bool with_bias) {
    Case c = make_case(rng, rows, in, out, with_bias);
    for (float& w : c.weight) w = bf16_to_f32(f32_to_bf16(w));
    return c;
  };
  auto sequential_sums = [](const Case& c, const std::vector<float>& x) {  // [out, in] weight
    std::vector<float> out(size_t(c.rows) * c.out);
    for (int r = 0; r < c.rows; ++r)
      for (int o = 0; o < c.out; ++o) {
        float sum = 0.0f;
        for (int i = 0; i < c.in; ++i) sum = std::fma(x[size_t(r) * c.in + i], c.weight[size_t(o) * c.in + i], sum);
        out[size_t(r) * c.out + o] = c.bias.empty() ? sum : sum + c.bias[o];
      }
    return out;
  };
  for (bool bf16_products : {false, true})
    for (MatmulIsa isa : supported()) {
      cpu::set_bf16_products(bf16_products);
      cpu::set_matmul_isa(isa);
      SCOPED_TRACE(std::string(cpu::matmul_isa_name(isa)) + (bf16_products ? ", bf16 products" : ""));
      for (int rows : {1, 2, 3, 4, 5, 8, 9, 16, 17, cpu::kSmallRowsMax + 1})
        for (const auto& [in, out] : {std::pair{7, 5}, std::pair{17, 23}, std::pair{45, 70}, std::pair{48, 9},
                                      std::pair{384, 16}, std::pair{384, 37}, std::pair{389, 203}})
          for (bool with_bias : {false, true}) {
            const Case c = bf16_case(rows, in, out, with_bias);
            const std::vector<uint16_t> panels = cpu::pack_bf16_rows(c.weight.data(), out, in);
            ASSERT_EQ(panels.size(), size_t((out + 15) / 16 * 16) * ((in + 1) / 2 * 2));
            const float* bias = c.bias.empty() ? nullptr : c.bias.data();
            Case multiplied = c;  // what is multiplied: x, rounded with bf16 products
            if (bf16_products)
              for (float& value : multiplied.x) value = bf16_to_f32(f32_to_bf16(value));
            const std::vector<float> expected = sequential_sums(multiplied, multiplied.x);
            std::vector<float> got(expected.size(), std::nanf(""));
            cpu::matmul_forward(got.data(), c.x.data(), c.weight.data(), panels.data(), bias, rows, in, out);
            const std::string where =
                "rows " + std::to_string(rows) + " in " + std::to_string(in) + " out " + std::to_string(out);
            // AMX sums a tile's 32 inputs in an order of its own (in a multiple of 32).
            const bool amx = bf16_products && isa == MatmulIsa::Amx && in % 32 == 0;
            const bool exact = (bf16_products || isa != MatmulIsa::Baseline) && !amx;
            if (exact)
              EXPECT_EQ(got, expected) << "[out, in] " << where;
            else
              expect_matches_reference(multiplied, Layout::OutIn, got, "[out, in] baseline");
            if (with_bias) continue;  // [in, out] has no bias
            // The same weight stored transposed, [in, out].
            std::vector<float> transposed(c.weight.size());
            for (int o = 0; o < out; ++o)
              for (int i = 0; i < in; ++i) transposed[size_t(i) * out + o] = c.weight[size_t(o) * in + i];
            const std::vector<uint16_t> column_panels = cpu::pack_bf16_columns(transposed.data(), in, out);
            EXPECT_EQ(column_panels, panels);
            std::vector<float> from_columns(got.size(), std::nanf(""));
            cpu::matmul_in_out_forward(from_columns.data(), c.x.data(), transposed.data(), column_panels.data(), rows,
                                       in, out);
            EXPECT_EQ(from_columns, got) << "[in, out] " << where;
          }
    }
  std::vector<float> not_bf16 = {1.0f, 1.0f + 1.0f / 1024.0f / 1024.0f};  // the second needs more than 8 bits
  EXPECT_TRUE(exact_bf16(not_bf16.data(), 2).empty());
  EXPECT_EQ(exact_bf16(not_bf16.data(), 1), std::vector<uint16_t>{0x3f80});
  EXPECT_TRUE(cpu::pack_bf16_rows(not_bf16.data(), 1, 2).empty());
  // The panels' layout itself, for 17 features of 3 inputs: weight[f, i] = 4 f + i (exact in bf16).
  std::vector<float> ramp(17 * 3);
  for (int f = 0; f < 17; ++f)
    for (int i = 0; i < 3; ++i) ramp[f * 3 + i] = float(4 * f + i);
  const std::vector<uint16_t> packed = cpu::pack_bf16_rows(ramp.data(), 17, 3);
  ASSERT_EQ(packed.size(), size_t(2 * 2 * 16 * 2));  // 2 panels x 2 pairs x 16 words of two halves
  auto word = [&](int panel, int pair, int lane) { return 2 * ((panel * 2 + pair) * 16 + lane); };
  EXPECT_EQ(packed[word(0, 0, 0) + 1], f32_to_bf16(0.0f));   // feature 0, input 0: the high half
  EXPECT_EQ(packed[word(0, 0, 0)], f32_to_bf16(1.0f));       // input 1: the low half
  EXPECT_EQ(packed[word(0, 1, 5) + 1], f32_to_bf16(22.0f));  // feature 5, input 2
  EXPECT_EQ(packed[word(0, 1, 5)], 0);                       // no input 3
  EXPECT_EQ(packed[word(1, 0, 0) + 1], f32_to_bf16(64.0f));  // feature 16 opens the second panel
  EXPECT_EQ(packed[word(1, 0, 1) + 1], 0);                   // no feature 17
}

// Both ways (f32 activations, and bf16 products) against the double-precision
// reference on what is multiplied, and a row gives the same bits alone as
// among 64, so that a verify row equals the same token decoded alone (in =
// 384: a multiple of 32, which AMX runs, in tiles of 16 rows).
TEST_F(MatmulTest, Bf16WeightsMatchTheReferenceAndDoNotDependOnTheRowCount) {
  Rng rng(16);
  for (bool bf16_products : {false, true})
    for (MatmulIsa isa : supported())
      for (int in : {389, 384}) {
        cpu::set_bf16_products(bf16_products);
        cpu::set_matmul_isa(isa);
        SCOPED_TRACE(std::string(cpu::matmul_isa_name(isa)) + (bf16_products ? ", bf16 products" : "") + ", in " +
                     std::to_string(in));
        Case c = make_case(rng, cpu::kSmallRowsMax, in, 203, true);
        for (float& w : c.weight) w = bf16_to_f32(f32_to_bf16(w));
        const std::vector<uint16_t> panels = cpu::pack_bf16_rows(c.weight.data(), c.out, c.in);
        std::vector<float> all(size_t(c.rows) * c.out, std::nanf(""));
        cpu::matmul_forward(all.data(), c.x.data(), c.weight.data(), panels.data(), c.bias.data(), c.rows, c.in, c.out);
        Case multiplied = c;
        if (bf16_products)
          for (float& value : multiplied.x) value = bf16_to_f32(f32_to_bf16(value));
        expect_matches_reference(multiplied, Layout::OutIn, all, "bf16 matmul_forward");
        for (int row : {0, 7, cpu::kSmallRowsMax - 1}) {
          std::vector<float> alone(c.out, std::nanf(""));
          cpu::matmul_forward(alone.data(), c.x.data() + size_t(row) * c.in, c.weight.data(), panels.data(),
                              c.bias.data(), 1, c.in, c.out);
          EXPECT_TRUE(std::equal(alone.begin(), alone.end(), all.begin() + size_t(row) * c.out)) << "row " << row;
        }
      }
}

TEST_F(MatmulTest, ZeroRowsWriteNothing) {
  std::vector<float> out(4, 7.0f), x(4, 1.0f), weight(16, 1.0f);
  cpu::matmul_forward_small_rows(out.data(), x.data(), weight.data(), nullptr, 0, 4, 4);
  cpu::matmul_in_out_forward_small_rows(out.data(), x.data(), weight.data(), 0, 4, 4);
  for (float value : out) EXPECT_EQ(value, 7.0f);
}

// Two threads multiplying at once: one gets the pool, the other runs alone;
// both results must be whole and right.
TEST_F(MatmulTest, ConcurrentCallersBothGetCorrectResults) {
  Rng rng(14);
  const Case first = make_case(rng, 8, 389, 203, true), second = make_case(rng, 5, 389, 203, false);
  std::vector<std::vector<float>> results(2);
  auto repeat = [](const Case& c, Forward forward, std::vector<float>& result) {
    for (int i = 0; i < 200; ++i) {
      std::vector<float> once = run(forward, c);
      if (i == 0)
        result = once;
      else if (once != result)
        result.assign(result.size(), std::nanf(""));  // must not vary between calls
    }
  };
  std::thread a(repeat, std::cref(first), small_rows_out_in, std::ref(results[0]));
  std::thread b(repeat, std::cref(second), small_rows_in_out, std::ref(results[1]));
  a.join();
  b.join();
  expect_matches_reference(first, Layout::OutIn, results[0], "thread 1");
  expect_matches_reference(second, Layout::InOut, results[1], "thread 2");
}

}  // namespace
}  // namespace dspark
