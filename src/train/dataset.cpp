#include "train/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/file.h"

namespace dspark {

Json manifest_to_json(const RegenManifest& manifest) {
  Json shards = Json::array(), sequences = Json::array();
  for (const ShardRecord& shard : manifest.shards)
    shards.push_back({{"file", shard.file}, {"sequences", shard.sequences}, {"tokens", shard.tokens}});
  for (const SequenceRecord& sequence : manifest.sequences)
    sequences.push_back({{"shard", sequence.shard},
                         {"offset", sequence.offset},
                         {"prompt_length", sequence.prompt_length},
                         {"length", sequence.length},
                         {"line", sequence.line},
                         {"stop", sequence.stop}});
  return {{"kind", "dspark-regen"},
          {"version", 1},
          {"target_id", manifest.target_id},
          {"tap_layers", manifest.tap_layers},
          {"hidden_size", manifest.hidden_size},
          {"vocab_size", manifest.vocab_size},
          {"num_layers", manifest.num_layers},
          {"rows_dtype", "BF16"},
          {"generation", manifest.generation},
          {"complete", manifest.complete},
          {"shards", shards},
          {"sequences", sequences}};
}

RegenManifest manifest_from_json(const Json& json, const std::string& where) {
  DSPARK_CHECK(json_get_or<std::string>(json, "kind", "", where) == "dspark-regen", where,
               ": not regenerated training data (\"kind\" must be \"dspark-regen\")");
  RegenManifest manifest;
  manifest.target_id = json_get<std::string>(json, "target_id", where);
  manifest.tap_layers = json_get<std::vector<int>>(json, "tap_layers", where);
  manifest.hidden_size = json_get<int>(json, "hidden_size", where);
  manifest.vocab_size = json_get<int>(json, "vocab_size", where);
  manifest.num_layers = json_get<int>(json, "num_layers", where);
  manifest.generation = json_get_or<Json>(json, "generation", Json::object(), where);
  manifest.complete = json_get_or<bool>(json, "complete", false, where);
  DSPARK_CHECK(!manifest.tap_layers.empty() && manifest.hidden_size > 0 && manifest.vocab_size > 0, where,
               ": needs tap layers, a hidden size and a vocabulary size");
  DSPARK_CHECK(json_get_or<std::string>(json, "rows_dtype", "BF16", where) == "BF16", where,
               ": rows_dtype must be BF16");
  for (const Json& shard : json_get<Json>(json, "shards", where)) {
    const std::string shard_where = where + " shard";
    manifest.shards.push_back({json_get<std::string>(shard, "file", shard_where),
                               json_get<int>(shard, "sequences", shard_where),
                               json_get<long>(shard, "tokens", shard_where)});
  }
  const Json sequences = json_get<Json>(json, "sequences", where);
  for (size_t i = 0; i < sequences.size(); ++i) {
    const Json& entry = sequences[i];
    const std::string entry_where = where + " sequence " + std::to_string(i);
    SequenceRecord sequence;
    sequence.shard = json_get<int>(entry, "shard", entry_where);
    sequence.offset = json_get<long>(entry, "offset", entry_where);
    sequence.prompt_length = json_get<int>(entry, "prompt_length", entry_where);
    sequence.length = json_get<int>(entry, "length", entry_where);
    sequence.line = json_get_or<int>(entry, "line", 0, entry_where);
    sequence.stop = json_get_or<std::string>(entry, "stop", "", entry_where);
    DSPARK_CHECK(sequence.shard >= 0 && sequence.shard < static_cast<int>(manifest.shards.size()), entry_where,
                 ": shard ", sequence.shard, " is not listed");
    DSPARK_CHECK(sequence.prompt_length >= 1 && sequence.length > sequence.prompt_length && sequence.offset >= 0,
                 entry_where, ": needs 1 <= prompt_length < length (got ", sequence.prompt_length, ", ",
                 sequence.length, ")");
    manifest.sequences.push_back(std::move(sequence));
  }
  return manifest;
}

RegenManifest read_manifest(const std::filesystem::path& data_directory) {
  const std::filesystem::path path = data_directory / kManifestFile;
  DSPARK_CHECK(std::filesystem::exists(path), "no ", kManifestFile, " in ", data_directory.string(),
               " (make training data with `dspark regen`)");
  return manifest_from_json(read_json_file(path), path.string());
}

void write_manifest(const std::filesystem::path& data_directory, const RegenManifest& manifest) {
  write_text_file_atomic(data_directory / kManifestFile, manifest_to_json(manifest).dump(1) + "\n");
}

Dataset::Dataset(const std::filesystem::path& data_directory) : manifest_(read_manifest(data_directory)) {
  const long width = manifest_.tap_width();
  for (const ShardRecord& record : manifest_.shards) {
    auto shard = std::make_unique<SafetensorsFile>(data_directory / record.file);
    const std::string where = shard->path().string();
    DSPARK_CHECK(shard->contains("ids") && shard->contains("rows"), where, ": needs tensors \"ids\" and \"rows\"");
    const SafetensorsEntry& ids = shard->entry("ids");
    const SafetensorsEntry& rows = shard->entry("rows");
    DSPARK_CHECK(ids.dtype == Dtype::I32 && ids.shape == Shape{record.tokens}, where, ": \"ids\" must be I32 [",
                 record.tokens, "], got ", dtype_name(ids.dtype), " ", shape_string(ids.shape));
    DSPARK_CHECK(rows.dtype == Dtype::BF16 && rows.shape == (Shape{record.tokens, width}), where,
                 ": \"rows\" must be BF16 [", record.tokens, ", ", width, "], got ", dtype_name(rows.dtype), " ",
                 shape_string(rows.shape));
    DSPARK_CHECK(reinterpret_cast<uintptr_t>(shard->raw("ids")) % alignof(int32_t) == 0, where,
                 ": \"ids\" is not 4-byte aligned in the file");
    shards_.push_back(std::move(shard));
  }
  for (int i = 0; i < size(); ++i) {
    const SequenceRecord& sequence = manifest_.sequences[i];
    DSPARK_CHECK(sequence.offset + sequence.length <= manifest_.shards[sequence.shard].tokens, "sequence ", i,
                 " runs past the end of ", manifest_.shards[sequence.shard].file);
    const int32_t* tokens = ids(i);
    for (int t = 0; t < sequence.length; ++t)
      DSPARK_CHECK(tokens[t] >= 0 && tokens[t] < manifest_.vocab_size, "sequence ", i, " token ", t, " (", tokens[t],
                   ") is outside the vocabulary of ", manifest_.vocab_size);
  }
}

const int32_t* Dataset::ids(int index) const {
  const SequenceRecord& sequence = manifest_.sequences.at(index);
  return static_cast<const int32_t*>(shards_[sequence.shard]->raw("ids")) + sequence.offset;
}

const uint16_t* Dataset::rows(int index) const {
  const SequenceRecord& sequence = manifest_.sequences.at(index);
  return static_cast<const uint16_t*>(shards_[sequence.shard]->raw("rows")) + sequence.offset * tap_width();
}

DatasetSplit split_dataset(int count, double held_out_fraction) {
  DatasetSplit split;
  long held_out = 0;
  if (held_out_fraction > 0 && count >= 2)
    held_out = std::clamp(std::lround(count * held_out_fraction), 1L, static_cast<long>(count) - 1);
  for (int i = 0; i < count; ++i) {
    const bool chosen = (long(i) + 1) * held_out / count > long(i) * held_out / count;
    (chosen ? split.held_out : split.train).push_back(i);
  }
  return split;
}

}  // namespace dspark
