// RMSNorm: out = x * rsqrt(mean(x^2) + eps) * weight, per row.
// x, out [rows, dim] (may alias), weight [dim].
#pragma once

namespace dspark::cpu {

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps);

}  // namespace dspark::cpu
