#include "core/safetensors.h"

#include <cstring>

#include "core/error.h"
#include "core/json.h"

namespace dspark {

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) {
  const std::string where = path.string();
  DSPARK_CHECK(std::filesystem::exists(path), "missing file ", where);
  file_ = MappedFile::open(path);
  const size_t file_size = file_->size();
  DSPARK_CHECK(file_size >= 8, where, ": truncated safetensors file (", file_size,
               " bytes, no header length)");
  uint64_t header_size = 0;
  std::memcpy(&header_size, file_->data(), 8);  // little-endian hosts only (x86-64, arm64)
  DSPARK_CHECK(header_size <= file_size - 8, where, ": truncated safetensors file (header of ",
               header_size, " bytes in a file of ", file_size, ")");
  const char* header_begin = reinterpret_cast<const char*>(file_->data()) + 8;
  Json header;
  try {
    header = Json::parse(header_begin, header_begin + header_size);
  } catch (const nlohmann::json::parse_error& e) {
    fail(where, ": bad safetensors header: ", e.what());
  }
  DSPARK_CHECK(header.is_object(), where, ": bad safetensors header: not a JSON object");
  const size_t data_start = 8 + header_size;
  const size_t data_size = file_size - data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (value.is_object())
        for (const auto& [key, text] : value.items())
          if (text.is_string()) metadata_[key] = text.get<std::string>();
      continue;
    }
    const std::string tensor_where = where + ": tensor \"" + name + "\"";
    DSPARK_CHECK(value.is_object(), tensor_where, ": bad header entry");
    SafetensorsEntry entry;
    entry.dtype = dtype_from_name(json_get<std::string>(value, "dtype", tensor_where), tensor_where);
    auto offsets = json_get<std::vector<size_t>>(value, "data_offsets", tensor_where);
    entry.shape = json_get<Shape>(value, "shape", tensor_where);
    DSPARK_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1], tensor_where,
                 ": bad data_offsets");
    for (int64_t extent : entry.shape) DSPARK_CHECK(extent >= 0, tensor_where, ": negative dimension");
    DSPARK_CHECK(offsets[1] <= data_size, tensor_where, ": data runs past the end of the file (",
                 offsets[1], " > ", data_size, " data bytes); the file is truncated");
    entry.bytes = offsets[1] - offsets[0];
    DSPARK_CHECK(entry.bytes == static_cast<size_t>(shape_numel(entry.shape)) * dtype_size(entry.dtype),
                 tensor_where, ": ", entry.bytes, " bytes do not hold shape ",
                 shape_string(entry.shape), " of ", dtype_name(entry.dtype));
    entry.offset = data_start + offsets[0];
    entries_.emplace(name, entry);
  }
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto found = entries_.find(name);
  DSPARK_CHECK(found != entries_.end(), path().string(), ": missing tensor \"", name, "\"");
  return found->second;
}

const void* SafetensorsFile::raw(const std::string& name) const {
  return file_->data() + entry(name).offset;
}

Tensor SafetensorsFile::load_f32(const std::string& name) const {
  const SafetensorsEntry& stored = entry(name);
  const void* source = raw(name);
  Tensor tensor;
  if (stored.dtype == Dtype::F32 && reinterpret_cast<uintptr_t>(source) % alignof(float) == 0) {
    tensor.shape = stored.shape;
    tensor.data = const_cast<float*>(static_cast<const float*>(source));  // read-only by contract
    tensor.owner = file_;
    return tensor;
  }
  tensor = Tensor::zeros(stored.shape);
  convert_to_f32(stored.dtype, source, tensor.data, static_cast<size_t>(tensor.numel()));
  return tensor;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::filesystem::path& directory)
    : directory_(directory) {
  const auto index_path = directory / "model.safetensors.index.json";
  const auto single_path = directory / "model.safetensors";
  if (std::filesystem::exists(index_path)) {
    Json index = read_json_file(index_path);
    DSPARK_CHECK(index.contains("weight_map") && index["weight_map"].is_object(),
                 index_path.string(), ": missing \"weight_map\"");
    std::map<std::string, size_t> shard_index;
    for (const auto& [name, shard] : index["weight_map"].items()) {
      DSPARK_CHECK(shard.is_string(), index_path.string(), ": bad shard for \"", name, "\"");
      const std::string shard_name = shard.get<std::string>();
      auto [it, inserted] = shard_index.emplace(shard_name, shards_.size());
      if (inserted) shards_.push_back(std::make_unique<SafetensorsFile>(directory / shard_name));
      DSPARK_CHECK(shards_[it->second]->contains(name), (directory / shard_name).string(),
                   ": missing tensor \"", name, "\" (listed in ", index_path.filename().string(), ")");
      shard_of_[name] = it->second;
    }
  } else {
    DSPARK_CHECK(std::filesystem::exists(single_path), "no model.safetensors or ",
                 "model.safetensors.index.json in ", directory.string());
    shards_.push_back(std::make_unique<SafetensorsFile>(single_path));
    for (const auto& [name, entry] : shards_[0]->entries()) shard_of_[name] = 0;
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> result;
  for (const auto& [name, shard] : shard_of_) result.push_back(name);
  return result;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto found = shard_of_.find(name);
  DSPARK_CHECK(found != shard_of_.end(), directory_.string(), ": missing tensor \"", name, "\"");
  return *shards_[found->second];
}

Tensor SafetensorsCheckpoint::load(const std::string& name, const Shape& expected_shape) const {
  const SafetensorsFile& file = file_of(name);
  const Shape& stored = file.entry(name).shape;
  DSPARK_CHECK(stored == expected_shape, file.path().string(), ": tensor \"", name, "\" has shape ",
               shape_string(stored), ", expected ", shape_string(expected_shape));
  return file.load_f32(name);
}

void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafetensorsWriteEntry>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& tensor : tensors) {
    DSPARK_CHECK(!header.contains(tensor.name), path.string(), ": duplicate tensor \"", tensor.name, "\"");
    size_t bytes = static_cast<size_t>(shape_numel(tensor.shape)) * dtype_size(tensor.dtype);
    header[tensor.name] = {{"dtype", dtype_name(tensor.dtype)},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_size = header_text.size();
  write_file_atomic(path, [&](const ByteSink& sink) {
    sink(&header_size, 8);
    sink(header_text.data(), header_text.size());
    for (const auto& tensor : tensors)
      sink(tensor.data, static_cast<size_t>(shape_numel(tensor.shape)) * dtype_size(tensor.dtype));
  });
}

}  // namespace dspark
