// Elementwise activations and residual adds.
#pragma once

namespace dspark::cpu {

// out[i] = silu(gate[i]) * up[i]  (SwiGLU); out may alias gate.
void swiglu_forward(float* out, const float* gate, const float* up, long count);

// x[i] += delta[i]  (the residual stream)
void residual_add(float* x, const float* delta, long count);

}  // namespace dspark::cpu
