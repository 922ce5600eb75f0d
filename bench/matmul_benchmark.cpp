// The CPU matmul forwards' two paths side by side at the shapes the models
// use: OpenBLAS (sgemv for one row, sgemm otherwise) against the small-row
// kernel, for 1-32 activation rows (decode is 1 row, verifying a block of k
// drafted tokens is k rows).
//
// Target shapes (weight [out, in], matmul_forward) run "cold": each iteration
// uses the next of enough weight copies to overflow the last-level cache, as
// in a decode step, which streams every layer's weights from memory once.
// Drafter shapes (weight [in, out], matmul_in_out_forward) run "hot" (one copy,
// cache-resident), as the drafter's few MB of weights stay in L2/L3 between
// its steps.
//
// small_rows_bf16 runs the small-row kernel on the weights' bf16 bits (the
// values rounded to bf16 first, in pack_bf16_rows' or pack_bf16_columns'
// panels), as the models' bf16 checkpoints are read.
// --isa=avx512 (or avx2, baseline) runs the small-row kernel's narrower builds.
// --hot runs every shape hot (to see the kernels' arithmetic apart from
// memory), --cold every shape cold. --bf16-products rounds the activations
// of bf16-weight products to bf16 (`dspark --bf16-products`).
//
// Build: cmake --build build --target dspark_matmul_benchmark (needs Google
// Benchmark, libbenchmark-dev; not part of ctest). Run e.g.
//   build/dspark_matmul_benchmark --benchmark_filter='forward/.*/rows:8$'
// target_forward/*: all matmuls of one forward of the 19M-parameter target.
// Counters: weight_GBps (weight bytes read per second), GFLOPs.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/random.h"
#include "kernels/cpu/matmul.h"

namespace {

using dspark::Rng;

// More weight bytes than any last-level cache this runs on (32 MB here).
constexpr size_t kColdBytes = size_t(128) << 20;

std::vector<float> random_floats(Rng& rng, size_t count) {
  std::vector<float> values(count);
  for (float& value : values) value = float(rng.uniform() * 2.0 - 1.0);
  return values;
}

// The bf16 value nearest each weight (what a bf16 checkpoint holds).
void round_to_bf16(std::vector<float>& values) {
  for (float& value : values) value = dspark::bf16_to_f32(dspark::f32_to_bf16(value));
}

enum class Path { Blas, SmallRows, SmallRowsBf16 };  // the last: the weights' bf16 bits
enum class Layout { OutIn, InOut };

std::string path_name(Path path) {
  return path == Path::Blas ? "blas" : path == Path::SmallRows ? "small_rows" : "small_rows_bf16";
}

void run(benchmark::State& state, Path path, Layout layout, bool cold) {
  const int in = int(state.range(0)), out = int(state.range(1)), rows = int(state.range(2));
  Rng rng(7);
  const size_t weight_size = size_t(in) * out;
  const size_t copies = cold ? std::max<size_t>(1, kColdBytes / (weight_size * sizeof(float)) + 1) : 1;
  std::vector<float> weights = random_floats(rng, weight_size * copies);
  std::vector<std::vector<uint16_t>> weights_bf16;  // one per copy
  if (path == Path::SmallRowsBf16) {
    round_to_bf16(weights);
    for (size_t copy = 0; copy < copies; ++copy) {
      const float* weight = weights.data() + copy * weight_size;
      weights_bf16.push_back(layout == Layout::OutIn ? dspark::cpu::pack_bf16_rows(weight, out, in)
                                                     : dspark::cpu::pack_bf16_columns(weight, in, out));
    }
  }
  const std::vector<float> x = random_floats(rng, size_t(rows) * in);
  const std::vector<float> bias = random_floats(rng, out);
  std::vector<float> y(size_t(rows) * out);
  size_t copy = 0;
  for (auto _ : state) {
    const float* weight = weights.data() + copy * weight_size;
    const uint16_t* weight_bf16 = path == Path::SmallRowsBf16 ? weights_bf16[copy].data() : nullptr;
    if (++copy == copies) copy = 0;
    if (path == Path::SmallRowsBf16) {  // either layout's panels: the same kernel
      dspark::cpu::matmul_forward_small_rows(y.data(), x.data(), weight_bf16, nullptr, rows, in, out);
    } else if (layout == Layout::OutIn) {
      if (path == Path::Blas)
        dspark::cpu::matmul_forward_blas(y.data(), x.data(), weight, nullptr, rows, in, out);
      else
        dspark::cpu::matmul_forward_small_rows(y.data(), x.data(), weight, nullptr, rows, in, out);
    } else {
      if (path == Path::Blas)
        dspark::cpu::matmul_in_out_forward_blas(y.data(), x.data(), weight, rows, in, out);
      else
        dspark::cpu::matmul_in_out_forward_small_rows(y.data(), x.data(), weight, rows, in, out);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double bytes = double(weight_size) * (path == Path::SmallRowsBf16 ? 2 : 4),
               flops = 2.0 * double(weight_size) * rows;
  state.counters["weight_GBps"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["GFLOPs"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

struct Shape {
  int in, out;
};

// Every matmul of one target forward over `rows` tokens, in order, each layer
// with its own weights (8 layers + LM head: 77 MB of f32, more than the last-
// level cache): the matmul part of a decode step (rows 1) or of verifying a
// block (rows k), without attention and the elementwise ops.
void target_forward(benchmark::State& state, Path path) {
  const int rows = int(state.range(0));
  constexpr int kLayers = 8, kHidden = 384, kKv = 128, kInner = 1408, kVocab = 8192;
  const std::vector<Shape> layer = {{kHidden, kHidden}, {kHidden, kKv},    {kHidden, kKv},   {kHidden, kHidden},
                                    {kHidden, kInner},  {kHidden, kInner}, {kInner, kHidden}};
  Rng rng(8);
  std::vector<std::vector<float>> weights;
  std::vector<std::vector<uint16_t>> weights_bf16;
  std::vector<Shape> shapes;
  for (int l = 0; l < kLayers; ++l)
    for (const Shape& shape : layer) shapes.push_back(shape);
  shapes.push_back({kHidden, kVocab});
  double bytes = 0, flops = 0;
  for (const Shape& shape : shapes) {
    weights.push_back(random_floats(rng, size_t(shape.in) * shape.out));
    if (path == Path::SmallRowsBf16) {
      round_to_bf16(weights.back());
      weights_bf16.push_back(dspark::cpu::pack_bf16_rows(weights.back().data(), shape.out, shape.in));
    }
    bytes += double(shape.in) * shape.out * (path == Path::SmallRowsBf16 ? 2 : 4);
    flops += 2.0 * shape.in * shape.out * rows;
  }
  const std::vector<float> x = random_floats(rng, size_t(rows) * kInner);
  std::vector<float> y(size_t(rows) * kVocab);
  for (auto _ : state) {
    for (size_t m = 0; m < shapes.size(); ++m) {
      const Shape& shape = shapes[m];
      if (path == Path::Blas)
        dspark::cpu::matmul_forward_blas(y.data(), x.data(), weights[m].data(), nullptr, rows, shape.in, shape.out);
      else if (path == Path::SmallRowsBf16)
        dspark::cpu::matmul_forward_small_rows(y.data(), x.data(), weights_bf16[m].data(), nullptr, rows, shape.in,
                                               shape.out);
      else
        dspark::cpu::matmul_forward_small_rows(y.data(), x.data(), weights[m].data(), nullptr, rows, shape.in,
                                               shape.out);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["weight_GBps"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["GFLOPs"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

enum class Weights { Default, Hot, Cold };

void register_all(Weights weights) {
  for (int row_count : {1, 2, 3, 4, 5, 6, 8, 16, 24, 32, 48, 64, 96, 128})
    for (Path path : {Path::Blas, Path::SmallRows, Path::SmallRowsBf16})
      benchmark::RegisterBenchmark(("target_forward/" + path_name(path)).c_str(), target_forward, path)
          ->Arg(row_count)
          ->ArgName("rows")
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
  // Qwen3 target (hidden 384, intermediate 1408, 2 KV heads of 64, V 8192).
  const std::vector<Shape> target = {{384, 384}, {384, 128}, {384, 1408}, {1408, 384}, {384, 8192}};
  // Drafter (d 256, inner 512, 1536 = concatenated taps, 384 = target hidden).
  const std::vector<Shape> drafter = {{256, 256}, {256, 512}, {512, 256}, {1536, 256}, {256, 384}};
  const std::vector<int> rows = {1, 2, 4, 8, 16, 24, 32};
  for (const auto& [layout, shapes, prefix] : {std::tuple{Layout::OutIn, target, std::string("forward")},
                                               std::tuple{Layout::InOut, drafter, std::string("in_out")}})
    for (const Shape& shape : shapes)
      for (int row_count : rows)
        for (Path path : {Path::Blas, Path::SmallRows, Path::SmallRowsBf16}) {
          const std::string name = prefix + "/" + path_name(path);
          const bool cold = weights == Weights::Default ? layout == Layout::OutIn : weights == Weights::Cold;
          benchmark::RegisterBenchmark(name.c_str(), run, path, layout, cold)
              ->Args({shape.in, shape.out, row_count})
              ->ArgNames({"in", "out", "rows"})
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
}

}  // namespace

int main(int argc, char** argv) {
  Weights weights = Weights::Default;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--hot") {
      weights = Weights::Hot;
    } else if (argument == "--cold") {
      weights = Weights::Cold;
    } else if (argument == "--bf16-products") {
      dspark::cpu::set_bf16_products(true);
    } else if (argument.rfind("--isa=", 0) == 0) {
      bool known = false;
      std::string names;
      for (auto isa : dspark::cpu::kMatmulIsas) {
        names += std::string(names.empty() ? "" : ", ") + dspark::cpu::matmul_isa_name(isa);
        if (argument.substr(6) == dspark::cpu::matmul_isa_name(isa)) {
          dspark::cpu::set_matmul_isa(isa);
          known = true;
        }
      }
      if (!known) {
        std::fprintf(stderr, "unknown %s (one of: %s)\n", argument.c_str(), names.c_str());
        return 1;
      }
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("matmul_threads", std::to_string(dspark::cpu::matmul_threads()));
  benchmark::AddCustomContext("matmul_isa", dspark::cpu::matmul_isa_name(dspark::cpu::matmul_isa()));
  benchmark::AddCustomContext("bf16_products", dspark::cpu::bf16_products() ? "yes" : "no");
  register_all(weights);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
