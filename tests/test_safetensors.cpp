// safetensors reading and writing: round trips, the dtype conversions checked
// against files torch itself cast, sharded checkpoints written by transformers,
// and one clear error for every kind of broken file.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "golden.h"

namespace dspark {
namespace {

using testing::golden_model;
using testing::TemporaryDirectory;

// Runs `action`, expects a dspark::Error whose message contains every fragment.
template <class Action>
void expect_error(Action action, std::initializer_list<std::string> fragments) {
  try {
    action();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const auto& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "\"" << fragment << "\" not in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "error spans lines: " << message;
  }
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file with the given header text and `data_bytes` zero bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  uint64_t size = header.size();
  std::string bytes(reinterpret_cast<const char*>(&size), 8);
  return bytes + header + std::string(data_bytes, '\0');
}

TEST(Safetensors, RoundTripEveryDtypeAndMetadata) {
  TemporaryDirectory directory;
  const auto path = directory.path / "t.safetensors";
  std::vector<float> f32 = {1.5f, -2.25f, 3.0e-3f, 1e20f, -0.0f, 7.0f};
  std::vector<uint16_t> bf16, f16;
  for (float value : f32) {
    bf16.push_back(f32_to_bf16(value));
    f16.push_back(f32_to_f16(value < 6e4f ? value : 6e4f));
  }
  write_safetensors(path, {{"a", Dtype::F32, {2, 3}, f32.data()},
                           {"b", Dtype::BF16, {6}, bf16.data()},
                           {"c", Dtype::F16, {3, 2}, f16.data()}},
                    {{"format", "pt"}});
  const SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const Tensor a = file.load_f32("a");
  EXPECT_EQ(a.shape, (Shape{2, 3}));
  EXPECT_EQ(std::memcmp(a.data, f32.data(), 24), 0);
  const Tensor b = file.load_f32("b"), c = file.load_f32("c");
  for (size_t i = 0; i < f32.size(); ++i) {
    EXPECT_EQ(b.data[i], bf16_to_f32(bf16[i]));
    EXPECT_EQ(c.data[i], f16_to_f32(f16[i]));
  }
  // The header is padded so the data starts 8-byte aligned, as HF's writer does.
  uint64_t header_size = 0;
  std::memcpy(&header_size, read_text_file(path).data(), 8);
  EXPECT_EQ(header_size % 8, 0u);
  // Atomic write: no temporary file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory.path), {}), 1);
}

TEST(Safetensors, ConversionsMatchTorchCasts) {
  // weights_bf16 / weights_f16 are the golden checkpoint cast by torch.
  const SafetensorsFile f32(golden_model("qwen3") / "model.safetensors");
  const SafetensorsFile bf16(golden_model("qwen3") / "reference" / "weights_bf16.safetensors");
  const SafetensorsFile f16(golden_model("qwen3") / "reference" / "weights_f16.safetensors");
  size_t checked = 0;
  for (const auto& [name, entry] : f32.entries()) {
    const Tensor exact = f32.load_f32(name), from_bf16 = bf16.load_f32(name), from_f16 = f16.load_f32(name);
    ASSERT_EQ(exact.shape, from_bf16.shape) << name;
    const uint16_t* bf16_bits = static_cast<const uint16_t*>(bf16.raw(name));
    const uint16_t* f16_bits = static_cast<const uint16_t*>(f16.raw(name));
    for (long i = 0; i < exact.numel(); ++i, ++checked) {
      ASSERT_EQ(f32_to_bf16(exact.data[i]), bf16_bits[i]) << name << "[" << i << "]";
      ASSERT_EQ(f32_to_f16(exact.data[i]), f16_bits[i]) << name << "[" << i << "]";
      ASSERT_EQ(from_bf16.data[i], bf16_to_f32(bf16_bits[i]));
      ASSERT_EQ(from_f16.data[i], f16_to_f32(f16_bits[i]));
    }
  }
  EXPECT_GT(checked, 100000u);
}

TEST(Safetensors, ShardedCheckpointWrittenByTransformers) {
  const SafetensorsCheckpoint checkpoint(golden_model("llama"));
  const Json index = read_json_file(golden_model("llama") / "model.safetensors.index.json");
  EXPECT_EQ(checkpoint.names().size(), index["weight_map"].size());
  EXPECT_TRUE(checkpoint.contains("lm_head.weight"));
  EXPECT_EQ(checkpoint.load("model.norm.weight", {96}).numel(), 96);
}

TEST(Safetensors, TruncatedFileIsRefused) {
  TemporaryDirectory directory;
  const std::string whole = read_text_file(golden_model("qwen3") / "model.safetensors");
  const auto path = directory.path / "model.safetensors";
  write_bytes(path, whole.substr(0, whole.size() - 1000));
  expect_error([&] { SafetensorsFile file(path); }, {path.string(), "truncated"});
  write_bytes(path, whole.substr(0, 100));
  expect_error([&] { SafetensorsFile file(path); }, {path.string(), "truncated"});
  write_bytes(path, whole.substr(0, 3));
  expect_error([&] { SafetensorsFile file(path); }, {path.string(), "truncated"});
}

TEST(Safetensors, BadHeadersAreRefused) {
  TemporaryDirectory directory;
  const auto path = directory.path / "bad.safetensors";
  write_bytes(path, raw_file("{not json", 0));
  expect_error([&] { SafetensorsFile file(path); }, {path.string(), "bad safetensors header"});
  write_bytes(path, raw_file(R"({"w": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}})", 16));
  expect_error([&] { SafetensorsFile file(path); }, {"\"w\"", "unsupported dtype \"I64\""});
  write_bytes(path, raw_file(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8));
  expect_error([&] { SafetensorsFile file(path); }, {"\"w\"", "do not hold shape [3]"});
  write_bytes(path, raw_file(R"({"w": {"dtype": "F32", "shape": [2]}})", 8));
  expect_error([&] { SafetensorsFile file(path); }, {"\"w\"", "data_offsets"});
  expect_error([&] { SafetensorsFile file(directory.path / "absent.safetensors"); }, {"missing file"});
}

TEST(Safetensors, MissingAndMisShapedTensorsNameFileAndTensor) {
  const SafetensorsCheckpoint checkpoint(golden_model("qwen3"));
  expect_error([&] { checkpoint.load("model.layers.99.mlp.up_proj.weight", {1}); },
               {"missing tensor", "model.layers.99.mlp.up_proj.weight"});
  expect_error([&] { checkpoint.load("model.norm.weight", {65}); },
               {"model.safetensors", "model.norm.weight", "[64]", "expected [65]"});
  TemporaryDirectory empty;
  expect_error([&] { SafetensorsCheckpoint none(empty.path); }, {"no model.safetensors"});
}

TEST(Dtype, HalfPrecisionEdgeCases) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bffu);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00u);                  // overflow to inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001u); // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0001u), std::ldexp(1.0f, -24));
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80u);  // tie rounds to even
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
}

TEST(AtomicWrite, FailureLeavesTheOldFileAlone) {
  TemporaryDirectory directory;
  const auto path = directory.path / "result.json";
  write_text_file_atomic(path, "old");
  EXPECT_THROW(write_file_atomic(path, [](const ByteSink& sink) {
                 sink("partial", 7);
                 throw Error("interrupted");
               }),
               Error);
  EXPECT_EQ(read_text_file(path), "old");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory.path), {}), 1);
}

}  // namespace
}  // namespace dspark
