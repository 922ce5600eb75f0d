// JSON helpers over nlohmann::json that fail with the file and key named.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace dspark {

using Json = nlohmann::json;

// Parses a JSON file; a missing file or a syntax error names the file.
Json read_json_file(const std::filesystem::path& path);

// object[key] converted to T; `where` names the object in the error message.
template <class T>
T json_get(const Json& object, const std::string& key, const std::string& where) {
  DSPARK_CHECK(object.is_object() && object.contains(key) && !object[key].is_null(),
               where, ": missing field \"", key, "\"");
  try {
    return object[key].get<T>();
  } catch (const nlohmann::json::exception&) {
    fail(where, ": field \"", key, "\" has the wrong type (", object[key].type_name(), ")");
  }
}

// object[key] converted to T, or `fallback` when the key is absent or null.
template <class T>
T json_get_or(const Json& object, const std::string& key, const T& fallback,
              const std::string& where) {
  if (!object.is_object() || !object.contains(key) || object[key].is_null()) return fallback;
  return json_get<T>(object, key, where);
}

}  // namespace dspark
