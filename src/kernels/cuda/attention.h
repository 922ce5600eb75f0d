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
// (split-KV / flash-decoding, through `partial_out` [splits, T, nh, hd] and
// `partial_lse` [splits, T, nh], merged by the last split to finish).
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

// The step before the attention, done inside it (decode and verify steps):
// q / k RMSNorm and RoPE from the QKV GEMM's output, and the append of the
// step's keys and values to the cache, with the code and bits of
// qkv_rope_kv_append_forward (rope.h), whose arguments these are. Each CTA
// computes the step's rows it reads itself; one CTA per (kv head, token)
// writes them to the cache.
struct AttentionRope {
  const __nv_bfloat16* qkv;  // [T, (nh + 2 nkv) * hd]
  const float* q_norm;       // [hd] or null
  const float* k_norm;       // [hd] or null
  const int32_t* positions;  // [T]
  const float2* rope_table;  // [positions, hd/2] (cos, sin)
  const int32_t* slots;      // [T] the cache slot of each row
  __nv_bfloat16* key_cache;  // the same caches as attention_forward's, written here
  __nv_bfloat16* value_cache;
  float eps;
};

// head_dim in {16, 32, 64, 128}. splits = 1 (one CTA per row block covers
// every position), or splits >= ceil(longest sequence / (kSplitTiles *
// kBlockSize)); the partial buffers and `counters` (attention_counters(...)
// of them, zeroed before the first call; every call leaves them zeroed) are
// only used when splits > 1.
// Two kernels with different roundings: splits = 1 in f32 on CUDA cores;
// splits > 1 (head_dim 32-128, max_query_length <= 64) on tensor cores, with
// the softmax weights rounded to bf16 for P V. A row's bits depend only on
// its own keys and the split boundaries, so a caller that wants a token to
// get the same bits whether decoded or verified keeps splits > 1 in both
// (DSPARK_ATTENTION_SCALAR=1 runs every call on the CUDA-core kernel).
// rope: null (q holds the step's queries and the cache its keys and values
// already), or the step before, fused in (q is then unused).
void attention_forward(__nv_bfloat16* out, const __nv_bfloat16* q, const __nv_bfloat16* key_cache,
                       const __nv_bfloat16* value_cache, const AttentionBatch& batch, int total_rows, int heads,
                       int kv_heads, int head_dim, int splits, float* partial_out, float* partial_lse,
                       unsigned* counters, cudaStream_t stream, const AttentionRope* rope = nullptr);

// Query rows one CTA handles (per kv head); sizes the grid.
constexpr int kAttentionRowsPerBlock = 8;

// The longest step (query tokens a sequence) the tensor-core kernel takes
// (its shared memory holds the step's rows); a longer one with splits > 1
// runs on the CUDA-core kernel, with other bits.
constexpr int kSplitMaxQueryLength = 64;

// Row blocks a sequence of at most max_query_length query tokens takes (per kv head).
constexpr int attention_row_blocks(int max_query_length, int heads, int kv_heads) {
  const long rows = long(max_query_length) * (heads / kv_heads);
  return static_cast<int>((rows + kAttentionRowsPerBlock - 1) / kAttentionRowsPerBlock);
}

// The counters attention_forward needs for S sequences of at most
// max_query_length query tokens: one per (sequence, row block, kv head).
constexpr long attention_counters(int sequences, int max_query_length, int heads, int kv_heads) {
  return long(sequences) * attention_row_blocks(max_query_length, heads, kv_heads) * kv_heads;
}

// KV tiles per split: split s covers positions [s, s + 1) * kSplitTiles * kBlockSize
// when splits > 1. `splits` must then cover the longest sequence of the step;
// splits past a sequence's end contribute nothing.
// One tile: the most CTAs for a decode step's few rows (8B, 128-256 positions:
// 4.73 -> 4.59 ms per step with 16 warps, against two tiles).
constexpr int kSplitTiles = 1;

// ---- the drafter's block attention (CUDA version of
// cpu::bidirectional_attention_forward, for a batch of B rows at once) ----
//
// Row b's block of γ queries attends, with no mask, to its own retained
// context (context_length[b] keys / values, ragged across the batch) followed
// by its own γ block keys / values. Block position k of row b is row k*B + b
// of q, block_keys, block_values (row stride `block_stride` elements) and of
// out [γ*B, heads*head_dim]; head h is elements h*head_dim .. of a row.
// Context position p of row b is at context_keys[b] + p * context_stride (and
// context_values[b] likewise). Scale head_dim^-0.5.
//
// Work: one CTA per (KV split, head, row); each split streams its share of the
// row's keys in tiles of 32 through shared memory with an online softmax, and
// the last split to finish (an atomic ticket per (row, head) in `counters`,
// zeroed once at allocation and left zeroed) merges the splits' partial
// results, so the op is one kernel launch. partial_out [B*heads*splits*γ*head_dim]
// and partial_lse [B*heads*splits*γ] are scratch, used only when splits > 1.
// Each CTA reads its first tile's context rows (and the batch's metadata)
// before it waits for the previous kernel (programmatic dependent launch), so
// the kernel launched just before this one must not write them; the block's
// rows (q, block_keys, block_values) it reads after.
constexpr int kMaxDraftQueries = 32;  // γ <= 32
constexpr int kMaxDraftSplits = 32;   // splits <= 32

struct DraftAttentionBatch {
  const __nv_bfloat16* const* context_keys;    // [B] (may be null where context_length is 0)
  const __nv_bfloat16* const* context_values;  // [B]
  const int32_t* context_length;               // [B]
  long context_stride;                         // elements between context positions
  int rows;                                    // B
};

// head_dim a multiple of 8, at most 256; gamma <= kMaxDraftQueries; splits <= kMaxDraftSplits.
void bidirectional_attention_forward(__nv_bfloat16* out, const __nv_bfloat16* q, const __nv_bfloat16* block_keys,
                                     const __nv_bfloat16* block_values, long block_stride,
                                     const DraftAttentionBatch& batch, int gamma, int heads, int head_dim,
                                     int splits, float* partial_out, float* partial_lse, unsigned* counters,
                                     cudaStream_t stream);

// ---- training: the drafter's block attention over a whole TrainBatch (f32;
// CUDA versions of cpu::bidirectional_attention_forward / backward, for a
// ragged batch of anchors at once) ----
//
// Anchor a's block of γ queries attends, with no mask, to its own context rows
// followed by its own γ block rows. Rows are in the training step's head order
// (train/cuda_loss.h): block position k of anchor a is row k·A + a of q,
// block_keys, block_values and out ([γ·A, heads·hd]); context position p of
// anchor a is row context_offsets[a] + p of context_keys / context_values
// ([C, heads·hd]). Head h is columns h·hd .. h·hd + hd - 1. Scale hd^-0.5.
//
// One CTA per (anchor, head) streams the anchor's keys in tiles of
// kTrainKeyTile through shared memory with an online softmax. The backward
// recomputes the probabilities from lse; since every key and every query
// belongs to exactly one anchor, each CTA owns the gradients it writes: no
// atomics, a fixed summation order.
constexpr int kTrainKeyTile = 32;

struct TrainAttentionBatch {
  const int32_t* context_offsets;  // [A + 1] device, context_offsets[0] = 0
  int anchors;                     // A
  int gamma;                       // γ
  int heads;
  int head_dim;  // hd; shared memory bounds γ·hd (about γ·hd <= 12k floats)
};

// Whether the training attention fits this γ and head size on the current device.
bool train_attention_fits(int gamma, int head_dim);

// out [γ·A, heads·hd]; lse [γ·A, heads] receives each query's log Σ exp(scores), for the backward.
void bidirectional_attention_forward(float* out, float* lse, const float* q, const float* block_keys,
                                     const float* block_values, const float* context_keys,
                                     const float* context_values, const TrainAttentionBatch& batch,
                                     cudaStream_t stream);

// Given dout and the forward's out and lse: dq, dblock_keys, dblock_values
// [γ·A, heads·hd] and dcontext_keys, dcontext_values [C, heads·hd] accumulate (+=).
void bidirectional_attention_backward(float* dq, float* dblock_keys, float* dblock_values, float* dcontext_keys,
                                      float* dcontext_values, const float* dout, const float* out, const float* lse,
                                      const float* q, const float* block_keys, const float* block_values,
                                      const float* context_keys, const float* context_values,
                                      const TrainAttentionBatch& batch, cudaStream_t stream);

}  // namespace dspark::cuda
