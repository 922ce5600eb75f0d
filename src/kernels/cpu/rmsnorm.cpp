#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace dspark::cpu {
namespace {

// rsqrt(mean(x^2) + eps), the mean of squares in double: the one place f32 loses digits.
double inverse_rms(const float* x, int dim, float eps) {
  double sum_of_squares = 0.0;
  for (int i = 0; i < dim; ++i) sum_of_squares += static_cast<double>(x[i]) * x[i];
  return 1.0 / std::sqrt(sum_of_squares / dim + eps);
}

}  // namespace

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps) {
  for (int row = 0; row < rows; ++row) {
    const float* in = x + static_cast<long>(row) * dim;
    float* result = out + static_cast<long>(row) * dim;
    const float scale = static_cast<float>(inverse_rms(in, dim, eps));
    for (int i = 0; i < dim; ++i) result[i] = in[i] * scale * weight[i];
  }
}

void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                      int dim, float eps) {
  for (int row = 0; row < rows; ++row) {
    const float* in = x + static_cast<long>(row) * dim;
    const float* gradient = dout + static_cast<long>(row) * dim;
    const double scale = inverse_rms(in, dim, eps);
    if (dx) {
      double dot = 0.0;  // sum_j dout_j w_j x_j
      for (int i = 0; i < dim; ++i) dot += static_cast<double>(gradient[i]) * weight[i] * in[i];
      const float correction = static_cast<float>(scale * scale * scale * dot / dim);
      float* result = dx + static_cast<long>(row) * dim;
      for (int i = 0; i < dim; ++i)
        result[i] += static_cast<float>(scale) * weight[i] * gradient[i] - correction * in[i];
    }
    if (dweight)
      for (int i = 0; i < dim; ++i) dweight[i] += gradient[i] * in[i] * static_cast<float>(scale);
  }
}

}  // namespace dspark::cpu
