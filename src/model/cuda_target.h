// The CUDA target: bf16 weights and activations with f32 accumulation, a paged
// KV cache shared by all sequences, and decode / verify steps replayed from
// captured CUDA graphs (see cuda_target.cpp).
#pragma once
#include <filesystem>
#include <memory>

#include "model/target.h"

namespace dspark {

std::unique_ptr<Target> make_cuda_target(const std::filesystem::path& model_directory);

}  // namespace dspark
