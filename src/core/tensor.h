// Tensor: a contiguous, row-major f32 array with a shape. The data is either
// owned or a zero-copy view into a memory-mapped checkpoint; `owner` keeps
// whichever it is alive. This is all the CPU path needs: ops are free
// functions over raw pointers (kernels/cpu), the model holds Tensors.
#pragma once
#include <cstdint>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace dspark {

using Shape = std::vector<int64_t>;

inline int64_t shape_numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

inline std::string shape_string(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// Scratch that only grows: `buffer` resized to at least `count` elements, so a
// workspace reused across calls allocates only when a call is larger than any before.
template <class T>
T* grow(std::vector<T>& buffer, size_t count) {
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

struct Tensor {
  Shape shape;
  float* data = nullptr;
  std::shared_ptr<void> owner;

  static Tensor zeros(Shape shape) {
    Tensor tensor;
    int64_t count = shape_numel(shape);
    std::shared_ptr<float[]> storage(new float[count]());
    tensor.shape = std::move(shape);
    tensor.data = storage.get();
    tensor.owner = std::move(storage);
    return tensor;
  }

  int64_t numel() const { return shape_numel(shape); }
  int64_t dim(int axis) const { return shape.at(axis < 0 ? shape.size() + axis : axis); }
  bool empty() const { return data == nullptr; }
};

}  // namespace dspark
