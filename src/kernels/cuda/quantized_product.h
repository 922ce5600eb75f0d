// Products read at 8 bits with a bound on what that leaves out, for greedy
// token selection, which needs an exact value only where the maximum can be:
// the drafter's LM head at one row (its logits U_k = h_k . w_v for γ block
// positions, v over the vocabulary). At Qwen3-8B's shape that product reads
// 1.2 GB of bf16 weights a draft step; these read the 8-bit rows (half the
// bytes) and put every U_k[v] in a known interval. The Markov head's
// tokens-only kernel (draft.h) then forms the exact U_k[v], with the bits of
// the LM head's own product (the tensor-core GEMV, tensor_gemv.cuh), only for
// the columns whose interval reaches the best lower end.
//
// The bound. Row v is kept as scale_v * q_v (q_v 8-bit, scale_v = max|w_v| /
// 127) and the activation row h as h' = s (q1 + q2 / 254) (two 8-bit levels,
// s = max|h| / 127), so that
//   h . w_v - scale_v (h' . q_v) = h . r_v + (h - h') . (scale_v q_v)
// (r_v = w_v - scale_v q_v), and by Cauchy-Schwarz
//   |U[v] - center[v]| <= ||h||_2 bounds[v] + ||h - h'||_2 norms[v],
// with bounds[v] = ||r_v|| plus `slack` (||w_v|| + ||r_v||) for the f32
// rounding of the exact product and of the center (the tensor cores' sums of
// 4096 terms are good to ~2^-14 of ||h|| ||w_v||; slack 2^-10 is kept), and
// norms[v] = ||scale_v q_v||, each rounded up. q . q1 and q . q2 are exact
// (int32 sums of the tensor cores' 8-bit products).
//
// Through the drafter's projection. The drafter's U_k is W y_k with y_k =
// bf16(P x_k) (x_k [D] its out_proj input, P [H, D] out_proj): the same
// logits come from M x_k, M = W P [V, D] (made once, in double), whose 8-bit
// rows are a quarter of W's bytes at Qwen3-8B's shape (D 1024, H 4096), with
// tighter intervals (a row of 1024 terms, not 4096). What that leaves out:
//   W_v y_k - M_v x_k = W_v (y_k - P x_k)  (M exact up to its f32 rounding,
//   inside the slack), at most ||W_v|| ||y_k - P x_k|| by Cauchy-Schwarz,
// plus the exact product's own f32 rounding, slack ||W_v|| ||y_k||.
// lm_head_projection_reach_forward recomputes P x_k in double at each step
// and turns both into the third activation norm: the intervals then reach
// ||x|| bounds[v] + ||x - x'|| norms[v] + reach_k.
//
// Shape letters: V weight rows (the vocabulary), H row length (a multiple of
// 32), R activation rows (at most kQuantizedActivationRows), D the
// projection's input width.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

// The slack the bounds keep for f32 rounding in products of a few thousand terms.
constexpr double kQuantizedProductSlack = 1.0 / 1024.0;

// The weight rows at 8 bits (quantize_rows_forward fills them).
struct QuantizedRows {
  int8_t* values;  // [V, H] q, w[v, i] ~ scales[v] * q[v, i], q in -127..127
  float* scales;   // [V] max_i |w[v, i]| / 127 (0 for a zero row or one with a non-finite weight)
  float* bounds;   // [V] ||r_v|| + slack (||w_v|| + ||r_v||), rounded up; infinite where w_v is not finite
  float* norms;    // [V] ||scales[v] q_v||, rounded up
};

// weight [V, H] (bf16 or f32) into `rows`. q_v, scale_v and the bound are
// those of spec/quantized_columns.h's quantize_columns on the transposed
// matrix with this slack (q and scales bit for bit; the norms summed in
// another order).
template <class T>
void quantize_rows_forward(const QuantizedRows& rows, const T* weight, int row_count, int row_length, double slack,
                           cudaStream_t stream);

// out [V, D] f32 = lm_head [V, H] @ projection [H, D], summed in double.
void lm_head_through_projection_forward(float* out, const __nv_bfloat16* lm_head, const __nv_bfloat16* projection,
                                        int V, int H, int D, cudaStream_t stream);

// *largest = the largest ||weight_v||_2 over the rows, rounded up, as f32 bits.
void largest_row_norm_forward(unsigned* largest, const __nv_bfloat16* weight, int row_count, int row_length,
                              cudaStream_t stream);

constexpr int kQuantizedActivationRows = 8;  // one tensor-core tile of activation rows

// Activation rows at two 8-bit levels (quantize_activation_rows_forward).
struct QuantizedActivations {
  int8_t* values;  // [2, kQuantizedActivationRows, H] q1 then q2; rows past R are zero
  float* scales;   // [kQuantizedActivationRows] s of each row
  float* norms;    // [3, kQuantizedActivationRows] ||h||_2, ||h - h'||_2, then a reach beyond the product's own
                   // bound (0, or lm_head_projection_reach_forward's), rounded up
};

// x [R, H] bf16 into `out` (all kQuantizedActivationRows rows written).
void quantize_activation_rows_forward(const QuantizedActivations& out, const __nv_bfloat16* x, int rows, int row_length,
                                      cudaStream_t stream);

// Through the projection (above): out.norms' third part, reach_k = largest_norm (||y_k - P x_k|| + slack
// ||y_k||) for x [R, D] bf16, projection P [H, D] bf16, y [R, H] bf16 the rows the exact product reads. sums
// [2 * kQuantizedActivationRows] double and finished (one unsigned) zeroed once; each call leaves them zeroed.
// After quantize_activation_rows_forward (which zeroes that part).
bool lm_head_projection_reach_supported(int D, int H);  // D a multiple of 8, H of 32, x in shared memory
void lm_head_projection_reach_forward(const QuantizedActivations& out, const __nv_bfloat16* x,
                                      const __nv_bfloat16* projection, const __nv_bfloat16* y, int rows, int D, int H,
                                      const unsigned* largest_norm, double* sums, unsigned* finished,
                                      cudaStream_t stream);

// centers [R, V]: centers[k, v] = scales[v] * s_k * (q_v . q1_k + q_v . q2_k / 254) in double, rounded to f32.
void quantized_rows_product_forward(float* centers, const QuantizedRows& weight, const QuantizedActivations& x,
                                    int rows, int row_length, int row_count, cudaStream_t stream);

}  // namespace dspark::cuda
