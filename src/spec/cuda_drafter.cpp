#include "spec/cuda_drafter.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/sampling.h"
#include "spec/quantized_columns.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr int kMaxDraftBatch = 64;  // rows per step (and per graph bucket); more requests run as several steps
constexpr int kExtendChunk = 256;   // context rows projected per pass of the extension
// Staged rows (all contexts) past which a draft projects every context's, not only its requests'.
constexpr long kMaxStagedBytes = 256L << 20;
// The drafter's products let every kernel compete, the tensor cores too (matmul.h).
constexpr auto kAnyKernel = cuda::FewRowKernels::Any;

std::string layer_name(int layer, const char* tensor) { return "bb." + std::to_string(layer) + "." + tensor; }

long align_up(long value, long alignment) { return (value + alignment - 1) / alignment * alignment; }

template <class Key>
void destroy_graphs(std::map<Key, cudaGraphExec_t>& graphs) {
  for (auto& [key, graph] : graphs) cudaGraphExecDestroy(graph);
  graphs.clear();
}

DeviceBuffer<float> upload_f32(const float* values, size_t count) {
  DeviceBuffer<float> buffer(count);
  if (count) CUDA_CHECK(cudaMemcpy(buffer.data(), values, count * sizeof(float), cudaMemcpyHostToDevice));
  return buffer;
}

DeviceBuffer<bf16> upload_bf16(const float* values, size_t count) {
  std::vector<uint16_t> bits(count);
  convert_to_bf16(values, bits.data(), count);
  DeviceBuffer<bf16> buffer(count);
  if (count) CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), count * 2, cudaMemcpyHostToDevice));
  return buffer;
}

// A host vector's bytes as a device buffer of Device (an element of the same size).
template <class Device, class Host>
DeviceBuffer<Device> upload_as(const std::vector<Host>& values) {
  static_assert(sizeof(Device) == sizeof(Host));
  DeviceBuffer<Device> buffer(values.size());
  if (!values.empty())
    CUDA_CHECK(cudaMemcpy(buffer.data(), values.data(), values.size() * sizeof(Host), cudaMemcpyHostToDevice));
  return buffer;
}

// Matrices stored [in, out] (the drafter's layout), transposed to [out, in]
// (the GEMMs' nn.Linear layout) and stacked along out, as bf16.
DeviceBuffer<bf16> upload_transposed_bf16(const std::vector<const float*>& matrices, int in, int out) {
  constexpr int kTile = 64;  // transposed tile by tile: W_c at Qwen3-8B shape is 16384 x 1024
  std::vector<uint16_t> bits(matrices.size() * size_t(in) * out);
  for (size_t m = 0; m < matrices.size(); ++m)
    for (int i0 = 0; i0 < in; i0 += kTile)
      for (int o0 = 0; o0 < out; o0 += kTile)
        for (int i = i0; i < std::min(in, i0 + kTile); ++i)
          for (int o = o0; o < std::min(out, o0 + kTile); ++o)
            bits[(m * out + o) * size_t(in) + i] = f32_to_bf16(matrices[m][size_t(i) * out + o]);
  DeviceBuffer<bf16> buffer(bits.size());
  CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return buffer;
}

// Every layer's k then v, [in, out] each, with input feature i scaled by the
// layer's attn_norm[i], uploaded [L * 2d, d] (CudaDrafter::context_keys_values_).
DeviceBuffer<bf16> upload_context_keys_values(const Drafter& drafter) {
  const int d = drafter.config.d_draft;
  std::vector<std::vector<float>> folded;
  for (int l = 0; l < drafter.config.num_layers; ++l) {
    const float* norm = drafter[layer_name(l, "attn_norm")];
    for (const char* name : {"k", "v"}) {
      const float* weight = drafter[layer_name(l, name)];
      std::vector<float>& scaled = folded.emplace_back(size_t(d) * d);
      for (int i = 0; i < d; ++i)
        for (int o = 0; o < d; ++o) scaled[size_t(i) * d + o] = weight[size_t(i) * d + o] * norm[i];
    }
  }
  std::vector<const float*> matrices;
  for (const std::vector<float>& matrix : folded) matrices.push_back(matrix.data());
  return upload_transposed_bf16(matrices, d, d);
}

}  // namespace

CudaDrafter::StepLayout::StepLayout(int rows, int gamma, int layers) {
  long at = 0;
  auto take = [&](long bytes, long alignment) {
    at = align_up(at, alignment);
    const long begin = at;
    at += bytes;
    return begin;
  };
  keys = take(long(layers) * rows * 8, 8);
  values = take(long(layers) * rows * 8, 8);
  control = take(sizeof(cuda::DraftControl), 8);
  sampling = take(sizeof(cuda::DeviceSamplingParams), 8);
  anchors = take(long(rows) * 4, 4);
  lengths = take(long(rows) * 4, 4);
  limits = take(long(rows) * 4, 4);
  uniforms = take(long(gamma) * rows * 4, 4);
  bytes = align_up(at, 16);
}

CudaDrafter::CudaDrafter(const Drafter& drafter, const CudaTargetHead& head)
    : config_(drafter.config), dims_(drafter.dims), head_(head) {
  const DrafterConfig& c = config_;
  const int d = c.d_draft, H = dims_.hidden_size, V = dims_.vocab_size, r = c.markov_rank;
  DSPARK_CHECK(head.embedding && head.lm_head, "the CUDA drafter needs the target's embedding and LM head on the GPU");
  DSPARK_CHECK(c.gamma >= 1 && c.gamma <= cuda::kMaxDraftGamma, "the CUDA drafter drafts at most ",
               cuda::kMaxDraftGamma, " tokens per round; this drafter's gamma is ", c.gamma);
  head_dim_ = d / c.num_heads;
  DSPARK_CHECK(head_dim_ % 8 == 0 && head_dim_ <= 256,
               "the CUDA drafter needs d / heads to be a multiple of 8, at most 256; ", "this drafter has ", d, " / ",
               c.num_heads, " = ", head_dim_);
  kind_ = c.seq_head == "rnn"   ? cuda::SequentialHeadKind::Rnn
          : c.seq_head == "gru" ? cuda::SequentialHeadKind::Gru
                                : cuda::SequentialHeadKind::Markov;
  width_ = static_cast<int>(c.tap_layers.size()) * H;
  inner_ = c.ff_mult * d;
  use_graphs_ = !(std::getenv("DSPARK_DRAFT_GRAPHS") && std::string(std::getenv("DSPARK_DRAFT_GRAPHS")) == "0") &&
                !profiler_.enabled();
  multiprocessors_ = cuda::multiprocessor_count();
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

  for (int l = 0; l < c.num_layers; ++l) {
    Layer layer;
    layer.attention_norm = upload_f32(drafter[layer_name(l, "attn_norm")], d);
    layer.ff_norm = upload_f32(drafter[layer_name(l, "ff_norm")], d);
    layer.kvq = upload_transposed_bf16(
        {drafter[layer_name(l, "k")], drafter[layer_name(l, "v")], drafter[layer_name(l, "q")]}, d, d);
    layer.o = upload_transposed_bf16({drafter[layer_name(l, "o")]}, d, d);
    layer.gate_up = upload_transposed_bf16({drafter[layer_name(l, "gate")], drafter[layer_name(l, "up")]}, d, inner_);
    layer.down = upload_transposed_bf16({drafter[layer_name(l, "down")]}, inner_, d);
    layers_.push_back(std::move(layer));
  }
  context_projection_ = upload_transposed_bf16({drafter["W_c"]}, width_, d);
  context_keys_values_ = upload_context_keys_values(drafter);
  ones_ = upload_f32(std::vector<float>(d, 1.0f).data(), d);
  token_projection_ = upload_transposed_bf16({drafter["tok_proj"]}, H, d);
  out_projection_ = upload_transposed_bf16({drafter["out_proj"]}, d, H);
  context_norm_ = upload_f32(drafter["ctx_norm"], d);
  out_norm_ = upload_f32(drafter["out_norm"], d);
  mask_embedding_ = upload_f32(drafter["mask_emb"], size_t(c.gamma - 1) * d);
  block_position_ = upload_f32(drafter["block_pos"], size_t(c.gamma) * d);
  head_embedding_ = upload_bf16(drafter["markov.w1"], size_t(V) * r);
  confidence_weight_ = upload_f32(drafter["conf.w"], size_t(d) + r);
  confidence_bias_ = upload_f32(drafter["conf.b"], 1);
  if (kind_ == cuda::SequentialHeadKind::Markov) {
    // The confidence logit's part from e_k = w1[x_{k-1}], for every token, from w1 as uploaded (bf16).
    const float* w1 = drafter["markov.w1"];
    const float* token_weight = drafter["conf.w"] + d;
    std::vector<float> token_confidence(V);
    for (int v = 0; v < V; ++v) {
      float sum = 0.0f;
      for (int i = 0; i < r; ++i) sum += bf16_to_f32(f32_to_bf16(w1[size_t(v) * r + i])) * token_weight[i];
      token_confidence[v] = sum;
    }
    token_confidence_ = upload_f32(token_confidence.data(), V);
  }
  if (kind_ == cuda::SequentialHeadKind::Rnn) {
    head_out_ = upload_bf16(drafter["rnn.wO"], size_t(r) * V);
    recurrent_ = upload_f32(drafter["rnn.wH"], size_t(r) * r);
    recurrent_bias_ = upload_f32(drafter["rnn.bH"], r);
  } else {
    head_out_ = upload_bf16(drafter["markov.w2"], size_t(r) * V);
    if (kind_ == cuda::SequentialHeadKind::Markov && r % 8 == 0) {
      const QuantizedColumns quantized = quantize_columns(drafter["markov.w2"], r, V);
      quantized_stride_ = quantized.stride;
      quantized_values_ = upload_as<uint8_t>(quantized.values);
      quantized_scales_ = upload_f32(quantized.scales.data(), V);
      quantized_bounds_ = upload_f32(quantized.bounds.data(), V);
      quantized_exact_ = upload_as<bf16>(quantized.exact);
    }
    if (kind_ == cuda::SequentialHeadKind::Gru) {
      recurrent_ = upload_f32(drafter["gru.wJ"], size_t(2 * r + d) * 3 * r);
      recurrent_bias_ = upload_f32(drafter["gru.bJ"], size_t(3) * r);
    }
  }
  std::vector<float> temperatures(c.gamma, 1.0f);
  if (c.sts && !c.sts->temperatures.empty()) {
    DSPARK_CHECK(c.sts->temperatures.size() >= size_t(c.gamma), "config.sts.temperatures has ",
                 c.sts->temperatures.size(), " entries for gamma ", c.gamma);
    std::copy_n(c.sts->temperatures.begin(), c.gamma, temperatures.begin());
  }
  temperatures_ = upload_f32(temperatures.data(), temperatures.size());

  // The extension pass: destinations [kExtendChunk, L], sources [kExtendChunk], then the tapped rows
  // [kExtendChunk, m*H] bf16.
  extend_sources_offset_ = long(c.num_layers) * kExtendChunk * 8;
  extend_taps_offset_ = align_up(extend_sources_offset_ + kExtendChunk * long(sizeof(cuda::TapRowSource)),
                                 256);  // cuBLASLt wants 256-byte operands
  const long extend_bytes = extend_taps_offset_ + long(kExtendChunk) * width_ * 2;
  extend_staging_.resize(extend_bytes);
  extend_metadata_.resize(extend_bytes);
  extend_projected_.resize(size_t(kExtendChunk) * d);
  extend_hidden_.resize(size_t(kExtendChunk) * d);
  extend_normed_.resize(size_t(kExtendChunk) * d);
  extend_kv_.resize(size_t(kExtendChunk) * c.num_layers * 2 * d);
  CUDA_CHECK(cudaEventCreateWithFlags(&device_staged_written_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&device_staged_read_, cudaEventDisableTiming));
  ensure_rows(1);
  use_quantized_lm_head(true);
}

CudaDrafter::~CudaDrafter() {
  enable_step_timing(false);
  destroy_graphs(graphs_);
  destroy_graphs(extend_graphs_);
  if (device_staged_.size()) cudaStreamSynchronize(head_.stream);  // conversions into device_staged_
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (device_staged_written_) cudaEventDestroy(device_staged_written_);
  if (device_staged_read_) cudaEventDestroy(device_staged_read_);
}

void CudaDrafter::enable_step_timing(bool on) {
  if (on && !step_start_) {
    CUDA_CHECK(cudaEventCreate(&step_start_));
    CUDA_CHECK(cudaEventCreate(&step_stop_));
  } else if (!on && step_start_) {
    cudaEventDestroy(step_start_);
    cudaEventDestroy(step_stop_);
    step_start_ = step_stop_ = nullptr;
  }
}

void CudaDrafter::use_one_launch_head(bool on) {
  if (on == one_launch_head_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  destroy_graphs(graphs_);  // captured the other way
  one_launch_head_ = on;
}

void CudaDrafter::use_quantized_head(bool on) {
  if (on == quantized_head_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  destroy_graphs(graphs_);  // captured the other way
  quantized_head_ = on;
}

void CudaDrafter::use_quantized_lm_head(bool on) {
  if (on == quantized_lm_head_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  destroy_graphs(graphs_);
  quantized_lm_head_ = on;
  const int H = dims_.hidden_size, V = dims_.vocab_size, d = config_.d_draft;
  if (!on || lm_head_values_.size() > 0 || quantized_stride_ == 0 || H % 32 != 0 || H > cuda::kMaxIntervalHidden ||
      d % 32 != 0 || !cuda::lm_head_projection_reach_supported(d, H) || config_.gamma > cuda::kQuantizedActivationRows)
    return;  // built already, or the tokens-only head or the kernels do not apply: the full product stays
  // M = lm_head @ out_proj [V, d], in double, then at 8 bits (kernels/cuda/quantized_product.h); `through` outlives
  // the synchronisation at the end.
  cuda::DeviceBuffer<float> through(size_t(V) * d);
  cuda::lm_head_through_projection_forward(through.data(), head_.lm_head, out_projection_.data(), V, H, d, stream_);
  lm_head_values_.resize(size_t(V) * d);
  lm_head_scales_.resize(V), lm_head_bounds_.resize(V), lm_head_norms_.resize(V);
  cuda::quantize_rows_forward(lm_head_quantized(), through.data(), V, d, cuda::kQuantizedProductSlack, stream_);
  lm_head_largest_norm_.resize(1);
  cuda::largest_row_norm_forward(lm_head_largest_norm_.data(), head_.lm_head, V, H, stream_);
  reach_sums_.resize(2 * cuda::kQuantizedActivationRows), reach_finished_.resize(1);
  CUDA_CHECK(cudaMemsetAsync(reach_sums_.data(), 0, reach_sums_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(reach_finished_.data(), 0, reach_finished_.bytes(), stream_));
  activation_values_.resize(size_t(2) * cuda::kQuantizedActivationRows * d);
  activation_scales_.resize(cuda::kQuantizedActivationRows);
  activation_norms_.resize(3 * cuda::kQuantizedActivationRows);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

cuda::QuantizedRows CudaDrafter::lm_head_quantized() const {
  return {lm_head_values_.data(), lm_head_scales_.data(), lm_head_bounds_.data(), lm_head_norms_.data()};
}

float CudaDrafter::last_step_milliseconds() const {
  DSPARK_CHECK(step_start_, "step timing is off");
  float milliseconds = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&milliseconds, step_start_, step_stop_));
  return milliseconds;
}

// ---------------------------------------------------------------- contexts

CudaDrafter::Context& CudaDrafter::context(int id) {
  auto found = contexts_.find(id);
  DSPARK_CHECK(found != contexts_.end(), "unknown draft context ", id);
  return found->second;
}

const CudaDrafter::Context& CudaDrafter::context(int id) const {
  auto found = contexts_.find(id);
  DSPARK_CHECK(found != contexts_.end(), "unknown draft context ", id);
  return found->second;
}

int CudaDrafter::create_context() {
  contexts_.emplace(next_context_, Context{});
  peak_contexts_ = std::max(peak_contexts_, contexts_.size());
  return next_context_++;
}

void CudaDrafter::release_context(int id) {
  Context& released = context(id);
  wait_for_extend_staging();  // an extension pass in flight may still write into it
  keep_spare_storage(std::move(released.storage));
  contexts_.erase(id);
  if (contexts_.empty()) {  // rows still held (of ended requests) are no one's: do not read them later
    pending_sources_.clear();
    pending_serial_ = -1;
    device_staged_rows_ = 0;
  }
}

int CudaDrafter::context_length(int id) const {
  const Context& c = context(id);
  return c.length + c.staged_rows();
}

void CudaDrafter::extend_context(int id, const float* tapped_rows, int count) {
  DSPARK_CHECK(count >= 0, "cannot extend a draft context by ", count, " rows");
  Context& c = context(id);
  const size_t first = c.staged.size(), values = size_t(count) * width_;
  c.staged.resize(first + values);
  convert_to_bf16(tapped_rows, c.staged.data() + first, values);
  c.staged_sources.insert(c.staged_sources.end(), count, kHostRow);
}

void CudaDrafter::extend_context_from_device(int id, const float* device_rows, int count) {
  DSPARK_CHECK(count >= 0, "cannot extend a draft context by ", count, " rows");
  Context& c = context(id);
  if (count == 0) return;
  DSPARK_CHECK(device_rows, "extending a draft context from device rows needs them");
  ensure_device_staging(device_staged_rows_ + count);
  for (int i = 0; i < count; ++i) {
    c.staged_sources.push_back(device_staged_rows_ + i);
    pending_sources_.push_back(device_rows + long(i) * width_);
  }
  device_staged_rows_ += count;
}

void CudaDrafter::finish_device_rows(long serial, int intact) {
  if (pending_sources_.empty()) return;
  if (pending_serial_ < 0) pending_serial_ = serial;
  // Rows of serial s stay until the forward of serial s + intact + 1; the
  // next forward's serial is at most serial + 1.
  if (intact == 0 || serial + 1 > pending_serial_ + intact) convert_device_rows();
}

void CudaDrafter::convert_device_rows() {
  pending_serial_ = -1;
  // (Rows a pass has read where the forward left them are null: nothing to convert.)
  if (std::all_of(pending_sources_.begin(), pending_sources_.end(), [](const float* row) { return !row; }))
    pending_sources_.clear();
  if (pending_sources_.empty()) return;
  const cudaStream_t producer = head_.stream;
  if (device_staged_read_pending_) {  // the last pass may still be reading the rows about to be overwritten
    CUDA_CHECK(cudaStreamWaitEvent(producer, device_staged_read_, 0));
    device_staged_read_pending_ = false;
  }
  // The rows as runs of consecutive source rows (an undrafted round's rows
  // are one run, in the order the forward left them), a launch per kMaxRuns.
  const int first_pending = device_staged_rows_ - static_cast<int>(pending_sources_.size());
  cuda::GatherRuns runs;
  auto launch = [&] {
    cuda::gather_f32_runs_to_bf16_forward(device_staged_.data(), runs, width_, producer);
    runs.count = 0;
  };
  for (size_t i = 0; i < pending_sources_.size(); ++i) {
    const float* source = pending_sources_[i];
    if (!source) continue;
    const int output_row = first_pending + static_cast<int>(i);
    if (runs.count > 0) {
      const int last = runs.count - 1, length = runs.first_block[runs.count] - runs.first_block[last];
      if (source == runs.sources[last] + long(length) * width_ && output_row == runs.output_row[last] + length) {
        ++runs.first_block[runs.count];
        continue;
      }
      if (runs.count == cuda::GatherRuns::kMaxRuns) launch();
    }
    const int first_block = runs.rows();
    runs.sources[runs.count] = source;
    runs.output_row[runs.count] = output_row;
    runs.first_block[runs.count] = first_block;
    runs.first_block[++runs.count] = first_block + 1;
  }
  launch();
  pending_sources_.clear();
}

void CudaDrafter::ensure_device_staging(int rows) {
  if (size_t(rows) * width_ <= device_staged_.size()) return;
  const size_t capacity = std::max<size_t>({size_t(rows), 2 * device_staged_.size() / width_, size_t(kExtendChunk)});
  cuda::DeviceBuffer<bf16> grown(capacity * width_);
  if (device_staged_rows_ > 0)  // after the conversions that wrote them, on the same stream
    CUDA_CHECK(cudaMemcpyAsync(grown.data(), device_staged_.data(), size_t(device_staged_rows_) * width_ * sizeof(bf16),
                               cudaMemcpyDeviceToDevice, head_.stream));
  // The old area is freed below: nothing may still write (conversions, the copy) or read (a pass) it.
  CUDA_CHECK(cudaStreamSynchronize(head_.stream));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  extend_in_flight_ = false;
  device_staged_read_pending_ = false;
  device_staged_ = std::move(grown);
}

void CudaDrafter::truncate_context(int id, int length) {
  Context& c = context(id);
  DSPARK_CHECK(length >= 0 && length <= c.length + c.staged_rows(), "cannot truncate a draft context of ",
               c.length + c.staged_rows(), " rows to ", length);
  if (length >= c.length) {  // only staged rows go (rows of device_staged_ are left unused until the next pass)
    c.staged_sources.resize(length - c.length);
    const auto host_rows = std::count(c.staged_sources.begin(), c.staged_sources.end(), kHostRow);
    c.staged.resize(size_t(host_rows) * width_);  // host rows are kept in order: the survivors are a prefix
  } else {  // the stored rows past `length` are simply overwritten later
    c.length = length;
    c.staged.clear();
    c.staged_sources.clear();
  }
}

void CudaDrafter::wait_for_extend_staging() {
  if (!extend_in_flight_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  extend_in_flight_ = false;
}

void CudaDrafter::grow_context(Context& c, int rows) {
  if (rows <= c.capacity) return;
  const long row = 2L * config_.d_draft, layer_rows = config_.num_layers * row;
  DeviceBuffer<bf16> storage = take_storage(size_t(std::max({rows, 2 * c.capacity, 64})) * layer_rows);
  const int capacity = static_cast<int>(storage.size() / layer_rows);  // a spare may hold more
  for (int l = 0; l < config_.num_layers && c.length > 0; ++l)
    CUDA_CHECK(cudaMemcpyAsync(storage.data() + l * capacity * row, c.storage.data() + l * c.capacity * row,
                               c.length * row * sizeof(bf16), cudaMemcpyDeviceToDevice, stream_));
  keep_spare_storage(std::exchange(c.storage, std::move(storage)));  // (read by the copies above first)
  c.capacity = capacity;
}

DeviceBuffer<bf16> CudaDrafter::take_storage(size_t count) {
  auto best = spare_storage_.end();
  for (auto spare = spare_storage_.begin(); spare != spare_storage_.end(); ++spare)
    if (spare->size() >= count && (best == spare_storage_.end() || spare->size() < best->size())) best = spare;
  if (best == spare_storage_.end()) return DeviceBuffer<bf16>(count);
  DeviceBuffer<bf16> storage = std::move(*best);
  spare_storage_.erase(best);
  return storage;
}

void CudaDrafter::keep_spare_storage(DeviceBuffer<bf16> storage) {
  if (storage.size() == 0) return;
  spare_storage_.push_back(std::move(storage));
  if (spare_storage_.size() <= peak_contexts_) return;
  auto smallest = std::min_element(spare_storage_.begin(), spare_storage_.end(),
                                   [](const auto& a, const auto& b) { return a.size() < b.size(); });
  spare_storage_.erase(smallest);  // freed: waits for the device, as every free did before
}

void CudaDrafter::flush_contexts() {
  flush_contexts_of({});
  // The pass may read rows where the target's forward left them; draft() waits
  // for it, here the target's stream does, before its next forward may write there.
  CUDA_CHECK(cudaEventRecord(device_staged_read_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(head_.stream, device_staged_read_, 0));
  device_staged_read_pending_ = false;
}

void CudaDrafter::flush_contexts_of(std::span<const CudaDraftRequest> requests) {
  // Only the requests' contexts (all when there are none): a request left
  // undrafted keeps its rows staged until it drafts, unless all contexts'
  // staged rows together outgrow kMaxStagedBytes.
  long staged = 0;
  for (const auto& [id, c] : contexts_) staged += c.staged_rows();
  const bool all = requests.empty() || staged * width_ * long(sizeof(bf16)) > kMaxStagedBytes;
  flushed_ids_.clear();  // sorted, for a lookup per context rather than a scan of the requests
  for (const CudaDraftRequest& request : requests) flushed_ids_.push_back(request.context);
  std::sort(flushed_ids_.begin(), flushed_ids_.end());
  auto flushed = [&](int id) { return all || std::binary_search(flushed_ids_.begin(), flushed_ids_.end(), id); };
  // A device row not yet converted is read where the target's forward left it
  // (its entry in pending_sources_ is then cleared: nothing converts it).
  const int first_pending = device_staged_rows_ - static_cast<int>(pending_sources_.size());
  std::vector<ExtensionRow>& rows = extension_rows_;
  rows.clear();
  bool device_rows = false, staged_rows_read = false;
  for (auto& [id, c] : contexts_) {
    if (c.staged_rows() == 0 || !flushed(id)) continue;
    grow_context(c, c.length + c.staged_rows());
    size_t host_row = 0;
    for (int i = 0; i < c.staged_rows(); ++i) {
      const int32_t source = c.staged_sources[i];
      ExtensionRow row{&c, c.length + i, nullptr, {nullptr, cuda::TapRowKind::Keep}};
      if (source == kHostRow) {
        row.host_taps = c.staged.data() + host_row++ * width_;
      } else if (source >= first_pending) {
        row.device = {std::exchange(pending_sources_[source - first_pending], nullptr), cuda::TapRowKind::F32};
      } else {
        row.device = {device_staged_.data() + long(source) * width_, cuda::TapRowKind::Bf16};
        staged_rows_read = true;
      }
      device_rows |= source != kHostRow;
      rows.push_back(row);
    }
  }
  // Every device row of a flushed context is in `rows` (the rest were
  // truncated away); the staging area starts over once no context holds one,
  // and rows no one holds any more need no conversion.
  bool device_rows_left = false;
  for (const auto& [id, c] : contexts_)
    if (!flushed(id))
      device_rows_left |= std::any_of(c.staged_sources.begin(), c.staged_sources.end(),
                                      [](int32_t source) { return source != kHostRow; });
  if (!device_rows_left) {
    device_staged_rows_ = 0;
    pending_sources_.clear();
    pending_serial_ = -1;
  }
  if (rows.empty()) return;
  cudaStream_t s = stream_;
  if (device_rows) {  // the pass reads the target's rows (and conversions) after the work queued on its stream
    CUDA_CHECK(cudaEventRecord(device_staged_written_, head_.stream));
    CUDA_CHECK(cudaStreamWaitEvent(s, device_staged_written_, 0));
  }
  const int L = config_.num_layers;
  const long row_elements = 2L * config_.d_draft;
  for (size_t begin = 0; begin < rows.size(); begin += kExtendChunk) {
    const int count = static_cast<int>(std::min<size_t>(kExtendChunk, rows.size() - begin));
    const int padded = static_cast<int>(std::bit_ceil(unsigned(count)));  // few distinct shapes (and graphs)
    wait_for_extend_staging();
    auto* destinations = reinterpret_cast<uint64_t*>(extend_staging_.data());
    auto* sources = reinterpret_cast<cuda::TapRowSource*>(extend_staging_.data() + extend_sources_offset_);
    auto* taps = reinterpret_cast<uint16_t*>(extend_staging_.data() + extend_taps_offset_);
    bool chunk_host_rows = false;
    for (int i = 0; i < padded; ++i) {
      const ExtensionRow* row = i < count ? &rows[begin + i] : nullptr;  // padding rows are computed and dropped
      for (int l = 0; l < L; ++l)
        destinations[long(i) * L + l] = reinterpret_cast<uint64_t>(
            row ? row->context->storage.data() + (long(l) * row->context->capacity + row->position) * row_elements
                : nullptr);
      sources[i] = row ? row->device : cuda::TapRowSource{nullptr, cuda::TapRowKind::Zero};
      if (row && row->host_taps) {  // host rows go up with the metadata
        std::memcpy(taps + size_t(i) * width_, row->host_taps, size_t(width_) * 2);
        chunk_host_rows = true;
      }
    }
    CUDA_CHECK(cudaMemcpyAsync(extend_metadata_.data(), extend_staging_.data(),
                               chunk_host_rows ? extend_taps_offset_ + long(count) * width_ * 2 : extend_taps_offset_,
                               cudaMemcpyHostToDevice, s));
    extend_in_flight_ = true;
    auto graph = extend_graphs_.find(padded);
    if (graph != extend_graphs_.end()) {
      CUDA_CHECK(cudaGraphLaunch(graph->second, s));
      continue;
    }
    run_extension(padded);
    // The first pass of a size ran eagerly (choosing GEMM algorithms); capture it for the next ones.
    if (use_graphs_) extend_graphs_.emplace(padded, capture([&] { run_extension(padded); }));
  }
  if (staged_rows_read) {  // the next conversion into device_staged_ waits for this pass to have read it
    CUDA_CHECK(cudaEventRecord(device_staged_read_, s));
    device_staged_read_pending_ = true;
  }
  for (auto& [id, c] : contexts_) {
    if (!flushed(id)) continue;
    c.length += c.staged_rows();
    c.staged.clear();
    c.staged_sources.clear();
  }
}

// The kernels of one extension pass of `padded` rows whose metadata is in
// extend_metadata_ (destinations [padded, L], sources [padded], host rows).
void CudaDrafter::run_extension(int padded) {
  const int d = config_.d_draft, L = config_.num_layers;
  cudaStream_t s = stream_;
  bf16* taps = reinterpret_cast<bf16*>(extend_metadata_.data() + extend_taps_offset_);
  cuda::gather_tap_rows_forward(
      taps, reinterpret_cast<const cuda::TapRowSource*>(extend_metadata_.data() + extend_sources_offset_), padded,
      width_, s);
  // Hc = rms(hctx @ W_c, ctx_norm), kept in f32; then every layer's rms(Hc, attn_norm) @ k | v in one product
  // (context_keys_values_), whose rows [L * 2d] go to the L layers' storage.
  cuda::matmul_forward(extend_projected_.data(), cuda::MatmulOutput::F32, taps, context_projection_.data(), nullptr,
                       padded, width_, d, s, kAnyKernel);
  cuda::residual_add_rmsnorm_forward(extend_projected_.data(), nullptr, extend_normed_.data(), context_norm_.data(),
                                     padded, d, dims_.eps, nullptr, extend_hidden_.data(), d, s);
  cuda::rmsnorm_forward(extend_normed_.data(), extend_hidden_.data(), ones_.data(), padded, d, dims_.eps, s);
  cuda::matmul_forward(extend_kv_.data(), cuda::MatmulOutput::BF16, extend_normed_.data(), context_keys_values_.data(),
                       nullptr, padded, d, L * 2 * d, s, kAnyKernel);
  cuda::scatter_rows_forward(reinterpret_cast<bf16* const*>(extend_metadata_.data()), extend_kv_.data(), padded * L,
                             static_cast<int>(2L * d), s);
}

void CudaDrafter::read_context(int id, int layer, std::vector<float>& keys, std::vector<float>& values) {
  DSPARK_CHECK(layer >= 0 && layer < config_.num_layers, "draft context layer ", layer, " is outside 0..",
               config_.num_layers - 1);
  flush_contexts();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  extend_in_flight_ = false;
  const Context& c = context(id);
  const int d = config_.d_draft;
  std::vector<uint16_t> bits(size_t(c.length) * 2 * d);
  if (!bits.empty())
    CUDA_CHECK(cudaMemcpy(bits.data(), c.storage.data() + long(layer) * c.capacity * 2 * d, bits.size() * 2,
                          cudaMemcpyDeviceToHost));
  keys.resize(size_t(c.length) * d);
  values.resize(size_t(c.length) * d);
  for (int p = 0; p < c.length; ++p)
    for (int i = 0; i < d; ++i) {
      keys[size_t(p) * d + i] = bf16_to_f32(bits[size_t(p) * 2 * d + i]);
      values[size_t(p) * d + i] = bf16_to_f32(bits[size_t(p) * 2 * d + d + i]);
    }
}

// ---------------------------------------------------------------- the draft step

int CudaDrafter::attention_splits(int rows) const {
  // Enough CTAs for about two waves, two resident a multiprocessor: at one row of 8 heads, 32 splits of one
  // tile each (a short context leaves some splits empty: they cost one tiny CTA). 16 splits of two tiles each
  // made the 8B step 0.035 ms slower (docs/PERF.md, stop 38).
  const long blocks = long(rows) * config_.num_heads;
  return static_cast<int>(std::clamp<long>((2L * multiprocessors_ + blocks - 1) / blocks, 1, cuda::kMaxDraftSplits));
}

void CudaDrafter::ensure_rows(int rows) {
  if (rows <= max_rows_) return;
  destroy_graphs(graphs_);  // they point at the old buffers
  max_rows_ = rows;
  const DrafterConfig& c = config_;
  const size_t M = rows, R = size_t(c.gamma) * rows, d = c.d_draft, r = c.markov_rank;
  const size_t H = dims_.hidden_size, V = dims_.vocab_size;
  layout_ = StepLayout(rows, c.gamma, c.num_layers);
  staging_.resize(layout_.bytes);
  metadata_.resize(layout_.bytes);
  anchor_rows_.resize(M * H);
  token_rows_.resize(M * d);
  block_.resize(R * d);
  normed_.resize(R * d);
  kvq_.resize(R * 3 * d);
  attention_.resize(R * d);
  projected_.resize(R * d);
  gate_up_.resize(R * 2 * inner_);
  activated_.resize(R * inner_);
  hidden_.resize(R * d);
  head_input_.resize(R * H);
  logits_.resize(R * V);
  e_.resize(M * r);
  hidden_logits_.resize(size_t(c.gamma) * M);
  state_.resize(M * r);
  recurrent_input_.resize(M * (2 * r + d));
  recurrent_pre_.resize(M * 3 * r);
  head_output_.resize(M * r);
  results_.resize((2 * size_t(c.gamma) + 1) * M);
  results_host_.resize((2 * size_t(c.gamma) + 1) * M);
  alive_.resize(M);
  alive_rows_.resize(c.gamma);
  argmax_keys_.resize(size_t(c.gamma) * M);
  lower_keys_.resize(c.gamma + 1);
  long partial_rows = 0;  // (row, head, split) triples of the largest bucket's attention
  for (int bucket = 1; bucket <= rows; bucket *= 2)
    partial_rows = std::max(partial_rows, long(bucket) * c.num_heads * attention_splits(bucket));
  partial_out_.resize(size_t(partial_rows) * c.gamma * head_dim_);
  partial_lse_.resize(size_t(partial_rows) * c.gamma);
  counters_.resize(M * c.num_heads);
  CUDA_CHECK(cudaMemset(counters_.data(), 0, counters_.bytes()));
  if (norm_counter_.size() == 0) {  // zeroed once: every launch leaves them as it found them
    norm_counter_.resize(1);
    CUDA_CHECK(cudaMemset(norm_counter_.data(), 0, norm_counter_.bytes()));
    head_barrier_.resize(2);
    CUDA_CHECK(cudaMemset(head_barrier_.data(), 0, head_barrier_.bytes()));
  }
}

void CudaDrafter::draft(std::span<const CudaDraftRequest> requests, const DraftOptions& options,
                        std::vector<DraftResult>& results) {
  const DrafterConfig& c = config_;
  const int limit = options.max_tokens > 0 ? std::min(options.max_tokens, c.gamma) : c.gamma;
  // As the CPU draft(): explicit thresholds, else config.sts's unless the caller turned them off.
  const bool calibrated = options.thresholds.empty() && c.sts && options.calibrated_thresholds;
  const std::vector<float>& thresholds = calibrated ? c.sts->thresholds : options.thresholds;
  DSPARK_CHECK(thresholds.empty() || thresholds.size() >= size_t(limit), "draft thresholds: ", thresholds.size(),
               " for ", limit, " positions");
  for (const CudaDraftRequest& request : requests) {
    context(request.context);
    DSPARK_CHECK(request.anchor >= 0 && request.anchor < dims_.vocab_size, "draft anchor ", request.anchor,
                 " is outside the vocabulary of ", dims_.vocab_size);
    DSPARK_CHECK(options.sampling.greedy() || request.rng, "sampled drafting needs each request's random stream");
  }
  flush_contexts_of(requests);
  results.assign(requests.size(), DraftResult{});
  for (size_t begin = 0; begin < requests.size(); begin += kMaxDraftBatch) {
    const size_t count = std::min<size_t>(kMaxDraftBatch, requests.size() - begin);
    draft_chunk(requests.subspan(begin, count), options, limit, thresholds, std::span(results).subspan(begin, count));
  }
}

void CudaDrafter::draft_chunk(std::span<const CudaDraftRequest> requests, const DraftOptions& options, int limit,
                              const std::vector<float>& thresholds, std::span<DraftResult> results) {
  const DrafterConfig& c = config_;
  const int B = static_cast<int>(requests.size()), gamma = c.gamma, V = dims_.vocab_size, d = c.d_draft;
  const int rows = static_cast<int>(std::bit_ceil(unsigned(B)));  // the batch bucket
  const bool sampling = !options.sampling.greedy();
  ensure_rows(rows);  // (the step's staging is free: the previous step ended with a synchronisation)

  // The step's metadata.
  unsigned char* bytes = staging_.data();
  std::memset(bytes, 0, layout_.bytes);
  auto* keys = reinterpret_cast<uint64_t*>(bytes + layout_.keys);
  auto* values = reinterpret_cast<uint64_t*>(bytes + layout_.values);
  auto* anchors = reinterpret_cast<int32_t*>(bytes + layout_.anchors);
  auto* lengths = reinterpret_cast<int32_t*>(bytes + layout_.lengths);
  auto* limits = reinterpret_cast<int32_t*>(bytes + layout_.limits);
  auto* uniforms = reinterpret_cast<float*>(bytes + layout_.uniforms);
  for (int b = 0; b < B; ++b) {  // padding rows stay zero: no context, anchor 0, limit 0
    const Context& context_b = context(requests[b].context);
    for (int l = 0; l < c.num_layers; ++l) {
      const bf16* base = context_b.storage.data() + long(l) * context_b.capacity * 2 * d;
      keys[long(l) * rows + b] = reinterpret_cast<uint64_t>(base);
      values[long(l) * rows + b] = reinterpret_cast<uint64_t>(base ? base + d : nullptr);
    }
    anchors[b] = requests[b].anchor;
    lengths[b] = context_b.length;
    limits[b] = limit;
  }
  cuda::DraftControl control{};
  control.min_confidence = options.min_confidence;
  control.has_thresholds = !thresholds.empty();
  for (int k = 0; k < limit && !thresholds.empty(); ++k) control.thresholds[k] = thresholds[k];
  std::memcpy(bytes + layout_.control, &control, sizeof control);
  const cuda::DeviceSamplingParams params{sampling ? options.sampling.temperature : 0.0f, options.sampling.top_k,
                                          options.sampling.top_p};
  std::memcpy(bytes + layout_.sampling, &params, sizeof params);
  uniforms_.assign(size_t(gamma) * B, 0.0);
  if (sampling) {
    for (int b = 0; b < B; ++b) {
      Rng stream = *requests[b].rng;  // a copy: the row's own stream advances by the tokens kept
      for (int k = 0; k < limit; ++k) {
        uniforms_[size_t(k) * B + b] = stream.uniform();
        uniforms[long(k) * rows + b] = static_cast<float>(uniforms_[size_t(k) * B + b]);
      }
    }
  }
  cudaStream_t s = stream_;
  if (step_start_) CUDA_CHECK(cudaEventRecord(step_start_, s));
  CUDA_CHECK(cudaMemcpyAsync(metadata_.data(), bytes, layout_.bytes, cudaMemcpyHostToDevice, s));
  head_timeline_.before_step(s);

  const StepKind kind = sampling                 ? StepKind::Sampled
                        : options.collect_logits ? StepKind::GreedyLogits
                                                 : StepKind::GreedyTokens;
  auto graph = graphs_.find({rows, kind});
  if (graph != graphs_.end())
    CUDA_CHECK(cudaGraphLaunch(graph->second, s));
  else
    run_step(rows, kind);
  const long result_words = (2L * gamma + 1) * rows;
  CUDA_CHECK(cudaMemcpyAsync(results_host_.data(), results_.data(), result_words * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, s));
  const bool want_logits = sampling || options.collect_logits;
  const size_t logit_count = size_t(limit) * rows * V;  // positions >= limit are never kept
  if (want_logits) {
    if (logits_host_.size() < logit_count) logits_host_.resize(logit_count);
    CUDA_CHECK(
        cudaMemcpyAsync(logits_host_.data(), logits_.data(), logit_count * sizeof(float), cudaMemcpyDeviceToHost, s));
  }
  if (step_stop_) CUDA_CHECK(cudaEventRecord(step_stop_, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  extend_in_flight_ = false;
  profiler_.finish_step();
  head_timeline_.after_step();

  const int32_t* tokens = results_host_.data();
  const float* confidence = reinterpret_cast<const float*>(results_host_.data() + long(gamma) * rows);
  const int32_t* count = results_host_.data() + 2L * gamma * rows;
  for (int b = 0; b < B; ++b) {
    DraftResult& result = results[b];
    const int n = count[b];
    DSPARK_CHECK(n >= 1 && n <= limit, "CUDA drafter: row ", b, " kept ", n, " positions (limit ", limit, ")");
    for (int k = 0; k < n; ++k) {
      result.tokens.push_back(tokens[long(k) * rows + b]);
      result.confidence.push_back(confidence[long(k) * rows + b]);
    }
    auto logits_of = [&](int k) { return logits_host_.data() + (size_t(k) * rows + b) * V; };
    if (sampling) {
      result.probs.resize(size_t(n) * V);
      for (int k = 0; k < n; ++k) {
        float* q = result.probs.data() + size_t(k) * V;
        cpu::processed_distribution(q, logits_of(k), V, options.sampling, order_);
        const int32_t token = cpu::sample_from_distribution(q, V, uniforms_[size_t(k) * B + b]);
        if (token != result.tokens[k]) {  // float rounding at an interval's edge: the host's draw stands
          result.tokens[k] = token;
          result.tokens.resize(k + 1);
          result.confidence.resize(k + 1);
          result.probs.resize(size_t(k + 1) * V);
          break;
        }
      }
      for (size_t k = 0; k < result.tokens.size(); ++k) requests[b].rng->uniform();  // as the CPU drafter draws
    }
    if (options.collect_logits)
      for (size_t k = 0; k < result.tokens.size(); ++k)
        result.logits.insert(result.logits.end(), logits_of(int(k)), logits_of(int(k)) + V);
  }

  // A bucket's first step ran eagerly (choosing GEMM algorithms); capture it for the next ones.
  if (use_graphs_ && graph == graphs_.end())
    graphs_.emplace(std::pair{rows, kind}, capture([&] { run_step(rows, kind); }));
}

cudaGraphExec_t CudaDrafter::capture(const std::function<void()>& work) {
  ++warm_up_runs_;  // (each capture follows the shape's eager first pass)
  try {
    return cuda::capture_graph(stream_, work);
  } catch (...) {  // the stream stays usable (capture_graph): run eagerly from now on
    use_graphs_ = false;
    throw;
  }
}

// The kernels of one step for a bucket of `rows` rows, in order; the same eager or captured.
void CudaDrafter::run_step(int rows, StepKind step) {
  const bool greedy = step != StepKind::Sampled;
  const DrafterConfig& c = config_;
  const int B = rows, gamma = c.gamma, R = gamma * B, d = c.d_draft, r = c.markov_rank;
  const int H = dims_.hidden_size, V = dims_.vocab_size;
  const float eps = dims_.eps;
  cudaStream_t s = stream_;
  const unsigned char* meta = metadata_.data();
  const auto* anchors = reinterpret_cast<const int32_t*>(meta + layout_.anchors);
  const auto* limits = reinterpret_cast<const int32_t*>(meta + layout_.limits);
  const auto* lengths = reinterpret_cast<const int32_t*>(meta + layout_.lengths);
  const auto* context_keys = reinterpret_cast<const bf16* const*>(meta + layout_.keys);
  const auto* context_values = reinterpret_cast<const bf16* const*>(meta + layout_.values);
  const auto* control = reinterpret_cast<const cuda::DraftControl*>(meta + layout_.control);
  const auto* params = reinterpret_cast<const cuda::DeviceSamplingParams*>(meta + layout_.sampling);
  const auto* uniforms = reinterpret_cast<const float*>(meta + layout_.uniforms);
  int32_t* tokens = results_.data();
  float* confidence = reinterpret_cast<float*>(results_.data() + long(gamma) * B);
  int32_t* count = results_.data() + 2L * gamma * B;
  // Every position in one launch where w2 fits on chip (the demo drafter: a 0.125 -> 0.115 ms step
  // at batch 4); at Qwen3-8B's vocabulary the per-position kernels below are faster (docs/PERF.md, stop 31).
  const bool one_launch = greedy && kind_ == cuda::SequentialHeadKind::Markov && one_launch_head_ &&
                          cuda::markov_head_supported(B, gamma, r, V, head_out_.data());
  // Greedy without logits: each block of a position's product bounds its columns' logits from w2 at 8 bits and
  // forms the exact logit only where the argmax can be (the same tokens; at Qwen3-8B's vocabulary half the bytes).
  const bool tokens_only =
      !one_launch && step == StepKind::GreedyTokens && quantized_head_ && quantized_stride_ > 0 && B == 1;
  // Then the LM head's logits too are intervals, from its 8-bit rows, and formed exactly only where the argmax
  // can be, as its product would form them (which therefore runs the tensor-core GEMV alone: at most 16 rows).
  const bool lm_head_intervals = tokens_only && quantized_lm_head_ && lm_head_values_.size() > 0;
  cuda::StepProfiler& p = profiler_;
  p.mark("start", s);
  CUDA_CHECK(cudaMemsetAsync(alive_rows_.data(), 0, alive_rows_.bytes(), s));
  if (greedy) CUDA_CHECK(cudaMemsetAsync(argmax_keys_.data(), 0, size_t(gamma) * B * sizeof(unsigned long long), s));
  if (tokens_only) CUDA_CHECK(cudaMemsetAsync(lower_keys_.data(), 0, lower_keys_.bytes(), s));

  // Block rows: row 0 = E[anchor] @ tok_proj + block_pos[0]; row k = mask_emb[k-1] + block_pos[k].
  cuda::gather_rows_forward(anchor_rows_.data(), head_.embedding, anchors, B, H, s);
  cuda::matmul_forward(token_rows_.data(), cuda::MatmulOutput::F32, anchor_rows_.data(), token_projection_.data(),
                       nullptr, B, H, d, s, kAnyKernel);
  cuda::draft_block_forward(block_.data(), token_rows_.data(), mask_embedding_.data(), block_position_.data(), B, gamma,
                            d, s);
  p.mark("block rows", s);

  const int splits = attention_splits(B);
  cuda::rmsnorm_forward(normed_.data(), block_.data(), layers_[0].attention_norm.data(), R, d, eps, s);
  p.mark("norm", s);
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& w = layers_[l];
    const bool last = l + 1 == c.num_layers;
    cuda::matmul_forward(kvq_.data(), cuda::MatmulOutput::BF16, normed_.data(), w.kvq.data(), nullptr, R, d, 3 * d, s,
                         kAnyKernel);
    p.mark("k|v|q gemm", s);
    const cuda::DraftAttentionBatch batch{context_keys + long(l) * B, context_values + long(l) * B, lengths, 2L * d, B};
    cuda::bidirectional_attention_forward(attention_.data(), kvq_.data() + 2 * d, kvq_.data(), kvq_.data() + d, 3L * d,
                                          batch, gamma, c.num_heads, head_dim_, splits, partial_out_.data(),
                                          partial_lse_.data(), counters_.data(), s);
    p.mark("attention", s);
    // Hd += attention @ o; normed = rms(Hd, ff_norm)
    const cuda::ResidualNorm attention_norm{.residual = block_.data(), .weight = w.ff_norm.data(),
                                            .normed = normed_.data(), .eps = eps, .counter = norm_counter_.data()};
    cuda::matmul_residual_rmsnorm_forward(projected_.data(), attention_.data(), w.o.data(), nullptr, R, d, d,
                                          attention_norm, s, kAnyKernel);
    p.mark("o gemm+add+norm", s);
    cuda::gated_matmul_forward(activated_.data(), cuda::GatedActivation::GeluTanh, normed_.data(), w.gate_up.data(),
                               nullptr, gate_up_.data(), R, d, inner_, s, kAnyKernel);
    p.mark("gate|up gemm+gelu", s);
    // Hd += activated @ down; normed = rms(Hd, the next layer's attention norm), or h = rms(Hd, out_norm)
    // (f32 for the head, bf16 for out_proj)
    const cuda::ResidualNorm mlp_norm{.residual = block_.data(),
                                      .weight = last ? out_norm_.data() : layers_[l + 1].attention_norm.data(),
                                      .normed = normed_.data(), .eps = eps,
                                      .normed_tap = last ? hidden_.data() : nullptr, .tap_stride = d,
                                      .counter = norm_counter_.data()};
    cuda::matmul_residual_rmsnorm_forward(projected_.data(), activated_.data(), w.down.data(), nullptr, R, inner_, d,
                                          mlp_norm, s, kAnyKernel);
    p.mark("down gemm+add+norm", s);
  }
  cuda::matmul_forward(head_input_.data(), cuda::MatmulOutput::BF16, normed_.data(), out_projection_.data(), nullptr, R,
                       d, H, s, kAnyKernel);
  p.mark("out_proj gemm", s);
  if (lm_head_intervals) {  // logits_ [γ, V]: the centers of U_k's intervals, from out_proj's input x_k
    const cuda::QuantizedActivations activations{activation_values_.data(), activation_scales_.data(),
                                                 activation_norms_.data()};
    cuda::quantize_activation_rows_forward(activations, normed_.data(), R, d, s);
    cuda::lm_head_projection_reach_forward(activations, normed_.data(), out_projection_.data(), head_input_.data(), R,
                                           d, H, lm_head_largest_norm_.data(), reach_sums_.data(),
                                           reach_finished_.data(), s);
    p.mark("lm head reach", s);
    cuda::quantized_rows_product_forward(logits_.data(), lm_head_quantized(), activations, R, d, V, s);
    p.mark("lm head 8-bit", s);
  } else {
    // The row-invariant family: the tensor-core GEMV alone up to 16 rows, whose sums the tokens-only head
    // forms again for the columns it needs (kernels/cuda/tensor_gemv.cuh).
    cuda::matmul_forward(logits_.data(), cuda::MatmulOutput::F32, head_input_.data(), head_.lm_head, nullptr, R, H, V,
                         s, cuda::FewRowKernels::DecodeFamily);
    p.mark("lm head gemm", s);
  }

  // The sequential head, position by position for all rows: L_k = U_k + B_k in place, then x_k.
  const cuda::SequentialHeadWeights weights{head_embedding_.data(), confidence_weight_.data(), confidence_bias_.data(),
                                            temperatures_.data(), token_confidence_.data()};
  const cuda::SequentialHeadState head{anchors,    limits,        tokens, greedy ? argmax_keys_.data() : nullptr,
                                       confidence, alive_.data(), count,  alive_rows_.data()};
  if (one_launch) {
    cuda::markov_head_forward(logits_.data(), argmax_keys_.data(), head_out_.data(), hidden_.data(), B, gamma, r, d, V,
                              weights, control, head, head_barrier_.data(), s);
    p.mark("markov head", s);
    return;
  }
  // At one or two rows the Markov head's positions find e_k, c_k and pruning inside their products
  // (markov_position_forward: no prepare kernel between positions); with more rows each block has more
  // verdicts to reach before its weights stream, and the prepare kernel pays (docs/PERF.md, stop 33).
  const bool markov_in_product = kind_ == cuda::SequentialHeadKind::Markov && B <= 2;
  const cuda::QuantizedColumnsView quantized{quantized_values_.data(), quantized_stride_,
                                             quantized_scales_.data(), quantized_bounds_.data(),
                                             quantized_exact_.data(),  float(kQuantizedSlack)};
  const cuda::LmHeadIntervals intervals{logits_.data(),
                                        lm_head_bounds_.data(),
                                        lm_head_norms_.data(),
                                        activation_norms_.data(),
                                        head_.lm_head,
                                        head_input_.data(),
                                        H,
                                        lower_keys_.data(),
                                        head_barrier_.data()};
  // The tokens-only head's positions in one launch where w2's 8-bit columns fit on chip (Qwen3-8B's vocabulary
  // on a 132-multiprocessor device): w2 read once a step, not once a position.
  if (tokens_only && one_launch_head_ &&
      cuda::markov_head_tokens_supported(r, V, quantized_stride_, lm_head_intervals ? H : 0)) {
    cuda::markov_head_tokens_forward(argmax_keys_.data(), logits_.data(), quantized,
                                     lm_head_intervals ? &intervals : nullptr, hidden_.data(), hidden_logits_.data(),
                                     gamma, r, d, V, weights, control, head, lower_keys_.data() + gamma, s);
    p.mark("markov head tokens", s);
    return;
  }
  for (int k = 0; k < gamma; ++k) {
    float* logits = logits_.data() + long(k) * B * V;
    const int32_t* any_alive = alive_rows_.data() + k;
    // L_k += x @ W (W [r, V]: markov.w2 or rnn.wO), then x_k: argmax fused in when greedy.
    auto vocabulary_head = [&](const float* x) {
      if (greedy)
        cuda::matmul_in_out_argmax_forward(logits, x, head_out_.data(), nullptr, B, r, V, true,
                                           argmax_keys_.data() + long(k) * B, any_alive, s);
      else
        cuda::matmul_in_out_forward(logits, x, head_out_.data(), nullptr, B, r, V, true, any_alive, s);
      p.mark(greedy ? "head vocab gemm+argmax" : "head vocab gemm", s);
    };
    if (tokens_only) {  // the same tokens without the logits: w2 read at 8 bits
      cuda::markov_position_tokens_forward(argmax_keys_.data(), logits, quantized,
                                           lm_head_intervals ? &intervals : nullptr, hidden_.data(),
                                           hidden_logits_.data(), k, B, gamma, r, d, V, weights, control, head, s);
      p.mark("head position tokens", s);
    } else if (markov_in_product) {  // e_k, c_k, pruning and B = e @ w2 in one launch
      cuda::markov_position_forward(logits, greedy ? argmax_keys_.data() : nullptr, head_out_.data(), hidden_.data(),
                                    hidden_logits_.data(), k, B, gamma, r, d, V, weights, control, head, s);
      p.mark(greedy ? "head position gemm+argmax" : "head position gemm", s);
    } else {
      cuda::sequential_head_prepare_forward(e_.data(), recurrent_input_.data(), state_.data(), hidden_.data(), k, B, r,
                                            d, V, kind_, weights, control, head, s);
      p.mark("head prepare", s);
    }
    switch (kind_) {
      case cuda::SequentialHeadKind::Markov:  // B = e @ w2
        if (!markov_in_product) vocabulary_head(e_.data());
        break;
      case cuda::SequentialHeadKind::Rnn:  // s = tanh(s @ wH + e + bH); B = s @ wO
        cuda::matmul_in_out_forward(recurrent_pre_.data(), state_.data(), recurrent_.data(), recurrent_bias_.data(), B,
                                    r, r, false, any_alive, s);
        cuda::recurrent_update_forward(state_.data(), nullptr, recurrent_pre_.data(), e_.data(), B, r, kind_, s);
        p.mark("head recurrent", s);
        vocabulary_head(state_.data());
        break;
      case cuda::SequentialHeadKind::Gru:  // [g, c, o] = z @ wJ + bJ; s = σ(g) s + (1 - σ(g)) tanh(c); B = tanh(o) @ w2
        cuda::matmul_in_out_forward(recurrent_pre_.data(), recurrent_input_.data(), recurrent_.data(),
                                    recurrent_bias_.data(), B, 2 * r + d, 3 * r, false, any_alive, s);
        cuda::recurrent_update_forward(state_.data(), head_output_.data(), recurrent_pre_.data(), e_.data(), B, r,
                                       kind_, s);
        p.mark("head recurrent", s);
        vocabulary_head(head_output_.data());
        break;
    }
    if (!greedy) {
      cuda::select_tokens_forward(tokens + long(k) * B, logits, uniforms + long(k) * B, params, B, V, s);
      p.mark("head token selection", s);
    }
  }
  if (greedy) cuda::argmax_tokens_forward(tokens, argmax_keys_.data(), gamma * B, s);
  p.mark("head argmax tokens", s);
}

}  // namespace dspark
