#include "spec/dspark_source.h"

#include <algorithm>

namespace dspark {

void fill_proposals(std::span<const DraftResult> results, std::span<const size_t> slots,
                    std::span<const int> max_tokens, int vocab, std::vector<Proposal>& proposals) {
  for (size_t j = 0; j < slots.size(); ++j) {
    Proposal& proposal = proposals[slots[j]];
    const DraftResult& result = results[j];
    const size_t keep = std::min(result.tokens.size(), size_t(max_tokens[slots[j]]));
    proposal.tokens.assign(result.tokens.begin(), result.tokens.begin() + keep);
    proposal.confidence.assign(result.confidence.begin(), result.confidence.begin() + keep);
    if (!result.probs.empty()) proposal.probs.assign(result.probs.begin(), result.probs.begin() + keep * vocab);
  }
}

void DSparkSource::begin(int row, std::span<const int32_t>, uint64_t seed) {
  std::vector<float> staged;
  if (!spare_staging_.empty()) {
    staged = std::move(spare_staging_.back());
    spare_staging_.pop_back();
  }
  rows_.insert_or_assign(row, RowState{DraftContext{}, Rng(seed), std::move(staged)});
}

void DSparkSource::end(int row) {
  const auto found = rows_.find(row);
  if (found == rows_.end()) return;
  found->second.staged.clear();  // (the capacity stays)
  spare_staging_.push_back(std::move(found->second.staged));
  rows_.erase(found);
}

void DSparkSource::accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) {
  const size_t width = drafter_.config.tap_layers.size() * size_t(drafter_.dims.hidden_size);
  std::vector<float>& staged = rows_.at(row).staged;
  staged.insert(staged.end(), tapped_rows, tapped_rows + tokens.size() * width);
}

void DSparkSource::propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
                           const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) {
  proposals.assign(rows.size(), Proposal{});
  // Rows that may draft at all go in one batch; the backbone drafts gamma for
  // each, and a row's own limit cuts its head short. Their staged context
  // rows are projected first, together.
  const size_t width = drafter_.config.tap_layers.size() * size_t(drafter_.dims.hidden_size);
  std::vector<DraftRequest> requests;
  std::vector<size_t> slots;
  std::vector<RowState*> staged;
  std::vector<DraftContext*> contexts;
  std::vector<const float*> staged_rows;
  std::vector<int> counts;
  int longest = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (max_tokens[i] <= 0) continue;
    RowState& state = rows_.at(rows[i]);
    requests.push_back({&state.context, pending[i], &state.rng});
    slots.push_back(i);
    longest = std::max(longest, max_tokens[i]);
    if (state.staged.empty()) continue;
    staged.push_back(&state);
    contexts.push_back(&state.context);
    staged_rows.push_back(state.staged.data());
    counts.push_back(static_cast<int>(state.staged.size() / width));
  }
  if (requests.empty()) return;
  extend_draft_contexts(drafter_, contexts, staged_rows, counts, workspace_);
  for (RowState* state : staged) state->staged.clear();
  DraftOptions options;
  options.sampling = sampling;
  options.min_confidence = min_confidence_;
  options.calibrated_thresholds = calibrated_thresholds_;
  options.max_tokens = longest;
  draft(drafter_, head_, requests, options, workspace_, results_);
  fill_proposals(results_, slots, max_tokens, drafter_.dims.vocab_size, proposals);
}

}  // namespace dspark
