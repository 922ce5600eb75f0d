// The worker pool of parallel.h (moved here from matmul.cpp so attention can
// share it).
#include "kernels/cpu/parallel.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace dspark::cpu {
namespace {

class WorkerPool {
 public:
  using Task = ParallelTask;

  // Never destroyed: the workers may still be polling while the process exits,
  // and a forked child (which has no workers) must not try to join them.
  static WorkerPool& instance() {
    static WorkerPool* const pool = new WorkerPool(std::max(1, openblas_get_num_threads()));
    return *pool;
  }

  int size() const { return workers_ + 1; }
  int threads() const { return active_workers_.load(std::memory_order_relaxed) + 1; }
  void set_threads(int threads) {
    DSPARK_CHECK(threads >= 1 && threads <= size(), "thread count ", threads, " is outside 1..", size());
    active_workers_.store(threads - 1, std::memory_order_relaxed);
  }

  void run(Task task, const void* context, int chunks) {
    // One job at a time; a second thread calling meanwhile runs alone.
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || threads() == 1 || chunks <= 1 || chunks > kMaxChunks) {
      for (int chunk = 0; chunk < chunks; ++chunk) task(context, chunk);
      return;
    }
    task_ = task;
    context_ = context;
    unfinished_.store(chunks, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & 0xffffffffu;
    state_.store(generation_ << 32 | uint64_t(chunks) << 16, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_seq_cst);
      wake_.notify_all();
    }
    work(generation_);
    // Chunks a worker claimed may still be running (or, on a busy machine,
    // waiting for a core: then give it ours now and then).
    for (int spin = 1; unfinished_.load(std::memory_order_acquire) != 0; ++spin)
      if (spin % 1024 == 0)
        std::this_thread::yield();
      else
        pause();
  }

 private:
  static constexpr int kMaxChunks = 0xffff;
  // How long an idle worker polls for the next job before sleeping: longer
  // than the gaps between the jobs of one decode step.
  static constexpr std::chrono::microseconds kSpin{300};

  explicit WorkerPool(int threads) {
    workers_ = threads - 1;
    active_workers_.store(workers_, std::memory_order_relaxed);
    for (int i = 0; i < workers_; ++i) std::thread([this, i] { worker_loop(i); }).detach();
  }

  static void pause() { __builtin_ia32_pause(); }

  // Claims and runs chunks of job `generation` until none is left. The
  // state word holds generation << 32 | chunks << 16 | next chunk, so a claim
  // (one compare-and-swap) can never take a chunk of a later job.
  void work(uint64_t generation) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (;;) {
      if (state >> 32 != generation) return;
      const uint64_t chunks = state >> 16 & 0xffff, next = state & 0xffff;
      if (next >= chunks) return;
      if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      // task_/context_ stay valid: the caller waits for this chunk to finish.
      task_(context_, static_cast<int>(next));
      unfinished_.fetch_sub(1, std::memory_order_release);
      state = state_.load(std::memory_order_acquire);
    }
  }

  [[noreturn]] void worker_loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t generation = state_.load(std::memory_order_acquire) >> 32;
      if (generation == seen) {
        const auto deadline = std::chrono::steady_clock::now() + kSpin;
        for (int spin = 1; generation == seen; ++spin) {
          pause();
          generation = state_.load(std::memory_order_acquire) >> 32;
          if (spin % 256 == 0) {
            if (std::chrono::steady_clock::now() > deadline) break;
            // On an oversubscribed machine let whatever shares this core run
            // (it may be the thread that is about to hand out the next job).
            if (spin % 1024 == 0) std::this_thread::yield();
          }
        }
      }
      while (generation == seen) {  // sleep until the caller bumps wake_
        const uint32_t ticket = wake_.load(std::memory_order_seq_cst);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        generation = state_.load(std::memory_order_seq_cst) >> 32;
        if (generation == seen) wake_.wait(ticket, std::memory_order_seq_cst);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        generation = state_.load(std::memory_order_acquire) >> 32;
      }
      seen = generation;
      // A worker beyond set_threads' count claims nothing.
      if (index < active_workers_.load(std::memory_order_relaxed)) work(generation);
    }
  }

  int workers_ = 0;
  std::atomic<int> active_workers_{0};  // workers that claim chunks (set_threads)
  std::mutex busy_;
  uint64_t generation_ = 0;  // of the last job run (caller side)
  Task task_ = nullptr;
  const void* context_ = nullptr;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> unfinished_{0};  // chunks not yet finished
  std::atomic<uint32_t> wake_{0};   // futex word the sleepers wait on
  std::atomic<int> sleepers_{0};
};

}  // namespace

void parallel_run(ParallelTask task, const void* context, int chunks) {
  WorkerPool::instance().run(task, context, chunks);
}

int parallel_threads() { return WorkerPool::instance().threads(); }

void set_parallel_threads(int threads) { WorkerPool::instance().set_threads(threads); }

}  // namespace dspark::cpu
