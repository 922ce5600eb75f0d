#include "kernels/cpu/rope.h"

#include <cmath>

namespace dspark::cpu {

void rope_forward(float* x, const int* positions, int rows, int heads, int head_dim,
                  const double* inverse_frequency) {
  const int half = head_dim / 2;
  for (int row = 0; row < rows; ++row) {
    for (int i = 0; i < half; ++i) {
      // Angles in double: at long positions an f32 product loses the phase.
      const double angle = positions[row] * inverse_frequency[i];
      const float cosine = static_cast<float>(std::cos(angle));
      const float sine = static_cast<float>(std::sin(angle));
      for (int head = 0; head < heads; ++head) {
        float* pair = x + (static_cast<long>(row) * heads + head) * head_dim;
        const float first = pair[i], second = pair[i + half];
        pair[i] = first * cosine - second * sine;
        pair[i + half] = second * cosine + first * sine;
      }
    }
  }
}

}  // namespace dspark::cpu
