#include "model/transformer.h"

#include <algorithm>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"

namespace dspark {

namespace {

// Visits every projection of a layer with its bf16 bits.
template <class Layer, class Visit>
void for_each_projection(Layer& layer, Visit visit) {
  visit(layer.q_proj, layer.bf16.q_proj);
  visit(layer.k_proj, layer.bf16.k_proj);
  visit(layer.v_proj, layer.bf16.v_proj);
  visit(layer.o_proj, layer.bf16.o_proj);
  visit(layer.gate_proj, layer.bf16.gate_proj);
  visit(layer.up_proj, layer.bf16.up_proj);
  visit(layer.down_proj, layer.bf16.down_proj);
}

void keep_bits(const Tensor& weight, std::vector<uint16_t>& bits) {
  if (weight.data)  // else released: its bits stay
    bits = cpu::pack_bf16_rows(weight.data, int(weight.shape[0]), int(weight.shape[1]));
}

// Frees a projection's f32 tensor when it has bf16 bits: the products read only
// those (cpu::matmul_forward). A tied head is the embedding, whose rows are
// gathered: it stays.
void release_f32_if_bits(Tensor& weight, const std::vector<uint16_t>& bits, const Tensor& embedding) {
  if (!bits.empty() && weight.data != embedding.data) {
    weight.data = nullptr;
    weight.owner.reset();
  }
}

}  // namespace

Transformer load_transformer(const std::filesystem::path& directory) {
  Transformer model;
  model.config = load_model_config(directory);
  const ModelConfig& c = model.config;
  const SafetensorsCheckpoint checkpoint(directory);
  const int64_t H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t q_size = int64_t{c.num_heads} * c.head_dim, kv_size = int64_t{c.num_kv_heads} * c.head_dim;
  auto optional = [&](const std::string& name, const Shape& shape) {
    return checkpoint.contains(name) ? checkpoint.load(name, shape) : Tensor{};
  };

  model.embed_tokens = checkpoint.load("model.embed_tokens.weight", {V, H});
  model.final_norm = checkpoint.load("model.norm.weight", {H});
  if (c.tie_word_embeddings) {
    model.lm_head = model.embed_tokens;
  } else {
    model.lm_head = checkpoint.load("lm_head.weight", {V, H});
  }
  keep_bits(model.lm_head, model.lm_head_bf16);
  release_f32_if_bits(model.lm_head, model.lm_head_bf16, model.embed_tokens);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    LayerWeights layer;
    layer.input_norm = checkpoint.load(prefix + "input_layernorm.weight", {H});
    layer.q_proj = checkpoint.load(prefix + "self_attn.q_proj.weight", {q_size, H});
    layer.k_proj = checkpoint.load(prefix + "self_attn.k_proj.weight", {kv_size, H});
    layer.v_proj = checkpoint.load(prefix + "self_attn.v_proj.weight", {kv_size, H});
    layer.o_proj = checkpoint.load(prefix + "self_attn.o_proj.weight", {H, q_size});
    if (c.attention_bias) {
      layer.q_bias = checkpoint.load(prefix + "self_attn.q_proj.bias", {q_size});
      layer.k_bias = checkpoint.load(prefix + "self_attn.k_proj.bias", {kv_size});
      layer.v_bias = checkpoint.load(prefix + "self_attn.v_proj.bias", {kv_size});
      layer.o_bias = optional(prefix + "self_attn.o_proj.bias", {H});  // Llama has it, Qwen3 not
    }
    if (c.qk_norm) {
      layer.q_norm = checkpoint.load(prefix + "self_attn.q_norm.weight", {c.head_dim});
      layer.k_norm = checkpoint.load(prefix + "self_attn.k_norm.weight", {c.head_dim});
    }
    layer.post_attention_norm = checkpoint.load(prefix + "post_attention_layernorm.weight", {H});
    layer.gate_proj = checkpoint.load(prefix + "mlp.gate_proj.weight", {F, H});
    layer.up_proj = checkpoint.load(prefix + "mlp.up_proj.weight", {F, H});
    layer.down_proj = checkpoint.load(prefix + "mlp.down_proj.weight", {H, F});
    if (c.mlp_bias) {
      layer.gate_bias = checkpoint.load(prefix + "mlp.gate_proj.bias", {F});
      layer.up_bias = checkpoint.load(prefix + "mlp.up_proj.bias", {F});
      layer.down_bias = checkpoint.load(prefix + "mlp.down_proj.bias", {H});
    }
    // Layer by layer, so that a bf16 checkpoint never holds all of its f32 tensors at once.
    for_each_projection(layer, [&](Tensor& weight, std::vector<uint16_t>& bits) {
      keep_bits(weight, bits);
      release_f32_if_bits(weight, bits, model.embed_tokens);
    });
    model.layers.push_back(std::move(layer));
  }
  model.rope_inverse_frequency = rope_inverse_frequencies(c);
  return model;
}

void keep_bf16_weights(Transformer& model) {
  for (LayerWeights& layer : model.layers) for_each_projection(layer, keep_bits);
  keep_bits(model.lm_head, model.lm_head_bf16);
}

namespace {

// out [rows, out_features] = x @ weight^T + bias (bias may be empty), reading
// the weight's packed bf16 bits (LayerWeights::bf16) where it has them.
void project(float* out, const float* x, const Tensor& weight, const std::vector<uint16_t>& bf16, const Tensor& bias,
             int rows, int in_features, int out_features) {
  cpu::matmul_forward(out, x, weight.data, cpu::bf16_or_null(bf16), bias.data, rows, in_features, out_features);
}

// Copies the residual stream x [T, H] into tap slot `slot` of taps [T, m, H].
void copy_tap(float* taps, const float* x, int rows, int hidden, int slot, int tap_count) {
  for (int row = 0; row < rows; ++row)
    std::copy_n(x + static_cast<long>(row) * hidden, hidden,
                taps + (static_cast<long>(row) * tap_count + slot) * hidden);
}

}  // namespace

void transformer_forward(const Transformer& model, std::span<const ForwardSequence> sequences,
                         std::span<const int> tap_layers, ForwardWorkspace& work,
                         ForwardOutput& output) {
  const ModelConfig& c = model.config;
  const int H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, hd = c.head_dim;
  const int nh = c.num_heads, nkv = c.num_kv_heads;
  const int q_size = nh * hd, kv_size = nkv * hd;
  const int m = static_cast<int>(tap_layers.size());
  for (int tap : tap_layers)
    DSPARK_CHECK(tap >= 0 && tap <= c.num_layers, "tap index ", tap, " is outside 0..", c.num_layers);

  // Gather the batch: tokens and absolute positions of all T rows.
  int T = 0, logit_rows = 0, longest = 0;
  for (const ForwardSequence& sequence : sequences) {
    const int count = static_cast<int>(sequence.tokens.size());
    DSPARK_CHECK(count > 0, "a forward needs at least one token per sequence");
    DSPARK_CHECK(sequence.cache->length() + count <= sequence.cache->capacity(), "context full: ",
                 sequence.cache->length(), " + ", count, " tokens exceed the ",
                 sequence.cache->capacity(), "-position KV cache");
    T += count;
    logit_rows += sequence.all_logits ? count : 1;
    longest = std::max(longest, sequence.cache->length() + count);
  }
  int32_t* tokens = grow(work.tokens, T);
  int* positions = grow(work.positions, T);
  for (int row = 0; const ForwardSequence& sequence : sequences)
    for (size_t i = 0; i < sequence.tokens.size(); ++i, ++row) {
      DSPARK_CHECK(sequence.tokens[i] >= 0 && sequence.tokens[i] < V, "token id ", sequence.tokens[i],
                   " is outside the vocabulary of ", V);
      tokens[row] = sequence.tokens[i];
      positions[row] = sequence.cache->length() + static_cast<int>(i);
    }

  float* x = grow(work.x, size_t(T) * H);
  float* normed = grow(work.normed, size_t(T) * H);
  float* q = grow(work.q, size_t(T) * q_size);
  float* k = grow(work.k, size_t(T) * kv_size);
  float* v = grow(work.v, size_t(T) * kv_size);
  float* attention = grow(work.attention, size_t(T) * q_size);
  float* projected = grow(work.projected, size_t(T) * H);
  float* gate = grow(work.gate, size_t(T) * F);
  float* up = grow(work.up, size_t(T) * F);
  float* scores = grow(work.scores, size_t(longest));
  float* cosines = grow(work.cosines, size_t(T) * (hd / 2));
  float* sines = grow(work.sines, size_t(T) * (hd / 2));
  cpu::rope_angles(cosines, sines, positions, T, hd, model.rope_inverse_frequency.data());
  output.taps.assign(m ? size_t(T) * m * H : 0, 0.0f);
  auto record_taps = [&](int layer_index, const float* hidden) {
    for (int slot = 0; slot < m; ++slot)
      if (tap_layers[slot] == layer_index) copy_tap(output.taps.data(), hidden, T, H, slot, m);
  };

  cpu::embedding_forward(x, model.embed_tokens.data, tokens, T, H);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = model.layers[l];
    // Attention block: x += o(attention(rope(norm(q)), rope(norm(k)), v)) on norm(x)
    cpu::rmsnorm_forward(normed, x, w.input_norm.data, T, H, c.rms_norm_eps);
    project(q, normed, w.q_proj, w.bf16.q_proj, w.q_bias, T, H, q_size);
    project(k, normed, w.k_proj, w.bf16.k_proj, w.k_bias, T, H, kv_size);
    project(v, normed, w.v_proj, w.bf16.v_proj, w.v_bias, T, H, kv_size);
    if (c.qk_norm) {
      cpu::rmsnorm_forward(q, q, w.q_norm.data, T * nh, hd, c.rms_norm_eps);
      cpu::rmsnorm_forward(k, k, w.k_norm.data, T * nkv, hd, c.rms_norm_eps);
    }
    cpu::rope_apply(q, cosines, sines, T, nh, hd);
    cpu::rope_apply(k, cosines, sines, T, nkv, hd);
    for (int row = 0; const ForwardSequence& sequence : sequences) {
      const int count = static_cast<int>(sequence.tokens.size());
      const int start = sequence.cache->length();
      float* keys = sequence.cache->keys(l);
      float* values = sequence.cache->values(l);
      std::copy_n(k + long(row) * kv_size, long(count) * kv_size, keys + long(start) * kv_size);
      std::copy_n(v + long(row) * kv_size, long(count) * kv_size, values + long(start) * kv_size);
      cpu::attention_forward(attention + long(row) * q_size, q + long(row) * q_size, keys, values,
                             count, start, nh, nkv, hd, scores);
      row += count;
    }
    project(projected, attention, w.o_proj, w.bf16.o_proj, w.o_bias, T, q_size, H);
    cpu::residual_add(x, projected, long(T) * H);
    // MLP block: x += down(silu(gate(norm(x))) * up(norm(x)))
    cpu::rmsnorm_forward(normed, x, w.post_attention_norm.data, T, H, c.rms_norm_eps);
    project(gate, normed, w.gate_proj, w.bf16.gate_proj, w.gate_bias, T, H, F);
    project(up, normed, w.up_proj, w.bf16.up_proj, w.up_bias, T, H, F);
    cpu::swiglu_forward(gate, gate, up, long(T) * F);
    project(projected, gate, w.down_proj, w.bf16.down_proj, w.down_bias, T, F, H);
    cpu::residual_add(x, projected, long(T) * H);
    record_taps(l, x);
  }
  for (const ForwardSequence& sequence : sequences)
    sequence.cache->advance(static_cast<int>(sequence.tokens.size()));

  // Final norm, then the LM head over only the rows whose logits are wanted.
  cpu::rmsnorm_forward(normed, x, model.final_norm.data, T, H, c.rms_norm_eps);
  record_taps(c.num_layers, normed);
  const float* head_input = normed;
  if (logit_rows != T) {
    int out_row = 0;
    for (int row = 0; const ForwardSequence& sequence : sequences) {
      const int count = static_cast<int>(sequence.tokens.size());
      const int first = sequence.all_logits ? 0 : count - 1;
      for (int i = first; i < count; ++i, ++out_row)
        std::copy_n(normed + long(row + i) * H, H, projected + long(out_row) * H);
      row += count;
    }
    head_input = projected;
  }
  output.logits.resize(size_t(logit_rows) * V);
  cpu::matmul_forward(output.logits.data(), head_input, model.lm_head.data, cpu::bf16_or_null(model.lm_head_bf16),
                      nullptr, logit_rows, H, V);
}

}  // namespace dspark
