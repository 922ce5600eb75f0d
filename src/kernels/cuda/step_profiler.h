// Per-op GPU times of a step, for finding where a step's time goes. When the
// environment variable given at construction is "1", the owner runs its steps
// eagerly and marks an event after each op; the mean time per op and per step
// is printed to stderr when the profiler is destroyed. Each step starts with
// the stream held for 20 ms (hold_stream) while the host queues the step, so
// the times are the kernels' own, not eager launch gaps (a caller's own
// timing of a profiled step includes the hold). (DSPARK_PROFILE: the
// CUDA target's decode steps, or with DSPARK_PROFILE_TOKENS=k its steps of k
// tokens per sequence; DSPARK_DRAFT_PROFILE: the CUDA drafter's steps.)
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "core/environment.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"

namespace dspark::cuda {

class StepProfiler {
 public:
  StepProfiler(const char* variable, const char* label) : enabled_(environment_switch_on(variable)), label_(label) {}
  ~StepProfiler() {
    for (cudaEvent_t event : events_) cudaEventDestroy(event);
    if (!enabled_ || steps_ == 0) return;
    double total = 0.0;
    for (const auto& [name, milliseconds] : totals_) total += milliseconds;
    std::fprintf(stderr, "%s: %ld steps, %.3f ms per step\n", label_.c_str(), steps_, total / steps_);
    for (const auto& [name, milliseconds] : totals_)
      std::fprintf(stderr, "  %-22s %9.1f us  %5.1f%%\n", name.c_str(), 1e3 * milliseconds / steps_,
                   100.0 * milliseconds / total);
  }
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool enabled() const { return enabled_; }
  void mark(const char* name, cudaStream_t stream) {
    if (!enabled_) return;
    if (marks_ == 0) hold_stream(stream, kHoldMicroseconds);
    if (marks_ == events_.size()) {
      events_.emplace_back();
      CUDA_CHECK(cudaEventCreate(&events_.back()));
    }
    CUDA_CHECK(cudaEventRecord(events_[marks_], stream));
    names_.resize(marks_ + 1);
    names_[marks_++] = name;
  }
  // Accumulates the time between consecutive marks under the later mark's
  // name (when `record`: the owner may profile only some kinds of step).
  void finish_step(bool record = true) {
    if (!enabled_ || marks_ == 0) return;
    if (!record) {
      marks_ = 0;
      return;
    }
    CUDA_CHECK(cudaEventSynchronize(events_[marks_ - 1]));
    if (++seen_ <= kWarmupSteps) {  // first steps also choose GEMM algorithms: not representative
      marks_ = 0;
      return;
    }
    for (size_t i = 1; i < marks_; ++i) {
      float milliseconds = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&milliseconds, events_[i - 1], events_[i]));
      totals_[names_[i]] += milliseconds;
    }
    ++steps_;
    marks_ = 0;
  }

 private:
  bool enabled_;
  std::string label_;
  std::vector<cudaEvent_t> events_;
  std::vector<std::string> names_;
  static constexpr long kWarmupSteps = 3;
  static constexpr int kHoldMicroseconds = 20000;  // longer than queueing the longest step's launches
  size_t marks_ = 0;
  long steps_ = 0, seen_ = 0;
  std::map<std::string, double> totals_;
};

}  // namespace dspark::cuda
