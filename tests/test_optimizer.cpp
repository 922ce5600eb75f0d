// AdamW, gradient clipping and the learning-rate schedule, against a hand
// computation and against torch.optim.AdamW + clip_grad_norm_
// (tests/tools/make_adamw_reference.py).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "train/optimizer.h"

namespace dspark {
namespace {

Tensor tensor_of(Shape shape, std::vector<float> values) {
  Tensor tensor = Tensor::zeros(std::move(shape));
  std::copy(values.begin(), values.end(), tensor.data);
  return tensor;
}

TensorMap reference_parameters() {
  TensorMap parameters;
  parameters.emplace("vector", tensor_of({3}, {0.5f, -0.25f, 1.0f}));
  parameters.emplace("matrix", tensor_of({2, 2}, {0.3f, -0.7f, 1.2f, 0.05f}));
  return parameters;
}

// The script's gradients at 1-based step s.
TensorMap reference_gradients(int step) {
  TensorMap gradients;
  Tensor vector = Tensor::zeros({3}), matrix = Tensor::zeros({2, 2});
  for (int i = 0; i < 3; ++i) vector.data[i] = static_cast<float>(3 * std::sin(step * (i + 1.0)));
  for (int i = 0; i < 4; ++i) matrix.data[i] = static_cast<float>(2 * std::cos(step + 0.5 * i));
  gradients.emplace("vector", vector);
  gradients.emplace("matrix", matrix);
  return gradients;
}

AdamWOptions reference_options() {
  AdamWOptions options;
  options.beta1 = 0.9;
  options.beta2 = 0.95;
  options.epsilon = 1e-8;
  options.weight_decay = 0.1;
  return options;
}

TEST(AdamW, FirstStepMatchesAHandComputation) {
  // Step 1: m̂ = g and v̂ = g², so the update is lr·g/(|g| + ε) ≈ lr·sign(g);
  // the decayed tensor is first multiplied by 1 - lr·wd.
  TensorMap parameters = reference_parameters();
  AdamW optimizer(parameters, {"matrix"}, reference_options());
  TensorMap gradients = reference_gradients(1);
  const double lr = 0.01;
  std::vector<float> expected_vector(3), expected_matrix(4);
  for (int i = 0; i < 3; ++i) {
    const double g = gradients.at("vector").data[i];
    expected_vector[i] = static_cast<float>(parameters.at("vector").data[i] - lr * g / (std::fabs(g) + 1e-8));
  }
  for (int i = 0; i < 4; ++i) {
    const double g = gradients.at("matrix").data[i];
    expected_matrix[i] =
        static_cast<float>(parameters.at("matrix").data[i] * (1 - lr * 0.1) - lr * g / (std::fabs(g) + 1e-8));
  }
  optimizer.step(parameters, gradients, lr);
  EXPECT_EQ(optimizer.steps(), 1);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(parameters.at("vector").data[i], expected_vector[i], 1e-7) << i;
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(parameters.at("matrix").data[i], expected_matrix[i], 1e-7) << i;
}

TEST(AdamW, ThreeClippedStepsMatchTorch) {
  // Printed by tests/tools/make_adamw_reference.py (torch 1.13).
  const double norms[3] = {4.29430437, 4.8976512, 3.42422986};
  const std::vector<std::vector<float>> vectors = {{0.49000001f, -0.25999999f, 0.99000001f},
                                                   {0.470021844f, -0.262055129f, 0.996172667f},
                                                   {0.456969142f, -0.260315835f, 0.98960942f}};
  const std::vector<std::vector<float>> matrices = {{0.289700031f, -0.709299982f, 1.20880008f, 0.0599500015f},
                                                    {0.286335558f, -0.69457829f, 1.22544551f, 0.0798352286f},
                                                    {0.293522626f, -0.681521416f, 1.23818755f, 0.0933168903f}};
  const double rates[3] = {0.01, 0.02, 0.015};
  TensorMap parameters = reference_parameters();
  AdamW optimizer(parameters, {"matrix"}, reference_options());
  for (int step = 1; step <= 3; ++step) {
    TensorMap gradients = reference_gradients(step);
    EXPECT_NEAR(clip_gradients_by_global_norm(gradients, 1.0), norms[step - 1], 1e-6);
    EXPECT_NEAR(global_gradient_norm(gradients), 1.0, 1e-5);
    optimizer.step(parameters, gradients, rates[step - 1]);
    for (int i = 0; i < 3; ++i)
      EXPECT_NEAR(parameters.at("vector").data[i], vectors[step - 1][i], 2e-7) << "step " << step << " vector " << i;
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(parameters.at("matrix").data[i], matrices[step - 1][i], 2e-7) << "step " << step << " matrix " << i;
  }
}

TEST(AdamW, RestoredStateContinuesIdentically) {
  TensorMap straight = reference_parameters(), resumed = reference_parameters();
  AdamW first(straight, {"matrix"}, reference_options());
  for (int step = 1; step <= 2; ++step) first.step(straight, reference_gradients(step), 0.01);
  TensorMap copy;
  for (const auto& [name, tensor] : straight) {
    Tensor owned = Tensor::zeros(tensor.shape);
    std::copy_n(tensor.data, tensor.numel(), owned.data);
    copy.emplace(name, owned);
  }
  AdamW second(copy, {"matrix"}, reference_options());
  second.restore(first.steps(), first.first_moments(), first.second_moments());
  first.step(straight, reference_gradients(3), 0.01);
  second.step(copy, reference_gradients(3), 0.01);
  for (const auto& [name, tensor] : straight)
    for (long i = 0; i < tensor.numel(); ++i) EXPECT_EQ(tensor.data[i], copy.at(name).data[i]) << name << i;
}

TEST(GradientClipping, ScalesToTheGlobalNormOnlyAboveIt) {
  TensorMap gradients;
  gradients.emplace("a", tensor_of({2}, {0.3f, 0.4f}));
  EXPECT_NEAR(clip_gradients_by_global_norm(gradients, 1.0), 0.5, 1e-7);
  EXPECT_EQ(gradients.at("a").data[0], 0.3f);
  EXPECT_EQ(gradients.at("a").data[1], 0.4f);
  gradients.at("a").data[0] = 3.0f;
  gradients.at("a").data[1] = 4.0f;
  gradients.emplace("b", tensor_of({1}, {12.0f}));  // norm 13 over both tensors
  EXPECT_NEAR(clip_gradients_by_global_norm(gradients, 1.0), 13.0, 1e-6);
  EXPECT_NEAR(gradients.at("b").data[0], 12.0 / (13.0 + 1e-6), 1e-7);
  EXPECT_NEAR(gradients.at("a").data[1], 4.0 / (13.0 + 1e-6), 1e-7);
  EXPECT_NEAR(global_gradient_norm(gradients), 1.0, 1e-6);
}

TEST(WeightDecay, MatricesDecayNormsBiasesAndTablesDoNot) {
  for (const char* name :
       {"bb.0.q", "bb.1.down", "W_c", "tok_proj", "out_proj", "markov.w2", "conf.w", "rnn.wH", "rnn.wO", "gru.wJ"})
    EXPECT_TRUE(drafter_parameter_decays(name, {4, 4})) << name;
  for (const char* name : {"markov.w1", "mask_emb", "block_pos"})
    EXPECT_FALSE(drafter_parameter_decays(name, {4, 4})) << name;
  for (const char* name : {"bb.0.attn_norm", "ctx_norm", "out_norm", "conf.b", "rnn.bH", "gru.bJ"})
    EXPECT_FALSE(drafter_parameter_decays(name, {4})) << name;
}

TEST(LearningRateSchedule, WarmsUpLinearlyThenFollowsTheCosine) {
  const LearningRateSchedule schedule{1e-3, 4, 14, 0.1};
  EXPECT_DOUBLE_EQ(schedule.at(0), 0.25e-3);
  EXPECT_DOUBLE_EQ(schedule.at(1), 0.5e-3);
  EXPECT_DOUBLE_EQ(schedule.at(3), 1e-3);
  EXPECT_DOUBLE_EQ(schedule.at(4), 1e-3);                        // the cosine starts at the peak
  EXPECT_NEAR(schedule.at(9), 1e-3 * (0.1 + 0.9 * 0.5), 1e-15);  // halfway: the mean of peak and floor
  // Step s is (s - 4)/10 of the way through the cosine.
  EXPECT_NEAR(schedule.at(10), 1e-3 * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.6))), 1e-15);
  EXPECT_NEAR(schedule.at(13), 1e-3 * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.9))), 1e-15);
  for (long step = 5; step < 14; ++step) EXPECT_LT(schedule.at(step), schedule.at(step - 1)) << step;
  const LearningRateSchedule no_warmup{2e-3, 0, 10, 0.0};
  EXPECT_DOUBLE_EQ(no_warmup.at(0), 2e-3);
  EXPECT_NEAR(no_warmup.at(5), 1e-3, 1e-15);
}

}  // namespace
}  // namespace dspark
