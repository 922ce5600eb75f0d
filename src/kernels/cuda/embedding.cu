#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/embedding.h"

namespace dspark::cuda {
namespace {

__global__ void embedding_kernel(float* out, const bf16* table, const int32_t* ids, int dim) {
  wait_for_previous_kernel();
  start_next_kernel();
  const bf16* source = table + static_cast<long>(ids[blockIdx.x]) * dim;
  float* destination = out + static_cast<long>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) destination[i] = __bfloat162float(source[i]);
}

__global__ void gather_rows_kernel(bf16* out, const bf16* in, const int32_t* rows, int dim) {
  wait_for_previous_kernel();
  start_next_kernel();
  const bf16* source = in + static_cast<long>(rows[blockIdx.x]) * dim;
  bf16* destination = out + static_cast<long>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) destination[i] = source[i];
}

__global__ void tap_ring_write_kernel(float* ring, const int32_t* placement, const int32_t* source_rows,
                                      const float* taps, int max_rows, int width) {
  wait_for_previous_kernel();
  start_next_kernel();
  const int first = placement[0], count = placement[1];
  if (count > max_rows || int(blockIdx.x) >= count) return;
  const float* source = taps + static_cast<long>(source_rows ? source_rows[blockIdx.x] : blockIdx.x) * width;
  float* destination = ring + (static_cast<long>(first) + blockIdx.x) * width;
  const auto [begin, end] = wide_row_slice(width);
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) destination[i] = source[i];
}

}  // namespace

void embedding_forward(float* out, const bf16* table, const int32_t* ids, int rows, int dim,
                       cudaStream_t stream) {
  launch_dependent(embedding_kernel, rows, 256, 0, stream, out, table, ids, dim);
  CUDA_CHECK_LAUNCH();
}

void gather_rows_forward(bf16* out, const bf16* in, const int32_t* rows, int count, int dim,
                         cudaStream_t stream) {
  launch_dependent(gather_rows_kernel, count, 256, 0, stream, out, in, rows, dim);
  CUDA_CHECK_LAUNCH();
}

void tap_ring_write_forward(float* ring, const int32_t* placement, const int32_t* source_rows, const float* taps,
                            int max_rows, int width, cudaStream_t stream) {
  if (max_rows <= 0) return;
  launch_dependent(tap_ring_write_kernel, wide_row_grid(max_rows, width), 256, 0, stream, ring, placement, source_rows,
                   taps, max_rows, width);
  CUDA_CHECK_LAUNCH();
}

// ---- training ----

namespace {

__global__ void embedding_f32_kernel(float* out, const float* table, const int32_t* ids, int dim) {
  const float* source = table + static_cast<long>(ids[blockIdx.x]) * dim;
  float* destination = out + static_cast<long>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) destination[i] = source[i];
}

__global__ void embedding_backward_kernel(float* dtable, const float* dout, const int32_t* ids, const int32_t* starts,
                                          const int32_t* sorted_rows, int dim) {
  const int group = blockIdx.x;
  const int first = starts[group], last = starts[group + 1];
  float* destination = dtable + static_cast<long>(ids[group]) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float total = 0.0f;
    for (int j = first; j < last; ++j) total += dout[static_cast<long>(sorted_rows[j]) * dim + i];
    destination[i] += total;
  }
}

}  // namespace

void embedding_forward(float* out, const float* table, const int32_t* ids, int rows, int dim, cudaStream_t stream) {
  if (rows <= 0) return;
  embedding_f32_kernel<<<rows, 256, 0, stream>>>(out, table, ids, dim);
  CUDA_CHECK_LAUNCH();
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, const int32_t* starts,
                        const int32_t* sorted_rows, int groups, int dim, cudaStream_t stream) {
  if (groups <= 0) return;
  embedding_backward_kernel<<<groups, 128, 0, stream>>>(dtable, dout, ids, starts, sorted_rows, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
