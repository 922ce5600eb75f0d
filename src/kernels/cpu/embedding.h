// Token embedding lookup: out[r] = table[ids[r]].  table [vocab, dim], out [rows, dim].
#pragma once
#include <cstdint>

namespace dspark::cpu {

void embedding_forward(float* out, const float* table, const int32_t* ids, int rows, int dim);

}  // namespace dspark::cpu
