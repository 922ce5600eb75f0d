#include "model/prompts.h"

#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "core/json.h"

namespace dspark {

std::vector<PromptEntry> read_prompt_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  DSPARK_CHECK(in, "cannot read prompts file ", path.string());
  std::vector<PromptEntry> entries;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const Json json = Json::parse(text);
      PromptEntry entry;
      entry.line = line;
      if (json.is_object() && json.contains("prompt") && json["prompt"].is_string()) {
        entry.prompt = json["prompt"].get<std::string>();
      } else if (json.is_object() && json.contains("messages") && json["messages"].is_array()) {
        for (const Json& message : json["messages"])
          entry.messages.push_back({message.at("role").get<std::string>(), message.at("content").get<std::string>()});
        DSPARK_CHECK(!entry.messages.empty(), "empty \"messages\"");
      } else {
        fail("needs a \"prompt\" string or a \"messages\" list");
      }
      entries.push_back(std::move(entry));
    } catch (const std::exception& error) {
      std::fprintf(stderr, "warning: %s:%d skipped: %s\n", path.string().c_str(), line, error.what());
    }
  }
  return entries;
}

std::vector<int32_t> tokenize_prompt(const Tokenizer& tokenizer, const PromptEntry& entry, bool chat) {
  if (!entry.messages.empty()) return tokenizer.encode(tokenizer.apply_chat_template(entry.messages, true), false);
  if (chat) return tokenizer.encode(tokenizer.apply_chat_template({{"user", entry.prompt}}, true), false);
  return tokenizer.encode(entry.prompt);
}

}  // namespace dspark
