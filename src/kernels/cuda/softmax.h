// Softmax over the last axis on the GPU (CUDA versions of kernels/cpu/softmax.h), f32.
// The drafter's training loss fuses its softmaxes into one kernel (loss.h);
// these are the plain ops, one block per row.
#pragma once
#include <cuda_runtime.h>

namespace dspark::cuda {

// probs = softmax(logits) per row (may alias); log_normalizers [rows] (null: not wanted) = log Σ exp(logits).
void softmax_forward(float* probs, const float* logits, int rows, int dim, float* log_normalizers,
                     cudaStream_t stream);

// dlogits += probs ⊙ (dprobs - <probs, dprobs>), per row.
void softmax_backward(float* dlogits, const float* dprobs, const float* probs, int rows, int dim,
                      cudaStream_t stream);

}  // namespace dspark::cuda
