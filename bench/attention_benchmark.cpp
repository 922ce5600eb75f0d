// The CPU causal attention over a KV cache (cpu::attention_forward) against
// the scalar kernel it replaced (copied below: one query row and head at a
// time, a scalar dot product per cached position), for one layer of the demo
// target (6 query heads on 2 KV heads of 64), k new rows (1: a decode step;
// k: verifying a block of k tokens) after `context` cached positions.
// --threads=1 runs the new kernel on the calling thread alone (the old one
// always did).
//
// Build: cmake --build build --target dspark_attention_benchmark (needs Google
// Benchmark, libbenchmark-dev; not part of ctest). Run e.g.
//   build/dspark_attention_benchmark --benchmark_filter='/context:2048/'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/random.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"

namespace {

using dspark::Rng;

constexpr int kHeads = 6, kKvHeads = 2, kHeadDim = 64;

// The previous kernel (src/kernels/cpu/attention.cpp before 2026-11-30).
void attend_one(float* out, const float* query, const float* keys, const float* values, int visible, long stride,
                int head_dim, float scale, float* scores) {
  float maximum = -INFINITY;
  for (int t = 0; t < visible; ++t) {
    const float* key = keys + t * stride;
    float dot = 0.0f;
    for (int i = 0; i < head_dim; ++i) dot += query[i] * key[i];
    scores[t] = dot * scale;
    maximum = std::max(maximum, scores[t]);
  }
  float total = 0.0f;
  for (int t = 0; t < visible; ++t) {
    scores[t] = std::exp(scores[t] - maximum);
    total += scores[t];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (int t = 0; t < visible; ++t) {
    const float weight = scores[t] / total;
    const float* value = values + t * stride;
    for (int i = 0; i < head_dim; ++i) out[i] += weight * value[i];
  }
}

void scalar_attention(float* out, const float* q, const float* keys, const float* values, int rows, int first_position,
                      int heads, int kv_heads, int head_dim, float* scores) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int group = heads / kv_heads;
  const long kv_stride = static_cast<long>(kv_heads) * head_dim;
  for (int row = 0; row < rows; ++row)
    for (int head = 0; head < heads; ++head)
      attend_one(out + (static_cast<long>(row) * heads + head) * head_dim,
                 q + (static_cast<long>(row) * heads + head) * head_dim,
                 keys + static_cast<long>(head / group) * head_dim, values + static_cast<long>(head / group) * head_dim,
                 first_position + row + 1, kv_stride, head_dim, scale, scores);
}

std::vector<float> random_floats(Rng& rng, size_t count) {
  std::vector<float> values(count);
  for (float& value : values) value = float(rng.uniform() * 2.0 - 1.0);
  return values;
}

void run(benchmark::State& state, bool vectorised) {
  const int context = int(state.range(0)), rows = int(state.range(1));
  Rng rng(5);
  const size_t kv = size_t(context + rows) * kKvHeads * kHeadDim;
  const std::vector<float> q = random_floats(rng, size_t(rows) * kHeads * kHeadDim);
  const std::vector<float> keys = random_floats(rng, kv), values = random_floats(rng, kv);
  std::vector<float> out(size_t(rows) * kHeads * kHeadDim), scores(context + rows);
  for (auto _ : state) {
    (vectorised ? dspark::cpu::attention_forward : scalar_attention)(
        out.data(), q.data(), keys.data(), values.data(), rows, context, kHeads, kKvHeads, kHeadDim, scores.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double flops = 4.0 * kHeads * kHeadDim * (double(rows) * context + rows * (rows + 1) / 2.0);
  state.counters["GFLOPs"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void register_all() {
  for (bool vectorised : {false, true})
    for (int context : {128, 512, 2048})
      for (int rows : {1, 2, 4, 8, 16})
        benchmark::RegisterBenchmark((std::string(vectorised ? "vectorised" : "scalar")).c_str(),
                                     [vectorised](benchmark::State& state) { run(state, vectorised); })
            ->Args({context, rows})
            ->ArgNames({"context", "rows"})
            ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  std::vector<char*> arguments;
  for (int i = 0; i < argc; ++i)
    if (std::strncmp(argv[i], "--threads=", 10) == 0)
      threads = std::atoi(argv[i] + 10);
    else
      arguments.push_back(argv[i]);
  if (threads > 0) dspark::cpu::set_parallel_threads(threads);
  int count = int(arguments.size());
  benchmark::Initialize(&count, arguments.data());
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
