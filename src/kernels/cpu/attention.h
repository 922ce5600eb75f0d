// Causal multi-head attention of a run of new query tokens over one
// sequence's KV cache (grouped-query: kv_heads divides heads).
//   q     [rows, heads, head_dim]       rows = new tokens, at positions
//                                       first_position .. first_position+rows-1
//   keys, values [>= first_position+rows, kv_heads, head_dim]  (the cache,
//                                       already holding the new tokens)
//   out   [rows, heads, head_dim]
// Query r attends to cache positions 0 .. first_position + r; scale
// head_dim^-0.5. Vectorised and spread over the kernels' worker pool; a
// row's output bits do not depend on `rows` (the same token gives the same
// output in a decode step and inside a verify block) or on the thread count.
// `scores` is unused (the kernel keeps per-thread scratch); callers still pass
// scratch of at least first_position + rows floats.
#pragma once

namespace dspark::cpu {

void attention_forward(float* out, const float* q, const float* keys, const float* values,
                       int rows, int first_position, int heads, int kv_heads, int head_dim,
                       float* scores);

// Unmasked multi-head attention (the drafter's block attends to all of its
// context and to itself): q [rows, heads, hd]; keys, values [kv_rows, heads, hd];
// out [rows, heads, hd]; scale hd^-0.5. The same kernel as attention_forward
// (a row's bits do not depend on `rows` or the thread count). `scores` is
// unused; callers still pass scratch of kv_rows floats.
void bidirectional_attention_forward(float* out, const float* q, const float* keys, const float* values, int rows,
                                     int kv_rows, int heads, int head_dim, float* scores);
// The same over keys and values in two pieces, without joining them: the
// drafter's retained context (context_rows, kept per request) and then its
// block's own rows (block_rows): the bits of the call above on the two
// concatenated.
void bidirectional_attention_forward(float* out, const float* q, const float* context_keys, const float* context_values,
                                     int context_rows, const float* block_keys, const float* block_values,
                                     int block_rows, int rows, int heads, int head_dim);

// Its backward, given dout [rows, heads, hd]: dq [rows, heads, hd], dkeys and
// dvalues [kv_rows, heads, hd] accumulate (+=). The attention weights are
// recomputed from q and keys (the forward keeps none). A ragged batch calls it
// once per sequence with that sequence's own kv_rows, so no padded column ever
// enters the softmax. `scratch` holds at least 2 * rows * kv_rows floats.
void bidirectional_attention_backward(float* dq, float* dkeys, float* dvalues, const float* dout, const float* q,
                                      const float* keys, const float* values, int rows, int kv_rows, int heads,
                                      int head_dim, float* scratch);

}  // namespace dspark::cpu
