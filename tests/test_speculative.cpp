// Speculative decoding is lossless: greedy output is token-identical to plain
// greedy decoding for every draft source, gamma, pruning setting and batch
// composition; sampled output has the target's own distribution; and rolling
// back the target's KV cache and the drafter's context leaves no trace.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "golden.h"
#include "model/cpu_target.h"
#include "model/generate.h"
#include "random_drafter.h"
#include "spec/acceptance.h"
#include "spec/dspark_source.h"
#include "spec/ngram_source.h"
#include "spec/scheduler.h"
#include "spec/speculative.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::golden_reference;

const Transformer& golden(const std::string& name) { return testing::golden_transformer(name); }

Drafter random_drafter(const ModelConfig& target, const std::string& head, int gamma, uint64_t seed, float scale) {
  DrafterConfig config;
  config.gamma = gamma;
  config.d_draft = 32;
  config.num_layers = 2;
  config.num_heads = 4;
  config.markov_rank = 8;
  config.tap_layers = default_tap_layers(target.num_layers);
  config.seq_head = head;
  Drafter drafter = init_drafter(config, {target.hidden_size, target.vocab_size, target.rms_norm_eps}, "t", 1);
  testing::randomize_parameters(drafter, seed, scale);
  return drafter;
}

// Verify step time 1 + seconds_per_token * B (in units of a fixed overhead):
// Alg 1 then admits a position of survival a when a > τ* / (1 / seconds_per_token + B),
// so it verifies long prefixes of confident rows and cuts the rest.
SpsProfile linear_sps(double seconds_per_token) {
  return {{1, 4097}, {1.0 / (1.0 + seconds_per_token), 1.0 / (1.0 + 4097 * seconds_per_token)}};
}

// Proposes the target's own greedy continuation: every draft is accepted.
class OracleSource final : public DraftSource {
 public:
  explicit OracleSource(const Transformer& target) : target_(target) {}
  void begin(int row, std::span<const int32_t> prompt, uint64_t) override { history_[row].clear(); }
  void accept(int row, std::span<const int32_t> tokens, const float*) override {
    history_[row].insert(history_[row].end(), tokens.begin(), tokens.end());
  }
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams&, std::vector<Proposal>& proposals) override {
    proposals.assign(rows.size(), Proposal{});
    for (size_t i = 0; i < rows.size(); ++i) {
      if (max_tokens[i] == 0) continue;
      std::vector<int32_t> text = history_[rows[i]];
      text.push_back(pending[i]);
      CpuTarget target(target_);
      GenerateOptions options;
      options.max_new_tokens = max_tokens[i];
      options.ignore_eos = true;
      if (text.size() + max_tokens[i] >= size_t(target_.config.max_positions)) continue;
      proposals[i].tokens = generate(target, text, options).tokens;
    }
  }
  void end(int row) override { history_.erase(row); }

 private:
  const Transformer& target_;
  std::map<int, std::vector<int32_t>> history_;
};

std::vector<std::vector<int32_t>> test_prompts(const std::string& model) {
  std::vector<std::vector<int32_t>> prompts;
  const Json forward = golden_reference(model, "forward.json");
  for (const auto& prompt : forward["prompts"])
    prompts.push_back(prompt["ids"].get<std::vector<int32_t>>());
  prompts.push_back({prompts[0][0]});  // a one-token prompt: nothing to prefill, empty context
  Rng rng(99);
  std::vector<int32_t> repetitive;  // n-gram lookup finds matches in this one
  for (int i = 0; i < 30; ++i) repetitive.push_back(int32_t(rng.next() % 5) + 100);
  prompts.push_back(repetitive);
  return prompts;
}

std::vector<int32_t> plain_greedy(const Transformer& model, const std::vector<int32_t>& prompt, int count) {
  CpuTarget target(model);
  GenerateOptions options;
  options.max_new_tokens = count;
  return generate(target, prompt, options).tokens;
}

struct GreedyCase {
  std::string model;
  std::string source;  // "untrained", "random", "oracle", "ngram"
  int gamma;
  float min_confidence;
  bool alg1 = false;  // the prefix scheduler cuts the proposals
  bool gate = false;  // ... and, drafting being dear, leaves rounds undrafted
};

class GreedyLossless : public ::testing::TestWithParam<GreedyCase> {};

TEST_P(GreedyLossless, SpeculativeEqualsPlain) {
  const GreedyCase& c = GetParam();
  const Transformer& model = golden(c.model);
  const ModelConfig& config = model.config;
  const Drafter untrained = [&] {
    DrafterConfig drafter_config;
    drafter_config.gamma = 8, drafter_config.d_draft = 32, drafter_config.num_layers = 1;
    drafter_config.num_heads = 4, drafter_config.markov_rank = 8;
    drafter_config.tap_layers = default_tap_layers(config.num_layers);
    return init_drafter(drafter_config, {config.hidden_size, config.vocab_size, config.rms_norm_eps}, "t", 5);
  }();
  const Drafter random = random_drafter(config, "gru", 8, 17, 3.0f);
  std::unique_ptr<DraftSource> source;
  if (c.source == "untrained") source = std::make_unique<DSparkSource>(untrained, target_head_of(model), c.min_confidence);
  if (c.source == "random") source = std::make_unique<DSparkSource>(random, target_head_of(model), c.min_confidence);
  if (c.source == "oracle") source = std::make_unique<OracleSource>(model);
  if (c.source == "ngram") source = std::make_unique<NgramSource>();

  const auto prompts = test_prompts(c.model);
  const int count = 20;
  SpeculativeOptions options;
  options.max_new_tokens = count;
  options.gamma = c.gamma;
  PrefixScheduler scheduler(linear_sps(0.2), c.gate ? std::optional(DraftCostProfile{{1}, {2.0}}) : std::nullopt);
  if (c.alg1) options.scheduler = &scheduler;
  // Every prompt alone, then all of them as one ragged batch.
  std::vector<std::vector<int32_t>> expected;
  for (const auto& prompt : prompts) expected.push_back(plain_greedy(model, prompt, count));
  CpuTarget target(model);
  SpeculativeStats total;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto result = speculative_generate(target, *source, std::span(prompts).subspan(i, 1), options);
    EXPECT_EQ(result[0].tokens, expected[i]) << "prompt " << i;
    total.add(result[0].stats);
  }
  const auto batched = speculative_generate(target, *source, prompts, options);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(batched[i].tokens, expected[i]) << "batched prompt " << i;
    total.add(batched[i].stats);
  }
  // Continuous batching: two at a time, a waiting prompt joining as one finishes.
  options.max_active = 2;
  const auto continuous = speculative_generate(target, *source, prompts, options);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(continuous[i].tokens, expected[i]) << "continuous prompt " << i;
  const bool scored = c.source == "untrained" || c.source == "random";  // proposals carry confidences
  if (c.gate) {  // drafted and undrafted rounds both occurred
    EXPECT_GT(total.undrafted, 0);
    EXPECT_LT(total.undrafted, total.rounds);
    EXPECT_GT(total.drafted, 0);
  } else if (c.alg1 && scored) {  // the scheduler both verified and cut drafts
    EXPECT_GT(total.drafted, 0);
    EXPECT_LT(total.drafted, total.proposed);
  } else {  // no scheduler, or nothing to rank by: every proposed token is verified
    EXPECT_EQ(total.drafted, total.proposed);
  }
  if (c.source == "oracle") {
    EXPECT_EQ(total.accepted, total.drafted);  // every draft accepted
  } else if (c.source == "untrained") {
    EXPECT_LE(total.accepted, total.drafted / 10);
  } else if (c.source == "ngram") {
    EXPECT_GT(total.drafted, 0);  // the repetitive prompt always has a match
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sources, GreedyLossless,
    ::testing::Values(GreedyCase{"qwen3", "untrained", 4, 0.0f}, GreedyCase{"qwen3", "random", 1, 0.0f},
                      GreedyCase{"qwen3", "random", 5, 0.0f}, GreedyCase{"llama", "random", 8, 0.0f},
                      GreedyCase{"qwen3", "random", 8, 0.45f}, GreedyCase{"llama", "oracle", 3, 0.0f},
                      GreedyCase{"qwen3", "oracle", 8, 0.0f}, GreedyCase{"qwen3", "ngram", 6, 0.0f},
                      GreedyCase{"llama", "ngram", 2, 0.0f}, GreedyCase{"qwen3", "random", 8, 0.0f, true},
                      GreedyCase{"llama", "random", 5, 0.0f, true}, GreedyCase{"qwen3", "untrained", 6, 0.0f, true},
                      GreedyCase{"qwen3", "oracle", 8, 0.0f, true}, GreedyCase{"qwen3", "random", 6, 0.0f, true, true},
                      GreedyCase{"llama", "oracle", 4, 0.0f, true, true}));

// The continuous batching tests' target and prompts: the golden qwen3.
class ContinuousBatching : public ::testing::Test {
 protected:
  const Transformer& model = golden("qwen3");
  const std::vector<std::vector<int32_t>> prompts = test_prompts("qwen3");
  CpuTarget target{model};
};

// A request's output does not depend on which others share its steps:
// plain and speculative decoding, greedy and sampled, all requests at once
// against at most one or two at a time (continuous batching).
TEST_F(ContinuousBatching, EachRequestGetsItsOwnOutput) {
  const Drafter drafter = random_drafter(model.config, "markov", 6, 23, 3.0f);
  DSparkSource source(drafter, target_head_of(model));
  for (float temperature : {0.0f, 1.0f}) {
    GenerateOptions plain;
    plain.max_new_tokens = 12;
    plain.sampling.temperature = temperature;
    plain.seed = 5;
    SpeculativeOptions speculative;
    speculative.max_new_tokens = 12;
    speculative.sampling.temperature = temperature;
    speculative.seed = 5;
    speculative.gamma = 4;
    const auto plain_all = generate_batch(target, prompts, plain);
    const auto speculative_all = speculative_generate(target, source, prompts, speculative);
    for (int max_active : {1, 2}) {
      plain.max_active = speculative.max_active = max_active;
      const auto plain_some = generate_batch(target, prompts, plain);
      const auto speculative_some = speculative_generate(target, source, prompts, speculative);
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(plain_some[i].tokens, plain_all[i].tokens) << "plain, T " << temperature << ", prompt " << i;
        EXPECT_EQ(speculative_some[i].tokens, speculative_all[i].tokens)
            << "speculative, T " << temperature << ", prompt " << i;
      }
    }
    if (temperature == 0.0f) {
      for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(speculative_all[i].tokens, plain_all[i].tokens);
    }
  }
}

// A target that records the tokens of every input of every forward.
class RecordingTarget : public Target {
 public:
  explicit RecordingTarget(Target& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device_description() const override { return inner_.device_description(); }
  int create_sequence(int capacity) override { return inner_.create_sequence(capacity); }
  void release_sequence(int sequence) override { inner_.release_sequence(sequence); }
  int sequence_length(int sequence) const override { return inner_.sequence_length(sequence); }
  void truncate_sequence(int sequence, int length) override { inner_.truncate_sequence(sequence, length); }
  int row_invariant_rows() const override { return inner_.row_invariant_rows(); }
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) override {
    std::vector<std::vector<int32_t>> tokens;
    for (const TargetInput& input : inputs) tokens.emplace_back(input.tokens.begin(), input.tokens.end());
    forwards.push_back(std::move(tokens));
    inner_.forward(inputs, request, result);
  }
  std::vector<std::vector<std::vector<int32_t>>> forwards;  // [forward][input] tokens

 private:
  Target& inner_;
};

// Whether a forward is a prefill: every input a prompt but its last token.
bool is_prefill(const std::vector<std::vector<int32_t>>& inputs, const std::vector<std::vector<int32_t>>& prompts) {
  return std::all_of(inputs.begin(), inputs.end(), [&](const std::vector<int32_t>& tokens) {
    return std::any_of(prompts.begin(), prompts.end(), [&](const std::vector<int32_t>& prompt) {
      return prompt.size() > 1 && std::equal(tokens.begin(), tokens.end(), prompt.begin(), prompt.end() - 1);
    });
  });
}

TEST_F(ContinuousBatching, PlainAndSpeculativeDecodingTakeAPromptInTheSameForwards) {
  // A prompt's tokens but the last enter the cache in a prefill forward of
  // its group (max_active requests, in order), the same forward in plain and
  // speculative decoding, however far apart the modes' requests finish; the
  // last prompt token starts the request's input in a later forward. The
  // GPU's kernels give a row the same bits at any row count up to 16 per step,
  // so this is what keeps greedy speculative output equal to plain output
  // bit for bit there (tests/cuda: SpeculativeGreedyEqualsPlainOnTheGpu).
  const Drafter drafter = random_drafter(model.config, "markov", 4, 23, 3.0f);
  DSparkSource source(drafter, target_head_of(model));
  for (int max_active : {0, 1, 2}) {
    GenerateOptions plain_options;
    plain_options.max_new_tokens = 6;
    plain_options.max_active = max_active;
    SpeculativeOptions speculative_options;
    speculative_options.max_new_tokens = 6;
    speculative_options.gamma = 4;
    speculative_options.max_active = max_active;
    RecordingTarget plain(target), speculative(target);
    generate_batch(plain, prompts, plain_options);
    speculative_generate(speculative, source, prompts, speculative_options);
    auto prefills = [&](const RecordingTarget& recorded) {
      std::vector<std::vector<std::vector<int32_t>>> found;
      std::copy_if(recorded.forwards.begin(), recorded.forwards.end(), std::back_inserter(found),
                   [&](const auto& inputs) { return is_prefill(inputs, prompts); });
      return found;
    };
    const std::string what = "max_active " + std::to_string(max_active);
    const auto plain_prefills = prefills(plain);
    EXPECT_EQ(plain_prefills, prefills(speculative)) << what;
    // One a group of max_active requests (all of them at 0) with a prompt of more than one token.
    const size_t group = max_active > 0 ? size_t(max_active) : prompts.size();
    size_t groups = 0;
    for (size_t first = 0; first < prompts.size(); first += group)
      groups += std::any_of(prompts.begin() + first, prompts.begin() + std::min(first + group, prompts.size()),
                            [](const auto& prompt) { return prompt.size() > 1; });
    EXPECT_EQ(plain_prefills.size(), groups) << what;
    for (size_t i = 0; i < prompts.size(); ++i) {  // the last prompt token starts a later input
      const auto starts_with_last = [&](const RecordingTarget& recorded) {
        return std::any_of(recorded.forwards.begin(), recorded.forwards.end(), [&](const auto& inputs) {
          return !is_prefill(inputs, prompts) && std::any_of(inputs.begin(), inputs.end(), [&](const auto& tokens) {
            return !tokens.empty() && tokens[0] == prompts[i].back() && tokens.size() <= 1 + 4;
          });
        });
      };
      EXPECT_TRUE(starts_with_last(plain)) << what << ", prompt " << i;
      EXPECT_TRUE(starts_with_last(speculative)) << what << ", prompt " << i;
    }
  }
}

// Under continuous batching both modes count a step or round in full_batch
// when it carries max_active requests, with the tokens it generated; the
// prefills and the tail's forwards do not count, and without max_active
// nothing does. (An odd number of requests two at a time: the last one runs alone.)
TEST_F(ContinuousBatching, FullBatchCountsTheForwardsWithEveryPlaceTaken) {
  const Drafter drafter = random_drafter(model.config, "markov", 4, 23, 3.0f);
  DSparkSource source(drafter, target_head_of(model));
  ASSERT_GE(prompts.size(), 3u);
  const std::vector<std::vector<int32_t>> odd(prompts.begin(), prompts.end() - (prompts.size() % 2 == 0));
  for (int max_active : {0, 2}) {
    GenerateOptions plain_options;
    plain_options.max_new_tokens = 6;
    plain_options.ignore_eos = true;
    plain_options.max_active = max_active;
    SpeculativeOptions speculative_options;
    speculative_options.max_new_tokens = 6;
    speculative_options.ignore_eos = true;
    speculative_options.gamma = 4;
    speculative_options.max_active = max_active;
    RecordingTarget plain(target), speculative(target);
    const std::vector<GenerateResult> plain_results = generate_batch(plain, odd, plain_options);
    SpeculativeTiming timing;
    const std::vector<SpeculativeResult> speculative_results =
        speculative_generate(speculative, source, odd, speculative_options, &timing);
    const std::string what = "max_active " + std::to_string(max_active);
    auto full_forwards = [&](const RecordingTarget& recorded) {
      return std::count_if(recorded.forwards.begin(), recorded.forwards.end(), [&](const auto& inputs) {
        return int(inputs.size()) == max_active && !is_prefill(inputs, odd);
      });
    };
    const StepTally& plain_full = plain_results[0].full_batch;
    if (max_active == 0) {
      EXPECT_EQ(plain_full.forwards, 0);
      EXPECT_EQ(timing.full_batch.forwards, 0);
      EXPECT_EQ(plain_results[0].admission_prefill_seconds, 0.0);  // every prompt prefilled at the start
      EXPECT_EQ(timing.admission_prefill_seconds, 0.0);
      continue;
    }
    EXPECT_EQ(plain_full.forwards, full_forwards(plain)) << what;
    EXPECT_EQ(timing.full_batch.forwards, full_forwards(speculative)) << what;
    EXPECT_LT(plain_full.forwards, plain_results[0].forwards);  // the tail runs one request
    EXPECT_LT(timing.full_batch.forwards, timing.rounds);
    EXPECT_EQ(plain_full.tokens, 2 * plain_full.forwards) << what;  // a token for each input of a full step
    long speculative_tokens = 0;
    for (const SpeculativeResult& result : speculative_results) speculative_tokens += long(result.tokens.size());
    EXPECT_GT(timing.full_batch.tokens, timing.full_batch.forwards);  // drafts were accepted
    EXPECT_LT(timing.full_batch.tokens, speculative_tokens);
    EXPECT_GT(plain_full.seconds, 0.0);
    EXPECT_GT(timing.full_batch.seconds, 0.0);
    EXPECT_LE(timing.full_batch.seconds, timing.decode_seconds);
    // the later groups' prefills, inside the decode time
    EXPECT_GT(plain_results[0].admission_prefill_seconds, 0.0);
    EXPECT_LT(plain_results[0].admission_prefill_seconds, plain_results[0].decode_seconds);
    EXPECT_GT(timing.admission_prefill_seconds, 0.0);
    EXPECT_LT(timing.admission_prefill_seconds, timing.decode_seconds);
  }
}

// A target that, as the CUDA target does with its captured shapes, counts a
// warm-up run for each forward of a token count it has not run before.
class WarmingTarget : public RecordingTarget {
 public:
  using RecordingTarget::RecordingTarget;
  long warm_up_runs() const override { return long(seen_.size()); }
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) override {
    size_t tokens = 0;
    for (const TargetInput& input : inputs) tokens += input.tokens.size();
    seen_.insert(tokens);
    RecordingTarget::forward(inputs, request, result);
  }

 private:
  std::set<size_t> seen_;
};

// Both modes count the steps or rounds whose forward ran a new shape, and their time.
TEST_F(ContinuousBatching, WarmUpRoundsAreThoseThatRanANewShape) {
  const Drafter drafter = random_drafter(model.config, "markov", 4, 23, 3.0f);
  DSparkSource source(drafter, target_head_of(model));
  GenerateOptions plain_options;
  plain_options.max_new_tokens = 6;
  plain_options.max_active = 2;
  SpeculativeOptions speculative_options;
  speculative_options.max_new_tokens = 6;
  speculative_options.gamma = 4;
  speculative_options.max_active = 2;
  WarmingTarget plain(target), speculative(target);
  const std::vector<GenerateResult> plain_results = generate_batch(plain, prompts, plain_options);
  SpeculativeTiming timing;
  speculative_generate(speculative, source, prompts, speculative_options, &timing);
  // The steps or rounds that ran a new token count, a prefill's included:
  // plain decoding's step runs to the next step's forward (the prefills after
  // it), a round from its iteration's start (the prefills before it). The
  // prefill at the start (forward 0) is in none.
  auto new_shapes = [&](const RecordingTarget& recorded, bool prefills_after) {
    std::set<size_t> seen;
    std::vector<bool> steps;  // per step or round: whether it ran a new shape
    bool before = false;      // a prefill since the last step ran one
    for (size_t f = 0; f < recorded.forwards.size(); ++f) {
      size_t tokens = 0;
      for (const auto& input : recorded.forwards[f]) tokens += input.size();
      const bool new_shape = seen.insert(tokens).second;
      if (!is_prefill(recorded.forwards[f], prompts)) {
        steps.push_back(new_shape || std::exchange(before, false));
      } else if (f > 0 && prefills_after) {
        if (new_shape) steps.back() = true;
      } else if (f > 0) {
        before = before || new_shape;
      }
    }
    return long(std::count(steps.begin(), steps.end(), true));
  };
  EXPECT_EQ(plain_results[0].warm_ups.forwards, new_shapes(plain, true));
  EXPECT_EQ(timing.warm_ups.forwards, new_shapes(speculative, false));
  EXPECT_GT(timing.warm_ups.forwards, 0);
  EXPECT_LT(timing.warm_ups.forwards, timing.rounds);
  EXPECT_GT(timing.warm_ups.seconds, 0.0);
  EXPECT_LE(timing.warm_ups.seconds, timing.decode_seconds);
}

TEST(SpeculativeLimits, ContextEndAndEosStopLikePlainDecoding) {
  const Transformer& model = golden("qwen3");
  const int room = 12;
  std::vector<int32_t> prompt(model.config.max_positions - room, 0);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(i * 7 % 900);
  CpuTarget target(model);
  GenerateOptions plain_options;
  plain_options.max_new_tokens = 50;
  plain_options.ignore_eos = true;
  const GenerateResult plain = generate(target, prompt, plain_options);
  OracleSource oracle(model);
  SpeculativeOptions options;
  options.max_new_tokens = 50;
  options.ignore_eos = true;
  options.gamma = 5;
  const auto spec = speculative_generate(target, oracle, std::span(&prompt, 1), options);
  EXPECT_EQ(spec[0].tokens, plain.tokens);
  EXPECT_EQ(spec[0].stop_reason, "context");
  EXPECT_EQ(plain.stop_reason, "context");
  // One place, two requests: the one after a request stopped at its context's end still runs.
  const std::vector<std::vector<int32_t>> two = {prompt, test_prompts("qwen3")[0]};
  SpeculativeOptions one_place = options;
  one_place.max_active = 1;
  const auto queued = speculative_generate(target, oracle, two, one_place);
  EXPECT_EQ(queued[0].tokens, plain.tokens);
  EXPECT_EQ(queued[1].tokens, plain_greedy(model, two[1], 50));

  // An EOS inside an accepted draft ends the output right after it.
  ModelConfig with_eos = model.config;
  Transformer eos_model = model;
  const auto continuation = plain_greedy(model, test_prompts("qwen3")[0], 12);
  eos_model.config.eos_token_ids = {continuation[6]};
  CpuTarget eos_target(eos_model);
  OracleSource eos_oracle(eos_model);
  options.ignore_eos = false;
  options.gamma = 8;
  const auto prompts = test_prompts("qwen3");
  const auto stopped = speculative_generate(eos_target, eos_oracle, std::span(prompts).first(1), options);
  GenerateOptions eos_options;
  eos_options.max_new_tokens = 50;
  EXPECT_EQ(stopped[0].tokens, generate(eos_target, prompts[0], eos_options).tokens);
  EXPECT_EQ(stopped[0].stop_reason, "eos");
}

// A Target that checks, at every forward, that each sequence's cache holds
// exactly its accepted history: the logits it returns must equal those of a
// fresh sequence prefilled with the whole history.
class FreshPrefillChecker final : public Target {
 public:
  explicit FreshPrefillChecker(const Transformer& model) : inner_(model), reference_(model) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device_description() const override { return "checker"; }
  int create_sequence(int capacity) override {
    const int id = inner_.create_sequence(capacity);
    history_[id].clear();
    return id;
  }
  void release_sequence(int sequence) override { inner_.release_sequence(sequence), history_.erase(sequence); }
  int sequence_length(int sequence) const override { return inner_.sequence_length(sequence); }
  void truncate_sequence(int sequence, int length) override {
    inner_.truncate_sequence(sequence, length);
    history_[sequence].resize(length);
  }
  int row_invariant_rows() const override { return inner_.row_invariant_rows(); }
  void forward(std::span<const TargetInput> inputs, const TargetRequest& request, TargetResult& result) override {
    TargetRequest with_logits = request;
    with_logits.want_logits = true;
    inner_.forward(inputs, with_logits, result);
    const int V = config().vocab_size;
    size_t row = 0;
    for (const TargetInput& input : inputs) {
      auto& history = history_[input.sequence];
      history.insert(history.end(), input.tokens.begin(), input.tokens.end());
      const int fresh = reference_.create_sequence(static_cast<int>(history.size()));
      TargetInput whole{fresh, history, true};
      TargetResult expected;
      TargetRequest logits_only;
      logits_only.want_logits = true;
      reference_.forward({&whole, 1}, logits_only, expected);
      reference_.release_sequence(fresh);
      const size_t rows = input.all_rows ? input.tokens.size() : 1;
      const size_t first = history.size() - rows;
      EXPECT_LE(testing::relative_error(result.logits.data() + row * V, expected.logits.data() + first * V, rows * V),
                1e-5);
      ++checks_;
      row += rows;
    }
  }
  int checks() const { return checks_; }

 private:
  CpuTarget inner_, reference_;
  std::map<int, std::vector<int32_t>> history_;
  int checks_ = 0;
};

TEST(SpeculativeRollback, TargetCacheAndDrafterContextLeaveNoTrace) {
  const Transformer& model = golden("llama");
  const Drafter drafter = random_drafter(model.config, "rnn", 6, 23, 3.0f);
  FreshPrefillChecker target(model);
  DSparkSource source(drafter, target_head_of(model));
  SpeculativeOptions options;
  options.max_new_tokens = 24;
  options.gamma = 6;
  options.sampling = {1.0f, 0, 1.0f};  // sampling rejects at varied positions
  options.seed = 3;
  const auto prompts = test_prompts("llama");
  const auto results = speculative_generate(target, source, std::span(prompts).first(3), options);
  EXPECT_GT(target.checks(), 20);
  SpeculativeStats stats;
  for (const auto& result : results) stats.add(result.stats);
  EXPECT_GT(stats.drafted, stats.accepted);  // rollbacks happened
}

// A source that can take device taps (as the GPU drafter can), beside a target
// that keeps its taps on the host: speculative_generate asks for device taps,
// gets host ones (model/target.h), and must feed them through accept(); the
// default accept_device() fails, so a wrong turn cannot pass unnoticed.
class DeviceCapableSource final : public DraftSource {
 public:
  explicit DeviceCapableSource(DraftSource& source) : source_(source) {}
  std::vector<int> tap_layers() const override { return source_.tap_layers(); }
  bool accepts_device_taps() const override { return true; }
  void begin(int row, std::span<const int32_t> prompt, uint64_t seed) override { source_.begin(row, prompt, seed); }
  void accept(int row, std::span<const int32_t> tokens, const float* tapped_rows) override {
    EXPECT_NE(tapped_rows, nullptr);
    ++host_accepts;
    source_.accept(row, tokens, tapped_rows);
  }
  void propose(std::span<const int> rows, std::span<const int32_t> pending, std::span<const int> max_tokens,
               const cpu::SamplingParams& sampling, std::vector<Proposal>& proposals) override {
    source_.propose(rows, pending, max_tokens, sampling, proposals);
  }
  void end(int row) override { source_.end(row); }
  long host_accepts = 0;

 private:
  DraftSource& source_;
};

TEST(SpeculativeDeviceTaps, AHostTargetFeedsADeviceCapableSourceHostTaps) {
  const Transformer& model = golden("llama");
  const Drafter drafter = random_drafter(model.config, "markov", 4, 29, 3.0f);
  CpuTarget target(model);
  DSparkSource plain(drafter, target_head_of(model)), inner(drafter, target_head_of(model));
  DeviceCapableSource device_capable(inner);
  SpeculativeOptions options;
  options.max_new_tokens = 12;
  options.gamma = 4;
  options.sampling = {1.0f, 0, 1.0f};
  options.seed = 5;
  options.trace = true;
  const auto prompts = test_prompts("llama");
  const auto batch = std::span(prompts).first(3);
  const auto expected = speculative_generate(target, plain, batch, options);
  const auto results = speculative_generate(target, device_capable, batch, options);
  EXPECT_GT(device_capable.host_accepts, 3);
  ASSERT_EQ(results.size(), expected.size());
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].tokens, expected[r].tokens) << "request " << r;
    ASSERT_EQ(results[r].trace.size(), expected[r].trace.size()) << "request " << r;
    for (size_t k = 0; k < results[r].trace.size(); ++k) {
      EXPECT_EQ(results[r].trace[k].draft, expected[r].trace[k].draft) << "request " << r << ", round " << k;
      EXPECT_EQ(results[r].trace[k].confidence, expected[r].trace[k].confidence) << "request " << r << ", round " << k;
    }
  }
}

// ---------------------------------------------------------------- sampling

// A tiny random target (V = 6) whose full output distribution can be enumerated.
Transformer tiny_target(uint64_t seed) {
  Transformer model;
  ModelConfig& c = model.config;
  c.family = "qwen3";
  c.vocab_size = 6, c.hidden_size = 8, c.intermediate_size = 16, c.num_layers = 1;
  c.num_heads = 2, c.num_kv_heads = 1, c.head_dim = 4, c.max_positions = 64;
  c.qk_norm = true, c.tie_word_embeddings = true, c.rms_norm_eps = 1e-6f;
  Rng rng(seed);
  auto random = [&](Shape shape, float scale, float offset = 0.0f) {
    Tensor tensor = Tensor::zeros(std::move(shape));
    for (long i = 0; i < tensor.numel(); ++i) tensor.data[i] = offset + scale * float(2.0 * rng.uniform() - 1.0);
    return tensor;
  };
  model.embed_tokens = random({6, 8}, 0.8f);
  model.lm_head = model.embed_tokens;
  model.final_norm = random({8}, 0.2f, 1.0f);
  LayerWeights layer;
  layer.input_norm = random({8}, 0.2f, 1.0f);
  layer.q_proj = random({8, 8}, 0.6f), layer.k_proj = random({4, 8}, 0.6f), layer.v_proj = random({4, 8}, 0.6f);
  layer.o_proj = random({8, 8}, 0.6f);
  layer.q_norm = random({4}, 0.2f, 1.0f), layer.k_norm = random({4}, 0.2f, 1.0f);
  layer.post_attention_norm = random({8}, 0.2f, 1.0f);
  layer.gate_proj = random({16, 8}, 0.5f), layer.up_proj = random({16, 8}, 0.5f), layer.down_proj = random({8, 16}, 0.5f);
  model.layers.push_back(std::move(layer));
  model.rope_inverse_frequency = rope_inverse_frequencies(c);
  return model;
}

// p(x1, x2, x3 | prompt) of plain sampling, enumerated exactly.
std::vector<double> exact_joint(const Transformer& model, const std::vector<int32_t>& prompt,
                                const cpu::SamplingParams& sampling) {
  CpuTarget target(model);
  const int V = model.config.vocab_size;
  std::vector<double> joint(V * V * V, 0.0);
  std::vector<float> probs(V);
  std::vector<int32_t> order;
  auto next = [&](const std::vector<int32_t>& text) {
    const int sequence = target.create_sequence(32);
    TargetInput input{sequence, text, false};
    TargetRequest request;
    request.want_logits = true;
    TargetResult result;
    target.forward({&input, 1}, request, result);
    target.release_sequence(sequence);
    cpu::processed_distribution(probs.data(), result.logits.data(), V, sampling, order);
    return std::vector<double>(probs.begin(), probs.end());
  };
  const auto first = next(prompt);
  for (int a = 0; a < V; ++a) {
    if (first[a] == 0) continue;
    auto text = prompt;
    text.push_back(a);
    const auto second = next(text);
    for (int b = 0; b < V; ++b) {
      if (second[b] == 0) continue;
      text.push_back(b);
      const auto third = next(text);
      text.pop_back();
      for (int c = 0; c < V; ++c) joint[(a * V + b) * V + c] = first[a] * second[b] * third[c];
    }
  }
  return joint;
}

// Pearson chi-square of counts against expected probabilities, cells with an
// expected count under 5 pooled into one; returns (statistic, degrees of freedom).
std::pair<double, int> chi_square(const std::vector<long>& counts, const std::vector<double>& probabilities, long draws) {
  double statistic = 0.0, pooled_expected = 0.0;
  long pooled_count = 0;
  int cells = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double expected = probabilities[i] * draws;
    if (expected < 5.0) {
      pooled_expected += expected, pooled_count += counts[i];
      continue;
    }
    statistic += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++cells;
  }
  if (pooled_expected > 0) {
    statistic += (pooled_count - pooled_expected) * (pooled_count - pooled_expected) / std::max(pooled_expected, 1e-9);
    ++cells;
  }
  return {statistic, cells - 1};
}

// The 1 - 1e-4 quantile of chi-square with k degrees of freedom (Wilson-Hilferty).
double chi_square_bound(int k) {
  const double z = 3.719, a = 2.0 / (9.0 * k);
  return k * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

struct SamplingCase {
  std::string source;
  cpu::SamplingParams sampling;
  bool alg1 = false;    // the prefix scheduler cuts the proposals
  bool gate = false;    // ... and, drafting being dear, leaves rounds undrafted
  bool padded = false;  // ... and fills every row up to the longest (RoundPricing::padded_rows)
  bool lengths = false;  // ... and drafts the length that pays best (PrefixScheduler::draft_length)
};

// A scheduler as it is, with the draft lengths it chose.
class LengthRecorder final : public VerifyScheduler {
 public:
  explicit LengthRecorder(VerifyScheduler& scheduler) : scheduler_(scheduler) {}
  int rows_to_draft(const RoundOutlook& outlook) override { return scheduler_.rows_to_draft(outlook); }
  int draft_length(int gamma) override {
    const int length = scheduler_.draft_length(gamma);
    ++counts[length];
    return length;
  }
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override {
    scheduler_.schedule(proposals, verify);
  }
  std::map<int, long> counts;  // rounds by draft length

 private:
  VerifyScheduler& scheduler_;
};

class SamplingLossless : public ::testing::TestWithParam<SamplingCase> {};

// 1e5 speculative runs; the joint law of the first three emitted tokens is
// tested against the exact plain-decoding law. Each case fails by chance with
// probability 1e-4 (the seeds are fixed, so the outcome is deterministic).
TEST_P(SamplingLossless, EmittedTokensHaveTheTargetsDistribution) {
  const SamplingCase& c = GetParam();
  const Transformer model = tiny_target(7);
  const std::vector<int32_t> prompt = {1, 4, 2, 2, 5};
  const int V = model.config.vocab_size;
  const auto expected = exact_joint(model, prompt, c.sampling);
  Drafter drafter = random_drafter(model.config, "markov", 3, 31, 2.0f);
  // This drafter's confidences sit near 0.01; centred near 0.5 they spread over
  // the scheduler's admission thresholds.
  if (c.alg1) drafter.parameters.at("conf.b").data[0] += 4.4f;
  std::unique_ptr<DraftSource> source;
  if (c.source == "drafter") source = std::make_unique<DSparkSource>(drafter, target_head_of(model));
  if (c.source == "ngram") source = std::make_unique<NgramSource>(2);
  CpuTarget target(model);
  SpeculativeOptions options;
  options.max_new_tokens = 3;
  options.gamma = 3;
  options.sampling = c.sampling;
  // 50 rows a round: a position is admitted while its survival exceeds τ*/(200 + B), about 0.2
  // to 0.25 here, so the cuts vary with the confidences. Padded, raising L
  // adds 50 tokens at once: a level pays while its rows' summed survival
  // exceeds 50 τ*/(200 + B), and the second level's (about 12 of 75) sits
  // at that edge, so L varies with the confidences.
  // With lengths, drafting costs 0.01, 0.02 and 0.2 s a round of 50 rows at
  // L = 1, 2, 3: the gate stays open (plain decoding runs 40 tokens/s, a
  // drafted round over 42), and L = 1 or 2 pays best by a margin that the
  // confidences' second position decides.
  std::optional<DraftCostProfile> draft_cost;
  if (c.gate) draft_cost = DraftCostProfile{{1}, {50.0}};
  if (c.lengths) draft_cost = DraftCostProfile{{1}, {0.0002, 0.0004, 0.004}, {1, 2, 3}};
  PrefixScheduler scheduler(linear_sps(0.005), draft_cost, c.padded);
  LengthRecorder recorder(scheduler);
  if (c.alg1) options.scheduler = &recorder;
  const long draws = 100000;
  std::vector<long> counts(V * V * V, 0);
  SpeculativeStats stats;
  std::vector<std::vector<int32_t>> batch(50, prompt);  // 50 requests a call
  for (long done = 0; done < draws; done += long(batch.size())) {
    options.seed = 1000003 * done + 17;
    for (const auto& result : speculative_generate(target, *source, batch, options)) {
      ++counts[(result.tokens[0] * V + result.tokens[1]) * V + result.tokens[2]];
      stats.add(result.stats);
    }
  }
  const auto [statistic, freedom] = chi_square(counts, expected, draws);
  EXPECT_LT(statistic, chi_square_bound(freedom)) << freedom << " degrees of freedom";
  EXPECT_GT(stats.accepted, 0);
  EXPECT_LT(stats.accepted, stats.drafted);  // both accepts and rejections were exercised
  if (c.gate) {
    EXPECT_GT(stats.undrafted, 0);
    EXPECT_LT(stats.undrafted, stats.rounds);
  } else if (c.lengths) {  // γ while unmeasured and every 16th round, and each shorter length (a row may draft 2 here)
    EXPECT_EQ(recorder.counts.size(), 3u);
    EXPECT_GT(recorder.counts[1], 0);
    EXPECT_GT(recorder.counts[2], 0);
    EXPECT_GT(recorder.counts[3], 0);
  } else if (c.alg1) {  // every verified length occurred (3 new tokens leave room for 2 drafts): 0, 1 and 2
    EXPECT_LT(stats.drafted, stats.proposed);
    EXPECT_LT(stats.drafted_at[0], stats.rounds);
    EXPECT_LT(stats.drafted_at[1], stats.drafted_at[0]);
    EXPECT_GT(stats.drafted_at[1], 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Sources, SamplingLossless,
                         ::testing::Values(SamplingCase{"drafter", {1.0f, 0, 1.0f}},
                                           SamplingCase{"drafter", {0.7f, 4, 0.9f}},
                                           SamplingCase{"ngram", {1.3f, 0, 0.95f}},
                                           SamplingCase{"drafter", {1.0f, 0, 1.0f}, true},
                                           SamplingCase{"drafter", {0.7f, 4, 0.9f}, true},
                                           SamplingCase{"drafter", {1.0f, 0, 1.0f}, true, true},
                                           SamplingCase{"drafter", {1.0f, 0, 1.0f}, true, false, true},
                                           SamplingCase{"drafter", {1.0f, 0, 1.0f}, true, false, false, true}));

// ---------------------------------------------- the scheduler's early stop
//
// The paper's Appendix A: a scheduler whose decision to verify draft position
// j depends on the value of the token drafted at j biases the output. In a
// DSpark drafter c_1 reads the drafted token x_0 (through e_1 = w1[x_0]), so a
// scheduler that decides position 0 by looking at position 1's confidence, as
// one without Alg 1's early stop may, is such a scheduler.

// Two positions per round: x_0 ~ q_0 (half its mass on `favoured`), x_1
// uniform; c_0 = 0.6, and c_1 = 0.9 when x_0 is `favoured`, else 0.1.
class TokenDependentSource final : public DraftSource {
 public:
  TokenDependentSource(int vocab, int32_t favoured) : vocab_(vocab), favoured_(favoured) {}
  void begin(int row, std::span<const int32_t>, uint64_t seed) override { rngs_.insert_or_assign(row, Rng(seed)); }
  void accept(int, std::span<const int32_t>, const float*) override {}
  void propose(std::span<const int> rows, std::span<const int32_t>, std::span<const int> max_tokens,
               const cpu::SamplingParams&, std::vector<Proposal>& proposals) override {
    proposals.assign(rows.size(), Proposal{});
    for (size_t i = 0; i < rows.size(); ++i) {
      Rng& rng = rngs_.at(rows[i]);
      Proposal& proposal = proposals[i];
      std::vector<float> first(vocab_, 0.5f / (vocab_ - 1)), second(vocab_, 1.0f / vocab_);
      first[favoured_] = 0.5f;
      for (const auto* q : {&first, &second}) {
        if (int(proposal.tokens.size()) >= max_tokens[i]) break;
        const float c = proposal.tokens.empty() ? 0.6f : proposal.tokens[0] == favoured_ ? 0.9f : 0.1f;
        proposal.tokens.push_back(cpu::sample_from_distribution(q->data(), vocab_, rng.uniform()));
        proposal.confidence.push_back(c);
        proposal.probs.insert(proposal.probs.end(), q->begin(), q->end());
      }
    }
  }
  void end(int row) override { rngs_.erase(row); }

 private:
  int vocab_;
  int32_t favoured_;
  std::map<int, Rng> rngs_;
};

// Alg 1 without the early stop: walks the same descending order, but keeps
// the best prefix of the whole walk, so position 0 can be verified because of
// what position 1 promises.
class NoEarlyStopScheduler final : public VerifyScheduler {
 public:
  explicit NoEarlyStopScheduler(SpsProfile sps) : sps_(std::move(sps)) {}
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override {
    std::vector<std::tuple<double, int, int>> walk;  // (-survival, position, row)
    for (size_t r = 0; r < proposals.size(); ++r) {
      double survival = 1.0;
      for (size_t j = 0; j < proposals[r].confidence.size(); ++j)
        walk.emplace_back(-(survival *= proposals[r].confidence[j]), int(j), int(r));
    }
    std::sort(walk.begin(), walk.end());
    const int rows = int(proposals.size());
    double expected = rows, best_rate = rows * sps_.at(rows);
    size_t best = 0;
    for (size_t i = 0; i < walk.size(); ++i) {
      expected -= std::get<0>(walk[i]);
      const double rate = expected * sps_.at(rows + int(i) + 1);
      if (rate > best_rate) best_rate = rate, best = i + 1;
    }
    verify.assign(rows, 0);
    for (size_t i = 0; i < best; ++i) verify[std::get<2>(walk[i])] = std::get<1>(walk[i]) + 1;
  }

 private:
  SpsProfile sps_;
};

// Verifies a row's draft only when its first token is `favoured`.
class TokenPeekingScheduler final : public VerifyScheduler {
 public:
  explicit TokenPeekingScheduler(int32_t favoured) : favoured_(favoured) {}
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override {
    verify.clear();
    for (const Proposal& proposal : proposals)
      verify.push_back(!proposal.tokens.empty() && proposal.tokens[0] == favoured_ ? int(proposal.tokens.size()) : 0);
  }

 private:
  int32_t favoured_;
};

// One request per call (R = 1), 20000 calls per scheduler; the joint law of the
// first two emitted tokens against the exact plain law (36 cells). Alg 1 must
// pass at the 1 - 1e-4 chi-square quantile (a false alarm has probability 1e-4;
// the seeds are fixed, so the outcome is deterministic). The biased variants
// move P(first token = favoured) from p to p + q(1 - p) or p(2 - q) (q = 0.5),
// a shift of several hundred standard deviations' worth of chi-square at this
// size: they must fail the same test.
TEST(SchedulerEarlyStop, TokenDependentAdmissionBiasesTheOutputAndAlg1DoesNot) {
  const Transformer model = tiny_target(7);
  const std::vector<int32_t> prompt = {1, 4, 2, 2, 5};
  const int V = model.config.vocab_size;
  const cpu::SamplingParams sampling{1.0f, 0, 1.0f};
  const auto joint3 = exact_joint(model, prompt, sampling);
  std::vector<double> joint2(V * V, 0.0), first(V, 0.0);
  for (int a = 0; a < V * V; ++a)
    for (int c = 0; c < V; ++c) joint2[a] += joint3[a * V + c], first[a / V] += joint3[a * V + c];
  // The favoured token: the target's likeliest first token (the largest bias).
  const int32_t favoured = int32_t(std::max_element(first.begin(), first.end()) - first.begin());
  ASSERT_GT(first[favoured], 0.05);
  ASSERT_LT(first[favoured], 0.95);

  // Alg 1 with a concave SPS: position 0 always pays (1.6 x 90 > 100); position
  // 1 pays only when x_0 is favoured (2.14 x 70 > 1.6 x 90 > 1.66 x 70). The
  // no-early-stop variant with a non-concave SPS: position 0 alone never pays
  // (1.6 x 60 < 100), both together do exactly when x_0 is favoured (2.14 x 59 > 100 > 1.66 x 59).
  PrefixScheduler alg1({{1, 2, 3}, {100.0, 90.0, 70.0}});
  NoEarlyStopScheduler no_early_stop({{1, 2, 3}, {100.0, 60.0, 59.0}});
  TokenPeekingScheduler peeking(favoured);
  struct Run {
    std::string name;
    VerifyScheduler* scheduler;
    bool lossless;
  };
  CpuTarget target(model);
  TokenDependentSource source(V, favoured);
  for (const Run& run : {Run{"alg1", &alg1, true}, Run{"no early stop", &no_early_stop, false},
                         Run{"token peeking", &peeking, false}}) {
    SpeculativeOptions options;
    options.max_new_tokens = 3;  // round 1 drafts 2 positions
    options.gamma = 2;
    options.sampling = sampling;
    options.scheduler = run.scheduler;
    const long draws = 20000;
    std::vector<long> counts(V * V, 0);
    SpeculativeStats stats;
    for (long i = 0; i < draws; ++i) {
      options.seed = 7919 * i + 3;
      const auto result = speculative_generate(target, source, std::span(&prompt, 1), options);
      ++counts[result[0].tokens[0] * V + result[0].tokens[1]];
      stats.add(result[0].stats);
    }
    const auto [statistic, freedom] = chi_square(counts, joint2, draws);
    if (run.lossless) {
      EXPECT_LT(statistic, chi_square_bound(freedom)) << run.name << ": " << freedom << " degrees of freedom";
      // Not vacuous: the verified length varied with the drafted token 0.
      EXPECT_GT(stats.drafted_at[1], 0);
      EXPECT_LT(stats.drafted_at[1], stats.drafted_at[0]);
    } else {
      EXPECT_GT(statistic, chi_square_bound(freedom)) << run.name << ": " << freedom << " degrees of freedom";
    }
  }
}

// Records what the engine tells a scheduler before each round.
class RemainingRecorder final : public VerifyScheduler {
 public:
  int rows_to_draft(const RoundOutlook& outlook) override {
    calls.emplace_back(outlook.remaining.begin(), outlook.remaining.end());
    rows.emplace_back(outlook.rows.begin(), outlook.rows.end());
    waiting.push_back(outlook.waiting);
    return static_cast<int>(outlook.remaining.size());
  }
  void schedule(std::span<const Proposal> proposals, std::vector<int>& verify) override {
    verify.clear();
    for (const Proposal& proposal : proposals) verify.push_back(int(proposal.tokens.size()));
  }
  std::vector<std::vector<int>> calls, rows;  // per round, each row's remaining length and request
  std::vector<int> waiting;
};

// rows_to_draft hears, per active row, the tokens it may still emit:
// max_new_tokens less what the row's earlier rounds emitted (from the trace),
// the newest request first.
TEST(SpeculativeEngine, TellsTheSchedulerEachRowsRemainingLength) {
  const Transformer model = tiny_target(7);
  CpuTarget target(model);
  NgramSource source;
  const std::vector<std::vector<int32_t>> prompts = {{1, 4, 2, 1, 4, 2, 1, 4}, {3, 5}};
  SpeculativeOptions options;
  options.max_new_tokens = 12;
  options.gamma = 3;
  options.ignore_eos = true;
  options.trace = true;
  RemainingRecorder recorder;
  options.scheduler = &recorder;
  const auto results = speculative_generate(target, source, prompts, options);
  std::vector<std::vector<int>> expected, expected_rows;  // per round, the rows still running and their requests
  std::vector<int> emitted(prompts.size(), 0);
  for (size_t round = 0;; ++round) {
    std::vector<int> left, running;
    for (int r = int(prompts.size()) - 1; r >= 0; --r)
      if (round < results[r].trace.size()) {
        left.push_back(options.max_new_tokens - emitted[r]);
        running.push_back(r);
        emitted[r] += int(results[r].trace[round].emitted.size());
      }
    if (left.empty()) break;
    expected.push_back(left);
    expected_rows.push_back(running);
  }
  EXPECT_EQ(recorder.calls, expected);
  EXPECT_EQ(recorder.rows, expected_rows);
  EXPECT_EQ(recorder.waiting, std::vector<int>(expected.size(), 0));  // both requests run from the start
  EXPECT_GT(expected.size(), 1u);
}

// Under continuous batching the outlook names each row's request and counts
// the requests still waiting for a place; a request prefilled when a place
// frees up is in the very next round's outlook, and drafts there.
TEST(SpeculativeEngine, TellsTheSchedulerWhichRequestsRunAndHowManyWait) {
  const Transformer model = tiny_target(7);
  CpuTarget target(model);
  NgramSource source;
  const std::vector<std::vector<int32_t>> prompts = {{1, 4, 2, 1}, {3, 5, 3}, {2, 2}};
  SpeculativeOptions options;
  options.max_new_tokens = 6;
  options.gamma = 2;
  options.ignore_eos = true;
  options.trace = true;
  options.max_active = 2;
  RemainingRecorder recorder;
  options.scheduler = &recorder;
  const auto results = speculative_generate(target, source, prompts, options);
  ASSERT_FALSE(recorder.rows.empty());
  EXPECT_EQ(recorder.rows[0], (std::vector<int>{1, 0}));  // the newest first
  EXPECT_EQ(recorder.waiting[0], 1);
  // Request 2 joins in the round after the first of 0 and 1 finishes, nothing waiting then.
  size_t joined = 0;
  while (joined < recorder.rows.size() && recorder.waiting[joined] == 1) ++joined;
  ASSERT_LT(joined, recorder.rows.size());
  const size_t first_done = std::min(results[0].trace.size(), results[1].trace.size());
  EXPECT_EQ(joined, first_done);
  EXPECT_EQ(recorder.rows[joined].front(), 2);  // the newest
  for (size_t round = joined; round < recorder.rows.size(); ++round) EXPECT_EQ(recorder.waiting[round], 0);
  EXPECT_EQ(recorder.calls[joined].front(), 6);  // all 6 tokens to come
  for (const SpeculativeResult& result : results) EXPECT_EQ(result.tokens.size(), 6u);
}

TEST(Acceptance, GreedyKeepsTheMatchingPrefix) {
  const std::vector<int32_t> target = {5, 6, 7, 8}, draft = {5, 6, 9};
  const Verdict verdict = accept_greedy(target, draft);
  EXPECT_EQ(verdict.accepted, 2);
  EXPECT_EQ(verdict.next, 7);
  const Verdict all = accept_greedy(std::vector<int32_t>{5, 6, 9, 4}, draft);
  EXPECT_EQ(all.accepted, 3);
  EXPECT_EQ(all.next, 4);
}

}  // namespace
}  // namespace dspark
