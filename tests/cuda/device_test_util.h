// Helpers of the CUDA tests: random inputs, bf16 rounding, and copies to and
// from the device.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/random.h"
#include "kernels/cuda/buffer.h"

namespace dspark::testing {

constexpr double kBf16Tolerance = 1e-2;  // bf16 outputs of f32 math on bf16 inputs

inline std::vector<float> random_values(size_t count, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> values(count);
  for (float& value : values) value = scale * static_cast<float>(2.0 * rng.uniform() - 1.0);
  return values;
}

// Rounds to bf16 and back: the inputs both sides see.
inline std::vector<float> bf16_rounded(std::vector<float> values) {
  for (float& value : values) value = bf16_to_f32(f32_to_bf16(value));
  return values;
}

inline cuda::DeviceBuffer<__nv_bfloat16> to_device_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bf16(values[i]);
  cuda::DeviceBuffer<__nv_bfloat16> buffer(values.size());
  CUDA_CHECK(cudaMemcpy(buffer.data(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  return buffer;
}

template <class T>
cuda::DeviceBuffer<T> to_device(const std::vector<T>& values) {
  cuda::DeviceBuffer<T> buffer(values.size());
  CUDA_CHECK(cudaMemcpy(buffer.data(), values.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

inline std::vector<float> from_device(const cuda::DeviceBuffer<__nv_bfloat16>& buffer) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> bits(buffer.size());
  CUDA_CHECK(cudaMemcpy(bits.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_f32(bits[i]);
  return values;
}

template <class T>
std::vector<T> from_device(const cuda::DeviceBuffer<T>& buffer) {
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> values(buffer.size());
  CUDA_CHECK(cudaMemcpy(values.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return values;
}

}  // namespace dspark::testing
