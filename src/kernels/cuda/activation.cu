#include "kernels/cuda/activation.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"

namespace dspark::cuda {
namespace {

__global__ void swiglu_kernel(bf16* out, const bf16* gate_up, int intermediate) {
  const long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= intermediate) return;
  const float gate = __bfloat162float(gate_up[row * 2 * intermediate + i]);
  const float up = __bfloat162float(gate_up[row * 2 * intermediate + intermediate + i]);
  out[row * intermediate + i] = __float2bfloat16(gate / (1.0f + __expf(-gate)) * up);
}

__global__ void gelu_tanh_gate_kernel(bf16* out, const bf16* gate_up, int intermediate) {
  const long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= intermediate) return;
  const float gate = __bfloat162float(gate_up[row * 2 * intermediate + i]);
  const float up = __bfloat162float(gate_up[row * 2 * intermediate + intermediate + i]);
  out[row * intermediate + i] = __float2bfloat16(gelu_tanh(gate) * up);
}

}  // namespace

void swiglu_forward(bf16* out, const bf16* gate_up, int rows, int intermediate, cudaStream_t stream) {
  const dim3 grid(ceil_div(intermediate, 256), rows);
  swiglu_kernel<<<grid, 256, 0, stream>>>(out, gate_up, intermediate);
  CUDA_CHECK_LAUNCH();
}

void gelu_tanh_gate_forward(bf16* out, const bf16* gate_up, int rows, int intermediate, cudaStream_t stream) {
  const dim3 grid(ceil_div(intermediate, 256), rows);
  gelu_tanh_gate_kernel<<<grid, 256, 0, stream>>>(out, gate_up, intermediate);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
