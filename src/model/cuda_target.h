// The CUDA target: bf16 weights and activations with f32 accumulation, a paged
// KV cache shared by all sequences, and decode / verify steps replayed from
// captured CUDA graphs (see cuda_target.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <filesystem>
#include <memory>
#include <optional>

#include "model/target.h"

namespace dspark {

std::unique_ptr<Target> make_cuda_target(const std::filesystem::path& model_directory);

// What a CUDA drafter borrows from a CUDA target instead of uploading copies:
// the device embedding and LM head (bf16), valid while the target lives.
struct CudaTargetHead {
  const __nv_bfloat16* embedding = nullptr;  // [V, H]
  const __nv_bfloat16* lm_head = nullptr;    // [V, H]; the embedding itself when tied
  cudaStream_t stream = nullptr;             // the target's stream (benchmarks time its steps on it)
};

// The head of `target` when it is a CUDA target; nullopt otherwise.
std::optional<CudaTargetHead> cuda_target_head(const Target& target);

}  // namespace dspark
