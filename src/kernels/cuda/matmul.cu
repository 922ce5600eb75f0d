#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/activation.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/matmul.h"

namespace dspark::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

// How one shape runs (MatmulContext::choose): cuBLASLt, or the GEMV with 1
// or 4 output features per warp. A gated GEMV either computes act(gate) * up
// itself for every output feature it owns (fused: one launch) or reads it from
// the activation kernel's output (unfused: computed once; wins where the gated
// input is wide and the output narrow, as in the drafter's down projection,
// 4096 -> 1024 at 7 rows: 1024 warps each evaluating 7 x 4096 gelu_tanh).
struct MatmulPath {
  bool gemv = false;
  int features_per_warp = 1;
  bool fused = true;
};

// (rows, in, out, output type, bias, gate): a shape's choice of MatmulPath.
using PathKey = std::tuple<int, int, int, MatmulOutput, bool, int>;

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

// What the GEMV's input is: x itself, or a gated activation of x = gate|up.
enum class Gate { None, Silu, GeluTanh };

template <Gate GATE>
__device__ __forceinline__ float gated(float gate, float up) {
  if constexpr (GATE == Gate::Silu) return gate / (1.0f + __expf(-gate)) * up;
  return gelu_tanh(gate) * up;
}

// A gated GATE: x is [ROWS, 2 * in] gate|up and the input is act(gate) * up,
// so the down projection needs no separate activation kernel.
//
// FEATURES output features per warp: each activation load (and, gated, each
// act(gate) * up) then serves FEATURES weight rows instead of one. With many
// rows the one-feature GEMV spends its time re-reading the activations from
// L1, ROWS times the bytes of the weight stream (the drafter's LM head: 7 block
// rows x 151936 features, 654 us for 1.2 GB of weights at batch 1); four
// features cut that to a quarter. A feature's sum is accumulated in the same
// order either way (lane by lane over k, then the warp sum).
template <int ROWS, int FEATURES, Gate GATE>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in,
                int out_features) {
  constexpr bool kGated = GATE != Gate::None;
  const int lane = threadIdx.x & 31;
  const int first_feature = (blockIdx.x * kGemvWarps + (threadIdx.x >> 5)) * FEATURES;
  if (first_feature >= out_features) return;
  const int features = min(FEATURES, out_features - first_feature);  // the same for the whole warp
  const bf16* rows = weight + static_cast<long>(first_feature) * in;
  const long x_stride = kGated ? 2L * in : in;
  float sums[ROWS][FEATURES] = {};
#pragma unroll(FEATURES == 1 ? 8 : 2)
  for (int k = lane * 8; k < in; k += 32 * 8) {
    uint4 packed[FEATURES];
#pragma unroll
    for (int f = 0; f < FEATURES; ++f)  // streamed once: keep it out of L1
      packed[f] = FEATURES == 1 || f < features
                      ? __ldcs(reinterpret_cast<const uint4*>(rows + static_cast<long>(f) * in + k))
                      : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float2 input[4];
      const uint4 activation = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + k));
      const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&activation);
      if constexpr (kGated) {
        const uint4 up_packed = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + in + k));
        const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(&up_packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 gf = __bfloat1622float2(a[j]), uf = __bfloat1622float2(u[j]);
          // rounded to bf16 as the unfused path's activation buffer is
          input[j] = __bfloat1622float2(__floats2bfloat162_rn(gated<GATE>(gf.x, uf.x), gated<GATE>(gf.y, uf.y)));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) input[j] = __bfloat1622float2(a[j]);
      }
#pragma unroll
      for (int f = 0; f < FEATURES; ++f) {
        const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed[f]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 wf = __bfloat1622float2(w[j]);
          sums[r][f] += wf.x * input[j].x + wf.y * input[j].y;
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
      if (lane == 0) {
        if (bias) total += __bfloat162float(bias[feature]);
        const long index = static_cast<long>(r) * out_features + feature;
        if (out_f32)
          static_cast<float*>(out)[index] = total;
        else
          static_cast<bf16*>(out)[index] = __float2bfloat16(total);
      }
    }
  }
}

template <int ROWS, int FEATURES, Gate GATE>
void launch_gemv(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in, int out_features,
                 cudaStream_t stream) {
  const int blocks = ceil_div(out_features, kGemvWarps * FEATURES);
  gemv_kernel<ROWS, FEATURES, GATE>
      <<<blocks, kGemvWarps * 32, 0, stream>>>(out, out_f32, x, weight, bias, in, out_features);
  CUDA_CHECK_LAUNCH();
}

bool gemv_possible(int rows, int in) {
  static const bool enabled = [] {
    const char* setting = std::getenv("DSPARK_GEMV");
    return !setting || std::string(setting) != "0";
  }();
  return enabled && rows <= kGemvMaxRows && in % 8 == 0;
}

template <int ROWS, Gate GATE>
void launch_gemv(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in, int out_features,
                 int features_per_warp, cudaStream_t stream) {
  if (features_per_warp == 4)
    launch_gemv<ROWS, 4, GATE>(out, out_f32, x, weight, bias, in, out_features, stream);
  else
    launch_gemv<ROWS, 1, GATE>(out, out_f32, x, weight, bias, in, out_features, stream);
}

template <Gate GATE>
void gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                  int in, int out_features, int features_per_warp, cudaStream_t stream) {
  const bool f32 = out_type == MatmulOutput::F32;
  const int f = features_per_warp;
  switch (rows) {
    case 1:
      return launch_gemv<1, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 2:
      return launch_gemv<2, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 3:
      return launch_gemv<3, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 4:
      return launch_gemv<4, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 5:
      return launch_gemv<5, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 6:
      return launch_gemv<6, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    case 7:
      return launch_gemv<7, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
    default:
      return launch_gemv<8, GATE>(out, f32, x, weight, bias, in, out_features, f, stream);
  }
}

// Median time of `runs` launches of `launch` on `stream`, in milliseconds.
template <class Launch>
float time_launches(Launch launch, cudaStream_t stream, int runs = 7) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  launch();  // warm-up
  std::vector<float> times;
  for (int run = 0; run < runs; ++run) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    launch();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float milliseconds = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
    times.push_back(milliseconds);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
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
    return plans_.emplace(key, plan).first->second;
  }
  // The MatmulPath that runs this shape fastest: every candidate timed once,
  // outside any graph capture (a shape's first use), then remembered.
  // run(path) computes the product along `path`.
  template <class Run>
  MatmulPath choose(const PathKey& key, bool gated, Run run, cudaStream_t stream) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = choices_.find(key);
      if (found != choices_.end()) return found->second;
    }
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    DSPARK_CHECK(capturing == cudaStreamCaptureStatusNone, "matmul: shape first seen during graph capture");
    MatmulPath chosen;  // cuBLASLt
    float best = time_launches([&] { run(chosen); }, stream);
    for (bool fused : {true, false}) {
      if (!fused && !gated) continue;  // without a gate the two are the same
      for (int features : {1, 4}) {
        const MatmulPath path{true, features, fused};
        const float time = time_launches([&] { run(path); }, stream);
        if (time < best) best = time, chosen = path;
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    choices_[key] = chosen;
    return chosen;
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
  std::map<PathKey, MatmulPath> choices_;
};

MatmulContext& context() {
  static MatmulContext instance;  // lives until exit: the driver reclaims it
  return instance;
}

}  // namespace

namespace {

void gemv_path(void* out, MatmulOutput out_type, Gate gate, const bf16* x, const bf16* weight, const bf16* bias,
               int rows, int in_features, int out_features, int features_per_warp, cudaStream_t stream) {
  if (gate == Gate::Silu)
    gemv_forward<Gate::Silu>(out, out_type, x, weight, bias, rows, in_features, out_features, features_per_warp,
                             stream);
  else if (gate == Gate::GeluTanh)
    gemv_forward<Gate::GeluTanh>(out, out_type, x, weight, bias, rows, in_features, out_features, features_per_warp,
                                 stream);
  else
    gemv_forward<Gate::None>(out, out_type, x, weight, bias, rows, in_features, out_features, features_per_warp,
                             stream);
}

// The product, by GEMV or cuBLASLt, whichever this shape runs faster with
// (timed once per shape). The choice can differ between row counts, and so
// can cuBLASLt's algorithm: a row's bits may then depend on how many rows
// share its step (docs/PERF.md, "verify invariance"). Forcing the GEMV on
// every row count up to 8 removed that, but cost 28% of decode speed and made
// verify blocks 2-5x dearer, so it is not done.
// With a gate, x is act(gate_up[:, :in]) * gate_up[:, in:]: computed into `x`
// itself by the activation kernel (cuBLASLt, unfused GEMV), or inside the
// fused GEMV.
void matmul(void* out, MatmulOutput out_type, Gate gate, const bf16* gate_up, bf16* x, const bf16* weight,
            const bf16* bias, int rows, int in_features, int out_features, cudaStream_t stream) {
  MatmulContext& matmul = context();
  const Plan& plan = matmul.plan(rows, in_features, out_features, out_type, bias != nullptr);
  auto activate = [&] {
    if (gate == Gate::Silu) swiglu_forward(x, gate_up, rows, in_features, stream);
    if (gate == Gate::GeluTanh) gelu_tanh_gate_forward(x, gate_up, rows, in_features, stream);
  };
  auto run = [&](const MatmulPath& path) {
    if (!path.gemv) {
      activate();
      matmul.run(plan, out, x, weight, bias, stream);
    } else if (path.fused) {
      gemv_path(out, out_type, gate, gate == Gate::None ? x : gate_up, weight, bias, rows, in_features, out_features,
                path.features_per_warp, stream);
    } else {
      activate();
      gemv_path(out, out_type, Gate::None, x, weight, bias, rows, in_features, out_features, path.features_per_warp,
                stream);
    }
  };
  const PathKey key{rows, in_features, out_features, out_type, bias != nullptr, static_cast<int>(gate)};
  run(gemv_possible(rows, in_features) ? matmul.choose(key, gate != Gate::None, run, stream) : MatmulPath{});
}

}  // namespace

namespace {

// [in, out] products for few rows (the drafter's sequential head): x @ W with
// W stored [in, out]. Each block owns kInOutColumns output columns; lane l of
// warp w owns columns l*8 .. l*8+7 and the input features i = w, w + 8, ...:
// a warp reads 32 * 8 consecutive weights of one input row per step (coalesced,
// no transpose needed), and the 8 warps' partial sums meet in shared memory.
// Rows beyond ROWS run as further blocks along y (each re-reads the weights).
constexpr int kInOutSlices = 8;
constexpr int kInOutColumns = 32 * 8;

// Eight consecutive weights as floats; VECTOR: one 16-byte (bf16) or two
// (f32) loads, else element by element up to `available`.
template <bool VECTOR>
__device__ __forceinline__ void load_eight(const bf16* weights, int available, float* out) {
  if constexpr (VECTOR) {
    const uint4 packed = __ldcs(reinterpret_cast<const uint4*>(weights));  // streamed once per use
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 pair = __bfloat1622float2(pairs[j]);
      out[2 * j] = pair.x, out[2 * j + 1] = pair.y;
    }
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

// ARGMAX: also each row's argmax over all out_features columns, by a block
// reduction and one atomicMax per (block, row) into argmax_keys[row].
template <class Weight, int ROWS, bool VECTOR, bool ARGMAX>
__global__ void __launch_bounds__(kInOutSlices * 32)
    matmul_in_out_kernel(float* out, const float* x, const Weight* weight, const float* bias, int rows, int in,
                         int out_features, bool accumulate, const int32_t* run_if,
                         unsigned long long* argmax_keys) {
  if (run_if && *run_if == 0) return;  // the whole block leaves: no barrier is skipped
  __shared__ __align__(16) float partial[kInOutSlices][kInOutColumns];
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const int column = blockIdx.x * kInOutColumns + lane * 8;
  const int first_row = blockIdx.y * ROWS;
  const int row_count = min(ROWS, rows - first_row);
  float sums[ROWS][8];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) sums[r][j] = 0.0f;
  if (column < out_features) {
#pragma unroll 4
    for (int i = slice; i < in; i += kInOutSlices) {
      float w[8];
      load_eight<VECTOR>(weight + static_cast<long>(i) * out_features + column, out_features - column, w);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float value = r < row_count ? __ldg(x + static_cast<long>(first_row + r) * in + i) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[r][j] += value * w[j];
      }
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
      float* destination = out + static_cast<long>(first_row + r) * out_features + own;
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
        atomicMax(argmax_keys + first_row + r, key);
      }
    }
    __syncthreads();  // partial (and warp_keys) are rewritten for the next row
  }
}

template <class Weight, bool VECTOR, bool ARGMAX>
void launch_in_out(float* out, const float* x, const Weight* weight, const float* bias, int rows, int in,
                   int out_features, bool accumulate, const int32_t* run_if, unsigned long long* argmax_keys,
                   cudaStream_t stream) {
  const int row_block = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
  const dim3 grid(ceil_div(out_features, kInOutColumns), ceil_div(rows, row_block));
  auto kernel = row_block == 1   ? matmul_in_out_kernel<Weight, 1, VECTOR, ARGMAX>
                : row_block == 2 ? matmul_in_out_kernel<Weight, 2, VECTOR, ARGMAX>
                : row_block == 4 ? matmul_in_out_kernel<Weight, 4, VECTOR, ARGMAX>
                                 : matmul_in_out_kernel<Weight, 8, VECTOR, ARGMAX>;
  kernel<<<grid, kInOutSlices * 32, 0, stream>>>(out, x, weight, bias, rows, in, out_features, accumulate, run_if,
                                                 argmax_keys);
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
  argmax_tokens_kernel<<<ceil_div(count, 256), 256, 0, stream>>>(tokens, argmax_keys, count);
  CUDA_CHECK_LAUNCH();
}

void matmul_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                    int in_features, int out_features, cudaStream_t stream) {
  matmul(out, out_type, Gate::None, nullptr, const_cast<bf16*>(x), weight, bias, rows, in_features, out_features,
         stream);
}

void swiglu_matmul_forward(void* out, MatmulOutput out_type, const bf16* gate_up, bf16* activated, const bf16* weight,
                           const bf16* bias, int rows, int in_features, int out_features, cudaStream_t stream) {
  matmul(out, out_type, Gate::Silu, gate_up, activated, weight, bias, rows, in_features, out_features, stream);
}

void gelu_tanh_gate_matmul_forward(void* out, MatmulOutput out_type, const bf16* gate_up, bf16* activated,
                                   const bf16* weight, const bf16* bias, int rows, int in_features, int out_features,
                                   cudaStream_t stream) {
  matmul(out, out_type, Gate::GeluTanh, gate_up, activated, weight, bias, rows, in_features, out_features, stream);
}
void gemv_matmul_forward(void* out, MatmulOutput out_type, GemvInput input, const bf16* x, const bf16* weight,
                         const bf16* bias, int rows, int in_features, int out_features, int features_per_warp,
                         cudaStream_t stream) {
  DSPARK_CHECK(rows >= 1 && rows <= kGemvMaxRows && in_features % 8 == 0, "the GEMV takes 1..", kGemvMaxRows,
               " rows and a multiple of 8 input features, not ", rows, " x ", in_features);
  DSPARK_CHECK(features_per_warp == 1 || features_per_warp == 4, "the GEMV runs 1 or 4 features per warp, not ",
               features_per_warp);
  const Gate gate = input == GemvInput::Swiglu ? Gate::Silu : input == GemvInput::GeluTanh ? Gate::GeluTanh : Gate::None;
  gemv_path(out, out_type, gate, x, weight, bias, rows, in_features, out_features, features_per_warp, stream);
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
