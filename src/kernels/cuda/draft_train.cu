#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/draft_train.h"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void to_bf16_kernel(bf16* out, const float* in, long count) {
  const long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) out[i] = __float2bfloat16(in[i]);
}

__global__ void to_f32_kernel(float* out, const bf16* in, long count) {
  const long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) out[i] = __bfloat162float(in[i]);
}

// splitmix64 of (seed, i) -> uniform in [-1, 1).
__device__ __forceinline__ float hashed_uniform(uint64_t seed, long i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

template <class T>
__global__ void fill_random_kernel(T* out, long count, uint64_t seed, float scale) {
  const long stride = static_cast<long>(gridDim.x) * kThreads;
  for (long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x; i < count; i += stride) {
    const float value = scale * hashed_uniform(seed, i);
    if constexpr (sizeof(T) == 2)
      out[i] = __float2bfloat16(value);
    else
      out[i] = value;
  }
}

// One block per row k·A + a.
__global__ void block_rows_kernel(float* block, const float* token_rows, const float* mask_embedding,
                                  const float* block_position, int anchors, int dim) {
  const long row = blockIdx.x;
  const int k = static_cast<int>(row / anchors), a = static_cast<int>(row % anchors);
  const float* first = k == 0 ? token_rows + static_cast<long>(a) * dim : mask_embedding + (k - 1L) * dim;
  const float* position = block_position + static_cast<long>(k) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) block[row * dim + i] = first[i] + position[i];
}

// Thread per (k, i): Σ_a dblock[k·A + a, i] in order.
__global__ void block_rows_backward_kernel(float* dmask_embedding, float* dblock_position, const float* dblock,
                                           int anchors, int dim) {
  const int k = blockIdx.y, i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= dim) return;
  float total = 0.0f;
  for (int a = 0; a < anchors; ++a) total += dblock[(static_cast<long>(k) * anchors + a) * dim + i];
  dblock_position[static_cast<long>(k) * dim + i] += total;
  if (k > 0) dmask_embedding[(k - 1L) * dim + i] += total;
}

// One warp per row.
__global__ void confidence_kernel(float* confidence, const float* hidden, const float* embedded, const float* weight,
                                  const float* bias, int rows, int dim, int rank) {
  const int row = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  float logit = 0.0f;
  for (int i = lane; i < dim; i += 32) logit += hidden[static_cast<long>(row) * dim + i] * weight[i];
  for (int i = lane; i < rank; i += 32) logit += embedded[static_cast<long>(row) * rank + i] * weight[dim + i];
  logit = warp_sum(logit);
  if (lane == 0) confidence[row] = sigmoid(logit + bias[0]);
}

__global__ void confidence_backward_kernel(float* dhidden, float* dembedded, const float* dlogit, const float* weight,
                                           int dim, int rank) {
  const long row = blockIdx.x;
  const float gradient = dlogit[row];
  for (int i = threadIdx.x; i < dim + rank; i += blockDim.x) {
    if (i < dim)
      dhidden[row * dim + i] = gradient * weight[i];
    else
      dembedded[row * rank + i - dim] = gradient * weight[i];
  }
}

__global__ void rnn_state_kernel(float* state, const float* embedded, const float* bias, int rank, long count,
                                 bool first) {
  const long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  const float recurrent = first ? 0.0f : state[i];
  state[i] = tanhf(recurrent + embedded[i] + bias[i % rank]);
}

__global__ void rnn_state_backward_kernel(float* dstate, float* dembedded, const float* state, long count) {
  const long i = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  const float gradient = dstate[i] * (1.0f - state[i] * state[i]);
  dstate[i] = gradient;
  dembedded[i] += gradient;
}

__global__ void gru_input_kernel(float* z, const float* previous_state, const float* embedded, const float* hidden,
                                 int rank, int dim) {
  const long row = blockIdx.x;
  const int width = 2 * rank + dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    float value;
    if (i < rank)
      value = previous_state ? previous_state[row * rank + i] : 0.0f;
    else if (i < 2 * rank)
      value = embedded[row * rank + i - rank];
    else
      value = hidden[row * dim + i - 2 * rank];
    z[row * width + i] = value;
  }
}

// Thread per (row, i < r): owns gate elements i, r + i, 2r + i of its row.
__global__ void gru_update_kernel(float* gates, float* state, float* output, const float* bias, const float* z,
                                  int rows, int rank, int z_width) {
  const long index = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= static_cast<long>(rows) * rank) return;
  const long row = index / rank;
  const int i = static_cast<int>(index % rank);
  float* g = gates + row * 3 * rank;
  g[i] += bias[i];
  g[rank + i] += bias[rank + i];
  g[2 * rank + i] += bias[2 * rank + i];
  const float keep = sigmoid(g[i]), previous_state = z[row * z_width + i];
  state[row * rank + i] = keep * previous_state + (1.0f - keep) * tanhf(g[rank + i]);
  output[row * rank + i] = tanhf(g[2 * rank + i]);
}

__global__ void gru_update_backward_kernel(float* dgates, float* dprevious_state, const float* dstate,
                                           const float* doutput, const float* gates, const float* output,
                                           const float* z, int rows, int rank, int z_width) {
  const long index = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= static_cast<long>(rows) * rank) return;
  const long row = index / rank;
  const int i = static_cast<int>(index % rank);
  const float* g = gates + row * 3 * rank;
  float* dg = dgates + row * 3 * rank;
  const float keep = sigmoid(g[i]), candidate = tanhf(g[rank + i]), out = output[index];
  const float d_state = dstate[index], previous_state = z[row * z_width + i];
  dg[i] = d_state * (previous_state - candidate) * keep * (1.0f - keep);
  dg[rank + i] = d_state * (1.0f - keep) * (1.0f - candidate * candidate);
  dg[2 * rank + i] = doutput[index] * (1.0f - out * out);
  if (dprevious_state) dprevious_state[index] += d_state * keep;
}

__global__ void gru_input_backward_kernel(float* dprevious_state, float* dembedded, float* dhidden, const float* dz,
                                          int rank, int dim) {
  const long row = blockIdx.x;
  const int width = 2 * rank + dim;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const float gradient = dz[row * width + i];
    if (i < rank) {
      if (dprevious_state) dprevious_state[row * rank + i] += gradient;
    } else if (i < 2 * rank) {
      dembedded[row * rank + i - rank] += gradient;
    } else {
      dhidden[row * dim + i - 2 * rank] += gradient;
    }
  }
}

}  // namespace

void convert_to_bf16(bf16* out, const float* in, long count, cudaStream_t stream) {
  if (count <= 0) return;
  to_bf16_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(out, in, count);
  CUDA_CHECK_LAUNCH();
}

void convert_to_f32(float* out, const bf16* in, long count, cudaStream_t stream) {
  if (count <= 0) return;
  to_f32_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(out, in, count);
  CUDA_CHECK_LAUNCH();
}

void fill_random_uniform(float* out, long count, uint64_t seed, float scale, cudaStream_t stream) {
  if (count <= 0) return;
  fill_random_kernel<float><<<1024, kThreads, 0, stream>>>(out, count, seed, scale);
  CUDA_CHECK_LAUNCH();
}

void fill_random_uniform(bf16* out, long count, uint64_t seed, float scale, cudaStream_t stream) {
  if (count <= 0) return;
  fill_random_kernel<bf16><<<1024, kThreads, 0, stream>>>(out, count, seed, scale);
  CUDA_CHECK_LAUNCH();
}

void block_rows_forward(float* block, const float* token_rows, const float* mask_embedding,
                        const float* block_position, int anchors, int gamma, int dim, cudaStream_t stream) {
  if (anchors <= 0) return;
  block_rows_kernel<<<anchors * gamma, kThreads, 0, stream>>>(block, token_rows, mask_embedding, block_position,
                                                               anchors, dim);
  CUDA_CHECK_LAUNCH();
}

void block_rows_backward(float* dmask_embedding, float* dblock_position, const float* dblock, int anchors, int gamma,
                         int dim, cudaStream_t stream) {
  if (anchors <= 0) return;
  const dim3 grid(ceil_div(dim, kThreads), gamma);
  block_rows_backward_kernel<<<grid, kThreads, 0, stream>>>(dmask_embedding, dblock_position, dblock, anchors, dim);
  CUDA_CHECK_LAUNCH();
}

void confidence_forward(float* confidence, const float* hidden, const float* embedded, const float* weight,
                        const float* bias, int rows, int dim, int rank, cudaStream_t stream) {
  if (rows <= 0) return;
  confidence_kernel<<<ceil_div(rows, kThreads / 32), kThreads, 0, stream>>>(confidence, hidden, embedded, weight, bias,
                                                                            rows, dim, rank);
  CUDA_CHECK_LAUNCH();
}

void confidence_backward(float* dhidden, float* dembedded, const float* dlogit, const float* weight, int rows,
                         int dim, int rank, cudaStream_t stream) {
  if (rows <= 0) return;
  confidence_backward_kernel<<<rows, 128, 0, stream>>>(dhidden, dembedded, dlogit, weight, dim, rank);
  CUDA_CHECK_LAUNCH();
}

void rnn_state_forward(float* state, const float* embedded, const float* bias, int rows, int rank, bool first,
                       cudaStream_t stream) {
  const long count = static_cast<long>(rows) * rank;
  if (count <= 0) return;
  rnn_state_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(state, embedded, bias, rank, count, first);
  CUDA_CHECK_LAUNCH();
}

void rnn_state_backward(float* dstate, float* dembedded, const float* state, long count, cudaStream_t stream) {
  if (count <= 0) return;
  rnn_state_backward_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(dstate, dembedded, state, count);
  CUDA_CHECK_LAUNCH();
}

void gru_input_forward(float* z, const float* previous_state, const float* embedded, const float* hidden, int rows,
                       int rank, int dim, cudaStream_t stream) {
  if (rows <= 0) return;
  gru_input_kernel<<<rows, 128, 0, stream>>>(z, previous_state, embedded, hidden, rank, dim);
  CUDA_CHECK_LAUNCH();
}

void gru_update_forward(float* gates, float* state, float* output, const float* bias, const float* z, int rows,
                        int rank, int z_width, cudaStream_t stream) {
  const long count = static_cast<long>(rows) * rank;
  if (count <= 0) return;
  gru_update_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(gates, state, output, bias, z, rows, rank,
                                                                        z_width);
  CUDA_CHECK_LAUNCH();
}

void gru_update_backward(float* dgates, float* dprevious_state, const float* dstate, const float* doutput,
                         const float* gates, const float* output, const float* z, int rows, int rank, int z_width,
                         cudaStream_t stream) {
  const long count = static_cast<long>(rows) * rank;
  if (count <= 0) return;
  gru_update_backward_kernel<<<ceil_div(count, kThreads), kThreads, 0, stream>>>(
      dgates, dprevious_state, dstate, doutput, gates, output, z, rows, rank, z_width);
  CUDA_CHECK_LAUNCH();
}

void gru_input_backward(float* dprevious_state, float* dembedded, float* dhidden, const float* dz, int rows, int rank,
                        int dim, cudaStream_t stream) {
  if (rows <= 0) return;
  gru_input_backward_kernel<<<rows, 128, 0, stream>>>(dprevious_state, dembedded, dhidden, dz, rank, dim);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
