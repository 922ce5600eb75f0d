#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/rope.h"

namespace dspark::cuda {
namespace {

constexpr int kWarps = 8;

// One warp per (row, head) across the q heads, the k heads, then the v heads
// (norm_rope_row of rope.cuh). Before the wait it reads what no kernel of the
// step writes (the step's positions and slots, the rotary table, the norm
// weights), so that after it only the QKV GEMM's output is a round trip away.
__global__ void qkv_rope_kv_append_kernel(bf16* q_out, const bf16* qkv, const float* q_norm, const float* k_norm,
                                          const int32_t* positions, const float2* rope_table, bf16* key_cache,
                                          bf16* value_cache, const int32_t* slots, int heads, int kv_heads,
                                          int head_dim, float eps) {
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.y * kWarps + (threadIdx.x >> 5);
  if (head >= heads + 2 * kv_heads) return;  // nothing to do, nothing to wait for
  const long row = blockIdx.x;
  const int width = (heads + 2 * kv_heads) * head_dim;
  const bf16* in = qkv + row * width + static_cast<long>(head) * head_dim;
  const long slot = slots[row];

  if (head >= heads + kv_heads) {  // v: straight into the cache
    wait_for_previous_kernel();
    start_next_kernel();
    bf16* destination = value_cache + (slot * kv_heads + (head - heads - kv_heads)) * head_dim;
    for (int i = lane; i < head_dim; i += 32) destination[i] = in[i];
    return;
  }
  const bool is_query = head < heads;
  const float* norm = is_query ? q_norm : k_norm;
  const RopeLane constants = load_rope_lane(norm, rope_table, positions[row], head_dim, lane);
  wait_for_previous_kernel();
  start_next_kernel();
  bf16* destination = is_query ? q_out + (row * heads + head) * head_dim
                               : key_cache + (slot * kv_heads + (head - heads)) * head_dim;
  norm_rope_row(in, constants, norm != nullptr, head_dim, eps, lane,
                [&](int i, bf16 value) { destination[i] = value; });
}

}  // namespace

void qkv_rope_kv_append_forward(bf16* q_out, const bf16* qkv, const float* q_norm, const float* k_norm,
                                const int32_t* positions, const float2* rope_table, bf16* key_cache,
                                bf16* value_cache, const int32_t* slots, int rows, int heads, int kv_heads,
                                int head_dim, float eps, cudaStream_t stream) {
  const dim3 grid(rows, ceil_div(heads + 2 * kv_heads, kWarps));
  launch_dependent(qkv_rope_kv_append_kernel, grid, kWarps * 32, 0, stream, q_out, qkv, q_norm, k_norm, positions,
                   rope_table, key_cache, value_cache, slots, heads, kv_heads, head_dim, eps);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
