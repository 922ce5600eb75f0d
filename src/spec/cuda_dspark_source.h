// The DSpark drafter as a draft source on the GPU: DSparkSource's behaviour
// (spec/dspark_source.h) with the drafter's weights, every request's retained
// context and the draft step on the device (spec/cuda_drafter.h). Chosen by
// load_draft_source() when the target is a CUDA target.
#pragma once
#include <unordered_map>

#include "spec/cuda_drafter.h"
#include "spec/draft_source.h"

namespace dspark {

class CudaDSparkSource final : public DraftSource {
 public:
  // `head` points into the CUDA target's weights, which must outlive the source.
  // `calibrated_thresholds`: as DSparkSource's (spec/dspark_source.h).
  CudaDSparkSource(const Drafter& drafter, const CudaTargetHead& head, float min_confidence = 0.0f,
                   bool calibrated_thresholds = true)
      : drafter_(drafter, head), min_confidence_(min_confidence), calibrated_thresholds_(calibrated_thresholds) {}
  std::vector<int> tap_layers() const override { return drafter_.config().tap_layers; }
  long warm_up_runs() const override { return drafter_.warm_up_runs(); }
  void begin(int row, std::span<const int32_t> prompt, uint64_t seed) override;
  void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) override;
  // The CUDA target's device taps: converted on the device, never copied to the host.
  bool accepts_device_taps() const override { return true; }
  void accept_device(int row, std::span<const int32_t> tokens, const float* device_rows) override;
  void finish_accepts(const TargetResult& forward) override {
    drafter_.finish_device_rows(forward.device_taps_serial, forward.device_taps_intact);
  }
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) override;
  void end(int row) override;

  CudaDrafter& drafter() { return drafter_; }

 private:
  struct RowState {
    int context;
    Rng rng;
  };
  CudaDrafter drafter_;
  float min_confidence_;
  bool calibrated_thresholds_;
  std::unordered_map<int, RowState> rows_;  // by request row (looked up once per row and round)
  std::vector<DraftResult> results_;
};

}  // namespace dspark
