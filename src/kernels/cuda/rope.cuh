// Device code shared by the RoPE kernel (rope.cu) and the attention kernel
// that takes its place in decode and verify steps (attention.cu): one warp
// normalises one head row (Qwen3's per-head RMSNorm, optional) and rotates
// it, lane owning the pairs (i, i + hd/2) for i = lane, lane + 32, ... Both
// kernels run this code, so a key appended to the cache by either has the
// same bits.
#pragma once
#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

constexpr int kRopeMaxPairsPerLane = 4;  // head_dim <= 2 * 32 * 4 = 256

// What a lane reads of the rotary table row and of the norm weight (no
// kernel writes either, so a kernel may load them before its wait).
struct RopeLane {
  float2 cos_sin[kRopeMaxPairsPerLane];
  float first_weight[kRopeMaxPairsPerLane], second_weight[kRopeMaxPairsPerLane];
};

// rope_table [positions, hd/2] (cos, sin); norm [hd] or null.
__device__ __forceinline__ RopeLane load_rope_lane(const float* norm, const float2* rope_table, int position,
                                                   int head_dim, int lane) {
  const int half = head_dim / 2;
  const float2* angles = rope_table + static_cast<long>(position) * half;
  RopeLane constants;
#pragma unroll
  for (int j = 0; j < kRopeMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    constants.cos_sin[j] = i < half ? angles[i] : make_float2(0.0f, 0.0f);
    constants.first_weight[j] = norm && i < half ? norm[i] : 1.0f;
    constants.second_weight[j] = norm && i < half ? norm[i + half] : 1.0f;
  }
  return constants;
}

// The head row `in` [hd] normed (when `normed`) and rotated: out(i, value)
// receives element i, rounded to bf16. Every lane of the warp calls it.
template <class Out>
__device__ __forceinline__ void norm_rope_row(const __nv_bfloat16* in, const RopeLane& constants, bool normed,
                                              int head_dim, float eps, int lane, Out out) {
  const int half = head_dim / 2;
  float first[kRopeMaxPairsPerLane], second[kRopeMaxPairsPerLane];
  float sum_of_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kRopeMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    first[j] = i < half ? __bfloat162float(in[i]) : 0.0f;
    second[j] = i < half ? __bfloat162float(in[i + half]) : 0.0f;
    sum_of_squares += first[j] * first[j] + second[j] * second[j];
  }
  const float scale = normed ? rsqrtf(warp_sum(sum_of_squares) / head_dim + eps) : 1.0f;
#pragma unroll
  for (int j = 0; j < kRopeMaxPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i >= half) break;
    float a = first[j], b = second[j];
    if (normed) {
      a = a * scale * constants.first_weight[j];
      b = b * scale * constants.second_weight[j];
    }
    const float2 cos_sin = constants.cos_sin[j];
    out(i, __float2bfloat16(a * cos_sin.x - b * cos_sin.y));
    out(i + half, __float2bfloat16(b * cos_sin.x + a * cos_sin.y));
  }
}

}  // namespace dspark::cuda
