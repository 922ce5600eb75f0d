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
// timed both ways once and the faster kept (see choose_gemv below).
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
template <int ROWS, Gate GATE>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in,
                int out_features) {
  constexpr bool kGated = GATE != Gate::None;
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const bf16* row = weight + static_cast<long>(feature) * in;
  if (feature >= out_features) return;
  const long x_stride = kGated ? 2L * in : in;
  float sums[ROWS] = {};
#pragma unroll 8
  for (int k = lane * 8; k < in; k += 32 * 8) {
    const uint4 packed = __ldcs(reinterpret_cast<const uint4*>(row + k));  // streamed once: keep it out of L1
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint4 activation = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + k));
      const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&activation);
      if constexpr (kGated) {
        const uint4 up_packed = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + in + k));
        const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(&up_packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 wf = __bfloat1622float2(w[j]), gf = __bfloat1622float2(a[j]), uf = __bfloat1622float2(u[j]);
          // rounded to bf16 as the unfused path's activation buffer is
          const float2 af =
              __bfloat1622float2(__floats2bfloat162_rn(gated<GATE>(gf.x, uf.x), gated<GATE>(gf.y, uf.y)));
          sums[r] += wf.x * af.x + wf.y * af.y;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 wf = __bfloat1622float2(w[j]), af = __bfloat1622float2(a[j]);
          sums[r] += wf.x * af.x + wf.y * af.y;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float total = warp_sum(sums[r]);
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

template <int ROWS, Gate GATE>
void launch_gemv(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in, int out_features,
                 cudaStream_t stream) {
  const int blocks = ceil_div(out_features, kGemvWarps);
  gemv_kernel<ROWS, GATE><<<blocks, kGemvWarps * 32, 0, stream>>>(out, out_f32, x, weight, bias, in, out_features);
  CUDA_CHECK_LAUNCH();
}

bool gemv_possible(int rows, int in) {
  static const bool enabled = [] {
    const char* setting = std::getenv("DSPARK_GEMV");
    return !setting || std::string(setting) != "0";
  }();
  return enabled && rows <= kGemvMaxRows && in % 8 == 0;
}

template <Gate GATE>
void gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                  int in, int out_features, cudaStream_t stream) {
  const bool f32 = out_type == MatmulOutput::F32;
  switch (rows) {
    case 1:
      return launch_gemv<1, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 2:
      return launch_gemv<2, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 3:
      return launch_gemv<3, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 4:
      return launch_gemv<4, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 5:
      return launch_gemv<5, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 6:
      return launch_gemv<6, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    case 7:
      return launch_gemv<7, GATE>(out, f32, x, weight, bias, in, out_features, stream);
    default:
      return launch_gemv<8, GATE>(out, f32, x, weight, bias, in, out_features, stream);
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
  // Whether the GEMV beats cuBLASLt for this shape: timed once, outside any
  // graph capture (a shape's first use), then remembered.
  template <class Gemv, class Lt>
  bool choose_gemv(const std::tuple<int, int, int, MatmulOutput, bool>& key, Gemv gemv, Lt lt, cudaStream_t stream) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = gemv_choice_.find(key);
      if (found != gemv_choice_.end()) return found->second;
    }
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    DSPARK_CHECK(capturing == cudaStreamCaptureStatusNone, "matmul: shape first seen during graph capture");
    const bool faster = time_launches(gemv, stream) < time_launches(lt, stream);
    std::lock_guard<std::mutex> lock(mutex_);
    gemv_choice_[key] = faster;
    return faster;
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
  std::map<std::tuple<int, int, int, MatmulOutput, bool>, bool> gemv_choice_;
};

MatmulContext& context() {
  static MatmulContext instance;  // lives until exit: the driver reclaims it
  return instance;
}

}  // namespace

namespace {

// The product, by GEMV or cuBLASLt, whichever this shape runs faster with
// (timed once per shape). The choice can differ between row counts, and so
// can cuBLASLt's algorithm: a row's bits may then depend on how many rows
// share its step (docs/PERF.md, "verify invariance"). Forcing the GEMV on
// every row count up to 8 removed that, but cost 28% of decode speed and made
// verify blocks 2-5x dearer, so it is not done.
// With a gate, x is first computed as act(gate_up[:, :in]) * gate_up[:, in:]
// (into `x` itself on the cuBLASLt path, fused into the GEMV otherwise).
void matmul(void* out, MatmulOutput out_type, Gate gate, const bf16* gate_up, bf16* x, const bf16* weight,
            const bf16* bias, int rows, int in_features, int out_features, cudaStream_t stream) {
  MatmulContext& matmul = context();
  const Plan& plan = matmul.plan(rows, in_features, out_features, out_type, bias != nullptr);
  auto lt = [&] {
    if (gate == Gate::Silu) swiglu_forward(x, gate_up, rows, in_features, stream);
    if (gate == Gate::GeluTanh) gelu_tanh_gate_forward(x, gate_up, rows, in_features, stream);
    matmul.run(plan, out, x, weight, bias, stream);
  };
  auto gemv = [&] {
    if (gate == Gate::Silu)
      gemv_forward<Gate::Silu>(out, out_type, gate_up, weight, bias, rows, in_features, out_features, stream);
    else if (gate == Gate::GeluTanh)
      gemv_forward<Gate::GeluTanh>(out, out_type, gate_up, weight, bias, rows, in_features, out_features, stream);
    else
      gemv_forward<Gate::None>(out, out_type, x, weight, bias, rows, in_features, out_features, stream);
  };
  const auto key = std::make_tuple(rows, in_features, out_features, out_type, bias != nullptr);
  if (gemv_possible(rows, in_features) && matmul.choose_gemv(key, gemv, lt, stream))
    gemv();
  else
    lt();
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
