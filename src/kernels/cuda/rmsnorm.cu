#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rmsnorm.h"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: pass 1 adds the residual and sums squares, pass 2 writes
// the normed row (the row is re-read from L1/L2, never from HBM twice).
__global__ void residual_add_rmsnorm_kernel(float* residual, const bf16* delta, bf16* out,
                                            const float* weight, int dim, float eps, float* residual_tap,
                                            float* normed_tap, long tap_stride) {
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  float* x = residual + row * dim;
  float sum_of_squares = 0.0f;
  for (int i = threadIdx.x; i < dim; i += kThreads) {
    float value = x[i];
    if (delta) {
      value += __bfloat162float(delta[row * dim + i]);
      x[i] = value;
    }
    if (residual_tap) residual_tap[row * tap_stride + i] = value;
    sum_of_squares += value * value;
  }
  const float scale = rsqrtf(block_sum(sum_of_squares, scratch) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += kThreads) {
    const float normed = x[i] * scale * weight[i];
    out[row * dim + i] = __float2bfloat16(normed);
    if (normed_tap) normed_tap[row * tap_stride + i] = normed;
  }
}

}  // namespace

void rmsnorm_forward(bf16* out, const float* x, const float* weight, int rows, int dim, float eps,
                     cudaStream_t stream) {
  residual_add_rmsnorm_kernel<<<rows, kThreads, 0, stream>>>(const_cast<float*>(x), nullptr, out, weight,
                                                             dim, eps, nullptr, nullptr, 0);
  CUDA_CHECK_LAUNCH();
}

void residual_add_rmsnorm_forward(float* residual, const bf16* delta, bf16* out, const float* weight,
                                  int rows, int dim, float eps, float* residual_tap, float* normed_tap,
                                  long tap_stride, cudaStream_t stream) {
  residual_add_rmsnorm_kernel<<<rows, kThreads, 0, stream>>>(residual, delta, out, weight, dim, eps,
                                                             residual_tap, normed_tap, tap_stride);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
