// RMSNorm on the GPU, fused with the residual add that precedes every norm in
// the decoder (CUDA version of kernels/cpu/rmsnorm.h). The residual stream
// stays in f32; the normed rows, which feed the next GEMM, are bf16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dspark::cuda {

// out = rmsnorm(x) * weight.  x [rows, dim] f32, out [rows, dim] bf16.
void rmsnorm_forward(__nv_bfloat16* out, const float* x, const float* weight, int rows, int dim, float eps,
                     cudaStream_t stream);

// residual += delta (when delta is given); out = rmsnorm(residual) * weight.
// Optional taps: residual_tap[r * tap_stride ..] receives the residual after
// the add, normed_tap[r * tap_stride ..] the normed row in f32 (both may be null).
void residual_add_rmsnorm_forward(float* residual, const __nv_bfloat16* delta, __nv_bfloat16* out,
                                  const float* weight, int rows, int dim, float eps, float* residual_tap,
                                  float* normed_tap, long tap_stride, cudaStream_t stream);

}  // namespace dspark::cuda
