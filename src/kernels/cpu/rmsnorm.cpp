#include "kernels/cpu/rmsnorm.h"

#include <cmath>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/simd.h"

namespace dspark::cpu {
namespace {

// The forward with vectors of W floats (instruction sets as in matmul.cpp).
// The sum of squares is still in double: W/2 floats at a time widened to
// doubles, four accumulators (the scalar loop was one latency-bound chain),
// summed in a fixed order, the tail added last. Each row takes the same steps
// whatever the row count, so a token's result does not depend on the rows
// that share its forward.
template <int W>
[[gnu::always_inline]] inline void rmsnorm_rows(float* out, const float* x, const float* weight, int rows, int dim,
                                                float eps) {
  constexpr int kHalf = W / 2;
  using V = typename simd::Floats<W>::Vector;
  using Half = typename simd::Floats<kHalf>::Vector;
  using Doubles = typename simd::Doubles<kHalf>::Vector;
  for (int row = 0; row < rows; ++row) {
    const float* in = x + static_cast<long>(row) * dim;
    float* result = out + static_cast<long>(row) * dim;
    Doubles sums[4] = {};
    int i = 0;
    for (; i + 4 * kHalf <= dim; i += 4 * kHalf)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const Doubles wide = __builtin_convertvector(simd::load<Half>(in + i + k * kHalf), Doubles);
        sums[k] += wide * wide;
      }
    const Doubles both = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    double sum_of_squares = 0.0;
#pragma GCC unroll 8
    for (int lane = 0; lane < kHalf; ++lane) sum_of_squares += both[lane];
    for (; i < dim; ++i) sum_of_squares += static_cast<double>(in[i]) * in[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(sum_of_squares / dim + eps));
    int j = 0;
    for (; j + W <= dim; j += W) simd::store(result + j, simd::load<V>(in + j) * scale * simd::load<V>(weight + j));
    for (; j < dim; ++j) result[j] = in[j] * scale * weight[j];
  }
}
__attribute__((target("arch=x86-64-v4"))) void rmsnorm_avx512(float* out, const float* x, const float* weight, int rows,
                                                              int dim, float eps) {
  rmsnorm_rows<16>(out, x, weight, rows, dim, eps);
}
__attribute__((target("arch=x86-64-v3"))) void rmsnorm_avx2(float* out, const float* x, const float* weight, int rows,
                                                            int dim, float eps) {
  rmsnorm_rows<8>(out, x, weight, rows, dim, eps);
}
void rmsnorm_baseline(float* out, const float* x, const float* weight, int rows, int dim, float eps) {
  rmsnorm_rows<4>(out, x, weight, rows, dim, eps);
}

// rsqrt(mean(x^2) + eps), the mean of squares in double: the one place f32 loses digits.
double inverse_rms(const float* x, int dim, float eps) {
  double sum_of_squares = 0.0;
  for (int i = 0; i < dim; ++i) sum_of_squares += static_cast<double>(x[i]) * x[i];
  return 1.0 / std::sqrt(sum_of_squares / dim + eps);
}

}  // namespace

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps) {
  for_matmul_isa(rmsnorm_avx512, rmsnorm_avx2, rmsnorm_baseline)(out, x, weight, rows, dim, eps);
}

void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                      int dim, float eps) {
  for (int row = 0; row < rows; ++row) {
    const float* in = x + static_cast<long>(row) * dim;
    const float* gradient = dout + static_cast<long>(row) * dim;
    const double scale = inverse_rms(in, dim, eps);
    if (dx) {
      double dot = 0.0;  // sum_j dout_j w_j x_j
      for (int i = 0; i < dim; ++i) dot += static_cast<double>(gradient[i]) * weight[i] * in[i];
      const float correction = static_cast<float>(scale * scale * scale * dot / dim);
      float* result = dx + static_cast<long>(row) * dim;
      for (int i = 0; i < dim; ++i)
        result[i] += static_cast<float>(scale) * weight[i] * gradient[i] - correction * in[i];
    }
    if (dweight)
      for (int i = 0; i < dim; ++i) dweight[i] += gradient[i] * in[i] * static_cast<float>(scale);
  }
}

}  // namespace dspark::cpu
