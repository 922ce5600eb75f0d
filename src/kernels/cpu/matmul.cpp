#include "kernels/cpu/matmul.h"

#include <cblas.h>

namespace dspark::cpu {

void matmul_forward(float* out, const float* x, const float* weight, const float* bias, int rows,
                    int in_features, int out_features) {
  if (rows == 1) {  // decode: a matrix-vector product streams the weight once
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out_features, in_features, 1.0f, weight, in_features,
                x, 1, 0.0f, out, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out_features, in_features, 1.0f, x,
                in_features, weight, in_features, 0.0f, out, out_features);
  }
  if (bias)
    for (int row = 0; row < rows; ++row)
      for (int column = 0; column < out_features; ++column)
        out[static_cast<long>(row) * out_features + column] += bias[column];
}

void matmul_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight, int rows,
                     int in_features, int out_features) {
  if (rows == 0) return;
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, in_features, out_features, 1.0f, dout,
                out_features, weight, in_features, 1.0f, dx, in_features);
  if (dweight)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out_features, in_features, rows, 1.0f, dout, out_features,
                x, in_features, 1.0f, dweight, in_features);
}

void matmul_in_out_forward(float* out, const float* x, const float* weight, int rows, int in_features,
                           int out_features) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasTrans, in_features, out_features, 1.0f, weight, out_features, x, 1, 0.0f, out, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, out_features, in_features, 1.0f, x, in_features,
                weight, out_features, 0.0f, out, out_features);
  }
}

void matmul_in_out_backward(float* dx, float* dweight, const float* dout, const float* x, const float* weight,
                            int rows, int in_features, int out_features) {
  if (rows == 0) return;
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, in_features, out_features, 1.0f, dout, out_features,
                weight, out_features, 1.0f, dx, in_features);
  if (dweight)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in_features, out_features, rows, 1.0f, x, in_features,
                dout, out_features, 1.0f, dweight, out_features);
}

}  // namespace dspark::cpu
