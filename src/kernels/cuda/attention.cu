#include <algorithm>
#include <climits>

#include "core/environment.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/tensor_gemv.cuh"

namespace dspark::cuda {
namespace {

// 8 warps, one query row each: a verify block's rows (up to 8 per kv head
// and CTA) are scored in parallel instead of four after one another per warp.
// With 16 a CTA, the demo target's batch-4 verify of 8 tokens (64 CTAs)
// spent 6.0 us a layer in the attention after the q|k|v product, batch 1's
// 4.3 (16 CTAs of the same work; whether from 16 warps issuing on one
// multiprocessor or from CTAs sharing one, not pinned down). With 8: the
// batch-4 verify of 8 tokens 0.204 -> 0.193 ms (with the merge below).
constexpr int kWarps = 8;
constexpr int kRowsPerWarp = kAttentionRowsPerBlock / kWarps;

// A step row of kv head `kv_head` (row qkv_row of the QKV GEMM's output) for
// the attention's tiles: its key normed and rotated into key_row, its value as
// it is into value_row (both shared), with the bits of the RoPE kernel, and
// appended to the cache when `appends`. Every lane of the warp calls it.
template <int HEAD_DIM>
__device__ __forceinline__ void step_key_value(const AttentionRope& rope, long qkv_row, int heads, int kv_heads,
                                               int kv_head, bool appends, bf16* key_row, bf16* value_row, int lane) {
  const long qkv_width = static_cast<long>(heads + 2 * kv_heads) * HEAD_DIM;
  const bf16* key_in = rope.qkv + qkv_row * qkv_width + static_cast<long>(heads + kv_head) * HEAD_DIM;
  const bf16* value_in = key_in + static_cast<long>(kv_heads) * HEAD_DIM;
  const long cache_row = (static_cast<long>(rope.slots[qkv_row]) * kv_heads + kv_head) * HEAD_DIM;
  const RopeLane constants = load_rope_lane(rope.k_norm, rope.rope_table, rope.positions[qkv_row], HEAD_DIM, lane);
  norm_rope_row(key_in, constants, rope.k_norm != nullptr, HEAD_DIM, rope.eps, lane, [&](int i, bf16 value) {
    key_row[i] = value;
    if (appends) rope.key_cache[cache_row + i] = value;
  });
  for (int i = lane; i < HEAD_DIM; i += 32) {
    const bf16 value = value_in[i];
    value_row[i] = value;
    if (appends) rope.value_cache[cache_row + i] = value;
  }
}

// Query head `head` of row qkv_row of the QKV GEMM's output, normed and
// rotated with the bits of the RoPE kernel, element i handed to store(i,
// value). Every lane of the warp calls it.
template <int HEAD_DIM, typename Store>
__device__ __forceinline__ void rope_query_row(const AttentionRope& rope, long qkv_row, int head, int heads,
                                               int kv_heads, int lane, Store store) {
  const long qkv_width = static_cast<long>(heads + 2 * kv_heads) * HEAD_DIM;
  const RopeLane constants = load_rope_lane(rope.q_norm, rope.rope_table, rope.positions[qkv_row], HEAD_DIM, lane);
  norm_rope_row(rope.qkv + qkv_row * qkv_width + static_cast<long>(head) * HEAD_DIM, constants, rope.q_norm != nullptr,
                HEAD_DIM, rope.eps, lane, store);
}

// The splits' partial results of one query row (out_row of `out`) merged,
// softmax-weighted by each split's log-sum-exp: a warp per row, a lane per
// dim, the splits in order. Split s of the row is partial_out[s * row_heads +
// out_row] (normalized, f32) and partial_lse[...] (-inf where it saw no key).
template <int HEAD_DIM>
__device__ __forceinline__ void merge_splits(bf16* out, const float* partial_out, const float* partial_lse, int splits,
                                             long row_heads, long out_row, int lane) {
  constexpr int kDimsPerLane = HEAD_DIM >= 32 ? HEAD_DIM / 32 : 1;
  float maximum = -INFINITY;
  for (int s = lane; s < splits; s += 32) maximum = fmaxf(maximum, __ldcg(partial_lse + s * row_heads + out_row));
  maximum = warp_max(maximum);
  float total[kDimsPerLane] = {}, weight_sum = 0.0f;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float lse = __ldcg(partial_lse + s * row_heads + out_row);
    if (lse == -INFINITY) continue;  // a split past this row's keys: adds exactly nothing
    const float weight = __expf(lse - maximum);
    weight_sum += weight;
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) {
      const int dim = lane * kDimsPerLane + d;
      if (dim < HEAD_DIM) total[d] += weight * __ldcg(partial_out + (s * row_heads + out_row) * HEAD_DIM + dim);
    }
  }
#pragma unroll
  for (int d = 0; d < kDimsPerLane; ++d) {
    const int dim = lane * kDimsPerLane + d;
    if (dim < HEAD_DIM)
      out[out_row * HEAD_DIM + dim] = __float2bfloat16(weight_sum > 0.0f ? total[d] / weight_sum : 0.0f);
  }
}

// What a CTA of a step kernel (attention_kernel, split_attention_kernel)
// works on, from its grid position (y = kv head, z = sequence * row_blocks +
// row block): kAttentionRowsPerBlock query rows from first_row of its kv
// head's (query token, head in group) pairs, row r being token r / group.
struct RowBlock {
  int row_block, kv_head;
  int group;                 // query heads a kv head
  int rows;                  // the kv head's (query token, head in group) pairs; none here if first_row >= rows
  int first_row;             // the CTA's first
  int length;                // the sequence's positions, the query tokens its last
  int first_query_position;  // length - query length
  int query_start;           // the sequence's first row in the step's tokens
  int visible_end;           // past the CTA's last visible key (its last row's)
  int tiles;                 // cache blocks holding a visible key
  const int32_t* blocks;     // the sequence's block table

  __device__ int token(int row) const { return row / group; }                   // of the sequence's query tokens
  __device__ int head(int row) const { return kv_head * group + row % group; }  // of the query heads
  // Row `row`'s row of out / partial_out ([tokens, heads]), or -1 past the kv head's rows.
  __device__ long out_row(int row, int heads) const {
    return row < rows ? static_cast<long>(query_start + token(row)) * heads + head(row) : -1;
  }
};
__device__ __forceinline__ RowBlock row_block_of(const AttentionBatch& batch, int heads, int kv_heads, int row_blocks) {
  RowBlock block;
  const int sequence = blockIdx.z / row_blocks;
  block.row_block = blockIdx.z % row_blocks;
  block.kv_head = blockIdx.y;
  block.group = heads / kv_heads;
  const int query_length = batch.query_length[sequence];
  block.rows = query_length * block.group;
  block.first_row = block.row_block * kAttentionRowsPerBlock;
  block.length = batch.sequence_length[sequence];
  block.first_query_position = block.length - query_length;
  block.query_start = batch.query_start[sequence];
  const int last_row = min(block.rows, block.first_row + kAttentionRowsPerBlock) - 1;
  block.visible_end = block.first_query_position + block.token(last_row) + 1;
  block.tiles = (block.visible_end + kBlockSize - 1) / kBlockSize;
  block.blocks = batch.block_tables + static_cast<long>(batch.table_row[sequence]) * batch.max_blocks;
  return block;
}

// The last CTA of its (sequence, kv head, row block) to finish its splits
// merges the block's rows (merge_splits), a warp a row, and leaves the
// counter zeroed for the next launch.
template <int HEAD_DIM, int WARPS>
__device__ __forceinline__ void merge_if_last(const RowBlock& block, bf16* out, const float* partial_out,
                                              const float* partial_lse, unsigned* counters, int splits, long row_heads,
                                              int heads, int warp, int lane) {
  unsigned* counter = counters + static_cast<long>(blockIdx.z) * gridDim.y + blockIdx.y;
  if (!took_last_ticket(counter, gridDim.x)) return;
  for (int local = warp; local < kAttentionRowsPerBlock; local += WARPS) {
    const long out_row = block.out_row(block.first_row + local, heads);
    if (out_row >= 0) merge_splits<HEAD_DIM>(out, partial_out, partial_lse, splits, row_heads, out_row, lane);
  }
  if (threadIdx.x == 0) *counter = 0;
}

// grid: x = group of split_group KV splits, y = kv head, z = sequence *
// row_blocks + row block. Each CTA streams its KV range tile by tile
// (kBlockSize positions, one cache block) through shared memory, the next
// tile's loads in flight while it scores the current one; each warp keeps an
// online softmax for kRowsPerWarp query rows, lane j scoring key j of the tile
// and owning head_dim/32 output dims.
// ROPE: the step's queries, keys and values come from the QKV GEMM's output
// (AttentionRope), normed and rotated here, instead of from q and the cache.
// Four CTAs per SM (64 registers): a 16-token verify step's 512 CTAs at 8B
// (8 splits at 256 positions) then run in one wave.
constexpr int kAttentionBlocksPerMultiprocessor = 4;
template <int HEAD_DIM, bool ROPE>
__global__ void __launch_bounds__(kWarps * 32, kAttentionBlocksPerMultiprocessor)
    attention_kernel(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache, AttentionBatch batch,
                     int heads, int kv_heads, int splits, int split_group, int row_blocks, float* partial_out,
                     float* partial_lse, unsigned* counters, int total_rows, AttentionRope rope) {
  // Before the wait, this CTA reads what no kernel of this step writes: the
  // step's metadata and block tables (copied in before its first kernel) and
  // the cache rows of positions before the step's own tokens (written by
  // earlier steps). So its first tile's old keys and values are on their way
  // while the kernel before it runs; after the wait only the queries and the
  // step's own rows remain (loaded, or with ROPE computed from the QKV GEMM's
  // output).
  // Row stride HEAD_DIM + 4 bf16: rows 8-byte aligned, so a lane reads 4 of
  // its key's (or value's) elements in one load, and the 16 lanes of a
  // half-warp reading their own keys hit distinct banks.
  constexpr int kPad = 4;
  constexpr int kDimsPerLane = HEAD_DIM >= 32 ? HEAD_DIM / 32 : 1;
  __shared__ __align__(16) bf16 keys[kBlockSize][HEAD_DIM + kPad];
  __shared__ __align__(16) bf16 values[kBlockSize][HEAD_DIM + kPad];
  __shared__ float queries[kAttentionRowsPerBlock][HEAD_DIM];
  const RowBlock block = row_block_of(batch, heads, kv_heads, row_blocks);
  if (block.first_row >= block.rows) return;  // nothing to do, nothing to wait for
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  // Split boundaries sit at fixed positions (kSplitTiles tiles each), never at
  // a fraction of this step's range: a query's keys are then reduced in the
  // same order whatever else the step holds (a 1-token decode, a verify block,
  // other sequences), so decode and verify agree to the bit.
  // One split: the whole range (a prefill chunk, whose many rows fill the GPU).
  // This CTA's splits: [first_split, end_split), each reduced on its own (its
  // softmax state restarted, its partial written) as if a CTA of its own had.
  const int first_split = blockIdx.x * split_group, end_split = min(splits, first_split + split_group);
  const int tile_begin = splits == 1 ? 0 : first_split * kSplitTiles;
  const int tile_end = splits == 1 ? block.tiles : min(block.tiles, end_split * kSplitTiles);
  // A tile (one cache block: kBlockSize consecutive slots) moves through
  // registers: 16-byte loads, all issued before the first store into the
  // padded shared rows. Vector i of the tile is row i / kVectorsPerRow.
  constexpr int kVectorsPerRow = HEAD_DIM / 8;
  constexpr int kTileVectors = kBlockSize * kVectorsPerRow;
  constexpr int kVectorsPerThread = (kTileVectors + kWarps * 32 - 1) / (kWarps * 32);
  uint4 key_vectors[kVectorsPerThread], value_vectors[kVectorsPerThread];
  // Loads the tile's rows at positions in [from, to) (from its first slot, slot0).
  auto load_tile = [&](long slot0, int tile, int from, int to) {
#pragma unroll
    for (int j = 0; j < kVectorsPerThread; ++j) {
      const int i = threadIdx.x + j * kWarps * 32;
      const int position = tile * kBlockSize + i / kVectorsPerRow;
      if (i >= kTileVectors || position < from || position >= to) continue;
      const long offset =
          ((slot0 + i / kVectorsPerRow) * kv_heads + block.kv_head) * HEAD_DIM + (i % kVectorsPerRow) * 8;
      key_vectors[j] = *reinterpret_cast<const uint4*>(key_cache + offset);
      value_vectors[j] = *reinterpret_cast<const uint4*>(value_cache + offset);
    }
  };
  long first_slot = 0;
  if (tile_begin < tile_end) {
    first_slot = static_cast<long>(block.blocks[tile_begin]) * kBlockSize;
    load_tile(first_slot, tile_begin, 0, block.first_query_position);
  }
  // ROPE: a warp per query row (kAttentionRowsPerBlock == kWarps), and a warp
  // per step row of a tile to rotate as a key (own_begin: this warp's first),
  // counted from the last warp down, so that in a decode step (4 query rows,
  // one key) the key's chain of loads runs beside the queries' instead of after
  // one of them.
  static_assert(kAttentionRowsPerBlock == kWarps);
  const int query_row = block.first_row + warp;
  auto own_begin = [&](int tile) { return max(tile * kBlockSize, block.first_query_position) + (kWarps - 1 - warp); };
  auto own_end = [&](int tile) { return min((tile + 1) * kBlockSize, block.length); };
  wait_for_previous_kernel();
  start_next_kernel();
  // With ROPE the step's own rows [first_query_position, length) are computed
  // below, not loaded; rows past the end are stale, and masked.
  if (tile_begin < tile_end)
    load_tile(first_slot, tile_begin, ROPE ? block.length : block.first_query_position, INT_MAX);
  if constexpr (ROPE) {
    if (query_row < block.rows)  // (rows past it are never read)
      rope_query_row<HEAD_DIM>(rope, block.query_start + block.token(query_row), block.head(query_row), heads, kv_heads,
                               lane, [&](int i, bf16 value) { queries[warp][i] = __bfloat162float(value); });
  } else {
#pragma unroll
    for (int i = threadIdx.x; i < kAttentionRowsPerBlock * HEAD_DIM; i += kWarps * 32) {  // unrolled: loads overlap
      const int local = i / HEAD_DIM, row = block.first_row + local;
      float value = 0.0f;
      const long out_row = block.out_row(row, heads);  // (q has out's rows)
      if (out_row >= 0) value = __bfloat162float(q[out_row * HEAD_DIM + i % HEAD_DIM]);
      queries[local][i % HEAD_DIM] = value;
    }
  }
  float running_max[kRowsPerWarp], running_sum[kRowsPerWarp], accumulator[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    running_max[r] = -INFINITY;
    running_sum[r] = 0.0f;
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) accumulator[r][d] = 0.0f;
  }
  // This warp's r-th row of `out` (its query token and head), or -1 past the block's rows.
  auto out_row_of = [&](int r) { return block.out_row(block.first_row + r * kWarps + warp, heads); };
  // A split's result: `out` itself when there is one split, else its partial
  // (normalized output and log-sum-exp, -inf when no key was visible); the
  // softmax state restarts for the next.
  auto finish_split = [&](int split) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const long out_row = out_row_of(r);
      if (out_row < 0) continue;
      const float inverse = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
#pragma unroll
      for (int d = 0; d < kDimsPerLane; ++d) {
        const int dim = lane * kDimsPerLane + d;
        if (dim >= HEAD_DIM) continue;
        if (splits == 1)
          out[out_row * HEAD_DIM + dim] = __float2bfloat16(accumulator[r][d] * inverse);
        else
          partial_out[(static_cast<long>(split) * total_rows * heads + out_row) * HEAD_DIM + dim] =
              accumulator[r][d] * inverse;
      }
      if (splits > 1 && lane == 0)
        partial_lse[static_cast<long>(split) * total_rows * heads + out_row] =
            running_sum[r] > 0.0f ? running_max[r] + __logf(running_sum[r]) : -INFINITY;
      running_max[r] = -INFINITY;
      running_sum[r] = 0.0f;
#pragma unroll
      for (int d = 0; d < kDimsPerLane; ++d) accumulator[r][d] = 0.0f;
    }
  };
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    if (tile != tile_begin) __syncthreads();  // the previous tile is no longer read
    const int tile_first = tile * kBlockSize;
#pragma unroll
    for (int j = 0; j < kVectorsPerThread; ++j) {
      const int i = threadIdx.x + j * kWarps * 32;
      if (i >= kTileVectors) break;
      const int position = tile_first + i / kVectorsPerRow;
      if (ROPE && position >= block.first_query_position && position < block.length) continue;  // computed below
      uint32_t* key_words = reinterpret_cast<uint32_t*>(&keys[i / kVectorsPerRow][(i % kVectorsPerRow) * 8]);
      uint32_t* value_words = reinterpret_cast<uint32_t*>(&values[i / kVectorsPerRow][(i % kVectorsPerRow) * 8]);
      key_words[0] = key_vectors[j].x, key_words[1] = key_vectors[j].y;
      key_words[2] = key_vectors[j].z, key_words[3] = key_vectors[j].w;
      value_words[0] = value_vectors[j].x, value_words[1] = value_vectors[j].y;
      value_words[2] = value_vectors[j].z, value_words[3] = value_vectors[j].w;
    }
    if constexpr (ROPE) {
      // The step's rows in this tile, a warp per position: the key normed and
      // rotated, the value as it is. The CTA of the row block that holds the
      // token's first query row appends them to the cache (it reads their tile).
      for (int position = own_begin(tile); position < own_end(tile); position += kWarps) {
        const int token = position - block.first_query_position;
        step_key_value<HEAD_DIM>(rope, block.query_start + token, heads, kv_heads, block.kv_head,
                                 block.row_block == token * block.group / kAttentionRowsPerBlock,
                                 keys[position - tile_first], values[position - tile_first], lane);
      }
    }
    __syncthreads();
    if (tile + 1 < tile_end) {  // the next tile's loads, in flight while this one is scored
      const long slot0 = static_cast<long>(block.blocks[tile + 1]) * kBlockSize;
      load_tile(slot0, tile + 1, 0, ROPE ? block.first_query_position : INT_MAX);
      if (ROPE) load_tile(slot0, tile + 1, block.length, INT_MAX);
    }
    const int key_position = tile * kBlockSize + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int local = r * kWarps + warp, row = block.first_row + local;
      if (row >= block.rows) continue;
      const int query_position = block.first_query_position + block.token(row);
      float score = -INFINITY;
      if (key_position <= query_position) {
        // Four elements per load of the key and the query; four independent
        // sums (over alternate groups of 4) so the FMAs do not wait on one chain.
        float dots[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int quad = 0; quad < HEAD_DIM / 4; ++quad) {
          const float4 query = *reinterpret_cast<const float4*>(&queries[local][4 * quad]);
          const float4 key = bf16x4_to_float4(&keys[lane][4 * quad]);
          float& dot = dots[quad % 4];
          dot += query.x * key.x + query.y * key.y;
          dot += query.z * key.z + query.w * key.w;
        }
        score = ((dots[0] + dots[1]) + (dots[2] + dots[3])) * scale;
      }
      const float new_max = fmaxf(running_max[r], warp_max(score));
      if (new_max == -INFINITY) continue;  // every key of this tile is in this row's future
      const float weight = __expf(score - new_max);
      const float correction = __expf(running_max[r] - new_max);
      running_sum[r] = running_sum[r] * correction + warp_sum(weight);
      running_max[r] = new_max;
#pragma unroll
      for (int d = 0; d < kDimsPerLane; ++d) accumulator[r][d] *= correction;
      for (int j = 0; j < kBlockSize; ++j) {
        const float p = __shfl_sync(0xffffffffu, weight, j);
        if constexpr (kDimsPerLane == 4) {  // HEAD_DIM 128: the lane's 4 dims in one load
          const float4 value = bf16x4_to_float4(&values[j][lane * 4]);
          accumulator[r][0] += p * value.x;
          accumulator[r][1] += p * value.y;
          accumulator[r][2] += p * value.z;
          accumulator[r][3] += p * value.w;
        } else {
#pragma unroll
          for (int d = 0; d < kDimsPerLane; ++d) {
            const int dim = lane * kDimsPerLane + d;
            if (dim < HEAD_DIM) accumulator[r][d] += p * __bfloat162float(values[j][dim]);
          }
        }
      }
    }
    if (splits > 1 && ((tile + 1) % kSplitTiles == 0 || tile + 1 == tile_end)) finish_split(tile / kSplitTiles);
  }
  if (splits == 1) {
    finish_split(0);
    return;
  }
  // Splits past the last visible tile: no key (lse -inf, which the merge skips).
  for (int split = tile_end > tile_begin ? (tile_end - 1) / kSplitTiles + 1 : first_split; split < end_split; ++split)
    finish_split(split);

  // The last split of this (sequence, kv head, row block) to finish merges
  // them all, softmax-weighted by each split's log-sum-exp: a warp per row, a
  // lane per dim, the splits in order, with the arithmetic (and the bits) of
  // the merge kernel this replaces, which ended 2.6-2.9 us after this kernel
  // in every step and layer (kernel trace, H100).
  merge_if_last<HEAD_DIM, kWarps>(block, out, partial_out, partial_lse, counters, splits,
                                  static_cast<long>(total_rows) * heads, heads, warp, lane);
}

template <int HEAD_DIM>
void launch(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache, const AttentionBatch& batch,
            int total_rows, int heads, int kv_heads, int splits, float* partial_out, float* partial_lse,
            unsigned* counters, cudaStream_t stream, const AttentionRope* rope) {
  const int row_blocks = attention_row_blocks(batch.max_query_length, heads, kv_heads);
  // A CTA per split would run many short waves when a step has many rows, kv
  // heads and positions (x16 pair, batch-4 verify of 32 tokens at ~500
  // positions: 6144 CTAs of one 32-key tile each, 12 waves, 45 us a layer on
  // the H100 against 15 for batch 1's 8 tokens): a CTA takes a power of two
  // of consecutive splits, so that they fit in one wave (measured, stop 51:
  // batch 4's round 66 us shorter on the H100). Each split is reduced as
  // before, so the bits do not change. Where one split's CTAs alone overflow
  // a wave (batch x kv heads x row blocks > resident CTAs: an x16 verify from
  // batch 8, its decode from batch 17), the grid stays a CTA per split: how
  // many splits a CTA should take against how many waves run there is not
  // measured yet.
  static const long resident = static_cast<long>(multiprocessor_count()) * kAttentionBlocksPerMultiprocessor;
  const long blocks_per_split = static_cast<long>(kv_heads) * batch.sequences * row_blocks;
  int split_group = 1;
  if (blocks_per_split <= resident)
    while (ceil_div(splits, split_group) * blocks_per_split > resident) split_group *= 2;
  const dim3 grid(ceil_div(splits, split_group), kv_heads, batch.sequences * row_blocks);
  launch_dependent(rope ? attention_kernel<HEAD_DIM, true> : attention_kernel<HEAD_DIM, false>, grid, kWarps * 32, 0,
                   stream, out, q, key_cache, value_cache, batch, heads, kv_heads, splits, split_group, row_blocks,
                   partial_out, partial_lse, counters, total_rows, rope ? *rope : AttentionRope{});
  CUDA_CHECK_LAUNCH();
}

// ---- decode and verify steps on tensor cores (splits > 1) ----
//
// The same work and results as attention_kernel with splits > 1 (one split a
// tile: kSplitTiles == 1), but a warp scores a whole split for the CTA's
// kAttentionRowsPerBlock query rows with mma.sync m16n8k16 (tensor_gemv.cuh):
// S = Q K^T, the split's softmax in the fragments' registers, then O = P V.
// Fragment rows g are the CTA's rows (rows g + 8 zero); a query row's sums
// depend only on its own fragment row, so a row keeps its bits wherever it
// sits in a step. P is rounded to bf16 for the second product, and the
// split's sum is taken over the rounded weights, so O / sum stays a weighted
// mean of the values.
//
// The scalar kernel spends about 350 instructions a query row and tile (a
// lane per key, a dot product in FMAs, then 32 shuffles for P V): an x16
// batch-4 verify (3072 query rows, 16 tiles) issues 17M warp instructions a
// layer, 16 us on 132 multiprocessors, and measured ~29 us (PERF.md, stop 51).
// Here a split is 4 x HEAD_DIM / 16 + 2 x HEAD_DIM / 8 mma for all 8 rows.
//
// Keys and values go from memory straight into the fragments, with no tile in
// shared memory: lane (g, c) loads 16 bytes of row 8j + g, dims 32q + 8c .. +
// 7 (TilePieces). For S the query's fragments take its dims in that same
// order (a sum over dims does not notice it, as in tensor_gemv.cuh); for P V
// each 8x8 block of values is transposed in registers (movmatrix), which puts
// output dims 32q + 8c + 2e, + 1 in lane (g, c)'s block e. Shared memory holds
// the CTA's query rows and, with ROPE, the step's own rows: a few KiB. (A form
// with each warp's tile in shared memory, 74 KiB a CTA, took the L1 carve-out
// from the GEMVs around it: they ran 40% slower at batch 1, stop 56.)
//
// grid: as attention_kernel (x = group of split_group splits, y = kv head, z =
// sequence * row_blocks + row block). kSplitWarps warps; counted down from the
// CTA's last visible split, warp w takes splits top - w, top - w - kSplitWarps,
// ... (the step's own rows, the highest, in the warps' first tiles). Shared
// memory (dynamic): the CTA's query rows, then with ROPE the step's keys and
// values ([max_query_length] rows each), rows padded by 16 bytes (8 rows read
// at one column fall on different banks).
constexpr int kSplitWarps = 4;
template <int HEAD_DIM>
constexpr int kSplitRowStride = HEAD_DIM + 8;  // bf16 elements
template <int HEAD_DIM>
constexpr size_t split_attention_shared_bytes(int step_rows) {
  return static_cast<size_t>(kAttentionRowsPerBlock + 2 * step_rows) * kSplitRowStride<HEAD_DIM> * sizeof(bf16);
}

__device__ __forceinline__ uint32_t pack_bf16_pair(bf16 low, bf16 high) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(low)) | (static_cast<uint32_t>(__bfloat16_as_ushort(high)) << 16);
}

// The 8x8 bf16 matrix whose row g, columns 2c and 2c + 1, lane (g, c) holds,
// transposed: the lane gets rows 2c and 2c + 1 of column g.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t fragment) {
  uint32_t transposed;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(transposed) : "r"(fragment));
  return transposed;
}

// Lane (g, c)'s share of a tile: key and value row 8j + g, dims 32q + 8c .. + 7.
template <int HEAD_DIM>
struct TilePieces {
  uint4 key[kBlockSize / 8][HEAD_DIM / 32];
  uint4 value[kBlockSize / 8][HEAD_DIM / 32];
};

// One split of kBlockSize keys (tile_first its first position) for fragment
// row g (query_position: the last key it sees; query: its dims in the tile's
// order): the normalized output (dims 32q + 8c + 2e, + 1 in output[q][e][0..1])
// and log-sum-exp (-inf, output zero, where it sees no key), the same in the
// four lanes of the row's quad.
template <int HEAD_DIM>
__device__ __forceinline__ float split_attention(float (&output)[HEAD_DIM / 32][4][4],
                                                 const uint4 (&query)[HEAD_DIM / 32], const TilePieces<HEAD_DIM>& tile,
                                                 int tile_first, int query_position, float scale, int lane) {
  const int c = lane & 3;
  // S = Q K^T: key block n (keys 8n .. 8n + 7) of row g at the lane's columns 2c, 2c + 1.
  float scores[kBlockSize / 8][4] = {};
#pragma unroll
  for (int n = 0; n < kBlockSize / 8; ++n) {
#pragma unroll
    for (int q = 0; q < HEAD_DIM / 32; ++q) {
      mma_m16n8k16(scores[n], query[q].x, 0u, query[q].y, 0u, tile.key[n][q].x, tile.key[n][q].y);
      mma_m16n8k16(scores[n], query[q].z, 0u, query[q].w, 0u, tile.key[n][q].z, tile.key[n][q].w);
    }
  }
  // The split's softmax: the row's 8 scores here, the rest in its quad's other lanes.
  float maximum = -INFINITY;
#pragma unroll
  for (int n = 0; n < kBlockSize / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key_position = tile_first + 8 * n + 2 * c + e;
      scores[n][e] = key_position <= query_position ? scores[n][e] * scale : -INFINITY;
      maximum = fmaxf(maximum, scores[n][e]);
    }
  maximum = fmaxf(maximum, __shfl_xor_sync(0xffffffffu, maximum, 1));
  maximum = fmaxf(maximum, __shfl_xor_sync(0xffffffffu, maximum, 2));
  uint32_t weights[kBlockSize / 8];  // P of key block n as a bf16 pair (columns 2c, 2c + 1)
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < kBlockSize / 8; ++n) {
    bf16 pair[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      pair[e] = __float2bfloat16(maximum == -INFINITY ? 0.0f : __expf(scores[n][e] - maximum));
      sum += __bfloat162float(pair[e]);
    }
    weights[n] = pack_bf16_pair(pair[0], pair[1]);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  // O = P V, keys 16s .. 16s + 15 a step: the B fragment of block e is the
  // transposed pair words e of value rows 16s + g and 16s + 8 + g.
#pragma unroll
  for (int q = 0; q < HEAD_DIM / 32; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) output[q][e][0] = output[q][e][1] = output[q][e][2] = output[q][e][3] = 0.0f;
#pragma unroll
  for (int step = 0; step < kBlockSize / 16; ++step) {
#pragma unroll
    for (int q = 0; q < HEAD_DIM / 32; ++q) {
      const uint32_t* low = reinterpret_cast<const uint32_t*>(&tile.value[2 * step][q]);
      const uint32_t* high = reinterpret_cast<const uint32_t*>(&tile.value[2 * step + 1][q]);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        mma_m16n8k16(output[q][e], weights[2 * step], 0u, weights[2 * step + 1], 0u, transpose_8x8(low[e]),
                     transpose_8x8(high[e]));
    }
  }
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
  for (int q = 0; q < HEAD_DIM / 32; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) output[q][e][0] *= inverse, output[q][e][1] *= inverse;
  return sum > 0.0f ? maximum + __logf(sum) : -INFINITY;
}

template <int HEAD_DIM, bool ROPE>
__global__ void __launch_bounds__(kSplitWarps * 32)
    split_attention_kernel(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache,
                           AttentionBatch batch, int heads, int kv_heads, int splits, int split_group, int row_blocks,
                           float* partial_out, float* partial_lse, unsigned* counters, int total_rows,
                           AttentionRope rope) {
  static_assert(kSplitTiles == 1 && kBlockSize == 32 && kAttentionRowsPerBlock == 8 && HEAD_DIM % 32 == 0);
  constexpr int kWarps = kSplitWarps;
  constexpr int kStride = kSplitRowStride<HEAD_DIM>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  bf16* queries = reinterpret_cast<bf16*>(shared_bytes);             // [kAttentionRowsPerBlock][kStride]
  bf16* step_keys = queries + kAttentionRowsPerBlock * kStride;      // [max_query_length][kStride] (ROPE)
  bf16* step_values = step_keys + batch.max_query_length * kStride;  // [max_query_length][kStride] (ROPE)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const RowBlock block = row_block_of(batch, heads, kv_heads, row_blocks);
  if (block.first_row >= block.rows) return;  // nothing to do, nothing to wait for
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  const int first_split = blockIdx.x * split_group, end_split = min(splits, first_split + split_group);
  const int top = min(end_split, block.tiles) - 1;  // the CTA's last split with a visible key (< first_split: none)
  const long row_heads = static_cast<long>(total_rows) * heads;
  // The tile's rows at positions [from, to) into the lane's pieces: from the
  // cache, or with ROPE the step's own rows from shared memory. (Rows past
  // those the step fills stay zero: masked, and P V multiplies them by 0.)
  auto load_tile = [&](TilePieces<HEAD_DIM>& pieces, int tile, int from, int to) {
    const long slot0 = static_cast<long>(block.blocks[tile]) * kBlockSize;
#pragma unroll
    for (int j = 0; j < kBlockSize / 8; ++j) {
      const int position = tile * kBlockSize + 8 * j + g;
      if (position < from || position >= to) continue;
      const bf16 *key_row, *value_row;
      if (ROPE && position >= block.first_query_position) {
        key_row = step_keys + (position - block.first_query_position) * kStride;
        value_row = step_values + (position - block.first_query_position) * kStride;
      } else {
        const long offset = ((slot0 + 8 * j + g) * kv_heads + block.kv_head) * HEAD_DIM;
        key_row = key_cache + offset;
        value_row = value_cache + offset;
      }
#pragma unroll
      for (int piece = 0; piece < HEAD_DIM / 32; ++piece) {
        pieces.key[j][piece] = *reinterpret_cast<const uint4*>(key_row + 32 * piece + 8 * c);
        pieces.value[j][piece] = *reinterpret_cast<const uint4*>(value_row + 32 * piece + 8 * c);
      }
    }
  };
  const int filled_end = ROPE ? block.visible_end : block.length;
  // Before the wait: this warp's first tile's cached rows (no kernel of this step writes them).
  const int first_tile = top - warp;
  TilePieces<HEAD_DIM> pieces = {};
  if (first_tile >= first_split) load_tile(pieces, first_tile, 0, block.first_query_position);
  wait_for_previous_kernel();
  start_next_kernel();

  // The CTA's query rows, a warp each (bf16, as attention_kernel reads or computes them); rows past `rows` zero.
  for (int local = warp; local < kAttentionRowsPerBlock; local += kWarps) {
    const int row = block.first_row + local;
    bf16* query_row = queries + local * kStride;
    if (row >= block.rows) {
      for (int i = lane; i < HEAD_DIM; i += 32) query_row[i] = __float2bfloat16(0.0f);
      continue;
    }
    if constexpr (ROPE) {
      rope_query_row<HEAD_DIM>(rope, block.query_start + block.token(row), block.head(row), heads, kv_heads, lane,
                               [&](int i, bf16 value) { query_row[i] = value; });
    } else {
      for (int i = lane; i < HEAD_DIM; i += 32) query_row[i] = q[block.out_row(row, heads) * HEAD_DIM + i];
    }
  }
  if constexpr (ROPE) {
    // The step's rows this CTA sees, a warp each, as attention_kernel computes
    // them: the key normed and rotated, the value as it is. The CTA of the row
    // block that holds the token's first query row appends them to the cache.
    // (Counted from the last warp down: in a decode step the key's chain of
    // loads runs beside the query rows' instead of after one of them.)
    const int begin = max(block.first_query_position, first_split * kBlockSize);
    const int end = min(block.visible_end, (top + 1) * kBlockSize);
    for (int position = begin + (kWarps - 1 - warp); position < end; position += kWarps) {
      const int token = position - block.first_query_position;
      step_key_value<HEAD_DIM>(rope, block.query_start + token, heads, kv_heads, block.kv_head,
                               block.row_block == token * block.group / kAttentionRowsPerBlock,
                               step_keys + token * kStride, step_values + token * kStride, lane);
    }
  }
  __syncthreads();  // the queries and the step's rows are in place
  if (first_tile >= first_split) load_tile(pieces, first_tile, block.first_query_position, filled_end);

  // Fragment row g: its dims in the tiles' order, its query position and its row of partial_out / out.
  uint4 query[HEAD_DIM / 32];
#pragma unroll
  for (int piece = 0; piece < HEAD_DIM / 32; ++piece)
    query[piece] = *reinterpret_cast<const uint4*>(queries + g * kStride + 32 * piece + 8 * c);
  const int row = block.first_row + g;
  const bool row_valid = row < block.rows;
  const int query_position = block.first_query_position + block.token(row);
  const long out_row = block.out_row(row, heads);
  for (int tile = first_tile; tile >= first_split; tile -= kWarps) {
    if (tile != first_tile) {
      pieces = {};
      load_tile(pieces, tile, 0, filled_end);
    }
    float output[HEAD_DIM / 32][4][4];
    const float lse = split_attention<HEAD_DIM>(output, query, pieces, tile * kBlockSize, query_position, scale, lane);
    if (row_valid) {
      float* partial = partial_out + (tile * row_heads + out_row) * HEAD_DIM;
#pragma unroll
      for (int piece = 0; piece < HEAD_DIM / 32; ++piece) {
        const float(&o)[4][4] = output[piece];
        float4* eight = reinterpret_cast<float4*>(partial + 32 * piece + 8 * c);
        eight[0] = make_float4(o[0][0], o[0][1], o[1][0], o[1][1]);
        eight[1] = make_float4(o[2][0], o[2][1], o[3][0], o[3][1]);
      }
      if (c == 0) partial_lse[tile * row_heads + out_row] = lse;
    }
  }
  // Splits past the block's last visible key: nothing to add.
  for (int split = max(first_split, block.tiles) + warp; split < end_split; split += kWarps)
    if (row_valid && c == 0) partial_lse[split * row_heads + out_row] = -INFINITY;

  merge_if_last<HEAD_DIM, kWarps>(block, out, partial_out, partial_lse, counters, splits, row_heads, heads, warp, lane);
}

template <int HEAD_DIM>
void launch_split(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache, const AttentionBatch& batch,
                  int total_rows, int heads, int kv_heads, int splits, float* partial_out, float* partial_lse,
                  unsigned* counters, cudaStream_t stream, const AttentionRope* rope) {
  auto kernel = rope ? split_attention_kernel<HEAD_DIM, true> : split_attention_kernel<HEAD_DIM, false>;
  const size_t shared = split_attention_shared_bytes<HEAD_DIM>(rope ? batch.max_query_length : 0);
  // The CTAs a multiprocessor holds (at the longest step's shared memory) size the split groups.
  static const long resident = [] {
    constexpr size_t kMostShared = split_attention_shared_bytes<HEAD_DIM>(kSplitMaxQueryLength);
    static_assert(kMostShared <= 48 * 1024, "above 48 KiB a launch needs an opt-in");
    long fewest = LONG_MAX;
    for (auto each : {split_attention_kernel<HEAD_DIM, true>, split_attention_kernel<HEAD_DIM, false>}) {
      int per_multiprocessor = 0;
      CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, each, kSplitWarps * 32, kMostShared));
      fewest = std::min(fewest, static_cast<long>(per_multiprocessor) * multiprocessor_count());
    }
    return fewest;
  }();
  const int row_blocks = attention_row_blocks(batch.max_query_length, heads, kv_heads);
  // A CTA takes at least a split a warp, and more (a power of two) while the
  // grid would overflow one wave.
  const long blocks_per_split = static_cast<long>(kv_heads) * batch.sequences * row_blocks;
  int split_group = kSplitWarps;
  while (split_group < splits && ceil_div(splits, split_group) * blocks_per_split > resident) split_group *= 2;
  const dim3 grid(ceil_div(splits, split_group), kv_heads, batch.sequences * row_blocks);
  launch_dependent(kernel, grid, kSplitWarps * 32, shared, stream, out, q, key_cache, value_cache, batch, heads,
                   kv_heads, splits, split_group, row_blocks, partial_out, partial_lse, counters, total_rows,
                   rope ? *rope : AttentionRope{});
  CUDA_CHECK_LAUNCH();
}

// ---- bidirectional block attention (the drafter) ----

// 8 warps: with γ <= 8 each query row has a warp of its own, and each thread
// keeps at most 4 rows' softmax state (more spills registers).
constexpr int kDraftWarps = 8;
constexpr int kDraftRowsPerWarp = kMaxDraftQueries / kDraftWarps;

// Dynamic shared memory: keys and values [kBlockSize][head_dim + 2] bf16 (the
// pad puts the lanes scoring their own key on distinct banks), then the
// queries [γ][head_dim] f32.
size_t bidirectional_shared_bytes(int gamma, int head_dim) {
  return 2 * size_t(kBlockSize) * (head_dim + 2) * sizeof(bf16) + size_t(gamma) * head_dim * sizeof(float);
}

// grid: x = KV split, y = head, z = row b. DIMS_PER_LANE = ceil(head_dim / 32).
// Two blocks a multiprocessor: a split of one tile each (kMaxDraftSplits)
// makes more blocks than multiprocessors.
template <int DIMS_PER_LANE>
__global__ void __launch_bounds__(kDraftWarps * 32, 2)
    bidirectional_attention_kernel(bf16* out, const bf16* q, const bf16* block_keys, const bf16* block_values,
                                   long block_stride, DraftAttentionBatch batch, int gamma, int heads, int head_dim,
                                   int splits, float* partial_out, float* partial_lse, unsigned* counters) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int padded = head_dim + 2;
  bf16* keys = reinterpret_cast<bf16*>(shared);
  bf16* values = keys + kBlockSize * padded;
  float* queries = reinterpret_cast<float*>(values + kBlockSize * padded);
  const int split = blockIdx.x, head = blockIdx.y, b = blockIdx.z;
  const int rows = batch.rows;
  const int length = batch.context_length[b];
  const int total = length + gamma;  // context ++ block
  const int tiles = (total + kBlockSize - 1) / kBlockSize;
  const int tiles_per_split = (tiles + splits - 1) / splits;
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min(tiles, tile_begin + tiles_per_split);
  const bf16* context_keys = batch.context_keys[b];
  const bf16* context_values = batch.context_values[b];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  const long head_offset = static_cast<long>(head) * head_dim;
  const int chunks = head_dim / 8;  // 16-byte pieces of one key row
  // 16-byte chunks of a tile a thread, at most
  constexpr int kDraftTileLoads = (kBlockSize * 32 * DIMS_PER_LANE / 8 + kDraftWarps * 32 - 1) / (kDraftWarps * 32);

  // A tile's keys and values in registers, chunk i = threadIdx.x + 256 j of the tile's [kBlockSize][chunks]:
  // the context's rows (CONTEXT), which no kernel before this one writes (they came from the context's
  // extension, before the step), and the block's own rows (BLOCK), which the previous kernel (the k|v|q GEMM)
  // writes. Past the end: zeros, never NaN.
  uint4 tile_keys[kDraftTileLoads], tile_values[kDraftTileLoads];
  auto load_tile = [&](int tile, bool context, bool block) {
#pragma unroll
    for (int j = 0; j < kDraftTileLoads; ++j) {
      const int i = threadIdx.x + j * kDraftWarps * 32, key = i / chunks, chunk = i % chunks;
      const int position = tile * kBlockSize + key;
      if (i >= kBlockSize * chunks) continue;
      if (position < length) {
        if (!context) continue;
        const long offset = static_cast<long>(position) * batch.context_stride + head_offset + chunk * 8;
        tile_keys[j] = *reinterpret_cast<const uint4*>(context_keys + offset);
        tile_values[j] = *reinterpret_cast<const uint4*>(context_values + offset);
      } else if (position < total) {
        if (!block) continue;
        const long offset = (static_cast<long>(position - length) * rows + b) * block_stride + head_offset + chunk * 8;
        tile_keys[j] = *reinterpret_cast<const uint4*>(block_keys + offset);
        tile_values[j] = *reinterpret_cast<const uint4*>(block_values + offset);
      }
    }
  };
  auto clear_tile = [&] {
#pragma unroll
    for (int j = 0; j < kDraftTileLoads; ++j) tile_keys[j] = tile_values[j] = make_uint4(0, 0, 0, 0);
  };
  // The first tile's context rows before the wait for the previous kernel: their round trip overlaps its end.
  clear_tile();
  if (tile_begin < tile_end) load_tile(tile_begin, true, false);
  wait_for_previous_kernel();
  start_next_kernel();
  if (tile_begin < tile_end) load_tile(tile_begin, false, true);

  for (int i = threadIdx.x; i < gamma * head_dim; i += kDraftWarps * 32) {
    const int k = i / head_dim, dim = i % head_dim;
    queries[i] = __bfloat162float(q[(static_cast<long>(k) * rows + b) * block_stride + head_offset + dim]);
  }
  float running_max[kDraftRowsPerWarp], running_sum[kDraftRowsPerWarp], accumulator[kDraftRowsPerWarp][DIMS_PER_LANE];
#pragma unroll
  for (int r = 0; r < kDraftRowsPerWarp; ++r) {
    running_max[r] = -INFINITY;
    running_sum[r] = 0.0f;
#pragma unroll
    for (int d = 0; d < DIMS_PER_LANE; ++d) accumulator[r][d] = 0.0f;
  }
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    if (tile > tile_begin) clear_tile(), load_tile(tile, true, true);
    __syncthreads();  // the previous tile is no longer read (and the queries are written)
#pragma unroll
    for (int j = 0; j < kDraftTileLoads; ++j) {
      const int i = threadIdx.x + j * kDraftWarps * 32, key = i / chunks, chunk = i % chunks;
      if (i >= kBlockSize * chunks) continue;
      uint32_t* key_words = reinterpret_cast<uint32_t*>(keys + key * padded + chunk * 8);
      uint32_t* value_words = reinterpret_cast<uint32_t*>(values + key * padded + chunk * 8);
      key_words[0] = tile_keys[j].x, key_words[1] = tile_keys[j].y, key_words[2] = tile_keys[j].z;
      key_words[3] = tile_keys[j].w;
      value_words[0] = tile_values[j].x, value_words[1] = tile_values[j].y, value_words[2] = tile_values[j].z;
      value_words[3] = tile_values[j].w;
    }
    __syncthreads();
    const int key_position = tile * kBlockSize + lane;
#pragma unroll
    for (int r = 0; r < kDraftRowsPerWarp; ++r) {
      const int k = r * kDraftWarps + warp;
      if (k >= gamma) continue;  // the same for the whole warp
      float score = -INFINITY;
      if (key_position < total) {
        const float* query = queries + k * head_dim;
        const bf16* key = keys + lane * padded;
        // Four independent sums over the 8-element chunks (head_dim / 8 of
        // them): one dependent chain of head_dim FMAs was most of the kernel.
        float dots[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int chunk = 0; chunk < chunks; ++chunk) {
          float& dot = dots[chunk % 4];
#pragma unroll
          for (int pair = 4 * chunk; pair < 4 * chunk + 4; ++pair) {
            const float2 key_pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(key + 2 * pair));
            dot += query[2 * pair] * key_pair.x + query[2 * pair + 1] * key_pair.y;
          }
        }
        score = ((dots[0] + dots[1]) + (dots[2] + dots[3])) * scale;
      }
      const float new_max = fmaxf(running_max[r], warp_max(score));
      if (new_max == -INFINITY) continue;  // no key of this tile (cannot happen inside [0, total))
      const float weight = __expf(score - new_max);
      const float correction = __expf(running_max[r] - new_max);
      running_sum[r] = running_sum[r] * correction + warp_sum(weight);
      running_max[r] = new_max;
#pragma unroll
      for (int d = 0; d < DIMS_PER_LANE; ++d) accumulator[r][d] *= correction;
      for (int j = 0; j < kBlockSize; ++j) {
        const float p = __shfl_sync(0xffffffffu, weight, j);
        const bf16* value = values + j * padded;
        if constexpr (DIMS_PER_LANE % 2 == 0) {  // bf16 pairs (head_dim is a multiple of 8, rows 4-byte aligned)
#pragma unroll
          for (int d = 0; d < DIMS_PER_LANE; d += 2) {
            const int dim = lane * DIMS_PER_LANE + d;
            if (dim >= head_dim) continue;
            const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(value + dim));
            accumulator[r][d] += p * pair.x;
            accumulator[r][d + 1] += p * pair.y;
          }
        } else {
#pragma unroll
          for (int d = 0; d < DIMS_PER_LANE; ++d) {
            const int dim = lane * DIMS_PER_LANE + d;
            if (dim < head_dim) accumulator[r][d] += p * __bfloat162float(value[dim]);
          }
        }
      }
    }
  }
  const long width = static_cast<long>(heads) * head_dim;
  const long partial_base = (static_cast<long>(b) * heads + head) * splits;  // this (row, head)'s first split
#pragma unroll
  for (int r = 0; r < kDraftRowsPerWarp; ++r) {
    const int k = r * kDraftWarps + warp;
    if (k >= gamma) continue;
    const float inverse = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
#pragma unroll
    for (int d = 0; d < DIMS_PER_LANE; ++d) {
      const int dim = lane * DIMS_PER_LANE + d;
      if (dim >= head_dim) continue;
      if (splits == 1)
        out[(static_cast<long>(k) * rows + b) * width + head_offset + dim] = __float2bfloat16(accumulator[r][d] * inverse);
      else
        partial_out[((partial_base + split) * gamma + k) * head_dim + dim] = accumulator[r][d] * inverse;
    }
    if (splits > 1 && lane == 0)
      partial_lse[(partial_base + split) * gamma + k] =
          running_sum[r] > 0.0f ? running_max[r] + __logf(running_sum[r]) : -INFINITY;
  }
  if (splits == 1) return;

  // The last split of this (row, head) to finish merges all of them.
  if (!took_last_ticket(counters + static_cast<long>(b) * heads + head, splits)) return;
  // Only the splits that hold keys (the rest wrote nothing to add). Each
  // split's weight per query is computed once into shared memory; then every
  // output element issues all its splits' loads at once: a loop of dependent
  // L2 round trips (one per split and element) cost the step 25 us per layer.
  const int active = (tiles + tiles_per_split - 1) / tiles_per_split;
  __shared__ float split_weight[kMaxDraftSplits][kMaxDraftQueries], weight_total[kMaxDraftQueries];
  for (int k = threadIdx.x; k < gamma; k += kDraftWarps * 32) {
    float lse[kMaxDraftSplits];
#pragma unroll
    for (int s = 0; s < kMaxDraftSplits; ++s)
      lse[s] = s < active ? __ldcg(partial_lse + (partial_base + s) * gamma + k) : -INFINITY;
    float maximum = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxDraftSplits; ++s) maximum = fmaxf(maximum, lse[s]);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxDraftSplits; ++s) {
      split_weight[s][k] = lse[s] == -INFINITY ? 0.0f : __expf(lse[s] - maximum);
      sum += split_weight[s][k];
    }
    weight_total[k] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < gamma * head_dim; i += kDraftWarps * 32) {
    const int k = i / head_dim, dim = i % head_dim;
    float value[kMaxDraftSplits];
#pragma unroll
    for (int s = 0; s < kMaxDraftSplits; ++s)
      value[s] = s < active ? __ldcg(partial_out + ((partial_base + s) * gamma + k) * head_dim + dim) : 0.0f;
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxDraftSplits; ++s) total += split_weight[s][k] * value[s];
    out[(static_cast<long>(k) * rows + b) * width + head_offset + dim] =
        __float2bfloat16(weight_total[k] > 0.0f ? total / weight_total[k] : 0.0f);
  }
  if (threadIdx.x == 0) counters[static_cast<long>(b) * heads + head] = 0;  // ready for the next launch
}

template <int DIMS_PER_LANE>
void launch_bidirectional(bf16* out, const bf16* q, const bf16* block_keys, const bf16* block_values,
                          long block_stride, const DraftAttentionBatch& batch, int gamma, int heads, int head_dim,
                          int splits, float* partial_out, float* partial_lse, unsigned* counters,
                          cudaStream_t stream) {
  // Above 48 KiB of dynamic shared memory needs an opt-in, given once for the
  // largest use (first made outside graph capture: the drafter runs each shape eagerly first).
  static const bool opted_in = [] {
    const int most = static_cast<int>(bidirectional_shared_bytes(kMaxDraftQueries, 32 * DIMS_PER_LANE));
    CUDA_CHECK(cudaFuncSetAttribute(bidirectional_attention_kernel<DIMS_PER_LANE>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    return true;
  }();
  (void)opted_in;
  const dim3 grid(splits, heads, batch.rows);
  launch_dependent(bidirectional_attention_kernel<DIMS_PER_LANE>, grid, kDraftWarps * 32,
                   bidirectional_shared_bytes(gamma, head_dim), stream, out, q, block_keys, block_values, block_stride,
                   batch, gamma, heads, head_dim, splits, partial_out, partial_lse, counters);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void bidirectional_attention_forward(bf16* out, const bf16* q, const bf16* block_keys, const bf16* block_values,
                                     long block_stride, const DraftAttentionBatch& batch, int gamma, int heads,
                                     int head_dim, int splits, float* partial_out, float* partial_lse,
                                     unsigned* counters, cudaStream_t stream) {
  DSPARK_CHECK(head_dim % 8 == 0 && head_dim > 0 && head_dim <= 256, "draft attention: head_dim ", head_dim,
               " is not supported (a multiple of 8, at most 256)");
  DSPARK_CHECK(gamma >= 1 && gamma <= kMaxDraftQueries, "draft attention: gamma ", gamma, " is outside 1..",
               kMaxDraftQueries);
  DSPARK_CHECK(splits >= 1 && splits <= kMaxDraftSplits, "draft attention: splits ", splits, " is outside 1..",
               kMaxDraftSplits);
  if (batch.rows == 0) return;
  auto launch = head_dim <= 32    ? launch_bidirectional<1>
                : head_dim <= 64  ? launch_bidirectional<2>
                : head_dim <= 128 ? launch_bidirectional<4>
                                  : launch_bidirectional<8>;
  launch(out, q, block_keys, block_values, block_stride, batch, gamma, heads, head_dim, splits, partial_out,
         partial_lse, counters, stream);
}

void attention_forward(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache,
                       const AttentionBatch& batch, int total_rows, int heads, int kv_heads, int head_dim, int splits,
                       float* partial_out, float* partial_lse, unsigned* counters, cudaStream_t stream,
                       const AttentionRope* rope) {
  auto launch_for_head_dim = head_dim == 16    ? launch<16>
                             : head_dim == 32  ? launch<32>
                             : head_dim == 64  ? launch<64>
                             : head_dim == 128 ? launch<128>
                                               : nullptr;
  if (!launch_for_head_dim) fail("attention: head_dim ", head_dim, " is not supported (16, 32, 64, 128)");
  // Decode and verify steps (splits > 1) on tensor cores, unless DSPARK_ATTENTION_SCALAR=1 (comparison).
  static const bool scalar = environment_switch_on("DSPARK_ATTENTION_SCALAR");
  auto split_for_head_dim = head_dim == 32    ? launch_split<32>
                            : head_dim == 64  ? launch_split<64>
                            : head_dim == 128 ? launch_split<128>
                                              : nullptr;
  const bool step_fits = batch.max_query_length <= kSplitMaxQueryLength;
  if (splits > 1 && split_for_head_dim && step_fits && !scalar) launch_for_head_dim = split_for_head_dim;
  launch_for_head_dim(out, q, key_cache, value_cache, batch, total_rows, heads, kv_heads, splits, partial_out,
                      partial_lse, counters, stream, rope);
}

// ---- training ----

namespace {

constexpr int kTrainThreads = 256;

// Shared floats of the forward and backward kernels for γ queries of head_dim.
long train_forward_floats(int gamma, int head_dim) {
  return 2L * gamma * head_dim + 2L * kTrainKeyTile * (head_dim + 1) + long(gamma) * kTrainKeyTile + 3L * gamma;
}
long train_backward_floats(int gamma, int head_dim) {
  return 3L * gamma * head_dim + 2L * kTrainKeyTile * (head_dim + 1) + 2L * gamma * kTrainKeyTile + 2L * gamma;
}

// Key `key` of anchor `anchor` (context rows first, then the block's): its row
// in the context tensors (is_context) or in the block tensors.
struct KeyRow {
  long row;
  bool is_context;
};
__device__ __forceinline__ KeyRow key_row(int key, int context_length, long context_first, int anchor, int anchors) {
  if (key < context_length) return {context_first + key, true};
  return {static_cast<long>(key - context_length) * anchors + anchor, false};
}

// Loads keys (and values) [count, hd] of one head into rows of hd + 1 floats
// (the padding puts the lanes reading one column of consecutive keys on distinct banks).
__device__ __forceinline__ void load_key_tile(float* keys, float* values, const float* block_keys,
                                              const float* block_values, const float* context_keys,
                                              const float* context_values, int tile, int count, int context_length,
                                              long context_first, int anchor, int anchors, int head, int head_dim,
                                              int width) {
  const int stride = head_dim + 1;
  for (int e = threadIdx.x; e < count * head_dim; e += blockDim.x) {
    const int j = e / head_dim, i = e % head_dim;
    const KeyRow at = key_row(tile + j, context_length, context_first, anchor, anchors);
    const long offset = at.row * width + static_cast<long>(head) * head_dim + i;
    keys[j * stride + i] = at.is_context ? context_keys[offset] : block_keys[offset];
    values[j * stride + i] = at.is_context ? context_values[offset] : block_values[offset];
  }
}

// grid (A, heads). Shared: queries [γ][hd], outputs [γ][hd], keys and values
// [T][hd+1], scores [γ][T], running max / sum / rescale factor [γ].
__global__ void __launch_bounds__(kTrainThreads)
    train_attention_forward_kernel(float* out, float* lse, const float* q, const float* block_keys,
                                   const float* block_values, const float* context_keys, const float* context_values,
                                   const int32_t* context_offsets, int anchors, int gamma, int heads, int head_dim) {
  constexpr int T = kTrainKeyTile;
  extern __shared__ __align__(16) unsigned char shared[];  // one declaration per file: the draft kernel's
  const int anchor = blockIdx.x, head = blockIdx.y;
  const int stride = head_dim + 1, width = heads * head_dim;
  float* queries = reinterpret_cast<float*>(shared);
  float* outputs = queries + gamma * head_dim;
  float* keys = outputs + gamma * head_dim;
  float* values = keys + T * stride;
  float* scores = values + T * stride;
  float* maxima = scores + gamma * T;
  float* sums = maxima + gamma;
  float* factors = sums + gamma;
  const long context_first = context_offsets[anchor];
  const int context_length = context_offsets[anchor + 1] - static_cast<int>(context_first);
  const int key_count = context_length + gamma;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
    const int k = e / head_dim, i = e % head_dim;
    queries[e] = q[(static_cast<long>(k) * anchors + anchor) * width + static_cast<long>(head) * head_dim + i];
    outputs[e] = 0.0f;
  }
  for (int k = threadIdx.x; k < gamma; k += blockDim.x) {
    maxima[k] = -INFINITY;
    sums[k] = 0.0f;
  }
  for (int tile = 0; tile < key_count; tile += T) {
    const int count = min(T, key_count - tile);
    __syncthreads();  // the previous tile is no longer read; the initial writes are visible
    load_key_tile(keys, values, block_keys, block_values, context_keys, context_values, tile, count, context_length,
                  context_first, anchor, anchors, head, head_dim, width);
    __syncthreads();
    for (int e = threadIdx.x; e < gamma * T; e += blockDim.x) {
      const int k = e / T, j = e % T;
      float score = -INFINITY;
      if (j < count) {
        float dot = 0.0f;
        for (int i = 0; i < head_dim; ++i) dot += queries[k * head_dim + i] * keys[j * stride + i];
        score = dot * scale;
      }
      scores[e] = score;
    }
    __syncthreads();
    for (int k = warp; k < gamma; k += warps) {  // lane j: key j of the tile (T == 32)
      const float score = scores[k * T + lane];
      const float previous_max = maxima[k];
      const float new_max = fmaxf(previous_max, warp_max(score));  // finite: key 0 of the tile is real
      const float weight = lane < count ? expf(score - new_max) : 0.0f;
      const float total = warp_sum(weight);
      scores[k * T + lane] = weight;
      if (lane == 0) {
        const float factor = expf(previous_max - new_max);  // 0 on the first tile (previous_max = -inf)
        factors[k] = factor;
        sums[k] = sums[k] * factor + total;
        maxima[k] = new_max;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
      const int k = e / head_dim, i = e % head_dim;
      float accumulator = outputs[e] * factors[k];
      for (int j = 0; j < count; ++j) accumulator += scores[k * T + j] * values[j * stride + i];
      outputs[e] = accumulator;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
    const int k = e / head_dim, i = e % head_dim;
    out[(static_cast<long>(k) * anchors + anchor) * width + static_cast<long>(head) * head_dim + i] =
        outputs[e] / sums[k];
  }
  for (int k = threadIdx.x; k < gamma; k += blockDim.x)
    lse[(static_cast<long>(k) * anchors + anchor) * heads + head] = maxima[k] + logf(sums[k]);
}

// grid (A, heads). Per tile of keys: P = exp(scale Q K^T - lse), dP = dO V^T,
// dS = scale P ⊙ (dP - Δ) with Δ_q = dO_q · O_q (= Σ_j P dP); then dV_j += Σ_q P dO_q,
// dK_j += Σ_q dS Q_q (keys owned by this CTA: written here), dQ += dS K (kept in shared memory).
// Shared: queries, dO, dQ [γ][hd], keys and values [T][hd+1], P and dS [γ][T], lse and Δ [γ].
__global__ void __launch_bounds__(kTrainThreads)
    train_attention_backward_kernel(float* dq, float* dblock_keys, float* dblock_values, float* dcontext_keys,
                                    float* dcontext_values, const float* dout, const float* out, const float* lse,
                                    const float* q, const float* block_keys, const float* block_values,
                                    const float* context_keys, const float* context_values,
                                    const int32_t* context_offsets, int anchors, int gamma, int heads, int head_dim) {
  constexpr int T = kTrainKeyTile;
  extern __shared__ __align__(16) unsigned char shared[];  // one declaration per file: the draft kernel's
  const int anchor = blockIdx.x, head = blockIdx.y;
  const int stride = head_dim + 1, width = heads * head_dim;
  float* queries = reinterpret_cast<float*>(shared);
  float* gradients = queries + gamma * head_dim;
  float* query_gradients = gradients + gamma * head_dim;
  float* keys = query_gradients + gamma * head_dim;
  float* values = keys + T * stride;
  float* probabilities = values + T * stride;
  float* score_gradients = probabilities + gamma * T;
  float* log_sums = score_gradients + gamma * T;
  float* deltas = log_sums + gamma;
  const long context_first = context_offsets[anchor];
  const int context_length = context_offsets[anchor + 1] - static_cast<int>(context_first);
  const int key_count = context_length + gamma;
  const float scale = rsqrtf(static_cast<float>(head_dim));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  auto query_offset = [&](int k) {
    return (static_cast<long>(k) * anchors + anchor) * width + static_cast<long>(head) * head_dim;
  };
  for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
    const int k = e / head_dim, i = e % head_dim;
    queries[e] = q[query_offset(k) + i];
    gradients[e] = dout[query_offset(k) + i];
    query_gradients[e] = 0.0f;
  }
  for (int k = warp; k < gamma; k += warps) {
    float dot = 0.0f;
    for (int i = lane; i < head_dim; i += 32) dot += dout[query_offset(k) + i] * out[query_offset(k) + i];
    dot = warp_sum(dot);
    if (lane == 0) {
      deltas[k] = dot;
      log_sums[k] = lse[(static_cast<long>(k) * anchors + anchor) * heads + head];
    }
  }
  for (int tile = 0; tile < key_count; tile += T) {
    const int count = min(T, key_count - tile);
    __syncthreads();  // the previous tile is no longer read; the initial writes are visible
    load_key_tile(keys, values, block_keys, block_values, context_keys, context_values, tile, count, context_length,
                  context_first, anchor, anchors, head, head_dim, width);
    __syncthreads();
    for (int e = threadIdx.x; e < gamma * T; e += blockDim.x) {
      const int k = e / T, j = e % T;
      float probability = 0.0f, score_gradient = 0.0f;
      if (j < count) {
        float dot = 0.0f, probability_gradient = 0.0f;
        for (int i = 0; i < head_dim; ++i) {
          dot += queries[k * head_dim + i] * keys[j * stride + i];
          probability_gradient += gradients[k * head_dim + i] * values[j * stride + i];
        }
        probability = expf(dot * scale - log_sums[k]);
        score_gradient = scale * probability * (probability_gradient - deltas[k]);
      }
      probabilities[e] = probability;
      score_gradients[e] = score_gradient;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < count * head_dim; e += blockDim.x) {
      const int j = e / head_dim, i = e % head_dim;
      float value_gradient = 0.0f, key_gradient = 0.0f;
      for (int k = 0; k < gamma; ++k) {
        value_gradient += probabilities[k * T + j] * gradients[k * head_dim + i];
        key_gradient += score_gradients[k * T + j] * queries[k * head_dim + i];
      }
      const KeyRow at = key_row(tile + j, context_length, context_first, anchor, anchors);
      const long offset = at.row * width + static_cast<long>(head) * head_dim + i;
      if (at.is_context) {
        dcontext_keys[offset] += key_gradient;
        dcontext_values[offset] += value_gradient;
      } else {
        dblock_keys[offset] += key_gradient;
        dblock_values[offset] += value_gradient;
      }
    }
    for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
      const int k = e / head_dim, i = e % head_dim;
      float accumulator = 0.0f;
      for (int j = 0; j < count; ++j) accumulator += score_gradients[k * T + j] * keys[j * stride + i];
      query_gradients[e] += accumulator;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < gamma * head_dim; e += blockDim.x) {
    const int k = e / head_dim, i = e % head_dim;
    dq[query_offset(k) + i] += query_gradients[e];
  }
}

template <class Kernel>
size_t train_shared_bytes(Kernel kernel, long floats) {
  const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
  DSPARK_CHECK(bytes <= static_cast<size_t>(max_shared_bytes()), "training attention: gamma x head size needs ", bytes,
               " bytes of shared memory; this GPU has ", max_shared_bytes());
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

}  // namespace

bool train_attention_fits(int gamma, int head_dim) {
  return train_backward_floats(gamma, head_dim) * static_cast<long>(sizeof(float)) <= max_shared_bytes();
}

void bidirectional_attention_forward(float* out, float* lse, const float* q, const float* block_keys,
                                     const float* block_values, const float* context_keys,
                                     const float* context_values, const TrainAttentionBatch& batch,
                                     cudaStream_t stream) {
  if (batch.anchors <= 0) return;
  const size_t bytes =
      train_shared_bytes(train_attention_forward_kernel, train_forward_floats(batch.gamma, batch.head_dim));
  const dim3 grid(batch.anchors, batch.heads);
  train_attention_forward_kernel<<<grid, kTrainThreads, bytes, stream>>>(
      out, lse, q, block_keys, block_values, context_keys, context_values, batch.context_offsets, batch.anchors,
      batch.gamma, batch.heads, batch.head_dim);
  CUDA_CHECK_LAUNCH();
}

void bidirectional_attention_backward(float* dq, float* dblock_keys, float* dblock_values, float* dcontext_keys,
                                      float* dcontext_values, const float* dout, const float* out, const float* lse,
                                      const float* q, const float* block_keys, const float* block_values,
                                      const float* context_keys, const float* context_values,
                                      const TrainAttentionBatch& batch, cudaStream_t stream) {
  if (batch.anchors <= 0) return;
  const size_t bytes =
      train_shared_bytes(train_attention_backward_kernel, train_backward_floats(batch.gamma, batch.head_dim));
  const dim3 grid(batch.anchors, batch.heads);
  train_attention_backward_kernel<<<grid, kTrainThreads, bytes, stream>>>(
      dq, dblock_keys, dblock_values, dcontext_keys, dcontext_values, dout, out, lse, q, block_keys, block_values,
      context_keys, context_values, batch.context_offsets, batch.anchors, batch.gamma, batch.heads, batch.head_dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
