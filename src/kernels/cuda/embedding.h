// Token embedding lookup and row gathers (CUDA versions of kernels/cpu/embedding.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

// out [rows, dim] f32 = table[ids[r]] (table bf16 [vocab, dim]).
void embedding_forward(float* out, const __nv_bfloat16* table, const int32_t* ids, int rows, int dim,
                       cudaStream_t stream);

// out [count, dim] = in[rows[i]]  (picks the rows whose logits are wanted).
void gather_rows_forward(__nv_bfloat16* out, const __nv_bfloat16* in, const int32_t* rows, int count,
                         int dim, cudaStream_t stream);

}  // namespace dspark::cuda
