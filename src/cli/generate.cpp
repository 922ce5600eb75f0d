// dspark generate: text from a prompt with the target model, alone or with a
// draft source (-d DIR for a DSpark drafter, -d ngram for prompt lookup).
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "core/json.h"
#include "model/generate.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/draft_sources.h"
#include "spec/speculative.h"

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
  std::string draft;  // "", "ngram", or a drafter directory
  int gamma = 0;      // 0: the drafter's own gamma (8 for ngram)
  float min_confidence = 0.0f;
  bool trace = false;
};

Json stats_json(const SpeculativeStats& stats) {
  return {{"rounds", stats.rounds},
          {"drafted", stats.drafted},
          {"accepted", stats.accepted},
          {"acceptance_by_position", stats.acceptance_by_position()},
          {"tau", stats.tau()}};
}

void run_generate(const GenerateFlags& flags) {
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  const ModelConfig& config = target->config();
  std::vector<int32_t> prompt;
  if (flags.chat) {
    prompt = tokenizer.encode(tokenizer.apply_chat_template({{"user", flags.prompt}}, true), false);
  } else {
    prompt = tokenizer.encode(flags.prompt);
  }
  const cpu::SamplingParams sampling{flags.temperature, flags.top_k, flags.top_p};

  std::vector<int32_t> tokens;
  std::string stop_reason;
  double prefill_seconds = 0.0, decode_seconds = 0.0;
  Json extra = Json::object(), trace = Json::array();
  StreamingDecoder stream(tokenizer);
  auto print = [&](int32_t token) {
    if (flags.json || (is_eos(config, token) && !flags.ignore_eos)) return;
    std::fputs(stream.push(token).c_str(), stdout);
    std::fflush(stdout);
  };
  if (flags.draft.empty()) {
    GenerateOptions options;
    options.max_new_tokens = flags.max_new_tokens;
    options.sampling = sampling;
    options.seed = flags.seed;
    options.ignore_eos = flags.ignore_eos;
    GenerateResult result = generate(*target, prompt, options, print);
    tokens = std::move(result.tokens);
    stop_reason = result.stop_reason;
    prefill_seconds = result.prefill_seconds;
    decode_seconds = result.decode_seconds;
  } else {
    LoadedDraftSource source = load_draft_source(flags.draft, flags.model, *target, flags.min_confidence);
    SpeculativeOptions options;
    options.max_new_tokens = flags.max_new_tokens;
    options.sampling = sampling;
    options.seed = flags.seed;
    options.ignore_eos = flags.ignore_eos;
    options.gamma = source.gamma_for(flags.gamma);
    options.trace = flags.trace;
    SpeculativeTiming timing;
    const std::vector<std::vector<int32_t>> prompts = {prompt};
    SpeculativeResult result = std::move(speculative_generate(*target, *source.source, prompts, options, &timing)[0]);
    for (int32_t token : result.tokens) print(token);
    tokens = std::move(result.tokens);
    stop_reason = result.stop_reason;
    prefill_seconds = timing.prefill_seconds;
    decode_seconds = timing.decode_seconds;
    extra = stats_json(result.stats);
    extra["gamma"] = options.gamma;
    for (const RoundTrace& round : result.trace)
      trace.push_back({{"draft", round.draft}, {"conf", round.confidence}, {"accepted", round.accepted},
                       {"emitted", round.emitted}});
  }

  // The text leaves out the EOS that stopped generation; `tokens` keeps it.
  std::vector<int32_t> text_tokens = tokens;
  if (stop_reason == "eos") text_tokens.pop_back();
  const double tokens_per_s = decode_seconds > 0 ? tokens.size() / decode_seconds : 0.0;
  // Both modes prefill every prompt token but the last, which the first step carries.
  const size_t prefilled = prompt.size() - 1;
  if (flags.json) {
    Json stats = {{"tokens_per_s", tokens_per_s},
                  {"generated_tokens", tokens.size()},
                  {"prefill_ms", prefill_seconds * 1e3},
                  {"decode_ms", decode_seconds * 1e3},
                  {"prefill_tokens_per_s", prefilled > 0 && prefill_seconds > 0 ? prefilled / prefill_seconds : 0.0}};
    stats.update(extra);
    Json out = {{"text", tokenizer.decode(text_tokens)}, {"tokens", tokens},
                {"prompt_tokens", prompt.size()},        {"stop_reason", stop_reason},
                {"device", target->device_description()}, {"stats", stats}};
    if (flags.trace) out["trace"] = trace;
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << std::endl;
    return;
  }
  std::fputs(stream.finish().c_str(), stdout);
  std::fputs("\n", stdout);
  std::fflush(stdout);
  std::fprintf(stderr, "[%zu prompt tokens (%zu prefilled in %.1f ms); %zu tokens in %.1f ms, %.1f tokens/s; stop: %s",
               prompt.size(), prefilled, prefill_seconds * 1e3, tokens.size(), decode_seconds * 1e3, tokens_per_s,
               stop_reason.c_str());
  if (!flags.draft.empty())
    std::fprintf(stderr, "; tau %.2f over %ld rounds", extra["tau"].get<double>(), extra["rounds"].get<long>());
  std::fprintf(stderr, "]\n");
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
  command->add_option("-d,--draft", flags->draft, "speculative decoding: a DSpark drafter directory, or ngram");
  command->add_option("--gamma", flags->gamma, "most tokens drafted per round (default: the drafter's; ngram 8)")
      ->check(CLI::Range(1, 64));
  command->add_option("--min-conf", flags->min_confidence, "prune drafts below this confidence")
      ->check(CLI::Range(0.0f, 1.0f));
  command->add_flag("--trace", flags->trace, "with --json: every round's draft, confidence, verdict and output");
  add_device_option(*command, flags->device);
  command->callback([flags] { run_generate(*flags); });
}

}  // namespace dspark::cli
