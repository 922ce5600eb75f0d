// dspark regen: training data for a drafter, made by the target itself
// (DESIGN.md §4): its answers to a prompts file and the tapped hidden rows of
// every token, in resumable shards (train/regen.h, train/dataset.h).
#include <cstdio>

#include "cli/commands.h"
#include "model/prompts.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/drafter.h"
#include "train/regen.h"

namespace dspark::cli {
namespace {

struct RegenFlags {
  std::string model = default_model_directory();
  std::string prompts;
  std::string output;
  std::vector<int> tap_layers;  // empty: the default for the target's depth
  int max_new_tokens = 512;
  float temperature = 0.0f;
  float top_p = 1.0f;
  bool chat = false;
  std::string device = "auto";
  uint64_t seed = 0;
  int batch = 8;
  long shard_mb = 1024;
};

void run_regen(const RegenFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  const ModelConfig& config = target->config();
  const std::vector<PromptEntry> entries = read_prompt_file(flags.prompts);
  const std::vector<RegenPrompt> prompts =
      tokenize_regen_prompts(tokenizer, entries, flags.chat, config, flags.prompts);
  DSPARK_CHECK(!prompts.empty(), flags.prompts, ": no usable prompts");

  RegenOptions options;
  options.tap_layers = flags.tap_layers.empty() ? default_tap_layers(config.num_layers) : flags.tap_layers;
  options.max_new_tokens = flags.max_new_tokens;
  options.sampling = {flags.temperature, 0, flags.top_p};
  options.chat = flags.chat;
  options.seed = flags.seed;
  options.batch = flags.batch;
  options.shard_bytes = flags.shard_mb << 20;
  const RegenSummary summary = regenerate(*target, target_id_of(flags.model), prompts, options, flags.output);

  std::string taps;
  for (size_t i = 0; i < options.tap_layers.size(); ++i)
    taps += (i ? "," : "") + std::to_string(options.tap_layers[i]);
  if (summary.new_sequences == 0 && summary.complete) {
    std::printf("%s is already complete: %d sequences in %d shards\n", flags.output.c_str(), summary.sequences,
                summary.shards);
    return;
  }
  std::printf("wrote %s: %d sequences (%d new, %ld tokens, %ld generated) in %d shards, taps [%s], on %s, "
              "%.1f s (%.1f sequences/s, %.1f generated tokens/s)%s\n",
              flags.output.c_str(), summary.sequences, summary.new_sequences, summary.new_tokens,
              summary.generated_tokens, summary.shards, taps.c_str(), target->device_description().c_str(),
              summary.seconds, summary.seconds > 0 ? summary.new_sequences / summary.seconds : 0.0,
              summary.seconds > 0 ? summary.generated_tokens / summary.seconds : 0.0,
              summary.complete ? "" : " (incomplete: rerun to continue)");
}

}  // namespace

void add_regen_command(CLI::App& app) {
  auto flags = std::make_shared<RegenFlags>();
  CLI::App* command = app.add_subcommand(
      "regen", "Make drafter training data: the target's answers to prompts, with its tapped hidden rows");
  command->add_option("-m,--model", flags->model, "the target's HF model directory")->capture_default_str();
  command->add_option("--prompts", flags->prompts, "JSONL file: one {\"prompt\": ...} or {\"messages\": [...]} per line")
      ->required();
  command->add_option("-o,--output", flags->output, "data directory to write (rerun to resume)")->required();
  command->add_option("--tap-layers", flags->tap_layers,
                      "target layers to tap, the last = the layer count (default: three in the upper half + L)")
      ->delimiter(',');
  command->add_option("-n,--max-tokens", flags->max_new_tokens, "longest response")
      ->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--temperature", flags->temperature, "0 = greedy")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--top-p", flags->top_p, "nucleus sampling mass (1 = off)")
      ->capture_default_str()->check(CLI::Range(0.0f, 1.0f));
  command->add_flag("--chat", flags->chat, "wrap text prompts in the model's chat template");
  command->add_option("--seed", flags->seed, "sampling seed (prompt i samples with its own stream)")
      ->capture_default_str();
  command->add_option("--batch", flags->batch, "prompts answered together")
      ->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--shard-mb", flags->shard_mb, "close a shard once its rows reach this many MiB")
      ->capture_default_str()->check(CLI::PositiveNumber);
  add_device_option(*command, flags->device);
  command->callback([flags] { run_regen(*flags); });
}

}  // namespace dspark::cli
