// Finite differences for the gradient checks: central differences of a scalar
// objective, one element at a time, summed in double.
#pragma once
#include <cmath>
#include <cstddef>
#include <functional>
#include <vector>

#include "core/random.h"

namespace dspark::testing {

// Uniform values in [-scale, scale).
inline std::vector<float> random_values(Rng& rng, size_t count, float scale) {
  std::vector<float> values(count);
  for (float& value : values) value = scale * float(2.0 * rng.uniform() - 1.0);
  return values;
}

// (f(x + step e_i) - f(x - step e_i)) / (2 step) for each i in `indices` (all
// of x when empty); x is restored after each element.
inline std::vector<double> numeric_gradient(float* x, size_t count, const std::function<double()>& objective,
                                            float step, const std::vector<size_t>& indices = {}) {
  std::vector<double> gradient;
  auto one = [&](size_t i) {
    const float saved = x[i];
    x[i] = saved + step;
    const double plus = objective();
    x[i] = saved - step;
    const double minus = objective();
    x[i] = saved;
    // The perturbation actually applied, after f32 rounding of saved ± step.
    gradient.push_back((plus - minus) / (double(saved + step) - double(saved - step)));
  };
  if (indices.empty())
    for (size_t i = 0; i < count; ++i) one(i);
  else
    for (size_t i : indices) one(i);
  return gradient;
}

// ||a - b|| / max(||b||, floor), a and b of equal length.
inline double relative_difference(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-12) {
  double difference = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(difference) / std::max(std::sqrt(norm), floor);
}

// Sum of weights[i] * values[i] in double: a scalar objective over an op's output.
inline double weighted_sum(const float* values, const std::vector<float>& weights) {
  double total = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) total += double(weights[i]) * values[i];
  return total;
}

}  // namespace dspark::testing
