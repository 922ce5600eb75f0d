// Softmax over the last axis, per row: probs, logits [rows, dim] (may alias).
#pragma once

namespace dspark::cpu {

// probs = softmax(logits), max-subtracted, the normaliser summed in double.
// log_normalizers [rows] (null: not wanted) = log sum exp(logits), so that
// log probs[i] = logits[i] - log_normalizer without the underflow of log(probs[i]).
void softmax_forward(float* probs, const float* logits, int rows, int dim, float* log_normalizers = nullptr);

// Given dprobs (dL/dprobs) and the forward's output probs:
// dlogits += probs ⊙ (dprobs - <probs, dprobs>), per row.
void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int rows, int dim);

}  // namespace dspark::cpu
