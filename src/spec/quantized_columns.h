// The Markov head's markov.w2 [r, V] prepared for the GPU's greedy head that
// returns tokens without logits (cuda::markov_position_tokens_forward):
// position k's token is argmax_v (U_k[v] + e_k . w2[:, v]), and at Qwen3-8B's
// vocabulary each position reads all of w2 (78 MB at r 256) for it.
//
// Each column v is kept in 8 bits with its own scale, w2[:, v] ~ scale_v *
// q[:, v], together with a bound on what that leaves out:
//   |e . w2[:, v] - scale_v * (e . q[:, v])| <= bound_v * ||e||_2
// (Cauchy-Schwarz on the column's rounding residual, plus slack for every f32
// rounding the kernel and the exact product make). A pass over the 8-bit
// columns (half the bytes) gives every logit within a known interval; only
// the columns whose interval reaches the best lower end can hold the argmax,
// and those get the exact bf16 product, summed in the order of the full
// kernel: the same token, bit for bit, as the product over all of w2.
#pragma once
#include <cstdint>
#include <vector>

namespace dspark {

struct QuantizedColumns {
  int rank = 0, vocab = 0;
  int stride = 0;               // the row length of `values`: vocab rounded up to 16 (16-byte rows)
  std::vector<uint8_t> values;  // [rank, stride] q + 128, q = round(w / scale) in -127..127; 128 past vocab
  std::vector<float> scales;    // [vocab] max_i |w[i, v]| / 127 (0 for a zero column)
  std::vector<float> bounds;    // [vocab] bound_v above
  std::vector<uint16_t> exact;  // [vocab, rank] bf16 bits of w[:, v], slice-major: feature s + 8j at s * rank/8 + j
};

// Relative slack the bounds (and the kernel's interval ends) allow for f32
// rounding: 2^-12, ~4000 units in the last place, where the sums of at most
// a few hundred terms need a few hundred.
constexpr double kQuantizedSlack = 1.0 / 4096.0;

// w [rank, vocab] as the GPU holds it (each value rounded to bf16 first);
// rank a multiple of 8. (kernels/cuda/quantized_product.h's rows are these
// columns with a larger slack: its products have thousands of terms.)
QuantizedColumns quantize_columns(const float* w, int rank, int vocab, double slack = kQuantizedSlack);

}  // namespace dspark
