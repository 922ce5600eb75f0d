// dspark perplexity: how well the model predicts a text file.
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/file.h"
#include "core/json.h"
#include "core/progress.h"
#include "model/perplexity.h"
#include "model/tokenizer.h"
#include "model/target.h"

namespace dspark::cli {
namespace {

struct PerplexityFlags {
  std::string model = default_model_directory();
  std::string file;
  int context = 0;  // 0: the model's max positions
  bool json = false;
  std::string device = "auto";
};

void run_perplexity(const PerplexityFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  DSPARK_CHECK(std::filesystem::is_regular_file(flags.file), "cannot read text file ", flags.file);
  const std::vector<int32_t> ids = tokenizer.encode(read_text_file(flags.file));
  const int context = flags.context > 0 ? flags.context : target->config().max_positions;
  Progress progress("perplexity", ids.empty() ? 0 : long(ids.size()) - 1, "tokens");
  const PerplexityResult result =
      perplexity(*target, ids, context, [&](long done, long) { progress.update(done); });
  if (flags.json) {
    std::cout << Json{{"nll", result.nll}, {"tokens", result.tokens}, {"ppl", result.ppl}}.dump()
              << std::endl;
  } else {
    std::printf("nll %.6f  tokens %ld  ppl %.6f\n", result.nll, result.tokens, result.ppl);
  }
}

}  // namespace

void add_perplexity_command(CLI::App& app) {
  auto flags = std::make_shared<PerplexityFlags>();
  CLI::App* command = app.add_subcommand("perplexity", "Score a text file: total NLL and perplexity");
  command->add_option("-m,--model", flags->model, "HF model directory")->capture_default_str();
  command->add_option("-f,--file", flags->file, "text file to score")->required();
  command->add_option("--ctx", flags->context, "window length (default: the model's context)")
      ->check(CLI::PositiveNumber);
  command->add_flag("--json", flags->json, "print {\"nll\", \"tokens\", \"ppl\"}");
  add_device_option(*command, flags->device);
  command->callback([flags] { run_perplexity(*flags); });
}

}  // namespace dspark::cli
