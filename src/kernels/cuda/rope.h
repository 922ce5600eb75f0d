// The step between the QKV GEMM and attention, fused: per-head q/k RMSNorm
// (Qwen3), rotary embedding (HF rotate_half layout, as kernels/cpu/rope.h),
// and the append of k and v to the paged KV cache. Prefill chunks run this
// kernel; decode and verify steps do the same inside the attention kernel
// (AttentionRope, attention.h), with the same device code (rope.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

// qkv [rows, (nh + 2 nkv) * hd] holds q | k | v per row (the fused GEMM's output).
// q_out [rows, nh, hd] receives normed, rotated q. Keys and values are written
// at key_cache / value_cache [slot, nkv, hd] for slot = slots[row].
// rope_table [position, hd/2] holds (cos, sin). q_norm / k_norm [hd] may be
// null (no q/k norm). head_dim <= 256.
void qkv_rope_kv_append_forward(__nv_bfloat16* q_out, const __nv_bfloat16* qkv, const float* q_norm,
                                const float* k_norm, const int32_t* positions, const float2* rope_table,
                                __nv_bfloat16* key_cache, __nv_bfloat16* value_cache, const int32_t* slots,
                                int rows, int heads, int kv_heads, int head_dim, float eps,
                                cudaStream_t stream);

}  // namespace dspark::cuda
