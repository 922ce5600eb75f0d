// PNG line plots drawn by PLplot's cairo driver ("pngcairo"), for every part
// of dspark that reports a curve: reliability diagrams (calibrate),
// throughput against batch size (bench spec --sweep), acceptance by position,
// training curves. The binary draws the file itself; no Python involved.
//
// PLplot ends the process on its own internal errors, so everything a user can
// get wrong (an unwritable path, empty or non-finite data, a PLplot without
// the cairo driver) is checked first and reported as a dspark::Error. The file
// is drawn next to its destination and renamed over it, so a reader never sees
// a half-written PNG.
#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dspark {

enum class Marker { none, circle, square, triangle, diamond, cross };

struct PlotSeries {
  std::string name;          // the legend entry; empty: not in the legend
  std::vector<double> x, y;  // [n] the points, joined in this order
  bool line = true;          // join the points
  bool dashed = false;       // a dashed line (e.g. a reference diagonal)
  Marker marker = Marker::none;
};

struct PlotOptions {
  std::optional<std::pair<double, double>> x_range, y_range;  // default: the data's, padded
  bool log_x = false;                                         // log x axis, ticks at powers of 2 (x > 0)
  int width = 900, height = 600;                              // pixels
};

// Draws every series on one set of axes with a legend and writes a PNG.
void write_line_plot(const std::filesystem::path& path, const std::string& title, const std::string& x_label,
                     const std::string& y_label, const std::vector<PlotSeries>& series,
                     const PlotOptions& options = {});

// Whether this PLplot can write PNGs (its cairo driver is installed and found;
// PLPLOT_DRV_DIR points elsewhere when the library was moved).
bool png_plots_available();

}  // namespace dspark
