// The training batches' way to the GPU, overlapped with the steps (DESIGN.md
// §4, the CUDA trainer): while the device runs step s, a host thread draws
// step s+1's anchors, packs its batch straight from the mapped data into the
// layout the CUDA loss reads, in pinned memory, and starts its copy on a copy
// stream; step s+1 waits (on the device) for its own copy only.
//
//   PackedBatchLayout  where each part of a batch lives in one block of bytes
//                      (what CudaDrafterLoss reads on the device)
//   pack_train_batch   a TrainBatch into that block (the serial upload and
//                      evaluation batches)
//   BatchStaging       the slots the pipeline packs into and what happens to a
//                      packed range: pinned host memory, device buffers, a
//                      copy stream and events for the CUDA step
//                      (TrainStep::batch_staging); plain host memory otherwise
//   BatchPipeline      the producer thread, its packing threads and the
//                      hand-over of the two slots
//
// Determinism: step s's batch is a function of (data, seed, s) alone
// (sample_step_anchors), so the pipeline yields exactly the batches the
// serial loop builds, in step order, and a resumed run (first step k) yields
// what an uninterrupted one would from k on. Evaluation draws nothing from
// these streams: it builds its own batches from fixed anchors.
//
// Buffer safety, per slot: the producer packs into a slot only after the
// consumer has handed it back (next() releases the batch of the previous
// call, whose step has been launched by then); the staging then makes the
// host memory wait for the slot's previous copy and the slot's next copy wait
// (cudaStreamWaitEvent on the copy stream) for the step that read it.
//
// Shape letters: A anchors, γ block, R = γ·A rows (head order: row k·A + a),
// C context rows, m taps, H target hidden, W = m·H.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "train/anchors.h"
#include "train/dataset.h"
#include "train/train_batch.h"

namespace dspark {

// One block of bytes, each part at a 256-byte aligned offset.
struct PackedBatchLayout {
  int anchors = 0;           // A
  int gamma = 0;             // γ
  int context_rows = 0;      // C
  int tap_width = 0;         // W
  int hidden_size = 0;       // H
  bool context_bf16 = true;  // the context rows' dtype on the device: bf16 (as stored) or f32
  long target_rows = 0;      // f32 [R, H] the target's row (last tap) at t+k
  long offsets = 0;          // i32 [A + 1] context_offsets
  long anchor_ids = 0;       // i32 [A] x_t
  long targets = 0;          // i32 [R] x_{t+1+k}
  long previous = 0;         // i32 [R] the block's previous token (x_t for k = 0): teacher forcing
  long weights = 0;          // f32 [R] position weights, written on the device by each launch (packed as 0)
  long group_ids = 0;        // i32 [R] the distinct previous tokens, ascending (PackedBatch::groups used)
  long group_starts = 0;     // i32 [R + 1] each group's first entry of sorted_rows (groups + 1 used)
  long sorted_rows = 0;      // i32 [R] rows ordered by previous token, then row
  long context = 0;          // bf16 or f32 [C, W]: last, so that everything before it is copied first
  long bytes = 0;            // the whole block

  int rows() const { return anchors * gamma; }
  long context_bytes() const { return long(context_rows) * tap_width * (context_bf16 ? 2 : 4); }
};

PackedBatchLayout packed_batch_layout(int anchors, int gamma, int context_rows, int tap_width, int hidden_size,
                                      bool context_bf16);

// A packed batch: its layout, what a launch needs on the host, and where its bytes are.
struct PackedBatch {
  PackedBatchLayout layout;
  int groups = 0;                       // distinct previous tokens (the Markov table rows the batch reads)
  long positions = 0;                   // trained positions (mask 1)
  std::vector<float> masks;             // [R] head order
  const unsigned char* host = nullptr;  // [layout.bytes]
  long step = -1;                       // the training step it is for (BatchPipeline), else -1
  int slot = -1;                        // the BatchStaging slot holding it (BatchPipeline), else -1
};

// `batch` packed into `host` ([packed.layout.bytes]), whose layout `packed`
// already holds (packed_batch_layout for its A, γ, C, W, H). The context rows
// travel as given (bf16 bits, or f32), or f32 rounded to bf16 when
// layout.context_bf16 (exact for regenerated data: stored in bf16).
// pack_batch_head packs everything before the context rows (any rows `batch`
// holds are ignored); pack_train_batch the whole block.
void pack_batch_head(const TrainBatch& batch, PackedBatch& packed, unsigned char* host);
void pack_train_batch(const TrainBatch& batch, PackedBatch& packed, unsigned char* host);

// The memory of the pipeline's slots and what becomes of their bytes. The
// producer thread calls host(), copy() and finish() for one slot at a time,
// only for a slot the consumer has handed back.
class BatchStaging {
 public:
  static constexpr int kSlots = 2;  // double buffering: one slot in the step, one being packed
  virtual ~BatchStaging() = default;
  // Slot `slot`'s host memory, at least `bytes`, once the slot's previous copy has left it.
  virtual unsigned char* host(int slot, size_t bytes) = 0;
  // Bytes [begin, end) of the slot hold their final values: start their copy
  // (to where the step reads them; host staging has nothing to do).
  virtual void copy(int slot, size_t begin, size_t end) = 0;
  // Every copy of the slot's batch has been started.
  virtual void finish(int slot) = 0;
};

// Staging in plain host memory: the pipeline on a machine (or a step) without
// a device to copy to; the CPU tests read the packed bytes from it.
std::unique_ptr<BatchStaging> make_host_batch_staging();

class BatchPipeline {
 public:
  struct Options {
    uint64_t seed = 0;             // the sampler's seed (sample_step_anchors)
    int batch = 16;                // A
    int gamma = 1;                 // γ
    int max_context = 1;           // context rows per anchor: [max(0, t - max_context), t)
    long first_step = 0;           // the first batch's step (a resumed run's step)
    long end_step = 0;             // batches for steps [first_step, end_step)
    int threads = 0;               // packing threads, the producer included; 0: from the machine's cores
    long chunk_bytes = 16L << 20;  // context bytes packed before their copy starts
  };

  // Starts the producer; `data`, `sampler` and `staging` must outlive this.
  BatchPipeline(const Dataset& data, const AnchorSampler& sampler, const Options& options, BatchStaging& staging);
  ~BatchPipeline();  // stops the producer (after the batch it is packing) and waits for it
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  // The next step's batch (first_step, first_step + 1, ...): waits until it is
  // packed and its copy started; rethrows what stopped the producer. Hands the
  // previous call's batch back to the producer, so that batch's step must have
  // been launched (the staging orders the slot's reuse after it).
  const PackedBatch& next();
  int threads() const { return threads_; }

 private:
  class WorkerPool;
  enum class SlotState { Free, Ready, InUse };
  void produce();
  void pack(long step, int slot);

  const Dataset& data_;
  const AnchorSampler& sampler_;
  const Options options_;
  BatchStaging& staging_;
  int threads_ = 1;
  size_t capacity_ = 0;  // the largest block: A·max_context context rows

  // Producer-side scratch.
  std::vector<Anchor> anchors_;
  TrainBatch head_;  // the batch but its context rows
  std::unique_ptr<WorkerPool> pool_;

  std::mutex mutex_;
  std::condition_variable changed_;
  SlotState states_[BatchStaging::kSlots] = {SlotState::Free, SlotState::Free};
  PackedBatch batches_[BatchStaging::kSlots];
  bool stop_ = false;
  std::exception_ptr error_;
  long next_step_ = 0;  // the step next() returns
  int in_use_ = -1;     // the slot next() returned last

  std::thread producer_;  // last: started once everything above is built
};

}  // namespace dspark
