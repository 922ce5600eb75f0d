// dspark demo: the README's first command. With no flags it loads the shipped
// target (models/dspark-target) and its DSpark drafter (models/dspark-drafter),
// continues a held-out code prompt plainly and then speculatively (same
// prompt, same settings, greedy), each after an untimed warm-up pass and then
// over several timed passes that alternate the modes, prints the text once
// and reports both speeds, their ratio, tau and acceptance by position, and
// whether the two texts are identical (at temperature 0 they must be: a
// difference is an error).
//
// A verb of its own rather than a mode of `generate`: generate is one run
// that streams text and stays scriptable (its --json is one result); the demo
// is a measurement that decodes the same prompt both ways, several times, and compares.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json.h"
#include "core/plot.h"
#include "kernels/cpu/matmul.h"
#include "model/prompts.h"
#include "model/target.h"
#include "model/tokenizer.h"
#include "spec/compare.h"
#include "spec/draft_sources.h"

namespace dspark::cli {
namespace {

// The default prompt: a held-out code prompt (the drafter never trained on
// it). Line 20 (pybind11's stl.h): its tau, 2.7 at gamma 7, sits at the mean
// of the first 80 held-out code prompts (2.78, bench/RESULTS.md), and the
// 19M target's greedy continuation starts as plausible C++ before it falls
// into the repetition greedy decoding of so small a model ends in; line 1
// (tau 2.1) repeats one import line from its first token.
constexpr const char* kDefaultPromptFile = "data/prompts/heldout_code.jsonl";
constexpr int kDefaultPromptLine = 20;

struct DemoFlags {
  std::string model = default_model_directory();
  std::string draft = default_drafter_directory();
  std::string prompt;  // empty: the held-out prompt above
  int max_new_tokens = 128;
  int passes = 5;  // timed passes of each mode
  float temperature = 0.0f;
  uint64_t seed = 0;
  int gamma = 0;  // 0: the drafter's own on a GPU, at most kCpuGamma on the CPU
  std::string schedule = "threshold";
  bool ignore_eos = false;
  std::string plot;
  bool json = false;
  bool f32 = false;  // the CPU's f32 reference instead of bf16 products
  std::string device = "auto";
};

// The text of the default prompt, and where it came from.
PromptEntry default_prompt(std::string& origin) {
  const std::filesystem::path file = source_tree_path(kDefaultPromptFile);
  DSPARK_CHECK(std::filesystem::exists(file), file.string(), ": the default prompt file is missing (pass -p TEXT)");
  for (PromptEntry& entry : read_prompt_file(file))
    if (entry.line == kDefaultPromptLine) {
      origin = std::string("held-out code, ") + kDefaultPromptFile + " line " + std::to_string(kDefaultPromptLine);
      return entry;
    }
  fail(file.string(), ": line ", kDefaultPromptLine, " is not a usable prompt (pass -p TEXT)");
}

// A path as a user would type it: relative to the current directory when inside it.
std::string shown(const std::string& path) {
  std::error_code error;
  const std::filesystem::path relative = std::filesystem::relative(path, error);
  if (error || relative.empty() || *relative.begin() == "..") return path;
  return relative.string();
}

void check_shipped(const std::string& directory, const char* what, const char* flag) {
  DSPARK_CHECK(std::filesystem::is_directory(directory), what, " ", directory,
               " does not exist (the repository ships it in models/; pass ", flag,
               " DIR, or set DSPARK_MODELS_DIR to a directory holding dspark-target/ and dspark-drafter/)");
}

// The demo's draft length on the CPU. There the verify of k tokens is bound
// by arithmetic, not by memory as on a GPU: with bf16 products t(5)/t(1) is
// ~1.4-1.9 and t(8)/t(1) ~2.0-2.8 on 2 cores, so the last drafted positions,
// accepted in 10-19% of rounds, cost more than they bring. Measured with the
// shipped drafter (bench/RESULTS.md, stop 17): gamma 4 1.40-1.45x, 5
// 1.25-1.44x, 7 0.86-1.29x, on the same machine in the same minutes.
constexpr int kCpuGamma = 4;

void run_demo(const DemoFlags& flags) {
  check_shipped(flags.model, "the target", "-m");
  check_shipped(flags.draft, "the drafter", "-d");
  // On 2 CPU cores a verify of 8 tokens with f32 activations costs 2-3.7
  // plain steps (f32 FMAs are the limit, not memory), which leaves
  // speculation little to gain; bf16 products (exact, summed in f32) do twice
  // the multiply-adds per instruction on CPUs with AVX-512 BF16.
  cpu::set_bf16_products(!flags.f32);
  const std::unique_ptr<Target> target = load_target(flags.model, flags.device);
  const Tokenizer tokenizer = Tokenizer::load(flags.model);
  const ModelConfig& config = target->config();
  LoadedDraftSource source = load_draft_source(flags.draft, flags.model, *target, 0.0f);
  int requested_gamma = flags.gamma;  // 0: the drafter's
  if (requested_gamma == 0 && resolve_device(flags.device) == "cpu")
    requested_gamma = std::min(kCpuGamma, source.gamma_for(0));
  const int gamma = source.gamma_for(requested_gamma);
  VerifySchedules schedules(*target, source, flags.model, flags.draft, {flags.schedule}, 1, gamma, default_sps_cache_path(),
                            false);

  std::string origin = "-p";
  PromptEntry entry;
  if (flags.prompt.empty()) {
    entry = default_prompt(origin);
  } else {
    entry.prompt = flags.prompt;
  }
  const std::string prompt_text = entry.prompt;
  const std::vector<std::vector<int32_t>> prompts = {tokenize_prompt(tokenizer, entry, false)};
  check_prompt_fits(config, prompts[0].size());

  const cpu::SamplingParams sampling{flags.temperature, 0, 1.0f};
  GenerateOptions plain_options;
  plain_options.max_new_tokens = flags.max_new_tokens;
  plain_options.sampling = sampling;
  plain_options.seed = flags.seed;
  plain_options.ignore_eos = flags.ignore_eos;
  SpeculativeOptions spec_options;
  spec_options.max_new_tokens = flags.max_new_tokens;
  spec_options.sampling = sampling;
  spec_options.seed = flags.seed;
  spec_options.ignore_eos = flags.ignore_eos;
  spec_options.gamma = gamma;
  spec_options.scheduler = schedules.scheduler(flags.schedule);
  DraftSource& drafts = schedules.source(flags.schedule);
  const bool greedy = sampling.greedy();

  if (!flags.json) {
    std::fprintf(stderr, "target %s, drafter %s (gamma %d, schedule %s) on %s\n", shown(flags.model).c_str(),
                 shown(flags.draft).c_str(), gamma, flags.schedule.c_str(), target->device_description().c_str());
    std::fprintf(stderr, "warming up (one untimed pass of each mode)...\n");
  }
  // Warm-up: first uses of a shape pick GEMM algorithms, capture CUDA graphs
  // and fault the weights in; both modes are measured warm.
  timed_plain_decoding(*target, prompts, plain_options, nullptr);
  timed_speculative_decoding(*target, drafts, prompts, spec_options, nullptr);

  // Plain decoding, its text streamed as it is generated (the speculative
  // text is the same at temperature 0; that is checked below).
  StreamingDecoder stream(tokenizer);
  if (!flags.json) {
    std::printf("--- prompt (%s; %zu tokens) ---\n%s", origin.c_str(), prompts[0].size(), prompt_text.c_str());
    if (prompt_text.empty() || prompt_text.back() != '\n') std::printf("\n");
    std::printf("--- continuation (plain decoding, %s) ---\n", greedy ? "greedy" : "sampled");
    std::fflush(stdout);
  }
  const std::function<void(size_t, int32_t)> print = [&](size_t, int32_t token) {
    if (flags.json || (is_eos(config, token) && !flags.ignore_eos)) return;
    std::fputs(stream.push(token).c_str(), stdout);
    std::fflush(stdout);
  };
  // Each mode runs `passes` times, alternating with the other, and its rate
  // is the median pass's: a drift in this machine's speed (a shared host's
  // memory bandwidth moves by tens of percent within minutes) then weighs on
  // both modes alike, and a pass that another tenant slowed does not count.
  TimedDecoding plain, speculative;
  std::vector<double> plain_rates, speculative_rates;  // [passes] tokens/s
  auto timed_pass = [](TimedDecoding& record, std::vector<double>& rates, const auto& decode) {
    const double seconds = record.seconds;
    const long tokens = record.tokens;
    decode();
    rates.push_back((record.tokens - tokens) / (record.seconds - seconds));
  };
  for (int pass = 0; pass < flags.passes; ++pass) {
    timed_pass(plain, plain_rates, [&] {
      timed_plain_decoding(*target, prompts, plain_options, &plain, pass == 0 ? print : nullptr);
    });
    if (pass == 0 && !flags.json) {
      std::fputs(stream.finish().c_str(), stdout);
      std::printf("\n");
      std::fflush(stdout);
      std::fprintf(stderr, "speculative decoding...\n");
    }
    timed_pass(speculative, speculative_rates, [&] {
      timed_speculative_decoding(*target, drafts, prompts, spec_options, &speculative, plain.outputs);
    });
  }
  const double plain_rate = median(plain_rates), speculative_rate = median(speculative_rates);

  const bool identical = speculative.matched == flags.passes;
  const double speedup = speculative_rate / plain_rate;
  const SpeculativeStats& stats = speculative.stats;
  const std::vector<double> acceptance = stats.acceptance_by_position();
  const double verified_per_round = stats.rounds ? double(stats.drafted) / stats.rounds : 0.0;
  if (!flags.plot.empty()) {
    PlotSeries series{"acceptance", {}, {}, true, false, Marker::circle};
    for (size_t k = 0; k < acceptance.size(); ++k) {
      if (stats.drafted_at[k] == 0) continue;  // never drafted there: no rate
      series.x.push_back(double(k + 1));
      series.y.push_back(acceptance[k]);
    }
    DSPARK_CHECK(!series.x.empty(), "--plot: no drafted tokens to plot (every round verified the pending token only)");
    PlotOptions axes;
    axes.x_range = {{0.5, gamma + 0.5}};
    axes.y_range = {{0.0, 1.0}};
    char title[256];
    std::snprintf(title, sizeof title, "Acceptance by draft position: %.2fx, tau %.2f, %s", speedup, stats.tau(),
                  target->device_description().c_str());
    write_line_plot(flags.plot, title, "draft position (1 = first drafted token)",
                    "accepted / drafted at this position", {series}, axes);
  }

  std::vector<int32_t> text_tokens = plain.outputs[0];
  if (plain.stop_reasons[0] == "eos") text_tokens.pop_back();
  if (flags.json) {
    auto mode_json = [](const TimedDecoding& mode, double rate, const std::vector<double>& rates) {
      return Json{{"tokens", mode.tokens}, {"seconds", mode.seconds}, {"tokens_per_s", rate}, {"pass_tokens_per_s", rates}};
    };
    Json out = {{"text", tokenizer.decode(text_tokens)},
                {"prompt_tokens", prompts[0].size()},
                {"prompt", origin},
                {"device", target->device_description()},
                {"target", flags.model},
                {"drafter", flags.draft},
                {"gamma", gamma},
                {"schedule", flags.schedule},
                {"temperature", flags.temperature},
                {"stop_reason", plain.stop_reasons[0]},
                {"plain", mode_json(plain, plain_rate, plain_rates)},
                {"speculative", mode_json(speculative, speculative_rate, speculative_rates)},
                {"speedup", speedup},
                {"tau", stats.tau()},
                {"rounds", stats.rounds},
                {"verified_per_round", verified_per_round},
                {"acceptance_by_position", acceptance},
                {"text_identical", identical},
                {"passes", flags.passes}};
    if (!flags.plot.empty()) out["plot"] = flags.plot;
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << std::endl;
  } else {
    std::printf("--- plain vs speculative decoding, %s ---\n", target->device_description().c_str());
    std::printf("%-22s %6s %8s %9s\n", "", "tokens", "seconds", "tokens/s");
    std::printf("%-22s %6ld %8.2f %9.1f\n", "plain", plain.tokens, plain.seconds, plain_rate);
    std::printf("%-22s %6ld %8.2f %9.1f\n", "speculative", speculative.tokens, speculative.seconds, speculative_rate);
    std::printf("%-22s %.2fx\n", "speed-up", speedup);
    std::printf("%-22s %.2f tokens per target forward (%ld verify rounds, %.2f drafted tokens verified per round)\n",
                "tau", stats.tau(), stats.rounds, verified_per_round);
    std::printf("%-22s", "acceptance by position");
    for (double rate : acceptance) std::printf(" %.2f", rate);
    std::printf("%s\n", acceptance.empty() ? " (no drafted token was verified)" : "");
    if (greedy)
      std::printf("%-22s %s\n", "text identical", identical ? "yes" : "NO");
    else
      std::printf("%-22s %s (sampling: each mode draws its own sample of the target's distribution)\n",
                  "text identical", identical ? "yes" : "no");
    std::printf(
        "(drafter %s, gamma %d, schedule %s, temperature %g; tokens and seconds summed over %d passes of "
        "each mode, alternating, after an untimed warm-up pass; tokens/s the median pass's; prompt "
        "processing included)\n",
        shown(flags.draft).c_str(), gamma, flags.schedule.c_str(), flags.temperature, flags.passes);
    if (!flags.plot.empty()) std::printf("wrote %s\n", flags.plot.c_str());
    std::fflush(stdout);
  }
  if (greedy && !identical) {
    const long at = first_difference(plain.outputs[0], speculative.outputs[0]);
    const int exact = target->row_invariant_rows();
    const std::string reason = gamma + 1 > exact
                                   ? "on " + target->device_description() + " verify steps of more than " +
                                         std::to_string(exact) +
                                         " tokens may round a near-tie differently from a decode step; gamma " +
                                         std::to_string(exact - 1) + " or less gives identical text"
                                   : "a bug, please report it";
    fail("speculative decoding did not reproduce plain greedy decoding (first difference at generated token ", at,
         "): ", reason);
  }
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto flags = std::make_shared<DemoFlags>();
  CLI::App* command = app.add_subcommand(
      "demo", "Plain vs speculative decoding of one prompt with the shipped target and drafter: text, speeds, tau");
  command->add_option("-m,--model", flags->model, "the target's HF model directory")->capture_default_str();
  command->add_option("-d,--draft", flags->draft, "a DSpark drafter for that target")->capture_default_str();
  command->add_option("-p,--prompt", flags->prompt,
                      std::string("prompt text, used as given (default: ") + kDefaultPromptFile + " line " +
                          std::to_string(kDefaultPromptLine) + ")");
  command->add_option("-n,--max-tokens", flags->max_new_tokens, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--passes", flags->passes, "timed passes of each mode, alternating plain and speculative")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  command->add_option("--temperature", flags->temperature, "0 = greedy (the texts must then be identical)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_option("--seed", flags->seed, "sampling seed")->capture_default_str();
  command->add_option("--gamma", flags->gamma,
                      "most tokens drafted per round (default: the drafter's on a GPU, at most 4 on the CPU)")
      ->check(CLI::Range(1, 64));
  command
      ->add_option("--schedule", flags->schedule,
                   "how much of each draft is verified: off (all), threshold (the drafter's calibrated "
                   "thresholds) or alg1 (the prefix scheduler)")
      ->capture_default_str()
      ->check(CLI::IsMember({"off", "threshold", "alg1"}));
  command->add_flag("--ignore-eos", flags->ignore_eos, "keep generating past end-of-sequence tokens");
  command->add_option("--plot", flags->plot, "write acceptance by draft position to this PNG");
  command->add_flag("--json", flags->json, "print one JSON object instead of the text and report");
  command->add_flag("--f32", flags->f32,
                    "CPU: the f32 reference (f32 activations) instead of the demo's bf16 products (activations rounded "
                    "to bf16, as HF transformers and the CUDA path multiply a bf16 checkpoint)");
  add_device_option(*command, flags->device);
  command->callback([flags] { run_demo(*flags); });
}

}  // namespace dspark::cli
