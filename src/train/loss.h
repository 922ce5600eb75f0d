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
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/train_batch.h"

namespace dspark {

struct LossWeights {
  float ce = 0.1f;
  float l1 = 0.9f;
  float bce = 1.0f;
  float gamma_decay = 7.0f;  // w_k = exp(-k / gamma_decay)
};

struct LossTerms {
  double loss = 0.0;          // ce·CE + l1·L1 + bce·BCE
  double ce = 0.0, l1 = 0.0, bce = 0.0;
  double tau_estimate = 0.0;  // mean over anchors of 1 + Σ_j Π_{i<=j} (1 - L1_i / 2), over unmasked positions
  long positions = 0;         // trained (unmasked) positions
};

// Gradients by parameter name, shaped like drafter.parameters.
using Gradients = std::map<std::string, Tensor>;
Gradients zero_gradients(const Drafter& drafter);

// Activations kept for the backward pass, reused across calls.
struct LossWorkspace {
  std::vector<float> scratch;
};

// The loss of `batch`; when `gradients` is non-null, also dL/dθ, accumulated (+=).
LossTerms drafter_loss(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                       const LossWeights& weights, Gradients* gradients, LossWorkspace& workspace);

}  // namespace dspark
