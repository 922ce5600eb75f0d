// Switches read from the environment (development tools: profiles, traces).
#pragma once
#include <cstdlib>
#include <string>

namespace dspark {

// Whether the environment variable `variable` is "1".
inline bool environment_switch_on(const char* variable) {
  const char* value = std::getenv(variable);
  return value && std::string(value) == "1";
}

}  // namespace dspark
