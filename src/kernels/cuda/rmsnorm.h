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

// ---- training (f32 in and out; CUDA versions of cpu::rmsnorm_forward / rmsnorm_backward) ----

// out = x * rsqrt(mean(x^2) + eps) * weight, per row; x, out [rows, dim] f32 (may alias).
void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps,
                     cudaStream_t stream);

// Scratch floats rmsnorm_backward needs.
long rmsnorm_backward_scratch(int rows, int dim);

// dx [rows, dim] += dL/dx and dweight [dim] += dL/dweight (null: not wanted), as
// cpu::rmsnorm_backward. dweight is a deterministic column sum (reduce.h).
// `scratch` holds rmsnorm_backward_scratch(rows, dim) floats.
void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                      int dim, float eps, float* scratch, cudaStream_t stream);

}  // namespace dspark::cuda
