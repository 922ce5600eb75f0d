#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"

namespace dspark::cuda {
namespace {

constexpr int kWarps = 4;

constexpr int kRowsPerWarp = kAttentionRowsPerBlock / kWarps;

// grid: x = KV split, y = kv head, z = sequence * row_blocks + row block.
// Each CTA streams its KV range tile by tile (kBlockSize positions, one cache
// block) through shared memory; each warp keeps an online softmax for
// kRowsPerWarp query rows, lane j scoring key j of the tile and owning
// head_dim/32 output dims.
template <int HEAD_DIM>
__global__ void __launch_bounds__(kWarps * 32)
    attention_kernel(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache, AttentionBatch batch,
                     int heads, int kv_heads, int splits, int row_blocks, float* partial_out, float* partial_lse,
                     int total_rows) {
  constexpr int kPad = 2;  // row stride HEAD_DIM + 2 bf16: lanes reading their own key hit distinct banks
  constexpr int kDimsPerLane = HEAD_DIM >= 32 ? HEAD_DIM / 32 : 1;
  __shared__ __align__(16) bf16 keys[kBlockSize][HEAD_DIM + kPad];
  __shared__ __align__(16) bf16 values[kBlockSize][HEAD_DIM + kPad];
  __shared__ float queries[kAttentionRowsPerBlock][HEAD_DIM];
  const int sequence = blockIdx.z / row_blocks, row_block = blockIdx.z % row_blocks;
  const int kv_head = blockIdx.y, split = blockIdx.x;
  const int group = heads / kv_heads;
  const int query_length = batch.query_length[sequence];
  const int rows = query_length * group;  // (query token, head in group) pairs of this kv head
  const int first_row = row_block * kAttentionRowsPerBlock;
  if (first_row >= rows) return;
  const int length = batch.sequence_length[sequence];
  const int first_query_position = length - query_length;
  const int query_start = batch.query_start[sequence];
  const int32_t* blocks = batch.block_tables + static_cast<long>(batch.table_row[sequence]) * batch.max_blocks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  // This CTA's rows; the last one bounds the causal range it needs.
  const int last_row = min(rows, first_row + kAttentionRowsPerBlock) - 1;
  const int visible_end = first_query_position + last_row / group + 1;
  const int tiles = (visible_end + kBlockSize - 1) / kBlockSize;
  // Split boundaries sit at fixed positions (kSplitTiles tiles each), never at
  // a fraction of this step's range: a query's keys are then reduced in the
  // same order whatever else the step holds (a 1-token decode, a verify block,
  // other sequences), so decode and verify agree to the bit.
  const int tile_begin = split * kSplitTiles;
  const int tile_end = min(tiles, tile_begin + kSplitTiles);
#pragma unroll
  for (int i = threadIdx.x; i < kAttentionRowsPerBlock * HEAD_DIM; i += kWarps * 32) {  // unrolled: loads overlap
    const int local = i / HEAD_DIM, row = first_row + local;
    float value = 0.0f;
    if (row < rows) {
      const int token = row / group, head = kv_head * group + row % group;
      value = __bfloat162float(q[(static_cast<long>(query_start + token) * heads + head) * HEAD_DIM + i % HEAD_DIM]);
    }
    queries[local][i % HEAD_DIM] = value;
  }
  float running_max[kRowsPerWarp], running_sum[kRowsPerWarp], accumulator[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    running_max[r] = -INFINITY;
    running_sum[r] = 0.0f;
#pragma unroll
    for (int d = 0; d < kDimsPerLane; ++d) accumulator[r][d] = 0.0f;
  }
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    __syncthreads();  // the previous tile is no longer read (and queries are written)
    const long slot0 = static_cast<long>(blocks[tile]) * kBlockSize;
    // 16-byte loads, all issued before the first store (the tile is one cache
    // block: kBlockSize consecutive slots), then 4-byte stores into the padded rows.
    constexpr int kVectorsPerRow = HEAD_DIM / 8;
    constexpr int kTileVectors = kBlockSize * kVectorsPerRow;
    constexpr int kVectorsPerThread = (kTileVectors + kWarps * 32 - 1) / (kWarps * 32);
    uint4 key_vectors[kVectorsPerThread], value_vectors[kVectorsPerThread];
#pragma unroll
    for (int j = 0; j < kVectorsPerThread; ++j) {
      const int i = threadIdx.x + j * kWarps * 32;
      if (i >= kTileVectors) break;
      const long offset = ((slot0 + i / kVectorsPerRow) * kv_heads + kv_head) * HEAD_DIM + (i % kVectorsPerRow) * 8;
      key_vectors[j] = *reinterpret_cast<const uint4*>(key_cache + offset);
      value_vectors[j] = *reinterpret_cast<const uint4*>(value_cache + offset);
    }
#pragma unroll
    for (int j = 0; j < kVectorsPerThread; ++j) {
      const int i = threadIdx.x + j * kWarps * 32;
      if (i >= kTileVectors) break;
      uint32_t* key_words = reinterpret_cast<uint32_t*>(&keys[i / kVectorsPerRow][(i % kVectorsPerRow) * 8]);
      uint32_t* value_words = reinterpret_cast<uint32_t*>(&values[i / kVectorsPerRow][(i % kVectorsPerRow) * 8]);
      key_words[0] = key_vectors[j].x, key_words[1] = key_vectors[j].y;
      key_words[2] = key_vectors[j].z, key_words[3] = key_vectors[j].w;
      value_words[0] = value_vectors[j].x, value_words[1] = value_vectors[j].y;
      value_words[2] = value_vectors[j].z, value_words[3] = value_vectors[j].w;
    }
    __syncthreads();
    const int key_position = tile * kBlockSize + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int local = r * kWarps + warp, row = first_row + local;
      if (row >= rows) continue;
      const int query_position = first_query_position + row / group;
      float score = -INFINITY;
      if (key_position <= query_position) {
        float dot = 0.0f;
#pragma unroll 8
        for (int pair = 0; pair < HEAD_DIM / 2; ++pair) {
          const float2 key = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&keys[lane][2 * pair]));
          dot += queries[local][2 * pair] * key.x + queries[local][2 * pair + 1] * key.y;
        }
        score = dot * scale;
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
#pragma unroll
        for (int d = 0; d < kDimsPerLane; ++d) {
          const int dim = lane * kDimsPerLane + d;
          if (dim < HEAD_DIM) accumulator[r][d] += p * __bfloat162float(values[j][dim]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int local = r * kWarps + warp, row = first_row + local;
    if (row >= rows) continue;
    const int token = row / group, head = kv_head * group + row % group;
    const long out_row = static_cast<long>(query_start + token) * heads + head;
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
  }
}

// Merges the splits of one (row, head): softmax-weighted by each split's
// log-sum-exp. One block per (row, head), one thread per dim; the loops are
// unrolled so a split's loads do not wait for the previous split's.
__global__ void merge_splits_kernel(bf16* out, const float* partial_out, const float* partial_lse, int splits,
                                    long row_heads, int head_dim) {
  const long row_head = blockIdx.x;
  float maximum = -INFINITY;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) maximum = fmaxf(maximum, partial_lse[s * row_heads + row_head]);
  for (int dim = threadIdx.x; dim < head_dim; dim += blockDim.x) {
    float total = 0.0f, weight_sum = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
      const float lse = partial_lse[s * row_heads + row_head];
      if (lse == -INFINITY) continue;  // a split past this row's keys: adds exactly nothing
      const float weight = __expf(lse - maximum);
      weight_sum += weight;
      total += weight * partial_out[(s * row_heads + row_head) * head_dim + dim];
    }
    out[row_head * head_dim + dim] = __float2bfloat16(weight_sum > 0.0f ? total / weight_sum : 0.0f);
  }
}

template <int HEAD_DIM>
void launch(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache, const AttentionBatch& batch,
            int total_rows, int heads, int kv_heads, int splits, float* partial_out, float* partial_lse,
            cudaStream_t stream) {
  const int row_blocks =
      ceil_div(static_cast<long>(batch.max_query_length) * (heads / kv_heads), kAttentionRowsPerBlock);
  const dim3 grid(splits, kv_heads, batch.sequences * row_blocks);
  attention_kernel<HEAD_DIM><<<grid, kWarps * 32, 0, stream>>>(
      out, q, key_cache, value_cache, batch, heads, kv_heads, splits, row_blocks, partial_out, partial_lse, total_rows);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(bf16* out, const bf16* q, const bf16* key_cache, const bf16* value_cache,
                       const AttentionBatch& batch, int total_rows, int heads, int kv_heads, int head_dim, int splits,
                       float* partial_out, float* partial_lse, cudaStream_t stream) {
  auto launch_for_head_dim = head_dim == 16    ? launch<16>
                             : head_dim == 32  ? launch<32>
                             : head_dim == 64  ? launch<64>
                             : head_dim == 128 ? launch<128>
                                               : nullptr;
  if (!launch_for_head_dim) fail("attention: head_dim ", head_dim, " is not supported (16, 32, 64, 128)");
  launch_for_head_dim(out, q, key_cache, value_cache, batch, total_rows, heads, kv_heads, splits, partial_out,
                      partial_lse, stream);
  if (splits > 1) {
    const long row_heads = static_cast<long>(total_rows) * heads;
    merge_splits_kernel<<<dim3(row_heads), dim3(min(head_dim, 256)), 0, stream>>>(out, partial_out, partial_lse, splits,
                                                                                  row_heads, head_dim);
    CUDA_CHECK_LAUNCH();
  }
}
}  // namespace dspark::cuda
