#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rope.h"

namespace dspark::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxPairsPerLane = 4;  // head_dim <= 2 * 32 * 4 = 256

// One warp per (row, head) across the q heads, the k heads, then the v heads.
// Lane handles pairs (i, i + hd/2) for i = lane, lane + 32, ...
// Before the wait it reads what no kernel of the step writes (the step's
// positions and slots, the rotary table, the norm weights), so that after it
// only the QKV GEMM's output is a round trip away.
__global__ void qkv_rope_kv_append_kernel(bf16* q_out, const bf16* qkv, const float* q_norm, const float* k_norm,
                                          const int32_t* positions, const float2* rope_table, bf16* key_cache,
                                          bf16* value_cache, const int32_t* slots, int heads, int kv_heads,
                                          int head_dim, float eps) {
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.y * kWarps + (threadIdx.x >> 5);
  if (head >= heads + 2 * kv_heads) return;  // nothing to do, nothing to wait for
  const long row = blockIdx.x;
  const int half = head_dim / 2;
  const int width = (heads + 2 * kv_heads) * head_dim;
  const bf16* in = qkv + row * width + static_cast<long>(head) * head_dim;
  const long slot = slots[row];

  if (head >= heads + kv_heads) {  // v: straight into the cache
    wait_for_previous_kernel();
    start_next_kernel();
    bf16* destination = value_cache + (slot * kv_heads + (head - heads - kv_heads)) * head_dim;
    for (int i = lane; i < head_dim; i += 32) destination[i] = in[i];
    return;
  }
  const bool is_query = head < heads;
  const float* norm = is_query ? q_norm : k_norm;
  const float2* angles = rope_table + static_cast<long>(positions[row]) * half;
  float2 cos_sin[kMaxPairsPerLane];
  float first_weight[kMaxPairsPerLane], second_weight[kMaxPairsPerLane];
#pragma unroll
  for (int j = 0; j < kMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    cos_sin[j] = i < half ? angles[i] : make_float2(0.0f, 0.0f);
    first_weight[j] = norm && i < half ? norm[i] : 1.0f;
    second_weight[j] = norm && i < half ? norm[i + half] : 1.0f;
  }
  wait_for_previous_kernel();
  start_next_kernel();
  float first[kMaxPairsPerLane], second[kMaxPairsPerLane];
  float sum_of_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    first[j] = i < half ? __bfloat162float(in[i]) : 0.0f;
    second[j] = i < half ? __bfloat162float(in[i + half]) : 0.0f;
    sum_of_squares += first[j] * first[j] + second[j] * second[j];
  }
  const float scale = norm ? rsqrtf(warp_sum(sum_of_squares) / head_dim + eps) : 1.0f;
  bf16* destination = is_query ? q_out + (row * heads + head) * head_dim
                               : key_cache + (slot * kv_heads + (head - heads)) * head_dim;
#pragma unroll
  for (int j = 0; j < kMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    float a = first[j], b = second[j];
    if (norm) {
      a = a * scale * first_weight[j];
      b = b * scale * second_weight[j];
    }
    destination[i] = __float2bfloat16(a * cos_sin[j].x - b * cos_sin[j].y);
    destination[i + half] = __float2bfloat16(b * cos_sin[j].x + a * cos_sin[j].y);
  }
}

}  // namespace

void qkv_rope_kv_append_forward(bf16* q_out, const bf16* qkv, const float* q_norm, const float* k_norm,
                                const int32_t* positions, const float2* rope_table, bf16* key_cache,
                                bf16* value_cache, const int32_t* slots, int rows, int heads, int kv_heads,
                                int head_dim, float eps, cudaStream_t stream) {
  const dim3 grid(rows, ceil_div(heads + 2 * kv_heads, kWarps));
  launch_dependent(qkv_rope_kv_append_kernel, grid, kWarps * 32, 0, stream, q_out, qkv, q_norm, k_norm, positions,
                   rope_table, key_cache, value_cache, slots, heads, kv_heads, head_dim, eps);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
