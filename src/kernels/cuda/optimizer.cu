#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/optimizer.h"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

// Round-to-nearest intrinsics throughout: nvcc would otherwise contract a*b + c
// into FMAs, which the CPU reference (no FMA) does not.
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* parameters, float* first_moments, float* second_moments, const float* gradients, long count,
                 long decayed, AdamWUpdate update, const double* squared_norm, const double* loss) {
  if (!isfinite(*loss)) return;
  const double norm = sqrt(*squared_norm);
  const bool clip = norm > update.max_norm;
  const float scale = clip ? static_cast<float>(update.max_norm / (norm + 1e-6)) : 1.0f;
  const long stride = static_cast<long>(gridDim.x) * kThreads;
  for (long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x; i < count; i += stride) {
    const float g = clip ? __fmul_rn(gradients[i], scale) : gradients[i];
    float theta = parameters[i];
    if (i < decayed) theta = __fmul_rn(theta, update.shrink);
    const float m = __fadd_rn(__fmul_rn(first_moments[i], update.beta1), __fmul_rn(g, update.keep1));
    const float v =
        __fadd_rn(__fmul_rn(second_moments[i], update.beta2), __fmul_rn(__fmul_rn(update.keep2, g), g));
    const float denominator = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), update.correction2_root), update.epsilon);
    parameters[i] = __fadd_rn(theta, __fmul_rn(-update.step_size, __fdiv_rn(m, denominator)));
    first_moments[i] = m;
    second_moments[i] = v;
  }
}

}  // namespace

void adamw_update(float* parameters, float* first_moments, float* second_moments, const float* gradients, long count,
                  long decayed, const AdamWUpdate& update, const double* squared_norm, const double* loss,
                  cudaStream_t stream) {
  if (count <= 0) return;
  const int blocks = static_cast<int>(std::min<long>(ceil_div(count, kThreads), 4096));
  adamw_kernel<<<blocks, kThreads, 0, stream>>>(parameters, first_moments, second_moments, gradients, count, decayed,
                                                update, squared_norm, loss);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
