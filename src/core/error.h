// Errors: every failure a user can cause (bad files, bad flags, bad shapes)
// is thrown as dspark::Error with one line that names the thing at fault.
// The CLI prints it as "error: ..." and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dspark {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream message;
  (message << ... << std::forward<Parts>(parts));
  throw Error(message.str());
}

}  // namespace dspark

// DSPARK_CHECK(cond, "message ", value, ...) throws dspark::Error when cond is false.
#define DSPARK_CHECK(cond, ...)        \
  do {                                 \
    if (!(cond)) ::dspark::fail(__VA_ARGS__); \
  } while (0)
