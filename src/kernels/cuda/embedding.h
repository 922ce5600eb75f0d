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

// A step's tapped rows into a ring of rows that outlives the step (a CUDA
// graph replays this with placement read at run time): with placement =
// {first, count} in device memory, ring row first + i = taps[source_rows[i]]
// (taps[i] when source_rows is null) for i < count, width f32 each. The
// launch covers max_rows rows; a count above it, or of 0, writes nothing.
void tap_ring_write_forward(float* ring, const int32_t* placement, const int32_t* source_rows, const float* taps,
                            int max_rows, int width, cudaStream_t stream);

// ---- training ----

// out [rows, dim] = table[ids[r]] with an f32 table [vocab, dim] (a drafter's own lookup table;
// also any gather of f32 rows, as of a padded step's tapped rows).
void embedding_forward(float* out, const float* table, const int32_t* ids, int rows, int dim, cudaStream_t stream);

// The lookup's backward, deterministic: rows that read the same table row are
// listed together, so each table row is summed by one block in a fixed order
// with no atomics. Group g reads table row ids[g] from the rows
// sorted_rows[starts[g] .. starts[g+1]) (ascending); dtable[ids[g]] += Σ dout[row].
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, const int32_t* starts,
                        const int32_t* sorted_rows, int groups, int dim, cudaStream_t stream);

}  // namespace dspark::cuda
