// The target transformer (Qwen3 / Llama families) on the CPU, in f32.
//
// Shape letters, used in every comment below:
//   T  tokens in one forward (all sequences together)     V  vocab
//   H  hidden size    F  intermediate (MLP) size           L  layers
//   nh query heads    nkv key/value heads    hd head dim   m  taps
//
// One forward runs a batch of sequences, each appending its new tokens to its
// own KV cache (prefill, decode and speculative verify are the same call with
// different token counts). Every projection runs once over all T rows; only
// attention is per sequence. Hidden-state taps copy the residual stream after
// the requested layers; with no taps requested nothing is copied.
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace dspark {

struct LayerWeights {
  Tensor input_norm;           // [H]
  Tensor q_proj;               // [nh*hd, H]
  Tensor k_proj;               // [nkv*hd, H]
  Tensor v_proj;               // [nkv*hd, H]
  Tensor o_proj;               // [H, nh*hd]
  Tensor q_bias, k_bias, v_bias, o_bias;  // [out] when the config has attention biases
  Tensor q_norm, k_norm;       // [hd], Qwen3 only
  Tensor post_attention_norm;  // [H]
  Tensor gate_proj, up_proj;   // [F, H]
  Tensor down_proj;            // [H, F]
  Tensor gate_bias, up_bias, down_bias;   // when the config has MLP biases
  // Each projection's bf16 bit patterns in cpu::pack_bf16_rows' panels when
  // every element is a bf16 value (a bf16 checkpoint; load_transformer fills
  // them), else empty. Every product then reads these, half the bytes, at any
  // row count (cpu::matmul_forward: a row's bits never depend on its batch),
  // and load_transformer frees the f32 tensors.
  struct {
    std::vector<uint16_t> q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
  } bf16;
};

struct Transformer {
  ModelConfig config;
  Tensor embed_tokens;               // [V, H]
  std::vector<LayerWeights> layers;  // L
  Tensor final_norm;                 // [H]
  Tensor lm_head;                    // [V, H]; the embedding itself when tied
  std::vector<uint16_t> lm_head_bf16;          // [V, H] as LayerWeights::bf16
  std::vector<double> rope_inverse_frequency;  // [hd/2]
};

// Loads config.json and the safetensors weights of an HF checkpoint directory.
// A projection whose elements are all bf16 values keeps only its bf16 bits
// (LayerWeights::bf16, lm_head_bf16; its Tensor keeps the shape, with null
// data), layer by layer: a bf16 checkpoint's layers take its bytes in memory,
// not three times them (Qwen3-8B: 18 GB instead of 48).
Transformer load_transformer(const std::filesystem::path& directory);

// Fills the bf16 bit patterns (LayerWeights::bf16, lm_head_bf16) of every
// projection whose elements are all bf16 values, empties the others'.
// Call it again after changing the weights; a projection whose f32 tensor
// load_transformer freed keeps its bits.
void keep_bf16_weights(Transformer& model);

// One sequence's part of a batched forward.
struct ForwardSequence {
  KVCache* cache;                      // new tokens go at positions cache->length() ...
  std::span<const int32_t> tokens;     // the new tokens (>= 1)
  bool all_logits = false;             // logits for every new token, else only the last
};

struct ForwardOutput {
  std::vector<float> logits;  // [R, V]: per sequence in order, all rows or the last one
  std::vector<float> taps;    // [T, m, H] when taps were requested, else empty
};

// Activations reused across forwards (grown, never shrunk), so decoding does
// not allocate per step.
struct ForwardWorkspace {
  std::vector<float> x, normed, q, k, v, attention, projected, gate, up, scores;
  std::vector<float> cosines, sines;  // RoPE of each row's position, [T, head_dim/2], shared by all layers
  std::vector<int32_t> tokens;
  std::vector<int> positions;
};

// Tap index j < L is the output of decoder layer j; j == L is the hidden after
// the final norm (what the LM head reads).
void transformer_forward(const Transformer& model, std::span<const ForwardSequence> sequences,
                         std::span<const int> tap_layers, ForwardWorkspace& workspace,
                         ForwardOutput& output);

}  // namespace dspark
