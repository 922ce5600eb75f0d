// The DSpark drafter's own small ops on the GPU (CUDA versions of the pieces
// of spec/draft.cpp that are not a matmul, norm or attention): the block rows,
// the sequential head's per-position work with confidence and pruning, the
// recurrent state updates, and the scatter of new context rows into each
// request's retained context.
//
// Shape letters: B rows (requests), γ block, d draft width, r head rank,
// V vocab. Block positions are position-major: position k of row b is row
// k*B + b, so one position of every row is a contiguous [B, ...] slice.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dspark::cuda {

constexpr int kMaxDraftGamma = 32;

// block [γ*B, d]: row k*B + b = (k == 0 ? token_rows[b] : mask_embedding[k-1]) + block_position[k].
// token_rows [B, d] = embed(anchor) @ tok_proj; mask_embedding [γ-1, d]; block_position [γ, d].
void draft_block_forward(float* block, const float* token_rows, const float* mask_embedding,
                         const float* block_position, int rows, int gamma, int dim, cudaStream_t stream);

enum class SequentialHeadKind { Markov = 0, Rnn = 1, Gru = 2 };

// Pruning settings of one draft step, in device memory (so one captured graph
// serves every setting).
struct DraftControl {
  float min_confidence;              // a uniform threshold; 0: none
  int32_t has_thresholds;            // whether thresholds[] applies
  float thresholds[kMaxDraftGamma];  // [γ] keep position k only if c_k >= thresholds[k]
};

struct SequentialHeadWeights {
  const __nv_bfloat16* embedding;  // [V, r] markov.w1: e_k = embedding[x_{k-1}]
  const float* confidence_weight;  // [d + r] conf.w
  const float* confidence_bias;    // [1] conf.b
  const float* temperatures;       // [γ] the STS temperature of each position's confidence logit (1: none)
  const float* token_confidence = nullptr;  // [V] w1[v] . conf.w[d:] (markov_position_forward only)
};

// What the head reads and writes across positions (device memory).
struct SequentialHeadState {
  const int32_t* anchors;                 // [B] x_{-1}
  const int32_t* limits;                  // [B] positions a row may draft (0: a padding row)
  int32_t* tokens;                        // [γ, B] x_k, written by token selection (sampling)
  const unsigned long long* argmax_keys;  // [γ, B] greedy: x_k = argmax_index(key) (matmul_in_out_argmax_forward);
                                          // null: x_k is read from tokens
  float* confidence;                      // [γ, B] c_k
  int32_t* alive;                         // [B] 1 while the row is still drafting
  int32_t* count;                         // [B] positions kept: the draft's length
  int32_t* alive_rows;                    // [γ] rows still drafting at position k (zeroed before position 0)
};

// Position k of the sequential head for every row, before its matmuls:
// e_k = w1[x_{k-1}] into e [B, r]; c_k = σ(([h_k; e_k] @ conf.w + conf.b) / T_k);
// pruning: a row stops at the first k >= 1 with c_k below its threshold or
// min_confidence, or at k = limit (position 0 is always kept, as on the CPU).
// Recurrent heads: at k = 0 the state [B, r] is zeroed; the GRU's input
// z = [s_{k-1}; e_k; h_k] is written to recurrent_input [B, 2r + d].
// hidden [γ*B, d] f32 is h (position-major).
void sequential_head_prepare_forward(float* e, float* recurrent_input, float* state, const float* hidden, int position,
                                     int rows, int rank, int width, int vocab, SequentialHeadKind kind,
                                     const SequentialHeadWeights& weights, const DraftControl* control,
                                     const SequentialHeadState& head, cudaStream_t stream);

// Position k of the Markov head for every row in one launch: what
// sequential_head_prepare_forward and matmul_in_out_argmax_forward (greedy;
// matmul_in_out_forward when sampled) do at k, with the same logits and keys
// for every (row, position) kept, and confidences equal up to the order of
// their dot product's sum (c_k's logit is (h_k . conf.w[:d] +
// weights.token_confidence[x_{k-1}] + conf.b) / T_k). The product is skipped
// for rows no longer drafting, so a pruned row's later logits and keys are
// left unspecified (they are never read). logits [B, V]: position k's,
// holding U_k; argmax_keys [γ, B] (zeroed before position 0): greedy, x_{k-1}
// read at k - 1 and position k's keys written; null: sampled, x_{k-1} read
// from head.tokens. hidden_logits [γ, B]: written at position 0 (h_k .
// conf.w[:d] for every k), read after. head.alive_rows zeroed before
// position 0; head.argmax_keys is not read.
void markov_position_forward(float* logits, unsigned long long* argmax_keys, const __nv_bfloat16* w2,
                             const float* hidden, float* hidden_logits, int position, int rows, int gamma, int rank,
                             int width, int vocab, const SequentialHeadWeights& weights, const DraftControl* control,
                             const SequentialHeadState& head, cudaStream_t stream);

// markov.w2 as markov_position_tokens_forward reads it (spec/quantized_columns.h
// makes it): 8-bit columns, a scale and a bound each, and the exact columns.
struct QuantizedColumnsView {
  const uint8_t* values;       // [r, stride] q + 128, w2[i, v] ~ scales[v] * q[i, v]
  int stride;                  // values' row length, a multiple of 16
  const float* scales;         // [V]
  const float* bounds;         // [V] |e . w2[:, v] - scales[v] e . q[:, v]| <= bounds[v] ||e||_2
  const __nv_bfloat16* exact;  // [V, r] w2[:, v], feature s + 8j at s * r/8 + j
  float slack;                 // relative slack for f32 rounding in the bounds
};

// The LM head's logits U_k when its product did not run, as intervals
// (quantized_product.h), with what it takes to form a column's exact logit:
// the bits of the LM head's tensor-core GEMV (matmul_forward at up to
// kRowInvariantRows rows, tensor_gemv.cuh).
constexpr int kMaxIntervalHidden = 12288;  // the largest H markov_position_tokens_forward takes as intervals
struct LmHeadIntervals {
  const float* centers;           // [γ, V] quantized_rows_product_forward's
  const float* row_bounds;        // [V] QuantizedRows::bounds
  const float* row_norms;         // [V] QuantizedRows::norms
  const float* activation_norms;  // [3, 8] QuantizedActivations::norms of the rows the centers come from (h_k, or
                                  // out_proj's input: quantized_product.h)
  const __nv_bfloat16* weight;    // [V, H] the LM head
  const __nv_bfloat16* hidden;    // [γ, H] its input rows h_k
  int hidden_size;                // H, a multiple of 32, at most kMaxIntervalHidden
  unsigned* lower_keys;           // [γ] zeroed before position 0: the best lower end over all blocks
  unsigned* barrier;              // two unsigned, zeroed once, left as they were found
};

// Position k of the greedy Markov head for one row, tokens only:
// markov_position_forward's e_k, c_k, pruning and x_k (the same argmax keys,
// bit for bit), without writing the logits. Each block bounds its columns'
// logits from the 8-bit columns, then forms the exact logit (the full
// product's sums, in its order) only for the columns whose upper bound
// reaches the best lower bound and the best key found so far; those keys go
// into argmax_keys. lm_head null: logits [1, V] hold U_k (read only), and a
// block compares with its own best lower bound. lm_head given: U_k is an
// interval too (logits is not read); the blocks meet at a grid barrier to
// compare with the best lower bound of all, and form U_k exactly where the
// argmax can be. Needs rows = 1 and r a multiple of 8.
void markov_position_tokens_forward(unsigned long long* argmax_keys, const float* logits,
                                    const QuantizedColumnsView& w2, const LmHeadIntervals* lm_head, const float* hidden,
                                    float* hidden_logits, int position, int rows, int gamma, int rank, int width,
                                    int vocab, const SequentialHeadWeights& weights, const DraftControl* control,
                                    const SequentialHeadState& head, cudaStream_t stream);

// The greedy Markov head's γ positions for every row in one launch, with the
// results of sequential_head_prepare_forward, matmul_in_out_argmax_forward
// (e_k @ w2 added into logits [γ*B, V], which hold the LM head's logits) and
// argmax_tokens_forward at each position: the same logits, keys and tokens,
// and confidences equal up to the order of their dot product's sum. Blocks
// meet at a grid barrier after each position and keep their share of w2 on
// chip across positions. argmax_keys [γ, B] zeroed before; barrier: two
// unsigned, zeroed once, left as they were found. Supported
// (markov_head_supported): rank and vocab multiples of 8, w2 16-byte aligned,
// γ <= kMaxDraftGamma, and each block's share of w2 (with B rows' scratch)
// within its registers and shared memory: the demo drafter's 1 MB, not
// Qwen3-8B's 78 MB.
bool markov_head_supported(int rows, int gamma, int rank, int vocab, const __nv_bfloat16* w2);
void markov_head_forward(float* logits, unsigned long long* argmax_keys, const __nv_bfloat16* w2, const float* hidden,
                         int rows, int gamma, int rank, int width, int vocab, const SequentialHeadWeights& weights,
                         const DraftControl* control, const SequentialHeadState& head, unsigned* barrier,
                         cudaStream_t stream);

// markov_position_tokens_forward for every position of a greedy step of one
// row in one persistent launch, and the tokens: head.tokens [γ] from
// argmax_keys [γ] (zeroed before, as lm_head->lower_keys). w2's 8-bit
// columns are read once a step and kept on chip (one block a multiprocessor,
// each with its share of the vocabulary); the blocks meet at a grid barrier
// after each position (and, with lm_head, once before each position's exact
// logits). The same keys and tokens, bit for bit, as the per-position kernels.
// counter: one unsigned, zeroed before each launch. Supported
// (markov_head_tokens_supported, hidden_size 0 without lm_head): r a multiple
// of 8 and each block's share of w2 and its scratch on chip: Qwen3-8B's
// vocabulary (39 MB at r 256) on a device of 132 multiprocessors.
bool markov_head_tokens_supported(int rank, int vocab, int stride, int hidden_size);
void markov_head_tokens_forward(unsigned long long* argmax_keys, const float* logits, const QuantizedColumnsView& w2,
                                const LmHeadIntervals* lm_head, const float* hidden, float* hidden_logits, int gamma,
                                int rank, int width, int vocab, const SequentialHeadWeights& weights,
                                const DraftControl* control, const SequentialHeadState& head, unsigned* counter,
                                cudaStream_t stream);

// Where markov_head_tokens_forward's time goes (a development tool,
// kernels/cuda/head_timeline.h). With stamps set (nullptr: off, the default),
// thread 0 of each block keeps its SM's clock (low 32 bits) in shared memory:
// at the start (slot 0), with the weights on chip (1), and at each step of the
// first kHeadTimelinePositions positions (slot 2 + k * kHeadTimelineStages +
// stage; stages: 0 start, 1 verdict, 2 e16, 3 sums (thread 0's), 4 bounds,
// 5 first barrier, 6 candidates listed, 7 their U, 8 their keys, 9 second
// barrier). At the end it writes them to stamps[b * kHeadTimelineSlots ...],
// then %globaltimer at the start and the end and the clock at the end (which
// place the clocks in global time), then each position's candidate count.
// On, the stamps add ~0.09 ms to the 8B draft step (~1 us a stamp, cause not
// found): read the stages for where the time goes, not as absolute costs.
constexpr int kHeadTimelineStages = 10, kHeadTimelinePositions = 8;
constexpr int kHeadTimelineClockSlots = 2 + kHeadTimelinePositions * kHeadTimelineStages;
constexpr int kHeadTimelineGlobalStart = kHeadTimelineClockSlots, kHeadTimelineGlobalEnd = kHeadTimelineClockSlots + 1,
              kHeadTimelineClockEnd = kHeadTimelineClockSlots + 2, kHeadTimelineCounts = kHeadTimelineClockSlots + 3;
constexpr int kHeadTimelineSlots = kHeadTimelineCounts + kHeadTimelinePositions;
void set_markov_head_timeline(unsigned long long* stamps);

// The recurrent state update after the recurrent matmul, for every row:
// RNN: state = tanh(pre + e) (pre = s @ wH + bH, [B, r]);
// GRU: g, c, o = split3(pre) (pre = z @ wJ + bJ, [B, 3r]); keep = σ(g);
// state = keep * state + (1 - keep) * tanh(c); output = tanh(o) [B, r].
void recurrent_update_forward(float* state, float* output, const float* pre, const float* e, int rows, int rank,
                              SequentialHeadKind kind, cudaStream_t stream);

// destinations[i] (width elements) = rows[i]; null destinations are skipped.
// Writes new context rows into each request's retained context.
void scatter_rows_forward(__nv_bfloat16* const* destinations, const __nv_bfloat16* rows, int count, int width,
                          cudaStream_t stream);

// out[i] = bf16(in[i]) for count values, rounded to nearest even with NaNs kept
// NaN exactly as the host's f32_to_bf16 (core/dtype.h): the bits of target
// taps converted here equal those converted on the host.
void f32_to_bf16_forward(__nv_bfloat16* out, const float* in, long count, cudaStream_t stream);

// Runs of tap rows to convert: run i is rows [first_block[i], first_block[i + 1])
// of the launch, output rows output_row[i] onward from sources[i] onward
// (consecutive rows `width` apart in both). Passed by value, so a conversion
// uploads no table (a pageable copy each admitting round at batch 64).
struct GatherRuns {
  static constexpr int kMaxRuns = 64;
  const float* sources[kMaxRuns];
  int output_row[kMaxRuns];
  int first_block[kMaxRuns + 1];
  int count = 0;  // runs
  int rows() const { return count ? first_block[count] : 0; }
};

// out's rows (width values each) of every run = bf16 of its source rows,
// rounded as f32_to_bf16_forward: a round's accepted tap rows, wherever the
// target's forward left them, into staging rows with one launch.
void gather_f32_runs_to_bf16_forward(__nv_bfloat16* out, const GatherRuns& runs, int width, cudaStream_t stream);

// Where row i of one context-extension pass comes from: a row the host
// already copied there (Keep), zeros (Zero: padding), a row staged as bf16
// (Bf16), or a target tap row still in f32 where the target's forward left it
// (F32: converted here, rounded as f32_to_bf16_forward).
enum class TapRowKind : int32_t { Keep = 0, Zero = 1, Bf16 = 2, F32 = 3 };
struct TapRowSource {
  const void* row;  // width values of the kind's type (Bf16, F32); unused otherwise
  TapRowKind kind;
};
// rows [count, width] of the pass from `sources` [count] (device memory), one
// launch whatever the mix.
void gather_tap_rows_forward(__nv_bfloat16* rows, const TapRowSource* sources, int count, int width,
                             cudaStream_t stream);

}  // namespace dspark::cuda
