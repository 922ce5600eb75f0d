#include <cublasLt.h>

#include <algorithm>
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
// front of every block.
constexpr int kGemvMaxRows = 8;
constexpr int kGemvWarps = 8;

__device__ __forceinline__ float silu_times(float gate, float up) { return gate / (1.0f + __expf(-gate)) * up; }

// SWIGLU: x is [ROWS, 2 * in] gate|up and the input is silu(gate) * up,
// so the down projection needs no separate activation kernel.
template <int ROWS, bool SWIGLU>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in,
                int out_features) {
  const int lane = threadIdx.x & 31;
  const int feature = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const bf16* row = weight + static_cast<long>(feature) * in;
  if (feature >= out_features) return;
  const long x_stride = SWIGLU ? 2L * in : in;
  float sums[ROWS] = {};
#pragma unroll 8
  for (int k = lane * 8; k < in; k += 32 * 8) {
    const uint4 packed = __ldcs(reinterpret_cast<const uint4*>(row + k));  // streamed once: keep it out of L1
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint4 activation = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + k));
      const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&activation);
      if constexpr (SWIGLU) {
        const uint4 up_packed = __ldg(reinterpret_cast<const uint4*>(x + r * x_stride + in + k));
        const __nv_bfloat162* u = reinterpret_cast<const __nv_bfloat162*>(&up_packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 wf = __bfloat1622float2(w[j]), gf = __bfloat1622float2(a[j]), uf = __bfloat1622float2(u[j]);
          // rounded to bf16 as the unfused path's activation buffer is
          const float2 af = __bfloat1622float2(__floats2bfloat162_rn(silu_times(gf.x, uf.x), silu_times(gf.y, uf.y)));
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

template <int ROWS, bool SWIGLU>
void launch_gemv(void* out, bool out_f32, const bf16* x, const bf16* weight, const bf16* bias, int in, int out_features,
                 cudaStream_t stream) {
  const int blocks = ceil_div(out_features, kGemvWarps);
  gemv_kernel<ROWS, SWIGLU><<<blocks, kGemvWarps * 32, 0, stream>>>(out, out_f32, x, weight, bias, in, out_features);
  CUDA_CHECK_LAUNCH();
}

bool gemv_possible(int rows, int in) {
  static const bool enabled = [] {
    const char* setting = std::getenv("DSPARK_GEMV");
    return !setting || std::string(setting) != "0";
  }();
  return enabled && rows <= kGemvMaxRows && in % 8 == 0;
}

template <bool SWIGLU>
void gemv_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                  int in, int out_features, cudaStream_t stream) {
  const bool f32 = out_type == MatmulOutput::F32;
  switch (rows) {
    case 1:
      return launch_gemv<1, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 2:
      return launch_gemv<2, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 3:
      return launch_gemv<3, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 4:
      return launch_gemv<4, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 5:
      return launch_gemv<5, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 6:
      return launch_gemv<6, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    case 7:
      return launch_gemv<7, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
    default:
      return launch_gemv<8, SWIGLU>(out, f32, x, weight, bias, in, out_features, stream);
  }
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
};

MatmulContext& context() {
  static MatmulContext instance;  // lives until exit: the driver reclaims it
  return instance;
}

}  // namespace

namespace {

// The product: the GEMV for up to kGemvMaxRows rows, cuBLASLt above. Every
// row count up to kGemvMaxRows takes the same kernel, whose per-row reduction
// does not depend on how many rows it has: a decode step and a verify block of
// up to 8 tokens compute each row's logits bit-identically, which greedy
// speculative decoding needs to match plain decoding exactly. (cuBLASLt picks
// a different algorithm, with a different reduction, for different M.)
// With gate_up set, x is first computed as swiglu(gate_up) (into `x` itself
// on the cuBLASLt path, fused into the GEMV otherwise).
void matmul(void* out, MatmulOutput out_type, const bf16* gate_up, bf16* x, const bf16* weight, const bf16* bias,
            int rows, int in_features, int out_features, cudaStream_t stream) {
  if (gemv_possible(rows, in_features)) {
    if (gate_up)
      return gemv_forward<true>(out, out_type, gate_up, weight, bias, rows, in_features, out_features, stream);
    return gemv_forward<false>(out, out_type, x, weight, bias, rows, in_features, out_features, stream);
  }
  MatmulContext& matmul = context();
  const Plan& plan = matmul.plan(rows, in_features, out_features, out_type, bias != nullptr);
  if (gate_up) swiglu_forward(x, gate_up, rows, in_features, stream);
  matmul.run(plan, out, x, weight, bias, stream);
}

}  // namespace

void matmul_forward(void* out, MatmulOutput out_type, const bf16* x, const bf16* weight, const bf16* bias, int rows,
                    int in_features, int out_features, cudaStream_t stream) {
  matmul(out, out_type, nullptr, const_cast<bf16*>(x), weight, bias, rows, in_features, out_features, stream);
}

void swiglu_matmul_forward(void* out, MatmulOutput out_type, const bf16* gate_up, bf16* activated, const bf16* weight,
                           const bf16* bias, int rows, int in_features, int out_features, cudaStream_t stream) {
  matmul(out, out_type, gate_up, activated, weight, bias, rows, in_features, out_features, stream);
}
}  // namespace dspark::cuda
