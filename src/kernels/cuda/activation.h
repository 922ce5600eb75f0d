// SwiGLU on the fused gate|up GEMM output (CUDA version of kernels/cpu/activation.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dspark::cuda {

// out [rows, F] = silu(gate_up[:, :F]) * gate_up[:, F:]   (gate_up [rows, 2F])
void swiglu_forward(__nv_bfloat16* out, const __nv_bfloat16* gate_up, int rows, int intermediate,
                    cudaStream_t stream);

}  // namespace dspark::cuda
