// Prompt files: one JSON object per line, with a "prompt" string (used as
// given) or chat "messages" ([{role, content}], rendered with the model's chat
// template). A bad line is reported with its number and skipped, not fatal.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "model/tokenizer.h"

namespace dspark {

struct PromptEntry {
  int line = 0;
  std::string prompt;                 // when given as text
  std::vector<ChatMessage> messages;  // when given as a chat
};

// Errors only if the file cannot be read; bad lines go to stderr.
std::vector<PromptEntry> read_prompt_file(const std::filesystem::path& path);

// Token ids: messages through the chat template (generation prompt added);
// text as given, or through the template as one user turn when `chat`.
std::vector<int32_t> tokenize_prompt(const Tokenizer& tokenizer, const PromptEntry& entry, bool chat);

}  // namespace dspark
