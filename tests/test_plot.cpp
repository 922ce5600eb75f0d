// PNG plots: the file is a real PNG of the requested size with drawn content,
// and bad input is an error rather than a PLplot exit or a stray file.
#include <gtest/gtest.h>

#include <cmath>

#include "core/file.h"
#include "core/plot.h"
#include "golden.h"

namespace dspark {
namespace {

using testing::error_of;
using testing::TemporaryDirectory;

uint32_t big_endian_32(const std::string& bytes, size_t at) {
  uint32_t value = 0;
  for (size_t i = 0; i < 4; ++i) value = value << 8 | static_cast<unsigned char>(bytes[at + i]);
  return value;
}

std::vector<PlotSeries> example_series() {
  PlotSeries diagonal{"perfect", {0.0, 1.0}, {0.0, 1.0}, true, true, Marker::none};
  PlotSeries curve{"measured", {}, {}, true, false, Marker::circle};
  PlotSeries points{"points only", {}, {}, false, false, Marker::square};
  for (int i = 0; i <= 10; ++i) {
    curve.x.push_back(i / 10.0), curve.y.push_back(std::pow(i / 10.0, 1.7));
    points.x.push_back(i / 10.0 + 0.03), points.y.push_back(std::sqrt(i / 10.0));
  }
  return {diagonal, curve, points};
}

TEST(Plot, WritesAValidPngOfTheRequestedSize) {
  TemporaryDirectory directory;
  const auto path = directory.path / "reliability.png";
  PlotOptions options;
  options.x_range = {0.0, 1.0}, options.y_range = {0.0, 1.0};
  options.width = 640, options.height = 480;
  write_line_plot(path, "Reliability", "predicted", "observed", example_series(), options);
  const std::string bytes = read_text_file(path);
  ASSERT_GT(bytes.size(), 33u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));  // the PNG signature
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");                              // first chunk
  EXPECT_EQ(big_endian_32(bytes, 16), 640u);
  EXPECT_EQ(big_endian_32(bytes, 20), 480u);
  EXPECT_EQ(bytes.substr(bytes.size() - 8, 4), "IEND");
  EXPECT_GT(bytes.size(), 8000u);  // axes, labels, three series and a legend, not a blank page
  // Only the plot is left in the directory: the temporary file was renamed.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(directory.path)) ++files, (void)entry;
  EXPECT_EQ(files, 1);
}

TEST(Plot, LogAxisAndAutomaticRanges) {
  TemporaryDirectory directory;
  const auto path = directory.path / "sweep.png";
  PlotSeries plain{"plain", {1, 2, 4, 8, 16, 32, 64}, {10, 19, 37, 70, 130, 240, 420}, true, false, Marker::circle};
  PlotSeries spec{"alg1", {1, 2, 4, 8, 16, 32, 64}, {25, 45, 80, 140, 220, 330, 450}, true, false, Marker::triangle};
  PlotOptions options;
  options.log_x = true;
  write_line_plot(path, "Throughput", "batch", "tokens/s", {plain, spec}, options);
  const std::string bytes = read_text_file(path);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  EXPECT_GT(bytes.size(), 8000u);
}

TEST(Plot, BadInputIsAnErrorAndLeavesNoFile) {
  TemporaryDirectory directory;
  EXPECT_NE(error_of([&] {
              write_line_plot(directory.path / "missing" / "dir" / "p.png", "t", "x", "y", example_series());
            }).find("cannot write there"),
            std::string::npos);
  PlotSeries bad{"bad", {0.0, 1.0}, {0.0, std::nan("")}};
  EXPECT_NE(error_of([&] { write_line_plot(directory.path / "p.png", "t", "x", "y", {bad}); }).find("non-finite"),
            std::string::npos);
  PlotSeries negative{"n", {0.0, 1.0}, {1.0, 2.0}};
  PlotOptions log;
  log.log_x = true;
  EXPECT_NE(
      error_of([&] { write_line_plot(directory.path / "p.png", "t", "x", "y", {negative}, log); }).find("log axis"),
      std::string::npos);
  PlotSeries mismatched{"m", {0.0, 1.0}, {1.0}};
  EXPECT_NE(
      error_of([&] { write_line_plot(directory.path / "p.png", "t", "x", "y", {mismatched}); }).find("1 y values"),
      std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(directory.path));
}

}  // namespace
}  // namespace dspark
