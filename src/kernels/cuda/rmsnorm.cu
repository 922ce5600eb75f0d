#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rmsnorm.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: pass 1 adds the residual and sums squares, pass 2 writes
// the normed row (the row is re-read from L1/L2, never from HBM twice).
__global__ void residual_add_rmsnorm_kernel(float* residual, const bf16* delta, bf16* out, const float* weight, int dim,
                                            float eps, float* residual_tap, float* normed_tap, long tap_stride) {
  wait_for_previous_kernel();
  start_next_kernel();
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

// The same with float4 / 4 x bf16 accesses and the row held in registers
// (residual_add_rmsnorm_row).
template <int VECTORS>
__global__ void __launch_bounds__(kResidualNormThreads)
    residual_add_rmsnorm_vector_kernel(float* residual, const bf16* delta, bf16* out, const float* weight, int dim,
                                       float eps, float* residual_tap, float* normed_tap, long tap_stride) {
  wait_for_previous_kernel();
  start_next_kernel();
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  residual_add_rmsnorm_row<VECTORS>(residual + row * dim, delta ? delta + row * dim : nullptr, out + row * dim, weight,
                                    dim, eps, residual_tap ? residual_tap + row * tap_stride : nullptr,
                                    normed_tap ? normed_tap + row * tap_stride : nullptr, scratch);
}

void launch(float* residual, const bf16* delta, bf16* out, const float* weight, int rows, int dim, float eps,
            float* residual_tap, float* normed_tap, long tap_stride, cudaStream_t stream) {
  const int vectors = residual_norm_vectors(dim, tap_stride);
  if (vectors > 0) {
    auto kernel = vectors == 1   ? residual_add_rmsnorm_vector_kernel<1>
                  : vectors == 2 ? residual_add_rmsnorm_vector_kernel<2>
                  : vectors == 4 ? residual_add_rmsnorm_vector_kernel<4>
                                 : residual_add_rmsnorm_vector_kernel<8>;
    launch_dependent(kernel, rows, kResidualNormThreads, 0, stream, residual, delta, out, weight, dim, eps,
                     residual_tap, normed_tap, tap_stride);
  } else {
    launch_dependent(residual_add_rmsnorm_kernel, rows, kThreads, 0, stream, residual, delta, out, weight, dim, eps,
                     residual_tap, normed_tap, tap_stride);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void rmsnorm_forward(bf16* out, const float* x, const float* weight, int rows, int dim, float eps,
                     cudaStream_t stream) {
  launch(const_cast<float*>(x), nullptr, out, weight, rows, dim, eps, nullptr, nullptr, 0, stream);
}

void residual_add_rmsnorm_forward(float* residual, const bf16* delta, bf16* out, const float* weight, int rows, int dim,
                                  float eps, float* residual_tap, float* normed_tap, long tap_stride,
                                  cudaStream_t stream) {
  launch(residual, delta, out, weight, rows, dim, eps, residual_tap, normed_tap, tap_stride, stream);
}

// ---- training ----

namespace {

constexpr int kTrainThreads = 256;

// One block per row, f32 out. The mean of squares is summed in f32 (the CPU
// reference sums in double; the difference is far below TF32 rounding).
__global__ void __launch_bounds__(kTrainThreads)
    rmsnorm_f32_kernel(float* out, const float* x, const float* weight, int dim, float eps) {
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  const float* in = x + row * dim;
  float sum_of_squares = 0.0f;
  for (int i = threadIdx.x; i < dim; i += kTrainThreads) sum_of_squares += in[i] * in[i];
  const float scale = rsqrtf(block_sum(sum_of_squares, scratch) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += kTrainThreads) out[row * dim + i] = in[i] * scale * weight[i];
}

// One block per row: dx_i += s w_i dout_i - s^3 x_i (Σ_j dout_j w_j x_j) / dim,
// s = rsqrt(mean(x^2) + eps), written to scales[row] for the weight's gradient.
__global__ void __launch_bounds__(kTrainThreads)
    rmsnorm_backward_kernel(float* dx, float* scales, const float* dout, const float* x, const float* weight, int dim,
                            float eps) {
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  const float* in = x + row * dim;
  const float* gradient = dout + row * dim;
  float sum_of_squares = 0.0f, dot = 0.0f;
  for (int i = threadIdx.x; i < dim; i += kTrainThreads) {
    sum_of_squares += in[i] * in[i];
    dot += gradient[i] * weight[i] * in[i];
  }
  const float scale = rsqrtf(block_sum(sum_of_squares, scratch) / dim + eps);
  dot = block_sum(dot, scratch);
  if (threadIdx.x == 0) scales[row] = scale;
  if (!dx) return;
  const float correction = scale * scale * scale * dot / dim;
  for (int i = threadIdx.x; i < dim; i += kTrainThreads)
    dx[row * dim + i] += scale * weight[i] * gradient[i] - correction * in[i];
}

}  // namespace

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps,
                     cudaStream_t stream) {
  if (rows <= 0) return;
  rmsnorm_f32_kernel<<<rows, kTrainThreads, 0, stream>>>(out, x, weight, dim, eps);
  CUDA_CHECK_LAUNCH();
}

long rmsnorm_backward_scratch(int rows, int dim) { return rows + column_sums_scratch(rows, dim); }

void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                      int dim, float eps, float* scratch, cudaStream_t stream) {
  if (rows <= 0) return;
  float* scales = scratch;  // [rows]
  rmsnorm_backward_kernel<<<rows, kTrainThreads, 0, stream>>>(dx, scales, dout, x, weight, dim, eps);
  CUDA_CHECK_LAUNCH();
  // dweight_i = Σ_rows dout_i x_i s
  if (dweight) column_sums(dweight, dout, dim, x, dim, scales, rows, dim, scratch + rows, stream);
}

}  // namespace dspark::cuda
