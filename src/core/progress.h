// Progress line for long work: done/total, rate and ETA, redrawn in place on a
// terminal (at most ~10 times a second) and printed as plain lines every few
// seconds otherwise, so logs stay readable.
#pragma once
#include <chrono>
#include <string>

namespace dspark {

class Progress {
 public:
  // `unit` names what is counted ("tokens", "sequences").
  Progress(std::string label, long total, std::string unit);
  // Reports `done` units finished; `detail` is appended to the line.
  void update(long done, const std::string& detail = "");
  // Prints the final line (and a newline on a terminal).
  void finish(const std::string& detail = "");

 private:
  void print(long done, const std::string& detail, bool final);
  std::string label_, unit_;
  long total_;
  bool terminal_;
  std::chrono::steady_clock::time_point start_, last_print_;
};

}  // namespace dspark
