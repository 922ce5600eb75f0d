// The verbs of the `dspark` command; each file adds one subcommand.
#pragma once
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace dspark::cli {

// A path of the source tree: under the tree this binary was built from, else
// (a binary carried to another machine) under the current directory when it
// exists there.
inline std::filesystem::path source_tree_path(const std::string& relative) {
  const std::filesystem::path built = std::filesystem::path(DSPARK_SOURCE_DIR) / relative;
  if (std::filesystem::exists(built) || !std::filesystem::exists(relative)) return built;
  return relative;
}

// Where the shipped demo models live: $DSPARK_MODELS_DIR when set (test-made
// models, or a copy elsewhere), else models/ of the source tree.
inline std::filesystem::path models_directory() {
  const char* overridden = std::getenv("DSPARK_MODELS_DIR");
  return overridden && *overridden ? std::filesystem::path(overridden) : source_tree_path("models");
}

// The model every verb runs when no -m is given: the shipped demo target.
inline std::string default_model_directory() { return (models_directory() / "dspark-target").string(); }

// The drafter `dspark demo` uses when no -d is given: the shipped drafter trained for that target.
inline std::string default_drafter_directory() { return (models_directory() / "dspark-drafter").string(); }

// --device cpu|cuda|auto (auto: cuda when a GPU is present).
// The median of timed runs (the upper middle value for an even count).
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

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
void add_demo_command(CLI::App& app);

}  // namespace dspark::cli
