// Gated activations on the fused gate|up GEMM output (CUDA versions of
// kernels/cpu/activation.h): SwiGLU for the target, gelu_tanh for the drafter.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dspark::cuda {

// out [rows, F] = silu(gate_up[:, :F]) * gate_up[:, F:]   (gate_up [rows, 2F])
void swiglu_forward(__nv_bfloat16* out, const __nv_bfloat16* gate_up, int rows, int intermediate,
                    cudaStream_t stream);

// out [rows, F] = gelu_tanh(gate_up[:, :F]) * gate_up[:, F:]   (gate_up [rows, 2F])
void gelu_tanh_gate_forward(__nv_bfloat16* out, const __nv_bfloat16* gate_up, int rows, int intermediate,
                            cudaStream_t stream);

// ---- training (f32; CUDA versions of cpu::gelu_tanh_gate_forward / backward) ----

// out[i] = gelu_tanh(gate[i]) * up[i]; out may alias gate.
void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count, cudaStream_t stream);

// dgate[i] += dout[i] up[i] gelu_tanh'(gate[i]),  dup[i] += dout[i] gelu_tanh(gate[i]).
void gelu_tanh_gate_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                             long count, cudaStream_t stream);

}  // namespace dspark::cuda
