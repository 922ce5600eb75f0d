// Chat formatting: format detection, the two hand-written renderers, and golden
// comparisons against transformers' apply_chat_template (skipped until the
// golden directories exist).
#include <gtest/gtest.h>

#include "golden.h"

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"

namespace dspark {
namespace {

namespace fs = std::filesystem;

TEST(ChatTemplate, DetectsFormats) {
  EXPECT_EQ(detect_chat_format("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "x"),
            ChatFormat::ChatML);
  EXPECT_EQ(detect_chat_format("{{ bos_token }}<|start_header_id|>{{ role }}<|end_header_id|>", "x"),
            ChatFormat::Llama3);
  std::string unknown = testing::error_of([] { detect_chat_format("[INST] {{ content }} [/INST]", "m/tokenizer_config.json"); });
  EXPECT_NE(unknown.find("m/tokenizer_config.json"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("<|im_start|>"), std::string::npos) << unknown;
  std::string absent = testing::error_of([] { detect_chat_format("", "m/tokenizer_config.json"); });
  EXPECT_NE(absent.find("tokenizer_config.json"), std::string::npos) << absent;
  EXPECT_NE(absent.find("chat_template"), std::string::npos) << absent;
}

TEST(ChatTemplate, RendersChatML) {
  std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", " Hi\n"}};
  EXPECT_EQ(render_chat(ChatFormat::ChatML, messages, false, "<s>"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi\n<|im_end|>\n");
  EXPECT_EQ(render_chat(ChatFormat::ChatML, messages, true, ""),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi\n<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, RendersLlama3WithTrimmedContent) {
  std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", " \t Hi there \n\n"},
                                       {"assistant", "\xE3\x80\x80Hello\xC2\xA0"}};
  EXPECT_EQ(render_chat(ChatFormat::Llama3, messages, true, "<|begin_of_text|>"),
            "<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(render_chat(ChatFormat::Llama3, {{"user", "   "}}, false, "B"),
            "B<|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>");
}

// ------------------------------------------------------------------ golden

// Checks every "chat" case of <golden>/<name>/reference/tokenization.json: our
// rendering against transformers' text, and our ids of that text against HF's.
void check_golden_chat(const std::string& name) {
  fs::path directory = testing::golden_model(name);
  ASSERT_TRUE(fs::exists(directory)) << "no golden directory " << directory.string();
  Json reference = read_json_file(directory / "reference" / "tokenization.json");
  ASSERT_TRUE(reference.contains("chat")) << name << " has no chat cases";
  Tokenizer tokenizer = Tokenizer::load(directory);
  for (const Json& chat : reference["chat"]) {
    std::vector<ChatMessage> messages;
    for (const Json& message : chat.at("messages")) {
      messages.push_back({message.at("role").get<std::string>(), message.at("content").get<std::string>()});
    }
    bool add_generation_prompt = chat.at("add_generation_prompt").get<bool>();
    std::string expected_text = chat.at("text").get<std::string>();
    std::string rendered = tokenizer.apply_chat_template(messages, add_generation_prompt);
    EXPECT_EQ(rendered, expected_text) << "messages: " << chat.at("messages").dump()
                                       << "\nours: " << Json(rendered).dump()
                                       << "\nHF:   " << Json(expected_text).dump();
    std::vector<int> expected_ids = chat.at("ids").get<std::vector<int>>();
    std::vector<int> ids = tokenizer.encode(expected_text, false);
    EXPECT_EQ(ids, expected_ids) << "text: " << Json(expected_text).dump() << "\nours: " << testing::describe_ids(ids)
                                 << "\nHF:   " << testing::describe_ids(expected_ids);
  }
}

TEST(ChatGolden, Qwen3) { check_golden_chat("qwen3"); }
TEST(ChatGolden, Llama) { check_golden_chat("llama"); }

}  // namespace
}  // namespace dspark
