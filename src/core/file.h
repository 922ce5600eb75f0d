// Files: whole-file reads, read-only memory maps, and atomic writes
// (temp file in the same directory + fsync + rename), so an interrupted write
// never leaves a half-written checkpoint, shard or result behind.
#pragma once
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace dspark {

std::string read_text_file(const std::filesystem::path& path);

// A read-only mapping of a whole file; unmapped when the last reference goes.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  MappedFile() = default;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
  std::filesystem::path path_;
};

// Streams content into "<path>.tmp.<pid>", fsyncs it, then renames it over
// `path`. The writer callback receives a function that appends bytes.
using ByteSink = std::function<void(const void* bytes, size_t count)>;
void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(const ByteSink&)>& write);
void write_text_file_atomic(const std::filesystem::path& path, std::string_view text);

}  // namespace dspark
