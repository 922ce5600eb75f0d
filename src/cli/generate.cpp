// dspark generate: text from a prompt with the target model.
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/json.h"
#include "model/generate.h"
#include "model/tokenizer.h"
#include "model/target.h"

namespace dspark::cli {
namespace {

struct GenerateFlags {
  std::string model = default_model_directory();
  std::string prompt = "def fibonacci(n):";
  int max_new_tokens = 128;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool chat = false;
  bool ignore_eos = false;
  bool json = false;
  std::string device = "auto";
};

void run_generate(const GenerateFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  std::vector<int32_t> prompt;
  if (flags.chat) {
    const std::string text = tokenizer.apply_chat_template({{"user", flags.prompt}}, true);
    prompt = tokenizer.encode(text, /*add_special_tokens=*/false);
  } else {
    prompt = tokenizer.encode(flags.prompt);
  }
  GenerateOptions options;
  options.max_new_tokens = flags.max_new_tokens;
  options.sampling = {flags.temperature, flags.top_k, flags.top_p};
  options.seed = flags.seed;
  options.ignore_eos = flags.ignore_eos;

  StreamingDecoder stream(tokenizer);
  const ModelConfig& config = target->config();
  const GenerateResult result = generate(*target, prompt, options, [&](int32_t token) {
    if (flags.json || (is_eos(config, token) && !flags.ignore_eos)) return;
    std::fputs(stream.push(token).c_str(), stdout);
    std::fflush(stdout);
  });

  // The text leaves out the EOS that stopped generation; `tokens` keeps it.
  std::vector<int32_t> text_tokens = result.tokens;
  if (result.stop_reason == "eos") text_tokens.pop_back();
  const double tokens_per_s =
      result.decode_seconds > 0 ? result.tokens.size() / result.decode_seconds : 0.0;
  if (flags.json) {
    Json out = {{"text", tokenizer.decode(text_tokens)},
                {"tokens", result.tokens},
                {"prompt_tokens", prompt.size()},
                {"stop_reason", result.stop_reason},
                {"device", target->device_description()},
                {"stats",
                 {{"tokens_per_s", tokens_per_s},
                  {"generated_tokens", result.tokens.size()},
                  {"prefill_ms", result.prefill_seconds * 1e3},
                  {"decode_ms", result.decode_seconds * 1e3},
                  {"prefill_tokens_per_s",
                   result.prefill_seconds > 0 ? prompt.size() / result.prefill_seconds : 0.0}}}};
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << std::endl;
  } else {
    std::fputs(stream.finish().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    std::fprintf(stderr, "[%zu prompt tokens in %.1f ms; %zu tokens in %.1f ms, %.1f tokens/s; stop: %s]\n",
                 prompt.size(), result.prefill_seconds * 1e3, result.tokens.size(),
                 result.decode_seconds * 1e3, tokens_per_s, result.stop_reason.c_str());
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* command = app.add_subcommand("generate", "Generate text from a prompt");
  command->add_option("-m,--model", flags->model, "HF model directory")->capture_default_str();
  command->add_option("-p,--prompt", flags->prompt, "prompt text (used as given unless --chat)")
      ->capture_default_str();
  command->add_option("-n,--max-tokens", flags->max_new_tokens, "tokens to generate")
      ->capture_default_str()->check(CLI::PositiveNumber);
  command->add_option("--temperature", flags->temperature, "0 = greedy")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--top-p", flags->top_p, "nucleus sampling mass (1 = off)")
      ->capture_default_str()->check(CLI::Range(0.0f, 1.0f));
  command->add_option("--top-k", flags->top_k, "keep the k most likely tokens (0 = off)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  command->add_option("--seed", flags->seed, "sampling seed")->capture_default_str();
  command->add_flag("--chat", flags->chat, "wrap the prompt in the model's chat template");
  command->add_flag("--ignore-eos", flags->ignore_eos, "keep generating past end-of-sequence tokens");
  command->add_flag("--json", flags->json, "print one JSON object instead of streaming text");
  add_device_option(*command, flags->device);
  command->callback([flags] { run_generate(*flags); });
}

}  // namespace dspark::cli
