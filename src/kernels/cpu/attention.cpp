#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

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
  const long stride = static_cast<long>(heads) * head_dim;
  for (int row = 0; row < rows; ++row)
    for (int head = 0; head < heads; ++head)
      attend_one(out + row * stride + head * head_dim, q + row * stride + head * head_dim, keys + head * head_dim,
                 values + head * head_dim, kv_rows, stride, head_dim, scale, scores);
}

}  // namespace dspark::cpu
