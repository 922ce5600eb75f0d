// What one training step runs on: the part of the trainer (train/trainer.h)
// that depends on the device. The trainer's loop (sampling, schedule, log,
// evaluation, checkpoints, resume) is the same for every device; a TrainStep
// computes the loss of a batch and applies one optimizer update.
//
//   CPU:  drafter_loss + clip_gradients_by_global_norm + AdamW::step on the
//         host Drafter and AdamW themselves (train/loss.h, train/optimizer.h).
//   CUDA: the same on the GPU (train/cuda_loss.h, train/cuda_optimizer.h):
//         weights, gradients and moments stay on the device; a step moves
//         only the batch there and a few numbers back. store() brings the
//         weights and moments back for checkpoints. Its batches may also come
//         packed through a BatchPipeline (train/batch_pipeline.h) into its
//         batch_staging(): packed and copied while the previous step runs.
#pragma once
#include <memory>

#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/batch_pipeline.h"
#include "train/loss.h"
#include "train/optimizer.h"
#include "train/train_batch.h"

namespace dspark {

class TrainStep {
 public:
  struct Result {
    LossTerms terms;
    double gradient_norm = 0.0;  // before clipping
  };
  virtual ~TrainStep() = default;
  // The loss terms of `batch` under the current weights (no gradient, no update).
  virtual LossTerms evaluate(const TrainBatch& batch, const LossWeights& weights) = 0;
  // dLoss/dθ over `batch`, clipped to clip_norm by global norm, then one AdamW
  // update at learning_rate. A loss that is not finite leaves the weights and
  // moments as they were (the caller stops).
  virtual Result train(const TrainBatch& batch, const LossWeights& weights, double clip_norm,
                       double learning_rate) = 0;
  // Where a BatchPipeline packs this step's batches, or null when the step
  // takes TrainBatches only (the CPU step: its loss reads the f32 TrainBatch).
  // Owned by the step; a pipeline using it must be destroyed first.
  virtual BatchStaging* batch_staging() { return nullptr; }
  // train() on a batch from a BatchPipeline over batch_staging(): the step
  // waits (on the device) for the batch's copy, and its slot's next copy
  // waits for the step.
  virtual Result train_packed(const PackedBatch& batch, const LossWeights& weights, double clip_norm,
                              double learning_rate);
  // The current weights into `drafter` and the optimizer's step count and
  // moments into `optimizer` (for checkpoints and best/; the CPU step works on
  // them in place, so there is nothing to do).
  virtual void store(Drafter& drafter, AdamW& optimizer) = 0;
};

// The CPU step over `drafter` and `optimizer` in place (`optimizer` may be
// null for a step that only evaluates). Both must outlive it.
std::unique_ptr<TrainStep> make_cpu_train_step(Drafter& drafter, const TargetHead& head, AdamW* optimizer);

// The CUDA step (CUDA builds only): uploads `head` (bf16) and the drafter's
// weights, and the step count and moments of `optimizer` (a resumed run's).
// Its decayed tensors are drafter_parameter_decays's. Batches may carry their
// context rows in bf16 (TrainBatch::context_rows_bf16) or f32.
std::unique_ptr<TrainStep> make_cuda_train_step(const Drafter& drafter, const TargetHead& head,
                                                const AdamW& optimizer);

// The same over a target head already on the device (benchmarks: CudaTrainHead::random)
// in `precision` (train/cuda_loss.h); the step owns `head`.
class CudaTrainHead;
struct CudaTrainPrecision;
std::unique_ptr<TrainStep> make_cuda_train_step(const Drafter& drafter, std::unique_ptr<CudaTrainHead> head,
                                                const CudaTrainPrecision& precision, const AdamW& optimizer);

}  // namespace dspark
