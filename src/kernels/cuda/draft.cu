#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/draft.h"
#include "kernels/cuda/sequential_head.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void draft_block_kernel(float* block, const float* token_rows, const float* mask_embedding,
                                   const float* block_position, int rows, int dim) {
  wait_for_previous_kernel();
  start_next_kernel();
  const int row = blockIdx.x;  // position * rows + b
  const int position = row / rows, b = row % rows;
  const float* source =
      position == 0 ? token_rows + static_cast<long>(b) * dim : mask_embedding + static_cast<long>(position - 1) * dim;
  const float* position_embedding = block_position + static_cast<long>(position) * dim;
  float* destination = block + static_cast<long>(row) * dim;
  for (int i = threadIdx.x; i < dim; i += kThreads) destination[i] = source[i] + position_embedding[i];
}

// One block per row.
__global__ void __launch_bounds__(kThreads)
    sequential_head_prepare_kernel(float* e, float* recurrent_input, float* state, const float* hidden, int position,
                                   int rows, int rank, int width, int vocab, int kind, SequentialHeadWeights weights,
                                   const DraftControl* control, SequentialHeadState head) {
  wait_for_previous_kernel();
  start_next_kernel();
  __shared__ float scratch[32];
  const int b = blockIdx.x;
  const int previous_slot = (position - 1) * rows + b;
  int32_t previous = position == 0      ? head.anchors[b]
                     : head.argmax_keys ? argmax_index(head.argmax_keys[previous_slot])
                                        : head.tokens[previous_slot];
  previous = min(max(previous, 0), vocab - 1);  // a pruned row's later tokens are never used, but stay in range
  const __nv_bfloat16* e_row = weights.embedding + static_cast<long>(previous) * rank;
  const float* h = hidden + (static_cast<long>(position) * rows + b) * width;
  const bool recurrent = kind != static_cast<int>(SequentialHeadKind::Markov);
  const bool gru = kind == static_cast<int>(SequentialHeadKind::Gru);
  float* z = recurrent_input + static_cast<long>(b) * (2L * rank + width);  // [s; e; h], GRU only
  float partial = 0.0f;
  for (int i = threadIdx.x; i < rank; i += kThreads) {
    const float value = __bfloat162float(e_row[i]);
    e[static_cast<long>(b) * rank + i] = value;
    partial += value * weights.confidence_weight[width + i];
    if (recurrent && position == 0) state[static_cast<long>(b) * rank + i] = 0.0f;  // s_{-1} = 0
    if (gru) {
      z[i] = position == 0 ? 0.0f : state[static_cast<long>(b) * rank + i];
      z[rank + i] = value;
    }
  }
  for (int i = threadIdx.x; i < width; i += kThreads) {
    partial += h[i] * weights.confidence_weight[i];
    if (gru) z[2 * rank + i] = h[i];
  }
  const float logit = (block_sum(partial, scratch) + weights.confidence_bias[0]) / weights.temperatures[position];
  if (threadIdx.x != 0) return;
  const float confidence = confidence_of(logit);
  head.confidence[position * rows + b] = confidence;
  const bool alive = position_kept(position, confidence, head.alive[b] != 0, head.limits[b], control);
  head.alive[b] = alive;
  if (position == 0) head.count[b] = 0;
  if (alive) {
    head.count[b] = position + 1;
    atomicAdd(head.alive_rows + position, 1);
  }
}

__global__ void recurrent_update_kernel(float* state, float* output, const float* pre, const float* e, int rank,
                                        int kind) {
  wait_for_previous_kernel();
  start_next_kernel();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const long b = blockIdx.y;
  if (i >= rank) return;
  float* s = state + b * rank + i;
  if (kind == static_cast<int>(SequentialHeadKind::Rnn)) {
    *s = tanhf(pre[b * rank + i] + e[b * rank + i]);
  } else {  // GRU: pre = [g; c; o] per row
    const float* gates = pre + b * 3 * rank;
    const float keep = 1.0f / (1.0f + expf(-gates[i]));
    *s = keep * *s + (1.0f - keep) * tanhf(gates[rank + i]);
    output[b * rank + i] = tanhf(gates[2 * rank + i]);
  }
}

__global__ void scatter_rows_kernel(bf16* const* destinations, const bf16* rows, int width) {
  wait_for_previous_kernel();
  start_next_kernel();
  bf16* destination = destinations[blockIdx.x];
  if (!destination) return;
  const bf16* source = rows + static_cast<long>(blockIdx.x) * width;
  for (int i = threadIdx.x; i < width; i += kThreads) destination[i] = source[i];
}

__device__ inline uint16_t bf16_bits(float value) {
  const uint32_t bits = __float_as_uint(value);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;  // core/dtype.h's f32_to_bf16, bit for bit
  return static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__global__ void f32_to_bf16_kernel(uint16_t* out, const float* in, long count) {
  wait_for_previous_kernel();
  start_next_kernel();
  for (long i = blockIdx.x * long(kThreads) + threadIdx.x; i < count; i += long(gridDim.x) * kThreads)
    out[i] = bf16_bits(in[i]);
}

__global__ void gather_f32_runs_to_bf16_kernel(uint16_t* out, const GatherRuns runs, int width) {
  wait_for_previous_kernel();
  start_next_kernel();
  const int block = blockIdx.x;
  int run = 0;
  while (block >= runs.first_block[run + 1]) ++run;
  const int offset = block - runs.first_block[run];
  const float* source = runs.sources[run] + static_cast<long>(offset) * width;
  uint16_t* row = out + static_cast<long>(runs.output_row[run] + offset) * width;
  for (int i = threadIdx.x; i < width; i += kThreads) row[i] = bf16_bits(source[i]);
}

__global__ void gather_tap_rows_kernel(bf16* rows, const TapRowSource* sources, int width) {
  wait_for_previous_kernel();
  start_next_kernel();
  const TapRowSource source = sources[blockIdx.x];
  bf16* destination = rows + static_cast<long>(blockIdx.x) * width;
  const auto [first, end] = wide_row_slice(width);
  const int begin = first + threadIdx.x;
  switch (source.kind) {
    case TapRowKind::Keep:
      return;
    case TapRowKind::Zero:
      for (int i = begin; i < end; i += kThreads) destination[i] = __ushort_as_bfloat16(0);
      return;
    case TapRowKind::Bf16:
      for (int i = begin; i < end; i += kThreads) destination[i] = static_cast<const bf16*>(source.row)[i];
      return;
    case TapRowKind::F32:
      for (int i = begin; i < end; i += kThreads)
        destination[i] = __ushort_as_bfloat16(bf16_bits(static_cast<const float*>(source.row)[i]));
      return;
  }
}

}  // namespace

void f32_to_bf16_forward(bf16* out, const float* in, long count, cudaStream_t stream) {
  if (count <= 0) return;
  const long blocks = std::min<long>((count + kThreads - 1) / kThreads, 4096);
  launch_dependent(f32_to_bf16_kernel, static_cast<int>(blocks), kThreads, 0, stream, reinterpret_cast<uint16_t*>(out),
                   in, count);
  CUDA_CHECK_LAUNCH();
}

void gather_f32_runs_to_bf16_forward(bf16* out, const GatherRuns& runs, int width, cudaStream_t stream) {
  DSPARK_CHECK(runs.count >= 0 && runs.count <= GatherRuns::kMaxRuns, "gather: ", runs.count, " runs");
  if (runs.rows() <= 0) return;
  launch_dependent(gather_f32_runs_to_bf16_kernel, runs.rows(), kThreads, 0, stream, reinterpret_cast<uint16_t*>(out),
                   runs, width);
  CUDA_CHECK_LAUNCH();
}

void gather_tap_rows_forward(bf16* rows, const TapRowSource* sources, int count, int width, cudaStream_t stream) {
  if (count == 0) return;
  launch_dependent(gather_tap_rows_kernel, wide_row_grid(count, width), kThreads, 0, stream, rows, sources, width);
  CUDA_CHECK_LAUNCH();
}

void draft_block_forward(float* block, const float* token_rows, const float* mask_embedding,
                         const float* block_position, int rows, int gamma, int dim, cudaStream_t stream) {
  if (rows * gamma == 0) return;
  launch_dependent(draft_block_kernel, rows * gamma, kThreads, 0, stream, block, token_rows, mask_embedding,
                   block_position, rows, dim);
  CUDA_CHECK_LAUNCH();
}

void sequential_head_prepare_forward(float* e, float* recurrent_input, float* state, const float* hidden, int position,
                                     int rows, int rank, int width, int vocab, SequentialHeadKind kind,
                                     const SequentialHeadWeights& weights, const DraftControl* control,
                                     const SequentialHeadState& head, cudaStream_t stream) {
  DSPARK_CHECK(position >= 0 && position < kMaxDraftGamma, "draft head: position ", position, " is outside 0..",
               kMaxDraftGamma - 1);
  if (rows == 0) return;
  launch_dependent(sequential_head_prepare_kernel, rows, kThreads, 0, stream, e, recurrent_input, state, hidden,
                   position, rows, rank, width, vocab, static_cast<int>(kind), weights, control, head);
  CUDA_CHECK_LAUNCH();
}

void recurrent_update_forward(float* state, float* output, const float* pre, const float* e, int rows, int rank,
                              SequentialHeadKind kind, cudaStream_t stream) {
  DSPARK_CHECK(kind != SequentialHeadKind::Markov, "recurrent_update_forward: the Markov head has no state");
  if (rows == 0) return;
  const dim3 grid(ceil_div(rank, kThreads), rows);
  launch_dependent(recurrent_update_kernel, grid, kThreads, 0, stream, state, output, pre, e, rank,
                   static_cast<int>(kind));
  CUDA_CHECK_LAUNCH();
}

void scatter_rows_forward(bf16* const* destinations, const bf16* rows, int count, int width, cudaStream_t stream) {
  if (count == 0) return;
  launch_dependent(scatter_rows_kernel, count, kThreads, 0, stream, destinations, rows, width);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
