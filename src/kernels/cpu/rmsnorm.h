// RMSNorm: out = x * rsqrt(mean(x^2) + eps) * weight, per row.
// x, out [rows, dim] (may alias), weight [dim].
#pragma once

namespace dspark::cpu {

void rmsnorm_forward(float* out, const float* x, const float* weight, int rows, int dim, float eps);

// Given dout [rows, dim] and the forward's input x: dx [rows, dim] += dL/dx and
// dweight [dim] += dL/dweight (null: not wanted). With s = rsqrt(mean(x^2) + eps):
//   dx_i = s w_i dout_i - s^3 x_i (sum_j dout_j w_j x_j) / dim,   dweight_i = sum_rows dout_i x_i s.
void rmsnorm_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                      int dim, float eps);

}  // namespace dspark::cpu
