// dspark bench train: the speed of GPU training steps (DESIGN.md §4) at a
// given drafter and target shape, on random data: the step `dspark train
// --device cuda` runs (train/train_step.h), alone and with its batches' way
// from the data.
//
// A fresh drafter (init_drafter) for a target of hidden size H and vocabulary
// V whose embedding and LM head are drawn on the device; batches of A anchors
// with `--context` context rows each (bf16 values, as regenerated data's),
// every block position trained (the data's batches: all but where a block
// runs off its sequence).
// Measured:
//   step       the batch already on the device: zero the gradients, loss and
//              backward, global norm, clipping and AdamW (CUDA events on the
//              step's stream, median of the timed steps after warm-up);
//   upload     a built TrainBatch's copy to the device (host packing +
//              transfer; host clock, median);
//   step + upload  both, one after the other (host clock, median);
// and, on data written in the regen format (random rows, each sequence's
// prompt as long as the context, so every anchor has its full context) and
// read through a Dataset as `dspark train` reads it, the mean wall clock per
// step of N consecutive steps (after the warm-up steps):
//   serial     draw the anchors, build the TrainBatch, upload it, step: the
//              trainer without prefetching (--no-prefetch);
//   pipelined  what `dspark train --device cuda` runs: a BatchPipeline packs
//              step s+1's batch from the data into pinned memory and copies
//              it while step s runs (train/batch_pipeline.h).
// Throughput is trained block positions (A·γ) per second, the trainer's
// tokens/s. bench/train_vs_torch.py runs this against PyTorch.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include "cli/commands.h"
#include "core/dtype.h"
#include "core/json.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "spec/drafter.h"
#include "train/anchors.h"
#include "train/batch_pipeline.h"
#include "train/dataset.h"
#include "train/train_batch.h"
#include "train/train_step.h"
#ifdef DSPARK_CUDA
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/loss.h"
#include "train/cuda_loss.h"
#include "train/cuda_optimizer.h"
#endif

namespace dspark::cli {
namespace {

struct BenchTrainFlags {
  DrafterConfig config;
  int hidden = 384;
  int vocab = 8192;
  int taps = 4;
  int batch = 64;
  int context = 256;
  int steps = 20;
  int warmup = 3;
  std::string math = "tf32";
  std::string head = "bf16";
  uint64_t seed = 1;
  int threads = 0;  // the pipeline's packing threads (0: its default)
  bool json = false;
};

#ifdef DSPARK_CUDA
// A anchors of `context` rows each, random rows in bf16 (as the trainer builds them for the GPU from
// regenerated data), random ids, every position trained.
TrainBatch random_batch(const DrafterConfig& config, const TargetDims& dims, int anchors, int context, uint64_t seed) {
  Rng rng(seed);
  const int gamma = config.gamma, H = dims.hidden_size, width = static_cast<int>(config.tap_layers.size()) * H;
  TrainBatch batch;
  batch.gamma = gamma;
  batch.hidden_size = H;
  batch.tap_width = width;
  batch.context_offsets.resize(anchors + 1);
  for (int a = 0; a <= anchors; ++a) batch.context_offsets[a] = a * context;
  batch.context_rows_bf16.resize(size_t(anchors) * context * width);
  for (uint16_t& value : batch.context_rows_bf16) value = f32_to_bf16(float(2.0 * rng.uniform() - 1.0));
  for (int a = 0; a < anchors; ++a) {
    batch.anchors.push_back(int32_t(rng.next() % dims.vocab_size));
    for (int k = 0; k < gamma; ++k) batch.targets.push_back(int32_t(rng.next() % dims.vocab_size));
  }
  batch.mask.assign(size_t(anchors) * gamma, 1.0f);
  batch.target_hidden.resize(size_t(anchors) * gamma * H);
  for (float& value : batch.target_hidden) value = float(2.0 * rng.uniform() - 1.0);
  return batch;
}

// Regenerated-format data for the end-to-end measures, in /dev/shm when it has
// room (no disk in the measurement, as a data set in the page cache), else in
// the temporary directory; removed when done. Each sequence: a prompt of
// context + 1 tokens (so every anchor has `context` rows) and a response of
// 8·γ tokens; about three batches' worth of rows in all, so that consecutive
// batches read different memory, as a real data set's do.
struct BenchData {
  std::filesystem::path directory;
  long bytes = 0;

  BenchData(const DrafterConfig& config, const TargetDims& dims, int anchors, int context, uint64_t seed) {
    const int width = static_cast<int>(config.tap_layers.size()) * dims.hidden_size;
    const int prompt = context + 1, length = prompt + 8 * config.gamma;
    const long sequences = std::max(8L, (3L * anchors * context + length - 1) / length);
    const long tokens = sequences * length;
    bytes = tokens * width * 2;
    std::filesystem::path base = std::filesystem::temp_directory_path();
    std::error_code error;
    if (std::filesystem::is_directory("/dev/shm") &&
        std::filesystem::space("/dev/shm", error).available > static_cast<std::uintmax_t>(bytes) * 5 / 4 && !error)
      base = "/dev/shm";
    directory = base / ("dspark-bench-train-" + std::to_string(::getpid()));
    std::filesystem::remove_all(directory);
    std::filesystem::create_directories(directory);
    Rng rng(seed);
    std::vector<int32_t> ids(tokens);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng.next() % dims.vocab_size);
    // Random signs and mantissas, magnitudes in [0.5, 1): four values per draw.
    std::vector<uint16_t> rows(size_t(tokens) * width);
    for (size_t i = 0; i < rows.size(); i += 4) {
      const uint64_t bits = rng.next();
      for (size_t j = 0; j < 4 && i + j < rows.size(); ++j)
        rows[i + j] = static_cast<uint16_t>(((bits >> (16 * j)) & 0x807f) | 0x3f00);
    }
    write_safetensors(directory / "shard-00000.safetensors",
                      {{"ids", Dtype::I32, {tokens}, ids.data()}, {"rows", Dtype::BF16, {tokens, width}, rows.data()}});
    RegenManifest manifest;
    manifest.target_id = "bench";
    manifest.tap_layers = config.tap_layers;
    manifest.hidden_size = dims.hidden_size;
    manifest.vocab_size = dims.vocab_size;
    manifest.num_layers = config.tap_layers.back();
    manifest.complete = true;
    manifest.shards.push_back({"shard-00000.safetensors", static_cast<int>(sequences), tokens});
    for (long s = 0; s < sequences; ++s)
      manifest.sequences.push_back({0, s * length, prompt, length, static_cast<int>(s) + 1, "length"});
    write_manifest(directory, manifest);
  }
  ~BenchData() {
    std::error_code ignored;
    std::filesystem::remove_all(directory, ignored);
  }
  BenchData(const BenchData&) = delete;
  BenchData& operator=(const BenchData&) = delete;
};
#endif

void run_bench_train(const BenchTrainFlags& flags) {
#ifndef DSPARK_CUDA
  fail("bench train: this build has no CUDA support (nvcc was not found at build time)");
#else
  DSPARK_CHECK(cuda::device_count() > 0, "bench train: no CUDA GPU is visible");
  DrafterConfig config = flags.config;
  config.tap_layers.clear();
  for (int tap = 1; tap <= flags.taps; ++tap) config.tap_layers.push_back(tap);
  validate_drafter_config(config, flags.taps);
  const TargetDims dims{flags.hidden, flags.vocab, 1e-6f};
  CudaTrainPrecision precision;
  precision.math = flags.math == "f32" ? cuda::GemmMath::F32 : cuda::GemmMath::TF32;
  precision.bf16_head = flags.head == "bf16";

  DSPARK_CHECK(flags.context >= 1, "bench train: --context must be at least 1 (the trainer's max context)");
  const auto setup_start = std::chrono::steady_clock::now();
  const Drafter drafter = init_drafter(config, dims, "bench", static_cast<uint32_t>(flags.seed));
  long parameters = 0;
  for (const auto& [name, tensor] : drafter.parameters) parameters += tensor.numel();
  auto head = std::make_unique<CudaTrainHead>(CudaTrainHead::random(dims, precision.bf16_head, flags.seed, 0.05f));
  const TrainBatch batch = random_batch(config, dims, flags.batch, flags.context, flags.seed + 1);
  auto loss_holder = std::make_unique<CudaDrafterLoss>(drafter, *head, precision);
  CudaDrafterLoss& loss = *loss_holder;
  auto optimizer_holder = std::make_unique<CudaAdamW>(loss.layout(), AdamWOptions{}, loss.stream());
  CudaAdamW& optimizer = *optimizer_holder;
  const BenchData data_files(config, dims, flags.batch, flags.context, flags.seed + 2);
  const double setup_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();

  cudaStream_t stream = loss.stream();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  auto elapsed = [&] {
    CUDA_CHECK(cudaEventSynchronize(stop));
    float milliseconds = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
    return double(milliseconds);
  };
  const LossWeights weights;
  auto train_step = [&] {
    loss.zero_gradients();
    loss.launch(weights, true);
    optimizer.step(loss.parameters(), loss.gradients(), 1e-4, 1.0, loss.device_terms());
  };
  std::vector<double> step_ms, upload_ms, full_ms;
  loss.upload(batch);
  for (int run = 0; run < flags.warmup + flags.steps; ++run) {  // the batch resident: the step alone
    CUDA_CHECK(cudaEventRecord(start, stream));
    train_step();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    const double milliseconds = elapsed();
    if (run >= flags.warmup) step_ms.push_back(milliseconds);
  }
  for (int run = 0; run < flags.warmup + flags.steps; ++run) {  // the upload alone, host packing included
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto host_start = std::chrono::steady_clock::now();
    loss.upload(batch);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
    if (run >= flags.warmup) upload_ms.push_back(seconds * 1e3);
  }
  LossTerms terms;
  for (int run = 0; run < flags.warmup + flags.steps; ++run) {  // both, as the trainer runs them
    const auto host_start = std::chrono::steady_clock::now();
    loss.upload(batch);
    train_step();
    double values[cuda::kLossTerms];
    CUDA_CHECK(cudaMemcpyAsync(values, loss.device_terms(), sizeof values, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    terms = CudaDrafterLoss::terms_from(values);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
    if (run >= flags.warmup) full_ms.push_back(seconds * 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  optimizer_holder.reset();
  loss_holder.reset();

  // End to end from the data, as `dspark train --device cuda` runs: the TrainStep with a fresh
  // optimizer, the batches of steps 0, 1, ... (sample_step_anchors), every step's loss read back.
  const Dataset data(data_files.directory);
  const AnchorSampler sampler(data, split_dataset(data.size(), 0.0).train);
  std::vector<std::string> decays;
  for (const std::string& name : drafter.names)
    if (drafter_parameter_decays(name, drafter.parameter(name).shape)) decays.push_back(name);
  const AdamW host_optimizer(drafter.parameters, decays, AdamWOptions{});
  const std::unique_ptr<TrainStep> stepper = make_cuda_train_step(drafter, std::move(head), precision, host_optimizer);
  const int runs = flags.warmup + flags.steps;
  using Clock = std::chrono::steady_clock;
  // The mean wall clock per step over the timed steps (the warm-up ones run first, untimed).
  auto mean_step_ms = [&](const std::function<TrainStep::Result(long)>& run_step) {
    Clock::time_point timed_start = Clock::now();
    for (long step = 0; step < runs; ++step) {
      if (step == flags.warmup) timed_start = Clock::now();
      const TrainStep::Result result = run_step(step);
      DSPARK_CHECK(std::isfinite(result.terms.loss), "bench train: the loss is not finite at step ", step + 1);
    }
    return std::chrono::duration<double, std::milli>(Clock::now() - timed_start).count() / flags.steps;
  };
  std::vector<Anchor> anchors(flags.batch);
  TrainBatch built;
  const double serial = mean_step_ms([&](long step) {
    sample_step_anchors(sampler, flags.seed, step, anchors);
    build_train_batch(data, anchors, config.gamma, flags.context, built, ContextRows::Bf16);
    return stepper->train(built, weights, 1.0, 1e-4);
  });
  BatchPipeline::Options pipeline_options;
  pipeline_options.seed = flags.seed;
  pipeline_options.batch = flags.batch;
  pipeline_options.gamma = config.gamma;
  pipeline_options.max_context = flags.context;
  pipeline_options.end_step = runs;
  pipeline_options.threads = flags.threads;
  int pack_threads = 0;
  double pipelined = 0.0;
  {
    // Made before the clock starts, as the trainer makes it before its first evaluation.
    BatchPipeline pipeline(data, sampler, pipeline_options, *stepper->batch_staging());
    pack_threads = pipeline.threads();
    pipelined = mean_step_ms([&](long) { return stepper->train_packed(pipeline.next(), weights, 1.0, 1e-4); });
  }

  const int positions = flags.batch * config.gamma;
  const double step = median(step_ms), upload = median(upload_ms), full = median(full_ms);
  const Json result = {
      {"engine", "dspark"},
      {"gpu", cuda::device_description(0)},
      {"hidden", flags.hidden},
      {"vocab", flags.vocab},
      {"taps", flags.taps},
      {"d_draft", config.d_draft},
      {"layers", config.num_layers},
      {"heads", config.num_heads},
      {"markov_rank", config.markov_rank},
      {"ff_mult", config.ff_mult},
      {"gamma", config.gamma},
      {"seq_head", config.seq_head},
      {"batch", flags.batch},
      {"context", flags.context},
      {"math", flags.math},
      {"head_dtype", flags.head},
      {"parameters", parameters},
      {"positions_per_step", positions},
      {"step_ms", step},
      {"upload_ms", upload},
      {"step_with_upload_ms", full},
      {"positions_per_s", positions / (step * 1e-3)},
      {"positions_per_s_with_upload", positions / (full * 1e-3)},
      {"anchors_per_s", flags.batch / (step * 1e-3)},
      {"serial_ms", serial},
      {"pipelined_ms", pipelined},
      {"positions_per_s_serial", positions / (serial * 1e-3)},
      {"positions_per_s_pipelined", positions / (pipelined * 1e-3)},
      {"pack_threads", pack_threads},
      {"data_mb", data_files.bytes / 1e6},
      {"batch_mb", double(batch.context_rows_bf16.size()) * 2 / 1e6},
      {"loss", terms.loss},
      {"setup_s", setup_seconds},
      {"steps", flags.steps}};
  if (flags.json) {
    std::printf("%s\n", result.dump().c_str());
    return;
  }
  std::printf("bench train on %s\n", cuda::device_description(0).c_str());
  std::printf("  target H %d V %d, %d taps; drafter d %d, %d layers, %d heads, r %d, gamma %d, %s head (%.1f M)\n",
              flags.hidden, flags.vocab, flags.taps, config.d_draft, config.num_layers, config.num_heads,
              config.markov_rank, config.gamma, config.seq_head.c_str(), parameters / 1e6);
  std::printf("  batch %d anchors x %d context rows; GEMMs %s, head %s\n", flags.batch, flags.context,
              flags.math.c_str(), flags.head.c_str());
  std::printf("  step (batch on the device) %.3f ms: %.0f positions/s\n", step, positions / (step * 1e-3));
  std::printf("  upload %.3f ms; step with upload %.3f ms: %.0f positions/s\n", upload, full,
              positions / (full * 1e-3));
  std::printf("  from the data (%.0f MB in the page cache, %.0f MB of context rows per batch), mean per step:\n",
              data_files.bytes / 1e6, double(batch.context_rows_bf16.size()) * 2 / 1e6);
  std::printf("    serial (sample, build, upload, step) %.3f ms: %.0f positions/s\n", serial,
              positions / (serial * 1e-3));
  std::printf("    pipelined (next batch packed and copied during the step, %d threads) %.3f ms: %.0f positions/s "
              "(%.2fx the step alone)\n",
              pack_threads, pipelined, positions / (pipelined * 1e-3), pipelined / step);
  std::printf("  last loss %.4f\n", terms.loss);
#endif
}

}  // namespace

void add_bench_train_command(CLI::App& bench) {
  auto flags = std::make_shared<BenchTrainFlags>();
  BenchTrainFlags& f = *flags;
  f.config.d_draft = 256;
  f.config.num_layers = 2;
  f.config.num_heads = 4;
  f.config.markov_rank = 64;
  CLI::App* command = bench.add_subcommand("train", "One GPU training step (loss, backward, AdamW) on random data");
  command->add_option("--hidden", f.hidden, "target hidden size H")->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--vocab", f.vocab, "target vocabulary V")->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--taps", f.taps, "tapped target layers m")->capture_default_str()->check(CLI::Range(1, 64));
  command->add_option("--gamma", f.config.gamma, "block size")->capture_default_str()->check(CLI::Range(1, 64));
  command->add_option("--d-draft", f.config.d_draft, "drafter width")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--layers", f.config.num_layers, "backbone layers")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--heads", f.config.num_heads, "attention heads")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--markov-rank", f.config.markov_rank, "sequential head rank")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--ff-mult", f.config.ff_mult, "MLP width multiplier")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--seq-head", f.config.seq_head, "sequential head")->capture_default_str()
      ->check(CLI::IsMember({"markov", "rnn", "gru"}));
  command->add_option("--batch", f.batch, "anchors per step")->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--context", f.context, "context rows per anchor")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--steps", f.steps, "timed steps")->capture_default_str()->check(CLI::Range(1, 100000));
  command->add_option("--warmup", f.warmup, "untimed steps first")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_option("--math", f.math, "the drafter's GEMMs: tf32 or f32")->capture_default_str()
      ->check(CLI::IsMember({"tf32", "f32"}));
  command->add_option("--head", f.head, "the target head's dtype: bf16 or f32")->capture_default_str()
      ->check(CLI::IsMember({"bf16", "f32"}));
  command->add_option("--seed", f.seed, "seed of the weights and the data")->capture_default_str();
  command->add_option("--threads", f.threads, "the batch pipeline's packing threads (0: its default)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--json", f.json, "print one JSON object");
  command->callback([flags] { run_bench_train(*flags); });
}

}  // namespace dspark::cli
