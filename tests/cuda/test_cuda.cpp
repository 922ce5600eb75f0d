// CUDA against the CPU reference: every op on random inputs (same names, same
// shapes), then the whole CUDA target on the golden models (bf16 tolerance),
// graphs, padding, rollback and greedy decoding. Runs on a GPU machine:
// tests/tools/run_cuda_checks.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/dtype.h"
#include "core/file.h"
#include "core/random.h"
#include "device_test_util.h"
#include "golden.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/buffer.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/sampling.h"
#include "model/cpu_target.h"
#include "model/generate.h"
#include "model/perplexity.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/dspark_source.h"
#include "spec/ngram_source.h"
#include "spec/speculative.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using testing::bf16_rounded;
using testing::expect_greedy_equals_plain;
using testing::from_device;
using testing::golden_model;
using testing::golden_reference;
using testing::kBf16Tolerance;
using testing::one_token_prompt_with_clear_greedy;
using testing::random_values;
using testing::relative_error;
using testing::to_device;
using testing::to_device_bf16;

// ---------------------------------------------------------------- ops

TEST(CudaOps, RmsnormWithResidualAndTaps) {
  for (int dim : {320, 4096, 322}) {  // vector kernels, and the scalar one for odd sizes
    const int rows = 5;
    const auto x = random_values(rows * dim, 1), weight = random_values(dim, 2);
    const auto delta = bf16_rounded(random_values(rows * dim, 3));
    std::vector<float> summed(x), expected(rows * dim);
    cpu::residual_add(summed.data(), delta.data(), summed.size());
    cpu::rmsnorm_forward(expected.data(), summed.data(), weight.data(), rows, dim, 1e-6f);

    auto residual = to_device(x);
    auto delta_device = to_device_bf16(delta);
    auto weight_device = to_device(weight);
    DeviceBuffer<bf16> out(rows * dim);
    DeviceBuffer<float> taps(rows * 2 * dim);
    cuda::residual_add_rmsnorm_forward(residual.data(), delta_device.data(), out.data(), weight_device.data(), rows,
                                       dim, 1e-6f, taps.data(), taps.data() + dim, 2 * dim, nullptr);
    EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance) << dim;
    EXPECT_LE(relative_error(from_device(residual).data(), summed.data(), summed.size()), 1e-6) << dim;
    const auto tap_values = from_device(taps);
    for (int r = 0; r < rows; ++r) {
      EXPECT_LE(relative_error(tap_values.data() + r * 2 * dim, summed.data() + r * dim, dim), 1e-6) << dim;
      EXPECT_LE(relative_error(tap_values.data() + r * 2 * dim + dim, expected.data() + r * dim, dim), 1e-5) << dim;
    }
  }
}

TEST(CudaOps, SwigluMatchesCpu) {
  const int rows = 3, F = 300;
  const auto gate_up = bf16_rounded(random_values(rows * 2 * F, 4, 3.0f));
  std::vector<float> expected(rows * F);
  for (int r = 0; r < rows; ++r)
    cpu::swiglu_forward(expected.data() + r * F, gate_up.data() + r * 2 * F, gate_up.data() + r * 2 * F + F, F);
  auto input = to_device_bf16(gate_up);
  DeviceBuffer<bf16> out(rows * F);
  cuda::swiglu_forward(out.data(), input.data(), rows, F, nullptr);
  EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance);
}

TEST(CudaOps, MatmulMatchesCpu) {
  for (int rows : {1, 3, 8, 64, 300}) {
    const int in = 256, out_features = 384;
    const auto x = bf16_rounded(random_values(rows * in, 5)), weight = bf16_rounded(random_values(out_features * in, 6));
    const auto bias = bf16_rounded(random_values(out_features, 7));
    std::vector<float> expected(rows * out_features);
    cpu::matmul_forward(expected.data(), x.data(), weight.data(), bias.data(), rows, in, out_features);
    auto x_device = to_device_bf16(x), weight_device = to_device_bf16(weight), bias_device = to_device_bf16(bias);
    DeviceBuffer<bf16> out(rows * out_features);
    cuda::matmul_forward(out.data(), cuda::MatmulOutput::BF16, x_device.data(), weight_device.data(),
                         bias_device.data(), rows, in, out_features, nullptr);
    EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance) << rows;
    DeviceBuffer<float> out_f32(rows * out_features);
    cpu::matmul_forward(expected.data(), x.data(), weight.data(), nullptr, rows, in, out_features);
    cuda::matmul_forward(out_f32.data(), cuda::MatmulOutput::F32, x_device.data(), weight_device.data(), nullptr,
                         rows, in, out_features, nullptr);
    EXPECT_LE(relative_error(from_device(out_f32).data(), expected.data(), expected.size()), 1e-5) << rows;
  }
}

// CPU reference of gated_matmul_forward: act(gate) * up with gate and up
// rounded to bf16 first (they pass through the bf16 gate|up buffer).
std::vector<float> gated_reference(cuda::GatedActivation activation, const std::vector<float>& x,
                                   const std::vector<float>& weight, const std::vector<float>& bias, int rows, int in,
                                   int out_features) {
  std::vector<float> gate_up(size_t(rows) * 2 * out_features), activated(size_t(rows) * out_features);
  cpu::matmul_forward(gate_up.data(), x.data(), weight.data(), bias.empty() ? nullptr : bias.data(), rows, in,
                      2 * out_features);
  gate_up = bf16_rounded(gate_up);
  for (int r = 0; r < rows; ++r) {
    const float* gate = gate_up.data() + size_t(r) * 2 * out_features;
    float* out = activated.data() + size_t(r) * out_features;
    if (activation == cuda::GatedActivation::Silu)
      cpu::swiglu_forward(out, gate, gate + out_features, out_features);
    else
      cpu::gelu_tanh_gate_forward(out, gate, gate + out_features, out_features);
  }
  return activated;
}

TEST(CudaOps, GatedMatmulMatchesCpu) {
  for (auto activation : {cuda::GatedActivation::Silu, cuda::GatedActivation::GeluTanh}) {
    for (int rows : {1, 4, 16, 20}) {  // a GEMV with the activation in its epilogue, or cuBLASLt and the kernel
      const int in = 512, out_features = 256;
      const auto x = bf16_rounded(random_values(rows * in, 11, 2.0f));
      const auto weight = bf16_rounded(random_values(2 * out_features * in, 12));
      const auto bias = bf16_rounded(random_values(2 * out_features, 13));
      const auto expected = gated_reference(activation, x, weight, bias, rows, in, out_features);
      auto x_device = to_device_bf16(x), weight_device = to_device_bf16(weight), bias_device = to_device_bf16(bias);
      DeviceBuffer<bf16> scratch(rows * 2 * out_features), out(rows * out_features);
      cuda::gated_matmul_forward(out.data(), activation, x_device.data(), weight_device.data(), bias_device.data(),
                                 scratch.data(), rows, in, out_features, nullptr);
      EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance) << rows;
    }
  }
}

// The operands of a residual add + norm over rows of `dim`, on the device,
// with taps at stride 2 * dim (the residual first, the normed row second).
struct ResidualNormOperands {
  DeviceBuffer<float> residual, weight, taps;
  DeviceBuffer<bf16> normed;
  DeviceBuffer<unsigned> counter{1};
  ResidualNormOperands(const std::vector<float>& initial, const std::vector<float>& norm_weight, int rows, int dim)
      : residual(to_device(initial)), weight(to_device(norm_weight)), taps(size_t(rows) * 2 * dim),
        normed(size_t(rows) * dim) {
    CUDA_CHECK(cudaMemset(counter.data(), 0, counter.bytes()));
  }
  cuda::ResidualNorm operands(int dim) {
    return {residual.data(), weight.data(), normed.data(), 1e-6f, taps.data(), taps.data() + dim, 2L * dim,
            counter.data()};
  }
};

TEST(CudaOps, MatmulResidualRmsnormMatchesCpu) {
  for (int rows : {1, 4, 16, 20}) {  // the norm in a GEMV's last block, or cuBLASLt and the norm kernel
    const int in = 512, dim = 384;
    const auto x = bf16_rounded(random_values(rows * in, 14)), weight = bf16_rounded(random_values(dim * in, 15));
    const auto initial = random_values(rows * dim, 16, 4.0f), norm_weight = random_values(dim, 17);
    std::vector<float> product(rows * dim);
    cpu::matmul_forward(product.data(), x.data(), weight.data(), nullptr, rows, in, dim);

    auto x_device = to_device_bf16(x), weight_device = to_device_bf16(weight);
    ResidualNormOperands norm(initial, norm_weight, rows, dim);
    DeviceBuffer<bf16> delta(rows * dim);
    cuda::matmul_residual_rmsnorm_forward(delta.data(), x_device.data(), weight_device.data(), nullptr, rows, in, dim,
                                          norm.operands(dim), nullptr);
    // The delta is the product in bf16; the residual and the norm follow from the delta as computed.
    std::vector<float> summed = from_device(delta), expected(rows * dim);
    EXPECT_LE(relative_error(summed.data(), product.data(), product.size()), kBf16Tolerance) << rows;
    cpu::residual_add(summed.data(), initial.data(), summed.size());
    cpu::rmsnorm_forward(expected.data(), summed.data(), norm_weight.data(), rows, dim, 1e-6f);
    EXPECT_EQ(from_device(norm.residual), summed) << rows;
    EXPECT_LE(relative_error(from_device(norm.normed).data(), expected.data(), expected.size()), kBf16Tolerance)
        << rows;
    const auto taps = from_device(norm.taps);
    for (int r = 0; r < rows; ++r) {
      EXPECT_TRUE(std::equal(summed.begin() + r * dim, summed.begin() + (r + 1) * dim, taps.begin() + r * 2 * dim))
          << rows;
      EXPECT_LE(relative_error(taps.data() + r * 2 * dim + dim, expected.data() + r * dim, dim), 1e-5) << rows;
    }
    EXPECT_EQ(from_device(norm.counter)[0], 0u);
  }
}

TEST(CudaOps, GemvKernelsMatchCpuAndTheirFusedEpiloguesEqualTheUnfusedKernels) {
  // Each GEMV kernel at the row counts it takes, out_features with a partial
  // last warp and block (1004 = 4 * 251 = 16 * 62 + 12) and one of a single
  // block. The plain product matches the CPU; four features per warp give
  // exactly the one-feature bits (the same summation order); on the tensor
  // cores, whole or in row groups of 16, every row has exactly the bits of the
  // same row multiplied alone (the target's decode and verify steps rely on
  // it); streamed (17-32 rows), every output has the tensor cores' bits, so
  // each row too; a fused epilogue gives exactly the bits of the kernel's
  // plain product followed by the activation or norm kernel. in = 288: a
  // multiple of 32 but not of the tensor cores' chunk of 64 (the streamed
  // kernel's last K box zero-filled past K); in = 448: 7 K boxes of 64, which
  // the streamed kernel copies 7 at a time where a block owns one group of 16
  // rows and 3 at a time where it owns 3 (48 features per SM: its last copy
  // holds 2 boxes past K). 48 features per SM: products of 1.5 to 3 waves of
  // two blocks per SM, which the tensor cores run three per SM from 1 to 8
  // rows (FEW_WAVES), so those rows are also held to the 9-64-row products'
  // rows.
  using cuda::GemvKernel;
  const int multiprocessors = cuda::multiprocessor_count();
  for (int in : {288, 448})
    for (int rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64}) {
      for (int out_features : {1004, 24, 48 * multiprocessors}) {
        const auto x = bf16_rounded(random_values(rows * in, 110 + rows, 2.0f));
        const auto weight = bf16_rounded(random_values(2 * out_features * in, 111));
        const auto bias = bf16_rounded(random_values(2 * out_features, 112));
        auto x_device = to_device_bf16(x), weight_device = to_device_bf16(weight), bias_device = to_device_bf16(bias);
        std::vector<float> expected(size_t(rows) * 2 * out_features);
        cpu::matmul_forward(expected.data(), x.data(), weight.data(), bias.data(), rows, in, 2 * out_features);
        const auto initial = random_values(rows * out_features, 113, 4.0f),
                   norm_weight = random_values(out_features, 114);
        std::vector<float> one_feature, tensor_cores;
        for (GemvKernel kernel :
             {GemvKernel::OneFeaturePerWarp, GemvKernel::FourFeaturesPerWarp, GemvKernel::TensorCores,
              GemvKernel::TensorCoresInRowGroups, GemvKernel::TensorCoresStreamed}) {
          const bool few_row_kernel =
              kernel == GemvKernel::OneFeaturePerWarp || kernel == GemvKernel::FourFeaturesPerWarp;
          if (few_row_kernel && rows > 8) continue;
          if ((kernel == GemvKernel::TensorCoresInRowGroups || kernel == GemvKernel::TensorCoresStreamed) && rows <= 16)
            continue;
          if (kernel == GemvKernel::TensorCoresStreamed && rows > 32) continue;
          const std::string what = std::to_string(rows) + " x " + std::to_string(in) + " -> " +
                                   std::to_string(out_features) + ", kernel " + std::to_string(int(kernel));
          auto gemv = [&](void* out, cuda::MatmulOutput type, cuda::GemvEpilogue epilogue, int width,
                          const cuda::ResidualNorm& norm) {
            cuda::gemv_matmul_forward(out, type, epilogue, kernel, x_device.data(), weight_device.data(),
                                      bias_device.data(), rows, in, width, norm, nullptr);
          };
          // Store, over the whole gate|up weight.
          DeviceBuffer<float> stored(size_t(rows) * 2 * out_features);
          gemv(stored.data(), cuda::MatmulOutput::F32, cuda::GemvEpilogue::Store, 2 * out_features, {});
          const auto values = from_device(stored);
          EXPECT_LE(relative_error(values.data(), expected.data(), expected.size()), 1e-5) << what;
          if (kernel == GemvKernel::OneFeaturePerWarp) one_feature = values;
          if (kernel == GemvKernel::FourFeaturesPerWarp) {
            EXPECT_EQ(values, one_feature) << what;
          }
          if (kernel == GemvKernel::TensorCores || kernel == GemvKernel::TensorCoresInRowGroups) {
            DeviceBuffer<float> row_alone(2 * out_features);
            for (int r = 0; r < rows; ++r) {
              cuda::gemv_matmul_forward(row_alone.data(), cuda::MatmulOutput::F32, cuda::GemvEpilogue::Store,
                                        GemvKernel::TensorCores, x_device.data() + r * in, weight_device.data(),
                                        bias_device.data(), 1, in, 2 * out_features, {}, nullptr);
              EXPECT_TRUE(std::equal(values.begin() + size_t(r) * 2 * out_features,
                                     values.begin() + size_t(r + 1) * 2 * out_features, from_device(row_alone).begin()))
                  << what << ", row " << r << " differs from the row alone";
            }
          }
          if (kernel == GemvKernel::TensorCores) tensor_cores = values;
          if (kernel == GemvKernel::TensorCoresStreamed) {  // the tensor cores' bits, so each row's alone
            EXPECT_EQ(values, tensor_cores) << what;
          }
          DeviceBuffer<bf16> gate_up(size_t(rows) * 2 * out_features);
          gemv(gate_up.data(), cuda::MatmulOutput::BF16, cuda::GemvEpilogue::Store, 2 * out_features, {});

          // Gated: this kernel's gate|up, then the activation kernel.
          for (auto epilogue : {cuda::GemvEpilogue::Silu, cuda::GemvEpilogue::GeluTanh}) {
            DeviceBuffer<bf16> unfused(size_t(rows) * out_features), fused(size_t(rows) * out_features);
            if (epilogue == cuda::GemvEpilogue::Silu)
              cuda::swiglu_forward(unfused.data(), gate_up.data(), rows, out_features, nullptr);
            else
              cuda::gelu_tanh_gate_forward(unfused.data(), gate_up.data(), rows, out_features, nullptr);
            gemv(fused.data(), cuda::MatmulOutput::BF16, epilogue, out_features, {});
            EXPECT_EQ(from_device(fused), from_device(unfused)) << what << ", epilogue " << int(epilogue);
          }

          // ResidualNorm: this kernel's product over the first out_features rows, then the norm kernel.
          ResidualNormOperands separate(initial, norm_weight, rows, out_features),
              fused(initial, norm_weight, rows, out_features);
          DeviceBuffer<bf16> delta(size_t(rows) * out_features), fused_delta(size_t(rows) * out_features);
          gemv(delta.data(), cuda::MatmulOutput::BF16, cuda::GemvEpilogue::Store, out_features, {});
          const cuda::ResidualNorm unfused = separate.operands(out_features);
          cuda::residual_add_rmsnorm_forward(unfused.residual, delta.data(), unfused.normed, unfused.weight, rows,
                                             out_features, unfused.eps, unfused.residual_tap, unfused.normed_tap,
                                             unfused.tap_stride, nullptr);
          gemv(fused_delta.data(), cuda::MatmulOutput::BF16, cuda::GemvEpilogue::ResidualNorm, out_features,
               fused.operands(out_features));
          EXPECT_EQ(from_device(fused_delta), from_device(delta)) << what;
          EXPECT_EQ(from_device(fused.residual), from_device(separate.residual)) << what;
          EXPECT_EQ(from_device(fused.normed), from_device(separate.normed)) << what;
          const auto fused_taps = from_device(fused.taps), separate_taps = from_device(separate.taps);
          const auto [fused_at, separate_at] =
              std::mismatch(fused_taps.begin(), fused_taps.end(), separate_taps.begin());
          const long at = fused_at - fused_taps.begin();
          EXPECT_EQ(fused_at, fused_taps.end())
              << what << ": the taps differ first in row " << at / (2 * out_features)
              << (at % (2 * out_features) < out_features ? ", residual" : ", normed") << " element "
              << at % out_features << ": " << *fused_at << " against " << *separate_at;
          EXPECT_EQ(from_device(fused.counter)[0], 0u) << what;
        }
      }
    }
}

TEST(CudaOps, QkvNormRopeAndCacheAppendMatchCpu) {
  const int rows = 4, heads = 4, kv_heads = 2, head_dim = 64, half = head_dim / 2;
  const int width = (heads + 2 * kv_heads) * head_dim;
  const auto qkv = bf16_rounded(random_values(rows * width, 8, 2.0f));
  const auto q_norm = random_values(head_dim, 9), k_norm = random_values(head_dim, 10);
  const std::vector<int32_t> positions = {0, 5, 17, 300}, slots = {3, 0, 7, 1};
  std::vector<double> frequencies(half);
  for (int i = 0; i < half; ++i) frequencies[i] = 1.0 / std::pow(10000.0, 2.0 * i / head_dim);
  std::vector<float2> table(512 * half);
  for (int p = 0; p < 512; ++p)
    for (int i = 0; i < half; ++i)
      table[p * half + i] = make_float2(float(std::cos(p * frequencies[i])), float(std::sin(p * frequencies[i])));
  for (bool with_norm : {true, false}) {
    // CPU: split q | k | v, norm, rope.
    std::vector<float> q(rows * heads * head_dim), k(rows * kv_heads * head_dim), v(rows * kv_heads * head_dim);
    for (int r = 0; r < rows; ++r) {
      std::copy_n(qkv.data() + r * width, heads * head_dim, q.data() + r * heads * head_dim);
      std::copy_n(qkv.data() + r * width + heads * head_dim, kv_heads * head_dim, k.data() + r * kv_heads * head_dim);
      std::copy_n(qkv.data() + r * width + (heads + kv_heads) * head_dim, kv_heads * head_dim,
                  v.data() + r * kv_heads * head_dim);
    }
    if (with_norm) {
      cpu::rmsnorm_forward(q.data(), q.data(), q_norm.data(), rows * heads, head_dim, 1e-6f);
      cpu::rmsnorm_forward(k.data(), k.data(), k_norm.data(), rows * kv_heads, head_dim, 1e-6f);
    }
    cpu::rope_forward(q.data(), positions.data(), rows, heads, head_dim, frequencies.data());
    cpu::rope_forward(k.data(), positions.data(), rows, kv_heads, head_dim, frequencies.data());

    auto qkv_device = to_device_bf16(qkv);
    auto q_norm_device = to_device(q_norm), k_norm_device = to_device(k_norm);
    auto positions_device = to_device(positions), slots_device = to_device(slots);
    auto table_device = to_device(table);
    DeviceBuffer<bf16> q_out(rows * heads * head_dim), keys(8 * kv_heads * head_dim), values(8 * kv_heads * head_dim);
    cuda::qkv_rope_kv_append_forward(q_out.data(), qkv_device.data(), with_norm ? q_norm_device.data() : nullptr,
                                     with_norm ? k_norm_device.data() : nullptr, positions_device.data(),
                                     table_device.data(), keys.data(), values.data(), slots_device.data(), rows, heads,
                                     kv_heads, head_dim, 1e-6f, nullptr);
    EXPECT_LE(relative_error(from_device(q_out).data(), q.data(), q.size()), kBf16Tolerance);
    const auto cached_keys = from_device(keys), cached_values = from_device(values);
    for (int r = 0; r < rows; ++r) {
      const int stride = kv_heads * head_dim;
      EXPECT_LE(relative_error(cached_keys.data() + slots[r] * stride, k.data() + r * stride, stride), kBf16Tolerance);
      EXPECT_LE(relative_error(cached_values.data() + slots[r] * stride, v.data() + r * stride, stride), 1e-7);
    }
  }
}

// A step's attention metadata on the device, one entry a sequence; `batch`
// points into the buffers (so the struct is never copied).
struct DeviceAttentionBatch {
  DeviceBuffer<int32_t> query_start, query_length, length, table_row, table;
  cuda::AttentionBatch batch;
  DeviceAttentionBatch(const std::vector<int32_t>& starts, const std::vector<int32_t>& query_lengths,
                       const std::vector<int32_t>& lengths, const std::vector<int32_t>& table_rows,
                       const std::vector<int32_t>& block_table, int max_blocks, int max_query_length)
      : query_start(to_device(starts)),
        query_length(to_device(query_lengths)),
        length(to_device(lengths)),
        table_row(to_device(table_rows)),
        table(to_device(block_table)),
        batch{query_start.data(),
              query_length.data(),
              length.data(),
              table_row.data(),
              table.data(),
              max_blocks,
              static_cast<int>(starts.size()),
              max_query_length} {}
  DeviceAttentionBatch(const DeviceAttentionBatch&) = delete;
  DeviceAttentionBatch& operator=(const DeviceAttentionBatch&) = delete;
};

TEST(CudaOps, PagedAttentionMatchesCpu) {
  // Three sequences of different lengths and query counts, blocks scattered
  // through the pool, grouped-query heads; with and without split-KV.
  const int heads = 8, kv_heads = 2, head_dim = 128, max_blocks = 8, pool_blocks = 24;
  const std::vector<int> lengths = {5, 70, 200}, query_lengths = {1, 9, 4};
  const int stride = kv_heads * head_dim;
  std::vector<std::vector<float>> keys, values;
  std::vector<int32_t> table(3 * max_blocks, 0), query_start, table_rows = {2, 0, 1};
  std::vector<float> q_all;
  std::vector<float> pool_keys(pool_blocks * cuda::kBlockSize * stride), pool_values(pool_keys.size());
  int next_block = pool_blocks - 1, total_rows = 0;
  for (int s = 0; s < 3; ++s) {
    keys.push_back(bf16_rounded(random_values(lengths[s] * stride, 20 + s)));
    values.push_back(bf16_rounded(random_values(lengths[s] * stride, 30 + s)));
    for (int b = 0; b * cuda::kBlockSize < lengths[s]; ++b) table[table_rows[s] * max_blocks + b] = next_block--;
    for (int p = 0; p < lengths[s]; ++p) {
      const int slot = table[table_rows[s] * max_blocks + p / cuda::kBlockSize] * cuda::kBlockSize + p % cuda::kBlockSize;
      std::copy_n(keys[s].data() + p * stride, stride, pool_keys.data() + slot * stride);
      std::copy_n(values[s].data() + p * stride, stride, pool_values.data() + slot * stride);
    }
    query_start.push_back(total_rows);
    total_rows += query_lengths[s];
  }
  q_all = bf16_rounded(random_values(total_rows * heads * head_dim, 40));
  std::vector<float> expected(total_rows * heads * head_dim), scores(256);
  for (int s = 0; s < 3; ++s)
    cpu::attention_forward(expected.data() + query_start[s] * heads * head_dim,
                           q_all.data() + query_start[s] * heads * head_dim, keys[s].data(), values[s].data(),
                           query_lengths[s], lengths[s] - query_lengths[s], heads, kv_heads, head_dim, scores.data());

  auto q_device = to_device_bf16(q_all), keys_device = to_device_bf16(pool_keys), values_device = to_device_bf16(pool_values);
  const DeviceAttentionBatch step(query_start, query_lengths, lengths, table_rows, table, max_blocks, 9);
  const cuda::AttentionBatch& batch = step.batch;
  // One split (one CTA covers every position), or splits at fixed positions
  // (kSplitTiles tiles each): the fewest that cover the longest sequence, and
  // more (those past a sequence's end add nothing).
  const int fewest = (200 + cuda::kSplitTiles * cuda::kBlockSize - 1) / (cuda::kSplitTiles * cuda::kBlockSize);
  for (int splits : {1, fewest, fewest + 1, 16}) {
    DeviceBuffer<bf16> out(total_rows * heads * head_dim);
    DeviceBuffer<float> partial_out(splits * total_rows * heads * head_dim), partial_lse(splits * total_rows * heads);
    auto counters = to_device(std::vector<unsigned>(cuda::attention_counters(3, 9, heads, kv_heads), 0));
    cuda::attention_forward(out.data(), q_device.data(), keys_device.data(), values_device.data(), batch, total_rows,
                            heads, kv_heads, head_dim, splits, partial_out.data(), partial_lse.data(), counters.data(),
                            nullptr);
    EXPECT_EQ(from_device(counters), std::vector<unsigned>(counters.size(), 0)) << "left for the next call";
    EXPECT_LE(relative_error(from_device(out).data(), expected.data(), expected.size()), kBf16Tolerance)
        << "splits " << splits;
  }
}

// A step with many rows, kv heads and splits gives each CTA several
// consecutive splits (attention.cu's split_group), one with few rows a CTA per
// split; every split is reduced alone either way, so a query row has the same
// bits in both: here a decode row alone (few splits a CTA) and the same row
// as the first of an 8-token verify block beside 7 other sequences (many
// splits a CTA), and both within bf16 rounding of the CPU. The block's last
// query alone and in the batch sit at other rows of their CTAs' mma
// fragments, which must not change their bits either.
TEST(CudaOps, AttentionGivesARowItsBitsWhateverTheSplitsPerBlock) {
  const int heads = 32, kv_heads = 8, head_dim = 64, length = 500, block_q = 8, sequences = 8;
  const int stride = kv_heads * head_dim, max_blocks = (length + cuda::kBlockSize - 1) / cuda::kBlockSize;
  const int splits = 16;  // covers 512 positions, at least `length`
  // One sequence's cache (blocks 0..max_blocks-1 in reverse order), read by every sequence of the batch.
  const auto keys = bf16_rounded(random_values(long(max_blocks) * cuda::kBlockSize * stride, 70));
  const auto values = bf16_rounded(random_values(keys.size(), 71));
  std::vector<int32_t> table(max_blocks);
  for (int b = 0; b < max_blocks; ++b) table[b] = max_blocks - 1 - b;
  const auto q = bf16_rounded(random_values(long(sequences) * block_q * heads * head_dim, 72));
  auto keys_device = to_device_bf16(keys), values_device = to_device_bf16(values), q_device = to_device_bf16(q);
  // `count` sequences of query_length queries, the first at row first_query of q; out from that row on.
  auto run = [&](int count, int query_length, int sequence_length, int first_query = 0) {
    std::vector<int32_t> starts(count), query_lengths(count, query_length), lengths(count, sequence_length),
        rows(count, 0);
    for (int s = 0; s < count; ++s) starts[s] = first_query + s * query_length;
    const DeviceAttentionBatch step(starts, query_lengths, lengths, rows, table, max_blocks, query_length);
    const cuda::AttentionBatch& batch = step.batch;
    const int total_rows = first_query + count * query_length;
    DeviceBuffer<bf16> out(long(total_rows) * heads * head_dim);
    DeviceBuffer<float> partial_out(long(splits) * total_rows * heads * head_dim),
        partial_lse(long(splits) * total_rows * heads);
    auto counters = to_device(std::vector<unsigned>(cuda::attention_counters(count, query_length, heads, kv_heads), 0));
    cuda::attention_forward(out.data(), q_device.data(), keys_device.data(), values_device.data(), batch, total_rows,
                            heads, kv_heads, head_dim, splits, partial_out.data(), partial_lse.data(), counters.data(),
                            nullptr);
    EXPECT_EQ(from_device(counters), std::vector<unsigned>(counters.size(), 0)) << "left for the next call";
    const auto all = from_device(out);
    return std::vector<float>(all.begin() + long(first_query) * heads * head_dim, all.end());
  };
  // The decode row: query 0 at position length - block_q, its keys 0..length - block_q.
  const auto alone = run(1, 1, length - block_q + 1);
  const auto in_batch = run(sequences, block_q, length);
  const std::vector<float> first_row(in_batch.begin(), in_batch.begin() + heads * head_dim);
  EXPECT_EQ(first_row, alone);
  // The block's last query decoded alone: its heads are the CTA's first rows
  // there, and the last rows of the block's last row block here.
  const auto last_alone = run(1, 1, length, block_q - 1);
  const std::vector<float> last_row(in_batch.begin() + (block_q - 1) * heads * head_dim,
                                    in_batch.begin() + block_q * heads * head_dim);
  EXPECT_EQ(last_row, last_alone);
  // The CPU reads the keys and values in position order.
  std::vector<float> ordered_keys(long(length) * stride), ordered_values(ordered_keys.size());
  for (int p = 0; p < length; ++p) {
    const long slot = long(table[p / cuda::kBlockSize]) * cuda::kBlockSize + p % cuda::kBlockSize;
    std::copy_n(keys.data() + slot * stride, stride, ordered_keys.data() + long(p) * stride);
    std::copy_n(values.data() + slot * stride, stride, ordered_values.data() + long(p) * stride);
  }
  std::vector<float> expected(heads * head_dim), scores(length);
  cpu::attention_forward(expected.data(), q.data(), ordered_keys.data(), ordered_values.data(), 1, length - block_q,
                         heads, kv_heads, head_dim, scores.data());
  EXPECT_LE(relative_error(alone.data(), expected.data(), expected.size()), kBf16Tolerance);
  // Every row of the batch against the CPU (sequence s's queries, the same keys).
  std::vector<float> block_expected(block_q * heads * head_dim);
  for (int s = 0; s < sequences; ++s) {
    cpu::attention_forward(block_expected.data(), q.data() + long(s) * block_q * heads * head_dim, ordered_keys.data(),
                           ordered_values.data(), block_q, length - block_q, heads, kv_heads, head_dim, scores.data());
    EXPECT_LE(relative_error(in_batch.data() + long(s) * block_q * heads * head_dim, block_expected.data(),
                             block_expected.size()),
              kBf16Tolerance)
        << "sequence " << s;
  }
}

// Decode and verify steps run the q/k norm, RoPE and the cache append inside
// the attention kernel (AttentionRope): its outputs and the cache it leaves
// must be those of the RoPE kernel followed by the attention, bit for bit,
// for ragged sequences whose step rows span tiles and row blocks, with split
// KV and without, with q/k norm and without.
TEST(CudaOps, AttentionWithRopeInsideEqualsRopeThenAttention) {
  const int heads = 8, kv_heads = 2, head_dim = 128, half = head_dim / 2, max_blocks = 8, pool_blocks = 24;
  const int width = (heads + 2 * kv_heads) * head_dim, stride = kv_heads * head_dim;
  const std::vector<int> lengths = {5, 70, 200}, query_lengths = {1, 16, 9};
  std::vector<int32_t> table(3 * max_blocks, 0), table_rows = {2, 0, 1}, query_start, positions, slots;
  int next_block = pool_blocks - 1, total_rows = 0;
  for (int s = 0; s < 3; ++s) {
    for (int b = 0; b * cuda::kBlockSize < lengths[s]; ++b) table[table_rows[s] * max_blocks + b] = next_block--;
    query_start.push_back(total_rows);
    total_rows += query_lengths[s];
    for (int p = lengths[s] - query_lengths[s]; p < lengths[s]; ++p) {
      positions.push_back(p);
      slots.push_back(table[table_rows[s] * max_blocks + p / cuda::kBlockSize] * cuda::kBlockSize +
                      p % cuda::kBlockSize);
    }
  }
  // The cache holds every slot's old rows (the step's own are overwritten).
  const auto pool_keys = bf16_rounded(random_values(pool_blocks * cuda::kBlockSize * stride, 60));
  const auto pool_values = bf16_rounded(random_values(pool_keys.size(), 61));
  const auto qkv = bf16_rounded(random_values(total_rows * width, 62, 2.0f));
  const auto q_norm = random_values(head_dim, 63), k_norm = random_values(head_dim, 64);
  std::vector<float2> table_values(256 * half);
  for (int p = 0; p < 256; ++p)
    for (int i = 0; i < half; ++i) {
      const double angle = p / std::pow(10000.0, 2.0 * i / head_dim);
      table_values[p * half + i] = make_float2(float(std::cos(angle)), float(std::sin(angle)));
    }
  auto qkv_device = to_device_bf16(qkv);
  auto q_norm_device = to_device(q_norm), k_norm_device = to_device(k_norm);
  auto rope_table = to_device(table_values);
  auto positions_device = to_device(positions), slots_device = to_device(slots);
  const DeviceAttentionBatch step(query_start, query_lengths, lengths, table_rows, table, max_blocks, 16);
  const cuda::AttentionBatch& batch = step.batch;
  const int fewest = (200 + cuda::kSplitTiles * cuda::kBlockSize - 1) / (cuda::kSplitTiles * cuda::kBlockSize);
  for (bool with_norm : {true, false}) {
    const float* q_norm_used = with_norm ? q_norm_device.data() : nullptr;
    const float* k_norm_used = with_norm ? k_norm_device.data() : nullptr;
    for (int splits : {1, fewest, 16}) {
      DeviceBuffer<float> partial_out(splits * total_rows * heads * head_dim), partial_lse(splits * total_rows * heads);
      auto counters = to_device(std::vector<unsigned>(cuda::attention_counters(3, 16, heads, kv_heads), 0));
      // The RoPE kernel, then the attention.
      auto keys_separate = to_device_bf16(pool_keys), values_separate = to_device_bf16(pool_values);
      DeviceBuffer<bf16> queries(total_rows * heads * head_dim), out_separate(total_rows * heads * head_dim);
      cuda::qkv_rope_kv_append_forward(queries.data(), qkv_device.data(), q_norm_used, k_norm_used,
                                       positions_device.data(), rope_table.data(), keys_separate.data(),
                                       values_separate.data(), slots_device.data(), total_rows, heads, kv_heads,
                                       head_dim, 1e-6f, nullptr);
      cuda::attention_forward(out_separate.data(), queries.data(), keys_separate.data(), values_separate.data(), batch,
                              total_rows, heads, kv_heads, head_dim, splits, partial_out.data(), partial_lse.data(),
                              counters.data(), nullptr);
      // Both inside the attention.
      auto keys_fused = to_device_bf16(pool_keys), values_fused = to_device_bf16(pool_values);
      DeviceBuffer<bf16> out_fused(total_rows * heads * head_dim);
      const cuda::AttentionRope rope{qkv_device.data(),       q_norm_used,         k_norm_used,
                                     positions_device.data(), rope_table.data(),   slots_device.data(),
                                     keys_fused.data(),       values_fused.data(), 1e-6f};
      cuda::attention_forward(out_fused.data(), nullptr, keys_fused.data(), values_fused.data(), batch, total_rows,
                              heads, kv_heads, head_dim, splits, partial_out.data(), partial_lse.data(),
                              counters.data(), nullptr, &rope);
      const std::string where = "splits " + std::to_string(splits) + (with_norm ? ", q/k norm" : ", no norm");
      EXPECT_EQ(from_device(out_fused), from_device(out_separate)) << where;
      EXPECT_EQ(from_device(keys_fused), from_device(keys_separate)) << where;
      EXPECT_EQ(from_device(values_fused), from_device(values_separate)) << where;
    }
  }
}

TEST(CudaOps, TokenSelectionMatchesCpuSampling) {
  const int vocab = 1000, rows = 64;
  const auto logits = random_values(rows * vocab, 50, 4.0f);
  Rng rng(51);
  std::vector<float> uniforms(rows);
  for (float& u : uniforms) u = static_cast<float>(rng.uniform());
  auto logits_device = to_device(logits), uniforms_device = to_device(uniforms);
  const std::vector<cpu::SamplingParams> settings = {
      {0.0f, 0, 1.0f}, {1.0f, 0, 1.0f}, {0.7f, 40, 1.0f}, {1.2f, 0, 0.8f}, {0.9f, 100, 0.5f}, {1.0f, 1, 1.0f}};
  for (const auto& params : settings) {
    cuda::DeviceSamplingParams device_params{params.temperature, params.top_k, params.top_p};
    auto params_device = to_device(std::vector<cuda::DeviceSamplingParams>{device_params});
    DeviceBuffer<int32_t> chosen(rows);
    cuda::select_tokens_forward(chosen.data(), logits_device.data(), uniforms_device.data(), params_device.data(), rows,
                                vocab, nullptr);
    const auto tokens = from_device(chosen);
    std::vector<float> probs(vocab);
    std::vector<int32_t> order;
    int agree = 0;
    for (int r = 0; r < rows; ++r) {
      cpu::processed_distribution(probs.data(), logits.data() + r * vocab, vocab, params, order);
      const int32_t expected = params.greedy() ? cpu::argmax(logits.data() + r * vocab, vocab)
                                               : cpu::sample_from_distribution(probs.data(), vocab, uniforms[r]);
      agree += tokens[r] == expected;
      EXPECT_GT(probs[tokens[r]], 0.0f) << "token outside the kept set, row " << r;
    }
    // A uniform within float rounding of an interval edge may pick the neighbour.
    EXPECT_GE(agree, rows - 1) << "T " << params.temperature << " k " << params.top_k << " p " << params.top_p;
  }
}

// ---------------------------------------------------------------- target

class CudaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    cuda_ = load_target(golden_model(GetParam()), "cuda");
    cpu_ = std::make_unique<CpuTarget>(load_transformer(golden_model(GetParam())));
    forward_ = golden_reference(GetParam(), "forward.json");
  }
  std::vector<int32_t> prompt(size_t index) const { return forward_["prompts"][index]["ids"].get<std::vector<int32_t>>(); }
  // Logits (and taps) of every row of `ids` from a fresh sequence on `target`.
  TargetResult full_forward(Target& target, const std::vector<int32_t>& ids, std::span<const int> taps = {}) {
    const int sequence = target.create_sequence(256);
    TargetInput input{sequence, ids, true};
    TargetRequest request;
    request.want_logits = true;
    request.taps = taps;
    TargetResult result;
    target.forward({&input, 1}, request, result);
    target.release_sequence(sequence);
    return result;
  }
  std::unique_ptr<Target> cuda_;
  std::unique_ptr<CpuTarget> cpu_;
  Json forward_;
};

constexpr double kModelTolerance = 3e-2;  // bf16 weights and activations through every layer
constexpr double kRowTolerance = 5e-2;    // the same for one row of logits (fewer values, more spread)

TEST_P(CudaGolden, LogitsAndTapsMatchCpu) {
  std::vector<int> taps;
  for (int j = 0; j <= cuda_->config().num_layers; ++j) taps.push_back(j);
  for (size_t index = 0; index < forward_["prompts"].size(); ++index) {
    const auto ids = prompt(index);
    const TargetResult gpu = full_forward(*cuda_, ids, taps), cpu = full_forward(*cpu_, ids, taps);
    const double logits_error = relative_error(gpu.logits.data(), cpu.logits.data(), cpu.logits.size());
    const double taps_error = relative_error(gpu.taps.data(), cpu.taps.data(), cpu.taps.size());
    EXPECT_LE(logits_error, kModelTolerance) << "prompt " << index;
    EXPECT_LE(taps_error, kModelTolerance) << "prompt " << index;
    std::printf("[ %s prompt %zu ] logits rel. error %.2e, taps %.2e\n", GetParam().c_str(), index, logits_error,
                taps_error);
  }
}

TEST_P(CudaGolden, DeviceTapsAreTheHostTapsLeftOnTheDevice) {
  // A ragged batch (every row, only the last row): with taps_on_device the
  // result holds a device view of exactly the rows the host copy would hold
  // (every input token, in input order), and no host taps; the CPU target
  // answers the same request with host taps.
  const std::vector<int> taps = {1, 0, cuda_->config().num_layers};
  const std::vector<std::vector<int32_t>> prompts = {prompt(0), prompt(2), prompt(3)};
  auto run = [&](Target& target, bool on_device, TargetResult& result) {
    std::vector<TargetInput> inputs;
    for (size_t s = 0; s < prompts.size(); ++s) inputs.push_back({target.create_sequence(128), prompts[s], s != 1});
    TargetRequest request;
    request.taps = taps;
    request.taps_on_device = on_device;
    target.forward(inputs, request, result);
    for (const TargetInput& input : inputs) target.release_sequence(input.sequence);
  };
  TargetResult host, device, cpu;
  run(*cuda_, false, host);
  EXPECT_EQ(host.device_taps, nullptr);
  run(*cuda_, true, device);
  ASSERT_NE(device.device_taps, nullptr);
  EXPECT_TRUE(device.taps.empty());
  EXPECT_EQ(device.tokens, host.tokens);
  std::vector<float> copied(host.taps.size());
  CUDA_CHECK(cudaMemcpy(copied.data(), device.device_taps, copied.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(copied, host.taps);
  run(*cpu_, true, cpu);
  EXPECT_EQ(cpu.device_taps, nullptr);
  EXPECT_EQ(cpu.taps.size(), host.taps.size());
}

TEST_P(CudaGolden, DeviceTapsOfSmallStepsOutliveTheNextSixtyThreeSuch) {
  // A step of at most 64 tokens leaves its taps in the tap ring: intact
  // through 63 more such steps (numbered one by one), whatever they are;
  // a larger step's taps last until the next forward and take no number.
  const std::vector<int> taps = {1, cuda_->config().num_layers};
  TargetRequest request;
  request.taps = taps;
  request.taps_on_device = true;
  const std::vector<int32_t> first = prompt(0), other = prompt(1);
  const int kept = cuda_->create_sequence(128), busy = cuda_->create_sequence(256);
  TargetInput input{kept, first, true};
  TargetResult result;
  cuda_->forward({&input, 1}, request, result);
  ASSERT_NE(result.device_taps, nullptr);
  ASSERT_EQ(result.device_taps_intact, 63);
  const long serial = result.device_taps_serial;
  const float* rows = result.device_taps;
  std::vector<float> before(first.size() * taps.size() * cuda_->config().hidden_size), after(before.size());
  CUDA_CHECK(cudaMemcpy(before.data(), rows, before.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<int32_t> long_prompt;
  while (long_prompt.size() <= 64) long_prompt.insert(long_prompt.end(), other.begin(), other.end());
  TargetInput large{busy, long_prompt, false};
  cuda_->forward({&large, 1}, request, result);  // more than a ring slot: no number
  EXPECT_EQ(result.device_taps_intact, 0);
  cuda_->truncate_sequence(busy, 0);
  for (int step = 1; step <= 63; ++step) {
    TargetInput small{busy, std::span(other).first(1 + step % 3), false};
    cuda_->forward({&small, 1}, request, result);
    ASSERT_EQ(result.device_taps_serial, serial + step);
    ASSERT_EQ(result.device_taps_intact, 63);
    if (step % 20 == 0) cuda_->truncate_sequence(busy, 0);
  }
  CUDA_CHECK(cudaMemcpy(after.data(), rows, after.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, before);
  cuda_->release_sequence(kept);
  cuda_->release_sequence(busy);
}

TEST_P(CudaGolden, GraphedDecodeMatchesFullForward) {
  const auto ids = prompt(1);
  const TargetResult full = full_forward(*cpu_, ids);
  const int V = cuda_->config().vocab_size;
  const int sequence = cuda_->create_sequence(64);
  TargetRequest request;
  request.want_logits = true;
  TargetResult step;
  TargetInput head{sequence, std::span(ids).first(3), false};
  cuda_->forward({&head, 1}, request, step);
  for (size_t position = 3; position < ids.size(); ++position) {  // the 2nd use of a shape on is a graph replay
    TargetInput input{sequence, std::span(ids).subspan(position, 1), false};
    cuda_->forward({&input, 1}, request, step);
    EXPECT_LE(relative_error(step.logits.data(), full.logits.data() + position * V, V), kRowTolerance) << position;
    EXPECT_EQ(step.tokens[0], cpu::argmax(step.logits.data(), V));
  }
  cuda_->release_sequence(sequence);
}

TEST_P(CudaGolden, VerifyRowsHaveTheBitsOfRowsDecodedAlone) {
  // The lossless claim on the GPU: k tokens verified in one step (k = 2..16,
  // one sequence, or two sequences of 8) give each row exactly the logits of
  // the same token decoded alone, one step per token, after the same prefill.
  // With that, greedy speculative decoding cannot part from plain decoding at
  // a bf16 near-tie.
  const int V = cuda_->config().vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {prompt(2), prompt(1)};
  const std::vector<int> decoded = {16, 8};  // tokens of each decoded alone
  const int prefilled = 3;
  TargetRequest request;
  request.want_logits = true;
  auto prefill = [&](size_t p) {
    const int sequence = cuda_->create_sequence(64);
    TargetInput input{sequence, std::span(prompts[p]).first(prefilled), false};
    TargetResult ignored;
    cuda_->forward({&input, 1}, TargetRequest{}, ignored);
    return sequence;
  };
  // Every prompt's rows prefilled.. prefilled + k - 1, decoded one token a step.
  std::vector<std::vector<float>> alone(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    ASSERT_GE(prompts[p].size(), size_t(prefilled + decoded[p])) << "prompt " << p;
    const int sequence = prefill(p);
    for (int i = 0; i < decoded[p]; ++i) {
      TargetInput input{sequence, std::span(prompts[p]).subspan(prefilled + i, 1), false};
      TargetResult step;
      cuda_->forward({&input, 1}, request, step);
      alone[p].insert(alone[p].end(), step.logits.begin(), step.logits.end());
    }
    cuda_->release_sequence(sequence);
  }
  auto expect_rows_equal = [&](const float* rows, size_t p, int count, const std::string& what) {
    for (int i = 0; i < count; ++i)
      EXPECT_EQ(0, std::memcmp(rows + size_t(i) * V, alone[p].data() + size_t(i) * V, V * sizeof(float)))
          << what << ", row " << i << " differs from the row decoded alone";
  };
  for (int k : {2, 5, 8, 16}) {
    for (int repeat = 0; repeat < 2; ++repeat) {  // eager, then a graph replay
      const int sequence = prefill(0);
      TargetInput input{sequence, std::span(prompts[0]).subspan(prefilled, k), true};
      TargetResult verify;
      cuda_->forward({&input, 1}, request, verify);
      expect_rows_equal(verify.logits.data(), 0, k, std::to_string(k) + " tokens in one step");
      cuda_->release_sequence(sequence);
    }
  }
  const int first = prefill(0), second = prefill(1);
  std::vector<TargetInput> inputs = {{first, std::span(prompts[0]).subspan(prefilled, 8), true},
                                     {second, std::span(prompts[1]).subspan(prefilled, 8), true}};
  TargetResult verify;
  cuda_->forward(inputs, request, verify);
  expect_rows_equal(verify.logits.data(), 0, 8, "two sequences of 8 tokens, the first");
  expect_rows_equal(verify.logits.data() + size_t(8) * V, 1, 8, "two sequences of 8 tokens, the second");
  cuda_->release_sequence(first);
  cuda_->release_sequence(second);
}

TEST_P(CudaGolden, PaddedBatchMatchesSingleSequences) {
  // Three ragged-history sequences decoding together: bucket 4, one padding sequence.
  const int V = cuda_->config().vocab_size;
  std::vector<std::vector<int32_t>> prompts = {prompt(0), prompt(2), prompt(3)};
  std::vector<int> sequences;
  TargetRequest request;
  request.want_logits = true;
  TargetResult result;
  std::vector<TargetInput> prefill;
  for (auto& ids : prompts) {
    sequences.push_back(cuda_->create_sequence(128));
    prefill.push_back({sequences.back(), std::span(ids).first(ids.size() - 2), false});
  }
  cuda_->forward(prefill, request, result);
  for (int step = 0; step < 2; ++step) {  // eager, then graph
    std::vector<TargetInput> decode;
    for (size_t s = 0; s < prompts.size(); ++s)
      decode.push_back({sequences[s], std::span(prompts[s]).subspan(prompts[s].size() - 2 + step, 1), false});
    cuda_->forward(decode, request, result);
    for (size_t s = 0; s < prompts.size(); ++s) {
      const TargetResult alone = full_forward(*cpu_, std::vector<int32_t>(prompts[s].begin(), prompts[s].end() - 1 + step));
      const size_t last = alone.logits.size() / V - 1;
      EXPECT_LE(relative_error(result.logits.data() + s * V, alone.logits.data() + last * V, V), kRowTolerance)
          << "sequence " << s << " step " << step;
    }
  }
  for (int sequence : sequences) cuda_->release_sequence(sequence);
}

TEST_P(CudaGolden, RaggedVerifyIsPaddedToAGraphAndMatchesTheCpu) {
  // Three sequences verifying blocks of 1, 3 and 2 tokens in one step (as
  // when Alg 1 keeps different draft prefixes): the step is padded to 3
  // tokens a sequence and 4 sequences, run eagerly (choosing its GEMMs), then
  // rolled back and repeated twice: captured, then replayed. Each real row's
  // logits and taps match the CPU's full forward, the graph picks the eager
  // run's tokens, the replay's device taps are the capture's host taps bit for
  // bit, and the sequences grow by their own tokens only.
  const int V = cuda_->config().vocab_size, H = cuda_->config().hidden_size;
  const std::vector<int> taps = {1, cuda_->config().num_layers};
  const std::vector<std::vector<int32_t>> prompts = {prompt(0), prompt(2), prompt(3)};
  const std::vector<int> block = {1, 3, 2};
  std::vector<int> sequences, prefix;
  TargetRequest request;
  request.want_logits = true;
  request.taps = taps;
  TargetResult result;
  for (size_t s = 0; s < prompts.size(); ++s) {
    ASSERT_GT(int(prompts[s].size()), block[s]);
    prefix.push_back(int(prompts[s].size()) - block[s]);
    sequences.push_back(cuda_->create_sequence(128));
    TargetInput head{sequences.back(), std::span(prompts[s]).first(prefix[s]), false};
    cuda_->forward({&head, 1}, TargetRequest{}, result);
  }
  std::vector<TargetInput> verify;
  for (size_t s = 0; s < prompts.size(); ++s)
    verify.push_back({sequences[s], std::span(prompts[s]).subspan(prefix[s], block[s]), true});
  TargetResult eager, graphed, on_device;
  cuda_->forward(verify, request, eager);
  for (size_t s = 0; s < prompts.size(); ++s) {
    EXPECT_EQ(cuda_->sequence_length(sequences[s]), int(prompts[s].size()));
    cuda_->truncate_sequence(sequences[s], prefix[s]);
  }
  cuda_->forward(verify, request, graphed);
  EXPECT_EQ(graphed.tokens, eager.tokens);
  EXPECT_LE(relative_error(graphed.logits.data(), eager.logits.data(), eager.logits.size()), 1e-2);
  for (size_t s = 0; s < prompts.size(); ++s) cuda_->truncate_sequence(sequences[s], prefix[s]);
  request.taps_on_device = true;
  cuda_->forward(verify, request, on_device);
  ASSERT_NE(on_device.device_taps, nullptr);
  EXPECT_EQ(on_device.tokens, graphed.tokens);
  std::vector<float> copied(graphed.taps.size());
  CUDA_CHECK(cudaMemcpy(copied.data(), on_device.device_taps, copied.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(copied, graphed.taps);
  const long tap_width = long(taps.size()) * H;
  long row = 0;
  for (size_t s = 0; s < prompts.size(); ++s) {
    const TargetResult alone = full_forward(*cpu_, prompts[s], taps);
    for (int i = 0; i < block[s]; ++i, ++row) {
      const long position = prefix[s] + i;
      EXPECT_LE(relative_error(eager.logits.data() + row * V, alone.logits.data() + position * V, V), kRowTolerance)
          << "sequence " << s << " token " << i;
      EXPECT_EQ(eager.tokens[row], cpu::argmax(eager.logits.data() + row * V, V));
      EXPECT_LE(relative_error(eager.taps.data() + row * tap_width, alone.taps.data() + position * tap_width,
                               tap_width),
                kRowTolerance)
          << "sequence " << s << " token " << i;
    }
  }
  for (int sequence : sequences) cuda_->release_sequence(sequence);
}

TEST_P(CudaGolden, RollbackLeavesNoTrace) {
  const auto ids = prompt(0);
  const int V = cuda_->config().vocab_size;
  const TargetResult full = full_forward(*cpu_, ids);
  const int sequence = cuda_->create_sequence(128);
  TargetRequest request;
  request.want_logits = true;
  TargetResult result;
  std::vector<int32_t> detour(40, 9);  // crosses a cache block boundary, then is rolled back
  TargetInput head{sequence, std::span(ids).first(4), false}, wrong{sequence, detour, true};
  cuda_->forward({&head, 1}, request, result);
  cuda_->forward({&wrong, 1}, request, result);
  cuda_->truncate_sequence(sequence, 4);
  TargetInput rest{sequence, std::span(ids).subspan(4), true};
  cuda_->forward({&rest, 1}, request, result);
  EXPECT_LE(relative_error(result.logits.data(), full.logits.data() + 4 * V, (ids.size() - 4) * V), kModelTolerance);
  cuda_->release_sequence(sequence);
}

TEST_P(CudaGolden, GreedyTokensAreTheTargetsArgmax) {
  // bf16 may flip a near-tie, so each token is checked against the f32 CPU
  // logits of the CUDA run's own history (teacher forcing), not HF's path.
  for (const auto& expected : forward_["greedy"]) {
    const auto ids = prompt(expected["prompt"].get<size_t>());
    const auto hf_tokens = expected["tokens"].get<std::vector<int32_t>>();
    GenerateOptions options;
    options.max_new_tokens = static_cast<int>(hf_tokens.size());
    options.ignore_eos = true;
    const auto tokens = generate(*cuda_, ids, options).tokens;
    std::vector<int32_t> history(ids);
    history.insert(history.end(), tokens.begin(), tokens.end());
    const TargetResult cpu = full_forward(*cpu_, history);
    const int V = cuda_->config().vocab_size;
    size_t same_as_hf = 0;
    while (same_as_hf < tokens.size() && tokens[same_as_hf] == hf_tokens[same_as_hf]) ++same_as_hf;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const float* row = cpu.logits.data() + (ids.size() - 1 + i) * V;
      const float best = row[cpu::argmax(row, V)];
      const float spread = best - *std::min_element(row, row + V);
      EXPECT_GE(row[tokens[i]], best - 2e-2f * spread) << "step " << i;
    }
    std::printf("[ %s ] CUDA greedy equals HF for the first %zu of %zu tokens\n", GetParam().c_str(), same_as_hf,
                tokens.size());
  }
}

TEST_P(CudaGolden, PerplexityNearTransformers) {
  const Tokenizer tokenizer = Tokenizer::load(golden_model(GetParam()));
  const auto ids = tokenizer.encode(read_text_file(golden_model(GetParam()) / "reference" / "perplexity.txt"));
  for (const auto& expected : forward_["perplexity"]["cases"]) {
    const PerplexityResult result = perplexity(*cuda_, ids, expected["context"].get<int>());
    EXPECT_EQ(result.tokens, expected["tokens"].get<long>());
    EXPECT_NEAR(result.nll / expected["nll"].get<double>(), 1.0, 1e-2);
  }
}

TEST_P(CudaGolden, SpeculativeGreedyEqualsPlainOnTheGpu) {
  const Transformer host = load_transformer(golden_model(GetParam()));
  const ModelConfig& c = host.config;
  DrafterConfig drafter_config;
  drafter_config.gamma = 6, drafter_config.d_draft = 32, drafter_config.num_layers = 1;
  drafter_config.num_heads = 4, drafter_config.markov_rank = 8;
  drafter_config.tap_layers = default_tap_layers(c.num_layers);
  Drafter drafter = init_drafter(drafter_config, {c.hidden_size, c.vocab_size, c.rms_norm_eps}, "t", 3);
  Rng rng(5);  // non-trivial weights so that some drafts are accepted and some rejected
  for (auto& [name, tensor] : drafter.parameters)
    for (long i = 0; i < tensor.numel(); ++i) tensor.data[i] += 0.3f * float(2.0 * rng.uniform() - 1.0);
  DSparkSource dspark_source(drafter, target_head_of(host));
  NgramSource ngram_source;
  const int count = 24;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < forward_["prompts"].size(); ++i) prompts.push_back(prompt(i));
  // Nothing to prefill: the first forward of this sequence is a verify block
  // at length 0, and the drafter's context starts empty.
  prompts.push_back(one_token_prompt_with_clear_greedy(*cpu_, count));
  GenerateOptions plain_options;
  plain_options.max_new_tokens = count;
  plain_options.ignore_eos = true;
  const auto plain = generate_batch(*cuda_, prompts, plain_options);
  SpeculativeOptions options;
  options.max_new_tokens = count;
  options.ignore_eos = true;
  for (DraftSource* source : std::initializer_list<DraftSource*>{&dspark_source, &ngram_source}) {
    for (int gamma : {1, 6}) {
      options.gamma = gamma;
      const auto spec = speculative_generate(*cuda_, *source, prompts, options);
      const size_t exact = expect_greedy_equals_plain(*cpu_, prompts, plain, spec, "gamma " + std::to_string(gamma));
      std::printf("[ %s ] gamma %d: %zu of %zu tokens past no near-tie, compared exactly\n", GetParam().c_str(), gamma,
                  exact, prompts.size() * count);
    }
  }
  // One request at a time, every step has at most 16 rows: the products and
  // attention give each row its bits at any row count
  // (VerifyRowsHaveTheBitsOfRowsDecodedAlone), so the tokens are equal
  // exactly, near-ties included.
  options.gamma = 6;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<std::vector<int32_t>> one = {prompts[i]};
    const auto plain_alone = generate_batch(*cuda_, one, plain_options);
    const auto spec_alone = speculative_generate(*cuda_, dspark_source, one, options);
    EXPECT_EQ(spec_alone[0].tokens, plain_alone[0].tokens) << "prompt " << i;
  }
  // Likewise one after another under continuous batching, where each prompt
  // but its last token enters the cache in a prefill of its own.
  plain_options.max_active = options.max_active = 1;
  const auto plain_queued = generate_batch(*cuda_, prompts, plain_options);
  const auto spec_queued = speculative_generate(*cuda_, dspark_source, prompts, options);
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(spec_queued[i].tokens, plain_queued[i].tokens) << "prompt " << i << ", one at a time";
}

INSTANTIATE_TEST_SUITE_P(Golden, CudaGolden, ::testing::Values("qwen3", "llama"));

}  // namespace
}  // namespace dspark
