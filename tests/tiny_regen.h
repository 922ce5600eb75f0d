// Eight sampled answers of 24 tokens from the golden qwen3 target, taps
// [1, 3, 4], regenerated once per test binary: the small real data set the
// CPU and the CUDA trainer tests train on.
#pragma once
#include <filesystem>
#include <vector>

#include "golden.h"
#include "model/cpu_target.h"
#include "model/prompts.h"
#include "model/tokenizer.h"
#include "train/regen.h"

namespace dspark::testing {

inline const std::filesystem::path& tiny_regenerated_data() {
  static TemporaryDirectory directory;
  static const bool made = [] {
    const char* const texts[] = {"def fibonacci(n):", "The cat sat", "hello world, hello", "1 2 3 4 5",
                                 "import numpy as", "Once upon a time there was", "x = [", "for i in range("};
    const Transformer& target = golden_transformer("qwen3");
    const Tokenizer tokenizer = Tokenizer::load(golden_model("qwen3"));
    std::vector<PromptEntry> entries;
    for (int i = 0; i < 8; ++i) entries.push_back({i + 1, texts[i], {}});
    RegenOptions options;
    options.tap_layers = {1, 3, 4};
    options.max_new_tokens = 24;
    options.sampling = {0.7f, 0, 1.0f};
    options.seed = 5;
    options.show_progress = false;
    CpuTarget cpu_target(target);
    regenerate(cpu_target, "qwen3", tokenize_regen_prompts(tokenizer, entries, false, target.config, "prompts"),
               options, directory.path);
    return true;
  }();
  (void)made;
  return directory.path;
}

}  // namespace dspark::testing
