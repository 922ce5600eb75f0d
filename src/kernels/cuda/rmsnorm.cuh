// The residual add + RMSNorm of one row by one block, shared by the norm's own
// kernel (rmsnorm.cu) and the GEMV whose last block finishes the projection
// into the residual stream with it (matmul.cu): both give the same bits.
#pragma once
#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

constexpr int kResidualNormThreads = 256;

// For one row, by a block of kResidualNormThreads threads: x += delta (when
// delta is given); out = rmsnorm(x) * weight; the taps (when given) receive x
// after the add and the normed row in f32. The row stays in registers:
// VECTORS float4 per thread covers dim <= VECTORS * 4 * kResidualNormThreads
// (dim a multiple of 4). delta is read through L2 (__ldcg): the GEMV's last
// block reads rows that other blocks have just written.
// Every load is issued before the first store: a store into x may alias a
// later load as far as the compiler knows, so interleaved they were a round
// trip each (PERF.md, stop 30).
template <int VECTORS>
__device__ __forceinline__ void residual_add_rmsnorm_row(float* x, const bf16* delta, bf16* out, const float* weight,
                                                         int dim, float eps, float* residual_tap, float* normed_tap,
                                                         float* scratch) {
  // The weight comes with the row (one round trip, not a second one after
  // the sum) where its registers fit beside the row's: the tensor-core GEMV
  // whose tail this is has 80 (an 8192-wide row and its delta alone take 48).
  constexpr bool kWeightWithRow = VECTORS <= 4;
  float4* row = reinterpret_cast<float4*>(x);
  const int vectors = dim / 4;
  float4 values[VECTORS], weights[VECTORS];
  uint2 deltas[VECTORS];
#pragma unroll
  for (int j = 0; j < VECTORS; ++j) {
    const int i = threadIdx.x + j * kResidualNormThreads;
    if (i >= vectors) break;
    values[j] = row[i];
    if (kWeightWithRow) weights[j] = reinterpret_cast<const float4*>(weight)[i];
    if (delta) deltas[j] = __ldcg(reinterpret_cast<const uint2*>(delta) + i);
  }
  float sum_of_squares = 0.0f;
#pragma unroll
  for (int j = 0; j < VECTORS; ++j) {
    const int i = threadIdx.x + j * kResidualNormThreads;
    if (i >= vectors) break;
    float4& value = values[j];
    if (delta) {
      const float4 added = bf16x4_to_float4(deltas[j]);
      value.x += added.x, value.y += added.y, value.z += added.z, value.w += added.w;
      row[i] = value;
    }
    if (residual_tap) reinterpret_cast<float4*>(residual_tap)[i] = value;
    // Fused multiply-adds in a fixed order, not left to the compiler's
    // contraction (which can differ between the instantiations inlined into
    // different kernels, and with it a row's bits).
    sum_of_squares = __fmaf_rn(
        value.w, value.w,
        __fmaf_rn(value.z, value.z, __fmaf_rn(value.y, value.y, __fmaf_rn(value.x, value.x, sum_of_squares))));
  }
  const float scale = rsqrtf(block_sum(sum_of_squares, scratch) / dim + eps);
#pragma unroll
  for (int j = 0; j < VECTORS; ++j) {
    const int i = threadIdx.x + j * kResidualNormThreads;
    if (i >= vectors) break;
    const float4 w = kWeightWithRow ? weights[j] : reinterpret_cast<const float4*>(weight)[i];
    const float4 value = values[j];
    const float4 normed =
        make_float4(value.x * scale * w.x, value.y * scale * w.y, value.z * scale * w.z, value.w * scale * w.w);
    __nv_bfloat162 packed[2] = {__floats2bfloat162_rn(normed.x, normed.y), __floats2bfloat162_rn(normed.z, normed.w)};
    reinterpret_cast<uint2*>(out)[i] = *reinterpret_cast<const uint2*>(packed);
    if (normed_tap) reinterpret_cast<float4*>(normed_tap)[i] = normed;
  }
}

// The float4s per thread that dim needs (1, 2, 4 or 8), or 0 where the row
// kernel does not apply (dim or the tap stride not a multiple of 4, or wider
// than 8 * 4 * kResidualNormThreads).
inline int residual_norm_vectors(int dim, long tap_stride) {
  const int per_thread = (dim / 4 + kResidualNormThreads - 1) / kResidualNormThreads;
  if (dim % 4 != 0 || tap_stride % 4 != 0 || per_thread > 8) return 0;
  return per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
}

}  // namespace dspark::cuda
