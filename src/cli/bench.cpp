// dspark bench decode: how fast the target decodes, against the memory
// roofline, and what verifying k tokens at once costs next to one.
//
// Every step is timed on the host around a complete, synchronised forward
// (what a decode loop actually waits for), after warm-up steps that also
// capture the CUDA graphs; the median of the timed steps is reported.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/json.h"
#include "core/random.h"
#include "model/target.h"
#ifdef DSPARK_CUDA
#include "kernels/cuda/device.h"
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
  bool json = false;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Bytes one decode step must read: every weight the step touches once (the
// embedding only as the rows it gathers), plus each sequence's KV cache.
double decode_step_bytes(const ModelConfig& c, double weight_bytes_per_element, int batch, double context) {
  const double H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const double q_size = double(c.num_heads) * c.head_dim, kv_size = double(c.num_kv_heads) * c.head_dim;
  const double layer = H * (q_size + 2 * kv_size) + q_size * H + 3 * H * F;
  const double weights = (c.num_layers * layer + V * H) * weight_bytes_per_element;
  const double kv_cache = batch * context * c.num_layers * 2 * kv_size * weight_bytes_per_element;
  return weights + kv_cache;
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

void run_bench_decode(const BenchDecodeFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const ModelConfig& c = target->config();
  const bool on_gpu = target->device_description().rfind("cuda", 0) == 0;
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
  std::vector<std::vector<int32_t>> blocks(flags.batch);
  for (int k = 1; k <= flags.max_verify; k = k < 4 ? k + 1 : k * 2) {
    std::vector<double> samples;
    for (int run = 0; run < 3 + 7; ++run) {
      for (int b = 0; b < flags.batch; ++b) {
        blocks[b].assign(k, next[b]);
        inputs[b] = {sequences[b], blocks[b], true};
      }
      const int length = target->sequence_length(sequences[0]);
      const double seconds = timed(inputs);
      for (int sequence : sequences) target->truncate_sequence(sequence, length);
      if (run >= 3) samples.push_back(seconds);
    }
    const double milliseconds = median(samples) * 1e3;
    if (k == 1) one_token = milliseconds;
    verify.push_back({{"k", k}, {"ms", milliseconds}, {"ratio", milliseconds / one_token}});
  }

  double copy_bandwidth = 0.0;
#ifdef DSPARK_CUDA
  if (on_gpu) copy_bandwidth = cuda::measure_copy_bandwidth(size_t(4) << 30);
#endif
  if (!on_gpu) copy_bandwidth = cpu_copy_bandwidth();
  const double bytes_per_element = on_gpu ? 2.0 : 4.0;
  const double context = flags.prompt_length + flags.generate / 2.0;
  const double bytes = decode_step_bytes(c, bytes_per_element, flags.batch, context);
  const double weight_bytes = decode_step_bytes(c, bytes_per_element, 0, 0);
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
  std::printf("decode: %.3f ms/step, %.1f tokens/s; %.1f GB/s of %.1f GB/s copy bandwidth (%.0f%% of roofline)\n",
              step * 1e3, flags.batch / step, achieved, copy_bandwidth, 100.0 * achieved / copy_bandwidth);
  std::printf("verify t(k)/t(1):");
  for (const auto& point : verify) std::printf("  k=%d %.2f", point["k"].get<int>(), point["ratio"].get<double>());
  std::printf("\n");
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
  decode->add_option("--max-verify", flags->max_verify, "largest k of the verify-cost curve")
      ->capture_default_str()->check(CLI::Range(1, 64));
  decode->add_flag("--json", flags->json, "print one JSON object");
  add_device_option(*decode, flags->device);
  decode->callback([flags] { run_bench_decode(*flags); });
}

}  // namespace dspark::cli
