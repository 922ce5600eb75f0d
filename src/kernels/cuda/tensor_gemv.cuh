// The tensor-core mma wrappers (bf16, and 8-bit for quantized_product.cu) and
// the tensor-core GEMV's chunk (matmul.cu's tensor_gemv_kernel, the target's
// product for up to 16 rows and the drafter's LM head): how a warp loads and
// multiplies one chunk of K. Shared with the Markov head's tokens-only kernel,
// which forms a few of the LM head's logits again and must get their bits:
// a logit's bits are fixed by the chunks' order within each warp (increasing
// k), the pieces' order within a chunk, and the warps' order when their sums
// meet (0 .. kMmaWarps - 1, from 0.0f); an mma's output element depends only
// on its own weight row and activation row.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace dspark::cuda {

// A block's kMmaWarps warps split K: warp w takes the chunks at k = w *
// kMmaChunk + i * kMmaWarps * kMmaChunk, i = 0, 1, ...
constexpr int kMmaWarps = 8;
constexpr int kMmaChunk = 64;
constexpr int kMmaPieces = kMmaChunk / 32;  // 16-byte pieces per lane and row in a chunk

__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// mma.sync m16n8k32, 8-bit signed operands, exact int32 accumulation.
__device__ __forceinline__ void mma_m16n8k32_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The chunk at k: lane (g, c) owns elements k + c * kMmaChunk / 4 .. + kMmaChunk / 4
// of every row (all past `in`, or none: in is a multiple of 32; past it, zeros).
// Weight rows g (low) and g + 8 (high) of the block's 16, streamed (read once).
__device__ __forceinline__ void tensor_gemv_load(uint4 (&a_low)[kMmaPieces], uint4 (&a_high)[kMmaPieces],
                                                 const bf16* low_row, const bf16* high_row, bool low_valid,
                                                 bool high_valid, int k, int c, int in) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int own = k + c * (kMmaChunk / 4);
  const bool inside = own < in;
#pragma unroll
  for (int piece = 0; piece < kMmaPieces; ++piece) {
    a_low[piece] = low_valid && inside ? __ldcs(reinterpret_cast<const uint4*>(low_row + own + 8 * piece)) : zero;
    a_high[piece] = high_valid && inside ? __ldcs(reinterpret_cast<const uint4*>(high_row + own + 8 * piece)) : zero;
  }
}

// sum += one piece of weight rows g and g + 8 times the activation's piece b:
// two mma. Both operands see K in the same permuted order (an mma's k 2c,
// 2c+1, 2c+8, 2c+9 are elements 0-3 of a piece, the next mma's elements 4-7),
// which the sum does not notice.
__device__ __forceinline__ void tensor_gemv_multiply_piece(float (&sum)[4], const uint4& a_low, const uint4& a_high,
                                                           const uint4& b) {
  mma_m16n8k16(sum, a_low.x, a_high.x, a_low.y, a_high.y, b.x, b.y);
  mma_m16n8k16(sum, a_low.z, a_high.z, a_low.w, a_high.w, b.z, b.w);
}

// sums[t] += the chunk's weights times activation rows x_rows[t] (lane (g, c)
// reads row g of tile t), pieces in order.
template <int TILES>
__device__ __forceinline__ void tensor_gemv_multiply(float (&sums)[TILES][4], const uint4 (&a_low)[kMmaPieces],
                                                     const uint4 (&a_high)[kMmaPieces],
                                                     const bf16* const (&x_rows)[TILES], int k, int c, int in) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int own = k + c * (kMmaChunk / 4);
  const bool inside = own < in;
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int piece = 0; piece < kMmaPieces; ++piece) {
      const uint4 b = inside ? __ldg(reinterpret_cast<const uint4*>(x_rows[t] + own + 8 * piece)) : zero;
      tensor_gemv_multiply_piece(sums[t], a_low[piece], a_high[piece], b);
    }
  }
}

}  // namespace dspark::cuda
