// The drafter's training pass over a whole TrainBatch (DESIGN.md §2 and §4):
// the forward of src/spec/draft.cpp (backbone, context projection, sequential
// and confidence heads) under teacher forcing, keeping every activation the
// backward needs, and the hand-written backward into every drafter parameter.
// It knows nothing of the loss: the loss reads `logits` and `confidence`, and
// writes `logits_gradient` and `confidence_gradient` before the backward.
//
// Shape letters: A anchors, γ block, C context rows of the whole batch, d draft
// width, f·d MLP width, H target hidden, V vocab, m taps, r Markov rank.
// Two row orders:
//   block rows  [A, γ] anchor-major, row a·γ + k: the backbone, whose
//               attention works one anchor (γ consecutive rows) at a time;
//   head rows   [γ, A] position-major, row k·A + a: everything from
//               h = rms(Hd, out_norm) on (out_proj, LM head, sequential and
//               confidence heads, loss), so that one step k of the recurrent
//               head is one contiguous [A, ·] matrix.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/train_batch.h"

namespace dspark {

// Gradients by parameter name, shaped like drafter.parameters.
using Gradients = std::map<std::string, Tensor>;
Gradients zero_gradients(const Drafter& drafter);

struct DrafterActivations {
  struct Layer {
    std::vector<float> input;                 // [A·γ, d] the block's residual stream entering the layer
    std::vector<float> normed;                // [A·γ, d] rms(input, attn_norm)
    std::vector<float> q, k, v;               // [A·γ, d] normed @ q | k | v
    std::vector<float> context_k, context_v;  // [C, d] rms(Hc, attn_norm) @ k | v
    std::vector<float> attention;             // [A·γ, d] attention output, before o
    std::vector<float> middle;                // [A·γ, d] the residual stream after attention
    std::vector<float> ff_normed;             // [A·γ, d] rms(middle, ff_norm)
    std::vector<float> gate, up;              // [A·γ, f·d] ff_normed @ gate | up
    std::vector<float> gated;                 // [A·γ, f·d] gelu_tanh(gate) ⊙ up
  };

  // Forward, kept for the backward.
  std::vector<float> context_projected;  // [C, d] hctx @ W_c
  std::vector<float> context_hidden;     // [C, d] Hc = rms(context_projected, ctx_norm)
  std::vector<float> anchor_embeddings;  // [A, H] the target's embedding rows of the anchors
  std::vector<Layer> layers;
  std::vector<float> block;       // [A·γ, d] the residual stream after the last layer
  std::vector<int32_t> previous;  // [γ·A] head rows: x_{k-1}, the anchor at k = 0 (teacher forced)
  std::vector<float> hidden;      // [γ·A, d] head rows: h = rms(block, out_norm)
  std::vector<float> head_input;  // [γ·A, H] h @ out_proj
  std::vector<float> embedded;    // [γ·A, r] e = markov.w1[previous]
  std::vector<float> state;       // [γ·A, r] rnn, gru: s_k
  std::vector<float> gru_input;   // [γ·A, 2r+d] gru: z = [s_{k-1}; e; h]
  std::vector<float> gru_gates;   // [γ·A, 3r] gru: [g, c, o] = z @ gru.wJ + gru.bJ
  std::vector<float> gru_output;  // [γ·A, r] gru: tanh(o)
  std::vector<float> logits;      // [γ·A, V] L = U + B
  std::vector<float> confidence;  // [γ·A] c = σ([h; e] @ conf.w + conf.b), no STS temperature

  // Written by the loss, read by drafter_backward.
  std::vector<float> logits_gradient;      // [γ·A, V] dLoss/dL (the forward borrows it as scratch for B)
  std::vector<float> confidence_gradient;  // [γ·A] dLoss/d(the confidence logit)

  // Scratch.
  std::vector<float> context_normed, keys, values, attention_scratch, projected;
  std::vector<float> d_block, d_normed, d_q, d_k, d_v, d_attention, d_gated, d_gate, d_up, d_context_hidden,
      d_context_k, d_context_v, d_context_normed, d_keys, d_values, d_hidden, d_head_input, d_embedded, d_state,
      d_gru_gates, d_gru_input, d_gru_output, d_token;
};

// Throws dspark::Error when `batch` does not fit a drafter of this config and
// dims (γ, widths, sizes, ids outside the vocabulary, offsets).
void check_train_batch(const DrafterConfig& config, const TargetDims& dims, const TrainBatch& batch);

// The forward over `batch`: fills every forward member of `activations`.
void drafter_training_forward(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                              DrafterActivations& activations);

// The backward of the last drafter_training_forward on the same batch, from
// activations.logits_gradient and confidence_gradient: dθ accumulates (+=)
// into `gradients` for every drafter parameter. The target's embedding and LM
// head are frozen.
void drafter_backward(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                      DrafterActivations& activations, Gradients& gradients);

}  // namespace dspark
