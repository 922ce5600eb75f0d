// The DSpark drafter on one NVIDIA GPU: the CUDA version of spec/draft.h,
// the same math (DESIGN.md §2) with bf16 weights and f32 accumulation.
//
// Weights are uploaded once, in the layouts the kernels read: the backbone's
// matrices transposed to [out, in] bf16 for the GEMMs (k|v|q and gate|up
// fused), the head's vocabulary-wide matrices (markov.w1 / w2, rnn.wO) kept
// [in, out] bf16, and norms, block embeddings, the confidence head and the
// small recurrent matrices f32. The target's embedding and LM head are
// borrowed from the CUDA target (CudaTargetHead), never copied.
//
// Retained context: one context per request holds, for every layer, the keys
// and values of rms(Hc, attn_norm) of its rows in one device allocation
// [layers, capacity, 2d] (k | v per row), grown by doubling. extend_context()
// only stages the tapped rows (as bf16); the next draft() projects its
// requests' contexts' new rows in one batched pass (flush_contexts(): all
// contexts'). A request left undrafted (Alg 1's gate: a probe drafts one row
// of 64) keeps its rows staged until it drafts, or until all staged rows
// together pass kMaxStagedBytes and a draft projects everyone's.
// Rows come from the host (extend_context: converted there, uploaded with the
// pass) or straight from the CUDA target's device taps
// (extend_context_from_device). A device row is recorded where the target's
// forward left it (f32), and the pass that projects it reads and converts it
// there: the CUDA target keeps a verify step's taps for 63 more such steps,
// so a round that drafts launches nothing for its rows before the pass, and
// undrafted rounds launch nothing at all. Only rows that would outlive their
// place (the target's next forward may overwrite the oldest of them:
// finish_device_rows(); a request left undrafted for 63 rounds, a prefill's
// rows) are converted first, together, into one device staging area shared
// by all contexts (convert_device_rows(): one launch on the target's stream,
// its rows passed by value as runs of consecutive rows, after the forwards
// that wrote them and before any later forward overwrites them). The pass
// (on the drafter's stream) waits on one event recorded on the target's
// stream, and the first conversion after a pass that read the staging area
// waits on one recorded after it. Either way a row's bf16 bits are the same,
// so the retained context is too. Each pass size (rows padded to a power of
// two) runs as one captured CUDA graph after its first use.
//
// One draft step for B requests: the host packs the step's metadata (anchors,
// context pointers and lengths, pruning settings, sampling parameters and
// uniforms) into one pinned buffer and copies it once; the backbone runs once
// for all B*γ block rows; the head walks positions 0..γ-1 on the device
// (e_k, confidence and pruning, the head's matmuls into the logits, token
// selection: greedy fused into the vocabulary matmul as an argmax, sampling by
// select_tokens_forward; a greedy Markov step of one row that returns
// no logits reads w2 at 8 bits and forms the exact logit only of the columns
// that can hold the argmax, spec/quantized_columns.h); one copy brings back
// tokens, confidences and lengths: the only
// synchronisation of the step. A position where every row has been pruned
// skips its vocabulary-wide matmul. Steps are captured as one CUDA graph per
// batch bucket (1, 2, 4, ... 64 rows; padding rows have no context and draft
// nothing) and kind (StepKind), on its first use after it has run
// once eagerly. DSPARK_DRAFT_GRAPHS=0 runs every step eagerly;
// DSPARK_DRAFT_PROFILE=1 does too and prints the mean time of each op.
//
// Sampling: the row's uniforms are drawn from a copy of its stream; after the
// step the stream advances by the number of tokens kept, so it is consumed as
// the CPU drafter consumes it. The host recomputes each kept position's
// processed distribution q (returned in DraftResult::probs) and re-derives the
// token from q and the same uniform; where float rounding made the GPU pick a
// different token, the host's token is kept and the draft ends there, so every
// drafted token is exactly a draw from the q it is verified against.
//
// Shape letters: B rows, γ block, d draft width, H target hidden, V vocab,
// m taps, r head rank, L drafter layers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <vector>

#include "kernels/cuda/buffer.h"
#include "kernels/cuda/draft.h"
#include "kernels/cuda/head_timeline.h"
#include "kernels/cuda/quantized_product.h"
#include "kernels/cuda/step_profiler.h"
#include "model/cuda_target.h"
#include "spec/draft.h"

namespace dspark {

struct CudaDraftRequest {
  int context;     // from CudaDrafter::create_context()
  int32_t anchor;  // the last token the target has accepted (its row is not in the context yet)
  Rng* rng;        // this row's stream, drawn from only when sampling
};

class CudaDrafter {
 public:
  // Uploads `drafter` (not read afterwards); `head` must outlive the drafter.
  CudaDrafter(const Drafter& drafter, const CudaTargetHead& head);
  ~CudaDrafter();
  CudaDrafter(const CudaDrafter&) = delete;
  CudaDrafter& operator=(const CudaDrafter&) = delete;

  const DrafterConfig& config() const { return config_; }
  // Passes so far that ran a shape eagerly and captured it (Target::warm_up_runs).
  long warm_up_runs() const { return warm_up_runs_; }
  const TargetDims& dims() const { return dims_; }
  cudaStream_t stream() const { return stream_; }

  int create_context();
  void release_context(int context);
  int context_length(int context) const;  // rows, staged ones included
  // Appends `count` context rows: tapped_rows [count, m*H] (host, f32), each
  // the m tapped target rows of one token concatenated on features.
  void extend_context(int context, const float* tapped_rows, int count);
  // The same from device_rows [count, m*H] f32 in device memory, written by
  // work on the target's stream (head.stream: a CUDA target's
  // TargetResult::device_taps). Records them; the next pass reads them there,
  // or convert_device_rows() converts them first, and the rows must stay as
  // they are until then.
  void extend_context_from_device(int context, const float* device_rows, int count);
  // Queues the conversion of every recorded device row, in one launch on the
  // target's stream: after it returns the rows may be overwritten by anything
  // queued there.
  void convert_device_rows();
  // After a round's device rows are recorded, before the target's next
  // forward, with the serial and lifetime of the forward that wrote them
  // (TargetResult::device_taps_serial, device_taps_intact): converts the
  // recorded rows when that forward may overwrite the oldest of them, else
  // leaves them for later (the next draft converts them anyway).
  void finish_device_rows(long serial, int intact);
  void truncate_context(int context, int length);
  // Projects every staged row into its context now (draft() does this first
  // for its requests' contexts).
  void flush_contexts();
  // One context's retained keys and values of `layer`, [length, d] each (for tests).
  void read_context(int context, int layer, std::vector<float>& keys, std::vector<float>& values);

  // Drafts for every request, as spec/draft.h's draft() (the same options and results).
  void draft(std::span<const CudaDraftRequest> requests, const DraftOptions& options,
             std::vector<DraftResult>& results);

  // Benchmarks: when on, each step's device time (metadata copy, kernels,
  // results copy) is measured with CUDA events; last_step_milliseconds() is
  // that of the last step (of the last chunk of 64 rows).
  void enable_step_timing(bool on);
  float last_step_milliseconds() const;
  // Greedy Markov drafting runs its head in one launch where w2 fits on chip
  // (markov_head_forward), and so do greedy tokens-only steps of one row
  // where w2's 8-bit columns do (markov_head_tokens_forward); off, they take
  // the per-position kernels there too (tests: both give the same bits).
  void use_one_launch_head(bool on);
  // Greedy Markov steps of one row that return no logits read w2 at
  // 8 bits and form the exact logit only where the argmax can be; off, they
  // form every logit (benchmarks: both give the same tokens).
  void use_quantized_head(bool on);
  // On by default: those steps also bound the LM head's logits from its product with out_proj at 8 bits
  // (kernels/cuda/quantized_product.h), made when first switched on (155 MB at Qwen3-8B's shape), and form
  // them only where the argmax can be; off, they run its product over the whole vocabulary (tests: the same
  // tokens).
  void use_quantized_lm_head(bool on);

 private:
  using bf16 = __nv_bfloat16;
  struct Layer {
    cuda::DeviceBuffer<float> attention_norm, ff_norm;  // [d]
    cuda::DeviceBuffer<bf16> kvq;                       // [3d, d]: k, v, q, each [out, in]
    cuda::DeviceBuffer<bf16> o;                         // [d, d]
    cuda::DeviceBuffer<bf16> gate_up;                   // [2fd, d]: gate then up
    cuda::DeviceBuffer<bf16> down;                      // [d, fd]
  };
  struct Context {
    cuda::DeviceBuffer<bf16> storage;  // [L, capacity, 2d]: row p of layer l is k | v
    int capacity = 0;
    int length = 0;                       // rows in storage
    std::vector<int32_t> staged_sources;  // one per staged row (not yet projected), in order: its row in
                                          // device_staged_, or kHostRow (the next row of `staged`)
    std::vector<uint16_t> staged;         // [host-staged rows, m*H] bf16 bits
    int staged_rows() const { return static_cast<int>(staged_sources.size()); }
  };
  static constexpr int32_t kHostRow = -1;
  // One staged row of an extension pass: where it goes and where it comes from.
  struct ExtensionRow {
    Context* context;
    int position;
    const uint16_t* host_taps;  // bf16 bits on the host, or null: the row comes from `device`
    cuda::TapRowSource device;
  };
  // Byte offsets of one step's metadata for batches of up to `rows` rows; the
  // per-row arrays are indexed with the bucket's own row count.
  struct StepLayout {
    long keys = 0, values = 0, control = 0, sampling = 0, anchors = 0, lengths = 0, limits = 0, uniforms = 0, bytes = 0;
    StepLayout() = default;
    StepLayout(int rows, int gamma, int layers);
  };

  Context& context(int id);
  const Context& context(int id) const;
  // flush_contexts() for the requests' contexts (all when there are none).
  void flush_contexts_of(std::span<const CudaDraftRequest> requests);
  void grow_context(Context& context, int rows);
  void wait_for_extend_staging();
  void ensure_device_staging(int rows);
  void ensure_rows(int rows);
  int attention_splits(int rows) const;
  void draft_chunk(std::span<const CudaDraftRequest> requests, const DraftOptions& options, int limit,
                   const std::vector<float>& thresholds, std::span<DraftResult> results);
  // What a step computes: sampled; greedy with every kept position's logits; greedy tokens only.
  enum class StepKind { Sampled, GreedyLogits, GreedyTokens };
  void run_step(int rows, StepKind kind);
  cuda::QuantizedRows lm_head_quantized() const;
  void run_extension(int padded);
  // The work `work` queues on the drafter's stream, captured (not run) as a CUDA graph.
  cudaGraphExec_t capture(const std::function<void()>& work);

  DrafterConfig config_;
  TargetDims dims_;
  CudaTargetHead head_;
  cuda::SequentialHeadKind kind_ = cuda::SequentialHeadKind::Markov;
  int width_ = 0;  // m*H: one context row's tapped features
  int inner_ = 0;  // f*d
  int head_dim_ = 0;
  int multiprocessors_ = 0;
  cudaStream_t stream_ = nullptr;
  bool use_graphs_ = true;
  long warm_up_runs_ = 0;
  bool one_launch_head_ = true;
  bool quantized_head_ = true;
  bool quantized_lm_head_ = false;

  // Weights.
  std::vector<Layer> layers_;
  cuda::DeviceBuffer<bf16> context_projection_;                    // [d, m*H] W_c
  // Every layer's k | v with the layer's attention norm weight folded in,
  // [L * 2d, d]: rms(Hc, w_l) @ k_l = (Hc / rms(Hc)) @ (diag(w_l) k_l), so one
  // product projects a context row for all layers.
  cuda::DeviceBuffer<bf16> context_keys_values_;
  cuda::DeviceBuffer<float> ones_;                                 // [d]: the unweighted norm
  cuda::DeviceBuffer<bf16> token_projection_;                      // [d, H] tok_proj
  cuda::DeviceBuffer<bf16> out_projection_;                        // [H, d] out_proj
  cuda::DeviceBuffer<float> context_norm_, out_norm_;              // [d]
  cuda::DeviceBuffer<float> mask_embedding_, block_position_;      // [γ-1, d], [γ, d]
  cuda::DeviceBuffer<bf16> head_embedding_;                        // [V, r] markov.w1
  cuda::DeviceBuffer<bf16> head_out_;                              // [r, V] markov.w2 (Markov, GRU) or rnn.wO
  // markov.w2 for greedy steps without logits (Markov head, r a multiple of 8; spec/quantized_columns.h),
  // 3 bytes per weight beside head_out_'s 2 (117 MB at Qwen3-8B's vocabulary and r 256):
  cuda::DeviceBuffer<uint8_t> quantized_values_;                   // [r, stride] 8-bit columns
  cuda::DeviceBuffer<float> quantized_scales_, quantized_bounds_;  // [V]
  cuda::DeviceBuffer<bf16> quantized_exact_;                       // [V, r] slice-major columns
  int quantized_stride_ = 0;                                       // 0: none
  // The target's LM head through out_proj, M = lm_head @ out_proj, at 8 bits for those steps (use_quantized_lm_head;
  // where H is a multiple of 32 and γ at most 8; kernels/cuda/quantized_product.h): 1 byte per weight of [V, d]
  // (155 MB at Qwen3-8B's shape); the logits' intervals go into logits_.
  cuda::DeviceBuffer<int8_t> lm_head_values_;                                  // [V, d]
  cuda::DeviceBuffer<float> lm_head_scales_, lm_head_bounds_, lm_head_norms_;  // [V]
  cuda::DeviceBuffer<unsigned> lm_head_largest_norm_;               // [1] the largest ||lm_head_v||, f32 bits
  cuda::DeviceBuffer<double> reach_sums_;                           // [2, 8] lm_head_projection_reach_forward's scratch
  cuda::DeviceBuffer<unsigned> reach_finished_;                     // [1]
  cuda::DeviceBuffer<int8_t> activation_values_;                    // [2, 8, d] out_proj's input x_k, two levels
  cuda::DeviceBuffer<float> activation_scales_, activation_norms_;  // [8], [3, 8]
  cuda::DeviceBuffer<float> recurrent_, recurrent_bias_;           // rnn.wH [r, r], bH [r] / gru.wJ [2r+d, 3r], bJ [3r]
  cuda::DeviceBuffer<float> confidence_weight_, confidence_bias_;  // [d + r], [1]
  cuda::DeviceBuffer<float> token_confidence_;                     // [V] w1[v] . conf.w[d:] (Markov head)
  cuda::DeviceBuffer<float> temperatures_;                         // [γ]

  // Retained contexts and the batched pass that extends them.
  std::map<int, Context> contexts_;
  int next_context_ = 0;
  // Storage of released contexts (and the smaller one a context grew out of),
  // reused by the next context that needs as much: a cudaFree per request
  // waited for the whole device (the target's forward in flight included).
  // Safe without a synchronisation: storage is only read and written by work
  // on stream_, so a new owner's writes queue after the old owner's reads.
  // At most peak_contexts_ kept (then the smallest goes).
  std::vector<cuda::DeviceBuffer<bf16>> spare_storage_;
  size_t peak_contexts_ = 0;
  cuda::DeviceBuffer<bf16> take_storage(size_t count);  // a spare of at least `count`, or a new one
  void keep_spare_storage(cuda::DeviceBuffer<bf16> storage);
  long extend_sources_offset_ = 0;  // byte offset of each row's source (kernels/cuda/draft.h) in the extension staging
  long extend_taps_offset_ = 0;     // byte offset of the tapped rows in the extension staging
  cuda::PinnedBuffer<unsigned char> extend_staging_;
  cuda::DeviceBuffer<unsigned char> extend_metadata_;           // destinations [rows, L], then tapped rows [rows, m*H]
  cuda::DeviceBuffer<float> extend_projected_, extend_hidden_;  // [rows, d]
  cuda::DeviceBuffer<bf16> extend_normed_, extend_kv_;          // [rows, d], [rows, L * 2d]
  bool extend_in_flight_ = false;                               // a copy from extend_staging_ may not have run yet
  // Rows staged from the target's device taps, for all contexts, until the next pass.
  cuda::DeviceBuffer<bf16> device_staged_;  // [capacity, m*H]
  int device_staged_rows_ = 0;              // rows written (truncated ones included) since the last pass
  cudaEvent_t device_staged_written_ = nullptr;  // recorded on the target's stream before a pass reads the rows
  cudaEvent_t device_staged_read_ = nullptr;     // recorded on the drafter's stream after a pass read them
  bool device_staged_read_pending_ = false;      // the next conversion must wait on device_staged_read_
  // Device rows accepted but not yet converted (the last pending_sources_.size()
  // rows of device_staged_): one gather-convert launch for all of them.
  std::vector<const float*> pending_sources_;
  long pending_serial_ = -1;      // the device_taps_serial of the oldest of them (-1: not yet told)
  std::vector<int> flushed_ids_;  // flush_contexts_of's requests' contexts, sorted (kept to reuse its storage)
  std::vector<ExtensionRow> extension_rows_;  // flush_contexts_of's rows (likewise)

  // The draft step, sized for max_rows_ rows (γ * max_rows_ block rows).
  int max_rows_ = 0;
  StepLayout layout_;
  cuda::PinnedBuffer<unsigned char> staging_;
  cuda::DeviceBuffer<unsigned char> metadata_;
  cuda::DeviceBuffer<bf16> anchor_rows_, normed_, kvq_, attention_, projected_, gate_up_, activated_, head_input_;
  cuda::DeviceBuffer<float> token_rows_, block_, hidden_, logits_, partial_out_, partial_lse_;
  cuda::DeviceBuffer<float> e_, state_, recurrent_input_, recurrent_pre_, head_output_;
  cuda::DeviceBuffer<float> hidden_logits_;  // [γ, B] h_k . conf.w[:d] (Markov head, per position)
  cuda::DeviceBuffer<int32_t> results_;  // tokens [γ, B], confidence [γ, B] (f32 bits), count [B]
  cuda::DeviceBuffer<int32_t> alive_, alive_rows_;
  cuda::DeviceBuffer<unsigned long long> argmax_keys_;  // [γ, B] greedy token selection
  cuda::DeviceBuffer<unsigned> lower_keys_;  // [γ + 1] the intervals' best lower ends, then the one-launch tokens
                                             // head's barrier counter; zeroed each step
  cuda::DeviceBuffer<unsigned> counters_;
  cuda::DeviceBuffer<unsigned> norm_counter_;  // the fused GEMV + norm's block count, 0 between launches
  cuda::DeviceBuffer<unsigned> head_barrier_;  // the one-launch Markov head's grid barrier (arrived, generation)
  cuda::PinnedBuffer<int32_t> results_host_;
  cuda::PinnedBuffer<float> logits_host_;
  std::vector<double> uniforms_;  // [γ, B] this step's uniforms, as drawn
  std::vector<int32_t> order_;
  std::map<std::pair<int, StepKind>, cudaGraphExec_t> graphs_;  // per (batch bucket, kind)
  std::map<int, cudaGraphExec_t> extend_graphs_;                // extension passes, per padded row count
  cudaEvent_t step_start_ = nullptr, step_stop_ = nullptr;  // set while step timing is on
  cuda::StepProfiler profiler_{"DSPARK_DRAFT_PROFILE", "draft profile"};  // on: every step eager, per-op times
  cuda::HeadTimeline head_timeline_;  // DSPARK_HEAD_TIMELINE=1: the one-launch tokens head's inner times
};

}  // namespace dspark
