#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/embedding.h"

namespace dspark::cuda {
namespace {

__global__ void embedding_kernel(float* out, const bf16* table, const int32_t* ids, int dim) {
  const bf16* source = table + static_cast<long>(ids[blockIdx.x]) * dim;
  float* destination = out + static_cast<long>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) destination[i] = __bfloat162float(source[i]);
}

__global__ void gather_rows_kernel(bf16* out, const bf16* in, const int32_t* rows, int dim) {
  const bf16* source = in + static_cast<long>(rows[blockIdx.x]) * dim;
  bf16* destination = out + static_cast<long>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) destination[i] = source[i];
}

}  // namespace

void embedding_forward(float* out, const bf16* table, const int32_t* ids, int rows, int dim,
                       cudaStream_t stream) {
  embedding_kernel<<<rows, 256, 0, stream>>>(out, table, ids, dim);
  CUDA_CHECK_LAUNCH();
}

void gather_rows_forward(bf16* out, const bf16* in, const int32_t* rows, int count, int dim,
                         cudaStream_t stream) {
  gather_rows_kernel<<<count, 256, 0, stream>>>(out, in, rows, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
