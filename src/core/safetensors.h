// safetensors: the Hugging Face tensor file format.
//   [u64 little-endian N][N bytes of JSON header][data]
//   header: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
//            "__metadata__": {"k": "v"}}  (offsets relative to the data start)
// Reading maps the file and validates every header entry up front, so a
// truncated or corrupt file fails at open with the file (and tensor) named.
// Sharded checkpoints (model.safetensors.index.json) read the same way.
#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/file.h"
#include "core/tensor.h"

namespace dspark {

struct SafetensorsEntry {
  Dtype dtype;
  Shape shape;
  size_t offset = 0;  // from the start of the file
  size_t bytes = 0;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_->path(); }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry& entry(const std::string& name) const;
  const void* raw(const std::string& name) const;

  // The tensor converted to f32: a zero-copy view when stored as aligned F32.
  Tensor load_f32(const std::string& name) const;

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards
// named by model.safetensors.index.json.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::filesystem::path& directory);

  bool contains(const std::string& name) const { return shard_of_.count(name) != 0; }
  std::vector<std::string> names() const;
  const SafetensorsFile& file_of(const std::string& name) const;

  // Loads `name` as f32 and checks its shape; errors name the file and tensor.
  Tensor load(const std::string& name, const Shape& expected_shape) const;

 private:
  std::filesystem::path directory_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, size_t> shard_of_;
};

// A tensor to write: `data` holds numel(shape) elements of `dtype`.
struct SafetensorsWriteEntry {
  std::string name;
  Dtype dtype;
  Shape shape;
  const void* data;
};

// Writes a safetensors file atomically (temp + rename). Tensors are laid out in
// the given order; the header is padded to 8 bytes as the reference writer does.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorsWriteEntry>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dspark
