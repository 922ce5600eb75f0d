// The host's own work per step of the decode loops, around a target whose
// forward costs nothing: plain decoding's step (generate_batch) against a
// speculative round whose rows all go undrafted (speculative_generate with
// Alg 1's gate shut, as at batch 16-64 on the GPU, where each such round
// competes with a plain step of the same forward). Whatever the round spends
// beyond the step is host time the GPU waits through, so it is what keeps a
// shut gate below plain decoding. The draft source takes its rows as the
// CUDA drafter does (on the device, here a pointer it ignores), so its own
// bookkeeping is left out: what is measured is the engine and the scheduler.
//
// Build: cmake --build build --target dspark_engine_overhead_benchmark (needs
// Google Benchmark, libbenchmark-dev; not part of ctest). Run e.g.
//   build/dspark_engine_overhead_benchmark --benchmark_filter='/64$'
// The counter us_per_step is the host time of one forward's step or round.
#include <benchmark/benchmark.h>

#include <vector>

#include "model/generate.h"
#include "spec/scheduler.h"
#include "spec/speculative.h"

namespace {

using namespace dspark;

constexpr int kNewTokens = 64, kPromptLength = 24, kChunkBatches = 4;

// A target that appends tokens and answers at once: row r's next token is a
// function of its last input token (never an end of sequence).
class InstantTarget final : public Target {
 public:
  InstantTarget() {
    config_.family = "qwen3";
    config_.vocab_size = 8192;
    config_.hidden_size = 384;
    config_.num_layers = 8;
    config_.max_positions = 2048;
  }
  const ModelConfig& config() const override { return config_; }
  std::string device_description() const override { return "instant"; }
  int create_sequence(int) override {
    lengths_.push_back(0);
    return int(lengths_.size()) - 1;
  }
  void release_sequence(int sequence) override { lengths_[sequence] = -1; }
  int sequence_length(int sequence) const override { return lengths_[sequence]; }
  void truncate_sequence(int sequence, int length) override { lengths_[sequence] = length; }
  int row_invariant_rows() const override { return 1 << 20; }
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) override {
    result.tokens.clear();
    for (const TargetInput& input : inputs) {
      lengths_[input.sequence] += int(input.tokens.size());
      const size_t rows = input.all_rows ? input.tokens.size() : 1;
      for (size_t i = 0; i < rows; ++i) result.tokens.push_back((input.tokens[i] * 31 + 7) % 8000);
    }
    result.device_taps = request.taps_on_device && !request.taps.empty() ? &kTaps : nullptr;
    result.device_taps_serial = serial_++;
    result.device_taps_intact = 63;
  }

 private:
  ModelConfig config_;
  std::vector<int> lengths_;
  static constexpr float kTaps = 0.0f;  // what device_taps points at (the source never reads it)
  long serial_ = 0;
};

// Reads taps on the device, like the CUDA drafter, and drafts tokens it has
// no confidence in (what a probe of the shut gate then sees).
class DoubtfulSource final : public DraftSource {
 public:
  std::vector<int> tap_layers() const override { return {1, 4, 7}; }
  bool accepts_device_taps() const override { return true; }
  void begin(int, std::span<const int32_t>, uint64_t) override {}
  void accept(int, std::span<const int32_t>, const float*) override {}
  void accept_device(int, std::span<const int32_t>, const float*) override {}
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams&, std::vector<Proposal>& proposals) override {
    proposals.assign(rows.size(), Proposal{});
    for (size_t i = 0; i < rows.size(); ++i) {
      proposals[i].tokens.assign(max_tokens[i], pending[i]);
      proposals[i].confidence.assign(max_tokens[i], 0.05f);
    }
  }
  void end(int) override {}
};

// A profile where drafting never pays: a draft costs ten plain steps.
PrefixScheduler shut_gate_scheduler(int batch, int gamma) {
  SpsProfile sps;
  for (int tokens : sps_profile_points(batch * (gamma + 1))) {
    sps.tokens.push_back(tokens);
    sps.steps_per_second.push_back(1e4);
  }
  DraftCostProfile draft_cost;
  for (int rows : sps_profile_points(batch)) {
    draft_cost.rows.push_back(rows);
    draft_cost.seconds.push_back(1e-3);
  }
  return PrefixScheduler(std::move(sps), std::move(draft_cost));
}

std::vector<std::vector<int32_t>> requests_for(int batch) {
  std::vector<std::vector<int32_t>> prompts(size_t(kChunkBatches) * batch);
  for (size_t r = 0; r < prompts.size(); ++r)
    for (int i = 0; i < kPromptLength; ++i) prompts[r].push_back(int32_t((r * 131 + i * 17) % 8000));
  return prompts;
}

void BM_PlainStep(benchmark::State& state) {
  const int batch = int(state.range(0));
  const auto prompts = requests_for(batch);
  GenerateOptions options;
  options.max_new_tokens = kNewTokens;
  options.max_active = batch;
  long steps = 0;
  double seconds = 0.0;
  for (auto _ : state) {
    InstantTarget target;
    const std::vector<GenerateResult> results = generate_batch(target, prompts, options);
    steps += results[0].forwards;
    seconds += results[0].prefill_seconds + results[0].decode_seconds;
  }
  state.counters["us_per_step"] = 1e6 * seconds / double(steps);
}

void BM_UndraftedRound(benchmark::State& state) {
  const int batch = int(state.range(0)), gamma = 7;
  const auto prompts = requests_for(batch);
  SpeculativeTiming timing;  // summed over the runs
  SpeculativeStats stats;
  // One scheduler for every run, as a server keeps it: its gate, shut by
  // the first runs, stays shut.
  PrefixScheduler scheduler = shut_gate_scheduler(batch, gamma);
  for (auto _ : state) {
    InstantTarget target;
    DoubtfulSource source;
    SpeculativeOptions options;
    options.max_new_tokens = kNewTokens;
    options.gamma = gamma;
    options.max_active = batch;
    options.scheduler = &scheduler;
    SpeculativeTiming run;
    for (const SpeculativeResult& result : speculative_generate(target, source, prompts, options, &run))
      stats.add(result.stats);
    timing.add(run);
  }
  const double rounds = double(timing.rounds);
  state.counters["us_per_step"] = 1e6 * (timing.prefill_seconds + timing.decode_seconds) / rounds;
  // The round's phases as the bench's ms_per_batch_round splits them.
  state.counters["draft_us"] = 1e6 * timing.draft_seconds / rounds;
  state.counters["verify_us"] = 1e6 * timing.verify_seconds / rounds;
  state.counters["accept_us"] = 1e6 * timing.accept_seconds / rounds;
  state.counters["undrafted_share"] = double(stats.undrafted) / double(stats.rounds);
}

BENCHMARK(BM_PlainStep)->Arg(1)->Arg(4)->Arg(16)->Arg(64);
BENCHMARK(BM_UndraftedRound)->Arg(1)->Arg(4)->Arg(16)->Arg(64);

}  // namespace

BENCHMARK_MAIN();
