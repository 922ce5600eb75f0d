// The DSpark training loss (DESIGN.md §4, Eq 8-12) and its gradient with
// respect to every drafter parameter, computed by hand (no autograd).
//
// Per trained position (a, k), with w_k = exp(-k / γ_decay):
//   p_d = softmax(L_k) the drafter's distribution (teacher forced: position
//         k's head sees x*_{k-1}, the anchor at k = 0),
//   p_t = softmax(lm_head(target_hidden[a, k])) the target's,
//   CE  = -log p_d(x*_k),  L1 = ||p_d - p_t||_1,
//   BCE = BCE(clip(c_k, 1e-6, 1 - 1e-6), c*_k) with c*_k = 1 - L1 / 2 (no gradient through c*).
// Each term is a w·mask weighted mean over positions; L = ce·CE + l1·L1 + bce·BCE.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/drafter_backward.h"
#include "train/train_batch.h"

namespace dspark {

struct LossWeights {
  float ce = 0.1f;
  float l1 = 0.9f;
  float bce = 1.0f;
  float gamma_decay = 7.0f;  // w_k = exp(-k / gamma_decay)
};

struct LossTerms {
  double loss = 0.0;  // ce·CE + l1·L1 + bce·BCE
  double ce = 0.0, l1 = 0.0, bce = 0.0;
  // Mean over anchors of 1 + Σ_j Π_{i<=j} (1 - L1_i / 2), i and j over the anchor's unmasked
  // positions; anchors with none are left out of the mean.
  double tau_estimate = 0.0;
  long positions = 0;  // trained (unmasked) positions; 0: every term, τ̂ and the gradient are 0
};

// Gradients (by parameter name) and zero_gradients() are declared in
// train/drafter_backward.h.

// Activations kept for the backward, reused across calls. After a call,
// activations.logits [γ·A, V] and .confidence [γ·A] hold the drafter's outputs
// in head-row order (row k·A + a, see train/drafter_backward.h).
struct LossWorkspace {
  DrafterActivations activations;
  std::vector<float> target_rows;       // [γ·A, H] target_hidden in head-row order
  std::vector<float> probabilities;     // [γ·A, V] p_d
  std::vector<float> target;            // [γ·A, V] p_t
  std::vector<float> log_normalizers;   // [γ·A] log Σ exp(L)
  std::vector<float> position_weights;  // [γ·A] w_k·mask / Σ w·mask; 0 where masked
  std::vector<float> l1;                // [γ·A] ||p_d - p_t||_1
  std::vector<float> labels;            // [γ·A] c* = 1 - L1 / 2
  std::vector<int8_t> signs;            // [γ·A, V] sign(p_d - p_t): dL1/dp_d
  std::vector<float> d_probabilities;   // [V] scratch: dLoss/dp_d of one row
  // Gradient checks only: reuse `labels` and `signs` from the previous call.
  // The loss is then c* held constant, as the stop-gradient makes it, and L1
  // linearised as Σ sign·(p_d - p_t): smooth, with the same value and gradient
  // at the point where they were taken, so finite differences do not straddle
  // the kinks of |p_d - p_t| (frequent among the many tiny tail probabilities).
  bool hold_for_gradient_check = false;
};

// The loss of `batch`; when `gradients` is non-null, also dL/dθ, accumulated (+=).
// The target head is read, never copied, and gets no gradient. Throws
// dspark::Error when the batch does not fit the drafter (γ, widths, ids, sizes).
LossTerms drafter_loss(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                       const LossWeights& weights, Gradients* gradients, LossWorkspace& workspace);

}  // namespace dspark
