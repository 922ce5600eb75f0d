#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>

namespace dspark::cpu {

void attention_forward(float* out, const float* q, const float* keys, const float* values,
                       int rows, int first_position, int heads, int kv_heads, int head_dim,
                       float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int group = heads / kv_heads;
  const long kv_stride = static_cast<long>(kv_heads) * head_dim;
  for (int row = 0; row < rows; ++row) {
    const int visible = first_position + row + 1;
    for (int head = 0; head < heads; ++head) {
      const float* query = q + (static_cast<long>(row) * heads + head) * head_dim;
      const long kv_offset = static_cast<long>(head / group) * head_dim;
      float maximum = -INFINITY;
      for (int t = 0; t < visible; ++t) {
        const float* key = keys + t * kv_stride + kv_offset;
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
      float* result = out + (static_cast<long>(row) * heads + head) * head_dim;
      std::fill(result, result + head_dim, 0.0f);
      for (int t = 0; t < visible; ++t) {
        const float weight = scores[t] / total;
        const float* value = values + t * kv_stride + kv_offset;
        for (int i = 0; i < head_dim; ++i) result[i] += weight * value[i];
      }
    }
  }
}

}  // namespace dspark::cpu
