// Access to the golden checkpoints and HF reference outputs under tests/golden
// (made by tests/tools/make_golden.py with transformers; see its docstring).
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "model/transformer.h"

namespace dspark::testing {

// The golden directory: $DSPARK_GOLDEN_DIR when set (a copied tree on another
// machine), else tests/golden of the source tree this binary was built from.
inline std::filesystem::path golden_directory() {
  const char* overridden = std::getenv("DSPARK_GOLDEN_DIR");
  return overridden ? std::filesystem::path(overridden) : std::filesystem::path(DSPARK_GOLDEN_DIR);
}

inline std::filesystem::path golden_model(const std::string& name) { return golden_directory() / name; }

// A golden checkpoint loaded once per test binary (tests only read it).
inline const Transformer& golden_transformer(const std::string& name) {
  static std::map<std::string, Transformer> models;
  auto found = models.find(name);
  if (found == models.end()) found = models.emplace(name, load_transformer(golden_model(name))).first;
  return found->second;
}

inline Json golden_reference(const std::string& name, const std::string& file) {
  return read_json_file(golden_model(name) / "reference" / file);
}

// ||a - b|| / ||b|| over n elements.
inline double relative_error(const float* a, const float* b, size_t n) {
  double difference = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    difference += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(difference / norm);
}

// max_i |got_i - expected_i| / max_i |expected_i|: how far a result moved,
// against the size of the values (a bf16 rounding of the inputs, not noise).
inline double largest_relative_difference(std::span<const float> got, std::span<const float> expected) {
  double largest = 0.0, difference = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    largest = std::max(largest, double(std::fabs(expected[i])));
    difference = std::max(difference, double(std::fabs(got[i] - expected[i])));
  }
  return difference / largest;
}

// The message of the dspark::Error `action` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

// "[1, 2, 3]" for failure messages.
inline std::string describe_ids(const std::vector<int>& ids) {
  std::string text = "[";
  for (size_t i = 0; i < ids.size(); ++i) text += (i ? ", " : "") + std::to_string(ids[i]);
  return text + "]";
}

// A fresh, empty temporary directory removed when the object goes.
struct TemporaryDirectory {
  std::filesystem::path path;
  TemporaryDirectory() {
    path = std::filesystem::temp_directory_path() /
           ("dspark-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TemporaryDirectory() { std::filesystem::remove_all(path); }
  static int& counter() {
    static int value = 0;
    return value;
  }
};

}  // namespace dspark::testing
