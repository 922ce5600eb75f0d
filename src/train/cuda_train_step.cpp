// The CUDA TrainStep (train/train_step.h): CudaDrafterLoss + CudaAdamW, and
// the staging its pipelined batches arrive through (train/batch_pipeline.h).
#include <cmath>
#include <memory>

#include "core/error.h"
#include "kernels/cuda/buffer.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/loss.h"
#include "train/cuda_loss.h"
#include "train/cuda_optimizer.h"
#include "train/train_step.h"

namespace dspark {
namespace {

// Two slots of pinned host memory and device memory, a copy stream, and per
// slot the events that order its reuse: `copied` (its copy has left the host
// memory and arrived) and `consumed` (the step that read the device memory is
// done).
class CudaBatchStaging : public BatchStaging {
 public:
  CudaBatchStaging() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    for (Slot& slot : slots_) {
      CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&slot.consumed, cudaEventDisableTiming));
    }
  }
  ~CudaBatchStaging() override {
    cudaStreamSynchronize(copy_stream_);
    for (Slot& slot : slots_) {
      cudaEventSynchronize(slot.consumed);
      cudaEventDestroy(slot.copied);
      cudaEventDestroy(slot.consumed);
    }
    cudaStreamDestroy(copy_stream_);
  }

  unsigned char* host(int slot_index, size_t bytes) override {
    Slot& slot = slots_[slot_index];
    CUDA_CHECK(cudaEventSynchronize(slot.copied));  // the previous copy has left the host memory
    if (slot.host.size() < bytes) slot.host.resize(bytes);
    if (slot.device.size() < bytes) {
      CUDA_CHECK(cudaEventSynchronize(slot.consumed));  // no step reads the memory being freed
      slot.device.resize(bytes);
    }
    // This slot's copies start after the step that read its previous batch.
    CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, slot.consumed, 0));
    return slot.host.data();
  }
  void copy(int slot_index, size_t begin, size_t end) override {
    Slot& slot = slots_[slot_index];
    CUDA_CHECK(cudaMemcpyAsync(slot.device.data() + begin, slot.host.data() + begin, end - begin,
                               cudaMemcpyHostToDevice, copy_stream_));
  }
  void finish(int slot_index) override { CUDA_CHECK(cudaEventRecord(slots_[slot_index].copied, copy_stream_)); }

  // The consumer's side: `stream` waits for the slot's copy; then, once the step is launched, the
  // slot's next copy waits for `stream`.
  unsigned char* device_ready_on(int slot_index, cudaStream_t stream) {
    Slot& slot = slots_[slot_index];
    CUDA_CHECK(cudaStreamWaitEvent(stream, slot.copied, 0));
    return slot.device.data();
  }
  void consumed_on(int slot_index, cudaStream_t stream) {
    CUDA_CHECK(cudaEventRecord(slots_[slot_index].consumed, stream));
  }

 private:
  struct Slot {
    cuda::PinnedBuffer<unsigned char> host;
    cuda::DeviceBuffer<unsigned char> device;
    cudaEvent_t copied = nullptr, consumed = nullptr;
  };
  cudaStream_t copy_stream_ = nullptr;
  Slot slots_[kSlots];
};

class CudaTrainStep : public TrainStep {
 public:
  CudaTrainStep(const Drafter& drafter, std::unique_ptr<CudaTrainHead> head, const CudaTrainPrecision& precision,
                const AdamW& optimizer)
      : precision_(precision),
        head_(std::move(head)),
        loss_(drafter, *head_, precision_),
        optimizer_(loss_.layout(), optimizer.options(), loss_.stream()) {
    optimizer_.restore(optimizer.steps(), optimizer.first_moments(), optimizer.second_moments());
  }
  ~CudaTrainStep() override { cudaStreamSynchronize(loss_.stream()); }

  LossTerms evaluate(const TrainBatch& batch, const LossWeights& weights) override {
    loss_.upload(batch);
    return loss_.compute(weights, false);
  }

  Result train(const TrainBatch& batch, const LossWeights& weights, double clip_norm,
               double learning_rate) override {
    loss_.upload(batch);
    return run(weights, clip_norm, learning_rate, -1);
  }

  BatchStaging* batch_staging() override {
    if (!staging_) staging_ = std::make_unique<CudaBatchStaging>();
    return staging_.get();
  }

  Result train_packed(const PackedBatch& batch, const LossWeights& weights, double clip_norm,
                      double learning_rate) override {
    DSPARK_CHECK(staging_ && batch.slot >= 0 && batch.slot < BatchStaging::kSlots,
                 "CUDA train step: a packed batch that is not from this step's staging");
    loss_.bind(batch, staging_->device_ready_on(batch.slot, loss_.stream()));
    return run(weights, clip_norm, learning_rate, batch.slot);
  }

  void store(Drafter& drafter, AdamW& optimizer) override {
    loss_.download_parameters(drafter);
    TensorMap first, second;
    optimizer_.download(first, second);
    optimizer.restore(optimizer_.steps(), first, second);
  }

 private:
  // The step on the bound batch; `slot` >= 0: the staging slot it reads, released to its next copy once the
  // step is launched.
  Result run(const LossWeights& weights, double clip_norm, double learning_rate, int slot) {
    loss_.zero_gradients();
    loss_.launch(weights, true);
    optimizer_.step(loss_.parameters(), loss_.gradients(), learning_rate, clip_norm, loss_.device_terms());
    if (slot >= 0) staging_->consumed_on(slot, loss_.stream());
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

  CudaTrainPrecision precision_;  // first: the members below are built with it
  std::unique_ptr<CudaTrainHead> head_;
  CudaDrafterLoss loss_;
  CudaAdamW optimizer_;
  std::unique_ptr<CudaBatchStaging> staging_;  // made on the first batch_staging()
};

}  // namespace

std::unique_ptr<TrainStep> make_cuda_train_step(const Drafter& drafter, const TargetHead& head,
                                                const AdamW& optimizer) {
  DSPARK_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA GPU is visible");
  const CudaTrainPrecision precision;
  return std::make_unique<CudaTrainStep>(
      drafter, std::make_unique<CudaTrainHead>(head, drafter.dims, precision.bf16_head), precision, optimizer);
}

std::unique_ptr<TrainStep> make_cuda_train_step(const Drafter& drafter, std::unique_ptr<CudaTrainHead> head,
                                                const CudaTrainPrecision& precision, const AdamW& optimizer) {
  DSPARK_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA GPU is visible");
  DSPARK_CHECK(head != nullptr, "the CUDA train step needs a target head");
  return std::make_unique<CudaTrainStep>(drafter, std::move(head), precision, optimizer);
}

}  // namespace dspark
