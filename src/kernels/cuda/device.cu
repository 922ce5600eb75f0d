#include <cstdio>

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

std::string device_description(int index) {
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, index));
  char text[256];
  std::snprintf(text, sizeof text, "%s, %d SMs, %.1f GiB, cc %d.%d", properties.name,
                properties.multiProcessorCount,
                static_cast<double>(properties.totalGlobalMem) / (1 << 30), properties.major,
                properties.minor);
  return text;
}

}  // namespace dspark::cuda
