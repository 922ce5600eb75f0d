#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/softmax.h"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
    softmax_kernel(float* probs, const float* logits, int dim, float* log_normalizers) {
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  const float* in = logits + row * dim;
  float* out = probs + row * dim;
  float maximum = -INFINITY;
  for (int i = threadIdx.x; i < dim; i += kThreads) maximum = fmaxf(maximum, in[i]);
  maximum = block_max(maximum, scratch);
  float total = 0.0f;
  for (int i = threadIdx.x; i < dim; i += kThreads) total += expf(in[i] - maximum);
  total = block_sum(total, scratch);
  if (log_normalizers && threadIdx.x == 0) log_normalizers[row] = maximum + logf(total);
  const float inverse = 1.0f / total;
  for (int i = threadIdx.x; i < dim; i += kThreads) out[i] = expf(in[i] - maximum) * inverse;
}

__global__ void __launch_bounds__(kThreads)
    softmax_backward_kernel(float* dlogits, const float* dprobs, const float* probs, int dim) {
  __shared__ float scratch[32];
  const long offset = static_cast<long>(blockIdx.x) * dim;
  float dot = 0.0f;
  for (int i = threadIdx.x; i < dim; i += kThreads) dot += probs[offset + i] * dprobs[offset + i];
  dot = block_sum(dot, scratch);
  for (int i = threadIdx.x; i < dim; i += kThreads)
    dlogits[offset + i] += probs[offset + i] * (dprobs[offset + i] - dot);
}

}  // namespace

void softmax_forward(float* probs, const float* logits, int rows, int dim, float* log_normalizers,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  softmax_kernel<<<rows, kThreads, 0, stream>>>(probs, logits, dim, log_normalizers);
  CUDA_CHECK_LAUNCH();
}

void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int rows, int dim,
                      cudaStream_t stream) {
  if (rows <= 0) return;
  softmax_backward_kernel<<<rows, kThreads, 0, stream>>>(dlogits, dprobs, probs, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
