// Choosing a draft source by name, as the CLI does: "ngram", or the
// directory of a DSpark drafter for the given target (run on the GPU, beside
// the target, when the target is a CUDA target; on the CPU otherwise).
#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include "model/target.h"
#include "spec/draft.h"
#include "spec/draft_source.h"

namespace dspark {

struct LoadedDraftSource {
  std::unique_ptr<Drafter> drafter;         // when a DSpark drafter
  // The target's embedding / LM head loaded for a CPU drafter whose target
  // keeps its weights elsewhere (a CPU target's own are read in place: null).
  std::unique_ptr<TargetHeadWeights> head;
  std::unique_ptr<DraftSource> source;
  int default_gamma = 8;
  // The γ a run drafts: `requested` when positive, else default_gamma. A
  // DSpark drafter drafts at most the block it was trained for; asking for
  // more is an error, not a silent cut.
  int gamma_for(int requested) const;
};

LoadedDraftSource load_draft_source(const std::string& name, const std::filesystem::path& target_directory,
                                    const Target& target, float min_confidence);

// Another DSpark source over a drafter already loaded for `target` (e.g. one
// without threshold pruning beside the pruned one): on the GPU when `target`
// is a CUDA target (it uploads its own copy of the drafter's weights, with the
// drafter's config as it is now), else on the CPU reading a CPU target's own
// embedding and LM head in place, or else `head` (required then:
// LoadedDraftSource::head). calibrated_thresholds: prune by config.sts's
// thresholds (the STS temperatures apply to the confidences either way).
std::unique_ptr<DraftSource> make_dspark_source(const Drafter& drafter, const Target& target,
                                                const TargetHeadWeights* head, float min_confidence,
                                                bool calibrated_thresholds);

// The loaded drafter as a second source that never prunes by its calibrated
// thresholds (its confidences keep the STS temperatures): the drafts a verify
// scheduler cuts instead. Null when the source has no drafter (ngram).
// `loaded` must outlive it.
std::unique_ptr<DraftSource> unpruned_draft_source(const LoadedDraftSource& loaded, const Target& target);

}  // namespace dspark
