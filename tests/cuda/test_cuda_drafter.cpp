// The CUDA drafter against the CPU drafter: each new op on random inputs
// (same names as the CPU ops, hand-written references where the CPU has no
// op of its own), then whole draft steps on the golden qwen3 target for the
// Markov, RNN and GRU heads: logits and confidences within bf16 tolerance of
// the CPU's (teacher-forced on the GPU's own tokens, so a near-tie flipped by
// bf16 cannot derail the comparison), greedy tokens equal wherever the CPU's
// top-2 gap is clear, ragged contexts, pruning, retained context == recompute,
// graph replays, sampling streams, and lossless speculative decoding with the
// GPU drafter. Runs on a GPU machine: tests/tools/run_cuda_checks.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>

#include "core/dtype.h"
#include "device_test_util.h"
#include "golden.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/draft.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/quantized_product.h"
#include "model/cpu_target.h"
#include "model/cuda_target.h"
#include "model/generate.h"
#include "model/kv_cache.h"
#include "model/target.h"
#include "model/transformer.h"
#include "random_drafter.h"
#include "spec/cuda_drafter.h"
#include "spec/cuda_dspark_source.h"
#include "spec/draft.h"
#include "spec/draft_sources.h"
#include "spec/quantized_columns.h"
#include "spec/scheduler.h"
#include "spec/speculative.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using testing::bf16_rounded;
using testing::from_device;
using testing::golden_model;
using testing::kBf16Tolerance;
using testing::random_values;
using testing::relative_error;
using testing::to_device;
using testing::to_device_bf16;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Device pointers as the uint64 words a pointer array holds.
template <class T>
uint64_t address(const T* pointer) {
  return reinterpret_cast<uint64_t>(pointer);
}

// ---------------------------------------------------------------- ops

TEST(CudaDraftOps, GeluTanhGateMatchesCpu) {
  const int rows = 3, F = 300;
  const auto gate_up = bf16_rounded(random_values(rows * 2 * F, 60, 3.0f));
  std::vector<float> expected(rows * F);
  for (int r = 0; r < rows; ++r)
    cpu::gelu_tanh_gate_forward(expected.data() + r * F, gate_up.data() + r * 2 * F, gate_up.data() + r * 2 * F + F, F);
  auto input = to_device_bf16(gate_up);
  DeviceBuffer<bf16> out(rows * F);
  cuda::gelu_tanh_gate_forward(out.data(), input.data(), rows, F, nullptr);
  EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance);
}

template <class Weight>
void check_matmul_in_out(bool bf16_weight) {
  for (int rows : {1, 3, 8, 13}) {
    for (int out_features : {1088, 1006, 24}) {  // 16-byte weight loads, element loads, one partial block
      const int in = 40;
      const auto x = random_values(rows * in, 63);
      auto weight = random_values(size_t(in) * out_features, 64);
      if (bf16_weight) weight = bf16_rounded(weight);
      const auto bias = random_values(out_features, 65), initial = random_values(size_t(rows) * out_features, 66);
      std::vector<float> product(size_t(rows) * out_features);
      cpu::matmul_in_out_forward(product.data(), x.data(), weight.data(), rows, in, out_features);
      auto x_device = to_device(x), bias_device = to_device(bias);
      DeviceBuffer<Weight> weight_device;
      if constexpr (std::is_same_v<Weight, float>)
        weight_device = to_device(weight);
      else
        weight_device = to_device_bf16(weight);
      for (bool accumulate : {false, true}) {
        std::vector<float> expected(product);
        for (int r = 0; r < rows; ++r)
          for (int o = 0; o < out_features; ++o)
            expected[size_t(r) * out_features + o] +=
                bias[o] + (accumulate ? initial[size_t(r) * out_features + o] : 0);
        auto out = to_device(initial);
        cuda::matmul_in_out_forward(out.data(), x_device.data(), weight_device.data(), bias_device.data(), rows, in,
                                    out_features, accumulate, nullptr, nullptr);
        EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), 1e-5)
            << rows << " x " << out_features << (accumulate ? " accumulated" : "");
      }
      // A zero run_if flag: nothing is written.
      auto out = to_device(initial);
      auto flag = to_device(std::vector<int32_t>{0});
      cuda::matmul_in_out_forward(out.data(), x_device.data(), weight_device.data(), nullptr, rows, in, out_features,
                                  false, flag.data(), nullptr);
      EXPECT_EQ(from_device(out), initial);
    }
  }
}

TEST(CudaDraftOps, MatmulInOutMatchesCpu) {
  check_matmul_in_out<bf16>(true);
  check_matmul_in_out<float>(false);
}

TEST(CudaDraftOps, MatmulInOutArgmaxFindsTheFirstLargest) {
  for (int rows : {1, 3, 8, 13}) {
    for (int out_features : {1088, 1006}) {
      const int in = 24;
      const auto x = random_values(rows * in, 67);
      auto weight = bf16_rounded(random_values(size_t(in) * out_features, 68));
      auto initial = random_values(size_t(rows) * out_features, 69);
      // Row 0: an exact tie for the maximum, in different blocks (the first index must win).
      for (int column : {700, 300}) {
        for (int i = 0; i < in; ++i) weight[size_t(i) * out_features + column] = 0.0f;
        initial[column] = 1e3f;
      }
      std::vector<float> expected(size_t(rows) * out_features);
      cpu::matmul_in_out_forward(expected.data(), x.data(), weight.data(), rows, in, out_features);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += initial[i];
      auto x_device = to_device(x), out = to_device(initial);
      auto weight_device = to_device_bf16(weight);
      auto keys = to_device(std::vector<unsigned long long>(rows, 0));
      DeviceBuffer<int32_t> tokens(rows + 1);
      auto no_key = to_device(std::vector<unsigned long long>{0});
      cuda::matmul_in_out_argmax_forward(out.data(), x_device.data(), weight_device.data(), nullptr, rows, in,
                                         out_features, true, keys.data(), nullptr, nullptr);
      cuda::argmax_tokens_forward(tokens.data(), keys.data(), rows, nullptr);
      cuda::argmax_tokens_forward(tokens.data() + rows, no_key.data(), 1, nullptr);
      const auto logits = from_device(out);
      EXPECT_LE(relative_error(logits.data(), expected.data(), expected.size()), 1e-5);
      const auto chosen = from_device(tokens);
      for (int r = 0; r < rows; ++r)  // the GPU's own logits decide (the CPU's sum may round a near-tie apart)
        EXPECT_EQ(chosen[r], cpu::argmax(logits.data() + size_t(r) * out_features, out_features)) << "row " << r;
      EXPECT_EQ(chosen[0], 300);
      EXPECT_EQ(chosen[rows], -1) << "a key never written";
    }
  }
}

TEST(CudaDraftOps, BidirectionalAttentionMatchesCpu) {
  // Ragged contexts (one empty), context rows k | v interleaved (stride 2d) as
  // the drafter stores them, block rows position-major in a q | k | v buffer.
  const std::vector<int> lengths = {0, 5, 70, 300};
  const int B = static_cast<int>(lengths.size());
  for (auto [heads, head_dim, gamma] : {std::tuple{4, 8, 7}, std::tuple{2, 64, 1}, std::tuple{8, 128, 7}}) {
    const int d = heads * head_dim;
    std::vector<std::vector<float>> contexts;  // [length, 2d] each
    std::vector<DeviceBuffer<bf16>> context_device;
    std::vector<uint64_t> key_pointers, value_pointers;
    for (int b = 0; b < B; ++b) {
      contexts.push_back(bf16_rounded(random_values(size_t(lengths[b]) * 2 * d, 70 + b)));
      context_device.push_back(to_device_bf16(contexts.back()));
      key_pointers.push_back(lengths[b] ? address(context_device.back().data()) : 0);
      value_pointers.push_back(lengths[b] ? address(context_device.back().data() + d) : 0);
    }
    const auto qkv = bf16_rounded(random_values(size_t(gamma) * B * 3 * d, 80, 2.0f));
    std::vector<float> expected(size_t(gamma) * B * d), scores(512);
    for (int b = 0; b < B; ++b) {
      const int total = lengths[b] + gamma;
      std::vector<float> q(size_t(gamma) * d), keys(size_t(total) * d), values(size_t(total) * d), out(q.size());
      for (int p = 0; p < lengths[b]; ++p) {
        std::copy_n(contexts[b].data() + size_t(p) * 2 * d, d, keys.data() + size_t(p) * d);
        std::copy_n(contexts[b].data() + size_t(p) * 2 * d + d, d, values.data() + size_t(p) * d);
      }
      for (int k = 0; k < gamma; ++k) {
        const float* row = qkv.data() + (size_t(k) * B + b) * 3 * d;
        std::copy_n(row, d, q.data() + size_t(k) * d);
        std::copy_n(row + d, d, keys.data() + size_t(lengths[b] + k) * d);
        std::copy_n(row + 2 * d, d, values.data() + size_t(lengths[b] + k) * d);
      }
      cpu::bidirectional_attention_forward(out.data(), q.data(), keys.data(), values.data(), gamma, total, heads,
                                           head_dim, scores.data());
      for (int k = 0; k < gamma; ++k)
        std::copy_n(out.data() + size_t(k) * d, d, expected.data() + (size_t(k) * B + b) * d);
    }
    auto qkv_device = to_device_bf16(qkv);
    auto keys_device = to_device(key_pointers), values_device = to_device(value_pointers);
    auto lengths_device = to_device(std::vector<int32_t>(lengths.begin(), lengths.end()));
    const cuda::DraftAttentionBatch batch{reinterpret_cast<const bf16* const*>(keys_device.data()),
                                          reinterpret_cast<const bf16* const*>(values_device.data()),
                                          lengths_device.data(), 2L * d, B};
    for (int splits : {1, 3, 16}) {
      DeviceBuffer<bf16> out(size_t(gamma) * B * d);
      DeviceBuffer<float> partial_out(size_t(B) * heads * splits * gamma * head_dim),
          partial_lse(size_t(B) * heads * splits * gamma);
      auto counters = to_device(std::vector<unsigned>(B * heads, 0u));
      for (int run = 0; run < 2; ++run) {  // the second run checks the merge left its tickets at zero
        cuda::bidirectional_attention_forward(out.data(), qkv_device.data(), qkv_device.data() + d,
                                              qkv_device.data() + 2 * d, 3L * d, batch, gamma, heads, head_dim, splits,
                                              partial_out.data(), partial_lse.data(), counters.data(), nullptr);
        EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance)
            << "head_dim " << head_dim << " splits " << splits << " run " << run;
      }
      EXPECT_EQ(from_device(counters), std::vector<unsigned>(B * heads, 0u));
    }
  }
}

TEST(CudaDraftOps, DraftBlockRows) {
  const int B = 3, gamma = 4, d = 40;
  const auto tokens = random_values(B * d, 90), mask = random_values((gamma - 1) * d, 91);
  const auto positions = random_values(gamma * d, 92);
  auto tokens_device = to_device(tokens), mask_device = to_device(mask), positions_device = to_device(positions);
  DeviceBuffer<float> block(gamma * B * d);
  cuda::draft_block_forward(block.data(), tokens_device.data(), mask_device.data(), positions_device.data(), B, gamma,
                            d, nullptr);
  const auto out = from_device(block);
  for (int k = 0; k < gamma; ++k)
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < d; ++i) {
        const float source = k == 0 ? tokens[b * d + i] : mask[(k - 1) * d + i];
        ASSERT_EQ(out[(k * B + b) * d + i], source + positions[k * d + i]) << k << " " << b << " " << i;
      }
}

TEST(CudaDraftOps, SequentialHeadPrepareConfidenceAndPruning) {
  // DESIGN §2 by hand: e_k = w1[x_{k-1}], c_k = σ(([h_k; e_k] @ conf.w + conf.b) / T_k);
  // a row stops at the first k >= 1 below its threshold or min_confidence, or at its limit.
  const int B = 4, gamma = 5, r = 8, d = 24, V = 50;
  const std::vector<int32_t> anchors = {3, 7, 11, 49}, limits = {5, 5, 2, 0};
  std::vector<int32_t> tokens(gamma * B);
  Rng rng(93);
  for (int32_t& token : tokens) token = int32_t(rng.next() % V);
  const auto w1 = bf16_rounded(random_values(V * r, 94, 2.0f)), hidden = random_values(gamma * B * d, 95);
  const auto confidence_weight = random_values(d + r, 96, 0.5f);
  const std::vector<float> bias = {0.3f}, temperatures = {1.0f, 2.0f, 0.5f, 1.0f, 1.5f};
  cuda::DraftControl control{};
  control.min_confidence = 0.2f;
  control.has_thresholds = 1;
  for (int k = 0; k < gamma; ++k) control.thresholds[k] = float(rng.uniform());

  for (auto kind : {cuda::SequentialHeadKind::Markov, cuda::SequentialHeadKind::Rnn, cuda::SequentialHeadKind::Gru}) {
    auto w1_device = to_device_bf16(w1);
    auto weight_device = to_device(confidence_weight), bias_device = to_device(bias);
    auto temperatures_device = to_device(temperatures), hidden_device = to_device(hidden);
    auto anchors_device = to_device(anchors), limits_device = to_device(limits), tokens_device = to_device(tokens);
    auto control_device = to_device(std::vector<cuda::DraftControl>{control});
    DeviceBuffer<float> e(B * r), confidence(gamma * B), z(B * (2 * r + d));
    auto state = to_device(random_values(B * r, 97));  // zeroed at position 0
    DeviceBuffer<int32_t> alive(B), count(B);
    auto alive_rows = to_device(std::vector<int32_t>(gamma, 0));
    const cuda::SequentialHeadWeights weights{w1_device.data(), weight_device.data(), bias_device.data(),
                                              temperatures_device.data()};
    // The Markov pass reads x_{k-1} from argmax keys (the greedy step), the others from tokens.
    std::vector<unsigned long long> keys(gamma * B);
    for (int i = 0; i < gamma * B; ++i) keys[i] = (0x80000000ull << 32) | (0xffffffffu - unsigned(tokens[i]));
    auto keys_device = to_device(keys);
    const bool from_keys = kind == cuda::SequentialHeadKind::Markov;
    const cuda::SequentialHeadState head{
        anchors_device.data(), limits_device.data(), tokens_device.data(), from_keys ? keys_device.data() : nullptr,
        confidence.data(),     alive.data(),         count.data(),         alive_rows.data()};
    std::vector<bool> alive_expected(B, true);
    std::vector<int32_t> count_expected(B, 0), alive_rows_expected(gamma, 0);
    for (int k = 0; k < gamma; ++k) {
      cuda::sequential_head_prepare_forward(e.data(), z.data(), state.data(), hidden_device.data(), k, B, r, d, V, kind,
                                            weights, control_device.data(), head, nullptr);
      const auto e_values = from_device(e), confidences = from_device(confidence), z_values = from_device(z);
      const auto state_values = from_device(state);
      for (int b = 0; b < B; ++b) {
        const int32_t previous = k == 0 ? anchors[b] : tokens[(k - 1) * B + b];
        const float* h = hidden.data() + (k * B + b) * d;
        float logit = bias[0];
        for (int i = 0; i < d; ++i) logit += h[i] * confidence_weight[i];
        for (int i = 0; i < r; ++i) {
          ASSERT_EQ(e_values[b * r + i], w1[previous * r + i]) << "e, position " << k << " row " << b;
          logit += w1[previous * r + i] * confidence_weight[d + i];
        }
        const float c = sigmoid(logit / temperatures[k]);
        EXPECT_NEAR(confidences[k * B + b], c, 1e-5) << "position " << k << " row " << b;
        const bool below = c < control.thresholds[k] || c < control.min_confidence;
        if (k >= limits[b] || (k >= 1 && below)) alive_expected[b] = false;
        if (alive_expected[b]) count_expected[b] = k + 1, ++alive_rows_expected[k];
        if (kind == cuda::SequentialHeadKind::Gru) {
          const float* row = z_values.data() + b * (2 * r + d);
          for (int i = 0; i < r; ++i) {
            if (k == 0) {
              EXPECT_EQ(row[i], 0.0f);  // s_{-1} = 0 (later: the state the update kernel leaves)
            }
            EXPECT_EQ(row[r + i], w1[previous * r + i]);
          }
          for (int i = 0; i < d; ++i) EXPECT_EQ(row[2 * r + i], h[i]);
        }
        if (kind != cuda::SequentialHeadKind::Markov && k == 0) {
          for (int i = 0; i < r; ++i) EXPECT_EQ(state_values[b * r + i], 0.0f);
        }
      }
    }
    EXPECT_EQ(from_device(count), count_expected);
    EXPECT_EQ(from_device(alive_rows), alive_rows_expected);
    EXPECT_EQ(count_expected[3], 0);  // the padding row (limit 0) drafts nothing
  }
}

enum class Floor { None, Between, Above };  // none; between row 0's confidences; above every confidence
enum class Head {
  Reference,
  PerPosition,
  OneLaunch,
  TokensOnly,
  TokensOnlyIntervals,
  TokensOneLaunch,
  TokensOneLaunchIntervals
};
bool tokens_head(Head kind) { return kind != Head::Reference && kind != Head::PerPosition && kind != Head::OneLaunch; }
bool intervals_head(Head kind) { return kind == Head::TokensOnlyIntervals || kind == Head::TokensOneLaunchIntervals; }
bool one_launch_tokens_head(Head kind) {
  return kind == Head::TokensOneLaunch || kind == Head::TokensOneLaunchIntervals;
}
struct MarkovCase {
  int B, r, V;
  Floor floor;
  float w2_scale = 1.0f;
  bool ties = false;
  int H = 0;  // > 0: U from an LM head [V, H] with weights uniform in +-lm_scale
  float lm_scale = 1.0f;
  int projected = 0;  // > 0 (D): the LM head's input is y = x @ P (x [γ, D], P [H, D] as the drafter's out_proj),
                      // and U's intervals come through M = lm_head @ P (quantized_product.h)
};

// The Markov head's kernels on `cases` (MarkovHeadKernelsEqualThePrepareAndProductKernels says what they check).
void check_markov_heads(const std::vector<MarkovCase>& cases) {
  const int gamma = 7, d = 40;
  DeviceBuffer<unsigned> barrier(2);  // zeroed once: every launch leaves it ready for the next
  CUDA_CHECK(cudaMemset(barrier.data(), 0, barrier.bytes()));
  DeviceBuffer<unsigned> meetings(1);  // the one-launch tokens head's barrier counter, zeroed before each launch
  EXPECT_FALSE(cuda::markov_head_supported(1, gamma, 256, 151936, nullptr)) << "Qwen3-8B's w2 does not fit on chip";
  if (cuda::multiprocessor_count() >= 132) {
    EXPECT_TRUE(cuda::markov_head_tokens_supported(256, 151936, 151936, 0)) << "Qwen3-8B's w2 fits at 8 bits";
    EXPECT_TRUE(cuda::markov_head_tokens_supported(256, 151936, 151936, 4096)) << "... with its LM head's scratch";
  }
  for (const MarkovCase& test : cases) {
    const int B = test.B, r = test.r, V = test.V;
    const std::string what = "B " + std::to_string(B) + " r " + std::to_string(r) + " V " + std::to_string(V);
    Rng rng(B * 131 + r);
    std::vector<int32_t> anchors(B), limits(B, gamma);
    for (int32_t& anchor : anchors) anchor = int32_t(rng.next() % V);
    if (B >= 3) limits[1] = 0, limits[2] = 3;  // a padding row; a row cut at 3
    if (B == 10) limits[8] = limits[9] = 0;    // a second row group of padding alone
    std::vector<int32_t> sampled(size_t(gamma) * B);  // the tokens a sampled head would have drawn
    for (int32_t& token : sampled) token = int32_t(rng.next() % V);
    const auto w1 = bf16_rounded(random_values(size_t(V) * r, 200 + B, 1.0f));
    auto w2 = bf16_rounded(random_values(size_t(r) * V, 300 + B, test.w2_scale));
    const auto hidden = random_values(size_t(gamma) * B * d, 400 + B);
    auto lm_logits = random_values(size_t(gamma) * B * V, 500 + B, 4.0f);
    if (test.ties) {  // every column (of w2 and U) repeats the first 7
      for (int v = 7; v < V; ++v) {
        for (int i = 0; i < r; ++i) w2[size_t(i) * V + v] = w2[size_t(i) * V + v % 7];
        for (int row = 0; row < gamma * B; ++row) lm_logits[size_t(row) * V + v] = lm_logits[size_t(row) * V + v % 7];
      }
    }
    // The LM head case: U = h @ lm_head (rows repeating every 7 for ties), and its intervals' inputs: the rows h
    // themselves, or (projected) x with h = x @ P.
    const int H = test.H, D = test.projected, width = D > 0 ? D : H;
    DeviceBuffer<bf16> lm_head(size_t(V) * H), lm_hidden = to_device_bf16(random_values(gamma * H, 800));
    DeviceBuffer<bf16> x_rows = to_device_bf16(random_values(size_t(gamma) * D, 810));
    DeviceBuffer<bf16> projection = to_device_bf16(random_values(size_t(H) * D, 820, 0.05f));
    DeviceBuffer<unsigned> largest_norm(1), reach_finished(1);
    DeviceBuffer<double> reach_sums(2 * cuda::kQuantizedActivationRows);
    CUDA_CHECK(cudaMemset(reach_finished.data(), 0, reach_finished.bytes()));
    CUDA_CHECK(cudaMemset(reach_sums.data(), 0, reach_sums.bytes()));
    DeviceBuffer<int8_t> lm_values(size_t(V) * width), activation_values(2 * cuda::kQuantizedActivationRows * width);
    DeviceBuffer<float> lm_scales(V), lm_bounds(V), lm_norms(V), activation_scales(cuda::kQuantizedActivationRows),
        activation_norms(3 * cuda::kQuantizedActivationRows);
    DeviceBuffer<float> centers(size_t(gamma) * V);
    DeviceBuffer<unsigned> lower_keys(gamma);
    const cuda::QuantizedRows lm_rows{lm_values.data(), lm_scales.data(), lm_bounds.data(), lm_norms.data()};
    const cuda::QuantizedActivations activations{activation_values.data(), activation_scales.data(),
                                                 activation_norms.data()};
    const cuda::LmHeadIntervals intervals{centers.data(),
                                          lm_bounds.data(),
                                          lm_norms.data(),
                                          activation_norms.data(),
                                          lm_head.data(),
                                          lm_hidden.data(),
                                          H,
                                          lower_keys.data(),
                                          barrier.data()};
    auto make_intervals = [&] {  // the centers [γ, V] and the activations' norms
      cuda::quantize_activation_rows_forward(activations, D > 0 ? x_rows.data() : lm_hidden.data(), gamma, width,
                                             nullptr);
      if (D > 0)
        cuda::lm_head_projection_reach_forward(activations, x_rows.data(), projection.data(), lm_hidden.data(), gamma,
                                               D, H, largest_norm.data(), reach_sums.data(), reach_finished.data(),
                                               nullptr);
      cuda::quantized_rows_product_forward(centers.data(), lm_rows, activations, gamma, width, V, nullptr);
    };
    if (H > 0) {
      std::vector<uint16_t> bits(size_t(V) * H);
      uint32_t state = 12345u + uint32_t(H);
      const size_t first_rows = size_t(7) * H;    // ties: every later row repeats one of these
      for (size_t i = 0; i < bits.size(); ++i) {  // xorshift32: uniform in +-lm_scale
        state ^= state << 13, state ^= state >> 17, state ^= state << 5;
        bits[i] = test.ties && i >= first_rows ? bits[i % first_rows]
                                               : f32_to_bf16(test.lm_scale * float(2.0 * (state / 4294967296.0) - 1.0));
      }
      CUDA_CHECK(cudaMemcpy(lm_head.data(), bits.data(), lm_head.bytes(), cudaMemcpyHostToDevice));
      if (D > 0)  // h = x @ P as the drafter's out_proj forms it
        cuda::matmul_forward(lm_hidden.data(), cuda::MatmulOutput::BF16, x_rows.data(), projection.data(), nullptr,
                             gamma, D, H, nullptr);
      DeviceBuffer<float> u(size_t(gamma) * V);
      cuda::matmul_forward(u.data(), cuda::MatmulOutput::F32, lm_hidden.data(), lm_head.data(), nullptr, gamma, H, V,
                           nullptr, cuda::FewRowKernels::DecodeFamily);
      lm_logits = from_device(u);
      if (D > 0) {
        DeviceBuffer<float> through(size_t(V) * D);
        cuda::lm_head_through_projection_forward(through.data(), lm_head.data(), projection.data(), V, H, D, nullptr);
        cuda::quantize_rows_forward(lm_rows, through.data(), V, D, cuda::kQuantizedProductSlack, nullptr);
        cuda::largest_row_norm_forward(largest_norm.data(), lm_head.data(), V, H, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
      } else {
        cuda::quantize_rows_forward(lm_rows, lm_head.data(), V, H, cuda::kQuantizedProductSlack, nullptr);
      }
      // Every U_k[v] within its interval.
      make_intervals();
      const auto center = from_device(centers), bound = from_device(lm_bounds), norm = from_device(lm_norms);
      const auto activation_norm = from_device(activation_norms);
      long outside = 0;
      double widest = 0.0, spread = 0.0;
      for (int k = 0; k < gamma; ++k)
        for (int v = 0; v < V; ++v) {
          const size_t i = size_t(k) * V + v;
          const double reach = double(activation_norm[k]) * bound[v] +
                               double(activation_norm[cuda::kQuantizedActivationRows + k]) * norm[v] +
                               double(activation_norm[2 * cuda::kQuantizedActivationRows + k]);
          outside += std::fabs(double(lm_logits[i]) - center[i]) > reach;
          widest = std::max(widest, reach);
          spread = std::max(spread, std::fabs(double(lm_logits[i])));
        }
      EXPECT_EQ(outside, 0) << what << ": logits outside their intervals";
      EXPECT_LT(widest, 0.2 * spread) << what << ": intervals too wide to prune";
    }
    const auto confidence_weight = random_values(d + r, 600 + B, 0.3f);
    std::vector<float> token_confidence(V, 0.0f);
    for (int v = 0; v < V; ++v)
      for (int i = 0; i < r; ++i) token_confidence[v] += w1[size_t(v) * r + i] * confidence_weight[d + i];
    const std::vector<float> bias = {0.2f}, temperatures = {1.0f, 0.9f, 1.1f, 1.3f, 0.8f, 1.0f, 1.2f};
    cuda::DraftControl control{};
    auto w1_device = to_device_bf16(w1), w2_device = to_device_bf16(w2);
    auto weight_device = to_device(confidence_weight), bias_device = to_device(bias);
    auto temperatures_device = to_device(temperatures), hidden_device = to_device(hidden);
    auto anchors_device = to_device(anchors), limits_device = to_device(limits);
    auto token_confidence_device = to_device(token_confidence);
    DeviceBuffer<cuda::DraftControl> control_device(1);
    auto set_control = [&] {
      CUDA_CHECK(cudaMemcpy(control_device.data(), &control, sizeof(control), cudaMemcpyHostToDevice));
    };
    set_control();
    const cuda::SequentialHeadWeights weights{w1_device.data(), weight_device.data(), bias_device.data(),
                                              temperatures_device.data(), token_confidence_device.data()};
    const bool on_chip = cuda::markov_head_supported(B, gamma, r, V, w2_device.data());
    const bool tokens_only = B == 1 && r % 8 == 0;
    EXPECT_TRUE(H == 0 || tokens_only) << what << ": an LM head case tests the tokens-only head";
    const QuantizedColumns quantized = tokens_only ? quantize_columns(w2.data(), r, V) : QuantizedColumns{};
    auto quantized_values = to_device(quantized.values);
    auto quantized_scales = to_device(quantized.scales), quantized_bounds = to_device(quantized.bounds);
    auto quantized_exact = to_device(quantized.exact);
    const cuda::QuantizedColumnsView quantized_view{quantized_values.data(),
                                                    quantized.stride,
                                                    quantized_scales.data(),
                                                    quantized_bounds.data(),
                                                    reinterpret_cast<const __nv_bfloat16*>(quantized_exact.data()),
                                                    float(kQuantizedSlack)};
    if (r < 256 && V % 8 == 0) {
      EXPECT_TRUE(on_chip) << what;
    }
    struct Outputs {
      std::vector<float> logits, confidence;
      std::vector<int32_t> tokens, count, alive_rows;
    };
    auto run = [&](Head kind, bool greedy) {
      auto logits = to_device(lm_logits);
      auto keys = to_device(std::vector<unsigned long long>(size_t(gamma) * B, 0));
      auto alive_rows = to_device(std::vector<int32_t>(gamma, 0));
      auto tokens = to_device(greedy ? std::vector<int32_t>(size_t(gamma) * B, 0) : sampled);
      DeviceBuffer<int32_t> alive(B), count(B);
      DeviceBuffer<float> confidence(gamma * B), e(B * r), hidden_logits(gamma * B);
      unsigned long long* greedy_keys = greedy ? keys.data() : nullptr;
      const cuda::SequentialHeadState head{anchors_device.data(), limits_device.data(), tokens.data(),
                                           greedy_keys,           confidence.data(),    alive.data(),
                                           count.data(),          alive_rows.data()};
      const bool intervals_kind = intervals_head(kind);
      if (intervals_kind) {  // U_k's intervals (the logits are not read)
        CUDA_CHECK(cudaMemset(lower_keys.data(), 0, lower_keys.bytes()));
        CUDA_CHECK(cudaMemset(logits.data(), 0xff, logits.bytes()));
        make_intervals();
      }
      if (one_launch_tokens_head(kind)) {
        CUDA_CHECK(cudaMemset(meetings.data(), 0, meetings.bytes()));
        cuda::markov_head_tokens_forward(
            keys.data(), logits.data(), quantized_view, intervals_kind ? &intervals : nullptr, hidden_device.data(),
            hidden_logits.data(), gamma, r, d, V, weights, control_device.data(), head, meetings.data(), nullptr);
      } else if (kind == Head::OneLaunch) {
        cuda::markov_head_forward(logits.data(), keys.data(), w2_device.data(), hidden_device.data(), B, gamma, r, d, V,
                                  weights, control_device.data(), head, barrier.data(), nullptr);
      } else {
        for (int k = 0; k < gamma; ++k) {
          float* position_logits = logits.data() + size_t(k) * B * V;
          if (tokens_head(kind)) {  // (the one-launch tokens heads are above)
            cuda::markov_position_tokens_forward(keys.data(), position_logits, quantized_view,
                                                 intervals_kind ? &intervals : nullptr, hidden_device.data(),
                                                 hidden_logits.data(), k, B, gamma, r, d, V, weights,
                                                 control_device.data(), head, nullptr);
            continue;
          }
          if (kind == Head::PerPosition) {
            cuda::markov_position_forward(position_logits, greedy_keys, w2_device.data(), hidden_device.data(),
                                          hidden_logits.data(), k, B, gamma, r, d, V, weights, control_device.data(),
                                          head, nullptr);
            continue;
          }
          cuda::sequential_head_prepare_forward(e.data(), nullptr, nullptr, hidden_device.data(), k, B, r, d, V,
                                                cuda::SequentialHeadKind::Markov, weights, control_device.data(), head,
                                                nullptr);
          if (greedy)
            cuda::matmul_in_out_argmax_forward(position_logits, e.data(), w2_device.data(), nullptr, B, r, V, true,
                                               keys.data() + k * B, alive_rows.data() + k, nullptr);
          else
            cuda::matmul_in_out_forward(position_logits, e.data(), w2_device.data(), nullptr, B, r, V, true,
                                        alive_rows.data() + k, nullptr);
        }
        if (greedy || tokens_head(kind)) cuda::argmax_tokens_forward(tokens.data(), keys.data(), gamma * B, nullptr);
      }
      return Outputs{from_device(logits), from_device(confidence), from_device(tokens), from_device(count),
                     from_device(alive_rows)};
    };
    if (test.floor == Floor::Above) {
      control.min_confidence = 1.1f;
    } else if (test.floor == Floor::Between) {  // between row 0's 3rd and 4th smallest confidences at positions 1..6
      const std::vector<float> unpruned = run(Head::Reference, true).confidence;
      std::vector<float> row;
      for (int k = 1; k < gamma; ++k) row.push_back(unpruned[k * B]);
      std::sort(row.begin(), row.end());
      control.min_confidence = 0.5f * (row[2] + row[3]);
    }
    set_control();
    for (const bool greedy : {true, false}) {
      const Outputs expected = run(Head::Reference, greedy);
      if (test.floor == Floor::Above) {
        EXPECT_EQ(expected.alive_rows[1], 0) << what << ": a floor above every confidence keeps position 0 alone";
      } else if (test.floor == Floor::Between && greedy) {  // (the sampled tokens give other confidences)
        EXPECT_LT(expected.count[0], gamma) << what << ": the floor prunes nothing (the case tests less than it says)";
      }
      for (const Head kind : {Head::PerPosition, Head::OneLaunch, Head::TokensOnly, Head::TokensOnlyIntervals,
                              Head::TokensOneLaunch, Head::TokensOneLaunchIntervals}) {
        const bool intervals_kind = intervals_head(kind);
        if (kind == Head::OneLaunch && (!greedy || !on_chip)) continue;
        if (tokens_head(kind) && (!greedy || !tokens_only)) continue;
        if (intervals_kind && H == 0) continue;
        if (one_launch_tokens_head(kind) &&
            !cuda::markov_head_tokens_supported(r, V, quantized.stride, intervals_kind ? H : 0))
          continue;
        const std::string how = what + " H " + std::to_string(H) +
                                (kind == Head::OneLaunch                  ? " one launch"
                                 : kind == Head::TokensOnly               ? " tokens only"
                                 : kind == Head::TokensOnlyIntervals      ? " tokens only, U as intervals"
                                 : kind == Head::TokensOneLaunch          ? " tokens only in one launch"
                                 : kind == Head::TokensOneLaunchIntervals ? " tokens only in one launch, U as intervals"
                                                                          : " per position") +
                                (greedy ? " greedy" : " sampled");
        const Outputs got = run(kind, greedy), again = run(kind, greedy);
        EXPECT_TRUE(std::memcmp(again.logits.data(), got.logits.data(), got.logits.size() * sizeof(float)) == 0 &&
                    again.tokens == got.tokens)  // bits: the tokens-only heads leave the poisoned logits (NaN)
            << how << ": a second launch differs";
        EXPECT_EQ(got.count, expected.count) << how;
        EXPECT_EQ(got.alive_rows, expected.alive_rows) << how;
        for (int b = 0; b < B; ++b) {
          for (int k = 0; k < expected.count[b]; ++k) {  // the (row, position) pairs kept
            const size_t slot = size_t(k) * B + b;
            EXPECT_NEAR(got.confidence[slot], expected.confidence[slot], 1e-5) << how << " slot " << slot;
            EXPECT_EQ(got.tokens[slot], expected.tokens[slot]) << how << " slot " << slot;
            if (tokens_head(kind)) continue;  // it writes no logits
            EXPECT_TRUE(std::equal(got.logits.begin() + slot * V, got.logits.begin() + (slot + 1) * V,
                                   expected.logits.begin() + slot * V))
                << how << ": logits differ at slot " << slot;
          }
        }
      }
    }
  }
}

TEST(CudaDraftOps, MarkovHeadKernelsEqualThePrepareAndProductKernels) {
  // The reference: sequential_head_prepare_forward + matmul_in_out(_argmax)_forward per position (+
  // argmax_tokens_forward). markov_position_forward per position, greedy and sampled, and markov_head_forward
  // (greedy, where w2 fits on chip) give the same counts and alive rows; the same logits and tokens, bit for bit,
  // at every (row, position) kept; confidences up to their dot product's order. Qwen3-8B's vocabulary at rank 64
  // (on chip) and 256 (per position only), the demo drafter's shape, small ones, a vocabulary not a multiple of 8
  // (per position only, weights read one by one), row groups of 1, 2, 4 and 8 (10 = 8 + 2, the second all padding),
  // a padding row, pruning, every row pruned. markov_position_tokens_forward (greedy, one row) and
  // markov_head_tokens_forward (the same in one launch, w2's 8-bit columns on chip): the same counts, alive rows,
  // confidences and tokens, with w2 large against U (many columns given the exact product), small (few), and
  // columns repeating every 7 (exact ties everywhere: the lowest index wins).
  check_markov_heads({MarkovCase{1, 64, 151936, Floor::None}, MarkovCase{1, 256, 151936, Floor::Between},
                      MarkovCase{1, 64, 8192, Floor::None}, MarkovCase{2, 128, 50000, Floor::Between},
                      MarkovCase{3, 16, 1000, Floor::None}, MarkovCase{6, 64, 8192, Floor::Between},
                      MarkovCase{4, 8, 512, Floor::Above}, MarkovCase{10, 32, 2048, Floor::Between},
                      MarkovCase{2, 16, 1001, Floor::None}, MarkovCase{1, 256, 151936, Floor::Between, 0.01f},
                      MarkovCase{1, 64, 20000, Floor::None, 0.05f}, MarkovCase{1, 64, 3000, Floor::None, 1.0f, true},
                      MarkovCase{1, 8, 1000, Floor::Between, 0.2f, true}, MarkovCase{1, 16, 1001, Floor::None}});
}

TEST(CudaDraftOps, MarkovTokensHeadWithTheLmHeadAsIntervals) {
  // Cases with an LM head (H > 0: U = h @ lm_head by the LM head's GEMV): every head as above, and the tokens-only
  // heads with U as intervals from the LM head's 8-bit rows (quantized_product.h), which first must hold U: Qwen3-8B's
  // shape with U large and small against e_k @ w2, small shapes (H 96: a chunk of 64 half past the row), and ties
  // (more candidates a block than its shared memory stages at once); then the same with U's input through a
  // projection and the intervals from the LM head through it (M = lm_head @ P, D 1024 at Qwen3-8B's shape, as the
  // drafter's out_proj).
  check_markov_heads(
      {MarkovCase{1, 256, 151936, Floor::Between, 1.0f, false, 4096, 1.0f},
       MarkovCase{1, 256, 151936, Floor::None, 1.0f, false, 4096, 0.02f},
       MarkovCase{1, 16, 1001, Floor::None, 1.0f, false, 64}, MarkovCase{1, 16, 1001, Floor::None, 1.0f, false, 96},
       MarkovCase{1, 64, 3000, Floor::Between, 0.5f, true, 128}, MarkovCase{1, 64, 3000, Floor::None, 1.0f, true, 4096},
       MarkovCase{1, 256, 151936, Floor::Between, 1.0f, false, 4096, 0.02f, 1024},
       MarkovCase{1, 16, 1001, Floor::None, 1.0f, false, 96, 1.0f, 64},
       MarkovCase{1, 64, 3000, Floor::None, 1.0f, true, 128, 1.0f, 32}});
}

TEST(CudaDraftOps, QuantizedRowsAreTheHostsQuantizedColumns) {
  // quantize_rows_forward against quantize_columns on the transposed matrix: the same 8-bit values and scales,
  // bounds within rounding (summed in another order), norms ||scale q|| rounded up; zero, spiky and
  // non-finite rows. quantize_activation_rows_forward: both levels within -127..127, ||h|| and ||h - h'||
  // rounded up, the second level leaving under 1% of the first's residual, padding rows zero.
  const int V = 301, H = 96;
  auto w = bf16_rounded(random_values(size_t(V) * H, 91, 0.5f));
  for (int i = 0; i < H; ++i) w[size_t(1) * H + i] = 0.0f;
  w[size_t(2) * H + 5] = 300.0f;
  w[size_t(3) * H + 7] = std::numeric_limits<float>::infinity();
  w[size_t(4) * H + 9] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> transposed(size_t(H) * V);
  for (int v = 0; v < V; ++v)
    for (int i = 0; i < H; ++i) transposed[size_t(i) * V + v] = w[size_t(v) * H + i];
  const QuantizedColumns expected = quantize_columns(transposed.data(), H, V, cuda::kQuantizedProductSlack);
  auto w_device = to_device_bf16(w);
  DeviceBuffer<int8_t> values(size_t(V) * H);
  DeviceBuffer<float> scales(V), bounds(V), norms(V);
  cuda::quantize_rows_forward({values.data(), scales.data(), bounds.data(), norms.data()}, w_device.data(), V, H,
                              cuda::kQuantizedProductSlack, nullptr);
  const auto got_values = from_device(values);
  const auto got_scales = from_device(scales), got_bounds = from_device(bounds), got_norms = from_device(norms);
  for (int v = 0; v < V; ++v) {
    for (int i = 0; i < H; ++i)
      ASSERT_EQ(int(got_values[size_t(v) * H + i]), int(expected.values[size_t(i) * expected.stride + v]) - 128)
          << "row " << v << " element " << i;
    EXPECT_EQ(got_scales[v], expected.scales[v]) << "row " << v;
    if (std::isinf(expected.bounds[v])) {
      EXPECT_TRUE(std::isinf(got_bounds[v])) << "row " << v;
    } else {
      EXPECT_NEAR(got_bounds[v], expected.bounds[v], 1e-6 * expected.bounds[v] + 1e-30) << "row " << v;
    }
    long double kept = 0.0L;
    for (int i = 0; i < H; ++i) {
      const long double q = static_cast<long double>(got_scales[v]) * got_values[size_t(v) * H + i];
      kept += q * q;
    }
    kept = std::sqrt(kept);
    EXPECT_GE(got_norms[v], kept) << "row " << v;
    EXPECT_LE(got_norms[v], kept * (1.0L + 1e-5L) + 1e-30L) << "row " << v;
  }
  EXPECT_EQ(got_scales[1], 0.0f);
  EXPECT_EQ(got_bounds[1], 0.0f) << "a zero row is exact";

  const int rows = 5;
  auto x = bf16_rounded(random_values(size_t(rows) * H, 92, 3.0f));
  x[2 * H + 11] = 900.0f;  // a spike: the first level's step is coarse, the second's fine
  auto x_device = to_device_bf16(x);
  DeviceBuffer<int8_t> levels(size_t(2) * cuda::kQuantizedActivationRows * H);
  DeviceBuffer<float> x_scales(cuda::kQuantizedActivationRows), x_norms(2 * cuda::kQuantizedActivationRows);
  CUDA_CHECK(cudaMemset(levels.data(), 0x55, levels.bytes()));
  cuda::quantize_activation_rows_forward({levels.data(), x_scales.data(), x_norms.data()}, x_device.data(), rows, H,
                                         nullptr);
  const auto got_levels = from_device(levels);
  const auto got_x_scales = from_device(x_scales), got_x_norms = from_device(x_norms);
  for (int k = 0; k < cuda::kQuantizedActivationRows; ++k) {
    long double norm = 0.0L, left = 0.0L, first_left = 0.0L;
    for (int i = 0; i < H; ++i) {
      const int q1 = got_levels[size_t(k) * H + i], q2 = got_levels[size_t(8 + k) * H + i];
      if (k >= rows) {
        ASSERT_EQ(q1, 0) << "padding row " << k;
        ASSERT_EQ(q2, 0) << "padding row " << k;
        continue;
      }
      ASSERT_TRUE(q1 >= -127 && q1 <= 127 && q2 >= -127 && q2 <= 127) << "row " << k;
      const long double value = x[size_t(k) * H + i], scale = got_x_scales[k];
      norm += value * value;
      const long double first = value - scale * q1, second = value - scale * (q1 + q2 / 254.0L);
      first_left += first * first, left += second * second;
    }
    if (k >= rows) continue;
    EXPECT_GE(got_x_norms[k], std::sqrt(norm)) << "row " << k;
    EXPECT_GE(got_x_norms[8 + k], std::sqrt(left)) << "row " << k;
    EXPECT_LE(got_x_norms[8 + k], 0.01L * std::sqrt(first_left) + 1e-30L) << "row " << k;
  }
}

TEST(CudaDraftOps, RecurrentUpdatesMatchTheFormulas) {
  const int B = 3, r = 300;
  const auto e = random_values(B * r, 100), state = random_values(B * r, 101);
  {  // RNN: s = tanh(pre + e), pre = s @ wH + bH
    const auto pre = random_values(B * r, 102, 2.0f);
    auto state_device = to_device(state), pre_device = to_device(pre), e_device = to_device(e);
    cuda::recurrent_update_forward(state_device.data(), nullptr, pre_device.data(), e_device.data(), B, r,
                                   cuda::SequentialHeadKind::Rnn, nullptr);
    const auto out = from_device(state_device);
    for (int i = 0; i < B * r; ++i) EXPECT_NEAR(out[i], std::tanh(pre[i] + e[i]), 1e-6) << i;
  }
  {  // GRU: keep = σ(g); s = keep s + (1 - keep) tanh(c); output = tanh(o)
    const auto pre = random_values(B * 3 * r, 103, 2.0f);
    auto state_device = to_device(state), pre_device = to_device(pre), e_device = to_device(e);
    DeviceBuffer<float> output(B * r);
    cuda::recurrent_update_forward(state_device.data(), output.data(), pre_device.data(), e_device.data(), B, r,
                                   cuda::SequentialHeadKind::Gru, nullptr);
    const auto new_state = from_device(state_device), out = from_device(output);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < r; ++i) {
        const float* gates = pre.data() + b * 3 * r;
        const float keep = sigmoid(gates[i]);
        EXPECT_NEAR(new_state[b * r + i], keep * state[b * r + i] + (1 - keep) * std::tanh(gates[r + i]), 1e-6);
        EXPECT_NEAR(out[b * r + i], std::tanh(gates[2 * r + i]), 1e-6);
      }
  }
}

TEST(CudaDraftOps, ScatterRowsSkipsNullDestinations) {
  const int count = 3, width = 72;
  const auto rows = bf16_rounded(random_values(count * width, 104));
  auto rows_device = to_device_bf16(rows);
  DeviceBuffer<bf16> destination(4 * width);
  CUDA_CHECK(cudaMemset(destination.data(), 0, destination.bytes()));
  auto pointers = to_device(
      std::vector<uint64_t>{address(destination.data() + 3 * width), 0, address(destination.data() + 1 * width)});
  cuda::scatter_rows_forward(reinterpret_cast<bf16* const*>(pointers.data()), rows_device.data(), count, width,
                             nullptr);
  const auto out = from_device(destination);
  for (int i = 0; i < width; ++i) {
    EXPECT_EQ(out[3 * width + i], rows[i]);
    EXPECT_EQ(out[1 * width + i], rows[2 * width + i]);
    EXPECT_EQ(out[0 * width + i], 0.0f);
    EXPECT_EQ(out[2 * width + i], 0.0f);
  }
}

TEST(CudaDraftOps, F32ToBf16MatchesTheHostBitForBit) {
  // Random values, then the cases rounding gets wrong: ties either way, the
  // carry into the exponent, subnormals, infinities, signed zeros and NaNs
  // (quiet, signalling, negative: each keeps its own bits as on the host).
  std::vector<float> values = random_values(5000, 105, 3.0f);
  const uint32_t words[] = {0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f7fffffu, 0x7f7fffffu, 0x00000001u, 0x807fffffu,
                            0x7f800000u, 0xff800000u, 0x80000000u, 0x7fc00000u, 0x7f800001u, 0xffa00001u, 0x7fbfffffu};
  for (uint32_t word : words) {
    float value;
    std::memcpy(&value, &word, 4);
    values.push_back(value);
  }
  auto in = to_device(values);
  DeviceBuffer<bf16> out(values.size());
  cuda::f32_to_bf16_forward(out.data(), in.data(), long(values.size()), nullptr);
  std::vector<uint16_t> bits(values.size());
  CUDA_CHECK(cudaMemcpy(bits.data(), out.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(bits[i], f32_to_bf16(values[i])) << "value " << i;
}

TEST(CudaDraftOps, GatherTapRowsCopiesConvertsZeroesAndKeeps) {
  // A narrow row, and a row of several blocks' slices (kWideRowSlice = 2048 columns) ending in a partial one.
  for (const int width : {40, 2 * 2048 + 40}) {
    SCOPED_TRACE("width " + std::to_string(width));
    const int rows = 5;
    const auto staged = bf16_rounded(random_values(3 * width, 106));
    auto staged_device = to_device_bf16(staged);
    const auto taps = random_values(2 * width, 108, 3.0f);  // f32 rows where a forward left them
    auto taps_device = to_device(taps);
    const auto before = bf16_rounded(random_values(rows * width, 107));
    auto out_device = to_device_bf16(before);
    using cuda::TapRowKind;
    auto sources = to_device(std::vector<cuda::TapRowSource>{{staged_device.data() + 2 * width, TapRowKind::Bf16},
                                                             {nullptr, TapRowKind::Keep},
                                                             {nullptr, TapRowKind::Zero},
                                                             {taps_device.data() + width, TapRowKind::F32},
                                                             {staged_device.data(), TapRowKind::Bf16}});
    cuda::gather_tap_rows_forward(out_device.data(), sources.data(), rows, width, nullptr);
    std::vector<uint16_t> bits(size_t(rows) * width);
    CUDA_CHECK(cudaMemcpy(bits.data(), out_device.data(), bits.size() * 2, cudaMemcpyDeviceToHost));
    const auto out = from_device(out_device);
    for (int i = 0; i < width; ++i) {
      ASSERT_EQ(out[0 * width + i], staged[2 * width + i]) << "column " << i;
      ASSERT_EQ(out[1 * width + i], before[1 * width + i]) << "column " << i;
      ASSERT_EQ(out[2 * width + i], 0.0f) << "column " << i;
      ASSERT_EQ(bits[3 * width + i], f32_to_bf16(taps[width + i])) << "column " << i;  // rounded as on the host
      ASSERT_EQ(out[4 * width + i], staged[0 * width + i]) << "column " << i;
    }
  }
}

// ---------------------------------------------------------------- whole draft steps

constexpr double kLogitTolerance = 3e-2;       // bf16 weights and activations through the backbone
constexpr double kConfidenceTolerance = 2e-2;  // |c_gpu - c_cpu|
constexpr float kClearGap = 0.05f;             // a top-2 gap this fraction of the logit spread is not a near-tie

class CudaDrafting : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    host_ = std::make_unique<Transformer>(load_transformer(golden_model("qwen3")));
    target_ = load_target(golden_model("qwen3"), "cuda");
    const ModelConfig& c = host_->config;
    DrafterConfig config;
    config.gamma = 6;
    config.d_draft = 64;
    config.num_layers = 2;
    config.num_heads = 4;  // head_dim 16
    config.markov_rank = 16;
    config.tap_layers = {1, 3, 4};
    config.seq_head = GetParam();
    drafter_ = init_drafter(config, {c.hidden_size, c.vocab_size, c.rms_norm_eps}, "qwen3", 3);
    testing::randomize_parameters(drafter_, 11, 1.0f);
    head_ = target_head_of(*host_);
    // Real tapped rows of the golden target for tokens_.
    KVCache cache(c, 128);
    ForwardWorkspace workspace;
    ForwardOutput output;
    ForwardSequence sequence{&cache, tokens_, false};
    transformer_forward(*host_, {&sequence, 1}, config.tap_layers, workspace, output);
    taps_ = output.taps;
    width_ = static_cast<int>(config.tap_layers.size()) * c.hidden_size;
    gpu_ = std::make_unique<CudaDrafter>(drafter_, *cuda_target_head(*target_));
  }
  void TearDown() override { gpu_.reset(); }

  const float* taps(int row) const { return taps_.data() + size_t(row) * width_; }
  DraftContext cpu_context(int rows) const {
    DraftContext context;
    extend_draft_context(drafter_, context, taps(0), rows);
    return context;
  }
  int gpu_context(int rows) {
    const int id = gpu_->create_context();
    gpu_->extend_context(id, taps(0), rows);
    return id;
  }

  // A greedy GPU draft against the CPU drafter teacher-forced on the GPU's own
  // tokens: logits and confidences close, each token the CPU's argmax up to
  // bf16 noise, and exactly it where the CPU's top-2 gap is clear. Clear: over
  // kClearGap of the logit spread, or, where the GPU's logits came back, over
  // twice the largest |GPU - CPU| logit difference δ of that row (the GPU's
  // token is the argmax of exactly those logits, and a gap over 2δ cannot
  // close when every logit moves by at most δ: a proof, not a tolerance).
  // Random drafters often have no gap of 5% of the spread in a whole block;
  // gaps over 2δ (about 1% at bf16) are common. Returns the CPU's confidences
  // for all γ positions.
  std::vector<float> expect_matches_cpu(const DraftResult& gpu, const DraftContext& context, int32_t anchor,
                                        const std::string& what) {
    const int gamma = drafter_.config.gamma, V = drafter_.dims.vocab_size;
    std::vector<int32_t> forced(gpu.tokens);
    forced.resize(gamma, 0);
    const DraftForward cpu = draft_teacher_forced(drafter_, head_, context, anchor, forced);
    const size_t n = gpu.tokens.size();
    EXPECT_GE(n, 1u) << what;
    int clear = 0;
    for (size_t k = 0; k < n; ++k) {
      const float* row = cpu.logits.data() + k * V;
      EXPECT_NEAR(gpu.confidence[k], cpu.confidence[k], kConfidenceTolerance) << what << " position " << k;
      if (!gpu.logits.empty()) {
        EXPECT_LE(relative_error(gpu.logits.data() + k * V, row, V), kLogitTolerance) << what << " position " << k;
      }
      const int32_t best = cpu::argmax(row, V);
      const float spread = row[best] - *std::min_element(row, row + V);
      float second = -INFINITY, largest_difference = INFINITY;
      for (int i = 0; i < V; ++i)
        if (i != best) second = std::max(second, row[i]);
      if (!gpu.logits.empty()) {
        largest_difference = 0.0f;
        for (int i = 0; i < V; ++i)
          largest_difference = std::max(largest_difference, std::fabs(gpu.logits[k * V + i] - row[i]));
      }
      EXPECT_GE(row[gpu.tokens[k]], row[best] - 2e-2f * spread) << what << " position " << k;
      const float gap = row[best] - second;
      if (gap > kClearGap * spread || gap > 2.0f * largest_difference) {
        EXPECT_EQ(gpu.tokens[k], best) << what << " position " << k << ": the CPU's top-2 gap is clear";
        ++clear;
      }
    }
    EXPECT_GT(clear, 0) << what << ": no position had a clear top-2 gap (the test compares nothing exactly)";
    return cpu.confidence;
  }

  std::vector<int32_t> tokens_ = {12, 400, 33, 901, 7, 256, 64, 500, 3, 77, 120, 5, 640, 18, 1000, 42};
  std::unique_ptr<Transformer> host_;
  std::unique_ptr<Target> target_;
  Drafter drafter_;
  TargetHead head_;
  std::vector<float> taps_;
  int width_ = 0;
  std::unique_ptr<CudaDrafter> gpu_;
};

TEST_P(CudaDrafting, RaggedBatchMatchesCpu) {
  // Three rows, one with an empty context: bucket 4 with a padding row; then
  // each row alone (bucket 1), twice (eager, then the captured graph).
  const std::vector<int> lengths = {2, 15, 0};
  const std::vector<int32_t> anchors = {tokens_[2], tokens_[15], tokens_[0]};
  std::vector<CudaDraftRequest> requests;
  for (size_t i = 0; i < lengths.size(); ++i) requests.push_back({gpu_context(lengths[i]), anchors[i], nullptr});
  DraftOptions options;
  options.collect_logits = true;
  std::vector<DraftResult> batched, alone;
  gpu_->draft(requests, options, batched);
  for (size_t i = 0; i < lengths.size(); ++i) {
    ASSERT_EQ(batched[i].tokens.size(), size_t(drafter_.config.gamma)) << "no pruning asked for";
    expect_matches_cpu(batched[i], cpu_context(lengths[i]), anchors[i], "batched row " + std::to_string(i));
    for (int run = 0; run < 2; ++run) {
      gpu_->draft({&requests[i], 1}, options, alone);
      expect_matches_cpu(alone[0], cpu_context(lengths[i]), anchors[i], "row " + std::to_string(i) + " alone");
    }
  }
}

TEST_P(CudaDrafting, GraphReplaysEqualTheEagerStep) {
  const int context = gpu_context(9);
  const CudaDraftRequest request{context, tokens_[9], nullptr};
  DraftOptions options;
  options.collect_logits = true;
  std::vector<DraftResult> eager, replayed;
  gpu_->draft({&request, 1}, options, eager);  // a bucket's first step runs eagerly, later ones replay its graph
  for (int run = 0; run < 3; ++run) {
    gpu_->draft({&request, 1}, options, replayed);
    EXPECT_EQ(replayed[0].tokens, eager[0].tokens) << run;
    EXPECT_EQ(replayed[0].confidence, eager[0].confidence) << run;
    EXPECT_EQ(replayed[0].logits, eager[0].logits) << run;
  }
}

// The drafter's greedy Markov head per position (what runs where w2 does not
// fit on chip: Qwen3-8B's) against its one-launch head, through whole steps;
// and without logits (at one row: w2 read at 8 bits), the same tokens and
// confidences.
TEST_P(CudaDrafting, PerPositionMarkovHeadEqualsTheOneLaunchHead) {
  if (drafter_.config.seq_head != "markov") GTEST_SKIP() << "the one-launch head is the greedy Markov head's";
  // One row (positions found inside their products) and three (a bucket of 4 with a padding row: prepare
  // kernels), each against the one-launch head.
  for (const std::vector<int>& lengths : {std::vector<int>{9}, std::vector<int>{9, 4, 12}}) {
    std::vector<CudaDraftRequest> requests;
    for (int length : lengths) requests.push_back({gpu_context(length), tokens_[length], nullptr});
    DraftOptions options;
    options.collect_logits = true;
    std::vector<DraftResult> one_launch, per_position, tokens_only;
    gpu_->use_one_launch_head(true);
    gpu_->draft(requests, options, one_launch);
    gpu_->use_one_launch_head(false);
    for (int run = 0; run < 3; ++run) {  // eager, then graph replays
      gpu_->draft(requests, options, per_position);
      gpu_->draft(requests, DraftOptions{}, tokens_only);
      for (size_t i = 0; i < requests.size(); ++i) {
        const std::string what =
            std::to_string(lengths.size()) + " rows, row " + std::to_string(i) + " run " + std::to_string(run);
        EXPECT_EQ(tokens_only[i].tokens, per_position[i].tokens) << what << " (tokens only)";
        EXPECT_EQ(tokens_only[i].confidence, per_position[i].confidence) << what << " (tokens only)";
        EXPECT_EQ(per_position[i].tokens, one_launch[i].tokens) << what;
        EXPECT_EQ(per_position[i].logits, one_launch[i].logits) << what;
        ASSERT_EQ(per_position[i].confidence.size(), one_launch[i].confidence.size()) << what;
        for (size_t k = 0; k < one_launch[i].confidence.size(); ++k)  // the same sum in another order
          EXPECT_NEAR(per_position[i].confidence[k], one_launch[i].confidence[k], 1e-5f) << what << " position " << k;
      }
    }
  }
}

TEST_P(CudaDrafting, PruningMatchesCpu) {
  const int length = 10, gamma = drafter_.config.gamma;
  const int context = gpu_context(length);
  const DraftContext cpu = cpu_context(length);
  const CudaDraftRequest request{context, tokens_[length], nullptr};
  std::vector<DraftResult> full;
  gpu_->draft({&request, 1}, DraftOptions{}, full);
  const std::vector<float> c = expect_matches_cpu(full[0], cpu, tokens_[length], "unpruned");
  // Thresholds 0.1 clear of the CPU's confidences: keep positions 0..2, stop at 3.
  DraftOptions options;
  options.thresholds.resize(gamma);
  for (int k = 0; k < gamma; ++k) options.thresholds[k] = k == 3 ? c[k] + 0.1f : c[k] - 0.1f;
  options.thresholds[0] = 2.0f;  // position 0 is always kept
  std::vector<DraftResult> pruned;
  gpu_->draft({&request, 1}, options, pruned);
  ASSERT_EQ(pruned[0].tokens.size(), 3u);
  EXPECT_TRUE(std::equal(pruned[0].tokens.begin(), pruned[0].tokens.end(), full[0].tokens.begin()));
  // A floor above every confidence: only position 0.
  DraftOptions floor;
  floor.min_confidence = *std::max_element(c.begin(), c.end()) + 0.1f;
  gpu_->draft({&request, 1}, floor, pruned);
  EXPECT_EQ(pruned[0].tokens.size(), 1u);
  // A floor between the confidences: the first position k >= 1 below it, as the CPU drafter stops.
  std::vector<float> sorted(c.begin() + 1, c.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i + 1 < sorted.size(); ++i) {
    if (sorted[i + 1] - sorted[i] < 2 * kConfidenceTolerance) continue;  // too close to call under bf16
    floor.min_confidence = 0.5f * (sorted[i] + sorted[i + 1]);
    size_t expected = 1;
    while (expected < size_t(gamma) && c[expected] >= floor.min_confidence) ++expected;
    gpu_->draft({&request, 1}, floor, pruned);
    EXPECT_EQ(pruned[0].tokens.size(), expected) << "floor " << floor.min_confidence;
    DraftWorkspace workspace;
    std::vector<DraftResult> on_cpu;
    const DraftRequest cpu_request{&cpu, tokens_[length], nullptr};
    draft(drafter_, head_, {&cpu_request, 1}, floor, workspace, on_cpu);
    if (on_cpu[0].tokens.size() <= 1 ||  // the same path as the GPU's (no near-tie flipped by bf16)
        std::equal(on_cpu[0].tokens.begin(), on_cpu[0].tokens.end(), full[0].tokens.begin())) {
      EXPECT_EQ(pruned[0].tokens.size(), on_cpu[0].tokens.size()) << "floor " << floor.min_confidence;
    }
  }
  // max_tokens cuts every row.
  DraftOptions short_draft;
  short_draft.max_tokens = 2;
  gpu_->draft({&request, 1}, short_draft, pruned);
  EXPECT_EQ(pruned[0].tokens.size(), 2u);
}

TEST_P(CudaDrafting, RetainedContextEqualsRecompute) {
  const int d = drafter_.config.d_draft;
  const int whole = gpu_context(12), pieces = gpu_->create_context();
  gpu_->extend_context(pieces, taps(0), 3);
  gpu_->flush_contexts();
  gpu_->extend_context(pieces, taps(3), 1);
  gpu_->extend_context(pieces, taps(4), 8);  // two staged pieces, projected together
  const DraftContext cpu = cpu_context(12);
  for (int l = 0; l < drafter_.config.num_layers; ++l) {
    std::vector<float> keys, values, piece_keys, piece_values;
    gpu_->read_context(whole, l, keys, values);
    gpu_->read_context(pieces, l, piece_keys, piece_values);
    ASSERT_EQ(keys.size(), size_t(12) * d);
    ASSERT_EQ(piece_keys.size(), keys.size());
    EXPECT_LE(relative_error(keys.data(), cpu.keys[l].data(), keys.size()), kBf16Tolerance) << "layer " << l;
    EXPECT_LE(relative_error(values.data(), cpu.values[l].data(), values.size()), kBf16Tolerance) << "layer " << l;
    EXPECT_LE(relative_error(piece_keys.data(), keys.data(), keys.size()), kBf16Tolerance) << "layer " << l;
    EXPECT_LE(relative_error(piece_values.data(), values.data(), values.size()), kBf16Tolerance) << "layer " << l;
  }
  // Rolled back (past projected and staged rows) and regrown, a context drafts as if never extended past the cut.
  gpu_->extend_context(pieces, taps(12), 2);
  gpu_->truncate_context(pieces, 13);  // drops one staged row
  EXPECT_EQ(gpu_->context_length(pieces), 13);
  gpu_->truncate_context(pieces, 6);  // drops projected rows
  EXPECT_EQ(gpu_->context_length(pieces), 6);
  gpu_->extend_context(pieces, taps(6), 3);
  DraftOptions options;
  options.collect_logits = true;
  std::vector<DraftResult> regrown;
  const CudaDraftRequest request{pieces, tokens_[9], nullptr};
  gpu_->draft({&request, 1}, options, regrown);
  expect_matches_cpu(regrown[0], cpu_context(9), tokens_[9], "regrown");
  // Growth past the first allocation (64 rows) keeps the rows already there.
  const int grown = gpu_context(16);
  gpu_->flush_contexts();  // the first allocation: 64 rows
  for (int i = 0; i < 5; ++i) gpu_->extend_context(grown, taps_.data(), 16);
  std::vector<float> grown_keys, grown_values, keys, values;
  gpu_->read_context(grown, 1, grown_keys, grown_values);
  gpu_->read_context(whole, 1, keys, values);
  ASSERT_EQ(grown_keys.size(), size_t(96) * d);
  EXPECT_LE(relative_error(grown_keys.data(), keys.data(), size_t(12) * d), kBf16Tolerance);
  EXPECT_LE(relative_error(grown_keys.data() + size_t(80) * d, keys.data(), size_t(12) * d), kBf16Tolerance);
  // Storage a context grew out of (64 rows) or left (128) serves the next
  // context that fits in it: that one reads and drafts from its own rows.
  gpu_->release_context(grown);
  const int reused = gpu_context(12);
  const int last = drafter_.config.num_layers - 1;
  gpu_->read_context(reused, last, grown_keys, grown_values);
  gpu_->read_context(whole, last, keys, values);
  ASSERT_EQ(grown_keys.size(), keys.size());
  EXPECT_LE(relative_error(grown_keys.data(), keys.data(), keys.size()), kBf16Tolerance);
  EXPECT_LE(relative_error(grown_values.data(), values.data(), values.size()), kBf16Tolerance);
  const CudaDraftRequest from_reused{reused, tokens_[12], nullptr};
  gpu_->draft({&from_reused, 1}, options, regrown);
  expect_matches_cpu(regrown[0], cpu, tokens_[12], "reused storage");
}

TEST_P(CudaDrafting, ExtendFromDeviceRowsStoresWhatHostRowsStore) {
  // The same rows through the host path, through the device path (as a CUDA
  // target's device taps: f32 on the device, converted there), and mixed,
  // with two contexts sharing each pass, staged rows truncated, stored rows
  // rolled back and regrown: every retained key and value equal bit for bit.
  auto rows_device = to_device(taps_);
  const float* device_rows = rows_device.data();
  auto device_taps = [&](int row) { return device_rows + size_t(row) * width_; };
  const int host = gpu_->create_context(), device = gpu_->create_context(), mixed = gpu_->create_context();
  auto both = [&](int from, int count, bool mixed_on_device) {
    gpu_->extend_context(host, taps(from), count);
    gpu_->extend_context_from_device(device, device_taps(from), count);
    if (mixed_on_device)
      gpu_->extend_context_from_device(mixed, device_taps(from), count);
    else
      gpu_->extend_context(mixed, taps(from), count);
  };
  auto truncate = [&](int length) {
    for (int context : {host, device, mixed}) gpu_->truncate_context(context, length);
  };
  auto expect_equal = [&](int length, const std::string& what) {
    for (int l = 0; l < drafter_.config.num_layers; ++l) {
      std::vector<float> keys, values, device_keys, device_values, mixed_keys, mixed_values;
      gpu_->read_context(host, l, keys, values);
      gpu_->read_context(device, l, device_keys, device_values);
      gpu_->read_context(mixed, l, mixed_keys, mixed_values);
      ASSERT_EQ(keys.size(), size_t(length) * drafter_.config.d_draft) << what;
      EXPECT_EQ(device_keys, keys) << what << ", layer " << l;
      EXPECT_EQ(device_values, values) << what << ", layer " << l;
      EXPECT_EQ(mixed_keys, keys) << what << ", layer " << l;
      EXPECT_EQ(mixed_values, values) << what << ", layer " << l;
    }
  };
  both(0, 5, true);
  both(5, 3, false);  // a pass with host and device rows of one context
  expect_equal(8, "prefill");
  both(8, 4, true);
  gpu_->convert_device_rows();  // (as before a forward that would overwrite them: read from the staging area)
  both(12, 2, false);
  truncate(13);  // drops staged rows: one host row of `mixed`, device rows of `device`
  EXPECT_EQ(gpu_->context_length(device), 13);
  expect_equal(13, "staged rows truncated");
  both(13, 3, true);
  truncate(14);  // drops staged device rows only
  both(14, 2, false);
  expect_equal(16, "truncated between staged device and host rows");
  truncate(6);  // rolls back stored rows
  both(6, 4, true);
  truncate(9);
  both(9, 7, true);
  expect_equal(16, "stored rows rolled back, regrown from the device");
  // A context grown past its first allocation (64 rows) while rows wait in the
  // device staging area, which itself grows past its first 256 rows.
  for (int i = 0; i < 20; ++i) both(0, 16, i % 3 != 0);
  expect_equal(16 + 20 * 16, "grown");
  // Converted before a pass reads them: single rows from scattered sources,
  // more runs of consecutive rows than one conversion launch takes.
  for (int i = 0; i < 70; ++i) both((i * 5) % 16, 1, true);
  gpu_->convert_device_rows();
  expect_equal(16 + 20 * 16 + 70, "converted in runs");
  // A draft projects only its requests' contexts: the others' rows stay
  // staged (device rows among them, while more arrive) and land the same.
  DraftOptions options;
  options.collect_logits = true;
  std::vector<DraftResult> results;
  both(0, 4, true);
  const CudaDraftRequest device_only{device, tokens_[3], nullptr};
  gpu_->draft({&device_only, 1}, options, results);
  both(4, 3, true);
  gpu_->draft({&device_only, 1}, options, results);
  both(7, 2, false);
  expect_equal(16 + 20 * 16 + 70 + 9, "one context drafting while the others stay staged");
  // Drafts from the three contexts are the same too.
  const CudaDraftRequest requests[] = {
      {host, tokens_[3], nullptr}, {device, tokens_[3], nullptr}, {mixed, tokens_[3], nullptr}};
  gpu_->draft(requests, options, results);
  EXPECT_EQ(results[1].tokens, results[0].tokens);
  EXPECT_EQ(results[1].confidence, results[0].confidence);
  EXPECT_EQ(results[1].logits, results[0].logits);
  EXPECT_EQ(results[2].logits, results[0].logits);
}

TEST_P(CudaDrafting, SamplingConsumesEachRowsStreamAsTheCpuDoes) {
  const int context = gpu_context(8), V = drafter_.dims.vocab_size;
  DraftOptions options;
  options.sampling = {1.0f, 0, 1.0f};
  options.collect_logits = true;
  auto sample = [&](uint64_t seed) {
    Rng rng(seed);
    const CudaDraftRequest request{context, tokens_[8], &rng};
    std::vector<DraftResult> results;
    gpu_->draft({&request, 1}, options, results);
    const DraftResult& result = results[0];
    EXPECT_EQ(result.probs.size(), result.tokens.size() * V);
    Rng expected(seed);  // one uniform per kept position, in order
    for (size_t k = 0; k < result.tokens.size(); ++k) {
      const float* q = result.probs.data() + k * V;
      EXPECT_GT(q[result.tokens[k]], 0.0f) << "position " << k;
      EXPECT_EQ(result.tokens[k], cpu::sample_from_distribution(q, V, expected.uniform())) << "position " << k;
      std::vector<float> recomputed(V);
      std::vector<int32_t> order;
      cpu::processed_distribution(recomputed.data(), result.logits.data() + k * V, V, options.sampling, order);
      EXPECT_EQ(std::vector<float>(q, q + V), recomputed) << "position " << k;
    }
    EXPECT_EQ(rng.next(), expected.next()) << "the row's stream advanced by exactly the kept positions";
    return result;
  };
  EXPECT_EQ(sample(1).tokens, sample(1).tokens);
  std::set<std::vector<int32_t>> distinct;
  for (uint64_t seed = 0; seed < 8; ++seed) distinct.insert(sample(seed).tokens);
  EXPECT_GT(distinct.size(), 1u);
  // The CPU drafter with the same seed draws its first token with the same
  // uniform u. Its q differs from the GPU's by bf16 noise, which moves every
  // cumulative boundary C_i = q_0 + ... + q_i a little; both draws pick the
  // first i with u < C_i, so they can only differ where u lies between some
  // C_i(CPU) and C_i(GPU). Such seeds are skipped, every other one must agree
  // exactly. (This drafter's q at T = 1 is flat, perplexity about 100, so that
  // a draw with any other uniform would almost surely differ; the skipped
  // share is about a quarter at the GPU's ~1% logit error, so 48 seeds leave
  // well over the 12 decided ones required.)
  auto decided = [&](const std::vector<float>& a, const float* b, double u) {
    double cumulative_a = 0.0, cumulative_b = 0.0;  // summed as cpu::sample_from_distribution sums
    for (int i = 0; i < V; ++i) {
      if (a[i] > 0.0f) cumulative_a += a[i];
      if (b[i] > 0.0f) cumulative_b += b[i];
      if ((u < cumulative_a) != (u < cumulative_b)) return false;
    }
    return u < std::min(cumulative_a, cumulative_b);  // past both totals each falls back to its last token
  };
  int compared = 0;
  std::set<int32_t> first_tokens;
  const DraftContext cpu = cpu_context(8);
  for (uint64_t seed = 0; seed < 48; ++seed) {
    Rng cpu_rng(seed);
    DraftWorkspace workspace;
    std::vector<DraftResult> on_cpu;
    const DraftRequest cpu_request{&cpu, tokens_[8], &cpu_rng};
    draft(drafter_, head_, {&cpu_request, 1}, options, workspace, on_cpu);
    std::vector<float> cpu_q(V);
    std::vector<int32_t> order;
    cpu::processed_distribution(cpu_q.data(), on_cpu[0].logits.data(), V, options.sampling, order);
    const DraftResult gpu = sample(seed);
    if (!decided(cpu_q, gpu.probs.data(), Rng(seed).uniform())) continue;
    ++compared;
    first_tokens.insert(gpu.tokens[0]);
    EXPECT_EQ(on_cpu[0].tokens[0], gpu.tokens[0]) << "seed " << seed << ": a draw bf16 noise cannot change";
  }
  EXPECT_GE(compared, 12) << "too few seeds away from the noise-moved boundaries";
  EXPECT_GT(first_tokens.size(), 1u) << "the compared draws must not all be one token";
}

TEST_P(CudaDrafting, SpeculativeDecodingWithTheGpuDrafterIsLossless) {
  const int count = 24;
  CpuTarget cpu(*host_);  // the f32 judge of greedy tokens (bf16 may flip a near-tie: device_test_util.h)
  std::vector<std::vector<int32_t>> prompts;
  const Json forward = testing::golden_reference("qwen3", "forward.json");
  for (const auto& prompt : forward["prompts"]) prompts.push_back(prompt["ids"].get<std::vector<int32_t>>());
  // Nothing to prefill: an empty draft context, and the sequence's first
  // forward is a verify block at length 0. (Not prompts[0][0] alone: its f32
  // greedy path has top-2 gaps of 0.005% and 0.4% of the logit spread at
  // tokens 0 and 7, which bf16 may decide differently in a verify block than in
  // a decode step or a prefill.)
  prompts.push_back(testing::one_token_prompt_with_clear_greedy(cpu, count));
  GenerateOptions plain_options;
  plain_options.max_new_tokens = count;
  plain_options.ignore_eos = true;
  const auto plain = generate_batch(*target_, prompts, plain_options);
  CudaDSparkSource source(drafter_, *cuda_target_head(*target_));
  SpeculativeOptions options;
  options.max_new_tokens = count;
  options.ignore_eos = true;
  for (int gamma : {1, 6}) {
    options.gamma = gamma;
    const auto spec = speculative_generate(*target_, source, prompts, options);
    const size_t exact =
        testing::expect_greedy_equals_plain(cpu, prompts, plain, spec, "gamma " + std::to_string(gamma));
    long accepted = 0;
    for (const SpeculativeResult& result : spec) accepted += result.stats.accepted;
    std::printf("[ %s ] gamma %d: %ld drafted tokens accepted; %zu of %zu tokens past no near-tie, compared exactly\n",
                GetParam().c_str(), gamma, accepted, exact, prompts.size() * count);
  }
  // Sampled: runs to the requested length with q from the GPU drafter.
  options.sampling = {0.8f, 20, 0.95f};
  options.seed = 7;
  for (const auto& result : speculative_generate(*target_, source, prompts, options))
    EXPECT_EQ(result.tokens.size(), 24u);
}

// The same source fed host taps: DraftSource's default accepts_device_taps()
// (false) makes speculative_generate copy the target's taps to the host, as
// for every source on the host.
class HostTapsSource final : public DraftSource {
 public:
  explicit HostTapsSource(DraftSource& source) : source_(source) {}
  std::vector<int> tap_layers() const override { return source_.tap_layers(); }
  void begin(int row, std::span<const int32_t> prompt, uint64_t seed) override { source_.begin(row, prompt, seed); }
  void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) override {
    source_.accept(row, tokens, tapped_rows);
  }
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) override {
    source_.propose(rows, pending, max_tokens, sampling, proposals);
  }
  void end(int row) override { source_.end(row); }

 private:
  DraftSource& source_;
};

TEST_P(CudaDrafting, SpeculativeDecodingWithDeviceTapsEqualsHostTaps) {
  // The GPU drafter beside the CUDA target reads the target's taps on the
  // device; through the host they reach the same bf16 bits, so every round
  // (drafts, confidences, verdicts, emitted tokens) is the same, greedy and
  // sampled, for a ragged batch (prompts of different lengths, one with
  // nothing to prefill) and for one request alone.
  std::vector<std::vector<int32_t>> prompts;
  const Json forward = testing::golden_reference("qwen3", "forward.json");
  for (const auto& prompt : forward["prompts"]) prompts.push_back(prompt["ids"].get<std::vector<int32_t>>());
  prompts.push_back(std::vector<int32_t>(tokens_.begin(), tokens_.begin() + 11));
  prompts.push_back({tokens_[2]});
  CudaDSparkSource device_source(drafter_, *cuda_target_head(*target_));
  CudaDSparkSource inner(drafter_, *cuda_target_head(*target_));
  HostTapsSource host_source(inner);
  ASSERT_TRUE(device_source.accepts_device_taps());
  ASSERT_FALSE(host_source.accepts_device_taps());
  SpeculativeOptions options;
  options.max_new_tokens = 20;
  options.ignore_eos = true;
  options.trace = true;
  long rounds = 0, rollbacks = 0, accepted = 0;
  for (const bool sampled : {false, true}) {
    options.sampling = sampled ? cpu::SamplingParams{0.8f, 20, 0.95f} : cpu::SamplingParams{};
    options.seed = 7;
    for (const size_t batch : {prompts.size(), size_t(1)}) {
      const std::span<const std::vector<int32_t>> batch_prompts = std::span(prompts).first(batch);
      for (const int gamma : {1, 6}) {
        options.gamma = gamma;
        const std::string what = std::string(sampled ? "sampled" : "greedy") + ", batch " + std::to_string(batch) +
                                 ", gamma " + std::to_string(gamma);
        const auto on_device = speculative_generate(*target_, device_source, batch_prompts, options);
        const auto on_host = speculative_generate(*target_, host_source, batch_prompts, options);
        ASSERT_EQ(on_device.size(), on_host.size()) << what;
        for (size_t r = 0; r < on_host.size(); ++r) {
          const std::string request = what + ", request " + std::to_string(r);
          EXPECT_EQ(on_device[r].tokens, on_host[r].tokens) << request;
          EXPECT_EQ(on_device[r].stop_reason, on_host[r].stop_reason) << request;
          ASSERT_EQ(on_device[r].trace.size(), on_host[r].trace.size()) << request;
          for (size_t k = 0; k < on_host[r].trace.size(); ++k) {
            const RoundTrace &device_round = on_device[r].trace[k], &host_round = on_host[r].trace[k];
            EXPECT_EQ(device_round.draft, host_round.draft) << request << ", round " << k;
            EXPECT_EQ(device_round.confidence, host_round.confidence) << request << ", round " << k;
            EXPECT_EQ(device_round.accepted, host_round.accepted) << request << ", round " << k;
            EXPECT_EQ(device_round.emitted, host_round.emitted) << request << ", round " << k;
            ++rounds;
            rollbacks += host_round.accepted < int(host_round.draft.size());
            accepted += host_round.accepted;
          }
        }
      }
    }
  }
  std::printf("[ %s ] %ld rounds, %ld with rejected drafts rolled back, %ld drafted tokens accepted\n",
              GetParam().c_str(), rounds, rollbacks, accepted);
  EXPECT_GT(rollbacks, 0) << "no round rolled a rejected draft back";
}

// Drafts in the first two rounds of every `period` and leaves the others
// undrafted (as Alg 1's gate does while drafting does not pay).
class DraftsNowAndThen final : public VerifyScheduler {
 public:
  explicit DraftsNowAndThen(int period) : period_(period) {}
  int rows_to_draft(const RoundOutlook& outlook) override {
    return round_++ % period_ < 2 ? static_cast<int>(outlook.remaining.size()) : 0;
  }
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override {
    verify.clear();
    for (const Proposal& proposal : proposals) verify.push_back(int(proposal.tokens.size()));
  }

 private:
  int period_, round_ = 0;
};

TEST_P(CudaDrafting, DeviceRowsHeldOverUndraftedRoundsEqualHostTaps) {
  // Undrafted rounds leave their tapped rows in the CUDA target's tap ring
  // until the next draft (period 20) or until the ring comes round to them
  // (period 90: 64 forwards); either way every draft equals the one drafted
  // from host taps, bit for bit.
  std::vector<std::vector<int32_t>> prompts;
  const Json forward = testing::golden_reference("qwen3", "forward.json");
  for (const auto& prompt : forward["prompts"]) prompts.push_back(prompt["ids"].get<std::vector<int32_t>>());
  CudaDSparkSource device_source(drafter_, *cuda_target_head(*target_));
  CudaDSparkSource inner(drafter_, *cuda_target_head(*target_));
  HostTapsSource host_source(inner);
  SpeculativeOptions options;
  options.max_new_tokens = 150;
  options.ignore_eos = true;
  options.trace = true;
  options.gamma = 4;
  for (const int period : {20, 90}) {
    DraftsNowAndThen device_schedule(period), host_schedule(period);
    options.scheduler = &device_schedule;
    const auto on_device = speculative_generate(*target_, device_source, prompts, options);
    options.scheduler = &host_schedule;
    const auto on_host = speculative_generate(*target_, host_source, prompts, options);
    long drafted_rounds = 0;
    for (size_t r = 0; r < on_host.size(); ++r) {
      const std::string what = "period " + std::to_string(period) + ", request " + std::to_string(r);
      EXPECT_EQ(on_device[r].tokens, on_host[r].tokens) << what;
      ASSERT_EQ(on_device[r].trace.size(), on_host[r].trace.size()) << what;
      for (size_t k = 0; k < on_host[r].trace.size(); ++k) {
        EXPECT_EQ(on_device[r].trace[k].draft, on_host[r].trace[k].draft) << what << ", round " << k;
        EXPECT_EQ(on_device[r].trace[k].confidence, on_host[r].trace[k].confidence) << what << ", round " << k;
        drafted_rounds += !on_host[r].trace[k].draft.empty();
      }
    }
    EXPECT_GT(drafted_rounds, long(2 * prompts.size())) << "period " << period << ": drafts after undrafted rounds";
  }
}

TEST_P(CudaDrafting, ThresholdPruningFollowsTheSourcesSetting) {
  // config.sts thresholds above every confidence: the default source drafts
  // position 0 only; one built without calibrated thresholds (bench spec's off
  // and alg1 modes, calibration) drafts all γ, on the GPU beside a CUDA target
  // (bench spec built it from the host copy of the target's head, absent there,
  // and crashed).
  const int gamma = drafter_.config.gamma;
  drafter_.config.sts = StsCalibration{std::vector<float>(gamma, 2.0f), {}, 0.9f, 100};
  const std::unique_ptr<DraftSource> pruned = make_dspark_source(drafter_, *target_, nullptr, 0.0f, true);
  const std::unique_ptr<DraftSource> unpruned = make_dspark_source(drafter_, *target_, nullptr, 0.0f, false);
  EXPECT_NE(dynamic_cast<CudaDSparkSource*>(unpruned.get()), nullptr);
  const int row = 0, limit = gamma;
  const int32_t pending = tokens_[9];
  std::vector<Proposal> proposals;
  for (auto [source, expected] : {std::pair{pruned.get(), 1}, std::pair{unpruned.get(), gamma}}) {
    source->begin(row, tokens_, 5);
    source->accept(row, std::span(tokens_).first(9), taps(0));
    source->propose({&row, 1}, {&pending, 1}, {&limit, 1}, cpu::SamplingParams{}, proposals);
    EXPECT_EQ(proposals[0].tokens.size(), size_t(expected));
    EXPECT_EQ(proposals[0].confidence.size(), size_t(expected));
    source->end(row);
  }
}

TEST_P(CudaDrafting, LoadDraftSourcePicksTheGpuDrafterForACudaTarget) {
  testing::TemporaryDirectory directory;
  save_drafter(drafter_, directory.path);
  LoadedDraftSource loaded = load_draft_source(directory.path.string(), golden_model("qwen3"), *target_, 0.0f);
  EXPECT_NE(dynamic_cast<CudaDSparkSource*>(loaded.source.get()), nullptr);
  EXPECT_TRUE(loaded.head == nullptr) << "the host copy of the target's head is not loaded for GPU drafting";
  CpuTarget cpu_target(*host_);
  LoadedDraftSource on_cpu = load_draft_source(directory.path.string(), golden_model("qwen3"), cpu_target, 0.0f);
  EXPECT_EQ(dynamic_cast<CudaDSparkSource*>(on_cpu.source.get()), nullptr);
}

INSTANTIATE_TEST_SUITE_P(Heads, CudaDrafting, ::testing::Values("markov", "rnn", "gru"));

}  // namespace
}  // namespace dspark
