#include "core/plot.h"

#include <plstream.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>

#include "core/error.h"

namespace dspark {
namespace {

// PLplot keeps global state (the stream table, the driver table): one plot at a time.
std::mutex& plplot_mutex() {
  static std::mutex mutex;
  return mutex;
}

// PLplot exits the process after an internal error; say why in dspark's words first.
int on_plplot_exit(const char* message) {
  std::fprintf(stderr, "error: PLplot: %s\n", message ? message : "(no message)");
  return 1;
}

// cmap0 indices: 0 background, 1 axes and text, 2 grid, 3.. the series colours.
constexpr int kBackground = 0, kForeground = 1, kGrid = 2, kFirstSeriesColour = 3;
constexpr int kSeriesColours[][3] = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},   {214, 39, 40},  {148, 103, 189},
                                     {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
constexpr int kSeriesColourCount = sizeof(kSeriesColours) / sizeof(kSeriesColours[0]);

// UTF-8 glyphs drawn as text by cairo, in Marker's order.
const char* marker_glyph(Marker marker) {
  static constexpr const char* kGlyphs[] = {"", "●", "■", "▲", "◆", "×"};
  return kGlyphs[static_cast<int>(marker)];
}

// [lo, hi] of the data, widened by 5% on each side (or by 0.5 when flat).
std::pair<double, double> padded_range(double lo, double hi) {
  if (hi - lo <= 1e-12 * std::max(1.0, std::abs(hi))) return {lo - 0.5, hi + 0.5};
  const double pad = 0.05 * (hi - lo);
  return {lo - pad, hi + pad};
}

// x tick labels on a log axis: the window holds log2(x); the label is x itself.
void log2_label(PLINT, PLFLT value, char* label, PLINT length, PLPointer) {
  std::snprintf(label, size_t(length), "%g", std::exp2(value));
}

bool cairo_png_driver_present() {
  constexpr int kMaxDevices = 128;
  const char* menus[kMaxDevices];
  const char* names[kMaxDevices];
  const char** menu_list = menus;
  const char** name_list = names;
  int count = kMaxDevices;  // in: room; out: the devices found
  plgDevs(&menu_list, &name_list, &count);
  for (int i = 0; i < count; ++i)
    if (names[i] && std::string(names[i]) == "pngcairo") return true;
  return false;
}

}  // namespace

bool png_plots_available() {
  std::lock_guard lock(plplot_mutex());
  return cairo_png_driver_present();
}

void write_line_plot(const std::filesystem::path& path, const std::string& title, const std::string& x_label,
                     const std::string& y_label, const std::vector<PlotSeries>& series, const PlotOptions& options) {
  DSPARK_CHECK(!series.empty(), "plot ", path.string(), ": no series to draw");
  DSPARK_CHECK(options.width >= 100 && options.height >= 100, "plot ", path.string(), ": ", options.width, "x",
               options.height, " pixels is too small");
  // Every point finite (and positive on a log axis); the data's extent.
  double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min, y_min = x_min, y_max = -x_min;
  std::vector<std::vector<double>> plotted_x(series.size());
  for (size_t s = 0; s < series.size(); ++s) {
    const PlotSeries& one = series[s];
    DSPARK_CHECK(one.x.size() == one.y.size(), "plot ", path.string(), ": series \"", one.name, "\" has ", one.x.size(),
                 " x values and ", one.y.size(), " y values");
    for (size_t i = 0; i < one.x.size(); ++i) {
      DSPARK_CHECK(std::isfinite(one.x[i]) && std::isfinite(one.y[i]), "plot ", path.string(), ": series \"", one.name,
                   "\" has a non-finite point (", one.x[i], ", ", one.y[i], ")");
      DSPARK_CHECK(!options.log_x || one.x[i] > 0, "plot ", path.string(), ": series \"", one.name,
                   "\" has x = ", one.x[i], " on a log axis");
      const double x = options.log_x ? std::log2(one.x[i]) : one.x[i];
      plotted_x[s].push_back(x);
      x_min = std::min(x_min, x), x_max = std::max(x_max, x);
      y_min = std::min(y_min, one.y[i]), y_max = std::max(y_max, one.y[i]);
    }
  }
  DSPARK_CHECK(std::isfinite(x_min), "plot ", path.string(), ": every series is empty");
  auto [x_lo, x_hi] = padded_range(x_min, x_max);
  auto [y_lo, y_hi] = padded_range(y_min, y_max);
  if (options.x_range) {
    x_lo = options.log_x ? std::log2(options.x_range->first) : options.x_range->first;
    x_hi = options.log_x ? std::log2(options.x_range->second) : options.x_range->second;
  }
  if (options.y_range) y_lo = options.y_range->first, y_hi = options.y_range->second;
  DSPARK_CHECK(std::isfinite(x_lo) && std::isfinite(x_hi) && x_lo < x_hi && std::isfinite(y_lo) &&
                   std::isfinite(y_hi) && y_lo < y_hi,
               "plot ", path.string(), ": empty axis range");

  std::lock_guard lock(plplot_mutex());
  DSPARK_CHECK(cairo_png_driver_present(), "plot ", path.string(),
               ": PLplot's cairo driver (pngcairo) is not installed (Debian: plplot-driver-cairo; a moved "
               "installation needs PLPLOT_DRV_DIR)");
  // Drawn beside the destination, then renamed over it. Opening the file here
  // first turns an unwritable path into an error rather than a PLplot exit.
  const std::filesystem::path temporary = path.string() + ".tmp." + std::to_string(::getpid()) + ".png";
  {
    std::ofstream probe(temporary, std::ios::binary | std::ios::trunc);
    DSPARK_CHECK(probe.good(), "plot ", path.string(), ": cannot write there");
  }
  try {
    plsexit(on_plplot_exit);
    {
      plstream plot;
      plot.sdev("pngcairo");
      plot.sfnam(temporary.c_str());
      plot.spage(0, 0, options.width, options.height, 0, 0);
      plot.scmap0n(kFirstSeriesColour + kSeriesColourCount);
      plot.scol0(kBackground, 255, 255, 255);
      plot.scol0(kForeground, 0, 0, 0);
      plot.scol0(kGrid, 215, 215, 215);
      for (int c = 0; c < kSeriesColourCount; ++c)
        plot.scol0(kFirstSeriesColour + c, kSeriesColours[c][0], kSeriesColours[c][1], kSeriesColours[c][2]);
      plot.init();
      plot.adv(0);
      plot.vsta();
      plot.wind(x_lo, x_hi, y_lo, y_hi);
      // A log axis ticks every power of two (fewer when the data spans more
      // than 12 octaves) and labels the values themselves.
      const double x_tick = options.log_x ? std::max(1.0, std::ceil((x_hi - x_lo) / 12.0)) : 0.0;
      if (options.log_x) plot.slabelfunc(log2_label, nullptr);
      plot.col0(kGrid);
      plot.width(1.0);
      plot.box("g", x_tick, 0, "g", 0.0, 0);
      plot.col0(kForeground);
      plot.box(options.log_x ? "bcnsto" : "bcnst", x_tick, options.log_x ? 1 : 0, "bcnstv", 0.0, 0);
      plot.lab(x_label.c_str(), y_label.c_str(), title.c_str());

      std::vector<PLINT> entry_options, colours, styles, text_colours, symbol_counts;
      std::vector<PLFLT> widths, symbol_scales;
      std::vector<const char*> texts, symbols;
      for (size_t s = 0; s < series.size(); ++s) {
        const PlotSeries& one = series[s];
        const int colour = kFirstSeriesColour + int(s) % kSeriesColourCount;
        const PLINT n = static_cast<PLINT>(one.x.size());
        plot.col0(colour);
        plot.width(2.0);
        plot.lsty(one.dashed ? 2 : 1);
        if (one.line && n >= 2) plot.line(n, plotted_x[s].data(), one.y.data());
        if (one.marker != Marker::none && n > 0) {
          plot.schr(0.0, 0.8);
          plot.string(n, plotted_x[s].data(), one.y.data(), marker_glyph(one.marker));
          plot.schr(0.0, 1.0);
        }
        plot.lsty(1);
        if (one.name.empty()) continue;
        entry_options.push_back((one.line ? PL_LEGEND_LINE : 0) | (one.marker != Marker::none ? PL_LEGEND_SYMBOL : 0));
        colours.push_back(colour);
        styles.push_back(one.dashed ? 2 : 1);
        widths.push_back(2.0);
        text_colours.push_back(kForeground);
        symbol_counts.push_back(one.line ? 2 : 1);
        symbol_scales.push_back(0.8);
        texts.push_back(one.name.c_str());
        symbols.push_back(marker_glyph(one.marker));
      }
      if (!texts.empty()) {
        PLFLT legend_width = 0, legend_height = 0;
        plot.col0(kForeground);
        plot.legend(&legend_width, &legend_height, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX,
                    PL_POSITION_INSIDE | PL_POSITION_TOP | PL_POSITION_LEFT, 0.02, 0.02, 0.1, kBackground, kForeground,
                    1, 0, 0, PLINT(texts.size()), entry_options.data(), 1.0, 0.9, 2.0, 0.0, text_colours.data(),
                    texts.data(), nullptr, nullptr, nullptr, nullptr, colours.data(), styles.data(), widths.data(),
                    colours.data(), symbol_scales.data(), symbol_counts.data(), symbols.data());
      }
    }  // the stream ends here: the cairo driver writes the PNG
    std::error_code error;
    DSPARK_CHECK(std::filesystem::file_size(temporary, error) > 0 && !error, "plot ", path.string(),
                 ": PLplot wrote nothing");
    std::filesystem::rename(temporary, path, error);
    DSPARK_CHECK(!error, "plot ", path.string(), ": cannot rename the drawn file into place: ", error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

}  // namespace dspark
