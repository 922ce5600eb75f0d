#include "spec/cuda_dspark_source.h"

#include <algorithm>

#include "spec/dspark_source.h"

namespace dspark {

void CudaDSparkSource::begin(int row, std::span<const int32_t>, uint64_t seed) {
  end(row);  // a slot reused without end(): its old context goes
  rows_.emplace(row, RowState{drafter_.create_context(), Rng(seed)});
}

void CudaDSparkSource::accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) {
  drafter_.extend_context(rows_.at(row).context, tapped_rows, static_cast<int>(tokens.size()));
}

void CudaDSparkSource::accept_device(int row, std::span<const int32_t> tokens, const float* device_rows) {
  drafter_.extend_context_from_device(rows_.at(row).context, device_rows, static_cast<int>(tokens.size()));
}

void CudaDSparkSource::end(int row) {
  auto found = rows_.find(row);
  if (found == rows_.end()) return;
  drafter_.release_context(found->second.context);
  rows_.erase(found);
}

void CudaDSparkSource::propose(std::span<const int> rows, std::span<const int32_t> pending,
                               std::span<const int> max_tokens, const cpu::SamplingParams& sampling,
                               std::vector<Proposal>& proposals) {
  proposals.assign(rows.size(), Proposal{});
  // As on the CPU: rows that may draft go in one batch with the longest limit,
  // and each row's own limit cuts its draft short.
  std::vector<CudaDraftRequest> requests;
  std::vector<size_t> slots;
  int longest = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (max_tokens[i] <= 0) continue;
    RowState& state = rows_.at(rows[i]);
    requests.push_back({state.context, pending[i], &state.rng});
    slots.push_back(i);
    longest = std::max(longest, max_tokens[i]);
  }
  if (requests.empty()) return;
  DraftOptions options;
  options.sampling = sampling;
  options.min_confidence = min_confidence_;
  options.calibrated_thresholds = calibrated_thresholds_;
  options.max_tokens = longest;
  drafter_.draft(requests, options, results_);
  fill_proposals(results_, slots, max_tokens, drafter_.dims().vocab_size, proposals);
}

}  // namespace dspark
