#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>

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

template <int W, Gate GATE, class V>
[[gnu::always_inline]] inline V gated_vector(V g, V u) {
  V argument = g;
  if constexpr (GATE == Gate::GeluTanh) argument = 2.0f * kSqrtTwoOverPi * (g + kGeluCubic * g * g * g);
  return g / (1.0f + simd::exp<W>(-argument)) * u;
}
// Whole vectors are loaded and stored as such (a copy of a variable length
// is a libc call: three per vector cost a verify 0.1 ms); the tail goes
// through zero-padded vectors.
template <int W, Gate GATE>
[[gnu::always_inline]] inline void gated(float* out, const float* gate, const float* up, long count) {
  using V = typename simd::Floats<W>::Vector;
  long i = 0;
  for (; i + W <= count; i += W)
    simd::store(out + i, gated_vector<W, GATE>(simd::load<V>(gate + i), simd::load<V>(up + i)));
  if (i == count) return;
  float g[W] = {}, u[W] = {}, result[W];
  std::copy_n(gate + i, count - i, g);
  std::copy_n(up + i, count - i, u);
  simd::store(result, gated_vector<W, GATE>(simd::load<V>(g), simd::load<V>(u)));
  std::copy_n(result, count - i, out + i);
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
