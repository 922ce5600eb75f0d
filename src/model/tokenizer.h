// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json, giving the
// same ids as the `tokenizers` library for the Qwen2/Qwen3, Llama 3 and GPT-2
// families. The pipeline is the library's:
//   added tokens are cut out of the raw text first (longest match, honouring
//   lstrip / rstrip / single_word), then each remaining piece goes through
//   normalizer -> pre_tokenizer -> BPE, and the post_processor adds BOS etc.
// Supported components (anything else is an Error naming the file and type):
//   normalizer      null, NFC, NFD, NFKC, NFKD, Sequence
//   pre_tokenizer   null, ByteLevel, Split, Sequence
//   model           BPE (vocab + merges in "a b" or ["a", "b"] form)
//   post_processor  null, ByteLevel, TemplateProcessing, RobertaProcessing,
//                   BertProcessing, Sequence
//   decoder         null (token texts joined by spaces, as HF does), ByteLevel,
//                   Sequence holding one ByteLevel
// The `truncation` and `padding` sections are ignored: encode() never cuts or pads.
#pragma once
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/chat_template.h"

namespace dspark {

class Tokenizer {
 public:
  // Reads <dir>/tokenizer.json and, when present, <dir>/tokenizer_config.json
  // (bos/eos tokens, chat_template; a chat_template.jinja beside it also counts).
  static Tokenizer load(const std::filesystem::path& model_directory);

  // Same ids as HF `Tokenizer.encode(text, add_special_tokens).ids`.
  // add_special_tokens=false only turns the post_processor off; added tokens
  // written in the text are always recognised. Invalid UTF-8 in `text` is
  // replaced by U+FFFD first (HF only ever sees valid strings).
  std::vector<int> encode(std::string_view text, bool add_special_tokens = true) const;

  // Same text as HF `Tokenizer.decode(ids, skip_special_tokens)`: bytes that are
  // not valid UTF-8 become U+FFFD as Rust's String::from_utf8_lossy does.
  // Ids the tokenizer does not know are skipped, as HF does.
  std::string decode(std::span<const int> ids, bool skip_special_tokens = false) const;

  // The raw bytes one token stands for (byte-level mapping undone; an added
  // token gives its content). Unknown ids are an Error.
  std::string token_bytes(int id) const;

  int vocab_size() const;  // largest id + 1 over the vocab and the added tokens
  std::optional<int> token_to_id(std::string_view token) const;
  bool is_special(int id) const;

  // From tokenizer_config.json (absent when it has no such token).
  std::optional<int> bos_token_id() const;
  std::optional<int> eos_token_id() const;
  // The Jinja chat template text; empty when the model has none.
  const std::string& chat_template_source() const;

  // Renders messages in the chat format recognised in chat_template_source().
  std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                  bool add_generation_prompt) const;


 private:
  struct Implementation;  // defined in tokenizer.cpp
  explicit Tokenizer(std::shared_ptr<const Implementation> implementation);
  friend class StreamingDecoder;
  // Immutable after load (the word cache inside is locked), so copies share it
  // and one tokenizer serves any number of threads.
  std::shared_ptr<const Implementation> implementation_;
};

// Incremental detokenizer for streaming output. push(id) returns the text that
// became complete with this token; a multi-byte character split over several
// tokens is held back until its last byte arrives. finish() flushes what is
// left (an unfinished character becomes U+FFFD). The concatenation of every
// push() and finish() equals decode() of all the ids.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(int id);
  std::string finish();

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  bool first_token_ = true;  // separators for tokenizers without a decoder
  std::string pending_bytes_;  // the start of a character not yet complete
};

}  // namespace dspark
