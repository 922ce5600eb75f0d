#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/error.h"
#include "core/file.h"
#include "core/json.h"

namespace dspark {
namespace {

// ============================================================== UTF-8 helpers

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// What the bytes at one position hold, under the Unicode "maximal subpart"
// rule that Rust's String::from_utf8_lossy follows: each maximal invalid
// subpart becomes one U+FFFD.
struct Utf8Unit {
  enum Kind { Character, Invalid, Truncated } kind;
  size_t length;  // the character, the invalid subpart, or the valid start seen so far
};

Utf8Unit next_utf8_unit(std::string_view bytes, size_t position) {
  uint8_t lead = static_cast<uint8_t>(bytes[position]);
  if (lead < 0x80) return {Utf8Unit::Character, 1};
  size_t continuation_count = 0;
  uint8_t second_low = 0x80, second_high = 0xBF;  // the second byte's range depends on the lead
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuation_count = 1;
  } else if (lead == 0xE0) {
    continuation_count = 2, second_low = 0xA0;
  } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
    continuation_count = 2;
  } else if (lead == 0xED) {
    continuation_count = 2, second_high = 0x9F;  // no UTF-16 surrogates
  } else if (lead == 0xF0) {
    continuation_count = 3, second_low = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    continuation_count = 3;
  } else if (lead == 0xF4) {
    continuation_count = 3, second_high = 0x8F;  // nothing above U+10FFFF
  } else {
    return {Utf8Unit::Invalid, 1};
  }
  for (size_t k = 1; k <= continuation_count; ++k) {
    if (position + k >= bytes.size()) return {Utf8Unit::Truncated, k};
    uint8_t byte = static_cast<uint8_t>(bytes[position + k]);
    uint8_t low = k == 1 ? second_low : 0x80, high = k == 1 ? second_high : 0xBF;
    if (byte < low || byte > high) return {Utf8Unit::Invalid, k};
  }
  return {Utf8Unit::Character, continuation_count + 1};
}

// Appends `bytes` to `out` as valid UTF-8. With hold_truncated_tail, a valid
// but unfinished character at the very end is left unconsumed (it may still
// complete); otherwise it becomes U+FFFD. Returns the bytes consumed.
size_t append_lossy_utf8(std::string_view bytes, bool hold_truncated_tail, std::string& out) {
  size_t position = 0;
  while (position < bytes.size()) {
    Utf8Unit unit = next_utf8_unit(bytes, position);
    if (unit.kind == Utf8Unit::Character) {
      out.append(bytes.substr(position, unit.length));
    } else if (unit.kind == Utf8Unit::Truncated && hold_truncated_tail) {
      return position;
    } else {
      out.append(kReplacementCharacter);
    }
    position += unit.length;
  }
  return position;
}

bool is_valid_utf8(std::string_view bytes) {
  for (size_t position = 0; position < bytes.size();) {
    Utf8Unit unit = next_utf8_unit(bytes, position);
    if (unit.kind != Utf8Unit::Character) return false;
    position += unit.length;
  }
  return true;
}

// Byte length of the character a lead byte starts (valid UTF-8 only).
size_t utf8_sequence_length(uint8_t lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// The code point at text[position] (valid UTF-8 only).
uint32_t code_point_at(std::string_view text, size_t position, size_t* length) {
  uint8_t lead = static_cast<uint8_t>(text[position]);
  size_t size = utf8_sequence_length(lead);
  uint32_t value = size == 1 ? lead : lead & (0x7F >> size);
  for (size_t i = 1; i < size; ++i) value = (value << 6) | (static_cast<uint8_t>(text[position + i]) & 0x3F);
  *length = size;
  return value;
}

// The code point ending just before text[end] and where it starts (valid UTF-8 only).
uint32_t code_point_before(std::string_view text, size_t end, size_t* start) {
  size_t position = end - 1;
  while (position > 0 && (static_cast<uint8_t>(text[position]) & 0xC0) == 0x80) --position;
  *start = position;
  size_t length = 0;
  return code_point_at(text, position, &length);
}

void append_code_point(uint32_t code_point, std::string& out) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

// Unicode White_Space: what \s means to Oniguruma (the HF pre-tokenizer
// regexes) and to Rust's regex crate (added-token lstrip / rstrip).
bool is_white_space(uint32_t code_point) {
  if (code_point >= 0x09 && code_point <= 0x0D) return true;
  if (code_point >= 0x2000 && code_point <= 0x200A) return true;
  switch (code_point) {
    case 0x20: case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return false;
  }
}

// The same set as a regex class body, for PCRE2 (whose \s under UCP also
// takes U+180E, which Oniguruma's does not).
constexpr std::string_view kWhiteSpaceClassBody =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

// \w of Rust's regex crate (Alphabetic, marks, decimal digits, connector
// punctuation, joiners), used by single_word added tokens.
bool is_word_character(uint32_t code_point) {
  if (code_point == '_' || code_point == 0x200C || code_point == 0x200D) return true;
  // Letters drawn as symbols that are still Alphabetic (circled / squared letters).
  if ((code_point >= 0x24B6 && code_point <= 0x24E9) || (code_point >= 0x1F130 && code_point <= 0x1F149) ||
      (code_point >= 0x1F150 && code_point <= 0x1F169) || (code_point >= 0x1F170 && code_point <= 0x1F189)) {
    return true;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(code_point))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// ======================================================== byte-level alphabet

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other
// 68 bytes for U+0100 onwards, so every byte string is printable text.
struct ByteLevelAlphabet {
  std::array<std::string, 256> text_of_byte;  // UTF-8 of the character for each byte
  std::array<int16_t, 0x144> byte_of_code_point;  // -1 where a code point stands for no byte
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet = [] {
    ByteLevelAlphabet table;
    table.byte_of_code_point.fill(-1);
    auto printable = [](int byte) {
      return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
    };
    uint32_t next_extra = 0x100;
    for (int byte = 0; byte < 256; ++byte) {
      uint32_t code_point = printable(byte) ? static_cast<uint32_t>(byte) : next_extra++;
      append_code_point(code_point, table.text_of_byte[byte]);
      table.byte_of_code_point[code_point] = static_cast<int16_t>(byte);
    }
    return table;
  }();
  return alphabet;
}

std::string byte_level_encode(std::string_view text) {
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  std::string out;
  out.reserve(text.size() * 2);
  for (char byte : text) out += alphabet.text_of_byte[static_cast<uint8_t>(byte)];
  return out;
}

// The ByteLevel decoder on one token: its characters mapped back to bytes, or
// the token's own bytes when any character is outside the alphabet.
void append_byte_level_decoded(std::string_view token, std::string& out) {
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  size_t start = out.size();
  for (size_t position = 0; position < token.size();) {
    Utf8Unit unit = next_utf8_unit(token, position);
    int byte = -1;
    if (unit.kind == Utf8Unit::Character) {
      size_t length = 0;
      uint32_t code_point = code_point_at(token, position, &length);
      if (code_point < alphabet.byte_of_code_point.size()) byte = alphabet.byte_of_code_point[code_point];
    }
    if (byte < 0) {
      out.resize(start);
      out.append(token);
      return;
    }
    out += static_cast<char>(byte);
    position += unit.length;
  }
}

// ===================================================================== regex

// Rewrites the escapes whose meaning differs between Oniguruma (Ruby syntax,
// as the HF library compiles its regexes) and PCRE2: \s (and \S outside
// classes) become explicit White_Space classes, and \h / \H, hex digits to
// Oniguruma, stop meaning horizontal space.
std::string rewrite_oniguruma_escapes(const std::string& pattern) {
  const std::string body(kWhiteSpaceClassBody);
  const std::string hex_body = "0-9a-fA-F";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size();) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char escaped = pattern[i + 1];
      if (escaped == 's') {
        out += in_class ? body : "[" + body + "]";
      } else if (escaped == 'S' && !in_class) {
        out += "[^" + body + "]";
      } else if (escaped == 'h') {
        out += in_class ? hex_body : "[" + hex_body + "]";
      } else if (escaped == 'H' && !in_class) {
        out += "[^" + hex_body + "]";
      } else if (escaped == 'Q') {  // \Q...\E is literal text: copy it untouched
        size_t end = pattern.find("\\E", i + 2);
        end = end == std::string::npos ? pattern.size() : end + 2;
        out.append(pattern, i, end - i);
        i = end;
        continue;
      } else {
        out += c;
        out += escaped;
      }
      i += 2;
      continue;
    }
    out += c;
    ++i;
    if (!in_class && c == '[') {
      in_class = true;
      if (i < pattern.size() && pattern[i] == '^') out += pattern[i++];
      if (i < pattern.size() && pattern[i] == ']') out += pattern[i++];  // a leading ] is literal
    } else if (in_class && c == '[' && i < pattern.size() && pattern[i] == ':') {
      size_t end = pattern.find(":]", i);  // POSIX class such as [:alpha:]
      if (end != std::string::npos) {
        out.append(pattern, i, end + 2 - i);
        i = end + 2;
      }
    } else if (in_class && c == ']') {
      in_class = false;
    }
  }
  return out;
}

// A PCRE2 pattern compiled once (JIT when available) and shared by all calls.
class Regex {
 public:
  // `literal`: the pattern is plain text (Split's {"String": ...}).
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    std::string source = literal ? pattern : rewrite_oniguruma_escapes(pattern);
    uint32_t options = literal ? (PCRE2_LITERAL | PCRE2_UTF) : (PCRE2_UTF | PCRE2_UCP);
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                          &error_code, &error_offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof(message));
      fail(where, ": cannot compile regex \"", pattern, "\": ", reinterpret_cast<char*>(message),
           " (at offset ", error_offset, ")");
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // on failure the interpreter is used
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Every match [begin, end) in `text` (valid UTF-8), iterated as the onig
  // crate's find_iter does: an empty match right at the end of the previous
  // match is skipped by stepping one character.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const {
    std::vector<std::pair<size_t, size_t>> matches;
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    DSPARK_CHECK(data != nullptr, "out of memory for regex match data");
    size_t search_from = 0;
    bool have_previous = false;
    size_t previous_end = 0;
    while (search_from <= text.size()) {
      int status = match(text, search_from, data, 0);
      if (status == PCRE2_ERROR_JIT_STACKLIMIT) status = match(text, search_from, data, PCRE2_NO_JIT);
      if (status == PCRE2_ERROR_NOMATCH) break;
      if (status < 0) {
        pcre2_match_data_free(data);
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(status, message, sizeof(message));
        fail("tokenizer regex match failed: ", reinterpret_cast<char*>(message));
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
      size_t begin = ovector[0], end = ovector[1];
      if (begin == end && have_previous && previous_end == end) {
        search_from += search_from < text.size()
                           ? utf8_sequence_length(static_cast<uint8_t>(text[search_from]))
                           : 1;
        continue;
      }
      search_from = end;
      have_previous = true;
      previous_end = end;
      matches.emplace_back(begin, end);
    }
    pcre2_match_data_free(data);
    return matches;
  }

 private:
  int match(std::string_view text, size_t start, pcre2_match_data* data, uint32_t options) const {
    return pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                       options | PCRE2_NO_UTF_CHECK, data, nullptr);
  }
  pcre2_code* code_ = nullptr;
};

// GPT-2's pre-tokenization regex, built into HF's ByteLevel pre-tokenizer.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF NormalizedString::split on plain text: cuts `text` at the pattern's
// matches and appends the non-empty pieces `behavior` keeps.
void split_by_pattern(std::string_view text, const Regex& regex, bool invert, SplitBehavior behavior,
                      std::vector<std::string>& pieces) {
  struct Span {
    size_t begin, end;
    bool flag;  // in `matches`: is a match; in `kept`: is removed
  };
  std::vector<Span> matches;
  if (text.empty()) {
    matches.push_back({0, 0, false});
  } else {
    size_t previous = 0;
    for (auto [begin, end] : regex.find_all(text)) {
      if (previous != begin) matches.push_back({previous, begin, false});
      matches.push_back({begin, end, true});
      previous = end;
    }
    if (previous != text.size()) matches.push_back({previous, text.size(), false});
  }
  if (invert) {
    for (Span& span : matches) span.flag = !span.flag;
  }
  std::vector<Span> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Span& span : matches) kept.push_back({span.begin, span.end, false});
      break;
    case SplitBehavior::Removed:
      kept = matches;
      break;
    case SplitBehavior::Contiguous:
      for (const Span& span : matches) {
        if (span.flag == previous_match && !kept.empty()) {
          kept.back().end = span.end;
        } else {
          kept.push_back({span.begin, span.end, false});
        }
        previous_match = span.flag;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Span& span : matches) {
        if (span.flag && !previous_match && !kept.empty()) {
          kept.back().end = span.end;
        } else {
          kept.push_back({span.begin, span.end, false});
        }
        previous_match = span.flag;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto span = matches.rbegin(); span != matches.rend(); ++span) {
        if (span->flag && !previous_match && !kept.empty()) {
          kept.back().begin = span->begin;
        } else {
          kept.push_back({span->begin, span->end, false});
        }
        previous_match = span->flag;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (const Span& span : kept) {
    if (!span.flag && span.end > span.begin) pieces.emplace_back(text.substr(span.begin, span.end - span.begin));
  }
}

// ================================================================ normalizer

enum class NormalForm { NFC, NFD, NFKC, NFKD };

std::string normalize_unicode(std::string_view text, NormalForm form) {
  bool ascii = std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; });
  if (ascii) return std::string(text);  // every normal form leaves ASCII alone
  int options = UTF8PROC_STABLE;
  if (form == NormalForm::NFC || form == NormalForm::NFKC) options |= UTF8PROC_COMPOSE;
  if (form == NormalForm::NFD || form == NormalForm::NFKD) options |= UTF8PROC_DECOMPOSE;
  if (form == NormalForm::NFKC || form == NormalForm::NFKD) options |= UTF8PROC_COMPAT;
  utf8proc_uint8_t* result = nullptr;
  utf8proc_ssize_t length = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                         static_cast<utf8proc_ssize_t>(text.size()), &result,
                                         static_cast<utf8proc_option_t>(options));
  DSPARK_CHECK(length >= 0, "Unicode normalization failed: ", utf8proc_errmsg(length));
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
  std::free(result);
  return out;
}

// ================================================================= BPE model

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
template <class Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  BpeModel(const Json& model, const std::string& where) {
    double dropout = json_get_or<double>(model, "dropout", 0.0, where);
    DSPARK_CHECK(dropout == 0.0, where, ": BPE dropout ", dropout, " is not supported (encoding would be random)");
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      unk_token_ = json_get<std::string>(model, "unk_token", where);
    }
    fuse_unk_ = json_get_or<bool>(model, "fuse_unk", false, where);
    byte_fallback_ = json_get_or<bool>(model, "byte_fallback", false, where);
    ignore_merges_ = json_get_or<bool>(model, "ignore_merges", false, where);
    continuing_subword_prefix_ = json_get_or<std::string>(model, "continuing_subword_prefix", "", where);
    end_of_word_suffix_ = json_get_or<std::string>(model, "end_of_word_suffix", "", where);

    DSPARK_CHECK(model.contains("vocab") && model["vocab"].is_object(), where,
                 ": missing field \"vocab\" (an object of token -> id)");
    const Json& vocab = model["vocab"];
    vocab_.reserve(vocab.size());
    for (auto entry = vocab.begin(); entry != vocab.end(); ++entry) {
      DSPARK_CHECK(entry.value().is_number_integer() && entry.value().get<int64_t>() >= 0 &&
                       entry.value().get<int64_t>() < (int64_t{1} << 30),
                   where, ": vocab entry \"", entry.key(), "\" has no valid id");
      vocab_.insert_or_assign(entry.key(), entry.value().get<int>());
    }
    for (const auto& [token, id] : vocab_) {
      if (static_cast<size_t>(id) >= token_of_id_.size()) token_of_id_.resize(id + 1, nullptr);
      token_of_id_[id] = &token;
    }

    DSPARK_CHECK(model.contains("merges") && model["merges"].is_array(), where,
                 ": missing field \"merges\" (an array)");
    const Json& merges = model["merges"];
    merges_.reserve(merges.size());
    uint32_t rank = 0;
    for (const Json& merge : merges) {
      std::string left, right;
      if (merge.is_string()) {  // legacy "a b"
        const std::string& line = merge.get_ref<const std::string&>();
        if (line.rfind("#version", 0) == 0) continue;
        size_t space = line.find(' ');
        DSPARK_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos, where,
                     ": merge ", rank + 1, " \"", line, "\" is not two tokens separated by one space");
        left = line.substr(0, space);
        right = line.substr(space + 1);
      } else {
        DSPARK_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                     where, ": merge ", rank + 1, " is neither \"a b\" nor [\"a\", \"b\"]");
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      }
      DSPARK_CHECK(right.size() >= continuing_subword_prefix_.size(), where, ": merge ", rank + 1,
                   " right side \"", right, "\" is shorter than continuing_subword_prefix");
      std::string merged = left + right.substr(continuing_subword_prefix_.size());
      int left_id = required_id(left, rank, where);
      int right_id = required_id(right, rank, where);
      int merged_id = required_id(merged, rank, where);
      // A repeated pair keeps its last rank, as the HF builder's map does.
      merges_.insert_or_assign(pair_key(left_id, right_id), MergeRule{rank, merged_id});
      ++rank;
    }
    if (unk_token_) {
      auto unk = vocab_.find(*unk_token_);
      DSPARK_CHECK(unk != vocab_.end(), where, ": unk_token \"", *unk_token_, "\" is not in the vocab");
      unk_id_ = unk->second;
    }
  }

  size_t entry_count() const { return vocab_.size(); }
  int largest_id() const { return static_cast<int>(token_of_id_.size()) - 1; }

  std::optional<int> token_to_id(std::string_view token) const {
    auto found = vocab_.find(token);
    if (found == vocab_.end()) return std::nullopt;
    return found->second;
  }

  const std::string* id_to_token(int id) const {
    if (id < 0 || static_cast<size_t>(id) >= token_of_id_.size()) return nullptr;
    return token_of_id_[id];
  }

  // Appends the ids of one pre-token.
  void tokenize(std::string_view word, std::vector<int>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      auto whole = vocab_.find(word);
      if (whole != vocab_.end()) {
        ids.push_back(whole->second);
        return;
      }
    }
    bool cacheable = word.size() < kMaxCachedWordBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto hit = cache_.find(word);
      if (hit != cache_.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    std::vector<int> word_ids = merge_word(word);
    ids.insert(ids.end(), word_ids.begin(), word_ids.end());
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() >= kCacheCapacity) cache_.clear();
      cache_.emplace(std::string(word), std::move(word_ids));
    }
  }

 private:
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kCacheCapacity = 10000;

  struct MergeRule {
    uint32_t rank;
    int merged_id;
  };

  static uint64_t pair_key(int left, int right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  int required_id(const std::string& token, uint32_t rank, const std::string& where) const {
    auto found = vocab_.find(token);
    DSPARK_CHECK(found != vocab_.end(), where, ": merge ", rank + 1, " uses \"", token,
                 "\", which is not in the vocab");
    return found->second;
  }

  // The word as characters, then merged by lowest rank first (ties: leftmost),
  // exactly as the HF Word::merge_all does, in O(n log n).
  std::vector<int> merge_word(std::string_view word) const {
    struct Symbol {
      int id;
      int previous;
      int next;
      size_t length;  // bytes of the word covered; 0 once merged into its left neighbour
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    auto add_symbol = [&symbols](int id, size_t length) {
      int index = static_cast<int>(symbols.size());
      if (!symbols.empty()) symbols.back().next = index;
      symbols.push_back({id, index - 1, -1, length});
    };

    // An unknown-character run not yet added (fuse_unk grows it): its bytes, 0 when none.
    size_t pending_unknown_bytes = 0;
    auto flush_unknown = [&] {
      if (pending_unknown_bytes > 0) add_symbol(*unk_id_, pending_unknown_bytes);
      pending_unknown_bytes = 0;
    };
    std::string piece;
    for (size_t position = 0; position < word.size();) {
      size_t length = utf8_sequence_length(static_cast<uint8_t>(word[position]));
      length = std::min(length, word.size() - position);
      bool first = position == 0, last = position + length == word.size();
      piece.clear();
      if (!first) piece += continuing_subword_prefix_;
      piece.append(word.substr(position, length));
      if (last) piece += end_of_word_suffix_;
      position += length;

      auto found = vocab_.find(piece);
      if (found != vocab_.end()) {
        flush_unknown();
        add_symbol(found->second, length);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int> byte_ids;
        for (char byte : piece) {
          static const char* kHex = "0123456789ABCDEF";
          uint8_t value = static_cast<uint8_t>(byte);
          std::string name = {'<', '0', 'x', kHex[value >> 4], kHex[value & 15], '>'};
          auto byte_token = vocab_.find(name);
          if (byte_token == vocab_.end()) break;
          byte_ids.push_back(byte_token->second);
        }
        if (byte_ids.size() == piece.size()) {
          for (int id : byte_ids) add_symbol(id, 1);
          continue;
        }
      }
      if (unk_id_) {
        if (!fuse_unk_) flush_unknown();
        pending_unknown_bytes += length;
      }
      // Without an unk token an unknown character is dropped, as HF does.
    }
    flush_unknown();

    struct Candidate {
      uint32_t rank;
      int position;
      int merged_id;
    };
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
    auto rule_for = [this](int left, int right) -> const MergeRule* {
      auto found = merges_.find(pair_key(left, right));
      return found == merges_.end() ? nullptr : &found->second;
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      if (const MergeRule* rule = rule_for(symbols[i].id, symbols[i + 1].id)) {
        queue.push({rule->rank, static_cast<int>(i), rule->merged_id});
      }
    }
    while (!queue.empty()) {
      Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.position];
      if (left.length == 0 || left.next == -1) continue;
      int right_position = left.next;
      Symbol right = symbols[right_position];
      // Stale entries (a neighbour changed since) are recognised by the result they would give.
      const MergeRule* current = rule_for(left.id, right.id);
      if (current == nullptr || current->merged_id != top.merged_id) continue;

      left.id = top.merged_id;
      left.length += right.length;
      left.next = right.next;
      symbols[right_position].length = 0;
      if (right.next > -1 && static_cast<size_t>(right.next) < symbols.size()) {
        symbols[right.next].previous = top.position;
      }
      if (left.previous >= 0) {
        if (const MergeRule* rule = rule_for(symbols[left.previous].id, left.id)) {
          queue.push({rule->rank, left.previous, rule->merged_id});
        }
      }
      if (left.next >= 0 && static_cast<size_t>(left.next) < symbols.size()) {
        if (const MergeRule* rule = rule_for(left.id, symbols[left.next].id)) {
          queue.push({rule->rank, top.position, rule->merged_id});
        }
      }
    }
    std::vector<int> ids;
    for (const Symbol& symbol : symbols) {
      if (symbol.length != 0) ids.push_back(symbol.id);
    }
    return ids;
  }

  StringMap<int> vocab_;
  std::vector<const std::string*> token_of_id_;  // keys of vocab_ (node-based, so stable)
  std::unordered_map<uint64_t, MergeRule> merges_;
  std::optional<std::string> unk_token_;
  std::optional<int> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  mutable std::mutex cache_mutex_;
  mutable StringMap<std::vector<int>> cache_;
};

// ============================================================== added tokens

struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

struct TokenMatch {
  size_t begin, end;
  int id;
};

// A byte trie over added-token texts giving leftmost-longest matches (the
// aho-corasick MatchKind::LeftmostLongest the HF library uses).
class TokenTrie {
 public:
  void insert(std::string_view text, int id) {
    int node = 0;
    for (char byte : text) {
      uint64_t key = edge_key(node, byte);
      auto found = edges_.find(key);
      if (found == edges_.end()) {
        ids_.push_back(-1);
        found = edges_.emplace(key, static_cast<int>(ids_.size()) - 1).first;
      }
      node = found->second;
    }
    ids_[node] = id;
    starts_[static_cast<uint8_t>(text[0])] = true;
    empty_ = false;
  }

  bool empty() const { return empty_; }

  std::optional<TokenMatch> find(std::string_view text, size_t from) const {
    for (size_t begin = from; begin < text.size(); ++begin) {
      if (!starts_[static_cast<uint8_t>(text[begin])]) continue;
      int node = 0;
      std::optional<TokenMatch> longest;
      for (size_t position = begin; position < text.size(); ++position) {
        auto found = edges_.find(edge_key(node, text[position]));
        if (found == edges_.end()) break;
        node = found->second;
        if (ids_[node] >= 0) longest = TokenMatch{begin, position + 1, ids_[node]};
      }
      if (longest) return longest;
    }
    return std::nullopt;
  }

 private:
  static uint64_t edge_key(int node, char byte) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(byte);
  }
  std::vector<int> ids_ = {-1};  // per node: the token ending there, or -1; node 0 is the root
  std::unordered_map<uint64_t, int> edges_;
  std::array<bool, 256> starts_{};
  bool empty_ = true;
};

// A piece of the input: plain text, or an added token already recognised.
struct Segment {
  std::string text;
  int token_id = -1;
};

// ================================================== pre-tokenizer / processors

struct PreTokenizerStep {
  enum class Kind { ByteLevel, Split } kind = Kind::Split;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = true;          // ByteLevel: split with the GPT-2 pattern first
  std::shared_ptr<const Regex> regex;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
};

struct PostProcessorStep {
  enum class Kind { Template, Wrap } kind = Kind::Template;
  struct Piece {
    bool is_sequence;
    std::vector<int> ids;  // the special token's ids
  };
  std::vector<Piece> single;  // Template
  int first_id = 0;           // Wrap (Bert / Roberta): cls
  int last_id = 0;            // Wrap: sep
};

enum class DecoderKind { None, ByteLevel };

std::string type_of(const Json& component, const std::string& where) {
  DSPARK_CHECK(component.is_object(), where, " must be an object or null");
  return json_get<std::string>(component, "type", where);
}

void parse_normalizer(const Json& normalizer, const std::string& where, std::vector<NormalForm>& forms) {
  if (normalizer.is_null()) return;
  std::string type = type_of(normalizer, where);
  if (type == "Sequence") {
    DSPARK_CHECK(normalizer.contains("normalizers") && normalizer["normalizers"].is_array(), where,
                 ": Sequence without a \"normalizers\" array");
    for (const Json& inner : normalizer["normalizers"]) parse_normalizer(inner, where, forms);
  } else if (type == "NFC") {
    forms.push_back(NormalForm::NFC);
  } else if (type == "NFD") {
    forms.push_back(NormalForm::NFD);
  } else if (type == "NFKC") {
    forms.push_back(NormalForm::NFKC);
  } else if (type == "NFKD") {
    forms.push_back(NormalForm::NFKD);
  } else {
    fail(where, ": normalizer type \"", type, "\" is not supported (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

SplitBehavior parse_split_behavior(const std::string& name, const std::string& where) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  fail(where, ": Split behavior \"", name,
       "\" is unknown (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

void parse_pre_tokenizer(const Json& pre_tokenizer, const std::string& where,
                         std::vector<PreTokenizerStep>& steps) {
  if (pre_tokenizer.is_null()) return;
  std::string type = type_of(pre_tokenizer, where);
  if (type == "Sequence") {
    DSPARK_CHECK(pre_tokenizer.contains("pretokenizers") && pre_tokenizer["pretokenizers"].is_array(), where,
                 ": Sequence without a \"pretokenizers\" array");
    for (const Json& inner : pre_tokenizer["pretokenizers"]) parse_pre_tokenizer(inner, where, steps);
  } else if (type == "ByteLevel") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::ByteLevel;
    step.add_prefix_space = json_get_or<bool>(pre_tokenizer, "add_prefix_space", true, where);
    step.use_regex = json_get_or<bool>(pre_tokenizer, "use_regex", true, where);
    if (step.use_regex) step.regex = std::make_shared<Regex>(kGpt2Pattern, false, where);
    steps.push_back(std::move(step));
  } else if (type == "Split") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Kind::Split;
    const Json& pattern = pre_tokenizer.value("pattern", Json());
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      step.regex = std::make_shared<Regex>(pattern["Regex"].get<std::string>(), false, where);
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      std::string literal = pattern["String"].get<std::string>();
      // An empty string pattern matches nothing, as in the HF library.
      step.regex = literal.empty() ? std::make_shared<Regex>("(*FAIL)", false, where)
                                   : std::make_shared<Regex>(literal, true, where);
    } else {
      fail(where, ": Split pattern must be {\"Regex\": ...} or {\"String\": ...}");
    }
    step.behavior = parse_split_behavior(json_get<std::string>(pre_tokenizer, "behavior", where), where);
    step.invert = json_get_or<bool>(pre_tokenizer, "invert", false, where);
    steps.push_back(std::move(step));
  } else {
    fail(where, ": pre_tokenizer type \"", type, "\" is not supported (supported: ByteLevel, Split, Sequence)");
  }
}

DecoderKind parse_decoder(const Json& decoder, const std::string& where) {
  if (decoder.is_null()) return DecoderKind::None;
  std::string type = type_of(decoder, where);
  if (type == "ByteLevel") return DecoderKind::ByteLevel;
  if (type == "Sequence") {
    DSPARK_CHECK(decoder.contains("decoders") && decoder["decoders"].is_array(), where,
                 ": Sequence without a \"decoders\" array");
    size_t byte_level_count = 0;
    for (const Json& inner : decoder["decoders"]) {
      std::string inner_type = type_of(inner, where);
      DSPARK_CHECK(inner_type == "ByteLevel", where, ": decoder type \"", inner_type,
                   "\" inside Sequence is not supported (supported: ByteLevel)");
      ++byte_level_count;
    }
    DSPARK_CHECK(byte_level_count == 1, where, ": decoder Sequence must hold exactly one ByteLevel");
    return DecoderKind::ByteLevel;
  }
  fail(where, ": decoder type \"", type, "\" is not supported (supported: ByteLevel, Sequence of ByteLevel)");
}

}  // namespace

// ============================================================ implementation

struct Tokenizer::Implementation {
  std::string tokenizer_file;  // for messages
  std::string config_file;
  std::vector<NormalForm> normal_forms;
  std::vector<PreTokenizerStep> pre_tokenizer_steps;
  std::unique_ptr<BpeModel> model;
  std::unordered_map<int, AddedToken> added_tokens;  // by id
  StringMap<int> added_token_ids;                    // by content
  std::unordered_map<int, std::string> added_token_text;  // normalized content, where it differs
  std::unordered_set<std::string> special_contents;
  TokenTrie raw_trie;         // added tokens with normalized=false, matched on the raw text
  TokenTrie normalized_trie;  // normalized=true, matched after the normalizer
  std::vector<PostProcessorStep> post_processor_steps;
  DecoderKind decoder = DecoderKind::None;
  int vocab_size = 0;
  std::string bos_text;
  std::optional<int> bos_id, eos_id;
  std::string chat_template;

  std::string normalize(std::string_view text) const {
    std::string out(text);
    for (NormalForm form : normal_forms) out = normalize_unicode(out, form);
    return out;
  }

  // AddedVocabulary::find_matches: cuts `text` at the added tokens of `trie`,
  // applying single_word / lstrip / rstrip. Empty plain pieces are dropped.
  void split_added_tokens(const std::string& text, const TokenTrie& trie, std::vector<Segment>& out) const {
    if (trie.empty()) {
      if (!text.empty()) out.push_back({text, -1});
      return;
    }
    size_t start_offset = 0, search_from = 0;
    while (std::optional<TokenMatch> match = trie.find(text, search_from)) {
      search_from = match->end;
      size_t start = match->begin, stop = match->end;
      const AddedToken& token = added_tokens.at(match->id);
      if (token.single_word) {
        size_t unused = 0;
        bool space_before = start == 0 || !is_word_character(code_point_before(text, start, &unused));
        bool space_after = stop == text.size() || !is_word_character(code_point_at(text, stop, &unused));
        if (!space_before || !space_after) continue;
      }
      if (token.lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          size_t character_start = 0;
          if (!is_white_space(code_point_before(text, new_start, &character_start))) break;
          new_start = character_start;
        }
        start = std::max(new_start, start_offset);  // an earlier rstrip may own those spaces
      }
      if (token.rstrip) {
        while (stop < text.size()) {
          size_t length = 0;
          if (!is_white_space(code_point_at(text, stop, &length))) break;
          stop += length;
        }
      }
      if (start_offset < start) out.push_back({text.substr(start_offset, start - start_offset), -1});
      out.push_back({text.substr(start, stop - start), match->id});
      start_offset = stop;
    }
    if (start_offset < text.size()) out.push_back({text.substr(start_offset), -1});
  }

  // Pre-tokenizer then BPE on one normalized plain-text segment.
  void append_text_ids(const std::string& text, std::vector<int>& ids) const {
    std::vector<std::string> pieces{text};
    std::vector<std::string> next;
    for (const PreTokenizerStep& step : pre_tokenizer_steps) {
      next.clear();
      for (std::string& piece : pieces) {
        if (step.kind == PreTokenizerStep::Kind::Split) {
          split_by_pattern(piece, *step.regex, step.invert, step.behavior, next);
          continue;
        }
        if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece.insert(0, " ");
        size_t first_new = next.size();
        if (step.use_regex) {
          split_by_pattern(piece, *step.regex, false, SplitBehavior::Isolated, next);
        } else if (!piece.empty()) {
          next.push_back(std::move(piece));
        }
        for (size_t i = first_new; i < next.size(); ++i) next[i] = byte_level_encode(next[i]);
      }
      std::swap(pieces, next);
    }
    for (const std::string& piece : pieces) model->tokenize(piece, ids);
  }

  // The token text HF decode() works from (an added token's normalized form
  // when the normalizer changes it), or nullptr for an unknown id.
  const std::string* decode_text(int id) const {
    auto added = added_tokens.find(id);
    if (added != added_tokens.end()) {
      auto normalized = added_token_text.find(id);
      return normalized != added_token_text.end() ? &normalized->second : &added->second.content;
    }
    return model->id_to_token(id);
  }

  // Appends what one token contributes to decode() before the final UTF-8
  // repair; false when the token is skipped (unknown, or special and skipped).
  bool append_decoded(int id, bool skip_special_tokens, bool first, std::string& bytes) const {
    const std::string* text = decode_text(id);
    if (text == nullptr) return false;
    if (skip_special_tokens && special_contents.count(*text) != 0) return false;
    if (decoder == DecoderKind::ByteLevel) {
      append_byte_level_decoded(*text, bytes);
    } else {
      if (!first) bytes += ' ';  // without a decoder HF joins the token texts with spaces
      bytes += *text;
    }
    return true;
  }
};

Tokenizer::Tokenizer(std::shared_ptr<const Implementation> implementation)
    : implementation_(std::move(implementation)) {}

namespace {

// bos_token / eos_token in tokenizer_config.json: a string, {"content": ...}, or null.
std::optional<std::string> config_token(const Json& config, const std::string& key, const std::string& where) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const Json& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object()) return json_get<std::string>(value, "content", where + " " + key);
  fail(where, ": ", key, " must be a string or an object with \"content\"");
}

void parse_post_processor(const Json& processor, const std::string& where,
                          std::vector<PostProcessorStep>& steps) {
  if (processor.is_null()) return;
  std::string type = type_of(processor, where);
  if (type == "Sequence") {
    DSPARK_CHECK(processor.contains("processors") && processor["processors"].is_array(), where,
                 ": Sequence without a \"processors\" array");
    for (const Json& inner : processor["processors"]) parse_post_processor(inner, where, steps);
  } else if (type == "ByteLevel") {
    // Only trims offsets; ids are unchanged.
  } else if (type == "TemplateProcessing") {
    PostProcessorStep step;
    step.kind = PostProcessorStep::Kind::Template;
    const Json& special_tokens = processor.value("special_tokens", Json::object());
    DSPARK_CHECK(processor.contains("single") && processor["single"].is_array(), where,
                 ": TemplateProcessing without a \"single\" array of pieces");
    for (const Json& piece : processor["single"]) {
      if (piece.is_object() && piece.contains("Sequence")) {
        std::string sequence = json_get<std::string>(piece["Sequence"], "id", where + " Sequence piece");
        DSPARK_CHECK(sequence == "A", where, ": TemplateProcessing single template uses sequence ", sequence);
        step.single.push_back({true, {}});
      } else if (piece.is_object() && piece.contains("SpecialToken")) {
        std::string name = json_get<std::string>(piece["SpecialToken"], "id", where + " SpecialToken piece");
        DSPARK_CHECK(special_tokens.is_object() && special_tokens.contains(name), where,
                     ": TemplateProcessing special token \"", name, "\" is missing from special_tokens");
        std::vector<int> ids =
            json_get<std::vector<int>>(special_tokens[name], "ids", where + " special_tokens." + name);
        step.single.push_back({false, std::move(ids)});
      } else {
        fail(where, ": TemplateProcessing piece ", piece.dump(), " is neither Sequence nor SpecialToken");
      }
    }
    steps.push_back(std::move(step));
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    PostProcessorStep step;
    step.kind = PostProcessorStep::Kind::Wrap;
    auto token_id = [&](const char* key) {
      DSPARK_CHECK(processor.contains(key) && processor[key].is_array() && processor[key].size() == 2 &&
                       processor[key][1].is_number_integer(),
                   where, ": ", type, " field \"", key, "\" must be [token, id]");
      return processor[key][1].get<int>();
    };
    step.first_id = token_id("cls");
    step.last_id = token_id("sep");
    steps.push_back(std::move(step));
  } else {
    fail(where, ": post_processor type \"", type,
         "\" is not supported (supported: ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing, "
         "Sequence)");
  }
}

}  // namespace

Tokenizer Tokenizer::load(const std::filesystem::path& model_directory) {
  auto implementation = std::make_shared<Implementation>();
  Implementation& self = *implementation;
  std::filesystem::path tokenizer_path = model_directory / "tokenizer.json";
  std::filesystem::path config_path = model_directory / "tokenizer_config.json";
  self.tokenizer_file = tokenizer_path.string();
  self.config_file = config_path.string();
  const std::string& where = self.tokenizer_file;
  DSPARK_CHECK(std::filesystem::exists(tokenizer_path), "missing file ", where,
               " (a Hugging Face tokenizer.json is needed)");
  Json tokenizer = read_json_file(tokenizer_path);
  DSPARK_CHECK(tokenizer.is_object(), where, ": expected a JSON object");

  // Model first: the added tokens take their ids from its vocab.
  DSPARK_CHECK(tokenizer.contains("model") && tokenizer["model"].is_object(), where, ": missing \"model\"");
  const Json& model = tokenizer["model"];
  std::string model_type = model.contains("type") ? json_get<std::string>(model, "type", where + " model")
                                                  : std::string(model.contains("merges") ? "BPE" : "?");
  DSPARK_CHECK(model_type == "BPE", where, ": model type \"", model_type, "\" is not supported (supported: BPE)");
  self.model = std::make_unique<BpeModel>(model, where + " model");

  parse_normalizer(tokenizer.value("normalizer", Json()), where + " normalizer", self.normal_forms);
  parse_pre_tokenizer(tokenizer.value("pre_tokenizer", Json()), where + " pre_tokenizer",
                      self.pre_tokenizer_steps);
  self.decoder = parse_decoder(tokenizer.value("decoder", Json()), where + " decoder");

  // Added tokens get ids the way HF's AddedVocabulary::add_tokens gives them:
  // the vocab's id when the content is in the vocab, else the next free id
  // after the vocab (HF ignores the "id" written in the file, only warning).
  const Json& added = tokenizer.value("added_tokens", Json::array());
  DSPARK_CHECK(added.is_array(), where, ": \"added_tokens\" must be an array");
  int next_id = static_cast<int>(self.model->entry_count());
  for (const Json& entry : added) {
    std::string entry_where = where + " added_tokens";
    AddedToken token;
    token.content = json_get<std::string>(entry, "content", entry_where);
    token.special = json_get_or<bool>(entry, "special", false, entry_where);
    token.single_word = json_get_or<bool>(entry, "single_word", false, entry_where);
    token.lstrip = json_get_or<bool>(entry, "lstrip", false, entry_where);
    token.rstrip = json_get_or<bool>(entry, "rstrip", false, entry_where);
    token.normalized = json_get_or<bool>(entry, "normalized", !token.special, entry_where);
    if (token.content.empty()) continue;
    int id;
    if (auto existing = self.added_token_ids.find(token.content); existing != self.added_token_ids.end()) {
      id = existing->second;
    } else if (std::optional<int> in_vocab = self.model->token_to_id(token.content)) {
      id = *in_vocab;
    } else {
      id = next_id++;
    }
    if (token.normalized && !self.normal_forms.empty()) {
      std::string normalized = self.normalize(token.content);
      if (normalized != token.content) self.added_token_text[id] = normalized;
    }
    self.added_token_ids.insert_or_assign(token.content, id);
    if (token.special) self.special_contents.insert(token.content);
    self.added_tokens.insert_or_assign(id, std::move(token));
  }
  for (const auto& [id, token] : self.added_tokens) {
    if (token.normalized) {
      auto normalized = self.added_token_text.find(id);
      self.normalized_trie.insert(normalized != self.added_token_text.end() ? normalized->second : token.content,
                                  id);
    } else {
      self.raw_trie.insert(token.content, id);
    }
  }

  auto id_of = [&self](const std::string& token) {
    auto added_id = self.added_token_ids.find(token);
    if (added_id != self.added_token_ids.end()) return added_id->second;
    return self.model->token_to_id(token).value_or(-1);
  };
  parse_post_processor(tokenizer.value("post_processor", Json()), where + " post_processor",
                       self.post_processor_steps);

  self.vocab_size = self.model->largest_id() + 1;
  for (const auto& [id, token] : self.added_tokens) self.vocab_size = std::max(self.vocab_size, id + 1);

  if (std::filesystem::exists(config_path)) {
    const std::string& config_where = self.config_file;
    Json config = read_json_file(config_path);
    DSPARK_CHECK(config.is_object(), config_where, ": expected a JSON object");
    auto resolve = [&](const char* key) -> std::optional<int> {
      std::optional<std::string> text = config_token(config, key, config_where);
      if (!text) return std::nullopt;
      int id = id_of(*text);
      DSPARK_CHECK(id >= 0, config_where, ": ", key, " \"", *text, "\" is not a token of ", where);
      if (std::string(key) == "bos_token") self.bos_text = *text;
      return id;
    };
    self.bos_id = resolve("bos_token");
    self.eos_id = resolve("eos_token");
    if (config.contains("chat_template") && !config["chat_template"].is_null()) {
      const Json& templates = config["chat_template"];
      if (templates.is_string()) {
        self.chat_template = templates.get<std::string>();
      } else if (templates.is_array()) {  // [{"name": ..., "template": ...}]: take "default"
        for (const Json& named : templates) {
          std::string name = json_get<std::string>(named, "name", config_where + " chat_template");
          if (name == "default" || self.chat_template.empty()) {
            self.chat_template = json_get<std::string>(named, "template", config_where + " chat_template");
          }
          if (name == "default") break;
        }
      } else {
        fail(config_where, ": chat_template must be a string or a list of {name, template}");
      }
    }
  }
  std::filesystem::path jinja_path = model_directory / "chat_template.jinja";
  if (self.chat_template.empty() && std::filesystem::exists(jinja_path)) {
    self.chat_template = read_text_file(jinja_path);
  }
  return Tokenizer(std::move(implementation));
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Implementation& self = *implementation_;
  std::string input;
  if (is_valid_utf8(text)) {
    input.assign(text);
  } else {
    append_lossy_utf8(text, false, input);
  }

  // 1. added tokens matched on the raw text; 2. the normalizer on what is
  // left, then the normalized added tokens; 3. pre-tokenizer and BPE.
  std::vector<Segment> raw_segments;
  self.split_added_tokens(input, self.raw_trie, raw_segments);
  std::vector<int> ids;
  std::vector<Segment> segments;
  for (const Segment& raw : raw_segments) {
    if (raw.token_id >= 0) {
      ids.push_back(raw.token_id);
      continue;
    }
    segments.clear();
    self.split_added_tokens(self.normalize(raw.text), self.normalized_trie, segments);
    for (const Segment& segment : segments) {
      if (segment.token_id >= 0) {
        ids.push_back(segment.token_id);
      } else {
        self.append_text_ids(segment.text, ids);
      }
    }
  }

  for (const PostProcessorStep& step : self.post_processor_steps) {
    if (!add_special_tokens && step.kind == PostProcessorStep::Kind::Wrap) continue;
    std::vector<int> processed;
    if (step.kind == PostProcessorStep::Kind::Wrap) {
      processed.push_back(step.first_id);
      processed.insert(processed.end(), ids.begin(), ids.end());
      processed.push_back(step.last_id);
    } else {
      for (const PostProcessorStep::Piece& piece : step.single) {
        if (!piece.is_sequence && !add_special_tokens) continue;  // the template without its specials
        const std::vector<int>& part = piece.is_sequence ? ids : piece.ids;
        processed.insert(processed.end(), part.begin(), part.end());
      }
    }
    ids = std::move(processed);
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int> ids, bool skip_special_tokens) const {
  const Implementation& self = *implementation_;
  std::string bytes;
  bool first = true;
  for (int id : ids) {
    if (self.append_decoded(id, skip_special_tokens, first, bytes)) first = false;
  }
  if (self.decoder == DecoderKind::None) return bytes;
  std::string text;
  append_lossy_utf8(bytes, false, text);
  return text;
}

std::string Tokenizer::token_bytes(int id) const {
  const Implementation& self = *implementation_;
  auto added = self.added_tokens.find(id);
  if (added != self.added_tokens.end()) return added->second.content;
  const std::string* text = self.model->id_to_token(id);
  DSPARK_CHECK(text != nullptr, self.tokenizer_file, ": token id ", id, " is not in the vocabulary");
  if (self.decoder == DecoderKind::None) return *text;
  std::string bytes;
  append_byte_level_decoded(*text, bytes);
  return bytes;
}

int Tokenizer::vocab_size() const { return implementation_->vocab_size; }

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  const Implementation& self = *implementation_;
  auto added = self.added_token_ids.find(token);
  if (added != self.added_token_ids.end()) return added->second;
  return self.model->token_to_id(token);
}

bool Tokenizer::is_special(int id) const {
  auto added = implementation_->added_tokens.find(id);
  return added != implementation_->added_tokens.end() && added->second.special;
}

std::optional<int> Tokenizer::bos_token_id() const { return implementation_->bos_id; }
std::optional<int> Tokenizer::eos_token_id() const { return implementation_->eos_id; }
const std::string& Tokenizer::chat_template_source() const { return implementation_->chat_template; }

std::string Tokenizer::apply_chat_template(const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt) const {
  const Implementation& self = *implementation_;
  ChatFormat format = detect_chat_format(self.chat_template, self.config_file);
  return render_chat(format, messages, add_generation_prompt, self.bos_text);
}

// ======================================================== streaming decoder

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamingDecoder::push(int id) {
  const Tokenizer::Implementation& self = *tokenizer_.implementation_;
  if (self.decoder == DecoderKind::None) {
    std::string text;
    if (self.append_decoded(id, skip_special_tokens_, first_token_, text)) first_token_ = false;
    return text;
  }
  if (self.append_decoded(id, skip_special_tokens_, first_token_, pending_bytes_)) first_token_ = false;
  std::string text;
  size_t consumed = append_lossy_utf8(pending_bytes_, true, text);
  pending_bytes_.erase(0, consumed);
  return text;
}

std::string StreamingDecoder::finish() {
  std::string text;
  append_lossy_utf8(pending_bytes_, false, text);
  pending_bytes_.clear();
  return text;
}

}  // namespace dspark
