// KVCache: one sequence's keys and values for every layer, on the CPU.
// Speculative decoding appends a drafted block, verifies it, and rolls the
// cache back to the accepted length: truncate() is O(1) because positions past
// `length` are simply overwritten by the next append.
#pragma once
#include <vector>

#include "model/config.h"

namespace dspark {

class KVCache {
 public:
  // Room for `capacity` positions (at most the model's context).
  KVCache(const ModelConfig& config, int capacity);

  int length() const { return length_; }
  int capacity() const { return capacity_; }
  // Forget every position at or after `new_length` (new_length <= length()).
  void truncate(int new_length);

  // Layer `layer`'s keys / values: [capacity, nkv, hd].
  float* keys(int layer) { return keys_.data() + layer * layer_stride_; }
  float* values(int layer) { return values_.data() + layer * layer_stride_; }
  // Records that `count` more positions were written (by the forward pass).
  void advance(int count);

 private:
  int capacity_;
  int length_ = 0;
  long layer_stride_;           // capacity * nkv * hd
  std::vector<float> keys_;     // [L, capacity, nkv, hd]
  std::vector<float> values_;   // [L, capacity, nkv, hd]
};

}  // namespace dspark
