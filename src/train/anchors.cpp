#include "train/anchors.h"

#include <algorithm>

#include "core/dtype.h"
#include "core/error.h"

namespace dspark {

AnchorSampler::AnchorSampler(const Dataset& data, std::vector<int> sequences) : sequences_(std::move(sequences)) {
  for (int index : sequences_) {
    DSPARK_CHECK(index >= 0 && index < data.size(), "sequence ", index, " is not in the data (", data.size(),
                 " sequences)");
    const SequenceRecord& sequence = data.sequence(index);
    first_position_.push_back(sequence.prompt_length - 1);
    total_ += sequence.length - sequence.prompt_length;  // t in [P - 1, length - 2]
    ends_.push_back(total_);
  }
}

Anchor AnchorSampler::at(long index) const {
  DSPARK_CHECK(index >= 0 && index < total_, "anchor ", index, " is outside 0..", total_ - 1);
  const size_t slot = std::upper_bound(ends_.begin(), ends_.end(), index) - ends_.begin();
  const long before = slot == 0 ? 0 : ends_[slot - 1];
  return {sequences_[slot], first_position_[slot] + static_cast<int>(index - before)};
}

Anchor AnchorSampler::sample(Rng& rng) const {
  DSPARK_CHECK(total_ > 0, "no anchors to sample from (no sequences with a response)");
  const long index = std::min(total_ - 1, static_cast<long>(rng.uniform() * static_cast<double>(total_)));
  return at(index);
}

const uint16_t* context_rows_of(const Dataset& data, const Anchor& anchor, int context_length) {
  return data.rows(anchor.sequence) + size_t(anchor.position - context_length) * data.tap_width();
}

void sample_step_anchors(const AnchorSampler& sampler, uint64_t seed, long step, std::span<Anchor> anchors) {
  constexpr uint64_t kStepStride = 0xd1b54a32d192ed03ull;
  Rng rng(seed ^ (kStepStride * static_cast<uint64_t>(step + 1)));
  for (Anchor& anchor : anchors) anchor = sampler.sample(rng);
}

void build_train_batch(const Dataset& data, std::span<const Anchor> anchors, int gamma, int max_context,
                       TrainBatch& batch, ContextRows context) {
  DSPARK_CHECK(gamma >= 1 && max_context >= 1, "a training batch needs gamma >= 1 and max context >= 1");
  const int A = static_cast<int>(anchors.size()), width = data.tap_width(), H = data.hidden_size();
  batch.gamma = gamma;
  batch.tap_width = width;
  batch.hidden_size = H;
  batch.context_offsets.assign(A + 1, 0);
  for (int a = 0; a < A; ++a) {
    const int t = anchors[a].position;
    batch.context_offsets[a + 1] = batch.context_offsets[a] + (t - std::max(0, t - max_context));
  }
  const size_t context_values = size_t(batch.context_offsets[A]) * width;
  batch.context_rows.resize(context == ContextRows::F32 ? context_values : 0);
  batch.context_rows_bf16.resize(context == ContextRows::Bf16 ? context_values : 0);
  batch.anchors.resize(A);
  batch.targets.assign(size_t(A) * gamma, 0);
  batch.target_hidden.assign(size_t(A) * gamma * H, 0.0f);
  batch.mask.assign(size_t(A) * gamma, 0.0f);
  for (int a = 0; a < A; ++a) {
    const SequenceRecord& sequence = data.sequence(anchors[a].sequence);
    const int t = anchors[a].position, length = sequence.length;
    DSPARK_CHECK(t >= sequence.prompt_length - 1 && t <= length - 2, "anchor ", t, " of sequence ", anchors[a].sequence,
                 " is outside its response [", sequence.prompt_length - 1, ", ", length - 2, "]");
    const int32_t* ids = data.ids(anchors[a].sequence);
    const uint16_t* rows = data.rows(anchors[a].sequence);
    const uint16_t* context_rows = context_rows_of(data, anchors[a], batch.context_length(a));
    if (context == ContextRows::Bf16)
      std::copy_n(context_rows, size_t(batch.context_length(a)) * width,
                  batch.context_rows_bf16.data() + size_t(batch.context_offsets[a]) * width);
    else if (context == ContextRows::F32)
      convert_to_f32(Dtype::BF16, context_rows, batch.context_rows.data() + size_t(batch.context_offsets[a]) * width,
                     size_t(batch.context_length(a)) * width);
    batch.anchors[a] = ids[t];
    for (int k = 0; k < gamma && t + 1 + k < length; ++k) {
      batch.targets[size_t(a) * gamma + k] = ids[t + 1 + k];
      batch.mask[size_t(a) * gamma + k] = 1.0f;
      // The last tap (post-final-norm) is the last H features of the row.
      convert_to_f32(Dtype::BF16, rows + size_t(t + k) * width + (width - H),
                     batch.target_hidden.data() + (size_t(a) * gamma + k) * H, H);
    }
  }
}

}  // namespace dspark
