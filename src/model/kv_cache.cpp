#include "model/kv_cache.h"

#include "core/error.h"

namespace dspark {

KVCache::KVCache(const ModelConfig& config, int capacity)
    : capacity_(capacity),
      layer_stride_(static_cast<long>(capacity) * config.num_kv_heads * config.head_dim),
      keys_(layer_stride_ * config.num_layers),
      values_(layer_stride_ * config.num_layers) {
  DSPARK_CHECK(capacity > 0 && capacity <= config.max_positions, "KV cache capacity ", capacity,
               " is outside the model's context of ", config.max_positions, " positions");
}

void KVCache::truncate(int new_length) {
  DSPARK_CHECK(new_length >= 0 && new_length <= length_, "cannot truncate a KV cache of length ",
               length_, " to ", new_length);
  length_ = new_length;
}

void KVCache::advance(int count) {
  DSPARK_CHECK(length_ + count <= capacity_, "KV cache is full: ", length_, " + ", count,
               " positions exceed its capacity of ", capacity_);
  length_ += count;
}

}  // namespace dspark
