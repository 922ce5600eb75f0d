#include "kernels/cpu/activation.h"

#include <cmath>

namespace dspark::cpu {

void swiglu_forward(float* out, const float* gate, const float* up, long count) {
  for (long i = 0; i < count; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void residual_add(float* x, const float* delta, long count) {
  for (long i = 0; i < count; ++i) x[i] += delta[i];
}

}  // namespace dspark::cpu
