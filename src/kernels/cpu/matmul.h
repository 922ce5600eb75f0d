// Matrix products of activations with weights.
// Shapes: x [rows, in], weight [out, in] (the PyTorch nn.Linear layout, as
// stored in HF checkpoints), bias [out] or null, out [rows, out].
// Backward passes accumulate (+=) into every gradient they are given; a null
// gradient pointer is skipped (a frozen weight, or an input that needs none).
//
// The forwards take one of two paths by row count. Up to kSmallRowsMax rows
// (decode, verifying a draft block, drafting) an own kernel streams each weight row
// once and applies it to every activation row while it sits in L1, split over
// output features across a small persistent pool of threads. Above that
// (prefill, training) OpenBLAS sgemm, whose packing of the weight then pays
// for itself. Both accumulate in f32; their summation orders differ. A bf16
// weight's packed bits (weight_bf16 below) take the own kernel at every row
// count.
#pragma once
#include <cstdint>
#include <vector>

namespace dspark::cpu {

// The largest row count the forwards hand to the small-row kernel with f32
// weights (bf16 ones take it at every row count, below). Measured on
// a 2-core AMD EPYC (Zen 4) over all matmuls of the 19M target's forward: the
// kernel is 1.7-2.9x faster than OpenBLAS at 1-16 rows, still ~1.2x at 48-64,
// about even at 96-128 (docs/PERF.md, CPU section); sgemm keeps prefill.
inline constexpr int kSmallRowsMax = 64;

// out = x @ weight^T (+ bias)
void matmul_forward(float* out, const float* x, const float* weight, const float* bias, int rows, int in_features,
                    int out_features);

// The same, given also weight_bf16: the same weight's bf16 bit patterns as
// pack_bf16_rows lays them out, or null. The small-row kernel then reads the
// bits, half the bytes of the f32 weight, and sums the products of each
// output in the order of `in` (an FMA per input), then adds the bias: the
// same bits for every row count, and on every instruction set with FMA.
// With bf16_products() on, x is first rounded to bf16 (to nearest even), so
// that every product is exact: the same bits on every instruction set, and
// on a CPU with AVX-512 BF16 one instruction multiplies a pair of inputs into
// 16 features, twice the multiply-adds of an f32 FMA. Every row count takes
// this kernel, prefill too: a row's result never depends on the rows it is
// batched with (sgemm's can, by its blocking; with bf16 products a last-bit
// difference flips an activation's rounding, and a batched plain decode
// differed from speculative decoding's until prefill left sgemm), and at
// 64-128 rows it ran 1.3x faster than sgemm on the f32 widening anyway.
void matmul_forward(float* out, const float* x, const float* weight, const uint16_t* weight_bf16, const float* bias,
                    int rows, int in_features, int out_features);

// An [out, in] weight's bf16 bit patterns laid out for matmul_forward's
// weight_bf16 when every element is a bf16 value (core/dtype.h, exact_bf16),
// else empty. Output features go in panels of 16, zero-padded; in a panel,
// each pair of inputs (2k, 2k + 1) has a 32-bit word per feature, input 2k's
// weight in its high half and 2k + 1's in its low half (zero past the last
// input). A tile of output features then streams its panels front to back,
// and AVX-512 BF16's dot product of a weight word with an activation word
// adds input 2k's product before 2k + 1's.
std::vector<uint16_t> pack_bf16_rows(const float* weight, int out_features, int in_features);
// The same panels for an [in, out] weight (matmul_in_out_forward's).
std::vector<uint16_t> pack_bf16_columns(const float* weight, int in_features, int out_features);

// What matmul_forward takes for weight_bf16: the bits, or null for none.
inline const uint16_t* bf16_or_null(const std::vector<uint16_t>& bits) { return bits.empty() ? nullptr : bits.data(); }

// dx [rows, in] += dout @ weight;  dweight [out, in] += dout^T @ x.  dout [rows, out].
void matmul_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                     int in_features, int out_features);

// out = x @ weight, with weight stored [in, out] (the drafter's layout).
void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features);
// The same given also the weight's bf16 bits in pack_bf16_columns' panels, or
// null: then summed exactly as matmul_forward's.
void matmul_in_out_forward(float* out, const float* x, const float* weight, const uint16_t* weight_bf16, int rows,
                           int in_features, int out_features);

// dx [rows, in] += dout @ weight^T;  dweight [in, out] += x^T @ dout.  dout [rows, out].
void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                            int in_features, int out_features);

// The two paths of each forward, for the benchmark (bench/matmul_benchmark.cpp)
// and the tests, which run each on shapes the dispatch would not give it.
// The small-row kernels take any row count; they are fast for few rows. The
// one for bf16 panels serves either layout's (pack_bf16_rows, _columns).
void matmul_forward_small_rows(float* out, const float* x, const float* weight, const float* bias, int rows,
                               int in_features, int out_features);
void matmul_forward_small_rows(float* out, const float* x, const uint16_t* weight, const float* bias, int rows,
                               int in_features, int out_features);
void matmul_in_out_forward_small_rows(float* out, const float* x, const float* weight, int rows, int in_features,
                                      int out_features);
// OpenBLAS: sgemv for one row, sgemm otherwise.
void matmul_forward_blas(float* out, const float* x, const float* weight, const float* bias, int rows, int in_features,
                         int out_features);
void matmul_in_out_forward_blas(float* out, const float* x, const float* weight, int rows, int in_features,
                                int out_features);

// Products with bf16 weights round their activations to bf16 first (as HF
// transformers and the CUDA path compute a bf16 model), process-wide, when
// on. Off by default: the CPU path is the f32 reference (DESIGN.md). `dspark
// --bf16-products` turns it on.
void set_bf16_products(bool on);
bool bf16_products();

// Threads the small-row kernels split a product over: the calling thread plus
// the pool's workers (openblas_get_num_threads() in all, read once).
int matmul_threads();

// The instruction sets the small-row kernels are compiled for. The widest the
// CPU supports is used unless set_matmul_isa picks a narrower one (tests run
// every supported one; the benchmark compares them). Asking for one the CPU
// lacks fails.
// SSE2; AVX2 + FMA (x86-64-v3); AVX-512 (x86-64-v4); AVX-512 BF16, which
// only products of bf16 weights with bf16_products() on use (every other
// kernel is AVX-512's), with the same result bits as AVX-512; and AMX
// (AVX-512 BF16 with Intel's tile multiply, where Linux grants it), which
// runs those products when in_features is a multiple of 32 (the rest as
// AVX-512 BF16) at the same cost for 1 to 16 rows, with bits of its own
// (matmul.cpp): a row's bits still do not depend on the rows beside it.
enum class MatmulIsa { Baseline, Avx2, Avx512, Avx512Bf16, Amx };
// Every one of them, narrowest first (for tests and benchmarks that try each).
constexpr MatmulIsa kMatmulIsas[] = {MatmulIsa::Baseline, MatmulIsa::Avx2, MatmulIsa::Avx512, MatmulIsa::Avx512Bf16,
                                     MatmulIsa::Amx};
MatmulIsa matmul_isa();
bool matmul_isa_supported(MatmulIsa isa);
void set_matmul_isa(MatmulIsa isa);
const char* matmul_isa_name(MatmulIsa isa);

// Of one kernel compiled three times (for AVX-512, AVX2 and the baseline),
// the version for the instruction set in use.
template <class Function>
Function for_matmul_isa(Function avx512, Function avx2, Function baseline) {
  const MatmulIsa isa = matmul_isa();
  return isa >= MatmulIsa::Avx512 ? avx512 : isa == MatmulIsa::Avx2 ? avx2 : baseline;
}

}  // namespace dspark::cpu
