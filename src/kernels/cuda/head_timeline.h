// Where the one-launch tokens-only Markov head's time goes, inside the kernel
// (a development tool, like StepProfiler): when DSPARK_HEAD_TIMELINE is "1",
// markov_head_tokens_forward's blocks stamp the time at each step of each
// position (set_markov_head_timeline, draft.h), and the summary over the
// steps, printed to stderr at destruction, gives each step's time (mean and
// slowest block), how long after the last block arrived a barrier let the
// first one go, a position's span, and the candidates.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "kernels/cuda/buffer.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/draft.h"
#include "kernels/cuda/step_profiler.h"

namespace dspark::cuda {

class HeadTimeline {
 public:
  HeadTimeline() {
    if (!environment_switch_on("DSPARK_HEAD_TIMELINE")) return;
    blocks_ = multiprocessor_count();
    stamps_.resize(size_t(blocks_) * kHeadTimelineSlots);
    host_.resize(stamps_.size());
    set_markov_head_timeline(stamps_.data());
  }
  ~HeadTimeline() {
    if (stamps_.size() == 0) return;
    set_markov_head_timeline(nullptr);
    if (steps_ == 0) return;
    static const char* names[kHeadTimelineStages] = {
        "(previous barrier)", "verdict",           "e16",     "sums (thread 0)", "bounds",
        "first barrier",      "candidates listed", "their U", "their keys",      "second barrier"};
    std::fprintf(stderr, "head timeline: %ld steps, %.1f positions a step; w2 on chip %.2f us\n", steps_,
                 double(positions_) / steps_, load_ / steps_ / 1e3);
    for (int j = 1; j < kHeadTimelineStages; ++j)
      std::fprintf(stderr, "  %-18s mean %6.2f us  slowest block %6.2f us\n", names[j], mean_[j] / positions_ / 1e3,
                   slowest_[j] / positions_ / 1e3);
    std::fprintf(stderr, "  barrier release    first %6.2f us  second %6.2f us (last arrival to first leaving)\n",
                 release_[0] / positions_ / 1e3, release_[1] / positions_ / 1e3);
    std::fprintf(stderr,
                 "  position span %.2f us; candidates a position %.1f (blocks with any %.1f, most in one %.1f)\n",
                 span_ / positions_ / 1e3, candidates_ / positions_, candidate_blocks_ / positions_,
                 candidate_most_ / positions_);
  }
  HeadTimeline(const HeadTimeline&) = delete;
  HeadTimeline& operator=(const HeadTimeline&) = delete;

  bool enabled() const { return stamps_.size() > 0; }
  void before_step(cudaStream_t stream) {
    if (enabled()) CUDA_CHECK(cudaMemsetAsync(stamps_.data(), 0, stamps_.bytes(), stream));
  }
  // After the step's synchronisation; a step that did not run the kernel left no stamps.
  void after_step() {
    if (!enabled()) return;
    CUDA_CHECK(cudaMemcpy(host_.data(), stamps_.data(), stamps_.bytes(), cudaMemcpyDeviceToHost));
    if (++seen_ <= kWarmupSteps) return;
    int blocks = 0;
    while (blocks < blocks_ && raw(blocks, kHeadTimelineGlobalEnd) != 0) ++blocks;
    if (blocks == 0) return;
    ++steps_;
    unsigned long long first = ~0ull, loaded = 0;
    for (int b = 0; b < blocks; ++b) first = std::min(first, at(b, 0)), loaded = std::max(loaded, at(b, 1));
    load_ += double(loaded - first);
    unsigned long long previous_end = loaded;
    for (int k = 0; k < kHeadTimelinePositions; ++k) {
      const int base = 2 + k * kHeadTimelineStages;
      bool complete = true;
      for (int b = 0; b < blocks && complete; ++b) complete = at(b, base + kHeadTimelineStages - 1) != 0;
      if (!complete) break;
      ++positions_;
      for (int j = 1; j < kHeadTimelineStages; ++j) {
        double sum = 0.0, most = 0.0;
        for (int b = 0; b < blocks; ++b) {
          const double step = double(at(b, base + j) - at(b, base + j - 1));
          sum += step, most = std::max(most, step);
        }
        mean_[j] += sum / blocks, slowest_[j] += most;
      }
      for (int i = 0; i < 2; ++i) {  // barriers: stages 4 -> 5 and 8 -> 9
        const int before = i == 0 ? 4 : 8;
        unsigned long long last_arrival = 0, first_leaving = ~0ull;
        for (int b = 0; b < blocks; ++b)
          last_arrival = std::max(last_arrival, at(b, base + before)),
          first_leaving = std::min(first_leaving, at(b, base + before + 1));
        release_[i] += double(first_leaving) - double(last_arrival);
      }
      unsigned long long end = 0;
      double count = 0.0, with_any = 0.0, most = 0.0;
      for (int b = 0; b < blocks; ++b) {
        end = std::max(end, at(b, base + kHeadTimelineStages - 1));
        const double c = double(raw(b, kHeadTimelineCounts + k));
        count += c, with_any += c > 0, most = std::max(most, c);
      }
      span_ += double(end - previous_end);
      previous_end = end;
      candidates_ += count, candidate_blocks_ += with_any, candidate_most_ += most;
    }
  }

 private:
  unsigned long long raw(int block, int slot) const { return host_[size_t(block) * kHeadTimelineSlots + slot]; }
  // A clock slot in global nanoseconds (the block's clock, placed by its two %globaltimer reads); 0 if unwritten.
  unsigned long long at(int block, int slot) const {
    if (raw(block, slot) == 0) return 0;
    auto since_start = [&](int s) { return double(unsigned(raw(block, s)) - unsigned(raw(block, 0))); };  // mod 2^32
    const double cycles = since_start(kHeadTimelineClockEnd);
    const double nanoseconds =
        double(raw(block, kHeadTimelineGlobalEnd)) - double(raw(block, kHeadTimelineGlobalStart));
    if (cycles <= 0.0) return 0;
    return raw(block, kHeadTimelineGlobalStart) +
           static_cast<unsigned long long>(since_start(slot) * nanoseconds / cycles);
  }
  static constexpr long kWarmupSteps = 3;
  int blocks_ = 0;
  DeviceBuffer<unsigned long long> stamps_;
  std::vector<unsigned long long> host_;
  long seen_ = 0, steps_ = 0, positions_ = 0;
  double load_ = 0.0, span_ = 0.0, candidates_ = 0.0, candidate_blocks_ = 0.0, candidate_most_ = 0.0;
  double mean_[kHeadTimelineStages] = {}, slowest_[kHeadTimelineStages] = {}, release_[2] = {};
};

}  // namespace dspark::cuda
