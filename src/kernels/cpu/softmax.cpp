#include "kernels/cpu/softmax.h"

#include <algorithm>
#include <cmath>

namespace dspark::cpu {

void softmax_forward(float* probs, const float* logits, int rows, int dim, float* log_normalizers) {
  for (int row = 0; row < rows; ++row) {
    const float* in = logits + static_cast<long>(row) * dim;
    float* out = probs + static_cast<long>(row) * dim;
    const float maximum = *std::max_element(in, in + dim);
    double total = 0.0;
    for (int i = 0; i < dim; ++i) {
      out[i] = std::exp(in[i] - maximum);
      total += out[i];
    }
    if (log_normalizers) log_normalizers[row] = maximum + static_cast<float>(std::log(total));
    const float inverse = static_cast<float>(1.0 / total);
    for (int i = 0; i < dim; ++i) out[i] *= inverse;
  }
}

void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int rows, int dim) {
  for (int row = 0; row < rows; ++row) {
    const long offset = static_cast<long>(row) * dim;
    double dot = 0.0;
    for (int i = 0; i < dim; ++i) dot += static_cast<double>(probs[offset + i]) * dprobs[offset + i];
    for (int i = 0; i < dim; ++i)
      dlogits[offset + i] += probs[offset + i] * (dprobs[offset + i] - static_cast<float>(dot));
  }
}

}  // namespace dspark::cpu
