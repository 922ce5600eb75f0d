#include "kernels/cuda/activation.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"

namespace dspark::cuda {
namespace {

__global__ void swiglu_kernel(bf16* out, const bf16* gate_up, int intermediate) {
  wait_for_previous_kernel();
  start_next_kernel();
  const long row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= intermediate) return;
  const float gate = __bfloat162float(gate_up[row * 2 * intermediate + i]);
  const float up = __bfloat162float(gate_up[row * 2 * intermediate + intermediate + i]);
  out[row * intermediate + i] = __float2bfloat16(gate / (1.0f + __expf(-gate)) * up);
}

__global__ void gelu_tanh_gate_kernel(bf16* out, const bf16* gate_up, int intermediate) {
  wait_for_previous_kernel();
  start_next_kernel();
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
  launch_dependent(swiglu_kernel, grid, 256, 0, stream, out, gate_up, intermediate);
  CUDA_CHECK_LAUNCH();
}

void gelu_tanh_gate_forward(bf16* out, const bf16* gate_up, int rows, int intermediate, cudaStream_t stream) {
  const dim3 grid(ceil_div(intermediate, 256), rows);
  launch_dependent(gelu_tanh_gate_kernel, grid, 256, 0, stream, out, gate_up, intermediate);
  CUDA_CHECK_LAUNCH();
}

// ---- training ----

namespace {

constexpr float kSqrtTwoOverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// The tanh form itself (tanhf, not the fast exponential of gelu_tanh()): training
// compares its gradients with the CPU's.
__global__ void gelu_tanh_gate_f32_kernel(float* out, const float* gate, const float* up, long count) {
  const long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float x = gate[i];
  out[i] = 0.5f * x * (1.0f + tanhf(kSqrtTwoOverPi * (x + kGeluCubic * x * x * x))) * up[i];
}

__global__ void gelu_tanh_gate_backward_kernel(float* dgate, float* dup, const float* dout, const float* gate,
                                               const float* up, long count) {
  const long i = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float x = gate[i];
  const float t = tanhf(kSqrtTwoOverPi * (x + kGeluCubic * x * x * x));
  const float gelu = 0.5f * x * (1.0f + t);
  const float slope = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrtTwoOverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  dgate[i] += dout[i] * up[i] * slope;
  dup[i] += dout[i] * gelu;
}

}  // namespace

void gelu_tanh_gate_forward(float* out, const float* gate, const float* up, long count, cudaStream_t stream) {
  if (count <= 0) return;
  gelu_tanh_gate_f32_kernel<<<ceil_div(count, 256), 256, 0, stream>>>(out, gate, up, count);
  CUDA_CHECK_LAUNCH();
}

void gelu_tanh_gate_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                             long count, cudaStream_t stream) {
  if (count <= 0) return;
  gelu_tanh_gate_backward_kernel<<<ceil_div(count, 256), 256, 0, stream>>>(dgate, dup, dout, gate, up, count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
