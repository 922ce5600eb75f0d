// The Markov head's kernels (draft.h): one launch per position for any
// vocabulary (markov_position_forward, at the end of the file), and the greedy
// head of a whole draft step in one persistent launch (markov_head_forward);
// for greedy steps that return tokens only, the same two ways with w2 at 8
// bits (markov_position_tokens_forward, markov_head_tokens_forward: at
// Qwen3-8B's vocabulary w2's 8-bit columns fit on chip where its bf16 ones
// do not).
//
// Why one launch: position k needs x_{k-1}, the argmax of the whole
// vocabulary at k-1, so the per-position kernels launch a prepare and a
// product kernel per position and read all of markov.w2 (r x V bf16) at each.
// Here each of one block per multiprocessor owns a fixed slice of the
// vocabulary for every position: it loads its slice's weights once a step
// into registers and shared memory, and the blocks meet at a grid barrier
// after each position, when every row's argmax key is complete. Only where
// the whole of w2 fits on chip: at Qwen3-8B's vocabulary (78 MB at r 256)
// a version that streamed the rest from memory at every position was slower
// than the per-position kernels (one block of 12 warps per multiprocessor
// keeps too few loads in flight; docs/PERF.md, stop 31).
//
// A block's columns come in groups of 128 = 16 octets (8 columns, one 16-byte
// load) x 8 slices (input features i = slice, slice + 8, ...); thread t's
// (octet, slice) pairs are p = t, t + 384, ... (p % 16 the octet, p / 16 % 8
// the slice, p / 128 the group): a half-warp reads 256 consecutive bytes of
// one weight row. Each column's sum is formed exactly as the per-position
// kernel (matmul_in_out_argmax_forward) forms it: per slice in feature order,
// then the slices in order, then the LM head's logit: the logits and tokens
// are the same bits.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/device.h"
#include "kernels/cuda/draft.h"
#include "kernels/cuda/in_out_product.cuh"
#include "kernels/cuda/quantized_product.h"
#include "kernels/cuda/sequential_head.cuh"
#include "kernels/cuda/tensor_gemv.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 384;  // a multiple of the 128 pairs of a group: every thread's pairs have one slice
constexpr int kWarps = kThreads / 32;
constexpr int kSlices = 8;
constexpr int kGroupColumns = 128;
constexpr int kMaxRows = 4;  // rows per pass over the weights; more rows run in groups of 4

// Weight loads (16 bytes each) a thread keeps in registers: as many as fit
// beside its ROWS x 8 sums within the 168 registers one block of 384 threads
// per multiprocessor allows; the rest are kept in shared memory.
template <int ROWS>
constexpr int kRegisterLoads = ROWS == 1   ? 12
                               : ROWS == 2 ? 10
                                           : 8;

struct Plan {
  int columns;       // per block: a multiple of kGroupColumns
  int pairs;         // (octet, slice) pairs per thread
  int loads;         // weight loads per pair: rank / 8
  int shared_loads;  // loads per thread kept in shared memory (after the register ones): all the rest
};

// The sums of the rows' 8 columns += x[r][feature] * w (w: 8 bf16).
template <int ROWS>
__device__ __forceinline__ void accumulate(float (&sums)[ROWS][8], uint4 packed, const float* x, int rank,
                                           int feature) {
  float w[8];
  unpack_eight(packed, w);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float value = x[r * rank + feature];
#pragma unroll
    for (int j = 0; j < 8; ++j) sums[r][j] += value * w[j];
  }
}

// Every block waits here until all blocks have arrived; what each wrote before
// is visible to all after. arrived returns to 0 at each barrier, generation
// only grows (both zeroed once, at allocation). It needs every block of the
// grid resident at once: the launchers check the occupancy, and a later
// kernel takes a multiprocessor early only once every block has called
// start_next_kernel(), so has one. A block that waits longer than
// kBarrierPatienceNanoseconds stops the kernel with an error: a grid not all
// resident would otherwise hang the process.
constexpr unsigned long long kBarrierPatienceNanoseconds = 10'000'000'000ull;

__device__ __forceinline__ unsigned long long global_nanoseconds() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* word) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(word) : "memory");
  return value;
}

// The calling thread polls *word until done(value), and past kBarrierPatienceNanoseconds stops the kernel.
template <class Done>
__device__ __forceinline__ void poll_until(const unsigned* word, Done done) {
  if (done(load_acquire(word))) return;
  const unsigned long long start = global_nanoseconds();
  for (unsigned now = load_acquire(word); !done(now); now = load_acquire(word))
    if (global_nanoseconds() - start > kBarrierPatienceNanoseconds) __trap();
}

__device__ __forceinline__ void grid_barrier(unsigned* arrived, unsigned* generation, unsigned blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned current = load_acquire(generation);
    unsigned ticket;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(arrived) : "memory");
    if (ticket == blocks - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(arrived) : "memory");
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(generation) : "memory");
    } else {
      poll_until(generation, [current](unsigned now) { return now != current; });
    }
  }
  __syncthreads();
}

// Every block waits here until all blocks have arrived `times` times in all:
// a counter zeroed before the launch, to which each block adds 1 at each
// barrier. No round trip to arrive (grid_barrier's ticket is an atomic that
// returns, after a load of the generation: about 2 us more a barrier at 132
// blocks, which a kernel meeting 14 times a step pays in full). Same watchdog.
// (A barrier that gathers what the blocks exchange, each block's word in a
// slot of its own that every block polls, let the blocks go ~0.7 us later
// than this one: docs/PERF.md, stop 38.)
__device__ __forceinline__ void counted_grid_barrier(unsigned* counter, unsigned times) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned target = times * gridDim.x;
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    poll_until(counter, [target](unsigned now) { return now >= target; });
  }
  __syncthreads();
}

// BYTES (4 or 16) from global to shared memory without registers; complete at cp.async.wait_all.
template <int BYTES = 16>
__device__ __forceinline__ void copy_to_shared_async(void* destination, const void* source) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(destination));
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(source) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(address), "l"(source) : "memory");
}

// Dynamic shared memory: the cached weights [shared_loads][kThreads] uint4,
// the slices' sums [ROWS][kSlices][columns], the LM head's logits of the
// block's columns [ROWS][columns], x [ROWS][rank], the confidence logits'
// hidden part [γ * rows], previous tokens [rows], alive flags [rows].
template <int ROWS>
__global__ void __launch_bounds__(kThreads, 1)
    markov_head_kernel(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden, int rows,
                       int gamma, int rank, int width, int vocab, SequentialHeadWeights weights,
                       const DraftControl* control, SequentialHeadState head, Plan plan, unsigned* barrier) {
  constexpr int kRegisters = kRegisterLoads<ROWS>;
  extern __shared__ __align__(16) unsigned char shared[];
  uint4* cache = reinterpret_cast<uint4*>(shared);
  float* partial = reinterpret_cast<float*>(cache + static_cast<long>(plan.shared_loads) * kThreads);
  float* lm_logits = partial + ROWS * kSlices * plan.columns;
  float* x = lm_logits + ROWS * plan.columns;
  float* hidden_part = x + ROWS * rank;
  int* previous = reinterpret_cast<int*>(hidden_part + gamma * rows);
  int* alive = previous + rows;
  __shared__ unsigned long long warp_keys[ROWS][kWarps];

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int slice = (t / 16) % kSlices;
  const int first_column = blockIdx.x * plan.columns;
  const int loads = plan.loads, total_loads = plan.pairs * loads;
  auto column_of = [&](int pair) {  // pair j's first column; past the block or the vocabulary: no pair
    const int p = t + pair * kThreads;
    return first_column + (p / kGroupColumns) * kGroupColumns + (p % 16) * 8;
  };
  auto has_pair = [&](int pair) {
    const int column = column_of(pair);
    return column < vocab && column < first_column + plan.columns;
  };
  auto weight_at = [&](int q) {  // load q of this thread: pair q / loads, feature slice + 8 (q % loads)
    return reinterpret_cast<const uint4*>(w2 + static_cast<long>(slice + 8 * (q % loads)) * vocab +
                                          column_of(q / loads));
  };
  const uint4 zero = make_uint4(0, 0, 0, 0);

  // The block's weights, loaded before the wait for the LM head (no kernel writes them).
  uint4 registers[kRegisters];
#pragma unroll
  for (int q = 0; q < kRegisters; ++q)
    registers[q] = q < total_loads && has_pair(q / loads) ? __ldcs(weight_at(q)) : zero;
  for (int q = kRegisters; q < total_loads; ++q) {
    uint4* slot = cache + static_cast<long>(q - kRegisters) * kThreads + t;
    if (has_pair(q / loads))
      copy_to_shared_async(slot, weight_at(q));
    else
      *slot = zero;
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  for (int i = t; i < ROWS * rank; i += kThreads) x[i] = 0.0f;  // rows past the batch stay 0

  wait_for_previous_kernel();
  // The confidence logit's hidden part, w_h . h_k, for every position and row.
  for (int i = warp; i < gamma * rows; i += kWarps) {
    const float dot = hidden_confidence_logit(hidden + static_cast<long>(i) * width, weights.confidence_weight, width);
    if (lane == 0) hidden_part[i] = dot;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  for (int k = 0; k < gamma; ++k) {
    // x_{k-1}, e_k (into x for the first rows), c_k and pruning for every row, as
    // sequential_head_prepare_forward; every block reaches the same verdicts, block 0 writes them.
    for (int b = warp; b < rows; b += kWarps) {
      int token = k == 0 ? head.anchors[b] : argmax_index(__ldcg(argmax_keys + static_cast<long>(k - 1) * rows + b));
      token = min(max(token, 0), vocab - 1);  // a pruned row's later tokens are never used, but stay in range
      const bf16* e = weights.embedding + static_cast<long>(token) * rank;
      float dot = 0.0f;
      for (int i = lane; i < rank; i += 32) {
        const float value = __bfloat162float(e[i]);
        if (b < ROWS) x[b * rank + i] = value;
        dot += value * weights.confidence_weight[width + i];
      }
      dot = warp_sum(dot);
      if (lane == 0) {
        previous[b] = token;
        const float logit = (hidden_part[k * rows + b] + dot + weights.confidence_bias[0]) / weights.temperatures[k];
        const float confidence = confidence_of(logit);
        const bool kept = position_kept(k, confidence, k > 0 && alive[b] != 0, head.limits[b], control);
        alive[b] = kept;
        if (blockIdx.x == 0) {
          head.confidence[k * rows + b] = confidence;
          head.alive[b] = kept;
          if (k == 0) head.count[b] = 0;
          if (kept) head.count[b] = k + 1;
        }
      }
    }
    __syncthreads();
    int alive_count = 0;
    for (int b = 0; b < rows; ++b) alive_count += alive[b];
    if (blockIdx.x == 0 && t == 0) head.alive_rows[k] = alive_count;
    if (alive_count == 0) break;  // the same in every block: no later position is drafted

    // L_k += e_k @ w2 and the argmax keys, ROWS rows at a time.
    for (int first_row = 0; first_row < rows; first_row += ROWS) {
      const int group_rows = min(ROWS, rows - first_row);
      float* position_logits = logits + (static_cast<long>(k) * rows + first_row) * vocab + first_column;
      const int columns = min(plan.columns, vocab - first_column);
      for (int i = t; i < group_rows * plan.columns; i += kThreads) {  // read while the products run
        const int r = i / plan.columns, c = i % plan.columns;
        if (c < columns) copy_to_shared_async<4>(lm_logits + i, position_logits + static_cast<long>(r) * vocab + c);
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
      if (first_row > 0) {  // the first group's x came with the prepare
        for (int i = t; i < ROWS * rank; i += kThreads) {
          const int r = i / rank;
          x[i] = r < group_rows
                     ? __bfloat162float(weights.embedding[static_cast<long>(previous[first_row + r]) * rank + i % rank])
                     : 0.0f;
        }
        __syncthreads();
      }
      float sums[ROWS][8];
      auto clear_sums = [&] {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) sums[r][j] = 0.0f;
      };
      clear_sums();
      int pair = 0, n = 0;
      auto add = [&](uint4 packed) {  // the next load of this thread; a pair's last one stores its sums
        accumulate<ROWS>(sums, packed, x, rank, slice + 8 * n);
        if (++n < loads) return;
        if (has_pair(pair)) {
          const int local = column_of(pair) - first_column;
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            float4* destination = reinterpret_cast<float4*>(partial + (r * kSlices + slice) * plan.columns + local);
            destination[0] = make_float4(sums[r][0], sums[r][1], sums[r][2], sums[r][3]);
            destination[1] = make_float4(sums[r][4], sums[r][5], sums[r][6], sums[r][7]);
          }
        }
        clear_sums();
        ++pair, n = 0;
      };
#pragma unroll
      for (int q = 0; q < kRegisters; ++q)
        if (q < total_loads) add(registers[q]);
      for (int q = kRegisters; q < total_loads; ++q) add(cache[static_cast<long>(q - kRegisters) * kThreads + t]);
      asm volatile("cp.async.wait_all;" ::: "memory");
      __syncthreads();

      // Each column: the slices' sums in order, then the LM head's logit; each row's first largest.
      unsigned long long keys[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) keys[r] = 0;
      for (int c = t; c < columns; c += kThreads) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r >= group_rows) break;
          float total = 0.0f;
#pragma unroll
          for (int s = 0; s < kSlices; ++s) total += partial[(r * kSlices + s) * plan.columns + c];
          total += lm_logits[r * plan.columns + c];
          position_logits[static_cast<long>(r) * vocab + c] = total;
          keys[r] = max(keys[r], argmax_key(total, first_column + c));
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
          keys[r] = max(keys[r], __shfl_xor_sync(0xffffffffu, keys[r], offset));
        if (lane == 0) warp_keys[r][warp] = keys[r];
      }
      __syncthreads();
      if (t < group_rows) {
        unsigned long long key = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) key = max(key, warp_keys[t][w]);
        atomicMax(argmax_keys + static_cast<long>(k) * rows + first_row + t, key);
      }
      // No barrier here: the next group rewrites x, partial and lm_logits, and warp_keys only after barriers.
    }
    grid_barrier(barrier, barrier + 1, gridDim.x);  // position k's keys are complete
  }
  if (blockIdx.x == 0)
    for (int i = t; i < gamma * rows; i += kThreads) head.tokens[i] = argmax_index(__ldcg(argmax_keys + i));
}

// Position k of the Markov head for the rows of block row y, with no prepare
// kernel between two positions' products: every block finds its rows' x_{k-1}
// and verdicts itself, from a few loads (the confidence logit is h_k .
// conf.w[:d], written by the writer blocks at position 0, plus the token's
// w1[x_{k-1}] . conf.w[d:] from a table made at upload), gathers e_k = w1[x_{k-1}]
// as it multiplies, and leaves if none of its rows is still drafting. The
// writer blocks (x = 0) write the confidences and verdicts. "Kept position
// k - 1" is read as count >= k: the writer only ever raises a count to k + 1
// here, so a block that reads it as it is written reaches the same verdict.
// At one row each thread loads its first two weight octets before the wait.
// Up to two rows, registers are capped at five blocks a multiprocessor so that
// Qwen3-8B's 594 blocks run in one wave and leave little room for the next
// position's blocks to sit waiting early; the uncapped kernel, with up to
// eight blocks a multiprocessor, made each position slower (docs/PERF.md,
// stop 33).
template <int ROWS>
constexpr int kPositionBlocks = ROWS <= 2 ? 5 : 1;  // blocks a multiprocessor at least

// x_{k-1} of the block's rows: the anchors at position 0, else position k - 1's
// argmax (or drawn) tokens, clamped to the vocabulary (a pruned row's later
// tokens are never used, but stay in range).
template <int ROWS>
__device__ __forceinline__ void markov_previous_tokens(int (&tokens)[ROWS], const unsigned long long* argmax_keys,
                                                       const SequentialHeadState& head, int k, int first_row,
                                                       int row_count, int rows, int vocab) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    tokens[r] = 0;
    if (r >= row_count) continue;
    const long previous_slot = static_cast<long>(k - 1) * rows + first_row + r;
    const int token = k == 0        ? head.anchors[first_row + r]
                      : argmax_keys ? argmax_index(__ldcg(argmax_keys + previous_slot))
                                    : __ldcg(head.tokens + previous_slot);
    tokens[r] = min(max(token, 0), vocab - 1);
  }
}

// Position k's verdicts for the block's rows, given their x_{k-1}: the writer
// blocks (x = 0) write h . conf.w[:d] at position 0 and the rows' confidences
// and verdicts. Returns how many of the block's rows are still drafting.
template <int ROWS>
__device__ __forceinline__ int markov_position_verdicts(const int (&tokens)[ROWS], const float* hidden,
                                                        float* hidden_logits, int k, int first_row, int row_count,
                                                        int rows, int gamma, int width,
                                                        const SequentialHeadWeights& weights,
                                                        const DraftControl* control, const SequentialHeadState& head) {
  const bool writer = blockIdx.x == 0;
  if (k == 0 && writer) {  // h . conf.w[:d] of the block's rows at every position
    for (int i = threadIdx.x >> 5; i < gamma * row_count; i += blockDim.x >> 5) {
      const long slot = static_cast<long>(i / row_count) * rows + first_row + i % row_count;
      const float dot = hidden_confidence_logit(hidden + slot * width, weights.confidence_weight, width);
      if ((threadIdx.x & 31) == 0) hidden_logits[slot] = dot;
    }
    __syncthreads();
  }
  int kept_rows = 0;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= row_count) continue;
    const int b = first_row + r;
    if (k == 0 && !writer) {  // position 0 needs no confidence to be kept
      kept_rows += 0 < head.limits[b];
      continue;
    }
    const float logit = (__ldcg(hidden_logits + static_cast<long>(k) * rows + b) + weights.token_confidence[tokens[r]] +
                         weights.confidence_bias[0]) /
                        weights.temperatures[k];
    const float confidence = confidence_of(logit);
    const bool kept = position_kept(k, confidence, k > 0 && __ldcg(head.count + b) >= k, head.limits[b], control);
    kept_rows += kept;
    if (writer && threadIdx.x == 0) {
      head.confidence[k * rows + b] = confidence;
      head.alive[b] = kept;
      if (kept || k == 0) head.count[b] = kept ? k + 1 : 0;
    }
  }
  if (writer && threadIdx.x == 0 && kept_rows > 0) atomicAdd(head.alive_rows + k, kept_rows);
  return kept_rows;
}

// What every block of position k's kernels (markov_position_kernel,
// markov_position_tokens_kernel) does first, after its wait: the verdicts
// above, and e pointed at its rows' e_k = w1[x_{k-1}]. Returns how many of the
// block's rows are still drafting.
template <int ROWS>
__device__ __forceinline__ int markov_position_start(GatheredRows<ROWS>& e, const unsigned long long* argmax_keys,
                                                     const float* hidden, float* hidden_logits, int k, int first_row,
                                                     int row_count, int rows, int gamma, int rank, int width, int vocab,
                                                     const SequentialHeadWeights& weights, const DraftControl* control,
                                                     const SequentialHeadState& head) {
  int tokens[ROWS];
  markov_previous_tokens(tokens, argmax_keys, head, k, first_row, row_count, rows, vocab);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) e.rows[r] = weights.embedding + static_cast<long>(tokens[r]) * rank;
  return markov_position_verdicts(tokens, hidden, hidden_logits, k, first_row, row_count, rows, gamma, width, weights,
                                  control, head);
}

template <int ROWS, bool VECTOR, bool ARGMAX>
__global__ void __launch_bounds__(kInOutSlices * 32, kPositionBlocks<ROWS>)
    markov_position_kernel(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden,
                           float* hidden_logits, int k, int rows, int gamma, int rank, int width, int vocab,
                           SequentialHeadWeights weights, const DraftControl* control, SequentialHeadState head) {
  FirstWeights<VECTOR && ROWS == 1 ? 2 : 0> first;
  in_out_first_weights(first, w2, rank, vocab);  // nothing before this kernel writes w2
  wait_for_previous_kernel();
  start_next_kernel();
  const int first_row = blockIdx.y * ROWS, row_count = min(ROWS, rows - first_row);
  GatheredRows<ROWS> e;
  const int kept_rows = markov_position_start(e, argmax_keys, hidden, hidden_logits, k, first_row, row_count, rows,
                                              gamma, rank, width, vocab, weights, control, head);
  if (kept_rows == 0) return;  // the same in every thread: no barrier is skipped
  in_out_product<bf16, ROWS, VECTOR, ARGMAX>(
      logits + static_cast<long>(first_row) * vocab, e, w2, nullptr, row_count, rank, vocab, true,
      ARGMAX ? argmax_keys + static_cast<long>(k) * rows + first_row : nullptr, first);
}

// The tokens-only head (markov_position_tokens_forward). A block owns 512
// columns: lane l of warp w holds columns l*16 .. l*16+15 (a 16-byte piece
// of 8-bit weights per input feature) and the features i = w, w + 8, ...
// A pass is bound by the bytes in flight (a load waits microseconds under
// load), so each thread's pieces go through a ring of kTokenStaged slots in
// shared memory by cp.async, the first ones before the launch wait, each
// slot refilled as it is used: three blocks a multiprocessor keep ~190 KB in
// flight. (Streaming through registers, four pieces in flight, read the
// half-size weights no faster than the bf16 product reads w2.)
//
// The block's columns' logits are then bounded (U + scale * (e . q), give or
// take bound * ||e||); a column can hold the argmax only if its upper end
// reaches the block's best lower end and the best key any block has found so
// far. Those columns' exact logits are formed by eight lanes each, lane s
// summing the features s, s + 8, ... in order from the slice-major exact
// copy, as in_out_product's slice s does, then the slices in order, then U:
// the same bits as the full product's logit, so the same key.
constexpr int kTokenThreads = kInOutSlices * 32;
constexpr int kTokenColumns = 32 * 16;
constexpr int kTokenStaged = 16;  // a thread's slots (pieces in flight)
constexpr int kMaxTokenRank = 1024;

// Dynamic shared memory: the slots [kTokenStaged][kTokenThreads] uint4,
// later the slices' sums [kInOutSlices][kTokenColumns] f32; then e_k [r] f32.
constexpr size_t kTokenSlotBytes =
    std::max(sizeof(uint4) * kTokenStaged * kTokenThreads, sizeof(float) * kInOutSlices * kTokenColumns);

// x times sixteen 8-bit weights (q + 128 in one 16-byte piece) into sums:
// the byte b as a float's low bits under the exponent of 2^23 is 2^23 + b,
// so q = that - (2^23 + 128), exactly.
__device__ __forceinline__ void multiply_sixteen(float (&sums)[16], uint4 packed, float x) {
  const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int w = 0; w < 4; ++w)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float q = __uint_as_float(__byte_perm(words[w], 0x4B000000u, 0x7440u | b)) - 8388736.0f;
      sums[w * 4 + b] += x * q;
    }
}

// INTERVALS: U_k too is an interval (LmHeadIntervals): the blocks meet at a
// grid barrier (all of them are resident: 297 at Qwen3-8B's vocabulary, three
// a multiprocessor) to compare with the best lower end of all, and a
// candidate's U_k is formed by the block's eight warps as the LM head's
// tensor-core GEMV forms it (tensor_gemv.cuh), from h_k and weight rows staged
// in shared memory: a warp's chunks follow each other, and from global memory
// each would wait for its own round trip.
constexpr size_t kWarpSumBytes = sizeof(float) * kMmaWarps * 4 * 32;
constexpr int kStagedRowPadding = 8;  // elements: rows g and g + 1 of a piece's load in different banks
constexpr int kMaxStagedRows = 16;    // the mma's 16 weight rows

// Candidate rows the slots hold at once beside the warps' sums and h_k (0: H too large).
__host__ __device__ constexpr int staged_row_count(int hidden_size) {
  const long free = long(kTokenSlotBytes) - long(kWarpSumBytes) - 2L * hidden_size;
  const long rows = free < 0 ? 0 : free / (2L * (hidden_size + kStagedRowPadding));
  return int(rows < kMaxStagedRows ? rows : kMaxStagedRows);
}
static_assert(staged_row_count(kMaxIntervalHidden) >= 1);

// A column's logit U + B lies within [lower, upper]: B within `reach` of `center` (from the 8-bit sum), U
// within base_reach of base (plus slack for its rounding). NaN anywhere makes upper NaN: such a column always
// gets its exact sum.
__device__ __forceinline__ void column_interval(float& upper, float& lower, float base, float base_reach, float center,
                                                float reach, float slack) {
  const float value = base + center;
  const float spread = reach + base_reach + slack * fabsf(base) + 1e-30f;
  upper = value + spread;
  lower = value - spread;
}

// The block's best lower end (-inf where it has none), in every thread: warps (= blockDim.x / 32) slots of
// shared memory in per_warp. (cuda::block_max fills past the warps with -FLT_MAX, not -inf.)
__device__ __forceinline__ float block_best_lower(float lower, float* per_warp, int warps) {
  lower = warp_max(lower);
  if ((threadIdx.x & 31) == 0) per_warp[threadIdx.x >> 5] = lower;
  __syncthreads();
  for (int w = 0; w < warps; ++w) lower = fmaxf(lower, per_warp[w]);
  return lower;
}

// The candidates' U_k (INTERVALS), as the LM head's tensor-core GEMV forms it (tensor_gemv.cuh), `staged` (at
// most kMaxStagedRows) at a time: h_k and the candidates' weight rows come into shared memory (`staging`: the warps'
// sums [kMmaWarps][4][32] f32, h_k [H] bf16, `staged` rows [H + kStagedRowPadding] bf16) in one round trip, then weight
// rows g and g + 8 of lane (g, c) of warps 0..7 are candidates first + g and first + g + 8, every column of the
// activation tile is h_k, and column 0 is kept. Every thread of the block calls it.
__device__ __forceinline__ void lm_head_candidate_logits(float* candidate_base, const unsigned short* candidates,
                                                         int candidate_count, long first_column,
                                                         const LmHeadIntervals& lm, int k, unsigned char* staging,
                                                         int staged) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3, H = lm.hidden_size, stride = H + kStagedRowPadding;
  float* warp_sums = reinterpret_cast<float*>(staging);
  bf16* staged_hidden = reinterpret_cast<bf16*>(staging + kWarpSumBytes);
  bf16* staged_rows = staged_hidden + H;  // [staged][stride]
  const int pieces = H / 8;
  if (candidate_count > 0)
    for (int i = threadIdx.x; i < pieces; i += blockDim.x)
      copy_to_shared_async(staged_hidden + 8 * i, lm.hidden + static_cast<long>(k) * H + 8 * i);
  for (int first = 0; first < candidate_count; first += staged) {
    const int count = min(staged, candidate_count - first);
    for (int i = threadIdx.x; i < count * pieces; i += blockDim.x) {
      const int j = i / pieces, piece = i - j * pieces;
      const long v = first_column + candidates[first + j];
      copy_to_shared_async(staged_rows + j * stride + 8 * piece, lm.weight + v * H + 8 * piece);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    if (warp < kMmaWarps) {
      const bool low_valid = g < count, high_valid = g + 8 < count;
      const bf16* low_row = staged_rows + g * stride;
      const bf16* high_row = staged_rows + (g + 8) * stride;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      float sums[4] = {};
      for (int at = warp * kMmaChunk; at < H; at += kMmaWarps * kMmaChunk) {
        const int own = at + c * (kMmaChunk / 4);  // a lane's 16 elements: all inside H or none (as in the GEMV)
        const bool inside = own < H;
#pragma unroll
        for (int piece = 0; piece < kMmaPieces; ++piece) {
          const int at_piece = own + 8 * piece;
          const uint4 a_low = low_valid && inside ? *reinterpret_cast<const uint4*>(low_row + at_piece) : zero;
          const uint4 a_high = high_valid && inside ? *reinterpret_cast<const uint4*>(high_row + at_piece) : zero;
          const uint4 b = inside ? *reinterpret_cast<const uint4*>(staged_hidden + at_piece) : zero;
          tensor_gemv_multiply_piece(sums, a_low, a_high, b);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) warp_sums[(warp * 4 + i) * 32 + lane] = sums[i];
    }
    __syncthreads();
    if (threadIdx.x < count) {  // row j: lane (j % 8, 0), element 0 or 2
      const int j = threadIdx.x, from = (j % 8) * 4, i = j < 8 ? 0 : 2;
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) total += warp_sums[(w * 4 + i) * 32 + from];
      candidate_base[first + j] = total;
    }
    __syncthreads();  // the staged rows and the warps' sums are free again
  }
}

// The candidates' exact logits, eight lanes each: lane s sums the features s, s + 8, ... in order from the
// slice-major exact copy, as in_out_product's slice s does, then the slices in order, then U (base(c)): the
// same bits as the full product's logit. Returns the best key of the thread's candidates (0: none).
template <class Base>
__device__ __forceinline__ unsigned long long candidate_keys(const unsigned short* candidates, int candidate_count,
                                                             long first_column, const float* e,
                                                             const QuantizedColumnsView& w2, int rank, Base base) {
  const int lane = threadIdx.x & 31, group = threadIdx.x >> 3, part = threadIdx.x & 7;
  const unsigned group_mask = 0xffu << (lane & 24);
  const int steps = rank / kInOutSlices;
  unsigned long long best = 0;
  for (int c = group; c < candidate_count; c += blockDim.x / 8) {
    const long v = first_column + candidates[c];
    const bf16* weights_of_part = w2.exact + v * rank + part * steps;
    float sum = 0.0f;
    if (steps % 8 == 0) {  // 16-byte pieces, four in flight at once (one round trip at r 256), summed in order
      for (int j = 0; j < steps; j += 32) {
        uint4 pieces[4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
          pieces[p] = j + 8 * p < steps ? __ldg(reinterpret_cast<const uint4*>(weights_of_part + j + 8 * p))
                                        : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          if (j + 8 * p >= steps) break;
          float w[8];
          unpack_eight(pieces[p], w);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum = fmaf(e[part + kInOutSlices * (j + 8 * p + i)], w[i], sum);
        }
      }
    } else {
      for (int j = 0; j < steps; ++j)
        sum = fmaf(e[part + kInOutSlices * j], __bfloat162float(__ldg(weights_of_part + j)), sum);
    }
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < kInOutSlices; ++s) total += __shfl_sync(group_mask, sum, s, 8);
    total += base(c);
    best = max(best, argmax_key(total, static_cast<int>(v)));
  }
  return best;
}

template <bool INTERVALS>
__global__ void __launch_bounds__(kTokenThreads, 3)
    markov_position_tokens_kernel(unsigned long long* argmax_keys, const float* logits, QuantizedColumnsView w2,
                                  LmHeadIntervals lm, const float* hidden, float* hidden_logits, int k, int rows,
                                  int gamma, int rank, int width, int vocab, SequentialHeadWeights weights,
                                  const DraftControl* control, SequentialHeadState head) {
  static_assert(kTokenThreads == kMmaWarps * 32, "a candidate's U_k takes the GEMV's warps");
  extern __shared__ __align__(16) unsigned char token_shared[];
  uint4* slots = reinterpret_cast<uint4*>(token_shared) + threadIdx.x;  // slot j at slots[j * kTokenThreads]
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const int column = blockIdx.x * kTokenColumns + lane * 16;  // a multiple of 16: all 16 are within the stride
  const bool active = column < vocab;
  const int steps = rank / kInOutSlices;  // features (pieces) per slice
  // Piece j into its slot, as one cp.async group (empty past the last piece: the ring's count stays even).
  auto stage = [&](int j) {
    if (active && j < steps)
      copy_to_shared_async(slots + (j % kTokenStaged) * kTokenThreads,
                           w2.values + static_cast<long>(slice + kInOutSlices * j) * w2.stride + column);
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  for (int j = 0; j < kTokenStaged; ++j) stage(j);  // before the wait: nothing before this kernel writes w2
  // The block's columns' scales and bounds (two a thread), also never written.
  float scale[2], bound[2], row_bound[2], row_norm[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int v = min(blockIdx.x * kTokenColumns + threadIdx.x + h * kTokenThreads, vocab - 1);
    scale[h] = __ldg(w2.scales + v), bound[h] = __ldg(w2.bounds + v);
    if constexpr (INTERVALS) row_bound[h] = __ldg(lm.row_bounds + v), row_norm[h] = __ldg(lm.row_norms + v);
  }
  wait_for_previous_kernel();
  start_next_kernel();
  GatheredRows<1> row;
  if (markov_position_start(row, argmax_keys, hidden, hidden_logits, k, 0, 1, rows, gamma, rank, width, vocab, weights,
                            control, head) == 0) {
    asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives the block
    return;                                           // the same in every thread: no barrier is skipped
  }
  float base[2], base_reach[2] = {};  // U of the two columns (INTERVALS: its center, and how far U can be from it)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int v = min(blockIdx.x * kTokenColumns + threadIdx.x + h * kTokenThreads, vocab - 1);
    if constexpr (INTERVALS) {
      base[h] = __ldcg(lm.centers + static_cast<long>(k) * vocab + v);
      base_reach[h] = __ldcg(lm.activation_norms + k) * row_bound[h] +
                      __ldcg(lm.activation_norms + kQuantizedActivationRows + k) * row_norm[h] +
                      __ldcg(lm.activation_norms + 2 * kQuantizedActivationRows + k);
    } else {
      base[h] = __ldcg(logits + v);
    }
  }
  // e_k into shared memory in one round trip (read in the loop, one feature an iteration, it waited on
  // each of its cache lines in turn).
  float* e = reinterpret_cast<float*>(token_shared + kTokenSlotBytes);
  for (int f = threadIdx.x * 8; f < rank; f += kTokenThreads * 8)
    unpack_eight(__ldg(reinterpret_cast<const uint4*>(row.rows[0] + f)), e + f);
  __syncthreads();

  float sums[16];
#pragma unroll
  for (int c = 0; c < 16; ++c) sums[c] = 0.0f;
  for (int j = 0; j < steps; ++j) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kTokenStaged - 1) : "memory");  // piece j has landed
    if (active) multiply_sixteen(sums, slots[(j % kTokenStaged) * kTokenThreads], e[slice + kInOutSlices * j]);
    stage(j + kTokenStaged);  // its slot, refilled (a thread reads and writes only its own slots)
  }
  asm volatile("cp.async.wait_all;" ::: "memory");

  float* partial = reinterpret_cast<float*>(token_shared);  // [kInOutSlices][kTokenColumns], over the slots
  __shared__ float warp_lower[kInOutSlices];
  __shared__ unsigned short candidates[kTokenColumns];
  __shared__ int candidate_count;
  __shared__ unsigned long long block_key;
  const float slack = w2.slack;
  const long slot = static_cast<long>(k) * rows;
  float norm = 0.0f;  // ||e||_2, each warp its own (the same) sum
  for (int f = lane; f < rank; f += 32) norm += e[f] * e[f];
  norm = sqrtf(warp_sum(norm)) * (1.0f + slack);
  const unsigned long long found = __ldcg(argmax_keys + slot);  // the best exact key of the blocks done so far
  __syncthreads();                                              // every thread is done with its slots
  float4* mine = reinterpret_cast<float4*>(partial + slice * kTokenColumns + lane * 16);
#pragma unroll
  for (int c = 0; c < 4; ++c) mine[c] = make_float4(sums[4 * c], sums[4 * c + 1], sums[4 * c + 2], sums[4 * c + 3]);
  if (threadIdx.x == 0) candidate_count = 0, block_key = 0;
  __syncthreads();

  // Each thread bounds two columns' logits.
  float upper[2];
  float best_lower = -INFINITY;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int local = threadIdx.x + h * kTokenThreads, v = blockIdx.x * kTokenColumns + local;
    upper[h] = -INFINITY;
    if (v >= vocab) continue;
    float approximate = 0.0f;
#pragma unroll
    for (int s = 0; s < kInOutSlices; ++s) approximate += partial[s * kTokenColumns + local];
    float lower;
    column_interval(upper[h], lower, base[h], base_reach[h], scale[h] * approximate, bound[h] * norm, slack);
    best_lower = fmaxf(best_lower, lower);
  }
  best_lower = block_best_lower(best_lower, warp_lower, kInOutSlices);
  if constexpr (INTERVALS) {  // the best lower end of all blocks
    if (threadIdx.x == 0) atomicMax(lm.lower_keys + k, ordered_bits(best_lower));
    grid_barrier(lm.barrier, lm.barrier + 1, gridDim.x);
    best_lower = fmaxf(best_lower, float_of_ordered_bits(__ldcg(lm.lower_keys + k)));
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int local = threadIdx.x + h * kTokenThreads, v = blockIdx.x * kTokenColumns + local;
    if (v < vocab && !(upper[h] < best_lower) && argmax_key(upper[h], v) >= found)
      candidates[atomicAdd(&candidate_count, 1)] = local;
  }
  __syncthreads();

  const long first_column = static_cast<long>(blockIdx.x) * kTokenColumns;
  __shared__ float candidate_base[INTERVALS ? kTokenColumns : 1];
  if constexpr (INTERVALS)  // over the slots: the bounds' sums are done with
    lm_head_candidate_logits(candidate_base, candidates, candidate_count, first_column, lm, k, token_shared,
                             staged_row_count(lm.hidden_size));
  const unsigned long long best = candidate_keys(candidates, candidate_count, first_column, e, w2, rank, [&](int c) {
    return INTERVALS ? candidate_base[c] : logits[first_column + candidates[c]];
  });
  if (best) atomicMax(&block_key, best);
  __syncthreads();
  if (threadIdx.x == 0 && block_key) atomicMax(argmax_keys + slot, block_key);
}

// The one-launch tokens head's timeline (draft.h, set_markov_head_timeline).
__device__ unsigned long long* head_timeline;  // set_markov_head_timeline

// The block's stamps (draft.h) while the kernel runs: thread 0 keeps them in shared memory and writes them out at
// the end.
struct TimelineStamps {
  bool on;  // head_timeline is set (thread 0's copy)
  unsigned clocks[kHeadTimelineClockSlots];
  unsigned counts[kHeadTimelinePositions];
  unsigned long long global_start;
};

__device__ __forceinline__ void timeline_stamp(TimelineStamps& stamps, int slot) {
  if (threadIdx.x == 0 && stamps.on && slot < kHeadTimelineClockSlots)
    stamps.clocks[slot] = static_cast<unsigned>(clock64());
}

__device__ __forceinline__ void timeline_count(TimelineStamps& stamps, int k, int count) {
  if (threadIdx.x == 0 && stamps.on && k < kHeadTimelinePositions) stamps.counts[k] = count;
}

__device__ __forceinline__ void timeline_write(const TimelineStamps& stamps) {
  if (threadIdx.x != 0 || !stamps.on) return;
  unsigned long long* out = head_timeline;
  const unsigned clock_end = static_cast<unsigned>(clock64());
  out += static_cast<long>(blockIdx.x) * kHeadTimelineSlots;
  for (int i = 0; i < kHeadTimelineClockSlots; ++i) out[i] = stamps.clocks[i];
  out[kHeadTimelineGlobalStart] = stamps.global_start;
  out[kHeadTimelineGlobalEnd] = global_nanoseconds();
  out[kHeadTimelineClockEnd] = clock_end;
  for (int k = 0; k < kHeadTimelinePositions; ++k) out[kHeadTimelineCounts + k] = stamps.counts[k];
}

// The tokens-only head of a whole draft step in one persistent launch
// (markov_head_tokens_forward): position k's work is the tokens kernel's
// above, but w2's 8-bit columns are read from memory once a step, not once a
// position. One block a multiprocessor owns `pieces` pieces of 16 columns
// (Qwen3-8B: 72 pieces, 1152 columns, 288 KB of w2 at r 256) and keeps them
// on chip for every position: kHeadTokensRegisterLoads 16-byte loads a thread
// in registers, the rest in shared memory. Each lane ends a position with the
// 8-bit sums of two columns; those give only intervals, whose bound does not
// depend on the order of the sum, and the exact logits are formed as the
// tokens kernel forms them. The blocks meet at a grid barrier
// (counted_grid_barrier) when each position's keys are complete, and
// (INTERVALS) once before, for the best lower end of all blocks. (At 576
// threads a thread gets at most 96 registers: the position's per-column
// values pass through shared memory so that the weights' registers are not
// spilled; ptxas reports 44 bytes spilled in the INTERVALS kernel, against
// ~180 when a lane held those values: docs/PERF.md, stop 38.)
//
// Warp w holds pieces 4w .. 4w + 3, lane l piece 4w + l / 8 and the features
// s, s + 8, ... (s = l % 8); the eight lanes of a piece then halve their
// sixteen sums three times, so lane s ends with the piece's columns 2s and
// 2s + 1. The sums are integers, exact: once a step each lane turns its
// loads, four features at a time, into one word a column (a 4 x 4 byte
// transpose, q signed), and at each position e_k is rounded to 16 bits
// (e ~ e_scale * e16, e_scale = max |e| / 32767) so that two dp2a
// instructions add a column's four products: a sixth of the instructions of
// converting each weight to f32 and multiplying, which was most of a
// position (docs/PERF.md, stop 38). The bound gains
// ||e - e_scale e16|| * scale_v * ||q_v|| for the rounding of e.
constexpr int kHeadTokensMaxThreads = 576;  // 72 pieces: Qwen3-8B's vocabulary over 132 multiprocessors
constexpr int kColumnArrays = 5;            // a position's data a column (markov_head_tokens_kernel's column_data)
constexpr int kHeadTokensRegisterLoads = 12;  // three groups of four loads
constexpr int kLargestE16 = 32767;

// Four loads (16 columns at features f0..f3) into words of one column each: word m of out[j] is column 4j + m, its
// bytes f0..f3, and q = stored - 128 as a signed byte.
__device__ __forceinline__ void transpose_four_loads(uint4 (&loads)[4]) {
  const unsigned in[4][4] = {{loads[0].x, loads[0].y, loads[0].z, loads[0].w},
                             {loads[1].x, loads[1].y, loads[1].z, loads[1].w},
                             {loads[2].x, loads[2].y, loads[2].z, loads[2].w},
                             {loads[3].x, loads[3].y, loads[3].z, loads[3].w}};
  unsigned out[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // columns 4j .. 4j + 3: word j of each load
    const unsigned low01 = __byte_perm(in[0][j], in[1][j], 0x5140), high01 = __byte_perm(in[0][j], in[1][j], 0x7362);
    const unsigned low23 = __byte_perm(in[2][j], in[3][j], 0x5140), high23 = __byte_perm(in[2][j], in[3][j], 0x7362);
    out[j][0] = __byte_perm(low01, low23, 0x5410) ^ 0x80808080u;
    out[j][1] = __byte_perm(low01, low23, 0x7632) ^ 0x80808080u;
    out[j][2] = __byte_perm(high01, high23, 0x5410) ^ 0x80808080u;
    out[j][3] = __byte_perm(high01, high23, 0x7632) ^ 0x80808080u;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) loads[j] = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
}

__device__ __forceinline__ int round_to_e16(float value, float inverse_scale) {
  return min(max(__float2int_rn(value * inverse_scale), -kLargestE16), kLargestE16);
}

// sums[c] += e16 . (column c's four bytes) for the 16 columns of a transposed group; low_pair, high_pair: e16 of
// f0, f1 and of f2, f3, the lower feature in the low half.
__device__ __forceinline__ void add_group(int (&sums)[16], const uint4 (&group)[4], int low_pair, int high_pair) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int words[4] = {int(group[j].x), int(group[j].y), int(group[j].z), int(group[j].w)};
#pragma unroll
    for (int m = 0; m < 4; ++m)
      sums[4 * j + m] = __dp2a_hi(high_pair, words[m], __dp2a_lo(low_pair, words[m], sums[4 * j + m]));
  }
}

// A lane and its partner (lane ^ bit, bit within a piece's eight lanes) split 2N sums: the lane whose slice has
// `bit` keeps the upper N, the other the lower N, each plus the partner's share of them.
template <int N>
__device__ __forceinline__ void keep_half(const int (&sums)[2 * N], int (&kept)[N], int slice, int bit) {
  const bool upper_half = slice & bit;
#pragma unroll
  for (int i = 0; i < N; ++i)
    kept[i] =
        (upper_half ? sums[N + i] : sums[i]) + __shfl_xor_sync(0xffffffffu, upper_half ? sums[i] : sums[N + i], bit);
}

struct HeadTokensPlan {
  int pieces;        // pieces of 16 columns a block: a multiple of 4, at least 32 (the candidates' GEMV's 8 warps)
  int blocks;        // one a multiprocessor at most
  int loads;         // 16-byte loads a thread: r / 8
  int groups;        // of four loads: loads / 4 rounded up (the loads past r are zeros)
  int shared_loads;  // kept in shared memory: 4 groups - kHeadTokensRegisterLoads
  int staged;        // INTERVALS: candidate rows staged at once
  size_t shared_bytes;
};

// Dynamic shared memory: the cached weights [shared_loads][threads] uint4, e_k [r] f32, e16 [8][4 groups] i16,
// the candidates [pieces * 16] u16 and their U [pieces * 16] f32, then (INTERVALS) lm_head_candidate_logits's
// staging.
template <bool INTERVALS>
__global__ void __launch_bounds__(kHeadTokensMaxThreads, 1)
    markov_head_tokens_kernel(unsigned long long* argmax_keys, const float* logits, QuantizedColumnsView w2,
                              LmHeadIntervals lm, const float* hidden, float* hidden_logits, int gamma, int rank,
                              int width, int vocab, SequentialHeadWeights weights, const DraftControl* control,
                              SequentialHeadState head, HeadTokensPlan plan, unsigned* counter) {
  constexpr int kRegisters = kHeadTokensRegisterLoads;
  extern __shared__ __align__(16) unsigned char head_shared[];
  const int threads = blockDim.x, columns = plan.pieces * 16;
  uint4* cache = reinterpret_cast<uint4*>(head_shared);
  float* e = reinterpret_cast<float*>(cache + static_cast<long>(plan.shared_loads) * threads);
  // e16 [8][4 groups]: slice s's features s, s + 8, ... in order, zeros past r; a group's two pairs in one int2.
  auto* e16 = reinterpret_cast<short*>(e + rank);
  auto* candidates = reinterpret_cast<unsigned short*>(e16 + 32 * plan.groups);  // the block's columns: local indices
  float* candidate_base = reinterpret_cast<float*>(candidates + columns);
  unsigned char* staging = reinterpret_cast<unsigned char*>(candidate_base + columns);
  // Over the staging, free until the candidates: the block's columns' scales, bounds, U (or its centers), and
  // (INTERVALS) the LM-head rows' bounds and norms, [kColumnArrays][columns] f32, then ||h_k||, ||h_k - h'_k||,
  // reach_k.
  float* column_data = reinterpret_cast<float*>(staging);
  __shared__ float warp_lower[kHeadTokensMaxThreads / 32];
  __shared__ int candidate_count;
  __shared__ unsigned long long block_key;

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, slice = lane & 7;
  const long first_column = static_cast<long>(blockIdx.x) * columns;
  const int local = (warp * 4 + (lane >> 3)) * 16 + 2 * slice;  // the lane's first column in the block (of two)
  const long column = first_column + local - 2 * slice;         // its piece's first column
  auto weight_at = [&](int q) -> const uint4* {  // load q: feature slice + 8q of the piece; null past the vocabulary
    return column < vocab ? reinterpret_cast<const uint4*>(
                                w2.values + static_cast<long>(slice + kInOutSlices * q) * w2.stride + column)
                          : nullptr;
  };
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const uint4 stored_zero = make_uint4(0x80808080u, 0x80808080u, 0x80808080u, 0x80808080u);  // q = 0
  // The block's weights, before the wait: nothing before this kernel writes them.
  uint4 registers[kRegisters / 4][4];
#pragma unroll
  for (int q = 0; q < kRegisters; ++q) {
    const uint4* source = q < plan.loads ? weight_at(q) : nullptr;
    registers[q / 4][q % 4] = source ? __ldcs(source) : stored_zero;
  }
  const int shared_end = 4 * plan.groups;
  for (int q = kRegisters; q < shared_end; ++q) {
    uint4* slot = cache + static_cast<long>(q - kRegisters) * threads + t;
    const uint4* source = q < plan.loads ? weight_at(q) : nullptr;
    if (source)
      copy_to_shared_async(slot, source);
    else
      *slot = stored_zero;
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  wait_for_previous_kernel();
  start_next_kernel();
  __shared__ TimelineStamps timeline;
  if (t == 0) timeline.on = head_timeline != nullptr;
  if (t == 0 && timeline.on) {
    for (int i = 0; i < kHeadTimelineClockSlots; ++i) timeline.clocks[i] = 0;
    for (int k = 0; k < kHeadTimelinePositions; ++k) timeline.counts[k] = 0;
    timeline.global_start = global_nanoseconds();
  }
  timeline_stamp(timeline, 0);
#pragma unroll
  for (int g = 0; g < kRegisters / 4; ++g) transpose_four_loads(registers[g]);
  asm volatile("cp.async.wait_all;" ::: "memory");  // a thread transposes only its own slots
  for (int g = kRegisters / 4; g < plan.groups; ++g) {
    uint4 group[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) group[j] = cache[static_cast<long>(4 * g + j - kRegisters) * threads + t];
    transpose_four_loads(group);
#pragma unroll
    for (int j = 0; j < 4; ++j) cache[static_cast<long>(4 * g + j - kRegisters) * threads + t] = group[j];
  }
  const float q_norm_bound = 127.0f * sqrtf(static_cast<float>(rank)) * (1.0f + w2.slack);  // ||q_v||_2 at most
  // Of each warp that holds part of e_k: max |e|, and the sums of e^2 and of (e - e_scale e16)^2.
  __shared__ float e_largest[kHeadTokensMaxThreads / 32], e_square[kHeadTokensMaxThreads / 32],
      e_rounding[kHeadTokensMaxThreads / 32];
  for (int i = t; i < 32 * plan.groups; i += threads) e16[i] = 0;
  __syncthreads();
  timeline_stamp(timeline, 1);

  const float slack = w2.slack;
  unsigned meetings = 0;  // grid barriers so far
  for (int k = 0; k < gamma; ++k) {
    const int stage = 2 + k * kHeadTimelineStages;
    timeline_stamp(timeline, stage);
    // The block's columns' scales and bounds and U (INTERVALS: its center, and its row's bound and norm) into
    // shared memory, before the previous token is known; read after the sums. (Held in registers across the sums
    // they pushed the weights out of registers, and the sums read them back from memory at every position.)
    for (int i = t; i < columns; i += threads) {
      const long v = min(first_column + i, static_cast<long>(vocab - 1));
      const float* sources[kColumnArrays] = {w2.scales + v, w2.bounds + v,
                                             (INTERVALS ? lm.centers : logits) + static_cast<long>(k) * vocab + v,
                                             lm.row_bounds + v, lm.row_norms + v};
#pragma unroll
      for (int a = 0; a < (INTERVALS ? kColumnArrays : 3); ++a)
        copy_to_shared_async<4>(column_data + a * columns + i, sources[a]);
    }
    if (INTERVALS && t < 3)  // ||h_k||, ||h_k - h'_k|| and the reach beyond (quantized_product.h)
      copy_to_shared_async<4>(column_data + kColumnArrays * columns + t,
                              lm.activation_norms + t * kQuantizedActivationRows + k);
    asm volatile("cp.async.commit_group;" ::: "memory");
    int token[1];
    markov_previous_tokens(token, argmax_keys, head, k, 0, 1, 1, vocab);
    // e_k = w1[x_{k-1}] (16 bytes a thread) is read beside the verdict's loads: one round trip for both.
    const uint4 e_piece =
        t * 8 < rank
            ? __ldg(reinterpret_cast<const uint4*>(weights.embedding + static_cast<long>(token[0]) * rank + t * 8))
            : zero;
    if (markov_position_verdicts(token, hidden, hidden_logits, k, 0, 1, 1, gamma, width, weights, control, head) == 0)
      break;  // the same verdict in every block: no barrier is skipped
    float piece_largest = 0.0f;
    if (t * 8 < rank) {
      float values[8];
      unpack_eight(e_piece, values);
#pragma unroll
      for (int i = 0; i < 8; ++i) e[t * 8 + i] = values[i], piece_largest = fmaxf(piece_largest, fabsf(values[i]));
    }
    if (warp * 256 < rank) {  // the warps that hold part of e_k
      piece_largest = warp_max(piece_largest);
      if (lane == 0) e_largest[warp] = piece_largest;
    }
    if (t == 0) candidate_count = 0, block_key = 0;
    __syncthreads();
    timeline_stamp(timeline, stage + 1);

    // B_k of the lane's two columns: a center and how far B can be from it, from the exact integer sums of
    // e16 and q. First e16, by the threads that hold e_k.
    float largest = 0.0f;
    for (int w = 0; w * 256 < rank; ++w) largest = fmaxf(largest, e_largest[w]);
    const float inverse_scale = largest > 0.0f ? kLargestE16 / largest : 0.0f;
    const float e_scale = largest / kLargestE16;
    asm volatile("cp.async.wait_all;" ::: "memory");  // the columns' data, visible to all after the barrier
    if (warp * 256 < rank) {
      float square = 0.0f, rounding = 0.0f;
      if (t * 8 < rank) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // feature 8t + i: slice i, the t-th of its slice
          const float value = e[t * 8 + i];
          const int rounded = round_to_e16(value, inverse_scale);
          const float left = value - e_scale * static_cast<float>(rounded);
          e16[i * 4 * plan.groups + t] = static_cast<short>(rounded);
          square += value * value, rounding += left * left;
        }
      }
      square = warp_sum(square), rounding = warp_sum(rounding);
      if (lane == 0) e_square[warp] = square, e_rounding[warp] = rounding;
    }
    __syncthreads();
    timeline_stamp(timeline, stage + 2);
    int sums[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sums[i] = 0;
    const int2* pairs = reinterpret_cast<const int2*>(e16 + slice * 4 * plan.groups);  // group g: e16 pairs
#pragma unroll
    for (int g = 0; g < kRegisters / 4; ++g) {
      const int2 pair = pairs[g];
      add_group(sums, registers[g], pair.x, pair.y);
    }
    for (int g = kRegisters / 4; g < plan.groups; ++g) {
      const int2 pair = pairs[g];
      uint4 group[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) group[j] = cache[static_cast<long>(4 * g + j - kRegisters) * threads + t];
      add_group(sums, group, pair.x, pair.y);
    }
    // The piece's eight lanes halve their sums three times: lane s ends with columns 2s and 2s + 1.
    int half[8], quarter[4], approximate[2];
    keep_half(sums, half, slice, 4);
    keep_half(half, quarter, slice, 2);
    keep_half(quarter, approximate, slice, 1);
    timeline_stamp(timeline, stage + 3);
    float norm = 0.0f, rounding = 0.0f;  // ||e||_2 and ||e - e_scale e16||_2
    for (int w = 0; w * 256 < rank; ++w) norm += e_square[w], rounding += e_rounding[w];
    norm = sqrtf(norm) * (1.0f + slack), rounding = sqrtf(rounding) * (1.0f + slack);
    float center[2], reach[2], base[2], base_reach[2] = {};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = local + h;
      const float scale = column_data[c], bound = column_data[columns + c];
      base[h] = column_data[2 * columns + c];
      if constexpr (INTERVALS)  // ||h_k|| bound_v + ||h_k - h'_k|| norm_v + reach_k
        base_reach[h] = column_data[kColumnArrays * columns] * column_data[3 * columns + c] +
                        column_data[kColumnArrays * columns + 1] * column_data[4 * columns + c] +
                        column_data[kColumnArrays * columns + 2];
      center[h] = scale * (e_scale * static_cast<float>(approximate[h]));
      reach[h] = bound * norm + rounding * scale * q_norm_bound + slack * fabsf(center[h]);
    }

    float upper[2], best_lower = -INFINITY;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      upper[h] = -INFINITY;
      if (first_column + local + h >= vocab) continue;
      float lower;
      column_interval(upper[h], lower, base[h], base_reach[h], center[h], reach[h], slack);
      best_lower = fmaxf(best_lower, lower);
    }
    best_lower = block_best_lower(best_lower, warp_lower, threads / 32);
    timeline_stamp(timeline, stage + 4);
    if constexpr (INTERVALS) {  // the best lower end of all blocks
      if (t == 0) atomicMax(lm.lower_keys + k, ordered_bits(best_lower));
      counted_grid_barrier(counter, ++meetings);
      best_lower = fmaxf(best_lower, float_of_ordered_bits(__ldcg(lm.lower_keys + k)));
    }
    timeline_stamp(timeline, stage + 5);
    const unsigned long long found = __ldcg(argmax_keys + k);  // the best exact key of the blocks done so far
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long v = first_column + local + h;
      if (v < vocab && !(upper[h] < best_lower) && argmax_key(upper[h], static_cast<int>(v)) >= found)
        candidates[atomicAdd(&candidate_count, 1)] = local + h;
    }
    __syncthreads();
    timeline_stamp(timeline, stage + 6);
    timeline_count(timeline, k, candidate_count);

    if constexpr (INTERVALS)
      lm_head_candidate_logits(candidate_base, candidates, candidate_count, first_column, lm, k, staging, plan.staged);
    timeline_stamp(timeline, stage + 7);
    const unsigned long long best = candidate_keys(candidates, candidate_count, first_column, e, w2, rank, [&](int c) {
      return INTERVALS ? candidate_base[c]
                       : __ldcg(logits + static_cast<long>(k) * vocab + first_column + candidates[c]);
    });
    if (best) atomicMax(&block_key, best);
    __syncthreads();
    timeline_stamp(timeline, stage + 8);
    if (t == 0 && block_key) atomicMax(argmax_keys + k, block_key);
    counted_grid_barrier(counter, ++meetings);  // position k's key is complete
    timeline_stamp(timeline, stage + 9);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives the block (a break leaves one)
  timeline_write(timeline);
  if (blockIdx.x == 0)
    for (int i = t; i < gamma; i += threads) head.tokens[i] = argmax_index(__ldcg(argmax_keys + i));
}

template <int ROWS>
void launch_markov_position(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden,
                            float* hidden_logits, int position, int rows, int gamma, int rank, int width, int vocab,
                            const SequentialHeadWeights& weights, const DraftControl* control,
                            const SequentialHeadState& head, cudaStream_t stream) {
  const bool vector = vocab % 8 == 0 && reinterpret_cast<uintptr_t>(w2) % 16 == 0;
  auto kernel =
      vector ? (argmax_keys ? markov_position_kernel<ROWS, true, true> : markov_position_kernel<ROWS, true, false>)
             : (argmax_keys ? markov_position_kernel<ROWS, false, true> : markov_position_kernel<ROWS, false, false>);
  const dim3 grid(ceil_div(vocab, kInOutColumns), ceil_div(rows, ROWS));
  launch_dependent(kernel, grid, kInOutSlices * 32, 0, stream, logits, argmax_keys, w2, hidden, hidden_logits, position,
                   rows, gamma, rank, width, vocab, weights, control, head);
  CUDA_CHECK_LAUNCH();
}

// What both per-position heads need of position k and the weights.
void check_position(int position, int gamma, const SequentialHeadWeights& weights) {
  DSPARK_CHECK(gamma >= 1 && gamma <= kMaxDraftGamma && position >= 0 && position < gamma, "Markov head: position ",
               position, " of gamma ", gamma, " is outside 0..", kMaxDraftGamma - 1);
  DSPARK_CHECK(weights.token_confidence, "Markov head: the per-position kernel needs the tokens' confidence table");
}

int rows_per_pass(int rows) { return rows <= 2 ? rows : kMaxRows; }  // the kernel's ROWS for a batch

int register_loads(int rows_per_pass) {
  return rows_per_pass == 1 ? kRegisterLoads<1> : rows_per_pass == 2 ? kRegisterLoads<2> : kRegisterLoads<kMaxRows>;
}

// Shared memory a launch needs besides the cached weights.
size_t fixed_shared_bytes(const Plan& plan, int rows, int gamma, int rank) {
  const int group = rows_per_pass(rows);
  return sizeof(float) * (size_t(group) * (kSlices + 1) * plan.columns + size_t(group) * rank + size_t(gamma) * rows) +
         sizeof(int) * 2 * size_t(rows);
}

int shared_memory_limit() { return max_shared_bytes() - 1024; }  // less the kernel's static shared memory

Plan make_plan(int rows, int gamma, int rank, int vocab, int* blocks) {
  Plan plan{};
  const int groups = ceil_div(vocab, kGroupColumns);  // whole groups, over one block per multiprocessor
  plan.columns = ceil_div(groups, std::min(multiprocessor_count(), groups)) * kGroupColumns;
  *blocks = ceil_div(vocab, plan.columns);
  plan.pairs = ceil_div(plan.columns, kThreads);  // a group's 128 pairs cover its 128 columns
  plan.loads = rank / 8;
  plan.shared_loads = std::max(0, plan.pairs * plan.loads - register_loads(rows_per_pass(rows)));
  return plan;
}

size_t shared_bytes(const Plan& plan, int rows, int gamma, int rank) {
  return fixed_shared_bytes(plan, rows, gamma, rank) + size_t(plan.shared_loads) * kThreads * sizeof(uint4);
}

template <int ROWS>
void launch_markov_head(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden, int rows,
                        int gamma, int rank, int width, int vocab, const SequentialHeadWeights& weights,
                        const DraftControl* control, const SequentialHeadState& head, unsigned* barrier,
                        cudaStream_t stream) {
  static const bool opted_in = [] {
    CUDA_CHECK(cudaFuncSetAttribute(markov_head_kernel<ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    shared_memory_limit()));
    return true;
  }();
  (void)opted_in;
  int blocks = 0;
  const Plan plan = make_plan(rows, gamma, rank, vocab, &blocks);
  const size_t bytes = shared_bytes(plan, rows, gamma, rank);
  // The grid barrier needs every block resident at once: one per multiprocessor.
  int per_multiprocessor = 0;
  CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, markov_head_kernel<ROWS>, kThreads, bytes));
  DSPARK_CHECK(per_multiprocessor >= 1 && blocks <= multiprocessor_count() * per_multiprocessor,
               "Markov head: ", blocks, " blocks cannot all be resident");
  launch_dependent(markov_head_kernel<ROWS>, blocks, kThreads, bytes, stream, logits, argmax_keys, w2, hidden, rows,
                   gamma, rank, width, vocab, weights, control, head, plan, barrier);
  CUDA_CHECK_LAUNCH();
}

// blocks = 0: not supported (the block's share of w2 and its scratch do not fit, or too many blocks to be resident).
HeadTokensPlan make_head_tokens_plan(int rank, int vocab, int hidden_size /* 0: no intervals */) {
  HeadTokensPlan plan{};
  const int pieces = ceil_div(vocab, 16);
  plan.pieces = std::max(32, ceil_div(ceil_div(pieces, multiprocessor_count()), 4) * 4);
  plan.loads = rank / 8;
  plan.groups = ceil_div(plan.loads, 4);
  plan.shared_loads = std::max(0, 4 * plan.groups - kHeadTokensRegisterLoads);
  const int threads = plan.pieces * 8, columns = plan.pieces * 16;
  const long fixed = long(plan.shared_loads) * threads * sizeof(uint4) + sizeof(float) * rank +
                     sizeof(short) * 32 * plan.groups + (sizeof(unsigned short) + sizeof(float)) * columns;
  const long limit = shared_memory_limit();
  long staging = long(sizeof(float)) * (kColumnArrays * columns + 3);  // at least the columns' data
  if (hidden_size > 0) {
    const long row_bytes = 2L * (hidden_size + kStagedRowPadding);
    const long left = limit - fixed - long(kWarpSumBytes) - 2L * hidden_size;
    plan.staged = int(std::clamp(left < 0 ? 0L : left / row_bytes, 0L, long(kMaxStagedRows)));
    staging = std::max(staging, long(kWarpSumBytes) + 2L * hidden_size + plan.staged * row_bytes);
  }
  const long bytes = fixed + staging;
  const bool fits =
      rank % 8 == 0 && threads <= kHeadTokensMaxThreads && bytes <= limit && (hidden_size == 0 || plan.staged >= 1);
  plan.blocks = fits ? ceil_div(pieces, plan.pieces) : 0;
  plan.shared_bytes = size_t(bytes);
  return plan;
}

}  // namespace

bool markov_head_tokens_supported(int rank, int vocab, int stride, int hidden_size) {
  // rank <= 512: the integer sums (at most r * 32767 * 127) stay within int32.
  if (rank % 8 != 0 || rank > 512 || stride % 16 != 0 || stride < vocab || (hidden_size > 0 && hidden_size % 32 != 0))
    return false;
  const HeadTokensPlan plan = make_head_tokens_plan(rank, vocab, hidden_size);
  return plan.blocks > 0 && plan.blocks <= multiprocessor_count();
}

void markov_head_tokens_forward(unsigned long long* argmax_keys, const float* logits, const QuantizedColumnsView& w2,
                                const LmHeadIntervals* lm_head, const float* hidden, float* hidden_logits, int gamma,
                                int rank, int width, int vocab, const SequentialHeadWeights& weights,
                                const DraftControl* control, const SequentialHeadState& head, unsigned* counter,
                                cudaStream_t stream) {
  check_position(0, gamma, weights);
  const int hidden_size = lm_head ? lm_head->hidden_size : 0;
  DSPARK_CHECK(markov_head_tokens_supported(rank, vocab, w2.stride, hidden_size) &&
                   reinterpret_cast<uintptr_t>(w2.values) % 16 == 0,
               "Markov head (tokens only, one launch): rank ", rank, ", vocab ", vocab, ", stride ", w2.stride,
               ", hidden size ", hidden_size, " are not supported (see markov_head_tokens_supported)");
  const HeadTokensPlan plan = make_head_tokens_plan(rank, vocab, hidden_size);
  static const bool opted_in = [] {
    for (auto kernel : {markov_head_tokens_kernel<false>, markov_head_tokens_kernel<true>})
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_memory_limit()));
    return true;
  }();
  (void)opted_in;
  const int threads = plan.pieces * 8;
  const auto kernel = lm_head ? markov_head_tokens_kernel<true> : markov_head_tokens_kernel<false>;
  int per_multiprocessor = 0;  // the grid barrier needs every block resident at once
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, plan.shared_bytes));
  DSPARK_CHECK(per_multiprocessor >= 1, "Markov head (tokens only, one launch): a block of ", threads, " threads and ",
               plan.shared_bytes, " bytes of shared memory cannot be resident");
  launch_dependent(kernel, plan.blocks, threads, plan.shared_bytes, stream, argmax_keys, logits, w2,
                   lm_head ? *lm_head : LmHeadIntervals{}, hidden, hidden_logits, gamma, rank, width, vocab, weights,
                   control, head, plan, counter);
  CUDA_CHECK_LAUNCH();
}

void set_markov_head_timeline(unsigned long long* stamps) {
  CUDA_CHECK(cudaMemcpyToSymbol(head_timeline, &stamps, sizeof stamps));
}

bool markov_head_supported(int rows, int gamma, int rank, int vocab, const bf16* w2) {
  if (rows < 1 || gamma < 1 || gamma > kMaxDraftGamma || rank % 8 != 0 || vocab % 8 != 0 ||
      reinterpret_cast<uintptr_t>(w2) % 16 != 0)
    return false;
  int blocks = 0;
  return long(shared_bytes(make_plan(rows, gamma, rank, vocab, &blocks), rows, gamma, rank)) <= shared_memory_limit();
}

void markov_head_forward(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden, int rows,
                         int gamma, int rank, int width, int vocab, const SequentialHeadWeights& weights,
                         const DraftControl* control, const SequentialHeadState& head, unsigned* barrier,
                         cudaStream_t stream) {
  DSPARK_CHECK(markov_head_supported(rows, gamma, rank, vocab, w2), "Markov head: rows ", rows, ", gamma ", gamma,
               ", rank ", rank, ", vocab ", vocab, " are not supported by the one-launch head");
  const int group = rows_per_pass(rows);
  auto launch = group == 1 ? launch_markov_head<1> : group == 2 ? launch_markov_head<2> : launch_markov_head<kMaxRows>;
  launch(logits, argmax_keys, w2, hidden, rows, gamma, rank, width, vocab, weights, control, head, barrier, stream);
}

void markov_position_forward(float* logits, unsigned long long* argmax_keys, const bf16* w2, const float* hidden,
                             float* hidden_logits, int position, int rows, int gamma, int rank, int width, int vocab,
                             const SequentialHeadWeights& weights, const DraftControl* control,
                             const SequentialHeadState& head, cudaStream_t stream) {
  check_position(position, gamma, weights);
  if (rows == 0) return;
  const int group = in_out_rows_per_block(rows);
  auto launch = group == 1   ? launch_markov_position<1>
                : group == 2 ? launch_markov_position<2>
                : group == 4 ? launch_markov_position<4>
                             : launch_markov_position<8>;
  launch(logits, argmax_keys, w2, hidden, hidden_logits, position, rows, gamma, rank, width, vocab, weights, control,
         head, stream);
}

void markov_position_tokens_forward(unsigned long long* argmax_keys, const float* logits,
                                    const QuantizedColumnsView& w2, const LmHeadIntervals* lm_head, const float* hidden,
                                    float* hidden_logits, int position, int rows, int gamma, int rank, int width,
                                    int vocab, const SequentialHeadWeights& weights, const DraftControl* control,
                                    const SequentialHeadState& head, cudaStream_t stream) {
  check_position(position, gamma, weights);
  DSPARK_CHECK(rows == 1 && rank % kInOutSlices == 0 && rank <= kMaxTokenRank && w2.stride % 16 == 0 &&
                   w2.stride >= vocab && reinterpret_cast<uintptr_t>(w2.values) % 16 == 0,
               "Markov head (tokens only): rows ", rows, " (one), rank ", rank, " (a multiple of 8, at most ",
               kMaxTokenRank, "), stride ", w2.stride, " (a multiple of 16 covering vocab ", vocab, ")");
  const int blocks = ceil_div(vocab, kTokenColumns);
  const size_t shared_bytes = kTokenSlotBytes + sizeof(float) * rank;
  auto prepare = [](auto kernel) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kTokenSlotBytes + sizeof(float) * kMaxTokenRank)));
    int resident = 0;  // blocks a multiprocessor at the largest rank
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kTokenThreads,
                                                             kTokenSlotBytes + sizeof(float) * kMaxTokenRank));
    return resident * multiprocessor_count();
  };
  if (!lm_head) {
    static const int resident = prepare(markov_position_tokens_kernel<false>);
    (void)resident;
    launch_dependent(markov_position_tokens_kernel<false>, blocks, kTokenThreads, shared_bytes, stream, argmax_keys,
                     logits, w2, LmHeadIntervals{}, hidden, hidden_logits, position, rows, gamma, rank, width, vocab,
                     weights, control, head);
  } else {
    static const int resident = prepare(markov_position_tokens_kernel<true>);
    DSPARK_CHECK(lm_head->hidden_size % 32 == 0 && staged_row_count(lm_head->hidden_size) >= 1 && blocks <= resident,
                 "Markov head (tokens only, LM head as intervals): hidden size ", lm_head->hidden_size,
                 " (a multiple of 32, at most ", kMaxIntervalHidden, "), ", blocks, " blocks for vocab ", vocab,
                 " (at most the ", resident, " that can be resident at once: the blocks meet at a grid barrier)");
    launch_dependent(markov_position_tokens_kernel<true>, blocks, kTokenThreads, shared_bytes, stream, argmax_keys,
                     logits, w2, *lm_head, hidden, hidden_logits, position, rows, gamma, rank, width, vocab, weights,
                     control, head);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace dspark::cuda
