// The training batch pipeline (train/batch_pipeline.h) on the CPU: the packed
// layout holds each part of a TrainBatch where it says, in head order, and the
// pipeline (a producer thread, packing threads, two slots) yields exactly the
// batches the serial trainer builds, in step order, from any first step.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "core/dtype.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "golden.h"
#include "train/anchors.h"
#include "train/batch_pipeline.h"
#include "train/dataset.h"

namespace dspark {
namespace {

using testing::error_of;
using testing::TemporaryDirectory;

constexpr int kTaps = 2, kHidden = 8, kWidth = kTaps * kHidden, kVocab = 97;

// Sequences of assorted prompt and response lengths over two shards, random
// rows: contexts cut at the sequence start and blocks that run off the end.
struct PipelineData {
  TemporaryDirectory directory;

  PipelineData() {
    const std::vector<std::pair<int, int>> shapes = {{3, 40}, {1, 9}, {12, 30}, {30, 34}, {5, 60}, {2, 3}, {20, 45}};
    Rng rng(17);
    RegenManifest manifest;
    manifest.target_id = "synthetic";
    manifest.tap_layers = {1, 2};
    manifest.hidden_size = kHidden;
    manifest.vocab_size = kVocab;
    manifest.num_layers = 2;
    manifest.complete = true;
    const std::vector<std::vector<int>> shards = {{0, 1, 2}, {3, 4, 5, 6}};
    for (size_t shard = 0; shard < shards.size(); ++shard) {
      std::vector<int32_t> ids;
      std::vector<uint16_t> rows;
      for (int s : shards[shard]) {
        manifest.sequences.push_back({int(shard), long(ids.size()), shapes[s].first, shapes[s].second, s + 1, "eos"});
        for (int t = 0; t < shapes[s].second; ++t) {
          ids.push_back(static_cast<int32_t>(rng.next() % kVocab));
          for (int f = 0; f < kWidth; ++f) rows.push_back(f32_to_bf16(float(2.0 * rng.uniform() - 1.0)));
        }
      }
      const std::string file = "shard-" + std::to_string(shard) + ".safetensors";
      write_safetensors(directory.path / file, {{"ids", Dtype::I32, {long(ids.size())}, ids.data()},
                                                {"rows", Dtype::BF16, {long(ids.size()), kWidth}, rows.data()}});
      manifest.shards.push_back({file, int(shards[shard].size()), long(ids.size())});
    }
    write_manifest(directory.path, manifest);
  }
};

const Dataset& pipeline_data() {
  static const PipelineData files;
  static const Dataset data(files.directory.path);
  return data;
}

template <class T>
const T* part(const std::vector<unsigned char>& bytes, long offset) {
  return reinterpret_cast<const T*>(bytes.data() + offset);
}

// The serial trainer's batch of `step`, packed.
struct SerialBatch {
  PackedBatch packed;
  std::vector<unsigned char> bytes;
  std::vector<Anchor> anchors;
};
SerialBatch serial_batch(const AnchorSampler& sampler, uint64_t seed, long step, int batch, int gamma,
                         int max_context) {
  const Dataset& data = pipeline_data();
  SerialBatch serial;
  serial.anchors.resize(batch);
  sample_step_anchors(sampler, seed, step, serial.anchors);
  TrainBatch built;
  build_train_batch(data, serial.anchors, gamma, max_context, built, ContextRows::Bf16);
  serial.packed.layout =
      packed_batch_layout(batch, gamma, built.context_offsets[batch], data.tap_width(), data.hidden_size(), true);
  serial.bytes.assign(serial.packed.layout.bytes, 0xAB);  // padding must be written, not inherited
  pack_train_batch(built, serial.packed, serial.bytes.data());
  return serial;
}

TEST(PackedBatch, HoldsEveryPartWhereTheLayoutSaysInHeadOrder) {
  const Dataset& data = pipeline_data();
  const AnchorSampler sampler(data, {0, 1, 2, 3, 4, 5, 6});
  const int A = 9, gamma = 4, max_context = 7;
  std::vector<Anchor> anchors(A);
  Rng rng(3);
  for (Anchor& anchor : anchors) anchor = sampler.sample(rng);
  TrainBatch bf16_batch, f32_batch;
  build_train_batch(data, anchors, gamma, max_context, bf16_batch, ContextRows::Bf16);
  build_train_batch(data, anchors, gamma, max_context, f32_batch, ContextRows::F32);
  const int C = bf16_batch.context_offsets[A], R = A * gamma;

  PackedBatch packed;
  packed.layout = packed_batch_layout(A, gamma, C, kWidth, kHidden, true);
  const PackedBatchLayout& layout = packed.layout;
  std::vector<unsigned char> bytes(layout.bytes, 0xAB);
  pack_train_batch(bf16_batch, packed, bytes.data());
  EXPECT_EQ(packed.host, bytes.data());
  for (long offset : {layout.target_rows, layout.offsets, layout.anchor_ids, layout.targets, layout.previous,
                      layout.weights, layout.group_ids, layout.group_starts, layout.sorted_rows, layout.context})
    EXPECT_EQ(offset % 256, 0);
  EXPECT_GE(layout.bytes, layout.context + long(C) * kWidth * 2);

  EXPECT_EQ(std::memcmp(part<int32_t>(bytes, layout.offsets), bf16_batch.context_offsets.data(), (A + 1) * 4), 0);
  EXPECT_EQ(std::memcmp(part<int32_t>(bytes, layout.anchor_ids), bf16_batch.anchors.data(), A * 4), 0);
  EXPECT_EQ(
      std::memcmp(part<uint16_t>(bytes, layout.context), bf16_batch.context_rows_bf16.data(), size_t(C) * kWidth * 2),
      0);
  long positions = 0;
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k) {
      const int row = k * A + a;  // head order
      EXPECT_EQ(part<int32_t>(bytes, layout.targets)[row], bf16_batch.targets[a * gamma + k]);
      EXPECT_EQ(part<int32_t>(bytes, layout.previous)[row],
                k == 0 ? bf16_batch.anchors[a] : bf16_batch.targets[a * gamma + k - 1]);
      EXPECT_EQ(packed.masks[row], bf16_batch.mask[a * gamma + k]);
      EXPECT_EQ(part<float>(bytes, layout.weights)[row], 0.0f);
      EXPECT_EQ(std::memcmp(part<float>(bytes, layout.target_rows) + size_t(row) * kHidden,
                            bf16_batch.target_hidden.data() + size_t(a * gamma + k) * kHidden, kHidden * 4),
                0);
      positions += bf16_batch.mask[a * gamma + k] > 0;
    }
  EXPECT_EQ(packed.positions, positions);
  EXPECT_GT(positions, 0);
  EXPECT_LT(positions, R);  // some block runs off its sequence: the mask is exercised

  // The groups: every row once, under its previous token; tokens ascending, rows ascending within.
  std::set<int32_t> distinct(part<int32_t>(bytes, layout.previous), part<int32_t>(bytes, layout.previous) + R);
  ASSERT_EQ(packed.groups, int(distinct.size()));
  const int32_t* group_ids = part<int32_t>(bytes, layout.group_ids);
  const int32_t* starts = part<int32_t>(bytes, layout.group_starts);
  const int32_t* sorted = part<int32_t>(bytes, layout.sorted_rows);
  EXPECT_EQ(starts[0], 0);
  EXPECT_EQ(starts[packed.groups], R);
  std::set<int32_t> seen_rows;
  for (int g = 0; g < packed.groups; ++g) {
    if (g > 0) {
      EXPECT_LT(group_ids[g - 1], group_ids[g]);
    }
    for (int i = starts[g]; i < starts[g + 1]; ++i) {
      EXPECT_EQ(part<int32_t>(bytes, layout.previous)[sorted[i]], group_ids[g]);
      if (i > starts[g]) {
        EXPECT_LT(sorted[i - 1], sorted[i]);
      }
      seen_rows.insert(sorted[i]);
    }
  }
  EXPECT_EQ(int(seen_rows.size()), R);

  // f32 rows travelling as bf16 pack to the same bytes (regenerated rows are bf16-exact).
  PackedBatch from_f32;
  from_f32.layout = layout;
  std::vector<unsigned char> f32_bytes(layout.bytes, 0xCD);
  pack_train_batch(f32_batch, from_f32, f32_bytes.data());
  EXPECT_EQ(f32_bytes, bytes);
  // As f32: the rows are the TrainBatch's floats.
  PackedBatch as_f32;
  as_f32.layout = packed_batch_layout(A, gamma, C, kWidth, kHidden, false);
  std::vector<unsigned char> wide(as_f32.layout.bytes);
  pack_train_batch(f32_batch, as_f32, wide.data());
  EXPECT_EQ(
      std::memcmp(part<float>(wide, as_f32.layout.context), f32_batch.context_rows.data(), size_t(C) * kWidth * 4), 0);
  // A layout for another batch is refused.
  PackedBatch wrong;
  wrong.layout = packed_batch_layout(A, gamma, C + 1, kWidth, kHidden, true);
  std::vector<unsigned char> room(wrong.layout.bytes);
  EXPECT_NE(error_of([&] { pack_train_batch(bf16_batch, wrong, room.data()); }).find("packed batch"),
            std::string::npos);
}

TEST(BatchPipeline, YieldsTheSerialBatchesInStepOrderFromAnyFirstStep) {
  const Dataset& data = pipeline_data();
  const AnchorSampler sampler(data, {0, 1, 2, 4, 5, 6});
  BatchPipeline::Options options;
  options.seed = 11;
  options.batch = 5;
  options.gamma = 3;
  options.max_context = 6;
  options.end_step = 14;
  options.threads = 3;
  options.chunk_bytes = 70;  // many chunks, each cut across anchors and threads
  std::vector<SerialBatch> serial;
  for (long step = 0; step < options.end_step; ++step)
    serial.push_back(serial_batch(sampler, options.seed, step, options.batch, options.gamma, options.max_context));
  // Consecutive steps draw different anchors (so an out-of-order batch could not pass).
  for (long step = 1; step < options.end_step; ++step) EXPECT_NE(serial[step].bytes, serial[step - 1].bytes);

  auto expect_serial = [&](const PackedBatch& got, long step, long first_step) {
    const SerialBatch& want = serial[step];
    EXPECT_EQ(got.step, step);
    EXPECT_EQ(got.slot, int(step - first_step) % BatchStaging::kSlots);
    ASSERT_EQ(got.layout.bytes, want.packed.layout.bytes) << "step " << step;
    EXPECT_EQ(got.layout.context_rows, want.packed.layout.context_rows);
    EXPECT_EQ(got.groups, want.packed.groups);
    EXPECT_EQ(got.positions, want.packed.positions);
    EXPECT_EQ(got.masks, want.packed.masks);
    EXPECT_EQ(std::memcmp(got.host, want.bytes.data(), want.bytes.size()), 0) << "step " << step;
  };
  for (long first_step : {0L, 9L}) {  // a fresh run, and one resumed at step 9
    options.first_step = first_step;
    const std::unique_ptr<BatchStaging> staging = make_host_batch_staging();
    BatchPipeline pipeline(data, sampler, options, *staging);
    EXPECT_EQ(pipeline.threads(), 3);
    for (long step = first_step; step < options.end_step; ++step) {
      const PackedBatch& got = pipeline.next();
      expect_serial(got, step, first_step);
      // Held while the producer packs ahead (as a step runs): the batch stays as it was.
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      expect_serial(got, step, first_step);
    }
    EXPECT_NE(error_of([&] { pipeline.next(); }).find("no batch for step 14"), std::string::npos);
  }

  // The default threads and chunks, stopped early (the producer is still ahead when it is destroyed).
  BatchPipeline::Options defaults = options;
  defaults.first_step = 0;
  defaults.threads = 0;
  defaults.chunk_bytes = BatchPipeline::Options{}.chunk_bytes;
  const std::unique_ptr<BatchStaging> staging = make_host_batch_staging();
  BatchPipeline pipeline(data, sampler, defaults, *staging);
  EXPECT_GE(pipeline.threads(), 1);
  for (long step = 0; step < 4; ++step) expect_serial(pipeline.next(), step, 0);
}

TEST(BatchPipeline, AProducerErrorReachesTheConsumer) {
  const Dataset& data = pipeline_data();
  const AnchorSampler nothing(data, {});  // no anchors to draw
  BatchPipeline::Options options;
  options.batch = 2;
  options.end_step = 3;
  const std::unique_ptr<BatchStaging> staging = make_host_batch_staging();
  BatchPipeline pipeline(data, nothing, options, *staging);
  EXPECT_NE(error_of([&] { pipeline.next(); }).find("no anchors to sample from"), std::string::npos);
}

}  // namespace
}  // namespace dspark
