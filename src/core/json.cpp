#include "core/json.h"

#include "core/file.h"

namespace dspark {

Json read_json_file(const std::filesystem::path& path) {
  DSPARK_CHECK(std::filesystem::exists(path), "missing file ", path.string());
  std::string text = read_text_file(path);
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail("cannot parse ", path.string(), ": ", e.what());
  }
}

}  // namespace dspark
