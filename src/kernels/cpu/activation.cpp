#include "kernels/cpu/activation.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

constexpr float kSqrtTwoOverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// SwiGLU with simd::exp, W elements at a time; the tail is padded to a whole
// vector so every element takes the same steps (a token's MLP activations do
// not depend on how many rows share the forward). Instruction sets as in
// matmul.cpp.
template <int W>
[[gnu::always_inline]] inline void swiglu(float* out, const float* gate, const float* up, long count) {
  using V = typename simd::Floats<W>::Vector;
  for (long i = 0; i < count; i += W) {
    const int lanes = count - i < W ? int(count - i) : W;
    V g = V{}, u = V{};
    std::memcpy(&g, gate + i, lanes * sizeof(float));
    std::memcpy(&u, up + i, lanes * sizeof(float));
    const V result = g / (1.0f + simd::exp<W>(-g)) * u;
    std::memcpy(out + i, &result, lanes * sizeof(float));
  }
}
__attribute__((target("arch=x86-64-v4"))) void swiglu_avx512(float* out, const float* gate, const float* up,
                                                             long count) {
  swiglu<16>(out, gate, up, count);
}
__attribute__((target("arch=x86-64-v3"))) void swiglu_avx2(float* out, const float* gate, const float* up, long count) {
  swiglu<8>(out, gate, up, count);
}
void swiglu_baseline(float* out, const float* gate, const float* up, long count) { swiglu<4>(out, gate, up, count); }

// gelu_tanh(gate) * up, W elements at a time, with gelu_tanh(x) written as
// x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) (the same function:
// 0.5 (1 + tanh(u)) = sigmoid(2u)), so one simd::exp per element instead of a
// scalar tanh (the drafter's MLP: 0.18 ms of a 6 ms CPU round went to tanh).
// The CUDA kernels use the same form.
template <int W>
[[gnu::always_inline]] inline void gelu_tanh_gate(float* out, const float* gate, const float* up, long count) {
  using V = typename simd::Floats<W>::Vector;
  for (long i = 0; i < count; i += W) {
    const int lanes = count - i < W ? int(count - i) : W;
    V g = V{}, u = V{};
    std::memcpy(&g, gate + i, lanes * sizeof(float));
    std::memcpy(&u, up + i, lanes * sizeof(float));
    const V inner = kSqrtTwoOverPi * (g + kGeluCubic * g * g * g);
    const V result = g / (1.0f + simd::exp<W>(-2.0f * inner)) * u;
    std::memcpy(out + i, &result, lanes * sizeof(float));
  }
}
__attribute__((target("arch=x86-64-v4"))) void gelu_tanh_gate_avx512(float* out, const float* gate, const float* up,
                                                                     long count) {
  gelu_tanh_gate<16>(out, gate, up, count);
}
__attribute__((target("arch=x86-64-v3"))) void gelu_tanh_gate_avx2(float* out, const float* gate, const float* up,
                                                                   long count) {
  gelu_tanh_gate<8>(out, gate, up, count);
}
void gelu_tanh_gate_baseline(float* out, const float* gate, const float* up, long count) {
  gelu_tanh_gate<4>(out, gate, up, count);
}

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, long count) {
  for_matmul_isa(swiglu_avx512, swiglu_avx2, swiglu_baseline)(out, gate, up, count);
}

void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count) {
  for_matmul_isa(gelu_tanh_gate_avx512, gelu_tanh_gate_avx2, gelu_tanh_gate_baseline)(out, gate, up, count);
}

void gelu_tanh_gate_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                             long count) {
  for (long i = 0; i < count; ++i) {
    const float x = gate[i];
    const float t = std::tanh(kSqrtTwoOverPi * (x + kGeluCubic * x * x * x));
    const float gelu = 0.5f * x * (1.0f + t);
    // d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    const float slope =
        0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrtTwoOverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    dgate[i] += dout[i] * up[i] * slope;
    dup[i] += dout[i] * gelu;
  }
}

void residual_add(float* x, const float* delta, long count) {
  for (long i = 0; i < count; ++i) x[i] += delta[i];
}

}  // namespace dspark::cpu
