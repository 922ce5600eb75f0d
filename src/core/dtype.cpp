#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace dspark {

Dtype dtype_from_name(std::string_view name, const std::string& where) {
  if (name == "F32") return Dtype::F32;
  if (name == "BF16") return Dtype::BF16;
  if (name == "F16") return Dtype::F16;
  if (name == "I32") return Dtype::I32;
  fail(where, ": unsupported dtype \"", name, "\" (supported: F32, BF16, F16, I32)");
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::F32: return "F32";
    case Dtype::BF16: return "BF16";
    case Dtype::F16: return "F16";
    case Dtype::I32: return "I32";
  }
  return "?";
}

size_t dtype_size(Dtype dtype) { return dtype == Dtype::F32 || dtype == Dtype::I32 ? 4 : 2; }

float f16_to_f32(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t out;
  if (exponent == 0x1f) {
    out = sign | 0x7f800000u | (mantissa << 13);  // inf / NaN
  } else if (exponent != 0) {
    out = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    out = sign;
  } else {  // subnormal: value = mantissa * 2^-24
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&out, &magnitude, 4);
    out |= sign;
  }
  float value;
  std::memcpy(&value, &out, 4);
  return value;
}

uint16_t f32_to_f16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;           // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;          // rounds to inf
  if (magnitude < 0x38800000u) {                                // subnormal or zero
    float scaled = std::fabs(value) * 16777216.0f;               // units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled)); // ties to even
  }
  uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

void convert_to_bf16(const float* __restrict source, uint16_t* __restrict destination, size_t count) {
  // In blocks of a fixed 16 values: GCC's cheap cost model at -O2 vectorises
  // only loops with no remainder to peel.
  constexpr size_t kBlock = 16;
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j) destination[i + j] = f32_to_bf16(source[i + j]);
  for (; i < count; ++i) destination[i] = f32_to_bf16(source[i]);
}

std::vector<uint16_t> exact_bf16(const float* values, size_t count) {
  std::vector<uint16_t> bits(count);
  for (size_t i = 0; i < count; ++i) {
    uint32_t word;
    std::memcpy(&word, values + i, sizeof word);
    if (word & 0xffffu) return {};  // not a bf16 value
    bits[i] = static_cast<uint16_t>(word >> 16);
  }
  return bits;
}

void convert_to_f32(Dtype dtype, const void* source, float* destination, size_t count) {
  switch (dtype) {
    case Dtype::F32:
      std::memcpy(destination, source, count * 4);
      return;
    case Dtype::BF16: {
      const uint16_t* half = static_cast<const uint16_t*>(source);
      for (size_t i = 0; i < count; ++i) destination[i] = bf16_to_f32(half[i]);
      return;
    }
    case Dtype::F16: {
      const uint16_t* half = static_cast<const uint16_t*>(source);
      for (size_t i = 0; i < count; ++i) destination[i] = f16_to_f32(half[i]);
      return;
    }
    case Dtype::I32: {
      const int32_t* integers = static_cast<const int32_t*>(source);
      for (size_t i = 0; i < count; ++i) destination[i] = static_cast<float>(integers[i]);
      return;
    }
  }
}

}  // namespace dspark
