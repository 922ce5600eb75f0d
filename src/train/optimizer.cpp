#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace dspark {

bool drafter_parameter_decays(const std::string& name, const Shape& shape) {
  if (shape.size() < 2) return false;  // norm weights and biases
  return name != "markov.w1" && name != "mask_emb" && name != "block_pos";
}

AdamW::AdamW(const TensorMap& parameters, std::vector<std::string> decays, const AdamWOptions& options)
    : options_(options), decays_(std::move(decays)) {
  std::sort(decays_.begin(), decays_.end());
  for (const auto& [name, tensor] : parameters) {
    first_.emplace(name, Tensor::zeros(tensor.shape));
    second_.emplace(name, Tensor::zeros(tensor.shape));
  }
}

void AdamW::step(TensorMap& parameters, const TensorMap& gradients, double learning_rate) {
  ++steps_;
  const double correction1 = 1.0 - std::pow(options_.beta1, double(steps_));
  const double correction2 = 1.0 - std::pow(options_.beta2, double(steps_));
  const float step_size = static_cast<float>(learning_rate / correction1);
  const float correction2_root = static_cast<float>(std::sqrt(correction2));
  const float beta1 = static_cast<float>(options_.beta1), beta2 = static_cast<float>(options_.beta2);
  const float keep1 = static_cast<float>(1.0 - options_.beta1), keep2 = static_cast<float>(1.0 - options_.beta2);
  const float epsilon = static_cast<float>(options_.epsilon);
  const float shrink = static_cast<float>(1.0 - learning_rate * options_.weight_decay);
  for (auto& [name, parameter] : parameters) {
    auto gradient = gradients.find(name);
    if (gradient == gradients.end()) continue;
    DSPARK_CHECK(gradient->second.shape == parameter.shape, "gradient of \"", name, "\" has shape ",
                 shape_string(gradient->second.shape), ", the parameter ", shape_string(parameter.shape));
    float* theta = parameter.data;
    const float* g = gradient->second.data;
    float* m = first_.at(name).data;
    float* v = second_.at(name).data;
    const long count = parameter.numel();
    if (std::binary_search(decays_.begin(), decays_.end(), name))
      for (long i = 0; i < count; ++i) theta[i] *= shrink;
    for (long i = 0; i < count; ++i) {
      m[i] = m[i] * beta1 + g[i] * keep1;
      v[i] = v[i] * beta2 + keep2 * g[i] * g[i];
      const float denominator = std::sqrt(v[i]) / correction2_root + epsilon;
      theta[i] += -step_size * (m[i] / denominator);
    }
  }
}

void AdamW::restore(long steps, const TensorMap& first, const TensorMap& second) {
  for (auto* moments : {&first_, &second_}) {
    const TensorMap& source = moments == &first_ ? first : second;
    for (auto& [name, tensor] : *moments) {
      auto found = source.find(name);
      DSPARK_CHECK(found != source.end() && found->second.shape == tensor.shape, "optimizer state has no ",
                   moments == &first_ ? "first" : "second", " moment for \"", name, "\" of shape ",
                   shape_string(tensor.shape));
      std::copy_n(found->second.data, tensor.numel(), tensor.data);
    }
  }
  steps_ = steps;
}

double global_gradient_norm(const TensorMap& gradients) {
  double total = 0.0;
  for (const auto& [name, gradient] : gradients)
    for (long i = 0; i < gradient.numel(); ++i) total += double(gradient.data[i]) * gradient.data[i];
  return std::sqrt(total);
}

double clip_gradients_by_global_norm(TensorMap& gradients, double max_norm) {
  const double norm = global_gradient_norm(gradients);
  if (norm > max_norm) {
    const float scale = static_cast<float>(max_norm / (norm + 1e-6));
    for (auto& [name, gradient] : gradients)
      for (long i = 0; i < gradient.numel(); ++i) gradient.data[i] *= scale;
  }
  return norm;
}

double LearningRateSchedule::at(long step) const {
  if (step < warmup_steps) return peak * double(step + 1) / double(warmup_steps);
  const double span = std::max(1L, total_steps - warmup_steps);
  const double progress = std::min(1.0, double(step - warmup_steps) / span);
  return peak * (final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

}  // namespace dspark
