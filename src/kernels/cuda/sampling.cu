#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sampling.h"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBisections = 40;  // the threshold interval ends far below float spacing

// Block argmax: the largest value, the smallest index among equals.
__device__ int block_argmax(const float* logits, int vocab, float* scratch_values, int* scratch_indices) {
  float best = -INFINITY;
  int best_index = vocab;
  for (int i = threadIdx.x; i < vocab; i += kThreads)
    if (logits[i] > best) best = logits[i], best_index = i;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (other > best || (other == best && other_index < best_index)) best = other, best_index = other_index;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch_values[warp] = best, scratch_indices[warp] = best_index;
  __syncthreads();
  if (warp == 0) {
    best = scratch_values[lane], best_index = scratch_indices[lane];
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
      if (other > best || (other == best && other_index < best_index)) best = other, best_index = other_index;
    }
    if (lane == 0) scratch_indices[0] = best_index;
  }
  __syncthreads();
  return scratch_indices[0];
}

// One block per row. Weights w_i = exp((l_i - max) / T); top-k keeps l_i >= the
// k-th largest logit, top-p keeps w_i >= the largest threshold whose kept mass
// reaches p. Both thresholds are found by bisection, then snapped to the exact
// smallest kept value, so ties with the boundary are kept (as on the CPU).
__global__ void __launch_bounds__(kThreads)
    select_tokens_kernel(int32_t* out, const float* all_logits, const float* uniforms,
                         const DeviceSamplingParams* params_pointer, int vocab) {
  wait_for_previous_kernel();
  start_next_kernel();
  __shared__ float scratch[32];
  __shared__ int scratch_indices[32];
  __shared__ float chunk_sums[kThreads];
  const float* logits = all_logits + static_cast<long>(blockIdx.x) * vocab;
  const DeviceSamplingParams params = *params_pointer;
  if (params.temperature <= 0.0f) {
    const int best = block_argmax(logits, vocab, scratch, scratch_indices);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
    return;
  }
  float local_max = -INFINITY, local_min = INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kThreads)
    local_max = fmaxf(local_max, logits[i]), local_min = fminf(local_min, logits[i]);
  const float maximum = block_max(local_max, scratch);
  const float minimum = -block_max(-local_min, scratch);
  const float inverse_temperature = 1.0f / params.temperature;

  float logit_floor = -INFINITY;  // top-k: keep logits >= floor
  if (params.top_k > 0 && params.top_k < vocab) {
    float low = minimum, high = maximum;  // count(>= low) >= k > count(>= high) unless high is the max
    for (int step = 0; step < kBisections; ++step) {
      const float middle = 0.5f * (low + high);
      float count = 0.0f;
      for (int i = threadIdx.x; i < vocab; i += kThreads) count += logits[i] >= middle;
      if (block_sum(count, scratch) >= params.top_k) low = middle; else high = middle;
    }
    float smallest_kept = INFINITY;
    for (int i = threadIdx.x; i < vocab; i += kThreads)
      if (logits[i] >= low) smallest_kept = fminf(smallest_kept, logits[i]);
    logit_floor = -block_max(-smallest_kept, scratch);
  }
  auto weight = [&](int i) {
    return logits[i] >= logit_floor ? __expf((logits[i] - maximum) * inverse_temperature) : 0.0f;
  };

  float weight_floor = 0.0f;  // top-p: keep weights >= floor
  if (params.top_p < 1.0f) {
    float local_total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += kThreads) local_total += weight(i);
    const float wanted = params.top_p * block_sum(local_total, scratch);
    float low = 0.0f, high = 1.0f;  // the largest weight is exp(0) = 1
    for (int step = 0; step < kBisections; ++step) {
      const float middle = 0.5f * (low + high);
      float mass = 0.0f;
      for (int i = threadIdx.x; i < vocab; i += kThreads) {
        const float w = weight(i);
        mass += w >= middle ? w : 0.0f;
      }
      if (block_sum(mass, scratch) >= wanted) low = middle; else high = middle;
    }
    float smallest_kept = INFINITY;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float w = weight(i);
      if (w >= low && w > 0.0f) smallest_kept = fminf(smallest_kept, w);
    }
    weight_floor = -block_max(-smallest_kept, scratch);
  }

  // Inverse CDF in index order: each thread owns a contiguous chunk.
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, static_cast<int>(threadIdx.x) * chunk), end = min(vocab, begin + chunk);
  float own = 0.0f;
  for (int i = begin; i < end; ++i) {
    const float w = weight(i);
    own += w >= weight_floor ? w : 0.0f;
  }
  chunk_sums[threadIdx.x] = own;
  __syncthreads();
  if (threadIdx.x == 0) {  // 1024 serial adds: cheap next to the passes above
    float running = 0.0f;
    for (int t = 0; t < kThreads; ++t) {
      const float value = chunk_sums[t];
      chunk_sums[t] = running;
      running += value;
    }
    scratch[0] = running;
    scratch_indices[0] = -1;
  }
  __syncthreads();
  const float target = uniforms[blockIdx.x] * scratch[0];
  const float before = chunk_sums[threadIdx.x];
  if (own > 0.0f && target >= before && target < before + own) {  // exactly one thread
    float running = before;
    int chosen = -1;
    for (int i = begin; i < end; ++i) {
      const float w = weight(i);
      if (w < weight_floor || w <= 0.0f) continue;
      chosen = i;
      running += w;
      if (target < running) break;
    }
    scratch_indices[0] = chosen;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int chosen = scratch_indices[0];
    if (chosen < 0) {  // rounding put the target past the last kept token
      for (int i = vocab - 1; i >= 0; --i) {
        const float w = weight(i);
        if (w >= weight_floor && w > 0.0f) { chosen = i; break; }
      }
    }
    out[blockIdx.x] = chosen;
  }
}

__global__ void __launch_bounds__(kThreads)
    token_nll_kernel(float* out, const float* all_logits, const int32_t* targets, int vocab) {
  wait_for_previous_kernel();
  start_next_kernel();
  __shared__ float scratch[32];
  const float* logits = all_logits + static_cast<long>(blockIdx.x) * vocab;
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kThreads) local_max = fmaxf(local_max, logits[i]);
  const float maximum = block_max(local_max, scratch);
  float total = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kThreads) total += __expf(logits[i] - maximum);
  total = block_sum(total, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = logf(total) + maximum - logits[targets[blockIdx.x]];
}

}  // namespace

void select_tokens_forward(int32_t* out, const float* logits, const float* uniforms,
                           const DeviceSamplingParams* params, int rows, int vocab, cudaStream_t stream) {
  launch_dependent(select_tokens_kernel, rows, kThreads, 0, stream, out, logits, uniforms, params, vocab);
  CUDA_CHECK_LAUNCH();
}

void token_nll_forward(float* out, const float* logits, const int32_t* targets, int rows, int vocab,
                       cudaStream_t stream) {
  launch_dependent(token_nll_kernel, rows, kThreads, 0, stream, out, logits, targets, vocab);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
