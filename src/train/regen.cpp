#include "train/regen.h"

#include <chrono>
#include <cstdio>

#include "core/dtype.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/safetensors.h"
#include "model/generate.h"
#include "train/dataset.h"

namespace dspark {
namespace {

constexpr uint64_t kStreamStride = 0x9e3779b97f4a7c15ull;  // generate_batch's per-request seed stride

// FNV-1a over every prompt's ids, so a resumed run can tell that the prompts
// (file, tokenizer or --chat) are the ones the data was started with.
std::string prompts_fingerprint(std::span<const RegenPrompt> prompts) {
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](uint32_t word) {
    for (int byte = 0; byte < 4; ++byte) {
      hash ^= (word >> (8 * byte)) & 0xffu;
      hash *= 0x100000001b3ull;
    }
  };
  for (const RegenPrompt& prompt : prompts) {
    mix(static_cast<uint32_t>(prompt.tokens.size()));
    for (int32_t token : prompt.tokens) mix(static_cast<uint32_t>(token));
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

Json generation_settings(std::span<const RegenPrompt> prompts, const RegenOptions& options) {
  return {{"prompts", prompts.size()},
          {"prompts_fingerprint", prompts_fingerprint(prompts)},
          {"max_tokens", options.max_new_tokens},
          {"temperature", options.sampling.temperature},
          {"top_p", options.sampling.top_p},
          {"top_k", options.sampling.top_k},
          {"chat", options.chat},
          {"seed", options.seed},
          {"batch", options.batch},
          {"shard_bytes", options.shard_bytes}};
}

std::string shard_name(size_t index) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05zu.safetensors", index);
  return name;
}

// The shards of an existing manifest that are really there, in order; the
// first missing or unreadable one and everything after it are dropped (and
// regenerated), so deleting the last shard makes a rerun redo it.
void keep_readable_shards(const std::filesystem::path& output, RegenManifest& manifest) {
  size_t kept = 0;
  for (; kept < manifest.shards.size(); ++kept) {
    const std::filesystem::path path = output / manifest.shards[kept].file;
    try {
      const SafetensorsFile shard(path);
      DSPARK_CHECK(shard.contains("ids") && shard.contains("rows") &&
                       shard.entry("ids").shape == Shape{manifest.shards[kept].tokens},
                   path.string(), " does not hold the ", manifest.shards[kept].tokens, " tokens the manifest lists");
    } catch (const Error& error) {
      std::fprintf(stderr, "warning: %s; it and the shards after it will be regenerated\n", error.what());
      break;
    }
  }
  if (kept == manifest.shards.size()) return;
  manifest.shards.resize(kept);
  size_t sequences = 0;
  while (sequences < manifest.sequences.size() && manifest.sequences[sequences].shard < static_cast<int>(kept))
    ++sequences;
  manifest.sequences.resize(sequences);
  manifest.complete = false;
}

void check_same_data(const RegenManifest& existing, const RegenManifest& fresh, const std::filesystem::path& output) {
  const std::string where = (output / kManifestFile).string();
  DSPARK_CHECK(existing.target_id == fresh.target_id && existing.hidden_size == fresh.hidden_size &&
                   existing.vocab_size == fresh.vocab_size && existing.num_layers == fresh.num_layers,
               where, ": the data there was made with target \"", existing.target_id, "\"; this is \"", fresh.target_id,
               "\" (use a new output directory)");
  DSPARK_CHECK(existing.tap_layers == fresh.tap_layers, where,
               ": the data there taps other layers (use the same --tap-layers or a new output directory)");
  for (const auto& [key, value] : fresh.generation.items())
    DSPARK_CHECK(existing.generation.contains(key) && existing.generation[key] == value, where,
                 ": the data there was made with ", key, " = ",
                 existing.generation.contains(key) ? existing.generation[key].dump() : "(unset)", ", not ",
                 value.dump(), " (same prompts and flags to resume, or a new output directory)");
}

}  // namespace

std::vector<RegenPrompt> tokenize_regen_prompts(const Tokenizer& tokenizer, std::span<const PromptEntry> entries,
                                                bool chat, const ModelConfig& config, const std::string& where) {
  std::vector<RegenPrompt> prompts;
  for (const PromptEntry& entry : entries) {
    try {
      RegenPrompt prompt{entry.line, tokenize_prompt(tokenizer, entry, chat)};
      check_prompt_fits(config, prompt.tokens.size());
      prompts.push_back(std::move(prompt));
    } catch (const Error& error) {
      std::fprintf(stderr, "warning: %s:%d skipped: %s\n", where.c_str(), entry.line, error.what());
    }
  }
  return prompts;
}

RegenSummary regenerate(Target& target, const std::string& target_id, std::span<const RegenPrompt> prompts,
                        const RegenOptions& options, const std::filesystem::path& output) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const ModelConfig& config = target.config();
  DSPARK_CHECK(!options.tap_layers.empty(), "regen needs at least one tap layer");
  for (int tap : options.tap_layers)
    DSPARK_CHECK(tap >= 0 && tap <= config.num_layers, "tap layer ", tap, " is outside the target's 0..",
                 config.num_layers);
  DSPARK_CHECK(options.tap_layers.back() == config.num_layers, "the last tap layer must be ", config.num_layers,
               " (the post-final-norm hidden, which training reads the target's distribution from)");
  DSPARK_CHECK(options.batch >= 1 && options.max_new_tokens >= 1 && options.shard_bytes >= 1,
               "regen needs batch, max tokens and shard size >= 1");

  RegenManifest manifest;
  manifest.target_id = target_id;
  manifest.tap_layers = options.tap_layers;
  manifest.hidden_size = config.hidden_size;
  manifest.vocab_size = config.vocab_size;
  manifest.num_layers = config.num_layers;
  manifest.generation = generation_settings(prompts, options);
  std::filesystem::create_directories(output);
  if (std::filesystem::exists(output / kManifestFile)) {
    RegenManifest existing = read_manifest(output);
    check_same_data(existing, manifest, output);
    manifest.shards = std::move(existing.shards);
    manifest.sequences = std::move(existing.sequences);
    keep_readable_shards(output, manifest);
  }

  const int total = static_cast<int>(prompts.size());
  const int width = manifest.tap_width();
  RegenSummary summary;
  size_t next = manifest.sequences.size();
  if (next > 0 && next < prompts.size())
    std::fprintf(stderr, "resuming: %zu of %d sequences already in %s\n", next, total, output.string().c_str());
  Progress progress("regen", total - static_cast<long>(next), "sequences");

  GenerateOptions generate_options;
  generate_options.max_new_tokens = options.max_new_tokens;
  generate_options.sampling = options.sampling;
  TargetRequest tap_request;
  tap_request.taps = options.tap_layers;
  TargetResult tapped;
  int shards_written = 0;
  while (next < prompts.size() && shards_written != options.stop_after_shards) {
    std::vector<int32_t> shard_ids;
    std::vector<uint16_t> shard_rows;
    std::vector<SequenceRecord> records;
    const int shard = static_cast<int>(manifest.shards.size());
    while (next < prompts.size() && static_cast<long>(shard_rows.size()) * 2 < options.shard_bytes) {
      const size_t count = std::min<size_t>(options.batch, prompts.size() - next);
      std::vector<std::vector<int32_t>> batch;
      for (size_t i = 0; i < count; ++i) batch.push_back(prompts[next + i].tokens);
      generate_options.seed = options.seed + kStreamStride * next;  // prompt i's stream: seed + stride·i
      const std::vector<GenerateResult> answers = generate_batch(target, batch, generate_options);
      for (size_t i = 0; i < count; ++i) {
        summary.generated_tokens += static_cast<long>(answers[i].tokens.size());
        batch[i].insert(batch[i].end(), answers[i].tokens.begin(), answers[i].tokens.end());
      }
      // The tapped forwards: as many whole sequences per forward as the token budget allows.
      for (size_t first = 0; first < count;) {
        size_t last = first;
        long tokens = 0;
        std::vector<TargetInput> inputs;
        while (last < count && (inputs.empty() || tokens + long(batch[last].size()) <= options.forward_tokens)) {
          tokens += static_cast<long>(batch[last].size());
          inputs.push_back({target.create_sequence(static_cast<int>(batch[last].size())), batch[last], false});
          ++last;
        }
        target.forward(inputs, tap_request, tapped);
        DSPARK_CHECK(tapped.taps.size() == size_t(tokens) * width, "the target returned ", tapped.taps.size(),
                     " tapped values for ", tokens, " tokens of ", width);
        for (const TargetInput& input : inputs) target.release_sequence(input.sequence);
        const size_t row_start = shard_rows.size();
        shard_rows.resize(row_start + tapped.taps.size());
        convert_to_bf16(tapped.taps.data(), shard_rows.data() + row_start, tapped.taps.size());
        for (size_t i = first; i < last; ++i) {
          const RegenPrompt& prompt = prompts[next + i];
          records.push_back({shard, static_cast<long>(shard_ids.size()), static_cast<int>(prompt.tokens.size()),
                             static_cast<int>(batch[i].size()), prompt.line, answers[i].stop_reason});
          shard_ids.insert(shard_ids.end(), batch[i].begin(), batch[i].end());
        }
        first = last;
      }
      next += count;
      summary.new_sequences += static_cast<int>(count);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (options.show_progress)
        progress.update(summary.new_sequences,
                        std::to_string(static_cast<long>(seconds > 0 ? summary.generated_tokens / seconds : 0)) +
                            " tokens/s, shard " + std::to_string(shard));
    }
    const long tokens = static_cast<long>(shard_ids.size());
    const std::string file = shard_name(shard);
    write_safetensors(
        output / file,
        {{"ids", Dtype::I32, {tokens}, shard_ids.data()}, {"rows", Dtype::BF16, {tokens, width}, shard_rows.data()}},
        {{"format", "dspark-regen"}, {"target_id", target_id}});
    manifest.shards.push_back({file, static_cast<int>(records.size()), tokens});
    manifest.sequences.insert(manifest.sequences.end(), records.begin(), records.end());
    manifest.complete = next == prompts.size();
    write_manifest(output, manifest);
    summary.new_tokens += tokens;
    ++shards_written;
  }
  manifest.complete = manifest.sequences.size() == prompts.size();
  if (shards_written == 0) write_manifest(output, manifest);  // a fresh, empty or already complete run
  summary.sequences = static_cast<int>(manifest.sequences.size());
  summary.shards = static_cast<int>(manifest.shards.size());
  summary.complete = manifest.complete;
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double rate = summary.seconds > 0 ? summary.generated_tokens / summary.seconds : 0.0;
  if (options.show_progress && summary.new_sequences > 0)
    progress.finish(std::to_string(static_cast<long>(rate)) + " tokens/s, " + std::to_string(summary.shards) +
                    " shards");
  return summary;
}

}  // namespace dspark
