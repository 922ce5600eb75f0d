// Device helpers shared by the kernels: bf16 type, warp and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>

namespace dspark::cuda {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Block-wide sum / max for blockDim.x a multiple of 32 (<= 1024). `scratch`
// is __shared__ float[32]; every thread gets the result.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  value = warp_sum(value);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(value);
}

__device__ __forceinline__ float block_max(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  value = warp_max(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : -FLT_MAX;
  return warp_max(value);
}

// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as kernels/cpu/activation.cpp,
// written as x * sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)) so that it costs one
// fast exponential.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + __expf(-2.0f * u));
}

// Argmax across blocks with one 64-bit atomicMax: the key orders by value,
// then by the smaller index (the first index among equal maxima, as
// torch.argmax and cpu::argmax). Every real key exceeds 0, the empty key.
__device__ __forceinline__ unsigned long long argmax_key(float value, int index) {
  const unsigned bits = __float_as_uint(value);
  const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | (0xffffffffu - static_cast<unsigned>(index));
}

// The index of a key; -1 for the empty key.
__device__ __forceinline__ int argmax_index(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}

inline int ceil_div(long a, long b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace dspark::cuda
