// The residual add + RMSNorm of rows by one block, shared by the norm's own
// kernel (rmsnorm.cu) and the GEMV whose last block finishes the projection
// into the residual stream with it (matmul.cu): both give the same bits.
#pragma once
#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

constexpr int kResidualNormThreads = 256;

// For ROWS rows, by a block of kResidualNormThreads threads: x += delta (when
// delta is given); out = rmsnorm(x) * weight; the taps (when given) receive x
// after the add and the normed row in f32. x, delta and out hold rows dim
// apart, the taps tap_stride apart. The rows stay in registers: VECTORS
// float4 per thread and row covers dim <= VECTORS * 4 * kResidualNormThreads
// (dim a multiple of 4). delta is read through L2 (__ldcg): the GEMV's last
// block reads rows that other blocks have just written. `scratch` is
// __shared__ float[32 * ROWS].
// Every load is issued before the first store (a store into x may alias a
// later load as far as the compiler knows, so interleaved they would be a
// round trip each), and ROWS rows share one block reduction; each row's
// arithmetic is the one-row case's in the same order (the same bits for any
// ROWS: a verify row keeps the bits of the row decoded alone).
template <int VECTORS, int ROWS = 1>
__device__ __forceinline__ void residual_add_rmsnorm_rows(float* x, const bf16* delta, bf16* out, const float* weight,
                                                          int dim, float eps, float* residual_tap, float* normed_tap,
                                                          long tap_stride, float* scratch) {
  // The weight comes with the rows (one round trip, not a second one after
  // the sum) where its registers fit beside theirs: the GEMV whose tail this
  // is has 80 (the 8192-wide rows alone take 48).
  constexpr bool kWeightWithRows = VECTORS <= 4;
  const int vectors = dim / 4;
  float4 values[ROWS][VECTORS], weights[VECTORS];
  uint2 deltas[ROWS][VECTORS];
#pragma unroll
  for (int j = 0; j < VECTORS; ++j) {
    const int i = threadIdx.x + j * kResidualNormThreads;
    if (i >= vectors) break;
    if (kWeightWithRows) weights[j] = reinterpret_cast<const float4*>(weight)[i];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      values[r][j] = reinterpret_cast<const float4*>(x + long(r) * dim)[i];
      if (delta) deltas[r][j] = __ldcg(reinterpret_cast<const uint2*>(delta + long(r) * dim) + i);
    }
  }
  float sums[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    sums[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < VECTORS; ++j) {
      const int i = threadIdx.x + j * kResidualNormThreads;
      if (i >= vectors) break;
      float4& value = values[r][j];
      if (delta) {
        const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&deltas[r][j].x));
        const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&deltas[r][j].y));
        value.x += low.x, value.y += low.y, value.z += high.x, value.w += high.y;
        reinterpret_cast<float4*>(x + long(r) * dim)[i] = value;
      }
      if (residual_tap) reinterpret_cast<float4*>(residual_tap + r * tap_stride)[i] = value;
      // Fused multiply-adds in a fixed order: left to the compiler, the
      // contraction of a * a + b * b + ... differed between instantiations
      // for different ROWS, and so did a row's bits.
      sums[r] =
          __fmaf_rn(value.w, value.w,
                    __fmaf_rn(value.z, value.z, __fmaf_rn(value.y, value.y, __fmaf_rn(value.x, value.x, sums[r]))));
    }
  }
  block_sums(sums, scratch);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float scale = rsqrtf(sums[r] / dim + eps);
#pragma unroll
    for (int j = 0; j < VECTORS; ++j) {
      const int i = threadIdx.x + j * kResidualNormThreads;
      if (i >= vectors) break;
      const float4 value = values[r][j];
      const float4 w = kWeightWithRows ? weights[j] : reinterpret_cast<const float4*>(weight)[i];
      const float4 normed =
          make_float4(value.x * scale * w.x, value.y * scale * w.y, value.z * scale * w.z, value.w * scale * w.w);
      __nv_bfloat162 packed[2] = {__floats2bfloat162_rn(normed.x, normed.y), __floats2bfloat162_rn(normed.z, normed.w)};
      reinterpret_cast<uint2*>(out + long(r) * dim)[i] = *reinterpret_cast<const uint2*>(packed);
      if (normed_tap) reinterpret_cast<float4*>(normed_tap + r * tap_stride)[i] = normed;
    }
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
