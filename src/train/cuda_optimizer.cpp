#include "train/cuda_optimizer.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/reduce.h"

namespace dspark {

CudaAdamW::CudaAdamW(const CudaParameterLayout& layout, const AdamWOptions& options, cudaStream_t stream)
    : layout_(layout), options_(options), stream_(stream) {
  first_.resize(layout.total);
  second_.resize(layout.total);
  norm_.resize(1 + cuda::kSquareBlocks);
  CUDA_CHECK(cudaMemsetAsync(first_.data(), 0, first_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(second_.data(), 0, second_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(norm_.data(), 0, norm_.bytes(), stream_));
}

void CudaAdamW::step(float* parameters, const float* gradients, double learning_rate, double clip_norm,
                     const double* loss) {
  DSPARK_CHECK(clip_norm > 0, "the clip norm must be positive");
  ++steps_;
  // The scalars exactly as AdamW::step computes them.
  const double correction1 = 1.0 - std::pow(options_.beta1, double(steps_));
  const double correction2 = 1.0 - std::pow(options_.beta2, double(steps_));
  cuda::AdamWUpdate update;
  update.step_size = static_cast<float>(learning_rate / correction1);
  update.correction2_root = static_cast<float>(std::sqrt(correction2));
  update.beta1 = static_cast<float>(options_.beta1);
  update.beta2 = static_cast<float>(options_.beta2);
  update.keep1 = static_cast<float>(1.0 - options_.beta1);
  update.keep2 = static_cast<float>(1.0 - options_.beta2);
  update.epsilon = static_cast<float>(options_.epsilon);
  update.shrink = static_cast<float>(1.0 - learning_rate * options_.weight_decay);
  update.max_norm = clip_norm;
  cuda::sum_of_squares(norm_.data(), gradients, layout_.total, norm_.data() + 1, stream_);
  cuda::adamw_update(parameters, first_.data(), second_.data(), gradients, layout_.total, layout_.decayed, update,
                     norm_.data(), loss, stream_);
}

double CudaAdamW::last_gradient_norm() const {
  double squared = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&squared, norm_.data(), sizeof squared, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return std::sqrt(squared);
}

void CudaAdamW::download(TensorMap& first, TensorMap& second) const {
  std::vector<float> flat(layout_.total);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(flat.data(), first_.data(), first_.bytes(), cudaMemcpyDeviceToHost));
  layout_.unpack(flat, first);
  CUDA_CHECK(cudaMemcpy(flat.data(), second_.data(), second_.bytes(), cudaMemcpyDeviceToHost));
  layout_.unpack(flat, second);
}

void CudaAdamW::restore(long steps, const TensorMap& first, const TensorMap& second) {
  const std::vector<float> first_flat = layout_.pack(first), second_flat = layout_.pack(second);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(first_.data(), first_flat.data(), first_.bytes(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(second_.data(), second_flat.data(), second_.bytes(), cudaMemcpyHostToDevice));
  steps_ = steps;
}

}  // namespace dspark
