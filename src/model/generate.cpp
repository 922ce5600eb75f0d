#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace dspark {

void check_prompt_fits(const ModelConfig& config, size_t prompt_tokens) {
  DSPARK_CHECK(prompt_tokens > 0, "the prompt is empty (no tokens)");
  DSPARK_CHECK(prompt_tokens < static_cast<size_t>(config.max_positions), "the prompt is ",
               prompt_tokens, " tokens; the model's context is ", config.max_positions,
               " positions, which leaves no room to generate");
}

GenerateResult generate(const Transformer& model, std::span<const int32_t> prompt,
                        const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = model.config;
  check_prompt_fits(config, prompt.size());
  const int capacity = static_cast<int>(
      std::min<long>(config.max_positions, static_cast<long>(prompt.size()) + options.max_new_tokens));
  KVCache cache(config, capacity);
  ForwardWorkspace workspace;
  ForwardOutput output;
  Rng rng(options.seed);
  std::vector<float> probs;
  std::vector<int32_t> order;
  GenerateResult result;
  result.stop_reason = "length";

  auto start = Clock::now();
  ForwardSequence sequence{&cache, prompt, false};
  transformer_forward(model, {&sequence, 1}, {}, workspace, output);
  auto prefill_done = Clock::now();
  result.prefill_seconds = std::chrono::duration<double>(prefill_done - start).count();

  while (static_cast<int>(result.tokens.size()) < options.max_new_tokens) {
    const int32_t token = cpu::sample_token(output.logits.data(), config.vocab_size, options.sampling,
                                            rng, probs, order);
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    const bool is_eos = std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), token) !=
                        config.eos_token_ids.end();
    if (is_eos && !options.ignore_eos) {
      result.stop_reason = "eos";
      break;
    }
    if (static_cast<int>(result.tokens.size()) == options.max_new_tokens) break;
    if (cache.length() == config.max_positions) {
      result.stop_reason = "context";
      break;
    }
    ForwardSequence next{&cache, {&result.tokens.back(), 1}, false};
    transformer_forward(model, {&next, 1}, {}, workspace, output);
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - prefill_done).count();
  return result;
}

}  // namespace dspark
