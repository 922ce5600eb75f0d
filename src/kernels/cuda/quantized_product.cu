#include <cmath>

#include "core/error.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/in_out_product.cuh"
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

__device__ __forceinline__ float as_float(bf16 value) { return __bfloat162float(value); }
__device__ __forceinline__ float as_float(float value) { return value; }

// The largest |x| of the block's row (every thread), and whether all of it is finite.
template <class T>
__device__ __forceinline__ float row_largest(const T* row, int length, bool& finite, float* scratch) {
  float largest = 0.0f;
  bool all_finite = true;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const float value = as_float(row[i]);
    all_finite = all_finite && isfinite(value);
    largest = fmaxf(largest, fabsf(value));
  }
  finite = __syncthreads_and(all_finite);
  return block_max(largest, scratch);
}

// One block per weight row.
template <class T>
__global__ void __launch_bounds__(kQuantizeThreads)
    quantize_rows_kernel(QuantizedRows rows, const T* weight, int length, double slack) {
  __shared__ float scratch[32];
  __shared__ double sums[kQuantizeThreads];
  const long v = blockIdx.x;
  const T* row = weight + v * length;
  bool finite;
  const float largest = row_largest(row, length, finite, scratch);
  const float scale = finite ? __fdiv_rn(largest, 127.0f) : 0.0f;
  double residual = 0.0, norm = 0.0, kept = 0.0;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const double value = as_float(row[i]);
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
    if (threadIdx.x == 0)
      out.scales[k] = 0.0f, out.norms[k] = out.norms[kQuantizedActivationRows + k] = 0.0f,
      out.norms[2 * kQuantizedActivationRows + k] = 0.0f;
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
    out.norms[2 * kQuantizedActivationRows + k] = 0.0f;  // lm_head_projection_reach_forward's, where it runs
  }
}

// The product: as the tensor-core GEMV (tensor_gemv.cuh) at one tile of 8
// activation rows, on 8-bit operands. A block owns GROUPS groups of 16 weight
// rows; its kProductWarps warps split each row in chunks of 128 bytes, lane
// (g, c) loading 32 bytes (two 16-byte pieces) of weight rows g and g + 8 and
// of both levels of activation row g at k + 32c. Warp w's item j is group
// j % GROUPS, chunk w + 8 (j / GROUPS): its first kProductEarly items, all of
// a block's 16 rows at H 4096 (GROUPS 1) or of 64 rows at 1024 (GROUPS 4: a
// row of 1024 bytes is one chunk a warp, too few bytes in flight for a block
// of 16 rows), are loaded before the launch wait (the 8-bit rows are written
// once, at load). Within a piece both operands see H in the same order (words
// x, y for one mma, z, w for the next), and the sums are exact, so the order
// does not matter.
constexpr int kProductWarps = 8;
constexpr int kProductChunk = 128;  // bytes of a row per warp and chunk
constexpr int kProductEarly = 4;    // items a warp loads before the wait

template <int GROUPS>
__global__ void __launch_bounds__(kProductWarps * 32, 2)
    quantized_rows_product_kernel(float* centers, QuantizedRows weight, QuantizedActivations x, int rows, int length,
                                  int row_count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int8_t* low_row[GROUPS];
  const int8_t* high_row[GROUPS];
  bool low_valid[GROUPS], high_valid[GROUPS];
#pragma unroll
  for (int group = 0; group < GROUPS; ++group) {
    const int low = (blockIdx.x * GROUPS + group) * 16 + g, high = low + 8;
    low_valid[group] = low < row_count, high_valid[group] = high < row_count;
    low_row[group] = weight.values + static_cast<long>(low_valid[group] ? low : 0) * length;
    high_row[group] = weight.values + static_cast<long>(high_valid[group] ? high : 0) * length;
  }
  const int8_t* first = x.values + static_cast<long>(g) * length;
  const int8_t* second = x.values + static_cast<long>(kQuantizedActivationRows + g) * length;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Piece p of the chunk at k: bytes k + 32c + 16p (length is a multiple of 32: a piece is all inside or none).
  auto load = [&](const int8_t* row, bool valid, int k, int p) {
    const int own = k + 32 * c + 16 * p;
    return valid && own < length ? __ldcs(reinterpret_cast<const uint4*>(row + own)) : zero;
  };
  int sums[GROUPS][2][4] = {};
  // Every lane runs every mma (mma.sync.aligned: the whole warp, converged); past the row, on zeros.
  auto multiply = [&](int(&group_sums)[2][4], int k, const uint4(&a_low)[2], const uint4(&a_high)[2]) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int own = k + 32 * c + 16 * p;
      const bool inside = own < length;
      const uint4 b1 = inside ? __ldg(reinterpret_cast<const uint4*>(first + own)) : zero;
      const uint4 b2 = inside ? __ldg(reinterpret_cast<const uint4*>(second + own)) : zero;
      mma_m16n8k32_s8(group_sums[0], a_low[p].x, a_high[p].x, a_low[p].y, a_high[p].y, b1.x, b1.y);
      mma_m16n8k32_s8(group_sums[0], a_low[p].z, a_high[p].z, a_low[p].w, a_high[p].w, b1.z, b1.w);
      mma_m16n8k32_s8(group_sums[1], a_low[p].x, a_high[p].x, a_low[p].y, a_high[p].y, b2.x, b2.y);
      mma_m16n8k32_s8(group_sums[1], a_low[p].z, a_high[p].z, a_low[p].w, a_high[p].w, b2.z, b2.w);
    }
  };
  // Item j: group j % GROUPS, the chunk at (warp + kProductWarps * (j / GROUPS)) * kProductChunk.
  auto item_k = [&](int j) { return (warp + kProductWarps * (j / GROUPS)) * kProductChunk; };
  uint4 early_low[kProductEarly][2], early_high[kProductEarly][2];
#pragma unroll
  for (int j = 0; j < kProductEarly; ++j)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      early_low[j][p] = load(low_row[j % GROUPS], low_valid[j % GROUPS], item_k(j), p);
      early_high[j][p] = load(high_row[j % GROUPS], high_valid[j % GROUPS], item_k(j), p);
    }
  wait_for_previous_kernel();
  start_next_kernel();
#pragma unroll
  for (int j = 0; j < kProductEarly; ++j) multiply(sums[j % GROUPS], item_k(j), early_low[j], early_high[j]);
  // The rest (rows longer than kProductEarly / GROUPS chunks a warp), GROUPS items at a time.
  for (int j = kProductEarly; item_k(j) < length; j += GROUPS) {
#pragma unroll
    for (int group = 0; group < GROUPS; ++group) {
      uint4 a_low[2], a_high[2];
#pragma unroll
      for (int p = 0; p < 2; ++p)
        a_low[p] = load(low_row[group], low_valid[group], item_k(j + group), p),
        a_high[p] = load(high_row[group], high_valid[group], item_k(j + group), p);
      multiply(sums[group], item_k(j + group), a_low, a_high);
    }
  }
  __shared__ int partial[kProductWarps][GROUPS][2][4][32];
#pragma unroll
  for (int group = 0; group < GROUPS; ++group)
#pragma unroll
    for (int level = 0; level < 2; ++level)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][group][level][i][lane] = sums[group][level][i];
  __syncthreads();
  // Output (weight row j of a group's 16, activation row n): fragment row j % 8 of lane (j % 8, n / 2),
  // element n % 2 (+ 2 for rows 8..15).
  for (int output = threadIdx.x; output < GROUPS * 16 * 8; output += blockDim.x) {
    const int group = output / 128, j = (output / 8) % 16, n = output % 8;
    const int v = (blockIdx.x * GROUPS + group) * 16 + j;
    if (n >= rows || v >= row_count) continue;
    const int from = (j % 8) * 4 + n / 2, i = n % 2 + (j >= 8 ? 2 : 0);
    int one = 0, two = 0;
#pragma unroll
    for (int w = 0; w < kProductWarps; ++w) one += partial[w][group][0][i][from], two += partial[w][group][1][i][from];
    centers[static_cast<long>(n) * row_count + v] =
        static_cast<float>(double(weight.scales[v]) * double(x.scales[n]) * (double(one) + double(two) / 254.0));
  }
}

// M = W P in double, rounded to f32: a 64 x 64 tile of M a block, 4 x 4 a thread, 16 of the H terms staged at a
// time. Made once; its cost (~2 * V * H * D flops on the double units) does not count.
constexpr int kThroughTile = 64, kThroughDepth = 16;

__global__ void __launch_bounds__(256)
    lm_head_through_projection_kernel(float* out, const bf16* lm_head, const bf16* projection, int V, int H, int D) {
  __shared__ double w_tile[kThroughDepth][kThroughTile + 1], p_tile[kThroughDepth][kThroughTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const long v0 = long(blockIdx.y) * kThroughTile;
  const int j0 = blockIdx.x * kThroughTile;
  double sums[4][4] = {};
  for (int i0 = 0; i0 < H; i0 += kThroughDepth) {
    for (int e = threadIdx.x; e < kThroughDepth * kThroughTile; e += blockDim.x) {
      const int row = e / kThroughDepth, i = e % kThroughDepth;  // W[v0 + row][i0 + i]
      w_tile[i][row] = v0 + row < V && i0 + i < H ? __bfloat162float(lm_head[(v0 + row) * H + i0 + i]) : 0.0;
      const int column = e % kThroughTile, depth = e / kThroughTile;  // P[i0 + depth][j0 + column]
      p_tile[depth][column] =
          i0 + depth < H && j0 + column < D ? __bfloat162float(projection[long(i0 + depth) * D + j0 + column]) : 0.0;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kThroughDepth; ++i)
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) sums[a][b] = fma(w_tile[i][ty + 16 * a], p_tile[i][tx + 16 * b], sums[a][b]);
    __syncthreads();
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const long v = v0 + ty + 16 * a;
      const int j = j0 + tx + 16 * b;
      if (v < V && j < D) out[v * D + j] = static_cast<float>(sums[a][b]);
    }
}

// The largest ||W_v||_2, as f32 bits (non-negative floats order as their bits), one block per row.
__global__ void __launch_bounds__(kQuantizeThreads)
    largest_row_norm_kernel(unsigned* largest, const bf16* weight, int length) {
  __shared__ double sums[kQuantizeThreads];
  const bf16* row = weight + long(blockIdx.x) * length;
  double square = 0.0;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    const double value = __bfloat162float(row[i]);
    square += value * value;
  }
  square = block_sum_double(square, sums);
  if (threadIdx.x == 0) atomicMax(largest, __float_as_uint(isfinite(square) ? rounded_up(sqrt(square)) : INFINITY));
}

// lm_head_projection_reach_forward: a block recomputes 32 outputs i of y = P x in double for every row, lane o
// output i0 + o, warp w its part of the D terms (x staged in shared memory as double: the products and sums stay
// on the double units, and every lane of a warp reads the same x); the parts are added in order, then each row's
// sums of (y_i - y'_i)^2 and y'_i^2 go to `sums` in double; the last block to finish turns them into each row's
// reach and zeroes `sums` for the next call.
constexpr int kReachWarps = 8, kReachOutputs = 32;

__device__ __forceinline__ int reach_part_length(int D) { return (D + 8 * kReachWarps - 1) / (8 * kReachWarps) * 8; }

__global__ void __launch_bounds__(kReachWarps * 32)
    lm_head_projection_reach_kernel(QuantizedActivations out, const bf16* x, const bf16* projection, const bf16* y,
                                    int rows, int D, int H, const unsigned* lm_row_norm, double* sums,
                                    unsigned* finished) {
  extern __shared__ double reach_shared[];  // x [rows][D], then the warps' parts [kReachWarps][rows][32]
  double* staged_x = reach_shared;
  double* parts = reach_shared + rows * D;
  __shared__ double block_sums[2][kQuantizedActivationRows];  // [rows]: a row's residual, then its y'
  wait_for_previous_kernel();  // x and y are earlier kernels' outputs
  start_next_kernel();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, i = blockIdx.x * kReachOutputs + lane;
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) staged_x[e] = __bfloat162float(x[e]);
  __syncthreads();
  double dot[kQuantizedActivationRows] = {};
  const int length = reach_part_length(D), begin = warp * length, end = min(begin + length, D);
  const bf16* row = projection + long(i) * D;
  for (int j0 = begin; j0 < end; j0 += 64) {  // eight loads in flight, then their 64 terms
    uint4 pieces[8];
#pragma unroll
    for (int q = 0; q < 8; ++q)
      pieces[q] = j0 + 8 * q < end ? *reinterpret_cast<const uint4*>(row + j0 + 8 * q) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (j0 + 8 * q >= end) break;
      float p[8];
      unpack_eight(pieces[q], p);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const double weight = p[e];
#pragma unroll
        for (int r = 0; r < kQuantizedActivationRows; ++r)
          if (r < rows) dot[r] = fma(staged_x[r * D + j0 + 8 * q + e], weight, dot[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kQuantizedActivationRows; ++r)
    if (r < rows) parts[(warp * rows + r) * kReachOutputs + lane] = dot[r];
  __syncthreads();
  if (threadIdx.x < rows * kReachOutputs) {  // thread (r, o): the parts in order, then the row's sums
    const int r = threadIdx.x / kReachOutputs, o = threadIdx.x % kReachOutputs;
    double exact = 0.0;
    for (int w = 0; w < kReachWarps; ++w) exact += parts[(w * rows + r) * kReachOutputs + o];
    const double rounded = __bfloat162float(y[long(r) * H + blockIdx.x * kReachOutputs + o]);
    const double residual = warp_sum_double((rounded - exact) * (rounded - exact)),
                 kept = warp_sum_double(rounded * rounded);  // a warp is one row's 32 outputs
    if (o == 0) block_sums[0][r] = residual, block_sums[1][r] = kept;
  }
  __syncthreads();
  if (threadIdx.x < rows)
    atomicAdd(&sums[threadIdx.x], block_sums[0][threadIdx.x]),
        atomicAdd(&sums[kQuantizedActivationRows + threadIdx.x], block_sums[1][threadIdx.x]);
  if (!took_last_ticket(finished, gridDim.x) || threadIdx.x >= kQuantizedActivationRows) return;
  const int r = threadIdx.x;
  const double residual_norm = sqrt(__ldcg(&sums[r])), norm = sqrt(__ldcg(&sums[kQuantizedActivationRows + r]));
  const double largest = __uint_as_float(*lm_row_norm);
  // ||W_v|| (||y' - P x|| + slack ||y'||): the rest of U's distance from the center; the double sums' own error
  // is far inside the relative 2^-20 kept.
  out.norms[2 * kQuantizedActivationRows + r] =
      r < rows ? rounded_up(largest * (residual_norm * (1.0 + 0x1p-20) + kQuantizedProductSlack * norm) + 1e-30) : 0.0f;
  sums[r] = sums[kQuantizedActivationRows + r] = 0.0;
  if (r == 0) *finished = 0;
}

}  // namespace

template <class T>
void quantize_rows_forward(const QuantizedRows& rows, const T* weight, int row_count, int row_length, double slack,
                           cudaStream_t stream) {
  DSPARK_CHECK(row_count > 0 && row_length > 0, "quantize_rows: ", row_count, " rows of ", row_length);
  quantize_rows_kernel<T><<<row_count, kQuantizeThreads, 0, stream>>>(rows, weight, row_length, slack);
  CUDA_CHECK_LAUNCH();
}
template void quantize_rows_forward(const QuantizedRows&, const bf16*, int, int, double, cudaStream_t);
template void quantize_rows_forward(const QuantizedRows&, const float*, int, int, double, cudaStream_t);

void lm_head_through_projection_forward(float* out, const bf16* lm_head, const bf16* projection, int V, int H, int D,
                                        cudaStream_t stream) {
  DSPARK_CHECK(V > 0 && H > 0 && D > 0, "lm_head_through_projection: V ", V, ", H ", H, ", D ", D);
  const dim3 grid(ceil_div(D, kThroughTile), ceil_div(V, kThroughTile));
  lm_head_through_projection_kernel<<<grid, 256, 0, stream>>>(out, lm_head, projection, V, H, D);
  CUDA_CHECK_LAUNCH();
}

void largest_row_norm_forward(unsigned* largest, const bf16* weight, int row_count, int row_length,
                              cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(largest, 0, sizeof(unsigned), stream));
  largest_row_norm_kernel<<<row_count, kQuantizeThreads, 0, stream>>>(largest, weight, row_length);
  CUDA_CHECK_LAUNCH();
}

static size_t reach_shared_bytes(int rows, int D) {
  return sizeof(double) * (size_t(rows) * D + size_t(kReachWarps) * rows * kReachOutputs);
}

bool lm_head_projection_reach_supported(int D, int H) {
  return D % 8 == 0 && H % kReachOutputs == 0 &&
         reach_shared_bytes(kQuantizedActivationRows, D) <= size_t(max_shared_bytes() - 1024);
}

void lm_head_projection_reach_forward(const QuantizedActivations& out, const bf16* x, const bf16* projection,
                                      const bf16* y, int rows, int D, int H, const unsigned* lm_row_norm, double* sums,
                                      unsigned* finished, cudaStream_t stream) {
  const size_t bytes = reach_shared_bytes(rows, D);
  DSPARK_CHECK(rows >= 1 && rows <= kQuantizedActivationRows && lm_head_projection_reach_supported(D, H),
               "lm_head_projection_reach: ", rows, " rows (1..", kQuantizedActivationRows, ") of ", D,
               " (a multiple of 8), H ", H, " (a multiple of 32)");
  static const bool opted_in = [] {
    CUDA_CHECK(cudaFuncSetAttribute(lm_head_projection_reach_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    max_shared_bytes() - 1024));  // less its static shared memory
    return true;
  }();
  (void)opted_in;
  launch_dependent(lm_head_projection_reach_kernel, H / kReachOutputs, kReachWarps * 32, bytes, stream, out, x,
                   projection, y, rows, D, H, lm_row_norm, sums, finished);
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
  // Groups of 16 rows a block: enough chunks a warp to load kProductEarly before the wait.
  const int chunks = ceil_div(row_length, kProductChunk);
  const int groups = chunks <= kProductWarps ? 4 : chunks <= 2 * kProductWarps ? 2 : 1;
  const auto kernel = groups == 4   ? quantized_rows_product_kernel<4>
                      : groups == 2 ? quantized_rows_product_kernel<2>
                                    : quantized_rows_product_kernel<1>;
  launch_dependent(kernel, ceil_div(row_count, 16 * groups), kProductWarps * 32, 0, stream, centers, weight, x, rows,
                   row_length, row_count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
