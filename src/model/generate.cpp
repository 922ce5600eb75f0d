#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/random.h"

namespace dspark {

void check_prompt_fits(const ModelConfig& config, size_t prompt_tokens) {
  DSPARK_CHECK(prompt_tokens > 0, "the prompt is empty (no tokens)");
  DSPARK_CHECK(prompt_tokens < static_cast<size_t>(config.max_positions), "the prompt is ",
               prompt_tokens, " tokens; the model's context is ", config.max_positions,
               " positions, which leaves no room to generate");
}

bool is_eos(const ModelConfig& config, int32_t token) {
  return std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), token) !=
         config.eos_token_ids.end();
}

GenerateResult generate(Target& target, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& config = target.config();
  check_prompt_fits(config, prompt.size());
  const int capacity = static_cast<int>(
      std::min<long>(config.max_positions, static_cast<long>(prompt.size()) + options.max_new_tokens));
  const int sequence = target.create_sequence(capacity);
  Rng rng(options.seed);
  double uniform = 0.0;
  TargetRequest request;
  request.sampling = options.sampling;
  if (!options.sampling.greedy()) request.uniforms = {&uniform, 1};
  TargetResult step;
  GenerateResult result;
  result.stop_reason = "length";

  const auto start = Clock::now();
  uniform = rng.uniform();
  TargetInput input{sequence, prompt, false};
  target.forward({&input, 1}, request, step);
  const auto prefill_done = Clock::now();
  result.prefill_seconds = std::chrono::duration<double>(prefill_done - start).count();

  while (true) {
    const int32_t token = step.tokens[0];
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (is_eos(config, token) && !options.ignore_eos) {
      result.stop_reason = "eos";
      break;
    }
    if (static_cast<int>(result.tokens.size()) == options.max_new_tokens) break;
    if (target.sequence_length(sequence) == config.max_positions) {
      result.stop_reason = "context";
      break;
    }
    uniform = rng.uniform();
    TargetInput next{sequence, {&result.tokens.back(), 1}, false};
    target.forward({&next, 1}, request, step);
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - prefill_done).count();
  target.release_sequence(sequence);
  return result;
}

}  // namespace dspark
