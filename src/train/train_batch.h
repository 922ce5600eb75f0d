// One training batch (DESIGN.md §4): A anchors drawn from regenerated
// sequences. For anchor position t of a sequence x (ids) with tapped rows:
//   context       the tapped rows [max(0, t - maxCtx), t): never row t itself,
//                 which at inference arrives only with the next verify;
//   anchor        x_t, the block's position 0 input;
//   targets       x*_k = x_{t+1+k} for k < γ;
//   target_hidden the post-final-norm row (the last tap) at t+k: the target's
//                 distribution for block position k is softmax(LM(row));
//   mask          1 where x_{t+1+k} exists, else 0 (the block runs off the end).
//
// The context rows come as f32 (context_rows; what the CPU loss reads) or, for
// the GPU, as the data's own bf16 bits (context_rows_bf16): half the bytes to
// move and no conversion on the host. Exactly one of the two is filled.
//
// Shape letters: A anchors, γ block, m taps, H target hidden.
#pragma once
#include <cstdint>
#include <vector>

namespace dspark {

struct TrainBatch {
  int gamma = 0;                          // γ
  int tap_width = 0;                      // m·H, one context row
  int hidden_size = 0;                    // H
  std::vector<int> context_offsets;       // [A + 1] anchor a's rows: [offsets[a], offsets[a+1])
  std::vector<float> context_rows;        // [offsets[A], m·H] (empty when context_rows_bf16 holds them)
  std::vector<uint16_t> context_rows_bf16;  // [offsets[A], m·H] bf16 bits, or empty
  std::vector<int32_t> anchors;           // [A] x_t
  std::vector<int32_t> targets;           // [A, γ] x_{t+1+k} (any valid id where masked)
  std::vector<float> target_hidden;       // [A, γ, H]
  std::vector<float> mask;                // [A, γ] 1 trained, 0 skipped

  int size() const { return static_cast<int>(anchors.size()); }
  int context_length(int a) const { return context_offsets[a + 1] - context_offsets[a]; }
};

}  // namespace dspark
