// Chat formatting without a Jinja interpreter: the chat_template text of a
// model is only inspected to recognise which of the known formats it renders,
// and that format is then produced by hand-written code.
#pragma once
#include <string>
#include <vector>

namespace dspark {

struct ChatMessage {
  std::string role;
  std::string content;
};

enum class ChatFormat {
  ChatML,  // Qwen2 / Qwen3: <|im_start|>role\ncontent<|im_end|>\n
  Llama3,  // Llama 3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
};

// ChatML when the template mentions <|im_start|>, Llama3 when it mentions
// <|start_header_id|>. An empty (absent) template or any other one is an Error
// naming `where` (the file the template came from).
ChatFormat detect_chat_format(const std::string& jinja_source, const std::string& where);

// The prompt text the model's template renders for `messages`. `bos_token` is
// the text of the BOS token (Llama3 starts with it; ChatML ignores it).
std::string render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::string& bos_token);

}  // namespace dspark
