#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace dspark::cpu {

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps) {
  for (int row = 0; row < rows; ++row) {
    const float* in = x + static_cast<long>(row) * dim;
    float* result = out + static_cast<long>(row) * dim;
    double sum_of_squares = 0.0;  // double: the mean of squares is the one place f32 loses digits
    for (int i = 0; i < dim; ++i) sum_of_squares += static_cast<double>(in[i]) * in[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares / dim + eps));
    for (int i = 0; i < dim; ++i) result[i] = in[i] * scale * weight[i];
  }
}

}  // namespace dspark::cpu
