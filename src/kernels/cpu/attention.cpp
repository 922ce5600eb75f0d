#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

namespace dspark::cpu {
namespace {

// out [hd] = softmax(scale * q . keys[t]) over t < visible, weighted sum of values[t].
// keys / values rows are `stride` floats apart.
void attend_one(float* out, const float* query, const float* keys, const float* values, int visible, long stride,
                int head_dim, float scale, float* scores) {
  float maximum = -INFINITY;
  for (int t = 0; t < visible; ++t) {
    const float* key = keys + t * stride;
    float dot = 0.0f;
    for (int i = 0; i < head_dim; ++i) dot += query[i] * key[i];
    scores[t] = dot * scale;
    maximum = std::max(maximum, scores[t]);
  }
  float total = 0.0f;
  for (int t = 0; t < visible; ++t) {
    scores[t] = std::exp(scores[t] - maximum);
    total += scores[t];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (int t = 0; t < visible; ++t) {
    const float weight = scores[t] / total;
    const float* value = values + t * stride;
    for (int i = 0; i < head_dim; ++i) out[i] += weight * value[i];
  }
}

}  // namespace

void attention_forward(float* out, const float* q, const float* keys, const float* values,
                       int rows, int first_position, int heads, int kv_heads, int head_dim,
                       float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int group = heads / kv_heads;
  const long kv_stride = static_cast<long>(kv_heads) * head_dim;
  for (int row = 0; row < rows; ++row)
    for (int head = 0; head < heads; ++head)
      attend_one(out + (static_cast<long>(row) * heads + head) * head_dim,
                 q + (static_cast<long>(row) * heads + head) * head_dim, keys + static_cast<long>(head / group) * head_dim,
                 values + static_cast<long>(head / group) * head_dim, first_position + row + 1, kv_stride, head_dim,
                 scale, scores);
}

void bidirectional_attention_forward(float* out, const float* q, const float* keys, const float* values, int rows,
                                     int kv_rows, int heads, int head_dim, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int stride = heads * head_dim;  // one head's rows are `stride` floats apart
  for (int row = 0; row < rows; ++row)
    for (int head = 0; head < heads; ++head) {
      const long offset = long(head) * head_dim, query = long(row) * stride + offset;
      // scores = scale K_h q;  out = V_h^T softmax(scores): BLAS matrix-vector products over the strided head.
      cblas_sgemv(CblasRowMajor, CblasNoTrans, kv_rows, head_dim, scale, keys + offset, stride, q + query, 1, 0.0f,
                  scores, 1);
      const float maximum = *std::max_element(scores, scores + kv_rows);
      float total = 0.0f;
      for (int t = 0; t < kv_rows; ++t) total += (scores[t] = std::exp(scores[t] - maximum));
      cblas_sgemv(CblasRowMajor, CblasTrans, kv_rows, head_dim, 1.0f / total, values + offset, stride, scores, 1, 0.0f,
                  out + query, 1);
    }
}

void bidirectional_attention_backward(float* dq, float* dkeys, float* dvalues, const float* dout, const float* q,
                                      const float* keys, const float* values, int rows, int kv_rows, int heads,
                                      int head_dim, float* scratch) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int stride = heads * head_dim;  // one head's rows are `stride` floats apart
  float* probs = scratch;                          // [rows, kv_rows] P = softmax(scale Q K^T)
  float* dscores = scratch + long(rows) * kv_rows;  // [rows, kv_rows] dP, then dS
  for (int head = 0; head < heads; ++head) {
    const long offset = long(head) * head_dim;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kv_rows, head_dim, scale, q + offset, stride,
                keys + offset, stride, 0.0f, probs, kv_rows);
    for (int row = 0; row < rows; ++row) {
      float* p = probs + long(row) * kv_rows;
      const float maximum = *std::max_element(p, p + kv_rows);
      float total = 0.0f;
      for (int t = 0; t < kv_rows; ++t) total += (p[t] = std::exp(p[t] - maximum));
      for (int t = 0; t < kv_rows; ++t) p[t] /= total;
    }
    // dP = dO V^T;  dS = P ⊙ (dP - rowsum(P ⊙ dP)), times the scale that multiplied Q K^T.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kv_rows, head_dim, 1.0f, dout + offset, stride,
                values + offset, stride, 0.0f, dscores, kv_rows);
    for (int row = 0; row < rows; ++row) {
      const float* p = probs + long(row) * kv_rows;
      float* ds = dscores + long(row) * kv_rows;
      float dot = 0.0f;
      for (int t = 0; t < kv_rows; ++t) dot += p[t] * ds[t];
      for (int t = 0; t < kv_rows; ++t) ds[t] = scale * p[t] * (ds[t] - dot);
    }
    // dQ += dS K;  dK += dS^T Q;  dV += P^T dO.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, kv_rows, 1.0f, dscores, kv_rows,
                keys + offset, stride, 1.0f, dq + offset, stride);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kv_rows, head_dim, rows, 1.0f, dscores, kv_rows,
                q + offset, stride, 1.0f, dkeys + offset, stride);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kv_rows, head_dim, rows, 1.0f, probs, kv_rows,
                dout + offset, stride, 1.0f, dvalues + offset, stride);
  }
}

}  // namespace dspark::cpu
