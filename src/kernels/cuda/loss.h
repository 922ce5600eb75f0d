// The DSpark training loss on the GPU (DESIGN.md §4, Eq 8-12; the CUDA version
// of the loss part of train/loss.cpp), fused: one kernel walks each trained
// position's two vocabulary-wide rows (the drafter's logits L and the target's
// logits T) three times (max and normaliser, L1 and its softmax dot, the
// gradient), never storing either distribution; a second, one-block kernel
// sums the terms in a fixed order.
//
// Per row (a trained position, in head order k·A + a), with w its weight
// w_k·mask / Σ w·mask (0 where masked) and p_d = softmax(L), p_t = softmax(T):
//   CE = log Σ exp(L) - L[x*],  L1 = Σ |p_d - p_t|,  c* = 1 - L1 / 2,
//   dLoss/dL = w·(ce·(p_d - onehot(x*)) + l1·p_d ⊙ (s - <p_d, s>)), s = sign(p_d - p_t),
//   dLoss/d(confidence logit) = w·bce·(c - c*) where c is not clipped, else 0.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

struct DrafterLossWeights {
  float ce, l1, bce;  // the terms' weights in the loss
};

// Values per row in row_terms [rows, kRowTerms].
constexpr int kRowTerms = 3;  // CE, L1, c*
// Doubles drafter_loss_terms writes.
constexpr int kLossTerms = 6;  // loss, CE, L1, BCE, τ̂, trained positions

// logits, target_logits [rows, V] f32; targets [rows]; position_weights [rows];
// confidence [rows] (σ of the confidence logit). Writes row_terms (0 where
// masked) and, with gradients: dlogits [rows, V] (f32; zeros where masked),
// dlogits_bf16 (the same in bf16, when not null) and dconfidence [rows].
void drafter_loss_rows(float* row_terms, float* dlogits, __nv_bfloat16* dlogits_bf16, float* dconfidence,
                       const float* logits, const float* target_logits, const int32_t* targets,
                       const float* position_weights, const float* confidence, int rows, int vocab,
                       const DrafterLossWeights& weights, bool gradients, cudaStream_t stream);

// terms [kLossTerms] = {loss, CE, L1, BCE, τ̂, positions}: each term the weighted
// sum Σ w·term over trained rows (BCE from c clipped to [1e-6, 1 - 1e-6] and c*);
// τ̂ the mean over anchors with any trained position of 1 + Σ_j Π_{i<=j} (1 - L1_i / 2).
// Rows are head order: anchor a's position k is row k·A + a.
void drafter_loss_terms(double* terms, const float* row_terms, const float* position_weights,
                        const float* confidence, int anchors, int gamma, const DrafterLossWeights& weights,
                        cudaStream_t stream);

}  // namespace dspark::cuda
