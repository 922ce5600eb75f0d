// Drafter training on the GPU against the CPU reference and PyTorch:
//  - every CUDA backward op (and the f32 forwards they pair with) against the
//    CPU op of the same name on random inputs, gradients pre-filled with noise
//    so that accumulation (+=) is checked too; the deterministic reductions and
//    the GEMM wrapper (transposes, bf16 operands, TF32) against host sums;
//  - the whole loss (terms and the gradient of every parameter) against
//    drafter_loss for the Markov, RNN and GRU heads, ragged contexts (0
//    included) and masked positions: in plain f32 with an f32 head (tight),
//    and in the training precision (TF32 GEMMs, bf16 head; loose, reported);
//  - against the PyTorch autograd goldens of tests/golden/train;
//  - AdamW with clipping, a few steps, against the CPU's;
//  - the trainer on --device cuda: the loss falls, a stopped and resumed run
//    equals a straight one bit for bit, checkpoints hold the GPU's weights.
// Runs on a GPU machine: tests/tools/run_train_checks.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <tuple>

#include "core/file.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "device_test_util.h"
#include "golden.h"
#include "gradient_check.h"
#include "tiny_regen.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/softmax.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/draft_train.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/loss.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/softmax.h"
#include "model/cpu_target.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "random_drafter.h"
#include "spec/draft.h"
#include "train/anchors.h"
#include "train/batch_pipeline.h"
#include "train/cuda_loss.h"
#include "train/cuda_optimizer.h"
#include "train/loss.h"
#include "train/optimizer.h"
#include "train/regen.h"
#include "train/train_step.h"
#include "train/trainer.h"
#include "train_golden.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using testing::bf16_rounded;
using testing::from_device;
using testing::golden_model;
using testing::random_values;
using testing::relative_difference;
using testing::relative_error;
using testing::TemporaryDirectory;
using testing::to_device;
using testing::to_device_bf16;

const std::vector<std::string> kHeads = {"markov", "rnn", "gru"};

std::vector<double> as_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }
std::vector<double> as_double(const Tensor& tensor) { return {tensor.data, tensor.data + tensor.numel()}; }

// ||gpu - cpu|| / ||cpu|| of two float vectors.
double difference(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  return relative_difference(as_double(gpu), as_double(cpu));
}

// ---------------------------------------------------------------- ops

TEST(CudaTrainOps, RmsnormForwardAndBackwardMatchCpu) {
  for (auto [rows, dim] : {std::pair{3, 24}, std::pair{300, 100}, std::pair{700, 1030}}) {  // one and several chunks
    const auto x = random_values(size_t(rows) * dim, 1, 2.0f), weight = random_values(dim, 2, 1.5f);
    const auto dout = random_values(size_t(rows) * dim, 3), dx0 = random_values(size_t(rows) * dim, 4);
    const auto dweight0 = random_values(dim, 5);
    std::vector<float> out(x.size()), dx = dx0, dweight = dweight0;
    cpu::rmsnorm_forward(out.data(), x.data(), weight.data(), rows, dim, 1e-6f);
    cpu::rmsnorm_backward(dx.data(), dweight.data(), dout.data(), x.data(), weight.data(), rows, dim, 1e-6f);
    auto x_device = to_device(x), weight_device = to_device(weight), dout_device = to_device(dout);
    auto dx_device = to_device(dx0), dweight_device = to_device(dweight0);
    DeviceBuffer<float> out_device(x.size()), scratch(cuda::rmsnorm_backward_scratch(rows, dim));
    cuda::rmsnorm_forward(out_device.data(), x_device.data(), weight_device.data(), rows, dim, 1e-6f, nullptr);
    cuda::rmsnorm_backward(dx_device.data(), dweight_device.data(), dout_device.data(), x_device.data(),
                           weight_device.data(), rows, dim, 1e-6f, scratch.data(), nullptr);
    EXPECT_LE(difference(from_device(out_device), out), 1e-6) << rows << " x " << dim;
    EXPECT_LE(difference(from_device(dx_device), dx), 1e-6) << rows << " x " << dim;
    EXPECT_LE(difference(from_device(dweight_device), dweight), 1e-5) << rows << " x " << dim;
  }
}

TEST(CudaTrainOps, GeluTanhGateForwardAndBackwardMatchCpu) {
  const long count = 5000;
  const auto gate = random_values(count, 6, 4.0f), up = random_values(count, 7, 2.0f);
  const auto dout = random_values(count, 8), dgate0 = random_values(count, 9), dup0 = random_values(count, 10);
  std::vector<float> out(count), dgate = dgate0, dup = dup0;
  cpu::gelu_tanh_gate_forward(out.data(), gate.data(), up.data(), count);
  cpu::gelu_tanh_gate_backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), count);
  auto gate_device = to_device(gate), up_device = to_device(up), dout_device = to_device(dout);
  auto dgate_device = to_device(dgate0), dup_device = to_device(dup0);
  DeviceBuffer<float> out_device(count);
  cuda::gelu_tanh_gate_forward(out_device.data(), gate_device.data(), up_device.data(), count, nullptr);
  cuda::gelu_tanh_gate_backward(dgate_device.data(), dup_device.data(), dout_device.data(), gate_device.data(),
                                up_device.data(), count, nullptr);
  EXPECT_LE(difference(from_device(out_device), out), 1e-6);
  EXPECT_LE(difference(from_device(dgate_device), dgate), 1e-6);
  EXPECT_LE(difference(from_device(dup_device), dup), 1e-6);
}

TEST(CudaTrainOps, SoftmaxForwardAndBackwardMatchCpu) {
  for (int dim : {7, 3000}) {
    const int rows = 5;
    const auto logits = random_values(size_t(rows) * dim, 11, 6.0f), dprobs = random_values(size_t(rows) * dim, 12);
    const auto dlogits0 = random_values(size_t(rows) * dim, 13);
    std::vector<float> probs(logits.size()), normalizers(rows), dlogits = dlogits0;
    cpu::softmax_forward(probs.data(), logits.data(), rows, dim, normalizers.data());
    cpu::softmax_backward(dlogits.data(), dprobs.data(), probs.data(), rows, dim);
    auto logits_device = to_device(logits), dprobs_device = to_device(dprobs), dlogits_device = to_device(dlogits0);
    DeviceBuffer<float> probs_device(logits.size()), normalizers_device(rows);
    cuda::softmax_forward(probs_device.data(), logits_device.data(), rows, dim, normalizers_device.data(), nullptr);
    cuda::softmax_backward(dlogits_device.data(), dprobs_device.data(), probs_device.data(), rows, dim, nullptr);
    EXPECT_LE(difference(from_device(probs_device), probs), 1e-6) << dim;
    EXPECT_LE(difference(from_device(normalizers_device), normalizers), 1e-6) << dim;
    EXPECT_LE(difference(from_device(dlogits_device), dlogits), 1e-6) << dim;
  }
}

// Products against OpenBLAS: in_out forward / backward (F32 tight, TF32 loose), and the
// general gemm with every transpose, a beta of 1, and bf16 operands.
TEST(CudaTrainOps, GemmsMatchCpu) {
  const int rows = 37, in = 70, out = 45;
  const auto x = random_values(size_t(rows) * in, 14), weight = random_values(size_t(in) * out, 15);
  const auto dout = random_values(size_t(rows) * out, 16), dx0 = random_values(x.size(), 17);
  const auto dweight0 = random_values(weight.size(), 18);
  std::vector<float> y(size_t(rows) * out), dx = dx0, dweight = dweight0;
  cpu::matmul_in_out_forward(y.data(), x.data(), weight.data(), rows, in, out);
  cpu::matmul_in_out_backward(dx.data(), dweight.data(), dout.data(), x.data(), weight.data(), rows, in, out);
  for (auto [math, tolerance] : {std::pair{cuda::GemmMath::F32, 1e-6}, std::pair{cuda::GemmMath::TF32, 3e-3}}) {
    auto x_device = to_device(x), weight_device = to_device(weight), dout_device = to_device(dout);
    auto dx_device = to_device(dx0), dweight_device = to_device(dweight0);
    DeviceBuffer<float> y_device(y.size());
    cuda::matmul_in_out_forward(y_device.data(), x_device.data(), weight_device.data(), rows, in, out, math, nullptr);
    cuda::matmul_in_out_backward(dx_device.data(), dweight_device.data(), dout_device.data(), x_device.data(),
                                 weight_device.data(), rows, in, out, math, nullptr);
    const char* name = math == cuda::GemmMath::F32 ? "f32" : "tf32";
    EXPECT_LE(difference(from_device(y_device), y), tolerance) << name;
    EXPECT_LE(difference(from_device(dx_device), dx), tolerance) << name;
    EXPECT_LE(difference(from_device(dweight_device), dweight), tolerance) << name;
  }
  // C [rows, out] = 1·C + x @ W^T with W stored [out, in] (nn.Linear), on bf16 operands.
  const auto linear = bf16_rounded(random_values(size_t(out) * in, 19)), xb = bf16_rounded(x);
  const auto c0 = random_values(size_t(rows) * out, 20);
  std::vector<float> expected(c0.size());
  cpu::matmul_forward(expected.data(), xb.data(), linear.data(), nullptr, rows, in, out);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += c0[i];
  auto xb_device = to_device_bf16(xb), linear_device = to_device_bf16(linear);
  auto c_device = to_device(c0);
  cuda::gemm(c_device.data(), out, xb_device.data(), in, false, linear_device.data(), in, true, rows, out, in, 1.0f,
             true, cuda::GemmMath::F32, nullptr);
  EXPECT_LE(difference(from_device(c_device), expected), 1e-6);
  // Both transposed: C [out, rows] = W [in, out]^T @ x [rows, in]^T, strided C (ldc > n).
  const int ldc = rows + 3;
  std::vector<float> both(size_t(out) * ldc, 0.0f);
  for (int o = 0; o < out; ++o)
    for (int r = 0; r < rows; ++r) {
      double sum = 0.0;
      for (int i = 0; i < in; ++i) sum += double(weight[size_t(i) * out + o]) * x[size_t(r) * in + i];
      both[size_t(o) * ldc + r] = float(sum);
    }
  auto x_device = to_device(x), weight_device = to_device(weight);
  auto both_device = to_device(std::vector<float>(both.size(), 0.0f));
  cuda::gemm(both_device.data(), ldc, weight_device.data(), out, true, x_device.data(), in, true, out, rows, in, 0.0f,
             false, cuda::GemmMath::F32, nullptr);
  EXPECT_LE(difference(from_device(both_device), both), 1e-6);
}

TEST(CudaTrainOps, ColumnSumsAndSumOfSquaresMatchDoubleSums) {
  for (int rows : {1, 255, 257, 1000}) {
    const int dim = 70, lda = 75;
    const auto a = random_values(size_t(rows) * lda, 21), b = random_values(size_t(rows) * dim, 22);
    const auto scale = random_values(rows, 23), out0 = random_values(dim, 24);
    std::vector<double> expected(dim);
    for (int i = 0; i < dim; ++i) {
      double sum = out0[i];
      for (int r = 0; r < rows; ++r) sum += double(a[size_t(r) * lda + i]) * b[size_t(r) * dim + i] * scale[r];
      expected[i] = sum;
    }
    auto a_device = to_device(a), b_device = to_device(b), scale_device = to_device(scale), out = to_device(out0);
    DeviceBuffer<float> partials(std::max(1L, cuda::column_sums_scratch(rows, dim)));
    cuda::column_sums(out.data(), a_device.data(), lda, b_device.data(), dim, scale_device.data(), rows, dim,
                      partials.data(), nullptr);
    EXPECT_LE(relative_difference(as_double(from_device(out)), expected), 1e-5) << rows;
  }
  const long count = 1000003;
  const auto x = random_values(count, 25);
  double expected = 0.0;
  for (float value : x) expected += double(value) * value;
  auto x_device = to_device(x);
  DeviceBuffer<double> result(1 + cuda::kSquareBlocks);
  cuda::sum_of_squares(result.data(), x_device.data(), count, result.data() + 1, nullptr);
  EXPECT_NEAR(from_device(result)[0], expected, 1e-9 * expected);
}

TEST(CudaTrainOps, EmbeddingBackwardSumsEachTableRowsReads) {
  const int vocab = 50, dim = 9, rows = 40;
  Rng rng(26);
  std::vector<int32_t> ids(rows);
  for (int32_t& id : ids) id = int32_t(rng.next() % 7) * 3;  // many repeats
  const auto dout = random_values(size_t(rows) * dim, 27), table0 = random_values(size_t(vocab) * dim, 28);
  std::vector<float> expected = table0;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < dim; ++i) expected[size_t(ids[r]) * dim + i] += dout[size_t(r) * dim + i];
  std::vector<std::pair<int32_t, int32_t>> reads;
  for (int r = 0; r < rows; ++r) reads.push_back({ids[r], r});
  std::sort(reads.begin(), reads.end());
  std::vector<int32_t> group_ids, starts, sorted;
  for (int i = 0; i < rows; ++i) {
    if (i == 0 || reads[i].first != reads[i - 1].first) group_ids.push_back(reads[i].first), starts.push_back(i);
    sorted.push_back(reads[i].second);
  }
  starts.push_back(rows);
  auto table = to_device(table0), dout_device = to_device(dout);
  auto ids_device = to_device(group_ids), starts_device = to_device(starts), sorted_device = to_device(sorted);
  cuda::embedding_backward(table.data(), dout_device.data(), ids_device.data(), starts_device.data(),
                           sorted_device.data(), int(group_ids.size()), dim, nullptr);
  EXPECT_LE(difference(from_device(table), expected), 1e-6);
  // And the f32 lookup.
  auto all_ids = to_device(ids);
  DeviceBuffer<float> looked_up(size_t(rows) * dim);
  cuda::embedding_forward(looked_up.data(), to_device(table0).data(), all_ids.data(), rows, dim, nullptr);
  const auto rows_read = from_device(looked_up);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < dim; ++i) ASSERT_EQ(rows_read[size_t(r) * dim + i], table0[size_t(ids[r]) * dim + i]);
}

// The ragged training attention against cpu::bidirectional_attention_forward / backward run
// anchor by anchor on gathered [context ; block] keys, as drafter_backward.cpp runs them.
TEST(CudaTrainOps, BidirectionalAttentionForwardAndBackwardMatchCpu) {
  const std::vector<int> lengths = {0, 1, 45, 5, 33};
  const int A = static_cast<int>(lengths.size());
  for (auto [heads, head_dim, gamma] : {std::tuple{2, 8, 4}, std::tuple{4, 64, 7}, std::tuple{2, 128, 16}}) {
    const int d = heads * head_dim, R = A * gamma;
    std::vector<int32_t> offsets = {0};
    for (int length : lengths) offsets.push_back(offsets.back() + length);
    const int C = offsets.back();
    const auto q = random_values(size_t(R) * d, 30, 1.5f), block_keys = random_values(size_t(R) * d, 31, 1.5f);
    const auto block_values = random_values(size_t(R) * d, 32), context_keys = random_values(size_t(C) * d, 33, 1.5f);
    const auto context_values = random_values(size_t(C) * d, 34), dout = random_values(size_t(R) * d, 35);
    const auto dq0 = random_values(size_t(R) * d, 36), dbk0 = random_values(size_t(R) * d, 37);
    const auto dbv0 = random_values(size_t(R) * d, 38), dck0 = random_values(size_t(C) * d, 39);
    const auto dcv0 = random_values(size_t(C) * d, 40);
    std::vector<float> out(size_t(R) * d), dq = dq0, dbk = dbk0, dbv = dbv0, dck = dck0, dcv = dcv0;
    for (int a = 0; a < A; ++a) {
      const int total = lengths[a] + gamma;
      std::vector<float> qa(size_t(gamma) * d), keys(size_t(total) * d), values(size_t(total) * d), oa(qa.size()),
          douta(qa.size()), dqa(qa.size(), 0.0f), dkeys(keys.size(), 0.0f), dvalues(keys.size(), 0.0f),
          scratch(size_t(2) * gamma * total);
      std::copy_n(context_keys.data() + size_t(offsets[a]) * d, size_t(lengths[a]) * d, keys.data());
      std::copy_n(context_values.data() + size_t(offsets[a]) * d, size_t(lengths[a]) * d, values.data());
      for (int k = 0; k < gamma; ++k) {
        const size_t row = size_t(k) * A + a;
        std::copy_n(q.data() + row * d, d, qa.data() + size_t(k) * d);
        std::copy_n(dout.data() + row * d, d, douta.data() + size_t(k) * d);
        std::copy_n(block_keys.data() + row * d, d, keys.data() + size_t(lengths[a] + k) * d);
        std::copy_n(block_values.data() + row * d, d, values.data() + size_t(lengths[a] + k) * d);
      }
      cpu::bidirectional_attention_forward(oa.data(), qa.data(), keys.data(), values.data(), gamma, total, heads,
                                           head_dim, scratch.data());
      cpu::bidirectional_attention_backward(dqa.data(), dkeys.data(), dvalues.data(), douta.data(), qa.data(),
                                            keys.data(), values.data(), gamma, total, heads, head_dim, scratch.data());
      for (int k = 0; k < gamma; ++k) {
        const size_t row = size_t(k) * A + a;
        for (int i = 0; i < d; ++i) {
          out[row * d + i] = oa[size_t(k) * d + i];
          dq[row * d + i] += dqa[size_t(k) * d + i];
          dbk[row * d + i] += dkeys[size_t(lengths[a] + k) * d + i];
          dbv[row * d + i] += dvalues[size_t(lengths[a] + k) * d + i];
        }
      }
      for (long i = 0; i < long(lengths[a]) * d; ++i) {
        dck[size_t(offsets[a]) * d + i] += dkeys[i];
        dcv[size_t(offsets[a]) * d + i] += dvalues[i];
      }
    }
    auto offsets_device = to_device(offsets);
    auto q_device = to_device(q), bk_device = to_device(block_keys), bv_device = to_device(block_values);
    auto ck_device = to_device(context_keys), cv_device = to_device(context_values), dout_device = to_device(dout);
    auto dq_device = to_device(dq0), dbk_device = to_device(dbk0), dbv_device = to_device(dbv0);
    auto dck_device = to_device(dck0), dcv_device = to_device(dcv0);
    DeviceBuffer<float> out_device(size_t(R) * d), lse(size_t(R) * heads);
    const cuda::TrainAttentionBatch batch{offsets_device.data(), A, gamma, heads, head_dim};
    cuda::bidirectional_attention_forward(out_device.data(), lse.data(), q_device.data(), bk_device.data(),
                                          bv_device.data(), ck_device.data(), cv_device.data(), batch, nullptr);
    cuda::bidirectional_attention_backward(dq_device.data(), dbk_device.data(), dbv_device.data(), dck_device.data(),
                                           dcv_device.data(), dout_device.data(), out_device.data(), lse.data(),
                                           q_device.data(), bk_device.data(), bv_device.data(), ck_device.data(),
                                           cv_device.data(), batch, nullptr);
    const std::string shape = std::to_string(heads) + "x" + std::to_string(head_dim) + " gamma " + std::to_string(gamma);
    EXPECT_LE(difference(from_device(out_device), out), 2e-6) << shape;
    EXPECT_LE(difference(from_device(dq_device), dq), 2e-6) << shape;
    EXPECT_LE(difference(from_device(dbk_device), dbk), 2e-6) << shape;
    EXPECT_LE(difference(from_device(dbv_device), dbv), 2e-6) << shape;
    EXPECT_LE(difference(from_device(dck_device), dck), 2e-6) << shape;
    EXPECT_LE(difference(from_device(dcv_device), dcv), 2e-6) << shape;
  }
}

TEST(CudaTrainOps, BlockRowsForwardAndBackward) {
  const int A = 5, gamma = 4, d = 300;
  const auto token = random_values(size_t(A) * d, 41), mask = random_values(size_t(gamma - 1) * d, 42);
  const auto position = random_values(size_t(gamma) * d, 43), dblock = random_values(size_t(A) * gamma * d, 44);
  const auto dmask0 = random_values(mask.size(), 45), dposition0 = random_values(position.size(), 46);
  auto token_device = to_device(token), mask_device = to_device(mask), position_device = to_device(position);
  DeviceBuffer<float> block(size_t(A) * gamma * d);
  cuda::block_rows_forward(block.data(), token_device.data(), mask_device.data(), position_device.data(), A, gamma, d,
                           nullptr);
  const auto rows = from_device(block);
  for (int k = 0; k < gamma; ++k)
    for (int a = 0; a < A; ++a)
      for (int i = 0; i < d; ++i) {
        const float first = k == 0 ? token[size_t(a) * d + i] : mask[size_t(k - 1) * d + i];
        ASSERT_EQ(rows[(size_t(k) * A + a) * d + i], first + position[size_t(k) * d + i]) << k << " " << a;
      }
  std::vector<float> dmask = dmask0, dposition = dposition0;
  for (int k = 0; k < gamma; ++k)
    for (int i = 0; i < d; ++i) {
      float total = 0.0f;
      for (int a = 0; a < A; ++a) total += dblock[(size_t(k) * A + a) * d + i];
      dposition[size_t(k) * d + i] += total;
      if (k > 0) dmask[size_t(k - 1) * d + i] += total;
    }
  auto dblock_device = to_device(dblock), dmask_device = to_device(dmask0), dposition_device = to_device(dposition0);
  cuda::block_rows_backward(dmask_device.data(), dposition_device.data(), dblock_device.data(), A, gamma, d, nullptr);
  EXPECT_LE(difference(from_device(dmask_device), dmask), 1e-6);
  EXPECT_LE(difference(from_device(dposition_device), dposition), 1e-6);
}

// ---------------------------------------------------------------- the loss

struct RandomTarget {
  TargetDims dims;
  std::vector<float> embedding, lm_head;
  RandomTarget(TargetDims target_dims, uint64_t seed, bool bf16_values) : dims(target_dims) {
    Rng rng(seed);
    embedding = testing::random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 1.0f);
    lm_head = testing::random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 0.8f);
    if (bf16_values) embedding = bf16_rounded(embedding), lm_head = bf16_rounded(lm_head);
  }
  TargetHead view() const { return {embedding.data(), lm_head.data()}; }
};

Drafter random_drafter(const std::string& head, const TargetDims& dims, int gamma, int d, int heads, int rank,
                       uint64_t seed) {
  DrafterConfig config;
  config.gamma = gamma;
  config.d_draft = d;
  config.num_layers = 2;
  config.num_heads = heads;
  config.markov_rank = rank;
  config.ff_mult = 2;
  config.tap_layers = {1, 2, 3};
  config.seq_head = head;
  Drafter drafter = init_drafter(config, dims, "random", 3);
  testing::randomize_parameters(drafter, seed, 1.0f);
  return drafter;
}

// Ragged contexts (lengths as given), the last masked[a] positions of anchor a
// masked, targets from V/8 tokens (repeats: shared Markov rows).
TrainBatch random_batch(const Drafter& drafter, uint64_t seed, const std::vector<int>& lengths,
                        const std::vector<int>& masked, bool bf16_values) {
  TrainBatch batch = testing::random_train_batch(drafter, seed, lengths, masked, drafter.dims.vocab_size / 8);
  if (bf16_values) batch.context_rows = bf16_rounded(batch.context_rows);
  return batch;
}

struct LossComparison {
  double terms = 0.0;     // the largest relative difference of loss, CE, L1, BCE and τ̂
  double gradient = 0.0;  // the largest relative difference of any parameter's gradient
  std::string worst;      // that parameter
};

// The CUDA loss and gradients against drafter_loss on the same drafter, head and batch.
LossComparison compare_with_cpu(const Drafter& drafter, const RandomTarget& target, const TrainBatch& batch,
                                const CudaTrainPrecision& precision, ContextUpload upload,
                                const LossWeights& weights) {
  LossWorkspace workspace;
  Gradients expected = zero_gradients(drafter);
  const LossTerms want = drafter_loss(drafter, target.view(), batch, weights, &expected, workspace);
  const CudaTrainHead head(target.view(), drafter.dims, precision.bf16_head);
  CudaDrafterLoss loss(drafter, head, precision);
  loss.upload(batch, upload);
  const LossTerms got = loss.compute(weights, true);
  Gradients gradients;
  loss.download_gradients(gradients);
  LossComparison result;
  EXPECT_EQ(got.positions, want.positions);
  for (auto [ours, theirs] : {std::pair{got.loss, want.loss}, std::pair{got.ce, want.ce}, std::pair{got.l1, want.l1},
                              std::pair{got.bce, want.bce}, std::pair{got.tau_estimate, want.tau_estimate}})
    result.terms = std::max(result.terms, std::fabs(ours - theirs) / std::max(std::fabs(theirs), 1e-12));
  for (const std::string& name : drafter.names) {
    const std::vector<double> a = as_double(gradients.at(name)), b = as_double(expected.at(name));
    double norm = 0.0;
    for (double value : b) norm += value * value;
    const double error = norm > 0 ? relative_difference(a, b) : std::sqrt(std::inner_product(a.begin(), a.end(),
                                                                                           a.begin(), 0.0));
    if (error > result.gradient) result.gradient = error, result.worst = name;
  }
  return result;
}

// Plain f32 GEMMs and an f32 head: the CUDA loss is the CPU's up to f32 summation order.
TEST(CudaTrainLoss, TermsAndEveryGradientMatchCpuInF32) {
  const RandomTarget target({48, 400, 1e-6f}, 1, false);
  LossWeights weights;
  weights.gamma_decay = 3.0f;
  const CudaTrainPrecision precise{cuda::GemmMath::F32, false};
  for (const std::string& head : kHeads) {
    const Drafter drafter = random_drafter(head, target.dims, 5, 32, 4, 12, 21);
    const TrainBatch batch = random_batch(drafter, 7, {0, 1, 40, 3, 0, 17}, {0, 2, 0, 5, 1, 0}, false);
    const LossComparison c = compare_with_cpu(drafter, target, batch, precise, ContextUpload::F32, weights);
    std::printf("  f32 %-6s: terms %.2e, gradients %.2e (%s)\n", head.c_str(), c.terms, c.gradient, c.worst.c_str());
    EXPECT_LE(c.terms, 2e-5) << head;
    EXPECT_LE(c.gradient, 1e-4) << head << " " << c.worst;
  }
}

// The training precision (TF32 GEMMs, the head and its inputs in bf16). The CPU gets the
// same bf16-valued head and context rows, so what differs is TF32 and the bf16 rounding of
// the head GEMMs' inputs. The errors are printed: the margin is visible in the log.
TEST(CudaTrainLoss, TermsAndEveryGradientMatchCpuInTrainingPrecision) {
  const RandomTarget target({64, 1000, 1e-6f}, 2, true);
  const LossWeights weights;
  for (const std::string& head : kHeads) {
    const Drafter drafter = random_drafter(head, target.dims, 7, 64, 4, 16, 31);
    const TrainBatch batch = random_batch(drafter, 9, {12, 0, 64, 5, 30, 1, 7, 0}, {0, 3, 0, 0, 7, 1, 0, 2}, true);
    const LossComparison c = compare_with_cpu(drafter, target, batch, CudaTrainPrecision{}, ContextUpload::Bf16, weights);
    std::printf("  tf32+bf16 %-6s: terms %.2e, gradients %.2e (%s)\n", head.c_str(), c.terms, c.gradient,
                c.worst.c_str());
    EXPECT_LE(c.terms, 1e-2) << head;
    EXPECT_LE(c.gradient, 5e-2) << head << " " << c.worst;
  }
}

// bf16 travel of bf16-valued rows is exact; gradients accumulate; a batch with nothing trained gives nothing.
TEST(CudaTrainLoss, Bf16UploadIsExactGradientsAccumulateAndNothingTrainedGivesNothing) {
  const RandomTarget target({32, 300, 1e-6f}, 3, false);
  const CudaTrainPrecision precise{cuda::GemmMath::F32, false};
  const Drafter drafter = random_drafter("gru", target.dims, 4, 32, 2, 8, 41);
  TrainBatch batch = random_batch(drafter, 11, {3, 0, 9}, {0, 1, 0}, true);
  const CudaTrainHead head(target.view(), drafter.dims, false);
  CudaDrafterLoss loss(drafter, head, precise);
  loss.upload(batch, ContextUpload::F32);
  const LossTerms f32 = loss.compute(LossWeights{}, true);
  Gradients once;
  loss.download_gradients(once);
  loss.upload(batch, ContextUpload::Bf16);
  const LossTerms bf16_upload = loss.compute(LossWeights{}, true);
  EXPECT_EQ(f32.loss, bf16_upload.loss);
  TrainBatch bf16_rows = batch;  // as the trainer builds batches for the GPU
  bf16_rows.context_rows_bf16.clear();
  for (float value : batch.context_rows) bf16_rows.context_rows_bf16.push_back(f32_to_bf16(value));
  bf16_rows.context_rows.clear();
  loss.upload(bf16_rows);
  EXPECT_EQ(loss.compute(LossWeights{}, false).loss, f32.loss);
  Gradients twice;
  loss.download_gradients(twice);
  for (const std::string& name : drafter.names) {
    std::vector<double> doubled = as_double(once.at(name));
    for (double& value : doubled) value *= 2.0;
    EXPECT_LE(relative_difference(as_double(twice.at(name)), doubled), 1e-6) << name;
  }
  std::fill(batch.mask.begin(), batch.mask.end(), 0.0f);
  loss.zero_gradients();
  loss.upload(batch);
  const LossTerms nothing = loss.compute(LossWeights{}, true);
  EXPECT_EQ(nothing.positions, 0);
  EXPECT_EQ(nothing.loss, 0.0);
  Gradients zero;
  loss.download_gradients(zero);
  for (const std::string& name : drafter.names)
    for (long i = 0; i < zero.at(name).numel(); ++i) ASSERT_EQ(zero.at(name).data[i], 0.0f) << name;
  // A mismatched batch is refused before anything reaches the device.
  TrainBatch bad = batch;
  bad.targets[2] = 300;
  EXPECT_NE(testing::error_of([&] { loss.upload(bad); }).find("outside vocab"), std::string::npos);
}

// Against PyTorch autograd in float64 (tests/tools/make_train_golden.py), as tests/test_loss.cpp does for the CPU.
class CudaLossGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaLossGolden, TermsAndEveryGradientMatchPyTorch) {
  const std::string head_kind = GetParam();
  const testing::TrainGolden golden = testing::load_train_golden(head_kind);
  const Json& reference = golden.reference;
  const SafetensorsFile& expected = *golden.expected;
  const Drafter& drafter = golden.drafter;
  const TargetDims& dims = drafter.dims;
  const TrainBatch& batch = golden.batch;
  const LossWeights& weights = golden.weights;
  const Json& want = reference["heads"][head_kind];
  const TargetHead target = golden.head();

  // Plain f32 with an f32 head: as close to PyTorch's float64 as the CPU's f32 (which sees ~5e-7).
  for (bool training_precision : {false, true}) {
    const CudaTrainPrecision precision =
        training_precision ? CudaTrainPrecision{} : CudaTrainPrecision{cuda::GemmMath::F32, false};
    // Training precision: TF32 and a bf16 head that PyTorch's float64 head is not.
    const double term_tolerance = training_precision ? 1e-2 : 2e-5, gradient_tolerance = training_precision ? 5e-2 : 1e-4;
    const CudaTrainHead head(target, dims, precision.bf16_head);
    CudaDrafterLoss loss(drafter, head, precision);
    loss.upload(batch);
    const LossTerms terms = loss.compute(weights, true);
    EXPECT_EQ(terms.positions, want["positions"].get<long>());
    for (auto [ours, key] : {std::pair{terms.loss, "loss"}, std::pair{terms.ce, "ce"}, std::pair{terms.l1, "l1"},
                             std::pair{terms.bce, "bce"}, std::pair{terms.tau_estimate, "tau_estimate"}}) {
      const double theirs = want[key];
      EXPECT_NEAR(ours, theirs, term_tolerance * std::fabs(theirs)) << key << (training_precision ? " (tf32)" : "");
    }
    Gradients gradients;
    loss.download_gradients(gradients);
    double worst = 0.0;
    for (const std::string& name : drafter.names) {
      const Tensor theirs = expected.load_f32("grad." + name);
      const std::vector<double> a = as_double(gradients.at(name)), b(theirs.data, theirs.data + theirs.numel());
      if (head_kind == "rnn" && name == "markov.w2") {  // unused by the RNN head: zero on both sides
        for (double value : a) ASSERT_EQ(value, 0.0);
        continue;
      }
      const double error = relative_difference(a, b);
      worst = std::max(worst, error);
      EXPECT_LE(error, gradient_tolerance) << name << (training_precision ? " (tf32)" : "");
    }
    std::printf("  golden %-6s %s: worst gradient %.2e\n", head_kind.c_str(), training_precision ? "tf32+bf16" : "f32",
                worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, CudaLossGolden, ::testing::Values("markov", "rnn", "gru"));

// ---------------------------------------------------------------- AdamW

// Three steps from the same gradients: the first two clipped (norm far above the clip), the
// last not. The GPU runs AdamW::step's arithmetic without FMA contraction: equal to ~1 ulp.
TEST(CudaTrainOptimizer, AdamWWithClippingMatchesCpu) {
  const RandomTarget target({16, 64, 1e-6f}, 4, false);
  Drafter cpu_drafter = random_drafter("rnn", target.dims, 3, 16, 2, 4, 51);
  const CudaTrainHead head(target.view(), cpu_drafter.dims, false);
  CudaDrafterLoss loss(cpu_drafter, head, CudaTrainPrecision{cuda::GemmMath::F32, false});
  std::vector<std::string> decays;
  for (const std::string& name : cpu_drafter.names)
    if (drafter_parameter_decays(name, cpu_drafter.parameter(name).shape)) decays.push_back(name);
  AdamWOptions options;
  options.weight_decay = 0.1;
  AdamW cpu_optimizer(cpu_drafter.parameters, decays, options);
  CudaAdamW gpu_optimizer(loss.layout(), options, loss.stream());
  auto finite_loss = to_device(std::vector<double>{1.0});
  for (int step = 0; step < 3; ++step) {
    const float scale = step < 2 ? 10.0f : 1e-3f;
    Gradients gradients = zero_gradients(cpu_drafter);
    long seed = 60 + step;
    for (auto& [name, gradient] : gradients) {
      const auto values = random_values(gradient.numel(), seed++, scale);
      std::copy(values.begin(), values.end(), gradient.data);
    }
    const std::vector<float> flat = loss.layout().pack(gradients);
    CUDA_CHECK(cudaMemcpy(loss.gradients(), flat.data(), flat.size() * 4, cudaMemcpyHostToDevice));
    const double lr = 1e-2 * (step + 1);
    const double norm = clip_gradients_by_global_norm(gradients, 1.0);
    cpu_optimizer.step(cpu_drafter.parameters, gradients, lr);
    gpu_optimizer.step(loss.parameters(), loss.gradients(), lr, 1.0, finite_loss.data());
    EXPECT_NEAR(gpu_optimizer.last_gradient_norm(), norm, 1e-9 * norm) << step;
  }
  Drafter gpu_drafter = cpu_drafter;
  for (auto& [name, tensor] : gpu_drafter.parameters) tensor = Tensor::zeros(tensor.shape);
  loss.download_parameters(gpu_drafter);
  TensorMap first, second;
  gpu_optimizer.download(first, second);
  EXPECT_EQ(gpu_optimizer.steps(), 3);
  for (const std::string& name : cpu_drafter.names) {
    EXPECT_LE(relative_difference(as_double(gpu_drafter.parameter(name)), as_double(cpu_drafter.parameter(name))),
              1e-6)
        << name;
    EXPECT_LE(relative_difference(as_double(first.at(name)), as_double(cpu_optimizer.first_moments().at(name))), 1e-6)
        << name;
    EXPECT_LE(relative_difference(as_double(second.at(name)), as_double(cpu_optimizer.second_moments().at(name))),
              1e-6)
        << name;
  }
  // A loss that is not finite changes nothing.
  auto bad_loss = to_device(std::vector<double>{NAN});
  gpu_optimizer.step(loss.parameters(), loss.gradients(), 1.0, 1.0, bad_loss.data());
  Drafter after = gpu_drafter;
  for (auto& [name, tensor] : after.parameters) tensor = Tensor::zeros(tensor.shape);
  loss.download_parameters(after);
  for (const std::string& name : cpu_drafter.names)
    ASSERT_EQ(std::memcmp(after.parameter(name).data, gpu_drafter.parameter(name).data,
                          gpu_drafter.parameter(name).numel() * 4),
              0)
        << name;
}

// ---------------------------------------------------------------- the trainer

const Transformer& golden_target() {
  static const Transformer target = load_transformer(golden_model("qwen3"));
  return target;
}

// Eight sampled answers of the golden qwen3 (tests/tiny_regen.h).
const std::filesystem::path& tiny_data() { return testing::tiny_regenerated_data(); }

Drafter tiny_drafter(const std::string& head) {
  DrafterConfig config;
  config.gamma = 4;
  config.d_draft = 32;
  config.num_layers = 1;
  config.num_heads = 4;
  config.markov_rank = 16;
  config.tap_layers = {1, 3, 4};
  config.seq_head = head;
  const ModelConfig& c = golden_target().config;
  return init_drafter(config, {c.hidden_size, c.vocab_size, c.rms_norm_eps}, "qwen3", 1);
}

TrainOptions cuda_options() {
  TrainOptions options;
  options.device = "cuda";
  options.show_progress = false;
  options.batch = 6;
  options.max_context = 16;
  options.learning_rate = 1e-2;
  options.warmup = 3;
  options.held_out_fraction = 0.125;
  options.eval_anchors = 32;
  options.seed = 9;
  return options;
}

TEST(CudaTrainer, LossFallsAndAStoppedAndResumedRunEqualsAStraightOne) {
  const Dataset data(tiny_data());
  const TargetHead head = target_head_of(golden_target());
  for (const std::string& head_kind : kHeads) {
    TrainOptions options = cuda_options();
    options.iterations = 40;
    options.eval_every = 20;
    options.save_every = 15;
    TemporaryDirectory straight_dir, resumed_dir;
    Drafter straight = tiny_drafter(head_kind);
    const TrainSummary summary = train_drafter(straight, head, data, options, straight_dir.path, false);
    EXPECT_TRUE(summary.finished);
    std::printf("  cuda %-6s: held-out loss %.4f -> %.4f, tau^ %.3f -> %.3f, %.0f tokens/s\n", head_kind.c_str(),
                summary.first_eval.terms.loss, summary.last_eval.terms.loss, summary.first_eval.terms.tau_estimate,
                summary.last_eval.terms.tau_estimate, summary.positions_per_second);
    // The training loss falls: the first step's against the mean of the last five.
    std::vector<double> losses;
    std::ifstream log(straight_dir.path / kTrainLogFile);
    for (std::string line; std::getline(log, line);) {
      const Json record = Json::parse(line);
      if (record["split"] == "train") losses.push_back(record["loss"].get<double>());
    }
    ASSERT_EQ(losses.size(), 40u);
    const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5.0;
    std::printf("  cuda %-6s: train loss %.4f -> %.4f\n", head_kind.c_str(), losses.front(), last);
    EXPECT_LT(last, 0.9 * losses.front()) << head_kind;
    // The checkpoint holds the GPU's weights, and the drafter came back trained in place.
    const Drafter saved = load_drafter(straight_dir.path);
    const Drafter fresh = tiny_drafter(head_kind);
    bool changed = false;
    for (const std::string& name : straight.names) {
      ASSERT_EQ(std::memcmp(saved.parameter(name).data, straight.parameter(name).data,
                            straight.parameter(name).numel() * 4),
                0)
          << name;
      changed |= std::memcmp(fresh.parameter(name).data, straight.parameter(name).data,
                             straight.parameter(name).numel() * 4) != 0;
    }
    EXPECT_TRUE(changed);

    TrainOptions stopping = options;
    stopping.stop_after = 17;
    Drafter first = tiny_drafter(head_kind);
    EXPECT_EQ(train_drafter(first, head, data, stopping, resumed_dir.path, false).steps, 17);
    Drafter resumed = load_drafter(resumed_dir.path);
    const TrainSummary rest = train_drafter(resumed, head, data, options, resumed_dir.path, true);
    EXPECT_EQ(rest.start_step, 17);
    EXPECT_TRUE(rest.finished);
    EXPECT_EQ(read_text_file(straight_dir.path / "model.safetensors"),
              read_text_file(resumed_dir.path / "model.safetensors"))
        << head_kind;
    EXPECT_EQ(read_text_file(straight_dir.path / "training_state-40.safetensors"),
              read_text_file(resumed_dir.path / "training_state-40.safetensors"))
        << head_kind;
  }
}

// The batch pipeline (the default: the next batch packed and copied while a step runs) trains exactly
// as building and uploading each batch between the steps does: the same batches, in the same order,
// evaluations in between drawing nothing from the steps' streams.
TEST(CudaTrainer, PrefetchedBatchesTrainBitIdenticallyToSerialOnes) {
  const Dataset data(tiny_data());
  const TargetHead head = target_head_of(golden_target());
  TrainOptions options = cuda_options();
  options.iterations = 12;
  options.eval_every = 3;  // evaluations between pipelined steps
  options.save_every = 0;
  TemporaryDirectory pipelined_dir, serial_dir;
  Drafter pipelined = tiny_drafter("gru"), serial = tiny_drafter("gru");
  TrainOptions serial_options = options;
  serial_options.prefetch = false;
  train_drafter(pipelined, head, data, options, pipelined_dir.path, false);
  train_drafter(serial, head, data, serial_options, serial_dir.path, false);
  EXPECT_EQ(read_text_file(pipelined_dir.path / "model.safetensors"),
            read_text_file(serial_dir.path / "model.safetensors"));
  EXPECT_EQ(read_text_file(pipelined_dir.path / "training_state-12.safetensors"),
            read_text_file(serial_dir.path / "training_state-12.safetensors"));
  auto records = [](const std::filesystem::path& output) {
    std::vector<Json> kept;
    std::ifstream log(output / kTrainLogFile);
    for (std::string line; std::getline(log, line);) {
      Json record = Json::parse(line);
      record.erase("tokens_per_s");  // the clock's
      kept.push_back(record);
    }
    return kept;
  };
  const std::vector<Json> with_pipeline = records(pipelined_dir.path), without = records(serial_dir.path);
  ASSERT_EQ(with_pipeline.size(), 12u + 5u);  // 12 steps, evaluations at 0, 3, 6, 9, 12
  EXPECT_EQ(with_pipeline, without);
}

// The step itself: N steps on pipelined batches == N steps on the same batches uploaded one by one.
TEST(CudaTrainer, PackedStepsEqualUploadedSteps) {
  const Dataset data(tiny_data());
  const TargetHead head = target_head_of(golden_target());
  const Drafter start = tiny_drafter("markov");
  std::vector<std::string> decays;
  for (const std::string& name : start.names)
    if (drafter_parameter_decays(name, start.parameter(name).shape)) decays.push_back(name);
  AdamW host_optimizer(start.parameters, decays, AdamWOptions{});
  const std::unique_ptr<TrainStep> packed_step = make_cuda_train_step(start, head, host_optimizer);
  const std::unique_ptr<TrainStep> uploaded_step = make_cuda_train_step(start, head, host_optimizer);
  const AnchorSampler sampler(data, split_dataset(data.size(), 0.0).train);
  BatchPipeline::Options options;
  options.seed = 4;
  options.batch = 5;
  options.gamma = start.config.gamma;
  options.max_context = 12;
  options.end_step = 6;
  options.chunk_bytes = 4096;  // several copies per batch
  BatchPipeline pipeline(data, sampler, options, *packed_step->batch_staging());
  std::vector<Anchor> anchors(options.batch);
  TrainBatch batch;
  const LossWeights weights;
  for (long step = 0; step < options.end_step; ++step) {
    const TrainStep::Result packed = packed_step->train_packed(pipeline.next(), weights, 1.0, 1e-2);
    sample_step_anchors(sampler, options.seed, step, anchors);
    build_train_batch(data, anchors, options.gamma, options.max_context, batch, ContextRows::Bf16);
    const TrainStep::Result uploaded = uploaded_step->train(batch, weights, 1.0, 1e-2);
    EXPECT_EQ(packed.terms.loss, uploaded.terms.loss) << "step " << step;
    EXPECT_EQ(packed.terms.positions, uploaded.terms.positions) << "step " << step;
    EXPECT_EQ(packed.gradient_norm, uploaded.gradient_norm) << "step " << step;
  }
  auto fresh = [&] {  // Drafter copies share their tensors: new ones to download into
    Drafter drafter = start;
    for (auto& [name, tensor] : drafter.parameters) tensor = Tensor::zeros(tensor.shape);
    return drafter;
  };
  Drafter from_packed = fresh(), from_uploaded = fresh();
  AdamW packed_optimizer(start.parameters, decays, AdamWOptions{});
  AdamW uploaded_optimizer(start.parameters, decays, AdamWOptions{});
  packed_step->store(from_packed, packed_optimizer);
  uploaded_step->store(from_uploaded, uploaded_optimizer);
  bool trained = false;
  for (const std::string& name : start.names) {
    const size_t bytes = start.parameter(name).numel() * 4;
    EXPECT_EQ(std::memcmp(from_packed.parameter(name).data, from_uploaded.parameter(name).data, bytes), 0) << name;
    trained |= std::memcmp(from_packed.parameter(name).data, start.parameter(name).data, bytes) != 0;
  }
  EXPECT_TRUE(trained);
}

// The first steps on the GPU follow the CPU's: the same batches, the training precision's differences only.
TEST(CudaTrainer, FirstStepsFollowTheCpu) {
  const Dataset data(tiny_data());
  const TargetHead head = target_head_of(golden_target());
  TrainOptions options = cuda_options();
  options.iterations = 5;
  options.eval_every = 0;
  TemporaryDirectory cpu_dir, cuda_dir;
  Drafter on_cpu = tiny_drafter("markov"), on_gpu = tiny_drafter("markov");
  TrainOptions cpu_options = options;
  cpu_options.device = "cpu";
  const TrainSummary cpu_run = train_drafter(on_cpu, head, data, cpu_options, cpu_dir.path, false);
  const TrainSummary gpu_run = train_drafter(on_gpu, head, data, options, cuda_dir.path, false);
  // (Not the weights themselves: AdamW's normalised step turns the sign of a near-zero gradient, which
  // TF32 may flip, into a full-size difference of that weight.)
  std::printf("  5 steps: cpu loss %.5f tau^ %.4f, cuda loss %.5f tau^ %.4f\n", cpu_run.last_train.loss,
              cpu_run.last_eval.terms.tau_estimate, gpu_run.last_train.loss, gpu_run.last_eval.terms.tau_estimate);
  EXPECT_NEAR(gpu_run.first_eval.terms.loss, cpu_run.first_eval.terms.loss, 1e-2 * cpu_run.first_eval.terms.loss);
  EXPECT_NEAR(gpu_run.last_train.loss, cpu_run.last_train.loss, 3e-2 * cpu_run.last_train.loss);
  EXPECT_NEAR(gpu_run.last_eval.terms.tau_estimate, cpu_run.last_eval.terms.tau_estimate, 5e-2);
}

}  // namespace
}  // namespace dspark
