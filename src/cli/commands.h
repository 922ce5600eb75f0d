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

void add_generate_command(CLI::App& app);
void add_perplexity_command(CLI::App& app);

}  // namespace dspark::cli
