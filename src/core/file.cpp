#include "core/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace dspark {

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  DSPARK_CHECK(in, "cannot open ", path.string(), ": ", std::strerror(errno));
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

std::shared_ptr<MappedFile> MappedFile::open(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  DSPARK_CHECK(fd >= 0, "cannot open ", path.string(), ": ", std::strerror(errno));
  struct stat info{};
  if (fstat(fd, &info) != 0) {
    int saved = errno;
    ::close(fd);
    fail("cannot stat ", path.string(), ": ", std::strerror(saved));
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(info.st_size);
  if (file->size_ > 0) {
    void* mapped = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int saved = errno;
    ::close(fd);
    DSPARK_CHECK(mapped != MAP_FAILED, "cannot map ", path.string(), ": ", std::strerror(saved));
    file->data_ = static_cast<const std::byte*>(mapped);
  } else {
    ::close(fd);
  }
  return file;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<std::byte*>(data_), size_);
}

void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(const ByteSink&)>& write) {
  std::filesystem::path temp = path;
  temp += ".tmp." + std::to_string(getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  DSPARK_CHECK(fd >= 0, "cannot create ", temp.string(), ": ", std::strerror(errno));
  auto abandon = [&](const char* what) {
    int saved = errno;
    ::close(fd);
    std::filesystem::remove(temp);
    fail("cannot ", what, " ", temp.string(), ": ", std::strerror(saved));
  };
  ByteSink sink = [&](const void* bytes, size_t count) {
    const char* cursor = static_cast<const char*>(bytes);
    while (count > 0) {
      ssize_t written = ::write(fd, cursor, count);
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) abandon("write");
      cursor += written;
      count -= static_cast<size_t>(written);
    }
  };
  try {
    write(sink);
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(temp);
    throw;
  }
  if (fsync(fd) != 0) abandon("sync");
  if (::close(fd) != 0) {
    std::filesystem::remove(temp);
    fail("cannot close ", temp.string(), ": ", std::strerror(errno));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    int saved = errno;
    std::filesystem::remove(temp);
    fail("cannot rename ", temp.string(), " to ", path.string(), ": ", std::strerror(saved));
  }
}

void write_text_file_atomic(const std::filesystem::path& path, std::string_view text) {
  write_file_atomic(path, [&](const ByteSink& sink) { sink(text.data(), text.size()); });
}

}  // namespace dspark
