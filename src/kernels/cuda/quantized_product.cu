#include <cmath>

#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/quantized_product.h"
#include "kernels/cuda/tensor_gemv.cuh"

namespace dspark::cuda {
namespace {

constexpr int kQuantizeThreads = 256;

// x rounded up by a relative 1e-6 and one more float step: the bounds are
// summed in double and stored as f32, so they stay upper bounds.
__device__ __forceinline__ float rounded_up(double x) {
  return x > 0.0 ? nextafterf(static_cast<float>(x * (1.0 + 1e-6)), INFINITY) : 0.0f;
}

// q = round(value / scale) within -127..127 (0 for a zero scale), in double as quantize_columns does.
__device__ __forceinline__ double quantized(double value, double scale) {
  return scale > 0.0 ? fmin(fmax(rint(value / scale), -127.0), 127.0) : 0.0;
}

// The largest |x| of the block's row (every thread), and whether all of it is finite.
__device__ __forceinline__ float row_largest(const bf16* row, int length, bool& finite, float* scratch) {
  float largest = 0.0f;
  bool all_finite = true;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const float value = __bfloat162float(row[i]);
    all_finite = all_finite && isfinite(value);
    largest = fmaxf(largest, fabsf(value));
  }
  finite = __syncthreads_and(all_finite);
  return block_max(largest, scratch);
}

// One block per weight row.
__global__ void __launch_bounds__(kQuantizeThreads)
    quantize_rows_kernel(QuantizedRows rows, const bf16* weight, int length, double slack) {
  __shared__ float scratch[32];
  __shared__ double sums[kQuantizeThreads];
  const long v = blockIdx.x;
  const bf16* row = weight + v * length;
  bool finite;
  const float largest = row_largest(row, length, finite, scratch);
  const float scale = finite ? __fdiv_rn(largest, 127.0f) : 0.0f;
  double residual = 0.0, norm = 0.0, kept = 0.0;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const double value = __bfloat162float(row[i]);
    const double q = quantized(value, scale);
    rows.values[v * length + i] = static_cast<int8_t>(q);
    const double left = value - double(scale) * q;  // exact: q has 8 bits, scale 24
    residual += left * left, norm += value * value, kept += double(scale) * q * double(scale) * q;
  }
  residual = sqrt(block_sum_double(residual, sums));
  norm = sqrt(block_sum_double(norm, sums));
  kept = sqrt(block_sum_double(kept, sums));
  if (threadIdx.x == 0) {
    rows.scales[v] = scale;
    rows.bounds[v] = finite ? rounded_up(residual + slack * (norm + residual)) : INFINITY;
    rows.norms[v] = rounded_up(kept);
  }
}

// One block per activation row slot (kQuantizedActivationRows): q1 = round(h / s),
// q2 = round((h - s q1) * 254 / s), both within -127..127 (|h - s q1| <= s / 2;
// the divisions as products with 1 / s: the norms below are of what the levels
// leave out, whichever way a half rounds). It runs on the draft step's
// critical path, so it is latency that counts: 1024 threads (four elements
// each at H 4096) and one round of warp reductions for both norms together
// (the stop-36 version's 256 threads and two tree sums of eight rounds each
// took 17 us on the H100).
constexpr int kActivationThreads = 1024;

__device__ __forceinline__ double warp_sum_double(double value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// round(value * inverse) within -127..127; 0 where inverse is (a zero or non-finite row).
__device__ __forceinline__ double quantized_by(double value, double inverse) {
  return inverse > 0.0 ? fmin(fmax(rint(value * inverse), -127.0), 127.0) : 0.0;
}

__global__ void __launch_bounds__(kActivationThreads)
    quantize_activation_rows_kernel(QuantizedActivations out, const bf16* x, int rows, int length) {
  __shared__ float scratch[32];
  __shared__ double warp_norms[2][kActivationThreads / 32];
  wait_for_previous_kernel();  // x is the previous kernel's output
  start_next_kernel();
  const int k = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int8_t* first = out.values + static_cast<long>(k) * length;
  int8_t* second = out.values + static_cast<long>(kQuantizedActivationRows + k) * length;
  if (k >= rows) {  // a padding row: zero
    for (int i = threadIdx.x; i < length; i += blockDim.x) first[i] = second[i] = 0;
    if (threadIdx.x == 0) out.scales[k] = 0.0f, out.norms[k] = out.norms[kQuantizedActivationRows + k] = 0.0f;
    return;
  }
  const bf16* row = x + static_cast<long>(k) * length;
  bool finite;
  const float largest = row_largest(row, length, finite, scratch);
  const double scale = finite ? __fdiv_rn(largest, 127.0f) : 0.0f;
  const double inverse = scale > 0.0 ? 1.0 / scale : 0.0;
  double norm = 0.0, residual = 0.0;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const double value = __bfloat162float(row[i]);
    const double q1 = quantized_by(value, inverse);
    const double q2 = quantized_by(value - scale * q1, 254.0 * inverse);
    first[i] = static_cast<int8_t>(q1), second[i] = static_cast<int8_t>(q2);
    const double left = value - scale * (q1 + q2 / 254.0);
    norm += value * value, residual += left * left;
  }
  norm = warp_sum_double(norm), residual = warp_sum_double(residual);
  if (lane == 0) warp_norms[0][warp] = norm, warp_norms[1][warp] = residual;
  __syncthreads();
  if (threadIdx.x == 0) {
    norm = residual = 0.0;
    for (int w = 0; w < warps; ++w) norm += warp_norms[0][w], residual += warp_norms[1][w];
    out.scales[k] = static_cast<float>(scale);
    out.norms[k] = finite ? rounded_up(sqrt(norm)) : INFINITY;
    out.norms[kQuantizedActivationRows + k] = finite ? rounded_up(sqrt(residual)) : INFINITY;
  }
}

// The product: as the tensor-core GEMV (tensor_gemv.cuh) at one tile of 8
// activation rows, on 8-bit operands. A block owns 16 weight rows; its
// kProductWarps warps split H in chunks of 128 bytes, lane (g, c) loading 32
// bytes (two 16-byte pieces) of weight rows g and g + 8 and of both levels of
// activation row g at k + 32c. Within a piece both operands see H in the same
// order (words x, y for one mma, z, w for the next), and the sums are exact,
// so the order does not matter. All of a warp's chunks up to kProductEarly are
// loaded before the launch wait (the 8-bit rows are written once, at load).
constexpr int kProductWarps = 8;
constexpr int kProductChunk = 128;  // bytes of a row per warp and chunk
constexpr int kProductEarly = 4;    // chunks a warp loads before the wait: all of a 4096-wide row

__global__ void __launch_bounds__(kProductWarps * 32, 2)
    quantized_rows_product_kernel(float* centers, QuantizedRows weight, QuantizedActivations x, int rows, int length,
                                  int row_count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int low = blockIdx.x * 16 + g, high = low + 8;
  const bool low_valid = low < row_count, high_valid = high < row_count;
  const int8_t* low_row = weight.values + static_cast<long>(low_valid ? low : 0) * length;
  const int8_t* high_row = weight.values + static_cast<long>(high_valid ? high : 0) * length;
  const int8_t* first = x.values + static_cast<long>(g) * length;
  const int8_t* second = x.values + static_cast<long>(kQuantizedActivationRows + g) * length;
  constexpr int kStride = kProductWarps * kProductChunk;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Piece p of the chunk at k: bytes k + 32c + 16p (length is a multiple of 32: a piece is all inside or none).
  auto load = [&](const int8_t* row, bool valid, int k, int p) {
    const int own = k + 32 * c + 16 * p;
    return valid && own < length ? __ldcs(reinterpret_cast<const uint4*>(row + own)) : zero;
  };
  int sums[2][4] = {};
  // Every lane runs every mma (mma.sync.aligned: the whole warp, converged); past the row, on zeros.
  auto multiply = [&](int k, const uint4(&a_low)[2], const uint4(&a_high)[2]) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int own = k + 32 * c + 16 * p;
      const bool inside = own < length;
      const uint4 b1 = inside ? __ldg(reinterpret_cast<const uint4*>(first + own)) : zero;
      const uint4 b2 = inside ? __ldg(reinterpret_cast<const uint4*>(second + own)) : zero;
      mma_m16n8k32_s8(sums[0], a_low[p].x, a_high[p].x, a_low[p].y, a_high[p].y, b1.x, b1.y);
      mma_m16n8k32_s8(sums[0], a_low[p].z, a_high[p].z, a_low[p].w, a_high[p].w, b1.z, b1.w);
      mma_m16n8k32_s8(sums[1], a_low[p].x, a_high[p].x, a_low[p].y, a_high[p].y, b2.x, b2.y);
      mma_m16n8k32_s8(sums[1], a_low[p].z, a_high[p].z, a_low[p].w, a_high[p].w, b2.z, b2.w);
    }
  };
  const int first_k = warp * kProductChunk;
  uint4 early_low[kProductEarly][2], early_high[kProductEarly][2];
#pragma unroll
  for (int step = 0; step < kProductEarly; ++step)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      early_low[step][p] = load(low_row, low_valid, first_k + step * kStride, p);
      early_high[step][p] = load(high_row, high_valid, first_k + step * kStride, p);
    }
  wait_for_previous_kernel();
  start_next_kernel();
#pragma unroll
  for (int step = 0; step < kProductEarly; ++step)
    multiply(first_k + step * kStride, early_low[step], early_high[step]);
#pragma unroll 2
  for (int k = first_k + kProductEarly * kStride; k < length; k += kStride) {
    uint4 a_low[2], a_high[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) a_low[p] = load(low_row, low_valid, k, p), a_high[p] = load(high_row, high_valid, k, p);
    multiply(k, a_low, a_high);
  }
  __shared__ int partial[kProductWarps][2][4][32];
#pragma unroll
  for (int level = 0; level < 2; ++level)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][level][i][lane] = sums[level][i];
  __syncthreads();
  // Output (weight row j of the block's 16, activation row n): fragment row j % 8 of lane (j % 8, n / 2),
  // element n % 2 (+ 2 for rows 8..15).
  const int j = threadIdx.x >> 3, n = threadIdx.x & 7;
  if (j >= 16 || n >= rows) return;
  const int v = blockIdx.x * 16 + j;
  if (v >= row_count) return;
  const int from = (j % 8) * 4 + n / 2, i = n % 2 + (j >= 8 ? 2 : 0);
  int one = 0, two = 0;
#pragma unroll
  for (int w = 0; w < kProductWarps; ++w) one += partial[w][0][i][from], two += partial[w][1][i][from];
  centers[static_cast<long>(n) * row_count + v] =
      static_cast<float>(double(weight.scales[v]) * double(x.scales[n]) * (double(one) + double(two) / 254.0));
}

}  // namespace

void quantize_rows_forward(const QuantizedRows& rows, const bf16* weight, int row_count, int row_length, double slack,
                           cudaStream_t stream) {
  DSPARK_CHECK(row_count > 0 && row_length > 0, "quantize_rows: ", row_count, " rows of ", row_length);
  quantize_rows_kernel<<<row_count, kQuantizeThreads, 0, stream>>>(rows, weight, row_length, slack);
  CUDA_CHECK_LAUNCH();
}

void quantize_activation_rows_forward(const QuantizedActivations& out, const bf16* x, int rows, int row_length,
                                      cudaStream_t stream) {
  DSPARK_CHECK(rows >= 1 && rows <= kQuantizedActivationRows && row_length % 32 == 0,
               "quantize_activation_rows: ", rows, " rows (1..", kQuantizedActivationRows, ") of ", row_length,
               " (a multiple of 32)");
  launch_dependent(quantize_activation_rows_kernel, kQuantizedActivationRows, kActivationThreads, 0, stream, out, x,
                   rows, row_length);
  CUDA_CHECK_LAUNCH();
}

void quantized_rows_product_forward(float* centers, const QuantizedRows& weight, const QuantizedActivations& x,
                                    int rows, int row_length, int row_count, cudaStream_t stream) {
  DSPARK_CHECK(rows >= 1 && rows <= kQuantizedActivationRows && row_length % 32 == 0 &&
                   reinterpret_cast<uintptr_t>(weight.values) % 16 == 0,
               "quantized_rows_product: ", rows, " activation rows (1..", kQuantizedActivationRows, ") of ", row_length,
               " (a multiple of 32), 16-byte aligned weights");
  launch_dependent(quantized_rows_product_kernel, ceil_div(row_count, 16), kProductWarps * 32, 0, stream, centers,
                   weight, x, rows, row_length, row_count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
