// The regenerated-data reader, the held-out split and anchor sampling, on a
// hand-written data directory whose every row is distinct, so each field of
// a batch can be checked against the rule in DESIGN.md §4 exactly.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "golden.h"
#include "train/anchors.h"
#include "train/dataset.h"

namespace dspark {
namespace {

using testing::error_of;
using testing::TemporaryDirectory;

constexpr int kTaps = 2, kHidden = 4, kWidth = kTaps * kHidden, kVocab = 50;

struct SyntheticSequence {
  int prompt_length;
  std::vector<int32_t> ids;
  std::vector<float> rows;  // [length, m·H], already bf16-exact
};

// Three sequences over two shards; row values are distinct bf16-exact numbers.
struct SyntheticData {
  TemporaryDirectory directory;
  std::vector<SyntheticSequence> sequences;

  SyntheticData() {
    const std::vector<std::pair<int, int>> shapes = {{3, 9}, {1, 4}, {5, 7}};  // (prompt length, length)
    int next_value = 1;
    for (size_t s = 0; s < shapes.size(); ++s) {
      SyntheticSequence sequence{shapes[s].first, {}, {}};
      for (int t = 0; t < shapes[s].second; ++t) {
        sequence.ids.push_back(static_cast<int32_t>((7 * s + 3 * t + 1) % kVocab));
        for (int f = 0; f < kWidth; ++f) sequence.rows.push_back(bf16_to_f32(f32_to_bf16(0.5f * next_value++)));
      }
      sequences.push_back(std::move(sequence));
    }
    RegenManifest manifest;
    manifest.target_id = "synthetic";
    manifest.tap_layers = {1, 2};
    manifest.hidden_size = kHidden;
    manifest.vocab_size = kVocab;
    manifest.num_layers = 2;
    manifest.complete = true;
    const std::vector<std::vector<int>> shards = {{0, 1}, {2}};
    for (size_t shard = 0; shard < shards.size(); ++shard) {
      std::vector<int32_t> ids;
      std::vector<uint16_t> rows;
      for (int s : shards[shard]) {
        manifest.sequences.push_back(
            {int(shard), long(ids.size()), sequences[s].prompt_length, int(sequences[s].ids.size()), s + 1, "length"});
        ids.insert(ids.end(), sequences[s].ids.begin(), sequences[s].ids.end());
        for (float value : sequences[s].rows) rows.push_back(f32_to_bf16(value));
      }
      const std::string file = "shard-" + std::to_string(shard) + ".safetensors";
      write_safetensors(directory.path / file, {{"ids", Dtype::I32, {long(ids.size())}, ids.data()},
                                                {"rows", Dtype::BF16, {long(ids.size()), kWidth}, rows.data()}});
      manifest.shards.push_back({file, int(shards[shard].size()), long(ids.size())});
    }
    write_manifest(directory.path, manifest);
  }
};

TEST(Dataset, ReadsSequencesBackExactly) {
  SyntheticData synthetic;
  const Dataset data(synthetic.directory.path);
  ASSERT_EQ(data.size(), 3);
  EXPECT_EQ(data.tap_width(), kWidth);
  for (int s = 0; s < 3; ++s) {
    const SyntheticSequence& expected = synthetic.sequences[s];
    EXPECT_EQ(data.sequence(s).prompt_length, expected.prompt_length);
    ASSERT_EQ(data.sequence(s).length, int(expected.ids.size()));
    for (size_t t = 0; t < expected.ids.size(); ++t) EXPECT_EQ(data.ids(s)[t], expected.ids[t]);
    for (size_t i = 0; i < expected.rows.size(); ++i) EXPECT_EQ(bf16_to_f32(data.rows(s)[i]), expected.rows[i]);
  }
}

TEST(Dataset, MissingOrMisshapedShardsAreClearErrors) {
  SyntheticData synthetic;
  RegenManifest manifest = read_manifest(synthetic.directory.path);
  manifest.shards[1].tokens += 1;
  write_manifest(synthetic.directory.path, manifest);
  EXPECT_NE(error_of([&] { Dataset data(synthetic.directory.path); }).find("shard-1.safetensors"), std::string::npos);
  std::filesystem::remove(synthetic.directory.path / "shard-1.safetensors");
  EXPECT_NE(error_of([&] { Dataset data(synthetic.directory.path); }).find("shard-1.safetensors"), std::string::npos);
  TemporaryDirectory empty;
  EXPECT_NE(error_of([&] { Dataset data(empty.path); }).find("dspark regen"), std::string::npos);
}

TEST(AnchorSampler, EnumeratesEveryResponsePositionWhoseNextTokenExists) {
  SyntheticData synthetic;
  const Dataset data(synthetic.directory.path);
  const AnchorSampler sampler(data, {0, 1, 2});
  // Sequence lengths 9, 4, 7 with prompts 3, 1, 5: anchors t in [P-1, length-2].
  std::vector<std::pair<int, int>> expected;
  for (int t = 2; t <= 7; ++t) expected.push_back({0, t});
  for (int t = 0; t <= 2; ++t) expected.push_back({1, t});
  for (int t = 4; t <= 5; ++t) expected.push_back({2, t});
  ASSERT_EQ(sampler.size(), long(expected.size()));
  for (long i = 0; i < sampler.size(); ++i) {
    EXPECT_EQ(sampler.at(i).sequence, expected[i].first) << i;
    EXPECT_EQ(sampler.at(i).position, expected[i].second) << i;
  }
  const AnchorSampler only_last(data, {2});
  EXPECT_EQ(only_last.size(), 2);
  EXPECT_EQ(only_last.at(0).sequence, 2);
}

TEST(AnchorSampler, DrawsEveryAnchorEquallyOftenAndIsSeeded) {
  SyntheticData synthetic;
  const Dataset data(synthetic.directory.path);
  const AnchorSampler sampler(data, {0, 1, 2});
  Rng rng(42), again(42);
  std::map<std::pair<int, int>, int> counts;
  const int draws = 110000;
  for (int i = 0; i < draws; ++i) {
    const Anchor anchor = sampler.sample(rng), repeated = sampler.sample(again);
    ASSERT_EQ(anchor.sequence, repeated.sequence);
    ASSERT_EQ(anchor.position, repeated.position);
    counts[{anchor.sequence, anchor.position}]++;
  }
  ASSERT_EQ(long(counts.size()), sampler.size());  // every anchor, and nothing else
  // Chi-square against uniform over 11 anchors (10 degrees of freedom; 0.1% critical value 29.6).
  const double expected = double(draws) / sampler.size();
  double chi_square = 0.0;
  for (const auto& [anchor, count] : counts) chi_square += (count - expected) * (count - expected) / expected;
  EXPECT_LT(chi_square, 29.6);
}

TEST(TrainBatch, FollowsTheAnchorRulesExactly) {
  SyntheticData synthetic;
  const Dataset data(synthetic.directory.path);
  const AnchorSampler sampler(data, {0, 1, 2});
  const int gamma = 4;
  for (int max_context : {1, 3, 100}) {
    std::vector<Anchor> anchors;
    for (long i = 0; i < sampler.size(); ++i) anchors.push_back(sampler.at(i));
    TrainBatch batch;
    build_train_batch(data, anchors, gamma, max_context, batch);
    ASSERT_EQ(batch.size(), int(anchors.size()));
    EXPECT_EQ(batch.gamma, gamma);
    EXPECT_EQ(batch.tap_width, kWidth);
    EXPECT_EQ(batch.hidden_size, kHidden);
    for (int a = 0; a < batch.size(); ++a) {
      const SyntheticSequence& sequence = synthetic.sequences[anchors[a].sequence];
      const int t = anchors[a].position, length = int(sequence.ids.size());
      const int first = std::max(0, t - max_context);
      SCOPED_TRACE("sequence " + std::to_string(anchors[a].sequence) + " t " + std::to_string(t) + " max_context " +
                   std::to_string(max_context));
      ASSERT_EQ(batch.context_length(a), t - first);
      const float* context = batch.context_rows.data() + size_t(batch.context_offsets[a]) * kWidth;
      for (int row = 0; row < t - first; ++row)
        for (int f = 0; f < kWidth; ++f)
          ASSERT_EQ(context[row * kWidth + f], sequence.rows[(first + row) * kWidth + f]);
      // Row t itself never appears in the context (every row's values are distinct).
      std::set<float> context_values(context, context + size_t(t - first) * kWidth);
      for (int f = 0; f < kWidth; ++f) EXPECT_EQ(context_values.count(sequence.rows[t * kWidth + f]), 0u);
      EXPECT_EQ(batch.anchors[a], sequence.ids[t]);
      for (int k = 0; k < gamma; ++k) {
        const bool exists = t + 1 + k < length;
        EXPECT_EQ(batch.mask[a * gamma + k], exists ? 1.0f : 0.0f) << k;
        if (!exists) continue;
        EXPECT_EQ(batch.targets[a * gamma + k], sequence.ids[t + 1 + k]) << k;
        for (int h = 0; h < kHidden; ++h)  // the last tap: the row's last H features
          EXPECT_EQ(batch.target_hidden[(size_t(a) * gamma + k) * kHidden + h],
                    sequence.rows[(t + k) * kWidth + (kTaps - 1) * kHidden + h])
              << k;
      }
      EXPECT_EQ(batch.mask[a * gamma], 1.0f);  // position 0 always trains
    }
    // The GPU's form: the same rows as the data's own bf16 bits, and no f32 copy.
    TrainBatch bf16_batch;
    build_train_batch(data, anchors, gamma, max_context, bf16_batch, ContextRows::Bf16);
    EXPECT_TRUE(bf16_batch.context_rows.empty());
    ASSERT_EQ(bf16_batch.context_rows_bf16.size(), batch.context_rows.size());
    for (size_t i = 0; i < batch.context_rows.size(); ++i)
      ASSERT_EQ(bf16_to_f32(bf16_batch.context_rows_bf16[i]), batch.context_rows[i]) << i;
    EXPECT_EQ(bf16_batch.context_offsets, batch.context_offsets);
    EXPECT_EQ(bf16_batch.target_hidden, batch.target_hidden);
  }
}

TEST(DatasetSplit, HoldsOutEvenlySpacedSequencesDeterministically) {
  const DatasetSplit twenty = split_dataset(20, 0.05);
  EXPECT_EQ(twenty.held_out, std::vector<int>{19});
  EXPECT_EQ(twenty.train.size(), 19u);
  const DatasetSplit hundred = split_dataset(100, 0.1);
  EXPECT_EQ(hundred.held_out, (std::vector<int>{9, 19, 29, 39, 49, 59, 69, 79, 89, 99}));
  EXPECT_EQ(split_dataset(6, 0.05).held_out, std::vector<int>{5});  // at least one
  EXPECT_TRUE(split_dataset(6, 0.0).held_out.empty());
  EXPECT_TRUE(split_dataset(1, 0.5).held_out.empty());  // never the only sequence
  const DatasetSplit half = split_dataset(3, 0.9);
  EXPECT_EQ(half.train.size(), 1u);  // never every sequence
}

}  // namespace
}  // namespace dspark
