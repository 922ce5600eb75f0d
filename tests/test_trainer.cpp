// The trainer on data regenerated from the golden qwen3 target: a tiny
// drafter overfits a tiny set (the loss falls, τ̂ rises well above the
// untrained drafter's), a run stopped and resumed ends bit-identical to one
// straight run, and the output directory, log and refusals behave.
#include <gtest/gtest.h>

#include <fstream>

#include "cli_runner.h"
#include "core/file.h"
#include "golden.h"
#include "tiny_regen.h"
#include "model/cpu_target.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/regen.h"
#include "train/trainer.h"

namespace dspark {
namespace {

using testing::error_of;
using testing::golden_model;
using testing::run_dspark;
using testing::TemporaryDirectory;

const Transformer& golden_target() { return testing::golden_transformer("qwen3"); }

TargetHead golden_head() { return target_head_of(golden_target()); }

using testing::tiny_regenerated_data;
const std::filesystem::path& tiny_data() { return tiny_regenerated_data(); }

const Dataset& tiny_dataset() {
  static const Dataset data(tiny_data());
  return data;
}

Drafter tiny_drafter(uint32_t seed = 1) {
  DrafterConfig config;
  config.gamma = 4;
  config.d_draft = 32;
  config.num_layers = 1;
  config.num_heads = 4;
  config.markov_rank = 16;
  config.tap_layers = {1, 3, 4};
  const ModelConfig& c = golden_target().config;
  return init_drafter(config, {c.hidden_size, c.vocab_size, c.rms_norm_eps}, "qwen3", seed);
}

TrainOptions quiet_options() {
  TrainOptions options;
  options.show_progress = false;
  options.batch = 6;
  options.max_context = 16;
  options.learning_rate = 1e-2;
  options.warmup = 3;
  options.held_out_fraction = 0.125;  // one sequence of eight
  options.eval_anchors = 32;
  options.seed = 9;
  return options;
}

std::vector<Json> read_log(const std::filesystem::path& output) {
  std::vector<Json> records;
  std::ifstream in(output / kTrainLogFile);
  std::string line;
  while (std::getline(in, line)) records.push_back(Json::parse(line));
  return records;
}

TEST(Trainer, ATinyDrafterOverfitsATinySet) {
  const Dataset& data = tiny_dataset();
  // Every anchor of the training split: what the drafter is fitted to.
  const DatasetSplit split = split_dataset(data.size(), 0.0);
  const AnchorSampler sampler(data, split.train);
  std::vector<Anchor> anchors;
  for (long i = 0; i < sampler.size(); ++i) anchors.push_back(sampler.at(i));

  Drafter drafter = tiny_drafter();
  TrainOptions options = quiet_options();
  options.held_out_fraction = 0.0;
  options.iterations = 600;
  options.batch = 16;
  options.warmup = 20;
  options.eval_every = 0;
  options.save_every = 0;
  const EvalResult before = evaluate_drafter(drafter, golden_head(), data, anchors, options);
  TemporaryDirectory output;
  const TrainSummary summary = train_drafter(drafter, golden_head(), data, options, output.path, false);
  const EvalResult after = evaluate_drafter(drafter, golden_head(), data, anchors, options);
  EXPECT_TRUE(summary.finished);
  EXPECT_FALSE(summary.evaluated);
  std::printf("overfit: loss %.4f -> %.4f, ce %.3f -> %.3f, l1 %.3f -> %.3f, tau^ %.3f -> %.3f (%.1f s)\n",
              before.terms.loss, after.terms.loss, before.terms.ce, after.terms.ce, before.terms.l1, after.terms.l1,
              before.terms.tau_estimate, after.terms.tau_estimate, summary.seconds);
  // With the full backward (merged tree): loss 2.67 -> 1.23, tau^ 1.40 -> 2.92 in ~2 s.
  EXPECT_LT(after.terms.loss, 0.6 * before.terms.loss);
  EXPECT_LT(after.terms.ce, 0.5 * before.terms.ce);
  EXPECT_LT(after.terms.l1, 0.6 * before.terms.l1);
  EXPECT_GT(after.terms.tau_estimate, before.terms.tau_estimate + 1.0);
}

TEST(Trainer, StoppedAndResumedEqualsOneStraightRunBitForBit) {
  const Dataset& data = tiny_dataset();
  TrainOptions options = quiet_options();
  options.iterations = 12;
  options.eval_every = 4;
  options.save_every = 5;
  TemporaryDirectory straight_dir, resumed_dir;
  Drafter straight = tiny_drafter();
  train_drafter(straight, golden_head(), data, options, straight_dir.path, false);

  TrainOptions stopping = options;
  stopping.stop_after = 7;
  Drafter first = tiny_drafter();
  const TrainSummary stopped = train_drafter(first, golden_head(), data, stopping, resumed_dir.path, false);
  EXPECT_EQ(stopped.steps, 7);
  EXPECT_FALSE(stopped.finished);
  EXPECT_EQ(read_training_state(resumed_dir.path)["step"], 7);
  // A new process: the drafter comes back from the output directory.
  Drafter resumed = load_drafter(resumed_dir.path);
  const TrainSummary rest = train_drafter(resumed, golden_head(), data, options, resumed_dir.path, true);
  EXPECT_EQ(rest.start_step, 7);
  EXPECT_TRUE(rest.finished);
  for (const std::string& name : straight.names) {
    const Tensor& a = straight.parameter(name);
    const Tensor& b = resumed.parameter(name);
    ASSERT_EQ(std::memcmp(a.data, b.data, a.numel() * sizeof(float)), 0) << name << " differs";
  }
  EXPECT_EQ(read_text_file(straight_dir.path / "model.safetensors"),
            read_text_file(resumed_dir.path / "model.safetensors"));
  EXPECT_EQ(read_text_file(straight_dir.path / "training_state-12.safetensors"),
            read_text_file(resumed_dir.path / "training_state-12.safetensors"));
  // The logs agree on every step's losses, the resumed one without duplicates.
  const std::vector<Json> a = read_log(straight_dir.path), b = read_log(resumed_dir.path);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]) << i;
    EXPECT_EQ(a[i]["split"], b[i]["split"]) << i;
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << i;
    EXPECT_EQ(a[i]["tau"], b[i]["tau"]) << i;
  }
}

TEST(Trainer, WritesCheckpointsBestAndALogLinePerStep) {
  const Dataset& data = tiny_dataset();
  TrainOptions options = quiet_options();
  options.iterations = 10;
  options.eval_every = 5;
  options.save_every = 4;
  TemporaryDirectory output;
  Drafter drafter = tiny_drafter();
  const TrainSummary summary = train_drafter(drafter, golden_head(), data, options, output.path, false);
  EXPECT_TRUE(summary.evaluated);
  EXPECT_GE(summary.best_step, 0);
  const std::vector<Json> log = read_log(output.path);
  int train_lines = 0, eval_lines = 0;
  for (const Json& record : log) {
    for (const char* key : {"step", "loss", "ce", "l1", "bce", "tau", "split"})
      EXPECT_TRUE(record.contains(key)) << key << " missing in " << record.dump();
    if (record["split"] == "train") {
      ++train_lines;
      EXPECT_EQ(record["step"], train_lines);
      for (const char* key : {"lr", "grad_norm", "tokens_per_s"}) EXPECT_TRUE(record.contains(key)) << key;
    } else {
      ++eval_lines;
      EXPECT_EQ(record["split"], "held_out");
    }
  }
  EXPECT_EQ(train_lines, 10);
  EXPECT_EQ(eval_lines, 3);  // steps 0, 5 and 10
  // The checkpoint: the final drafter, its state (the older state files gone), best/.
  const Json state = read_training_state(output.path);
  EXPECT_EQ(state["step"], 10);
  EXPECT_EQ(state["state_file"], "training_state-10.safetensors");
  EXPECT_FALSE(std::filesystem::exists(output.path / "training_state-8.safetensors"));
  EXPECT_EQ(state["best"]["step"], summary.best_step);
  const Drafter saved = load_drafter(output.path);
  for (const std::string& name : drafter.names)
    EXPECT_EQ(std::memcmp(saved.parameter(name).data, drafter.parameter(name).data,
                          drafter.parameter(name).numel() * sizeof(float)),
              0)
        << name;
  EXPECT_NO_THROW(load_drafter(output.path / "best"));
  // One layer's q k v o gate up down, then W_c, tok_proj, out_proj, markov.w2, conf.w.
  EXPECT_EQ(state["decayed"].size(), 12u);
}

TEST(Trainer, RefusesToOverwriteOrToResumeWithOtherSettings) {
  const Dataset& data = tiny_dataset();
  TrainOptions options = quiet_options();
  options.iterations = 4;
  options.stop_after = 2;
  TemporaryDirectory output;
  Drafter drafter = tiny_drafter();
  train_drafter(drafter, golden_head(), data, options, output.path, false);
  EXPECT_NE(
      error_of([&] { train_drafter(drafter, golden_head(), data, options, output.path, false); }).find("--resume"),
      std::string::npos);
  TrainOptions other = options;
  other.learning_rate = 5e-3;
  EXPECT_NE(
      error_of([&] { train_drafter(drafter, golden_head(), data, other, output.path, true); }).find("learning_rate"),
      std::string::npos);
  TemporaryDirectory empty;
  EXPECT_NE(error_of([&] {
              train_drafter(drafter, golden_head(), data, options, empty.path, true);
            }).find("nothing to resume"),
            std::string::npos);
}

TEST(CliTrain, TrainsStopsAndResumesToTheSameDrafter) {
  TemporaryDirectory directory;
  const std::string data = tiny_data().string();
  const std::string target = golden_model("qwen3").string();
  const std::vector<std::string> common = {
      "train", "-m",        target, "--data",       data, "--iters",   "6",   "--batch",        "4", "--gamma",
      "3",     "--d-draft", "16",   "--layers",     "1",  "--heads",   "2",   "--markov-rank",  "8", "--max-ctx",
      "8",     "--warmup",  "2",    "--eval-every", "3",  "--holdout", "0.2", "--eval-anchors", "8", "--seed",
      "4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> arguments = common;
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    return run_dspark(arguments);
  };
  const std::string straight = (directory.path / "straight").string(), resumed = (directory.path / "resumed").string();
  const auto full = with({"-o", straight});
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_NE(full.out.find("trained"), std::string::npos) << full.out;
  EXPECT_NE(full.out.find("held-out"), std::string::npos) << full.out;
  const auto stopped = with({"-o", resumed, "--stop-after", "4"});
  ASSERT_EQ(stopped.exit_code, 0) << stopped.err;
  EXPECT_NE(stopped.err.find("--resume"), std::string::npos) << stopped.err;
  const auto again = with({"-o", resumed});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.err.find("--resume"), std::string::npos) << again.err;
  // --resume with no other flags takes the run's own settings.
  const auto rest = run_dspark({"train", "-m", target, "--data", data, "-o", resumed, "--iters", "6", "--resume"});
  ASSERT_EQ(rest.exit_code, 0) << rest.err;
  EXPECT_EQ(read_text_file(std::filesystem::path(straight) / "model.safetensors"),
            read_text_file(std::filesystem::path(resumed) / "model.safetensors"));
  const auto conflicting =
      run_dspark({"train", "-m", target, "--data", data, "-o", resumed, "--iters", "8", "--resume", "--lr", "0.5"});
  EXPECT_NE(conflicting.exit_code, 0);
  EXPECT_NE(conflicting.err.find("learning_rate"), std::string::npos) << conflicting.err;
  // The trained drafter drives speculative decoding.
  const auto decode = run_dspark({"generate", "-m", target, "-d", straight, "-n", "8", "--device", "cpu"});
  EXPECT_EQ(decode.exit_code, 0) << decode.err;
}

TEST(CliTrain, RefusesDataForAnotherTargetAndCudaWithoutAGpu) {
  TemporaryDirectory directory;
  const std::string data = tiny_data().string();
  const auto other = run_dspark({"train", "-m", golden_model("llama").string(), "--data", data, "-o",
                                 (directory.path / "a").string(), "--iters", "1"});
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("made with target \"qwen3\""), std::string::npos) << other.err;
  if (default_device() == "cpu") {  // no GPU here (the GPU tests train on one: tests/cuda/test_cuda_train.cpp)
    const auto cuda = run_dspark({"train", "-m", golden_model("qwen3").string(), "--data", data, "-o",
                                  (directory.path / "b").string(), "--device", "cuda"});
    EXPECT_NE(cuda.exit_code, 0);
    EXPECT_NE(cuda.err.find("--device cuda: "), std::string::npos) << cuda.err;
  }
  const auto missing = run_dspark({"train", "-m", golden_model("qwen3").string(), "--data",
                                   (directory.path / "none").string(), "-o", (directory.path / "c").string()});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("dspark regen"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace dspark
