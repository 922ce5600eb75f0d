// Elementwise activations and residual adds. Backward passes accumulate (+=).
#pragma once

namespace dspark::cpu {

// out[i] = silu(gate[i]) * up[i]  (SwiGLU); out may alias gate.
void swiglu_forward(float* out, const float* gate, const float* up, long count);

// out[i] = gelu_tanh(gate[i]) * up[i] (the drafter's gated MLP); out may alias gate.
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count);

// Given dout and the forward's inputs: dgate[i] += dout[i] up[i] gelu_tanh'(gate[i]),
// dup[i] += dout[i] gelu_tanh(gate[i]).
void gelu_tanh_gate_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                             long count);

// x[i] += delta[i]  (the residual stream)
void residual_add(float* x, const float* delta, long count);

}  // namespace dspark::cpu
