// dspark bench train: the speed of one GPU training step (DESIGN.md §4) at a
// given drafter and target shape, on random data: the step `dspark train
// --device cuda` runs (train/train_step.h), without the host's batch building.
//
// A fresh drafter (init_drafter) for a target of hidden size H and vocabulary
// V whose embedding and LM head are drawn on the device; a batch of A anchors
// with `--context` context rows each (bf16 values, as regenerated data's),
// every block position trained. Measured (CUDA events on the step's stream,
// median of the timed steps after warm-up):
//   step       the batch already on the device: zero the gradients, loss and
//              backward, global norm, clipping and AdamW;
//   upload     the batch's copy to the device (host packing + transfer);
// and, on the host clock, step + upload as `dspark train` runs them.
// Throughput is trained block positions (A·γ) per second, the trainer's
// tokens/s. bench/train_vs_torch.py runs this against PyTorch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "cli/commands.h"
#include "core/dtype.h"
#include "core/json.h"
#include "core/random.h"
#include "spec/drafter.h"
#include "train/train_batch.h"
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
  bool json = false;
};

#ifdef DSPARK_CUDA
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

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

  const auto setup_start = std::chrono::steady_clock::now();
  Drafter drafter = init_drafter(config, dims, "bench", static_cast<uint32_t>(flags.seed));
  long parameters = 0;
  for (const auto& [name, tensor] : drafter.parameters) parameters += tensor.numel();
  const CudaTrainHead head = CudaTrainHead::random(dims, precision.bf16_head, flags.seed, 0.05f);
  const TrainBatch batch = random_batch(config, dims, flags.batch, flags.context, flags.seed + 1);
  CudaDrafterLoss loss(drafter, head, precision);
  drafter = Drafter{};  // uploaded
  CudaAdamW optimizer(loss.layout(), AdamWOptions{}, loss.stream());
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
      ->check(CLI::NonNegativeNumber);
  command->add_option("--steps", f.steps, "timed steps")->capture_default_str()->check(CLI::Range(1, 100000));
  command->add_option("--warmup", f.warmup, "untimed steps first")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_option("--math", f.math, "the drafter's GEMMs: tf32 or f32")->capture_default_str()
      ->check(CLI::IsMember({"tf32", "f32"}));
  command->add_option("--head", f.head, "the target head's dtype: bf16 or f32")->capture_default_str()
      ->check(CLI::IsMember({"bf16", "f32"}));
  command->add_option("--seed", f.seed, "seed of the weights and the data")->capture_default_str();
  command->add_flag("--json", f.json, "print one JSON object");
  command->callback([flags] { run_bench_train(*flags); });
}

}  // namespace dspark::cli
