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

}  // namespace dspark
