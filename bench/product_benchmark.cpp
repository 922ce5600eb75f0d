// A target's products on the GPU, each way the engine can run them, at the
// row counts of a decode step (1 row a sequence) and of verify steps (8-64):
// cuBLASLt alone (cublaslt_matmul_forward), the tensor-core GEMV, and the
// tensor-core GEMV in row groups of 16 (past 16 rows). Plain products, bf16
// out, no bias: what is compared is how fast each streams the weights (the
// engine's fused epilogues are timed against the unfused ones in
// matmul.cu's own choice, DSPARK_MATMUL_LOG=1).
//
// Shapes: x16 (the demo pair widened 16x by bench/widen_checkpoint.py:
// hidden 6144, intermediate 22528, 96 heads on 32 KV heads of 64, vocabulary
// 8192) and qwen3-8b (4096, 12288, 32 on 8 of 128, 151936). Every product's
// weights are at least 75 MB, more than the L2, so each launch reads them
// from memory, as a forward does.
//
// Timing: CUDA events around kLaunches launches queued behind a spinning
// kernel (hold_stream, so the host's launch rate is not what is timed), the
// time per launch reported as manual time; Google Benchmark repeats that
// until its minimum time. Counters: weight_GBps (the weights' bytes per
// second) and of_read (that over the bandwidth of a kernel that only streams
// 1 GB, measured once: the roofline of a product that reads its weights once).
//
// Build (where CUDA builds): cmake --build build --target
// dspark_product_benchmark (needs libbenchmark-dev). Run on the GPU machine,
// e.g. build/dspark_product_benchmark --benchmark_filter='x16/gate_up/rows:(8|32)/'
#include <benchmark/benchmark.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/random.h"
#include "kernels/cuda/buffer.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/matmul.h"

namespace {

using namespace dspark;
using bf16 = __nv_bfloat16;

constexpr int kLaunches = 20;
constexpr int kRowCounts[] = {1, 8, 16, 32, 64};

struct Product {
  const char* model;
  const char* name;
  int in, out;  // weight [out, in]
};

constexpr Product kProducts[] = {
    {"x16", "qkv", 6144, 10240},         {"x16", "o", 6144, 6144},
    {"x16", "gate_up", 6144, 2 * 22528}, {"x16", "down", 22528, 6144},
    {"x16", "lm_head", 6144, 8192},      {"qwen3-8b", "qkv", 4096, 6144},
    {"qwen3-8b", "o", 4096, 4096},       {"qwen3-8b", "gate_up", 4096, 2 * 12288},
    {"qwen3-8b", "down", 12288, 4096},   {"qwen3-8b", "lm_head", 4096, 151936},
};

enum class Way { CublasLt, TensorCores, TensorCoresInRowGroups, TensorCoresStreamed };
constexpr const char* kWayNames[] = {"cublaslt", "tensor_cores", "tensor_cores_row_groups", "tensor_cores_streamed"};
constexpr cuda::GemvKernel kWayKernels[] = {cuda::GemvKernel::None, cuda::GemvKernel::TensorCores,
                                            cuda::GemvKernel::TensorCoresInRowGroups,
                                            cuda::GemvKernel::TensorCoresStreamed};

// Values in [-1, 1) (their size does not change the time; NaNs could).
cuda::DeviceBuffer<bf16> random_device_bf16(size_t count, uint64_t seed) {
  Rng rng(seed);
  std::vector<bf16> pattern(1 << 16);
  for (bf16& value : pattern) value = __float2bfloat16(static_cast<float>(rng.uniform() * 2.0 - 1.0));
  cuda::DeviceBuffer<bf16> buffer(count);
  size_t done = std::min(pattern.size(), count);
  CUDA_CHECK(cudaMemcpy(buffer.data(), pattern.data(), done * sizeof(bf16), cudaMemcpyHostToDevice));
  for (; done < count; done += std::min(done, count - done))  // the filled part copied after itself
    CUDA_CHECK(cudaMemcpy(buffer.data() + done, buffer.data(), std::min(done, count - done) * sizeof(bf16),
                          cudaMemcpyDeviceToDevice));
  return buffer;
}

double read_bandwidth() {
  static const double measured = cuda::measure_read_bandwidth(size_t(1) << 30);
  return measured;
}

void run_product(benchmark::State& state, Product product, int rows, Way way) {
  const bf16* no_bias = nullptr;
  auto weight = random_device_bf16(size_t(product.in) * product.out, 1);
  auto x = random_device_bf16(size_t(rows) * product.in, 2);
  cuda::DeviceBuffer<bf16> out(size_t(rows) * product.out);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&] {
    if (way == Way::CublasLt)
      cuda::cublaslt_matmul_forward(out.data(), cuda::MatmulOutput::BF16, x.data(), weight.data(), no_bias, rows,
                                    product.in, product.out, stream);
    else
      cuda::gemv_matmul_forward(out.data(), cuda::MatmulOutput::BF16, cuda::GemvEpilogue::Store, kWayKernels[int(way)],
                                x.data(), weight.data(), no_bias, rows, product.in, product.out, cuda::ResidualNorm{},
                                stream);
  };
  try {
    launch();  // warm-up; the GEMV checks here whether it can run the shape
    CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (const std::exception& error) {
    state.SkipWithError(error.what());
    CUDA_CHECK(cudaStreamDestroy(stream));
    return;
  }
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  double seconds = 0.0;
  for (auto _ : state) {
    cuda::hold_stream(stream, 1000);
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < kLaunches; ++i) launch();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float milliseconds = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
    state.SetIterationTime(milliseconds * 1e-3 / kLaunches);
    seconds += milliseconds * 1e-3 / kLaunches;
  }
  const double weight_gigabytes = 2e-9 * product.in * product.out;
  state.counters["weight_GBps"] = weight_gigabytes * state.iterations() / seconds;
  state.counters["of_read"] = state.counters["weight_GBps"] / read_bandwidth();
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

void register_products() {
  for (const Product& product : kProducts)
    for (int rows : kRowCounts)
      for (Way way : {Way::CublasLt, Way::TensorCores, Way::TensorCoresInRowGroups, Way::TensorCoresStreamed}) {
        if (way == Way::TensorCoresInRowGroups && rows <= 16) continue;  // one group: the plain kernel
        if (way == Way::TensorCoresStreamed && rows <= 16) continue;
        const std::string name = std::string(product.model) + "/" + product.name + "/rows:" + std::to_string(rows) +
                                 "/" + kWayNames[int(way)];
        benchmark::RegisterBenchmark(name.c_str(), run_product, product, rows, way)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
}

// The TMA's copies alone (the streamed GEMV's): 256 rows of 6144 columns an
// SM (the x16 gate|up's K), in boxes of 8 to 256 rows of 128 bytes and of 8
// and 64 rows of 512 bytes: whether their rate follows the copies' count or
// their 128-byte lines.
void register_tma_reads() {
  for (const auto& [box_rows, box_columns] : {std::pair{8, 64}, {64, 64}, {256, 64}, {8, 256}, {64, 256}}) {
    const std::string name = "tma_read/box:" + std::to_string(box_rows) + "x" + std::to_string(box_columns);
    benchmark::RegisterBenchmark(name.c_str(), [box_rows, box_columns](benchmark::State& state) {
      double gigabytes_per_second = 0.0;
      for (auto _ : state)
        gigabytes_per_second =
            cuda::measure_tma_read_bandwidth(256 * cuda::multiprocessor_count(), 6144, box_rows, box_columns);
      state.counters["GBps"] = gigabytes_per_second;
      state.counters["of_read"] = gigabytes_per_second / read_bandwidth();
    })->Iterations(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "dspark_product_benchmark: no CUDA device\n");
    return 1;
  }
  register_products();
  register_tma_reads();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
