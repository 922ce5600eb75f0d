// Regenerated training data on disk (DESIGN.md §4): what `dspark regen` writes
// and `dspark train` reads.
//
//   DATA/manifest.json          what the data is, and where each sequence lives
//   DATA/shard-00000.safetensors  "ids"  I32  [N]        the tokens of its sequences, back to back
//                                 "rows" BF16 [N, m·H]   each token's m tapped target rows
//
// A sequence is prompt + response: ids[0, prompt_length) is the prompt,
// ids[prompt_length, length) the target's answer (its stopping EOS included).
// Row i holds the tapped hidden states at token i, tap j's H features at
// [j·H, (j+1)·H); the last tap is the post-final-norm hidden, so its slice is
// what the target's LM head reads.
//
// Shape letters: N tokens in a shard, m taps, H target hidden.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/json.h"
#include "core/safetensors.h"

namespace dspark {

struct SequenceRecord {
  int shard = 0;          // index into RegenManifest::shards
  long offset = 0;        // first token's row within the shard
  int prompt_length = 0;  // P >= 1
  int length = 0;         // P + response length, > P
  int line = 0;           // the prompt's line in the prompts file
  std::string stop;       // why the response ended: "eos" | "length" | "context"
};

struct ShardRecord {
  std::string file;  // relative to the data directory
  int sequences = 0;
  long tokens = 0;
};

struct RegenManifest {
  std::string target_id;
  std::vector<int> tap_layers;       // m taps; the last is the target's layer count L
  int hidden_size = 0;               // H
  int vocab_size = 0;                // V
  int num_layers = 0;                // L
  Json generation = Json::object();  // the settings the responses were made with (checked on resume)
  bool complete = false;             // every prompt has its sequence
  std::vector<ShardRecord> shards;
  std::vector<SequenceRecord> sequences;  // in prompt order

  int tap_width() const { return static_cast<int>(tap_layers.size()) * hidden_size; }  // m·H
};

inline constexpr const char* kManifestFile = "manifest.json";

Json manifest_to_json(const RegenManifest& manifest);
RegenManifest manifest_from_json(const Json& json, const std::string& where);
RegenManifest read_manifest(const std::filesystem::path& data_directory);
// Atomic (temp + rename): an interrupted write leaves the previous manifest.
void write_manifest(const std::filesystem::path& data_directory, const RegenManifest& manifest);

// The shards of a data directory, mapped read-only, with every sequence's
// place checked against its shard's tensors up front.
class Dataset {
 public:
  explicit Dataset(const std::filesystem::path& data_directory);

  const RegenManifest& manifest() const { return manifest_; }
  int size() const { return static_cast<int>(manifest_.sequences.size()); }
  const SequenceRecord& sequence(int index) const { return manifest_.sequences[index]; }
  int tap_width() const { return manifest_.tap_width(); }    // m·H
  int hidden_size() const { return manifest_.hidden_size; }  // H

  const int32_t* ids(int index) const;    // [length]
  const uint16_t* rows(int index) const;  // [length, m·H] bf16 bits

 private:
  RegenManifest manifest_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
};

// The deterministic held-out split, by sequence: round(count · fraction)
// sequences (at least one when fraction > 0 and count >= 2), spread evenly
// over the indices (sequence i is held out when floor((i+1)·h/count) >
// floor(i·h/count)), so the split depends on nothing but the count.
struct DatasetSplit {
  std::vector<int> train;
  std::vector<int> held_out;
};
DatasetSplit split_dataset(int count, double held_out_fraction);

}  // namespace dspark
