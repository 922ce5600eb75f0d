// dspark bench decode: how fast the target decodes, against the memory
// roofline, and what verifying k tokens at once costs next to one.
//
// Every step is timed on the host around a complete, synchronised forward
// (what a decode loop actually waits for), after warm-up steps that also
// capture the CUDA graphs; the median of the timed steps is reported.
//
// dspark bench spec: plain vs speculative decoding of the same prompts.
//
// dspark bench draft: one GPU draft step (backbone + head + pruning) against
// one target decode step at the same batch and context, timed with CUDA
// events on each one's stream around the complete call (median after warm-up).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "core/json.h"
#include "core/plot.h"
#include "core/random.h"
#include "model/cpu_target.h"
#include "model/generate.h"
#include "model/prompts.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/compare.h"
#include "spec/draft_sources.h"
#include "spec/scheduler.h"
#include "spec/speculative.h"
#ifdef DSPARK_CUDA
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "model/cuda_target.h"
#include "spec/cuda_drafter.h"
#endif

namespace dspark::cli {
namespace {

struct BenchDecodeFlags {
  std::string model = default_model_directory();
  std::string device = "auto";
  int batch = 1;
  int prompt_length = 128;
  int generate = 128;
  int max_verify = 32;
  int verify_runs = 15;
  bool json = false;
};

// Bytes one decode step must read: every weight the step touches once (the
// embedding only as the rows it gathers), plus each sequence's KV cache.
double decode_step_bytes(const ModelConfig& c, double weight_bytes_per_element, double kv_bytes_per_element, int batch,
                         double context) {
  const double H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const double q_size = double(c.num_heads) * c.head_dim, kv_size = double(c.num_kv_heads) * c.head_dim;
  const double layer = H * (q_size + 2 * kv_size) + q_size * H + 3 * H * F;
  const double weights = (c.num_layers * layer + V * H) * weight_bytes_per_element;
  const double kv_cache = batch * context * c.num_layers * 2 * kv_size * kv_bytes_per_element;
  return weights + kv_cache;
}

// What a target's step reads per weight and per cached key or value: bf16 on
// the GPU; on the CPU the weights' bf16 copies when it keeps them (a bf16
// checkpoint), else f32, and an f32 cache.
std::pair<double, double> stored_bytes_per_element(const Target& target) {
  const auto* cpu_target = dynamic_cast<const CpuTarget*>(&target);
  if (!cpu_target) return {2.0, 2.0};
  return {cpu_target->model().lm_head_bf16.empty() ? 4.0 : 2.0, 4.0};
}

double cpu_copy_bandwidth() {
  const size_t bytes = size_t(1) << 28;
  std::vector<char> source(bytes, 1), destination(bytes);
  std::vector<double> seconds;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(destination.data(), source.data(), bytes);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * bytes / median(seconds) / 1e9;
}

bool runs_on_gpu(const Target& target) { return target.device_description().rfind("cuda", 0) == 0; }

// Median seconds of a forward that feeds k tokens to each of `sequences`
// (whose next token is `next[b]`), rolled back after every run: the cost of
// verifying k tokens at once.
double verify_seconds(Target& target, const std::vector<int>& sequences, const std::vector<int32_t>& next, int k,
                      int runs = 7) {
  std::vector<std::vector<int32_t>> blocks(sequences.size());
  std::vector<TargetInput> inputs(sequences.size());
  TargetRequest greedy;
  TargetResult result;
  std::vector<double> samples;
  for (int run = 0; run < 3 + runs; ++run) {  // 3 warm-up runs also capture the graphs
    for (size_t b = 0; b < sequences.size(); ++b) {
      blocks[b].assign(k, next[b]);
      inputs[b] = {sequences[b], blocks[b], true};
    }
    std::vector<int> lengths;
    for (int sequence : sequences) lengths.push_back(target.sequence_length(sequence));
    const auto start = std::chrono::steady_clock::now();
    target.forward(inputs, greedy, result);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (size_t b = 0; b < sequences.size(); ++b) target.truncate_sequence(sequences[b], lengths[b]);
    if (run >= 3) samples.push_back(seconds);
  }
  return median(samples);
}

void run_bench_decode(const BenchDecodeFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const ModelConfig& c = target->config();
  const bool on_gpu = runs_on_gpu(*target);
  const int capacity = flags.prompt_length + flags.generate + flags.max_verify + 1;
  DSPARK_CHECK(capacity <= c.max_positions, "--prompt-len + --gen + ", flags.max_verify + 1,
               " exceeds the model's context of ", c.max_positions);
  Rng rng(1234);
  std::vector<int> sequences;
  std::vector<std::vector<int32_t>> prompts(flags.batch);
  for (auto& prompt : prompts)
    for (int i = 0; i < flags.prompt_length; ++i) prompt.push_back(int32_t(rng.next() % c.vocab_size));
  TargetRequest greedy;
  TargetResult result;
  std::vector<TargetInput> inputs;
  for (int b = 0; b < flags.batch; ++b) {
    sequences.push_back(target->create_sequence(capacity));
    inputs.push_back({sequences.back(), prompts[b], false});
  }
  auto timed = [&](std::vector<TargetInput>& step) {
    const auto start = std::chrono::steady_clock::now();
    target->forward(step, greedy, result);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const double prefill_seconds = timed(inputs);

  // Decode: each sequence feeds back its own greedy token.
  const int warmup = std::min(3, flags.generate - 1);
  std::vector<double> step_seconds;
  std::vector<int32_t> next = result.tokens;
  for (int step = 0; step < flags.generate; ++step) {
    for (int b = 0; b < flags.batch; ++b) inputs[b] = {sequences[b], {&next[b], 1}, false};
    const double seconds = timed(inputs);
    next = result.tokens;
    if (step >= warmup) step_seconds.push_back(seconds);
  }
  const double step = median(step_seconds);

  // Verify cost: k tokens per sequence in one forward, rolled back after each.
  Json verify = Json::array();
  double one_token = 0.0;
  for (int k = 1; k <= flags.max_verify; k = k < 8 ? k + 1 : k * 2) {  // every k up to 8 (a block of γ <= 7)
    const double milliseconds = verify_seconds(*target, sequences, next, k, flags.verify_runs) * 1e3;
    if (k == 1) one_token = milliseconds;
    verify.push_back({{"k", k}, {"ms", milliseconds}, {"ratio", milliseconds / one_token}});
  }

  double copy_bandwidth = 0.0;
#ifdef DSPARK_CUDA
  if (on_gpu) copy_bandwidth = cuda::measure_copy_bandwidth(size_t(4) << 30);
#endif
  if (!on_gpu) copy_bandwidth = cpu_copy_bandwidth();
  const auto [weight_element, kv_element] = stored_bytes_per_element(*target);
  const double context = flags.prompt_length + flags.generate / 2.0;
  const double bytes = decode_step_bytes(c, weight_element, kv_element, flags.batch, context);
  const double weight_bytes = decode_step_bytes(c, weight_element, kv_element, 0, 0);
  const double achieved = bytes / step / 1e9;
  Json out = {{"device", target->device_description()},
              {"batch", flags.batch},
              {"prompt_len", flags.prompt_length},
              {"gen", flags.generate},
              {"prefill_ms", prefill_seconds * 1e3},
              {"ms_per_step", step * 1e3},
              {"tokens_per_s", flags.batch / step},
              {"weight_bytes", weight_bytes},
              {"bytes_per_step", bytes},
              {"achieved_gb_per_s", achieved},
              {"copy_gb_per_s", copy_bandwidth},
              {"roofline_fraction", achieved / copy_bandwidth},
              {"verify_cost", verify}};
  if (flags.json) {
    std::cout << out.dump() << std::endl;
    return;
  }
  std::printf("%s, batch %d, prompt %d, %d steps\n", out["device"].get<std::string>().c_str(), flags.batch,
              flags.prompt_length, flags.generate);
  std::printf("decode: %.3f ms/step, %.1f tokens/s; %.1f GB/s of %.1f GB/s copy bandwidth (%.0f%% of roofline)%s\n",
              step * 1e3, flags.batch / step, achieved, copy_bandwidth, 100.0 * achieved / copy_bandwidth,
              achieved > copy_bandwidth ? "; above it: part of the weights stays in the last-level cache" : "");
  std::printf("verify t(k)/t(1):");
  for (const auto& point : verify) std::printf("  k=%d %.2f", point["k"].get<int>(), point["ratio"].get<double>());
  std::printf("\n");
}

struct BenchSpecFlags {
  std::string model = default_model_directory();
  std::string draft;
  std::string prompts;
  std::string device = "auto";
  std::vector<int> batches = {1};
  bool sweep = false;
  bool continuous = false;             // continuous batching: a finished request's place goes to the next
  std::vector<std::string> schedules;  // empty: threshold for one batch size, all three for several
  std::string plot;
  std::string sps_cache;  // empty: default_sps_cache_path()
  bool reprofile = false;
  int gamma = 0;
  int max_new_tokens = 128;
  float temperature = 0.0f;
  uint64_t seed = 0;
  bool chat = false;
  bool json = false;
};

// Plain and speculative decoding of the same prompts, at one or several batch
// sizes and under one or several verify schedules:
//   off        every drafted position is verified (no pruning);
//   threshold  the drafter prunes by its calibrated thresholds (config.sts);
//   alg1       the hardware-aware prefix scheduler cuts unpruned drafts.
// One batch size and one schedule also report acceptance by position and how
// close the speed-up comes to the ideal tau * t(1) / t(gamma + 1) given this
// run's verify cost; several print (and --plot draws) tokens/s against batch size.
void run_bench_spec(const BenchSpecFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  // Where greedy outputs are exact: Target::row_invariant_rows.
  auto print_exactness_note = [&] {
    if (flags.temperature > 0) return;  // sampled: the two modes draw different random numbers
    const int exact = target->row_invariant_rows();
    std::printf(
        "(greedy outputs are identical while every step has at most %d rows, batch x (gamma + 1) <= %d; "
        "larger steps may take kernels that round a near-tie differently)\n",
        exact, exact);
  };
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  const ModelConfig& config = target->config();
  std::vector<std::vector<int32_t>> prompts;
  for (const PromptEntry& entry : read_prompt_file(flags.prompts))
    prompts.push_back(tokenize_prompt(tokenizer, entry, flags.chat));
  DSPARK_CHECK(!prompts.empty(), flags.prompts, ": no usable prompts");
  LoadedDraftSource source = load_draft_source(flags.draft, flags.model, *target, 0.0f);
  const int gamma = source.gamma_for(flags.gamma);
  const cpu::SamplingParams sampling{flags.temperature, 0, 1.0f};
  const std::vector<int> batches = flags.sweep ? std::vector<int>{1, 2, 4, 8, 16, 32, 64} : flags.batches;
  const std::vector<std::string> schedules =
      !flags.schedules.empty() ? flags.schedules
      : batches.size() > 1     ? std::vector<std::string>{"off", "threshold", "alg1"}
                               : std::vector<std::string>{"threshold"};
  auto scheduled = [&](const std::string& name) {
    return std::find(schedules.begin(), schedules.end(), name) != schedules.end();
  };
  if (scheduled("threshold") && source.drafter && !source.drafter->config.sts)
    std::fprintf(stderr, "note: %s has no config.sts (run dspark calibrate): threshold prunes nothing\n",
                 flags.draft.c_str());
  if (scheduled("alg1") && !source.drafter)
    std::fprintf(stderr, "note: -d %s gives no confidences: alg1 verifies every proposed token\n",
                 flags.draft.c_str());
  const std::filesystem::path cache =
      flags.sps_cache.empty() ? default_sps_cache_path() : std::filesystem::path(flags.sps_cache);
  VerifySchedules verify_schedules(*target, source, flags.model, flags.draft, schedules,
                                   *std::max_element(batches.begin(), batches.end()), gamma, cache, flags.reprofile);
  const std::string sps_note = verify_schedules.sps_note();

  struct Point {
    int batch = 0;
    size_t requests = 0;
    TimedDecoding plain;
    std::vector<TimedDecoding> modes;  // one per schedule
  };
  // On the GPU every chunk is run once untimed by every mode before it is
  // timed. A product's first use of a row count sets up its plan (the
  // per-shape choice between kernels, cuBLASLt's algorithm), and a chunk has
  // row counts no earlier one had: its prefill, and under continuous
  // batching each forward that takes in new prompts. That one-time cost fell
  // on whichever mode met the count first: plain decoding, which runs each
  // chunk first (1 ms a request at batch 1 from the prefill; 2.6 ms for each
  // wave of admissions at batch 8 with continuous batching, where alg1 with
  // its gate shut then ran 5-16% faster than plain decoding on the same forwards).
  const bool on_gpu = runs_on_gpu(*target);
  std::vector<Point> points;
  for (const int batch : batches) {
    // Static batches (the default): each batch of requests is decoded to its
    // slowest request's end. Continuous: `batch` requests decode together
    // and a finished one's place goes to the next, as a server runs; the
    // modes then alternate every kChunkBatches batches' worth of requests,
    // and there are at least that many (the run's last requests finish with
    // fewer in flight: a tail a few batches' worth of requests keeps small).
    constexpr size_t kChunkBatches = 4;
    const size_t chunk = flags.continuous ? kChunkBatches * batch : size_t(batch);
    // At least one full chunk: fewer prompts are repeated to fill it.
    std::vector<std::vector<int32_t>> requests = prompts;
    for (size_t i = 0; requests.size() < chunk; ++i) requests.push_back(prompts[i % prompts.size()]);
    const int max_active = flags.continuous ? batch : 0;
    auto chunk_of = [&](size_t begin) {
      return std::span<const std::vector<int32_t>>(requests).subspan(begin, std::min(chunk, requests.size() - begin));
    };
    Point point;
    point.batch = batch;
    point.requests = requests.size();
    point.modes.resize(schedules.size());
    GenerateOptions plain_options;
    plain_options.max_new_tokens = flags.max_new_tokens;
    plain_options.sampling = sampling;
    plain_options.seed = flags.seed;
    plain_options.max_active = max_active;
    auto spec_options = [&](const std::string& schedule) {
      SpeculativeOptions options;
      options.max_new_tokens = flags.max_new_tokens;
      options.sampling = sampling;
      options.seed = flags.seed;
      options.gamma = gamma;
      options.scheduler = verify_schedules.scheduler(schedule);
      options.max_active = max_active;
      return options;
    };
    auto run_spec = [&](size_t begin, size_t m, TimedDecoding* record) {
      const std::span<const std::vector<int32_t>> reference = point.plain.outputs;
      timed_speculative_decoding(
          *target, verify_schedules.source(schedules[m]), chunk_of(begin), spec_options(schedules[m]), record,
          record ? reference.subspan(begin, std::min(chunk, reference.size() - begin)) : reference.first(0));
    };
    // Chunk by chunk, every mode on the same requests one after another, so
    // that a shared machine's drift in memory bandwidth over the run falls on
    // all modes alike (the 2-core guest's plain decoding speeds up and slows
    // down by 10-25% over minutes; measured mode after mode, the batch-64
    // ratio of two identical runs came out 0.83 and 0.91). An untimed pass of
    // every mode first, over the first chunk (on the GPU over each, above):
    // GEMM algorithm choice and CUDA graph capture happen on a shape's first
    // uses, and every mode should be measured warm.
    for (size_t begin = 0; begin < requests.size(); begin += chunk) {
      const std::span<const std::vector<int32_t>> requests_of_chunk = chunk_of(begin);
      if (begin == 0 || on_gpu) {
        timed_plain_decoding(*target, requests_of_chunk, plain_options, nullptr);
        for (size_t m = 0; m < schedules.size(); ++m) run_spec(begin, m, nullptr);
      }
      timed_plain_decoding(*target, requests_of_chunk, plain_options, &point.plain);
      for (size_t m = 0; m < schedules.size(); ++m) run_spec(begin, m, &point.modes[m]);
    }
    points.push_back(std::move(point));
  }

  // Where a round of the whole batch spends its time, on the host's clock.
  auto round_phases = [](const SpeculativeTiming& timing) {
    const double rounds = std::max<long>(timing.rounds, 1);
    return Json{{"draft", 1e3 * timing.draft_seconds / rounds},
                {"verify", 1e3 * timing.verify_seconds / rounds},
                {"accept", 1e3 * timing.accept_seconds / rounds},
                {"admission_prefill", 1e3 * timing.admission_prefill_seconds / rounds},
                {"total", 1e3 * timing.decode_seconds / rounds}};
  };
  auto mode_json = [&](const Point& point, const TimedDecoding& mode) {
    const SpeculativeStats& stats = mode.stats;
    Json json = {
        {"tokens_per_s", mode.tokens_per_s()},
        {"speedup", mode.tokens_per_s() / point.plain.tokens_per_s()},
        {"tau", stats.tau()},
        {"proposed_per_round", stats.rounds ? double(stats.proposed) / stats.rounds : 0.0},
        {"verified_per_round", stats.rounds ? double(stats.drafted) / stats.rounds : 0.0},
        {"undrafted_rounds", stats.undrafted},
        {"rounds", stats.rounds},
        {"prefill_ms", 1e3 * mode.prefill_seconds},
        {"batch_rounds", mode.timing.rounds},
        {"ms_per_batch_round", round_phases(mode.timing)},
        {"warm_up_rounds", mode.warm_ups.forwards},
        {"ms_in_warm_up_rounds", 1e3 * mode.warm_ups.seconds},
        {"ms_per_undrafted_round",
         mode.timing.undrafted_rounds ? 1e3 * mode.timing.undrafted_seconds / mode.timing.undrafted_rounds : 0.0},
        {"acceptance_by_position", stats.acceptance_by_position()},
        {"outputs_matched", mode.matched},
        {"all_outputs_match", mode.matched == long(point.requests)}};
    // Continuous batching: the same with every place taken in both modes
    // (GenerateResult::full_batch: what a server sustains at this batch size).
    if (point.plain.full_batch.forwards > 0 && mode.full_batch.forwards > 0) {
      json["full_batch_speedup"] = mode.full_batch.tokens_per_s() / point.plain.full_batch.tokens_per_s();
      json["full_batch_rounds"] = mode.full_batch.forwards;
    }
    return json;
  };
  // A point's batch and its plain decoding, in either shape of the output.
  auto point_json = [](const Point& point) {
    return Json{{"batch", point.batch},
                {"requests", point.requests},
                {"plain_tokens_per_s", point.plain.tokens_per_s()},
                {"plain_prefill_ms", 1e3 * point.plain.prefill_seconds},
                {"plain_admission_prefill_ms", 1e3 * point.plain.admission_prefill_seconds},
                {"plain_steps", point.plain.steps},
                {"plain_ms_per_step",
                 1e3 * (point.plain.seconds - point.plain.prefill_seconds) / std::max<long>(point.plain.steps, 1)},
                {"plain_warm_up_steps", point.plain.warm_ups.forwards},
                {"plain_ms_in_warm_up_steps", 1e3 * point.plain.warm_ups.seconds},
                {"plain_full_batch_steps", point.plain.full_batch.forwards},
                {"plain_full_batch_tokens_per_s", point.plain.full_batch.tokens_per_s()}};
  };
  if (!flags.plot.empty()) {
    std::vector<PlotSeries> series;
    const Marker markers[] = {Marker::square, Marker::triangle, Marker::diamond, Marker::cross};
    series.push_back({"plain", {}, {}, true, false, Marker::circle});
    for (size_t m = 0; m < schedules.size(); ++m) series.push_back({schedules[m], {}, {}, true, false, markers[m % 4]});
    for (const Point& point : points) {
      series[0].x.push_back(point.batch), series[0].y.push_back(point.plain.tokens_per_s());
      for (size_t m = 0; m < schedules.size(); ++m)
        series[m + 1].x.push_back(point.batch), series[m + 1].y.push_back(point.modes[m].tokens_per_s());
    }
    PlotOptions axes;
    axes.log_x = batches.size() > 1;
    char title[256];
    std::snprintf(title, sizeof title, "Throughput, %s, gamma %d, temperature %.2f",
                  target->device_description().c_str(), gamma, flags.temperature);
    write_line_plot(flags.plot, title, "batch size (requests decoded together)", "tokens/s", series, axes);
  }

  if (points.size() == 1 && schedules.size() == 1) {
    // The verify cost at this batch size and a typical context.
    const Point& point = points[0];
    const TimedDecoding& mode = point.modes[0];
    const int batch = point.batch;
    size_t total_length = 0;
    for (const auto& prompt : prompts) total_length += prompt.size();
    const int context = std::min<int>(config.max_positions - gamma - 2, int(total_length / prompts.size()));
    std::vector<int> sequences;
    std::vector<int32_t> next;
    for (int b = 0; b < batch; ++b) {
      sequences.push_back(target->create_sequence(context + gamma + 1));
      std::vector<int32_t> filler(std::max(1, context), prompts[0][0]);
      TargetInput input{sequences.back(), filler, false};
      TargetResult result;
      target->forward({&input, 1}, TargetRequest{}, result);
      next.push_back(result.tokens[0]);
    }
    const double t1 = verify_seconds(*target, sequences, next, 1);
    const double t_block = verify_seconds(*target, sequences, next, gamma + 1);
    for (int sequence : sequences) target->release_sequence(sequence);

    const double plain_rate = point.plain.tokens_per_s(), spec_rate = mode.tokens_per_s();
    const double speedup = spec_rate / plain_rate, ideal = mode.stats.tau() * t1 / t_block;
    Json out = mode_json(point, mode);
    out.update(point_json(point));
    out.update({{"device", target->device_description()},
                {"draft", flags.draft},
                {"schedule", schedules[0]},
                {"prompts", prompts.size()},
                {"gamma", gamma},
                {"temperature", flags.temperature},
                {"spec_tokens_per_s", spec_rate},
                {"verify_cost_ratio", t_block / t1},
                {"ideal_speedup", ideal},
                {"efficiency", speedup / ideal}});
    out.erase("tokens_per_s");
    if (!sps_note.empty()) out["sps_profile"] = sps_note;
    if (flags.plot.size()) out["plot"] = flags.plot;
    if (flags.json) {
      std::cout << out.dump() << std::endl;
      return;
    }
    std::printf("%s, %zu prompts, batch %d, gamma %d, temperature %.2f, draft %s, schedule %s\n",
                out["device"].get<std::string>().c_str(), prompts.size(), batch, gamma, flags.temperature,
                flags.draft.c_str(), schedules[0].c_str());
    std::printf("tau %.3f; %.2f of %.2f proposed tokens verified per round; acceptance by position:",
                mode.stats.tau(), out["verified_per_round"].get<double>(), out["proposed_per_round"].get<double>());
    for (double rate : mode.stats.acceptance_by_position()) std::printf(" %.2f", rate);
    std::printf("\nplain %.1f tokens/s, speculative %.1f tokens/s: %.2fx (ideal %.2fx = tau x t(1)/t(%d) with "
                "t(%d)/t(1) = %.2f; efficiency %.0f%%)\n",
                plain_rate, spec_rate, speedup, ideal, gamma + 1, gamma + 1, t_block / t1, 100.0 * speedup / ideal);
    if (out.contains("full_batch_speedup"))
      std::printf("with every place taken (%ld of %ld rounds): %.2fx\n", mode.full_batch.forwards, mode.timing.rounds,
                  out["full_batch_speedup"].get<double>());
    std::printf("outputs identical to plain decoding: %ld of %zu\n", mode.matched, point.requests);
    if (mode.matched != long(point.requests)) print_exactness_note();
    if (!sps_note.empty()) std::printf("SPS profile %s\n", sps_note.c_str());
    return;
  }

  Json out = {{"device", target->device_description()},
              {"draft", flags.draft},
              {"prompts", prompts.size()},
              {"gamma", gamma},
              {"temperature", flags.temperature},
              {"schedules", schedules},
              {"batching", flags.continuous ? "continuous" : "static"},
              {"points", Json::array()}};
  if (!sps_note.empty()) out["sps_profile"] = sps_note;
  if (flags.plot.size()) out["plot"] = flags.plot;
  for (const Point& point : points) {
    Json entry = point_json(point);
    entry["schedules"] = Json::object();
    for (size_t m = 0; m < schedules.size(); ++m) entry["schedules"][schedules[m]] = mode_json(point, point.modes[m]);
    out["points"].push_back(entry);
  }
  // Issue 8's two figures for each schedule: its lowest speed-up over plain
  // decoding across the batch sizes run (the goal: >= 0.98 everywhere), and
  // what batch 4 keeps of batch 1's speed-up (the goal: >= 90%; also as a
  // share of batch 1's gain over plain, (s4 - 1) / (s1 - 1)). Under
  // continuous batching, also from the full-batch speed-ups ("full_batch").
  auto summary_of = [&](const std::string& schedule, const char* key) {
    double lowest = std::numeric_limits<double>::infinity(), at_1 = 0.0, at_4 = 0.0;
    int lowest_batch = 0;
    for (const Json& entry : out["points"]) {
      const Json& mode = entry["schedules"][schedule];
      if (!mode.contains(key)) return Json();
      const double speedup = mode[key].get<double>();
      const int batch = entry["batch"].get<int>();
      if (speedup < lowest) lowest = speedup, lowest_batch = batch;
      if (batch == 1) at_1 = speedup;
      if (batch == 4) at_4 = speedup;
    }
    Json summary = {{"lowest_speedup", lowest}, {"lowest_at_batch", lowest_batch}};
    if (at_1 > 0.0 && at_4 > 0.0) {
      summary["batch4_over_batch1"] = at_4 / at_1;
      if (at_1 > 1.0) summary["batch4_share_of_batch1_gain"] = (at_4 - 1.0) / (at_1 - 1.0);
    }
    return summary;
  };
  out["summary"] = Json::object();
  for (const std::string& schedule : schedules) {
    out["summary"][schedule] = summary_of(schedule, "speedup");
    if (Json full = summary_of(schedule, "full_batch_speedup"); !full.is_null())
      out["summary"][schedule]["full_batch"] = full;
  }
  if (flags.json) {
    std::cout << out.dump() << std::endl;
    return;
  }
  std::printf("%s, %zu prompts, gamma %d, temperature %.2f, draft %s, %s batching\n",
              out["device"].get<std::string>().c_str(), prompts.size(), gamma, flags.temperature, flags.draft.c_str(),
              flags.continuous ? "continuous" : "static");
  std::printf("tokens/s (speed-up over plain%s, tau, tokens verified per round; * = an output differed)\n",
              flags.continuous ? " [with every place taken]" : "");
  std::printf("batch  requests     plain");
  for (const std::string& schedule : schedules) std::printf("  %38s", schedule.c_str());
  std::printf("\n");
  for (const Json& entry : out["points"]) {
    std::printf("%5d  %8zu  %8.1f", entry["batch"].get<int>(), entry["requests"].get<size_t>(),
                entry["plain_tokens_per_s"].get<double>());
    for (const std::string& schedule : schedules) {
      const Json& mode = entry["schedules"][schedule];
      char full[32] = "";
      if (mode.contains("full_batch_speedup"))
        std::snprintf(full, sizeof full, " [%.2fx]", mode["full_batch_speedup"].get<double>());
      char cell[96];
      std::snprintf(cell, sizeof cell, "%.1f (%.2fx%s, %.2f, %.2f)%s", mode["tokens_per_s"].get<double>(),
                    mode["speedup"].get<double>(), full, mode["tau"].get<double>(),
                    mode["verified_per_round"].get<double>(), mode["all_outputs_match"].get<bool>() ? " " : "*");
      std::printf("  %38s", cell);
    }
    std::printf("\n");
  }
  auto print_summary = [](const std::string& what, const Json& summary) {
    std::printf("%s: lowest speed-up %.3fx (batch %d)", what.c_str(), summary["lowest_speedup"].get<double>(),
                summary["lowest_at_batch"].get<int>());
    if (summary.contains("batch4_over_batch1"))
      std::printf("; batch 4 keeps %.0f%% of batch 1's speed-up", 100.0 * summary["batch4_over_batch1"].get<double>());
    if (summary.contains("batch4_share_of_batch1_gain"))
      std::printf(" (%.0f%% of its gain)", 100.0 * summary["batch4_share_of_batch1_gain"].get<double>());
    std::printf("\n");
  };
  for (const std::string& schedule : schedules) {
    const Json& summary = out["summary"][schedule];
    print_summary(schedule, summary);
    if (summary.contains("full_batch")) print_summary(schedule + ", every place taken", summary["full_batch"]);
  }
  const bool differed = std::any_of(out["points"].begin(), out["points"].end(), [](const Json& entry) {
    return std::any_of(entry["schedules"].begin(), entry["schedules"].end(),
                       [](const Json& mode) { return !mode["all_outputs_match"].get<bool>(); });
  });
  if (differed) print_exactness_note();
  if (!sps_note.empty()) std::printf("SPS profile %s\n", sps_note.c_str());
  if (!flags.plot.empty()) std::printf("wrote %s\n", flags.plot.c_str());
}

struct BenchDraftFlags {
  std::string model = default_model_directory();
  std::string draft;     // a drafter directory; empty: a fresh one from `config`
  DrafterConfig config;  // (its tap layers: the target's default)
  uint32_t seed = 0;
  // A fresh drafter's markov.w2 (zero at init) drawn N(0, std): a head with
  // work to do. At zero the tokens-only head's bounds are exact, so it forms
  // one exact logit per block, fewer than a trained head's.
  float markov_w2_std = 0.0f;
  bool full_head = false;          // greedy steps form every logit (CudaDrafter::use_quantized_head(false))
  bool full_lm_head = false;       // ... and the LM head's full product (CudaDrafter::use_quantized_lm_head(false))
  bool per_position_head = false;  // the head's positions one launch each (CudaDrafter::use_one_launch_head(false))
  int batch = 1;
  int context = 512;
  int runs = 50;
  bool after_target = false;  // each timed draft step follows an untimed target step, as in decoding
  bool json = false;
};

#ifdef DSPARK_CUDA
// Milliseconds from an event recorded on `stream` before `call` to one recorded after it.
template <class Call>
double event_milliseconds(cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, Call call) {
  CUDA_CHECK(cudaEventRecord(start, stream));
  call();
  CUDA_CHECK(cudaEventRecord(stop, stream));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float milliseconds = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
  return milliseconds;
}
#endif

void run_bench_draft(const BenchDraftFlags& flags) {
#ifndef DSPARK_CUDA
  fail("bench draft: this build has no CUDA support (nvcc was not found at build time)");
#else
  DSPARK_CHECK(cuda::device_count() > 0, "bench draft: no CUDA GPU is visible");
  const std::unique_ptr<Target> target = load_target(flags.model, "cuda");
  const ModelConfig& c = target->config();
  const CudaTargetHead head = *cuda_target_head(*target);
  Drafter drafter;
  if (flags.draft.empty()) {
    DrafterConfig config = flags.config;
    config.tap_layers = default_tap_layers(c.num_layers);
    validate_drafter_config(config, c.num_layers);
    drafter = init_drafter(config, {c.hidden_size, c.vocab_size, c.rms_norm_eps}, target_id_of(flags.model),
                           flags.seed);
    if (flags.markov_w2_std > 0.0f && config.seq_head != "rnn") {
      const Tensor& w2 = drafter.parameter("markov.w2");
      draw_normal(w2.data, w2.numel(), flags.markov_w2_std, flags.seed + 1);
    }
  } else {
    drafter = load_drafter(flags.draft);
    check_drafter_matches_target(drafter, c, target_id_of(flags.model));
  }
  const DrafterConfig config = drafter.config;
  const int gamma = config.gamma, width = static_cast<int>(config.tap_layers.size()) * c.hidden_size;
  DSPARK_CHECK(flags.context + gamma + 2 <= c.max_positions, "--context ", flags.context, " leaves no room for a ",
               "step in the target's context of ", c.max_positions);
  CudaDrafter gpu(drafter, head);
  gpu.use_quantized_head(!flags.full_head);
  gpu.use_quantized_lm_head(!flags.full_lm_head);
  gpu.use_one_launch_head(!flags.per_position_head);
  drafter = Drafter{};  // uploaded: the host copy is no longer needed

  // B requests, each with `context` rows of tapped features (random: the
  // step's cost does not depend on their values) and a random anchor.
  Rng rng(1234);
  std::vector<float> rows(size_t(flags.context + gamma + 1) * width);
  for (float& value : rows) value = float(2.0 * rng.uniform() - 1.0);
  std::vector<CudaDraftRequest> requests;
  for (int b = 0; b < flags.batch; ++b) {
    const int context = gpu.create_context();
    gpu.extend_context(context, rows.data(), flags.context);
    requests.push_back({context, int32_t(rng.next() % c.vocab_size), nullptr});
  }
  gpu.flush_contexts();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  constexpr int kWarmup = 3;  // the first step of a bucket runs eagerly and is captured; then replays

  // B target sequences at the same context, and one decode step of all of them, rolled back after.
  std::vector<int> sequences;
  std::vector<int32_t> prompt(flags.context), next(flags.batch);
  for (int b = 0; b < flags.batch; ++b) {
    for (int32_t& token : prompt) token = int32_t(rng.next() % c.vocab_size);
    sequences.push_back(target->create_sequence(flags.context + 1));
    TargetInput input{sequences.back(), prompt, false};
    TargetResult result;
    target->forward({&input, 1}, TargetRequest{}, result);
    next[b] = result.tokens[0];
  }
  std::vector<TargetInput> inputs;
  TargetResult result;
  auto target_step = [&] {
    inputs.clear();
    for (int b = 0; b < flags.batch; ++b) inputs.push_back({sequences[b], {&next[b], 1}, false});
    const double milliseconds =
        event_milliseconds(head.stream, start, stop, [&] { target->forward(inputs, TargetRequest{}, result); });
    for (int sequence : sequences) target->truncate_sequence(sequence, flags.context);
    return milliseconds;
  };

  // The draft step: every position drafted (no thresholds, no floor).
  gpu.enable_step_timing(true);
  std::vector<DraftResult> results;
  std::vector<double> draft_ms, draft_device_ms, draft_host_ms;
  for (int run = 0; run < kWarmup + flags.runs; ++run) {
    if (flags.after_target) target_step();  // its weights, not the drafter's, are what L2 holds then
    const auto host_start = std::chrono::steady_clock::now();
    const double milliseconds =
        event_milliseconds(gpu.stream(), start, stop, [&] { gpu.draft(requests, DraftOptions{}, results); });
    const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count() * 1e3;
    if (run < kWarmup) continue;
    draft_ms.push_back(milliseconds);
    draft_device_ms.push_back(gpu.last_step_milliseconds());
    draft_host_ms.push_back(host);
  }
  gpu.enable_step_timing(false);

  // The context extension one round at most adds (pending + gamma accepted rows per request), rolled back after.
  std::vector<double> extend_ms;
  for (int run = 0; run < kWarmup + flags.runs; ++run) {
    for (const CudaDraftRequest& request : requests)
      gpu.extend_context(request.context, rows.data() + size_t(flags.context) * width, gamma + 1);
    const double milliseconds = event_milliseconds(gpu.stream(), start, stop, [&] { gpu.flush_contexts(); });
    for (const CudaDraftRequest& request : requests) gpu.truncate_context(request.context, flags.context);
    if (run >= kWarmup) extend_ms.push_back(milliseconds);
  }

  // One target decode step at the same batch and context.
  std::vector<double> target_ms, target_host_ms;
  for (int run = 0; run < kWarmup + flags.runs; ++run) {
    const auto host_start = std::chrono::steady_clock::now();
    const double milliseconds = target_step();
    const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count() * 1e3;
    if (run < kWarmup) continue;
    target_ms.push_back(milliseconds);
    target_host_ms.push_back(host);
  }
  for (int sequence : sequences) target->release_sequence(sequence);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);

  const double draft = median(draft_ms), decode = median(target_ms), ratio = draft / decode;
  Json out = {{"device", target->device_description()},
              {"target", flags.model},
              {"draft", flags.draft.empty() ? "fresh init" : flags.draft},
              {"seq_head", config.seq_head},
              {"markov_w2_std", flags.markov_w2_std},
              {"full_head", flags.full_head},
              {"full_lm_head", flags.full_lm_head},
              {"per_position_head", flags.per_position_head},
              {"gamma", gamma},
              {"d_draft", config.d_draft},
              {"layers", config.num_layers},
              {"heads", config.num_heads},
              {"markov_rank", config.markov_rank},
              {"hidden_size", c.hidden_size},
              {"vocab_size", c.vocab_size},
              {"batch", flags.batch},
              {"context", flags.context},
              {"runs", flags.runs},
              {"after_target", flags.after_target},
              {"draft_ms", draft},
              {"draft_device_ms", median(draft_device_ms)},
              {"draft_host_ms", median(draft_host_ms)},
              {"extend_ms", median(extend_ms)},
              {"target_decode_ms", decode},
              {"target_decode_host_ms", median(target_host_ms)},
              {"ratio", ratio},
              {"ratio_with_extend", (draft + median(extend_ms)) / decode}};
  if (flags.json) {
    std::cout << out.dump() << std::endl;
    return;
  }
  std::printf("%s; %s head, gamma %d, d %d, %d layers; batch %d, context %d; median of %d\n",
              out["device"].get<std::string>().c_str(), config.seq_head.c_str(), gamma, config.d_draft,
              config.num_layers, flags.batch, flags.context, flags.runs);
  std::printf("draft step   %8.3f ms (device %.3f ms, host %.3f ms)%s\n", draft, median(draft_device_ms),
              median(draft_host_ms), flags.after_target ? ", each after a target step" : "");
  std::printf("extend %2d rows %6.3f ms\n", gamma + 1, median(extend_ms));
  std::printf("target decode %7.3f ms (host %.3f ms)\n", decode, median(target_host_ms));
  std::printf("draft / decode = %.1f%% (with the extension %.1f%%)\n", 100.0 * ratio,
              100.0 * (draft + median(extend_ms)) / decode);
#endif
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto flags = std::make_shared<BenchDecodeFlags>();
  CLI::App* decode = bench->add_subcommand("decode", "Target decode speed, roofline and verify cost");
  decode->add_option("-m,--model", flags->model, "HF model directory")->capture_default_str();
  decode->add_option("--batch", flags->batch, "sequences decoded together")->capture_default_str()
      ->check(CLI::Range(1, 256));
  decode->add_option("--prompt-len", flags->prompt_length, "prompt tokens per sequence")->capture_default_str()
      ->check(CLI::PositiveNumber);
  decode->add_option("--gen", flags->generate, "decode steps")->capture_default_str()->check(CLI::Range(2, 100000));
  decode->add_option("--verify-runs", flags->verify_runs, "timed forwards per k (median), after 3 warm-up ones")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  decode->add_option("--max-verify", flags->max_verify, "largest k of the verify-cost curve")
      ->capture_default_str()->check(CLI::Range(1, 64));
  decode->add_flag("--json", flags->json, "print one JSON object");
  add_device_option(*decode, flags->device);
  decode->callback([flags] { run_bench_decode(*flags); });

  auto spec_flags = std::make_shared<BenchSpecFlags>();
  CLI::App* spec = bench->add_subcommand("spec", "Plain vs speculative decoding of the same prompts");
  spec->add_option("-m,--model", spec_flags->model, "the target's HF model directory")->capture_default_str();
  spec->add_option("-d,--draft", spec_flags->draft, "a DSpark drafter directory, or ngram")->required();
  spec->add_option("--prompts", spec_flags->prompts, "JSONL file of {\"prompt\"} or {\"messages\"}")->required();
  CLI::Option* batch_option =
      spec->add_option("--batch", spec_flags->batches, "requests decoded together; a list (1,4,16) runs each")
          ->capture_default_str()->delimiter(',')->check(CLI::Range(1, 256));
  spec->add_flag("--sweep", spec_flags->sweep, "batch sizes 1, 2, 4, ..., 64")->excludes(batch_option);
  spec->add_option("--schedule", spec_flags->schedules,
                   "off, threshold (config.sts) or alg1 (prefix scheduler), or a list; default threshold, "
                   "or all three for several batch sizes")
      ->delimiter(',')->check(CLI::IsMember({"off", "threshold", "alg1"}));
  spec->add_option("--plot", spec_flags->plot, "write tokens/s against batch size to this PNG");
  spec->add_option("--sps-cache", spec_flags->sps_cache,
                   "alg1's SPS(B) profile cache (default $DSPARK_CACHE_DIR/sps.json, else "
                   "$XDG_CACHE_HOME or ~/.cache /dspark/sps.json)");
  spec->add_flag("--reprofile", spec_flags->reprofile, "measure SPS(B) again even when cached");
  spec->add_flag("--continuous", spec_flags->continuous,
                 "continuous batching: a finished request's place goes to the next waiting one (default: each batch "
                 "is decoded to its slowest request's end before the next starts)");
  spec->add_option("--gamma", spec_flags->gamma, "most tokens drafted per round (default: the drafter's)")
      ->check(CLI::Range(1, 64));
  spec->add_option("-n,--max-tokens", spec_flags->max_new_tokens, "tokens per prompt")->capture_default_str()
      ->check(CLI::PositiveNumber);
  spec->add_option("--temperature", spec_flags->temperature, "0 = greedy")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  spec->add_option("--seed", spec_flags->seed, "sampling seed")->capture_default_str();
  spec->add_flag("--chat", spec_flags->chat, "wrap text prompts in the chat template");
  spec->add_flag("--json", spec_flags->json, "print one JSON object");
  add_device_option(*spec, spec_flags->device);
  spec->callback([spec_flags] { run_bench_spec(*spec_flags); });

  auto draft_flags = std::make_shared<BenchDraftFlags>();
  CLI::App* draft = bench->add_subcommand("draft", "One GPU draft step against one target decode step");
  draft->add_option("-m,--model", draft_flags->model, "the target's HF model directory")->capture_default_str();
  draft->add_option("-d,--draft", draft_flags->draft, "a DSpark drafter directory (default: a fresh one, below)");
  draft->add_option("--gamma", draft_flags->config.gamma, "fresh drafter: tokens drafted per round")
      ->capture_default_str()->check(CLI::Range(1, 32));
  draft->add_option("--d-draft", draft_flags->config.d_draft, "fresh drafter: width")->capture_default_str()
      ->check(CLI::PositiveNumber);
  draft->add_option("--layers", draft_flags->config.num_layers, "fresh drafter: backbone layers")
      ->capture_default_str()->check(CLI::PositiveNumber);
  draft->add_option("--heads", draft_flags->config.num_heads, "fresh drafter: attention heads")
      ->capture_default_str()->check(CLI::PositiveNumber);
  draft->add_option("--markov-rank", draft_flags->config.markov_rank, "fresh drafter: head rank")
      ->capture_default_str()->check(CLI::PositiveNumber);
  draft->add_option("--ff-mult", draft_flags->config.ff_mult, "fresh drafter: MLP width multiplier")
      ->capture_default_str()->check(CLI::PositiveNumber);
  draft->add_option("--seq-head", draft_flags->config.seq_head, "fresh drafter: sequential head")
      ->capture_default_str()->check(CLI::IsMember({"markov", "rnn", "gru"}));
  draft->add_option("--seed", draft_flags->seed, "fresh drafter: initialisation seed")->capture_default_str();
  draft
      ->add_option("--markov-w2-std", draft_flags->markov_w2_std,
                   "fresh drafter: markov.w2 drawn N(0, std) instead of zero (a head with work to do)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  draft->add_flag("--full-head", draft_flags->full_head,
                  "greedy steps form every logit of the Markov head (not w2 at 8 bits and the exact logit only "
                  "where the argmax can be)");
  draft->add_flag("--full-lm-head", draft_flags->full_lm_head,
                  "greedy steps of one row form every logit of the LM head (not its rows at 8 bits and the exact "
                  "logit only where the argmax can be)");
  draft->add_flag("--per-position-head", draft_flags->per_position_head,
                  "the sequential head's positions one launch each (not the whole head in one launch where its "
                  "weights fit on chip)");
  draft->add_option("--batch", draft_flags->batch, "requests drafted (and decoded) together")->capture_default_str()
      ->check(CLI::Range(1, 256));
  draft->add_option("--context", draft_flags->context, "context rows per request")->capture_default_str()
      ->check(CLI::PositiveNumber);
  draft->add_option("--runs", draft_flags->runs, "timed steps (after 3 warm-up steps)")->capture_default_str()
      ->check(CLI::Range(1, 100000));
  draft->add_flag("--after-target", draft_flags->after_target,
                  "time each draft step after an (untimed) target decode step, as in decoding");
  draft->add_flag("--json", draft_flags->json, "print one JSON object");
  draft->callback([draft_flags] { run_bench_draft(*draft_flags); });
}

}  // namespace dspark::cli
