// Device helpers shared by the kernels: bf16 type, warp and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <utility>

#include "kernels/cuda/cuda_check.h"

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

// Tree sum of a block's doubles in shared memory (blockDim.x a power of two;
// scratch [blockDim.x]); every thread gets the result.
__device__ __forceinline__ double block_sum_double(double value, double* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();  // scratch may be reused right after
  return total;
}

// Four bf16 packed in 8 bytes (low half first) as floats.
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 bits) {
  const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
  const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
  return make_float4(low.x, low.y, high.x, high.y);
}

// Four consecutive bf16 (8-byte aligned) as floats, in one load.
__device__ __forceinline__ float4 bf16x4_to_float4(const bf16* source) {
  return bf16x4_to_float4(*reinterpret_cast<const uint2*>(source));
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
// A float's bits as an unsigned that orders as the floats do (0: below -inf).
__device__ __forceinline__ unsigned ordered_bits(float value) {
  const unsigned bits = __float_as_uint(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ float float_of_ordered_bits(unsigned ordered) {
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

__device__ __forceinline__ unsigned long long argmax_key(float value, int index) {
  return (static_cast<unsigned long long>(ordered_bits(value)) << 32) | (0xffffffffu - static_cast<unsigned>(index));
}

// The index of a key; -1 for the empty key.
__device__ __forceinline__ int argmax_index(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}

// A "last block to finish" ticket, taken by every block of a grid after its
// threads have written what the last block will read: true (in every thread)
// in the block that took the last of `count` tickets from *counter, which then
// sees every block's writes. Thread 0's one acquire-release atomic orders the
// block's writes (before the barrier) and acquires the others' (as CUTLASS's
// barriers do), where a sequentially consistent fence in every thread before
// and after the atomic made a longer chain (docs/PERF.md, stop 29).
__device__ __forceinline__ bool took_last_ticket(unsigned* counter, unsigned count) {
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    unsigned ticket;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    last = ticket == count - 1;
  }
  return __syncthreads_or(last);
}

inline int ceil_div(long a, long b) { return static_cast<int>((a + b - 1) / b); }

// Columns of a wide row (the taps: tap layers x hidden, 30720 floats on the
// x16 target) that one block of a row copy takes: the row gets a grid row of
// blocks. One block a row made a chain of dependent rounds of 256 loads: 16
// us for one such row, 41-66 us for 8-32 (H100, PERF.md stop 56's traces);
// sliced, the x16 pair's rounds ran 28-32 us shorter at batch 1 and 4 (stop 60).
constexpr int kWideRowSlice = 2048;

// A row copy's grid: row r's slices are blocks (r, 0), (r, 1), ...
inline dim3 wide_row_grid(int rows, int width) { return dim3(rows, ceil_div(width, kWideRowSlice)); }

// The columns [begin, end) of the calling block's slice of a row of `width`.
struct ColumnRange {
  int begin, end;
};
__device__ __forceinline__ ColumnRange wide_row_slice(int width) {
  const int begin = blockIdx.y * kWideRowSlice;
  return {begin, min(width, begin + kWideRowSlice)};
}

// ---- programmatic dependent launch (Hopper) ----
//
// A kernel launched with launch_dependent() may start while the kernel before
// it on the stream is still running: its launch and block scheduling overlap
// the previous kernel's tail. Such a kernel calls wait_for_previous_kernel()
// before it writes any memory, and before it reads memory that the previous
// kernel may write (an earlier kernel may still be writing what it reads, or
// reading what it writes); the wait returns when the previous kernel has
// finished and its writes are visible. start_next_kernel(), called right
// after the wait, lets the next kernel launch once all blocks of this one
// have called it (or exited): calling it after the wait keeps the chain
// ordered, so that when a kernel starts, every kernel before the one just
// before it has finished. What those wrote, and what no kernel writes, a
// kernel may read before its wait: the attention and RoPE kernels load
// their step's metadata, constants and old cache rows there (8B decode 1%,
// 1.7B 2% faster), and the tensor-core GEMV its first chunks of weights,
// into registers (8B decode 3%, 1.7B 4% faster). (Weights into L2 instead
// were tried twice: the GEMVs' first weights before the wait, 1-3% slower;
// a layer's o-projection weights by bulk prefetches during its attention,
// 15% slower.)
// Both are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void start_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launch_dependent() launches programmatically: on devices of
// compute capability 9.0 and up, unless DSPARK_PDL=0 (ordinary launches, for
// comparison).
bool dependent_launches_enabled();

// kernel<<<grid, block, shared_bytes, stream>>>(args...), as a programmatic
// dependent launch where enabled. The kernel must follow the rules above.
template <class... Parameters, class... Arguments>
void launch_dependent(void (*kernel)(Parameters...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                      Arguments&&... arguments) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent_launches_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Arguments>(arguments)...));
}

}  // namespace dspark::cuda
