// Causal attention of new query tokens over a paged KV cache, for a batch of
// sequences of different lengths (CUDA version of kernels/cpu/attention.h).
//
// Cache: key_cache / value_cache [slots, nkv, hd], slot = block * kBlockSize +
// position % kBlockSize, with each sequence's blocks listed in its row of
// block_tables [table_rows, max_blocks]. Sequence s owns query rows
// query_start[s] .. + query_length[s] of q / out [T, nh, hd]; they sit at the
// last query_length[s] of its sequence_length[s] cached positions, and query i
// sees positions 0 .. sequence_length - query_length + i.
//
// Work is split three ways so short and long, few and many sequences all fill
// the GPU: over (sequence, kv head, block of query rows) and over KV ranges
// (split-KV / flash-decoding, merged by a second kernel through `partial_out`
// [splits, T, nh, hd] and `partial_lse` [splits, T, nh]).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

constexpr int kBlockSize = 32;  // tokens per KV block (and per attention tile)

struct AttentionBatch {
  const int32_t* query_start;      // [S]
  const int32_t* query_length;     // [S]
  const int32_t* sequence_length;  // [S]
  const int32_t* table_row;        // [S] row of block_tables for each sequence
  const int32_t* block_tables;     // [table_rows, max_blocks]
  int max_blocks;
  int sequences;                   // S
  int max_query_length;            // bound on query_length (sizes the grid)
};

// head_dim in {16, 32, 64, 128}. splits >= ceil(longest sequence / (kSplitTiles *
// kBlockSize)); the partial buffers are only used when splits > 1.
void attention_forward(__nv_bfloat16* out, const __nv_bfloat16* q, const __nv_bfloat16* key_cache,
                       const __nv_bfloat16* value_cache, const AttentionBatch& batch, int total_rows,
                       int heads, int kv_heads, int head_dim, int splits, float* partial_out,
                       float* partial_lse, cudaStream_t stream);

// Query rows one CTA handles (per kv head); sizes the grid.
constexpr int kAttentionRowsPerBlock = 16;

// KV tiles per split: split s covers positions [s, s + 1) * kSplitTiles * kBlockSize.
// `splits` must cover the longest sequence of the step; splits past a
// sequence's end contribute nothing.
constexpr int kSplitTiles = 8;

}  // namespace dspark::cuda
