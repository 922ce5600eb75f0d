#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.h"

namespace dspark::cuda {
namespace {

constexpr int kColumns = 32;    // columns per block: one warp wide, coalesced
constexpr int kRowLanes = 8;    // rows summed side by side within a chunk
constexpr int kSquareThreads = 256;

// grid (column tiles, chunks), block (kColumns, kRowLanes). Thread (x, y) sums
// rows y, y + kRowLanes, ... of its chunk for column x; the kRowLanes partial
// sums meet in shared memory in order. One chunk: added to out; else written
// to partials[chunk, column].
__global__ void __launch_bounds__(kColumns* kRowLanes)
    column_sums_kernel(float* out, const float* a, long lda, const float* b, long ldb, const float* row_scale,
                       int rows, int dim, float* partials) {
  __shared__ float sums[kRowLanes][kColumns + 1];
  const int column = blockIdx.x * kColumns + threadIdx.x;
  const int first = blockIdx.y * kColumnChunk, last = min(rows, first + kColumnChunk);
  float total = 0.0f;
  if (column < dim)
    for (int row = first + threadIdx.y; row < last; row += kRowLanes) {
      float value = a[row * lda + column];
      if (b) value *= b[row * ldb + column];
      if (row_scale) value *= row_scale[row];
      total += value;
    }
  sums[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y != 0 || column >= dim) return;
  total = 0.0f;
#pragma unroll
  for (int lane = 0; lane < kRowLanes; ++lane) total += sums[lane][threadIdx.x];
  if (gridDim.y == 1)
    out[column] += total;
  else
    partials[static_cast<long>(blockIdx.y) * dim + column] = total;
}

__global__ void add_chunks_kernel(float* out, const float* partials, int chunks, int dim) {
  const int column = blockIdx.x * blockDim.x + threadIdx.x;
  if (column >= dim) return;
  float total = 0.0f;
  for (int chunk = 0; chunk < chunks; ++chunk) total += partials[static_cast<long>(chunk) * dim + column];
  out[column] += total;
}

__global__ void __launch_bounds__(kSquareThreads) square_partials_kernel(double* partials, const float* x, long count) {
  __shared__ double scratch[kSquareThreads];
  double total = 0.0;
  const long stride = static_cast<long>(gridDim.x) * kSquareThreads;
  for (long i = static_cast<long>(blockIdx.x) * kSquareThreads + threadIdx.x; i < count; i += stride)
    total += static_cast<double>(x[i]) * x[i];
  total = block_sum_double(total, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kSquareThreads) add_partials_kernel(double* out, const double* partials, int count) {
  __shared__ double scratch[kSquareThreads];
  double total = 0.0;
  for (int i = threadIdx.x; i < count; i += kSquareThreads) total += partials[i];
  total = block_sum_double(total, scratch);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace

long column_sums_scratch(int rows, int dim) {
  const int chunks = ceil_div(rows, kColumnChunk);
  return chunks > 1 ? static_cast<long>(chunks) * dim : 0;
}

void column_sums(float* out, const float* a, long lda, const float* b, long ldb, const float* row_scale, int rows,
                 int dim, float* partials, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return;
  const int chunks = ceil_div(rows, kColumnChunk);
  DSPARK_CHECK(chunks <= 65535, "column_sums: ", rows, " rows are more than a grid holds");
  const dim3 grid(ceil_div(dim, kColumns), chunks), block(kColumns, kRowLanes);
  column_sums_kernel<<<grid, block, 0, stream>>>(out, a, lda, b, ldb, row_scale, rows, dim, partials);
  CUDA_CHECK_LAUNCH();
  if (chunks > 1) {
    add_chunks_kernel<<<ceil_div(dim, 256), 256, 0, stream>>>(out, partials, chunks, dim);
    CUDA_CHECK_LAUNCH();
  }
}

void sum_of_squares(double* out, const float* x, long count, double* partials, cudaStream_t stream) {
  square_partials_kernel<<<kSquareBlocks, kSquareThreads, 0, stream>>>(partials, x, count);
  CUDA_CHECK_LAUNCH();
  add_partials_kernel<<<1, kSquareThreads, 0, stream>>>(out, partials, kSquareBlocks);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
