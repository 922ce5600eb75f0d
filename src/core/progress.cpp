#include "core/progress.h"

#include <unistd.h>

#include <cstdio>

namespace dspark {

namespace {

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 99 * 3600) return "--:--";
  const long whole = static_cast<long>(seconds + 0.5);
  char text[32];
  if (whole >= 3600)
    std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", whole / 3600, whole / 60 % 60, whole % 60);
  else
    std::snprintf(text, sizeof text, "%02ld:%02ld", whole / 60, whole % 60);
  return text;
}

}  // namespace

Progress::Progress(std::string label, long total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), terminal_(isatty(fileno(stderr))) {
  start_ = last_print_ = std::chrono::steady_clock::now();
}

void Progress::update(long done, const std::string& detail) {
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_print_).count();
  if (since < (terminal_ ? 0.1 : 5.0)) return;
  last_print_ = now;
  print(done, detail, false);
}

void Progress::finish(const std::string& detail) { print(total_, detail, true); }

void Progress::print(long done, const std::string& detail, bool final) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? done / elapsed : 0.0;
  const double eta = rate > 0 ? (total_ - done) / rate : -1.0;
  const double fraction = total_ > 0 ? static_cast<double>(done) / total_ : 1.0;
  char line[512];
  std::snprintf(line, sizeof line, "%s %5.1f%% %ld/%ld %s, %.1f %s/s, %s %s%s%s", label_.c_str(),
                100.0 * fraction, done, total_, unit_.c_str(), rate, unit_.c_str(),
                final ? "took" : "ETA", format_duration(final ? elapsed : eta).c_str(),
                detail.empty() ? "" : ", ", detail.c_str());
  if (terminal_)
    std::fprintf(stderr, "\r\033[K%s%s", line, final ? "\n" : "");
  else
    std::fprintf(stderr, "%s\n", line);
  std::fflush(stderr);
}

}  // namespace dspark
