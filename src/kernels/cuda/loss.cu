#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/loss.h"

namespace dspark::cuda {
namespace {

constexpr int kRowThreads = 512;
constexpr int kTermThreads = 256;
constexpr float kConfidenceFloor = 1e-6f;  // c is clipped to [1e-6, 1 - 1e-6] inside the BCE

// Log Σ exp over the block's row: each thread keeps an online (max, sum), then
// the block agrees on the max and adds the rescaled sums.
__device__ float block_log_sum_exp(const float* row, int vocab, float* scratch) {
  float maximum = -INFINITY, total = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kRowThreads) {
    const float value = row[i];
    if (value > maximum) {
      total = total * expf(maximum - value) + 1.0f;
      maximum = value;
    } else {
      total += expf(value - maximum);
    }
  }
  const float block_maximum = block_max(maximum, scratch);
  total = maximum == -INFINITY ? 0.0f : total * expf(maximum - block_maximum);
  return block_maximum + logf(block_sum(total, scratch));
}

__global__ void __launch_bounds__(kRowThreads)
    loss_rows_kernel(float* row_terms, float* dlogits, bf16* dlogits_bf16, float* dconfidence, const float* logits,
                     const float* target_logits, const int32_t* targets, const float* position_weights,
                     const float* confidence, int vocab, DrafterLossWeights weights, bool gradients) {
  __shared__ float scratch[32];
  const long row = blockIdx.x;
  const float weight = position_weights[row];
  float* terms = row_terms + row * kRowTerms;
  if (weight == 0.0f) {  // masked: nothing, and no gradient
    if (threadIdx.x < kRowTerms) terms[threadIdx.x] = 0.0f;
    if (!gradients) return;
    if (threadIdx.x == 0) dconfidence[row] = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += kRowThreads) {
      dlogits[row * vocab + i] = 0.0f;
      if (dlogits_bf16) dlogits_bf16[row * vocab + i] = __float2bfloat16(0.0f);
    }
    return;
  }
  const float* drafted = logits + row * vocab;
  const float* target = target_logits + row * vocab;
  const float drafted_lse = block_log_sum_exp(drafted, vocab, scratch);
  const float target_lse = block_log_sum_exp(target, vocab, scratch);

  // L1 = Σ |p_d - p_t| and <p_d, s>, s = sign(p_d - p_t).
  float distance = 0.0f, dot = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kRowThreads) {
    const float p = expf(drafted[i] - drafted_lse), t = expf(target[i] - target_lse);
    const float sign = p > t ? 1.0f : p < t ? -1.0f : 0.0f;
    distance += sign * (p - t);
    dot += p * sign;
  }
  distance = block_sum(distance, scratch);
  dot = block_sum(dot, scratch);
  const float label = 1.0f - 0.5f * distance;
  const int x = targets[row];
  if (threadIdx.x == 0) {
    terms[0] = drafted_lse - drafted[x];
    terms[1] = distance;
    terms[2] = label;
  }
  if (!gradients) return;
  const float ce = weights.ce * weight, l1 = weights.l1 * weight;
  for (int i = threadIdx.x; i < vocab; i += kRowThreads) {
    const float p = expf(drafted[i] - drafted_lse), t = expf(target[i] - target_lse);
    const float sign = p > t ? 1.0f : p < t ? -1.0f : 0.0f;
    float gradient = ce * p + p * (l1 * sign - l1 * dot);
    if (i == x) gradient -= ce;
    dlogits[row * vocab + i] = gradient;
    if (dlogits_bf16) dlogits_bf16[row * vocab + i] = __float2bfloat16(gradient);
  }
  if (threadIdx.x == 0) {
    const float c = confidence[row];
    dconfidence[row] =
        c >= kConfidenceFloor && c <= 1.0f - kConfidenceFloor ? weights.bce * weight * (c - label) : 0.0f;
  }
}

// Tree sum over the block (kTermThreads, a power of two), in a fixed order.
__device__ double block_total(double value, double* scratch) {
  __syncthreads();  // scratch may still be read by the previous total
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int half = kTermThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) scratch[threadIdx.x] += scratch[threadIdx.x + half];
    __syncthreads();
  }
  return scratch[0];
}

__global__ void __launch_bounds__(kTermThreads)
    loss_terms_kernel(double* out, const float* row_terms, const float* position_weights, const float* confidence,
                      int anchors, int gamma, DrafterLossWeights weights) {
  __shared__ double scratch[kTermThreads];
  const int rows = anchors * gamma;
  double ce = 0.0, l1 = 0.0, bce = 0.0, positions = 0.0, tau_sum = 0.0, anchors_trained = 0.0;
  for (int row = threadIdx.x; row < rows; row += kTermThreads) {
    const double weight = position_weights[row];
    if (weight == 0.0) continue;  // masked
    const float* terms = row_terms + static_cast<long>(row) * kRowTerms;
    const double label = terms[2];
    const double c = fminf(fmaxf(confidence[row], kConfidenceFloor), 1.0f - kConfidenceFloor);
    ce += weight * terms[0];
    l1 += weight * terms[1];
    bce -= weight * (label * log(c) + (1.0 - label) * log(1.0 - c));
    positions += 1.0;
  }
  for (int a = threadIdx.x; a < anchors; a += kTermThreads) {
    double survival = 1.0, tau = 1.0;
    bool trained = false;
    for (int k = 0; k < gamma; ++k) {
      const long row = static_cast<long>(k) * anchors + a;
      if (position_weights[row] == 0.0f) continue;  // masked
      survival *= 1.0 - 0.5 * row_terms[row * kRowTerms + 1];
      tau += survival;
      trained = true;
    }
    if (trained) tau_sum += tau, anchors_trained += 1.0;
  }
  ce = block_total(ce, scratch);
  l1 = block_total(l1, scratch);
  bce = block_total(bce, scratch);
  positions = block_total(positions, scratch);
  tau_sum = block_total(tau_sum, scratch);
  anchors_trained = block_total(anchors_trained, scratch);
  if (threadIdx.x != 0) return;
  out[0] = double(weights.ce) * ce + double(weights.l1) * l1 + double(weights.bce) * bce;
  out[1] = ce;
  out[2] = l1;
  out[3] = bce;
  out[4] = anchors_trained > 0.0 ? tau_sum / anchors_trained : 0.0;
  out[5] = positions;
}

}  // namespace

void drafter_loss_rows(float* row_terms, float* dlogits, bf16* dlogits_bf16, float* dconfidence, const float* logits,
                       const float* target_logits, const int32_t* targets, const float* position_weights,
                       const float* confidence, int rows, int vocab, const DrafterLossWeights& weights,
                       bool gradients, cudaStream_t stream) {
  if (rows <= 0) return;
  loss_rows_kernel<<<rows, kRowThreads, 0, stream>>>(row_terms, dlogits, dlogits_bf16, dconfidence, logits,
                                                      target_logits, targets, position_weights, confidence, vocab,
                                                      weights, gradients);
  CUDA_CHECK_LAUNCH();
}

void drafter_loss_terms(double* terms, const float* row_terms, const float* position_weights,
                        const float* confidence, int anchors, int gamma, const DrafterLossWeights& weights,
                        cudaStream_t stream) {
  loss_terms_kernel<<<1, kTermThreads, 0, stream>>>(terms, row_terms, position_weights, confidence, anchors, gamma,
                                                     weights);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
