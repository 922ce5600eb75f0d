// AdamW and clipping by global norm on the GPU (the CUDA version of
// train/optimizer.h's AdamW and clip_gradients_by_global_norm) over the flat
// device arrays of a CudaDrafterLoss (train/cuda_loss.h): the moments live on
// the device next to the f32 master weights; a step launches two small
// reductions and one update kernel, and the host learns the gradient norm
// only when it asks (one copy of a double).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/buffer.h"
#include "train/cuda_loss.h"
#include "train/optimizer.h"

namespace dspark {

class CudaAdamW {
 public:
  // Moments start at zero; `stream` is the loss's.
  CudaAdamW(const CudaParameterLayout& layout, const AdamWOptions& options, cudaStream_t stream);

  // One step on the stream: the global norm of `gradients`, then AdamW at
  // learning_rate on the gradients scaled to clip_norm when the norm exceeds it
  // (as clip_gradients_by_global_norm + AdamW::step). When *loss (device) is not
  // finite the weights and moments are left as they are (the step count still
  // advances: the host stops the run).
  void step(float* parameters, const float* gradients, double learning_rate, double clip_norm, const double* loss);
  // The last step's gradient norm before clipping (waits for the stream).
  double last_gradient_norm() const;
  const double* device_squared_norm() const { return norm_.data(); }

  long steps() const { return steps_; }
  // The moments as host tensors by name (waits for the stream).
  void download(TensorMap& first, TensorMap& second) const;
  // Puts back a checkpoint's step count and moments (AdamW::restore's).
  void restore(long steps, const TensorMap& first, const TensorMap& second);

 private:
  const CudaParameterLayout& layout_;
  AdamWOptions options_;
  cudaStream_t stream_;
  long steps_ = 0;
  cuda::DeviceBuffer<float> first_, second_;
  cuda::DeviceBuffer<double> norm_;  // [1 + kSquareBlocks]: Σ g², then the partial sums
};

}  // namespace dspark
