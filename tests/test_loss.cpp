// The DSpark training loss and its backward (src/train/loss.h):
//  - the training forward equals draft_teacher_forced, anchor by anchor;
//  - every gradient of every parameter of every head against central finite
//    differences of the loss itself (the BCE label held fixed, as the
//    stop-gradient makes it);
//  - hand-built distributions (identical: L1 = 0 and c* = 1; disjoint: L1 = 2),
//    masked positions contributing nothing, the exp(-k/γ_decay) weights and τ̂
//    recomputed here in double from the drafter's outputs;
//  - loss terms, τ̂ and every gradient against PyTorch autograd
//    (tests/tools/make_train_golden.py, an independent float64 implementation).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <vector>

#include "core/json.h"
#include "core/safetensors.h"
#include "golden.h"
#include "gradient_check.h"
#include "random_drafter.h"
#include "train_golden.h"
#include "spec/draft.h"
#include "train/loss.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::numeric_gradient;
using testing::random_values;
using testing::relative_difference;
using testing::relative_error;

const std::vector<std::string> kHeads = {"markov", "rnn", "gru"};

// A tiny target: embedding and LM head [V, H] of uniform noise.
struct TinyTarget {
  TargetDims dims{8, 40, 1e-5f};  // H, V, eps
  std::vector<float> embedding, lm_head;
  explicit TinyTarget(uint64_t seed) {
    Rng rng(seed);
    embedding = random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 1.0f);
    lm_head = random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 0.8f);
  }
  TargetHead view() const { return {embedding.data(), lm_head.data()}; }
};

Drafter tiny_drafter(const std::string& head, const TargetDims& dims, uint64_t seed) {
  DrafterConfig config;
  config.gamma = 4;
  config.d_draft = 16;
  config.num_layers = 2;
  config.num_heads = 2;
  config.markov_rank = 4;
  config.ff_mult = 2;
  config.tap_layers = {1, 2};
  config.seq_head = head;
  Drafter drafter = init_drafter(config, dims, "tiny", 3);
  testing::randomize_parameters(drafter, seed, 1.0f);
  return drafter;
}

// Anchors with ragged contexts (lengths as given, 0 and 1 included); `masked`
// positions per anchor are the last ones (the block running off the end).
TrainBatch tiny_batch(const Drafter& drafter, uint64_t seed, const std::vector<int>& lengths,
                      const std::vector<int>& masked) {
  return testing::random_train_batch(drafter, seed, lengths, masked, drafter.dims.vocab_size);
}

// The training forward is draft_teacher_forced, anchor by anchor (head row k·A + a).
TEST(DrafterLoss, ForwardMatchesTeacherForcedDrafting) {
  const TinyTarget target(1);
  for (const std::string& head : kHeads) {
    Drafter drafter = tiny_drafter(head, target.dims, 21);
    const TrainBatch batch = tiny_batch(drafter, 5, {0, 1, 6, 3}, {0, 2, 0, 1});
    LossWorkspace workspace;
    drafter_loss(drafter, target.view(), batch, LossWeights{}, nullptr, workspace);
    const int A = batch.size(), gamma = batch.gamma, V = target.dims.vocab_size;
    for (int a = 0; a < A; ++a) {
      DraftContext context;
      extend_draft_context(drafter, context,
                           batch.context_rows.data() + long(batch.context_offsets[a]) * batch.tap_width,
                           batch.context_length(a));
      const std::span<const int32_t> tokens(batch.targets.data() + long(a) * gamma, gamma);
      const DraftForward expected = draft_teacher_forced(drafter, target.view(), context, batch.anchors[a], tokens);
      for (int k = 0; k < gamma; ++k) {
        const long row = long(k) * A + a;
        EXPECT_LE(
            relative_error(workspace.activations.logits.data() + row * V, expected.logits.data() + long(k) * V, V),
            1e-5)
            << head << " anchor " << a << " position " << k;
        EXPECT_NEAR(workspace.activations.confidence[row], expected.confidence[k], 1e-6) << head << " anchor " << a;
      }
    }
    // Training ignores the STS temperatures that inference divides the confidence logit by.
    const std::vector<float> confidence(workspace.activations.confidence.begin(),
                                        workspace.activations.confidence.begin() + A * gamma);
    drafter.config.sts = StsCalibration{{0, 0, 0, 0}, {2.0f, 3.0f, 4.0f, 5.0f}, 0.5f, 100};
    drafter_loss(drafter, target.view(), batch, LossWeights{}, nullptr, workspace);
    for (int row = 0; row < A * gamma; ++row) EXPECT_EQ(workspace.activations.confidence[row], confidence[row]);
  }
}

// Every parameter of every head against central differences of the loss.
TEST(DrafterLoss, GradientsMatchFiniteDifferences) {
  const TinyTarget target(2);
  LossWeights weights;
  weights.gamma_decay = 3.0f;
  for (const std::string& head : kHeads) {
    Drafter drafter = tiny_drafter(head, target.dims, 31);
    const TrainBatch batch = tiny_batch(drafter, 7, {0, 1, 5, 3}, {0, 2, 0, 1});
    LossWorkspace workspace;
    Gradients gradients = zero_gradients(drafter);
    const LossTerms terms = drafter_loss(drafter, target.view(), batch, weights, &gradients, workspace);
    ASSERT_EQ(terms.positions, 13);
    workspace.hold_for_gradient_check = true;  // c* constant, L1 linearised
    auto loss = [&] { return drafter_loss(drafter, target.view(), batch, weights, nullptr, workspace).loss; };
    for (const std::string& name : drafter.names) {
      Tensor& parameter = drafter.parameters.at(name);
      const Tensor& gradient = gradients.at(name);
      const std::vector<double> analytic(gradient.data, gradient.data + gradient.numel());
      const std::vector<double> numeric = numeric_gradient(parameter.data, parameter.numel(), loss, 1e-2f);
      double norm = 0.0;
      for (double value : analytic) norm += value * value;
      if (head == "rnn" && name == "markov.w2") {  // the RNN head's output matrix is rnn.wO
        EXPECT_EQ(norm, 0.0);
        continue;
      }
      EXPECT_GT(norm, 0.0) << head << " " << name << " has no gradient";
      EXPECT_LE(relative_difference(analytic, numeric), 2e-3) << head << " " << name;
    }
  }
}

void fill(Drafter& drafter, const std::string& name, float value) {
  Tensor& tensor = drafter.parameters.at(name);
  std::fill_n(tensor.data, tensor.numel(), value);
}

// The loss recomputed here in double from the drafter's outputs (logits and
// confidence in the workspace) and the target head: per-position CE, L1, BCE,
// means weighted by exp(-k / γ_decay)·mask, and τ̂.
LossTerms loss_by_hand(const TinyTarget& target, const TrainBatch& batch, const LossWorkspace& workspace,
                       const LossWeights& weights) {
  const int A = batch.size(), gamma = batch.gamma, H = target.dims.hidden_size, V = target.dims.vocab_size;
  LossTerms terms;
  double total_weight = 0.0, tau_sum = 0.0;
  int anchors_trained = 0;
  for (int a = 0; a < A; ++a) {
    double survival = 1.0, tau = 1.0;
    bool trained = false;
    for (int k = 0; k < gamma; ++k) {
      const float mask = batch.mask[a * gamma + k];
      if (mask == 0.0f) continue;
      const float* logits = workspace.activations.logits.data() + long(k * A + a) * V;
      const float* row = batch.target_hidden.data() + long(a * gamma + k) * H;
      std::vector<double> drafted(V), expected(V);
      double drafted_total = 0.0, expected_total = 0.0;
      for (int v = 0; v < V; ++v) {
        double target_logit = 0.0;
        for (int i = 0; i < H; ++i) target_logit += double(row[i]) * target.lm_head[long(v) * H + i];
        drafted_total += drafted[v] = std::exp(double(logits[v]));
        expected_total += expected[v] = std::exp(target_logit);
      }
      double l1 = 0.0;
      for (int v = 0; v < V; ++v) l1 += std::fabs(drafted[v] / drafted_total - expected[v] / expected_total);
      const double label = 1.0 - l1 / 2.0, c = workspace.activations.confidence[k * A + a];
      const double weight = std::exp(-k / double(weights.gamma_decay)) * mask;
      terms.ce -= weight * std::log(drafted[batch.targets[a * gamma + k]] / drafted_total);
      terms.l1 += weight * l1;
      terms.bce -= weight * (label * std::log(c) + (1.0 - label) * std::log(1.0 - c));
      total_weight += weight;
      ++terms.positions;
      survival *= label;
      tau += survival;
      trained = true;
    }
    if (trained) tau_sum += tau, ++anchors_trained;
  }
  terms.ce /= total_weight, terms.l1 /= total_weight, terms.bce /= total_weight;
  terms.loss = weights.ce * terms.ce + weights.l1 * terms.l1 + weights.bce * terms.bce;
  terms.tau_estimate = tau_sum / anchors_trained;
  return terms;
}

TEST(DrafterLoss, TermsAreDecayWeightedMeansOverTrainedPositions) {
  const TinyTarget target(3);
  for (const std::string& head : kHeads) {
    const Drafter drafter = tiny_drafter(head, target.dims, 41);
    const TrainBatch batch = tiny_batch(drafter, 9, {2, 0, 4, 1, 3}, {0, 1, 3, 0, 4});
    double previous_ce = 0.0;
    for (float decay : {7.0f, 0.5f}) {
      LossWeights weights;
      weights.gamma_decay = decay;
      LossWorkspace workspace;
      const LossTerms ours = drafter_loss(drafter, target.view(), batch, weights, nullptr, workspace);
      const LossTerms expected = loss_by_hand(target, batch, workspace, weights);
      EXPECT_EQ(ours.positions, 12);
      EXPECT_NEAR(ours.ce, expected.ce, 1e-5 * expected.ce) << head << " decay " << decay;
      EXPECT_NEAR(ours.l1, expected.l1, 1e-5 * expected.l1) << head << " decay " << decay;
      EXPECT_NEAR(ours.bce, expected.bce, 1e-5 * expected.bce) << head << " decay " << decay;
      EXPECT_NEAR(ours.loss, expected.loss, 1e-5 * expected.loss) << head << " decay " << decay;
      EXPECT_NEAR(ours.tau_estimate, expected.tau_estimate, 1e-5) << head << " decay " << decay;
      EXPECT_NE(ours.ce, previous_ce);  // the decay reweights positions
      previous_ce = ours.ce;
    }
  }
}

// Identical distributions (LM head zero, so U = 0; the sequential head's output zero, so B = 0):
// L1 = 0, c* = 1, CE = log V, and L1 contributes no gradient.
TEST(DrafterLoss, IdenticalDistributionsGiveZeroL1) {
  TinyTarget target(4);
  std::fill(target.lm_head.begin(), target.lm_head.end(), 0.0f);
  for (const std::string& head : kHeads) {
    Drafter drafter = tiny_drafter(head, target.dims, 51);
    fill(drafter, head == "rnn" ? "rnn.wO" : "markov.w2", 0.0f);
    fill(drafter, "conf.w", 0.0f);
    fill(drafter, "conf.b", 0.7f);
    const TrainBatch batch = tiny_batch(drafter, 11, {3, 0, 2}, {0, 1, 2});
    LossWorkspace workspace;
    Gradients with_l1 = zero_gradients(drafter), without_l1 = zero_gradients(drafter);
    const LossTerms terms = drafter_loss(drafter, target.view(), batch, LossWeights{}, &with_l1, workspace);
    const double c = 1.0 / (1.0 + std::exp(-0.7));
    EXPECT_EQ(terms.l1, 0.0) << head;
    EXPECT_NEAR(terms.ce, std::log(40.0), 1e-6) << head;
    EXPECT_NEAR(terms.bce, -std::log(c), 1e-6) << head;  // c* = 1
    EXPECT_NEAR(terms.loss, 0.1 * std::log(40.0) - std::log(c), 1e-6) << head;
    for (int a = 0; a < 3; ++a)
      for (int k = 0; k < 4; ++k) {
        if (batch.mask[a * 4 + k] > 0.0f) {
          EXPECT_EQ(workspace.labels[k * 3 + a], 1.0f) << head;
        }
      }
    EXPECT_NEAR(terms.tau_estimate, 1.0 + (4 + 3 + 2) / 3.0, 1e-6) << head;  // every prefix survives
    LossWeights no_l1;
    no_l1.l1 = 0.0f;
    drafter_loss(drafter, target.view(), batch, no_l1, &without_l1, workspace);
    for (const std::string& name : drafter.names)
      for (long i = 0; i < with_l1.at(name).numel(); ++i)
        ASSERT_EQ(with_l1.at(name).data[i], without_l1.at(name).data[i]) << head << " " << name << "[" << i << "]";
  }
}

// Disjoint supports: the target puts all its mass on token 0 (LM head row 0 aligned with every target
// row), the drafter on token 1 (out_proj = 0 so U = 0; B = 1000 on token 1). L1 = 2, c* = 0, CE = 0.
TEST(DrafterLoss, DisjointSupportsGiveL1OfTwo) {
  TinyTarget target(5);
  const int H = target.dims.hidden_size, V = target.dims.vocab_size, r = 4;
  std::fill(target.lm_head.begin(), target.lm_head.end(), 0.0f);
  target.lm_head[0] = 100.0f;
  Drafter drafter = tiny_drafter("markov", target.dims, 61);
  fill(drafter, "out_proj", 0.0f);
  fill(drafter, "markov.w1", 0.0f);
  fill(drafter, "markov.w2", 0.0f);
  for (int v = 0; v < V; ++v) drafter.parameters.at("markov.w1").data[v * r] = 1.0f;  // e = [1, 0, 0, 0]
  drafter.parameters.at("markov.w2").data[1] = 1000.0f;                               // B = 1000 on token 1
  fill(drafter, "conf.w", 0.0f);
  fill(drafter, "conf.b", -0.4f);
  TrainBatch batch = tiny_batch(drafter, 13, {1, 4}, {0, 2});
  std::fill(batch.targets.begin(), batch.targets.end(), 1);
  for (size_t row = 0; row < batch.target_hidden.size() / H; ++row)
    for (int i = 0; i < H; ++i) batch.target_hidden[row * H + i] = i == 0 ? 1.0f : 0.0f;
  LossWorkspace workspace;
  const LossTerms terms = drafter_loss(drafter, target.view(), batch, LossWeights{}, nullptr, workspace);
  const double c = 1.0 / (1.0 + std::exp(0.4));
  EXPECT_NEAR(terms.l1, 2.0, 1e-6);
  EXPECT_NEAR(terms.ce, 0.0, 1e-6);
  EXPECT_NEAR(terms.bce, -std::log(1.0 - c), 1e-6);  // c* = 0
  for (int a = 0; a < 2; ++a)
    for (int k = 0; k < 4; ++k) {
      if (batch.mask[a * 4 + k] > 0.0f) {
        EXPECT_NEAR(workspace.labels[k * 2 + a], 0.0f, 1e-6);
      }
    }
  EXPECT_NEAR(terms.tau_estimate, 1.0, 1e-6);  // nothing survives the first position
}

// Masked positions contribute nothing: their targets and target rows can be anything.
TEST(DrafterLoss, MaskedPositionsContributeNothing) {
  const TinyTarget target(6);
  for (const std::string& head : kHeads) {
    const Drafter drafter = tiny_drafter(head, target.dims, 71);
    const TrainBatch batch = tiny_batch(drafter, 15, {2, 5, 0}, {1, 3, 2});
    TrainBatch changed = batch;
    Rng rng(3);
    const int gamma = batch.gamma, H = batch.hidden_size;
    for (size_t position = 0; position < batch.mask.size(); ++position)
      if (batch.mask[position] == 0.0f) {
        changed.targets[position] = static_cast<int32_t>(rng.next() % 40);
        for (int i = 0; i < H; ++i) changed.target_hidden[position * H + i] = float(rng.uniform() * 4.0 - 2.0);
      }
    LossWorkspace workspace;
    Gradients original = zero_gradients(drafter), altered = zero_gradients(drafter);
    const LossTerms a = drafter_loss(drafter, target.view(), batch, LossWeights{}, &original, workspace);
    const LossTerms b = drafter_loss(drafter, target.view(), changed, LossWeights{}, &altered, workspace);
    EXPECT_EQ(a.positions, 3 * gamma - 6);
    EXPECT_NEAR(a.loss, b.loss, 1e-6 * a.loss) << head;
    EXPECT_NEAR(a.tau_estimate, b.tau_estimate, 1e-6) << head;
    for (const std::string& name : drafter.names) {
      const Tensor &x = original.at(name), &y = altered.at(name);
      EXPECT_LE(relative_difference({y.data, y.data + y.numel()}, {x.data, x.data + x.numel()}), 1e-5)
          << head << " " << name;
    }

    // Nothing trained: no positions, no loss, no gradient.
    TrainBatch none = batch;
    std::fill(none.mask.begin(), none.mask.end(), 0.0f);
    Gradients zero = zero_gradients(drafter);
    const LossTerms empty = drafter_loss(drafter, target.view(), none, LossWeights{}, &zero, workspace);
    EXPECT_EQ(empty.positions, 0);
    EXPECT_EQ(empty.loss, 0.0);
    for (const std::string& name : drafter.names)
      for (long i = 0; i < zero.at(name).numel(); ++i) ASSERT_EQ(zero.at(name).data[i], 0.0f) << name;
  }
}

TEST(DrafterLoss, RefusesAMismatchedBatch) {
  const TinyTarget target(7);
  const Drafter drafter = tiny_drafter("markov", target.dims, 81);
  TrainBatch batch = tiny_batch(drafter, 17, {1, 2}, {0, 0});
  LossWorkspace workspace;
  auto error = [&](const TrainBatch& bad) {
    return testing::error_of([&] { drafter_loss(drafter, target.view(), bad, LossWeights{}, nullptr, workspace); });
  };
  TrainBatch wrong_gamma = batch;
  wrong_gamma.gamma = 5;
  EXPECT_NE(error(wrong_gamma).find("gamma 5"), std::string::npos) << error(wrong_gamma);
  TrainBatch wrong_id = batch;
  wrong_id.targets[3] = 40;
  EXPECT_NE(error(wrong_id).find("target 40 outside vocab 40"), std::string::npos) << error(wrong_id);
  TrainBatch short_context = batch;
  short_context.context_rows.pop_back();
  EXPECT_NE(error(short_context).find("context floats"), std::string::npos) << error(short_context);
  TrainBatch bf16_rows = batch;  // the GPU's form of the rows: the CPU loss asks for f32
  bf16_rows.context_rows_bf16.assign(bf16_rows.context_rows.size(), 0);
  bf16_rows.context_rows.clear();
  EXPECT_NE(error(bf16_rows).find("f32 context rows"), std::string::npos) << error(bf16_rows);
}

// Against PyTorch autograd in float64 (tests/tools/make_train_golden.py).
class LossGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(LossGolden, TermsAndEveryGradientMatchPyTorch) {
  const std::string head = GetParam();
  const testing::TrainGolden golden = testing::load_train_golden(head);
  const Json& reference = golden.reference;
  const SafetensorsFile& expected = *golden.expected;
  const Drafter& drafter = golden.drafter;
  const TrainBatch& batch = golden.batch;
  const LossWeights& weights = golden.weights;
  ASSERT_EQ(drafter.names, reference["heads"][head]["param_names"].get<std::vector<std::string>>());

  LossWorkspace workspace;
  Gradients gradients = zero_gradients(drafter);
  const LossTerms terms =
      drafter_loss(drafter, golden.head(), batch, weights, &gradients, workspace);
  const Json& want = reference["heads"][head];
  EXPECT_EQ(terms.positions, want["positions"].get<long>());
  for (auto [ours, key] : {std::pair{terms.loss, "loss"}, std::pair{terms.ce, "ce"}, std::pair{terms.l1, "l1"},
                           std::pair{terms.bce, "bce"}, std::pair{terms.tau_estimate, "tau_estimate"}}) {
    const double theirs = want[key];
    EXPECT_NEAR(ours, theirs, 1e-5 * std::fabs(theirs)) << key;
  }
  for (const std::string& name : drafter.names) {
    const Tensor theirs = expected.load_f32("grad." + name), ours = gradients.at(name);
    const std::vector<double> a(ours.data, ours.data + ours.numel()), b(theirs.data, theirs.data + theirs.numel());
    EXPECT_LE(relative_difference(a, b), 1e-5) << name;  // f32 against f64: ~5e-7 seen
  }

  // Gradients accumulate: a second call adds the same again.
  drafter_loss(drafter, golden.head(), batch, weights, &gradients, workspace);
  for (const std::string& name : drafter.names) {
    const Tensor theirs = expected.load_f32("grad." + name), ours = gradients.at(name);
    std::vector<double> a(ours.data, ours.data + ours.numel()), b(theirs.data, theirs.data + theirs.numel());
    for (double& value : b) value *= 2.0;
    EXPECT_LE(relative_difference(a, b), 1e-5) << name << " after two calls";
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, LossGolden, ::testing::Values("markov", "rnn", "gru"));

// Timing of one realistic batch (not a check; run with --gtest_also_run_disabled_tests
// --gtest_filter='*LossTiming*'): d 256, 2 layers, 4 heads, r 128, γ 7, V 8192,
// H 512, 4 taps, A 32 anchors with contexts of 192..320 rows.
TEST(DrafterLoss, DISABLED_LossTiming) {
  const TargetDims dims{512, 8192, 1e-6f};
  Rng rng(1);
  const std::vector<float> embedding = random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 1.0f);
  const std::vector<float> lm_head = random_values(rng, size_t(dims.vocab_size) * dims.hidden_size, 0.1f);
  for (const std::string& head : kHeads) {
    DrafterConfig config;
    config.gamma = 7;
    config.d_draft = 256;
    config.num_layers = 2;
    config.num_heads = 4;
    config.markov_rank = 128;
    config.ff_mult = 2;
    config.tap_layers = {10, 15, 19, 20};
    config.seq_head = head;
    Drafter drafter = init_drafter(config, dims, "timing", 1);
    testing::randomize_parameters(drafter, 2, 1.0f);
    std::vector<int> lengths, masked;
    for (int a = 0; a < 32; ++a) lengths.push_back(192 + int(rng.next() % 129)), masked.push_back(a % 8 == 0 ? 3 : 0);
    TrainBatch batch;
    batch.gamma = config.gamma;
    batch.hidden_size = dims.hidden_size;
    batch.tap_width = 4 * dims.hidden_size;
    batch.context_offsets = {0};
    for (int a = 0; a < 32; ++a) {
      batch.context_offsets.push_back(batch.context_offsets.back() + lengths[a]);
      batch.anchors.push_back(int32_t(rng.next() % dims.vocab_size));
      for (int k = 0; k < config.gamma; ++k) {
        batch.targets.push_back(int32_t(rng.next() % dims.vocab_size));
        batch.mask.push_back(k < config.gamma - masked[a] ? 1.0f : 0.0f);
      }
    }
    batch.context_rows = random_values(rng, size_t(batch.context_offsets.back()) * batch.tap_width, 1.0f);
    batch.target_hidden = random_values(rng, size_t(32) * config.gamma * dims.hidden_size, 1.0f);
    LossWorkspace workspace;
    Gradients gradients = zero_gradients(drafter);
    const TargetHead target{embedding.data(), lm_head.data()};
    // Median wall time and process CPU time (all threads) of 3 runs after a warm-up: on a
    // shared machine the CPU time, with OPENBLAS_NUM_THREADS=1, is the steadier figure.
    auto measure = [&](bool backward) {
      std::vector<double> wall, cpu;
      for (int run = 0; run < 4; ++run) {
        const auto start = std::chrono::steady_clock::now();
        const std::clock_t cpu_start = std::clock();
        drafter_loss(drafter, target, batch, LossWeights{}, backward ? &gradients : nullptr, workspace);
        cpu.push_back(double(std::clock() - cpu_start) / CLOCKS_PER_SEC);
        wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(wall.begin() + 1, wall.end());
      std::sort(cpu.begin() + 1, cpu.end());
      return std::pair{wall[2] * 1e3, cpu[2] * 1e3};
    };
    const auto [forward_wall, forward_cpu] = measure(false);
    const auto [both_wall, both_cpu] = measure(true);
    std::printf("%-6s context rows %d: loss forward %.0f ms (cpu %.0f), forward + backward %.0f ms (cpu %.0f)\n",
                head.c_str(), batch.context_offsets.back(), forward_wall, forward_cpu, both_wall, both_cpu);
  }
}

}  // namespace
}  // namespace dspark
