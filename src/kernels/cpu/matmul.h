// Matrix products of activations with weights, through OpenBLAS.
// Shapes: x [rows, in], weight [out, in] (the PyTorch nn.Linear layout, as
// stored in HF checkpoints), bias [out] or null, out [rows, out].
// Backward passes accumulate (+=) into every gradient they are given; a null
// gradient pointer is skipped (a frozen weight, or an input that needs none).
#pragma once

namespace dspark::cpu {

// out = x @ weight^T (+ bias)
void matmul_forward(float* out, const float* x, const float* weight, const float* bias, int rows,
                    int in_features, int out_features);

// dx [rows, in] += dout @ weight;  dweight [out, in] += dout^T @ x.  dout [rows, out].
void matmul_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                     int in_features, int out_features);

// out = x @ weight, with weight stored [in, out] (the drafter's layout).
void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features);

// dx [rows, in] += dout @ weight^T;  dweight [in, out] += x^T @ dout.  dout [rows, out].
void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight,
                            int rows, int in_features, int out_features);

}  // namespace dspark::cpu
