#include "train/train_step.h"

#include <cmath>

#include "core/error.h"

namespace dspark {
namespace {

class CpuTrainStep : public TrainStep {
 public:
  CpuTrainStep(Drafter& drafter, const TargetHead& head, AdamW* optimizer)
      : drafter_(drafter), head_(head), optimizer_(optimizer) {}

  LossTerms evaluate(const TrainBatch& batch, const LossWeights& weights) override {
    return drafter_loss(drafter_, head_, batch, weights, nullptr, workspace_);
  }

  Result train(const TrainBatch& batch, const LossWeights& weights, double clip_norm,
               double learning_rate) override {
    DSPARK_CHECK(optimizer_, "this CPU train step only evaluates");
    if (gradients_.empty()) gradients_ = zero_gradients(drafter_);
    for (auto& [name, gradient] : gradients_) std::fill_n(gradient.data, gradient.numel(), 0.0f);
    Result result;
    result.terms = drafter_loss(drafter_, head_, batch, weights, &gradients_, workspace_);
    if (!std::isfinite(result.terms.loss)) return result;
    result.gradient_norm = clip_gradients_by_global_norm(gradients_, clip_norm);
    optimizer_->step(drafter_.parameters, gradients_, learning_rate);
    return result;
  }

  void store(Drafter&, AdamW&) override {}

 private:
  Drafter& drafter_;
  TargetHead head_;
  AdamW* optimizer_;
  Gradients gradients_;
  LossWorkspace workspace_;
};

}  // namespace

TrainStep::Result TrainStep::train_packed(const PackedBatch&, const LossWeights&, double, double) {
  fail("this training step takes no packed batches (it has no batch staging)");
}

std::unique_ptr<TrainStep> make_cpu_train_step(Drafter& drafter, const TargetHead& head, AdamW* optimizer) {
  return std::make_unique<CpuTrainStep>(drafter, head, optimizer);
}

}  // namespace dspark
