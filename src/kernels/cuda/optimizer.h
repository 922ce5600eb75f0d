// AdamW with clipping by global norm on the GPU (the CUDA version of
// train/optimizer.h's AdamW::step and clip_gradients_by_global_norm), over
// flat f32 arrays of every parameter, gradient and moment.
#pragma once
#include <cuda_runtime.h>

namespace dspark::cuda {

// One step's scalars, computed on the host in double as AdamW::step does.
struct AdamWUpdate {
  float step_size;         // lr / (1 - β1^t)
  float correction2_root;  // sqrt(1 - β2^t)
  float beta1, beta2;
  float keep1, keep2;  // 1 - β1, 1 - β2
  float epsilon;
  float shrink;     // 1 - lr·wd, applied to the decayed elements
  double max_norm;  // clip norm (> 0)
};

// With norm = sqrt(*squared_norm) (sum_of_squares of the gradients), each
// gradient is first scaled by float(max_norm / (norm + 1e-6)) when norm >
// max_norm; then, per element, exactly AdamW::step's f32 arithmetic (no fused
// multiply-adds): θ ·= shrink for i < decayed; m = β1 m + (1-β1) g;
// v = β2 v + (1-β2) g g; θ += -step_size · m / (sqrt(v) / correction2_root + ε).
// When *loss is not finite nothing changes (the host then stops the run).
void adamw_update(float* parameters, float* first_moments, float* second_moments, const float* gradients, long count,
                  long decayed, const AdamWUpdate& update, const double* squared_norm, const double* loss,
                  cudaStream_t stream);

}  // namespace dspark::cuda
