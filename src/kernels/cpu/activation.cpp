#include "kernels/cpu/activation.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

constexpr float kSqrtTwoOverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// act(gate) * up with simd::exp, W elements at a time; the tail is padded to a
// whole vector so every element takes the same steps (a token's MLP
// activations do not depend on how many rows share the forward). Instruction
// sets as in matmul.cpp.
//  Silu: gate * sigmoid(gate) (SwiGLU);
//  GeluTanh: gelu_tanh(gate) written as x * sigmoid(2u), u = sqrt(2/pi)
//    (x + 0.044715 x^3) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)),
//    one simd::exp per element instead of a scalar tanh (the drafter's MLP:
//    0.18 ms of a 6 ms CPU round went to tanh). The CUDA kernels use the same form.
enum class Gate { Silu, GeluTanh };

template <int W, Gate GATE>
[[gnu::always_inline]] inline void gated(float* out, const float* gate, const float* up, long count) {
  using V = typename simd::Floats<W>::Vector;
  for (long i = 0; i < count; i += W) {
    const int lanes = count - i < W ? int(count - i) : W;
    V g = V{}, u = V{};
    std::memcpy(&g, gate + i, lanes * sizeof(float));
    std::memcpy(&u, up + i, lanes * sizeof(float));
    V argument = g;
    if constexpr (GATE == Gate::GeluTanh) argument = 2.0f * kSqrtTwoOverPi * (g + kGeluCubic * g * g * g);
    const V result = g / (1.0f + simd::exp<W>(-argument)) * u;
    std::memcpy(out + i, &result, lanes * sizeof(float));
  }
}
template <Gate GATE>
__attribute__((target("arch=x86-64-v4"))) void gated_avx512(float* out, const float* gate, const float* up,
                                                            long count) {
  gated<16, GATE>(out, gate, up, count);
}
template <Gate GATE>
__attribute__((target("arch=x86-64-v3"))) void gated_avx2(float* out, const float* gate, const float* up, long count) {
  gated<8, GATE>(out, gate, up, count);
}
template <Gate GATE>
void gated_baseline(float* out, const float* gate, const float* up, long count) {
  gated<4, GATE>(out, gate, up, count);
}

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, long count) {
  for_matmul_isa(gated_avx512<Gate::Silu>, gated_avx2<Gate::Silu>, gated_baseline<Gate::Silu>)(out, gate, up, count);
}

void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count) {
  for_matmul_isa(gated_avx512<Gate::GeluTanh>, gated_avx2<Gate::GeluTanh>, gated_baseline<Gate::GeluTanh>)(out, gate, up,
                                                                                                       count);
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
