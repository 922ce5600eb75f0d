// The CPU causal attention over a KV cache (cpu::attention_forward):
//  - against a plain double-precision softmax attention, on grouped-query
//    shapes whose head_dim is and is not a multiple of each vector width, over
//    contexts that are and are not whole vectors and tiles, under every
//    instruction set the CPU supports;
//  - its invariance, which lossless speculative decoding relies on: row r of a
//    k-row call (a verify block) has exactly the bits of a 1-row call for that
//    token (a decode step) over the same cache, and neither depends on the
//    number of threads the work is spread over.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/random.h"
#include "gradient_check.h"
#include "isa_test.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"

namespace dspark {
namespace {

using cpu::MatmulIsa;
using testing::random_values;

struct Shape {
  int heads, kv_heads, head_dim;
};

// A cache of `positions` tokens and `rows` queries, the last of which is at
// position positions - 1. Scores of spread ~`sharpness` (so the softmax is
// neither uniform nor one-hot).
struct Case {
  Shape shape;
  int rows, first_position;
  std::vector<float> q, keys, values;
  bool bidirectional = false;  // every row sees all first_position + rows positions
};

Case make_case(Rng& rng, Shape shape, int rows, int first_position, float sharpness) {
  const int positions = first_position + rows;
  const size_t kv = size_t(positions) * shape.kv_heads * shape.head_dim;
  // q . k / sqrt(hd) with entries uniform in [-a, a] has spread a^2 / 3.
  const float amplitude = std::sqrt(3.0f * sharpness);
  return Case{shape,
              rows,
              first_position,
              random_values(rng, size_t(rows) * shape.heads * shape.head_dim, amplitude),
              random_values(rng, kv, amplitude),
              random_values(rng, kv, 1.0f)};
}

// Runs attention_forward for rows [row, row + count) of `c` (their queries,
// attending to positions up to first_position + row + count - 1 of the same
// cache) into NaN-filled output, so an element left unwritten fails.
std::vector<float> run(const Case& c, int row, int count) {
  const Shape s = c.shape;
  const long q_size = long(s.heads) * s.head_dim;
  std::vector<float> out(size_t(count) * q_size, std::nanf(""));
  std::vector<float> scores(size_t(c.first_position + row + count));
  cpu::attention_forward(out.data(), c.q.data() + row * q_size, c.keys.data(), c.values.data(), count,
                         c.first_position + row, s.heads, s.kv_heads, s.head_dim, scores.data());
  return out;
}

// Compares with softmax attention in double precision. The bound on each
// element scales with Σ_t p_t |v_t| (f32 rounding of the weighted sum in any
// order) plus the f32 error of the weights themselves (a few ulp of each
// score, scaled by the score's size): dropping a position or using another
// row's mask moves the result by ~p_t |v_t| >> 1e-5 of that.
void expect_matches_reference(const Case& c, const std::vector<float>& result, const char* what) {
  const Shape s = c.shape;
  const int group = s.heads / s.kv_heads;
  const double scale = 1.0 / std::sqrt(double(s.head_dim));
  int reported = 0;
  for (int r = 0; r < c.rows; ++r)
    for (int h = 0; h < s.heads; ++h) {
      const int visible = c.bidirectional ? c.first_position + c.rows : c.first_position + r + 1;
      const int kv_head = h / group;
      const float* query = c.q.data() + (long(r) * s.heads + h) * s.head_dim;
      std::vector<double> weights(visible);
      double maximum = -INFINITY, largest_score = 0.0;
      for (int t = 0; t < visible; ++t) {
        const float* key = c.keys.data() + (long(t) * s.kv_heads + kv_head) * s.head_dim;
        double dot = 0.0;
        for (int d = 0; d < s.head_dim; ++d) dot += double(query[d]) * key[d];
        weights[t] = dot * scale;
        maximum = std::max(maximum, weights[t]);
        largest_score = std::max(largest_score, std::fabs(weights[t]));
      }
      double total = 0.0;
      for (double& w : weights) total += (w = std::exp(w - maximum));
      for (int d = 0; d < s.head_dim; ++d) {
        double sum = 0.0, magnitude = 0.0;
        for (int t = 0; t < visible; ++t) {
          const double v = c.values[(long(t) * s.kv_heads + kv_head) * s.head_dim + d];
          sum += weights[t] * v;
          magnitude += weights[t] * std::fabs(v);
        }
        sum /= total, magnitude /= total;
        const double got = result[(long(r) * s.heads + h) * s.head_dim + d];
        const double bound = 1e-5 * magnitude * (1.0 + largest_score);
        if (!(std::fabs(got - sum) <= bound) && reported++ < 3)
          ADD_FAILURE() << what << ": heads " << s.heads << "/" << s.kv_heads << " head_dim " << s.head_dim << " rows "
                        << c.rows << " from position " << c.first_position << " at [" << r << ", " << h << ", " << d
                        << "]: " << got << ", reference " << sum << " (bound " << bound << ")";
      }
    }
}

using AttentionTest = testing::IsaTest;  // restores the instruction set and thread count

// The demo target's shape (6 query heads on 2 KV heads of 64), multi-head
// without grouping, head_dims that only narrower vectors (or none) divide,
// and one wider than the score tiles' registers.
const Shape kShapes[] = {{6, 2, 64}, {4, 4, 16}, {2, 1, 4}, {3, 1, 12}, {4, 2, 7}, {8, 2, 128}};

TEST_F(AttentionTest, MatchesDoubleReference) {
  Rng rng(21);
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (const Shape& shape : kShapes)
      for (int first_position : {0, 1, 37, 300})
        for (int rows : {1, 3, 8, 17}) {
          const Case c = make_case(rng, shape, rows, first_position, 1.0f);
          expect_matches_reference(c, run(c, 0, rows), "attention_forward");
        }
    // Sharp softmaxes: scores tens apart, so most weights underflow in f32.
    for (int rows : {1, 5}) {
      const Case c = make_case(rng, {6, 2, 64}, rows, 90, 30.0f);
      expect_matches_reference(c, run(c, 0, rows), "attention_forward, sharp");
    }
  }
}

// The drafter's unmasked attention (heads == kv_heads, every row sees every
// key, the block's own included).
TEST_F(AttentionTest, BidirectionalMatchesDoubleReference) {
  Rng rng(23);
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (const Shape& shape : {Shape{4, 4, 64}, Shape{2, 2, 4}, Shape{3, 3, 7}})
      for (int context : {0, 9, 200})
        for (int rows : {1, 7, 16}) {
          Case c = make_case(rng, shape, rows, context, 1.0f);
          c.bidirectional = true;
          const int kv_rows = context + rows;
          std::vector<float> out(size_t(rows) * shape.heads * shape.head_dim, std::nanf(""));
          std::vector<float> scores(kv_rows);
          cpu::bidirectional_attention_forward(out.data(), c.q.data(), c.keys.data(), c.values.data(), rows, kv_rows,
                                               shape.heads, shape.head_dim, scores.data());
          expect_matches_reference(c, out, "bidirectional_attention_forward");
          // The keys and values in two pieces, [0, context) and the block's
          // own rows, copied apart: the same bits.
          const long row_floats = long(shape.kv_heads) * shape.head_dim;
          const std::vector<float> block_keys(c.keys.begin() + context * row_floats, c.keys.end()),
              block_values(c.values.begin() + context * row_floats, c.values.end());
          std::vector<float> pieces(out.size(), std::nanf(""));
          cpu::bidirectional_attention_forward(pieces.data(), c.q.data(), context ? c.keys.data() : nullptr,
                                               context ? c.values.data() : nullptr, context, block_keys.data(),
                                               block_values.data(), rows, rows, shape.heads, shape.head_dim);
          ASSERT_EQ(std::memcmp(pieces.data(), out.data(), out.size() * sizeof(float)), 0)
              << "context " << context << ", rows " << rows << ": two pieces differ from one";
        }
  }
}

// A verify block of k rows against k decode steps over the same cache, each
// side on one thread and on all of them, bit for bit.
TEST_F(AttentionTest, RowsAreBitIdenticalToSingleRowCalls) {
  Rng rng(22);
  const int all_threads = cpu::parallel_threads();
  for (MatmulIsa isa : supported()) {
    cpu::set_matmul_isa(isa);
    SCOPED_TRACE(cpu::matmul_isa_name(isa));
    for (const Shape& shape : {Shape{6, 2, 64}, Shape{4, 1, 12}, Shape{4, 2, 7}})
      for (int first_position : {0, 5, 130, 700})
        for (int k : {2, 3, 5, 8, 16, 33}) {
          const Case c = make_case(rng, shape, k, first_position, 2.0f);
          const long q_size = long(shape.heads) * shape.head_dim;
          for (int block_threads : {1, all_threads}) {
            cpu::set_parallel_threads(block_threads);
            const std::vector<float> block = run(c, 0, k);
            cpu::set_parallel_threads(block_threads == 1 ? all_threads : 1);
            for (int r = 0; r < k; ++r) {
              const std::vector<float> single = run(c, r, 1);
              ASSERT_EQ(std::memcmp(single.data(), block.data() + r * q_size, q_size * sizeof(float)), 0)
                  << "heads " << shape.heads << "/" << shape.kv_heads << " head_dim " << shape.head_dim << ": row " << r
                  << " of " << k << " from position " << first_position << " (" << block_threads
                  << " threads for the block) differs from its 1-row call";
            }
            // And a split of the block in two calls (a partially accepted draft, re-verified).
            const int split = k / 2;
            const std::vector<float> tail = run(c, split, k - split);
            ASSERT_EQ(std::memcmp(tail.data(), block.data() + split * q_size, tail.size() * sizeof(float)), 0)
                << "rows " << split << ".." << k - 1 << " as their own call differ";
          }
        }
  }
}

}  // namespace
}  // namespace dspark
