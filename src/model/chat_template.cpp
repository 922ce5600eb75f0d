#include "model/chat_template.h"

#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace dspark {
namespace {

// Python's str.isspace(), which Jinja's |trim filter (str.strip) relies on.
bool is_python_space(uint32_t code_point) {
  if (code_point >= 0x09 && code_point <= 0x0D) return true;
  if (code_point >= 0x1C && code_point <= 0x20) return true;
  switch (code_point) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return code_point >= 0x2000 && code_point <= 0x200A;
  }
}

// Decodes the code point starting at text[position] and its byte length.
// Invalid bytes count as one non-space unit, so trimming never splits them.
uint32_t code_point_at(std::string_view text, size_t position, size_t* length) {
  auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  uint8_t lead = byte(position);
  size_t size = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3
                : (lead >> 3) == 0x1E ? 4 : 0;
  if (size == 0 || position + size > text.size()) {
    *length = 1;
    return 0xFFFFFFFF;
  }
  uint32_t value = size == 1 ? lead : lead & (0x7F >> size);
  for (size_t i = 1; i < size; ++i) {
    if ((byte(position + i) & 0xC0) != 0x80) {
      *length = 1;
      return 0xFFFFFFFF;
    }
    value = (value << 6) | (byte(position + i) & 0x3F);
  }
  *length = size;
  return value;
}

// Jinja's `|trim`: strips leading and trailing whitespace.
std::string trim(const std::string& text) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t length = 0;
    if (!is_python_space(code_point_at(text, begin, &length))) break;
    begin += length;
  }
  size_t end = begin;  // one past the last non-space character
  for (size_t position = begin; position < text.size();) {
    size_t length = 0;
    bool space = is_python_space(code_point_at(text, position, &length));
    position += length;
    if (!space) end = position;
  }
  return text.substr(begin, end - begin);
}

}  // namespace

ChatFormat detect_chat_format(const std::string& jinja_source, const std::string& where) {
  DSPARK_CHECK(!jinja_source.empty(), where,
               ": no chat_template (chat formatting needs one; supported formats: "
               "ChatML with <|im_start|>, Llama 3 with <|start_header_id|>)");
  if (jinja_source.find("<|im_start|>") != std::string::npos) return ChatFormat::ChatML;
  if (jinja_source.find("<|start_header_id|>") != std::string::npos) return ChatFormat::Llama3;
  fail(where, ": chat_template is not a supported chat format (supported: ChatML with "
       "<|im_start|>, Llama 3 with <|start_header_id|>)");
}

std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::string& bos_token) {
  std::string text;
  switch (format) {
    case ChatFormat::ChatML:
      for (const ChatMessage& message : messages) {
        text += "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n";
      }
      if (add_generation_prompt) text += "<|im_start|>assistant\n";
      break;
    case ChatFormat::Llama3:
      text += bos_token;
      for (const ChatMessage& message : messages) {
        text += "<|start_header_id|>" + message.role + "<|end_header_id|>\n\n" +
                trim(message.content) + "<|eot_id|>";
      }
      if (add_generation_prompt) text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
  }
  return text;
}

}  // namespace dspark
