// Owning device and pinned-host allocations (RAII over cudaMalloc /
// cudaMallocHost), resized by reallocation.
#pragma once
#include <cstddef>
#include <utility>

#include "kernels/cuda/cuda_check.h"

namespace dspark::cuda {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { resize(count); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Reallocates (contents lost) when `count` differs from the current size.
  void resize(size_t count) {
    if (count == count_) return;
    release();
    if (count) CUDA_CHECK(cudaMalloc(&data_, count * sizeof(T)));
    count_ = count;
  }
  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void release() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t count) { resize(count); }
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void resize(size_t count) {
    if (count == count_) return;
    release();
    if (count) CUDA_CHECK(cudaMallocHost(&data_, count * sizeof(T)));
    count_ = count;
  }
  T* data() const { return data_; }
  size_t size() const { return count_; }
  T& operator[](size_t i) const { return data_[i]; }

 private:
  void release() {
    if (data_) cudaFreeHost(data_);
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace dspark::cuda
