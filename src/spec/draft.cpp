#include "spec/draft.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"

namespace dspark {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

std::string layer_name(int layer, const char* tensor) { return "bb." + std::to_string(layer) + "." + tensor; }

// out [rows, out_features] = x [rows, in] @ the drafter's matrix `name`
// ([in, out_features]), read as bf16 when decoding keeps a copy (Drafter::bf16).
void product(const Drafter& drafter, const std::string& name, float* out, const float* x, int rows, int in,
             int out_features) {
  cpu::matmul_in_out_forward(out, x, drafter[name], drafter.bf16_of(name), rows, in, out_features);
}

// The parallel backbone for B rows: work.hidden [B*γ, d] = h, work.base_logits
// [B*P, V] = U of each block's first P = `head_positions` rows (a draft of at
// most P tokens reads no other; the LM head is most of a CPU draft's
// arithmetic). Row b's block attends to its retained context and to itself.
void backbone_forward(const Drafter& drafter, const TargetHead& head, std::span<const DraftContext* const> contexts,
                      std::span<const int32_t> anchors, int head_positions, DraftWorkspace& work) {
  const DrafterConfig& c = drafter.config;
  const int B = static_cast<int>(anchors.size()), gamma = c.gamma, d = c.d_draft, inner = c.ff_mult * d;
  const int H = drafter.dims.hidden_size, V = drafter.dims.vocab_size, rows = B * gamma;
  const float eps = drafter.dims.eps;

  float* block = grow(work.block, size_t(rows) * d);
  float* normed = grow(work.normed, size_t(rows) * d);
  float* q = grow(work.q, size_t(rows) * d);
  float* k = grow(work.k, size_t(rows) * d);
  float* v = grow(work.v, size_t(rows) * d);
  float* attention = grow(work.attention, size_t(rows) * d);
  float* projected = grow(work.projected, size_t(rows) * std::max(d, H));
  float* gate = grow(work.gate, size_t(rows) * inner);
  float* up = grow(work.up, size_t(rows) * inner);
  float* hidden = grow(work.hidden, size_t(rows) * d);

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0]; row k = mask_emb[k-1] + block_pos[k].
  for (int b = 0; b < B; ++b) {
    DSPARK_CHECK(anchors[b] >= 0 && anchors[b] < V, "draft anchor ", anchors[b], " is outside the vocabulary of ", V);
    product(drafter, "tok_proj", block + long(b) * gamma * d, head.embedding + long(anchors[b]) * H, 1, H, d);
    for (int position = 0; position < gamma; ++position) {
      float* row = block + (long(b) * gamma + position) * d;
      const float* position_embedding = drafter["block_pos"] + long(position) * d;
      if (position == 0) {
        for (int i = 0; i < d; ++i) row[i] += position_embedding[i];
      } else {
        const float* mask = drafter["mask_emb"] + long(position - 1) * d;
        for (int i = 0; i < d; ++i) row[i] = mask[i] + position_embedding[i];
      }
    }
  }

  for (int l = 0; l < c.num_layers; ++l) {
    cpu::rmsnorm_forward(normed, block, drafter[layer_name(l, "attn_norm")], rows, d, eps);
    product(drafter, layer_name(l, "q"), q, normed, rows, d, d);
    product(drafter, layer_name(l, "k"), k, normed, rows, d, d);
    product(drafter, layer_name(l, "v"), v, normed, rows, d, d);
    for (int b = 0; b < B; ++b) {  // over [context ; block]
      const DraftContext& context = *contexts[b];
      const bool extended = context.length > 0;  // a context never extended has no per-layer vectors at all
      cpu::bidirectional_attention_forward(
          attention + long(b) * gamma * d, q + long(b) * gamma * d, extended ? context.keys[l].data() : nullptr,
          extended ? context.values[l].data() : nullptr, context.length, k + long(b) * gamma * d,
          v + long(b) * gamma * d, gamma, gamma, c.num_heads, d / c.num_heads);
    }
    product(drafter, layer_name(l, "o"), projected, attention, rows, d, d);
    cpu::residual_add(block, projected, long(rows) * d);
    cpu::rmsnorm_forward(normed, block, drafter[layer_name(l, "ff_norm")], rows, d, eps);
    product(drafter, layer_name(l, "gate"), gate, normed, rows, d, inner);
    product(drafter, layer_name(l, "up"), up, normed, rows, d, inner);
    cpu::gelu_tanh_gate_forward(gate, gate, up, long(rows) * inner);
    product(drafter, layer_name(l, "down"), projected, gate, rows, inner, d);
    cpu::residual_add(block, projected, long(rows) * d);
  }
  // h = rms(Hd, out_norm); U = (h @ out_proj) through the target's own LM head.
  cpu::rmsnorm_forward(hidden, block, drafter["out_norm"], rows, d, eps);
  const float* head_hidden = hidden;
  if (head_positions < gamma) {  // each block's first head_positions rows, gathered
    for (int b = 0; b < B; ++b)
      std::copy_n(hidden + long(b) * gamma * d, long(head_positions) * d, normed + long(b) * head_positions * d);
    head_hidden = normed;
  }
  const int head_rows = B * head_positions;
  float* head_input = grow(work.head_input, size_t(head_rows) * H);
  product(drafter, "out_proj", head_input, head_hidden, head_rows, d, H);
  cpu::matmul_forward(grow(work.base_logits, size_t(head_rows) * V), head_input, head.lm_head, head.lm_head_bf16,
                      nullptr, head_rows, H, V);
}

// The sequential head and the confidence head, walked position by position
// for one row at a time. Parameter pointers are resolved once per call, not
// per position.
class SequentialHead {
 public:
  explicit SequentialHead(const Drafter& drafter)
      : kind_(drafter.config.seq_head),
        rank_(drafter.config.markov_rank),
        width_(drafter.config.d_draft),
        vocab_(drafter.dims.vocab_size),
        embedding_(drafter["markov.w1"]),
        markov_out_(drafter["markov.w2"]),
        confidence_weight_(drafter["conf.w"]),
        confidence_bias_(drafter["conf.b"][0]),
        sts_(drafter.config.sts),
        state_(rank_),
        scratch_(size_t(vocab_) + 5 * rank_ + width_) {  // B [V], then the GRU's z [2r+d] and gates [3r]
    markov_out_bf16_ = drafter.bf16_of("markov.w2");
    if (kind_ == "rnn") {
      recurrent_ = drafter["rnn.wH"], recurrent_bias_ = drafter["rnn.bH"], recurrent_out_ = drafter["rnn.wO"];
      recurrent_bf16_ = drafter.bf16_of("rnn.wH"), recurrent_out_bf16_ = drafter.bf16_of("rnn.wO");
    } else if (kind_ == "gru") {
      recurrent_ = drafter["gru.wJ"], recurrent_bias_ = drafter["gru.bJ"], recurrent_bf16_ = drafter.bf16_of("gru.wJ");
    }
  }

  void reset() { std::fill(state_.begin(), state_.end(), 0.0f); }

  // e_k = w1[x_{k-1}]
  const float* embedding(int32_t previous) const { return embedding_ + long(previous) * rank_; }

  // c_k = σ([h_k; e_k] @ conf.w + conf.b), the logit divided by the STS temperature when calibrated.
  float confidence(int position, const float* hidden, const float* e) const {
    float logit = confidence_bias_;
    for (int i = 0; i < width_; ++i) logit += hidden[i] * confidence_weight_[i];
    for (int i = 0; i < rank_; ++i) logit += e[i] * confidence_weight_[width_ + i];
    if (sts_ && !sts_->temperatures.empty()) logit /= sts_->temperatures[position];
    return sigmoid(logit);
  }

  // logits [V] = base [V] + B_k, and advances the recurrent state.
  void step(const float* e, const float* h, const float* base, float* logits) {
    const int r = rank_, d = width_, V = vocab_;
    float* added = scratch_.data();
    const float* x = e;  // B_k = x @ out
    const float* out = markov_out_;
    const uint16_t* out_bf16 = markov_out_bf16_;
    if (kind_ == "rnn") {  // s = tanh(s @ wH + e + bH); B = s @ wO
      float* pre = added + V;
      cpu::matmul_in_out_forward(pre, state_.data(), recurrent_, recurrent_bf16_, 1, r, r);
      for (int i = 0; i < r; ++i) state_[i] = std::tanh(pre[i] + e[i] + recurrent_bias_[i]);
      x = state_.data(), out = recurrent_out_, out_bf16 = recurrent_out_bf16_;
    } else if (kind_ == "gru") {  // [g, c, o] = [s; e; h] @ wJ + bJ; s = σ(g) s + (1 - σ(g)) tanh(c); B = tanh(o) @ w2
      float* z = added + V;          // [2r + d]
      float* gates = z + 2 * r + d;  // [3r]
      std::copy_n(state_.data(), r, z);
      std::copy_n(e, r, z + r);
      std::copy_n(h, d, z + 2 * r);
      cpu::matmul_in_out_forward(gates, z, recurrent_, recurrent_bf16_, 1, 2 * r + d, 3 * r);
      const float* bias = recurrent_bias_;
      for (int i = 0; i < r; ++i) {
        const float keep = sigmoid(gates[i] + bias[i]);
        state_[i] = keep * state_[i] + (1.0f - keep) * std::tanh(gates[r + i] + bias[r + i]);
        z[i] = std::tanh(gates[2 * r + i] + bias[2 * r + i]);  // tanh(o), reusing z's head
      }
      x = z;
    }
    if (out_bf16) {  // base as the product's bias: the same sums as adding them after, in one pass
      cpu::matmul_forward_small_rows(logits, x, out_bf16, base, 1, r, V);
    } else {
      cpu::matmul_in_out_forward(added, x, out, 1, r, V);
      for (int i = 0; i < V; ++i) logits[i] = base[i] + added[i];
    }
  }

 private:
  std::string kind_;
  int rank_, width_, vocab_;
  const float *embedding_, *markov_out_, *confidence_weight_;
  float confidence_bias_;
  const std::optional<StsCalibration>& sts_;
  const float *recurrent_ = nullptr, *recurrent_bias_ = nullptr, *recurrent_out_ = nullptr;
  const uint16_t *markov_out_bf16_ = nullptr, *recurrent_bf16_ = nullptr, *recurrent_out_bf16_ = nullptr;  // null: f32
  std::vector<float> state_, scratch_;
};

}  // namespace

TargetHead target_head_of(const Transformer& model) {
  return {model.embed_tokens.data, model.lm_head.data, cpu::bf16_or_null(model.lm_head_bf16)};
}

TargetHeadWeights load_target_head(const std::filesystem::path& target_directory, const ModelConfig& config) {
  const SafetensorsCheckpoint checkpoint(target_directory);
  const Shape shape = {config.vocab_size, config.hidden_size};
  TargetHeadWeights weights;
  weights.embedding = checkpoint.load("model.embed_tokens.weight", shape);
  weights.lm_head = config.tie_word_embeddings ? weights.embedding : checkpoint.load("lm_head.weight", shape);
  weights.lm_head_bf16 = cpu::pack_bf16_rows(weights.lm_head.data, config.vocab_size, config.hidden_size);
  return weights;
}

void DraftContext::truncate(int new_length) {
  DSPARK_CHECK(new_length >= 0 && new_length <= length, "cannot truncate a draft context of ", length, " rows to ",
               new_length);
  for (auto* layers : {&keys, &values})
    for (auto& layer : *layers) layer.resize(length ? layer.size() / length * new_length : 0);  // rows of d
  length = new_length;
}

void extend_draft_contexts(const Drafter& drafter, std::span<DraftContext* const> contexts,
                           std::span<const float* const> tapped_rows, std::span<const int> counts,
                           DraftWorkspace& work) {
  DSPARK_CHECK(contexts.size() == tapped_rows.size() && contexts.size() == counts.size(),
               "extend_draft_contexts: ", contexts.size(), " contexts, ", tapped_rows.size(), " row sets, ",
               counts.size(), " counts");
  const DrafterConfig& c = drafter.config;
  const int d = c.d_draft, L = c.num_layers, width = static_cast<int>(c.tap_layers.size()) * drafter.dims.hidden_size;
  struct Row {
    DraftContext* context;
    const float* taps;  // [m·H]
    int position;       // where it lands in its context
  };
  std::vector<Row> rows;
  for (size_t i = 0; i < contexts.size(); ++i) {
    DSPARK_CHECK(counts[i] >= 0, "cannot extend a draft context by ", counts[i], " rows");
    DraftContext& context = *contexts[i];
    context.keys.resize(L);
    context.values.resize(L);
    for (int r = 0; r < counts[i]; ++r)
      rows.push_back({&context, tapped_rows[i] + size_t(r) * width, context.length + r});
    context.length += counts[i];
    for (int l = 0; l < L; ++l) {
      context.keys[l].resize(size_t(context.length) * d);
      context.values[l].resize(size_t(context.length) * d);
    }
  }
  // Chunks of at most 64 rows, the small-row matmul's range, where a row's
  // result does not depend on the other rows of the call: a context holds the
  // same bits however its rows were grouped (one request's prefill, or many
  // requests' rounds at once).
  constexpr int kChunk = 64;
  const size_t chunk = std::min<size_t>(kChunk, rows.size());
  float* gathered = grow(work.context_rows, chunk * width);
  float* projected = grow(work.projected, chunk * d);
  float* normed = grow(work.normed, chunk * d);
  float* keys = grow(work.k, chunk * d);
  float* values = grow(work.v, chunk * d);
  for (size_t begin = 0; begin < rows.size(); begin += kChunk) {
    const int n = static_cast<int>(std::min<size_t>(kChunk, rows.size() - begin));
    for (int r = 0; r < n; ++r) std::copy_n(rows[begin + r].taps, width, gathered + size_t(r) * width);
    // Hc = rms(hctx @ W_c, ctx_norm)
    product(drafter, "W_c", projected, gathered, n, width, d);
    cpu::rmsnorm_forward(projected, projected, drafter["ctx_norm"], n, d, drafter.dims.eps);
    for (int l = 0; l < L; ++l) {  // per layer: rms(Hc, attn_norm) @ k | v
      cpu::rmsnorm_forward(normed, projected, drafter[layer_name(l, "attn_norm")], n, d, drafter.dims.eps);
      product(drafter, layer_name(l, "k"), keys, normed, n, d, d);
      product(drafter, layer_name(l, "v"), values, normed, n, d, d);
      for (int r = 0; r < n; ++r) {
        const Row& row = rows[begin + r];
        std::copy_n(keys + size_t(r) * d, d, row.context->keys[l].data() + size_t(row.position) * d);
        std::copy_n(values + size_t(r) * d, d, row.context->values[l].data() + size_t(row.position) * d);
      }
    }
  }
}

void extend_draft_context(const Drafter& drafter, DraftContext& context, const float* tapped_rows, int count) {
  DraftContext* contexts[] = {&context};
  const float* rows[] = {tapped_rows};
  const int counts[] = {count};
  DraftWorkspace work;
  extend_draft_contexts(drafter, contexts, rows, counts, work);
}

void draft(const Drafter& drafter, const TargetHead& head, std::span<const DraftRequest> requests,
           const DraftOptions& options, DraftWorkspace& work, std::vector<DraftResult>& results) {
  const DrafterConfig& c = drafter.config;
  const int gamma = c.gamma, d = c.d_draft, V = drafter.dims.vocab_size;
  const int limit = options.max_tokens > 0 ? std::min(options.max_tokens, gamma) : gamma;
  const bool calibrated = options.thresholds.empty() && c.sts && options.calibrated_thresholds;
  const std::vector<float>& thresholds = calibrated ? c.sts->thresholds : options.thresholds;
  DSPARK_CHECK(thresholds.empty() || thresholds.size() >= size_t(limit), "draft thresholds: ", thresholds.size(),
               " for ", limit, " positions");
  std::vector<const DraftContext*> contexts;
  std::vector<int32_t> anchors;
  for (const DraftRequest& request : requests) {
    contexts.push_back(request.context);
    anchors.push_back(request.anchor);
  }
  backbone_forward(drafter, head, contexts, anchors, limit, work);

  results.assign(requests.size(), DraftResult{});
  SequentialHead sequential(drafter);
  std::vector<float> logits(V);
  for (size_t b = 0; b < requests.size(); ++b) {
    DraftResult& result = results[b];
    sequential.reset();
    int32_t previous = requests[b].anchor;
    for (int position = 0; position < limit; ++position) {
      const float* hidden = work.hidden.data() + (long(b) * gamma + position) * d;
      const float* e = sequential.embedding(previous);
      const float confidence = sequential.confidence(position, hidden, e);
      const bool below = (!thresholds.empty() && confidence < thresholds[position]) ||
                         confidence < options.min_confidence;
      if (position >= 1 && below) break;  // pruned here; position 0 is always kept
      sequential.step(e, hidden, work.base_logits.data() + (long(b) * limit + position) * V, logits.data());
      int32_t token;
      if (options.sampling.greedy()) {
        token = cpu::argmax(logits.data(), V);
      } else {
        const size_t at = result.probs.size();
        result.probs.resize(at + V);  // kept: the proposal's q
        float* probs = result.probs.data() + at;
        cpu::processed_distribution(probs, logits.data(), V, options.sampling, work.order);
        token = cpu::sample_from_distribution(probs, V, requests[b].rng->uniform());
      }
      result.tokens.push_back(token);
      result.confidence.push_back(confidence);
      if (options.collect_logits) result.logits.insert(result.logits.end(), logits.begin(), logits.end());
      previous = token;
    }
  }
}

DraftForward draft_teacher_forced(const Drafter& drafter, const TargetHead& head, const DraftContext& context,
                                  int32_t anchor, std::span<const int32_t> tokens) {
  const DrafterConfig& c = drafter.config;
  const int gamma = c.gamma, d = c.d_draft, V = drafter.dims.vocab_size;
  DSPARK_CHECK(tokens.size() == size_t(gamma), "teacher forcing needs ", gamma, " tokens, got ", tokens.size());
  DraftWorkspace work;
  const DraftContext* contexts[] = {&context};
  const int32_t anchors[] = {anchor};
  backbone_forward(drafter, head, contexts, anchors, gamma, work);
  DraftForward forward;
  forward.hidden.assign(work.hidden.begin(), work.hidden.begin() + long(gamma) * d);
  forward.base_logits.assign(work.base_logits.begin(), work.base_logits.begin() + long(gamma) * V);
  forward.logits.resize(forward.base_logits.size());
  SequentialHead sequential(drafter);
  for (int position = 0; position < gamma; ++position) {
    const float* e = sequential.embedding(position == 0 ? anchor : tokens[position - 1]);
    const float* hidden = forward.hidden.data() + long(position) * d;
    forward.confidence.push_back(sequential.confidence(position, hidden, e));
    sequential.step(e, hidden, forward.base_logits.data() + long(position) * V,
                    forward.logits.data() + long(position) * V);
  }
  return forward;
}

}  // namespace dspark
