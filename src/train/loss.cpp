#include "train/loss.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/softmax.h"

namespace dspark {
namespace {

constexpr float kConfidenceFloor = 1e-6f;  // c is clipped to [1e-6, 1 - 1e-6] inside the BCE

}  // namespace

LossTerms drafter_loss(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                       const LossWeights& weights, Gradients* gradients, LossWorkspace& work) {
  DrafterActivations& act = work.activations;
  drafter_training_forward(drafter, head, batch, act);
  const int A = batch.size(), gamma = drafter.config.gamma, H = drafter.dims.hidden_size;
  const int V = drafter.dims.vocab_size, rows = A * gamma;
  auto block_row = [&](long head_row) { return head_row % A * gamma + head_row / A; };  // k·A + a -> a·γ + k

  // p_d = softmax(L); p_t = softmax(lm_head(target row)), both in head-row order.
  float* target_rows = grow(work.target_rows, size_t(rows) * H);
  for (long row = 0; row < rows; ++row)
    std::copy_n(batch.target_hidden.data() + block_row(row) * H, H, target_rows + row * H);
  float* target = grow(work.target, size_t(rows) * V);
  cpu::matmul_forward(target, target_rows, head.lm_head, nullptr, rows, H, V);
  cpu::softmax_forward(target, target, rows, V);
  float* probabilities = grow(work.probabilities, size_t(rows) * V);
  float* log_normalizers = grow(work.log_normalizers, size_t(rows));
  cpu::softmax_forward(probabilities, act.logits.data(), rows, V, log_normalizers);

  // Per trained position: its weight w_k·mask / Σ w·mask, CE, L1, the label c* and the BCE.
  float* position_weights = grow(work.position_weights, size_t(rows));
  double total_weight = 0.0;
  for (long row = 0; row < rows; ++row) {
    const float mask = batch.mask[block_row(row)];
    position_weights[row] =
        mask > 0.0f ? static_cast<float>(std::exp(-double(row / A) / weights.gamma_decay)) * mask : 0.0f;
    total_weight += position_weights[row];
  }
  const double normalizer = total_weight > 0.0 ? 1.0 / total_weight : 0.0;  // nothing trained: every weight 0
  for (long row = 0; row < rows; ++row) position_weights[row] = static_cast<float>(position_weights[row] * normalizer);
  const bool hold = work.hold_for_gradient_check;
  DSPARK_CHECK(!hold || work.signs.size() >= size_t(rows) * V, "loss: nothing to hold for a gradient check yet");
  float* l1 = grow(work.l1, size_t(rows));
  float* labels = grow(work.labels, size_t(rows));
  int8_t* signs = grow(work.signs, size_t(rows) * V);
  LossTerms terms;
  for (long row = 0; row < rows; ++row) {
    if (position_weights[row] == 0.0f) continue;  // masked
    const float* p = probabilities + row * V;
    const float* t = target + row * V;
    int8_t* sign = signs + row * V;
    double distance = 0.0;  // Σ |p_d - p_t| = Σ sign·(p_d - p_t)
    for (int i = 0; i < V; ++i) {
      if (!hold) sign[i] = p[i] > t[i] ? 1 : p[i] < t[i] ? -1 : 0;
      distance += sign[i] * (double(p[i]) - t[i]);
    }
    l1[row] = static_cast<float>(distance);
    if (!hold) labels[row] = 1.0f - 0.5f * l1[row];
    const double weight = position_weights[row], label = labels[row];
    const double c = std::clamp(act.confidence[row], kConfidenceFloor, 1.0f - kConfidenceFloor);
    terms.ce += weight * (log_normalizers[row] - act.logits[row * V + batch.targets[block_row(row)]]);
    terms.l1 += weight * distance;
    terms.bce -= weight * (label * std::log(c) + (1.0 - label) * std::log(1.0 - c));
    ++terms.positions;
  }
  terms.loss = weights.ce * terms.ce + weights.l1 * terms.l1 + weights.bce * terms.bce;

  // τ̂ = 1 + Σ_j Π_{i<=j} (1 - L1_i / 2) over an anchor's trained positions, averaged over anchors that have any.
  int anchors_trained = 0;
  for (int a = 0; a < A; ++a) {
    double survival = 1.0, tau = 1.0;
    bool trained = false;
    for (int k = 0; k < gamma; ++k) {
      if (position_weights[long(k) * A + a] == 0.0f) continue;  // masked
      survival *= 1.0 - 0.5 * l1[long(k) * A + a];
      tau += survival;
      trained = true;
    }
    if (trained) terms.tau_estimate += tau, ++anchors_trained;
  }
  if (anchors_trained > 0) terms.tau_estimate /= anchors_trained;
  if (!gradients || terms.positions == 0) return terms;

  // dLoss/dL per position: ce·(p_d - onehot(x*)) + l1·softmax_backward(sign(p_d - p_t)), times the weight;
  // dLoss/d(confidence logit) = bce·(c - c*) times the weight (zero where the clip holds c).
  float* d_logits = grow(act.logits_gradient, size_t(rows) * V);
  float* d_confidence = grow(act.confidence_gradient, size_t(rows));
  float* d_probabilities = grow(work.d_probabilities, size_t(V));
  for (long row = 0; row < rows; ++row) {
    float* d_row = d_logits + row * V;
    std::fill_n(d_row, V, 0.0f);
    d_confidence[row] = 0.0f;
    const float weight = position_weights[row];
    if (weight == 0.0f) continue;  // masked
    const float* p = probabilities + row * V;
    const int8_t* sign = signs + row * V;
    const float ce = weights.ce * weight, l1 = weights.l1 * weight;
    for (int i = 0; i < V; ++i) {
      d_row[i] = ce * p[i];
      d_probabilities[i] = l1 * sign[i];
    }
    d_row[batch.targets[block_row(row)]] -= ce;
    cpu::softmax_backward(d_row, d_probabilities, p, 1, V);
    const float c = act.confidence[row];
    if (c >= kConfidenceFloor && c <= 1.0f - kConfidenceFloor)
      d_confidence[row] = weights.bce * weight * (c - labels[row]);
  }
  drafter_backward(drafter, head, batch, act, *gradients);
  return terms;
}

}  // namespace dspark
