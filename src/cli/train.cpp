// dspark train: trains a DSpark drafter on data made by `dspark regen`
// (DESIGN.md §4; train/trainer.h). Ctrl-C checkpoints and stops; --resume
// continues exactly where a run stopped.
#include <csignal>
#include <cstdio>

#include "cli/commands.h"
#include "model/config.h"
#include "model/target.h"
#ifdef DSPARK_CUDA
#include "kernels/cuda/device.h"
#endif
#include "spec/draft.h"
#include "spec/drafter.h"
#include "train/dataset.h"
#include "train/trainer.h"

namespace dspark::cli {
namespace {

volatile std::sig_atomic_t interrupt_requested = 0;

void on_interrupt(int) {
  interrupt_requested = 1;
  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C stops at once
}

struct TrainFlags {
  std::string model = default_model_directory();
  std::string data;
  std::string output;
  DrafterConfig config;
  TrainOptions options;
  bool resume = false;
  bool no_prefetch = false;
  std::string device = "cpu";
  // Flags whose value, when not given with --resume, comes from the run being resumed.
  std::vector<std::pair<CLI::Option*, std::function<void(TrainOptions&, const TrainOptions&)>>> trajectory_flags;
  std::vector<std::pair<CLI::Option*, std::function<bool(const DrafterConfig&)>>> architecture_flags;
};

void check_data_matches_target(const Dataset& data, const ModelConfig& target, const std::string& target_id,
                               const std::string& where) {
  const RegenManifest& manifest = data.manifest();
  DSPARK_CHECK(manifest.target_id == target_id, where, " was made with target \"", manifest.target_id,
               "\", not \"", target_id, "\"");
  DSPARK_CHECK(manifest.hidden_size == target.hidden_size && manifest.vocab_size == target.vocab_size &&
                   manifest.num_layers == target.num_layers,
               where, " was made with a target of hidden size ", manifest.hidden_size, ", vocabulary ",
               manifest.vocab_size, " and ", manifest.num_layers, " layers; this target has ", target.hidden_size,
               ", ", target.vocab_size, " and ", target.num_layers);
  if (!manifest.complete)
    std::fprintf(stderr, "warning: %s is incomplete (regen was interrupted); training on its %d sequences\n",
                 where.c_str(), data.size());
}

void run_train(TrainFlags& flags) {
  const std::string device = resolve_device(flags.device);
#ifdef DSPARK_CUDA
  DSPARK_CHECK(device != "cuda" || cuda::device_count() > 0, "--device cuda: no CUDA GPU is visible");
#else
  DSPARK_CHECK(device != "cuda", "--device cuda: this build has no CUDA support (nvcc was not found at build time)");
#endif
  const ModelConfig target = load_model_config(flags.model);
  const std::string target_id = target_id_of(flags.model);
  const Dataset data(flags.data);
  check_data_matches_target(data, target, target_id, flags.data);

  Drafter drafter;
  TrainOptions options = flags.options;
  if (flags.resume) {
    const Json state = read_training_state(flags.output);
    DSPARK_CHECK(!state.is_null(), "nothing to resume in ", flags.output, " (no ", kTrainingStateFile, ")");
    drafter = load_drafter(flags.output);
    for (const auto& [option, matches] : flags.architecture_flags)
      DSPARK_CHECK(option->count() == 0 || matches(drafter.config), "--resume: ", option->get_name(),
                   " differs from the drafter being trained (", flags.output, "/dspark.json)");
    // Unspecified trajectory flags take the resumed run's values; given ones must agree (the trainer checks).
    const TrainOptions stored = train_options_from_json(state.value("options", Json::object()), flags.options);
    options = stored;
    for (const auto& [option, apply] : flags.trajectory_flags)
      if (option->count() > 0) apply(options, flags.options);
  } else {
    flags.config.tap_layers = data.manifest().tap_layers;
    validate_drafter_config(flags.config, target.num_layers);
    drafter = init_drafter(flags.config, {target.hidden_size, target.vocab_size, target.rms_norm_eps}, target_id,
                           static_cast<uint32_t>(flags.options.seed));
  }
  check_drafter_matches_target(drafter, target, target_id);
  const TargetHeadWeights head = load_target_head(flags.model, target);

  options.device = device;
  options.prefetch = !flags.no_prefetch;
  interrupt_requested = 0;
  std::signal(SIGINT, on_interrupt);
  options.interrupted = [] { return interrupt_requested != 0; };
  const TrainSummary summary = train_drafter(drafter, head.view(), data, options, flags.output, flags.resume);
  std::signal(SIGINT, SIG_DFL);

  long parameters = 0;
  for (const auto& [name, tensor] : drafter.parameters) parameters += tensor.numel();
  std::printf("%s %s on %s: steps %ld..%ld of %ld in %.1f s (%.0f tokens/s), %.2f M parameters\n",
              summary.finished ? "trained" : "stopped", flags.output.c_str(), device.c_str(), summary.start_step,
              summary.steps, options.iterations, summary.seconds, summary.positions_per_second, parameters / 1e6);
  const LossTerms& last = summary.last_train;
  std::printf("  last step:        loss %.4f  ce %.4f  l1 %.4f  bce %.4f  tau^ %.3f\n", last.loss, last.ce, last.l1,
              last.bce, last.tau_estimate);
  if (summary.evaluated) {
    const LossTerms& held = summary.last_eval.terms;
    std::printf("  held-out (%d anchors): loss %.4f  ce %.4f  l1 %.4f  bce %.4f  tau^ %.3f\n",
                summary.last_eval.anchors, held.loss, held.ce, held.l1, held.bce, held.tau_estimate);
    if (summary.start_step == 0)
      std::printf("  untrained tau^ %.3f -> best %.3f at step %ld (%s/best)\n",
                  summary.first_eval.terms.tau_estimate, summary.best_tau, summary.best_step, flags.output.c_str());
    else
      std::printf("  best tau^ %.3f at step %ld (%s/best)\n", summary.best_tau, summary.best_step,
                  flags.output.c_str());
  }
  std::printf("  log: %s/%s\n", flags.output.c_str(), kTrainLogFile);
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  TrainFlags& f = *flags;
  CLI::App* command = app.add_subcommand("train", "Train a DSpark drafter on data made by `dspark regen`");
  command->add_option("-m,--model", f.model, "the target's HF model directory")->capture_default_str();
  command->add_option("--data", f.data, "data directory written by `dspark regen`")->required();
  command->add_option("-o,--output", f.output, "drafter directory to write (checkpoints, best/, log)")->required();
  command->add_flag("--resume", f.resume, "continue the run in the output directory where it stopped");
  command->add_option("--device", f.device,
                      "cpu or cuda (the GPU: f32 weights, TF32 GEMMs, bf16 target head), or auto (cuda when a GPU "
                      "is present)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  command->add_flag("--no-prefetch", f.no_prefetch,
                    "cuda: build and upload each batch between the steps instead of packing and copying the next "
                    "batch while a step runs (the same batches; to compare speeds)");

  auto architecture = [&](CLI::Option* option, std::function<bool(const DrafterConfig&)> matches) {
    f.architecture_flags.emplace_back(option, std::move(matches));
  };
  architecture(command->add_option("--gamma", f.config.gamma, "tokens drafted per round")->capture_default_str()
                   ->check(CLI::Range(1, 64)),
               [&f](const DrafterConfig& c) { return c.gamma == f.config.gamma; });
  architecture(command->add_option("--d-draft", f.config.d_draft, "drafter width")->capture_default_str()
                   ->check(CLI::PositiveNumber),
               [&f](const DrafterConfig& c) { return c.d_draft == f.config.d_draft; });
  architecture(command->add_option("--layers", f.config.num_layers, "backbone layers")->capture_default_str()
                   ->check(CLI::PositiveNumber),
               [&f](const DrafterConfig& c) { return c.num_layers == f.config.num_layers; });
  architecture(command->add_option("--heads", f.config.num_heads, "attention heads")->capture_default_str()
                   ->check(CLI::PositiveNumber),
               [&f](const DrafterConfig& c) { return c.num_heads == f.config.num_heads; });
  architecture(command->add_option("--markov-rank", f.config.markov_rank, "sequential head rank")
                   ->capture_default_str()->check(CLI::PositiveNumber),
               [&f](const DrafterConfig& c) { return c.markov_rank == f.config.markov_rank; });
  architecture(command->add_option("--ff-mult", f.config.ff_mult, "MLP width multiplier")->capture_default_str()
                   ->check(CLI::PositiveNumber),
               [&f](const DrafterConfig& c) { return c.ff_mult == f.config.ff_mult; });
  architecture(command->add_option("--seq-head", f.config.seq_head, "sequential head")->capture_default_str()
                   ->check(CLI::IsMember({"markov", "rnn", "gru"})),
               [&f](const DrafterConfig& c) { return c.seq_head == f.config.seq_head; });

  TrainOptions& o = f.options;
  command->add_option("--iters", o.iterations, "optimizer steps in all")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--eval-every", o.eval_every, "held-out evaluation every N steps (0: start and end only)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--save-every", o.save_every, "checkpoint every N steps (0: at the end only)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--stop-after", o.stop_after, "stop (checkpointed) after this step, as an interruption would")
      ->group("");  // for tests of --resume
  auto trajectory = [&](CLI::Option* option, std::function<void(TrainOptions&, const TrainOptions&)> apply) {
    f.trajectory_flags.emplace_back(option, std::move(apply));
  };
  trajectory(command->add_option("--batch", o.batch, "anchors per step")->capture_default_str()
                 ->check(CLI::PositiveNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.batch = from.batch; });
  trajectory(command->add_option("--lr", o.learning_rate, "peak learning rate")->capture_default_str()
                 ->check(CLI::PositiveNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.learning_rate = from.learning_rate; });
  trajectory(command->add_option("--warmup", o.warmup, "linear warmup steps")->capture_default_str()
                 ->check(CLI::NonNegativeNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.warmup = from.warmup; });
  trajectory(command->add_option("--weight-decay", o.adamw.weight_decay, "AdamW decoupled weight decay")
                 ->capture_default_str()->check(CLI::NonNegativeNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.adamw.weight_decay = from.adamw.weight_decay; });
  trajectory(command->add_option("--max-ctx", o.max_context, "context rows per anchor")->capture_default_str()
                 ->check(CLI::PositiveNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.max_context = from.max_context; });
  trajectory(command->add_option("--seed", o.seed, "seed of the drafter's initialisation and of the data sampler")->capture_default_str(),
             [](TrainOptions& to, const TrainOptions& from) { to.seed = from.seed; });
  trajectory(command->add_option("--holdout", o.held_out_fraction, "fraction of sequences held out for tau^")
                 ->capture_default_str()->check(CLI::Range(0.0, 0.5)),
             [](TrainOptions& to, const TrainOptions& from) { to.held_out_fraction = from.held_out_fraction; });
  trajectory(command->add_option("--eval-anchors", o.eval_anchors, "held-out anchors per evaluation")
                 ->capture_default_str()->check(CLI::PositiveNumber),
             [](TrainOptions& to, const TrainOptions& from) { to.eval_anchors = from.eval_anchors; });
  command->callback([flags] { run_train(*flags); });
}

}  // namespace dspark::cli
