// Activation x weight products through cuBLASLt (CUDA version of
// kernels/cpu/matmul.h): bf16 operands, f32 accumulation, bf16 or f32 output.
// Shapes as on the CPU: x [rows, in], weight [out, in] (nn.Linear layout),
// bias [out] or null, out [rows, out].
//
// Up to 64 rows may run a weight-streaming GEMV where it times faster than
// cuBLASLt (CUDA cores or tensor cores, the epilogue fused in): every way is
// timed once per shape and the fastest kept (DSPARK_MATMUL_LOG=1 prints each
// shape's times; DSPARK_GEMV=0 runs cuBLASLt only), except for the target's
// products, below.
// The cuBLASLt algorithm for each (rows, in, out, output type, bias) is chosen
// once by its heuristic and cached with its descriptors, so a call inside CUDA
// graph capture never queries the heuristic (warm each shape up first).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

enum class MatmulOutput { BF16, F32 };

// Which kernels may run a product of few rows. DecodeFamily (the target): up
// to 16 rows, the tensor-core GEMV alone, whose per-row sums do not depend on
// how many rows share the product, so that a verify row has the bits of the
// same row decoded alone and greedy speculative output is plain output bit
// for bit (for 17-64 rows, whichever of the GEMVs and cuBLASLt times
// faster: where that is the streamed GEMV or the tensor-core GEMV the rows
// keep those bits, where it is cuBLASLt they may not).
// Any (the drafter, which has no such pairing): whichever kernel times
// fastest (the tensor-core GEMV wins most of its 7-row shapes).
enum class FewRowKernels { DecodeFamily, Any };
// The row count up to which DecodeFamily products run the tensor-core GEMV alone.
constexpr int kRowInvariantRows = 16;

void matmul_forward(void* out, MatmulOutput out_type, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                    const __nv_bfloat16* bias, int rows, int in_features, int out_features, cudaStream_t stream,
                    FewRowKernels kernels = FewRowKernels::DecodeFamily);

// The MLP's gated input: activated [rows, out] = act(x @ gate^T + gate_bias) *
// (x @ up^T + up_bias), weight = gate|up [2 * out, in], bias [2 * out] or null.
// Gate and up are rounded to bf16 before the activation, as when they pass
// through the gate|up buffer, which is how the shapes that run on cuBLASLt do
// it (gate_up: scratch [rows, 2 * out]); the GEMV sums a feature's gate and up
// rows in one warp and writes only the activation.
enum class GatedActivation { Silu, GeluTanh };
void gated_matmul_forward(__nv_bfloat16* activated, GatedActivation activation, const __nv_bfloat16* x,
                          const __nv_bfloat16* gate_up_weight, const __nv_bfloat16* bias, __nv_bfloat16* gate_up,
                          int rows, int in_features, int out_features, cudaStream_t stream,
                          FewRowKernels kernels = FewRowKernels::DecodeFamily);

// A projection back into the residual stream and the norm after it:
// delta [rows, out] = x @ weight^T (+ bias), then residual_add_rmsnorm_forward
// with these operands (rmsnorm.h). On the GEMV, the grid's last block to
// finish does the add and the norm with the norm kernel's own row code (the
// same bits), which saves a launch: two per decoder layer.
struct ResidualNorm {
  float* residual = nullptr;             // [rows, out] f32, += delta
  const float* weight = nullptr;         // [out]
  __nv_bfloat16* normed = nullptr;       // [rows, out] rmsnorm(residual) * weight
  float eps = 0.0f;
  float* residual_tap = nullptr;         // optional: residual_tap[r * tap_stride ..] = the residual after the add
  float* normed_tap = nullptr;           // optional: the normed row in f32
  long tap_stride = 0;
  unsigned* counter = nullptr;           // a device word holding 0, which the call leaves at 0 (blocks count in it)
};
void matmul_residual_rmsnorm_forward(__nv_bfloat16* delta, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                     const __nv_bfloat16* bias, int rows, int in_features, int out_features,
                                     const ResidualNorm& norm, cudaStream_t stream,
                                     FewRowKernels kernels = FewRowKernels::DecodeFamily);

// The GEMVs alone: on the CUDA cores with 1 or 4 output features per warp
// (1..8 rows, in_features a multiple of 8), or on the tensor cores (1..64
// rows, in_features a multiple of 32; past 16 rows also in groups of 16 rows,
// a block row each, or streamed: 17..32 rows, at most 8 groups of 16 weight
// rows a multiprocessor, in_features a multiple of 8, x and the weight
// 16-byte aligned). The products above time each against
// cuBLASLt on a shape's first use and keep the fastest; tests hold each to
// the CPU and to the unfused kernels. Silu / GeluTanh: weight and bias are
// gate|up, out [rows, out] the activation; ResidualNorm: out is the delta and
// `norm` as above. Fused epilogues write bf16.
enum class GemvEpilogue { Store, Silu, GeluTanh, ResidualNorm };
enum class GemvKernel {
  None,
  OneFeaturePerWarp,
  FourFeaturesPerWarp,
  TensorCores,
  TensorCoresInRowGroups,
  // 17-32 rows and at most 8 groups of 16 weight rows an SM: one block an SM, the weights streamed
  // through shared memory by the TMA, each output with the bits TensorCores gives it
  TensorCoresStreamed,
};
void gemv_matmul_forward(void* out, MatmulOutput out_type, GemvEpilogue epilogue, GemvKernel kernel,
                         const __nv_bfloat16* x, const __nv_bfloat16* weight, const __nv_bfloat16* bias, int rows,
                         int in_features, int out_features, const ResidualNorm& norm, cudaStream_t stream);

// GB/s that the streamed GEMV's copies (the TMA, one block an SM, boxes of
// box_rows x box_columns: 64 columns swizzled by 128 bytes, or up to 256 not
// swizzled) read a [rows, columns] bf16 matrix at, with no arithmetic.
double measure_tma_read_bandwidth(int rows, int columns, int box_rows, int box_columns);

// The product on cuBLASLt alone (the algorithm its heuristic gives the
// shape's row class, as matmul_forward runs it): what benchmarks hold the
// GEMVs against.
void cublaslt_matmul_forward(void* out, MatmulOutput out_type, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                             const __nv_bfloat16* bias, int rows, int in_features, int out_features,
                             cudaStream_t stream);
// out [rows, out] = x [rows, in] @ weight (+ bias [out]) with weight stored
// [in, out] (the drafter's layout: CUDA version of cpu::matmul_in_out_forward),
// for few rows (the sequential head: one row per request). x, bias and out are
// f32; the weight bf16 (the vocabulary-wide head matrices) or f32 (the small
// recurrent ones); f32 accumulation. accumulate: out += the product instead.
// run_if: a device flag or null; when it holds 0 the kernel does nothing, so a
// captured graph skips work that the device has found unneeded.
void matmul_in_out_forward(float* out, const float* x, const __nv_bfloat16* weight, const float* bias, int rows,
                           int in_features, int out_features, bool accumulate, const int32_t* run_if,
                           cudaStream_t stream);
void matmul_in_out_forward(float* out, const float* x, const float* weight, const float* bias, int rows,
                           int in_features, int out_features, bool accumulate, const int32_t* run_if,
                           cudaStream_t stream);

// The same (bf16 weight), and each row's argmax over its out_features outputs
// (greedy token selection fused into the sequential head's vocabulary matmul):
// argmax_keys[row] (zeroed before) receives, by atomicMax, a key that orders by
// value and then by the smaller index; argmax_tokens_forward turns keys into
// indices (-1 for a key never written).
void matmul_in_out_argmax_forward(float* out, const float* x, const __nv_bfloat16* weight, const float* bias,
                                  int rows, int in_features, int out_features, bool accumulate,
                                  unsigned long long* argmax_keys, const int32_t* run_if, cudaStream_t stream);
void argmax_tokens_forward(int32_t* tokens, const unsigned long long* argmax_keys, int count, cudaStream_t stream);

// ---- training: general products of f32 (or bf16) matrices, f32 results ----
//
// How f32 operands are multiplied: F32 is plain single precision (FMA, no
// tensor cores: the parity tests); TF32 runs the tensor cores on operands
// rounded to TF32 (10-bit mantissa), accumulating in f32. bf16 operands always
// accumulate in f32.
enum class GemmMath { F32, TF32 };

// Row-major C [m, n] (leading dimension ldc) = op(A) @ op(B) + beta * C, through
// cuBLASLt: op(A) [m, k] is A stored [m, k] (lda), or its transpose when
// transpose_a (A stored [k, m]); op(B) [k, n] likewise. A and B are both f32, or
// both bf16 (bf16_operands); C is f32. beta 0: C is not read. m, n or k of 0
// does nothing (with k = 0, C is left as it was). Deterministic: a shape's
// algorithm is chosen once by cuBLASLt's heuristic (with the pointers'
// alignments) and cached.
void gemm(float* c, long ldc, const void* a, long lda, bool transpose_a, const void* b, long ldb, bool transpose_b,
          int m, int n, int k, float beta, bool bf16_operands, GemmMath math, cudaStream_t stream);

// CUDA versions of cpu::matmul_in_out_forward / backward (f32, weight stored [in, out]):
// out [rows, out] = x [rows, in] @ weight;  dx += dout @ weight^T, dweight += x^T @ dout
// (a null gradient is skipped; the backward accumulates, as on the CPU).
void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features, GemmMath math, cudaStream_t stream);
void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight,
                            int rows, int in_features, int out_features, GemmMath math, cudaStream_t stream);

}  // namespace dspark::cuda
