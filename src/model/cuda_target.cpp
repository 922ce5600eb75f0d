// CudaTarget: the target transformer on one NVIDIA GPU.
//
// Precision: weights and the activations fed to GEMMs are bf16; GEMMs, norms,
// softmax and the residual stream are f32. Layer weights are fused where the
// math allows one GEMM instead of several: q|k|v in one [nh+2nkv)*hd, H]
// matrix, gate|up in one [2F, H] matrix.
//
// KV cache: one pool of kBlockSize-token blocks per layer shared by every
// sequence; a sequence holds a list of blocks (a row of the device block
// table), grows block by block and gives blocks back when rolled back.
//
// A forward: the host packs the step's metadata (token ids, positions, cache
// slots, per-sequence offsets and lengths, sampling uniforms) into one pinned
// buffer and copies it with one cudaMemcpyAsync; the kernels run; the chosen
// token ids come back in one copy, the only synchronisation of the step.
// Steps of up to 64 sequences of up to 64 tokens each are captured once per
// (batch bucket, tokens per sequence) as CUDA graphs and replayed; the batch
// is padded to its bucket with dummy sequences that write only to two
// reserved cache blocks. A step whose sequences add different numbers of
// tokens (a verify where rows keep different draft prefixes) is padded to
// its longest: each short sequence's block gets dummy tokens after its own,
// written to its cache past its length, where nothing reads them (a query
// sees only positions up to its own, and the sequence's length does not
// count them) until real tokens overwrite them; its real rows' outputs are
// gathered back to the front.
#include "model/cuda_target.h"

#include <algorithm>
#include <bit>
#include <utility>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>

#include "core/dtype.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/buffer.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/step_profiler.h"

namespace dspark {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using cuda::kBlockSize;
using cuda::PinnedBuffer;

constexpr int kMaxGraphBatch = 64;        // batch buckets 1, 2, 4, ... 64
constexpr int kMaxGraphTokens = 64;       // tokens per sequence in a graphed step
// Every graphed step's attention (decode and verify, splits > 1) runs one
// kernel, so a token gets the same bits decoded or verified.
static_assert(kMaxGraphTokens <= cuda::kSplitMaxQueryLength);
// The tap ring: a step of at most kTapRingSlotRows tokens also leaves its
// tapped rows in slot (serial mod kTapRingSlots) of a ring, where they stay
// through the next kTapRingSlots - 1 such steps (TargetResult::device_taps_intact):
// a draft source can take a round's rows when it needs them, not every round.
constexpr int kTapRingSlots = 64;
constexpr int kTapRingSlotRows = 64;
constexpr int kMaxTableRows = 1024;       // sequences alive at once (+1 for padding)
constexpr long kMaxChunkTokens = 8192;    // a long single-sequence forward runs in chunks
constexpr long kMaxPoolTokens = 1 << 18;  // KV pool cap

inline int ceil_div(long a, long b) { return static_cast<int>((a + b - 1) / b); }

// Uploads a checkpoint tensor as bf16 (raw copy when it is stored as bf16).
void upload_bf16(bf16* destination, const SafetensorsCheckpoint& checkpoint, const std::string& name,
                 const Shape& shape) {
  const SafetensorsFile& file = checkpoint.file_of(name);
  const SafetensorsEntry& entry = file.entry(name);
  DSPARK_CHECK(entry.shape == shape, file.path().string(), ": tensor \"", name, "\" has shape ",
               shape_string(entry.shape), ", expected ", shape_string(shape));
  const size_t count = static_cast<size_t>(shape_numel(shape));
  if (entry.dtype == Dtype::BF16) {
    CUDA_CHECK(cudaMemcpy(destination, file.raw(name), count * 2, cudaMemcpyHostToDevice));
    return;
  }
  const Tensor values = checkpoint.load(name, shape);
  std::vector<uint16_t> bits(count);
  convert_to_bf16(values.data, bits.data(), count);
  CUDA_CHECK(cudaMemcpy(destination, bits.data(), count * 2, cudaMemcpyHostToDevice));
}

DeviceBuffer<float> upload_f32(const SafetensorsCheckpoint& checkpoint, const std::string& name, const Shape& shape) {
  const Tensor values = checkpoint.load(name, shape);
  DeviceBuffer<float> buffer(values.numel());
  CUDA_CHECK(cudaMemcpy(buffer.data(), values.data, buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

struct CudaLayer {
  DeviceBuffer<float> input_norm, post_attention_norm, q_norm, k_norm;  // f32, tiny
  DeviceBuffer<bf16> qkv, qkv_bias;          // [(nh+2nkv)*hd, H], [(nh+2nkv)*hd]
  DeviceBuffer<bf16> o_proj, o_bias;         // [H, nh*hd], [H]
  DeviceBuffer<bf16> gate_up, gate_up_bias;  // [2F, H], [2F]
  DeviceBuffer<bf16> down, down_bias;        // [H, F], [H]
};

struct SequenceState {
  int capacity = 0;
  int length = 0;
  int table_row = 0;
  std::vector<int32_t> blocks;
};

// Offsets (in 4-byte words) of the step metadata inside the staging buffers.
struct StepLayout {
  long tokens, positions, slots, query_start, query_length, sequence_length, table_row, logit_rows, score_tokens,
      uniforms, tap_rows, tap_ring, words;
  StepLayout(long max_tokens, long max_sequences) {
    long at = (sizeof(cuda::DeviceSamplingParams) + 3) / 4;
    auto take = [&](long count) { long begin = at; at += count; return begin; };
    tokens = take(max_tokens), positions = take(max_tokens), slots = take(max_tokens);
    query_start = take(max_sequences), query_length = take(max_sequences);
    sequence_length = take(max_sequences), table_row = take(max_sequences);
    logit_rows = take(max_tokens), score_tokens = take(max_tokens), uniforms = take(max_tokens);
    tap_rows = take(max_tokens);
    tap_ring = take(2);  // the step's tap ring placement: first ring row, rows (0: none)
    words = at;
  }
};

class CudaTarget final : public Target {
 public:
  explicit CudaTarget(const std::filesystem::path& directory);
  ~CudaTarget() override;

  const ModelConfig& config() const override { return config_; }
  std::string device_description() const override { return "cuda: " + cuda::device_description(device_); }
  int create_sequence(int capacity) override;
  void release_sequence(int sequence) override;
  int sequence_length(int sequence) const override { return state(sequence).length; }
  void truncate_sequence(int sequence, int length) override;
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) override;
  int row_invariant_rows() const override { return cuda::kRowInvariantRows; }
  bool pads_verify_rows() const override { return true; }
  long warm_up_runs() const override { return warm_up_runs_; }
  CudaTargetHead head() const { return {embed_tokens_.data(), lm_head_, stream_}; }

 private:
  // What one forward runs, after padding: the shapes every kernel launch sees.
  struct StepShape {
    int tokens = 0, sequences = 0, logit_rows = 0, max_query_length = 0, splits = 1;
    bool padded = false;    // sequences padded to the longest: logit rows listed real ones first
    // A decode or verify step (few query tokens per sequence): split-KV attention with the RoPE inside.
    bool few_tokens() const { return max_query_length <= kMaxGraphTokens; }
    std::vector<int> taps;  // hidden states copied out (a verify step for a DSpark drafter)
    bool operator<(const StepShape& other) const {
      return std::tie(tokens, sequences, logit_rows, max_query_length, splits, padded, taps) <
             std::tie(other.tokens, other.sequences, other.logit_rows, other.max_query_length, other.splits,
                      other.padded, other.taps);
    }
  };

  const SequenceState& state(int sequence) const;
  SequenceState& state(int sequence) { return const_cast<SequenceState&>(std::as_const(*this).state(sequence)); }
  void ensure_blocks(SequenceState& sequence, int length);
  void ensure_capacity(long tokens, long sequences);
  int attention_splits(int longest_sequence) const;
  void ensure_split_capacity(const StepShape& shape);
  void forget_graphs();
  void forward_chunk(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result);
  void run_step(const StepShape& shape, std::span<const int> taps, bool score);

  ModelConfig config_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  // A step's copy into the tap ring runs beside its LM head (run_step), on a
  // stream of its own that forks from stream_ and joins it again.
  cudaStream_t ring_stream_ = nullptr;
  cudaEvent_t taps_written_ = nullptr, ring_written_ = nullptr;
  int qkv_width_ = 0;  // (nh + 2 nkv) * hd

  DeviceBuffer<bf16> embed_tokens_, lm_head_storage_;
  const bf16* lm_head_ = nullptr;
  DeviceBuffer<float> final_norm_;
  std::vector<CudaLayer> layers_;
  DeviceBuffer<float2> rope_table_;  // [max_positions, hd/2] (cos, sin)

  // Paged KV cache: per layer [pool_blocks * kBlockSize, nkv, hd].
  long pool_blocks_ = 0;
  std::vector<DeviceBuffer<bf16>> key_cache_, value_cache_;
  std::vector<int32_t> free_blocks_;
  int max_blocks_ = 0;  // blocks per sequence at the model's context
  DeviceBuffer<int32_t> block_tables_;  // [kMaxTableRows + 1, max_blocks]; the last row: padding
  std::vector<int> free_table_rows_;
  std::map<int, SequenceState> sequences_;
  int next_sequence_ = 0;

  // Step metadata and activations, sized for max_tokens_ rows.
  long max_tokens_ = 0, max_sequences_ = 0;
  StepLayout layout_{0, 0};
  PinnedBuffer<uint32_t> staging_;
  DeviceBuffer<uint32_t> metadata_;
  DeviceBuffer<float> residual_, logits_, nll_, taps_, partial_out_, partial_lse_;
  DeviceBuffer<float> packed_taps_;  // a padded step's taps, its real rows only
  DeviceBuffer<float> tap_ring_;     // [kTapRingSlots * kTapRingSlotRows, tap width] (empty before a tapped step)
  long tap_ring_serial_ = 0;         // tapped steps that used the ring so far (their slot: serial mod slots)
  DeviceBuffer<bf16> normed_, qkv_, queries_, attention_, projected_, gate_up_, activated_, head_input_;
  DeviceBuffer<unsigned> norm_counter_;  // the fused GEMV + norm's block count, 0 between launches
  DeviceBuffer<unsigned> attention_counters_;  // the splits finished per attention CTA row, 0 between launches
  DeviceBuffer<int32_t> chosen_;
  PinnedBuffer<int32_t> chosen_host_;
  PinnedBuffer<float> nll_host_;

  cuda::StepProfiler profiler_{"DSPARK_PROFILE", "profile"};
  // The steps profiled: those feeding this many tokens to each sequence (DSPARK_PROFILE_TOKENS, default 1: decode).
  const int profiled_tokens_ = std::getenv("DSPARK_PROFILE_TOKENS") ? std::atoi(std::getenv("DSPARK_PROFILE_TOKENS")) : 1;
  std::map<StepShape, cudaGraphExec_t> graphs_;
  std::map<StepShape, int> eager_runs_;  // a shape is captured on its second use
  long warm_up_runs_ = 0;                // forwards that ran a graphable shape eagerly or captured it
};

CudaTarget::CudaTarget(const std::filesystem::path& directory) {
  config_ = load_model_config(directory);
  const ModelConfig& c = config_;
  CUDA_CHECK(cudaGetDevice(&device_));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&ring_stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&taps_written_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&ring_written_, cudaEventDisableTiming));
  DSPARK_CHECK(c.head_dim == 16 || c.head_dim == 32 || c.head_dim == 64 || c.head_dim == 128,
               "--device cuda: head_dim ", c.head_dim, " is not supported (16, 32, 64, 128)");

  const SafetensorsCheckpoint checkpoint(directory);
  const int64_t H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t q_size = int64_t{c.num_heads} * c.head_dim, kv_size = int64_t{c.num_kv_heads} * c.head_dim;
  qkv_width_ = static_cast<int>(q_size + 2 * kv_size);

  embed_tokens_.resize(V * H);
  upload_bf16(embed_tokens_.data(), checkpoint, "model.embed_tokens.weight", {V, H});
  if (c.tie_word_embeddings) {
    lm_head_ = embed_tokens_.data();
  } else {
    lm_head_storage_.resize(V * H);
    upload_bf16(lm_head_storage_.data(), checkpoint, "lm_head.weight", {V, H});
    lm_head_ = lm_head_storage_.data();
  }
  final_norm_ = upload_f32(checkpoint, "model.norm.weight", {H});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    CudaLayer layer;
    layer.input_norm = upload_f32(checkpoint, prefix + "input_layernorm.weight", {H});
    layer.post_attention_norm = upload_f32(checkpoint, prefix + "post_attention_layernorm.weight", {H});
    if (c.qk_norm) {
      layer.q_norm = upload_f32(checkpoint, prefix + "self_attn.q_norm.weight", {c.head_dim});
      layer.k_norm = upload_f32(checkpoint, prefix + "self_attn.k_norm.weight", {c.head_dim});
    }
    layer.qkv.resize(qkv_width_ * H);
    upload_bf16(layer.qkv.data(), checkpoint, prefix + "self_attn.q_proj.weight", {q_size, H});
    upload_bf16(layer.qkv.data() + q_size * H, checkpoint, prefix + "self_attn.k_proj.weight", {kv_size, H});
    upload_bf16(layer.qkv.data() + (q_size + kv_size) * H, checkpoint, prefix + "self_attn.v_proj.weight", {kv_size, H});
    if (c.attention_bias) {
      layer.qkv_bias.resize(qkv_width_);
      upload_bf16(layer.qkv_bias.data(), checkpoint, prefix + "self_attn.q_proj.bias", {q_size});
      upload_bf16(layer.qkv_bias.data() + q_size, checkpoint, prefix + "self_attn.k_proj.bias", {kv_size});
      upload_bf16(layer.qkv_bias.data() + q_size + kv_size, checkpoint, prefix + "self_attn.v_proj.bias", {kv_size});
      if (checkpoint.contains(prefix + "self_attn.o_proj.bias")) {
        layer.o_bias.resize(H);
        upload_bf16(layer.o_bias.data(), checkpoint, prefix + "self_attn.o_proj.bias", {H});
      }
    }
    layer.o_proj.resize(H * q_size);
    upload_bf16(layer.o_proj.data(), checkpoint, prefix + "self_attn.o_proj.weight", {H, q_size});
    layer.gate_up.resize(2 * F * H);
    upload_bf16(layer.gate_up.data(), checkpoint, prefix + "mlp.gate_proj.weight", {F, H});
    upload_bf16(layer.gate_up.data() + F * H, checkpoint, prefix + "mlp.up_proj.weight", {F, H});
    layer.down.resize(H * F);
    upload_bf16(layer.down.data(), checkpoint, prefix + "mlp.down_proj.weight", {H, F});
    if (c.mlp_bias) {
      layer.gate_up_bias.resize(2 * F);
      upload_bf16(layer.gate_up_bias.data(), checkpoint, prefix + "mlp.gate_proj.bias", {F});
      upload_bf16(layer.gate_up_bias.data() + F, checkpoint, prefix + "mlp.up_proj.bias", {F});
      layer.down_bias.resize(H);
      upload_bf16(layer.down_bias.data(), checkpoint, prefix + "mlp.down_proj.bias", {H});
    }
    layers_.push_back(std::move(layer));
  }

  // RoPE angles in double on the host, as the CPU path computes them.
  const std::vector<double> frequencies = rope_inverse_frequencies(c);
  const int half = c.head_dim / 2;
  std::vector<float2> table(static_cast<size_t>(c.max_positions) * half);
  for (int position = 0; position < c.max_positions; ++position)
    for (int i = 0; i < half; ++i) {
      const double angle = position * frequencies[i];
      table[size_t(position) * half + i] = make_float2(static_cast<float>(std::cos(angle)),
                                                       static_cast<float>(std::sin(angle)));
    }
  rope_table_.resize(table.size());
  CUDA_CHECK(cudaMemcpy(rope_table_.data(), table.data(), rope_table_.bytes(), cudaMemcpyHostToDevice));
  norm_counter_.resize(1);
  CUDA_CHECK(cudaMemset(norm_counter_.data(), 0, norm_counter_.bytes()));

  // KV pool: half of what is free after the weights, at most kMaxPoolTokens.
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const long bytes_per_token = 2L * c.num_layers * kv_size * 2;
  const long pool_tokens = std::min<long>(kMaxPoolTokens, static_cast<long>(free_bytes / 2) / bytes_per_token);
  pool_blocks_ = pool_tokens / kBlockSize;
  DSPARK_CHECK(pool_blocks_ > 2, "--device cuda: no GPU memory left for the KV cache");
  for (int l = 0; l < c.num_layers; ++l) {
    key_cache_.emplace_back(pool_blocks_ * kBlockSize * kv_size);
    value_cache_.emplace_back(pool_blocks_ * kBlockSize * kv_size);
  }
  for (long block = pool_blocks_ - 1; block >= 2; --block) free_blocks_.push_back(static_cast<int32_t>(block));
  max_blocks_ = std::max(2, ceil_div(c.max_positions, kBlockSize));
  block_tables_.resize(static_cast<size_t>(kMaxTableRows + 1) * max_blocks_);
  const int32_t padding_blocks[2] = {0, 1};  // blocks 0 and 1 hold the padding sequences' writes
  CUDA_CHECK(cudaMemcpy(block_tables_.data() + static_cast<size_t>(kMaxTableRows) * max_blocks_, padding_blocks,
                        sizeof padding_blocks, cudaMemcpyHostToDevice));
  for (int row = kMaxTableRows - 1; row >= 0; --row) free_table_rows_.push_back(row);
  ensure_capacity(kMaxGraphBatch * 8, kMaxGraphBatch);
}

CudaTarget::~CudaTarget() {
  for (auto& [shape, graph] : graphs_) cudaGraphExecDestroy(graph);
  if (taps_written_) cudaEventDestroy(taps_written_);
  if (ring_written_) cudaEventDestroy(ring_written_);
  if (ring_stream_) cudaStreamDestroy(ring_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

const SequenceState& CudaTarget::state(int sequence) const {
  auto found = sequences_.find(sequence);
  DSPARK_CHECK(found != sequences_.end(), "unknown sequence ", sequence);
  return found->second;
}

int CudaTarget::create_sequence(int capacity) {
  DSPARK_CHECK(capacity > 0 && capacity <= config_.max_positions, "sequence capacity ", capacity,
               " is outside the model's context of ", config_.max_positions, " positions");
  DSPARK_CHECK(!free_table_rows_.empty(), "more than ", kMaxTableRows, " sequences at once");
  SequenceState sequence;
  sequence.capacity = capacity;
  sequence.table_row = free_table_rows_.back();
  free_table_rows_.pop_back();
  sequences_.emplace(next_sequence_, std::move(sequence));
  return next_sequence_++;
}

void CudaTarget::release_sequence(int sequence) {
  SequenceState& released = state(sequence);
  free_blocks_.insert(free_blocks_.end(), released.blocks.begin(), released.blocks.end());
  free_table_rows_.push_back(released.table_row);
  sequences_.erase(sequence);
}

void CudaTarget::truncate_sequence(int sequence, int length) {
  SequenceState& truncated = state(sequence);
  DSPARK_CHECK(length >= 0 && length <= truncated.length, "cannot truncate a sequence of length ",
               truncated.length, " to ", length);
  truncated.length = length;
  // One block past the length stays: a verify block that crossed into it and
  // was rejected comes right back next round, and giving the block back and
  // taking it again costs a block-table upload each time.
  const size_t keep = std::min(truncated.blocks.size(), static_cast<size_t>(ceil_div(length, kBlockSize)) + 1);
  free_blocks_.insert(free_blocks_.end(), truncated.blocks.begin() + keep, truncated.blocks.end());
  truncated.blocks.resize(keep);
}

void CudaTarget::ensure_blocks(SequenceState& sequence, int length) {
  const size_t needed = static_cast<size_t>(ceil_div(length, kBlockSize));
  const size_t first_new = sequence.blocks.size();
  if (needed <= first_new) return;
  DSPARK_CHECK(free_blocks_.size() >= needed - first_new, "the GPU KV cache is full (", pool_blocks_, " blocks of ",
               kBlockSize, " tokens)");
  while (sequence.blocks.size() < needed) {
    sequence.blocks.push_back(free_blocks_.back());
    free_blocks_.pop_back();
  }
  CUDA_CHECK(cudaMemcpyAsync(block_tables_.data() + static_cast<size_t>(sequence.table_row) * max_blocks_ + first_new,
                             sequence.blocks.data() + first_new, (needed - first_new) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
}

// A buffer's new size when `needed` exceeds `current`: grown by half at
// least, since every growth drops the captured graphs, and a run's prefills of
// a few hundred tokens more each time (a benchmark's batches, a server's)
// would otherwise drop them at each new maximum.
long grown_size(long needed, long current) { return std::max(needed, current + current / 2); }

void CudaTarget::ensure_capacity(long tokens, long sequences) {
  if (tokens <= max_tokens_ && sequences <= max_sequences_) return;
  if (tokens > max_tokens_) max_tokens_ = grown_size(tokens, max_tokens_);
  max_sequences_ = std::max(sequences, max_sequences_);
  const ModelConfig& c = config_;
  const long T = max_tokens_, H = c.hidden_size, q_size = long(c.num_heads) * c.head_dim;
  layout_ = StepLayout(T, max_sequences_);
  staging_.resize(layout_.words);
  metadata_.resize(layout_.words);
  residual_.resize(T * H);
  normed_.resize(T * H);
  qkv_.resize(T * qkv_width_);
  queries_.resize(T * q_size);
  attention_.resize(T * q_size);
  projected_.resize(T * H);
  gate_up_.resize(T * 2 * c.intermediate_size);
  activated_.resize(T * c.intermediate_size);
  head_input_.resize(T * H);
  logits_.resize(T * c.vocab_size);
  chosen_.resize(T);
  nll_.resize(T);
  chosen_host_.resize(T);
  nll_host_.resize(T);
  forget_graphs();  // every captured graph points at the old buffers
}

void CudaTarget::forget_graphs() {
  for (auto& [shape, graph] : graphs_) cudaGraphExecDestroy(graph);
  graphs_.clear();
  eager_runs_.clear();
}

int CudaTarget::attention_splits(int longest_sequence) const {
  // Splits sit at fixed positions (cuda::kSplitTiles tiles each, so decode and
  // verify reduce alike); the count is rounded up to a power of two so that a
  // captured graph serves a growing context until it doubles. At least two,
  // even where one covers the batch: one split runs the scalar kernel, more
  // the tensor-core one (attention.cu), and a row must get the same kernel
  // whatever the length of the longest sequence beside it.
  const int needed = ceil_div(longest_sequence, cuda::kSplitTiles * kBlockSize);
  return static_cast<int>(std::bit_ceil(unsigned(std::max(needed, 2))));
}

void CudaTarget::ensure_split_capacity(const StepShape& shape) {
  const ModelConfig& c = config_;
  if (shape.splits <= 1) return;
  const long row_heads = long(shape.splits) * shape.tokens * c.num_heads;
  const long counters = cuda::attention_counters(shape.sequences, shape.max_query_length, c.num_heads, c.num_kv_heads);
  bool grown = false;
  if (long(partial_lse_.size()) < row_heads) {
    const long capacity = grown_size(row_heads, long(partial_lse_.size()));
    partial_out_.resize(capacity * c.head_dim);
    partial_lse_.resize(capacity);
    grown = true;
  }
  if (long(attention_counters_.size()) < counters) {
    attention_counters_.resize(grown_size(counters, long(attention_counters_.size())));
    CUDA_CHECK(cudaMemset(attention_counters_.data(), 0, attention_counters_.bytes()));
    grown = true;
  }
  if (grown) forget_graphs();  // they point at the old buffers
}

void CudaTarget::forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) {
  DSPARK_CHECK(!inputs.empty(), "a forward needs at least one sequence");
  // One long sequence (a prefill or a perplexity window) runs in chunks.
  if (inputs.size() == 1 && long(inputs[0].tokens.size()) > kMaxChunkTokens) {
    const TargetInput& input = inputs[0];
    TargetResult part;
    result = TargetResult{};
    const size_t total = input.tokens.size();
    for (size_t begin = 0; begin < total; begin += kMaxChunkTokens) {
      const size_t count = std::min<size_t>(kMaxChunkTokens, total - begin);
      const bool last = begin + count == total;
      if (!input.all_rows && !last) {  // rows of this chunk produce no output: still run it
        TargetInput chunk{input.sequence, input.tokens.subspan(begin, count), false};
        TargetRequest silent;  // (taps on the host: each chunk overwrites the device buffer)
        silent.taps = request.taps;
        forward_chunk({&chunk, 1}, silent, part);
        result.taps.insert(result.taps.end(), part.taps.begin(), part.taps.end());
        continue;
      }
      TargetInput chunk{input.sequence, input.tokens.subspan(begin, count), input.all_rows};
      TargetRequest piece = request;
      piece.taps_on_device = false;
      const size_t row_begin = input.all_rows ? begin : 0, rows = input.all_rows ? count : 1;
      if (!request.uniforms.empty()) piece.uniforms = request.uniforms.subspan(row_begin, rows);
      if (!request.score_tokens.empty()) piece.score_tokens = request.score_tokens.subspan(row_begin, rows);
      forward_chunk({&chunk, 1}, piece, part);
      result.tokens.insert(result.tokens.end(), part.tokens.begin(), part.tokens.end());
      result.nll.insert(result.nll.end(), part.nll.begin(), part.nll.end());
      result.logits.insert(result.logits.end(), part.logits.begin(), part.logits.end());
      result.taps.insert(result.taps.end(), part.taps.begin(), part.taps.end());
    }
    result.device_taps_serial = tap_ring_serial_;  // host taps, device_taps_intact 0: nothing of it stays
    return;
  }
  forward_chunk(inputs, request, result);
}

void CudaTarget::forward_chunk(std::span<const TargetInput> inputs, const TargetRequest& request,
                               TargetResult& result) {
  const ModelConfig& c = config_;
  for (int tap : request.taps)
    DSPARK_CHECK(tap >= 0 && tap <= c.num_layers, "tap index ", tap, " is outside 0..", c.num_layers);
  // Real sequences first, then padding sequences up to the batch bucket (graphable steps only).
  const bool all_rows = inputs[0].all_rows;
  const bool alike = std::all_of(inputs.begin(), inputs.end(),
                                 [&](const TargetInput& input) { return input.all_rows == all_rows; });
  int real_tokens = 0, real_rows = 0, max_query_length = 0, longest_sequence = 0;
  for (const TargetInput& input : inputs) {
    const SequenceState& sequence = state(input.sequence);
    DSPARK_CHECK(!input.tokens.empty(), "a forward needs at least one token per sequence");
    DSPARK_CHECK(sequence.length + long(input.tokens.size()) <= sequence.capacity, "context full: ",
                 sequence.length, " + ", input.tokens.size(), " tokens exceed the sequence's capacity of ",
                 sequence.capacity);
    for (int32_t token : input.tokens)
      DSPARK_CHECK(token >= 0 && token < c.vocab_size, "token id ", token, " is outside the vocabulary of ",
                   c.vocab_size);
    real_tokens += static_cast<int>(input.tokens.size());
    real_rows += input.all_rows ? static_cast<int>(input.tokens.size()) : 1;
    max_query_length = std::max(max_query_length, static_cast<int>(input.tokens.size()));
    longest_sequence = std::max(longest_sequence, sequence.length + static_cast<int>(input.tokens.size()));
  }
  DSPARK_CHECK(request.sampling.greedy() || request.uniforms.size() == size_t(real_rows), "sampling needs ",
               real_rows, " uniforms, got ", request.uniforms.size());
  DSPARK_CHECK(request.score_tokens.empty() || request.score_tokens.size() == size_t(real_rows),
               "scoring needs ", real_rows, " tokens, got ", request.score_tokens.size());
  // Graphed: every sequence padded to the longest's Q tokens, where each has
  // room for them in its capacity and the pool has the blocks.
  const int Q = max_query_length;
  bool uniform = true, fits = true;
  size_t blocks_needed = 0;
  for (const TargetInput& input : inputs) {
    const SequenceState& sequence = state(input.sequence);
    uniform &= int(input.tokens.size()) == Q;
    fits &= sequence.length + Q <= sequence.capacity;
    blocks_needed += std::max<long>(0, ceil_div(sequence.length + Q, kBlockSize) - long(sequence.blocks.size()));
  }
  // Padding may at most double the step's tokens: on a large model the dummy
  // rows' FLOPs would cost more than the launches a graph saves (one row
  // drafting 7 tokens beside 63 undrafted ones would run 512 rows for 71).
  const int bucket = static_cast<int>(std::bit_ceil(unsigned(inputs.size())));  // sequences, padded
  const bool graphable = alike && request.score_tokens.empty() && inputs.size() <= size_t(kMaxGraphBatch) &&
                         Q <= kMaxGraphTokens && fits && blocks_needed <= free_blocks_.size() &&
                         (uniform || bucket * Q <= 2 * real_tokens);
  const bool padded = graphable && !uniform;
  if (padded)  // the attention's splits cover the padded lengths
    for (const TargetInput& input : inputs)
      longest_sequence = std::max(longest_sequence, state(input.sequence).length + Q);
  const int sequences = graphable ? bucket : static_cast<int>(inputs.size());
  StepShape shape;
  shape.sequences = sequences;
  shape.tokens = graphable ? sequences * Q : real_tokens;
  shape.logit_rows = !graphable ? real_rows : all_rows ? shape.tokens : sequences;
  shape.max_query_length = Q;
  shape.padded = padded;
  ensure_capacity(shape.tokens, shape.sequences);
  // Split-KV for steps of few query tokens per sequence (decode, verify: the
  // same splits for both, so they agree to the bit); a prefill chunk's many
  // query rows fill the GPU without it and would need [splits, T] partials.
  shape.splits = shape.few_tokens() ? attention_splits(longest_sequence) : 1;
  ensure_split_capacity(shape);

  // Pack the metadata.
  uint32_t* words = staging_.data();
  auto ints = [&](long offset) { return reinterpret_cast<int32_t*>(words + offset); };
  cuda::DeviceSamplingParams params{request.sampling.greedy() ? 0.0f : request.sampling.temperature,
                                    request.sampling.top_k, request.sampling.top_p};
  std::memcpy(words, &params, sizeof params);
  // Logit rows: the real ones first, in order (results are read from the
  // front), then those of dummy tokens. Tap rows: where each real token's taps are.
  int row = 0, logit_row = 0, extra_logit_row = real_rows;
  auto add_sequence = [&](int index, int table_row, int start_length, std::span<const int32_t> tokens, int length,
                          const std::vector<int32_t>& blocks, bool every_row, bool real) {
    ints(layout_.query_start)[index] = row;
    ints(layout_.query_length)[index] = length;
    ints(layout_.sequence_length)[index] = start_length + length;
    ints(layout_.table_row)[index] = table_row;
    const int own = static_cast<int>(tokens.size());
    for (int i = 0; i < length; ++i, ++row) {
      const int position = start_length + i;
      ints(layout_.tokens)[row] = i < own ? tokens[i] : 0;
      ints(layout_.positions)[row] = position;
      ints(layout_.slots)[row] = blocks[position / kBlockSize] * kBlockSize + position % kBlockSize;
      // A real sequence's last row is its own last token's; a dummy sequence's, its last.
      if (!every_row && i + 1 != (real ? own : length)) continue;
      if (real && i < own)
        ints(layout_.logit_rows)[logit_row++] = row;
      else
        ints(layout_.logit_rows)[extra_logit_row++] = row;
    }
  };
  int real_token = 0;
  for (size_t index = 0; index < inputs.size(); ++index) {
    SequenceState& sequence = state(inputs[index].sequence);
    const int own = static_cast<int>(inputs[index].tokens.size()), length = graphable ? Q : own;
    ensure_blocks(sequence, sequence.length + length);
    if (padded)
      for (int i = 0; i < own; ++i) ints(layout_.tap_rows)[real_token++] = row + i;
    add_sequence(static_cast<int>(index), sequence.table_row, sequence.length, inputs[index].tokens, length,
                 sequence.blocks, inputs[index].all_rows, true);
  }
  static const std::vector<int32_t> padding_blocks = {0, 1};  // the reserved blocks, as a block list
  for (int index = static_cast<int>(inputs.size()); index < sequences; ++index)
    add_sequence(index, kMaxTableRows, 0, {}, Q, padding_blocks, all_rows, false);
  for (int r = 0; r < real_rows; ++r) {
    reinterpret_cast<float*>(words + layout_.uniforms)[r] =
        request.uniforms.empty() ? 0.0f : static_cast<float>(request.uniforms[r]);
    ints(layout_.score_tokens)[r] = request.score_tokens.empty() ? 0 : request.score_tokens[r];
  }
  // The tap ring (see kTapRingSlots): sized for this tap width (a new width
  // starts it over: every captured graph and every row in it is stale; one
  // draft source reads a target's taps at a time).
  const long tap_width = long(request.taps.size()) * c.hidden_size;
  const bool ring = tap_width > 0 && real_tokens <= kTapRingSlotRows;
  const size_t ring_values = size_t(kTapRingSlots) * kTapRingSlotRows * tap_width;
  if (tap_width > 0 && tap_ring_.size() != ring_values) {
    tap_ring_.resize(ring_values);
    tap_ring_serial_ += kTapRingSlots;
    forget_graphs();
  }
  const int ring_slot = static_cast<int>(tap_ring_serial_ % kTapRingSlots);
  ints(layout_.tap_ring)[0] = ring_slot * kTapRingSlotRows;
  ints(layout_.tap_ring)[1] = ring ? real_tokens : 0;
  CUDA_CHECK(cudaMemcpyAsync(metadata_.data(), words, layout_.words * sizeof(uint32_t), cudaMemcpyHostToDevice,
                             stream_));

  const bool score = !request.score_tokens.empty();
  shape.taps.assign(request.taps.begin(), request.taps.end());
  const size_t tap_values = size_t(shape.tokens) * request.taps.size() * c.hidden_size;
  if (tap_values > taps_.size()) {  // room for the most tokens a step has had (ensure_capacity grows it ahead)
    taps_.resize(std::max(tap_values, size_t(max_tokens_) * request.taps.size() * c.hidden_size));
    forget_graphs();  // they point at the old buffer
  }
  if (graphable && eager_runs_[shape] >= 1 && !profiler_.enabled()) {
    auto found = graphs_.find(shape);
    if (found == graphs_.end()) {
      ++warm_up_runs_;
      found = graphs_.emplace(shape, cuda::capture_graph(stream_, [&] { run_step(shape, shape.taps, false); })).first;
    }
    CUDA_CHECK(cudaGraphLaunch(found->second, stream_));
  } else {
    run_step(shape, request.taps, score);
    if (graphable) ++eager_runs_[shape], ++warm_up_runs_;
    profiler_.finish_step(shape.tokens == profiled_tokens_ * shape.sequences);
  }
  const float* taps = taps_.data();
  if (ring) {  // the real tokens' rows, back to back in the ring
    taps = tap_ring_.data() + long(ring_slot) * kTapRingSlotRows * tap_width;
  } else if (padded && tap_width > 0) {  // the real tokens' rows, back to back
    if (packed_taps_.size() < size_t(real_tokens) * tap_width) packed_taps_.resize(size_t(shape.tokens) * tap_width);
    cuda::embedding_forward(packed_taps_.data(), taps_.data(), reinterpret_cast<const int32_t*>(metadata_.data()) +
                            layout_.tap_rows, real_tokens, static_cast<int>(tap_width), stream_);
    taps = packed_taps_.data();
  }
  CUDA_CHECK(cudaMemcpyAsync(chosen_host_.data(), chosen_.data(), real_rows * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_));
  if (score)
    CUDA_CHECK(cudaMemcpyAsync(nll_host_.data(), nll_.data(), real_rows * sizeof(float), cudaMemcpyDeviceToHost,
                               stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));

  result.tokens.assign(chosen_host_.data(), chosen_host_.data() + real_rows);
  result.nll.assign(score ? nll_host_.data() : nullptr, score ? nll_host_.data() + real_rows : nullptr);
  result.logits.clear();
  if (request.want_logits) {
    result.logits.resize(size_t(real_rows) * c.vocab_size);
    CUDA_CHECK(cudaMemcpy(result.logits.data(), logits_.data(), result.logits.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
  }
  result.taps.clear();
  result.device_taps = nullptr;
  result.device_taps_serial = tap_ring_serial_;
  result.device_taps_intact = ring ? kTapRingSlots - 1 : 0;
  if (ring) ++tap_ring_serial_;
  if (!request.taps.empty() && request.taps_on_device) {
    result.device_taps = taps;  // complete: the stream was synchronised above
  } else if (!request.taps.empty()) {
    result.taps.resize(size_t(real_tokens) * tap_width);
    CUDA_CHECK(cudaMemcpy(result.taps.data(), taps, result.taps.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  for (const TargetInput& input : inputs) state(input.sequence).length += static_cast<int>(input.tokens.size());
}

// The kernels of one forward, in order; the same sequence eager or captured.
void CudaTarget::run_step(const StepShape& shape, std::span<const int> taps, bool score) {
  const ModelConfig& c = config_;
  const int T = shape.tokens, H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int q_size = c.num_heads * c.head_dim;
  const int32_t* meta = reinterpret_cast<const int32_t*>(metadata_.data());
  const int32_t* tokens = meta + layout_.tokens;
  const int32_t* positions = meta + layout_.positions;
  const int32_t* slots = meta + layout_.slots;
  cuda::AttentionBatch batch{meta + layout_.query_start, meta + layout_.query_length, meta + layout_.sequence_length,
                             meta + layout_.table_row, block_tables_.data(), max_blocks_, shape.sequences,
                             shape.max_query_length};
  const int m = static_cast<int>(taps.size());
  const long tap_stride = long(m) * H;
  // Where tap index j (layer j's output, or L: the final normed hidden) goes, if requested.
  auto tap_slot = [&](int j) -> float* {
    for (int slot = 0; slot < m; ++slot)
      if (taps[slot] == j) return taps_.data() + long(slot) * H;
    return nullptr;
  };
  float* x = residual_.data();
  cudaStream_t s = stream_;

  cuda::StepProfiler& p = profiler_;
  p.mark("start", s);
  cuda::embedding_forward(x, embed_tokens_.data(), tokens, T, H, s);
  p.mark("embedding", s);
  cuda::rmsnorm_forward(normed_.data(), x, layers_[0].input_norm.data(), T, H, c.rms_norm_eps, s);
  p.mark("norm", s);
  for (int l = 0; l < c.num_layers; ++l) {
    const CudaLayer& w = layers_[l];
    const bool last = l + 1 == c.num_layers;
    cuda::matmul_forward(qkv_.data(), cuda::MatmulOutput::BF16, normed_.data(), w.qkv.data(), w.qkv_bias.data(), T,
                         H, qkv_width_, s);
    p.mark("qkv gemm", s);
    // Decode and verify steps: the q/k norm, RoPE and the cache append inside
    // the attention kernel (one launch and one round trip fewer per layer); a
    // prefill chunk's many rows run them once, in their own kernel.
    const cuda::AttentionRope rope{qkv_.data(),        w.q_norm.data(), w.k_norm.data(),      positions,
                                   rope_table_.data(), slots,           key_cache_[l].data(), value_cache_[l].data(),
                                   c.rms_norm_eps};
    const bool rope_in_attention = shape.few_tokens();
    if (!rope_in_attention) {
      cuda::qkv_rope_kv_append_forward(queries_.data(), qkv_.data(), w.q_norm.data(), w.k_norm.data(), positions,
                                       rope_table_.data(), key_cache_[l].data(), value_cache_[l].data(), slots, T,
                                       c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, s);
      p.mark("qk norm+rope+append", s);
    }
    cuda::attention_forward(attention_.data(), queries_.data(), key_cache_[l].data(), value_cache_[l].data(), batch, T,
                            c.num_heads, c.num_kv_heads, c.head_dim, shape.splits, partial_out_.data(),
                            partial_lse_.data(), attention_counters_.data(), s, rope_in_attention ? &rope : nullptr);
    p.mark("attention", s);
    // x += attention @ o_proj^T; normed = rms(x, post_attention_norm)
    const cuda::ResidualNorm attention_norm{.residual = x, .weight = w.post_attention_norm.data(),
                                            .normed = normed_.data(), .eps = c.rms_norm_eps,
                                            .counter = norm_counter_.data()};
    cuda::matmul_residual_rmsnorm_forward(projected_.data(), attention_.data(), w.o_proj.data(), w.o_bias.data(), T,
                                          q_size, H, attention_norm, s);
    p.mark("o gemm+add+norm", s);
    cuda::gated_matmul_forward(activated_.data(), cuda::GatedActivation::Silu, normed_.data(), w.gate_up.data(),
                               w.gate_up_bias.data(), gate_up_.data(), T, H, F, s);
    p.mark("gate|up gemm+swiglu", s);
    // x += activated @ down^T (layer l's output: tap l); normed = rms(x, the next layer's input norm, or the
    // final norm: tap L)
    const cuda::ResidualNorm mlp_norm{.residual = x,
                                      .weight = last ? final_norm_.data() : layers_[l + 1].input_norm.data(),
                                      .normed = normed_.data(), .eps = c.rms_norm_eps, .residual_tap = tap_slot(l),
                                      .normed_tap = last ? tap_slot(c.num_layers) : nullptr, .tap_stride = tap_stride,
                                      .counter = norm_counter_.data()};
    cuda::matmul_residual_rmsnorm_forward(projected_.data(), activated_.data(), w.down.data(), w.down_bias.data(), T, F,
                                          H, mlp_norm, s);
    p.mark("down gemm+add+norm", s);
  }
  // The tapped rows into the tap ring, where the step's placement says (a
  // step of more tokens than a slot holds writes none): every tap is written
  // by now, and the copy runs beside the LM head and the token's selection
  // (on the demo target the step's result waited ~1-2 us for it when it came
  // after them). The step ends when both are done.
  if (m > 0) {
    CUDA_CHECK(cudaEventRecord(taps_written_, s));
    CUDA_CHECK(cudaStreamWaitEvent(ring_stream_, taps_written_, 0));
    cuda::tap_ring_write_forward(tap_ring_.data(), meta + layout_.tap_ring,
                                 shape.padded ? meta + layout_.tap_rows : nullptr, taps_.data(),
                                 std::min(T, kTapRingSlotRows), static_cast<int>(tap_stride), ring_stream_);
    CUDA_CHECK(cudaEventRecord(ring_written_, ring_stream_));
  }
  const bf16* head_input = normed_.data();
  if (shape.logit_rows != T || shape.padded) {  // not every row in order: gather the listed ones
    cuda::gather_rows_forward(head_input_.data(), normed_.data(), meta + layout_.logit_rows, shape.logit_rows, H, s);
    head_input = head_input_.data();
  }
  cuda::matmul_forward(logits_.data(), cuda::MatmulOutput::F32, head_input, lm_head_, nullptr, shape.logit_rows, H,
                       V, s);
  p.mark("lm head gemm", s);
  cuda::select_tokens_forward(chosen_.data(), logits_.data(),
                              reinterpret_cast<const float*>(metadata_.data() + layout_.uniforms),
                              reinterpret_cast<const cuda::DeviceSamplingParams*>(metadata_.data()),
                              shape.logit_rows, V, s);
  p.mark("token selection", s);
  if (score) cuda::token_nll_forward(nll_.data(), logits_.data(), meta + layout_.score_tokens, shape.logit_rows, V, s);
  if (m > 0) CUDA_CHECK(cudaStreamWaitEvent(s, ring_written_, 0));  // the ring's copy joins the step
}

}  // namespace

std::unique_ptr<Target> make_cuda_target(const std::filesystem::path& model_directory) {
  return std::make_unique<CudaTarget>(model_directory);
}

std::optional<CudaTargetHead> cuda_target_head(const Target& target) {
  const auto* cuda_target = dynamic_cast<const CudaTarget*>(&target);
  if (!cuda_target) return std::nullopt;
  return cuda_target->head();
}

}  // namespace dspark
