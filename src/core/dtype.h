// Storage dtypes and their conversion to the f32 compute dtype of the CPU path.
// bf16 and f16 conversions round to nearest even, as PyTorch does.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace dspark {

enum class Dtype { F32, BF16, F16, I32 };  // I32: token ids (regenerated training data)

// "F32" | "BF16" | "F16" | "I32" (safetensors spelling); anything else is an Error
// naming `where`.
Dtype dtype_from_name(std::string_view name, const std::string& where);
const char* dtype_name(Dtype dtype);
size_t dtype_size(Dtype dtype);

inline float bf16_to_f32(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

// Branch-free (NaN stays NaN by a select, not an early return), so that loops
// over it vectorise.
inline uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// destination[i] = f32_to_bf16(source[i]) for `count` values, vectorised.
void convert_to_bf16(const float* source, uint16_t* destination, size_t count);

// The bf16 bit patterns of `count` values if every one is exactly a bf16
// value (as a bf16 checkpoint's are once widened to f32), else empty.
std::vector<uint16_t> exact_bf16(const float* values, size_t count);

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

// Converts `count` elements stored as `dtype` at `source` to f32 (I32 by value).
void convert_to_f32(Dtype dtype, const void* source, float* destination, size_t count);

}  // namespace dspark
