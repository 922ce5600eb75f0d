#include <cublasLt.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/cuda/activation.h"
#include "kernels/cuda/buffer.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/in_out_product.cuh"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/tensor_gemv.cuh"
#include "kernels/cuda/tma.cuh"

namespace dspark::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

// How one shape runs (MatmulContext::choose): cuBLASLt (plus the separate
// activation or norm kernel its epilogue needs), or a GEMV (on the CUDA cores
// with 1 or 4 output features per warp, or on the tensor cores) with the
// epilogue fused in or, where that is slower (the fused norm runs in one
// block: at 8 rows it costs more than its launch saves), followed by it.
struct MatmulPath {
  GemvKernel gemv = GemvKernel::None;  // None: cuBLASLt
  bool fused = true;                   // GEMV: the epilogue in the kernel, or the plain product then its kernel
};

// What a product does with its sums:
//  Store: out = the product (+ bias);
//  Silu, GeluTanh: out = act(gate) * up, the weight being gate|up
//    [2 * out_features, in]: the GEMV sums feature f's gate row and up row in
//    one warp; cuBLASLt writes gate|up to scratch for the activation kernel.
//    Gate and up are rounded to bf16 before the activation either way;
//  ResidualNorm: Store, then residual_add_rmsnorm_forward on the product: in
//    the GEMV, by the grid's last block to finish.
using Epilogue = GemvEpilogue;

// (row class: choice_rows, in, out, output type, bias, epilogue, kernels allowed): a shape's choice of MatmulPath.
using PathKey = std::tuple<int, int, int, MatmulOutput, bool, int, FewRowKernels>;

struct Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t weight_layout = nullptr, x_layout = nullptr, out_layout = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
};

// Few rows (decode, short verify blocks): a weight-streaming GEMV. One warp
// per output feature; each lane loads 16 bytes of the weight row and the
// matching 16 bytes of every activation row per step, eight steps in flight.
// Activations are read straight from global memory (L1 serves the block's
// other warps): staging them in shared memory first put a latency chain in
// front of every block. cuBLASLt still wins some shapes, so each shape is
// timed every way once and the fastest kept (MatmulContext::choose below).
constexpr int kGemvMaxRows = 8;
constexpr int kGemvWarps = 8;
static_assert(kGemvWarps * 32 == kResidualNormThreads, "the GEMV's last block runs the norm's row code");

template <Epilogue EPILOGUE>
__device__ __forceinline__ float gated(float gate, float up) {
  if constexpr (EPILOGUE == Epilogue::Silu) return gate / (1.0f + __expf(-gate)) * up;  // as swiglu_forward
  return gelu_tanh(gate) * up;                                                         // as gelu_tanh_gate_forward
}

template <int VECTORS>
__device__ void residual_norm_rows(const ResidualNorm& norm, const bf16* delta, int rows, int dim, float* scratch) {
  for (int r = 0; r < rows; ++r)
    residual_add_rmsnorm_row<VECTORS>(norm.residual + long(r) * dim, delta + long(r) * dim,
                                      norm.normed + long(r) * dim, norm.weight, dim, norm.eps,
                                      norm.residual_tap ? norm.residual_tap + r * norm.tap_stride : nullptr,
                                      norm.normed_tap ? norm.normed_tap + r * norm.tap_stride : nullptr, scratch);
}

// The ResidualNorm epilogue, after a block has written its part of `delta`:
// the grid's last block to finish adds every row into the residual stream and
// norms it (every block must call this).
__device__ void finish_residual_norm(const ResidualNorm& norm, const bf16* delta, int rows, int dim, int vectors) {
  __shared__ float scratch[32];
  if (!took_last_ticket(norm.counter, gridDim.x * gridDim.y)) return;
  switch (vectors) {
    case 1: residual_norm_rows<1>(norm, delta, rows, dim, scratch); break;
    case 2: residual_norm_rows<2>(norm, delta, rows, dim, scratch); break;
    case 4: residual_norm_rows<4>(norm, delta, rows, dim, scratch); break;
    default: residual_norm_rows<8>(norm, delta, rows, dim, scratch); break;
  }
  if (threadIdx.x == 0) *norm.counter = 0;  // ready for the next launch
}

// FEATURES output features per warp: each activation load then serves
// FEATURES weight rows instead of one. With many rows the one-feature GEMV
// spends its time re-reading the activations from L1, ROWS times the bytes of
// the weight stream (the drafter's LM head: 7 block rows x 151936 features,
// 654 us for 1.2 GB of weights at batch 1); four features cut that to a
// quarter. A feature's sum is accumulated in the same order either way (lane
// by lane over k, then the warp sum). A gated EPILOGUE doubles the weight
// rows per warp (each feature's gate row and up row). residual_norm_vectors:
// the norm's float4s per thread (residual_norm_vectors() of rmsnorm.cuh).
template <int ROWS, int FEATURES, Epilogue EPILOGUE>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in,
                int out_features, ResidualNorm norm, int residual_norm_vectors) {
  constexpr bool kGated = EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh;
  constexpr int kWeightRows = kGated ? 2 * FEATURES : FEATURES;
  wait_for_previous_kernel();
  start_next_kernel();
  const int lane = threadIdx.x & 31;
  const int first_feature = (blockIdx.x * kGemvWarps + (threadIdx.x >> 5)) * FEATURES;
  const int features = min(FEATURES, out_features - first_feature);  // the same for the whole warp
  if (features > 0) {  // (not returning: ResidualNorm's blocks all reach the count below)
    // Weight row j: feature first_feature + j % FEATURES, its up row for j >= FEATURES when gated.
    const bf16* rows[kWeightRows];
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j)
      rows[j] = weight + (static_cast<long>(first_feature + j % FEATURES) + (j >= FEATURES ? out_features : 0)) * in;
    float sums[ROWS][kWeightRows] = {};
#pragma unroll(FEATURES == 1 && !kGated ? 8 : 2)
    for (int k = lane * 8; k < in; k += 32 * 8) {
      uint4 packed[kWeightRows];
#pragma unroll
      for (int j = 0; j < kWeightRows; ++j)  // streamed once: keep it out of L1
        packed[j] = FEATURES == 1 || j % FEATURES < features
                        ? __ldcs(reinterpret_cast<const uint4*>(rows[j] + k))
                        : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const uint4 activation = __ldg(reinterpret_cast<const uint4*>(x + static_cast<long>(r) * in + k));
        const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&activation);
        float2 input[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) input[i] = __bfloat1622float2(a[i]);
#pragma unroll
        for (int j = 0; j < kWeightRows; ++j) {
          const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed[j]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 wf = __bfloat1622float2(w[i]);
            sums[r][j] += wf.x * input[i].x + wf.y * input[i].y;
          }
        }
      }
    }
#pragma unroll
    for (int f = 0; f < FEATURES; ++f) {
      if (f >= features) break;  // uniform across the warp: the shuffles below stay converged
      const int feature = first_feature + f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float total = warp_sum(sums[r][f]);
        if (bias) total += __bfloat162float(bias[feature]);
        const long index = static_cast<long>(r) * out_features + feature;
        if constexpr (kGated) {
          float up = warp_sum(sums[r][FEATURES + f]);
          if (bias) up += __bfloat162float(bias[out_features + feature]);
          const float gate_rounded = __bfloat162float(__float2bfloat16(total));
          const float up_rounded = __bfloat162float(__float2bfloat16(up));
          if (lane == 0) static_cast<bf16*>(out)[index] = __float2bfloat16(gated<EPILOGUE>(gate_rounded, up_rounded));
        } else if (lane == 0) {
          if (out_f32)
            static_cast<float*>(out)[index] = total;
          else
            static_cast<bf16*>(out)[index] = __float2bfloat16(total);
        }
      }
    }
  }
  if constexpr (EPILOGUE == Epilogue::ResidualNorm)
    finish_residual_norm(norm, static_cast<const bf16*>(out), ROWS, out_features, residual_norm_vectors);
}

template <int ROWS, Epilogue EPILOGUE>
void launch_gemv(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in, int out_features,
                 int features_per_warp, const ResidualNorm& norm, cudaStream_t stream) {
  const int vectors = EPILOGUE == Epilogue::ResidualNorm ? residual_norm_vectors(out_features, norm.tap_stride) : 0;
  if (features_per_warp == 4)
    launch_dependent(gemv_kernel<ROWS, 4, EPILOGUE>, ceil_div(out_features, kGemvWarps * 4), kGemvWarps * 32, 0, stream,
                     out, out_f32, x, weight, bias, in, out_features, norm, vectors);
  else
    launch_dependent(gemv_kernel<ROWS, 1, EPILOGUE>, ceil_div(out_features, kGemvWarps), kGemvWarps * 32, 0, stream,
                     out, out_f32, x, weight, bias, in, out_features, norm, vectors);
  CUDA_CHECK_LAUNCH();
}

// Up to 64 rows on the tensor cores: mma.sync m16n8k16 (bf16 operands, f32
// accumulation) with 16 weight rows as the A operand and the activation rows
// as its n columns (1, 2, 4 or 8 n tiles of 8 rows). The CUDA-core GEMV spends an
// FMA and a conversion per weight, row and element and runs out of issue
// slots from a few rows (verify blocks); here the rows cost tensor-core
// cycles, which are plentiful, and the kernel stays bound by the weight stream.
// A block owns 16 weight rows: 16 output features, or, gated, 8 features'
// gate rows and their 8 up rows (fragment rows g and g + 8 of lane (g, c) =
// (lane / 4, lane % 4), so one lane holds a feature's gate and up sums). Its
// kMmaWarps warps split K in chunks of kMmaChunk and meet in shared memory.
// In a chunk at k, lane (g, c) loads 32 bytes of weight rows g and g + 8 and
// of activation row g at k + 16c, as two 16-byte pieces (tensor_gemv.cuh,
// shared with the Markov head's tokens-only kernel). Chunks of 64 put 128
// contiguous bytes of a weight row in each warp load (chunks of 32: 64 bytes,
// and the 8B decode step 12% slower in a graph;
// 128: 45% slower). The loop is unrolled kMmaStepsInFlight chunks deep, so a
// warp has that many chunks' loads in flight (4: the 8B step 1-4% and the
// 1.7B step 5% faster than 2; unrolling keeps each sum's order, and so its
// bits). This is the target's kernel for every step of up to
// kRowInvariantRows rows, so the chunk fixes the order of its sums: changing it
// changes bits. A row's sums do not depend on the other rows of its tiles, so
// a launch may also split its rows into groups of TILES * 8, a group per grid
// row (blockIdx.y): more blocks, each with fewer tiles (tensor_gemv_forward's
// row_groups).
constexpr int kMmaStepsInFlight = 4;
// Per count of 8-row activation tiles: the chunks a warp loads before the
// dependency wait, and the blocks per SM ptxas is told to fit
// (__launch_bounds__). Both measured together (PERF.md, stop 22): without a
// minimum ptxas allocates fewer registers and the 1-row decode step gained
// 1% instead of 3%; early loads at 4 tiles and more, or more than one at 2,
// made the verify step slower. Four tiles (17-32 rows) at two blocks an SM,
// not three: 128 registers and no spills, where three spilled 48-56 bytes;
// on the H100 the x16 gate|up at 32 rows 195 us against 218 (and cuBLASLt's
// 193 + its separate SwiGLU), its LM head 38 against 53, and x16 batch 4's
// speed-up 3.059 against 2.972 (64 prompts; PERF.md, stops 53 and 55).
template <int TILES>
constexpr int kMmaEarlySteps = TILES == 1   ? 4
                               : TILES == 2 ? 1
                                            : 0;
template <int TILES>
constexpr int kMmaMinBlocks = TILES == 1   ? 1
                              : TILES == 2 ? 3
                              : TILES == 4 ? 2
                                           : 2;
// FEW_WAVES, one row tile: the kernel above fits two blocks per SM (110
// registers), so a product of more than one and up to kMmaFewWavesMost
// waves of them (the 8B q|k|v: 384 blocks on 132 SMs, 1.45 waves; the 1.7B
// gate|up: 2.9) runs three per SM instead, in fewer, fuller waves; its 80
// registers hold two early chunks (four spill). 8B and 1.7B decode 1.5-2%
// faster; the 8B gate|up (5.8 waves) was slower so (PERF.md, stop 23).
constexpr int kMmaFewWavesMost = 6;
constexpr int kMmaFewWavesMinBlocks = 3;
constexpr int kMmaFewWavesEarlySteps = 2;
constexpr int kMmaMaxRows = 64;

// The row count a shape's one-time choices are made for: its own up to
// kRowInvariantRows (decode and short verify steps, whose rows keep their
// bits), else its class (17-32, 33-48, 49-64, then each power of two). A
// verify forward that carries a newly admitted prompt has a row count of its
// own nearly every time (the prompt's length plus the verified drafts), and
// each new count timed every candidate path and asked cuBLASLt's heuristic
// again: on the H100 such rounds took 1.0 ms at batch 8 (up to 6 ms) against
// 0.36 ms for the same admission beside undrafted rows, whose counts recur.
int choice_rows(int rows) {
  if (rows <= kRowInvariantRows) return rows;
  if (rows <= kMmaMaxRows) return (rows + 15) / 16 * 16;
  int rows_class = 2 * kMmaMaxRows;
  while (rows_class < rows) rows_class *= 2;
  return rows_class;
}

// Stores activation row `row`'s sums of a 16-row weight group's fragment rows
// g (low_sum) and g + 8 (high_sum), bias added: gated, feature `low`'s gate
// and up sums, activated (each rounded to bf16 first, as the unfused path's
// gate|up buffer is); else features `low` and `high`. Features past
// out_features are not stored.
template <Epilogue EPILOGUE>
__device__ __forceinline__ void store_group_sums(void* out, bool out_f32, const bf16* bias, int row, int out_features,
                                                 int low, int high, float low_sum, float high_sum) {
  if constexpr (EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh) {
    if (low >= out_features) return;
    if (bias) {
      low_sum += __bfloat162float(bias[low]);
      high_sum += __bfloat162float(bias[out_features + low]);
    }
    const float gate = __bfloat162float(__float2bfloat16(low_sum));
    const float up = __bfloat162float(__float2bfloat16(high_sum));
    static_cast<bf16*>(out)[static_cast<long>(row) * out_features + low] = __float2bfloat16(gated<EPILOGUE>(gate, up));
  } else {
    auto store = [&](int feature, float total) {
      if (feature >= out_features) return;
      if (bias) total += __bfloat162float(bias[feature]);
      const long index = static_cast<long>(row) * out_features + feature;
      if (out_f32)
        static_cast<float*>(out)[index] = total;
      else
        static_cast<bf16*>(out)[index] = __float2bfloat16(total);
    };
    store(low, low_sum);
    store(high, high_sum);
  }
}

template <int TILES, Epilogue EPILOGUE, bool FEW_WAVES = false>
__global__ void __launch_bounds__(kMmaWarps * 32, FEW_WAVES ? kMmaFewWavesMinBlocks : kMmaMinBlocks<TILES>)
    tensor_gemv_kernel(void* all_out, bool out_f32, const bf16* all_x, const bf16* weight, const bf16* bias,
                       int all_rows, int in, int out_features, ResidualNorm norm, int residual_norm_vectors) {
  constexpr bool kGated = EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  // This block's row group (all the rows unless the launch splits them).
  const long first_row = static_cast<long>(blockIdx.y) * TILES * 8;
  const int rows = min(all_rows - static_cast<int>(first_row), TILES * 8);
  const bf16* x = all_x + first_row * in;
  void* out = out_f32 ? static_cast<void*>(static_cast<float*>(all_out) + first_row * out_features)
                      : static_cast<void*>(static_cast<bf16*>(all_out) + first_row * out_features);
  // Fragment rows g and g + 8: output features (gated: feature g's gate and up rows).
  const int first = blockIdx.x * (kGated ? 8 : 16);
  const int low = first + g, high = kGated ? first + g : first + g + 8;
  const bool low_valid = low < out_features, high_valid = high < out_features;
  const bf16* low_row = weight + static_cast<long>(low_valid ? low : 0) * in;
  const bf16* high_row = weight + (static_cast<long>(high_valid ? high : 0) + (kGated ? out_features : 0)) * in;
  const bf16* x_rows[TILES];
#pragma unroll
  for (int t = 0; t < TILES; ++t) x_rows[t] = x + static_cast<long>(min(t * 8 + g, rows - 1)) * in;
  float sums[TILES][4] = {};
  constexpr int kStride = kMmaWarps * kMmaChunk;
  auto load_weights = [&](int k, uint4(&a_low)[kMmaPieces], uint4(&a_high)[kMmaPieces]) {
    tensor_gemv_load(a_low, a_high, low_row, high_row, low_valid, high_valid, k, c, in);
  };
  auto multiply = [&](int k, const uint4(&a_low)[kMmaPieces], const uint4(&a_high)[kMmaPieces]) {
    tensor_gemv_multiply(sums, a_low, a_high, x_rows, k, c, in);  // rows past `rows` repeat the last: never stored
  };
  // The weights are never written, so a warp's first chunks are loaded
  // before the wait: under programmatic launch they stream in while the
  // previous kernel finishes (its last blocks, its norm tail, a layer's
  // attention), which otherwise leaves HBM idle. The same sums in the same
  // order: the same bits.
  constexpr int kEarlySteps = FEW_WAVES ? kMmaFewWavesEarlySteps : kMmaEarlySteps<TILES>;
  const int first_k = warp * kMmaChunk;
  uint4 early_low[kEarlySteps + 1][kMmaPieces], early_high[kEarlySteps + 1][kMmaPieces];  // (+1: no empty arrays)
#pragma unroll
  for (int step = 0; step < kEarlySteps; ++step)
    if (first_k + step * kStride < in) load_weights(first_k + step * kStride, early_low[step], early_high[step]);
  wait_for_previous_kernel();
  start_next_kernel();
#pragma unroll
  for (int step = 0; step < kEarlySteps; ++step)
    if (first_k + step * kStride < in) multiply(first_k + step * kStride, early_low[step], early_high[step]);
#pragma unroll(kMmaStepsInFlight)
  for (int k = first_k + kEarlySteps * kStride; k < in; k += kStride) {
    uint4 a_low[kMmaPieces], a_high[kMmaPieces];
    load_weights(k, a_low, a_high);
    multiply(k, a_low, a_high);
  }
  __shared__ float partial[kMmaWarps][TILES][4][32];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][t][i][lane] = sums[t][i];
  __syncthreads();
  // Lane (g, c) holds fragment rows g (i = 0, 1) and g + 8 (i = 2, 3) for
  // columns 2c and 2c + 1. The (tile, column j) pairs are dealt out one per
  // warp, not all to warp 0: a 16-row product's four pairs (a 32-row one's
  // eight) read and store in parallel, so the block frees its slot sooner;
  // each pair still adds the warps' partials in warp order (the same bits).
  for (int pair = warp; pair < TILES * 2; pair += kMmaWarps) {
    const int t = pair / 2, j = pair % 2;
    const int row = t * 8 + 2 * c + j;
    if (row >= rows) continue;
    float low_sum = 0.0f, high_sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) low_sum += partial[w][t][j][lane], high_sum += partial[w][t][2 + j][lane];
    store_group_sums<EPILOGUE>(out, out_f32, bias, row, out_features, low, high, low_sum, high_sum);
  }
  if constexpr (EPILOGUE == Epilogue::ResidualNorm)
    finish_residual_norm(norm, static_cast<const bf16*>(all_out), all_rows, out_features, residual_norm_vectors);
}

// few_waves: a product of one row tile and more than one wave may take the
// FEW_WAVES kernel. row_groups: rows past 16 run as groups of 16 on the
// two-tile kernel, a grid row each, instead of on the four- or eight-tile
// kernel: where one group's blocks leave most multiprocessors idle (the demo
// target's 24-176 blocks on 132) the groups cost a second read of the
// weights from L2, and each block is the shorter two-tile one, which loads
// its first weights before the previous kernel ends (kMmaEarlySteps).
template <Epilogue EPILOGUE>
void tensor_gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias,
                         int rows, int in, int out_features, const ResidualNorm& norm, bool few_waves, bool row_groups,
                         cudaStream_t stream) {
  constexpr bool kGated = EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh;
  const int vectors = EPILOGUE == Epilogue::ResidualNorm ? residual_norm_vectors(out_features, norm.tap_stride) : 0;
  const int blocks = ceil_div(out_features, kGated ? 8 : 16);
  const bool f32 = out_type == MatmulOutput::F32;
  row_groups = row_groups && rows > 16;
  auto kernel = rows <= 8                  ? tensor_gemv_kernel<1, EPILOGUE>
                : rows <= 16 || row_groups ? tensor_gemv_kernel<2, EPILOGUE>
                : rows <= 32               ? tensor_gemv_kernel<4, EPILOGUE>
                                           : tensor_gemv_kernel<8, EPILOGUE>;
  static const int multiprocessors = multiprocessor_count();
  if (few_waves && rows <= 8 && blocks > 2 * multiprocessors && blocks <= kMmaFewWavesMost * multiprocessors)
    kernel = tensor_gemv_kernel<1, EPILOGUE, true>;
  const dim3 grid(blocks, row_groups ? ceil_div(rows, 16) : 1);
  launch_dependent(kernel, grid, kMmaWarps * 32, 0, stream, out, f32, x, weight, bias, rows, in, out_features, norm,
                   vectors);
  CUDA_CHECK_LAUNCH();
}

// ---- the streamed GEMV: 17-32 rows, one block an SM ----
//
// At 17-32 rows the products above stream the weights at 78-92% of the read
// roofline (PERF.md, stops 50-60), and cuBLASLt's, the fastest of them on
// most shapes, round differently from the tensor-core GEMV that decodes one
// to sixteen rows, so that a batch's verify drifts from plain decoding
// through bf16 near-ties. Here each block owns a contiguous run of at most
// kStreamMostGroups of the product's 16-row weight groups (gated: 8 features'
// gate rows and their up rows), the runs as even as whole groups allow, so
// that every SM streams the same bytes. The TMA copies each K chunk of the
// block's weight rows (one copy; gated two: its gate rows and its up rows)
// and of the activations (one copy of kStreamTiles * 8 rows) into a ring of
// slots in shared memory, without registers, several slots ahead of the
// warps. A chunk is an odd number of K boxes of 64 columns, as many as make a
// weight copy >= kStreamCopyBytes: the TMA's rate follows the bytes a copy
// carries (one block an SM on the H100: 1 KB copies 17% of the read roofline,
// 8 KB 80%, 32 KB 96%; PERF.md stop 60). The warps split K as the tensor-core
// GEMV's do, warp w taking the K boxes at w * 64 + i * 512 for all the
// block's groups, each box's pieces in that kernel's order, and their sums
// meet as that kernel's do: every output has the bits the tensor-core GEMV
// gives it, whatever the row count (the GEMV test). The ring's refills are
// issued by one thread of the last warp once every warp has released the slot.
constexpr int kStreamWarps = kMmaWarps;
constexpr int kStreamProducer = (kStreamWarps - 1) * 32;
constexpr int kStreamMaxStages = 8;
constexpr int kStreamTiles = 4;               // activation rows: 17-32
constexpr int kStreamMostGroups = 8;          // a block's groups: their sums' registers, kStreamTiles * 4 each
constexpr int kStreamBoxColumns = kMmaChunk;  // a box row: 128 bytes, the swizzle's span; one warp's chunk
constexpr int kStreamRowBytes = kStreamBoxColumns * 2;
constexpr int kStreamCopyBytes = 12 * 1024;  // at least this many bytes a weight copy where K and the ring allow
constexpr int kStreamMinStages = 3;
static_assert(kStreamWarps * 32 == kResidualNormThreads, "the last block runs the norm's row code");

// The ring's budget: 200 KB, or less where a block may opt in to less (227 KB
// on the H100 and H200), leaving room for the 1 KB alignment and the static
// barriers.
int streamed_shared_bytes() {
  static const int bytes = std::min(200 * 1024, max_shared_bytes() - 2048);
  return bytes;
}

struct StreamedShape {
  int groups = 0;       // 16-row weight groups (gated: 8 features' gate and up rows) in all
  int most_groups = 0;  // the most a block owns (the others own one fewer): the slot's layout
  int chunk_boxes = 0;  // K boxes of kStreamBoxColumns a chunk, a copy: odd (the banks), 1 where in % 64 != 0
  int chunks = 0;       // K chunks: ceil(in / (chunk_boxes * kStreamBoxColumns))
  int stages = 0;       // slots in the ring
  int in = 0;
  // A slot holds lines of 128 bytes (64 columns): the block's weight rows,
  // 16 * most_groups (its groups' rows in order; gated, its gate rows then its
  // up rows), each row's chunk_boxes K boxes in a row (row r, K box b: line
  // r * chunk_boxes + b, as the copies lay out their boxes); then the
  // activations' kStreamTiles * 8 rows the same way. A lane reads 16 bytes of
  // rows g and g + 8: with an odd chunk_boxes, rows g and g + 1 (a quarter
  // warp's) sit on lines of different parity, whose swizzles put their pieces
  // in different banks.
  __host__ __device__ int slot_weight_bytes() const { return chunk_boxes * 16 * most_groups * kStreamRowBytes; }
  __host__ __device__ int slot_bytes() const {
    return slot_weight_bytes() + chunk_boxes * kStreamTiles * 8 * kStreamRowBytes;
  }
};

// The warps' sums of `groups` groups, [warp][group][tile][4][lane], meet in
// the ring's memory once it is drained.
constexpr int stream_partial_bytes(int groups) { return kStreamWarps * groups * kStreamTiles * 4 * 32 * sizeof(float); }
static_assert(stream_partial_bytes(kStreamMostGroups) <= 200 * 1024, "the warps' sums fit the ring's memory");

// The streamed GEMV's blocks for a product of `groups` groups (one an SM, at
// most one a group), and the most groups one of them owns.
int streamed_blocks(int groups) {
  static const int multiprocessors = multiprocessor_count();
  return std::min(groups, multiprocessors);
}
int streamed_most_groups(int groups) { return ceil_div(groups, streamed_blocks(groups)); }

template <int GROUPS, Epilogue EPILOGUE>
__global__ void __launch_bounds__(kStreamWarps * 32, 1)
    streamed_gemv_kernel(const __grid_constant__ CUtensorMap most_map, const __grid_constant__ CUtensorMap fewer_map,
                         const __grid_constant__ CUtensorMap x_map, void* out, bool out_f32, const bf16* bias, int rows,
                         int out_features, StreamedShape shape, ResidualNorm norm, int residual_norm_vectors) {
  constexpr bool kGated = EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh;
  constexpr int TILES = kStreamTiles;
  constexpr int kTileBytes = TILES * 8 * kStreamRowBytes;  // an activation box
  constexpr int kCopies = kGated ? 2 : 1;                  // weight copies a chunk
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int first_group = static_cast<int>(long(blockIdx.x) * shape.groups / gridDim.x);
  const int groups = static_cast<int>(long(blockIdx.x + 1) * shape.groups / gridDim.x) - first_group;
  extern __shared__ uint8_t dynamic_shared[];
  uint8_t* const ring = dynamic_shared + ((1024 - shared_address(dynamic_shared) % 1024) % 1024);
  __shared__ uint64_t full[kStreamMaxStages], empty[kStreamMaxStages];
  const int slot_bytes = shape.slot_bytes(), weight_bytes = shape.slot_weight_bytes();

  // The block's weight rows: one copy of its 16 * groups rows, or gated two of
  // 8 * groups, its gate rows (h = 0) and its up rows (weight maps of
  // most_groups and of one fewer). Rows past the weight's arrive as zeros.
  const CUtensorMap* weight_map = groups == shape.most_groups ? &most_map : &fewer_map;
  const int copy_bytes = (kGated ? 8 : 16) * groups * shape.chunk_boxes * kStreamRowBytes;
  auto copy_row = [&](int h) { return kGated ? h * out_features + first_group * 8 : first_group * 16; };
  // Group j's fragment rows g (low) and g + 8 (high) among the slot's weight
  // rows: gated, its features' gate and up rows; else its 16 rows in order.
  auto group_row = [&](int j, int high) { return kGated ? high * groups * 8 + j * 8 : j * 16 + high * 8; };
  auto boxes_in = [&](int chunk) {  // the K boxes of a chunk that hold columns of K (the last may hold fewer)
    const int columns = shape.in - chunk * shape.chunk_boxes * kStreamBoxColumns;
    return min(shape.chunk_boxes, (columns + kStreamBoxColumns - 1) / kStreamBoxColumns);
  };
  // Where in is a multiple of 64 the maps' middle dimension counts K boxes
  // (a copy takes chunk_boxes of them); else it is 1 and the innermost spans
  // K (a copy takes one K box, its columns past K zero-filled).
  const bool boxes_dimension = shape.in % kStreamBoxColumns == 0;
  auto load = [&](uint8_t* destination, const CUtensorMap* map, int row, int chunk) {
    const int box = chunk * shape.chunk_boxes;
    tma_load_box(destination, map, boxes_dimension ? 0 : box * kStreamBoxColumns, boxes_dimension ? box : 0, row,
                 &full[chunk % shape.stages]);
  };
  auto slot_of = [&](int chunk) { return ring + (chunk % shape.stages) * slot_bytes; };
  // Every copy's bytes count in full, its zero-filled K boxes past K included.
  auto load_weights = [&](int chunk) {
    barrier_arrive_expecting(&full[chunk % shape.stages], kCopies * copy_bytes + kTileBytes * shape.chunk_boxes);
    for (int h = 0; h < kCopies; ++h) load(slot_of(chunk) + h * copy_bytes, weight_map, copy_row(h), chunk);
  };
  auto load_activations = [&](int chunk) { load(slot_of(chunk) + weight_bytes, &x_map, 0, chunk); };

  if (threadIdx.x == kStreamProducer) {
    for (int s = 0; s < shape.stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], kStreamWarps);
    barrier_init_fence();
  }
  __syncthreads();
  // The weights are never written: the first slots' weights stream in while
  // the previous kernel finishes; the activations only after its writes.
  const int preloaded = min(shape.stages, shape.chunks);
  if (threadIdx.x == kStreamProducer)
    for (int chunk = 0; chunk < preloaded; ++chunk) load_weights(chunk);
  wait_for_previous_kernel();
  start_next_kernel();
  if (threadIdx.x == kStreamProducer)
    for (int chunk = 0; chunk < preloaded; ++chunk) load_activations(chunk);

  // Lane (g, c) reads pieces 2c and 2c + 1 (16 bytes each) of a box's rows, as
  // tensor_gemv_load and tensor_gemv_multiply read a chunk's.
  float sums[GROUPS][TILES][4] = {};
  for (int chunk = 0; chunk < shape.chunks; ++chunk) {
    const int stage = chunk % shape.stages;
    const uint32_t parity = (chunk / shape.stages) & 1;
    barrier_wait(&full[stage], parity);
    const uint32_t weights = shared_address(slot_of(chunk)), activations = weights + weight_bytes;
    const int lines = shape.chunk_boxes, boxes = boxes_in(chunk);
    // This warp's K boxes of the chunk: those at k = warp * 64 + i * 512, in increasing k.
    for (int b = (warp - chunk * lines % kStreamWarps + kStreamWarps) % kStreamWarps; b < boxes; b += kStreamWarps) {
      uint4 x_pieces[TILES][kMmaPieces];
#pragma unroll
      for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int piece = 0; piece < kMmaPieces; ++piece)
          x_pieces[t][piece] = load_shared_16(activations + swizzled_offset((t * 8 + g) * lines + b, 2 * c + piece));
#pragma unroll
      for (int j = 0; j < GROUPS; ++j) {
        if (j >= groups) break;
        uint4 a_low[kMmaPieces], a_high[kMmaPieces];
#pragma unroll
        for (int piece = 0; piece < kMmaPieces; ++piece) {
          a_low[piece] = load_shared_16(weights + swizzled_offset((group_row(j, 0) + g) * lines + b, 2 * c + piece));
          a_high[piece] = load_shared_16(weights + swizzled_offset((group_row(j, 1) + g) * lines + b, 2 * c + piece));
        }
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
          for (int piece = 0; piece < kMmaPieces; ++piece)
            tensor_gemv_multiply_piece(sums[j][t], a_low[piece], a_high[piece], x_pieces[t][piece]);
      }
    }
    __syncwarp();
    if (lane == 0) barrier_arrive(&empty[stage]);
    if (threadIdx.x == kStreamProducer && chunk + shape.stages < shape.chunks) {
      barrier_wait(&empty[stage], parity);  // every warp is done with the slot
      load_weights(chunk + shape.stages);
      load_activations(chunk + shape.stages);
    }
    __syncwarp();
  }

  // The warps' sums meet in warp order from 0.0f, as the tensor-core GEMV's
  // do, in the drained ring (every copy issued has landed: each was waited on).
  __syncthreads();
  float* const partial = reinterpret_cast<float*>(ring);
  auto partial_of = [&](int w, int j, int t, int i) { return partial + (((w * GROUPS + j) * TILES + t) * 4 + i) * 32; };
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) {
    if (j >= groups) break;
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial_of(warp, j, t, i)[lane] = sums[j][t][i];
  }
  __syncthreads();
  // Lane (g, c) holds fragment rows g (i = 0, 1) and g + 8 (i = 2, 3) of each
  // group for activation rows t * 8 + 2c and + 1: the (group, tile, column)
  // triples are dealt out one per warp.
  for (int item = warp; item < groups * TILES * 2; item += kStreamWarps) {
    const int j = item / (TILES * 2), t = item / 2 % TILES, column = item % 2;
    const int row = t * 8 + 2 * c + column;
    if (row >= rows) continue;
    float low_sum = 0.0f, high_sum = 0.0f;
    for (int w = 0; w < kStreamWarps; ++w)
      low_sum += partial_of(w, j, t, column)[lane], high_sum += partial_of(w, j, t, 2 + column)[lane];
    // Group j's features (gated: its 8; else its 16, rows g and g + 8 here).
    const int low = (first_group + j) * (kGated ? 8 : 16) + g;
    store_group_sums<EPILOGUE>(out, out_f32, bias, row, out_features, low, low + 8, low_sum, high_sum);
  }
  if constexpr (EPILOGUE == Epilogue::ResidualNorm)
    finish_residual_norm(norm, static_cast<const bf16*>(out), rows, out_features, residual_norm_vectors);
}

// A tensor map of a row-major bf16 [rows, columns] matrix, copied in boxes
// of box_rows rows x `boxes` K boxes of box_columns columns, swizzled by 128
// bytes where a box row is 128 bytes (else not: tma_read_kernel's wider
// boxes). Where box_columns divides the columns, the map is three-dimensional
// (box_columns, columns / box_columns, rows), so that one copy takes several
// K boxes (coordinates: 0, the first K box, the first row); else it is
// (columns, 1, rows), a copy takes one K box and zero-fills it past the
// columns (coordinates: the first column, 0, the first row). Kept per
// (address, shape), so a step replayed eagerly encodes its products' maps once.
CUtensorMap tensor_map(const bf16* base, int rows, int columns, int box_rows, int box_columns, int boxes) {
  static const auto encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    DSPARK_CHECK(found == cudaDriverEntryPointSuccess && function, "the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  static std::mutex mutex;
  static std::map<std::tuple<const bf16*, int, int, int, int, int>, CUtensorMap> maps;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(base, rows, columns, box_rows, box_columns, boxes);
  if (auto found = maps.find(key); found != maps.end()) return found->second;
  const bool boxes_dimension = columns % box_columns == 0;
  DSPARK_CHECK(boxes_dimension || boxes == 1, "a tensor map of ", columns, " columns takes one box of ", box_columns,
               " a copy");
  const cuuint64_t row_bytes = cuuint64_t(columns) * sizeof(bf16);
  const cuuint64_t dimensions[3] = {cuuint64_t(boxes_dimension ? box_columns : columns),
                                    cuuint64_t(boxes_dimension ? columns / box_columns : 1), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {boxes_dimension ? box_columns * sizeof(bf16) : row_bytes, row_bytes};
  const cuuint32_t box[3] = {cuuint32_t(box_columns), cuuint32_t(boxes), cuuint32_t(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map{};
  const CUresult result =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(base), dimensions, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             box_columns == kStreamBoxColumns ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DSPARK_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (", int(result), ") for a ", rows, " x ", columns,
               " bf16 tensor in boxes of ", box_rows, " x ", boxes, " x ", box_columns);
  return maps.emplace(key, map).first->second;
}

// Whether the streamed GEMV can run a product of a weight of weight_rows rows
// (gated: its gate and up rows): 17-32 rows, at most kStreamMostGroups groups
// a block, rows of 16-byte multiples (the TMA's strides; the forward also
// checks that x and the weight start 16-byte aligned).
bool streamed_gemv_fits(int rows, int in, int weight_rows) {
  return rows > 16 && rows <= kStreamTiles * 8 && in % 8 == 0 &&
         streamed_most_groups(ceil_div(weight_rows, 16)) <= kStreamMostGroups;
}

template <Epilogue EPILOGUE>
void streamed_gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias,
                           int rows, int in, int out_features, const ResidualNorm& norm, cudaStream_t stream) {
  constexpr bool kGated = EPILOGUE == Epilogue::Silu || EPILOGUE == Epilogue::GeluTanh;
  DSPARK_CHECK(streamed_gemv_fits(rows, in, kGated ? 2 * out_features : out_features) &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0,
               "the streamed GEMV cannot run ", rows, " rows of ", in, " features into ", out_features);
  StreamedShape shape;
  shape.in = in;
  shape.groups = ceil_div(out_features, kGated ? 8 : 16);
  const int blocks = streamed_blocks(shape.groups);
  shape.most_groups = streamed_most_groups(shape.groups);
  const int copy_rows = (kGated ? 8 : 16) * shape.most_groups;
  // K boxes a chunk: the fewest odd number whose weight copies carry
  // kStreamCopyBytes, at most K's boxes and as many as leave
  // kStreamMinStages slots; one where K is not a whole number of boxes.
  const int k_boxes = ceil_div(in, kStreamBoxColumns);
  shape.chunk_boxes = 1;
  if (in % kStreamBoxColumns == 0) {
    shape.chunk_boxes = std::min(ceil_div(kStreamCopyBytes, copy_rows * kStreamRowBytes), k_boxes) | 1;
    while (shape.chunk_boxes > 1 && kStreamMinStages * shape.slot_bytes() > streamed_shared_bytes())
      shape.chunk_boxes -= 2;
  }
  shape.chunks = ceil_div(k_boxes, shape.chunk_boxes);
  shape.stages = std::min(kStreamMaxStages, streamed_shared_bytes() / shape.slot_bytes());
  DSPARK_CHECK(shape.stages >= 2, "the streamed GEMV's slot of ", shape.slot_bytes(), " bytes leaves no ring");
  // The instantiations by the groups' registers: 2, 4, 6, 8 groups.
  static constexpr decltype(&streamed_gemv_kernel<2, EPILOGUE>) kernels[] = {
      streamed_gemv_kernel<2, EPILOGUE>, streamed_gemv_kernel<4, EPILOGUE>, streamed_gemv_kernel<6, EPILOGUE>,
      streamed_gemv_kernel<8, EPILOGUE>};
  const int instance = (shape.most_groups + 1) / 2 - 1;  // of GROUPS = 2 * (instance + 1)
  const int shared_bytes =
      std::max(shape.stages * shape.slot_bytes(), stream_partial_bytes(2 * (instance + 1))) + 1024;  // + alignment
  DSPARK_CHECK(shared_bytes <= streamed_shared_bytes() + 1024, "the streamed GEMV's sums need ", shared_bytes,
               " bytes of shared memory");
  const int weight_rows = kGated ? 2 * out_features : out_features;
  const int boxes = shape.chunk_boxes;
  const CUtensorMap most_map = tensor_map(weight, weight_rows, in, copy_rows, kStreamBoxColumns, boxes);
  const CUtensorMap fewer_map =
      shape.most_groups > 1
          ? tensor_map(weight, weight_rows, in, copy_rows - (kGated ? 8 : 16), kStreamBoxColumns, boxes)
          : most_map;
  const CUtensorMap x_map = tensor_map(x, rows, in, kStreamTiles * 8, kStreamBoxColumns, boxes);
  const int vectors = EPILOGUE == Epilogue::ResidualNorm ? residual_norm_vectors(out_features, norm.tap_stride) : 0;
  static const bool opted_in = [] {
    for (auto kernel : kernels)
      CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, streamed_shared_bytes() + 1024));
    return true;
  }();
  (void)opted_in;
  launch_dependent(kernels[instance], blocks, kStreamWarps * 32, shared_bytes, stream, most_map, fewer_map, x_map, out,
                   out_type == MatmulOutput::F32, bias, rows, out_features, shape, norm, vectors);
  CUDA_CHECK_LAUNCH();
}

// The TMA's read rate alone, for the streamed GEMV's copies: one block an SM,
// one thread copying its run of whole boxes of a [rows, columns] matrix, K
// box by K box as the GEMV does, through a ring of `stages` slots (up to
// kTmaReadStages: as many 1 KB boxes in flight as the GEMV's ring holds), and
// discarding them (measure_tma_read_bandwidth).
constexpr int kTmaReadStages = 128;
__global__ void __launch_bounds__(32, 1) tma_read_kernel(const __grid_constant__ CUtensorMap map, int row_boxes,
                                                         int column_boxes, int box_rows, int box_columns, int stages) {
  extern __shared__ uint8_t dynamic_shared[];
  uint8_t* const ring = dynamic_shared + ((1024 - shared_address(dynamic_shared) % 1024) % 1024);
  __shared__ uint64_t full[kTmaReadStages];
  if (threadIdx.x != 0) return;
  const int first = static_cast<int>(long(blockIdx.x) * row_boxes / gridDim.x);
  const int run = static_cast<int>(long(blockIdx.x + 1) * row_boxes / gridDim.x) - first;
  const int box_bytes = box_rows * box_columns * 2, copies = run * column_boxes;
  for (int s = 0; s < stages; ++s) barrier_init(&full[s], 1);
  barrier_init_fence();
  for (int i = 0; i < copies + stages; ++i) {
    if (i >= stages) barrier_wait(&full[(i - stages) % stages], ((i - stages) / stages) & 1);
    if (i >= copies) continue;
    barrier_arrive_expecting(&full[i % stages], box_bytes);
    tma_load_box(ring + (i % stages) * box_bytes, &map, 0, i / run, (first + i % run) * box_rows, &full[i % stages]);
  }
}

// The GEMV kernels that can run a product of a weight of weight_rows rows
// (gated: its gate and up rows) (DSPARK_GEMV=0: none, cuBLASLt only;
// DSPARK_GEMV_STREAMED=0: all but the streamed one, for comparison).
std::vector<GemvKernel> gemv_kernels(int rows, int in, int weight_rows) {
  const auto not_off = [](const char* name) {
    const char* setting = std::getenv(name);
    return !setting || std::string(setting) != "0";
  };
  static const bool enabled = not_off("DSPARK_GEMV"), streamed = not_off("DSPARK_GEMV_STREAMED");
  std::vector<GemvKernel> kernels;
  if (!enabled) return kernels;
  if (rows <= kGemvMaxRows && in % 8 == 0) {
    kernels.push_back(GemvKernel::OneFeaturePerWarp);
    kernels.push_back(GemvKernel::FourFeaturesPerWarp);
  }
  if (rows <= kMmaMaxRows && in % 32 == 0) kernels.push_back(GemvKernel::TensorCores);
  if (rows > 16 && rows <= kMmaMaxRows && in % 32 == 0) kernels.push_back(GemvKernel::TensorCoresInRowGroups);
  if (streamed && streamed_gemv_fits(rows, in, weight_rows)) kernels.push_back(GemvKernel::TensorCoresStreamed);
  return kernels;
}

template <Epilogue EPILOGUE>
void gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                  int in, int out_features, int features_per_warp, const ResidualNorm& norm, cudaStream_t stream) {
  const bool f32 = out_type == MatmulOutput::F32;
  const int f = features_per_warp;
  switch (rows) {
    case 1:
      return launch_gemv<1, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 2:
      return launch_gemv<2, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 3:
      return launch_gemv<3, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 4:
      return launch_gemv<4, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 5:
      return launch_gemv<5, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 6:
      return launch_gemv<6, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    case 7:
      return launch_gemv<7, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
    default:
      return launch_gemv<8, EPILOGUE>(out, f32, x, weight, bias, in, out_features, f, norm, stream);
  }
}

// few_waves: as tensor_gemv_forward's (the target's products: the drafter's were not measured with it).
void gemv_path(void* out, MatmulOutput out_type, Epilogue epilogue, const bf16* x, const bf16* weight, const bf16* bias,
               int rows, int in_features, int out_features, GemvKernel kernel, const ResidualNorm& norm, bool few_waves,
               cudaStream_t stream) {
  const auto run = [&](auto kind) {
    constexpr Epilogue kEpilogue = decltype(kind)::value;
    if (kernel == GemvKernel::TensorCoresStreamed)
      streamed_gemv_forward<kEpilogue>(out, out_type, x, weight, bias, rows, in_features, out_features, norm, stream);
    else if (kernel == GemvKernel::TensorCores || kernel == GemvKernel::TensorCoresInRowGroups)
      tensor_gemv_forward<kEpilogue>(out, out_type, x, weight, bias, rows, in_features, out_features, norm, few_waves,
                                     kernel == GemvKernel::TensorCoresInRowGroups, stream);
    else
      gemv_forward<kEpilogue>(out, out_type, x, weight, bias, rows, in_features, out_features,
                              kernel == GemvKernel::FourFeaturesPerWarp ? 4 : 1, norm, stream);
  };
  switch (epilogue) {
    case Epilogue::Store: return run(std::integral_constant<Epilogue, Epilogue::Store>{});
    case Epilogue::Silu: return run(std::integral_constant<Epilogue, Epilogue::Silu>{});
    case Epilogue::GeluTanh: return run(std::integral_constant<Epilogue, Epilogue::GeluTanh>{});
    case Epilogue::ResidualNorm: return run(std::integral_constant<Epilogue, Epilogue::ResidualNorm>{});
  }
}

// Median time of one launch(stream) in milliseconds, as a step replayed from
// a CUDA graph runs it: kTimedLaunches launches back to back, captured in one
// graph on a stream of its own once `stream`'s work is done, the graph
// replayed `runs` times. Launched one by one, each timed alone, a product
// paid its launch and its wait for the one before in full, which a graph's
// programmatic launches mostly hide: the norm's own kernel after a product
// looked dearer than the product's fused tail (in a graph the tail, one block
// norming every row, costs 1.5-5x the separate kernel), and the demo target's
// verify steps of 3-5 rows, which kept the tail, cost more than those of 7-8
// (0.17-0.20 ms against 0.164 at batch 1 on the H100; timed in a graph,
// 0.146-0.163 in order, and the batch-4 decode step 0.145-0.149 ms against
// 0.172; Qwen3-8B's draft step 0.412 against 0.457 ms).
// Back to back, so a product whose weights fit in L2 reads them from there: as
// a small model's forward does (the 19M demo target sits in L2 whole). Timing
// from a cold L2 instead chose cuBLASLt for its 8-row verify shapes, whose
// rows then lost their bits against the row decoded alone (8B: no change).
constexpr int kTimedLaunches = 8;
template <class Launch>
float time_launches(Launch launch, cudaStream_t stream, int runs = 7) {
  CUDA_CHECK(cudaStreamSynchronize(stream));  // its work wrote the inputs
  cudaStream_t timing;
  CUDA_CHECK(cudaStreamCreateWithFlags(&timing, cudaStreamNonBlocking));
  const cudaGraphExec_t executable = capture_graph(timing, [&] {
    for (int i = 0; i < kTimedLaunches; ++i) launch(timing);
  });
  auto replay = [&] { CUDA_CHECK(cudaGraphLaunch(executable, timing)); };
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  replay();  // warm-up
  std::vector<float> times;
  for (int run = 0; run < runs; ++run) {
    CUDA_CHECK(cudaEventRecord(start, timing));
    replay();
    CUDA_CHECK(cudaEventRecord(stop, timing));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float milliseconds = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
    times.push_back(milliseconds / kTimedLaunches);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  CUDA_CHECK(cudaGraphExecDestroy(executable));
  CUDA_CHECK(cudaStreamDestroy(timing));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Row-major out[rows, out] = x[rows, in] @ W[out, in]^T is, column-major,
// out'[out, rows] = W'^T [out, in] @ x' [in, rows], with W' = W seen as an
// [in, out] column-major matrix: A = W' transposed, B = x', C = out'.
class MatmulContext {
 public:
  MatmulContext() {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }
  const Plan& plan(int rows, int in, int out, MatmulOutput out_type, bool with_bias) {
    const auto key = std::make_tuple(rows, in, out, out_type, with_bias);
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    Plan plan;
    const cudaDataType_t output = out_type == MatmulOutput::BF16 ? CUDA_R_16BF : CUDA_R_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep));
    if (with_bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = CUDA_R_16BF;
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                  sizeof bias_type));
    }
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.weight_layout, CUDA_R_16BF, in, out, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.x_layout, CUDA_R_16BF, in, rows, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.out_layout, output, out, rows, out));
    // The algorithm the heuristic gave the first shape of this row class, where it runs this one.
    const auto class_key = std::make_tuple(choice_rows(rows), in, out, out_type, with_bias);
    if (auto known = algorithms_.find(class_key); known != algorithms_.end()) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle_, plan.operation, plan.weight_layout, plan.x_layout, plan.out_layout,
                                  plan.out_layout, &known->second, &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kWorkspaceBytes) {
        plan.algorithm = known->second;
        return plans_.emplace(key, plan).first->second;
      }
    }
    cublasLtMatmulPreference_t preference;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const size_t workspace = kWorkspaceBytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                      sizeof workspace));
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, plan.operation, plan.weight_layout, plan.x_layout,
                                                plan.out_layout, plan.out_layout, preference, 1, &result,
                                                &found_count));
    cublasLtMatmulPreferenceDestroy(preference);
    DSPARK_CHECK(found_count > 0, "cuBLASLt has no algorithm for a ", rows, "x", in, " @ ", in, "x", out,
                 " bf16 product");
    plan.algorithm = result.algo;
    algorithms_.try_emplace(class_key, result.algo);
    return plans_.emplace(key, plan).first->second;
  }
  // The MatmulPath that runs this shape fastest: every candidate (cuBLASLt
  // when with_cublaslt, each GEMV kernel fused and unfused) timed once,
  // outside any graph capture (the first use of a shape's row class), then
  // remembered for the class.
  // run(path, stream) computes the product along `path` on `stream`.
  // With no GEMV candidate the choice is cuBLASLt, untimed.
  template <class Run>
  MatmulPath choose(const PathKey& key, const std::vector<GemvKernel>& gemv_kernels, bool with_cublaslt,
                    bool epilogue_kernel, Run run, cudaStream_t stream) {
    if (gemv_kernels.empty()) return remember(key, MatmulPath{});
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    DSPARK_CHECK(capturing == cudaStreamCaptureStatusNone, "matmul: shape first seen during graph capture");
    std::vector<MatmulPath> candidates;
    if (with_cublaslt) candidates.push_back(MatmulPath{});
    for (GemvKernel kernel : gemv_kernels)
      for (bool fused : {true, false})
        if (fused || epilogue_kernel) candidates.push_back({kernel, fused});  // a plain product: the two are the same
    MatmulPath chosen;
    float best = FLT_MAX;
    std::string times;
    for (const MatmulPath& path : candidates) {
      const float time = time_launches([&](cudaStream_t on) { run(path, on); }, stream);
      static const char* const names[] = {"cuBLASLt",
                                          "GEMV 1 feature/warp",
                                          "GEMV 4 features/warp",
                                          "GEMV tensor cores",
                                          "GEMV tensor cores in row groups",
                                          "GEMV tensor cores streamed"};
      times += std::string(times.empty() ? "" : ", ") + names[int(path.gemv)] + (path.fused ? "" : " unfused") + " " +
               std::to_string(1e3f * time);
      if (time < best) best = time, chosen = path;
    }
    static const bool log = std::getenv("DSPARK_MATMUL_LOG") != nullptr;
    if (log)
      std::fprintf(stderr, "matmul %d (row class) x %d -> %d (epilogue %d): %s us\n", std::get<0>(key),
                   std::get<1>(key), std::get<2>(key), std::get<5>(key), times.c_str());
    return remember(key, chosen);
  }
  // The path chosen for a shape before, if any.
  std::optional<MatmulPath> chosen(const PathKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = choices_.find(key);
    if (found == choices_.end()) return std::nullopt;
    return found->second;
  }
  void run(const Plan& plan, void* out, const bf16* x, const bf16* weight, const bf16* bias, cudaStream_t stream) {
    if (bias)
      CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.operation, &one, weight, plan.weight_layout, x, plan.x_layout, &zero, out,
                                plan.out_layout, out, plan.out_layout, &plan.algorithm, workspace_, kWorkspaceBytes,
                                stream));
  }

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::mutex mutex_;
  std::map<std::tuple<int, int, int, MatmulOutput, bool>, Plan> plans_;
  std::map<std::tuple<int, int, int, MatmulOutput, bool>, cublasLtMatmulAlgo_t> algorithms_;  // by row class
  std::map<PathKey, MatmulPath> choices_;                                                     // by row class

  MatmulPath remember(const PathKey& key, const MatmulPath& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    choices_[key] = path;
    return path;
  }
};

MatmulContext& context() {
  static MatmulContext instance;  // lives until exit: the driver reclaims it
  return instance;
}

}  // namespace

namespace {

// The product and its epilogue, by GEMV or cuBLASLt, whichever this shape
// runs faster with (timed once per shape). The choice can differ between row
// counts, and so can cuBLASLt's algorithm: a row's bits would then depend on
// how many rows share its step (docs/PERF.md, "verify invariance"). So the
// target's products of up to kRowInvariantRows rows (FewRowKernels::DecodeFamily)
// run the tensor-core GEMV alone, whose sums do not depend on the row count;
// from there to 64 rows it competes with cuBLASLt (at 8B-size shapes
// cuBLASLt is 20-40% faster there; a small model in L2 takes the GEMV).
// gate_up: scratch [rows, 2 * out] for a gated epilogue on cuBLASLt.
void matmul(void* out, MatmulOutput out_type, Epilogue epilogue, const bf16* x, const bf16* weight, const bf16* bias,
            int rows, int in_features, int out_features, bf16* gate_up, const ResidualNorm& norm, cudaStream_t stream,
            FewRowKernels kernels_allowed) {
  const bool gated = epilogue == Epilogue::Silu || epilogue == Epilogue::GeluTanh;
  const int product_features = gated ? 2 * out_features : out_features;
  const bool decode_family = kernels_allowed == FewRowKernels::DecodeFamily;
  MatmulContext& matmul = context();
  const Plan& plan = matmul.plan(rows, in_features, product_features, gated ? MatmulOutput::BF16 : out_type,
                                 bias != nullptr);
  // The epilogue as a kernel of its own, after the plain product (into gate_up when gated).
  auto epilogue_kernel = [&](cudaStream_t on) {
    if (epilogue == Epilogue::Silu) swiglu_forward(static_cast<bf16*>(out), gate_up, rows, out_features, on);
    if (epilogue == Epilogue::GeluTanh)
      gelu_tanh_gate_forward(static_cast<bf16*>(out), gate_up, rows, out_features, on);
    if (epilogue == Epilogue::ResidualNorm)
      residual_add_rmsnorm_forward(norm.residual, static_cast<const bf16*>(out), norm.normed, norm.weight, rows,
                                   out_features, norm.eps, norm.residual_tap, norm.normed_tap, norm.tap_stride, on);
  };
  auto run = [&](const MatmulPath& path, cudaStream_t on) {
    if (path.gemv != GemvKernel::None && (path.fused || epilogue == Epilogue::Store))
      return gemv_path(out, out_type, epilogue, x, weight, bias, rows, in_features, out_features, path.gemv, norm,
                       decode_family, on);
    void* product = gated ? gate_up : out;
    if (path.gemv == GemvKernel::None)
      matmul.run(plan, product, x, weight, bias, on);
    else
      gemv_path(product, gated ? MatmulOutput::BF16 : out_type, Epilogue::Store, x, weight, bias, rows, in_features,
                product_features, path.gemv, norm, decode_family, on);
    epilogue_kernel(on);
  };
  // A shape's path is chosen on its first use; later calls (every eager step) only look it up.
  const PathKey key = std::make_tuple(choice_rows(rows), in_features, out_features, out_type, bias != nullptr,
                                      static_cast<int>(epilogue), kernels_allowed);
  if (const std::optional<MatmulPath> path = matmul.chosen(key)) return run(*path, stream);
  std::vector<GemvKernel> kernels = gemv_kernels(rows, in_features, product_features);
  if (epilogue == Epilogue::ResidualNorm && residual_norm_vectors(out_features, norm.tap_stride) == 0)
    kernels.clear();  // (the unfused path would do; not worth a case: no model of ours has such rows)
  // The target's decode and verify steps: the tensor-core GEMV alone (fused
  // or not: the same bits), so that a verify row has the bits of the same row
  // decoded alone, and greedy speculative output is plain output bit for bit
  // through bf16 near-ties (FewRowKernels).
  const bool row_invariant = kernels_allowed == FewRowKernels::DecodeFamily && rows <= kRowInvariantRows &&
                             std::find(kernels.begin(), kernels.end(), GemvKernel::TensorCores) != kernels.end();
  if (row_invariant) kernels = {GemvKernel::TensorCores};
  if (epilogue != Epilogue::ResidualNorm || kernels.empty())
    return run(matmul.choose(key, kernels, !row_invariant, epilogue != Epilogue::Store, run, stream), stream);
  // Timing runs add into the residual stream: it is put back before the real run.
  DeviceBuffer<float> saved(size_t(rows) * out_features);
  CUDA_CHECK(cudaMemcpyAsync(saved.data(), norm.residual, saved.bytes(), cudaMemcpyDeviceToDevice, stream));
  const MatmulPath path = matmul.choose(key, kernels, !row_invariant, true, run, stream);
  CUDA_CHECK(cudaMemcpyAsync(norm.residual, saved.data(), saved.bytes(), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before `saved` is freed
  run(path, stream);
}

}  // namespace

namespace {

// [in, out] products for few rows (in_out_product.cuh). ARGMAX: also each
// row's argmax over all out_features columns into argmax_keys[row].
template <class Weight, int ROWS, bool VECTOR, bool ARGMAX>
__global__ void __launch_bounds__(kInOutSlices * 32)
    matmul_in_out_kernel(float* out, const float* x, const Weight* weight, const float* bias, int rows, int in,
                         int out_features, bool accumulate, const int32_t* run_if,
                         unsigned long long* argmax_keys) {
  wait_for_previous_kernel();
  start_next_kernel();
  if (run_if && *run_if == 0) return;  // the whole block leaves: no barrier is skipped
  const int first_row = blockIdx.y * ROWS;
  in_out_product<Weight, ROWS, VECTOR, ARGMAX>(
      out + static_cast<long>(first_row) * out_features, DenseRows{x + static_cast<long>(first_row) * in, in}, weight,
      bias, min(ROWS, rows - first_row), in, out_features, accumulate, ARGMAX ? argmax_keys + first_row : nullptr);
}

template <class Weight, bool VECTOR, bool ARGMAX>
void launch_in_out(float* out, const float* x, const Weight* weight, const float* bias, int rows, int in,
                   int out_features, bool accumulate, const int32_t* run_if, unsigned long long* argmax_keys,
                   cudaStream_t stream) {
  const int row_block = in_out_rows_per_block(rows);
  const dim3 grid(ceil_div(out_features, kInOutColumns), ceil_div(rows, row_block));
  auto kernel = row_block == 1   ? matmul_in_out_kernel<Weight, 1, VECTOR, ARGMAX>
                : row_block == 2 ? matmul_in_out_kernel<Weight, 2, VECTOR, ARGMAX>
                : row_block == 4 ? matmul_in_out_kernel<Weight, 4, VECTOR, ARGMAX>
                                 : matmul_in_out_kernel<Weight, 8, VECTOR, ARGMAX>;
  launch_dependent(kernel, grid, kInOutSlices * 32, 0, stream, out, x, weight, bias, rows, in, out_features, accumulate,
                   run_if, argmax_keys);
  CUDA_CHECK_LAUNCH();
}

template <class Weight, bool ARGMAX = false>
void in_out_forward(float* out, const float* x, const Weight* weight, const float* bias, int rows, int in,
                    int out_features, bool accumulate, const int32_t* run_if, cudaStream_t stream,
                    unsigned long long* argmax_keys = nullptr) {
  if (rows <= 0 || out_features <= 0) return;
  // 16-byte weight loads need every weight row to start 16-byte aligned.
  const bool vector = out_features % 8 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0;
  if (vector)
    launch_in_out<Weight, true, ARGMAX>(out, x, weight, bias, rows, in, out_features, accumulate, run_if,
                                        argmax_keys, stream);
  else
    launch_in_out<Weight, false, ARGMAX>(out, x, weight, bias, rows, in, out_features, accumulate, run_if,
                                         argmax_keys, stream);
}

__global__ void argmax_tokens_kernel(int32_t* tokens, const unsigned long long* keys, int count) {
  wait_for_previous_kernel();
  start_next_kernel();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) tokens[i] = argmax_index(keys[i]);
}

}  // namespace

void matmul_in_out_forward(float* out, const float* x, const bf16* weight, const float* bias, int rows,
                           int in_features, int out_features, bool accumulate, const int32_t* run_if,
                           cudaStream_t stream) {
  in_out_forward(out, x, weight, bias, rows, in_features, out_features, accumulate, run_if, stream);
}

void matmul_in_out_forward(float* out, const float* x, const float* weight, const float* bias, int rows,
                           int in_features, int out_features, bool accumulate, const int32_t* run_if,
                           cudaStream_t stream) {
  in_out_forward(out, x, weight, bias, rows, in_features, out_features, accumulate, run_if, stream);
}

void matmul_in_out_argmax_forward(float* out, const float* x, const bf16* weight, const float* bias, int rows,
                                  int in_features, int out_features, bool accumulate,
                                  unsigned long long* argmax_keys, const int32_t* run_if, cudaStream_t stream) {
  in_out_forward<bf16, true>(out, x, weight, bias, rows, in_features, out_features, accumulate, run_if, stream,
                             argmax_keys);
}

void argmax_tokens_forward(int32_t* tokens, const unsigned long long* argmax_keys, int count, cudaStream_t stream) {
  if (count == 0) return;
  launch_dependent(argmax_tokens_kernel, ceil_div(count, 256), 256, 0, stream, tokens, argmax_keys, count);
  CUDA_CHECK_LAUNCH();
}

void matmul_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                    int in_features, int out_features, cudaStream_t stream, FewRowKernels kernels) {
  matmul(out, out_type, Epilogue::Store, x, weight, bias, rows, in_features, out_features, nullptr, {}, stream,
         kernels);
}

void gated_matmul_forward(bf16* activated, GatedActivation activation, const bf16* x, const bf16* gate_up_weight,
                          const bf16* bias, bf16* gate_up, int rows, int in_features, int out_features,
                          cudaStream_t stream, FewRowKernels kernels) {
  matmul(activated, MatmulOutput::BF16, activation == GatedActivation::Silu ? Epilogue::Silu : Epilogue::GeluTanh, x,
         gate_up_weight, bias, rows, in_features, out_features, gate_up, {}, stream, kernels);
}

void matmul_residual_rmsnorm_forward(bf16* delta, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                                     int in_features, int out_features, const ResidualNorm& norm, cudaStream_t stream,
                                     FewRowKernels kernels) {
  matmul(delta, MatmulOutput::BF16, Epilogue::ResidualNorm, x, weight, bias, rows, in_features, out_features, nullptr,
         norm, stream, kernels);
}

void gemv_matmul_forward(void* out, MatmulOutput out_type, GemvEpilogue epilogue, GemvKernel kernel, const bf16* x,
                         const bf16* weight, const bf16* bias, int rows, int in_features, int out_features,
                         const ResidualNorm& norm, cudaStream_t stream) {
  const bool gated = epilogue == Epilogue::Silu || epilogue == Epilogue::GeluTanh;
  const std::vector<GemvKernel> kernels = gemv_kernels(rows, in_features, gated ? 2 * out_features : out_features);
  DSPARK_CHECK(rows >= 1 && std::find(kernels.begin(), kernels.end(), kernel) != kernels.end(), "GEMV kernel ",
               int(kernel), " cannot run ", rows, " rows of ", in_features, " features");
  DSPARK_CHECK(epilogue == Epilogue::Store || out_type == MatmulOutput::BF16, "a fused GEMV epilogue writes bf16");
  DSPARK_CHECK(epilogue != Epilogue::ResidualNorm || residual_norm_vectors(out_features, norm.tap_stride) > 0,
               "the GEMV's norm takes rows of a multiple of 4 and at most 8192 features, not ", out_features);
  gemv_path(out, out_type, epilogue, x, weight, bias, rows, in_features, out_features, kernel, norm, true, stream);
}

double measure_tma_read_bandwidth(int rows, int columns, int box_rows, int box_columns) {
  DSPARK_CHECK(box_rows >= 1 && box_rows <= 256 && rows % box_rows == 0 && columns % box_columns == 0 &&
                   (box_columns == kStreamBoxColumns || (box_columns % 8 == 0 && box_columns <= 256)),
               "measure_tma_read_bandwidth: boxes of ", box_rows, " x ", box_columns, " over ", rows, " x ", columns);
  DeviceBuffer<bf16> matrix(size_t(rows) * columns);
  CUDA_CHECK(cudaMemset(matrix.data(), 0, matrix.bytes()));
  const CUtensorMap map = tensor_map(matrix.data(), rows, columns, box_rows, box_columns, 1);
  const int box_bytes = box_rows * box_columns * 2;
  const int stages = std::min(kTmaReadStages, streamed_shared_bytes() / box_bytes);
  DSPARK_CHECK(stages >= 2, "measure_tma_read_bandwidth: a box of ", box_bytes, " bytes leaves no ring");
  CUDA_CHECK(cudaFuncSetAttribute(tma_read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  streamed_shared_bytes() + 1024));
  const int blocks = multiprocessor_count();
  const double milliseconds = median_milliseconds([&] {
    tma_read_kernel<<<blocks, 32, stages * box_bytes + 1024>>>(map, rows / box_rows, columns / box_columns, box_rows,
                                                               box_columns, stages);
    CUDA_CHECK_LAUNCH();
  });
  return static_cast<double>(matrix.bytes()) / (milliseconds * 1e-3) / 1e9;
}

void cublaslt_matmul_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias,
                             int rows, int in_features, int out_features, cudaStream_t stream) {
  MatmulContext& matmul = context();
  matmul.run(matmul.plan(rows, in_features, out_features, out_type, bias != nullptr), out, x, weight, bias, stream);
}

// ---- training ----

namespace {

using GemmKey = std::tuple<int, int, int, long, long, long, bool, bool, bool, GemmMath, unsigned, unsigned, unsigned>;

struct GemmPlan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, c_layout = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
};

// The largest power of two (at most 256) dividing the address: what cuBLASLt may assume.
unsigned pointer_alignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  unsigned alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment >>= 1;
  return alignment;
}

// Its own handle and workspace (training steps never share a stream with the
// inference GEMMs' captured graphs). Row-major C = op(A) op(B) is, column-major,
// C' [n, m] = op(B)' [n, k] @ op(A)' [k, m] with X' the same buffer read
// column-major: cuBLASLt's A is our B and its B our A.
class GemmContext {
 public:
  GemmContext() {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  }
  const GemmPlan& plan(const GemmKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    if (plans_.size() >= kMaxPlans) clear();  // the context lengths of a run are many: bound the cache
    const auto [m, n, k, lda, ldb, ldc, transpose_a, transpose_b, bf16_operands, math, align_a, align_b, align_c] =
        key;
    GemmPlan plan;
    const cublasComputeType_t compute =
        !bf16_operands && math == GemmMath::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cudaDataType_t operand = bf16_operands ? CUDA_R_16BF : CUDA_R_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.operation, compute, CUDA_R_32F));
    const cublasOperation_t lt_a = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, lt_b = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSA, &lt_a, sizeof lt_a));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSB, &lt_b, sizeof lt_b));
    // Stored shapes, column-major: B [k, n] row-major is [n, k] column-major; transposed, [k, n].
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a_layout, operand, transpose_b ? k : n, transpose_b ? n : k, ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b_layout, operand, transpose_a ? m : k, transpose_a ? k : m, lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c_layout, CUDA_R_32F, n, m, ldc));
    cublasLtMatmulPreference_t preference;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const size_t workspace = kWorkspaceBytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                      sizeof workspace));
    const uint32_t alignments[3] = {align_b, align_a, align_c};  // cuBLASLt's A (our B), its B (our A), C = D
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                      &alignments[0], sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                      &alignments[1], sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                      &alignments[2], sizeof(uint32_t)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                      &alignments[2], sizeof(uint32_t)));
    cublasLtMatmulHeuristicResult_t result{};
    int found_count = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, plan.operation, plan.a_layout, plan.b_layout, plan.c_layout,
                                                plan.c_layout, preference, 1, &result, &found_count));
    cublasLtMatmulPreferenceDestroy(preference);
    DSPARK_CHECK(found_count > 0, "cuBLASLt has no algorithm for a ", m, "x", k, " @ ", k, "x", n,
                 bf16_operands ? " bf16" : " f32", " product");
    plan.algorithm = result.algo;
    return plans_.emplace(key, plan).first->second;
  }
  void run(const GemmPlan& plan, float* c, const void* a, const void* b, float beta, cudaStream_t stream) {
    const float one = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle_, plan.operation, &one, b, plan.a_layout, a, plan.b_layout, &beta, c,
                                plan.c_layout, c, plan.c_layout, &plan.algorithm, workspace_, kWorkspaceBytes,
                                stream));
  }

 private:
  static constexpr size_t kMaxPlans = 4096;
  void clear() {
    for (auto& [key, plan] : plans_) {
      cublasLtMatrixLayoutDestroy(plan.a_layout);
      cublasLtMatrixLayoutDestroy(plan.b_layout);
      cublasLtMatrixLayoutDestroy(plan.c_layout);
      cublasLtMatmulDescDestroy(plan.operation);
    }
    plans_.clear();
  }
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::mutex mutex_;
  std::map<GemmKey, GemmPlan> plans_;
};

GemmContext& gemm_context() {
  static GemmContext instance;  // lives until exit: the driver reclaims it
  return instance;
}

}  // namespace

void gemm(float* c, long ldc, const void* a, long lda, bool transpose_a, const void* b, long ldb, bool transpose_b,
          int m, int n, int k, float beta, bool bf16_operands, GemmMath math, cudaStream_t stream) {
  if (m <= 0 || n <= 0 || k <= 0) return;
  const GemmKey key{m,           n,           k,          lda,  ldb, ldc, transpose_a, transpose_b, bf16_operands,
                    math,        pointer_alignment(a),    pointer_alignment(b),          pointer_alignment(c)};
  GemmContext& context = gemm_context();
  context.run(context.plan(key), c, a, b, beta, stream);
}

void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features, GemmMath math, cudaStream_t stream) {
  gemm(out, out_features, x, in_features, false, weight, out_features, false, rows, out_features, in_features, 0.0f,
       false, math, stream);
}

void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight,
                            int rows, int in_features, int out_features, GemmMath math, cudaStream_t stream) {
  if (dx)  // [rows, in] += [rows, out] @ weight^T
    gemm(dx, in_features, dout, out_features, false, weight, out_features, true, rows, in_features, out_features,
         1.0f, false, math, stream);
  if (dweight)  // [in, out] += x^T @ dout
    gemm(dweight, out_features, x, in_features, true, dout, out_features, false, in_features, out_features, rows,
         1.0f, false, math, stream);
}

}  // namespace dspark::cuda
