// The CUDA TrainStep (train/train_step.h): CudaDrafterLoss + CudaAdamW.
#include <cmath>
#include <memory>

#include "core/error.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/loss.h"
#include "train/cuda_loss.h"
#include "train/cuda_optimizer.h"
#include "train/train_step.h"

namespace dspark {
namespace {

class CudaTrainStep : public TrainStep {
 public:
  CudaTrainStep(const Drafter& drafter, const TargetHead& head, const AdamW& optimizer)
      : head_(head, drafter.dims, precision_.bf16_head),
        loss_(drafter, head_, precision_),
        optimizer_(loss_.layout(), optimizer.options(), loss_.stream()) {
    optimizer_.restore(optimizer.steps(), optimizer.first_moments(), optimizer.second_moments());
  }

  LossTerms evaluate(const TrainBatch& batch, const LossWeights& weights) override {
    loss_.upload(batch);
    return loss_.compute(weights, false);
  }

  Result train(const TrainBatch& batch, const LossWeights& weights, double clip_norm,
               double learning_rate) override {
    loss_.upload(batch);
    loss_.zero_gradients();
    loss_.launch(weights, true);
    optimizer_.step(loss_.parameters(), loss_.gradients(), learning_rate, clip_norm, loss_.device_terms());
    // One copy back: the terms and the squared gradient norm.
    double values[cuda::kLossTerms + 1];
    CUDA_CHECK(cudaMemcpyAsync(values, loss_.device_terms(), cuda::kLossTerms * sizeof(double),
                               cudaMemcpyDeviceToHost, loss_.stream()));
    CUDA_CHECK(cudaMemcpyAsync(values + cuda::kLossTerms, optimizer_.device_squared_norm(), sizeof(double),
                               cudaMemcpyDeviceToHost, loss_.stream()));
    CUDA_CHECK(cudaStreamSynchronize(loss_.stream()));
    Result result;
    result.terms = CudaDrafterLoss::terms_from(values);
    result.gradient_norm = std::sqrt(values[cuda::kLossTerms]);
    return result;
  }

  void store(Drafter& drafter, AdamW& optimizer) override {
    loss_.download_parameters(drafter);
    TensorMap first, second;
    optimizer_.download(first, second);
    optimizer.restore(optimizer_.steps(), first, second);
  }

 private:
  CudaTrainPrecision precision_;  // first: the members below are built with it
  CudaTrainHead head_;
  CudaDrafterLoss loss_;
  CudaAdamW optimizer_;
};

}  // namespace

std::unique_ptr<TrainStep> make_cuda_train_step(const Drafter& drafter, const TargetHead& head,
                                                const AdamW& optimizer) {
  DSPARK_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA GPU is visible");
  return std::make_unique<CudaTrainStep>(drafter, head, optimizer);
}

}  // namespace dspark
