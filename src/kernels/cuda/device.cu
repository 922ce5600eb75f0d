#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"

namespace dspark::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

bool dependent_launches_enabled() {
  static const bool enabled = [] {
    const char* setting = std::getenv("DSPARK_PDL");
    if (setting && std::string(setting) == "0") return false;
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major >= 9;
  }();
  return enabled;
}

int multiprocessor_count() {
  int device = 0, count = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

int max_shared_bytes() {
  static const int bytes = [] {
    int device = 0, value = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return value;
  }();
  return bytes;
}

std::string device_description(int index) {
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, index));
  char memory[32];
  std::snprintf(memory, sizeof memory, "%.1f GiB", static_cast<double>(properties.totalGlobalMem) / (1 << 30));
  return std::string(properties.name) + ", " + std::to_string(properties.multiProcessorCount) + " SMs, " + memory +
         ", cc " + std::to_string(properties.major) + "." + std::to_string(properties.minor);
}

}  // namespace dspark::cuda

namespace dspark::cuda {

namespace {

__global__ void hold_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) __nanosleep(1000);
}

}  // namespace

void hold_stream(cudaStream_t stream, int microseconds) {
  static const int cycles_per_microsecond = [] {
    int device = 0, kilohertz = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&kilohertz, cudaDevAttrClockRate, device));
    return kilohertz / 1000;
  }();
  hold_kernel<<<1, 1, 0, stream>>>(static_cast<long long>(microseconds) * cycles_per_microsecond);
  CUDA_CHECK_LAUNCH();
}

cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& work) {
  cudaGraph_t captured = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    work();
  } catch (...) {
    cudaStreamEndCapture(stream, &captured);
    if (captured) cudaGraphDestroy(captured);
    cudaGetLastError();  // (the capture's error, if any, is not the caller's next one)
    throw;
  }
  CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
  cudaGraphExec_t executable;
  CUDA_CHECK(cudaGraphInstantiate(&executable, captured, 0));
  CUDA_CHECK(cudaGraphDestroy(captured));
  return executable;
}

namespace {

// Reads `count` 16-byte vectors once (streaming loads, as the GEMVs read
// weights), four in flight per thread; `sink` is written only if the data's
// XOR is a value memset data never has, so the loads are not dropped.
__global__ void read_kernel(const uint4* data, size_t count, unsigned* sink) {
  unsigned folded = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __ldcs(data + i + j * stride);
#pragma unroll
    for (int j = 0; j < 4; ++j) folded ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < count; i += stride) {
    const uint4 v = __ldcs(data + i);
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (folded == 0x12345678u) *sink = folded;
}

}  // namespace

double median_milliseconds(const std::function<void()>& work) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> milliseconds;
  for (int run = 0; run < 12; ++run) {
    CUDA_CHECK(cudaEventRecord(start));
    work();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    if (run >= 2) milliseconds.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(milliseconds.begin(), milliseconds.end());
  return milliseconds[milliseconds.size() / 2];
}

double measure_copy_bandwidth(size_t bytes) {
  void *source = nullptr, *destination = nullptr;
  CUDA_CHECK(cudaMalloc(&source, bytes));
  CUDA_CHECK(cudaMalloc(&destination, bytes));
  CUDA_CHECK(cudaMemset(source, 1, bytes));
  const double milliseconds =
      median_milliseconds([&] { CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice)); });
  cudaFree(source);
  cudaFree(destination);
  return 2.0 * static_cast<double>(bytes) / (milliseconds * 1e-3) / 1e9;
}

double measure_read_bandwidth(size_t bytes) {
  const size_t vectors = bytes / sizeof(uint4);
  void* data = nullptr;
  unsigned* sink = nullptr;
  CUDA_CHECK(cudaMalloc(&data, vectors * sizeof(uint4)));
  CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  CUDA_CHECK(cudaMemset(data, 1, vectors * sizeof(uint4)));
  const int blocks = multiprocessor_count() * 8;
  const double milliseconds = median_milliseconds([&] {
    read_kernel<<<blocks, 256>>>(static_cast<const uint4*>(data), vectors, sink);
    CUDA_CHECK_LAUNCH();
  });
  cudaFree(data);
  cudaFree(sink);
  return static_cast<double>(vectors * sizeof(uint4)) / (milliseconds * 1e-3) / 1e9;
}

}  // namespace dspark::cuda
