#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

namespace dspark::cpu {

void rope_angles(float* cosines, float* sines, const int* positions, int rows, int head_dim,
                 const double* inverse_frequency) {
  const int half = head_dim / 2;
  for (int row = 0; row < rows; ++row)
    for (int i = 0; i < half; ++i) {
      // Angles in double: at long positions an f32 product loses the phase.
      const double angle = positions[row] * inverse_frequency[i];
      cosines[static_cast<long>(row) * half + i] = static_cast<float>(std::cos(angle));
      sines[static_cast<long>(row) * half + i] = static_cast<float>(std::sin(angle));
    }
}

void rope_apply(float* x, const float* cosines, const float* sines, int rows, int heads, int head_dim) {
  const int half = head_dim / 2;
  for (int row = 0; row < rows; ++row) {
    const float* cosine = cosines + static_cast<long>(row) * half;
    const float* sine = sines + static_cast<long>(row) * half;
    for (int head = 0; head < heads; ++head) {
      float* pair = x + (static_cast<long>(row) * heads + head) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float first = pair[i], second = pair[i + half];
        pair[i] = first * cosine[i] - second * sine[i];
        pair[i + half] = second * cosine[i] + first * sine[i];
      }
    }
  }
}

void rope_forward(float* x, const int* positions, int rows, int heads, int head_dim, const double* inverse_frequency) {
  const long table = static_cast<long>(rows) * (head_dim / 2);
  std::vector<float> cosines(table), sines(table);
  rope_angles(cosines.data(), sines.data(), positions, rows, head_dim, inverse_frequency);
  rope_apply(x, cosines.data(), sines.data(), rows, heads, head_dim);
}

}  // namespace dspark::cpu
