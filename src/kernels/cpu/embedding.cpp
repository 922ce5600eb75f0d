#include "kernels/cpu/embedding.h"

#include <cstring>

namespace dspark::cpu {

void embedding_forward(float* out, const float* table, const int32_t* ids, int rows, int dim) {
  for (int row = 0; row < rows; ++row)
    std::memcpy(out + static_cast<long>(row) * dim, table + static_cast<long>(ids[row]) * dim,
                sizeof(float) * dim);
}

}  // namespace dspark::cpu
