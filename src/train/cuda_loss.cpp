#include "train/cuda_loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/draft_train.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/loss.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/rmsnorm.h"
#include "train/optimizer.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr long kAlignmentFloats = 64;  // 256 bytes

long align_up(long value, long alignment) { return (value + alignment - 1) / alignment * alignment; }

// Grow-only device scratch: reallocated (contents lost) only when too small.
template <class T>
T* ensure(DeviceBuffer<T>& buffer, size_t count) {
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

std::vector<uint16_t> to_bf16_bits(const float* values, size_t count) {
  std::vector<uint16_t> bits(count);
  convert_to_bf16(values, bits.data(), count);
  return bits;
}

std::string layer_name(int layer, const char* tensor) { return "bb." + std::to_string(layer) + "." + tensor; }

}  // namespace

// ------------------------------------------------------------------ the head

CudaTrainHead::CudaTrainHead(const TargetHead& head, const TargetDims& dims, bool use_bf16)
    : dims_(dims), bf16_(use_bf16) {
  DSPARK_CHECK(head.embedding && head.lm_head, "the CUDA trainer needs the target's embedding and LM head");
  const size_t count = size_t(dims.vocab_size) * dims.hidden_size;
  tied_ = head.embedding == head.lm_head;
  auto upload_f32 = [&](DeviceBuffer<float>& buffer, const float* values) {
    buffer.resize(count);
    CUDA_CHECK(cudaMemcpy(buffer.data(), values, count * sizeof(float), cudaMemcpyHostToDevice));
  };
  auto upload_bf16 = [&](DeviceBuffer<__nv_bfloat16>& buffer, const float* values) {
    const std::vector<uint16_t> bits = to_bf16_bits(values, count);
    buffer.resize(count);
    CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), count * 2, cudaMemcpyHostToDevice));
  };
  if (use_bf16) {
    upload_bf16(embedding_bf16_, head.embedding);
    if (!tied_) upload_bf16(lm_head_bf16_, head.lm_head);
  } else {
    upload_f32(embedding_f32_, head.embedding);
    if (!tied_) upload_f32(lm_head_f32_, head.lm_head);
  }
}

CudaTrainHead CudaTrainHead::random(const TargetDims& dims, bool use_bf16, uint64_t seed, float scale) {
  CudaTrainHead head(dims, use_bf16);
  const long count = long(dims.vocab_size) * dims.hidden_size;
  if (use_bf16) {
    head.embedding_bf16_.resize(count);
    head.lm_head_bf16_.resize(count);
    cuda::fill_random_uniform(head.embedding_bf16_.data(), count, seed, 1.0f, nullptr);
    cuda::fill_random_uniform(head.lm_head_bf16_.data(), count, seed + 1, scale, nullptr);
  } else {
    head.embedding_f32_.resize(count);
    head.lm_head_f32_.resize(count);
    cuda::fill_random_uniform(head.embedding_f32_.data(), count, seed, 1.0f, nullptr);
    cuda::fill_random_uniform(head.lm_head_f32_.data(), count, seed + 1, scale, nullptr);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return head;
}

const void* CudaTrainHead::embedding() const {
  return bf16_ ? static_cast<const void*>(embedding_bf16_.data()) : embedding_f32_.data();
}

const void* CudaTrainHead::lm_head() const {
  if (tied_) return embedding();
  return bf16_ ? static_cast<const void*>(lm_head_bf16_.data()) : lm_head_f32_.data();
}

// ------------------------------------------------------------------ layout

CudaParameterLayout::CudaParameterLayout(const Drafter& drafter) : names(drafter.names) {
  for (bool decays : {true, false}) {
    for (const std::string& name : names) {
      const Tensor& tensor = drafter.parameter(name);
      if (drafter_parameter_decays(name, tensor.shape) != decays) continue;
      entries[name] = {total, tensor.shape, tensor.numel()};
      total = align_up(total + tensor.numel(), kAlignmentFloats);
    }
    if (decays) decayed = total;
  }
}

std::vector<float> CudaParameterLayout::pack(const std::map<std::string, Tensor>& tensors) const {
  std::vector<float> flat(total, 0.0f);
  for (const std::string& name : names) {
    const Entry& entry = entries.at(name);
    auto found = tensors.find(name);
    DSPARK_CHECK(found != tensors.end() && found->second.shape == entry.shape, "no tensor \"", name, "\" of shape ",
                 shape_string(entry.shape), " to upload");
    std::copy_n(found->second.data, entry.count, flat.data() + entry.offset);
  }
  return flat;
}

void CudaParameterLayout::unpack(const std::vector<float>& flat, std::map<std::string, Tensor>& tensors) const {
  for (const std::string& name : names) {
    const Entry& entry = entries.at(name);
    Tensor& tensor = tensors[name];
    if (tensor.empty() || tensor.shape != entry.shape) tensor = Tensor::zeros(entry.shape);
    std::copy_n(flat.data() + entry.offset, entry.count, tensor.data);
  }
}

// ------------------------------------------------------------------ the loss

struct CudaDrafterLoss::Weights {
  struct Layer {
    float *attn_norm, *q, *k, *v, *o, *ff_norm, *gate, *up, *down;
  };
  std::vector<Layer> layers;
  float *W_c, *ctx_norm, *tok_proj, *mask_emb, *block_pos, *out_norm, *out_proj;
  float *markov_w1, *markov_w2, *conf_w, *conf_b;
  float *rnn_wH = nullptr, *rnn_bH = nullptr, *rnn_wO = nullptr;  // seqHead "rnn"
  float *gru_wJ = nullptr, *gru_bJ = nullptr;                     // seqHead "gru"
};

CudaDrafterLoss::Weights CudaDrafterLoss::resolve(float* base) const {
  auto find = [&](const std::string& name) { return base + layout_.entries.at(name).offset; };
  Weights w;
  for (int l = 0; l < config_.num_layers; ++l)
    w.layers.push_back({find(layer_name(l, "attn_norm")), find(layer_name(l, "q")), find(layer_name(l, "k")),
                        find(layer_name(l, "v")), find(layer_name(l, "o")), find(layer_name(l, "ff_norm")),
                        find(layer_name(l, "gate")), find(layer_name(l, "up")), find(layer_name(l, "down"))});
  w.W_c = find("W_c"), w.ctx_norm = find("ctx_norm"), w.tok_proj = find("tok_proj"), w.mask_emb = find("mask_emb");
  w.block_pos = find("block_pos"), w.out_norm = find("out_norm"), w.out_proj = find("out_proj");
  w.markov_w1 = find("markov.w1"), w.markov_w2 = find("markov.w2"), w.conf_w = find("conf.w");
  w.conf_b = find("conf.b");
  if (config_.seq_head == "rnn") w.rnn_wH = find("rnn.wH"), w.rnn_bH = find("rnn.bH"), w.rnn_wO = find("rnn.wO");
  if (config_.seq_head == "gru") w.gru_wJ = find("gru.wJ"), w.gru_bJ = find("gru.bJ");
  return w;
}

CudaDrafterLoss::CudaDrafterLoss(const Drafter& drafter, const CudaTrainHead& head,
                                 const CudaTrainPrecision& precision)
    : config_(drafter.config), dims_(drafter.dims), head_(head), precision_(precision), layout_(drafter) {
  const DrafterConfig& c = config_;
  DSPARK_CHECK(head.dims().hidden_size == dims_.hidden_size && head.dims().vocab_size == dims_.vocab_size,
               "the CUDA trainer's target head is ", head.dims().vocab_size, " x ", head.dims().hidden_size,
               "; the drafter's target is ", dims_.vocab_size, " x ", dims_.hidden_size);
  DSPARK_CHECK(head.bf16() == precision.bf16_head, "the target head's dtype is not the precision's");
  DSPARK_CHECK(c.seq_head == "markov" || c.seq_head == "rnn" || c.seq_head == "gru", "unknown seqHead \"",
               c.seq_head, "\"");
  head_dim_ = c.d_draft / c.num_heads;
  DSPARK_CHECK(cuda::train_attention_fits(c.gamma, head_dim_), "training on the GPU: gamma ", c.gamma,
               " with a head size of ", head_dim_, " needs more shared memory than this GPU has");
  width_ = static_cast<int>(c.tap_layers.size()) * dims_.hidden_size;
  inner_ = c.ff_mult * c.d_draft;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&weights_copied_, cudaEventDisableTiming));
  parameters_.resize(layout_.total);
  gradients_.resize(layout_.total);
  terms_.resize(cuda::kLossTerms);
  layers_.resize(c.num_layers);
  upload_parameters(drafter);
  zero_gradients();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

CudaDrafterLoss::~CudaDrafterLoss() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (uploaded_) cudaEventDestroy(uploaded_);
  if (weights_copied_) cudaEventDestroy(weights_copied_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaDrafterLoss::upload_parameters(const Drafter& drafter) {
  const std::vector<float> flat = layout_.pack(drafter.parameters);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(parameters_.data(), flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice));
}

void CudaDrafterLoss::download_parameters(Drafter& drafter) const {
  std::vector<float> flat(layout_.total);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(flat.data(), parameters_.data(), flat.size() * sizeof(float), cudaMemcpyDeviceToHost));
  layout_.unpack(flat, drafter.parameters);
}

void CudaDrafterLoss::download_gradients(Gradients& gradients) const {
  std::vector<float> flat(layout_.total);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(flat.data(), gradients_.data(), flat.size() * sizeof(float), cudaMemcpyDeviceToHost));
  layout_.unpack(flat, gradients);
}

void CudaDrafterLoss::zero_gradients() {
  CUDA_CHECK(cudaMemsetAsync(gradients_.data(), 0, gradients_.bytes(), stream_));
}

float* CudaDrafterLoss::scratch(long floats) { return ensure(scratch_, std::max(1L, floats)); }

void CudaDrafterLoss::upload(const TrainBatch& batch, ContextUpload context) {
  check_train_batch(config_, dims_, batch);
  const bool given_bf16 = batch.context_rows.empty() && !batch.context_rows_bf16.empty();
  PackedBatch packed;
  packed.layout = packed_batch_layout(batch.size(), config_.gamma, batch.context_offsets[batch.size()], width_,
                                      dims_.hidden_size, given_bf16 || context == ContextUpload::Bf16);
  const long bytes = packed.layout.bytes;
  CUDA_CHECK(cudaEventSynchronize(uploaded_));  // the previous batch has left the staging buffer
  if (staging_.size() < size_t(bytes)) staging_.resize(bytes);
  pack_train_batch(batch, packed, staging_.data());
  ensure(batch_, bytes);
  CUDA_CHECK(cudaMemcpyAsync(batch_.data(), staging_.data(), bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(uploaded_, stream_));
  bind(packed, batch_.data());
}

void CudaDrafterLoss::bind(const PackedBatch& batch, unsigned char* device) {
  const PackedBatchLayout& layout = batch.layout;
  DSPARK_CHECK(layout.anchors >= 1 && layout.gamma == config_.gamma && layout.tap_width == width_ &&
                   layout.hidden_size == dims_.hidden_size && batch.masks.size() == size_t(layout.rows()),
               "CUDA loss: a packed batch of ", layout.anchors, " anchors, gamma ", layout.gamma, ", tap width ",
               layout.tap_width, " and hidden size ", layout.hidden_size, " for a drafter of gamma ", config_.gamma,
               ", tap width ", width_, " and hidden size ", dims_.hidden_size);
  bound_ = batch;
  bound_.host = nullptr;
  device_batch_ = device;
}

void CudaDrafterLoss::gemm_in_out(float* out, const float* x, const float* weight, int rows, int in, int out_features,
                                  float beta) {
  cuda::gemm(out, out_features, x, in, false, weight, out_features, false, rows, out_features, in, beta, false,
             precision_.math, stream_);
}

// dx [rows, in] (= or +=) dout [rows, out] @ weight^T, weight [in, out].
void CudaDrafterLoss::gemm_backward_input(float* dx, const float* dout, const float* weight, int rows, int in,
                                          int out_features, float beta) {
  cuda::gemm(dx, in, dout, out_features, false, weight, out_features, true, rows, in, out_features, beta, false,
             precision_.math, stream_);
}

// dweight [in, out] += x [rows, in]^T @ dout [rows, out].
void CudaDrafterLoss::gemm_backward_weight(float* dweight, const float* x, const float* dout, int rows, int in,
                                           int out_features) {
  cuda::gemm(dweight, out_features, x, in, true, dout, out_features, false, in, out_features, rows, 1.0f, false,
             precision_.math, stream_);
}

void CudaDrafterLoss::launch(const LossWeights& weights, bool with_gradients) {
  DSPARK_CHECK(device_batch_ != nullptr, "CUDA loss: no batch uploaded");
  const int A = bound_.layout.anchors, gamma = config_.gamma, R = A * gamma;
  // Position weights w_k·mask / Σ w·mask, exactly as drafter_loss computes them.
  CUDA_CHECK(cudaEventSynchronize(weights_copied_));
  if (weights_staging_.size() < size_t(R)) weights_staging_.resize(R);
  float* position_weights = weights_staging_.data();
  double total_weight = 0.0;
  for (int row = 0; row < R; ++row) {
    const float mask = bound_.masks[row];
    position_weights[row] =
        mask > 0.0f ? static_cast<float>(std::exp(-double(row / A) / weights.gamma_decay)) * mask : 0.0f;
    total_weight += position_weights[row];
  }
  const double normalizer = total_weight > 0.0 ? 1.0 / total_weight : 0.0;
  for (int row = 0; row < R; ++row) position_weights[row] = static_cast<float>(position_weights[row] * normalizer);
  CUDA_CHECK(cudaMemcpyAsync(device_batch_ + bound_.layout.weights, position_weights, size_t(R) * 4,
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(weights_copied_, stream_));

  const Weights p = resolve(parameters_.data());
  forward(p);
  const cuda::DrafterLossWeights loss_weights{weights.ce, weights.l1, weights.bce};
  const int V = dims_.vocab_size;
  const bool backward_wanted = with_gradients && bound_.positions > 0;
  const float* row_weights = reinterpret_cast<const float*>(device_batch_ + bound_.layout.weights);
  float* dlogits = backward_wanted ? ensure(dlogits_, size_t(R) * V) : nullptr;
  bf16* dlogits_bf16 = backward_wanted && head_.bf16() ? ensure(dlogits_bf16_, size_t(R) * V) : nullptr;
  float* dconfidence = backward_wanted ? ensure(dconfidence_, R) : nullptr;
  cuda::drafter_loss_rows(ensure(row_terms_, size_t(R) * cuda::kRowTerms), dlogits, dlogits_bf16, dconfidence,
                          logits_.data(), target_logits_.data(),
                          reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.targets), row_weights,
                          confidence_.data(), R, V, loss_weights, backward_wanted, stream_);
  cuda::drafter_loss_terms(terms_.data(), row_terms_.data(), row_weights, confidence_.data(), A, gamma, loss_weights,
                           stream_);
  if (backward_wanted) backward(p, resolve(gradients_.data()));
}

LossTerms CudaDrafterLoss::terms_from(const double* values) {
  LossTerms terms;
  terms.loss = values[0];
  terms.ce = values[1];
  terms.l1 = values[2];
  terms.bce = values[3];
  terms.tau_estimate = values[4];
  terms.positions = std::lround(values[5]);
  return terms;
}

LossTerms CudaDrafterLoss::compute(const LossWeights& weights, bool with_gradients) {
  launch(weights, with_gradients);
  double values[cuda::kLossTerms];
  CUDA_CHECK(cudaMemcpyAsync(values, terms_.data(), sizeof values, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return terms_from(values);
}

// ------------------------------------------------------------------ forward

void CudaDrafterLoss::forward(const Weights& p) {
  const DrafterConfig& c = config_;
  const int A = bound_.layout.anchors, gamma = c.gamma, R = A * gamma, C = bound_.layout.context_rows, d = c.d_draft,
            F = inner_;
  const int H = dims_.hidden_size, V = dims_.vocab_size, r = c.markov_rank, W = width_;
  const float eps = dims_.eps;
  cudaStream_t s = stream_;
  const int32_t* offsets = reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.offsets);

  // Context (Eq 2): Hc = rms(hctx @ W_c, ctx_norm), every anchor's rows at once.
  const float* context = nullptr;
  if (C > 0) {
    if (bound_.layout.context_bf16) {
      float* converted = ensure(context_f32_, size_t(C) * W);
      cuda::convert_to_f32(converted, reinterpret_cast<const bf16*>(device_batch_ + bound_.layout.context), long(C) * W,
                           s);
      context = converted;
    } else {
      context = reinterpret_cast<const float*>(device_batch_ + bound_.layout.context);
    }
    gemm_in_out(ensure(context_projected_, size_t(C) * d), context, p.W_c, C, W, d, 0.0f);
    cuda::rmsnorm_forward(ensure(context_hidden_, size_t(C) * d), context_projected_.data(), p.ctx_norm, C, d, eps, s);
  }

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0]; row k = mask_emb[k-1] + block_pos[k].
  float* anchor_embeddings = ensure(anchor_embeddings_, size_t(A) * H);
  const int32_t* anchors = reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.anchor_ids);
  if (head_.bf16())
    cuda::embedding_forward(anchor_embeddings, static_cast<const bf16*>(head_.embedding()), anchors, A, H, s);
  else
    cuda::embedding_forward(anchor_embeddings, static_cast<const float*>(head_.embedding()), anchors, A, H, s);
  gemm_in_out(ensure(token_, size_t(A) * d), anchor_embeddings, p.tok_proj, A, H, d, 0.0f);
  ensure(block_, size_t(R) * d);
  for (LayerActivations& layer : layers_) ensure(layer.input, size_t(R) * d);
  cuda::block_rows_forward(layers_[0].input.data(), token_.data(), p.mask_emb, p.block_pos, A, gamma, d, s);

  // Layers (Eq 3).
  const cuda::TrainAttentionBatch attention_batch{offsets, A, gamma, c.num_heads, head_dim_};
  for (int l = 0; l < c.num_layers; ++l) {
    LayerActivations& layer = layers_[l];
    const Weights::Layer& w = p.layers[l];
    float* input = layer.input.data();
    float* normed = ensure(layer.normed, size_t(R) * d);
    cuda::rmsnorm_forward(normed, input, w.attn_norm, R, d, eps, s);
    gemm_in_out(ensure(layer.q, size_t(R) * d), normed, w.q, R, d, d, 0.0f);
    gemm_in_out(ensure(layer.k, size_t(R) * d), normed, w.k, R, d, d, 0.0f);
    gemm_in_out(ensure(layer.v, size_t(R) * d), normed, w.v, R, d, d, 0.0f);
    float *context_k = nullptr, *context_v = nullptr;
    if (C > 0) {
      float* context_normed = ensure(context_normed_, size_t(C) * d);
      cuda::rmsnorm_forward(context_normed, context_hidden_.data(), w.attn_norm, C, d, eps, s);
      context_k = ensure(layer.context_k, size_t(C) * d);
      context_v = ensure(layer.context_v, size_t(C) * d);
      gemm_in_out(context_k, context_normed, w.k, C, d, d, 0.0f);
      gemm_in_out(context_v, context_normed, w.v, C, d, d, 0.0f);
    }
    float* attention = ensure(layer.attention, size_t(R) * d);
    cuda::bidirectional_attention_forward(attention, ensure(layer.lse, size_t(R) * c.num_heads), layer.q.data(),
                                          layer.k.data(), layer.v.data(), context_k, context_v, attention_batch, s);
    // middle = input + attention @ o
    float* middle = ensure(layer.middle, size_t(R) * d);
    CUDA_CHECK(cudaMemcpyAsync(middle, input, size_t(R) * d * 4, cudaMemcpyDeviceToDevice, s));
    gemm_in_out(middle, attention, w.o, R, d, d, 1.0f);
    // next = middle + (gelu_tanh(n2 @ gate) ⊙ (n2 @ up)) @ down, n2 = rms(middle, ff_norm)
    float* ff_normed = ensure(layer.ff_normed, size_t(R) * d);
    cuda::rmsnorm_forward(ff_normed, middle, w.ff_norm, R, d, eps, s);
    float* gate = ensure(layer.gate, size_t(R) * F);
    float* up = ensure(layer.up, size_t(R) * F);
    float* gated = ensure(layer.gated, size_t(R) * F);
    gemm_in_out(gate, ff_normed, w.gate, R, d, F, 0.0f);
    gemm_in_out(up, ff_normed, w.up, R, d, F, 0.0f);
    cuda::gelu_tanh_gate_forward(gated, gate, up, long(R) * F, s);
    float* next = l + 1 < c.num_layers ? layers_[l + 1].input.data() : block_.data();
    CUDA_CHECK(cudaMemcpyAsync(next, middle, size_t(R) * d * 4, cudaMemcpyDeviceToDevice, s));
    gemm_in_out(next, gated, w.down, R, F, d, 1.0f);
  }

  // h = rms(Hd, out_norm); U = (h @ out_proj) through the target's LM head.
  float* hidden = ensure(hidden_, size_t(R) * d);
  cuda::rmsnorm_forward(hidden, block_.data(), p.out_norm, R, d, eps, s);
  float* head_input = ensure(head_input_, size_t(R) * H);
  gemm_in_out(head_input, hidden, p.out_proj, R, d, H, 0.0f);
  float* logits = ensure(logits_, size_t(R) * V);
  float* target_logits = ensure(target_logits_, size_t(R) * V);
  const float* target_rows = reinterpret_cast<const float*>(device_batch_ + bound_.layout.target_rows);
  if (head_.bf16()) {  // logits [R, V] = rows [R, H] @ lm_head [V, H]^T on bf16 operands
    bf16* head_input_bf16 = ensure(head_input_bf16_, size_t(R) * H);
    bf16* target_rows_bf16 = ensure(target_rows_bf16_, size_t(R) * H);
    cuda::convert_to_bf16(head_input_bf16, head_input, long(R) * H, s);
    cuda::convert_to_bf16(target_rows_bf16, target_rows, long(R) * H, s);
    cuda::gemm(logits, V, head_input_bf16, H, false, head_.lm_head(), H, true, R, V, H, 0.0f, true,
               cuda::GemmMath::F32, s);
    cuda::gemm(target_logits, V, target_rows_bf16, H, false, head_.lm_head(), H, true, R, V, H, 0.0f, true,
               cuda::GemmMath::F32, s);
  } else {
    cuda::gemm(logits, V, head_input, H, false, head_.lm_head(), H, true, R, V, H, 0.0f, false, precision_.math, s);
    cuda::gemm(target_logits, V, target_rows, H, false, head_.lm_head(), H, true, R, V, H, 0.0f, false,
               precision_.math, s);
  }

  // Sequential head, teacher forced: e = w1[x_{k-1}]; L += B.
  float* embedded = ensure(embedded_, size_t(R) * r);
  cuda::embedding_forward(embedded, p.markov_w1,
                          reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.previous), R, r, s);
  const long slab = long(A) * r;  // one position's [A, r]
  if (c.seq_head == "markov") {  // B = e @ w2
    gemm_in_out(logits, embedded, p.markov_w2, R, r, V, 1.0f);
  } else if (c.seq_head == "rnn") {  // s_k = tanh(s_{k-1} @ wH + e_k + bH); B = s @ wO
    float* state = ensure(state_, size_t(R) * r);
    for (int k = 0; k < gamma; ++k) {
      float* current = state + k * slab;
      if (k > 0) gemm_in_out(current, current - slab, p.rnn_wH, A, r, r, 0.0f);
      cuda::rnn_state_forward(current, embedded + k * slab, p.rnn_bH, A, r, k == 0, s);
    }
    gemm_in_out(logits, state, p.rnn_wO, R, r, V, 1.0f);
  } else {  // gru: [g, c, o] = [s_{k-1}; e; h] @ wJ + bJ; s = σ(g) s_{k-1} + (1 - σ(g)) tanh(c); B = tanh(o) @ w2
    const int z_width = 2 * r + d;
    float* state = ensure(state_, size_t(R) * r);
    float* z = ensure(gru_input_, size_t(R) * z_width);
    float* gates = ensure(gru_gates_, size_t(R) * 3 * r);
    float* output = ensure(gru_output_, size_t(R) * r);
    for (int k = 0; k < gamma; ++k) {
      const long first = long(k) * A;
      float* z_k = z + first * z_width;
      cuda::gru_input_forward(z_k, k > 0 ? state + (k - 1) * slab : nullptr, embedded + k * slab,
                              hidden + first * d, A, r, d, s);
      gemm_in_out(gates + first * 3 * r, z_k, p.gru_wJ, A, z_width, 3 * r, 0.0f);
      cuda::gru_update_forward(gates + first * 3 * r, state + k * slab, output + k * slab, p.gru_bJ, z_k, A, r,
                               z_width, s);
    }
    gemm_in_out(logits, output, p.markov_w2, R, r, V, 1.0f);
  }

  // Confidence (Eq 7): c = σ([h; e] @ conf.w + conf.b); no STS temperature in training.
  cuda::confidence_forward(ensure(confidence_, R), hidden, embedded, p.conf_w, p.conf_b, R, d, r, s);
}

// ------------------------------------------------------------------ backward

void CudaDrafterLoss::backward(const Weights& p, const Weights& g) {
  const DrafterConfig& c = config_;
  const int A = bound_.layout.anchors, gamma = c.gamma, R = A * gamma, C = bound_.layout.context_rows, d = c.d_draft,
            F = inner_;
  const int H = dims_.hidden_size, V = dims_.vocab_size, r = c.markov_rank, W = width_;
  const float eps = dims_.eps;
  cudaStream_t s = stream_;
  const float* dlogits = dlogits_.data();
  const float* hidden = hidden_.data();
  const float* embedded = embedded_.data();
  // Scratch for the column sums and norms: the largest any call below needs.
  const long scratch_floats =
      std::max({cuda::rmsnorm_backward_scratch(R, d), cuda::rmsnorm_backward_scratch(C, d),
                cuda::column_sums_scratch(R, std::max(d, 3 * r)), cuda::column_sums_scratch(R, 1)});
  float* work = scratch(scratch_floats);

  // Confidence: logit = [h; e] @ conf.w + conf.b. Writes the first dh and de.
  const float* dconfidence = dconfidence_.data();
  float* dhidden = ensure(dhidden_, size_t(R) * d);
  float* dembedded = ensure(dembedded_, size_t(R) * r);
  cuda::confidence_backward(dhidden, dembedded, dconfidence, p.conf_w, R, d, r, s);
  cuda::column_sums(g.conf_w, hidden, d, nullptr, 0, dconfidence, R, d, work, s);
  cuda::column_sums(g.conf_w + d, embedded, r, nullptr, 0, dconfidence, R, r, work, s);
  cuda::column_sums(g.conf_b, dconfidence, 1, nullptr, 0, nullptr, R, 1, work, s);

  // Sequential head: dB = dL; the recurrences run backwards through k.
  const long slab = long(A) * r;
  if (c.seq_head == "markov") {
    gemm_backward_input(dembedded, dlogits, p.markov_w2, R, r, V, 1.0f);
    gemm_backward_weight(g.markov_w2, embedded, dlogits, R, r, V);
  } else if (c.seq_head == "rnn") {
    const float* state = state_.data();
    float* dstate = ensure(dstate_, size_t(R) * r);  // dLoss/ds_k, then dLoss/d(pre-activation)
    gemm_backward_input(dstate, dlogits, p.rnn_wO, R, r, V, 0.0f);
    gemm_backward_weight(g.rnn_wO, state, dlogits, R, r, V);
    for (int k = gamma - 1; k >= 0; --k) {
      cuda::rnn_state_backward(dstate + k * slab, dembedded + k * slab, state + k * slab, slab, s);
      if (k > 0) gemm_backward_input(dstate + (k - 1) * slab, dstate + k * slab, p.rnn_wH, A, r, r, 1.0f);
    }
    // wH: s_{k-1} (rows [0, (γ-1)·A)) against the pre-activation gradients of k (rows [A, γ·A)).
    if (gamma > 1) gemm_backward_weight(g.rnn_wH, state, dstate + slab, (gamma - 1) * A, r, r);
    cuda::column_sums(g.rnn_bH, dstate, r, nullptr, 0, nullptr, R, r, work, s);
  } else {
    const int z_width = 2 * r + d;
    const float *z = gru_input_.data(), *gates = gru_gates_.data(), *output = gru_output_.data();
    float* doutput = ensure(dgru_output_, size_t(R) * r);
    gemm_backward_input(doutput, dlogits, p.markov_w2, R, r, V, 0.0f);
    gemm_backward_weight(g.markov_w2, output, dlogits, R, r, V);
    float* dstate = ensure(dstate_, size_t(R) * r);
    CUDA_CHECK(cudaMemsetAsync(dstate, 0, size_t(R) * r * 4, s));
    float* dgates = ensure(dgru_gates_, size_t(R) * 3 * r);
    float* dz = ensure(dz_, size_t(A) * z_width);
    for (int k = gamma - 1; k >= 0; --k) {
      const long first = long(k) * A;
      float* dprevious = k > 0 ? dstate + (k - 1) * slab : nullptr;
      cuda::gru_update_backward(dgates + first * 3 * r, dprevious, dstate + k * slab, doutput + k * slab,
                                gates + first * 3 * r, output + k * slab, z + first * z_width, A, r, z_width, s);
      // dz = dgates_k @ wJ^T, then back to [s_{k-1}; e; h].
      gemm_backward_input(dz, dgates + first * 3 * r, p.gru_wJ, A, z_width, 3 * r, 0.0f);
      cuda::gru_input_backward(dprevious, dembedded + k * slab, dhidden + first * d, dz, A, r, d, s);
    }
    gemm_backward_weight(g.gru_wJ, z, dgates, R, z_width, 3 * r);
    cuda::column_sums(g.gru_bJ, dgates, 3 * r, nullptr, 0, nullptr, R, 3 * r, work, s);
  }
  // e = w1[x_{k-1}]
  cuda::embedding_backward(
      g.markov_w1, dembedded, reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.group_ids),
      reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.group_starts),
      reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.sorted_rows), bound_.groups, r, s);

  // U = (h @ out_proj) @ lm_head^T: the LM head is the target's, frozen.
  float* dhead_input = ensure(dhead_input_, size_t(R) * H);
  if (head_.bf16())
    cuda::gemm(dhead_input, H, dlogits_bf16_.data(), V, false, head_.lm_head(), H, false, R, H, V, 0.0f, true,
               cuda::GemmMath::F32, s);
  else
    cuda::gemm(dhead_input, H, dlogits, V, false, head_.lm_head(), H, false, R, H, V, 0.0f, false, precision_.math,
               s);
  gemm_backward_input(dhidden, dhead_input, p.out_proj, R, d, H, 1.0f);
  gemm_backward_weight(g.out_proj, hidden, dhead_input, R, d, H);
  // h = rms(block, out_norm)
  float* dblock = ensure(dblock_, size_t(R) * d);
  CUDA_CHECK(cudaMemsetAsync(dblock, 0, size_t(R) * d * 4, s));
  cuda::rmsnorm_backward(dblock, g.out_norm, dhidden, block_.data(), p.out_norm, R, d, eps, work, s);

  // Layers, last to first: dblock is dLoss/d(the residual stream) after the layer, then before it.
  const int32_t* offsets = reinterpret_cast<const int32_t*>(device_batch_ + bound_.layout.offsets);
  const cuda::TrainAttentionBatch attention_batch{offsets, A, gamma, c.num_heads, head_dim_};
  float* dgated = ensure(dgated_, size_t(R) * F);
  float* dgate = ensure(dgate_, size_t(R) * F);
  float* dup = ensure(dup_, size_t(R) * F);
  float* dnormed = ensure(dnormed_, size_t(R) * d);
  float* dattention = ensure(dattention_, size_t(R) * d);
  float* dq = ensure(dq_, size_t(R) * d);
  float* dk = ensure(dk_, size_t(R) * d);
  float* dv = ensure(dv_, size_t(R) * d);
  float *dcontext_k = nullptr, *dcontext_v = nullptr, *dcontext_normed = nullptr, *dcontext_hidden = nullptr;
  if (C > 0) {
    dcontext_k = ensure(dcontext_k_, size_t(C) * d);
    dcontext_v = ensure(dcontext_v_, size_t(C) * d);
    dcontext_normed = ensure(dcontext_normed_, size_t(C) * d);
    dcontext_hidden = ensure(dcontext_hidden_, size_t(C) * d);
    CUDA_CHECK(cudaMemsetAsync(dcontext_hidden, 0, size_t(C) * d * 4, s));
  }
  for (int l = c.num_layers - 1; l >= 0; --l) {
    const LayerActivations& layer = layers_[l];
    const Weights::Layer& w = p.layers[l];
    const Weights::Layer& dw = g.layers[l];

    // MLP: block += (gelu_tanh(n2 @ gate) ⊙ (n2 @ up)) @ down, n2 = rms(middle, ff_norm).
    gemm_backward_input(dgated, dblock, w.down, R, F, d, 0.0f);
    gemm_backward_weight(dw.down, layer.gated.data(), dblock, R, F, d);
    CUDA_CHECK(cudaMemsetAsync(dgate, 0, size_t(R) * F * 4, s));
    CUDA_CHECK(cudaMemsetAsync(dup, 0, size_t(R) * F * 4, s));
    cuda::gelu_tanh_gate_backward(dgate, dup, dgated, layer.gate.data(), layer.up.data(), long(R) * F, s);
    gemm_backward_input(dnormed, dgate, w.gate, R, d, F, 0.0f);
    gemm_backward_input(dnormed, dup, w.up, R, d, F, 1.0f);
    gemm_backward_weight(dw.gate, layer.ff_normed.data(), dgate, R, d, F);
    gemm_backward_weight(dw.up, layer.ff_normed.data(), dup, R, d, F);
    cuda::rmsnorm_backward(dblock, dw.ff_norm, dnormed, layer.middle.data(), w.ff_norm, R, d, eps, work, s);

    // Attention: block += attention @ o, keys / values [context ; block] per anchor.
    gemm_backward_input(dattention, dblock, w.o, R, d, d, 0.0f);
    gemm_backward_weight(dw.o, layer.attention.data(), dblock, R, d, d);
    CUDA_CHECK(cudaMemsetAsync(dq, 0, size_t(R) * d * 4, s));
    CUDA_CHECK(cudaMemsetAsync(dk, 0, size_t(R) * d * 4, s));
    CUDA_CHECK(cudaMemsetAsync(dv, 0, size_t(R) * d * 4, s));
    if (C > 0) {
      CUDA_CHECK(cudaMemsetAsync(dcontext_k, 0, size_t(C) * d * 4, s));
      CUDA_CHECK(cudaMemsetAsync(dcontext_v, 0, size_t(C) * d * 4, s));
    }
    cuda::bidirectional_attention_backward(dq, dk, dv, dcontext_k, dcontext_v, dattention, layer.attention.data(),
                                           layer.lse.data(), layer.q.data(), layer.k.data(), layer.v.data(),
                                           C > 0 ? layer.context_k.data() : nullptr,
                                           C > 0 ? layer.context_v.data() : nullptr, attention_batch, s);
    const float* normed = layer.normed.data();
    gemm_backward_input(dnormed, dq, w.q, R, d, d, 0.0f);
    gemm_backward_input(dnormed, dk, w.k, R, d, d, 1.0f);
    gemm_backward_input(dnormed, dv, w.v, R, d, d, 1.0f);
    gemm_backward_weight(dw.q, normed, dq, R, d, d);
    gemm_backward_weight(dw.k, normed, dk, R, d, d);
    gemm_backward_weight(dw.v, normed, dv, R, d, d);
    cuda::rmsnorm_backward(dblock, dw.attn_norm, dnormed, layer.input.data(), w.attn_norm, R, d, eps, work, s);

    // The context's keys / values: rms(Hc, attn_norm) @ k | v (the normed rows recomputed, not kept).
    if (C > 0) {
      float* context_normed = ensure(context_normed_, size_t(C) * d);
      cuda::rmsnorm_forward(context_normed, context_hidden_.data(), w.attn_norm, C, d, eps, s);
      gemm_backward_input(dcontext_normed, dcontext_k, w.k, C, d, d, 0.0f);
      gemm_backward_input(dcontext_normed, dcontext_v, w.v, C, d, d, 1.0f);
      gemm_backward_weight(dw.k, context_normed, dcontext_k, C, d, d);
      gemm_backward_weight(dw.v, context_normed, dcontext_v, C, d, d);
      cuda::rmsnorm_backward(dcontext_hidden, dw.attn_norm, dcontext_normed, context_hidden_.data(), w.attn_norm, C, d,
                             eps, work, s);
    }
  }

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0] (dblock's first A rows); row k = mask_emb[k-1] + block_pos[k].
  cuda::block_rows_backward(g.mask_emb, g.block_pos, dblock, A, gamma, d, s);
  gemm_backward_weight(g.tok_proj, anchor_embeddings_.data(), dblock, A, H, d);

  // Context: Hc = rms(hctx @ W_c, ctx_norm). The tapped rows themselves are data.
  if (C > 0) {
    float* dprojected = dcontext_normed;  // free again
    CUDA_CHECK(cudaMemsetAsync(dprojected, 0, size_t(C) * d * 4, s));
    cuda::rmsnorm_backward(dprojected, g.ctx_norm, dcontext_hidden, context_projected_.data(), p.ctx_norm, C, d, eps,
                           work, s);
    const float* context = bound_.layout.context_bf16
                               ? context_f32_.data()
                               : reinterpret_cast<const float*>(device_batch_ + bound_.layout.context);
    gemm_backward_weight(g.W_c, context, dprojected, C, W, d);
  }
}

}  // namespace dspark
