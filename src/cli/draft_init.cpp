// dspark draft-init: a freshly initialised DSpark drafter for a target.
#include <cstdio>

#include "cli/commands.h"
#include "spec/drafter.h"

namespace dspark::cli {
namespace {

struct DraftInitFlags {
  std::string target = default_model_directory();
  std::string output;
  DrafterConfig config;
  std::vector<int> tap_layers;  // empty: the default for the target's depth
  uint32_t seed = 0;
};

void run_draft_init(DraftInitFlags flags) {
  const ModelConfig target = load_model_config(flags.target);
  flags.config.tap_layers = flags.tap_layers.empty() ? default_tap_layers(target.num_layers) : flags.tap_layers;
  validate_drafter_config(flags.config, target.num_layers);
  const TargetDims dims{target.hidden_size, target.vocab_size, target.rms_norm_eps};
  const Drafter drafter = init_drafter(flags.config, dims, target_id_of(flags.target), flags.seed);
  save_drafter(drafter, flags.output);
  long parameters = 0;
  for (const auto& [name, tensor] : drafter.parameters) parameters += tensor.numel();
  std::printf("wrote %s: %s head, gamma %d, d %d, %d layers, taps [", flags.output.c_str(),
              flags.config.seq_head.c_str(), flags.config.gamma, flags.config.d_draft, flags.config.num_layers);
  for (size_t i = 0; i < flags.config.tap_layers.size(); ++i)
    std::printf("%s%d", i ? ", " : "", flags.config.tap_layers[i]);
  std::printf("], %.2f M parameters\n", parameters / 1e6);
}

}  // namespace

void add_draft_init_command(CLI::App& app) {
  auto flags = std::make_shared<DraftInitFlags>();
  CLI::App* command = app.add_subcommand("draft-init", "Write a freshly initialised DSpark drafter for a target");
  command->add_option("-m,--model", flags->target, "the target's HF model directory")->capture_default_str();
  command->add_option("-o,--output", flags->output, "drafter directory to write")->required();
  command->add_option("--gamma", flags->config.gamma, "tokens drafted per round")->capture_default_str()
      ->check(CLI::Range(1, 64));
  command->add_option("--d-draft", flags->config.d_draft, "drafter width")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--layers", flags->config.num_layers, "backbone layers")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--heads", flags->config.num_heads, "attention heads")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--markov-rank", flags->config.markov_rank, "sequential head rank")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--ff-mult", flags->config.ff_mult, "MLP width multiplier")->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--tap-layers", flags->tap_layers, "target layers to tap, the last = the layer count")
      ->delimiter(',');
  command->add_option("--seq-head", flags->config.seq_head, "sequential head")->capture_default_str()
      ->check(CLI::IsMember({"markov", "rnn", "gru"}));
  command->add_option("--seed", flags->seed, "initialisation seed")->capture_default_str();
  command->callback([flags] { run_draft_init(*flags); });
}

}  // namespace dspark::cli
