#include "train/batch_pipeline.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

#include "core/dtype.h"
#include "core/error.h"

namespace dspark {
namespace {

constexpr long kAlignment = 256;  // bytes: every part of a packed block starts at a multiple

long align_up(long value, long alignment) { return (value + alignment - 1) / alignment * alignment; }

// body(begin, end) over [0, count) in contiguous slices on up to 8 threads when
// the work is large (a batch's context rows: hundreds of MB at 8B shapes).
template <class Body>
void parallel_slices(long count, long serial_below, const Body& body) {
  const long threads = std::min<long>(8, std::max(1u, std::thread::hardware_concurrency()));
  if (count < serial_below || threads == 1) return body(0L, count);
  std::vector<std::thread> workers;
  const long slice = (count + threads - 1) / threads;
  for (long begin = 0; begin < count; begin += slice)
    workers.emplace_back([&body, begin, end = std::min(count, begin + slice)] { body(begin, end); });
  for (std::thread& worker : workers) worker.join();
}

class HostBatchStaging : public BatchStaging {
 public:
  unsigned char* host(int slot, size_t bytes) override {
    if (memory_[slot].size() < bytes) memory_[slot].resize(bytes);
    return memory_[slot].data();
  }
  void copy(int, size_t, size_t) override {}
  void finish(int) override {}

 private:
  std::vector<unsigned char> memory_[kSlots];
};

}  // namespace

PackedBatchLayout packed_batch_layout(int anchors, int gamma, int context_rows, int tap_width, int hidden_size,
                                      bool context_bf16) {
  PackedBatchLayout layout;
  layout.anchors = anchors;
  layout.gamma = gamma;
  layout.context_rows = context_rows;
  layout.tap_width = tap_width;
  layout.hidden_size = hidden_size;
  layout.context_bf16 = context_bf16;
  const long A = anchors, R = long(anchors) * gamma;
  long at = 0;
  auto take = [&](long bytes) {
    const long begin = at;
    at = align_up(at + bytes, kAlignment);
    return begin;
  };
  layout.target_rows = take(R * hidden_size * 4);
  layout.offsets = take((A + 1) * 4);
  layout.anchor_ids = take(A * 4);
  layout.targets = take(R * 4);
  layout.previous = take(R * 4);
  layout.weights = take(R * 4);
  layout.group_ids = take(R * 4);
  layout.group_starts = take((R + 1) * 4);
  layout.sorted_rows = take(R * 4);
  layout.context = take(layout.context_bytes());
  layout.bytes = at;
  return layout;
}

void pack_batch_head(const TrainBatch& batch, PackedBatch& packed, unsigned char* host) {
  const PackedBatchLayout& layout = packed.layout;
  const int A = batch.size(), gamma = batch.gamma, R = A * gamma, H = batch.hidden_size;
  DSPARK_CHECK(layout.anchors == A && layout.gamma == gamma && layout.hidden_size == H &&
                   layout.tap_width == batch.tap_width && batch.context_offsets.size() == size_t(A) + 1 &&
                   layout.context_rows == batch.context_offsets[A],
               "packed batch: the layout is for ", layout.anchors, " anchors of ", layout.gamma, " positions and ",
               layout.context_rows, " context rows, the batch has ", A, " of ", gamma, " and ",
               batch.context_offsets.empty() ? 0 : batch.context_offsets.back());
  // Head order (row k·A + a): targets, previous tokens (teacher forcing), masks, target rows.
  std::vector<int32_t> targets(R), previous(R);
  packed.masks.assign(R, 0.0f);
  packed.positions = 0;
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k) {
      const int row = k * A + a;
      targets[row] = batch.targets[size_t(a) * gamma + k];
      previous[row] = k == 0 ? batch.anchors[a] : batch.targets[size_t(a) * gamma + k - 1];
      packed.masks[row] = batch.mask[size_t(a) * gamma + k];
      if (packed.masks[row] > 0.0f) ++packed.positions;
    }
  // The Markov table rows read, each with the rows that read it (ascending): its backward's groups.
  std::vector<std::pair<int32_t, int32_t>> reads(R);
  for (int row = 0; row < R; ++row) reads[row] = {previous[row], row};
  std::sort(reads.begin(), reads.end());
  std::vector<int32_t> group_ids, group_starts, sorted_rows(R);
  for (int i = 0; i < R; ++i) {
    if (i == 0 || reads[i].first != reads[i - 1].first) {
      group_ids.push_back(reads[i].first);
      group_starts.push_back(i);
    }
    sorted_rows[i] = reads[i].second;
  }
  group_starts.push_back(R);
  packed.groups = static_cast<int>(group_ids.size());

  // Padding and unused group entries are zero: the same batch packs to the same bytes.
  std::memset(host, 0, layout.context);
  const long context_end = layout.context + layout.context_bytes();
  std::memset(host + context_end, 0, layout.bytes - context_end);
  float* target_rows = reinterpret_cast<float*>(host + layout.target_rows);
  for (int a = 0; a < A; ++a)
    for (int k = 0; k < gamma; ++k)
      std::copy_n(batch.target_hidden.data() + (size_t(a) * gamma + k) * H, H, target_rows + size_t(k * A + a) * H);
  std::memcpy(host + layout.offsets, batch.context_offsets.data(), size_t(A + 1) * 4);
  std::memcpy(host + layout.anchor_ids, batch.anchors.data(), size_t(A) * 4);
  std::memcpy(host + layout.targets, targets.data(), size_t(R) * 4);
  std::memcpy(host + layout.previous, previous.data(), size_t(R) * 4);
  std::memcpy(host + layout.group_ids, group_ids.data(), group_ids.size() * 4);
  std::memcpy(host + layout.group_starts, group_starts.data(), group_starts.size() * 4);
  std::memcpy(host + layout.sorted_rows, sorted_rows.data(), size_t(R) * 4);
  packed.host = host;
}

void pack_train_batch(const TrainBatch& batch, PackedBatch& packed, unsigned char* host) {
  pack_batch_head(batch, packed, host);
  const PackedBatchLayout& layout = packed.layout;
  const long values = long(layout.context_rows) * layout.tap_width;
  const bool given_bf16 = batch.context_rows.empty() && !batch.context_rows_bf16.empty();
  DSPARK_CHECK(size_t(values) == (given_bf16 ? batch.context_rows_bf16.size() : batch.context_rows.size()),
               "packed batch: ", values, " context values expected");
  DSPARK_CHECK(layout.context_bf16 || !given_bf16, "packed batch: bf16 context rows cannot travel as f32");
  constexpr long kSerialBelow = 1L << 22;  // values
  if (given_bf16) {
    const uint16_t* in = batch.context_rows_bf16.data();
    uint16_t* out = reinterpret_cast<uint16_t*>(host + layout.context);
    parallel_slices(values, kSerialBelow,
                    [&](long begin, long end) { std::memcpy(out + begin, in + begin, (end - begin) * 2); });
  } else if (layout.context_bf16) {
    const float* in = batch.context_rows.data();
    uint16_t* out = reinterpret_cast<uint16_t*>(host + layout.context);
    parallel_slices(values, kSerialBelow,
                    [&](long begin, long end) { convert_to_bf16(in + begin, out + begin, end - begin); });
  } else {
    const float* in = batch.context_rows.data();
    float* out = reinterpret_cast<float*>(host + layout.context);
    parallel_slices(values, kSerialBelow,
                    [&](long begin, long end) { std::memcpy(out + begin, in + begin, (end - begin) * 4); });
  }
}

std::unique_ptr<BatchStaging> make_host_batch_staging() { return std::make_unique<HostBatchStaging>(); }

// ------------------------------------------------------------------ the pipeline

// A fixed set of threads that run body(i) for i in [0, count) with the caller,
// then meet: started once, so a chunk's packing costs no thread creation.
class BatchPipeline::WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard lock(mutex_);
      quit_ = true;
    }
    start_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  void run(int count, const std::function<void(int)>& body) {
    {
      std::lock_guard lock(mutex_);
      body_ = &body;
      count_ = count;
      next_ = 0;
      pending_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    start_.notify_all();
    drain();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (int i; (i = next_.fetch_add(1)) < count_;) {
      try {
        (*body_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  void work() {
    long seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        start_.wait(lock, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* body_ = nullptr;
  int count_ = 0, pending_ = 0;
  std::atomic<int> next_{0};
  long generation_ = 0;
  bool quit_ = false;
  std::exception_ptr error_;
};

BatchPipeline::BatchPipeline(const Dataset& data, const AnchorSampler& sampler, const Options& options,
                             BatchStaging& staging)
    : data_(data), sampler_(sampler), options_(options), staging_(staging) {
  DSPARK_CHECK(options.batch >= 1 && options.gamma >= 1 && options.max_context >= 1 && options.chunk_bytes >= 2 &&
                   options.first_step >= 0 && options.first_step <= options.end_step,
               "batch pipeline: needs batch, gamma and max context >= 1 and 0 <= first step <= end step");
  // Half the cores (at most 8): copying rows is bound by memory bandwidth well before that, and the
  // step's own host thread and the driver keep theirs.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = options.threads > 0 ? options.threads : std::clamp(cores / 2, 1, 8);
  capacity_ = packed_batch_layout(options.batch, options.gamma, options.batch * options.max_context, data.tap_width(),
                                  data.hidden_size(), true)
                  .bytes;
  anchors_.resize(options.batch);
  next_step_ = options.first_step;
  pool_ = std::make_unique<WorkerPool>(threads_);
  producer_ = std::thread([this] { produce(); });
}

BatchPipeline::~BatchPipeline() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  producer_.join();
}

void BatchPipeline::produce() {
  try {
    for (long step = options_.first_step; step < options_.end_step; ++step) {
      const int slot = static_cast<int>((step - options_.first_step) % BatchStaging::kSlots);
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || states_[slot] == SlotState::Free; });
        if (stop_) return;
      }
      pack(step, slot);
      {
        std::lock_guard lock(mutex_);
        states_[slot] = SlotState::Ready;
      }
      changed_.notify_all();
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    error_ = std::current_exception();
    changed_.notify_all();
  }
}

void BatchPipeline::pack(long step, int slot) {
  const int A = options_.batch, W = data_.tap_width();
  sample_step_anchors(sampler_, options_.seed, step, anchors_);
  build_train_batch(data_, anchors_, options_.gamma, options_.max_context, head_, ContextRows::OffsetsOnly);
  PackedBatch& packed = batches_[slot];
  packed.layout = packed_batch_layout(A, options_.gamma, head_.context_offsets[A], W, data_.hidden_size(), true);
  packed.step = step;
  packed.slot = slot;
  unsigned char* host = staging_.host(slot, capacity_);
  pack_batch_head(head_, packed, host);
  const PackedBatchLayout& layout = packed.layout;
  staging_.copy(slot, 0, layout.context);

  // The context rows, straight from the mapped shards: chunk by chunk, each
  // chunk's copy running while the next is packed.
  uint16_t* out = reinterpret_cast<uint16_t*>(host + layout.context);
  const std::vector<int>& offsets = head_.context_offsets;
  auto copy_values = [&](long begin, long end) {  // context values [begin, end) of the batch
    int a = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), begin / W) - offsets.begin()) - 1;
    while (begin < end) {
      const long anchor_begin = long(offsets[a]) * W, anchor_end = long(offsets[a + 1]) * W;
      const long stop = std::min(end, anchor_end);
      if (stop > begin) {
        const uint16_t* in = context_rows_of(data_, anchors_[a], head_.context_length(a));
        std::memcpy(out + begin, in + (begin - anchor_begin), size_t(stop - begin) * 2);
        begin = stop;
      }
      ++a;
    }
  };
  const long values = long(layout.context_rows) * W, chunk = std::max(1L, options_.chunk_bytes / 2);
  for (long begin = 0; begin < values; begin += chunk) {
    const long end = std::min(values, begin + chunk);
    const long piece = (end - begin + threads_ - 1) / threads_;
    pool_->run(threads_, [&](int i) {
      const long piece_begin = begin + i * piece, piece_end = std::min(end, piece_begin + piece);
      if (piece_begin < piece_end) copy_values(piece_begin, piece_end);
    });
    staging_.copy(slot, layout.context + begin * 2, layout.context + end * 2);
  }
  staging_.finish(slot);
}

const PackedBatch& BatchPipeline::next() {
  std::unique_lock lock(mutex_);
  if (in_use_ >= 0) {
    states_[in_use_] = SlotState::Free;
    in_use_ = -1;
    changed_.notify_all();
  }
  DSPARK_CHECK(next_step_ < options_.end_step, "batch pipeline: no batch for step ", next_step_, " (it ends at ",
               options_.end_step, ")");
  const int slot = static_cast<int>((next_step_ - options_.first_step) % BatchStaging::kSlots);
  changed_.wait(lock, [&] { return error_ || states_[slot] == SlotState::Ready; });
  if (states_[slot] != SlotState::Ready) std::rethrow_exception(error_);
  states_[slot] = SlotState::InUse;
  in_use_ = slot;
  ++next_step_;
  return batches_[slot];
}

}  // namespace dspark
