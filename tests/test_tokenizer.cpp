// Tokenizer tests: small hand-built tokenizer.json files with hand-derived ids,
// and golden comparisons against HF `tokenizers` (skipped until the golden
// directories exist).
#include <gtest/gtest.h>

#include "golden.h"
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "model/tokenizer.h"

namespace dspark {
namespace {

namespace fs = std::filesystem;

// GPT-2's bytes_to_unicode, written out independently of the implementation.
std::string byte_level(const std::string& raw) {
  std::string out;
  for (unsigned char byte : raw) {
    bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    uint32_t code_point = byte;
    if (!printable) {
      code_point = 0x100;
      for (int lower = 0; lower < byte; ++lower) {
        bool lower_printable = (lower >= '!' && lower <= '~') || (lower >= 0xA1 && lower <= 0xAC) || lower >= 0xAE;
        if (!lower_printable) ++code_point;
      }
    }
    if (code_point < 0x80) {
      out += static_cast<char>(code_point);
    } else {
      out += static_cast<char>(0xC0 | (code_point >> 6));
      out += static_cast<char>(0x80 | (code_point & 0x3F));
    }
  }
  return out;
}

// A byte-level vocabulary: ids 0..255 are the single bytes; add() appends tokens.
struct Vocabulary {
  Json vocab = Json::object();
  Json merges = Json::array();
  int next_id = 256;

  Vocabulary() {
    for (int byte = 0; byte < 256; ++byte) vocab[byte_level(std::string(1, static_cast<char>(byte)))] = byte;
  }
  int add(const std::string& raw) {
    std::string key = byte_level(raw);
    if (!vocab.contains(key)) vocab[key] = next_id++;
    return vocab[key].get<int>();
  }
  // Adds the merge (left, right) and its result; merges are ranked in call order.
  int merge(const std::string& left, const std::string& right, bool pair_format = true) {
    int id = add(left + right);
    if (pair_format) {
      merges.push_back(Json::array({byte_level(left), byte_level(right)}));
    } else {
      merges.push_back(byte_level(left) + " " + byte_level(right));
    }
    return id;
  }
  int id(const std::string& raw) const { return vocab.at(byte_level(raw)).get<int>(); }
  Json model(bool ignore_merges = false) const {
    return {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
            {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", ignore_merges},
            {"vocab", vocab}, {"merges", merges}};
  }
};

Json byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex = true) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", true},
          {"use_regex", use_regex}};
}

Json byte_level_decoder() {
  return {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
}

Json added_token(int id, const std::string& content, bool special, bool lstrip = false, bool rstrip = false,
                 bool single_word = false) {
  return {{"id", id}, {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", false}, {"special", special}};
}

Json tokenizer_json(const Json& model, const Json& pre_tokenizer, const Json& added_tokens = Json::array(),
                    const Json& normalizer = nullptr, const Json& post_processor = nullptr,
                    const Json& decoder = byte_level_decoder()) {
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
          {"added_tokens", added_tokens}, {"normalizer", normalizer}, {"pre_tokenizer", pre_tokenizer},
          {"post_processor", post_processor}, {"decoder", decoder}, {"model", model}};
}

// Each test gets a fresh directory to write tokenizer files into.
class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    directory_ = fs::temp_directory_path() /
                 ("dspark_tokenizer_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(directory_);
    fs::create_directories(directory_);
  }
  void TearDown() override { fs::remove_all(directory_); }

  void write(const std::string& name, const std::string& text) {
    std::ofstream out(directory_ / name, std::ios::binary);
    out << text;
  }
  Tokenizer load(const Json& tokenizer, const Json& config = nullptr) {
    write("tokenizer.json", tokenizer.dump());
    if (!config.is_null()) write("tokenizer_config.json", config.dump());
    return Tokenizer::load(directory_);
  }

  fs::path directory_;
};

using Ids = std::vector<int>;

TEST_F(TokenizerFiles, MergesFollowRankNotPosition) {
  // "abc": with "b c" ranked first, b+c merge before a+b can.
  Vocabulary first_bc;
  first_bc.merge("b", "c");
  first_bc.merge("a", "b");
  first_bc.merge("a", "bc");
  Tokenizer tokenizer = load(tokenizer_json(first_bc.model(), byte_level_pre_tokenizer(false)));
  EXPECT_EQ(tokenizer.encode("abc"), (Ids{first_bc.id("abc")}));
  EXPECT_EQ(tokenizer.encode("ab"), (Ids{first_bc.id("ab")}));

  // Same tokens, "a b" ranked first: ab + c, and no rule merges those.
  Vocabulary first_ab;
  first_ab.merge("a", "b");
  first_ab.merge("b", "c");
  first_ab.merge("a", "bc");
  tokenizer = load(tokenizer_json(first_ab.model(), byte_level_pre_tokenizer(false)));
  EXPECT_EQ(tokenizer.encode("abc"), (Ids{first_ab.id("ab"), 'c'}));
  // Ties between equal pairs go to the leftmost: "aaa" -> aa + a.
  Vocabulary repeated;
  repeated.merge("a", "a");
  tokenizer = load(tokenizer_json(repeated.model(), byte_level_pre_tokenizer(false)));
  EXPECT_EQ(tokenizer.encode("aaa"), (Ids{repeated.id("aa"), 'a'}));
  EXPECT_EQ(tokenizer.encode("aaaa"), (Ids{repeated.id("aa"), repeated.id("aa")}));
}

TEST_F(TokenizerFiles, BothMergeFormatsGiveTheSameIds) {
  Vocabulary pairs, strings;
  for (Vocabulary* vocabulary : {&pairs, &strings}) {
    bool pair_format = vocabulary == &pairs;
    vocabulary->merge(" ", "w", pair_format);
    vocabulary->merge("o", "r", pair_format);
    vocabulary->merge(" w", "or", pair_format);
    vocabulary->merge("l", "d", pair_format);
    vocabulary->merge(" wor", "ld", pair_format);
  }
  ASSERT_TRUE(strings.merges[0].is_string());
  ASSERT_TRUE(pairs.merges[0].is_array());
  Tokenizer from_pairs = load(tokenizer_json(pairs.model(), byte_level_pre_tokenizer(false)));
  Tokenizer from_strings = load(tokenizer_json(strings.model(), byte_level_pre_tokenizer(false)));
  Ids expected{'h', 'i', pairs.id(" world")};
  EXPECT_EQ(from_pairs.encode("hi world"), expected);
  EXPECT_EQ(from_strings.encode("hi world"), expected);
}

TEST_F(TokenizerFiles, IgnoreMergesEmitsWholeVocabWords) {
  Vocabulary vocabulary;
  vocabulary.merge("a", "b");
  int abc = vocabulary.add("abc");  // in the vocab, but no merge leads to it
  Tokenizer plain = load(tokenizer_json(vocabulary.model(false), byte_level_pre_tokenizer(false)));
  EXPECT_EQ(plain.encode("abc"), (Ids{vocabulary.id("ab"), 'c'}));
  Tokenizer ignoring = load(tokenizer_json(vocabulary.model(true), byte_level_pre_tokenizer(false)));
  EXPECT_EQ(ignoring.encode("abc"), (Ids{abc}));
  EXPECT_EQ(ignoring.encode("abcab"), (Ids{vocabulary.id("ab"), 'c', vocabulary.id("ab")}));
}

TEST_F(TokenizerFiles, AddedTokensStripAndSplitText) {
  Vocabulary vocabulary;
  Json added = Json::array({added_token(256, "<left>", true, /*lstrip=*/true),
                            added_token(257, "<right>", true, false, /*rstrip=*/true),
                            added_token(258, "<end>", true), added_token(259, "<tool>", false),
                            added_token(260, "<end>x", false)});
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added));
  // lstrip: the spaces before <left> belong to it.
  EXPECT_EQ(tokenizer.encode("a  <left>b"), (Ids{'a', 256, 'b'}));
  // rstrip: the spaces after <right> belong to it.
  EXPECT_EQ(tokenizer.encode("a <right>  b"), (Ids{'a', ' ', 257, 'b'}));
  // Neither: the space stays text.
  EXPECT_EQ(tokenizer.encode("a <end> b"), (Ids{'a', ' ', 258, ' ', 'b'}));
  // Special and non-special added tokens both split the text; the longest match wins.
  EXPECT_EQ(tokenizer.encode("q<end>x<tool><end>"), (Ids{'q', 260, 259, 258}));
  EXPECT_EQ(tokenizer.encode("<end><end>"), (Ids{258, 258}));

  EXPECT_EQ(tokenizer.decode(Ids{'a', 258, 'b', 259}), "a<end>b<tool>");
  EXPECT_EQ(tokenizer.decode(Ids{'a', 258, 'b', 259}, true), "ab<tool>");
  EXPECT_TRUE(tokenizer.is_special(258));
  EXPECT_FALSE(tokenizer.is_special(259));
  EXPECT_FALSE(tokenizer.is_special('a'));
  EXPECT_EQ(tokenizer.token_to_id("<tool>"), 259);
  EXPECT_EQ(tokenizer.token_to_id("a"), 'a');
  EXPECT_EQ(tokenizer.token_to_id("missing"), std::nullopt);
  EXPECT_EQ(tokenizer.token_bytes(258), "<end>");
  EXPECT_EQ(tokenizer.token_bytes(' '), " ");
  EXPECT_EQ(tokenizer.vocab_size(), 261);
}

TEST_F(TokenizerFiles, SingleWordAddedTokensNeedWordBoundaries) {
  Vocabulary vocabulary;
  Json added = Json::array({added_token(256, "cat", false, false, false, /*single_word=*/true)});
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added));
  EXPECT_EQ(tokenizer.encode("a cat."), (Ids{'a', ' ', 256, '.'}));
  EXPECT_EQ(tokenizer.encode("cats"), (Ids{'c', 'a', 't', 's'}));
}

TEST_F(TokenizerFiles, TemplateProcessingAddsBos) {
  Vocabulary vocabulary;
  vocabulary.merge("h", "i");
  Json added = Json::array({added_token(257, "<bos>", true)});
  Json post_processor = {
      {"type", "Sequence"},
      {"processors",
       Json::array({{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
                     {"use_regex", true}},
                    {{"type", "TemplateProcessing"},
                     {"single", Json::array({{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                     {"pair", Json::array()},
                     {"special_tokens",
                      {{"<bos>", {{"id", "<bos>"}, {"ids", Json::array({257})}, {"tokens", Json::array({"<bos>"})}}}}}}})}};
  Json config = {{"bos_token", "<bos>"}, {"eos_token", {{"content", "<bos>"}, {"lstrip", false}}}};
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added, nullptr,
                                            post_processor),
                             config);
  int hi = vocabulary.id("hi");
  EXPECT_EQ(tokenizer.encode("hi"), (Ids{257, hi}));
  EXPECT_EQ(tokenizer.encode("hi", false), (Ids{hi}));
  EXPECT_EQ(tokenizer.encode(""), (Ids{257}));
  EXPECT_EQ(tokenizer.encode("", false), (Ids{}));
  EXPECT_EQ(tokenizer.bos_token_id(), 257);
  EXPECT_EQ(tokenizer.eos_token_id(), 257);
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("hi"), true), "hi");
}

// A raw-text (no byte-level) tokenizer whose merges would cross the split points,
// so the ids show where the Split pre-tokenizer cut.
class TokenizerSplitBehavior : public TokenizerFiles {
 protected:
  Tokenizer load_split(const std::string& behavior, bool invert = false, const Json& pattern = {{"String", " "}}) {
    Json vocab = {{"a", 0}, {"b", 1}, {" ", 2}, {"a ", 3}, {" b", 4}, {"a b", 5}, {"  ", 6}};
    Json merges = Json::array({Json::array({"a", " "}), Json::array({" ", "b"}), Json::array({"a ", "b"}),
                               Json::array({" ", " "})});
    Json model = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
    Json pre_tokenizer = {{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
    return load(tokenizer_json(model, pre_tokenizer, Json::array(), nullptr, nullptr, nullptr));
  }
};

TEST_F(TokenizerSplitBehavior, AllBehaviorsAndInvert) {
  EXPECT_EQ(load_split("Isolated").encode("a b"), (Ids{0, 2, 1}));
  EXPECT_EQ(load_split("Removed").encode("a b"), (Ids{0, 1}));
  EXPECT_EQ(load_split("MergedWithPrevious").encode("a b"), (Ids{3, 1}));
  EXPECT_EQ(load_split("MergedWithNext").encode("a b"), (Ids{0, 4}));
  EXPECT_EQ(load_split("Isolated").encode("a  b"), (Ids{0, 2, 2, 1}));
  EXPECT_EQ(load_split("Contiguous").encode("a  b"), (Ids{0, 6, 1}));
  // Inverted: the letters are the "non-matches", so Removed drops the space.
  Json letters = {{"Regex", "a|b"}};
  EXPECT_EQ(load_split("Removed", false, letters).encode("a b"), (Ids{2}));
  EXPECT_EQ(load_split("Removed", true, letters).encode("a b"), (Ids{0, 1}));
  // Without a decoder HF joins token texts with spaces.
  EXPECT_EQ(load_split("Isolated").decode(Ids{0, 2, 1}), "a   b");
}

TEST_F(TokenizerFiles, Gpt2ByteLevelWithPrefixSpace) {
  Vocabulary vocabulary;
  vocabulary.merge(" ", "h");
  vocabulary.merge(" h", "i");
  vocabulary.merge("'", "s");
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(true)));
  int space_hi = vocabulary.id(" hi");
  // The prefix space makes the first word look like the others.
  EXPECT_EQ(tokenizer.encode("hi hi"), (Ids{space_hi, space_hi}));
  EXPECT_EQ(tokenizer.encode(" hi"), (Ids{space_hi}));
  // GPT-2 regex: contractions split off, and "  hi" keeps one space for the word.
  EXPECT_EQ(tokenizer.encode("hi's"), (Ids{space_hi, vocabulary.id("'s")}));
  EXPECT_EQ(tokenizer.encode("hi  hi"), (Ids{space_hi, ' ', space_hi}));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("hi  hi")), " hi  hi");
}

// Qwen2-style pipeline: Split(regex, Isolated) then ByteLevel without regex,
// with ignore_merges so each expected pre-token shows up as its own id.
TEST_F(TokenizerFiles, QwenAndLlamaSplitPatterns) {
  const std::string qwen_pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string llama_pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  std::vector<std::string> pieces = {"Hello", " world", " ", "1", "2", "3", "!!\n\n", " x", "IT", "'S",
                                     "123", "45", "\xC3\xA9t\xC3\xA9", "\n", "  \t", "  \n", "!\xE1\xA0\x8E"};
  Vocabulary vocabulary;
  for (const std::string& piece : pieces) vocabulary.add(piece);
  auto pipeline = [&](const std::string& pattern) {
    Json pre_tokenizer = {{"type", "Sequence"},
                          {"pretokenizers",
                           Json::array({{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"},
                                         {"invert", false}},
                                        byte_level_pre_tokenizer(false, false)})}};
    return tokenizer_json(vocabulary.model(true), pre_tokenizer, Json::array(), {{"type", "NFC"}});
  };
  auto ids = [&](std::vector<std::string> expected) {
    Ids out;
    for (const std::string& piece : expected) out.push_back(vocabulary.id(piece));
    return out;
  };
  Tokenizer qwen = load(pipeline(qwen_pattern));
  EXPECT_EQ(qwen.encode("Hello world 123!!\n\n  x"),
            ids({"Hello", " world", " ", "1", "2", "3", "!!\n\n", " ", " x"}));
  EXPECT_EQ(qwen.encode("IT'S"), ids({"IT", "'S"}));
  EXPECT_EQ(qwen.encode("\xC3\xA9t\xC3\xA9\n  \t"), ids({"\xC3\xA9t\xC3\xA9", "\n", "  \t"}));
  EXPECT_EQ(qwen.encode("  \nx"), ids({"  \n", "x"}));
  Tokenizer llama = load(pipeline(llama_pattern));
  EXPECT_EQ(llama.encode("12345"), ids({"123", "45"}));
  // U+180E is not White_Space (PCRE2's \s would say it is; Oniguruma's does not),
  // so it joins the punctuation run.
  EXPECT_EQ(llama.encode("!\xE1\xA0\x8E"), ids({"!\xE1\xA0\x8E"}));
}

TEST_F(TokenizerFiles, NfcNormalization) {
  Vocabulary vocabulary;
  int e_acute = vocabulary.merge("\xC3", "\xA9");  // é
  Tokenizer tokenizer =
      load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), Json::array(), {{"type", "NFC"}}));
  EXPECT_EQ(tokenizer.encode("e\xCC\x81"), (Ids{e_acute}));
  EXPECT_EQ(tokenizer.encode("\xC3\xA9"), (Ids{e_acute}));
  EXPECT_EQ(tokenizer.decode(Ids{e_acute}), "\xC3\xA9");

  Json sequence = {{"type", "Sequence"}, {"normalizers", Json::array({{{"type", "NFC"}}})}};
  Tokenizer in_sequence = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), Json::array(), sequence));
  EXPECT_EQ(in_sequence.encode("e\xCC\x81"), (Ids{e_acute}));
}

TEST_F(TokenizerFiles, DecodeRoundTripAndInvalidUtf8) {
  Vocabulary vocabulary;
  vocabulary.merge("\xE4", "\xBD");
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false)));
  for (std::string text : {"Hello, world!", "  tabs\tand\nnewlines  ", "\xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80", ""}) {
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  }
  const std::string replacement = "\xEF\xBF\xBD";
  EXPECT_EQ(tokenizer.decode(Ids{0xC3, 'a'}), replacement + "a");
  // One U+FFFD per maximal invalid subpart, as Rust's from_utf8_lossy.
  EXPECT_EQ(tokenizer.decode(Ids{0xE2, 0x82, 'a'}), replacement + "a");
  EXPECT_EQ(tokenizer.decode(Ids{0xF0, '(', 0x80, 0x80}), replacement + "(" + replacement + replacement);
  EXPECT_EQ(tokenizer.decode(Ids{0xED, 0xA0, 0x80}), replacement + replacement + replacement);
  EXPECT_EQ(tokenizer.decode(Ids{'a', 0xF0, 0x9F, 0x98}), "a" + replacement);
  // Unknown ids are skipped.
  EXPECT_EQ(tokenizer.decode(Ids{'a', 999999, 'b'}), "ab");
  EXPECT_EQ(tokenizer.token_bytes(0xC3), "\xC3");
  EXPECT_NE(testing::error_of([&] { tokenizer.token_bytes(999999); }).find("999999"), std::string::npos);
  // Invalid UTF-8 in the input is replaced before tokenizing.
  EXPECT_EQ(tokenizer.encode("a\xFF"), (Ids{'a', 0xEF, 0xBF, 0xBD}));
}

TEST_F(TokenizerFiles, StreamingDecoderHoldsSplitCharacters) {
  Vocabulary vocabulary;
  Json added = Json::array({added_token(256, "<end>", true)});
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added));
  StreamingDecoder stream(tokenizer);
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0xC3), "");
  EXPECT_EQ(stream.push(0xA9), "\xC3\xA9");
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push(0x98), "");
  EXPECT_EQ(stream.push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(stream.push(256), "<end>");
  EXPECT_EQ(stream.push(0xE2), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");

  // Everything streamed equals decode() of all ids, invalid bytes included.
  Ids ids{'x', 0xE4, 0xBD, 0xA0, 0xC3, 'y', 0x80, 256, 0xF0, 0x9F};
  for (bool skip : {false, true}) {
    StreamingDecoder whole(tokenizer, skip);
    std::string streamed;
    for (int id : ids) streamed += whole.push(id);
    streamed += whole.finish();
    EXPECT_EQ(streamed, tokenizer.decode(ids, skip));
  }
}

TEST_F(TokenizerFiles, UnknownCharactersUseUnkToken) {
  Json vocab = {{"<unk>", 0}, {"a", 1}};
  for (bool fuse : {false, true}) {
    Json model = {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", fuse}, {"vocab", vocab},
                  {"merges", Json::array()}};
    Tokenizer tokenizer = load(tokenizer_json(model, nullptr, Json::array(), nullptr, nullptr, nullptr));
    EXPECT_EQ(tokenizer.encode("abba"), fuse ? (Ids{1, 0, 1}) : (Ids{1, 0, 0, 1}));
  }
  // Without an unk token, HF drops characters missing from the vocab.
  Json model = {{"type", "BPE"}, {"vocab", vocab}, {"merges", Json::array()}};
  Tokenizer dropping = load(tokenizer_json(model, nullptr, Json::array(), nullptr, nullptr, nullptr));
  EXPECT_EQ(dropping.encode("abba"), (Ids{1, 1}));
}

TEST_F(TokenizerFiles, ConcurrentEncodesAgree) {
  Vocabulary vocabulary;
  vocabulary.merge(" ", "t");
  vocabulary.merge(" t", "h");
  vocabulary.merge(" th", "e");
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false)));
  std::string text;
  for (int i = 0; i < 2000; ++i) text += " the w" + std::to_string(i % 97) + " then";
  const Ids expected = tokenizer.encode(text);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 5; ++round) {
        if (tokenizer.encode(text) != expected) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(TokenizerFiles, LongWhitespaceRunsAreFast) {
  Vocabulary vocabulary;
  vocabulary.merge(" ", " ");
  vocabulary.merge("  ", "  ");
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false)));
  std::string text = "x" + std::string(200000, ' ') + "y" + std::string(50000, '\n') + "z";
  auto start = std::chrono::steady_clock::now();
  Ids ids = tokenizer.encode(text);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0);
  EXPECT_EQ(tokenizer.decode(ids), text);
}

TEST_F(TokenizerFiles, ClearErrors) {
  std::string missing = testing::error_of([&] { Tokenizer::load(directory_ / "nowhere"); });
  EXPECT_NE(missing.find("tokenizer.json"), std::string::npos) << missing;

  Json word_piece = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}};
  std::string model_error = testing::error_of([&] { load(tokenizer_json(word_piece, nullptr)); });
  EXPECT_NE(model_error.find("WordPiece"), std::string::npos) << model_error;
  EXPECT_NE(model_error.find("tokenizer.json"), std::string::npos) << model_error;

  Vocabulary vocabulary;
  std::string pre_tokenizer_error =
      testing::error_of([&] { load(tokenizer_json(vocabulary.model(), {{"type", "Whitespace"}})); });
  EXPECT_NE(pre_tokenizer_error.find("Whitespace"), std::string::npos) << pre_tokenizer_error;
  std::string normalizer_error = testing::error_of(
      [&] { load(tokenizer_json(vocabulary.model(), nullptr, Json::array(), {{"type", "Lowercase"}})); });
  EXPECT_NE(normalizer_error.find("Lowercase"), std::string::npos) << normalizer_error;
  std::string decoder_error = testing::error_of([&] {
    load(tokenizer_json(vocabulary.model(), nullptr, Json::array(), nullptr, nullptr, {{"type", "WordPiece"}}));
  });
  EXPECT_NE(decoder_error.find("decoder"), std::string::npos) << decoder_error;
  std::string processor_error = testing::error_of([&] {
    load(tokenizer_json(vocabulary.model(), nullptr, Json::array(), nullptr, {{"type", "Unknown"}}));
  });
  EXPECT_NE(processor_error.find("Unknown"), std::string::npos) << processor_error;

  Vocabulary broken;
  broken.merges.push_back(Json::array({"a", "zz"}));
  std::string merge_error = testing::error_of([&] { load(tokenizer_json(broken.model(), nullptr)); });
  EXPECT_NE(merge_error.find("zz"), std::string::npos) << merge_error;
}

TEST_F(TokenizerFiles, ChatTemplateFromConfig) {
  Vocabulary vocabulary;
  Json added = Json::array({added_token(256, "<|begin_of_text|>", true)});
  Json config = {{"bos_token", "<|begin_of_text|>"},
                 {"chat_template", "{{ bos_token }}<|start_header_id|>{{ role }}<|end_header_id|>"}};
  Tokenizer tokenizer = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added), config);
  std::vector<ChatMessage> messages = {{"user", " Hi "}};
  EXPECT_EQ(tokenizer.apply_chat_template(messages, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");

  Tokenizer without = load(tokenizer_json(vocabulary.model(), byte_level_pre_tokenizer(false), added),
                           Json{{"eos_token", nullptr}});
  EXPECT_TRUE(without.chat_template_source().empty());
  EXPECT_EQ(without.bos_token_id(), std::nullopt);
  std::string error = testing::error_of([&] { without.apply_chat_template(messages, true); });
  EXPECT_NE(error.find("tokenizer_config.json"), std::string::npos) << error;
}

// ------------------------------------------------------------------ golden

std::vector<int> ids_of(const Json& array) { return array.get<std::vector<int>>(); }

// Compares our encode/decode with HF on every case of <golden>/<name>/reference/tokenization.json.
void check_golden_tokenization(const std::string& name) {
  fs::path directory = testing::golden_model(name);
  ASSERT_TRUE(fs::exists(directory)) << "no golden directory " << directory.string();
  Tokenizer tokenizer = Tokenizer::load(directory);
  Json reference = read_json_file(directory / "reference" / "tokenization.json");
  ASSERT_TRUE(reference.contains("cases"));
  for (const Json& test_case : reference["cases"]) {
    std::string text = test_case.at("text").get<std::string>();
    std::vector<int> expected = ids_of(test_case.at("ids"));
    std::vector<int> expected_plain = ids_of(test_case.at("ids_plain"));
    std::vector<int> actual = tokenizer.encode(text, true);
    std::vector<int> actual_plain = tokenizer.encode(text, false);
    EXPECT_EQ(actual, expected) << "text: " << Json(text).dump() << "\nours: " << testing::describe_ids(actual)
                                << "\nHF:   " << testing::describe_ids(expected);
    EXPECT_EQ(actual_plain, expected_plain) << "text (no special): " << Json(text).dump()
                                            << "\nours: " << testing::describe_ids(actual_plain)
                                            << "\nHF:   " << testing::describe_ids(expected_plain);
    EXPECT_EQ(tokenizer.decode(expected_plain, false), test_case.at("decoded").get<std::string>())
        << "decode of " << testing::describe_ids(expected_plain);
    EXPECT_EQ(tokenizer.decode(expected_plain, true), test_case.at("decoded_skip_special").get<std::string>())
        << "decode (skip special) of " << testing::describe_ids(expected_plain);
  }
}

TEST(TokenizerGolden, Qwen3) { check_golden_tokenization("qwen3"); }
TEST(TokenizerGolden, Llama) { check_golden_tokenization("llama"); }
TEST(TokenizerGolden, Gpt2Tokenizer) { check_golden_tokenization("gpt2-tokenizer"); }

}  // namespace
}  // namespace dspark
