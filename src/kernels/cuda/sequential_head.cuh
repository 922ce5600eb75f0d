// Device helpers of the drafter's sequential head shared by its kernels
// (draft.cu's per-position prepare, markov_head.cu's kernels): the
// confidence and the pruning rule, written once.
#pragma once
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/draft.h"

namespace dspark::cuda {

// One warp's h . conf.w[:d] (width values): the confidence logit's hidden
// part, the warp's sum in every lane.
__device__ __forceinline__ float hidden_confidence_logit(const float* h, const float* confidence_weight, int width) {
  const int lane = threadIdx.x & 31;
  float dot = 0.0f;
  for (int f = lane; f < width; f += 32) dot += h[f] * confidence_weight[f];
  return warp_sum(dot);
}

// c_k = σ(logit), the logit already divided by the position's STS temperature.
__device__ __forceinline__ float confidence_of(float logit) { return 1.0f / (1.0f + expf(-logit)); }

// Whether a row keeps position k (DESIGN.md §2): it kept position k - 1, k is
// under its limit, and c_k reaches the thresholds; position 0 is always kept
// (within the limit: a padding row's limit is 0).
__device__ __forceinline__ bool position_kept(int k, float confidence, bool kept_before, int limit,
                                              const DraftControl* control) {
  const bool below =
      (control->has_thresholds && confidence < control->thresholds[k]) || confidence < control->min_confidence;
  return (k == 0 || kept_before) && k < limit && !(k >= 1 && below);
}

}  // namespace dspark::cuda
