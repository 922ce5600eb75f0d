// Runs the built `dspark` binary as a user would and captures what it prints.
#pragma once
#include <sys/wait.h>

#include <string>
#include <vector>

#include "core/file.h"
#include "golden.h"

namespace dspark::testing {

struct CommandResult {
  int exit_code = -1;       // -1 when killed by a signal (a crash)
  std::string out, err;
};

inline std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// `environment`: NAME=value settings for this run only.
inline CommandResult run_dspark(const std::vector<std::string>& arguments,
                                const std::vector<std::string>& environment = {}) {
  TemporaryDirectory directory;
  std::string command;
  if (!environment.empty()) {
    command = "env";
    for (const auto& setting : environment) command += " " + shell_quote(setting);
    command += " ";
  }
  command += shell_quote(DSPARK_BINARY);
  for (const auto& argument : arguments) command += " " + shell_quote(argument);
  command += " >" + shell_quote((directory.path / "out").string()) + " 2>" +
             shell_quote((directory.path / "err").string());
  const int status = std::system(command.c_str());
  CommandResult result;
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  result.out = read_text_file(directory.path / "out");
  result.err = read_text_file(directory.path / "err");
  return result;
}

}  // namespace dspark::testing
