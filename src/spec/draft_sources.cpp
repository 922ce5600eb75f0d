#include "spec/draft_sources.h"

#include "core/error.h"
#include "spec/dspark_source.h"
#include "spec/ngram_source.h"
#ifdef DSPARK_CUDA
#include "model/cuda_target.h"
#include "spec/cuda_dspark_source.h"
#endif

namespace dspark {

LoadedDraftSource load_draft_source(const std::string& name, const std::filesystem::path& target_directory,
                                    const Target& target, float min_confidence) {
  LoadedDraftSource loaded;
  if (name == "ngram") {
    loaded.source = std::make_unique<NgramSource>();
    return loaded;
  }
  DSPARK_CHECK(std::filesystem::is_directory(name), "-d ", name, ": not a drafter directory (or \"ngram\")");
  loaded.drafter = std::make_unique<Drafter>(load_drafter(name));
  check_drafter_matches_target(*loaded.drafter, target.config(), target_id_of(target_directory));
  loaded.default_gamma = loaded.drafter->config.gamma;
#ifdef DSPARK_CUDA
  if (const std::optional<CudaTargetHead> head = cuda_target_head(target)) {  // the drafter runs beside it on the GPU
    loaded.source = std::make_unique<CudaDSparkSource>(*loaded.drafter, *head, min_confidence);
    return loaded;
  }
#endif
  loaded.head = std::make_unique<TargetHeadWeights>(load_target_head(target_directory, target.config()));
  loaded.source = std::make_unique<DSparkSource>(*loaded.drafter, loaded.head->view(), min_confidence);
  return loaded;
}

std::unique_ptr<DraftSource> unpruned_draft_source(const LoadedDraftSource& loaded, const Target& target) {
  if (!loaded.drafter) return nullptr;
#ifdef DSPARK_CUDA
  if (const std::optional<CudaTargetHead> head = cuda_target_head(target)) {
    // The CUDA drafter copies the weights to the device, so a copy without
    // thresholds (temperatures kept) can go once it is uploaded.
    Drafter unpruned = *loaded.drafter;
    if (unpruned.config.sts) unpruned.config.sts->thresholds.clear();
    return std::make_unique<CudaDSparkSource>(unpruned, *head, 0.0f);
  }
#endif
  DSPARK_CHECK(loaded.head, "unpruned_draft_source: the drafter has no target head to read");
  return std::make_unique<DSparkSource>(*loaded.drafter, loaded.head->view(), 0.0f, false);
}

}  // namespace dspark
