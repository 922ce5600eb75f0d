// [in, out] products for few rows (the drafter's sequential head): x @ W with
// W stored [in, out], one block's share, for the kernels that run it
// (matmul_in_out_forward in matmul.cu, the Markov head's per-position kernel
// in markov_head.cu): one body, so that their logits are the same bits.
//
// Each block owns kInOutColumns output columns; lane l of warp w owns columns
// l*8 .. l*8+7 and the input features i = w, w + 8, ...: a warp reads 32 * 8
// consecutive weights of one input row per step (coalesced, no transpose
// needed), and the 8 warps' partial sums meet in shared memory. Rows beyond
// ROWS run as further blocks along y (each re-reads the weights).
#pragma once
#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

constexpr int kInOutSlices = 8;
constexpr int kInOutColumns = 32 * 8;

// Eight bf16 packed in 16 bytes as floats.
__device__ __forceinline__ void unpack_eight(uint4 packed, float* out) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 pair = __bfloat1622float2(pairs[j]);
    out[2 * j] = pair.x, out[2 * j + 1] = pair.y;
  }
}

// Eight consecutive weights as floats; VECTOR: one 16-byte (bf16) or two
// (f32) loads, else element by element up to `available`.
template <bool VECTOR>
__device__ __forceinline__ void load_eight(const bf16* weights, int available, float* out) {
  if constexpr (VECTOR) {
    unpack_eight(__ldcs(reinterpret_cast<const uint4*>(weights)), out);  // streamed once per use
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = j < available ? __bfloat162float(weights[j]) : 0.0f;
  }
}

template <bool VECTOR>
__device__ __forceinline__ void load_eight(const float* weights, int available, float* out) {
  if constexpr (VECTOR) {
    const float4 low = __ldg(reinterpret_cast<const float4*>(weights));
    const float4 high = __ldg(reinterpret_cast<const float4*>(weights) + 1);
    out[0] = low.x, out[1] = low.y, out[2] = low.z, out[3] = low.w;
    out[4] = high.x, out[5] = high.y, out[6] = high.z, out[7] = high.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = j < available ? __ldg(weights + j) : 0.0f;
  }
}

// Rows a block takes in one pass over the weights (its ROWS) for a batch of `rows`.
inline int in_out_rows_per_block(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }

// The input rows of a block as consecutive f32 rows of `in` features.
struct DenseRows {
  const float* x;  // the block's first row
  int in;
  __device__ __forceinline__ float operator()(int row, int feature) const {
    return __ldg(x + static_cast<long>(row) * in + feature);
  }
};

// The input rows of a block as bf16 table rows (the Markov head's e_k = w1[x_{k-1}]).
template <int ROWS>
struct GatheredRows {
  const bf16* rows[ROWS];
  __device__ __forceinline__ float operator()(int row, int feature) const {
    return __bfloat162float(__ldg(rows[row] + feature));
  }
};

// A thread's first P bf16 weight octets (features slice, slice + 8, ...), as
// loaded, before a kernel's wait where no kernel before it writes the weights
// (16-byte rows only: VECTOR).
template <int P>
struct FirstWeights {
  uint4 packed[P > 0 ? P : 1];
};

template <int P>
__device__ __forceinline__ void in_out_first_weights(FirstWeights<P>& first, const bf16* weight, int in,
                                                     int out_features) {
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const int column = blockIdx.x * kInOutColumns + lane * 8;
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int i = slice + j * kInOutSlices;
    if (column < out_features && i < in)
      first.packed[j] = __ldcs(reinterpret_cast<const uint4*>(weight + static_cast<long>(i) * out_features + column));
  }
}

// The block's share of out[row_count, out_features] = x @ W (+ bias) (+= out
// when accumulating): out and argmax_keys point at the block's first row.
// ARGMAX: also each row's argmax over all out_features columns, by a block
// reduction and one atomicMax per (block, row) into argmax_keys[row]. Each
// column's sum: per slice in feature order, the slices in order (after the
// bias), then the value already in out.
template <class Weight, int ROWS, bool VECTOR, bool ARGMAX, class Rows, int P = 0>
__device__ __forceinline__ void in_out_product(float* out, const Rows& x, const Weight* weight, const float* bias,
                                               int row_count, int in, int out_features, bool accumulate,
                                               unsigned long long* argmax_keys, const FirstWeights<P>& first = {}) {
  __shared__ __align__(16) float partial[kInOutSlices][kInOutColumns];
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const int column = blockIdx.x * kInOutColumns + lane * 8;
  float sums[ROWS][8];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) sums[r][j] = 0.0f;
  // Input feature i's eight weights times each row's x(r, i), into the sums.
  auto multiply = [&](int i, const float(&w)[8]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float value = r < row_count ? x(r, i) : 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) sums[r][c] += value * w[c];
    }
  };
  if (column < out_features) {
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const int i = slice + j * kInOutSlices;
      if (i >= in) break;
      float w[8];
      unpack_eight(first.packed[j], w);
      multiply(i, w);
    }
#pragma unroll 4
    for (int i = slice + P * kInOutSlices; i < in; i += kInOutSlices) {
      float w[8];
      load_eight<VECTOR>(weight + static_cast<long>(i) * out_features + column, out_features - column, w);
      multiply(i, w);
    }
  }
  // One row at a time: the 8 slices' sums of each column, added by the thread owning that column.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= row_count) break;  // the same for every thread of the block
    float4* mine = reinterpret_cast<float4*>(&partial[slice][lane * 8]);
    mine[0] = make_float4(sums[r][0], sums[r][1], sums[r][2], sums[r][3]);
    mine[1] = make_float4(sums[r][4], sums[r][5], sums[r][6], sums[r][7]);
    __syncthreads();
    const int own = blockIdx.x * kInOutColumns + threadIdx.x;
    unsigned long long key = 0;
    if (own < out_features) {
      float total = bias ? bias[own] : 0.0f;
#pragma unroll
      for (int s = 0; s < kInOutSlices; ++s) total += partial[s][threadIdx.x];
      float* destination = out + static_cast<long>(r) * out_features + own;
      if (accumulate) total += *destination;
      *destination = total;
      key = argmax_key(total, own);
    }
    if constexpr (ARGMAX) {
      __shared__ unsigned long long warp_keys[kInOutSlices];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, offset));
      if (lane == 0) warp_keys[slice] = key;
      __syncthreads();
      if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < kInOutSlices; ++w) key = max(key, warp_keys[w]);
        atomicMax(argmax_keys + r, key);
      }
    }
    __syncthreads();  // partial (and warp_keys) are rewritten for the next row
  }
}

}  // namespace dspark::cuda
