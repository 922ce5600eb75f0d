// Choosing tokens from logits on the GPU (CUDA version of
// kernels/cpu/sampling.h), so a decode step copies back only token ids.
// The parameters live in device memory so that one captured CUDA graph serves
// every temperature / top-k / top-p setting.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

struct DeviceSamplingParams {
  float temperature;  // <= 0: greedy
  int top_k;          // 0: off
  float top_p;        // >= 1: off
};

// out[r] = argmax(logits[r]) when greedy (first index on ties), else the
// token of the processed distribution (temperature, top-k with ties kept,
// top-p) whose cumulative interval, in index order, holds uniforms[r].
// logits [rows, vocab] f32.
void select_tokens_forward(int32_t* out, const float* logits, const float* uniforms,
                           const DeviceSamplingParams* params, int rows, int vocab, cudaStream_t stream);

// out[r] = -log softmax(logits[r])[targets[r]]
void token_nll_forward(float* out, const float* logits, const int32_t* targets, int rows, int vocab,
                       cudaStream_t stream);

}  // namespace dspark::cuda
