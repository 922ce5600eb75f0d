#include "train/drafter_backward.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"

namespace dspark {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Scratch of `count` zeros.
float* zeroed(std::vector<float>& buffer, size_t count) {
  float* data = grow(buffer, count);
  std::fill_n(data, count, 0.0f);
  return data;
}

// Every drafter tensor by role, resolved once per call: the parameters
// (T = const float) or their gradients (T = float), which share names.
template <class T>
struct DrafterTensors {
  struct Layer {
    T *attn_norm, *q, *k, *v, *o, *ff_norm, *gate, *up, *down;
  };
  std::vector<Layer> layers;
  T *W_c, *ctx_norm, *tok_proj, *mask_emb, *block_pos, *out_norm, *out_proj;
  T *markov_w1, *markov_w2, *conf_w, *conf_b;
  T *rnn_wH = nullptr, *rnn_bH = nullptr, *rnn_wO = nullptr;  // seqHead "rnn"
  T *gru_wJ = nullptr, *gru_bJ = nullptr;                     // seqHead "gru"
};

template <class T>
DrafterTensors<T> resolve(const DrafterConfig& config, const std::map<std::string, Tensor>& tensors, const char* what) {
  auto find = [&](const std::string& name) -> T* {
    auto found = tensors.find(name);
    DSPARK_CHECK(found != tensors.end(), what, " have no tensor \"", name, "\"");
    return found->second.data;
  };
  DrafterTensors<T> t;
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string prefix = "bb." + std::to_string(l) + ".";
    t.layers.push_back({find(prefix + "attn_norm"), find(prefix + "q"), find(prefix + "k"), find(prefix + "v"),
                        find(prefix + "o"), find(prefix + "ff_norm"), find(prefix + "gate"), find(prefix + "up"),
                        find(prefix + "down")});
  }
  t.W_c = find("W_c"), t.ctx_norm = find("ctx_norm"), t.tok_proj = find("tok_proj"), t.mask_emb = find("mask_emb");
  t.block_pos = find("block_pos"), t.out_norm = find("out_norm"), t.out_proj = find("out_proj");
  t.markov_w1 = find("markov.w1"), t.markov_w2 = find("markov.w2"), t.conf_w = find("conf.w"),
  t.conf_b = find("conf.b");
  if (config.seq_head == "rnn") t.rnn_wH = find("rnn.wH"), t.rnn_bH = find("rnn.bH"), t.rnn_wO = find("rnn.wO");
  if (config.seq_head == "gru") t.gru_wJ = find("gru.wJ"), t.gru_bJ = find("gru.bJ");
  return t;
}

}  // namespace

void check_train_batch(const DrafterConfig& c, const TargetDims& dims, const TrainBatch& batch) {
  const int A = batch.size(), gamma = c.gamma, V = dims.vocab_size, H = dims.hidden_size;
  const long width = long(c.tap_layers.size()) * H;
  DSPARK_CHECK(A >= 1, "train batch has no anchors");
  DSPARK_CHECK(batch.gamma == gamma, "train batch: gamma ", batch.gamma, " but the drafter drafts ", gamma);
  DSPARK_CHECK(batch.hidden_size == H && batch.tap_width == width, "train batch: hidden size ", batch.hidden_size,
               " and tap width ", batch.tap_width, " but the drafter expects ", H, " and ", width);
  DSPARK_CHECK(batch.context_offsets.size() == size_t(A) + 1 && batch.context_offsets[0] == 0,
               "train batch: ", batch.context_offsets.size(), " context offsets for ", A, " anchors");
  for (int a = 0; a < A; ++a)
    DSPARK_CHECK(batch.context_length(a) >= 0, "train batch: anchor ", a, " has a negative context length");
  const size_t context_values = size_t(batch.context_offsets[A]) * width;
  const bool bf16 = batch.context_rows.empty() && !batch.context_rows_bf16.empty();
  DSPARK_CHECK((bf16 ? batch.context_rows_bf16.size() : batch.context_rows.size()) == context_values,
               "train batch: ", bf16 ? batch.context_rows_bf16.size() : batch.context_rows.size(), " context ",
               bf16 ? "bf16 values" : "floats", " for ", batch.context_offsets[A], " rows of ", width);
  DSPARK_CHECK(batch.targets.size() == size_t(A) * gamma && batch.mask.size() == size_t(A) * gamma &&
                   batch.target_hidden.size() == size_t(A) * gamma * H,
               "train batch: targets, mask or target rows do not match ", A, " anchors of ", gamma, " positions");
  for (int32_t id : batch.anchors) DSPARK_CHECK(id >= 0 && id < V, "train batch: anchor ", id, " outside vocab ", V);
  for (int32_t id : batch.targets) DSPARK_CHECK(id >= 0 && id < V, "train batch: target ", id, " outside vocab ", V);
}

Gradients zero_gradients(const Drafter& drafter) {
  Gradients gradients;
  for (const std::string& name : drafter.names) gradients[name] = Tensor::zeros(drafter.parameter(name).shape);
  return gradients;
}

void drafter_training_forward(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch,
                              DrafterActivations& act) {
  check_train_batch(drafter.config, drafter.dims, batch);
  DSPARK_CHECK(batch.context_rows_bf16.empty(), "the CPU loss reads f32 context rows (build the batch without bf16 rows)");
  const DrafterConfig& c = drafter.config;
  const int A = batch.size(), gamma = c.gamma, d = c.d_draft, inner = c.ff_mult * d, r = c.markov_rank;
  const int H = drafter.dims.hidden_size, V = drafter.dims.vocab_size, width = batch.tap_width;
  const int rows = A * gamma, C = batch.context_offsets[A], heads = c.num_heads;
  const float eps = drafter.dims.eps;
  const DrafterTensors<const float> p = resolve<const float>(c, drafter.parameters, "the drafter's parameters");
  int longest_context = 0;
  for (int a = 0; a < A; ++a) longest_context = std::max(longest_context, batch.context_length(a));

  // Context (Eq 2): Hc = rms(hctx @ W_c, ctx_norm), every anchor's rows at once.
  float* context_projected = grow(act.context_projected, size_t(C) * d);
  float* context_hidden = grow(act.context_hidden, size_t(C) * d);
  if (C > 0) {
    cpu::matmul_in_out_forward(context_projected, batch.context_rows.data(), p.W_c, C, width, d);
    cpu::rmsnorm_forward(context_hidden, context_projected, p.ctx_norm, C, d, eps);
  }

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0]; row k = mask_emb[k-1] + block_pos[k].
  float* anchor_embeddings = grow(act.anchor_embeddings, size_t(A) * H);
  cpu::embedding_forward(anchor_embeddings, head.embedding, batch.anchors.data(), A, H);
  float* token = grow(act.projected, size_t(A) * d);
  cpu::matmul_in_out_forward(token, anchor_embeddings, p.tok_proj, A, H, d);
  float* block = grow(act.block, size_t(rows) * d);
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k) {
      float* row = block + (long(a) * gamma + k) * d;
      const float* first = k == 0 ? token + long(a) * d : p.mask_emb + long(k - 1) * d;
      for (int i = 0; i < d; ++i) row[i] = first[i] + p.block_pos[long(k) * d + i];
    }

  // Layers (Eq 3): the block attends to its own anchor's context ++ block, no mask, no RoPE.
  act.layers.resize(c.num_layers);
  float* context_normed = grow(act.context_normed, size_t(C) * d);
  float* keys = grow(act.keys, size_t(longest_context + gamma) * d);
  float* values = grow(act.values, size_t(longest_context + gamma) * d);
  float* scores = grow(act.attention_scratch, size_t(longest_context + gamma));
  float* projected = grow(act.projected, size_t(rows) * d);
  for (int l = 0; l < c.num_layers; ++l) {
    DrafterActivations::Layer& layer = act.layers[l];
    const auto& w = p.layers[l];
    float* input = grow(layer.input, size_t(rows) * d);
    float* normed = grow(layer.normed, size_t(rows) * d);
    float* q = grow(layer.q, size_t(rows) * d);
    float* k = grow(layer.k, size_t(rows) * d);
    float* v = grow(layer.v, size_t(rows) * d);
    float* context_k = grow(layer.context_k, size_t(C) * d);
    float* context_v = grow(layer.context_v, size_t(C) * d);
    float* attention = grow(layer.attention, size_t(rows) * d);
    std::copy_n(block, long(rows) * d, input);
    cpu::rmsnorm_forward(normed, block, w.attn_norm, rows, d, eps);
    cpu::matmul_in_out_forward(q, normed, w.q, rows, d, d);
    cpu::matmul_in_out_forward(k, normed, w.k, rows, d, d);
    cpu::matmul_in_out_forward(v, normed, w.v, rows, d, d);
    if (C > 0) {
      cpu::rmsnorm_forward(context_normed, context_hidden, w.attn_norm, C, d, eps);
      cpu::matmul_in_out_forward(context_k, context_normed, w.k, C, d, d);
      cpu::matmul_in_out_forward(context_v, context_normed, w.v, C, d, d);
    }
    for (int a = 0; a < A; ++a) {  // keys / values = [this anchor's context ; its block]
      const long first = batch.context_offsets[a], length = batch.context_length(a), offset = long(a) * gamma * d;
      std::copy_n(context_k + first * d, length * d, keys);
      std::copy_n(context_v + first * d, length * d, values);
      std::copy_n(k + offset, long(gamma) * d, keys + length * d);
      std::copy_n(v + offset, long(gamma) * d, values + length * d);
      cpu::bidirectional_attention_forward(attention + offset, q + offset, keys, values, gamma, length + gamma, heads,
                                           d / heads, scores);
    }
    cpu::matmul_in_out_forward(projected, attention, w.o, rows, d, d);
    cpu::residual_add(block, projected, long(rows) * d);

    float* middle = grow(layer.middle, size_t(rows) * d);
    float* ff_normed = grow(layer.ff_normed, size_t(rows) * d);
    float* gate = grow(layer.gate, size_t(rows) * inner);
    float* up = grow(layer.up, size_t(rows) * inner);
    float* gated = grow(layer.gated, size_t(rows) * inner);
    std::copy_n(block, long(rows) * d, middle);
    cpu::rmsnorm_forward(ff_normed, block, w.ff_norm, rows, d, eps);
    cpu::matmul_in_out_forward(gate, ff_normed, w.gate, rows, d, inner);
    cpu::matmul_in_out_forward(up, ff_normed, w.up, rows, d, inner);
    cpu::gelu_tanh_gate_forward(gated, gate, up, long(rows) * inner);
    cpu::matmul_in_out_forward(projected, gated, w.down, rows, inner, d);
    cpu::residual_add(block, projected, long(rows) * d);
  }

  // Head rows from here on. h = rms(Hd, out_norm); U = (h @ out_proj) through the target's LM head.
  float* hidden = grow(act.hidden, size_t(rows) * d);
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k)
      cpu::rmsnorm_forward(hidden + (long(k) * A + a) * d, block + (long(a) * gamma + k) * d, p.out_norm, 1, d, eps);
  float* head_input = grow(act.head_input, size_t(rows) * H);
  float* logits = grow(act.logits, size_t(rows) * V);
  cpu::matmul_in_out_forward(head_input, hidden, p.out_proj, rows, d, H);
  cpu::matmul_forward(logits, head_input, head.lm_head, nullptr, rows, H, V);

  // Sequential head, teacher forced: e_k = w1[x_{k-1}], x_{-1} = the anchor. L = U + B.
  int32_t* previous = grow(act.previous, size_t(rows));
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k)
      previous[long(k) * A + a] = k == 0 ? batch.anchors[a] : batch.targets[long(a) * gamma + k - 1];
  float* embedded = grow(act.embedded, size_t(rows) * r);
  cpu::embedding_forward(embedded, p.markov_w1, previous, rows, r);
  // B is computed in logits_gradient, scratch until the loss writes the gradient there.
  float* added = grow(act.logits_gradient, size_t(rows) * V);
  if (c.seq_head == "markov") {  // B = e @ w2
    cpu::matmul_in_out_forward(added, embedded, p.markov_w2, rows, r, V);
  } else if (c.seq_head == "rnn") {  // s_k = tanh(s_{k-1} @ wH + e_k + bH), s_{-1} = 0; B = s @ wO
    float* state = grow(act.state, size_t(rows) * r);
    for (int k = 0; k < gamma; ++k) {
      float* current = state + long(k) * A * r;
      const float* e = embedded + long(k) * A * r;
      if (k == 0)
        std::fill_n(current, long(A) * r, 0.0f);
      else
        cpu::matmul_in_out_forward(current, current - long(A) * r, p.rnn_wH, A, r, r);
      for (int a = 0; a < A; ++a)
        for (int i = 0; i < r; ++i) {
          float& s = current[long(a) * r + i];
          s = std::tanh(s + e[long(a) * r + i] + p.rnn_bH[i]);
        }
    }
    cpu::matmul_in_out_forward(added, state, p.rnn_wO, rows, r, V);
  } else {  // gru: [g, c, o] = [s_{k-1}; e; h] @ wJ + bJ; s = σ(g) s_{k-1} + (1 - σ(g)) tanh(c); B = tanh(o) @ w2
    const int z_width = 2 * r + d;
    float* state = grow(act.state, size_t(rows) * r);
    float* z = grow(act.gru_input, size_t(rows) * z_width);
    float* gates = grow(act.gru_gates, size_t(rows) * 3 * r);
    float* output = grow(act.gru_output, size_t(rows) * r);
    for (int k = 0; k < gamma; ++k) {
      for (int a = 0; a < A; ++a) {
        const long row = long(k) * A + a;
        float* zrow = z + row * z_width;
        if (k == 0)
          std::fill_n(zrow, r, 0.0f);
        else
          std::copy_n(state + (row - A) * r, r, zrow);
        std::copy_n(embedded + row * r, r, zrow + r);
        std::copy_n(hidden + row * d, d, zrow + 2 * r);
      }
      const long first = long(k) * A;
      cpu::matmul_in_out_forward(gates + first * 3 * r, z + first * z_width, p.gru_wJ, A, z_width, 3 * r);
      for (long row = first; row < first + A; ++row) {
        float* g = gates + row * 3 * r;
        for (int i = 0; i < 3 * r; ++i) g[i] += p.gru_bJ[i];
        for (int i = 0; i < r; ++i) {
          const float keep = sigmoid(g[i]), previous_state = z[row * z_width + i];
          state[row * r + i] = keep * previous_state + (1.0f - keep) * std::tanh(g[r + i]);
          output[row * r + i] = std::tanh(g[2 * r + i]);
        }
      }
    }
    cpu::matmul_in_out_forward(added, output, p.markov_w2, rows, r, V);
  }
  cpu::residual_add(logits, added, long(rows) * V);

  // Confidence (Eq 7): c = σ([h; e] @ conf.w + conf.b). STS temperatures apply only at inference.
  float* confidence = grow(act.confidence, size_t(rows));
  for (long row = 0; row < rows; ++row) {
    float logit = p.conf_b[0];
    for (int i = 0; i < d; ++i) logit += hidden[row * d + i] * p.conf_w[i];
    for (int i = 0; i < r; ++i) logit += embedded[row * r + i] * p.conf_w[d + i];
    confidence[row] = sigmoid(logit);
  }
}

void drafter_backward(const Drafter& drafter, const TargetHead& head, const TrainBatch& batch, DrafterActivations& act,
                      Gradients& gradients) {
  const DrafterConfig& c = drafter.config;
  const int A = batch.size(), gamma = c.gamma, d = c.d_draft, inner = c.ff_mult * d, r = c.markov_rank;
  const int H = drafter.dims.hidden_size, V = drafter.dims.vocab_size, width = batch.tap_width;
  const int rows = A * gamma, C = batch.context_offsets[A], heads = c.num_heads;
  const float eps = drafter.dims.eps;
  const DrafterTensors<const float> p = resolve<const float>(c, drafter.parameters, "the drafter's parameters");
  const DrafterTensors<float> g = resolve<float>(c, gradients, "the gradients");
  const float* d_logits = act.logits_gradient.data();
  const float* hidden = act.hidden.data();
  const float* embedded = act.embedded.data();

  // Confidence: logit = [h; e] @ conf.w + conf.b.
  float* d_hidden = zeroed(act.d_hidden, size_t(rows) * d);
  float* d_embedded = zeroed(act.d_embedded, size_t(rows) * r);
  for (long row = 0; row < rows; ++row) {
    const float d_logit = act.confidence_gradient[row];
    if (d_logit == 0.0f) continue;
    g.conf_b[0] += d_logit;
    for (int i = 0; i < d; ++i) {
      g.conf_w[i] += d_logit * hidden[row * d + i];
      d_hidden[row * d + i] += d_logit * p.conf_w[i];
    }
    for (int i = 0; i < r; ++i) {
      g.conf_w[d + i] += d_logit * embedded[row * r + i];
      d_embedded[row * r + i] += d_logit * p.conf_w[d + i];
    }
  }

  // Sequential head: dB = dL. The recurrences run backwards through k.
  if (c.seq_head == "markov") {
    cpu::matmul_in_out_backward(d_embedded, g.markov_w2, d_logits, embedded, p.markov_w2, rows, r, V);
  } else if (c.seq_head == "rnn") {
    const float* state = act.state.data();
    float* d_state = zeroed(act.d_state, size_t(rows) * r);  // dLoss/ds_k, then dLoss/d(pre-activation)
    cpu::matmul_in_out_backward(d_state, g.rnn_wO, d_logits, state, p.rnn_wO, rows, r, V);
    for (int k = gamma - 1; k >= 0; --k) {
      const long first = long(k) * A * r;
      for (long i = first; i < first + long(A) * r; ++i) {
        d_state[i] *= 1.0f - state[i] * state[i];  // through tanh
        d_embedded[i] += d_state[i];
        g.rnn_bH[i % r] += d_state[i];
      }
      if (k > 0)  // s_{k-1} @ wH
        cpu::matmul_in_out_backward(d_state + first - long(A) * r, g.rnn_wH, d_state + first,
                                    state + first - long(A) * r, p.rnn_wH, A, r, r);
    }
  } else {
    const int z_width = 2 * r + d;
    const float *z = act.gru_input.data(), *gates = act.gru_gates.data(), *output = act.gru_output.data();
    float* d_output = zeroed(act.d_gru_output, size_t(rows) * r);
    cpu::matmul_in_out_backward(d_output, g.markov_w2, d_logits, output, p.markov_w2, rows, r, V);
    float* d_state = zeroed(act.d_state, size_t(rows) * r);
    float* d_gates = grow(act.d_gru_gates, size_t(rows) * 3 * r);
    for (int k = gamma - 1; k >= 0; --k) {
      const long first = long(k) * A;
      for (long row = first; row < first + A; ++row) {
        const float* gate = gates + row * 3 * r;
        float* d_gate = d_gates + row * 3 * r;
        for (int i = 0; i < r; ++i) {
          const float keep = sigmoid(gate[i]), candidate = std::tanh(gate[r + i]), out = output[row * r + i];
          const float d_s = d_state[row * r + i], previous_state = z[row * z_width + i];
          d_gate[i] = d_s * (previous_state - candidate) * keep * (1.0f - keep);
          d_gate[r + i] = d_s * (1.0f - keep) * (1.0f - candidate * candidate);
          d_gate[2 * r + i] = d_output[row * r + i] * (1.0f - out * out);
          if (k > 0) d_state[(row - A) * r + i] += d_s * keep;
        }
        for (int i = 0; i < 3 * r; ++i) g.gru_bJ[i] += d_gate[i];
      }
      float* d_z = zeroed(act.d_gru_input, size_t(A) * z_width);
      cpu::matmul_in_out_backward(d_z, g.gru_wJ, d_gates + first * 3 * r, z + first * z_width, p.gru_wJ, A, z_width,
                                  3 * r);
      for (int a = 0; a < A; ++a) {  // z = [s_{k-1}; e; h]
        const long row = first + a;
        const float* d_zrow = d_z + long(a) * z_width;
        if (k > 0)
          for (int i = 0; i < r; ++i) d_state[(row - A) * r + i] += d_zrow[i];
        for (int i = 0; i < r; ++i) d_embedded[row * r + i] += d_zrow[r + i];
        for (int i = 0; i < d; ++i) d_hidden[row * d + i] += d_zrow[2 * r + i];
      }
    }
  }
  // e = w1[x_{k-1}]
  for (long row = 0; row < rows; ++row) {
    float* d_table_row = g.markov_w1 + long(act.previous[row]) * r;
    for (int i = 0; i < r; ++i) d_table_row[i] += d_embedded[row * r + i];
  }

  // U = (h @ out_proj) @ lm_head^T: the LM head is the target's, frozen.
  float* d_head_input = zeroed(act.d_head_input, size_t(rows) * H);
  cpu::matmul_backward(d_head_input, nullptr, d_logits, act.head_input.data(), head.lm_head, rows, H, V);
  cpu::matmul_in_out_backward(d_hidden, g.out_proj, d_head_input, hidden, p.out_proj, rows, d, H);
  // h = rms(block, out_norm): head row k·A + a comes from block row a·γ + k.
  float* d_block = zeroed(act.d_block, size_t(rows) * d);
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k) {
      const long block_row = long(a) * gamma + k, head_row = long(k) * A + a;
      cpu::rmsnorm_backward(d_block + block_row * d, g.out_norm, d_hidden + head_row * d,
                            act.block.data() + block_row * d, p.out_norm, 1, d, eps);
    }

  // Layers, last to first. d_block is dLoss/d(the residual stream) after the layer, then before it.
  int longest_context = 0;
  for (int a = 0; a < A; ++a) longest_context = std::max(longest_context, batch.context_length(a));
  float* d_context_hidden = zeroed(act.d_context_hidden, size_t(C) * d);
  float* context_normed = grow(act.context_normed, size_t(C) * d);
  float* keys = grow(act.keys, size_t(longest_context + gamma) * d);
  float* values = grow(act.values, size_t(longest_context + gamma) * d);
  float* scratch = grow(act.attention_scratch, size_t(2) * gamma * (longest_context + gamma));
  for (int l = c.num_layers - 1; l >= 0; --l) {
    const DrafterActivations::Layer& layer = act.layers[l];
    const auto& w = p.layers[l];
    const auto& dw = g.layers[l];

    // MLP: block += (gelu_tanh(n2 @ gate) ⊙ (n2 @ up)) @ down, n2 = rms(middle, ff_norm).
    float* d_gated = zeroed(act.d_gated, size_t(rows) * inner);
    cpu::matmul_in_out_backward(d_gated, dw.down, d_block, layer.gated.data(), w.down, rows, inner, d);
    float* d_gate = zeroed(act.d_gate, size_t(rows) * inner);
    float* d_up = zeroed(act.d_up, size_t(rows) * inner);
    cpu::gelu_tanh_gate_backward(d_gate, d_up, d_gated, layer.gate.data(), layer.up.data(), long(rows) * inner);
    float* d_normed = zeroed(act.d_normed, size_t(rows) * d);
    cpu::matmul_in_out_backward(d_normed, dw.gate, d_gate, layer.ff_normed.data(), w.gate, rows, d, inner);
    cpu::matmul_in_out_backward(d_normed, dw.up, d_up, layer.ff_normed.data(), w.up, rows, d, inner);
    cpu::rmsnorm_backward(d_block, dw.ff_norm, d_normed, layer.middle.data(), w.ff_norm, rows, d, eps);

    // Attention: block += attention @ o, over keys / values [context ; block] per anchor.
    float* d_attention = zeroed(act.d_attention, size_t(rows) * d);
    cpu::matmul_in_out_backward(d_attention, dw.o, d_block, layer.attention.data(), w.o, rows, d, d);
    float* d_q = zeroed(act.d_q, size_t(rows) * d);
    float* d_k = grow(act.d_k, size_t(rows) * d);
    float* d_v = grow(act.d_v, size_t(rows) * d);
    float* d_context_k = grow(act.d_context_k, size_t(C) * d);
    float* d_context_v = grow(act.d_context_v, size_t(C) * d);
    float* d_keys = grow(act.d_keys, size_t(longest_context + gamma) * d);
    float* d_values = grow(act.d_values, size_t(longest_context + gamma) * d);
    for (int a = 0; a < A; ++a) {
      const long first = batch.context_offsets[a], length = batch.context_length(a), offset = long(a) * gamma * d;
      const long kv_floats = (length + gamma) * d;
      std::copy_n(layer.context_k.data() + first * d, length * d, keys);
      std::copy_n(layer.context_v.data() + first * d, length * d, values);
      std::copy_n(layer.k.data() + offset, long(gamma) * d, keys + length * d);
      std::copy_n(layer.v.data() + offset, long(gamma) * d, values + length * d);
      std::fill_n(d_keys, kv_floats, 0.0f);
      std::fill_n(d_values, kv_floats, 0.0f);
      cpu::bidirectional_attention_backward(d_q + offset, d_keys, d_values, d_attention + offset,
                                            layer.q.data() + offset, keys, values, gamma, length + gamma, heads,
                                            d / heads, scratch);
      // Each anchor owns its context rows and its block rows: copy, not add.
      std::copy_n(d_keys, length * d, d_context_k + first * d);
      std::copy_n(d_values, length * d, d_context_v + first * d);
      std::copy_n(d_keys + length * d, long(gamma) * d, d_k + offset);
      std::copy_n(d_values + length * d, long(gamma) * d, d_v + offset);
    }
    std::fill_n(d_normed, long(rows) * d, 0.0f);
    cpu::matmul_in_out_backward(d_normed, dw.q, d_q, layer.normed.data(), w.q, rows, d, d);
    cpu::matmul_in_out_backward(d_normed, dw.k, d_k, layer.normed.data(), w.k, rows, d, d);
    cpu::matmul_in_out_backward(d_normed, dw.v, d_v, layer.normed.data(), w.v, rows, d, d);
    cpu::rmsnorm_backward(d_block, dw.attn_norm, d_normed, layer.input.data(), w.attn_norm, rows, d, eps);

    // The context's keys / values: rms(Hc, attn_norm) @ k | v (the normed rows recomputed, not kept).
    if (C > 0) {
      cpu::rmsnorm_forward(context_normed, act.context_hidden.data(), w.attn_norm, C, d, eps);
      float* d_context_normed = zeroed(act.d_context_normed, size_t(C) * d);
      cpu::matmul_in_out_backward(d_context_normed, dw.k, d_context_k, context_normed, w.k, C, d, d);
      cpu::matmul_in_out_backward(d_context_normed, dw.v, d_context_v, context_normed, w.v, C, d, d);
      cpu::rmsnorm_backward(d_context_hidden, dw.attn_norm, d_context_normed, act.context_hidden.data(), w.attn_norm, C,
                            d, eps);
    }
  }

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0]; row k = mask_emb[k-1] + block_pos[k].
  float* d_token = grow(act.d_token, size_t(A) * d);
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k) {
      const float* d_row = d_block + (long(a) * gamma + k) * d;
      for (int i = 0; i < d; ++i) g.block_pos[long(k) * d + i] += d_row[i];
      if (k == 0)
        std::copy_n(d_row, d, d_token + long(a) * d);
      else
        cpu::residual_add(g.mask_emb + long(k - 1) * d, d_row, d);
    }
  cpu::matmul_in_out_backward(nullptr, g.tok_proj, d_token, act.anchor_embeddings.data(), p.tok_proj, A, H, d);

  // Context: Hc = rms(hctx @ W_c, ctx_norm). The tapped rows themselves are data.
  if (C > 0) {
    float* d_projected = zeroed(act.d_context_normed, size_t(C) * d);
    cpu::rmsnorm_backward(d_projected, g.ctx_norm, d_context_hidden, act.context_projected.data(), p.ctx_norm, C, d,
                          eps);
    cpu::matmul_in_out_backward(nullptr, g.W_c, d_projected, batch.context_rows.data(), p.W_c, C, width, d);
  }
}

}  // namespace dspark
