// Activation x weight products through cuBLASLt (CUDA version of
// kernels/cpu/matmul.h): bf16 operands, f32 accumulation, bf16 or f32 output.
// Shapes as on the CPU: x [rows, in], weight [out, in] (nn.Linear layout),
// bias [out] or null, out [rows, out].
//
// Up to 8 rows run a weight-streaming GEMV whose per-row result does not
// depend on the row count (decode and verify agree to the bit). Above that,
// the cuBLASLt algorithm for each (rows, in, out, output type, bias) is chosen
// once by its heuristic and cached with its descriptors, so a call inside CUDA
// graph capture never queries the heuristic (warm each shape up first).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dspark::cuda {

enum class MatmulOutput { BF16, F32 };

void matmul_forward(void* out, MatmulOutput out_type, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                    const __nv_bfloat16* bias, int rows, int in_features, int out_features,
                    cudaStream_t stream);

// out = (silu(gate_up[:, :in]) * gate_up[:, in:]) @ weight^T (+ bias): the MLP's
// down projection with SwiGLU fused in. gate_up [rows, 2 * in]; `activated`
// [rows, in] is scratch for the shapes that run unfused.
void swiglu_matmul_forward(void* out, MatmulOutput out_type, const __nv_bfloat16* gate_up, __nv_bfloat16* activated,
                           const __nv_bfloat16* weight, const __nv_bfloat16* bias, int rows, int in_features,
                           int out_features, cudaStream_t stream);

}  // namespace dspark::cuda
