// The DSpark drafter as a draft source: each request keeps its retained
// context (the tapped target rows of every token in the target's cache) and
// its own seeded sampling stream; a round drafts all requests in one batch.
// accept() only stages the tapped rows; propose() projects every staged row
// of the requests it drafts in one pass (extend_draft_contexts), so rounds
// left undrafted, and many requests' rounds, share the weights' reads.
#pragma once
#include <map>

#include "spec/draft.h"
#include "spec/draft_source.h"

namespace dspark {

// proposals[slots[j]] = results[j] cut to max_tokens[slots[j]] positions: the
// tokens, their confidences and, when sampling, the distributions q they were
// drawn from. Both DSpark sources (CPU and GPU) end propose() with it.
void fill_proposals(std::span<const DraftResult> results, std::span<const size_t> slots,
                    std::span<const int> max_tokens, int vocab, std::vector<Proposal>& proposals);

class DSparkSource final : public DraftSource {
 public:
  // `head` points into the target's weights, which must outlive the source.
  // `calibrated_thresholds`: prune by the drafter's config.sts thresholds
  // (off when a scheduler decides the lengths instead; the STS temperatures
  // still apply to the reported confidences).
  DSparkSource(const Drafter& drafter, const TargetHead& head, float min_confidence = 0.0f,
               bool calibrated_thresholds = true)
      : drafter_(drafter),
        head_(head),
        min_confidence_(min_confidence),
        calibrated_thresholds_(calibrated_thresholds) {}
  std::vector<int> tap_layers() const override { return drafter_.config.tap_layers; }
  void begin(int row, std::span<const int32_t> prompt, uint64_t seed) override;
  void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) override;
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) override;
  void end(int row) override;

 private:
  struct RowState {
    DraftContext context;
    Rng rng;
    std::vector<float> staged;  // [staged rows, m·H] accepted, not yet projected
  };
  const Drafter& drafter_;
  TargetHead head_;
  float min_confidence_;
  bool calibrated_thresholds_;
  std::map<int, RowState> rows_;
  // Ended rows' staging buffers, emptied, for the rows that begin next. A
  // row left undrafted for many rounds stages its tapped rows all that while
  // (6 KB a token with the demo models); in fresh memory every new page
  // faulted, and at batch 64 on the CPU that was ~0.7-1 ms of a ~9 ms round.
  std::vector<std::vector<float>> spare_staging_;
  DraftWorkspace workspace_;
  std::vector<DraftResult> results_;
};

}  // namespace dspark
