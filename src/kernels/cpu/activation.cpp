#include "kernels/cpu/activation.h"

#include <cmath>

namespace dspark::cpu {

void swiglu_forward(float* out, const float* gate, const float* up, long count) {
  for (long i = 0; i < count; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count) {
  const float sqrt_two_over_pi = 0.7978845608028654f;
  for (long i = 0; i < count; ++i) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(sqrt_two_over_pi * (x + 0.044715f * x * x * x))) * up[i];
  }
}

void residual_add(float* x, const float* delta, long count) {
  for (long i = 0; i < count; ++i) x[i] += delta[i];
}

}  // namespace dspark::cpu
