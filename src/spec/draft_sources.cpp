#include "spec/draft_sources.h"

#include "core/error.h"
#include "model/cpu_target.h"
#include "spec/dspark_source.h"
#include "spec/ngram_source.h"
#ifdef DSPARK_CUDA
#include "model/cuda_target.h"
#include "spec/cuda_dspark_source.h"
#endif

namespace dspark {

int LoadedDraftSource::gamma_for(int requested) const {
  if (requested <= 0) return default_gamma;
  DSPARK_CHECK(!drafter || requested <= drafter->config.gamma, "--gamma ", requested, " exceeds the drafter's gamma of ",
               drafter->config.gamma, " (the block it was trained to draft)");
  return requested;
}

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
  const bool on_gpu = cuda_target_head(target).has_value();  // the drafter runs beside it on the GPU
#else
  const bool on_gpu = false;
#endif
  if (!on_gpu) {
    keep_bf16_weights(*loaded.drafter);            // decoding on the CPU: its few-row products read half the bytes
    if (!dynamic_cast<const CpuTarget*>(&target))  // a CPU target's own head is read in place
      loaded.head = std::make_unique<TargetHeadWeights>(load_target_head(target_directory, target.config()));
  }
  loaded.source = make_dspark_source(*loaded.drafter, target, loaded.head.get(), min_confidence, true);
  return loaded;
}

std::unique_ptr<DraftSource> make_dspark_source(const Drafter& drafter, const Target& target,
                                                const TargetHeadWeights* head, float min_confidence,
                                                bool calibrated_thresholds) {
#ifdef DSPARK_CUDA
  if (const std::optional<CudaTargetHead> cuda_head = cuda_target_head(target))
    return std::make_unique<CudaDSparkSource>(drafter, *cuda_head, min_confidence, calibrated_thresholds);
#endif
  if (const auto* cpu_target = dynamic_cast<const CpuTarget*>(&target))  // its embedding and LM head, in place
    return std::make_unique<DSparkSource>(drafter, target_head_of(cpu_target->model()), min_confidence,
                                          calibrated_thresholds);
  DSPARK_CHECK(head, "a DSpark drafter on the CPU needs the target's embedding and LM head on the host");
  return std::make_unique<DSparkSource>(drafter, head->view(), min_confidence, calibrated_thresholds);
}

std::unique_ptr<DraftSource> unpruned_draft_source(const LoadedDraftSource& loaded, const Target& target) {
  if (!loaded.drafter) return nullptr;
  return make_dspark_source(*loaded.drafter, target, loaded.head.get(), 0.0f, false);
}

}  // namespace dspark
