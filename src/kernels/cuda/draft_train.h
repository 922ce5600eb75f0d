// The DSpark drafter's own small ops for training on the GPU, forward and
// backward: the pieces of train/drafter_backward.cpp that are not a matmul,
// norm or attention (the block rows, the confidence head, the RNN and GRU
// cells), plus dtype conversions and device-side random fills.
//
// Rows are in the training step's head order (train/cuda_loss.h): position k
// of anchor a is row k·A + a, so one position of every anchor is a
// contiguous [A, ·] slab. Backward passes accumulate (+=) unless they say
// they write. Shape letters: A anchors, γ block, d draft width, r head rank.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

void convert_to_bf16(__nv_bfloat16* out, const float* in, long count, cudaStream_t stream);
void convert_to_f32(float* out, const __nv_bfloat16* in, long count, cudaStream_t stream);

// out[i] = scale * u_i, u_i uniform in [-1, 1) from a hash of (seed, i): reproducible, for benchmarks.
void fill_random_uniform(float* out, long count, uint64_t seed, float scale, cudaStream_t stream);
void fill_random_uniform(__nv_bfloat16* out, long count, uint64_t seed, float scale, cudaStream_t stream);

// block [γ·A, d]: row k·A + a = (k == 0 ? token_rows[a] : mask_embedding[k-1]) + block_position[k].
void block_rows_forward(float* block, const float* token_rows, const float* mask_embedding,
                        const float* block_position, int anchors, int gamma, int dim, cudaStream_t stream);
// dblock_position[k] += Σ_a dblock[k·A + a] and, for k >= 1, dmask_embedding[k-1] += the same sum
// (a summed in order). The token rows' gradient is dblock's first A rows.
void block_rows_backward(float* dmask_embedding, float* dblock_position, const float* dblock, int anchors, int gamma,
                         int dim, cudaStream_t stream);

// confidence [rows] = σ([hidden; embedded] · weight + bias[0]); hidden [rows, d], embedded [rows, r], weight [d + r].
void confidence_forward(float* confidence, const float* hidden, const float* embedded, const float* weight,
                        const float* bias, int rows, int dim, int rank, cudaStream_t stream);
// Given dlogit [rows] (dLoss/d(the confidence logit)): WRITES dhidden = dlogit·weight[:d] and
// dembedded = dlogit·weight[d:] (the first gradients those receive). The weight's and bias's
// gradients are column sums (reduce.h).
void confidence_backward(float* dhidden, float* dembedded, const float* dlogit, const float* weight, int rows,
                         int dim, int rank, cudaStream_t stream);

// RNN cell of one position, in place: state [A, r] = tanh(state + embedded + bias), where state
// holds s_{k-1} @ wH on entry (first: nothing; s_{-1} = 0).
void rnn_state_forward(float* state, const float* embedded, const float* bias, int rows, int rank, bool first,
                       cudaStream_t stream);
// Through the tanh, in place: dstate = dstate·(1 - state²) (now dLoss/d(pre-activation)); dembedded += it.
void rnn_state_backward(float* dstate, float* dembedded, const float* state, long count, cudaStream_t stream);

// GRU input of one position: z [A, 2r + d] = [previous_state (zeros when null); embedded; hidden].
void gru_input_forward(float* z, const float* previous_state, const float* embedded, const float* hidden, int rows,
                       int rank, int dim, cudaStream_t stream);
// GRU cell: gates [A, 3r] (z @ wJ on entry) += bias; keep = σ(g); state = keep·s_{k-1} + (1 - keep)·tanh(c)
// with s_{k-1} = z[:, :r]; output = tanh(o). state, output [A, r].
void gru_update_forward(float* gates, float* state, float* output, const float* bias, const float* z, int rows,
                        int rank, int z_width, cudaStream_t stream);
// Its backward: WRITES dgates [A, 3r]; dprevious_state [A, r] += dstate·keep (null at k = 0).
void gru_update_backward(float* dgates, float* dprevious_state, const float* dstate, const float* doutput,
                         const float* gates, const float* output, const float* z, int rows, int rank, int z_width,
                         cudaStream_t stream);
// dz [A, 2r + d] back to its parts: dprevious_state (null at k = 0), dembedded and dhidden, all +=.
void gru_input_backward(float* dprevious_state, float* dembedded, float* dhidden, const float* dz, int rows, int rank,
                        int dim, cudaStream_t stream);

}  // namespace dspark::cuda
