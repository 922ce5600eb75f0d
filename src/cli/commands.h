// The verbs of the `dspark` command; each file adds one subcommand.
#pragma once
#include <CLI/CLI.hpp>
#include <filesystem>
#include <string>

namespace dspark::cli {

// The model `dspark` runs when no -m is given: the project's embedded default.
// (Until the trained demo model ships, the golden qwen3 test model.)
inline std::string default_model_directory() {
  return std::string(DSPARK_SOURCE_DIR) + "/tests/golden/qwen3";
}

// --device cpu|cuda|auto (auto: cuda when a GPU is present).
inline void add_device_option(CLI::App& command, std::string& device) {
  command.add_option("--device", device, "cpu, cuda, or auto (cuda when a GPU is present)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
}

void add_generate_command(CLI::App& app);
void add_perplexity_command(CLI::App& app);
void add_bench_command(CLI::App& app);
// `dspark bench train` (src/cli/bench_train.cpp), added under the bench command.
void add_bench_train_command(CLI::App& bench);
void add_draft_init_command(CLI::App& app);
void add_regen_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);

}  // namespace dspark::cli
