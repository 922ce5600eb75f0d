#include "kernels/cpu/activation.h"

#include <cmath>

namespace dspark::cpu {
namespace {

constexpr float kSqrtTwoOverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, long count) {
  for (long i = 0; i < count; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count) {
  for (long i = 0; i < count; ++i) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kSqrtTwoOverPi * (x + kGeluCubic * x * x * x))) * up[i];
  }
}

void gelu_tanh_gate_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                             long count) {
  for (long i = 0; i < count; ++i) {
    const float x = gate[i];
    const float t = std::tanh(kSqrtTwoOverPi * (x + kGeluCubic * x * x * x));
    const float gelu = 0.5f * x * (1.0f + t);
    // d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    const float slope = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrtTwoOverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    dgate[i] += dout[i] * up[i] * slope;
    dup[i] += dout[i] * gelu;
  }
}

void residual_add(float* x, const float* delta, long count) {
  for (long i = 0; i < count; ++i) x[i] += delta[i];
}

}  // namespace dspark::cpu
