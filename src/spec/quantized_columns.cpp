#include "spec/quantized_columns.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"

namespace dspark {

QuantizedColumns quantize_columns(const float* w, int rank, int vocab, double slack) {
  DSPARK_CHECK(rank > 0 && rank % 8 == 0 && vocab > 0, "quantize_columns: rank ", rank, " (a multiple of 8) and vocab ",
               vocab, " (positive)");
  QuantizedColumns out;
  out.rank = rank, out.vocab = vocab, out.stride = (vocab + 15) / 16 * 16;
  out.values.assign(size_t(rank) * out.stride, 128);
  out.scales.resize(vocab);
  out.bounds.resize(vocab);
  out.exact.resize(size_t(vocab) * rank);
  const int per_slice = rank / 8;
  std::vector<uint16_t> column(rank);
  for (int v = 0; v < vocab; ++v) {
    float largest = 0.0f;
    bool finite = true;
    for (int i = 0; i < rank; ++i) {
      column[i] = f32_to_bf16(w[size_t(i) * vocab + v]);
      const float value = bf16_to_f32(column[i]);
      finite = finite && std::isfinite(value);
      largest = std::max(largest, std::fabs(value));
    }
    // A column with a non-finite weight keeps q = 0 and an infinite bound: always given the exact product.
    const float scale = finite ? largest / 127.0f : 0.0f;
    double residual = 0.0, norm = 0.0;
    for (int i = 0; i < rank; ++i) {
      const double value = bf16_to_f32(column[i]);
      const double q = scale > 0.0f ? std::clamp(std::nearbyint(value / scale), -127.0, 127.0) : 0.0;
      out.values[size_t(i) * out.stride + v] = uint8_t(int(q) + 128);
      const double left = value - double(scale) * q;  // exact in double: q has 8 bits, scale 24
      residual += left * left, norm += value * value;
      out.exact[size_t(v) * rank + size_t(i % 8) * per_slice + i / 8] = column[i];
    }
    residual = std::sqrt(residual), norm = std::sqrt(norm);
    const double bound = (residual + slack * (norm + residual)) * (1.0 + 1e-6);
    out.scales[v] = scale;
    const float infinity = std::numeric_limits<float>::infinity();
    out.bounds[v] = !finite ? infinity : bound > 0.0 ? std::nextafter(float(bound), infinity) : 0.0f;
  }
  return out;
}

}  // namespace dspark
