// Anchor sampling (DESIGN.md §4): which positions of the regenerated data a
// training batch is made of, and the batch itself (train/train_batch.h).
//
// An anchor is a position t in a sequence's response whose next token exists:
// prompt_length - 1 <= t <= length - 2 (t = prompt_length - 1 drafts the
// first response token from the prompt's last token, as the first round of
// decoding does). For anchor t the batch holds
//   context        rows [max(0, t - max_context), t): never row t itself,
//   anchor         x_t,
//   targets        x_{t+1+k} for k < γ (0 where masked),
//   target_hidden  the last tap's H features of row t+k (zeros where masked),
//   mask           1 where t+1+k < length, else 0.
//
// Shape letters: A anchors, γ block, m taps, H target hidden.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/random.h"
#include "train/dataset.h"
#include "train/train_batch.h"

namespace dspark {

struct Anchor {
  int sequence = 0;  // index into the dataset
  int position = 0;  // t
};

// Every anchor of a set of sequences, each equally likely: a sequence is drawn
// in proportion to its response length, so every response token is an equally
// likely training target whatever the sequence lengths.
class AnchorSampler {
 public:
  AnchorSampler(const Dataset& data, std::vector<int> sequences);

  long size() const { return total_; }  // anchors in all
  // The index-th anchor in (sequence order, position) order, 0 <= index < size().
  Anchor at(long index) const;
  // One anchor, from one uniform of `rng`.
  Anchor sample(Rng& rng) const;

 private:
  std::vector<int> sequences_;
  std::vector<int> first_position_;  // per listed sequence: prompt_length - 1
  std::vector<long> ends_;           // per listed sequence: anchors in it and all before it
  long total_ = 0;
};

// The anchors of training step `step` (0-based): batch.size() draws from the
// step's own stream Rng(seed ^ 0xd1b54a32d192ed03·(step+1)), so a step's
// batch depends on nothing but (seed, step): a resumed run, the batch
// pipeline (train/batch_pipeline.h) and every device draw the same anchors.
void sample_step_anchors(const AnchorSampler& sampler, uint64_t seed, long step, std::span<Anchor> anchors);

// The first of anchor `anchor`'s `context_length` context rows in the data:
// rows [t - context_length, t) of its sequence, m·H bf16 values each, back to back.
const uint16_t* context_rows_of(const Dataset& data, const Anchor& anchor, int context_length);

// Where build_train_batch puts the context rows: f32 in context_rows (what
// the CPU loss reads), the stored bf16 bits in context_rows_bf16 (the GPU's
// upload), or nowhere (OffsetsOnly: both left empty, context_offsets set; the
// batch pipeline copies the rows itself, straight into pinned memory).
enum class ContextRows { F32, Bf16, OffsetsOnly };

// Fills `batch` (reusing its storage) for `anchors`; max_context >= 1.
void build_train_batch(const Dataset& data, std::span<const Anchor> anchors, int gamma, int max_context,
                       TrainBatch& batch, ContextRows context = ContextRows::F32);

}  // namespace dspark
